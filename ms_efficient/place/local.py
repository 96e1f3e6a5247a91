"""Local search on one placement: the exploit population's improvement step in TGA.

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

from typing import List, Tuple

import numpy as np

from ms_efficient.place.cost import memory_by_device
from ms_efficient.place.cost import Evaluator
from ms_efficient.place.operators import move_with_closure
from ms_efficient.place.problem import PlacementProblem

__all__ = ["neighbourhood", "apply_move", "local_search"]

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
