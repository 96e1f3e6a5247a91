"""MemOpt entry points: plan a profile under a budget with any method, and find the largest
batch a method fits (no MindSpore import).

METHODS: "memopt" (the dual-agent RL planner, warm-started from the best fitting of the
Capuchin greedy, full recompute, Chen sqrt(n) and, when it solves in time, the recompute-only
MILP), and the baselines "none", "full-recompute", "chen-sqrt", "checkmate-milp",
"capuchin-greedy", "exact-milp".
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ms_efficient.core.units import format_size
from ms_efficient.memopt.agents import RLConfig, train_agents
from ms_efficient.memopt.baselines import (capuchin_greedy, chen_sqrt, full_recompute,
                                           no_optimization)
from ms_efficient.memopt.env import (ALL_ACTIONS, OFFLOAD, RECOMPUTE_ALL, SWAP, MemoryPlan,
                                     StepResult, check_actions, check_budget, evaluate,
                                     min_budget_bytes)
from ms_efficient.memopt.milp import checkmate_milp, checkmate_min_peak, exact_milp
from ms_efficient.memopt.profile import LayerProfile

__all__ = ["METHODS", "WARM_START_METHODS", "budget_floor", "plan_memory", "plan_with", "max_batch",
           "max_batches", "max_batch_bound", "max_batch_link_estimate"]

logger = logging.getLogger(__name__)

METHODS = ("memopt", "none", "full-recompute", "chen-sqrt", "checkmate-milp",
           "capuchin-greedy", "exact-milp")
# baselines MemOpt warm-starts from (it returns a plan at least as fast as the best fitting one)
WARM_START_METHODS = ("capuchin-greedy", "full-recompute", "chen-sqrt", "checkmate-milp")


def budget_floor(profile: LayerProfile, host_link, actions: Sequence[int] = ALL_ACTIONS
                 ) -> Tuple[float, float, MemoryPlan]:
    """(floor, safe, plan): no plan of ``actions`` fits below ``floor`` bytes; ``plan``, the
    least-peak recompute plan of ``actions`` (``checkmate_min_peak``), fits in ``safe`` bytes.

    Recompute-only targets: floor = safe = that plan's peak. With host actions (swap,
    offload) the floor is ``min_budget_bytes`` (static + the largest working set of one
    layer); between it and ``safe`` only swapping can fit, if the host link keeps up.
    ``plan_memory`` at a budget >= ``safe`` can fall back on ``plan``, so it never fails."""
    codes = check_actions(actions)
    low = min_budget_bytes(profile)
    least = checkmate_min_peak(profile, host_link, allow_drop=RECOMPUTE_ALL in codes)
    safe = max(low, evaluate(profile, least, float("inf"), host_link).peak_bytes)
    return (low if SWAP in codes or OFFLOAD in codes else safe), safe, least


def plan_memory(profile: LayerProfile, budget_bytes: float, host_link,
                config: RLConfig = RLConfig(), milp_time_limit_s: float = 10.0,
                actions: Sequence[int] = ALL_ACTIONS,
                candidates: Optional[Dict[str, Optional[MemoryPlan]]] = None
                ) -> Tuple[MemoryPlan, StepResult]:
    """The MemOpt plan: fastest simulated step whose peak fits ``budget_bytes``.

    actions: action codes the target realises (``ALL_ACTIONS`` on Ascend,
    ``CELL_RECOMPUTE_ACTIONS`` for MindSpore on CPU). candidates: warm-start plans already made
    for this profile, budget and actions, {method in WARM_START_METHODS: plan, or None if that
    method found none}; missing ones are made here. Raises ValueError if the budget is below
    the unavoidable minimum (stated in the message) or no fitting plan was found.
    """
    codes = check_actions(actions)
    check_budget(profile, budget_bytes)
    start = time.perf_counter()
    # Step 1: warm-start candidates, the fastest fitting one seeds the agents
    made = dict(candidates or {})
    makers = {
        "capuchin-greedy": lambda: capuchin_greedy(profile, budget_bytes, host_link,
                                                   allow_swap=SWAP in codes,
                                                   allow_offload=OFFLOAD in codes),
        "full-recompute": lambda: full_recompute(profile),
        "chen-sqrt": lambda: chen_sqrt(profile),
        "checkmate-milp": lambda: checkmate_milp(profile, budget_bytes, host_link,
                                                 time_limit_s=milp_time_limit_s,
                                                 allow_drop=RECOMPUTE_ALL in codes),
    }
    for method in WARM_START_METHODS:
        if method not in made:
            try:
                made[method] = makers[method]()
            except ValueError as err:
                logger.debug("no %s warm start: %s", method, err)
                made[method] = None
    candidates = [made[m] for m in WARM_START_METHODS
                  if made[m] is not None and np.isin(made[m].actions, codes).all()]
    scored = [(evaluate(profile, c, budget_bytes, host_link), c) for c in candidates]
    fitting = [(r.step_time_s, i) for i, (r, _) in enumerate(scored) if r.fits]
    warm = scored[min(fitting)[1]][1] if fitting else None
    # Step 2: train the two agents for the remaining time
    left = (config.time_limit_s if config.time_limit_s == math.inf
            else max(1.0, config.time_limit_s - (time.perf_counter() - start)))
    plan, result, history = train_agents(profile, budget_bytes, host_link, warm,
                                         replace(config, time_limit_s=left), codes)
    if plan is None:
        raise ValueError(f"budget {format_size(budget_bytes)}: MemOpt found no plan that fits "
                         f"at batch {profile.batch_size}; raise the budget or lower the batch.")
    plan.method = "memopt"
    plan.meta.update({"warm_start": warm.method if warm is not None else None,
                      "planning_time_s": time.perf_counter() - start,
                      "evaluations": history["evaluations"],
                      "updates": len(history["mean_reward"]),
                      "stopped_by": history["stopped_by"],
                      "time_limit_s": (None if config.time_limit_s == math.inf
                                       else config.time_limit_s)})
    return plan, result


def plan_with(method: str, profile: LayerProfile, budget_bytes: float, host_link,
              config: RLConfig = RLConfig(), milp_time_limit_s: float = 30.0,
              actions: Sequence[int] = ALL_ACTIONS,
              candidates: Optional[Dict[str, Optional[MemoryPlan]]] = None
              ) -> Tuple[MemoryPlan, StepResult]:
    """Plan with ``method`` (one of METHODS) and simulate it. Budget-agnostic baselines
    (none, full-recompute, chen-sqrt) are returned even when they do not fit (check
    ``StepResult.fits``); the others raise ValueError when nothing fits. ``actions`` limits
    the budget-aware planners (memopt, checkmate-milp, capuchin-greedy) to what the target
    realises; the fixed baselines and the exact-milp yardstick ignore it. ``candidates``:
    see ``plan_memory`` (memopt only)."""
    codes = check_actions(actions)
    makers: Dict[str, Callable[[], MemoryPlan]] = {
        "none": lambda: no_optimization(profile),
        "full-recompute": lambda: full_recompute(profile),
        "chen-sqrt": lambda: chen_sqrt(profile),
        "capuchin-greedy": lambda: capuchin_greedy(profile, budget_bytes, host_link,
                                                   allow_swap=SWAP in codes,
                                                   allow_offload=OFFLOAD in codes),
        "checkmate-milp": lambda: checkmate_milp(profile, budget_bytes, host_link,
                                                 time_limit_s=milp_time_limit_s,
                                                 allow_drop=RECOMPUTE_ALL in codes),
        "exact-milp": lambda: exact_milp(profile, budget_bytes, host_link,
                                         time_limit_s=milp_time_limit_s),
    }
    if method == "memopt":
        return plan_memory(profile, budget_bytes, host_link, config, actions=codes,
                           candidates=candidates)
    if method not in makers:
        raise ValueError(f"'method' must be one of {list(METHODS)}, but got {method!r}.")
    start = time.perf_counter()
    plan = makers[method]()
    plan.meta.setdefault("planning_time_s", time.perf_counter() - start)
    return plan, evaluate(profile, plan, budget_bytes, host_link)


def max_batch_bound(profile: LayerProfile, budget_bytes: float) -> int:
    """Largest batch any plan can fit in ``budget_bytes`` (0: not even batch 1).

    No plan goes below ``min_budget_bytes`` (static bytes plus the largest working set of
    one layer), which grows linearly with the batch on ``profile.at_batch``; this is the
    largest batch where it still fits. A yardstick for ``max_batches``: a method at the
    bound cannot be beaten by any planner on this layer model."""
    one = profile.at_batch(1)
    per_sample = min_budget_bytes(one) - one.static_bytes
    if per_sample <= 0:
        raise ValueError("the profile has no activation bytes: every batch needs the same "
                         "memory, so there is no largest batch.")
    bound = max(0, int((budget_bytes - one.static_bytes) // per_sample))
    while bound > 0 and min_budget_bytes(one.at_batch(bound)) > budget_bytes:   # rounding
        bound -= 1
    while min_budget_bytes(one.at_batch(bound + 1)) <= budget_bytes:
        bound += 1
    return bound


def max_batch_link_estimate(profile: LayerProfile, budget_bytes: float, host_link) -> int:
    """Largest batch at which paging can plausibly close the gap of the least-peak
    recompute-only plan (an estimate between Checkmate's largest batch and the bound).

    Swapping a layer out instead of keeping (or recomputing from) its checkpoint lowers the
    memory at a program point by at most the bytes the host link has moved by then, and the
    forward pass never waits for a page-out, so a plan fits at batch b only if
        peak(least-peak recompute plan at b) - bandwidth * (sum f + sum b at b) <= budget.
    Not a proof (a backward pass that stalls on prefetches leaves the link more time), but it
    shows when the host link, not the planner, sets the largest batch."""
    one = profile.at_batch(1)
    least = checkmate_min_peak(one, host_link, allow_drop=True)

    def fits(batch: int) -> bool:
        prof = one.at_batch(batch)
        moved = host_link.bandwidth_Bps * float(prof.forward_time_s.sum()
                                                + prof.backward_time_s.sum())
        return evaluate(prof, least, budget_bytes, host_link).peak_bytes - moved <= budget_bytes

    lo, hi = 0, max_batch_bound(profile, budget_bytes) + 1     # fits(lo); not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def max_batch(method: str, profile: LayerProfile, budget_bytes: float, host_link,
              hi: int = 4096, config: RLConfig = RLConfig()) -> int:
    """Largest batch at which ``method`` returns a fitting plan (see ``max_batches``)."""
    return max_batches([method], profile, budget_bytes, host_link, hi, config)[method]


def max_batches(methods: Sequence[str], profile: LayerProfile, budget_bytes: float, host_link,
                hi: int = 4096, config: RLConfig = RLConfig(),
                actions: Sequence[int] = ALL_ACTIONS) -> Dict[str, int]:
    """{method: largest batch size in [0, hi] at which it returns a fitting plan} (0: batch 1
    does not fit), on ``profile.at_batch``; budget in bytes.

    Step 1: the ceiling: the unavoidable minimum (``min_budget_bytes``) grows linearly with
        the batch, so no method fits at or above up = its first batch over the budget.
    Step 2: per method, a batch it provably reaches: 1 for the heuristics; for checkmate-milp
        the best of none / full recompute / chen-sqrt (plans in its feasible set); for memopt
        the best of the baselines it warm-starts from (it returns one of them if the agents
        find nothing faster). The bound is checked, and the search falls back to 1 if it does
        not hold.
    Step 3: from there, galloping (1, 2, 4, ... above) then bisection below the ceiling.
    checkmate-milp is answered by one MILP: its least-peak plan (``checkmate_min_peak``) is
    the least-peak recompute-only plan at every batch, so a recompute-only plan fits at a
    batch iff that one does (the time-optimal MILP near the limit takes 10-30 s per batch to
    prove infeasible). Every plan is made once per (method, batch); memopt reuses the
    baselines' fitting plans at a batch as its warm starts.
    """
    codes = check_actions(actions)
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"'methods' must be in {list(METHODS)}, but got {unknown}.")
    # Step 1: the ceiling
    one = profile.at_batch(1)
    up = min(hi, max_batch_bound(profile, budget_bytes)) + 1
    plans: Dict[Tuple[str, int], Optional[MemoryPlan]] = {}
    fitting: Dict[Tuple[str, int], bool] = {}
    found: Dict[str, int] = {}
    least_peak: List[MemoryPlan] = []      # checkmate's least-peak plan, solved once

    def fits(method: str, batch: int) -> bool:
        if (method, batch) in fitting:
            return fitting[method, batch]
        prof = profile.at_batch(batch)
        if method == "checkmate-milp":
            if not least_peak:
                least_peak.append(checkmate_min_peak(one, host_link,
                                                     allow_drop=RECOMPUTE_ALL in codes))
            plan, result = least_peak[0], evaluate(prof, least_peak[0], budget_bytes, host_link)
        else:
            warm = None
            if method == "memopt":
                warm = {m: plans[m, batch] for m in WARM_START_METHODS if (m, batch) in plans}
                if batch > found.get("checkmate-milp", batch):
                    warm["checkmate-milp"] = None     # no recompute-only plan fits here
            try:
                plan, result = plan_with(method, prof, budget_bytes, host_link, config,
                                         actions=codes, candidates=warm)
            except ValueError:
                plan, result = None, None
        fitting[method, batch] = bool(result is not None and result.fits)
        plans[method, batch] = plan if fitting[method, batch] else None
        return fitting[method, batch]

    def search(method: str, start: int) -> int:
        """Step 3: galloping from ``start`` (checked), then bisection below the first miss."""
        if fits(method, start):
            lo = start
        elif start > 1 and fits(method, 1):
            logger.warning("max batch of %s: the bound %d does not fit; searching from 1",
                           method, start)
            lo = 1
        else:
            return 0
        step, top = 1, up
        while lo + step < top:
            if not fits(method, lo + step):
                top = lo + step
                break
            lo, step = lo + step, 2 * step
        while top - lo > 1:
            mid = (lo + top) // 2
            lo, top = (mid, top) if fits(method, mid) else (lo, mid)
        return lo

    # Step 2: baselines first; checkmate-milp and memopt start from the plans they contain
    drop = [] if RECOMPUTE_ALL not in codes else ["chen-sqrt"]
    bounds = {"checkmate-milp": ["none", "full-recompute"] + drop,
              "memopt": ["capuchin-greedy", "full-recompute", "checkmate-milp"] + drop}
    needed = set(methods)
    for method in methods:
        needed.update(bounds.get(method, []))
    for method in sorted(needed, key=lambda m: (m == "memopt", m == "checkmate-milp", m)):
        start = max([1] + [found[m] for m in bounds.get(method, [])])
        found[method] = search(method, start) if up > 1 else 0
    return {m: found[m] for m in methods}
