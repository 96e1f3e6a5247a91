"""Capacity model: the static capacity (rows per step) of every expert slot, before compilation.

A slot's capacity is a bet on its coming loads: too small drops tokens, too large computes zero
padding. We size it from the predicted per-slot load and the recent relative forecast errors of
the load predictor (``rel_err_KE`` [K, E], from
:func:`ms_efficient.moe.predictor.relative_residuals`). K is small (a few recent steps), too
few for a tail quantile per expert, so errors are standardised: each expert gets an error
scale sigma_e (its root mean square error, shrunk toward the layer's), and the standardised
errors z = rel_err / sigma of all experts are pooled (K * E samples):

    samples:   load_ns = pred_s * max(0, 1 + sigma_e(s) * z_n)            (N = K * E futures)
    capacity:  cap_s = round_up(pred_s * max(1, Q_q(samples_s / pred_s)) * (1 + margin), multiple)

q is the smallest value of a grid whose expected drop rate over the samples meets
``drop_target``. At q = 1 (the largest sample) the samples never drop, so the target is
always reachable. Capacities are rounded up
to ``multiple`` tokens (16 by default: Ascend cube units work on 16x16 fp16 tiles) and are at
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
from typing import Sequence, Tuple

import numpy as np

__all__ = ["CapacityResult", "round_up", "switch_capacity", "error_scales", "load_samples",
           "expected_drop_and_padding", "slot_capacities", "uniform_capacity",
           "exact_capacities", "expected_expert_drop_rate", "QUANTILE_GRID"]

logger = logging.getLogger(__name__)

QUANTILE_GRID = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.975, 0.99, 0.995, 0.999, 1.0)
FALLBACK_MARGIN = 0.25  # relative headroom used when there are no residual samples yet
PRIOR_SAMPLES = 8.0     # weight of the layer-wide error scale in each expert's (in samples)


@dataclass(frozen=True)
class CapacityResult:
    """capacity_S: int64 [S] tokens per slot; quantile: the q chosen (nan for uniform/exact);
    expected_drop_rate, expected_padding_fraction: over the load samples, in [0, 1]."""

    capacity_S: np.ndarray
    quantile: float
    expected_drop_rate: float
    expected_padding_fraction: float


def round_up(x, multiple: int) -> np.ndarray:
    """Round every entry of ``x`` up to a multiple of ``multiple`` (int64)."""
    if isinstance(multiple, bool) or not isinstance(multiple, (int, np.integer)) or multiple < 1:
        raise ValueError(f"'multiple' must be a positive integer, but got {multiple!r}.")
    arr = np.ceil(np.asarray(x, dtype=np.float64) / multiple - 1e-9)
    return (np.maximum(arr, 0) * multiple).astype(np.int64)


def switch_capacity(assignments_per_step: int, num_experts: int, capacity_factor: float,
                    multiple: int = 1) -> int:
    """Switch/GShard capacity of every expert, tokens: ceil(cf * assignments / E), rounded up
    to ``multiple`` (assignments = tokens * top_k, summed over ranks)."""
    if capacity_factor <= 0:
        raise ValueError(f"'capacity_factor' must be > 0, but got {capacity_factor!r}.")
    cap = math.ceil(capacity_factor * assignments_per_step / num_experts - 1e-9)
    return int(round_up(max(cap, 1), multiple))


def error_scales(rel_err_KE: np.ndarray,
                 prior_samples: float = PRIOR_SAMPLES) -> Tuple[np.ndarray, np.ndarray]:
    """Per-expert error scale and pooled standardised errors: (sigma_E [E], z [K * E]).

    sigma_e^2 = (K * mean_k rel[k, e]^2 + prior_samples * pooled mean square) / (K + prior):
    each expert's own mean square shrunk toward the layer's, so a few samples per expert
    still give a stable scale; z = rel / sigma pooled over all experts, so the tail quantiles
    come from K * E samples instead of K.
    """
    rel = np.asarray(rel_err_KE, dtype=np.float64)
    k = rel.shape[0]
    pooled = float(np.mean(rel ** 2))
    sigma = np.sqrt((k * np.mean(rel ** 2, axis=0) + prior_samples * pooled) / (k + prior_samples))
    sigma = np.maximum(sigma, 1e-6)
    return sigma, (rel / sigma).reshape(-1)


def load_samples(pred_load_S: np.ndarray, slot_expert: np.ndarray,
                 rel_err_KE: np.ndarray) -> np.ndarray:
    """Plausible per-slot loads, explicitly: float64 [N, S] = pred_s * max(0, 1 + sigma_e(s) z_n)
    over the pooled standardised errors z (:func:`error_scales`, N = K * E). With K = 0, one
    sample pred * (1 + FALLBACK_MARGIN). The planners use the same model in closed form."""
    pred = np.asarray(pred_load_S, dtype=np.float64)
    sigma_S, z = _error_model(pred, slot_expert, rel_err_KE)
    return pred[None, :] * np.maximum(0.0, 1.0 + z[:, None] * sigma_S[None, :])


def _error_model(pred_S: np.ndarray, slot_expert: np.ndarray,
                 rel_err_KE: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(sigma of each slot [S], pooled standardised errors z [N], ascending)."""
    rel = np.asarray(rel_err_KE, dtype=np.float64)
    if rel.ndim != 2:
        raise ValueError(f"'rel_err_KE' must be 2-D [sample, expert], but got shape {rel.shape}.")
    if rel.shape[0] == 0:
        return np.full(pred_S.shape, FALLBACK_MARGIN), np.ones(1)
    sigma_E, z = error_scales(rel)
    return sigma_E[np.asarray(slot_expert)], np.sort(z)


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


def _expected(cap_S: np.ndarray, pred_S: np.ndarray, sigma_S: np.ndarray,
              z: np.ndarray) -> Tuple[float, float]:
    """:func:`expected_drop_and_padding` over the samples pred (1 + sigma z)^+ in closed form,
    O(S log N): with z sorted and suffix sums, mean_n max(0, pred (1 + sigma z_n) - cap) =
    (pred (count + sigma * sum) - cap * count) / N over the z_n above (cap / pred - 1) / sigma."""
    n = z.size
    suffix = np.concatenate([np.cumsum(z[::-1])[::-1], [0.0]])
    pred = np.asarray(pred_S, dtype=np.float64)
    cap = np.asarray(cap_S, dtype=np.float64)
    live = (pred > 0) & (sigma_S > 0)
    p, sg, c = pred[live], sigma_S[live], cap[live]

    def above(threshold):
        i = np.searchsorted(z, threshold, side="right")
        return n - i, suffix[i]

    cnt0, sum0 = above(-1.0 / sg)                                   # samples with load > 0
    load = p * (cnt0 + sg * sum0) / n
    cnt, tot = above((c / p - 1.0) / sg)
    over = np.maximum(0.0, p * (cnt + sg * tot) - c * cnt) / n
    # slots with no load or no spread: one point load, pred itself
    flat = ~live
    flat_load = pred[flat]
    total_load = load.sum() + flat_load.sum()
    total_over = over.sum() + np.maximum(0.0, flat_load - cap[flat]).sum()
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


def slot_capacities(pred_load_S: np.ndarray, slot_expert: np.ndarray, rel_err_KE: np.ndarray,
                    drop_target: float = 0.005, multiple: int = 16, margin: float = 0.0,
                    quantiles: Sequence[float] = QUANTILE_GRID) -> CapacityResult:
    """Per-slot capacities meeting ``drop_target`` with the least padding on the grid.

    pred_load_S: float [S] predicted tokens of each slot per step.
    slot_expert: int [S] logical expert of each slot (selects its residual column).
    rel_err_KE: float [K, E] relative forecast errors (K may be 0, see :func:`load_samples`).
    drop_target: expected drop rate to stay at or below, in [0, 1).
    multiple: capacities are multiples of this many tokens, and at least one multiple.
    margin: extra relative headroom on top of the quantile, >= 0.
    """
    _check(pred_load_S, slot_expert, drop_target)
    pred = np.asarray(pred_load_S, dtype=np.float64)
    sigma_S, z = _error_model(pred, slot_expert, rel_err_KE)
    best = None
    for q in sorted(quantiles):
        growth = np.maximum(1.0 + sigma_S * np.quantile(z, q), 1.0)          # [S]
        cap = np.maximum(round_up(pred * growth * (1 + margin), multiple), multiple)
        drop, pad = _expected(cap, pred, sigma_S, z)
        best = CapacityResult(cap, float(q), drop, pad)
        if drop <= drop_target:
            break
    return best


def uniform_capacity(pred_load_S: np.ndarray, slot_expert: np.ndarray, rel_err_KE: np.ndarray,
                     drop_target: float = 0.005, multiple: int = 16) -> CapacityResult:
    """One capacity for every slot (as a graph with a single expert capacity has): the smallest
    multiple of ``multiple`` whose expected drop rate over the load samples is <= drop_target.
    Arguments as :func:`slot_capacities`."""
    _check(pred_load_S, slot_expert, drop_target)
    pred = np.asarray(pred_load_S, dtype=np.float64)
    sigma_S, z = _error_model(pred, slot_expert, rel_err_KE)
    top = float((pred * np.maximum(0.0, 1.0 + sigma_S * z[-1])).max())
    lo, hi = 1, max(1, int(round_up(top, multiple)) // multiple)
    while lo < hi:                                   # smallest k with drop(k * multiple) ok
        mid = (lo + hi) // 2
        if _expected(np.full(pred.size, mid * multiple), pred, sigma_S, z)[0] <= drop_target:
            hi = mid
        else:
            lo = mid + 1
    cap = np.full(pred.size, lo * multiple, dtype=np.int64)
    drop, pad = _expected(cap, pred, sigma_S, z)
    return CapacityResult(cap, math.nan, drop, pad)


def exact_capacities(load_S: np.ndarray, multiple: int = 16) -> CapacityResult:
    """Capacities that fit known loads exactly up to rounding (the oracle's): round_up(load),
    at least one multiple."""
    load = np.asarray(load_S, dtype=np.float64)
    cap = np.maximum(round_up(load, multiple), multiple)
    drop, pad = expected_drop_and_padding(cap, load[None, :])
    return CapacityResult(cap, math.nan, drop, pad)


def expected_expert_drop_rate(capacity_E: np.ndarray, pred_load_E: np.ndarray,
                              rel_err_KE: np.ndarray) -> float:
    """Expected drop rate of a plan whose experts have total capacities ``capacity_E`` (int [E],
    summed over replicas: overflow moves between replicas) when the coming loads follow the
    error model of :func:`load_samples` around ``pred_load_E``, in [0, 1]."""
    pred = np.asarray(pred_load_E, dtype=np.float64)
    sigma_S, z = _error_model(pred, np.arange(pred.size), rel_err_KE)
    return _expected(np.asarray(capacity_E, dtype=np.float64), pred, sigma_S, z)[0]
