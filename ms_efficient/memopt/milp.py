"""MILPs over the layer chain (PuLP/CBC): Checkmate-style recompute-only optimum and a
POET-style exact recompute+swap(+offload) yardstick. Written from the papers' descriptions
(Jain et al. 2020 "Checkmate"; Patil et al. 2022 "POET"), on MemOpt's layer model
(``ms_efficient.memopt.env``), so their plans are evaluated by the same simulator.

Stages: forward F_0..F_{L-1}, then backward B_{L-1}..B_0 (B_p = the re-runs backward p needs,
then backward p). With a = o + e (bytes a layer holds when kept) and S the static bytes:

    stored_j = x[j,K] * a_j + x[j,R] * o_j                 bytes layer j keeps after forward
    h_j      = x[j,S] * a_j + x[j,O] * o_j                 bytes layer j copies to the host
    H        = (in_flight - 1) * sum_j stored_j            the other micro-batches of a stage
    mem(F_i) = S + H + sum_{j<i} stored_j + x[i-1,RA] o_{i-1} + h_{i-1} + a_i
    mem(B_p) = S + H + sum_{j<p} stored_j + sum_{j<p} u[p,j] a_j + a_p + w_p + h_{p-1} + h_{p-2}
where u[p,j] = 1 iff layers j..p-1 are all RECOMPUTE_ALL (the Chen segment re-run for B_p).
Swap (S) and recompute-offload (O) follow the timing (swap_delay 0, prefetch_lead 1): the
page-out of layer j runs during F_{j+1} (allowed only if it fits there: h_j / bw + latency <=
f_{j+1}, so it never delays the forward pass and the bytes are gone when F_{j+1} ends); the
prefetch runs during backward j+2 and stalls the step by max(0, transfer - b_{j+2}). These
restrictions make the model exact for the simulator as long as prefetches do not queue on the
copy stream; POET's full time-indexed model is wider (see the report).
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import numpy as np

from ms_efficient.core.units import format_size
from ms_efficient.memopt.env import (KEEP, OFFLOAD, RECOMPUTE, RECOMPUTE_ALL, SWAP, MemoryPlan,
                                     check_budget)
from ms_efficient.memopt.profile import LayerProfile

__all__ = ["checkmate_milp", "checkmate_min_peak", "exact_milp", "solve_chain_milp"]

logger = logging.getLogger(__name__)


def _pulp():
    try:
        import pulp
    except ImportError:  # pragma: no cover - pulp is a declared dependency
        raise ImportError("the MILP baselines need PuLP: pip install 'pulp>=2.7'") from None
    return pulp


def solve_chain_milp(profile: LayerProfile, budget_bytes: Optional[float], host_link,
                     allow_swap: bool, time_limit_s: float = 30.0, window: Optional[int] = None,
                     allow_drop: bool = True, allow_offload: bool = False) -> MemoryPlan:
    """Fastest plan (least re-run + stall seconds) whose modelled peak <= budget_bytes; with
    ``budget_bytes=None`` the plan of least modelled peak instead (ties: less re-run time).

    window: longest RECOMPUTE_ALL run allowed (default: all layers; caps the u variables).
    allow_drop: False forbids RECOMPUTE_ALL (targets where a recomputed Cell keeps its output).
    allow_swap / allow_offload: SWAP / OFFLOAD (recompute-offload) may be chosen.
    Returns a MemoryPlan (meta: objective_s, status, solve_time_s; peak_bytes when minimising
    the peak). Raises ValueError when the budget is below the unavoidable minimum or the model
    is infeasible (states the budget).
    """
    pulp = _pulp()
    min_peak = budget_bytes is None
    if not min_peak:
        check_budget(profile, budget_bytes)
    L = profile.num_layers
    W = L if window is None else max(1, min(window, L))
    f, b = profile.forward_time_s, profile.backward_time_s
    o, e, w = profile.output_bytes, profile.interior_bytes, profile.workspace_bytes
    a = o + e
    # bytes in units of the budget (or of the unoptimised peak): a well-scaled model
    scale = float(max(profile.static_bytes + a.sum() + w.max() if min_peak else budget_bytes, 1.0))
    t_scale = float(max(f.sum() + b.sum(), 1e-12))
    acts = ([KEEP, RECOMPUTE] + ([RECOMPUTE_ALL] if allow_drop else [])
            + ([SWAP] if allow_swap else []) + ([OFFLOAD] if allow_offload else []))
    host = [k for k in (SWAP, OFFLOAD) if k in acts]
    moved = {SWAP: a, OFFLOAD: o}                 # bytes each host action copies
    t_copy = {k: host_link.latency_s + moved[k] / host_link.bandwidth_Bps for k in host}
    prob = pulp.LpProblem("memopt_chain", pulp.LpMinimize)
    # x[i][a]: 1 if layer i takes action a
    x = [{k: pulp.LpVariable(f"x_{i}_{k}", cat="Binary") for k in acts} for i in range(L)]
    # u[p][j]: 1 if layers j..p-1 are all RECOMPUTE_ALL (re-run together before backward p)
    u = {(p, j): pulp.LpVariable(f"u_{p}_{j}", lowBound=0) for p in range(1, L)
         for j in range(max(0, p - W), p)} if allow_drop else {}
    # sigma[j]: seconds the prefetch of layer j stalls the backward pass
    sigma = {j: pulp.LpVariable(f"sigma_{j}", lowBound=0) for j in range(L)} if host else {}

    def X(i, k):
        return x[i][k] if 0 <= i < L and k in x[i] else 0

    # [Objective] re-run forward seconds plus prefetch stalls; or the peak (activation bytes
    # over scale), with those seconds at weight 1e-6 as a tie-break
    seconds = (pulp.lpSum((X(i, RECOMPUTE) + X(i, RECOMPUTE_ALL) + X(i, OFFLOAD))
                          * (f[i] / t_scale) for i in range(L))
               + pulp.lpSum(s * (1.0 / t_scale) for s in sigma.values()))
    # peak: activation bytes at the step's peak over scale (minimised when there is no budget)
    peak = pulp.LpVariable("peak", lowBound=0) if min_peak else None
    prob += peak + 1e-6 * seconds if min_peak else seconds
    for i in range(L):
        # [Constraint] one action per layer
        prob += pulp.lpSum(x[i].values()) == 1
    # [Constraint] the last layer's output is read at once: no drop-output, no copy to host
    for k in ([RECOMPUTE_ALL] if allow_drop else []) + host:
        prob += x[L - 1][k] == 0
    for j in range(L - 1):
        for k in host:
            # [Constraint] the page-out of j hides behind forward j+1, else no swap / offload
            if t_copy[k][j] > f[j + 1]:
                prob += x[j][k] == 0
        if host:
            # [Constraint] a copied output is not the checkpoint of a drop-output run
            prob += pulp.lpSum(x[j][k] for k in host) + X(j + 1, RECOMPUTE_ALL) <= 1
            # [Constraint] the prefetch overlaps backward j+2; the rest stalls the step
            overlap = b[j + 2] if j + 2 < L else 0.0
            prob += sigma[j] >= pulp.lpSum(x[j][k] * (t_copy[k][j] - overlap) for k in host)
    for p in (range(1, L) if allow_drop else ()):
        # [Constraint] u[p,j] >= product of RECOMPUTE_ALL over j..p-1 (tight at the optimum)
        prob += u[p, p - 1] >= X(p - 1, RECOMPUTE_ALL)
        for j in range(max(0, p - W), p - 1):
            prob += u[p, j] >= u[p, j + 1] + X(j, RECOMPUTE_ALL) - 1
    if allow_drop and W < L:
        for j in range(L - W):
            # [Constraint] no drop-output run longer than the window
            prob += pulp.lpSum(X(m, RECOMPUTE_ALL) for m in range(j, j + W + 1)) <= W
    stored = [X(j, KEEP) * (a[j] / scale) + X(j, RECOMPUTE) * (o[j] / scale) for j in range(L)]
    copied = [pulp.lpSum(x[j][k] * (moved[k][j] / scale) for k in host) for j in range(L)]
    cap = peak if min_peak else (budget_bytes - profile.static_bytes) / scale
    # the other in-flight micro-batches of a pipeline stage hold what each layer stores
    prefix = (profile.in_flight - 1) * pulp.lpSum(stored)
    for i in range(L):
        # [Constraint] memory during forward i stays within the budget
        prob += (prefix + X(i - 1, RECOMPUTE_ALL) * (o[i - 1] / scale if i else 0)
                 + (copied[i - 1] if i else 0) + a[i] / scale <= cap)
        # [Constraint] memory during backward i (re-run segment, prefetches) within the budget
        prob += (prefix + pulp.lpSum(u[i, j] * (a[j] / scale) for j in range(max(0, i - W), i)
                                     if (i, j) in u)
                 + (a[i] + w[i]) / scale
                 + (copied[i - 1] if i >= 1 else 0) + (copied[i - 2] if i >= 2 else 0) <= cap)
        prefix = prefix + stored[i]
    start = time.perf_counter()
    status = prob.solve(pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s))
    elapsed = time.perf_counter() - start
    name = pulp.LpStatus[status]
    values = np.array([[pulp.value(x[i][k]) or 0.0 for k in acts] for i in range(L)])
    if name != "Optimal" and not np.allclose(values.sum(axis=1), 1.0, atol=1e-3):
        raise ValueError(f"budget {format_size(budget_bytes or 0)}: the "
                         f"{'recompute+swap' if host else 'recompute-only'} MILP found no "
                         f"plan ({name}); raise the budget or lower the batch size.")
    actions = np.array([acts[int(np.argmax(row))] for row in values])
    logger.debug("chain MILP (%d layers, actions %s): %s in %.2f s", L, acts, name, elapsed)
    meta = {"status": name, "solve_time_s": elapsed,
            "objective_s": float(pulp.value(seconds) or 0.0) * t_scale}
    if min_peak:
        meta["peak_bytes"] = profile.static_bytes + float(pulp.value(peak)) * scale
    return MemoryPlan(actions, method="exact-milp" if host else "checkmate-milp", meta=meta)


def checkmate_milp(profile: LayerProfile, budget_bytes: float, host_link,
                   time_limit_s: float = 30.0, window: Optional[int] = 32,
                   allow_drop: bool = True) -> MemoryPlan:
    """Optimal recompute-only plan (keep / recompute / recompute-all), Checkmate-style
    (``allow_drop=False``: keep / recompute only)."""
    return solve_chain_milp(profile, budget_bytes, host_link, allow_swap=False,
                            time_limit_s=time_limit_s, window=window, allow_drop=allow_drop)


def checkmate_min_peak(profile: LayerProfile, host_link, time_limit_s: float = 30.0,
                       window: Optional[int] = 32, allow_drop: bool = True) -> MemoryPlan:
    """The recompute-only plan of least modelled peak (meta["peak_bytes"]). Every byte term
    but the static bytes scales with the batch (``LayerProfile.at_batch``), so this plan is
    the least-peak one at every batch: the largest batch any recompute-only plan fits in is
    the largest at which this one fits."""
    return solve_chain_milp(profile, None, host_link, allow_swap=False,
                            time_limit_s=time_limit_s, window=window, allow_drop=allow_drop)


def exact_milp(profile: LayerProfile, budget_bytes: float, host_link,
               time_limit_s: float = 30.0, allow_offload: bool = True) -> MemoryPlan:
    """Exact recompute+swap(+recompute-offload) optimum of the chain model (small graphs; a
    yardstick)."""
    return solve_chain_milp(profile, budget_bytes, host_link, allow_swap=True,
                            time_limit_s=time_limit_s, window=None, allow_offload=allow_offload)
