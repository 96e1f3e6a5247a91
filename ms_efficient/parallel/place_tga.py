"""TGA: a dual-population genetic algorithm for partitioning and device placement.

Two populations with different roles search the same chromosome space ([U] device ids):

- exploit (``pop_exploit`` individuals): tournament selection of size 4 (strong pressure),
  two-point crossover along the topological order, gentle mutation (a few units take a
  neighbour's device), (mu + lambda) survival of the best, and a best-improvement local
  search over boundary moves on its champion every ``local_search_every`` generations.
- explore (``pop_explore``): binary tournaments, high mutation (per-gene rate
  ``explore_mutation`` plus whole-run block moves), generational replacement keeping one
  elite, so it stays diverse.
- every ``migrate_every`` generations the best ``migrants`` of explore replace the worst of
  exploit, and exploit's champion replaces a random explorer.

Every child is repaired (place_operators.repair) before evaluation. The exploit population
starts from the min-max contiguous split (``place_baselines.contiguous``), balanced
contiguous splits over 1..D devices and random contiguous splits; the
explore population from uniform random assignments. The search stops at ``max_evaluations``
cost evaluations or ``time_budget_s`` seconds, whichever comes first. Same seed, same
inputs -> same result (the time budget is the only source of run-to-run difference; set it
generously to reproduce exactly).

``ga_single`` is the single-population baseline with the same operators, budget and repair:
one population of ``pop_exploit + pop_explore``, binary tournaments, crossover, per-gene
mutation 1/U, generational replacement with one elite, no local search, no migration.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np

from ms_efficient.parallel.place_cost import evaluate_population, penalised_cost
from ms_efficient.parallel.place_operators import (balanced_contiguous, crossover_two_point,
                                                   local_search, mutate_block,
                                                   mutate_neighbours, mutate_points,
                                                   random_contiguous, repair)
from ms_efficient.parallel.place_problem import PlacementProblem

__all__ = ["TGAConfig", "SearchResult", "TracePoint", "tga", "ga_single"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TGAConfig:
    """Search settings (sizes are individuals, rates are probabilities per gene/child)."""

    seed: int = 0
    max_evaluations: int = 4000
    time_budget_s: float = 60.0     # the bar for a 10k-operator graph
    pop_exploit: int = 24
    pop_explore: int = 24
    tournament_exploit: int = 4
    crossover_rate: float = 0.9
    explore_mutation: float = 0.08  # per gene: high, keeps explore diverse
    migrate_every: int = 5
    migrants: int = 2
    local_search_every: int = 3
    local_search_budget: int = 64   # evaluations per local-search call

    def __post_init__(self) -> None:
        for key in ("max_evaluations", "pop_exploit", "pop_explore", "migrate_every"):
            if getattr(self, key) < 1:
                raise ValueError(f"'{key}' must be >= 1, but got {getattr(self, key)}.")
        if self.pop_exploit < 4 or self.pop_explore < 4:
            raise ValueError("'pop_exploit' and 'pop_explore' must be >= 4.")
        if self.time_budget_s <= 0:
            raise ValueError(f"'time_budget_s' must be > 0, but got {self.time_budget_s}.")


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
    evaluator); trace: convergence; evaluations: cost evaluations spent; search_time_s."""

    method: str
    assign: np.ndarray
    cost_s: float
    evaluations: int
    search_time_s: float
    trace: List[TracePoint] = field(default_factory=list)


class _Budget:
    """Counts evaluations and wall time; ``evaluate`` returns penalised costs [P]."""

    def __init__(self, problem: PlacementProblem, max_evaluations: int, time_budget_s: float):
        self.problem, self.max_evals, self.deadline = problem, max_evaluations, time_budget_s
        self.used, self.t0 = 0, time.perf_counter()

    def evaluate(self, pop: np.ndarray) -> np.ndarray:
        step, mem = evaluate_population(self.problem, pop)
        self.used += len(pop)
        return penalised_cost(self.problem, step, mem)

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> int:
        return 0 if self.elapsed_s >= self.deadline else self.max_evals - self.used


def _tournament(costs: np.ndarray, k: int, rng: np.random.Generator) -> int:
    picks = rng.integers(0, len(costs), size=k)
    return int(picks[np.argmin(costs[picks])])


def _initial(problem: PlacementProblem, size: int, rng: np.random.Generator,
             kind: str) -> np.ndarray:
    """[size, U] repaired starting chromosomes ("exploit": balanced and random contiguous
    splits; "explore": uniform random devices)."""
    d_count, u_count = problem.num_devices, problem.num_units
    pop = []
    if kind == "exploit":
        from ms_efficient.parallel.place_baselines import contiguous
        pop = [contiguous(problem)]
        pop += [balanced_contiguous(problem, s) for s in range(1, d_count + 1)][:size // 2]
    while len(pop) < size:
        pop.append(random_contiguous(problem, rng) if kind == "exploit"
                   else rng.integers(0, d_count, size=u_count))
    return np.stack([repair(problem, x) for x in pop])


def _children(problem: PlacementProblem, pop: np.ndarray, costs: np.ndarray, count: int,
              k: int, rng: np.random.Generator, explore: bool, cfg: TGAConfig) -> np.ndarray:
    d_count = problem.num_devices
    out = []
    for _ in range(count):
        x = pop[_tournament(costs, k, rng)]
        if rng.random() < cfg.crossover_rate:
            x = crossover_two_point(x, pop[_tournament(costs, k, rng)], rng)
        if explore:
            x = mutate_points(x, cfg.explore_mutation, d_count, rng)
            if rng.random() < 0.3:
                x = mutate_block(x, d_count, rng)
        else:
            x = mutate_neighbours(problem, x, 1 + int(rng.integers(0, 3)), rng)
        out.append(repair(problem, x))
    return np.stack(out)


def tga(problem: PlacementProblem, config: Optional[TGAConfig] = None) -> SearchResult:
    """Search a placement with the dual-population GA (see module docstring)."""
    cfg = config or TGAConfig()
    rng = np.random.default_rng(cfg.seed)
    budget = _Budget(problem, cfg.max_evaluations, cfg.time_budget_s)
    # Step 1: two starting populations.
    exploit = _initial(problem, cfg.pop_exploit, rng, "exploit")
    explore = _initial(problem, cfg.pop_explore, rng, "explore")
    c_exploit, c_explore = budget.evaluate(exploit), budget.evaluate(explore)
    trace: List[TracePoint] = []

    def record() -> None:
        e, x = float(c_exploit.min()), float(c_explore.min())
        trace.append(TracePoint(budget.used, budget.elapsed_s, min(e, x), e, x))

    record()
    gen = 0
    while budget.left() > 0:
        gen += 1
        # Step 2: exploit: strong selection, gentle mutation, (mu + lambda) survival.
        n = min(cfg.pop_exploit, budget.left())
        kids = _children(problem, exploit, c_exploit, n, cfg.tournament_exploit, rng, False, cfg)
        c_kids = budget.evaluate(kids)
        both, c_both = np.concatenate([exploit, kids]), np.concatenate([c_exploit, c_kids])
        _, first = np.unique(both, axis=0, return_index=True)  # drop duplicates
        keep = first[np.argsort(c_both[first], kind="stable")][:cfg.pop_exploit]
        if len(keep) < cfg.pop_exploit:  # converged population: refill with copies
            keep = np.resize(keep, cfg.pop_exploit)
        exploit, c_exploit = both[keep], c_both[keep]
        # Step 3: explore: weak selection, heavy mutation, generational replacement.
        n = min(cfg.pop_explore - 1, budget.left())
        if n > 0:
            kids = _children(problem, explore, c_explore, n, 2, rng, True, cfg)
            c_kids = budget.evaluate(kids)
            elite = int(np.argmin(c_explore))
            explore = np.concatenate([explore[elite:elite + 1], kids,
                                      explore[:cfg.pop_explore - 1 - n]])
            c_explore = np.concatenate([c_explore[elite:elite + 1], c_kids,
                                        c_explore[:cfg.pop_explore - 1 - n]])
        # Step 4: local search on exploit's champion.
        if gen % cfg.local_search_every == 0 and budget.left() > 0:
            best = int(np.argmin(c_exploit))
            x, c, used = local_search(problem, exploit[best], float(c_exploit[best]),
                                      budget.evaluate, min(cfg.local_search_budget,
                                                           budget.left()), rng)
            exploit[best], c_exploit[best] = x, c
        # Step 5: migration between the populations.
        if gen % cfg.migrate_every == 0:
            src = np.argsort(c_explore, kind="stable")[:cfg.migrants]
            dst = np.argsort(c_exploit, kind="stable")[::-1][:cfg.migrants]
            exploit[dst], c_exploit[dst] = explore[src], c_explore[src]
            champ = int(np.argmin(c_exploit))
            slot = int(rng.integers(1, cfg.pop_explore))
            explore[slot], c_explore[slot] = exploit[champ], c_exploit[champ]
        record()
    pool = np.concatenate([exploit, explore])
    costs = np.concatenate([c_exploit, c_explore])
    best = int(np.argmin(costs))
    logger.info("tga %s: %d generations, %d evaluations, %.2f s, best %.6g s", problem.name,
                gen, budget.used, budget.elapsed_s, costs[best])
    return SearchResult("tga", pool[best].copy(), float(costs[best]), budget.used,
                        budget.elapsed_s, trace)


def ga_single(problem: PlacementProblem, config: Optional[TGAConfig] = None) -> SearchResult:
    """Single-population GA baseline (see module docstring), same budget as ``tga``."""
    cfg = config or TGAConfig()
    rng = np.random.default_rng(cfg.seed)
    budget = _Budget(problem, cfg.max_evaluations, cfg.time_budget_s)
    size = cfg.pop_exploit + cfg.pop_explore
    pop = np.concatenate([_initial(problem, size // 2, rng, "exploit"),
                          _initial(problem, size - size // 2, rng, "explore")])
    costs = budget.evaluate(pop)
    trace = [TracePoint(budget.used, budget.elapsed_s, float(costs.min()), float(costs.min()),
                        float(costs.min()))]
    rate = 1.0 / problem.num_units
    while budget.left() > 0:
        n = min(size - 1, budget.left())
        kids = []
        for _ in range(n):
            x = pop[_tournament(costs, 2, rng)]
            if rng.random() < cfg.crossover_rate:
                x = crossover_two_point(x, pop[_tournament(costs, 2, rng)], rng)
            kids.append(repair(problem, mutate_points(x, rate, problem.num_devices, rng)))
        c_kids = budget.evaluate(np.stack(kids))
        elite = int(np.argmin(costs))
        pop = np.concatenate([pop[elite:elite + 1], np.stack(kids), pop[:size - 1 - n]])
        costs = np.concatenate([costs[elite:elite + 1], c_kids, costs[:size - 1 - n]])
        best = float(costs.min())
        trace.append(TracePoint(budget.used, budget.elapsed_s, best, best, best))
    best = int(np.argmin(costs))
    return SearchResult("ga-single", pop[best].copy(), float(costs[best]), budget.used,
                        budget.elapsed_s, trace)
