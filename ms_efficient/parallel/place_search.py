"""Counted, cached and time-limited cost evaluations shared by the placement searches.

Every search method (TGA, the single-population GA, the Hierarchical planner) scores
placements through one ``Evaluator``, so "the same number of evaluations" means the same
number of distinct placements scored by the cost model:

- a placement seen before is answered from a cache and not counted again;
- once ``max_evaluations`` are spent, or the time budget would be overrun by one more
  call (the slowest call so far is the estimate), new placements score ``inf``.

Costs are penalised step seconds (``place_cost.penalised_cost``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np

from ms_efficient.parallel.place_cost import evaluate_population, penalised_cost
from ms_efficient.parallel.place_problem import PlacementProblem

__all__ = ["Evaluator", "SearchResult", "TracePoint"]

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


class Evaluator:
    """Scores [P, U] placements; see the module docstring for counting and limits.

    Attributes: used (evaluations spent), cache_hits, max_call_s (slowest cost-model
    call, seconds), elapsed_s (since construction).
    """

    def __init__(self, problem: PlacementProblem, max_evaluations: int, time_budget_s: float):
        if max_evaluations < 1:
            raise ValueError(f"'max_evaluations' must be >= 1, but got {max_evaluations}.")
        if not time_budget_s > 0:
            raise ValueError(f"'time_budget_s' must be > 0, but got {time_budget_s}.")
        self.problem = problem
        self.max_evaluations, self.time_budget_s = int(max_evaluations), float(time_budget_s)
        self.used, self.cache_hits, self.max_call_s = 0, 0, 0.0
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
        reserve_s = 1.5 * max(self.max_call_s, extra_s) + 0.01 * self.time_budget_s
        return self.elapsed_s + reserve_s >= self.time_budget_s

    def left(self) -> int:
        """Evaluations still allowed (0 once the time is up)."""
        return 0 if self.time_up() else self.max_evaluations - self.used

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
