"""Heuristic baselines in MemOpt's harness: none, full recompute, Chen et al. sqrt(n)
checkpointing and a Capuchin-style hybrid greedy (swap or recompute, whichever costs less).

Written from the papers' public descriptions (Chen et al. 2016 "Training Deep Nets with
Sublinear Memory Cost"; Peng et al. 2020 "Capuchin"). Pure numpy; plans are MemoryPlans.
"""
from __future__ import annotations

import math

import numpy as np

from ms_efficient.memopt.env import (KEEP, OFFLOAD, RECOMPUTE, RECOMPUTE_ALL, SWAP, MemoryPlan,
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


def capuchin_greedy(profile: LayerProfile, budget_bytes: float, host_link,
                    allow_swap: bool = True, allow_offload: bool = True) -> MemoryPlan:
    """Capuchin-style hybrid greedy (Peng et al. 2020), from all-keep, until the simulated
    peak fits the budget. Capuchin evicts tensors in order of their free time (FT: the idle
    time between a tensor's forward use and its backward use, which a swap can hide in) and
    for each picks swap or recompute, whichever costs less time for the memory it frees.

    Step 1 hybrid, layers in descending FT (from the unoptimised step: the forward and
        backward time after layer i, so early layers first): try each eviction the target
        allows (SWAP its activations; OFFLOAD: recompute the interior, swap the output;
        RECOMPUTE) in the simulator and keep the one with the least added step time per byte
        of peak it removes (none if no eviction lowers the peak).
    Step 2 recompute: layers still kept by memory saved per re-run second (MSPS, e_i / f_i),
        highest first, while the peak does not rise.
    ``allow_swap`` / ``allow_offload`` False: targets without them (CPU: neither).
    Returns the first plan that fits, or the last one tried (meta["fits"] says which).
    """
    n = profile.num_layers
    f, b = profile.forward_time_s, profile.backward_time_s
    evictions = [a for a, ok in ((SWAP, allow_swap), (OFFLOAD, allow_offload),
                                 (RECOMPUTE, True)) if ok]
    free_time = np.cumsum((f + b)[::-1])[::-1] - (f + b)      # seconds after layer i's use
    plan = MemoryPlan(np.full(n, KEEP), method="capuchin-greedy")
    result = evaluate(profile, plan, budget_bytes, host_link)
    # Step 1: hybrid swap / recompute in free-time order
    for i in np.argsort(-free_time, kind="stable"):
        if result.fits:
            break
        best = None
        for action in evictions:
            trial = MemoryPlan(plan.actions, method="capuchin-greedy")
            trial.actions[i] = action
            r = evaluate(profile, trial, budget_bytes, host_link)
            gain = result.peak_bytes - r.peak_bytes
            if gain > 0:
                cost = max(r.step_time_s - result.step_time_s, 0.0) / gain
                if best is None or cost < best[0]:
                    best = (cost, trial, r)
        if best is not None:
            _, plan, result = best
    # Step 2: recompute what is still kept, by MSPS
    msps = profile.interior_bytes / np.maximum(f, 1e-15)
    for i in np.argsort(-msps, kind="stable"):
        if result.fits:
            break
        if plan.actions[i] != KEEP:
            continue
        trial = MemoryPlan(plan.actions, method="capuchin-greedy")
        trial.actions[i] = RECOMPUTE
        r = evaluate(profile, trial, budget_bytes, host_link)
        if r.peak_bytes <= result.peak_bytes:
            plan, result = trial, r
    plan.meta["fits"] = result.fits
    return plan
