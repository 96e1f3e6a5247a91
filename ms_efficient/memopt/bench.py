"""MemOpt benchmark rows: every method on the same profiles and budgets (simulated, Ascend
910B preset) plus the measured CPU check. No MindSpore import (the measured part spawns a
child process).

Row: {"evidence", "workload", "method", "budget_bytes", "peak_bytes", "step_time_s",
"max_batch", "fits", "throughput_vs_full_recompute", "planning_time_s"}.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ms_efficient.cluster import ClusterSpec, get_cluster
from ms_efficient.config import ModelConfig, MoEConfig
from ms_efficient.memopt.agents import RLConfig
from ms_efficient.memopt.env import RECOMPUTE_ALL, SWAP, RECOMPUTE, evaluate, min_budget_bytes
from ms_efficient.memopt.planner import METHODS, max_batch, plan_with
from ms_efficient.memopt.profile import LayerProfile, profile_from_graph, profile_from_model

__all__ = ["gpt_workloads", "simulated_rows", "measured_rows", "EXACT_MAX_LAYERS"]

logger = logging.getLogger(__name__)

EXACT_MAX_LAYERS = 40      # exact-milp only on graphs this small

# GPT-style sizes (name, layers, hidden, heads, ffn, seq, experts/top_k or None, batch)
_GPT_SIZES = [
    ("gpt-350m", 24, 1024, 16, 4096, 2048, None, 8),
    ("gpt-1.3b", 24, 2048, 16, 8192, 2048, None, 4),
    ("gpt-moe-8x350m", 24, 1024, 16, 4096, 2048, (8, 2), 4),
    ("gpt-6.7b-l50", 50, 4096, 32, 16384, 2048, None, 1),
]


def gpt_workloads(quick: bool, cluster: ClusterSpec) -> List[Tuple[str, LayerProfile]]:
    """Estimated profiles of GPT-style configs (fp16) on ``cluster``; ``quick``: two sizes."""
    out = []
    for name, layers, h, a, ffn, s, moe, batch in (_GPT_SIZES[:1] if quick else _GPT_SIZES):
        model = ModelConfig(num_layers=layers, hidden_size=h, num_heads=a, ffn_hidden_size=ffn,
                            seq_length=s, vocab_size=50304, dtype="float16")
        moe_cfg = MoEConfig(num_experts=moe[0], top_k=moe[1]) if moe else None
        out.append((name, profile_from_model(model, moe_cfg, batch, cluster)))
    return out


def _row(evidence, workload, method, budget, result, plan, ref_time, batch) -> Dict[str, Any]:
    return {"evidence": evidence, "workload": workload, "method": method,
            "budget_bytes": int(budget), "batch": batch,
            "peak_bytes": int(result.peak_bytes) if result else None,
            "step_time_s": result.step_time_s if result and result.fits else None,
            "fits": bool(result.fits) if result else False,
            "throughput_vs_full_recompute": (ref_time / result.step_time_s
                                             if result and result.fits and ref_time else None),
            "planning_time_s": plan.meta.get("planning_time_s") if plan else None,
            "max_batch": None}


def simulated_rows(workloads: Sequence[Tuple[str, LayerProfile]], cluster: ClusterSpec,
                   fractions: Sequence[float], rl: RLConfig, with_max_batch: bool = True,
                   max_batch_rl: Optional[RLConfig] = None, max_batch_hi: int = 1024
                   ) -> List[Dict[str, Any]]:
    """Per workload and budget fraction (of the way from the minimum feasible budget to the
    unoptimised peak): step time of every method at the profile's batch; then, at the
    device's memory (90%), the largest batch per method."""
    rows: List[Dict[str, Any]] = []
    link = cluster.host_link
    for workload, prof in workloads:
        none_peak = evaluate(prof, plan_with("none", prof, 1e30, link)[0], 1e30, link).peak_bytes
        low = min_budget_bytes(prof)
        methods = [m for m in METHODS if m != "exact-milp" or prof.num_layers <= EXACT_MAX_LAYERS]
        for frac in fractions:
            budget = low + frac * (none_peak - low)
            full = plan_with("full-recompute", prof, budget, link)[1]
            ref = full.step_time_s if full.fits else None
            for method in methods:
                try:
                    plan, result = plan_with(method, prof, budget, link, rl)
                except ValueError as err:
                    logger.info("%s %s at %.2f: %s", workload, method, frac, err)
                    plan, result = None, None
                row = _row("simulated", f"{workload}@{frac:.2f}", method, budget, result, plan,
                           ref, prof.batch_size)
                rows.append(row)
        if with_max_batch:
            budget = 0.9 * cluster.device_memory_bytes
            per_sample = prof.at_batch(1)
            for method in methods:
                if method == "exact-milp":
                    continue
                mb = max_batch(method, per_sample, budget, link, hi=max_batch_hi,
                               config=max_batch_rl or rl)
                rows.append({"evidence": "simulated", "workload": f"{workload}@device",
                             "method": method, "budget_bytes": int(budget), "batch": None,
                             "peak_bytes": None, "step_time_s": None, "fits": mb > 0,
                             "throughput_vs_full_recompute": None, "planning_time_s": None,
                             "max_batch": mb})
    return rows


def graph_workloads(paths: Sequence[str], graph_batch: int) -> List[Tuple[str, LayerProfile]]:
    """Profiles of graph files (PipeDream, OpGraph JSON, MINDIR), named by file name."""
    from ms_efficient.graph import load_graph

    out = []
    for path in paths:
        if not os.path.isfile(path):
            raise ValueError(f"--graph file {path!r} does not exist.")
        graph = load_graph(path)
        name = os.path.splitext(os.path.basename(path))[0]
        out.append((name, profile_from_graph(graph, batch_size=graph_batch)))
    return out


def measured_rows(quick: bool, rl: RLConfig) -> List[Dict[str, Any]]:
    """Item 6 on this CPU: none, full recompute, checkmate-milp and MemOpt's recompute part,
    each trained a few GRAPH-mode steps in a fresh process; peak = ru_maxrss.

    The budget is set between the measured peaks of none and full recompute; the planners get
    it shifted by the measured-minus-modelled offset of the unoptimised run (the framework's
    own memory, which the layer model does not see).
    """
    from ms_efficient.memopt.measure import measure_plan

    model = dict(vocab_size=256, seq_length=128, hidden_size=128, num_layers=4, num_heads=8,
                 ffn_hidden_size=256)
    moe = dict(num_experts=4, top_k=2, moe_every=2)
    batch = 16
    cpu = get_cluster("cpu-local")
    prof = profile_from_model(ModelConfig(**model), MoEConfig(**moe), batch, cpu, "float32")
    link = cpu.host_link
    none_m = measure_plan(model, moe, batch, [])
    full_m = measure_plan(model, moe, batch, list(prof.names))
    budget = full_m["peak_bytes"] + 0.5 * (none_m["peak_bytes"] - full_m["peak_bytes"])
    offset = none_m["peak_bytes"] - evaluate(prof, plan_with("none", prof, 1e30, link)[0],
                                             1e30, link).peak_bytes
    model_budget = budget - offset
    rows = []
    measured = {"none": none_m, "full-recompute": full_m}
    for method in (["memopt"] if quick else ["checkmate-milp", "memopt"]):
        try:
            plan, _ = plan_with(method, prof, model_budget, link, rl)
        except ValueError as err:
            logger.info("measured check: %s: %s", method, err)
            continue
        names = [n for n, a in zip(prof.names, plan.actions) if a in (RECOMPUTE, RECOMPUTE_ALL, SWAP)]
        measured[method] = measure_plan(model, moe, batch, names)
    ref = full_m["step_time_s"]
    for method, m in measured.items():
        rows.append({"evidence": "measured", "workload": "gpt-moe-tiny-cpu", "method": method,
                     "budget_bytes": int(budget), "batch": batch, "peak_bytes": int(m["peak_bytes"]),
                     "step_time_s": m["step_time_s"], "fits": m["peak_bytes"] <= budget,
                     "throughput_vs_full_recompute": ref / m["step_time_s"],
                     "planning_time_s": None, "max_batch": None})
    return rows
