"""TGA: a dual-population genetic algorithm for partitioning and device placement.

Two populations with different roles search the same chromosome space ([U] device ids):

- exploit (``pop_exploit`` individuals) refines: tournaments of size 4 (strong pressure),
  (mu + lambda) survival of the best distinct individuals, and a local search
  (place.operators.local_search) on its champion every ``local_search_every`` generations until the
  champion is a local optimum. A child stays in its parents' class: pipelines (monotone
  placements, see place.operators) get stage-boundary or two-point crossover, boundary
  moves and sibling spreads inside a stage range, and are repaired into pipeline order;
  other placements (e.g. experts spread over all devices, the layout that wins with one
  micro-batch) get two-point crossover, boundary or neighbour moves and free spreads.
- explore (``pop_explore``) searches all placements: binary tournaments, two-point
  crossover, per-gene mutation at an adaptive rate (the 1/5 success rule: the rate grows
  by ``adapt`` while more than a fifth of the children beat their parent, and shrinks
  otherwise, within [1/U, 0.5]), block moves and sibling spreads, generational
  replacement keeping one elite, so it stays diverse.
- every ``migrate_every`` generations the best ``migrants`` explorers that exploit does
  not already hold replace exploit's worst, and exploit's champion, if explore lacks it,
  replaces a random explorer.

Every child is repaired (place.operators.repair) and both populations' children are
scored in one cost-model call per generation (one call of a few dozen rows costs about
as much as one row). Starting points (``_initial``) are structural heuristics, not other
planners' answers: min-max contiguous splits (``place.baselines.contiguous``) over D,
D-1, ... devices, the same with parallel siblings spread over all devices, balanced and
random contiguous splits for exploit; uniform random placements and spread random splits
for explore. The search stops at ``max_evaluations`` distinct evaluations, when the next
step would overrun ``time_budget_s`` if one is set (default none: place.cost.Evaluator),
or after ``patience``
generations that met no new placement (a small space is exhausted). The GA scores every
placement in the unit numbering; at the end the ``order_candidates`` best distinct
placements are also run in their own ETF list order (``place.baselines.list_order``, scored
by the simulator, counted as evaluations and kept from the GA's budget), and the plan is the
best placement with its order, as m-ETF's plan carries its list order. Same seed, same
inputs -> same result by default (no wall-clock budget); ``SearchResult.stopped_by`` says
which rule ended the search.

``ga_single`` is the single-population baseline with the same budget, seeds, repair, champion
local search and final list orders: one population of ``pop_exploit + pop_explore``, binary
tournaments, two-point crossover, per-gene mutation 1/U, generational replacement with one
elite. ``place.hierarchical`` starts from the same seeds and ends the same way.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import List, Optional

import numpy as np

from ms_efficient.place.cost import Evaluator, SearchResult, TracePoint
from ms_efficient.place.operators import (balanced_contiguous, crossover_stages,
                                          crossover_two_point, is_monotone, local_search,
                                          mutate_block, mutate_boundary, mutate_neighbours,
                                          mutate_points, mutate_spread, random_contiguous,
                                          repair, spread_all)
from ms_efficient.place.problem import PlacementProblem

__all__ = ["TGAConfig", "SearchResult", "TracePoint", "tga", "ga_single", "seeded_start",
           "order_finals"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TGAConfig:
    """Search settings (sizes are individuals, rates are probabilities per gene/child)."""

    seed: int = 0
    max_evaluations: int = 4000
    # wall-clock seconds; inf (default) = stop on max_evaluations / patience only, so a seed
    # gives the same plan on any machine (60 s was the bar for a 10k-operator graph)
    time_budget_s: float = math.inf
    pop_exploit: int = 24
    pop_explore: int = 24
    tournament_exploit: int = 4
    crossover_rate: float = 0.9
    explore_mutation: float = 0.08  # starting per-gene rate of explore; adapted
    adapt: float = 1.25             # factor of the 1/5 success rule
    spread_rate: float = 0.2        # share of children whose mutation spreads siblings
    migrate_every: int = 5
    migrants: int = 2
    local_search_every: int = 2
    local_search_budget: int = 128  # evaluations per local-search call
    local_search_batch: int = 64    # moves scored per cost-model call
    patience: int = 25              # generations without a new placement before stopping
    order_candidates: int = 8       # best final placements also tried in their list order

    def __post_init__(self) -> None:
        if self.order_candidates < 0:
            raise ValueError(f"'order_candidates' must be >= 0, but got {self.order_candidates}.")
        for key in ("max_evaluations", "migrate_every", "local_search_every",
                    "local_search_batch", "patience"):
            if getattr(self, key) < 1:
                raise ValueError(f"'{key}' must be >= 1, but got {getattr(self, key)}.")
        if self.pop_exploit < 4 or self.pop_explore < 4:
            raise ValueError("'pop_exploit' and 'pop_explore' must be >= 4.")
        if not self.time_budget_s > 0:
            raise ValueError(f"'time_budget_s' must be > 0 (inf = no wall-clock limit), but "
                             f"got {self.time_budget_s}.")
        if self.adapt < 1:
            raise ValueError(f"'adapt' must be >= 1.0, but got {self.adapt}.")


def _tournament(costs: np.ndarray, k: int, rng: np.random.Generator) -> int:
    picks = rng.integers(0, len(costs), size=k)
    return int(picks[np.argmin(costs[picks])])


def _initial(problem: PlacementProblem, size: int, rng: np.random.Generator,
             kind: str) -> np.ndarray:
    """[size, U] repaired starting chromosomes.

    exploit: min-max contiguous splits over D, D-1, ... devices; the same with every
    group of parallel siblings spread over all devices (``spread_all``, when the graph has
    such groups and contiguity is not required); balanced contiguous splits; random
    contiguous splits. explore: alternately uniform random placements and random
    contiguous splits with spread siblings."""
    from ms_efficient.place.baselines import contiguous

    d_count, u_count = problem.num_devices, problem.num_units
    spread = bool(problem.sibling_groups()) and not problem.contiguous
    pop: List[np.ndarray] = []
    if kind == "exploit":
        splits = [contiguous(problem, s) for s in range(d_count, 0, -1)]
        pop = splits[:size // 4]
        if spread:
            pop += [spread_all(problem, x) for x in splits[::-1][:size // 4]]
        pop += [balanced_contiguous(problem, s) for s in range(d_count, 0, -1)][:size // 4]
    while len(pop) < size:
        if kind == "exploit":
            pop.append(random_contiguous(problem, rng))
        elif len(pop) % 2 or not spread:
            pop.append(rng.integers(0, d_count, size=u_count))
        else:
            pop.append(spread_all(problem, random_contiguous(problem, rng), rng))
    return np.stack([repair(problem, x, monotone=is_monotone(problem, x)) for x in pop])


def _exploit_child(problem: PlacementProblem, pop: np.ndarray, costs: np.ndarray,
                   rng: np.random.Generator, cfg: TGAConfig) -> np.ndarray:
    """A child that stays in its parents' class: monotone parents give a monotone child
    (stage-boundary crossover, boundary moves, ranged sibling spread); otherwise two-point
    crossover and moves to a neighbour's device keep fine-grained splits alive."""
    x = pop[_tournament(costs, cfg.tournament_exploit, rng)]
    monotone = is_monotone(problem, x)
    if rng.random() < cfg.crossover_rate:
        y = pop[_tournament(costs, cfg.tournament_exploit, rng)]
        monotone = monotone and is_monotone(problem, y)
        x = crossover_stages(x, y, problem.num_devices, rng) if monotone and rng.random() < 0.5 \
            else crossover_two_point(x, y, rng)
    if rng.random() < cfg.spread_rate:
        x = mutate_spread(problem, x, monotone, rng)
    elif monotone or rng.random() < 0.5:
        x = mutate_boundary(problem, x, 1 + int(rng.integers(0, 3)), rng)
    else:
        x = mutate_neighbours(problem, x, 1 + int(rng.integers(0, 3)), rng)
    return repair(problem, x, monotone=monotone)


def _explore_child(problem: PlacementProblem, pop: np.ndarray, costs: np.ndarray,
                   rate: float, rng: np.random.Generator, cfg: TGAConfig):
    """(child, index of its first parent)."""
    d_count = problem.num_devices
    i = _tournament(costs, 2, rng)
    x = pop[i]
    if rng.random() < cfg.crossover_rate:
        x = crossover_two_point(x, pop[_tournament(costs, 2, rng)], rng)
    x = mutate_points(x, rate, d_count, rng)
    if rng.random() < 0.3:
        x = mutate_block(x, d_count, rng)
    if rng.random() < cfg.spread_rate:
        x = mutate_spread(problem, x, False, rng)
    return repair(problem, x), i


def _survivors(pop: np.ndarray, costs: np.ndarray, size: int):
    """(mu + lambda): the ``size`` best distinct rows (refilled with copies if fewer)."""
    _, first = np.unique(pop, axis=0, return_index=True)
    keep = first[np.argsort(costs[first], kind="stable")][:size]
    return pop[np.resize(keep, size)], costs[np.resize(keep, size)]


def tga(problem: PlacementProblem, config: Optional[TGAConfig] = None) -> SearchResult:
    """Search a placement with the dual-population GA (see module docstring)."""
    cfg = config or TGAConfig()
    rng = np.random.default_rng(cfg.seed)
    # the last evaluations are kept for the final list orders
    reserve = min(cfg.order_candidates, cfg.max_evaluations // 2)
    ev = Evaluator(problem, cfg.max_evaluations - reserve, cfg.time_budget_s)
    # Step 1: two starting populations, scored in one call.
    exploit = _initial(problem, cfg.pop_exploit, rng, "exploit")
    explore = _initial(problem, cfg.pop_explore, rng, "explore")
    costs = ev.evaluate(np.concatenate([exploit, explore]))
    c_exploit, c_explore = costs[:len(exploit)], costs[len(exploit):]
    rate_lo, rate = 1.0 / problem.num_units, cfg.explore_mutation
    trace: List[TracePoint] = []
    local_optima = set()  # keys of champions the local search could not improve
    gen_s, stale = 0.0, 0

    def record() -> None:
        e, x = float(c_exploit.min()), float(c_explore.min())
        trace.append(TracePoint(ev.used, ev.elapsed_s, min(e, x), e, x))

    record()
    gen = 0
    while ev.left() > 0 and not ev.time_up(gen_s) and stale < cfg.patience:
        gen += 1
        t_gen, used = time.perf_counter(), ev.used
        # Step 2: children of both populations, scored together.
        kids_x = [_exploit_child(problem, exploit, c_exploit, rng, cfg)
                  for _ in range(cfg.pop_exploit)]
        kids_e, parents = zip(*[_explore_child(problem, explore, c_explore, rate, rng, cfg)
                                for _ in range(cfg.pop_explore - 1)])
        c_kids = ev.evaluate(np.stack(kids_x + list(kids_e)))
        c_kx, c_ke = c_kids[:len(kids_x)], c_kids[len(kids_x):]
        # Step 3: exploit keeps the best distinct of parents and children.
        exploit, c_exploit = _survivors(np.concatenate([exploit, np.stack(kids_x)]),
                                        np.concatenate([c_exploit, c_kx]), cfg.pop_exploit)
        # Step 4: explore: generational with one elite; adapt its mutation rate.
        success = float(np.mean(c_ke < c_explore[list(parents)]))
        rate = float(np.clip(rate * (cfg.adapt if success > 0.2 else cfg.adapt ** -0.25),
                             rate_lo, 0.5))
        elite = int(np.argmin(c_explore))
        explore = np.concatenate([explore[elite:elite + 1], np.stack(kids_e)])
        c_explore = np.concatenate([c_explore[elite:elite + 1], c_ke])
        # Step 5: local search on exploit's champion, until it is a local optimum.
        if gen % cfg.local_search_every == 0:
            _champion_search(problem, exploit, c_exploit, ev, rng, cfg, local_optima)
        # Step 6: migration of the best distinct individuals.
        if gen % cfg.migrate_every == 0:
            held = {ev.key(x) for x in exploit}
            movers = [i for i in np.argsort(c_explore, kind="stable")
                      if ev.key(explore[i]) not in held][:cfg.migrants]
            worst = np.argsort(c_exploit, kind="stable")[::-1][:len(movers)]
            exploit[worst], c_exploit[worst] = explore[movers], c_explore[movers]
            champ = int(np.argmin(c_exploit))
            if ev.key(exploit[champ]) not in {ev.key(x) for x in explore}:
                slot = int(rng.integers(1, cfg.pop_explore))
                explore[slot], c_explore[slot] = exploit[champ], c_exploit[champ]
        record()
        gen_s = time.perf_counter() - t_gen
        stale = stale + 1 if ev.used == used else 0
    pool = np.concatenate([exploit, explore])
    costs = np.concatenate([c_exploit, c_explore])
    assign, cost, order, extra = _order_finals(problem, pool, costs, reserve, ev)
    logger.info("tga %s: %d generations, %d evaluations (%d cache hits), %.2f s, best %.6g s "
                "(%s order), explore rate %.3g", problem.name, gen, ev.used + extra,
                ev.cache_hits, ev.elapsed_s, cost, "list" if order is not None else "unit",
                rate)
    return SearchResult("tga", assign, cost, ev.used + extra, ev.elapsed_s, trace, order=order,
                        stopped_by=ev.stop_reason())


def _champion_search(problem: PlacementProblem, pop: np.ndarray, costs: np.ndarray,
                     ev: Evaluator, rng: np.random.Generator, cfg: TGAConfig,
                     local_optima: set) -> None:
    """Local search on the population's best member until it is a local optimum (in place;
    ``local_optima`` holds the keys of champions the search could not improve)."""
    best = int(np.argmin(costs))
    if ev.key(pop[best]) in local_optima:
        return
    x, c, converged = local_search(problem, pop[best], float(costs[best]), ev,
                                   cfg.local_search_budget, rng,
                                   monotone=is_monotone(problem, pop[best]),
                                   batch=cfg.local_search_batch)
    if converged:
        local_optima.add(ev.key(x))
    pop[best], costs[best] = x, c


def _order_finals(problem: PlacementProblem, pool: np.ndarray, costs: np.ndarray, k: int,
                  ev: Evaluator):
    """The best of the ``k`` best distinct final placements, each run in the unit numbering
    (its GA cost) or in its own ETF list order (``place.baselines.list_order``, scored by
    the simulator): (assign, cost_s, order or None, simulator evaluations spent)."""
    from ms_efficient.place.baselines import list_order
    from ms_efficient.place.cost import penalised_cost, simulate_placement

    _, first = np.unique(pool, axis=0, return_index=True)
    top = first[np.argsort(costs[first], kind="stable")][:k]
    best = int(top[0])
    out = (pool[best].copy(), float(costs[best]), None)
    spent, sim_s = 0, 4.0 * ev.max_call_s     # a simulator run costs ~3 evaluator calls
    for i in top:
        if not np.isfinite(costs[i]) or ev.time_up(extra_s=sim_s):
            break
        t0 = time.perf_counter()
        order = list_order(problem, pool[i])
        sim = simulate_placement(problem, pool[i], order=order)
        sim_s, spent = time.perf_counter() - t0, spent + 1
        c = float(penalised_cost(problem, np.array([sim.step_time_s]),
                                 sim.peak_memory_bytes[None])[0])
        if c < out[1] * (1 - 1e-9):
            out = (pool[i].copy(), c, order)
    return out + (spent,)


def ga_single(problem: PlacementProblem, config: Optional[TGAConfig] = None) -> SearchResult:
    """Single-population GA baseline (see module docstring): same budget, seeds, repair,
    champion local search and final list orders as ``tga``; only the search differs."""
    cfg = config or TGAConfig()
    rng = np.random.default_rng(cfg.seed)
    reserve = min(cfg.order_candidates, cfg.max_evaluations // 2)
    ev = Evaluator(problem, cfg.max_evaluations - reserve, cfg.time_budget_s)
    local_optima = set()
    size = cfg.pop_exploit + cfg.pop_explore
    pop = np.concatenate([_initial(problem, size // 2, rng, "exploit"),
                          _initial(problem, size - size // 2, rng, "explore")])
    costs = ev.evaluate(pop)
    trace = [TracePoint(ev.used, ev.elapsed_s, float(costs.min()), float(costs.min()),
                        float(costs.min()))]
    rate = 1.0 / problem.num_units
    gen_s, stale, gen = 0.0, 0, 0
    while ev.left() > 0 and not ev.time_up(gen_s) and stale < cfg.patience:
        gen += 1
        t_gen, used = time.perf_counter(), ev.used
        kids = []
        for _ in range(size - 1):
            x = pop[_tournament(costs, 2, rng)]
            if rng.random() < cfg.crossover_rate:
                x = crossover_two_point(x, pop[_tournament(costs, 2, rng)], rng)
            kids.append(repair(problem, mutate_points(x, rate, problem.num_devices, rng)))
        c_kids = ev.evaluate(np.stack(kids))
        elite = int(np.argmin(costs))
        pop = np.concatenate([pop[elite:elite + 1], np.stack(kids)])
        costs = np.concatenate([costs[elite:elite + 1], c_kids])
        # the same champion local search as TGA's exploit population
        if gen % cfg.local_search_every == 0:
            _champion_search(problem, pop, costs, ev, rng, cfg, local_optima)
        best = float(costs.min())
        trace.append(TracePoint(ev.used, ev.elapsed_s, best, best, best))
        gen_s = time.perf_counter() - t_gen
        stale = stale + 1 if ev.used == used else 0
    assign, cost, order, extra = _order_finals(problem, pop, costs, reserve, ev)
    return SearchResult("ga-single", assign, cost, ev.used + extra, ev.elapsed_s, trace,
                        order=order, stopped_by=ev.stop_reason())


def seeded_start(problem: PlacementProblem, size: int, rng: np.random.Generator) -> np.ndarray:
    """TGA's structural starting placements (contiguous splits and their spreads), for the
    baselines that should start where TGA does."""
    return _initial(problem, size, rng, "exploit")


def order_finals(problem: PlacementProblem, pool: np.ndarray, costs: np.ndarray, k: int,
                 ev: Evaluator):
    """TGA's last step for any search (see ``_order_finals``)."""
    return _order_finals(problem, pool, costs, k, ev)
