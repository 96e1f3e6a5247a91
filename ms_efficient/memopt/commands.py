"""MemOpt: plan per-Cell keep/recompute/swap with a dual-agent RL planner (and benchmark it).

    ms-efficient plan memory CONFIG --budget 12GiB [--batch N] [--method M] --out plan.yaml
    ms-efficient bench memory [--quick] [--graph FILE ...] [--measured] --json OUT

Benchmark run times on the 2-core build machine (shared with other jobs):
    bench memory --quick --json q.json            2 GPT + resnet50 x 1 budget     ~18 s
    bench memory --json full.json                 4 GPT + 2 mindcv x 3 budgets   ~70 s
    --graph PATH/pipedream_*.txt adds PipeDream-format profiled graphs          ~90 s
        (VGG-16, ResNet-18, GNMT in the benchmark's figures)
    --measured adds the CPU check (5 MindSpore processes, one at a time)       ~2.5-3 min
(the first run exports the mindcv models to MINDIR, a few seconds each, cached next to
--json.) Every run prints the per-target summary of ``bench.summarise``.

No MindSpore import at module level (the CLI imports this module to build its parser).
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import time

from ms_efficient.core.argtypes import positive_float, positive_int

__all__ = ["add_plan_arguments", "run_plan", "add_bench_arguments", "run_bench",
           "graph_batch_size"]

logger = logging.getLogger(__name__)


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="run config YAML (model/moe/train/cluster sections), "
                                       "or a graph file (MINDIR, OpGraph JSON, PipeDream)")
    parser.add_argument("--budget", required=True,
                        help="device memory the step may use, as optimize.memory_budget: "
                             "a size (12GiB, 800MB), bytes, or a share of the unoptimised "
                             "simulated peak (95%%); below the feasible floor is refused "
                             "with the floor named")
    parser.add_argument("--batch", type=positive_int,
                        help="batch size (default: train.batch_size of a config, the batch "
                             "a graph was exported at)")
    parser.add_argument("--cluster", help="cluster preset (default: the config's cluster)")
    parser.add_argument("--method", default="memopt",
                        help="memopt (default) or a baseline: none, full-recompute, chen-sqrt, "
                             "checkmate-milp, capuchin-greedy, exact-milp")
    parser.add_argument("--cells", action="append", metavar="PATTERN",
                        help="for a MINDIR/JSON graph: glob of the Cells to plan, e.g. "
                             "'model.layers.*' (repeatable; default: its repeated blocks)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-limit", type=positive_float,
                        help="wall-clock planning seconds (default: none; MemOpt stops on "
                             "its update count and patience, so the plan is the same on a "
                             "busy machine)")
    parser.add_argument("--out", required=True, help="plan YAML to write")


def _profile_for(args):
    from ms_efficient.core.cluster import get_cluster
    from ms_efficient.memopt.profile import profile_from_graph, profile_from_model

    if args.config.endswith((".yaml", ".yml")):
        from ms_efficient.core.config import load_config

        cfg = load_config(args.config)
        cluster = get_cluster(args.cluster) if args.cluster else cfg.cluster_spec()
        batch = args.batch or cfg.train.batch_size
        return profile_from_model(cfg.model, cfg.moe, batch, cluster), cluster
    from ms_efficient.graph import load_graph
    from ms_efficient.graph.cells import (assign_units, cell_tree_from_graph, forward_subgraph,
                                          match_cells, repeated_blocks)
    from ms_efficient.memopt.profile import profile_from_units

    cluster = get_cluster(args.cluster or "ascend910b-1x8")
    graph = load_graph(args.config)
    if any(n.scope for n in graph):
        # a MindSpore graph: the layers are its Cells, named as apply_plan takes them
        tree = cell_tree_from_graph(graph)
        units = match_cells(tree, args.cells) if args.cells else repeated_blocks(tree)
        if not units:
            raise ValueError(f"{args.config}: found no repeated blocks (children of a CellList "
                             "or SequentialCell of one class); name the Cells with --cells.")
        # the graph stands for the batch it was exported at (its first input's leading
        # dim); --batch rescales the profile to another batch
        exported = graph_batch_size(graph)
        profile = profile_from_units(graph, assign_units(graph, units), cluster,
                                     batch_size=exported)
        return (profile.at_batch(args.batch) if args.batch and args.batch != exported
                else profile), cluster
    if args.cells:
        raise ValueError(f"{args.config}: '--cells' needs a graph with Cell scopes (MINDIR or "
                         "its JSON), but this one has none.")
    # no scopes (PipeDream): layers are runs of forward ops, named by their first and last op
    return profile_from_graph(forward_subgraph(graph), batch_size=args.batch or 1,
                              cluster=cluster), cluster


def graph_batch_size(graph) -> int:
    """The batch a MindSpore graph was exported at: the leading dim of its first input
    (``graph.meta["inputs"]``, recorded by the MINDIR reader); 1 when it has none."""
    inputs = graph.meta.get("inputs") or []
    shape = inputs[0].get("shape") if inputs else None
    return int(shape[0]) if shape and int(shape[0]) > 0 else 1


def run_plan(args: argparse.Namespace) -> int:
    from ms_efficient.core.units import format_size, parse_budget
    from ms_efficient.memopt.agents import RLConfig
    from ms_efficient.memopt.apply import (budget_bytes, check_budget_floor, plan_to_dict,
                                           save_plan)
    from ms_efficient.memopt.env import realisable_actions
    from ms_efficient.memopt.planner import METHODS, budget_floor, plan_with

    if args.method not in METHODS:
        raise ValueError(f"'--method' must be one of {list(METHODS)}, but got {args.method!r}.")
    parse_budget(args.budget, "--budget")          # a bad value fails before profiling
    profile, cluster = _profile_for(args)
    budget, peak = budget_bytes(args.budget, profile, cluster.host_link,
                                cluster.device_memory_bytes, "--budget")
    actions = realisable_actions("Ascend")      # what apply_plan realises on the cluster
    floor, safe, least = budget_floor(profile, cluster.host_link, actions)
    check_budget_floor(args.budget, "--budget", budget, peak, floor, safe, actions)
    rl = RLConfig(seed=args.seed, time_limit_s=args.time_limit or math.inf)
    start = time.perf_counter()
    try:
        plan, result = plan_with(args.method, profile, budget, cluster.host_link, rl,
                                 actions=actions)
    except ValueError:
        if args.method != "memopt" or budget < safe:
            raise
        # at or above the safe floor the least-peak recompute plan fits: start from it
        plan, result = plan_with(args.method, profile, budget, cluster.host_link, rl,
                                 candidates={"checkmate-milp": least}, actions=actions)
    if not result.fits:
        raise ValueError(f"the {args.method} plan needs {format_size(result.peak_bytes)}, above "
                         f"the budget {format_size(budget)}; use --method memopt or raise it.")
    doc = plan_to_dict(profile, plan, result, budget, {"cluster": cluster.name})
    save_plan(args.out, doc)
    counts = plan.counts()
    print(f"{args.method}: {profile.num_layers} layers -> "
          + ", ".join(f"{k} {v}" for k, v in counts.items()))
    print(f"simulated step {result.step_time_s * 1e3:.2f} ms, peak {format_size(result.peak_bytes)}"
          f" of budget {format_size(budget)} on {cluster.name} "
          f"(planned in {time.perf_counter() - start:.1f} s"
          + (f", stopped by {plan.meta['stopped_by']})" if "stopped_by" in plan.meta else ")"))
    print(f"plan written to {args.out}")
    return 0


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="small run, ~20 s")
    parser.add_argument("--graph", nargs="*", default=[], help="graph files (PipeDream ...)")
    parser.add_argument("--graph-batch", type=positive_int, default=32,
                        help="samples a graph profile stands for (for max_batch)")
    parser.add_argument("--measured", action="store_true",
                        help="also run the measured CPU check (5 MindSpore processes, "
                             "~3 min)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", required=True, help="write rows here")


def run_bench(args: argparse.Namespace) -> int:
    from ms_efficient.core.benchio import markdown_table, write_bench_json
    from ms_efficient.core.cluster import get_cluster
    from ms_efficient.memopt.agents import RLConfig
    from ms_efficient.memopt.bench import (graph_workloads, gpt_workloads, measured_rows,
                                           simulated_rows, summarise, vision_workloads)

    start = time.perf_counter()
    cluster = get_cluster("ascend910b-1x8")
    # The max-batch search runs the agents only above the baselines' best batch (a few
    # batches), so they get the same episodes there as at a fixed batch.
    rl = RLConfig(seed=args.seed, iterations=40 if args.quick else 120,
                  time_limit_s=10.0 if args.quick else 60.0)
    cache = os.path.join(os.path.dirname(os.path.abspath(args.json)), "memopt_cache")
    workloads = (gpt_workloads(args.quick, cluster) + vision_workloads(args.quick, cluster, cache)
                 + graph_workloads(args.graph, args.graph_batch, cluster))
    fractions = (0.3,) if args.quick else (0.15, 0.3, 0.6)
    rows = simulated_rows(workloads, cluster, fractions, rl, with_max_batch=True,
                          max_batch_rl=rl, max_batch_hi=1 << 16)
    summary = summarise(rows)
    meta = {"cluster": cluster.name, "quick": args.quick, "seed": args.seed,
            "summary": summary}
    if args.measured:
        measured, meta["measured_check"] = measured_rows(rl)
        rows += measured
    meta["time_s"] = time.perf_counter() - start
    write_bench_json(args.json, "memopt", rows, meta=meta)
    cols = ["evidence", "workload", "method", "budget_bytes", "peak_bytes", "step_time_s",
            "throughput_vs_full_recompute", "max_batch", "planning_time_s"]
    if args.measured:
        cols[5:5] = ["simulated_peak_bytes"]
        cols[7:7] = ["step_cpu_s", "load_avg_1min"]
    print(markdown_table(rows, cols))
    print()
    print(markdown_table(summary, ["workload", "metric", "memopt", "exact_milp",
                                   "memopt_step_vs_exact", "best_baseline", "bound",
                                   "link_estimate", "memopt_vs_best", "bound_vs_best",
                                   "link_estimate_vs_best", "target", "met"]))
    print(f"rows written to {args.json} ({time.perf_counter() - start:.1f} s)")
    return 0
