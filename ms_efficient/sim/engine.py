"""Event-driven cost simulator shared by every planner (MoE placement, MPipeMoE, MemOpt, TGA).

Planners describe one training step (or one layer) as tasks with dependencies on named
resources, run it, and read the makespan, resource utilisation and device memory peaks.
Pure Python + numpy; deterministic: the same calls in the same order give identical results.

The model
---------
Resources. A resource is a named stream, e.g. "dev0.compute", "dev0.h2d", "dev0.d2h",
"link:dev0->dev1", "link:node0->node1". It runs at most `capacity` tasks at once (default 1:
a serial stream), non-preemptively. Resources are created on first use; declare one with
`add_resource` to set its capacity or queue policy.

Tasks. A task runs on one resource (or on none: `resource=None`, unlimited concurrency, e.g.
a pure delay or a bookkeeping event) for `duration_s` >= 0 seconds. It becomes READY when
all its `deps` have ended and the clock has reached its `earliest_start_s` (default 0):
    ready_s = max(earliest_start_s, max(end_s of deps)).
A ready task starts as soon as its resource has a free slot. When a slot frees (or tasks
become ready) at time t, the resource starts the waiting task with the smallest key:
    policy "fifo" (default):  (ready_s, priority, insertion order)
    policy "priority":        (priority, ready_s, insertion order)
so a smaller `priority` wins ties (fifo) or always wins (priority). All task ends at one
timestamp are processed before any task starts at that timestamp, so tasks freed by
simultaneous ends compete on equal terms. (One caveat: a task that becomes ready through a
zero-duration task on a resource at time t is queued after the starts already made at t.)
    start_s = the time the resource starts it,  end_s = start_s + duration_s.

Transfers. `add_transfer` is a task on a link resource lasting the alpha-beta time
    latency_s + nbytes / bandwidth_Bps.
Transfers on one link SERIALIZE in the queue order above: two 1 MB transfers at 1 GB/s with
10 us latency end at 1.01 ms and 2.02 ms. This is a FIFO model, not fair bandwidth sharing:
it is simple, deterministic, matches a single DMA engine / NIC queue, and gives the same
finish time for the last transfer as fair sharing would (only the order of the earlier ones
differs). Model a link with several independent channels with `capacity` > 1.

Memory. Each device (any name: "dev0", "host0") has a running total of resident bytes,
starting from `set_initial_memory(device, nbytes)` (default 0). A task's `alloc` entries
(device, nbytes) are added when it STARTS; its `free` entries are subtracted when it ENDS.
`add_event` is a zero-duration, resource-less task for alloc/free not tied to any work.
At equal timestamps FREES COME BEFORE ALLOCS: only the net change at a time counts, so a
task that frees a buffer at t and a task that allocates one at t need max, not sum; a
zero-duration task's own alloc and free cancel out. Resident bytes going below zero is a
modelling error (ValueError). Exceeding a capacity (`set_memory_capacity`) is NOT an error:
it is reported in `SimResult.memory_violations` so planners can penalise it.
"""
from __future__ import annotations

import heapq
import math
import numbers
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

from ms_efficient.sim.result import SimResult, build_memory_report

__all__ = ["Task", "Simulator", "transfer_time_s"]

TaskRef = Union[str, int]  # a task's name, or the id returned by add_task
MemoryEffect = Tuple[str, float]  # (device name, bytes)

_POLICIES = ("fifo", "priority")
_RELEASE, _FINISH = 0, 1  # event kinds: deps done / earliest_start reached; task ends


def _check_nonneg(what: str, value: float) -> float:
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or math.isnan(value) \
            or value < 0 or math.isinf(value):
        raise ValueError(f"{what} must be a finite number >= 0, but got {value!r}.")
    return float(value)


def transfer_time_s(nbytes: float, latency_s: float, bandwidth_Bps: float) -> float:
    """Alpha-beta time of one transfer: latency_s + nbytes / bandwidth_Bps (seconds)."""
    _check_nonneg("'nbytes'", nbytes)
    _check_nonneg("'latency_s'", latency_s)
    if not bandwidth_Bps > 0 or math.isinf(bandwidth_Bps):
        raise ValueError(f"'bandwidth_Bps' must be a finite number > 0, but got {bandwidth_Bps!r}.")
    return latency_s + nbytes / bandwidth_Bps


@dataclass(frozen=True)
class Task:
    """One unit of work as recorded by `Simulator.add_task` (read-only; see module docs)."""

    name: str
    resource: Optional[str]  # None: no resource, starts as soon as ready
    duration_s: float
    deps: Tuple[TaskRef, ...]
    priority: float
    alloc: Tuple[MemoryEffect, ...]  # applied at start
    free: Tuple[MemoryEffect, ...]  # applied at end
    earliest_start_s: float


class Simulator:
    """Builder of a task graph; `run()` simulates it (see the module docstring for the model).

    sim = Simulator()
    sim.set_initial_memory("dev0", 2e9)
    a = sim.add_task("fwd0", "dev0.compute", 1e-3, alloc=[("dev0", 1e8)])
    sim.add_transfer("swap0", "dev0.d2h", 1e8, 1e-5, 2.5e10, deps=[a], free=[("dev0", 1e8)])
    result = sim.run()
    """

    def __init__(self) -> None:
        self._tasks: List[Task] = []
        self._ids: Dict[str, int] = {}
        self._capacity: Dict[str, int] = {}
        self._policy: Dict[str, str] = {}
        self._initial_bytes: Dict[str, float] = {}
        self._capacity_bytes: Dict[str, float] = {}
        self._devices: Dict[str, int] = {}  # device -> index, in order of first mention

    def __len__(self) -> int:
        return len(self._tasks)

    def task(self, ref: TaskRef) -> Task:
        """The recorded task with this name or id."""
        if isinstance(ref, str):
            if ref not in self._ids:
                raise ValueError(f"unknown task '{ref}'.")
            return self._tasks[self._ids[ref]]
        return self._tasks[ref]

    def add_resource(self, name: str, capacity: int = 1, policy: str = "fifo") -> None:
        """Declare resource `name` running up to `capacity` tasks at once, queue `policy`
        "fifo" (by ready time, then priority) or "priority" (by priority, then ready time)."""
        if name in self._capacity:
            raise ValueError(f"resource '{name}' is already declared.")
        if not isinstance(capacity, numbers.Integral) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"'capacity' of resource '{name}' must be an int >= 1, but got {capacity!r}.")
        if policy not in _POLICIES:
            raise ValueError(f"'policy' of resource '{name}' must be one of {_POLICIES}, but got {policy!r}.")
        self._capacity[name] = int(capacity)
        self._policy[name] = policy

    def set_initial_memory(self, device: str, nbytes: float) -> None:
        """Bytes resident on `device` at time 0 (weights, optimizer state...)."""
        self._initial_bytes[device] = _check_nonneg(f"initial memory of device '{device}'", nbytes)
        self._devices.setdefault(device, len(self._devices))

    def set_memory_capacity(self, device: str, capacity_bytes: float) -> None:
        """Bytes available on `device`; exceeding it is reported, not raised."""
        self._capacity_bytes[device] = _check_nonneg(f"memory capacity of device '{device}'",
                                                     capacity_bytes)
        self._devices.setdefault(device, len(self._devices))

    def add_task(
        self,
        name: str,
        resource: Optional[str],
        duration_s: float,
        deps: Sequence[TaskRef] = (),
        priority: float = 0,
        alloc: Sequence[MemoryEffect] = (),
        free: Sequence[MemoryEffect] = (),
        earliest_start_s: float = 0.0,
    ) -> int:
        """Add a task and return its id (usable in `deps` like its name).

        name: unique task name. resource: resource name, or None for no resource.
        duration_s: seconds >= 0. deps: names or ids of tasks that must end first (may name
        tasks added later; resolved by run()). priority: smaller runs first among ties.
        alloc / free: (device, bytes >= 0) pairs applied at start / at end.
        earliest_start_s: the task is not ready before this time (seconds >= 0).
        """
        if not isinstance(name, str):
            raise TypeError(f"task name must be a str, but got {type(name).__name__}.")
        if name in self._ids:
            raise ValueError(f"task name '{name}' is already used.")
        if resource is not None and not isinstance(resource, str):
            raise TypeError(f"'resource' of task '{name}' must be a str or None, "
                            f"but got {type(resource).__name__}.")
        duration_s = _check_nonneg(f"'duration_s' of task '{name}'", duration_s)
        earliest_start_s = _check_nonneg(f"'earliest_start_s' of task '{name}'", earliest_start_s)
        if isinstance(priority, bool) or not isinstance(priority, numbers.Real) or math.isnan(priority):
            raise ValueError(f"'priority' of task '{name}' must be a number, but got {priority!r}.")
        if isinstance(deps, (str, numbers.Integral)):
            raise TypeError(f"'deps' of task '{name}' must be a sequence of names or ids, "
                            f"but got {deps!r}; wrap a single dependency in a list.")
        task = Task(name=name, resource=resource, duration_s=duration_s, deps=tuple(deps),
                    priority=float(priority), alloc=self._effects(name, "alloc", alloc),
                    free=self._effects(name, "free", free), earliest_start_s=earliest_start_s)
        for device, _ in task.alloc + task.free:
            self._devices.setdefault(device, len(self._devices))
        self._ids[name] = len(self._tasks)
        self._tasks.append(task)
        return self._ids[name]

    def add_transfer(
        self,
        name: str,
        link: str,
        nbytes: float,
        latency_s: float,
        bandwidth_Bps: float,
        deps: Sequence[TaskRef] = (),
        priority: float = 0,
        alloc: Sequence[MemoryEffect] = (),
        free: Sequence[MemoryEffect] = (),
        earliest_start_s: float = 0.0,
    ) -> int:
        """Add a transfer of `nbytes` bytes on resource `link` lasting
        latency_s + nbytes / bandwidth_Bps seconds (bandwidth in bytes/s); returns its id.
        Transfers on one link serialize (FIFO, see module docs); other arguments as add_task."""
        try:
            duration_s = transfer_time_s(nbytes, latency_s, bandwidth_Bps)
        except ValueError as err:
            raise ValueError(f"transfer '{name}': {err}") from None
        return self.add_task(name, link, duration_s, deps=deps, priority=priority, alloc=alloc,
                             free=free, earliest_start_s=earliest_start_s)

    def add_event(
        self,
        name: str,
        deps: Sequence[TaskRef] = (),
        alloc: Sequence[MemoryEffect] = (),
        free: Sequence[MemoryEffect] = (),
        earliest_start_s: float = 0.0,
    ) -> int:
        """Add a zero-duration, resource-less task (a memory event or a join point) that
        happens as soon as its deps end; returns its id."""
        return self.add_task(name, None, 0.0, deps=deps, alloc=alloc, free=free,
                             earliest_start_s=earliest_start_s)

    def _effects(self, name: str, kind: str, effects: Sequence[MemoryEffect]) -> Tuple[MemoryEffect, ...]:
        out = []
        for entry in effects:
            if not (isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(entry[0], str)):
                raise ValueError(f"'{kind}' of task '{name}' must hold (device, bytes) pairs, "
                                 f"but got {entry!r}.")
            out.append((entry[0], _check_nonneg(f"'{kind}' bytes of task '{name}' on '{entry[0]}'",
                                                entry[1])))
        return tuple(out)

    def _resolve(self, ref: TaskRef, task: Task) -> int:
        if isinstance(ref, str):
            if ref not in self._ids:
                raise ValueError(f"task '{task.name}' depends on unknown task '{ref}'.")
            return self._ids[ref]
        if isinstance(ref, bool) or not isinstance(ref, numbers.Integral) \
                or not 0 <= ref < len(self._tasks):
            raise ValueError(f"task '{task.name}' depends on unknown task id {ref!r}.")
        return int(ref)

    def run(self) -> SimResult:
        """Simulate all tasks and return the SimResult. Raises ValueError on an unknown
        dependency or a dependency cycle (naming the tasks), or if memory goes below zero."""
        tasks = self._tasks
        n = len(tasks)
        # Step 1: resolve deps to ids; successor lists; resource and device indices
        succs: List[List[int]] = [[] for _ in range(n)]
        remaining = [0] * n
        for tid, task in enumerate(tasks):
            for d in dict.fromkeys(self._resolve(ref, task) for ref in task.deps):
                succs[d].append(tid)
                remaining[tid] += 1
        res_ids: Dict[str, int] = {name: i for i, name in enumerate(self._capacity)}
        dev_ids = self._devices
        res_of, alloc_of, free_of = [-1] * n, [()] * n, [()] * n
        for tid, task in enumerate(tasks):
            if task.resource is not None:
                res_of[tid] = res_ids.setdefault(task.resource, len(res_ids))
            if task.alloc:
                alloc_of[tid] = tuple((dev_ids[dv], b) for dv, b in task.alloc)
            if task.free:
                free_of[tid] = tuple((dev_ids[dv], -b) for dv, b in task.free)
        res_names = list(res_ids)
        res_cap = [self._capacity.get(r, 1) for r in res_names]
        by_priority = [self._policy.get(r, "fifo") == "priority" for r in res_names]

        # Step 2: event loop. events: (time, task id, kind); ready_q[r]: heap of queue keys
        duration = [task.duration_s for task in tasks]
        priority = [task.priority for task in tasks]
        earliest = [task.earliest_start_s for task in tasks]
        start_s, end_s, ready_s = [math.nan] * n, [math.nan] * n, [0.0] * n
        cause = [-1] * n  # the task whose end let this one start (critical path)
        running = [0] * len(res_names)
        last_freed = [-1] * len(res_names)
        ready_q: List[list] = [[] for _ in res_names]
        touched: List[int] = []
        is_touched = [False] * len(res_names)
        mem_t: List[float] = []
        mem_dev: List[int] = []
        mem_delta: List[float] = []
        push, pop = heapq.heappush, heapq.heappop

        def start(tid: int, t: float) -> None:
            start_s[tid] = t
            for dev, b in alloc_of[tid]:
                mem_t.append(t)
                mem_dev.append(dev)
                mem_delta.append(b)
            push(events, (t + duration[tid], tid, _FINISH))

        def release(tid: int, t: float) -> None:
            ready_s[tid] = t
            r = res_of[tid]
            if r < 0:
                start(tid, t)
                return
            key = (priority[tid], t, tid) if by_priority[r] else (t, priority[tid], tid)
            push(ready_q[r], key)
            if not is_touched[r]:
                is_touched[r] = True
                touched.append(r)

        events = [(earliest[tid], tid, _RELEASE) for tid in range(n) if remaining[tid] == 0]
        heapq.heapify(events)
        finished = 0
        while events:
            t = events[0][0]
            # Step 2a: every end and release at time t (zero-duration resource-less tasks
            # started here end within this same loop)
            while events and events[0][0] == t:
                _, tid, kind = pop(events)
                if kind == _RELEASE:
                    release(tid, t)
                    continue
                end_s[tid] = t
                finished += 1
                for dev, b in free_of[tid]:
                    mem_t.append(t)
                    mem_dev.append(dev)
                    mem_delta.append(b)
                r = res_of[tid]
                if r >= 0:
                    running[r] -= 1
                    last_freed[r] = tid
                    if not is_touched[r]:
                        is_touched[r] = True
                        touched.append(r)
                for s in succs[tid]:
                    remaining[s] -= 1
                    if remaining[s] == 0:
                        if earliest[s] > t:  # wait for the clock, not for this dep
                            push(events, (earliest[s], s, _RELEASE))
                        else:
                            cause[s] = tid
                            release(s, t)
            # Step 2b: start waiting tasks on every resource that changed at time t
            for r in touched:
                is_touched[r] = False
                q = ready_q[r]
                while q and running[r] < res_cap[r]:
                    tid = pop(q)[2]
                    running[r] += 1
                    if ready_s[tid] < t:  # it waited for the resource
                        cause[tid] = last_freed[r]
                    start(tid, t)
            touched.clear()

        if finished < n:
            raise ValueError(self._cycle_message(end_s))

        # Step 3: resource busy time and memory report
        makespan = max(end_s, default=0.0)
        busy = [0.0] * len(res_names)
        for tid in range(n):
            if res_of[tid] >= 0:
                busy[res_of[tid]] += duration[tid]
        devices = list(dev_ids)
        timelines, peaks, peak_times, violations = build_memory_report(
            devices, [self._initial_bytes.get(d, 0.0) for d in devices],
            [self._capacity_bytes.get(d, math.inf) for d in devices], mem_t, mem_dev, mem_delta)
        names = [task.name for task in tasks]
        return SimResult(
            makespan_s=makespan,
            start_s=dict(zip(names, start_s)),
            end_s=dict(zip(names, end_s)),
            busy_s=dict(zip(res_names, busy)),
            utilization={r: (busy[i] / (res_cap[i] * makespan) if makespan > 0 else 0.0)
                         for i, r in enumerate(res_names)},
            peak_memory_bytes=peaks,
            peak_time_s=peak_times,
            memory_timeline=timelines,
            memory_violations=violations,
            _names=names,
            _cause=cause,
        )

    def _cycle_message(self, end_s: List[float]) -> str:
        """Describe one dependency cycle among the tasks that never ran."""
        # Every task that never ran waits on another that never ran: walking such waits must
        # revisit a task, and the walk from there on is a cycle.
        tid = next(i for i, e in enumerate(end_s) if math.isnan(e))
        order: Dict[int, int] = {}
        walk: List[int] = []
        while tid not in order:
            order[tid] = len(walk)
            walk.append(tid)
            task = self._tasks[tid]
            tid = next(d for d in (self._resolve(ref, task) for ref in task.deps)
                       if math.isnan(end_s[d]))
        cycle = walk[order[tid]:] + [tid]
        chain = " -> ".join(f"'{self._tasks[i].name}'" for i in cycle)
        return (f"dependency cycle: task '{self._tasks[tid].name}' waits on itself through "
                f"{chain} (each task depends on the next); remove one of these deps.")
