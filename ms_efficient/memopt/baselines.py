"""Heuristic baselines in MemOpt's harness: none, full recompute, Chen et al. sqrt(n)
checkpointing and a Capuchin-style greedy (swap what hides behind compute, else recompute).

Written from the papers' public descriptions (Chen et al. 2016 "Training Deep Nets with
Sublinear Memory Cost"; Peng et al. 2020 "Capuchin"). Pure numpy; plans are MemoryPlans.
"""
from __future__ import annotations

import math

import numpy as np

from ms_efficient.memopt.env import (KEEP, RECOMPUTE, RECOMPUTE_ALL, SWAP, MemoryPlan,
                                     evaluate)
from ms_efficient.memopt.profile import LayerProfile

__all__ = ["no_optimization", "full_recompute", "chen_sqrt", "chen_segments", "capuchin_greedy"]


def no_optimization(profile: LayerProfile) -> MemoryPlan:
    """Every layer keeps its activations."""
    return MemoryPlan(np.full(profile.num_layers, KEEP), method="none")


def full_recompute(profile: LayerProfile) -> MemoryPlan:
    """Every layer recomputed, its input kept (``Cell.recompute()`` on every candidate Cell)."""
    return MemoryPlan(np.full(profile.num_layers, RECOMPUTE), method="full-recompute")


def chen_segments(num_layers: int) -> int:
    """Segment length k = ceil(sqrt(n)); the number of segments is ceil(n / k)."""
    return max(1, math.ceil(math.sqrt(num_layers)))


def chen_sqrt(profile: LayerProfile) -> MemoryPlan:
    """Chen et al.: cut the chain into segments of ceil(sqrt(n)) layers; keep only each
    segment's last output (RECOMPUTE), drop everything inside (RECOMPUTE_ALL); backward re-runs
    one segment at a time. Memory O(sqrt(n)) activations for one extra forward pass."""
    n = profile.num_layers
    k = chen_segments(n)
    actions = np.full(n, RECOMPUTE_ALL)
    actions[k - 1::k] = RECOMPUTE
    actions[-1] = RECOMPUTE
    return MemoryPlan(actions, method="chen-sqrt")


def capuchin_greedy(profile: LayerProfile, budget_bytes: float, host_link) -> MemoryPlan:
    """Capuchin-style greedy, from all-keep, until the simulated peak fits the budget:

    Step 1 swap: layers whose page-out hides behind the next forward and whose prefetch hides
        behind the backward before its use (free time >= 0), largest activations first;
    Step 2 recompute: the rest by memory saved per re-run second (MSPS, e_i / f_i), highest
        first.
    Returns the first plan that fits, or the last one tried (meta["fits"] says which).
    """
    n = profile.num_layers
    f, b, a = profile.forward_time_s, profile.backward_time_s, profile.activation_bytes
    t_xfer = host_link.latency_s + a / host_link.bandwidth_Bps
    actions = np.full(n, KEEP)
    hides = np.zeros(n, bool)
    hides[:-2] = (t_xfer[:-2] <= f[1:-1]) & (t_xfer[:-2] <= b[2:])
    swap_order = [i for i in np.argsort(-a, kind="stable") if hides[i]]
    msps = profile.interior_bytes / np.maximum(f, 1e-15)
    recompute_order = [i for i in np.argsort(-msps, kind="stable") if not hides[i]]
    plan = MemoryPlan(actions, method="capuchin-greedy")
    result = evaluate(profile, plan, budget_bytes, host_link)
    for i, action in [(i, SWAP) for i in swap_order] + [(i, RECOMPUTE) for i in recompute_order]:
        if result.fits:
            break
        trial = MemoryPlan(plan.actions, method="capuchin-greedy")
        trial.actions[i] = action
        trial_result = evaluate(profile, trial, budget_bytes, host_link)
        if trial_result.peak_bytes <= result.peak_bytes:   # keep steps that do not hurt
            plan, result = trial, trial_result
    plan.meta["fits"] = result.fits
    return plan
