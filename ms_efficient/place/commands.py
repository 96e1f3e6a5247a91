"""TGA placement: partition a graph into pipeline stages on devices (plan place / bench place).

    ms-efficient plan place GRAPH_OR_CONFIG --cluster NAME --out plan.yaml
    ms-efficient bench place [--quick] [--graph FILE ...] [--devices N] --json OUT

No MindSpore import at module level (a config YAML imports it to export the model graph).
"""
from __future__ import annotations

import argparse
import logging
import os
import time
from typing import Dict, List, Tuple

from ms_efficient.core.argtypes import positive_float, positive_int as _positive_int

__all__ = ["add_plan_arguments", "run_plan", "add_bench_arguments", "run_bench"]

logger = logging.getLogger(__name__)

_REFERENCE_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "configs", "gpt_moe_tiny.yaml")
_VISION_BATCH = 32   # images per training step of the mindcv workloads


def _positive_ints(text: str) -> List[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be positive integers separated by commas, "
                                         f"but got {text!r}")
    return sorted(set(values))


def _common(parser: argparse.ArgumentParser, time_budget) -> None:
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-budget", type=positive_float, default=time_budget,
                        help="wall-clock seconds per search (TGA, GA, Hierarchical); "
                             + ("default: none, the search stops on --evaluations, so the "
                                "plan is the same on a busy machine" if time_budget is None
                                else f"default {time_budget:g}"))


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="config YAML (exports the reference model), graph JSON, "
                                       "MINDIR file or PipeDream profile")
    parser.add_argument("--cluster", default="ascend910b-1x8",
                        help="cluster preset name, or a YAML file with a 'cluster:' section")
    parser.add_argument("--devices", type=_positive_int,
                        help="resize the cluster to N devices (<= 8 per node)")
    parser.add_argument("--method", default="tga",
                        help="tga, m-topo, m-etf, m-sct, hierarchical, ga-single, contiguous, "
                             "round-robin")
    parser.add_argument("--evaluations", type=_positive_int, default=4000,
                        help="cost evaluations for the search methods")
    parser.add_argument("--contiguous", action="store_true",
                        help="require pipeline stages (data flows only to the same or a "
                             "later device)")
    parser.add_argument("--out", required=True, help="plan YAML to write")
    parser.add_argument("--micro-batches", type=_positive_int, default=8,
                        help="GPipe micro-batches per step (1 = plain model parallelism)")
    _common(parser, None)


def _load_cluster(name: str, devices):
    from ms_efficient.core.cluster import ClusterSpec, get_cluster

    if name.endswith((".yaml", ".yml")):
        import yaml

        if not os.path.isfile(name):
            raise ValueError(f"cluster file '{name}' does not exist.")
        with open(name, "r", encoding="utf-8") as fh:
            data = yaml.safe_load(fh) or {}
        spec = ClusterSpec.from_dict(data.get("cluster", data))
    else:
        spec = get_cluster(name)
    if devices:
        if devices <= spec.devices_per_node:
            spec = spec.with_overrides(nodes=1, devices_per_node=devices,
                                       name=f"{spec.name}-as-1x{devices}")
        elif devices % spec.devices_per_node == 0:
            spec = spec.with_overrides(nodes=devices // spec.devices_per_node,
                                       name=f"{spec.name}-as-{devices // spec.devices_per_node}"
                                            f"x{spec.devices_per_node}")
        else:
            raise ValueError(f"'--devices' must be <= {spec.devices_per_node} or a multiple "
                             f"of it for cluster {spec.name!r}, but got {devices}.")
    return spec


def _load_graph(source: str):
    from ms_efficient.graph import load_graph
    from ms_efficient.place.workloads import reference_model_graph

    if not os.path.exists(source):
        raise ValueError(f"'{source}' does not exist.")
    if source.endswith((".yaml", ".yml")):
        return reference_model_graph(source)
    return load_graph(source)


def run_plan(args: argparse.Namespace) -> int:
    from ms_efficient.core.units import format_size
    from ms_efficient.place.apply import make_plan, save_plan
    from ms_efficient.place.bench import run_methods
    from ms_efficient.place.same_devices import best_replica_plan, replica_plans
    from ms_efficient.place.problem import PlacementOptions, build_problem

    t0 = time.perf_counter()
    graph = _load_graph(args.source)
    cluster = _load_cluster(args.cluster, args.devices)
    problem = build_problem(graph, cluster, PlacementOptions(
        micro_batches=args.micro_batches, contiguous=args.contiguous))
    result = run_methods(problem, [args.method], args.evaluations, args.time_budget,
                         args.seed, spent_s=time.perf_counter() - t0)[args.method]
    plan = make_plan(problem, result.assign, args.method,
                     scopes={n.name: n.scope for n in graph if n.scope},
                     meta={"search_time_s": result.search_time_s,
                           "evaluations": result.evaluations, "seed": args.seed,
                           "units": problem.num_units, "max_evaluations": args.evaluations,
                           "time_budget_s": args.time_budget,
                           "stopped_by": result.stopped_by}, order=result.order)
    # the same devices without a pipeline (the graph has no batch size: every split allowed)
    baseline = best_replica_plan(replica_plans(graph, cluster))
    ratio = plan.step_time_s / baseline.step_time_s
    plan.meta["same_devices"] = {"baseline": baseline.to_dict(), "pp": len(plan.stages),
                                 "dp": 1, "ratio_to_baseline": float(ratio)}
    save_plan(plan, args.out)
    print(f"{args.method}: {len(graph)} ops in {problem.num_units} units on "
          f"{len(plan.stages)}/{cluster.num_devices} devices of {cluster.name}")
    print(f"simulated step time {plan.step_time_s * 1e3:.3f} ms with {args.micro_batches} "
          f"micro-batches; peak memory {max(plan.peak_memory_bytes) / 2**30:.2f} GiB/device"
          f"{'' if plan.meta['feasible'] else ' (OVER MEMORY)'}; search "
          f"{result.search_time_s:.1f} s, {result.evaluations} evaluations "
          f"(stopped by {result.stopped_by})")
    verdict = (f": {baseline.label} is the better use of these devices" if ratio >= 1 else "") \
        if baseline.feasible else f"; {baseline.label} does not fit, so only a pipeline does"
    print(f"same devices without a pipeline: {baseline.label}, {baseline.step_time_s * 1e3:.3f} "
          f"ms per step, {format_size(baseline.memory_bytes)} per device"
          f"{'' if baseline.feasible else ' (OVER MEMORY)'}; this plan ({len(plan.stages)} "
          f"stages x 1 copy) takes {ratio:.3g}x its step time{verdict}")
    print(f"plan written to {args.out}")
    return 0


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="PipeDream graphs, the reference model and gpt-1.3b, small "
                             "budgets (under a minute)")
    parser.add_argument("--graph", action="append", default=[], metavar="FILE",
                        help="extra graph file (JSON, MINDIR, PipeDream); repeatable")
    parser.add_argument("--graph-dir", metavar="DIR",
                        help="folder of PipeDream-format profiles pipedream_vgg16.txt, "
                             "pipedream_resnet18.txt, pipedream_gnmt.txt (the benchmark's "
                             "three profiled CNN / RNN workloads; without it they are skipped)")
    parser.add_argument("--devices", type=_positive_int, help="only this device count")
    parser.add_argument("--evaluations", type=_positive_int,
                        help="evaluations per search (default 300 quick, 3000 full)")
    parser.add_argument("--no-scaling", action="store_true",
                        help="skip the 10k-operator scaling run of the full benchmark")
    parser.add_argument("--plot", help="convergence plot PNG (default: next to --json)")
    parser.add_argument("--json", required=True, help="write rows here")
    parser.add_argument("--micro-batches", type=_positive_ints, default=[1, 8],
                        metavar="M[,M...]",
                        help="GPipe micro-batch counts to run every case at (default 1,8: "
                             "1 is the single-batch setting Baechi's m-ETF/m-SCT schedule "
                             "for, 8 a pipelined step)")
    _common(parser, 60.0)


def _workloads(args: argparse.Namespace) -> List[Tuple[str, object]]:
    """(name, graph) pairs; loaders that cannot run here are skipped with a log line."""
    from ms_efficient.graph import load_graph
    from ms_efficient.place.workloads import (TRANSFORMER_CONFIGS, mindcv_graph,
                                              reference_model_graph, transformer_graph)

    out: List[Tuple[str, object]] = []
    if args.graph_dir is not None and not os.path.isdir(args.graph_dir):
        raise ValueError(f"--graph-dir must be a folder, but got {args.graph_dir!r}.")
    for stem in ("vgg16", "resnet18", "gnmt"):
        path = None if args.graph_dir is None else os.path.join(args.graph_dir,
                                                                 f"pipedream_{stem}.txt")
        if path is not None and os.path.isfile(path):
            out.append((f"pipedream-{stem}", load_graph(path)))
        else:
            logger.info("no pipedream_%s.txt (--graph-dir %s): skipping that workload", stem,
                        args.graph_dir)
    cache = os.path.join(os.path.dirname(os.path.abspath(args.json)), "place_cache")
    try:
        out.append(("gpt_moe_tiny (MINDIR)", reference_model_graph(_REFERENCE_CONFIG, cache)))
    except ImportError as err:  # MindSpore missing: still benchmark the rest
        logger.info("reference model graph unavailable (%s): skipped", err)
    names = ["gpt-1.3b"] if args.quick else ["gpt-1.3b", "gpt-6.7b", "gpt-moe-16e"]
    out += [(n, transformer_graph(TRANSFORMER_CONFIGS[n], n)) for n in names]
    for model in ("resnet50", "inception_v3"):   # branchy CNNs; None without mindcv
        graph = mindcv_graph(model, batch=_VISION_BATCH, cache_dir=cache)
        if graph is not None:
            out.append((f"{model} (mindcv)", graph))
    for path in args.graph:
        out.append((os.path.basename(path), _load_graph(path)))
    return out


def run_bench(args: argparse.Namespace) -> int:
    from ms_efficient.core.benchio import markdown_table, write_bench_json
    from ms_efficient.place.bench import METHODS, bench_workload, plot_traces, summarise
    from ms_efficient.place.workloads import TRANSFORMER_CONFIGS, transformer_graph

    t0 = time.perf_counter()
    evaluations = args.evaluations or (300 if args.quick else 3000)
    device_counts = [args.devices] if args.devices else [4, 8]
    rows: List[dict] = []
    traces: Dict[str, dict] = {}
    for name, graph in _workloads(args):
        for devices in device_counts:
            for micro_batches in args.micro_batches:
                logger.info("bench place: %s on %d devices, %d micro-batches", name, devices,
                            micro_batches)
                got, results = bench_workload(graph, name, devices, METHODS, evaluations,
                                              args.time_budget, args.seed, micro_batches)
                rows += got
                traces[f"{name} / {devices} dev / M={micro_batches}"] = {
                    m: results[m] for m in ("tga", "ga-single", "hierarchical")}
    if not args.quick and not args.no_scaling:  # search-time scaling: TGA on ~10k ops
        t_graph = time.perf_counter()
        graph = transformer_graph(TRANSFORMER_CONFIGS["moe-10k-ops"], "moe-10k-ops")
        graph_s = time.perf_counter() - t_graph
        devices, micro_batches = args.devices or 8, max(args.micro_batches)
        got, results = bench_workload(graph, "moe-10k-ops", devices,
                                      ["tga", "m-topo", "m-etf", "m-sct", "contiguous"], 10**6,
                                      args.time_budget, args.seed, micro_batches,
                                      graph_s=graph_s)
        rows += got
        traces[f"moe-10k-ops / {devices} dev / M={micro_batches}"] = {"tga": results["tga"]}
    summary = summarise(rows)
    columns = ["workload", "devices", "micro_batches", "method", "step_time_s",
               "peak_memory_bytes", "search_time_s", "evaluations", "devices_used", "feasible"]
    print(markdown_table(rows, columns))
    print()
    print(markdown_table(summary))
    write_bench_json(args.json, "place", rows, meta={
        "summary": summary, "micro_batches": args.micro_batches, "seed": args.seed,
        "evaluations": evaluations, "quick": args.quick, "wall_s": time.perf_counter() - t0,
        "cluster": "ascend910b-1x8 resized to N devices (simulated)"})
    plot = args.plot or os.path.splitext(args.json)[0] + ".png"
    plot_traces(traces, plot)
    print(f"rows written to {args.json}; convergence plot {plot} "
          f"({time.perf_counter() - t0:.1f} s)")
    return 0
