"""EfficientMoE online: sample routing counts each step, predict, and re-size expert capacities.

This is the single-device (or data-parallel) half of EfficientMoE that runs inside training:
every expert's static capacity is re-planned from the predicted load so that almost no slot
row computes padding and almost no token is dropped. The multi-device half (replication and
placement of experts over an expert-parallel group) is planned by
:mod:`ms_efficient.efficientmoe.placement` and evaluated with the simulator.

No MindSpore here: :class:`RoutingSampler` keeps numpy rows, :class:`CapacityPlanner` is a
pure function of the history. The trainer applies a plan with
``MoEFeedForward.set_capacities`` and recompiles its step.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import List

import numpy as np

from ms_efficient.core.config import EfficientMoEConfig
from ms_efficient.efficientmoe.capacity import expected_drop_and_padding, slot_capacities
from ms_efficient.efficientmoe.predictor import get_predictor, relative_residuals
from ms_efficient.moe.trace import RoutingTrace

__all__ = ["RoutingSampler", "CapacityPlan", "CapacityPlanner", "quantize_levels"]

logger = logging.getLogger(__name__)


class RoutingSampler:
    """Per-step routing counts, the input of every MoE planner.

    ``record(counts_LRE)`` appends one step (int [layer, src_rank, expert], tokens sent by each
    source rank to each expert, top-k counted k times); ``trace()`` returns the history in the
    routing-trace format. Recording is one small host copy per step: the trainer reports its
    measured cost as ``sampler_overhead_s``.
    """

    def __init__(self) -> None:
        self._rows: List[np.ndarray] = []

    def record(self, counts_LRE: np.ndarray) -> None:
        counts = np.asarray(counts_LRE, dtype=np.int64)
        if counts.ndim != 3:
            raise ValueError(f"counts must be [layer, src_rank, expert], but got shape "
                             f"{counts.shape}.")
        if self._rows and counts.shape != self._rows[0].shape:
            raise ValueError(f"counts shape changed from {self._rows[0].shape} to "
                             f"{counts.shape}.")
        self._rows.append(counts)

    def truncate(self, steps: int) -> None:
        """Keep the first ``steps`` rows (used when a run resumes from a checkpoint)."""
        del self._rows[steps:]

    def __len__(self) -> int:
        return len(self._rows)

    def counts(self) -> np.ndarray:
        """int64 [step, layer, src_rank, expert]."""
        return np.stack(self._rows)

    def expert_load(self) -> np.ndarray:
        """int64 [step, layer, expert], tokens per expert summed over source ranks."""
        return self.counts().sum(axis=2)

    def trace(self, **meta) -> RoutingTrace:
        return RoutingTrace(counts=self.counts(), steps=np.arange(1, len(self) + 1), **meta)


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


@dataclass(frozen=True)
class CapacityPlan:
    """capacity_LE: int64 [layer, expert] static capacity (token rows) of every expert.
    expected_drop_rate, expected_padding_fraction: per layer, float64 [layer], over the
    predicted load samples; predicted_load_LE: float64 [layer, expert], tokens next step."""

    capacity_LE: np.ndarray
    expected_drop_rate: np.ndarray
    expected_padding_fraction: np.ndarray
    predicted_load_LE: np.ndarray

    def rows(self) -> int:
        """Slot rows computed per step over all layers."""
        return int(self.capacity_LE.sum())


class CapacityPlanner:
    """Plans per-expert capacities from a load history (see :mod:`.capacity`).

    tokens_per_step: T, tokens each MoE layer routes per step; an expert never gets more than
    T assignments, so capacities are capped there.
    """

    def __init__(self, cfg: EfficientMoEConfig, tokens_per_step: int):
        self.cfg = cfg
        self.tokens_per_step = tokens_per_step
        self.predictor = get_predictor(cfg.predictor)

    def plan(self, load_TLE: np.ndarray) -> CapacityPlan:
        """Capacities for the next ``replan_every`` steps from history [t, layer, expert]."""
        cfg = self.cfg
        hist = np.asarray(load_TLE, dtype=np.float64)[-cfg.window:]
        pred_LE = self.predictor.predict(hist)
        rel_err_KLE = relative_residuals(hist, self.predictor, window=cfg.window,
                                         horizon=min(cfg.replan_every, max(1, len(hist) - 2)))
        layers, experts = pred_LE.shape
        caps = np.zeros((layers, experts), np.int64)
        drop = np.zeros(layers)
        pad = np.zeros(layers)
        for layer in range(layers):
            res = slot_capacities(pred_LE[layer], np.arange(experts), rel_err_KLE[:, layer, :],
                                  drop_target=cfg.drop_target, multiple=cfg.capacity_multiple)
            caps[layer] = quantize_levels(np.minimum(res.capacity_S, self.tokens_per_step),
                                          cfg.capacity_levels)
            drop[layer], pad[layer] = res.expected_drop_rate, res.expected_padding_fraction
        return CapacityPlan(caps, drop, pad, pred_LE)

    def worth_applying(self, current_LE: np.ndarray, candidate: CapacityPlan,
                       load_TLE: np.ndarray, row_time_s: float, recompile_s: float) -> bool:
        """Adopt ``candidate`` when the compute it saves over the next ``replan_every`` steps
        exceeds one recompilation, or when the current capacities would drop more than the
        target on the recent loads (a correctness matter, adopted whatever it costs).

        row_time_s: seconds to compute one slot row forward and backward (all layers share it).
        """
        if np.array_equal(current_LE, candidate.capacity_LE):
            return False
        recent = np.asarray(load_TLE, dtype=np.float64)[-self.cfg.window:]      # [t, L, E]
        drops = [expected_drop_and_padding(current_LE[layer], recent[:, layer, :])[0]
                 for layer in range(current_LE.shape[0])]
        if max(drops) > self.cfg.drop_target:
            return True
        saved_rows = int(current_LE.sum()) - candidate.rows()
        gain_s = saved_rows * row_time_s * self.cfg.replan_every
        logger.debug("re-plan gain %.3f s vs recompile %.3f s", gain_s, recompile_s)
        return gain_s > recompile_s
