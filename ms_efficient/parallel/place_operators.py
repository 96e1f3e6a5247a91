"""Genetic operators on placement chromosomes, and the repair that restores feasibility.

A chromosome is ``assign``: [U] int64, the device of every unit (units in topological order,
see place_problem). All functions are pure given the ``rng`` (numpy ``Generator``).
"""
from __future__ import annotations

from typing import Callable, Tuple

import numpy as np

from ms_efficient.parallel.place_cost import memory_by_device
from ms_efficient.parallel.place_problem import PlacementProblem

__all__ = ["repair", "balanced_contiguous", "random_contiguous", "crossover_two_point",
           "mutate_points", "mutate_neighbours", "mutate_block", "local_search"]


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
    out = np.searchsorted(cuts, np.arange(u_count), side="right").astype(np.int64)
    return out


def _memory_repair(problem: PlacementProblem, a: np.ndarray, max_moves: int) -> np.ndarray:
    """Greedy moves off the most over-full device d: among moving a unit of d to a device
    holding one of its neighbours or to the emptiest device, alone or with its neighbours on
    d (in contiguous mode only a run's end to the next run), take the move that lowers the total excess memory the most
    (received tensors included, evaluated exactly in one batch); stop when none helps."""
    cap = problem.capacity_bytes
    nbrs = problem.neighbours()
    excess = np.clip(memory_by_device(problem, a) - cap, 0, None)
    for _ in range(max_moves):
        if excess.sum() <= 0:
            return a
        d = int(np.argmax(excess))
        on_d = np.flatnonzero(a == d)
        if problem.contiguous:
            cands = [(u, t) for u, t in ((on_d[0], d - 1), (on_d[-1], d + 1))
                     if 0 <= t < problem.num_devices]
        else:
            emptiest = int(np.argmin(memory_by_device(problem, a) / cap))
            cands = sorted({(int(u), int(t)) for u in on_d
                            for t in np.append(a[nbrs[u]], emptiest) if t != d})
        if not cands:
            return a
        # each move is tried alone and with the unit's neighbours on d (keeps edges uncut)
        trial = np.repeat(a[None], 2 * len(cands), axis=0)
        for k, (u, t) in enumerate(cands):
            trial[2 * k, u] = t
            trial[2 * k + 1, u] = t
            if not problem.contiguous:
                group = nbrs[u][a[nbrs[u]] == d]
                trial[2 * k + 1, group] = t
        over = np.clip(memory_by_device(problem, trial) - cap, 0, None)
        k = int(np.argmin(over.sum(axis=1)))
        if over[k].sum() >= excess.sum():
            return a
        a, excess = trial[k], over[k]
    return a


def repair(problem: PlacementProblem, assign: np.ndarray) -> np.ndarray:
    """A feasible copy of ``assign`` where one can be found by local moves.

    Order: contiguity (sort device ids along the topological order, keeping each device's
    unit count), colocation (every group takes its first unit's device), memory (greedy
    moves, at most 4 x U). A plan still over memory is returned as is and is penalised by
    the cost (``place_cost.penalised_cost``).
    """
    a = np.array(assign, dtype=np.int64, copy=True)
    if problem.contiguous:
        a = np.sort(a)
    for group in problem.colocate:
        a[group] = a[group[0]]
    return _memory_repair(problem, a, max_moves=4 * problem.num_units)


def crossover_two_point(x: np.ndarray, y: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Child = x with the segment [i, j) of the topological order taken from y."""
    i, j = np.sort(rng.integers(0, len(x) + 1, size=2))
    child = x.copy()
    child[i:j] = y[i:j]
    return child


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


def local_search(problem: PlacementProblem, x: np.ndarray, cost: float,
                 evaluate: Callable[[np.ndarray], np.ndarray], budget: int,
                 rng: np.random.Generator) -> Tuple[np.ndarray, float, int]:
    """Best-improvement search over boundary moves (a unit to a neighbour's device).

    Each round evaluates up to 32 repaired candidate moves as one batch and keeps the best
    if it improves. Returns (assign, cost, evaluations used), evaluations <= budget.
    """
    nbrs = problem.neighbours()
    used = 0
    while used < budget:
        moves = [(u, int(t)) for u in range(len(x)) for t in np.unique(x[nbrs[u]]) if t != x[u]]
        if problem.contiguous:  # keep it cheap and contiguous: only run ends move
            moves = [(u, t) for u, t in moves if abs(t - x[u]) == 1]
        if not moves:
            break
        take = min(len(moves), 32, budget - used)
        pick = rng.choice(len(moves), size=take, replace=False)
        cands = []
        for k in pick:
            u, t = moves[k]
            c = x.copy()
            c[u] = t
            cands.append(repair(problem, c))
        costs = evaluate(np.stack(cands))
        used += take
        k = int(np.argmin(costs))
        if costs[k] >= cost * (1 - 1e-9):
            break
        x, cost = cands[k], float(costs[k])
    return x, cost, used
