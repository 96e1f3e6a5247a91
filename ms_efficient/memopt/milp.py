"""MILPs over the layer chain (PuLP/CBC): Checkmate-style recompute-only optimum and a
POET-style exact recompute+swap yardstick. Written from the papers' descriptions
(Jain et al. 2020 "Checkmate"; Patil et al. 2022 "POET"), on MemOpt's layer model
(``ms_efficient.memopt.env``), so their plans are evaluated by the same simulator.

Stages: forward F_0..F_{L-1}, then backward B_{L-1}..B_0 (B_p = the re-runs backward p needs,
then backward p). With a = o + e (bytes a layer holds when kept) and S the static bytes:

    stored_j = x[j,K] * a_j + x[j,R] * o_j                 bytes layer j keeps after forward
    mem(F_i) = S + sum_{j<i} stored_j + x[i-1,RA] o_{i-1} + x[i-1,S] a_{i-1} + a_i
    mem(B_p) = S + sum_{j<p} stored_j + sum_{j<p} u[p,j] a_j + a_p + w_p
               + x[p-1,S] a_{p-1} + x[p-2,S] a_{p-2}
where u[p,j] = 1 iff layers j..p-1 are all RECOMPUTE_ALL (the Chen segment re-run for B_p).
Swap follows the timing (swap_delay 0, prefetch_lead 1): the page-out of layer j runs during
F_{j+1} (allowed only if it fits there: a_j / bw + latency <= f_{j+1}, so it never delays the
forward pass and the bytes are gone when F_{j+1} ends); the prefetch runs during backward
j+2 and stalls the step by max(0, transfer - b_{j+2}). These restrictions make the model
exact for the simulator; POET's full time-indexed model is wider (see the report).
"""
from __future__ import annotations

import logging
import time
from typing import Dict, Optional

import numpy as np

from ms_efficient.memopt.env import (KEEP, RECOMPUTE, RECOMPUTE_ALL, SWAP, MemoryPlan,
                                     check_budget)
from ms_efficient.memopt.profile import LayerProfile, format_size

__all__ = ["checkmate_milp", "exact_milp", "solve_chain_milp"]

logger = logging.getLogger(__name__)


def _pulp():
    try:
        import pulp
    except ImportError:  # pragma: no cover - pulp is a declared dependency
        raise ImportError("the MILP baselines need PuLP: pip install 'pulp>=2.7'") from None
    return pulp


def solve_chain_milp(profile: LayerProfile, budget_bytes: float, host_link, allow_swap: bool,
                     time_limit_s: float = 30.0, window: Optional[int] = None) -> MemoryPlan:
    """Fastest plan (least re-run + stall seconds) whose modelled peak <= budget_bytes.

    window: longest RECOMPUTE_ALL run allowed (default: all layers; caps the u variables).
    Returns a MemoryPlan (meta: objective_s, status, solve_time_s). Raises ValueError when the
    budget is below the unavoidable minimum or the model is infeasible (states the budget).
    """
    pulp = _pulp()
    check_budget(profile, budget_bytes)
    L = profile.num_layers
    W = L if window is None else max(1, min(window, L))
    f, b = profile.forward_time_s, profile.backward_time_s
    o, e, w = profile.output_bytes, profile.interior_bytes, profile.workspace_bytes
    a = o + e
    scale = float(max(budget_bytes, 1.0))    # bytes in units of the budget: a well-scaled model
    t_scale = float(max(f.sum() + b.sum(), 1e-12))
    t_out = host_link.latency_s + a / host_link.bandwidth_Bps
    acts = [KEEP, RECOMPUTE, RECOMPUTE_ALL] + ([SWAP] if allow_swap else [])
    prob = pulp.LpProblem("memopt_chain", pulp.LpMinimize)
    # x[i][a]: 1 if layer i takes action a
    x = [{k: pulp.LpVariable(f"x_{i}_{k}", cat="Binary") for k in acts} for i in range(L)]
    # u[p][j]: 1 if layers j..p-1 are all RECOMPUTE_ALL (re-run together before backward p)
    u = {(p, j): pulp.LpVariable(f"u_{p}_{j}", lowBound=0) for p in range(1, L)
         for j in range(max(0, p - W), p)}
    # sigma[j]: seconds the prefetch of layer j stalls the backward pass
    sigma = {j: pulp.LpVariable(f"sigma_{j}", lowBound=0) for j in range(L)} if allow_swap else {}

    def X(i, k):
        return x[i][k] if 0 <= i < L and k in x[i] else 0

    # [Objective] re-run forward seconds plus prefetch stalls
    prob += (pulp.lpSum((X(i, RECOMPUTE) + X(i, RECOMPUTE_ALL)) * (f[i] / t_scale) for i in range(L))
             + pulp.lpSum(s * (1.0 / t_scale) for s in sigma.values()))
    for i in range(L):
        # [Constraint] one action per layer
        prob += pulp.lpSum(x[i].values()) == 1
    # [Constraint] the last layer's output is read at once: no drop-output, no swap
    prob += X(L - 1, RECOMPUTE_ALL) == 0
    if allow_swap:
        prob += X(L - 1, SWAP) == 0
        for j in range(L - 1):
            # [Constraint] the page-out of j hides behind forward j+1, else no swap
            if t_out[j] > f[j + 1]:
                prob += X(j, SWAP) == 0
            # [Constraint] a swapped output is not the checkpoint of a drop-output run
            prob += X(j, SWAP) + X(j + 1, RECOMPUTE_ALL) <= 1
            # [Constraint] the prefetch overlaps backward j+2; the rest stalls the step
            overlap = b[j + 2] if j + 2 < L else 0.0
            prob += sigma[j] >= X(j, SWAP) * (t_out[j] - overlap)
    for p in range(1, L):
        # [Constraint] u[p,j] >= product of RECOMPUTE_ALL over j..p-1 (tight at the optimum)
        prob += u[p, p - 1] >= X(p - 1, RECOMPUTE_ALL)
        for j in range(max(0, p - W), p - 1):
            prob += u[p, j] >= u[p, j + 1] + X(j, RECOMPUTE_ALL) - 1
    if W < L:
        for j in range(L - W):
            # [Constraint] no drop-output run longer than the window
            prob += pulp.lpSum(X(m, RECOMPUTE_ALL) for m in range(j, j + W + 1)) <= W
    stored = [X(j, KEEP) * (a[j] / scale) + X(j, RECOMPUTE) * (o[j] / scale) for j in range(L)]
    cap = (budget_bytes - profile.static_bytes) / scale
    prefix = pulp.LpAffineExpression()
    for i in range(L):
        # [Constraint] memory during forward i stays within the budget
        prob += (prefix + X(i - 1, RECOMPUTE_ALL) * (o[i - 1] / scale if i else 0)
                 + X(i - 1, SWAP) * (a[i - 1] / scale if i else 0) + a[i] / scale <= cap)
        # [Constraint] memory during backward i (re-run segment, prefetches) within the budget
        prob += (prefix + pulp.lpSum(u[i, j] * (a[j] / scale) for j in range(max(0, i - W), i))
                 + (a[i] + w[i]) / scale
                 + X(i - 1, SWAP) * (a[i - 1] / scale if i >= 1 else 0)
                 + X(i - 2, SWAP) * (a[i - 2] / scale if i >= 2 else 0) <= cap)
        prefix = prefix + stored[i]
    start = time.perf_counter()
    status = prob.solve(pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s))
    elapsed = time.perf_counter() - start
    name = pulp.LpStatus[status]
    values = np.array([[pulp.value(x[i][k]) or 0.0 for k in acts] for i in range(L)])
    if name != "Optimal" and not np.allclose(values.sum(axis=1), 1.0, atol=1e-3):
        raise ValueError(f"budget {format_size(budget_bytes)}: the "
                         f"{'recompute+swap' if allow_swap else 'recompute-only'} MILP found no "
                         f"plan ({name}); raise the budget or lower the batch size.")
    actions = np.array([acts[int(np.argmax(row))] for row in values])
    logger.debug("chain MILP (%d layers, swap=%s): %s in %.2f s", L, allow_swap, name, elapsed)
    return MemoryPlan(actions, method="exact-milp" if allow_swap else "checkmate-milp",
                      meta={"status": name, "solve_time_s": elapsed,
                            "objective_s": float(pulp.value(prob.objective) or 0.0) * t_scale})


def checkmate_milp(profile: LayerProfile, budget_bytes: float, host_link,
                   time_limit_s: float = 30.0, window: Optional[int] = 32) -> MemoryPlan:
    """Optimal recompute-only plan (keep / recompute / recompute-all), Checkmate-style."""
    return solve_chain_milp(profile, budget_bytes, host_link, allow_swap=False,
                            time_limit_s=time_limit_s, window=window)


def exact_milp(profile: LayerProfile, budget_bytes: float, host_link,
               time_limit_s: float = 30.0) -> MemoryPlan:
    """Exact recompute+swap optimum of the chain model (small graphs; a yardstick)."""
    return solve_chain_milp(profile, budget_bytes, host_link, allow_swap=True,
                            time_limit_s=time_limit_s, window=None)
