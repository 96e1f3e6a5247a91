"""Minimal-redundancy sharding (ILP) plans and benchmark against Megatron/ZeRO baselines.

    ms-efficient plan shard CONFIG [--mesh 4x8] [--out plan.yaml] [--strategy-json s.json]
    ms-efficient plan shard GRAPH [--mesh 2x4] [--cluster PRESET] [--comm-ratio 1.0]
    ms-efficient bench shard [--quick] --json OUT

CONFIG is a shard config (``configs/shard_*.yaml``, a ``shard:`` section) or a training
config (``configs/gpt_moe_tiny.yaml``). GRAPH is an ``OpGraph`` JSON (``ms-efficient graph``)
or a ``.mindir`` file of the user's network: the ILP then plans its own operators
(``shard.graph_ops``), one entry per operator in the plan. No MindSpore import here unless a strategy JSON is
asked for a training config (it builds the network and sets ``shard()`` on its primitives).
"""
from __future__ import annotations

import argparse
import logging
import os
import time
from typing import Any, Dict, List

from ms_efficient.core.argtypes import non_negative_float, positive_float

__all__ = ["add_plan_arguments", "run_plan", "add_bench_arguments", "run_bench"]

logger = logging.getLogger(__name__)
_GIB = float(2**30)


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="shard config (shard: section), training config YAML, "
                                       "or a graph (.json OpGraph, .mindir)")
    parser.add_argument("--mesh", help="DPxMP device mesh, e.g. 4x8 (overrides the config; "
                                       "graphs: default every factorisation of the cluster's "
                                       "devices, as optimize.shard_mesh)")
    parser.add_argument("--cluster", help="graphs: cluster preset (default: the smallest "
                                          "Ascend 910B preset with the mesh's devices)")
    parser.add_argument("--comm-ratio", type=non_negative_float, default=1.0,
                        help="graphs: communication budget as a multiple of ZeRO-1's on the "
                             "same graph and mesh, as optimize.shard_comm_ratio (0 = "
                             "unconstrained; default 1.0)")
    parser.add_argument("--out", default="shard_plan.yaml", help="plan YAML to write")
    parser.add_argument("--strategy-json", help="also write a MindSpore strategy JSON here")


def _summary_rows(doc: Dict[str, Any]) -> List[Dict[str, Any]]:
    ref, s = doc["reference"], doc["summary"]
    rows = []
    for label, c in ((ref["method"], ref), ("ilp", s)):
        rows.append({"method": label, "memory_GiB": c["memory_per_device_bytes"] / _GIB,
                     "redundant_GiB": c["redundant_bytes"] / _GIB,
                     "activations_GiB": c["activations_bytes"] / _GIB,
                     "comm_time_s": c["comm_time_s"],
                     "memory_ratio": c["memory_per_device_bytes"] / ref["memory_per_device_bytes"],
                     "comm_ratio": c["comm_time_s"] / ref["comm_time_s"] if ref["comm_time_s"] else None})
    return rows


def _strategy_json_for(args, req, doc) -> None:
    from ms_efficient.core.fileio import atomic_write_text
    from ms_efficient.shard.apply import OpRecord, strategy_json, write_strategy_json
    import json
    import yaml

    with open(args.config, "r", encoding="utf-8") as fh:
        data = yaml.safe_load(fh) or {}
    if "shard" in data:    # analytic workload: one item per planner operator
        ops = {name: OpRecord(e["prim"], tuple(tuple(f) for f in e["in_strategy"]))
               for name, e in {**doc["templates"], **doc["overrides"]}.items()}
        js = strategy_json(ops, doc["mesh"]["dp"], doc["mesh"]["mp"])
        atomic_write_text(args.strategy_json, json.dumps(js, indent=1) + "\n")
        return
    import mindspore as ms
    from ms_efficient.core.config import load_config
    from ms_efficient.models.gpt_moe import build_model
    from ms_efficient.shard.apply import apply_shard_plan

    cfg = load_config(args.config)
    ms.set_context(mode=ms.GRAPH_MODE)
    net = build_model(cfg.model, cfg.moe, cfg.train.batch_size)
    applied = apply_shard_plan(net, doc["templates"], doc.get("overrides"))
    write_strategy_json(args.strategy_json, net, applied, doc)


def _is_graph_file(path: str) -> bool:
    return os.path.splitext(path)[1].lower() in (".json", ".mindir")


def _run_graph_plan(args: argparse.Namespace) -> int:
    from ms_efficient.core.benchio import markdown_table
    from ms_efficient.core.cluster import get_cluster
    from ms_efficient.graph.load import load_graph
    from ms_efficient.place.stages import price_network
    from ms_efficient.shard.mesh_search import plan_graph_doc
    from ms_efficient.shard.planner import default_cluster, save_plan
    from ms_efficient.shard.strategies import parse_mesh

    if args.strategy_json:
        raise ValueError("'--strategy-json' needs the network (it names primitives); for a "
                         "graph use optimize() with optimize.shard_strategy_file.")
    if not args.comm_ratio >= 0:
        raise ValueError(f"'--comm-ratio' must be >= 0, but got {args.comm_ratio}.")
    mesh = parse_mesh(args.mesh, dp_model_split=False) if args.mesh else None
    cluster = get_cluster(args.cluster) if args.cluster else default_cluster(
        mesh.devices if mesh else 8)
    if mesh and cluster.num_devices < mesh.devices:
        raise ValueError(f"'--mesh' {mesh} needs {mesh.devices} devices; cluster "
                         f"'{cluster.name}' has {cluster.num_devices}.")
    graph = load_graph(args.config)
    price = price_network(graph, cluster)
    doc = plan_graph_doc(graph, cluster, price.step_time_s, args.comm_ratio,
                         [mesh] if mesh else None)
    doc["unoptimised"] = price.to_dict()
    mesh = f"{doc['mesh']['dp']}x{doc['mesh']['mp']}"
    save_plan(args.out, doc)
    rows = [{"method": m, "memory_MiB": c["memory_per_device_bytes"] / 2**20,
             "comm_time_s": c["comm_time_s"]} for m, c in doc["baselines"].items()
            if "error" not in c]
    rows.append({"method": "ilp", "memory_MiB": doc["summary"]["memory_per_device_bytes"] / 2**20,
                 "comm_time_s": doc["summary"]["comm_time_s"]})
    print(f"{args.config}: {doc['summary']['operators']} forward operators on mesh {mesh} "
          f"({cluster.name}), comm budget {doc['comm_budget_s']} s (model evidence)")
    print(markdown_table(rows))
    if doc["kept_whole"]:
        print(f"kept whole (replicated): {doc['kept_whole']}")
    print(f"plan written to {args.out} (solved in {doc['summary']['solve_time_s']:.2f} s)")
    return 0


def run_plan(args: argparse.Namespace) -> int:
    from ms_efficient.core.benchio import markdown_table
    from ms_efficient.shard.planner import load_request, plan, plan_to_dict, save_plan

    if _is_graph_file(args.config):
        return _run_graph_plan(args)
    req = load_request(args.config, args.mesh)
    doc = plan_to_dict(req, plan(req))
    save_plan(args.out, doc)
    print(f"{req.dims.name} on mesh {req.mesh} ({req.cluster.name}), batch {req.dims.batch}, "
          f"comm budget {doc['comm_budget_s']} s (model evidence)")
    print(markdown_table(_summary_rows(doc)))
    print(f"plan written to {args.out} (solved in {doc['summary']['solve_time_s']:.2f} s)")
    if args.strategy_json:
        _strategy_json_for(args, req, doc)
        print(f"strategy JSON written to {args.strategy_json}")
    return 0


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="fewer workloads (< 1 minute)")
    parser.add_argument("--json", required=True, help="write the result rows here")
    parser.add_argument("--budget-ratio", type=positive_float, default=1.2,
                        help="ILP communication budget relative to megatron-tp (default 1.2)")
    parser.add_argument("--tie", default="binary", choices=("layer", "binary", "none"),
                        help="how repeated layers share strategies in the ILP (default "
                             "binary: any number of layers may differ, ~log2(L) layer copies)")
    parser.add_argument("--dp-batch-only", action="store_true",
                        help="the ILP's dp axis splits only batch/expert dims (classic data "
                             "parallelism), not model dims (2-D tensor parallelism)")


def run_bench(args: argparse.Namespace) -> int:
    from ms_efficient.core.benchio import markdown_table, write_bench_json
    from ms_efficient.shard.bench import FULL_CASES, QUICK_CASES, bench_rows

    t0 = time.perf_counter()
    cases = QUICK_CASES if args.quick else FULL_CASES
    rows = bench_rows(cases, args.budget_ratio, args.tie, not args.dp_batch_only)
    shown = [{"workload": r["workload"], "devices": r["devices"], "method": r["method"],
              "memory_GiB": r["memory_per_device_bytes"] / _GIB,
              "mem_x_tp": r["memory_vs_megatron_tp"], "comm_s": r["comm_time_s"],
              "comm_x_tp": r["comm_vs_megatron_tp"], "redundant_GiB": r["redundant_bytes"] / _GIB,
              "solve_s": r["solve_time_s"]} for r in rows]
    print(markdown_table(shown))
    from ms_efficient.shard.bench import graph_vs_template_rows

    graph_rows = graph_vs_template_rows(meshes=("2x4", "1x8") if args.quick else
                                        ("2x4", "1x8", "4x2", "8x1"))
    print("\ngraph-driven ILP (the reference GPT's MINDIR) vs the template ILP, same dims:")
    print(markdown_table([{k: r[k] for k in ("mesh", "budget_x_megatron", "template_bytes",
                                             "graph_bytes", "graph_vs_template", "graph_ops")}
                          for r in graph_rows]))
    rows = rows + [{"method": "graph-vs-template", **r} for r in graph_rows]
    meta = {"budget_ratio": args.budget_ratio, "tie": args.tie, "quick": bool(args.quick),
            "dp_model_split": not args.dp_batch_only,
            "evidence": "analytic cost model (shard.cost) on ascend910b presets, not measured",
            "wall_s": time.perf_counter() - t0}
    write_bench_json(args.json, "shard", rows, meta)
    print(f"results written to {os.path.abspath(args.json)} ({meta['wall_s']:.1f} s)")
    return 0
