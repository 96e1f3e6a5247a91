"""Static capacities from a recorded trace: the fewest expert rows that drop at most a target.

A one-process "static" MoE layer computes ``capacity_e`` rows of every expert e each step,
whatever the routing: too small drops tokens, too large computes zero padding. Given the
loads a trace recorded (float [T, E] tokens per expert and step), the capacities with the
fewest rows whose drop rate over those T steps is at most ``drop_target`` solve a separable
convex problem (:func:`hindsight_capacities`):

    minimise  sum_e c_e   subject to   sum_e d_e(c_e) <= drop_target * sum_te l_te,
    d_e(c) = sum_t (l_te - c)^+   (convex, piecewise linear, slope -#{t: l_te > c}),

so lowering every expert's capacity from its largest load, segment by segment in order of
increasing slope (between its sorted loads, the last segment partly), is exact.

:func:`static_capacities` is what the ``efficientmoe`` pass gives a one-process network
before it compiles (the last ``window`` rows of ``efficientmoe.history``, per layer, rounded
up to ``capacity_multiple`` rows: Ascend's cube units work on 16 x 16 tiles; never above the
tokens of a step, the most one expert can receive). :func:`static_capacity_limit` is the
``static-limit`` yardstick rows of ``bench moe``: the least padding any static plan
re-planned every ``window`` steps can have at that drop rate, capacities chosen knowing the
loads.

    drop rate        = sum_te max(0, l_te - c_e) / sum_te l_te
    padding fraction = sum_te max(0, c_e - l_te) / (T sum_e c_e)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

__all__ = ["StaticCapacities", "round_up", "expected_drop_and_padding", "hindsight_capacities",
           "static_capacities", "static_capacity_limit"]


@dataclass(frozen=True)
class StaticCapacities:
    """capacity_LE: int64 [L, E] rows per step of every layer's experts. drop_rate,
    padding_fraction: over the trace rows they were sized on, in [0, 1]."""

    capacity_LE: np.ndarray
    drop_rate: float
    padding_fraction: float


def round_up(x, multiple: int) -> np.ndarray:
    """Round every entry of ``x`` up to a multiple of ``multiple`` (int64)."""
    if isinstance(multiple, bool) or not isinstance(multiple, (int, np.integer)) or multiple < 1:
        raise ValueError(f"'multiple' must be a positive integer, but got {multiple!r}.")
    arr = np.ceil(np.asarray(x, dtype=np.float64) / multiple - 1e-9)
    return (np.maximum(arr, 0) * multiple).astype(np.int64)


def expected_drop_and_padding(capacity_E: np.ndarray,
                              loads_TE: np.ndarray) -> Tuple[float, float]:
    """(drop rate, padding fraction) of capacities int [E] over loads [T, E] (module
    docstring)."""
    cap = np.asarray(capacity_E, dtype=np.float64)[None, :]
    load = np.asarray(loads_TE, dtype=np.float64)
    total = load.sum()
    drop = float(np.maximum(0.0, load - cap).sum() / total) if total > 0 else 0.0
    rows = cap.sum() * load.shape[0]
    pad = float(np.maximum(0.0, cap - load).sum() / rows) if rows > 0 else 0.0
    return drop, pad


def hindsight_capacities(loads_TE: np.ndarray, drop_target: float) -> np.ndarray:
    """int64 [E]: the static capacities with the fewest rows whose drop rate over the steps
    ``loads_TE`` (float [T, E] >= 0, known in advance) is at most ``drop_target`` (module
    docstring), rounded up to whole rows."""
    loads = np.asarray(loads_TE, dtype=np.float64)
    if loads.ndim != 2 or loads.shape[0] < 1 or (loads < 0).any():
        raise ValueError(f"'loads_TE' must be a [steps, experts] array of loads >= 0, but got "
                         f"shape {loads.shape}.")
    if not 0 <= drop_target < 1:
        raise ValueError(f"'drop_target' must be in [0, 1), but got {drop_target}.")
    steps, experts = loads.shape
    desc = -np.sort(-loads, axis=0)                       # [T, E], largest first
    # segment k of expert e: lowering c from desc[k-1] to desc[k] drops k + 1 tokens per row
    lengths = np.vstack([desc[:-1] - desc[1:], desc[-1:]])     # [T, E]; last: down to 0
    cap = desc[0].copy()
    budget = drop_target * loads.sum()
    for idx in range(steps * experts):                   # slope k + 1 grows with the row
        k, e = divmod(idx, experts)
        length, slope = lengths[k, e], k + 1
        if length <= 0:
            continue
        if slope * length <= budget:
            cap[e] -= length
            budget -= slope * length
        else:
            cap[e] -= budget / slope
            break
    return np.ceil(cap - 1e-9).astype(np.int64)


def static_capacities(load_TLE: np.ndarray, drop_target: float, multiple: int,
                      max_load: Optional[int] = None) -> StaticCapacities:
    """Every layer's :func:`hindsight_capacities` on ``load_TLE`` (int [T, L, E] tokens per
    expert and step), rounded up to ``multiple`` and capped at ``max_load`` (the tokens of a
    step: an expert receives each token at most once); the drop rate and padding over those
    rows with the rounded capacities."""
    load = np.asarray(load_TLE, dtype=np.float64)
    if load.ndim != 3 or load.shape[0] < 1:
        raise ValueError(f"'load_TLE' must be [steps >= 1, layers, experts], but got shape "
                         f"{load.shape}.")
    caps = np.stack([round_up(hindsight_capacities(load[:, layer], drop_target), multiple)
                     for layer in range(load.shape[1])])
    caps = np.maximum(caps, multiple)
    if max_load is not None:
        caps = np.minimum(caps, int(max_load))
    # every (layer, expert) as one column: the rates over all layers' rows at once
    drop, pad = expected_drop_and_padding(caps.ravel(), load.reshape(load.shape[0], -1))
    return StaticCapacities(caps, drop, pad)


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
            cap = hindsight_capacities(block, drop_target)
            drop, pad = expected_drop_and_padding(cap, block)
            computed = float(cap.sum()) * block.shape[0]
            rows += computed
            pad_rows += pad * computed
            dropped += drop * float(block.sum())
    return pad_rows / max(rows, 1.0), dropped / max(float(loads.sum()), 1.0)
