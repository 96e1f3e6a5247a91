"""What a simulation returns: task times, resource busy time, device memory timelines.

`SimResult` is produced by `Simulator.run()` (see `ms_efficient.sim.engine` for the model).
This module also turns the raw memory events recorded during the run into per-device
timelines (`build_memory_report`), so that the event loop stays small.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

import numpy as np

__all__ = ["MemoryTimeline", "MemoryViolation", "SimResult", "build_memory_report"]


@dataclass(frozen=True)
class MemoryTimeline:
    """Resident bytes of one device as a step function of time.

    times_s: [P] float64, non-decreasing seconds. times_s[0] is 0.0 and bytes[0] is the
        initial resident bytes (before any task runs); then one point per distinct time at
        which the device's memory changed, so time 0.0 can appear twice.
    bytes: [P] float64, resident bytes from times_s[i] until times_s[i + 1] (the last value
        holds until the end of the run): the level after ALL frees and allocs at that time.
    """

    times_s: np.ndarray
    bytes: np.ndarray


@dataclass(frozen=True)
class MemoryViolation:
    """A device whose resident bytes exceeded its capacity at some point of the run.

    device: device name.
    capacity_bytes: the capacity set with `Simulator.set_memory_capacity`.
    peak_bytes: the device's peak resident bytes over the run.
    excess_bytes: peak_bytes - capacity_bytes (> 0), a ready-made penalty for planners.
    first_time_s: the first time (seconds) at which resident bytes > capacity_bytes.
    """

    device: str
    capacity_bytes: float
    peak_bytes: float
    excess_bytes: float
    first_time_s: float


@dataclass
class SimResult:
    """Outcome of `Simulator.run()`. All times in seconds, all memory in bytes.

    makespan_s: end time of the last task (0.0 with no tasks); the run starts at 0.0.
    start_s, end_s: task name -> start / end time.
    busy_s: resource name -> sum of the durations of the tasks that ran on it (slot-seconds;
        for a capacity-1 resource this is the time it was busy).
    utilization: resource name -> busy_s / (capacity * makespan_s), in [0, 1]; 0.0 when the
        makespan is 0.
    peak_memory_bytes: device -> max of its memory timeline (includes initial bytes).
    peak_time_s: device -> first time at which the peak was reached.
    memory_timeline: device -> MemoryTimeline.
    memory_violations: one MemoryViolation per device that exceeded its capacity, in device
        order of first mention; empty when everything fits.
    """

    makespan_s: float
    start_s: Dict[str, float]
    end_s: Dict[str, float]
    busy_s: Dict[str, float]
    utilization: Dict[str, float]
    peak_memory_bytes: Dict[str, float]
    peak_time_s: Dict[str, float]
    memory_timeline: Dict[str, MemoryTimeline]
    memory_violations: List[MemoryViolation]
    # Per task id, in insertion order: name, and the task whose end let it start (-1: none).
    _names: Sequence[str] = field(default=(), repr=False)
    _cause: Sequence[int] = field(default=(), repr=False)

    @property
    def fits_memory(self) -> bool:
        """True when no device exceeded its memory capacity."""
        return not self.memory_violations

    def critical_path(self) -> List[str]:
        """Task names, first to last, of a chain that explains the makespan.

        Starts from the task that ends last (ties: the earliest added) and walks back: each
        step goes to the task whose end let the current one start, either its last-finishing
        dependency (preferred when both coincide) or, if it waited for its resource, the task
        that freed the slot. The walk stops at a task that started at its `earliest_start_s`
        or at time 0. Consecutive tasks on the path touch (end == next start), so without
        `earliest_start_s` delays the path's durations sum to the makespan.
        """
        if not self._names:
            return []
        ends = np.fromiter((self.end_s[name] for name in self._names), dtype=np.float64,
                           count=len(self._names))
        tid = int(np.argmax(ends))  # argmax returns the first maximum: earliest added
        path = [tid]
        while self._cause[tid] >= 0:
            tid = self._cause[tid]
            path.append(tid)
        return [self._names[i] for i in reversed(path)]


def build_memory_report(
    devices: Sequence[str],
    initial_bytes: Sequence[float],
    capacity_bytes: Sequence[float],
    event_time_s: Sequence[float],
    event_device: Sequence[int],
    event_delta_bytes: Sequence[float],
) -> Tuple[Dict[str, MemoryTimeline], Dict[str, float], Dict[str, float], List[MemoryViolation]]:
    """Per-device timelines, peaks and capacity violations from raw memory events.

    devices: [D] device names; initial_bytes, capacity_bytes: [D] (capacity inf = unlimited).
    event_time_s, event_device, event_delta_bytes: [E] one row per alloc (+bytes) or free
        (-bytes), in any order; event_device indexes `devices`.
    Within one timestamp only the net change counts (frees before allocs, see engine docs).
    Raises ValueError if a device's resident bytes go below zero (a free without its alloc).
    Returns (memory_timeline, peak_memory_bytes, peak_time_s, memory_violations).
    """
    times_E = np.asarray(event_time_s, dtype=np.float64)
    dev_E = np.asarray(event_device, dtype=np.int64)
    delta_E = np.asarray(event_delta_bytes, dtype=np.float64)
    # Step 1: group events by device, then by time (lexsort: last key is primary)
    order = np.lexsort((times_E, dev_E))
    times_E, dev_E, delta_E = times_E[order], dev_E[order], delta_E[order]
    bounds = np.searchsorted(dev_E, np.arange(len(devices) + 1))

    timelines: Dict[str, MemoryTimeline] = {}
    peaks: Dict[str, float] = {}
    peak_times: Dict[str, float] = {}
    violations: List[MemoryViolation] = []
    for d, device in enumerate(devices):
        t_e = times_E[bounds[d]:bounds[d + 1]]
        delta_e = delta_E[bounds[d]:bounds[d + 1]]
        # Step 2: net change per distinct time, then the level after each time
        if len(t_e):
            starts = np.flatnonzero(np.r_[True, t_e[1:] != t_e[:-1]])
            times = np.r_[0.0, t_e[starts]]
            levels = initial_bytes[d] + np.r_[0.0, np.cumsum(np.add.reduceat(delta_e, starts))]
        else:
            times = np.zeros(1)
            levels = np.full(1, float(initial_bytes[d]))
        scale = max(1.0, float(np.abs(delta_e).max()) if len(delta_e) else 1.0)
        lowest = int(np.argmin(levels))
        if levels[lowest] < -1e-9 * scale:
            raise ValueError(
                f"memory on device '{device}' drops to {levels[lowest]:.6g} bytes at "
                f"t={times[lowest]:.9g} s; a task frees bytes that were never allocated "
                f"(set_initial_memory or an earlier alloc must cover every free).")
        # Step 3: peak (first time reached) and capacity check
        top = int(np.argmax(levels))
        timelines[device] = MemoryTimeline(times_s=times, bytes=levels)
        peaks[device] = float(levels[top])
        peak_times[device] = float(times[top])
        cap = capacity_bytes[d]
        if levels[top] > cap:
            first = int(np.argmax(levels > cap))
            violations.append(MemoryViolation(
                device=device, capacity_bytes=float(cap), peak_bytes=float(levels[top]),
                excess_bytes=float(levels[top] - cap), first_time_s=float(times[first])))
    return timelines, peaks, peak_times, violations
