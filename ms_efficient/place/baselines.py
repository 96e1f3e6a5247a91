"""Baseline placers: contiguous and round-robin splits, and Baechi's m-TOPO, m-ETF, m-SCT.

Baechi (Jeon et al., "Baechi: Fast Device Placement of Machine Learning Graphs", SoCC 2020)
places a graph under per-device memory limits with three memory-constrained algorithms,
written here from the paper's description, on the same units as TGA:

- m-TOPO: walk the topological order, filling device 0 up to an equal share of the total
  compute (or until its memory is full), then device 1, and so on.
- m-ETF (Earliest Task First): list scheduling; repeatedly place the (ready unit, device)
  pair with the earliest possible start, counting a transfer for every input coming from
  another device; a device whose memory cannot hold the unit is skipped.
- m-SCT (Small Communication Times): solve the LP relaxation of Hanen & Munier's
  favourite-child formulation, where x_e = 0 means edge e is not cut::

      minimise w
      s_v >= s_u + p_u + c_e x_e            for every edge e = (u, v)
      sum_{e out of u} x_e >= outdeg(u) - 1   # at most one uncut child per unit
      sum_{e into v} x_e >= indeg(v) - 1      # at most one uncut parent per unit
      w >= s_u + p_u,  0 <= x_e <= 1,  s_u >= 0

  an edge with x_e < 0.5 names v the favourite child of u; then ETF with the rule that a
  favourite child goes to its parent's device whenever that device has memory for it.

Baechi schedules a single batch: a unit costs p = fwd_s + bwd_s and a cut edge
c = 2 x (alpha + bytes * beta) (activation forward, gradient back). Every result goes through
the same ``repair`` as TGA's children, then the shared cost model judges it. m-ETF and
m-SCT also fix the order in which each device runs its units (the list schedule); the
``*_plan`` functions return it so the cost model can run their plans in their own order
(``simulate_placement(..., order=...)``) rather than in the topological index order.
"""
from __future__ import annotations

import logging
from typing import Dict, List, Optional, Tuple

import numpy as np

from ms_efficient.place.operators import repair
from ms_efficient.place.problem import PlacementProblem

__all__ = ["contiguous", "round_robin", "m_topo", "m_etf", "m_sct", "m_etf_plan", "m_sct_plan",
           "sct_favourite_children"]

logger = logging.getLogger(__name__)


def round_robin(problem: PlacementProblem) -> np.ndarray:
    """[U] unit u on device u mod D (then repaired)."""
    return repair(problem, np.arange(problem.num_units) % problem.num_devices)


def contiguous(problem: PlacementProblem, stages: Optional[int] = None) -> np.ndarray:
    """[U] split of the topological order into at most ``stages`` (default D) runs
    minimising the largest run's compute (fwd + bwd seconds) under device memory: binary
    search on the bound T, greedy fill for each T (exact for this min-max linear
    partition)."""
    p = problem.fwd_s + problem.bwd_s
    mem, cap = problem.static_bytes, problem.capacity_bytes[0]
    d_count = min(stages or problem.num_devices, problem.num_devices)

    def split(bound: float) -> Optional[np.ndarray]:
        out = np.zeros(problem.num_units, dtype=np.int64)
        stage, t, m = 0, 0.0, 0.0
        for u in range(problem.num_units):
            if t + p[u] > bound or m + mem[u] > cap:
                stage, t, m = stage + 1, 0.0, 0.0
                if stage >= d_count:
                    return None
            out[u], t, m = stage, t + p[u], m + mem[u]
        return out

    lo, hi = float(p.max()), float(p.sum()) * (1 + 1e-9)
    best = split(hi) if split(hi) is not None else split(np.inf)
    for _ in range(60):
        mid = (lo + hi) / 2
        found = split(mid)
        if found is None:
            lo = mid
        else:
            hi, best = mid, found
    if best is None:  # memory forces more runs than devices: let repair place the rest
        best = np.minimum(np.arange(problem.num_units) * d_count // problem.num_units, d_count - 1)
    return repair(problem, best)


def m_topo(problem: PlacementProblem) -> np.ndarray:
    """[U] Baechi m-TOPO: topological order, equal compute share per device, memory-capped."""
    p = problem.fwd_s + problem.bwd_s
    share = p.sum() / problem.num_devices
    out = np.zeros(problem.num_units, dtype=np.int64)
    d, load, used = 0, 0.0, np.zeros(problem.num_devices)
    for u in range(problem.num_units):
        while d < problem.num_devices - 1 and (
                load + p[u] > share * (1 + 1e-9) and load > 0
                or used[d] + problem.static_bytes[u] > problem.capacity_bytes[d]):
            d, load = d + 1, 0.0
        out[u] = d
        load += p[u]
        used[d] += problem.static_bytes[u]
    return repair(problem, out)


def _comm_s(problem: PlacementProblem) -> np.ndarray:
    """[E, D, D] seconds of a cut edge between each device pair (both directions)."""
    return 2 * (problem.latency_s[None] + problem.edge_bytes[:, None, None]
                * problem.inv_bw_s_per_B[None])


def _list_schedule(problem: PlacementProblem, favourite_parent: Optional[np.ndarray],
                   fixed: Optional[np.ndarray] = None) -> Tuple[np.ndarray, np.ndarray]:
    """ETF list scheduling under memory; with ``favourite_parent`` [U] (-1: none) it is SCT;
    with ``fixed`` [U] devices it only orders: every unit goes to its fixed device.
    Returns ([U] device per unit, [U] units in the order they were scheduled)."""
    p = problem.fwd_s + problem.bwd_s
    comm = _comm_s(problem)
    u_count, d_count = problem.num_units, problem.num_devices
    preds: List[List[int]] = [[] for _ in range(u_count)]  # (edge ids into u)
    for k in range(len(problem.in_edges)):
        e = int(problem.in_edges[k])
        preds[int(problem.edge_dst[e])].append(e)
    waiting = np.diff(problem.in_indptr).copy()
    ready = [u for u in range(u_count) if waiting[u] == 0]
    dev = np.full(u_count, -1, dtype=np.int64)
    order: List[int] = []
    finish = np.zeros(u_count)
    avail = np.zeros(d_count)
    used = np.zeros(d_count)
    cap = problem.capacity_bytes
    while ready:
        best = (np.inf, -1, -1)
        for u in ready:
            start = avail.copy()
            for e in preds[u]:
                w = int(problem.edge_src[e])
                start = np.maximum(start, finish[w] + comm[e, dev[w], :])
            fits = used + problem.static_bytes[u] <= cap
            if not fits.any():
                fits = used == used.min()  # nothing fits: least-used device, repair later
            allowed = fits.copy()
            if fixed is not None:
                allowed[:] = False
                allowed[fixed[u]] = True
            elif favourite_parent is not None and favourite_parent[u] >= 0:
                home = dev[favourite_parent[u]]
                if fits[home]:
                    allowed[:] = False
                    allowed[home] = True
            start = np.where(allowed, start, np.inf)
            d = int(np.argmin(start))
            if start[d] < best[0]:
                best = (float(start[d]), u, d)
        t, u, d = best
        dev[u], finish[u] = d, t + p[u]
        order.append(u)
        avail[d] = finish[u]
        used[d] += problem.static_bytes[u]
        ready.remove(u)
        for e in range(problem.out_indptr[u], problem.out_indptr[u + 1]):
            v = int(problem.edge_dst[e])
            waiting[v] -= 1
            if waiting[v] == 0:
                ready.append(v)
    return dev, np.array(order, dtype=np.int64)


def list_order(problem: PlacementProblem, assign: np.ndarray) -> np.ndarray:
    """[U] program order for the fixed placement ``assign``: ETF list scheduling (the ready
    unit that can start first on its device goes next), a topological order."""
    return _list_schedule(problem, None, fixed=np.asarray(assign, dtype=np.int64))[1]


def m_etf_plan(problem: PlacementProblem) -> Tuple[np.ndarray, np.ndarray]:
    """([U] Baechi m-ETF placement, [U] its list-schedule order of the units)."""
    dev, order = _list_schedule(problem, None)
    return repair(problem, dev), order


def m_etf(problem: PlacementProblem) -> np.ndarray:
    """[U] Baechi m-ETF placement (see module docstring)."""
    return m_etf_plan(problem)[0]


def sct_favourite_children(problem: PlacementProblem) -> np.ndarray:
    """[U] favourite parent of each unit (-1: none) from the SCT LP relaxation (HiGHS)."""
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    u_count, e_count = problem.num_units, len(problem.edge_src)
    if e_count == 0:
        return np.full(u_count, -1, dtype=np.int64)
    p = problem.fwd_s + problem.bwd_s
    # c_e: cut cost over the slowest link (the LP does not know devices yet)
    c = 2 * (problem.latency_s.max() + problem.edge_bytes * problem.inv_bw_s_per_B.max())
    # variables: s_u (U) | x_e (E) | w (1)
    xs, ws = u_count, u_count + e_count
    rows: List[int] = []
    cols: List[int] = []
    vals: List[float] = []
    rhs: List[float] = []
    r = 0
    # [Constraint] precedence with communication: s_u - s_v + c_e x_e <= -p_u
    for e in range(e_count):
        u, v = int(problem.edge_src[e]), int(problem.edge_dst[e])
        rows += [r, r, r]
        cols += [u, v, xs + e]
        vals += [1.0, -1.0, float(c[e])]
        rhs.append(-float(p[u]))
        r += 1
    # [Constraint] at most one uncut child / parent: -sum x_e <= -(deg - 1)
    for ptr, order in ((problem.out_indptr, np.arange(e_count)),
                       (problem.in_indptr, problem.in_edges)):
        for u in range(u_count):
            edges = order[ptr[u]:ptr[u + 1]]
            if len(edges) > 1:
                rows += [r] * len(edges)
                cols += (xs + edges).tolist()
                vals += [-1.0] * len(edges)
                rhs.append(-(len(edges) - 1.0))
                r += 1
    # [Constraint] makespan: s_u - w <= -p_u
    for u in range(u_count):
        rows += [r, r]
        cols += [u, ws]
        vals += [1.0, -1.0]
        rhs.append(-float(p[u]))
        r += 1
    a_ub = coo_matrix((vals, (rows, cols)), shape=(r, ws + 1)).tocsr()
    cost = np.zeros(ws + 1)
    cost[ws] = 1.0
    bounds = [(0, None)] * u_count + [(0, 1)] * e_count + [(0, None)]
    res = linprog(cost, A_ub=a_ub, b_ub=np.array(rhs), bounds=bounds, method="highs")
    if res.status != 0:
        raise ValueError(f"m-SCT LP failed on {problem.name!r}: {res.message}")
    x = res.x[xs:ws]
    fav_parent = np.full(u_count, -1, dtype=np.int64)
    best_x: Dict[int, float] = {}
    for e in np.argsort(x, kind="stable"):
        u, v = int(problem.edge_src[e]), int(problem.edge_dst[e])
        if x[e] < 0.5 and u not in best_x and fav_parent[v] < 0:
            best_x[u] = float(x[e])
            fav_parent[v] = u
    return fav_parent


def m_sct_plan(problem: PlacementProblem) -> Tuple[np.ndarray, np.ndarray]:
    """([U] Baechi m-SCT placement, [U] its list-schedule order of the units)."""
    dev, order = _list_schedule(problem, sct_favourite_children(problem))
    return repair(problem, dev), order


def m_sct(problem: PlacementProblem) -> np.ndarray:
    """[U] Baechi m-SCT placement (see module docstring)."""
    return m_sct_plan(problem)[0]
