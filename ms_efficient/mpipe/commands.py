"""MPipeMoE: chunk count and activation reuse of expert-parallel MoE layers (and their benchmark).

    ms-efficient plan mpipe CONFIG [--cluster NAME] [--budget SIZE] --out plan.yaml
    ms-efficient bench mpipe [--quick] --json OUT

``plan`` takes a run config (model/moe/train sections): every MoE layer runs T = batch x
sequence tokens per rank, top-k, experts spread over the cluster's devices; it writes the
chunk count and reuse strategy (fastest within ``--budget`` of activation memory per layer)
with the timing table. ``bench`` replays chunk policies over synthetic routing traces and
picks reuse strategies under budgets (simulated on Ascend 910B presets, about 10 s; --quick
one workload). No MindSpore import.
"""
from __future__ import annotations

import argparse
import logging
import time

__all__ = ["add_plan_arguments", "run_plan", "add_bench_arguments", "run_bench"]

logger = logging.getLogger(__name__)


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="run config YAML (model, moe, train, cluster sections)")
    parser.add_argument("--cluster", help="cluster preset (default: the config's cluster)")
    parser.add_argument("--budget", help="activation memory one MoE layer may keep per device, "
                                         "e.g. 2GiB (default: no limit)")
    parser.add_argument("--out", required=True, help="plan YAML to write")


def run_plan(args: argparse.Namespace) -> int:
    from ms_efficient.core.cluster import get_cluster
    from ms_efficient.core.config import load_config
    from ms_efficient.core.fileio import atomic_write_text
    from ms_efficient.core.units import format_size, parse_size
    from ms_efficient.mpipe.planner import MoELayerShape, choose_reuse

    import yaml

    cfg = load_config(args.config)
    cluster = get_cluster(args.cluster) if args.cluster else cfg.cluster_spec()
    devices = cluster.num_devices
    if cfg.moe.num_experts % devices:
        raise ValueError(f"'moe.num_experts' ({cfg.moe.num_experts}) must be a multiple of the "
                         f"cluster's {devices} devices for expert parallelism over all of them.")
    rows = cfg.train.batch_size * cfg.model.seq_length * cfg.moe.top_k
    shape = MoELayerShape(rows=rows, hidden=cfg.model.hidden_size,
                          ffn_hidden=cfg.model.ffn_hidden_size,
                          local_experts=cfg.moe.num_experts // devices, ranks=devices)
    budget = parse_size(args.budget, "--budget") if args.budget else float("inf")
    try:
        best, timings = choose_reuse(shape, cluster, budget)
    except ValueError as err:
        raise ValueError(f"'--budget' {args.budget}: {err}") from None
    doc = {"kind": "mpipe", "cluster": cluster.name, "rows_per_rank": rows,
           "chunks": best.chunks, "reuse": best.strategy,
           "layer_time_s": best.time_s, "memory_bytes": best.memory_bytes,
           "budget_bytes": None if budget == float("inf") else budget,
           "evidence": "simulated",
           "table": [{"chunks": t.chunks, "reuse": t.strategy, "layer_time_s": t.time_s,
                      "exposed_comm_s": t.exposed_comm_s, "memory_bytes": t.memory_bytes}
                     for t in timings]}
    atomic_write_text(args.out, yaml.safe_dump(doc, sort_keys=False))
    print(f"{cluster.name}: {rows} rows per rank -> {best.chunks} chunks, reuse "
          f"{best.strategy}: {best.time_s * 1e3:.3f} ms per layer (simulated), "
          f"{format_size(best.memory_bytes)} kept")
    print(f"plan written to {args.out}")
    return 0


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="one workload, 32 trace rows")
    parser.add_argument("--seed", type=int, default=0, help="synthetic trace seed")
    parser.add_argument("--json", required=True, help="write the rows here")


def run_bench(args: argparse.Namespace) -> int:
    from ms_efficient.core.benchio import markdown_table, write_bench_json
    from ms_efficient.mpipe.bench import WORKLOADS, policy_rows, reuse_rows

    start = time.perf_counter()
    workloads = WORKLOADS[:1] if args.quick else WORKLOADS
    policies, reuse = [], []
    for w in workloads:
        policies += policy_rows(w, steps=32 if args.quick else 128, seed=args.seed)
        reuse += reuse_rows(w)
    print("Chunk policies (simulated, mean of forward + backward per MoE layer):")
    print(markdown_table(policies, ["workload", "method", "layer_time_s",
                                    "speedup_vs_no_pipeline", "exposed_comm_fraction",
                                    "chunks_mean", "chunk_changes", "memory_bytes"]))
    print()
    print("Reuse strategies under activation-memory budgets (simulated):")
    print(markdown_table(reuse, ["workload", "budget_fraction", "chunks", "strategy",
                                 "layer_time_s", "slowdown_vs_keep", "memory_bytes"]))
    write_bench_json(args.json, "mpipe", policies + reuse,
                     meta={"quick": args.quick, "seed": args.seed,
                           "seconds": round(time.perf_counter() - start, 1)})
    print(f"rows written to {args.json} ({time.perf_counter() - start:.1f} s)")
    return 0
