"""The event-driven cost simulator every planner uses to evaluate its plans.

Tasks with dependencies run on named serial resources (compute streams, copy engines,
links); transfers last latency + bytes / bandwidth and serialize per link; device memory is
tracked from per-task alloc-at-start / free-at-end effects. See `ms_efficient.sim.engine`
for the exact semantics.
"""
from ms_efficient.sim.engine import Simulator, Task, transfer_time_s
from ms_efficient.sim.result import MemoryTimeline, MemoryViolation, SimResult

__all__ = ["Simulator", "Task", "transfer_time_s", "SimResult", "MemoryTimeline", "MemoryViolation"]
