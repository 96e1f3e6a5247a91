"""EfficientMoE from routing traces: the two-level layout (home experts, spare slots, buffers).

    ms-efficient plan moe --trace FILE.npz [--cluster NAME] [--slots N] [--last N]
                          --out plan.yaml
    ms-efficient bench moe [--quick] [--trace FILE.npz ...] [--cluster NAME] --json OUT
                           [--config CONFIG] [--steps N] [--init-from RUN_DIR]
                           [--no-measured | --no-simulated]

The bench runs two kinds of evidence, never mixed in one number: measured rows (the reference
model trained on this CPU under each capacity policy, see ``bench.run_measured``) and simulated
rows (traces replayed on an Ascend cluster preset, see ``bench`` and ``simulate``). The
routing trace of the measured dropless run is replayed too.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time

from ms_efficient.core.argtypes import positive_int

__all__ = ["add_plan_arguments", "run_plan", "add_bench_arguments", "run_bench"]


DEFAULT_CONFIG = "configs/gpt_moe_tiny.yaml"
MEASURED_STEPS = 40     # per measured method
MEASURED_COLUMNS = ("workload", "method", "step_time_s", "step_time_vs_dropless",
                    "total_wall_s", "wall_vs_dropless", "compile_s", "padding_fraction",
                    "drop_rate", "final_val_loss", "steps")


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True, help="routing trace (.npz, see docs/formats.md)")
    parser.add_argument("--cluster", help="cluster preset (default: 8-chip Ascend 910B nodes, "
                                          "as many as the trace's ranks need)")
    parser.add_argument("--last", type=positive_int, metavar="N",
                        help="plan from the trace's last N steps only (default: all). A trace "
                             "recorded from initialisation holds the router's early, volatile "
                             "steps")
    parser.add_argument("--slots", type=int, default=1, metavar="N",
                        help="expert slots per device beyond ceil(E / W), for redundant "
                             "home replicas or per-step copies (default 1)")
    parser.add_argument("--out", required=True, help="plan YAML to write")


def _plan_balanced(trace, cluster, args) -> int:
    """``plan moe``: the slow level's layout, written as YAML, with the
    fast level's replay on the trace's last rows printed (simulated)."""
    from ms_efficient.efficientmoe.cost import CostModel
    from ms_efficient.efficientmoe.planner import LayoutConfig, plan_layout, replay_cost_s, save_layout
    from ms_efficient.efficientmoe.replay import check_trace_fits, cluster_for_ranks

    if args.slots < 0:
        raise ValueError(f"'--slots' must be >= 0, but got {args.slots}.")
    cluster = cluster or cluster_for_ranks(trace.num_ranks)
    check_trace_fits(trace, cluster)
    hidden = trace.hidden or 1024
    model = CostModel(cluster, hidden, 4 * hidden)
    config = LayoutConfig(slots=args.slots)
    start = time.perf_counter()
    layout = plan_layout(trace.counts, model, config)
    took = time.perf_counter() - start
    recent = trace.counts[-config.window:]
    step_s, worst_L = replay_cost_s(recent, layout.home_LWS, layout.spare_W, model,
                                    layout.buffer_LW, layout.sync_rows)
    save_layout(args.out, layout, {"trace": os.path.basename(args.trace),
                                   "cluster": cluster.name, "hidden": hidden})
    mean = recent.sum(axis=(2, 3)).mean() / trace.num_ranks
    for layer in range(layout.num_layers):
        print(f"layer {layer}: buffer {int(layout.buffer_LW[layer, 0])} rows per device "
              f"({layout.buffer_LW[layer, 0] / mean:.2f}x the mean share), balanced max/mean "
              f"{worst_L[layer]:.2f} on the last {len(recent)} rows")
    print(f"layout: {layout.redundant} redundant home slot(s) and "
          f"{int(layout.spare_W[0])} spare slot(s) per device, a replica-gradient table of "
          f"{layout.sync_rows} expert(s), planned in {took:.2f} s; "
          f"simulated MoE time per step on the last {len(recent)} rows "
          f"{1e3 * step_s:.4g} ms ({cluster.name}, H={hidden})")
    print(f"layout written to {args.out}")
    return 0


def run_plan(args: argparse.Namespace) -> int:
    from ms_efficient.core.cluster import get_cluster
    from ms_efficient.moe.trace import load_trace

    trace = load_trace(args.trace)
    if args.last is not None:
        if args.last < 2 or args.last > trace.num_steps:
            raise ValueError(f"'--last' must be in [2, {trace.num_steps}] (the trace's steps), "
                             f"but got {args.last}.")
        trace = dataclasses.replace(trace, counts=trace.counts[-args.last:],
                                    steps=None if trace.steps is None
                                    else trace.steps[-args.last:])
    cluster = get_cluster(args.cluster) if args.cluster else None
    return _plan_balanced(trace, cluster, args)


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="small model and short replays (about a minute)")
    parser.add_argument("--trace", nargs="*", default=[], metavar="FILE",
                        help="extra routing traces to replay (.npz)")
    parser.add_argument("--cluster", help="cluster preset for the simulated rows")
    parser.add_argument("--json", required=True, help="write the rows here")
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="model for the measured rows")
    parser.add_argument("--steps", type=int,
                        help=f"training steps per measured method (default {MEASURED_STEPS}; "
                             f"--quick: 20). With the default, the measured methods (each in "
                             f"its own process) and the simulated rows took about 9 minutes "
                             f"on 2 cores (most of it training); the config's own "
                             f"train.steps (300 for the default config) would take far "
                             f"longer")
    parser.add_argument("--init-from", help="run folder whose checkpoint every measured "
                                            "method starts from (e.g. runs/demo)")
    parser.add_argument("--no-measured", action="store_true",
                        help="simulated rows only (no MindSpore training)")
    parser.add_argument("--no-simulated", action="store_true",
                        help="measured rows only (no trace replay)")
    parser.add_argument("--fast-level-ms", type=float, default=None, metavar="MS",
                        help="charge the two-level methods' fast level this many ms per MoE "
                             "layer-step (default: what the cluster's target compiles: on a "
                             "910B preset the MindSpore-ops twin's launched kernels for that "
                             "step x the preset's op_launch_s; on cpu-local cost.FAST_LEVEL_S "
                             "= 0.75 ms, the compiled kernel; scripts/time_fast_level.py "
                             "measures the twins here)")
    parser.add_argument("--methods", nargs="+", metavar="M",
                        help="simulated methods to replay (default: "
                             "ms_efficient.efficientmoe.replay.DEFAULT_METHODS; any of "
                             "METHODS)")
    parser.add_argument("--deepseek-layers", type=int, default=DEEPSEEK_LAYERS, metavar="L",
                        help="layers of the DeepSeek-V3-shaped workload (64 ranks x 256 "
                             "experts, top-8, group-limited routing: "
                             "moe.trace.group_limited_trace; its full 58 layers take about "
                             "7x as long); 0: skip it")
    parser.add_argument("--skew", nargs="*", type=float, default=[1.45], metavar="S",
                        help="Zipf exponents of the skewed 16-rank top-1 traces to replay "
                             "(moe.trace.skewed_trace; 1.45: max/mean load ~13, top-2 "
                             "experts ~56%% of a layer's tokens); none: skip them")


# the DeepSeek-V3-shaped workload (moe.trace.group_limited_trace): its first 8 MoE layers by
# default, rows 10 training steps apart, its experts' sizes (hidden 7168, expert FFN 2048,
# gated, no biases; DeepSeek-V3 technical report sec. 4.2)
DEEPSEEK_LAYERS = 8
DEEPSEEK_RANKS = 64
DEEPSEEK_WORKLOAD = "deepseek-v3-64r"


def _deepseek_rows(args: argparse.Namespace, methods) -> list:
    """The simulated rows of the DeepSeek-V3-shaped workload (``--deepseek-layers`` layers,
    40 rows; --quick: 2 layers, 24 rows) under ``methods``."""
    from ms_efficient.efficientmoe.bench import run_simulated
    from ms_efficient.efficientmoe.replay import ReplayConfig
    from ms_efficient.moe.trace import group_limited_trace

    trace = group_limited_trace(steps=24 if args.quick else 40,
                                layers=2 if args.quick else args.deepseek_layers,
                                ranks=DEEPSEEK_RANKS)
    config = ReplayConfig(fast_level_s=_fast_level_s(args), ffn_hidden=2048,
                          expert_kind="glu", expert_bias=False)
    return run_simulated([(DEEPSEEK_WORKLOAD, trace)], args.cluster, False, methods=methods,
                         config=config)


def _fast_level_s(args: argparse.Namespace):
    """``--fast-level-ms`` in seconds, or None (charged as the cluster's target compiles)."""
    return None if args.fast_level_ms is None else args.fast_level_ms / 1e3


def run_bench(args: argparse.Namespace) -> int:
    from ms_efficient.core import benchio
    from ms_efficient.core.benchio import write_bench_json
    from ms_efficient.core.config import load_config
    from ms_efficient.efficientmoe.bench import markdown_table, run_simulated, targets_table
    from ms_efficient.moe.trace import skewed_trace, synthetic_trace
    from ms_efficient.moe.trace import load_trace

    if args.steps is not None and args.steps < 1:
        raise ValueError(f"'--steps' must be a positive integer, but got {args.steps}.")
    if args.fast_level_ms is not None and not 0.0 <= args.fast_level_ms < float("inf"):
        raise ValueError(f"'--fast-level-ms' must be a finite number >= 0 milliseconds, but "
                         f"got {args.fast_level_ms}.")
    if args.no_measured and args.no_simulated:
        raise ValueError("'--no-measured' and '--no-simulated' together leave nothing to run; "
                         "give at most one of them.")
    from ms_efficient.efficientmoe.replay import DEFAULT_METHODS, METHODS

    unknown = [m for m in args.methods or () if m not in METHODS]
    if unknown:
        raise ValueError(f"'--methods' names unknown method {unknown[0]!r}; allowed: "
                         f"{list(METHODS)}.")
    if not 0 <= args.deepseek_layers <= 58:
        raise ValueError(f"'--deepseek-layers' must be in [0, 58] (DeepSeek-V3 has 58 MoE "
                         f"layers), but got {args.deepseek_layers}.")
    bad_skew = [s for s in args.skew if not 0 <= s <= 4]
    if bad_skew:
        raise ValueError(f"'--skew' values must be in [0, 4], but got {bad_skew[0]}.")
    traces = [(os.path.basename(p), load_trace(p)) for p in args.trace]   # validate first
    if args.cluster:
        from ms_efficient.core.cluster import get_cluster

        spec = get_cluster(args.cluster)
        if args.deepseek_layers and not args.no_simulated and spec.num_devices < DEEPSEEK_RANKS:
            raise ValueError(f"'--cluster' {spec.name} has {spec.num_devices} devices, but the "
                             f"DeepSeek-V3-shaped workload runs {DEEPSEEK_RANKS} ranks; pass a "
                             f"cluster with >= {DEEPSEEK_RANKS} devices, or '--deepseek-layers "
                             f"0' to skip that workload.")
    start = time.perf_counter()
    rows = []
    if not args.no_measured:
        from ms_efficient.efficientmoe.bench import quick_config, run_measured

        cfg = load_config(args.config)
        if args.quick:
            cfg = quick_config(cfg)
        with tempfile.TemporaryDirectory(prefix="bench-moe-trace-") as keep:
            trace_path = os.path.join(keep, "trace.npz")
            steps = args.steps or (None if args.quick else MEASURED_STEPS)
            rows += run_measured(cfg, steps=steps, init_from=args.init_from,
                                 workload=os.path.splitext(os.path.basename(args.config))[0],
                                 keep_trace=trace_path)
            if os.path.isfile(trace_path):
                traces.insert(0, ("measured-routing-trace", load_trace(trace_path)))
    synthetic = synthetic_trace(steps=40 if args.quick else 128)   # --quick: under a minute
    traces.append(("synthetic-32r", synthetic))
    for skew in args.skew:
        traces.append((f"skewed-16r-s{skew:g}", skewed_trace(steps=40 if args.quick else 100,
                                                             skew=skew)))
    measured = [r for r in rows if r["evidence"] == "measured"]
    from ms_efficient.efficientmoe.replay import ReplayConfig

    if not args.no_simulated:
        rows += run_simulated(traces, args.cluster, args.quick, methods=args.methods or DEFAULT_METHODS,
                              config=ReplayConfig(fast_level_s=_fast_level_s(args)))
        if args.deepseek_layers:
            rows += _deepseek_rows(args, args.methods or DEFAULT_METHODS)
    if measured:
        print("Measured (MindSpore GRAPH_MODE on this CPU):")
        print(benchio.markdown_table(measured, MEASURED_COLUMNS))
        print()
    if not args.no_simulated:
        print("Simulated (trace replay on the cluster preset):")
        print(markdown_table(rows))
        for method in ("efficientmoe", "efficientmoe-fixed-home"):
            checks = targets_table(rows, method)
            if checks:
                print()
                print(f"Targets of {method}:" if method != "efficientmoe" else
                      "Targets of efficientmoe (the default):")
                print(checks)
    write_bench_json(args.json, "moe", rows,
                     meta={"quick": args.quick, "seconds": round(time.perf_counter() - start, 1),
                           "config": args.config, "init_from": args.init_from,
                           "fast_level_ms": args.fast_level_ms})
    print(f"rows written to {args.json}")
    return 0
