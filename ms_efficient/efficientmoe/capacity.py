"""Capacity model: the static capacity (rows per step) of every expert slot, before compilation.

A slot's capacity is a bet on its coming loads: too small drops tokens, too large computes zero
padding. We size it from the predicted per-slot load and the recent relative forecast errors of
the load predictor (``rel_err_KE`` [K, E], from
:func:`ms_efficient.efficientmoe.predictor.relative_residuals`: (actual - pred) / max(pred, floor)).
K is small (a few recent steps), too few for a tail quantile per expert, so errors are
standardised: each expert gets an error scale sigma_e (its root mean square error, shrunk
toward the layer's), and the standardised errors z = rel_err / sigma of all experts are pooled
(K * E samples). A slot of expert e with predicted load p_s gets the share p_s / P_e of the
expert's error, in the units the errors were measured in (P_e = sum of e's slots):

    spread:    g_s = sigma_e(s) * p_s / P_e * max(P_e, floor)          (tokens per unit of z)
    samples:   load_ns = min(M, max(0, p_s + g_s z_n))                  (N = K * E futures)
    capacity:  cap_s = min(round_up(max(p_s, p_s + g_s z_(i)) * (1 + margin)), round_up(M))

floor = max(1, FLOOR_FRACTION * mean_e P_e), as in the residuals: an expert predicted near zero
keeps an error scale of a few percent of the mean expert load instead of a vanishing one (an
expert predicted at 2 tokens that may receive 500 must not get 2 * (1 + sigma z) rows).
M (``max_load``) is the most tokens a slot can ever receive: the tokens routed per step (an
expert appears at most once in a token's top-k), so no slot is given more rows than a dropless
graph would. z_(i) is the i-th smallest pooled error; i is the smallest index whose expected
drop rate over the samples meets ``drop_target``, found by bisection (the drop rate falls as
i grows; at the largest z nothing drops, so the target is always reachable).

One index for all slots is the optimum, not a simplification: minimising the total rows
sum_s cap_s subject to the expected overflow sum_s E[(load_s - cap_s)^+] <= budget has the
Lagrange condition P(load_s > cap_s) = lambda for every slot (d/dc E[(X - c)^+] = -P(X > c)),
i.e. one exceedance probability, which in standardised errors is one z quantile; rounding
each slot up to the hardware multiple only adds headroom. Capacities are rounded up to
``multiple`` tokens (16 by default: Ascend cube units work on 16x16 fp16 tiles) and are at
least one ``multiple``. The expected drop rate ignores re-routing of overflow to a sibling
replica, so it is an upper bound for replicated experts.

    expected drop rate   = sum_ns max(0, load_ns - cap_s) / sum_ns load_ns
    expected padding     = sum_ns max(0, cap_s - load_ns) / (N * sum_s cap_s)

The planners evaluate these sums in closed form over the sorted z (O(S log N), see
:func:`_expected`); :func:`load_samples` and :func:`expected_drop_and_padding` give the same
numbers from explicit samples (a test checks they agree).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from ms_efficient.efficientmoe.predictor import FLOOR_FRACTION
from ms_efficient.moe.plan import ExpertPlan
from ms_efficient.moe.exchange import slot_rows_by_device
from ms_efficient.moe.split import SPLIT_UNITS, grouped_split, grouped_split_weights

__all__ = ["CapacityResult", "round_up", "error_scales", "load_samples",
           "expected_drop_and_padding", "slot_capacities",
           "expected_expert_drop_rate", "hindsight_capacities",
           "static_capacity_limit", "pair_loads", "device_loads", "send_blocks",
           "expected_pair_drop_rate", "quantize_levels"]

logger = logging.getLogger(__name__)

FALLBACK_MARGIN = 0.25  # relative headroom used when there are no residual samples yet
PRIOR_SAMPLES = 8.0     # weight of the layer-wide error scale in each expert's (in samples)


@dataclass(frozen=True)
class CapacityResult:
    """capacity_S: int64 [S] tokens per slot; quantile: the fraction of pooled errors at or
    below the one chosen (nan for uniform/exact); expected_drop_rate,
    expected_padding_fraction: over the load samples, in [0, 1]; uniform: the one capacity C
    of a single-capacity sizing (None otherwise)."""

    capacity_S: np.ndarray
    quantile: float
    expected_drop_rate: float
    expected_padding_fraction: float
    uniform: Optional[int] = None


def round_up(x, multiple: int) -> np.ndarray:
    """Round every entry of ``x`` up to a multiple of ``multiple`` (int64)."""
    if isinstance(multiple, bool) or not isinstance(multiple, (int, np.integer)) or multiple < 1:
        raise ValueError(f"'multiple' must be a positive integer, but got {multiple!r}.")
    arr = np.ceil(np.asarray(x, dtype=np.float64) / multiple - 1e-9)
    return (np.maximum(arr, 0) * multiple).astype(np.int64)


def error_scales(rel_err_KE: np.ndarray, prior_samples: float = PRIOR_SAMPLES,
                 load_E: Optional[np.ndarray] = None) -> Tuple[np.ndarray, np.ndarray]:
    """Per-expert error scale and pooled standardised errors: (sigma_E [E], z [K * E]).

    sigma_e^2 = (K * mean_k rel[k, e]^2 + prior_samples * m_e) / (K + prior_samples): each
    expert's own mean square shrunk toward a layer-wide model m_e, so a few samples per
    expert still give a stable scale; z = rel / sigma pooled over all experts, so the tail
    quantiles come from K * E samples instead of K.

    m_e: without ``load_E``, the pooled mean square. With ``load_E`` (float [E], the tokens
    each column's errors are relative to), m_e = a / load_e + b, a, b >= 0 fitted by least
    squares to the columns' mean squares: routing counts are multinomial, so the sampling
    part of a relative error has variance ~ 1 / load (a), and the drift of the popularity
    adds a part that does not depend on it (b). Pooling to one flat mean instead would give
    a 500-token column the relative noise of a 30-token one.
    """
    rel = np.asarray(rel_err_KE, dtype=np.float64)
    k = rel.shape[0]
    own = np.mean(rel ** 2, axis=0)
    if load_E is None:
        model = np.full(own.shape, float(own.mean()))
    else:
        x = 1.0 / np.maximum(np.asarray(load_E, dtype=np.float64), 1.0)
        (a, b), *_ = np.linalg.lstsq(np.stack([x, np.ones_like(x)], axis=1), own, rcond=None)
        if a < 0:
            a, b = 0.0, float(own.mean())
        elif b < 0:
            a, b = float(x @ own / max(x @ x, 1e-300)), 0.0
        model = a * x + b
    sigma = np.sqrt((k * own + prior_samples * model) / (k + prior_samples))
    sigma = np.maximum(sigma, 1e-6)
    return sigma, (rel / sigma).reshape(-1)


def _error_model(pred_S: np.ndarray, slot_expert: np.ndarray,
                 rel_err_KE: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(spread g of each slot, tokens per unit z [S]; pooled standardised errors z [N],
    ascending); module docstring. With K = 0: g = FALLBACK_MARGIN * scale, z = [1]."""
    rel = np.asarray(rel_err_KE, dtype=np.float64)
    if rel.ndim != 2:
        raise ValueError(f"'rel_err_KE' must be 2-D [sample, expert], but got shape {rel.shape}.")
    slot_expert = np.asarray(slot_expert)
    if slot_expert.size and slot_expert.max() >= rel.shape[1]:
        raise ValueError(f"'rel_err_KE' has {rel.shape[1]} expert columns, but a slot names "
                         f"expert {int(slot_expert.max())}.")
    total_E = np.bincount(slot_expert, weights=pred_S)
    present = np.bincount(slot_expert) > 0
    floor = max(1.0, FLOOR_FRACTION * float(total_E[present].mean()))
    replicas = np.bincount(slot_expert)[slot_expert]
    total = total_E[slot_expert]
    # the slot's share of max(P_e, floor): p_s / P_e of it, or an equal share when P_e = 0
    scale_S = np.where(total > 0, pred_S / np.where(total > 0, total, 1.0) *
                       np.maximum(total, floor), floor / replicas)
    if rel.shape[0] == 0:
        return FALLBACK_MARGIN * scale_S, np.ones(1)
    columns = np.zeros(rel.shape[1])
    columns[:total_E.size] = np.maximum(total_E, floor)
    sigma_E, z = error_scales(rel, load_E=columns)
    return sigma_E[slot_expert] * scale_S, np.sort(z)


def load_samples(pred_load_S: np.ndarray, slot_expert: np.ndarray, rel_err_KE: np.ndarray,
                 max_load: Optional[float] = None) -> np.ndarray:
    """Plausible per-slot loads, explicitly: float64 [N, S] = min(max_load, max(0, p_s +
    g_s z_n)) over the pooled standardised errors z (module docstring, N = K * E). With K = 0,
    one sample p + FALLBACK_MARGIN * scale. The planners use the same model in closed form."""
    pred = np.asarray(pred_load_S, dtype=np.float64)
    spread_S, z = _error_model(pred, slot_expert, rel_err_KE)
    samples = np.maximum(0.0, pred[None, :] + z[:, None] * spread_S[None, :])
    return samples if max_load is None else np.minimum(samples, max_load)


def expected_drop_and_padding(capacity_S: np.ndarray,
                              samples_KS: np.ndarray) -> Tuple[float, float]:
    """(drop rate, padding fraction) of capacities over explicit load samples [K, S]
    (formulas in the module docstring)."""
    cap = np.asarray(capacity_S, dtype=np.float64)[None, :]
    load = np.asarray(samples_KS, dtype=np.float64)
    total = load.sum()
    drop = float(np.maximum(0.0, load - cap).sum() / total) if total > 0 else 0.0
    rows = cap.sum() * load.shape[0]
    pad = float(np.maximum(0.0, cap - load).sum() / rows) if rows > 0 else 0.0
    return drop, pad


def _suffix(z: np.ndarray) -> np.ndarray:
    """Suffix sums of the sorted errors: [N + 1], suffix[i] = sum(z[i:])."""
    return np.concatenate([np.cumsum(z[::-1])[::-1], [0.0]])


def _expected(cap_S: np.ndarray, pred_S: np.ndarray, spread_S: np.ndarray, z: np.ndarray,
              max_load: Optional[float] = None,
              suffix: Optional[np.ndarray] = None) -> Tuple[float, float]:
    """:func:`expected_drop_and_padding` over the samples min(M, (p + g z)^+) in closed form,
    O(S log N). With z sorted and suffix sums, the mean excess over a threshold u,
    x(u) = mean_n max(0, p + g z_n - u), is ((p - u) count + g sum) / N over the z_n above
    (u - p) / g; clipping at M gives load = x(0) - x(M) and overflow = x(min(cap, M)) - x(M)."""
    n = z.size
    suffix = _suffix(z) if suffix is None else suffix
    pred = np.asarray(pred_S, dtype=np.float64)
    cap = np.asarray(cap_S, dtype=np.float64)
    top_S = np.full(pred.shape, np.inf) if max_load is None else np.broadcast_to(
        np.asarray(max_load, dtype=np.float64), pred.shape)
    live = spread_S > 0
    p, g, c, top = pred[live], spread_S[live], cap[live], top_S[live]

    def excess(u: np.ndarray) -> np.ndarray:                             # u: finite [S']
        i = np.searchsorted(z, (u - p) / g, side="right")
        count, total = n - i, suffix[i]
        return np.maximum(0.0, (p - u) * count + g * total) / n

    capped = np.isfinite(top)
    beyond = np.where(capped, excess(np.where(capped, top, 0.0)), 0.0)
    load = excess(np.zeros_like(p)) - beyond
    over = np.maximum(0.0, excess(np.minimum(c, top)) - beyond)
    # slots with no spread: one point load, pred itself (clipped)
    flat_load = np.minimum(pred[~live], top_S[~live])
    total_load = load.sum() + flat_load.sum()
    total_over = over.sum() + np.maximum(0.0, flat_load - cap[~live]).sum()
    rows = cap.sum()
    drop = float(total_over / total_load) if total_load > 0 else 0.0
    pad = float((rows - total_load + total_over) / rows) if rows > 0 else 0.0
    return drop, max(0.0, pad)


def _check(pred_load_S: np.ndarray, slot_expert: np.ndarray, drop_target: float) -> None:
    pred = np.asarray(pred_load_S)
    if pred.ndim != 1 or pred.shape != np.shape(slot_expert):
        raise ValueError(f"'pred_load_S' and 'slot_expert' must be 1-D of equal length, but got "
                         f"{pred.shape} and {np.shape(slot_expert)}.")
    if (pred < 0).any():
        raise ValueError("'pred_load_S' must be >= 0, but got a negative load.")
    if not 0 <= drop_target < 1:
        raise ValueError(f"'drop_target' must be in [0, 1), but got {drop_target!r}.")


def _capped(cap: np.ndarray, max_load: Optional[float], multiple: int) -> np.ndarray:
    """Capacities at least one multiple and at most round_up(max_load)."""
    cap = np.maximum(cap, multiple)
    if max_load is not None:
        cap = np.minimum(cap, max(int(round_up(max_load, multiple)), multiple))
    return cap


def slot_capacities(pred_load_S: np.ndarray, slot_expert: np.ndarray, rel_err_KE: np.ndarray,
                    drop_target: float = 0.005, multiple: int = 16, margin: float = 0.0,
                    max_load: Optional[float] = None) -> CapacityResult:
    """Per-slot capacities meeting ``drop_target`` with the fewest rows (module docstring).

    pred_load_S: float [S] predicted tokens of each slot per step.
    slot_expert: int [S] logical expert of each slot (selects its residual column).
    rel_err_KE: float [K, E] relative forecast errors (K may be 0, see :func:`load_samples`).
    drop_target: expected drop rate to stay at or below, in [0, 1).
    multiple: capacities are multiples of this many tokens, and at least one multiple.
    margin: extra relative headroom on top of the quantile, >= 0.
    max_load: most tokens a slot can receive per step (tokens routed per step), or None.
    """
    _check(pred_load_S, slot_expert, drop_target)
    pred = np.asarray(pred_load_S, dtype=np.float64)
    spread_S, z = _error_model(pred, slot_expert, rel_err_KE)
    suffix = _suffix(z)

    def at(i: int) -> CapacityResult:
        want = pred + spread_S * max(float(z[i]), 0.0)                     # [S]
        cap = _capped(round_up(want * (1 + margin), multiple), max_load, multiple)
        drop, pad = _expected(cap, pred, spread_S, z, max_load, suffix)
        return CapacityResult(cap, (i + 1) / z.size, drop, pad)

    # smallest i with drop(i) <= target; below the first z >= 0 the capacity is the prediction
    lo, hi = int(np.searchsorted(z, 0.0)), z.size - 1
    lo = min(lo, hi)
    first = at(lo)
    if first.expected_drop_rate <= drop_target:
        return first
    while hi - lo > 1:                          # invariant: drop(lo) > target >= drop(hi)
        mid = (lo + hi) // 2
        if at(mid).expected_drop_rate <= drop_target:
            hi = mid
        else:
            lo = mid
    return at(hi)


def expected_expert_drop_rate(capacity_E: np.ndarray, pred_load_E: np.ndarray,
                              rel_err_KE: np.ndarray, max_load=None) -> float:
    """Expected drop rate of a plan whose experts have total capacities ``capacity_E`` (int [E],
    summed over replicas: overflow moves between replicas) when the coming loads follow the
    error model of :func:`load_samples` around ``pred_load_E``, in [0, 1]. ``max_load``: the
    most tokens an entry can receive, a number or float [E] (None: unbounded)."""
    pred = np.asarray(pred_load_E, dtype=np.float64)
    spread_E, z = _error_model(pred, np.arange(pred.size), rel_err_KE)
    return _expected(np.asarray(capacity_E, dtype=np.float64), pred, spread_E, z, max_load)[0]


def hindsight_capacities(loads_TE: np.ndarray, drop_target: float) -> CapacityResult:
    """The static capacities with the fewest rows whose drop rate over the steps ``loads_TE``
    (float [T, E] tokens per expert and step, known in advance) is at most ``drop_target``:
    the best any planner could give these T steps, so a yardstick, not a planner.

    Per expert the dropped tokens d_e(c) = sum_t (l_te - c)^+ are convex and piecewise
    linear in c, with slope -#{t: l_te > c}. Minimising sum_e c_e subject to
    sum_e d_e(c_e) <= drop_target * sum l is a separable convex problem, so lowering the
    capacities from each expert's largest load in order of increasing slope (segment by
    segment between sorted loads, the last one partly) is exact; capacities are then rounded
    up to whole rows (no multiple: the bound stays a bound).
    """
    loads = np.asarray(loads_TE, dtype=np.float64)
    if loads.ndim != 2 or loads.shape[0] < 1 or (loads < 0).any():
        raise ValueError(f"'loads_TE' must be a [steps, experts] array of loads >= 0, but got "
                         f"shape {loads.shape}.")
    if not 0 <= drop_target < 1:
        raise ValueError(f"'drop_target' must be in [0, 1), but got {drop_target}.")
    steps = loads.shape[0]
    desc = -np.sort(-loads, axis=0)                       # [T, E], largest first
    # segment k of expert e: lowering c from desc[k-1] to desc[k] drops k tokens per row
    lengths = np.vstack([desc[:-1] - desc[1:], desc[-1:]])     # [T, E]; last: down to 0
    slopes = np.repeat(np.arange(1, steps + 1)[:, None], loads.shape[1], axis=1)
    cap = desc[0].copy()
    budget = drop_target * loads.sum()
    order = np.argsort(slopes.ravel(), kind="stable")
    for idx in order:
        k, e = divmod(int(idx), loads.shape[1])
        length, slope = lengths[k, e], k + 1
        if length <= 0:
            continue
        if slope * length <= budget:
            cap[e] -= length
            budget -= slope * length
        else:
            cap[e] -= budget / slope
            break
    cap = np.ceil(cap - 1e-9).astype(np.int64)
    drop, pad = expected_drop_and_padding(cap, loads)
    return CapacityResult(cap, math.nan, drop, pad)


def static_capacity_limit(loads_TLE: np.ndarray, drop_target: float,
                          window: int) -> Tuple[float, float]:
    """(padding fraction, drop rate) of :func:`hindsight_capacities` chosen afresh for every
    layer and every ``window`` consecutive steps of ``loads_TLE`` (float [T, L, E]): the least
    padding any static-capacity plan re-planned every ``window`` steps can have at that drop
    rate. Expert-level capacities pool an expert's replicas and source ranks, which only
    lowers drops, so the figure bounds per-rank, per-replica plans too."""
    loads = np.asarray(loads_TLE, dtype=np.float64)
    if loads.ndim != 3 or window < 1:
        raise ValueError(f"'loads_TLE' must be [steps, layers, experts] and 'window' >= 1, but "
                         f"got shape {loads.shape} and window {window}.")
    rows = pad_rows = dropped = 0.0
    for start in range(0, loads.shape[0], window):
        for layer in range(loads.shape[1]):
            block = loads[start:start + window, layer]
            res = hindsight_capacities(block, drop_target)
            computed = float(res.capacity_S.sum()) * block.shape[0]
            rows += computed
            pad_rows += res.expected_padding_fraction * computed
            dropped += res.expected_drop_rate * float(block.sum())
    return pad_rows / max(rows, 1.0), dropped / max(float(loads.sum()), 1.0)


# ---------------------------------------------------------------------------------------------
# "grouped" dispatch: one send block per (source rank, device), one row buffer per device
# ---------------------------------------------------------------------------------------------

def pair_loads(plan: ExpertPlan, load_RE: np.ndarray, rel_err_KRE: Optional[np.ndarray],
               rank_device: np.ndarray, devices_per_node: Optional[int] = None
               ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The forecast rows every source rank sends every device hosting a slot of a
    ``"grouped"`` plan, and their relative errors: (devices int64 [H], load float64 [R, H],
    rel float64 [K, R, H]).

    Rank r's forecast ``load_RE[r, e]`` reaches slot s in the plan's fixed split
    (:func:`~ms_efficient.moe.split.grouped_split_weights`), so the pair (r, d) carries
    P_rd = sum over d's slots of load_RE[r, e(s)] * w_rs. Error sample k of a pair is exact
    for the sum: sum over d's slots of load_RE[r, e(s)] w_rs rel[k, r, e(s)] / max(P_rd, 1).
    rel_err_KRE: float [K, R, E] relative per-rank forecast errors (None: K = 0)."""
    load = np.asarray(load_RE, dtype=np.float64)
    frac_RS = grouped_split_weights(plan, load.shape[1], rank_device,
                                    devices_per_node) / SPLIT_UNITS
    part_RS = load[:, plan.slot_expert] * frac_RS                          # [R, S]
    devices = np.unique(plan.slot_device)
    onehot_SH = (plan.slot_device[:, None] == devices[None, :]).astype(np.float64)
    load_RH = part_RS @ onehot_SH
    if rel_err_KRE is None:
        return devices, load_RH, np.zeros((0,) + load_RH.shape)
    rel = np.asarray(rel_err_KRE, dtype=np.float64)[:, :, plan.slot_expert]   # [K, R, S]
    err_KRH = (rel * part_RS[None]) @ onehot_SH
    return devices, load_RH, err_KRH / np.maximum(load_RH, 1.0)[None]


def device_loads(plan: ExpertPlan, load_RE: np.ndarray, rel_err_KRE: Optional[np.ndarray],
                 rank_device: np.ndarray, devices_per_node: Optional[int] = None
                 ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`pair_loads` summed over the source ranks: (devices int64 [H], load float64 [H],
    rel float64 [K, H]), the forecast rows every hosting device receives and its errors."""
    devices, load_RH, rel_KRH = pair_loads(plan, load_RE, rel_err_KRE, rank_device,
                                           devices_per_node)
    load_H = load_RH.sum(axis=0)
    rel_KH = (rel_KRH * load_RH[None]).sum(axis=1) / np.maximum(load_H, 1.0)[None]
    return devices, load_H, rel_KH


def send_blocks(plan: ExpertPlan, load_RE: np.ndarray, rel_err_KRE: Optional[np.ndarray],
                rank_device: np.ndarray, devices_per_node: Optional[int],
                drop_target: float, max_rows_RD: Optional[np.ndarray] = None) -> np.ndarray:
    """The send block C[r, d] of every (source rank, device) pair of a ``"grouped"`` plan,
    int64 [R, D] (D = largest device id + 1; 0 towards devices without slots): the capacity
    model (:func:`slot_capacities`) with each pair as one slot, its forecast rows and errors
    from :func:`pair_loads`, so the blocks meet ``drop_target`` together with the fewest
    rows (a block row is a row sent every step, full or not: padding costs communication,
    a short block drops). The exact load (``rel_err_KRE`` None) gets its rounded-up value;
    whole counts get exactly the rows the layer's split sends each pair.
    Every block holds >= 1 row. ``max_rows_RD``: float [R, D], the most rows a rank can
    ever send a device (its tokens x the device's experts, at most top-k), a cap."""
    devices, load_RH, rel_KRH = pair_loads(plan, load_RE, rel_err_KRE, rank_device,
                                           devices_per_node)
    load_P = load_RH.ravel()
    load_RE = np.asarray(load_RE, dtype=np.float64)
    if rel_err_KRE is None and np.array_equal(load_RE, np.round(load_RE)):
        # whole counts (an oracle's): the rows the layer's integer split gives each pair
        rows_RS = grouped_split(plan, load_RE.astype(np.int64), rank_device, devices_per_node)
        exact_RD = slot_rows_by_device(rows_RS, plan.slot_device, int(devices.max()) + 1)
        caps = np.maximum(exact_RD[:, devices].ravel(), 1).astype(np.float64)
    elif rel_err_KRE is None:
        caps = np.maximum(np.ceil(load_P - 1e-9), 1)
    else:
        caps = slot_capacities(load_P, np.arange(load_P.size),
                               rel_KRH.reshape(rel_KRH.shape[0], -1), drop_target,
                               1).capacity_S
    caps = caps.reshape(load_RH.shape)
    if max_rows_RD is not None:
        top = np.asarray(max_rows_RD, np.float64)[:, devices]
        caps = np.minimum(caps, np.maximum(np.ceil(top - 1e-9), 1))
    out = np.zeros((load_RH.shape[0], int(plan.slot_device.max()) + 1), dtype=np.int64)
    out[:, devices] = caps
    return out


def expected_pair_drop_rate(plan: ExpertPlan, load_RE: np.ndarray,
                            rel_err_KRE: np.ndarray, rank_device: np.ndarray,
                            devices_per_node: Optional[int],
                            max_rows_RD: Optional[np.ndarray] = None) -> float:
    """Expected drop rate of a ``"grouped"`` plan's send blocks (``plan.send_rows``) when the
    coming per-rank loads follow the error model around ``load_RE`` (float [R, E]), in [0, 1];
    the device buffers of a planned plan (B_d = the column sums) drop nothing more."""
    devices, load_RH, rel_KRH = pair_loads(plan, load_RE, rel_err_KRE, rank_device,
                                           devices_per_node)
    block_RH = plan.send_rows(load_RH.shape[0], int(devices.max()) + 1)[:, devices]
    top = None if max_rows_RD is None else np.asarray(max_rows_RD, np.float64)[:, devices]
    return expected_expert_drop_rate(block_RH.ravel(), load_RH.ravel(),
                                     rel_KRH.reshape(rel_KRH.shape[0], -1),
                                     None if top is None else top.ravel())


def quantize_levels(capacity_E: np.ndarray, levels: int) -> np.ndarray:
    """Raise capacities to at most ``levels`` distinct values with the fewest added rows.

    Experts of equal capacity run as one batched matmul (``MoEFeedForward`` groups them), so
    few distinct values mean few kernels: the planner raises each device's "static" slot
    capacities with it when ``PlannerConfig.capacity_levels`` is set (grouped plans have no
    per-slot capacities and skip it). Sorted descending, the values split into ``levels``
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
