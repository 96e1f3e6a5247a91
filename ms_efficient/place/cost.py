"""Cost model of a placement: step makespan and device memory (no MindSpore import).

Execution model (one training step, GPipe schedule with M micro-batches):
- Each device runs its units in a fixed program order: the forwards of micro-batch 0 in
  topological order, then of micro-batch 1, ..., then the backwards of micro-batch 0 in
  reverse topological order, and so on. The topological order is the unit numbering,
  unless a plan brings its own (``simulate_placement(..., order=...)``, e.g. the list
  schedule of Baechi's m-ETF/m-SCT). A consequence: devices that feed each other in a
  cycle (a -> b -> a) cannot run ahead of each other (a starts micro-batch m + 1 only
  after its part of m, which waits on b), so micro-batches overlap between the devices of
  a pipeline, not inside such a cycle. A unit's forward lasts fwd_s / M, its backward
  bwd_s / M seconds.
- A cut edge (u -> v, devices a != b) sends bytes / M over the directed link a -> b after
  u's forward, and the gradient (same bytes) over b -> a after v's backward. Each directed
  device pair is one serial resource (links contend); transfers on it go in program order.
  A transfer lasts latency_s + bytes * inv_bw (alpha-beta, ``ClusterSpec.link_between``).
- Memory of device d = parameter state and activations of its units + received
  activations (cut edges into d); everything stays resident until backward, so the peak is
  reached when the last forward starts, and equals this sum.

Two evaluators of this one model:
- ``simulate_placement`` builds it in the shared ``ms_efficient.sim.Simulator`` (a task per
  unit forward/backward and per transfer, resources "dev{d}.compute" and
  "link:dev{a}->dev{b}", program order as dependencies) and is the reported number.
- ``evaluate_population`` computes the same recurrence vectorised over a population
  (start = max(resource free, inputs ready)); tests check that both agree to 1e-9 relative.

Every search method (TGA, the single-population GA, the Hierarchical planner) scores
placements through one ``Evaluator`` (end of this module), so "the same number of
evaluations" means the same number of distinct placements scored by the cost model:

- a placement seen before is answered from a cache and not counted again;
- once ``max_evaluations`` are spent, or the time budget would be overrun by one more
  call (the slowest call so far is the estimate), new placements score ``inf``. The default
  budget is ``inf`` s (stop on counts: same seed, same plan on a busy machine);
  :meth:`Evaluator.stop_reason` says which rule ended a search.

Costs are penalised step seconds (:func:`penalised_cost`).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ms_efficient.core.cluster import ClusterSpec
from ms_efficient.place.problem import PlacementProblem
from ms_efficient.sim import Simulator

__all__ = ["PlacementCost", "evaluate_population", "memory_by_device", "simulate_placement",
           "penalised_cost", "step_time_lower_bound",
           "Evaluator", "SearchResult", "TracePoint", "ZERO_LEVELS", "check_zero",
           "gradient_sync_time_s"]


def memory_by_device(problem: PlacementProblem, assign: np.ndarray) -> np.ndarray:
    """Peak resident bytes per device: [P, U] assignments -> [P, D] (or [U] -> [D])."""
    a = np.atleast_2d(np.asarray(assign, dtype=np.int64))
    p_count, d_count = a.shape[0], problem.num_devices
    base = (np.arange(p_count) * d_count)[:, None]
    mem = np.bincount((a + base).ravel(), weights=np.tile(problem.static_bytes, p_count),
                      minlength=p_count * d_count)
    if len(problem.edge_src):
        ds, dd = a[:, problem.edge_src], a[:, problem.edge_dst]
        cut = ds != dd
        mem += np.bincount((dd + base)[cut], weights=np.broadcast_to(
            problem.edge_bytes, ds.shape)[cut], minlength=p_count * d_count)
    mem = mem.reshape(p_count, d_count)
    return mem if np.ndim(assign) == 2 else mem[0]


def evaluate_population(problem: PlacementProblem,
                        assign: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Step makespan of each placement, vectorised over the population.

    Args:
        assign: [P, U] int device of every unit, one row per individual.
    Returns:
        step_s: [P] seconds of one training step (forward + backward, M micro-batches).
        mem: [P, D] peak resident bytes per device.

    The Python loop runs over units and edges (M times per phase); every step works on all
    P individuals at once, so one call with a few hundred rows costs little more than one
    with a few: callers should batch. State lives in flat arrays indexed by
    ``individual * D + device`` (compute streams) and ``individual * D^2 + link`` (links).
    An uncut edge uses the diagonal "link" d -> d, whose alpha and beta are 0 and whose free
    time never exceeds the device's (the device is serial), so it passes ``end`` through
    unchanged and needs no masking.
    """
    a = np.atleast_2d(np.asarray(assign, dtype=np.int64))
    p_count, u_count = a.shape
    d_count, m_count = problem.num_devices, problem.micro_batches
    fwd, bwd = (problem.fwd_s / m_count).tolist(), (problem.bwd_s / m_count).tolist()
    e_src, e_dst = problem.edge_src.tolist(), problem.edge_dst.tolist()
    out_ptr, in_ptr = problem.out_indptr.tolist(), problem.in_indptr.tolist()
    in_edges = problem.in_edges.tolist()
    a_t = a.T                                                           # [U, P]
    dev_idx = list(a_t + (np.arange(p_count) * d_count)[None])         # U x [P]
    # Per edge, the link id and its alpha-beta time for every individual (forward a -> b,
    # gradient b -> a), computed once: [E, P].
    lat, inv_bw = problem.latency_s.ravel(), problem.inv_bw_s_per_B.ravel()
    e_bytes = (problem.edge_bytes / m_count)[:, None]
    link_f = a_t[problem.edge_src] * d_count + a_t[problem.edge_dst]
    link_b = a_t[problem.edge_dst] * d_count + a_t[problem.edge_src]
    dur_f = list(lat[link_f] + e_bytes * inv_bw[link_f])
    dur_b = list(lat[link_b] + e_bytes * inv_bw[link_b])
    base_l = (np.arange(p_count) * d_count * d_count)[None]
    idx_f, idx_b = list(link_f + base_l), list(link_b + base_l)
    dev_free = np.zeros(p_count * d_count)
    link_free = np.zeros(p_count * d_count * d_count)
    zero = np.zeros(p_count)
    take, put, maximum = np.take, np.put, np.maximum
    # Step 1: forwards, micro-batch-major, topological order inside.
    for _ in range(m_count):
        ready = [zero] * u_count
        for u in range(u_count):
            end = maximum(take(dev_free, dev_idx[u]), ready[u]) + fwd[u]
            put(dev_free, dev_idx[u], end)
            for e in range(out_ptr[u], out_ptr[u + 1]):
                t_end = maximum(take(link_free, idx_f[e]), end) + dur_f[e]
                put(link_free, idx_f[e], t_end)
                ready[e_dst[e]] = maximum(ready[e_dst[e]], t_end)
    # Step 2: backwards, micro-batch-major, reverse topological order inside.
    for _ in range(m_count):
        ready = [zero] * u_count
        for u in range(u_count - 1, -1, -1):
            end = maximum(take(dev_free, dev_idx[u]), ready[u]) + bwd[u]
            put(dev_free, dev_idx[u], end)
            for k in range(in_ptr[u], in_ptr[u + 1]):
                e = in_edges[k]
                t_end = maximum(take(link_free, idx_b[e]), end) + dur_b[e]
                put(link_free, idx_b[e], t_end)
                ready[e_src[e]] = maximum(ready[e_src[e]], t_end)
    step = np.maximum(dev_free.reshape(p_count, -1).max(axis=1),
                      link_free.reshape(p_count, -1).max(axis=1))
    return step, memory_by_device(problem, a)


def step_time_lower_bound(problem: PlacementProblem) -> float:
    """Seconds no placement and no program order can beat under this cost model.

    The larger of two bounds, both ignoring transfers (which only add time) and memory:
    - work: every device is one serial stream, so step >= sum(fwd + bwd) / D;
    - per unit u: u's M forwards run back to back on its device, after the forwards of
      micro-batch 0 along the longest path into u (head, at fwd/M per unit); then micro-batch
      M-1 must finish its forward along a path P from u to a sink, whose device runs every
      forward before any backward, and the backward of micro-batch 0 must come back along P
      (tail = sum over P of (fwd + bwd) / M, longest P); then u's M backwards run back to
      back: step >= head(u) + fwd_u + tail(u) + bwd_u. With M = 1 this is the critical path.
    The bound is reached by one device on a chain at M = 1 (critical path = all the work);
    with M > 1 it leaves out the pipeline's fill and drain, so it is loose on pipelines.
    """
    m_count = problem.micro_batches
    fwd, bwd = problem.fwd_s, problem.bwd_s
    u_count = problem.num_units
    head = np.zeros(u_count)             # units are numbered topologically
    for u in range(u_count):
        for e in range(problem.out_indptr[u], problem.out_indptr[u + 1]):
            v = int(problem.edge_dst[e])
            head[v] = max(head[v], head[u] + fwd[u] / m_count)
    tail = np.zeros(u_count)
    for u in range(u_count - 1, -1, -1):
        for e in range(problem.out_indptr[u], problem.out_indptr[u + 1]):
            v = int(problem.edge_dst[e])
            tail[u] = max(tail[u], tail[v] + (fwd[v] + bwd[v]) / m_count)
    per_unit = float((head + fwd + tail + bwd).max()) if u_count else 0.0
    return max(float((fwd + bwd).sum()) / problem.num_devices, per_unit)


def penalised_cost(problem: PlacementProblem, step_s: np.ndarray, mem: np.ndarray) -> np.ndarray:
    """Fitness to minimise: step seconds, times (1 + 10 x memory excess / capacity) when a
    device is over its usable memory, so any infeasible plan ranks behind its feasible twin."""
    excess = np.clip(mem - problem.capacity_bytes, 0, None).sum(axis=-1)
    return step_s * (1.0 + 10.0 * excess / problem.capacity_bytes.min()) + (excess > 0) * 1e-9


@dataclass
class PlacementCost:
    """Simulated step of one placement.

    step_time_s: makespan of one training step, seconds.
    peak_memory_bytes: [D] peak resident bytes per device.
    feasible: every device within its usable memory.
    busy_s: resource name -> busy seconds (compute streams and links).
    """

    step_time_s: float
    peak_memory_bytes: np.ndarray
    feasible: bool
    busy_s: Dict[str, float]


def _check_order(problem: PlacementProblem, order) -> List[int]:
    """[U] program order as a list; ValueError unless it is a topological permutation."""
    if order is None:
        return list(range(problem.num_units))
    order = np.asarray(order, dtype=np.int64)
    if sorted(order.tolist()) != list(range(problem.num_units)):
        raise ValueError(f"'order' must be a permutation of the {problem.num_units} units.")
    pos = np.empty(problem.num_units, dtype=np.int64)
    pos[order] = np.arange(problem.num_units)
    if (pos[problem.edge_src] > pos[problem.edge_dst]).any():
        raise ValueError("'order' must list every unit after its predecessors.")
    return order.tolist()


def simulate_placement(problem: PlacementProblem, assign: np.ndarray,
                       order=None) -> PlacementCost:
    """Simulate one step of the [U] unit assignment ``assign`` with the shared Simulator.

    order: [U] units in the order devices run their forwards (a topological order; the
    backwards run in reverse); None is the unit numbering, as ``evaluate_population``."""
    a = np.asarray(assign, dtype=np.int64)
    if a.shape != (problem.num_units,) or a.min() < 0 or a.max() >= problem.num_devices:
        raise ValueError(f"assignment must be [{problem.num_units}] device ids in "
                         f"[0, {problem.num_devices}), but got shape {a.shape}.")
    program = _check_order(problem, order)
    m_count = problem.micro_batches
    sim = Simulator()
    dev = [f"dev{d}" for d in range(problem.num_devices)]
    static_param = np.bincount(a, weights=problem.static_bytes - problem.act_bytes,
                               minlength=problem.num_devices)
    for d in range(problem.num_devices):
        sim.set_initial_memory(dev[d], float(static_param[d]))
        sim.set_memory_capacity(dev[d], float(problem.capacity_bytes[d]))
    last_on: Dict[str, int] = {}  # resource -> last task id (program order)

    def task(name: str, res: str, dur: float, deps: List[int], **mem) -> int:
        if res in last_on:
            deps = deps + [last_on[res]]
        tid = sim.add_task(name, res, dur, deps=deps, **mem)
        last_on[res] = tid
        return tid

    def link_time(src: int, dst: int, nbytes: float) -> float:
        return problem.latency_s[src, dst] + nbytes * problem.inv_bw_s_per_B[src, dst]

    fwd_id: Dict[Tuple[int, int], int] = {}
    recv: Dict[Tuple[int, int], List[int]] = {}  # (m, v) -> transfer ids into v
    for m in range(m_count):
        for u in program:
            du = int(a[u])
            deps = recv.pop((m, u), [])
            fwd_id[m, u] = task(f"f{m}:{u}", f"{dev[du]}.compute", problem.fwd_s[u] / m_count,
                                deps, alloc=[(dev[du], problem.act_bytes[u] / m_count)])
            for e in range(problem.out_indptr[u], problem.out_indptr[u + 1]):
                v = int(problem.edge_dst[e])
                dv = int(a[v])
                if dv == du:
                    recv.setdefault((m, v), []).append(fwd_id[m, u])
                    continue
                nbytes = problem.edge_bytes[e] / m_count
                tid = task(f"x{m}:{e}", f"link:{dev[du]}->{dev[dv]}", link_time(du, dv, nbytes),
                           [fwd_id[m, u]], alloc=[(dev[dv], nbytes)])
                recv.setdefault((m, v), []).append(tid)
    grad: Dict[Tuple[int, int], List[int]] = {}
    for m in range(m_count):
        for u in reversed(program):
            du = int(a[u])
            freed = problem.act_bytes[u] / m_count
            for k in range(problem.in_indptr[u], problem.in_indptr[u + 1]):
                e = int(problem.in_edges[k])
                if a[problem.edge_src[e]] != du:
                    freed += problem.edge_bytes[e] / m_count
            bid = task(f"b{m}:{u}", f"{dev[du]}.compute", problem.bwd_s[u] / m_count,
                       grad.pop((m, u), []) + [fwd_id[m, u]], free=[(dev[du], freed)])
            for k in range(problem.in_indptr[u], problem.in_indptr[u + 1]):
                e = int(problem.in_edges[k])
                w = int(problem.edge_src[e])
                dw = int(a[w])
                if dw == du:
                    grad.setdefault((m, w), []).append(bid)
                    continue
                tid = task(f"g{m}:{e}", f"link:{dev[du]}->{dev[dw]}",
                           link_time(du, dw, problem.edge_bytes[e] / m_count), [bid])
                grad.setdefault((m, w), []).append(tid)
    result = sim.run()
    peak = np.array([result.peak_memory_bytes.get(d, 0.0) for d in dev])
    return PlacementCost(step_time_s=result.makespan_s, peak_memory_bytes=peak,
                         feasible=not result.memory_violations, busy_s=dict(result.busy_s))


# ---- counted, cached, time-limited evaluations for the searches --------------------------

_CACHE_LIMIT = 400_000  # placements remembered (about 100 MB for 256 units)


@dataclass
class TracePoint:
    """Best penalised step seconds after ``evaluations`` evaluations / ``elapsed_s``."""

    evaluations: int
    elapsed_s: float
    best_s: float
    exploit_best_s: float
    explore_best_s: float


@dataclass
class SearchResult:
    """A planner's answer. assign: [U] device per unit; cost_s: penalised step seconds (fast
    evaluator); trace: convergence; evaluations: cost evaluations spent; search_time_s;
    order: [U] program order of the units when the planner chose one (list schedules),
    None for the unit numbering."""

    method: str
    assign: np.ndarray
    cost_s: float
    evaluations: int
    search_time_s: float
    trace: List[TracePoint] = field(default_factory=list)
    order: Optional[np.ndarray] = None
    # "evaluations", "time_budget", "patience" (no new placement lately) or "" (no search)
    stopped_by: str = ""


class Evaluator:
    """Scores [P, U] placements; see the module docstring for counting and limits.

    Attributes: used (evaluations spent), cache_hits, max_call_s (slowest cost-model
    call, seconds), elapsed_s (since construction).
    """

    def __init__(self, problem: PlacementProblem, max_evaluations: int,
                 time_budget_s: float = math.inf):
        if max_evaluations < 1:
            raise ValueError(f"'max_evaluations' must be >= 1, but got {max_evaluations}.")
        if not time_budget_s > 0:
            raise ValueError(f"'time_budget_s' must be > 0 (inf = no wall-clock limit), but "
                             f"got {time_budget_s}.")
        self.problem = problem
        self.max_evaluations, self.time_budget_s = int(max_evaluations), float(time_budget_s)
        self.used, self.cache_hits, self.max_call_s = 0, 0, 0.0
        self.timed_out = False          # the wall-clock budget stopped something
        self._key_dtype = np.uint8 if problem.num_devices <= 256 else np.uint16
        self._cache: Dict[bytes, float] = {}
        self._t0 = time.perf_counter()

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self._t0

    def time_up(self, extra_s: float = 0.0) -> bool:
        """True when one more cost-model call, or ``extra_s`` of other work (one
        generation), would overrun the time budget; headroom for a busy CPU: 50% on the
        estimate and 1% of the budget."""
        if self.time_budget_s == math.inf:
            return False
        reserve_s = 1.5 * max(self.max_call_s, extra_s) + 0.01 * self.time_budget_s
        if self.elapsed_s + reserve_s >= self.time_budget_s:
            self.timed_out = True
            return True
        return False

    def stop_reason(self) -> str:
        """Which rule ended the search: "time_budget", "evaluations" or "patience"."""
        if self.timed_out:
            return "time_budget"
        return "evaluations" if self.used >= self.max_evaluations else "patience"

    def left(self) -> int:
        """Evaluations still allowed (0 once the time is up, but never before the first
        call: a search always scores its initial population, so its result has a cost)."""
        if self.used and self.time_up():
            return 0
        return self.max_evaluations - self.used

    def key(self, x: np.ndarray) -> bytes:
        return np.asarray(x).astype(self._key_dtype).tobytes()

    def seen(self, x: np.ndarray) -> bool:
        return self.key(x) in self._cache

    def evaluate(self, pop: np.ndarray) -> np.ndarray:
        """[P] penalised step seconds of the rows of ``pop`` ([P, U]); inf for new rows
        beyond the budget."""
        pop = np.atleast_2d(pop)
        keys = [self.key(x) for x in pop]
        out = np.full(len(pop), np.inf)
        new: Dict[bytes, List[int]] = {}
        for i, k in enumerate(keys):
            if k in self._cache:
                out[i] = self._cache[k]
                self.cache_hits += 1
            else:
                new.setdefault(k, []).append(i)
        todo = list(new.items())[:max(self.left(), 0)]
        if not todo:
            return out
        t0 = time.perf_counter()
        rows = np.array([idx[0] for _, idx in todo])
        step, mem = evaluate_population(self.problem, pop[rows])
        costs = penalised_cost(self.problem, step, mem)
        self.max_call_s = max(self.max_call_s, time.perf_counter() - t0)
        self.used += len(todo)
        if len(self._cache) + len(todo) > _CACHE_LIMIT:
            self._cache.clear()
        for (k, idx), c in zip(todo, costs.tolist()):
            self._cache[k] = c
            out[idx] = c
        return out


# ---------------------------------------------------------------- data-parallel copies
ZERO_LEVELS = (0, 1, 2, 3)


def check_zero(zero: int) -> None:
    if isinstance(zero, bool) or zero not in ZERO_LEVELS:
        raise ValueError(f"'zero' must be one of {list(ZERO_LEVELS)}, but got {zero!r}.")


def gradient_sync_time_s(cluster: ClusterSpec, devices: Sequence[int], grad_bytes: float,
                         zero: int = 0) -> float:
    """Seconds to synchronise ``grad_bytes`` of gradients (as many bytes of weights) over the
    data-parallel replicas on ``devices`` (ids of ``cluster``) at ZeRO level ``zero``: level 0
    one all-reduce; 1 and 2 a reduce-scatter and an all-gather of the updated weights; 3 a
    reduce-scatter and two all-gathers (module docstring). One device: 0."""
    check_zero(zero)
    devices = list(devices)
    if len(devices) < 2 or grad_bytes <= 0:
        return 0.0
    if zero == 0:
        return cluster.collective_time_s("allreduce", grad_bytes, devices)
    gathers = 2 if zero == 3 else 1
    return (cluster.collective_time_s("reduce_scatter", grad_bytes, devices)
            + gathers * cluster.collective_time_s("allgather", grad_bytes, devices))
