"""Capacity levels: at most ``levels`` distinct capacities per device, fewest rows added.

``MoEFeedForward`` runs experts of equal capacity as one batched matmul, so a "static" plan
with few distinct capacities per device runs few kernels. The planner raises each device's
slot capacities with :func:`quantize_levels` when ``PlannerConfig.capacity_levels`` is set
(:meth:`~ms_efficient.efficientmoe.planner.EfficientMoEPlanner.plans_for`); "grouped" plans
have no per-slot capacities and skip it.
"""
from __future__ import annotations

import numpy as np

__all__ = ["quantize_levels"]


def quantize_levels(capacity_E: np.ndarray, levels: int) -> np.ndarray:
    """Raise capacities to at most ``levels`` distinct values with the fewest added rows.

    Experts of equal capacity run as one batched matmul (``MoEFeedForward`` groups them), so
    few distinct values mean few kernels. Sorted descending, the values split into ``levels``
    contiguous groups, each raised to its largest member; dynamic programming over the split
    points gives the minimum total (O(E^2 * levels)). Only raises, so it never adds drops.

    capacity_E: int [E] >= 1. Returns int64 [E].
    """
    caps = np.asarray(capacity_E, dtype=np.int64)
    if levels < 1:
        raise ValueError(f"'levels' must be a positive integer, but got {levels}.")
    order = np.argsort(-caps, kind="stable")
    v = caps[order]                                            # descending
    n = len(v)
    levels = min(levels, len(np.unique(v)))
    # best[g][i]: fewest rows covering v[:i] with g groups; a group v[j:i] costs v[j] * (i - j)
    inf = np.iinfo(np.int64).max // 4
    best = np.full((levels + 1, n + 1), inf, dtype=np.int64)
    cut = np.zeros((levels + 1, n + 1), dtype=np.int64)
    best[0, 0] = 0
    for g in range(1, levels + 1):
        for i in range(1, n + 1):
            for j in range(g - 1, i):
                cost = best[g - 1, j] + v[j] * (i - j)
                if cost < best[g, i]:
                    best[g, i], cut[g, i] = cost, j
    out_sorted = np.empty(n, dtype=np.int64)
    i, g = n, levels
    while g > 0:
        j = cut[g, i]
        out_sorted[j:i] = v[j]
        i, g = j, g - 1
    out = np.empty(n, dtype=np.int64)
    out[order] = out_sorted
    return out
