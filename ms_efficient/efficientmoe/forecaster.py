"""Forecaster: the load forecast a plan is sized from, and the errors of past forecasts.

:class:`Forecaster` wraps a load predictor (:mod:`~ms_efficient.efficientmoe.predictor`) for
the planner: the next row's per-rank counts, float64 [L, R, E], and the relative errors of
its recent per-rank forecasts over a plan's lifetime, [K, L, R, E] (K forecast origins, at
most ``residual_window``), which the capacity model turns into headroom. The replay's
oracle-static method substitutes a foresight object with the same two methods.
"""
from __future__ import annotations

import numpy as np

from ms_efficient.efficientmoe.predictor import (PerRank, get_predictor, predict_counts,
                                                 relative_residuals)

__all__ = ["Forecaster"]


class Forecaster:
    """The forecast a plan is sized from: next-row per-rank counts and their relative errors.

    Replaced by a foresight object in the replay's oracle-static method (same interface)."""

    def __init__(self, predictor_name: str, residual_window: int):
        self.predictor = get_predictor(predictor_name)
        self.residual_window = residual_window

    def forecast(self, counts_TLRE: np.ndarray, horizon_rows: int):
        """(predicted counts float64 [L, R, E], relative errors [K, L, R, E] of per-rank
        forecasts over the next ``horizon_rows`` rows)."""
        counts = np.asarray(counts_TLRE)
        pred = predict_counts(counts, self.predictor)
        steps, layers, ranks, experts = counts.shape
        rel = relative_residuals(counts.reshape(steps, layers, ranks * experts),
                                 PerRank(self.predictor, ranks), self.residual_window,
                                 horizon_rows)
        return pred, rel.reshape(-1, layers, ranks, experts)

    def one_step_errors(self, counts_TLRE: np.ndarray) -> np.ndarray:
        """Relative one-step errors of the expert totals, [K, L, E] (K = 0: none yet)."""
        load = np.asarray(counts_TLRE).sum(axis=2)
        return relative_residuals(load, self.predictor, self.residual_window, 1)
