"""MemOpt entry points: plan a profile under a budget with any method, and find the largest
batch a method fits (no MindSpore import).

METHODS: "memopt" (the dual-agent RL planner, warm-started from the best fitting of the
Capuchin greedy, full recompute and, when it solves in time, the recompute-only MILP), and the
baselines "none", "full-recompute", "chen-sqrt", "checkmate-milp", "capuchin-greedy",
"exact-milp".
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Callable, Dict, Optional, Tuple

from ms_efficient.memopt.agents import RLConfig, train_agents
from ms_efficient.memopt.baselines import (capuchin_greedy, chen_sqrt, full_recompute,
                                           no_optimization)
from ms_efficient.memopt.env import MemoryPlan, StepResult, check_budget, evaluate
from ms_efficient.memopt.milp import checkmate_milp, exact_milp
from ms_efficient.memopt.profile import LayerProfile, format_size

__all__ = ["METHODS", "plan_memory", "plan_with", "max_batch"]

logger = logging.getLogger(__name__)

METHODS = ("memopt", "none", "full-recompute", "chen-sqrt", "checkmate-milp",
           "capuchin-greedy", "exact-milp")


def plan_memory(profile: LayerProfile, budget_bytes: float, host_link,
                config: RLConfig = RLConfig(), milp_time_limit_s: float = 10.0
                ) -> Tuple[MemoryPlan, StepResult]:
    """The MemOpt plan: fastest simulated step whose peak fits ``budget_bytes``.

    Raises ValueError if the budget is below the unavoidable minimum (stated in the message) or
    no fitting plan was found.
    """
    check_budget(profile, budget_bytes)
    start = time.perf_counter()
    # Step 1: warm-start candidates, the fastest fitting one seeds the agents
    candidates = [capuchin_greedy(profile, budget_bytes, host_link), full_recompute(profile),
                  chen_sqrt(profile)]
    try:
        candidates.append(checkmate_milp(profile, budget_bytes, host_link,
                                         time_limit_s=milp_time_limit_s))
    except ValueError as err:
        logger.debug("no recompute-only MILP warm start: %s", err)
    scored = [(evaluate(profile, c, budget_bytes, host_link), c) for c in candidates]
    fitting = [(r.step_time_s, i) for i, (r, _) in enumerate(scored) if r.fits]
    warm = scored[min(fitting)[1]][1] if fitting else None
    # Step 2: train the two agents for the remaining time
    left = max(1.0, config.time_limit_s - (time.perf_counter() - start))
    plan, result, history = train_agents(profile, budget_bytes, host_link, warm,
                                         replace(config, time_limit_s=left))
    if plan is None:
        raise ValueError(f"budget {format_size(budget_bytes)}: MemOpt found no plan that fits "
                         f"at batch {profile.batch_size}; raise the budget or lower the batch.")
    plan.method = "memopt"
    plan.meta.update({"warm_start": warm.method if warm is not None else None,
                      "planning_time_s": time.perf_counter() - start,
                      "evaluations": history["evaluations"],
                      "updates": len(history["mean_reward"])})
    return plan, result


def plan_with(method: str, profile: LayerProfile, budget_bytes: float, host_link,
              config: RLConfig = RLConfig(), milp_time_limit_s: float = 30.0
              ) -> Tuple[MemoryPlan, StepResult]:
    """Plan with ``method`` (one of METHODS) and simulate it. Budget-agnostic baselines
    (none, full-recompute, chen-sqrt) are returned even when they do not fit (check
    ``StepResult.fits``); the others raise ValueError when nothing fits."""
    makers: Dict[str, Callable[[], MemoryPlan]] = {
        "none": lambda: no_optimization(profile),
        "full-recompute": lambda: full_recompute(profile),
        "chen-sqrt": lambda: chen_sqrt(profile),
        "capuchin-greedy": lambda: capuchin_greedy(profile, budget_bytes, host_link),
        "checkmate-milp": lambda: checkmate_milp(profile, budget_bytes, host_link,
                                                 time_limit_s=milp_time_limit_s),
        "exact-milp": lambda: exact_milp(profile, budget_bytes, host_link,
                                         time_limit_s=milp_time_limit_s),
    }
    if method == "memopt":
        return plan_memory(profile, budget_bytes, host_link, config)
    if method not in makers:
        raise ValueError(f"'method' must be one of {list(METHODS)}, but got {method!r}.")
    start = time.perf_counter()
    plan = makers[method]()
    plan.meta.setdefault("planning_time_s", time.perf_counter() - start)
    return plan, evaluate(profile, plan, budget_bytes, host_link)


def max_batch(method: str, profile: LayerProfile, budget_bytes: float, host_link,
              hi: int = 4096, config: RLConfig = RLConfig()) -> int:
    """Largest batch size (a multiple of nothing, >= 0) at which ``method`` returns a fitting
    plan, by doubling then bisection on ``profile.at_batch``; 0 if batch 1 does not fit."""

    def fits(batch: int) -> bool:
        prof = profile.at_batch(batch)
        try:
            _, result = plan_with(method, prof, budget_bytes, host_link, config)
        except ValueError:
            return False
        return result.fits

    if not fits(1):
        return 0
    lo, up = 1, 2
    while up <= hi and fits(up):
        lo, up = up, up * 2
    up = min(up, hi + 1)
    while up - lo > 1:
        mid = (lo + up) // 2
        lo, up = (mid, up) if fits(mid) else (lo, mid)
    return lo
