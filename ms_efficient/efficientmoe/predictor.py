"""Expert-load predictors: forecast next step's tokens per expert from a window of past steps.

Every predictor is a small frozen dataclass with a ``name`` and a pure method
``predict(load_TLE) -> pred_LE``: ``load_TLE`` float/int [t, layer, expert] is the history
(tokens each expert received at each past step, summed over source ranks, oldest first) and
``pred_LE`` float64 [layer, expert] the forecast for the step after the last row. Learned
models are refitted online inside ``predict`` on the most recent rows, so calling it step after
step is "fit online, predict next" with no hidden state.

    last-value  the last row (what most systems use implicitly).
    ema         exponential moving average, s_t = alpha * x_t + (1 - alpha) * s_{t-1}.
    ar-ridge    our learned model, see :class:`ARRidge`.

:func:`evaluate_predictors` scores them on a trace with a floored MAPE;
:func:`predict_counts` spreads an expert forecast over source ranks ([layer, rank, expert]);
:func:`relative_residuals` gives the recent forecast errors the capacity model sizes from.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar, Dict, List, Optional, Sequence, Union

import numpy as np

from ms_efficient.core.config import PREDICTOR_NAMES

__all__ = ["Forecaster", "LastValue", "EMA", "ARRidge", "PerRank", "Predictor",
           "PREDICTOR_NAMES",
           "get_predictor", "evaluate_predictors", "mape_percent", "predict_counts",
           "relative_residuals", "error_floor", "EXTRAPOLATED_LEADS", "EXTRAPOLATION_LIMIT",
           "FLOOR_FRACTION"]

logger = logging.getLogger(__name__)

FLOOR_FRACTION = 0.05   # error floor, fraction of the mean expert load (see mape_percent)


def _history(load_TLE: np.ndarray) -> np.ndarray:
    arr = np.asarray(load_TLE, dtype=np.float64)
    if arr.ndim != 3 or arr.shape[0] < 1:
        raise ValueError(f"load history must be [t >= 1, layer, expert], but got shape "
                         f"{arr.shape}.")
    return arr


@dataclass(frozen=True)
class LastValue:
    """Predict the last observed load."""

    name: ClassVar[str] = "last-value"

    def predict(self, load_TLE: np.ndarray) -> np.ndarray:
        """[t, L, E] history -> [L, E] forecast (float64, tokens)."""
        return _history(load_TLE)[-1].copy()


@dataclass(frozen=True)
class EMA:
    """Exponential moving average: s_0 = x_0, s_t = alpha x_t + (1 - alpha) s_{t-1}; predict s_T.

    alpha in (0, 1]: weight of the newest row (1.0 is last-value).
    """

    alpha: float = 0.5
    name: ClassVar[str] = "ema"

    def __post_init__(self) -> None:
        if not 0 < self.alpha <= 1:
            raise ValueError(f"'alpha' must be in (0, 1], but got {self.alpha!r}.")

    def predict(self, load_TLE: np.ndarray) -> np.ndarray:
        """[t, L, E] history -> [L, E] forecast (float64, tokens)."""
        hist = _history(load_TLE)
        steps = hist.shape[0]
        # closed form of the recursion: weights alpha (1-alpha)^k, the oldest row keeps the rest
        w = self.alpha * (1 - self.alpha) ** np.arange(steps - 1, -1, -1, dtype=np.float64)
        w[0] = (1 - self.alpha) ** (steps - 1)
        return np.tensordot(w, hist, axes=(0, 0))


@dataclass(frozen=True)
class ARRidge:
    """Pooled ridge autoregression on load shares, refitted online on the last ``window`` rows.

    Per layer, the share of expert e at step t, x_t[e] = load_t[e] / sum_e load_t[e], is
    modelled as its recent mean plus a weighted sum of the latest deviations from it:
        x_t[e] - m_t[e] = sum_k beta_k (x_{t-k}[e] - m_t[e]),   k = 1 .. order,
    where m_t[e] is the mean share of e over the ``window`` rows before t. One beta per layer,
    shared by all experts, fitted by ridge regression (closed form) on the most recent
    ``window`` targets. The forecast share is clipped at 0, renormalised, and scaled by the
    last row's total.

    Why this model: routing loads are a slowly drifting popularity plus sampling noise, so the
    best forecast is a smoothed recent value pulled toward the expert's longer-run mean. The
    regression learns that smoothing (an EMA-like weighting of the lags) and the strength of
    the pull (1 - sum beta) from the data of each layer instead of fixing ``alpha`` by hand;
    pooling the experts gives E samples per step, so ``order`` coefficients are well
    determined after a few steps; shares make it insensitive to the batch's token count. A
    fit is one order x order solve per layer: microseconds, deterministic, no state between
    calls.
    With fewer than ``order + 3`` rows it falls back to :class:`EMA`.

    order: lags used, >= 1. window: rows of targets per fit and of the mean feature, >= 2.
    ridge: L2 penalty relative to the mean diagonal of the normal matrix, >= 0.
    """

    order: int = 3
    window: int = 16
    ridge: float = 1e-2
    name: ClassVar[str] = "ar-ridge"

    def __post_init__(self) -> None:
        if self.order < 1 or self.window < 2 or self.ridge < 0:
            raise ValueError(f"ARRidge needs order >= 1, window >= 2, ridge >= 0, but got "
                             f"order={self.order}, window={self.window}, ridge={self.ridge}.")

    def predict(self, load_TLE: np.ndarray) -> np.ndarray:
        """[t, L, E] history -> [L, E] forecast (float64, tokens)."""
        hist = _history(load_TLE)
        steps, _, num_experts = hist.shape
        p = self.order
        if steps < p + 3:
            return EMA().predict(hist)
        hist = hist[-(2 * self.window + p):]
        steps = hist.shape[0]
        totals = hist.sum(axis=2, keepdims=True)
        x = hist / np.where(totals > 0, totals, 1.0)                       # shares [t, L, E]
        csum = np.concatenate([np.zeros_like(x[:1]), np.cumsum(x, axis=0)])
        lo = np.maximum(0, np.arange(steps + 1) - self.window)
        mean = (csum[1:] - csum[lo[1:]]) / (np.arange(1, steps + 1) - lo[1:])[:, None, None]
        # mean[t] = mean share over rows [t - window + 1, t]: the feature for target t + 1

        def features(t: int) -> np.ndarray:                                # [L, E, p]
            return np.stack([x[t - k] - mean[t - 1] for k in range(1, p + 1)], axis=-1)

        targets = range(max(p, steps - self.window), steps)
        feats = np.stack([features(t) for t in targets], axis=1)            # [L, n, E, p]
        ys = np.stack([x[t] - mean[t - 1] for t in targets], axis=1)        # [L, n, E]
        num_layers = hist.shape[1]
        feats = feats.reshape(num_layers, -1, p)
        ys = ys.reshape(num_layers, -1)
        gram = np.einsum("lnf,lng->lfg", feats, feats)
        lam = self.ridge * np.trace(gram, axis1=1, axis2=2) / p + 1e-30
        gram += lam[:, None, None] * np.eye(p)
        beta = np.linalg.solve(gram, np.einsum("lnf,ln->lf", feats, ys)[..., None])[..., 0]
        now = features(steps)                                               # [L, E, p]
        share = np.clip(mean[steps - 1] + np.einsum("lef,lf->le", now, beta), 0.0, None)
        norm = share.sum(axis=1, keepdims=True)
        share = np.where(norm > 0, share / np.where(norm > 0, norm, 1.0), 1.0 / num_experts)
        return share * totals[-1]


@dataclass(frozen=True)
class PerRank:
    """Forecast per-(rank, expert) loads from a [t, layer, R * E] history (rank-major columns):
    the expert totals by ``base``, spread over the ranks by their recent shares
    (:func:`predict_counts`). Lets :func:`relative_residuals` measure the errors of the
    per-rank forecasts that static dispatch sizes each rank's rows from."""

    base: Union[LastValue, EMA, ARRidge]
    num_ranks: int
    share_window: int = 8
    name: ClassVar[str] = "per-rank"

    def predict(self, load_TLE: np.ndarray) -> np.ndarray:
        """[t, L, R * E] history -> [L, R * E] forecast (float64, tokens)."""
        hist = _history(load_TLE)
        steps, layers, columns = hist.shape
        if columns % self.num_ranks:
            raise ValueError(f"{columns} columns do not split into {self.num_ranks} ranks.")
        counts = hist.reshape(steps, layers, self.num_ranks, columns // self.num_ranks)
        return predict_counts(counts, self.base, self.share_window).reshape(layers, columns)


Predictor = Union[LastValue, EMA, ARRidge, PerRank]


def get_predictor(name: str) -> Predictor:
    """The predictor called ``name`` with its default parameters."""
    table = {"last-value": LastValue, "ema": EMA, "ar-ridge": ARRidge}
    if name not in table:
        raise ValueError(f"predictor must be one of {list(table)}, but got {name!r}.")
    return table[name]()


def error_floor(actual_LE: np.ndarray, floor_fraction: float) -> np.ndarray:
    """Per-layer error floor, tokens: max(1, floor_fraction * mean expert load): [L, 1]."""
    return np.maximum(1.0, floor_fraction * actual_LE.mean(axis=-1, keepdims=True))


def mape_percent(pred_TLE: np.ndarray, actual_TLE: np.ndarray,
                 floor_fraction: float = FLOOR_FRACTION) -> np.ndarray:
    """Floored mean absolute percentage error per layer, percent: float64 [L].

    MAPE_l = 100 * mean over steps t and experts e of |pred - actual| / max(actual, floor_tl),
    floor_tl = max(1 token, floor_fraction * mean_e actual[t, l, e]). Without the floor an
    expert that received 0 or 1 tokens would dominate the mean with an unbounded ratio; with it,
    an expert far below the layer's mean load counts as if it had floor_fraction of it.
    """
    pred = np.asarray(pred_TLE, dtype=np.float64)
    actual = np.asarray(actual_TLE, dtype=np.float64)
    if pred.shape != actual.shape or actual.ndim != 3:
        raise ValueError(f"pred and actual must both be [t, layer, expert], but got "
                         f"{pred.shape} and {actual.shape}.")
    denom = np.maximum(actual, error_floor(actual, floor_fraction))
    return 100.0 * (np.abs(pred - actual) / denom).mean(axis=(0, 2))


def evaluate_predictors(load_TLE: np.ndarray, predictors: Optional[Sequence[Predictor]] = None,
                        warmup: int = 1,
                        floor_fraction: float = FLOOR_FRACTION) -> Dict[str, np.ndarray]:
    """One-step-ahead MAPE (percent, :func:`mape_percent`) of each predictor, per layer.

    load_TLE: [t, layer, expert] tokens per expert (``RoutingTrace.expert_load()``).
    Step t is predicted from rows [0, t) for t in [warmup, T). Returns {name: float64 [L]}.
    """
    hist = _history(load_TLE)
    if not 1 <= warmup < hist.shape[0]:
        raise ValueError(f"'warmup' must be in [1, {hist.shape[0] - 1}] for a {hist.shape[0]}-"
                         f"step trace, but got {warmup}.")
    predictors = list(predictors) if predictors is not None else [
        get_predictor(n) for n in PREDICTOR_NAMES]
    out: Dict[str, np.ndarray] = {}
    for pred in predictors:
        forecast = np.stack([pred.predict(hist[:t]) for t in range(warmup, hist.shape[0])])
        out[pred.name] = mape_percent(forecast, hist[warmup:], floor_fraction)
    return out


def predict_counts(counts_TLRE: np.ndarray, predictor: Predictor,
                   share_window: int = 8) -> np.ndarray:
    """Forecast next step's per-rank routing counts: float64 [layer, rank, expert], tokens.

    The expert totals come from ``predictor``; each expert's tokens are spread over source
    ranks by the ranks' share of that expert's tokens over the last ``share_window`` rows
    (uniform over ranks for an expert that received nothing).
    """
    counts = np.asarray(counts_TLRE, dtype=np.float64)
    if counts.ndim != 4:
        raise ValueError(f"counts must be [t, layer, rank, expert], but got shape "
                         f"{counts.shape}.")
    pred_LE = predictor.predict(counts.sum(axis=2))
    recent = counts[-share_window:].sum(axis=0)                               # [L, R, E]
    total = recent.sum(axis=1, keepdims=True)
    share = np.where(total > 0, recent / np.where(total > 0, total, 1.0), 1.0 / counts.shape[2])
    return pred_LE[:, None, :] * share


EXTRAPOLATED_LEADS = 8   # lead points that stand for the leads beyond the history
EXTRAPOLATION_LIMIT = 4  # errors are held beyond this many times the longest observed lead


def relative_residuals(load_TLE: np.ndarray, predictor: Predictor, window: int = 8,
                       horizon: int = 1, floor_fraction: float = FLOOR_FRACTION) -> np.ndarray:
    """Relative forecast errors over the next ``horizon`` rows: float64 [K, layer, expert].

    A plan made now serves rows at lead 1 .. horizon. For each lead l the history gives up to
    ``window`` samples: the forecast from rows [0, o) against row o + l - 1, as
    (actual - pred) / max(pred, floor) (floor as in :func:`mape_percent`). When the history
    covers every lead, those samples are returned, lead after lead.

    When it covers only leads 1 .. L < horizon, the errors of the whole lifetime are
    represented by EXTRAPOLATED_LEADS evenly spaced lead points l_i in [1, horizon] (each
    standing for an equal share of the lifetime); every point contributes the pool P of all
    observed samples, each divided by the root mean square error of its own lead, times
    sqrt(m(l_i)). m(l) is the observed pooled mean square error for l <= L; beyond, a noise
    plus random walk model m(l) = a + b min(l, EXTRAPOLATION_LIMIT * L) (a, b >= 0, least
    squares over the observed leads, weighted by their sample counts).
    Why the pool: the longest observed leads have one or two origins, and copying those few
    samples to every later lead would make the per-expert error pattern that of a single
    step. Why the limit: a plan sized for 1600 rows from 16 rows of history would extrapolate
    the error growth a hundredfold, and any noise in the fitted slope becomes a capacity
    near the dropless bound; we size for what four times the history can vouch for and let
    the drop monitor of the re-plan loop catch a load that wanders further. (A cap at the
    history's own spread, "no worse than two independent rows", was tried and rejected: with
    a history shorter than the load's correlation time it is several times too small, e.g.
    0.014 against 0.031 observed later at lead 32 on the synthetic trace at row 16.)
    K is 0 only when the history has fewer than 2 rows.
    """
    hist = _history(load_TLE)
    steps = hist.shape[0]
    by_lead: List[np.ndarray] = []
    forecasts: Dict[int, np.ndarray] = {}
    for lead in range(1, horizon + 1):
        origins = range(max(1, steps - lead - window + 1), steps - lead + 1)
        if not origins:
            break
        samples = []
        for o in origins:
            if o not in forecasts:
                forecasts[o] = predictor.predict(hist[:o])
            pred = forecasts[o]
            denom = np.maximum(pred, error_floor(pred, floor_fraction))
            samples.append((hist[o + lead - 1] - pred) / denom)
        by_lead.append(np.stack(samples))
    if not by_lead:
        return np.zeros((0,) + hist.shape[1:])
    observed = len(by_lead)
    if observed == horizon:
        return np.concatenate(by_lead)
    # Step 1: mean square error per observed lead, and its model beyond the history
    mse = np.array([float(np.mean(r ** 2)) for r in by_lead])
    leads = np.arange(1, observed + 1, dtype=np.float64)
    sizes = np.array([r.shape[0] for r in by_lead], dtype=np.float64)
    slope = (max(0.0, float(np.polyfit(leads, mse, 1, w=np.sqrt(sizes))[0]))
             if observed >= 2 else 0.0)
    base = max(float(np.average(mse - slope * leads, weights=sizes)), 0.0)
    held = EXTRAPOLATION_LIMIT * observed

    def msq(lead: int) -> float:
        return mse[lead - 1] if lead <= observed else base + slope * min(lead, held)

    # Step 2: the standardised pool, scaled to each lead point
    pool = np.concatenate([r / np.sqrt(m) if m > 0 else r for r, m in zip(by_lead, mse)])
    points = np.unique(np.round(np.linspace(1, horizon, EXTRAPOLATED_LEADS)).astype(int))
    return np.concatenate([pool * np.sqrt(msq(int(lead))) for lead in points])


class Forecaster:
    """The forecast a plan is sized from: next-row per-rank counts and their relative errors."""

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
