"""Simulated MoE benchmark: every planning method replayed on the same traces, plus predictors.

:func:`run_simulated` returns rows in the JSON format of issue 4 (``evidence: "simulated"``),
:func:`markdown_table` renders them with speed-ups against Switch CF 1.25, and
:func:`synthetic_trace` makes routing traces with drifting Zipf-like skew, so benchmarks and
tests have inputs without a training run. No MindSpore import.
"""
from __future__ import annotations

import logging
import os
from typing import Dict, List, Sequence, Tuple, Union

import numpy as np

from ms_efficient.cluster import ClusterSpec, get_cluster
from ms_efficient.moe.capacity import static_capacity_limit
from ms_efficient.moe.predictor import PREDICTOR_NAMES, evaluate_predictors, get_predictor
from ms_efficient.moe.simulate import METHODS, ReplayConfig, cluster_for_ranks, replay
from ms_efficient.moe.trace import RoutingTrace, load_trace

__all__ = ["synthetic_trace", "run_simulated", "speedups", "markdown_table", "QUICK_ROWS",
           "QUICK_LAYERS"]

logger = logging.getLogger(__name__)

QUICK_ROWS = 64     # --quick: the LAST rows of each trace ...
QUICK_LAYERS = 2    # ... and its first layers: the 32-rank, 64-expert synthetic trace in ~10 s
REFERENCE = "switch-cf1.25"
LIMIT_WINDOWS = (1, 2, 5, 10, 20)   # trace rows a static plan is held, for static-limit rows

TraceInput = Union[str, Tuple[str, RoutingTrace]]


def synthetic_trace(steps: int = 64, layers: int = 2, ranks: int = 32, experts: int = 64,
                    skew: float = 0.4, drift: float = 0.05, seed: int = 0,
                    tokens_per_rank: int = 4096, top_k: int = 2, hidden: int = 2048,
                    rank_affinity: float = 0.3, persistence: float = 0.95,
                    batch_noise: float = 0.05, step_stride: int = 50) -> RoutingTrace:
    """A routing trace with Zipf-like expert popularity that drifts over time.

    Per layer, expert e has log-popularity  w_t[e] = -skew * log(1 + rank[e]) + u_t[e]:
    rank is a random permutation of 0..E-1 (Zipf exponent ``skew``), u is a mean-reverting
    random walk  u_t = persistence * u_{t-1} + drift * N(0, 1)  (u_0 ~ N(0, drift^2)).
    Each source rank adds a fixed affinity  a[r, e] ~ N(0, rank_affinity^2)  (data locality),
    and each step a transient batch effect  b_t[e] ~ N(0, batch_noise^2)  (what the batch is
    about), shared by the ranks. Routing probabilities are softmax(w_t + b_t + a[r]) capped at
    1 / top_k (an expert appears once per token's top-k); counts[t, l, r] ~
    Multinomial(tokens_per_rank * top_k, p). Rows are recorded every ``step_stride`` training
    steps (the ``steps`` field).

    The defaults are a modelling choice, not a measurement: skewed loads (skew 0.4, the
    hottest of 64 experts gets ~3.6x the mean) that shift gradually (drift 0.05 per row) with
    small step-to-step noise (batch_noise 0.05: one-step MAPE ~7 %); ``batch_noise=0.15``
    gives a noisier workload (one-step MAPE ~15 %).
    Returns a RoutingTrace with counts int64 [steps, layers, ranks, experts].
    """
    if min(steps, layers, ranks, experts, tokens_per_rank, top_k, step_stride) < 1:
        raise ValueError("synthetic_trace sizes must all be positive integers.")
    if top_k > experts or skew < 0 or drift < 0 or not 0 <= persistence < 1:
        raise ValueError(f"synthetic_trace needs top_k <= experts, skew >= 0, drift >= 0 and "
                         f"persistence in [0, 1), but got top_k={top_k}, skew={skew}, "
                         f"drift={drift}, persistence={persistence}.")
    rng = np.random.default_rng(seed)
    base_LE = -skew * np.log1p(np.stack([rng.permutation(experts) for _ in range(layers)]))
    affinity_LRE = rank_affinity * rng.standard_normal((layers, ranks, experts))
    u_LE = drift * rng.standard_normal((layers, experts))
    counts = np.zeros((steps, layers, ranks, experts), dtype=np.int64)
    for t in range(steps):
        if t:
            u_LE = persistence * u_LE + drift * rng.standard_normal((layers, experts))
        batch_LE = batch_noise * rng.standard_normal((layers, experts))
        logits = (base_LE + u_LE + batch_LE)[:, None, :] + affinity_LRE
        p = np.exp(logits - logits.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        for _ in range(4):                           # cap at 1/top_k, renormalise
            p = np.minimum(p, 1.0 / top_k)
            p /= p.sum(axis=-1, keepdims=True)
        counts[t] = rng.multinomial(tokens_per_rank * top_k, p)
    return RoutingTrace(counts=counts, top_k=top_k, hidden=hidden,
                        tokens_per_rank=tokens_per_rank,
                        steps=np.arange(steps, dtype=np.int64) * step_stride)


def _load(trace: TraceInput) -> Tuple[str, RoutingTrace]:
    if isinstance(trace, str):
        return os.path.basename(trace), load_trace(trace)
    name, tr = trace
    if not isinstance(tr, RoutingTrace):
        raise ValueError(f"trace '{name}' must be a RoutingTrace, but got {type(tr).__name__}.")
    return name, tr


def _truncate(trace: RoutingTrace, rows: int, layers: int) -> RoutingTrace:
    """The last ``rows`` rows and the first ``layers`` layers of ``trace``.

    Why the last rows: the first steps of a training run are its least representative part
    (the router is still moving fast: on the demo run, expert loads change several-fold from
    one step to the next during the first ~50 of 300 steps, while a real run lasts 10^4-10^5
    steps whose routing drifts slowly). The tail is the steady state that the bulk of a long
    run looks like, and it keeps consecutive rows, so the predictors see the trace's own
    stride. A full (non-quick) run replays every row, the early phase included.
    """
    steps = None if trace.steps is None else trace.steps[-rows:]
    return RoutingTrace(counts=trace.counts[-rows:, :layers], top_k=trace.top_k,
                        hidden=trace.hidden, tokens_per_rank=trace.tokens_per_rank, steps=steps)


def run_simulated(traces: Sequence[TraceInput], cluster: Union[None, str, ClusterSpec] = None,
                  quick: bool = False, methods: Sequence[str] = METHODS,
                  config: ReplayConfig = ReplayConfig()) -> List[Dict[str, object]]:
    """Replay every trace under every method; rows in issue 4's JSON format.

    traces: paths of ``.npz`` traces (workload = file name) or (name, RoutingTrace) pairs.
    cluster: a ClusterSpec, a preset name, or None (per trace: ceil(ranks / 8) 910B nodes).
    quick: only the last QUICK_ROWS rows and the first QUICK_LAYERS layers of each trace
        (:func:`_truncate` says why the last rows).
    Method rows: {"evidence": "simulated", "workload", "method", "cluster", iteration_time_s,
    a2a_time_s, max_over_mean_load, padding_fraction, drop_rate, replans, replan_overhead_s}.
    Predictor rows: {"evidence", "workload", "method": predictor name, "mape" (percent, mean
    over layers), "mape_per_layer"}. Static-limit rows (a yardstick for the padding target):
    {"method": "static-limit", "window_rows", "padding_fraction", "drop_rate"}, the least
    padding at ``config.drop_target`` drops of any static-capacity plan re-planned every
    ``window_rows`` trace rows, capacities chosen knowing the loads
    (:func:`~ms_efficient.moe.capacity.static_capacity_limit`).
    """
    spec = get_cluster(cluster) if isinstance(cluster, str) else cluster
    rows: List[Dict[str, object]] = []
    for item in traces:
        name, trace = _load(item)
        if quick:
            trace = _truncate(trace, QUICK_ROWS, QUICK_LAYERS)
        target = spec or cluster_for_ranks(trace.num_ranks)
        for method in methods:
            result = replay(trace, method, target, config)
            rows.append({"evidence": "simulated", "workload": name, "method": method,
                         "cluster": target.name, **result.metrics()})
            logger.info("%s %s: %.4g s/step", name, method, result.iteration_time_s)
        loads = trace.expert_load().astype(np.float64)
        for window in sorted({w for w in LIMIT_WINDOWS if w < trace.num_steps}
                             | {trace.num_steps}):
            pad, drop = static_capacity_limit(loads, config.drop_target, window)
            rows.append({"evidence": "simulated", "workload": name, "method": "static-limit",
                         "window_rows": window, "padding_fraction": pad, "drop_rate": drop})
        mape = evaluate_predictors(trace.expert_load(),
                                   [get_predictor(p) for p in PREDICTOR_NAMES],
                                   warmup=min(config.warmup, trace.num_steps - 1))
        for pred_name, per_layer in mape.items():
            rows.append({"evidence": "simulated", "workload": name, "method": pred_name,
                         "mape": float(per_layer.mean()),
                         "mape_per_layer": [round(float(v), 3) for v in per_layer]})
    return rows


def speedups(rows: Sequence[Dict[str, object]],
             method: str = "efficientmoe") -> Dict[str, Dict[str, float]]:
    """Per workload: {other method: its iteration time / ``method``'s} (> 1: ``method`` faster)."""
    out: Dict[str, Dict[str, float]] = {}
    timed = [r for r in rows if "iteration_time_s" in r]
    for r in timed:
        if r["method"] != method:
            continue
        mine = float(r["iteration_time_s"])
        out[str(r["workload"])] = {str(o["method"]): float(o["iteration_time_s"]) / mine
                                   for o in timed if o["workload"] == r["workload"]
                                   and o["method"] != method}
    return out


def markdown_table(rows: Sequence[Dict[str, object]], reference: str = REFERENCE) -> str:
    """Markdown tables: methods (time in ms, speed-up over ``reference``, a2a, imbalance,
    padding, drops, re-plans) and predictors (MAPE %)."""
    timed = [r for r in rows if "iteration_time_s" in r]
    ref = {r["workload"]: float(r["iteration_time_s"]) for r in timed if r["method"] == reference}
    lines = [f"| workload | method | iteration ms | speed-up vs {reference} | a2a ms | "
             f"max/mean load | padding % | drop % | re-plans (forced) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in timed:
        t = float(r["iteration_time_s"])
        speed = f"{ref[r['workload']] / t:.2f}x" if r["workload"] in ref else "-"
        lines.append(f"| {r['workload']} | {r['method']} | {1e3 * t:.3f} | {speed} | "
                     f"{1e3 * float(r['a2a_time_s']):.3f} | {float(r['max_over_mean_load']):.2f} | "
                     f"{100 * float(r['padding_fraction']):.1f} | "
                     f"{100 * float(r['drop_rate']):.2f} | {r.get('replans', 0)} "
                     f"({r.get('forced_replans', 0)}) |")
    limits = [r for r in rows if r.get("method") == "static-limit"]
    if limits:
        lines += ["", "| workload | static plan held for (trace rows) | least padding % | "
                      "drop % |", "|---|---:|---:|---:|"]
        lines += [f"| {r['workload']} | {r['window_rows']} | "
                  f"{100 * float(r['padding_fraction']):.1f} | "
                  f"{100 * float(r['drop_rate']):.2f} |" for r in limits]
    predicted = [r for r in rows if "mape" in r]
    if predicted:
        lines += ["", "| workload | predictor | MAPE % (mean over layers) | per layer |",
                  "|---|---|---:|---|"]
        lines += [f"| {r['workload']} | {r['method']} | {float(r['mape']):.2f} | "
                  f"{', '.join(f'{v:.1f}' for v in r.get('mape_per_layer', []))} |"
                  for r in predicted]
    return "\n".join(lines)
