"""MoE benchmark rows: every planning method on the same inputs, simulated and measured.

Simulated (``evidence: "simulated"``): :func:`run_simulated` replays the same traces under every
method on a simulated cluster, :func:`markdown_table` renders them with speed-ups against
Switch CF 1.25. No MindSpore import at module level.

Measured (``evidence: "measured"``): :func:`run_measured` trains the reference model on this
CPU under each capacity policy, each method in a fresh child process (its graphs and memory
pool end with it). Every method trains the same network from the same seed on the same
batches for the same number of steps; only the expert capacities differ. Rows report
the median step time (MindSpore GRAPH_MODE on CPU, excluding the compiling first step) AND
the total wall time of all steps with that compile included (``total_wall_s``; ``compile_s``
= what the first step took beyond the median), the
padding fraction (computed slot rows that held no token / computed
slot rows) and the drop rate (assignments that found no slot / assignments), both over the
whole run.

Methods that differ only in where experts live on several devices (EfficientMoE's two levels,
FasterMoE shadowing, EPLB, MoonEP, the bound) have nothing to change on one CPU process; they
appear in the simulated rows only (EfficientMoE's measured multi-device runs are ``train
--workers``). The measured ``grouped-kernel-1proc`` row is the padding-free grouped layer on
one process: the kernel, not a planner.
"""
from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import tempfile
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from ms_efficient.core.cluster import ClusterSpec, get_cluster
from ms_efficient.core.config import RunConfig
from ms_efficient.efficientmoe.capacity import static_capacity_limit
from ms_efficient.efficientmoe.replay import (DEFAULT_METHODS, ReplayConfig, cluster_for_ranks,
                                             replay)
from ms_efficient.moe.trace import RoutingTrace, load_trace

__all__ = ["run_simulated", "speedups", "markdown_table", "targets_table", "held_back",
           "TARGETS", "QUICK_ROWS", "QUICK_LAYERS",
           "run_measured", "quick_config", "MEASURED_METHODS"]

logger = logging.getLogger(__name__)

QUICK_ROWS = 64     # --quick: the LAST rows of each trace ...
QUICK_LAYERS = 2    # ... and its first layers: the 32-rank, 64-expert synthetic trace in ~10 s
REFERENCE = "switch-cf1.25"
LIMIT_WINDOWS = (1, 2, 5, 10, 20)   # trace rows a static plan is held, for static-limit rows

TraceInput = Union[str, Tuple[str, RoutingTrace]]


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
    run looks like, and it keeps consecutive rows, so the slow level's window sees the
    trace's own stride. A full (non-quick) run replays every row, the early phase included.
    """
    steps = None if trace.steps is None else trace.steps[-rows:]
    return RoutingTrace(counts=trace.counts[-rows:, :layers], top_k=trace.top_k,
                        hidden=trace.hidden, tokens_per_rank=trace.tokens_per_rank, steps=steps)


def run_simulated(traces: Sequence[TraceInput], cluster: Union[None, str, ClusterSpec] = None,
                  quick: bool = False, methods: Sequence[str] = DEFAULT_METHODS,
                  config: ReplayConfig = ReplayConfig()) -> List[Dict[str, object]]:
    """Replay every trace under every method; rows in issue 4's JSON format.

    traces: paths of ``.npz`` traces (workload = file name) or (name, RoutingTrace) pairs.
    cluster: a ClusterSpec, a preset name, or None (per trace: ceil(ranks / 8) 910B nodes).
    quick: only the last QUICK_ROWS rows and the first QUICK_LAYERS layers of each trace
        (:func:`_truncate` says why the last rows).
    Method rows: {"evidence": "simulated", "workload", "method", "cluster", iteration_time_s,
    a2a_time_s, max_over_mean_load, padding_fraction, drop_rate, replans, replan_overhead_s}.
    Static-limit rows (a yardstick for the padding target):
    {"method": "static-limit", "window_rows", "padding_fraction", "drop_rate"}, the least
    padding at ``config.drop_target`` drops of any static-capacity plan re-planned every
    ``window_rows`` trace rows, capacities chosen knowing the loads
    (:func:`~ms_efficient.efficientmoe.capacity.static_capacity_limit`).
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
    """Markdown tables: methods (time in ms, speed-up over ``reference``, efficientmoe's
    speed-up over the method, All-to-All ms and its share of the layer time (count exchange
    included), imbalance, padding, drops, re-plans, what the row was charged per layer-step
    for the fast level and per count-driven exchange) and the static-limit yardstick."""
    timed = [r for r in rows if "iteration_time_s" in r]
    ref = {r["workload"]: float(r["iteration_time_s"]) for r in timed if r["method"] == reference}
    ours = {r["workload"]: float(r["iteration_time_s"]) for r in timed
            if r["method"] == "efficientmoe"}
    lines = [f"| workload | method | iteration ms | speed-up vs {reference} | "
             f"efficientmoe's speed-up over it | a2a ms | a2a share % | "
             f"max/mean load | padding % | drop % | re-plans (forced) | copies/step | "
             f"copied GB/step | fast level ms charged | dynamic exchange ms charged |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in timed:
        t = float(r["iteration_time_s"])
        speed = f"{ref[r['workload']] / t:.2f}x" if r["workload"] in ref else "-"
        gain = f"{t / ours[r['workload']]:.2f}x" if r["workload"] in ours else "-"
        a2a = float(r["a2a_time_s"])
        lines.append(f"| {r['workload']} | {r['method']} | {1e3 * t:.3f} | {speed} | {gain} | "
                     f"{1e3 * a2a:.3f} | {100 * a2a / t if t > 0 else 0.0:.1f} | "
                     f"{float(r['max_over_mean_load']):.2f} | "
                     f"{100 * float(r['padding_fraction']):.1f} | "
                     f"{100 * float(r['drop_rate']):.2f} | {r.get('replans', 0)} "
                     f"({r.get('forced_replans', 0)}) | "
                     + (f"{float(r['copies_per_step']):.1f} | "
                        f"{float(r['weight_bytes_per_step']) / 1e9:.2f} |"
                        if "copies_per_step" in r else "- | - |")
                     + (f" {1e3 * float(r['fast_level_s']):.3f} | "
                        f"{1e3 * float(r['dynamic_exchange_s']):.3f} |"
                        if "fast_level_s" in r else " - | - |"))
    limits = [r for r in rows if r.get("method") == "static-limit"]
    if limits:
        lines += ["", "| workload | static plan held for (trace rows) | least padding % | "
                      "drop % |", "|---|---:|---:|---:|"]
        lines += [f"| {r['workload']} | {r['window_rows']} | "
                  f"{100 * float(r['padding_fraction']):.1f} | "
                  f"{100 * float(r['drop_rate']):.2f} |" for r in limits]
    return "\n".join(lines)


# issue 32's targets for the default row: (label, other method or group, least ratio of the
# other's iteration time to ours)
TARGETS = (("FasterMoE", ("fastermoe",), 1.3), ("best eplb-* row", ("eplb-",), 1.2),
           ("MoonEP", ("moonep",), 1.0), ("lower bound", ("oracle-bound",), 0.8))


def held_back(ours: Dict[str, object], needed_s: float) -> str:
    """What holds a missed target back: the milliseconds per iteration ``ours`` must lose to
    reach ``needed_s``, and its step's terms (``terms_ms`` of a two-level row: exchange and
    dynamic-shape overhead, tokens, copies, compute, sync, fast level), largest first."""
    gap_ms = 1e3 * (float(ours["iteration_time_s"]) - needed_s)
    terms = ours.get("terms_ms") or {}
    parts = ", ".join(f"{name} {ms:.1f}" for name, ms in
                      sorted(terms.items(), key=lambda kv: -kv[1]))
    return f"{gap_ms:.1f} ms/iteration short" + (f" (ours, ms: {parts})" if parts else "")


def targets_table(rows: Sequence[Dict[str, object]], method: str = "efficientmoe") -> str:
    """Per workload, ``method``'s standing against issue 32's targets (met / MISSED), with
    the figures that explain a miss: its max/mean load, All-to-All share, copies and copied
    bytes per step, drops. "" when ``method`` has no row."""
    timed = [r for r in rows if "iteration_time_s" in r]
    lines = ["| workload | target | ratio | met | why (ours: max/mean load, a2a share, "
             "copies/step, copied GB/step, drops) |", "|---|---|---:|---|---|"]
    for ours in (r for r in timed if r["method"] == method):
        t = float(ours["iteration_time_s"])
        why = (f"{float(ours['max_over_mean_load']):.2f}, "
               f"{100 * float(ours['a2a_time_s']) / t:.0f}%, "
               f"{float(ours.get('copies_per_step', 0)):.0f}, "
               f"{float(ours.get('weight_bytes_per_step', 0)) / 1e9:.2f}, "
               f"{100 * float(ours['drop_rate']):.3f}%")
        for label, names, least in TARGETS:
            others = [float(o["iteration_time_s"]) for o in timed
                      if o["workload"] == ours["workload"]
                      and any(o["method"] == n or (n.endswith("-") and o["method"].startswith(n))
                              for n in names)]
            if not others:
                continue
            ratio = min(others) / t
            held = "" if ratio >= least else "; " + held_back(ours, min(others) / least)
            lines.append(f"| {ours['workload']} | >= {least:g}x {label} | {ratio:.2f}x | "
                         f"{'met' if ratio >= least else 'MISSED'} | {why}{held} |")
        drops = float(ours["drop_rate"])
        lines.append(f"| {ours['workload']} | drops <= 0.1% | {100 * drops:.3f}% | "
                     f"{'met' if drops <= 0.001 else 'MISSED'} | recompiles after the first "
                     f"compile: {int(ours.get('recompiles', 0))} |")
    return "\n".join(lines) if len(lines) > 2 else ""


# ---- measured rows (MindSpore on this CPU) ----------------------------------------------
# method label -> (moe.capacity_factor, moe.dispatch)
MEASURED_METHODS = {
    "switch-cf1.0": (1.0, "static"),
    "switch-cf1.25": (1.25, "static"),
    "switch-cf2.0": (2.0, "static"),
    # capacity = tokens per step: the only static capacity that can never drop for any routing
    "dropless-static": (0.0, "static"),
    # The padding-free grouped layer on one process: the grouped-matmul kernel against the
    # padded BatchMatMul layers, NOT EfficientMoE's planner (one device has no replicas to
    # place and one buffer of all assignments, so no planner runs); also what a MegaBlocks-
    # style dropless grouped layer is on one device. EfficientMoE's multi-device figures
    # are the simulated rows and the `train --workers` run.
    "grouped-kernel-1proc": (0.0, "grouped"),
}
# the run whose routing trace ``run_measured(keep_trace=...)`` keeps: nothing dropped
TRACED_METHOD = "grouped-kernel-1proc"


def quick_config(cfg: RunConfig) -> RunConfig:
    """A smaller model and run for ``--quick`` (about a minute for all methods)."""
    cfg = copy.deepcopy(cfg)
    cfg.model.hidden_size, cfg.model.ffn_hidden_size, cfg.model.num_heads = 64, 128, 2
    cfg.model.num_layers, cfg.model.seq_length = 2, 64
    cfg.train.batch_size, cfg.train.steps = 8, 20
    cfg.moe.trace_ranks = 4
    return cfg


def _run_one(cfg: RunConfig, out_dir: str, init_from: Optional[str],
             timeout_s: float = 3600.0) -> Dict:
    """Train ``cfg`` into ``out_dir`` in a fresh child process (``python -m
    ms_efficient.efficientmoe.bench``, :func:`_child`): each method's graphs, buffers and
    allocator pool live and die with its own process, so one method's memory neither
    lingers into the next nor sets its step times (in one process the six methods of the
    tiny config held 10.4 GB at the end, 10 steps each). MindSpore's graph pipeline is off in
    the child, as the CLI's ``train`` runs (``core.backend.run_json_child``). Returns the
    child's {"result": TrainResult fields, "rows", "step_times", "totals"};
    RuntimeError with its stderr tail if it fails."""
    from ms_efficient.core import backend

    spec = json.dumps({"config": cfg.to_dict(), "out_dir": out_dir, "init_from": init_from})
    return backend.run_json_child("ms_efficient.efficientmoe.bench", spec,
                                  cfg.context.device_target, timeout_s,
                                  f"measured run of {out_dir}")


def _child(spec: str) -> None:
    """The child of :func:`_run_one`: train, then print one JSON line of what it measured."""
    import dataclasses
    import sys

    from ms_efficient.core.config import config_from_dict
    from ms_efficient.train.trainer import Trainer

    args = json.loads(spec)
    cfg = config_from_dict(args["config"])
    out_dir = args["out_dir"]
    trainer = Trainer(cfg, out_dir)
    if args["init_from"]:
        trainer.load_weights(args["init_from"], keep_step=False)
    result = trainer.run()
    with open(os.path.join(out_dir, "metrics.jsonl"), encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    # the child's answer to run_json_child on its stdout (the protocol, not a log line)
    sys.stdout.write(json.dumps({"result": dataclasses.asdict(result), "rows": rows,
                                 "step_times": [float(t) for t in trainer.step_times],
                                 "totals": {k: int(v) for k, v in trainer.totals.items()}})
                     + "\n")
    sys.stdout.flush()


def run_measured(base: RunConfig, methods: Optional[List[str]] = None, steps: Optional[int] = None,
                 workload: str = "gpt_moe", init_from: Optional[str] = None,
                 keep_trace: Optional[str] = None) -> List[Dict]:
    """Train ``base`` once per method; returns benchmark rows (evidence "measured").

    keep_trace: copy the routing trace of the ``TRACED_METHOD`` run (dropless: the
        routing, nothing cut) to this path.
    init_from: a run folder whose last checkpoint every method starts from (routing of a
    trained model is steadier than at initialisation, which is where static capacities are
    decided in practice); its learning rate continues at the schedule's floor (10% of peak)
    with no warm-up.
    """
    methods = list(methods or MEASURED_METHODS)
    rows = []
    for method in methods:
        if method not in MEASURED_METHODS:
            raise ValueError(f"measured method must be one of {list(MEASURED_METHODS)}, "
                             f"but got {method!r}.")
        cf, dispatch = MEASURED_METHODS[method]
        cfg = copy.deepcopy(base)
        cfg.moe.capacity_factor = cf
        cfg.moe.dispatch = dispatch
        cfg.efficientmoe.enabled = False
        cfg.train.eval_every = cfg.train.steps = steps or cfg.train.steps
        cfg.train.save_every = cfg.train.steps
        if init_from:
            cfg.train.warmup_steps = 0
            cfg.train.learning_rate = 0.1 * base.train.learning_rate
        with tempfile.TemporaryDirectory(prefix=f"bench-{method}-") as out:
            logger.info("measured run: %s (%d steps)", method, cfg.train.steps)
            run = _run_one(cfg, out, init_from)
            if keep_trace and method == TRACED_METHOD:
                shutil.copyfile(os.path.join(out, "trace.npz"), keep_trace)
        times = np.array(run["step_times"])
        steady = list(times[1:]) or list(times)          # the compiling first step out
        tot = run["totals"]
        median = float(np.median(steady))
        rows.append({
            "evidence": "measured", "workload": workload, "method": method,
            "step_time_s": median,
            # every step, the compiling first one included
            "total_wall_s": float(times.sum()),
            "compile_s": float(max(0.0, times[0] - median)) if len(times) else 0.0,
            "padding_fraction": 1.0 - tot["kept"] / max(1, tot["rows"]),
            "drop_rate": 1.0 - tot["kept"] / max(1, tot["assigned"]),
            "final_val_loss": run["result"]["final_val_loss"],
            "steps": cfg.train.steps})
    dropless = [r for r in rows if r["method"] == "dropless-static"]
    for r in rows:
        if dropless:
            r["step_time_vs_dropless"] = r["step_time_s"] / dropless[0]["step_time_s"]
            r["wall_vs_dropless"] = r["total_wall_s"] / dropless[0]["total_wall_s"]
    return rows


if __name__ == "__main__":                     # the child of _run_one
    import sys

    _child(sys.argv[1])
