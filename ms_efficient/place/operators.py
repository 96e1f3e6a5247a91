"""Genetic operators on placement chromosomes, and the repair that restores feasibility.

A chromosome is ``assign``: [U] int64, the device of every unit (units in topological order,
see place.problem). All functions are pure given the ``rng`` (numpy ``Generator``).

Pipeline order. A placement is *monotone* when ``assign[u] <= assign[v]`` for every edge
u -> v: data only flows to the same or a higher device, so the devices form a pipeline
(the ILP's contiguity constraint, and what MindSpore's ``pipeline_stage`` needs). Unlike a
split of one topological order into runs, a monotone placement may put parallel branches
(the two paths of a residual block, the experts of an MoE layer) on different devices of
the same pipeline. Under the cost model's micro-batch-major program order (place.cost) a
placement whose devices wait on each other in a cycle cannot overlap micro-batches, so the
exploit side of TGA searches monotone placements; the explore side searches all.

Local search on one placement (``local_search``): the exploit population's improvement
step in TGA.

Neighbourhood of a placement x ([U] devices):
- boundary moves (u, x[u] +- 1) with ``move_with_closure``: a pipeline-stage boundary
  shifts around u and monotone placements stay monotone;
- unit moves (u, device of a neighbour of u), alone, when the search is not restricted
  to monotone placements (fine-grained splits such as experts on two devices);
- stage swaps (d, d + 1): the units of two adjacent devices exchange devices; only on
  clusters whose links differ (several nodes), since on one node a swap changes nothing.

Moves are drawn in a random order and scored in batches (one cost-model call each); the
best of a batch is taken when it improves (first improvement at batch granularity), and
the neighbourhood of the new point is drawn afresh. A full pass without improvement means
a local optimum. Moves that overfill memory are dropped rather than repaired (a repair
would turn a small move into a large, mostly useless one, and costs more than scoring).
"""
from __future__ import annotations

import heapq
from typing import List, Optional, Tuple

import numpy as np

from ms_efficient.place.cost import Evaluator, memory_by_device
from ms_efficient.place.problem import PlacementProblem

__all__ = ["repair", "is_monotone", "stage_sort", "move_with_closure", "balanced_contiguous",
           "random_contiguous", "crossover_two_point", "crossover_stages", "mutate_points",
           "mutate_neighbours", "mutate_block", "mutate_boundary", "mutate_spread",
           "spread_all"]


def balanced_contiguous(problem: PlacementProblem, stages: int) -> np.ndarray:
    """[U] split of the topological order into ``stages`` runs of about equal compute
    (fwd + bwd seconds) on devices 0..stages-1; memory is left to ``repair``."""
    w = problem.fwd_s + problem.bwd_s + 1e-12
    cum = np.cumsum(w) - w / 2
    return np.minimum((cum / w.sum() * stages).astype(np.int64), stages - 1)


def random_contiguous(problem: PlacementProblem, rng: np.random.Generator) -> np.ndarray:
    """[U] contiguous split with random cut points over a random number of devices."""
    u_count, d_count = problem.num_units, problem.num_devices
    stages = int(rng.integers(1, d_count + 1))
    cuts = np.sort(rng.choice(np.arange(1, max(u_count, 2)), size=min(stages - 1, u_count - 1),
                              replace=False)) if stages > 1 and u_count > 1 else np.array([], int)
    return np.searchsorted(cuts, np.arange(u_count), side="right").astype(np.int64)


def is_monotone(problem: PlacementProblem, a: np.ndarray) -> bool:
    """True when every edge goes to the same or a higher device (see module docstring)."""
    return bool((a[problem.edge_src] <= a[problem.edge_dst]).all())


def stage_sort(problem: PlacementProblem, a: np.ndarray) -> np.ndarray:
    """The monotone placement nearest in spirit to ``a`` with the same units per device:
    list the units in a topological order that prefers low devices (a heap on
    (a[u], u)), then hand out the sorted device ids along that order. Monotone inputs come
    back unchanged; on a chain this is ``np.sort(a)``."""
    if is_monotone(problem, a):
        return a
    preds, succs = problem.adjacency()
    waiting = [len(p) for p in preds]
    heap = [(int(a[u]), u) for u in range(problem.num_units) if not waiting[u]]
    heapq.heapify(heap)
    order: List[int] = []
    while heap:
        _, u = heapq.heappop(heap)
        order.append(u)
        for v in succs[u]:
            waiting[v] -= 1
            if not waiting[v]:
                heapq.heappush(heap, (int(a[v]), v))
    out = np.empty_like(a)
    out[order] = np.sort(a)
    return out


def move_with_closure(problem: PlacementProblem, a: np.ndarray, u: int, t: int) -> np.ndarray:
    """Copy of ``a`` with unit u on device t; moving later pushes u's descendants that
    sit below t up to t, moving earlier pulls its ancestors above t down to t, so a
    monotone placement stays monotone (a stage boundary shifts around u)."""
    preds, succs = problem.adjacency()
    out = a.copy()
    out[u] = t
    later = t > a[u]
    stack = [u]
    while stack:
        x = stack.pop()
        for y in (succs[x] if later else preds[x]):
            if (out[y] < t) if later else (out[y] > t):
                out[y] = t
                stack.append(y)
    return out


def _memory_repair(problem: PlacementProblem, a: np.ndarray, max_moves: int,
                   monotone: bool) -> np.ndarray:
    """Greedy single-unit moves off the most over-full device d until every device fits.

    Every (unit on d, target t) move is scored exactly and at once: moving u from d to t
    changes only d's and t's bytes (its state, the tensors it receives, and the copies of
    its outputs that d or t receive). The move lowering the total excess the most wins;
    ties go to the move that cuts the fewest bytes. With ``monotone`` only moves that keep
    the placement monotone are allowed. Stops when no move helps."""
    cap, d_count, u_count = problem.capacity_bytes, problem.num_devices, problem.num_units
    src, dst, nbytes = problem.edge_src, problem.edge_dst, problem.edge_bytes
    mem = memory_by_device(problem, a)
    for _ in range(max_moves):
        excess = np.clip(mem - cap, 0, None)
        if excess.sum() <= 0:
            return a
        d = int(np.argmax(mem - cap))
        on_d = np.flatnonzero(a == d)
        # in_from[i, k]: bytes unit on_d[i] receives from units on device k;
        # out_to[i, k]: bytes it sends to units on device k.
        in_from = np.bincount(dst * d_count + a[src], weights=nbytes,
                              minlength=u_count * d_count).reshape(u_count, d_count)[on_d]
        out_to = np.bincount(src * d_count + a[dst], weights=nbytes,
                             minlength=u_count * d_count).reshape(u_count, d_count)[on_d]
        state = problem.static_bytes[on_d]
        in_total = in_from.sum(axis=1)
        mem_d = mem[d] - state - (in_total - in_from[:, d]) + out_to[:, d]           # [n]
        mem_t = mem[None, :] + state[:, None] + in_total[:, None] - in_from - out_to  # [n, D]
        total = (excess.sum() - excess[d] - excess[None, :]
                 + np.clip(mem_d - cap[d], 0, None)[:, None] + np.clip(mem_t - cap, 0, None))
        total[:, d] = np.inf
        if monotone:
            lo = np.zeros(u_count, dtype=np.int64)
            hi = np.full(u_count, d_count - 1, dtype=np.int64)
            np.maximum.at(lo, dst, a[src])
            np.minimum.at(hi, src, a[dst])
            t_ids = np.arange(d_count)[None, :]
            total[(t_ids < lo[on_d, None]) | (t_ids > hi[on_d, None])] = np.inf
        cut_added = (in_from[:, [d]] + out_to[:, [d]]) - in_from - out_to
        best = np.lexsort((cut_added.ravel(), total.ravel()))[0]
        i, t = divmod(int(best), d_count)
        if total[i, t] < excess.sum() * (1 - 1e-12):
            a = a.copy()
            a[on_d[i]] = t
            mem[d], mem[t] = mem_d[i], mem_t[i, t]
            continue
        # No single move helps (each new cut adds received bytes, or the pipeline order
        # forbids it): move a unit together with neighbours, scored exactly.
        moved = _group_move(problem, a, on_d, excess.sum(), monotone)
        if moved is None:
            return a
        a = moved
        mem = memory_by_device(problem, a)
    return a


def _group_move(problem: PlacementProblem, a: np.ndarray, on_d: np.ndarray, excess: float,
                monotone: bool):
    """Best move of a unit on device d together with neighbours, or None when none lowers
    the total excess below ``excess``: ``move_with_closure`` to any device (the ancestors
    or descendants in the way follow) and, unless ``monotone``, the unit and its
    neighbours on d to any device."""
    nbrs = problem.neighbours()
    d = int(a[on_d[0]])
    trials = []
    for u in on_d:
        group = np.append(nbrs[u][a[nbrs[u]] == d], u)
        for t in range(problem.num_devices):
            if t == d:
                continue
            trials.append(move_with_closure(problem, a, int(u), t))
            if not monotone:
                y = a.copy()
                y[group] = t
                trials.append(y)
    if not trials:
        return None
    trials = np.stack(trials)
    over = np.clip(memory_by_device(problem, trials) - problem.capacity_bytes, 0, None).sum(1)
    k = int(np.argmin(over))
    return trials[k] if over[k] < excess * (1 - 1e-12) else None


def repair(problem: PlacementProblem, assign: np.ndarray, monotone: bool = False) -> np.ndarray:
    """A feasible copy of ``assign`` where one can be found by local moves.

    Order: pipeline order (``stage_sort``) when the problem requires contiguity or
    ``monotone`` is asked for, colocation (every group takes its first unit's device),
    memory (greedy moves, at most 4 x U). A plan still over memory is returned as is and
    is penalised by the cost (``place.cost.penalised_cost``).
    """
    a = np.array(assign, dtype=np.int64, copy=True)
    monotone = monotone or problem.contiguous
    if monotone:
        a = stage_sort(problem, a)
    for group in problem.colocate:
        a[group] = a[group[0]]
    return _memory_repair(problem, a, 4 * problem.num_units, monotone)


def crossover_two_point(x: np.ndarray, y: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Child = x with the segment [i, j) of the topological order taken from y."""
    i, j = np.sort(rng.integers(0, len(x) + 1, size=2))
    child = x.copy()
    child[i:j] = y[i:j]
    return child


def crossover_stages(x: np.ndarray, y: np.ndarray, d_count: int,
                     rng: np.random.Generator) -> np.ndarray:
    """Stage-boundary crossover: the units on x's devices below a random k keep x's
    devices, the others take y's device raised to at least k. Children of monotone
    parents are monotone: x's early pipeline stages joined to y's late ones."""
    k = int(rng.integers(1, d_count)) if d_count > 1 else 0
    return np.where(x < k, x, np.maximum(y, k))


def mutate_points(x: np.ndarray, rate: float, d_count: int, rng: np.random.Generator) -> np.ndarray:
    """Each gene becomes a uniform random device with probability ``rate``."""
    hit = rng.random(len(x)) < rate
    out = x.copy()
    out[hit] = rng.integers(0, d_count, size=int(hit.sum()))
    return out


def mutate_neighbours(problem: PlacementProblem, x: np.ndarray, count: int,
                      rng: np.random.Generator) -> np.ndarray:
    """``count`` random units take the device of a random neighbour (shifts cut edges)."""
    nbrs = problem.neighbours()
    out = x.copy()
    for u in rng.integers(0, len(x), size=count):
        if len(nbrs[u]):
            out[u] = out[nbrs[u][rng.integers(len(nbrs[u]))]]
    return out


def mutate_block(x: np.ndarray, d_count: int, rng: np.random.Generator) -> np.ndarray:
    """A random run [i, j) of the topological order moves to one random device."""
    i, j = np.sort(rng.integers(0, len(x) + 1, size=2))
    out = x.copy()
    out[i:j] = rng.integers(0, d_count)
    return out


def mutate_boundary(problem: PlacementProblem, x: np.ndarray, count: int,
                    rng: np.random.Generator) -> np.ndarray:
    """``count`` random units move one device up or down with ``move_with_closure``."""
    out = x
    for u in rng.integers(0, len(x), size=count):
        t = int(out[u]) + (1 if rng.random() < 0.5 else -1)
        if 0 <= t < problem.num_devices:
            out = move_with_closure(problem, out, int(u), t)
    return out if out is not x else x.copy()


def mutate_spread(problem: PlacementProblem, x: np.ndarray, monotone: bool,
                  rng: np.random.Generator) -> np.ndarray:
    """Spread one group of parallel siblings (``sibling_groups``) over several devices,
    round-robin in a random order. With ``monotone`` only devices between the group's
    latest predecessor and earliest successor are used."""
    groups = problem.sibling_groups()
    out = x.copy()
    if not groups:
        return out
    g = groups[int(rng.integers(len(groups)))]
    preds, succs = problem.adjacency()
    lo, hi = 0, problem.num_devices - 1
    if monotone:
        lo = max((int(x[p]) for p in preds[g[0]]), default=0)
        hi = min((int(x[s]) for s in succs[g[0]]), default=problem.num_devices - 1)
    if hi <= lo:
        return out
    span = np.arange(lo, hi + 1)
    k = int(rng.integers(2, min(len(span), len(g)) + 1))
    devices = rng.choice(span, size=k, replace=False)
    out[g] = devices[np.arange(len(g)) % k][rng.permutation(len(g))]
    return out


def spread_all(problem: PlacementProblem, x: np.ndarray,
               rng: Optional[np.random.Generator] = None) -> np.ndarray:
    """Every group of parallel siblings spread round-robin over all devices (in a random
    rotation with ``rng``): the expert-parallel layout of MoE layers, a starting point
    when micro-batches are few and branches must overlap."""
    out = x.copy()
    d_count = problem.num_devices
    for g in problem.sibling_groups():
        shift = int(rng.integers(d_count)) if rng is not None else 0
        out[g] = (np.arange(len(g)) + shift) % d_count
    return out


__all__ += ["neighbourhood", "apply_move", "local_search"]

_SWAP = -1  # move kind marker: (_SWAP, d) swaps devices d and d + 1


def neighbourhood(problem: PlacementProblem, x: np.ndarray,
                  monotone: bool) -> List[Tuple[int, int]]:
    """Moves (u, t) around ``x``; (-1, d) is the swap of devices d and d + 1."""
    d_count = problem.num_devices
    moves = [(u, t) for u in range(problem.num_units) for t in (int(x[u]) - 1, int(x[u]) + 1)
             if 0 <= t < d_count]
    if not monotone:
        nbrs = problem.neighbours()
        moves += [(u, int(t)) for u in range(problem.num_units)
                  for t in np.unique(x[nbrs[u]]) if abs(int(t) - int(x[u])) > 1]
    if not problem.uniform_links:
        moves += [(_SWAP, d) for d in range(d_count - 1)]
    return moves


def apply_move(problem: PlacementProblem, x: np.ndarray, move: Tuple[int, int]) -> np.ndarray:
    """The placement after ``move``, colocation groups following their first unit."""
    u, t = move
    if u == _SWAP:
        y = x.copy()
        y[x == t], y[x == t + 1] = t + 1, t
    elif abs(t - int(x[u])) == 1:
        y = move_with_closure(problem, x, u, t)
    else:
        y = x.copy()
        y[u] = t
    for group in problem.colocate:
        y[group] = y[group[0]]
    return y


def _excess(problem: PlacementProblem, pop: np.ndarray) -> np.ndarray:
    """[P] bytes over capacity summed over devices."""
    return np.clip(memory_by_device(problem, pop) - problem.capacity_bytes, 0, None).sum(-1)


def local_search(problem: PlacementProblem, x: np.ndarray, cost: float, evaluator: Evaluator,
                 budget: int, rng: np.random.Generator, monotone: bool,
                 batch: int = 64) -> Tuple[np.ndarray, float, bool]:
    """Improve ``x`` (penalised cost ``cost``) with at most ``budget`` new evaluations.

    Moves are not repaired: a move that puts more bytes over capacity than ``x`` has (or,
    with ``monotone``, breaks the pipeline order) is dropped before it is scored, so the
    search walks the feasible neighbourhood. Returns (placement, cost, converged):
    converged is True when a full pass over the neighbourhood found no improvement (x is
    a local optimum)."""
    stop_at = evaluator.used + budget
    while True:
        moves = neighbourhood(problem, x, monotone)
        order = rng.permutation(len(moves))
        limit = _excess(problem, x)
        improved = False
        for start in range(0, len(order), batch):
            left = min(stop_at - evaluator.used, evaluator.left())
            if left <= 0:
                return x, cost, False
            cands = np.stack([apply_move(problem, x, moves[k])
                              for k in order[start:start + batch]])
            keep = _excess(problem, cands) <= limit
            if monotone:
                keep &= np.all(cands[:, problem.edge_src] <= cands[:, problem.edge_dst], axis=1)
            cands = cands[keep][:left]
            if not len(cands):
                continue
            costs = evaluator.evaluate(cands)
            k = int(np.argmin(costs))
            if costs[k] < cost * (1 - 1e-9):
                x, cost, improved = cands[k], float(costs[k]), True
                break
        if not improved:
            return x, cost, True
