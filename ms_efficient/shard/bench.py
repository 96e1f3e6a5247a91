"""Sharding benchmark rows: the ILP against Megatron TP/SP, DP and ZeRO on the same operator
templates, mesh and cost model (analytic: ``shard.cost`` on the Ascend 910B presets)."""
from __future__ import annotations

import logging
from typing import Any, Dict, List

from ms_efficient.shard.baselines import METHODS, baseline_cost
from ms_efficient.shard.cost import CostModel
from ms_efficient.shard.ilp import ShardOptions, solve_sharding
from ms_efficient.shard.planner import default_cluster
from ms_efficient.shard.strategies import parse_mesh
from ms_efficient.shard.workloads import get_workload, transformer_ops

__all__ = ["FULL_CASES", "QUICK_CASES", "bench_rows", "GRAPH_DIMS", "graph_vs_template_rows"]

logger = logging.getLogger(__name__)

# (workload preset, devices, mesh, batch label); batch "N" = one sequence per device (every
# method runs), "dp" = one sequence per data-parallel replica (Megatron micro-batch 1; pure
# data-parallel methods cannot split it and are left out)
FULL_CASES = [(w, n, mesh, b) for w in ("gpt-1.3b", "gpt-13b", "gpt-175b", "moe-1.3b-e32")
              for n, mesh in ((8, "1x8"), (32, "4x8")) for b in ("N", "dp")]
QUICK_CASES = [(w, n, mesh, "N") for w in ("gpt-1.3b", "gpt-175b", "moe-1.3b-e32")
               for n, mesh in ((8, "1x8"), (32, "4x8"))]


def bench_rows(cases, budget_ratio: float = 1.2, tie: str = "binary",
               dp_model_split: bool = True) -> List[Dict[str, Any]]:
    """Rows for every (workload, devices, mesh, batch label) case: the baselines and the ILP."""
    rows: List[Dict[str, Any]] = []
    for name, devices, mesh_text, blabel in cases:
        mesh = parse_mesh(mesh_text, dp_model_split=dp_model_split)
        batch = devices if blabel == "N" else max(mesh.dp, 1)
        dims = get_workload(name, batch=batch)
        specs = transformer_ops(dims)
        model = CostModel(mesh, default_cluster(devices))
        workload = f"{name}/b{batch}"
        base = {"evidence": "model", "workload": workload, "devices": devices, "mesh": mesh_text}
        ref = None
        for method in METHODS:
            try:
                c = baseline_cost(specs, model, method)
            except ValueError as err:
                logger.info("%s %s skipped: %s", workload, method, err)
                continue
            ref = c if method == "megatron-tp" else ref
            rows.append({**base, "method": method, "memory_per_device_bytes": c.memory,
                         "comm_time_s": c.comm_s, "solve_time_s": 0.0,
                         "redundant_bytes": c.redundant})
        sol = solve_sharding(specs, model, ShardOptions(comm_budget_s=budget_ratio * ref.comm_s,
                                                        tie=tie))
        rows.append({**base, "method": "ilp", "memory_per_device_bytes": sol.cost.memory,
                     "comm_time_s": sol.cost.comm_s, "solve_time_s": sol.solve_time_s,
                     "redundant_bytes": sol.cost.redundant})
        for r in rows:
            if r["workload"] == workload and r["devices"] == devices:
                r["memory_vs_megatron_tp"] = r["memory_per_device_bytes"] / ref.memory
                r["comm_vs_megatron_tp"] = r["comm_time_s"] / ref.comm_s
                r["floor_bytes"] = ref.memory - ref.redundant
    return rows


# The reference GPT's MINDIR against the hand-written templates of the same dimensions.
GRAPH_DIMS = dict(num_layers=4, hidden=256, heads=8, seq=128, batch=8, vocab=64, ffn=1024)
GRAPH_MESHES = ("2x4", "1x8", "4x2", "8x1")


def graph_vs_template_rows(dims: Dict[str, int] = GRAPH_DIMS, meshes=GRAPH_MESHES,
                           ratios=(1.2, 2.0, None)) -> List[Dict[str, Any]]:
    """The graph-driven ILP (``shard.graph_ops`` on the exported reference GPT, dense FFNs,
    MindSpore needed) next to the template ILP (``workloads.transformer_ops``, same dims) on
    each mesh (dp over batch dims only) and budget: ratio x each one's own Megatron-TP
    communication, or unconstrained (None)."""
    from ms_efficient.models.zoo import dense_reference_graph
    from ms_efficient.shard.planner import plan_graph
    from ms_efficient.shard.workloads import TransformerDims

    graph = dense_reference_graph(**dims)
    tmpl = transformer_ops(TransformerDims("ref", dims["num_layers"], dims["hidden"],
                                           dims["heads"], dims["seq"], batch=dims["batch"],
                                           vocab=dims["vocab"], ffn=dims["ffn"]))
    rows = []
    for mesh_text in meshes:
        mesh = parse_mesh(mesh_text, dp_model_split=False)
        cluster = default_cluster(mesh.devices)
        model = CostModel(mesh, cluster)
        ref = baseline_cost(tmpl, model, "megatron-tp")
        for ratio in ratios:
            t = solve_sharding(tmpl, model, ShardOptions(
                comm_budget_s=ratio * ref.comm_s if ratio else None))
            g = plan_graph(graph, mesh, cluster, budget_ratio=ratio)
            rows.append({"evidence": "model", "workload": graph.name, "mesh": mesh_text,
                         "budget_x_megatron": ratio,
                         "template_bytes": t.cost.memory, "graph_bytes": g["solution"].cost.memory,
                         "graph_vs_template": g["solution"].cost.memory / t.cost.memory,
                         "template_comm_s": t.cost.comm_s,
                         "graph_comm_s": g["solution"].cost.comm_s,
                         "graph_ops": len(g["specs"]), "graph_solve_s": g["solution"].solve_time_s})
    return rows
