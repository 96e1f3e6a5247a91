"""MemOpt benchmark rows: every method on the same profiles and budgets (simulated, Ascend
910B preset) plus the measured CPU check. No MindSpore import at module level: the measured
part spawns a child process, and ``vision_workloads`` imports MindSpore (and mindcv) only to
export a model the first time (``ms_efficient.models.zoo`` caches the graph).

Row: {"evidence", "workload", "method", "budget_bytes", "peak_bytes", "step_time_s",
"max_batch", "fits", "throughput_vs_full_recompute", "planning_time_s"}; device rows add
"max_batch_bound" and "max_batch_link_estimate" (``planner``); measured rows add
"simulated_peak_bytes", "step_time_median_s", "step_cpu_s", "load_avg_1min" and
"recomputed_cells" (see ``ms_efficient.memopt.measure.measured_check``).
Run times: see ``ms_efficient.memopt.commands``.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ms_efficient.core.cluster import ClusterSpec
from ms_efficient.core.config import ModelConfig, MoEConfig
from ms_efficient.memopt.agents import RLConfig
from ms_efficient.memopt.env import evaluate, min_budget_bytes
from ms_efficient.memopt.planner import (METHODS, WARM_START_METHODS, max_batch_bound,
                                         max_batch_link_estimate, max_batches, plan_with)
from ms_efficient.memopt.profile import LayerProfile, profile_from_graph, profile_from_model

__all__ = ["gpt_workloads", "graph_workloads", "vision_workloads", "simulated_rows",
           "measured_rows", "summarise", "EXACT_MAX_LAYERS"]

logger = logging.getLogger(__name__)

# exact-milp runs on chains up to this many layers (48-layer GPT profiles solve in ~0.2 s,
# the 100-layer one in a few seconds; the MILP grows with L^2 through its segment terms)
EXACT_MAX_LAYERS = 128

# GPT-style sizes (name, layers, hidden, heads, ffn, seq, experts/top_k or None, batch)
_GPT_SIZES = [
    ("gpt-350m", 24, 1024, 16, 4096, 2048, None, 8),
    ("gpt-1.3b", 24, 2048, 16, 8192, 2048, None, 4),
    ("gpt-moe-8x350m", 24, 1024, 16, 4096, 2048, (8, 2), 4),
    ("gpt-6.7b-l50", 50, 4096, 32, 16384, 2048, None, 1),
]


def gpt_workloads(quick: bool, cluster: ClusterSpec) -> List[Tuple[str, LayerProfile]]:
    """Estimated profiles of GPT-style configs (fp16) on ``cluster``; ``quick``: the dense and
    the MoE 350M configs."""
    out = []
    for name, layers, h, a, ffn, s, moe, batch in (_GPT_SIZES[:3:2] if quick else _GPT_SIZES):
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
    device's memory (90%), the largest batch per method (``max_batches``, exact-milp left
    out: it is a yardstick for small graphs). MemOpt is warm-started from the baselines'
    plans at the same budget instead of solving the MILP again."""
    rows: List[Dict[str, Any]] = []
    link = cluster.host_link
    for workload, prof in workloads:
        none_peak = evaluate(prof, plan_with("none", prof, 1e30, link)[0], 1e30, link).peak_bytes
        low = min_budget_bytes(prof)
        methods = [m for m in METHODS if m != "exact-milp" or prof.num_layers <= EXACT_MAX_LAYERS]
        for frac in fractions:
            budget = low + frac * (none_peak - low)
            done: Dict[str, Tuple[Any, Any]] = {}
            for method in sorted(methods, key=lambda m: m == "memopt"):   # memopt last
                warm = {m: done[m][0] for m in WARM_START_METHODS if m in done}
                try:
                    done[method] = plan_with(method, prof, budget, link, rl, candidates=warm)
                except ValueError as err:
                    logger.info("%s %s at %.2f: %s", workload, method, frac, err)
                    done[method] = (None, None)
            full = done["full-recompute"][1]
            ref = full.step_time_s if full.fits else None
            for method in methods:
                plan, result = done[method]
                rows.append(_row("simulated", f"{workload}@{frac:.2f}", method, budget, result,
                                 plan, ref, prof.batch_size))
        if with_max_batch:
            budget = 0.9 * cluster.device_memory_bytes
            batch_methods = [m for m in methods if m != "exact-milp"]
            bound = max_batch_bound(prof, budget)
            if bound == 0:
                logger.warning("%s: not even batch 1 fits %s (static bytes %.3g): no "
                               "max-batch rows", workload, budget, prof.static_bytes)
                continue
            found = max_batches(batch_methods, prof.at_batch(1), budget, link, hi=max_batch_hi,
                                config=max_batch_rl or rl)
            estimate = max_batch_link_estimate(prof, budget, link)
            for method in batch_methods:
                rows.append({"evidence": "simulated", "workload": f"{workload}@device",
                             "method": method, "budget_bytes": int(budget), "batch": None,
                             "peak_bytes": None, "step_time_s": None, "fits": found[method] > 0,
                             "throughput_vs_full_recompute": None, "planning_time_s": None,
                             "max_batch": found[method], "max_batch_bound": bound,
                             "max_batch_link_estimate": estimate,
                             "max_batch_capped": found[method] >= max_batch_hi})
    return rows


def summarise(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The issue's targets per workload, from simulated rows (``simulated_rows``), next to
    what the layer model lets any planner reach:

    - budget rows (``<workload>@<fraction>``): MemOpt's throughput vs full recompute (target:
      >= 1.2, judged only where full recompute fits the budget) and the exact MILP's (the
      optimum of the chain model, where it ran: what any plan can reach), and MemOpt's step
      over the exact MILP's (target: <= 1.03); ``met`` is None when neither applies;
    - device rows (``<workload>@device``): MemOpt's largest batch over the best baseline's
      (target: >= 1.15) and ``max_batch_bound`` over the best baseline's (the most any
      planner can reach: when it is below 1.15 the target is out of reach on this workload),
      and the host-link estimate (``planner.max_batch_link_estimate``) over it.
    """
    cases: Dict[str, Dict[str, Dict[str, Any]]] = {}
    for r in rows:
        if r["evidence"] == "simulated":
            cases.setdefault(r["workload"], {})[r["method"]] = r
    out: List[Dict[str, Any]] = []
    for workload, by_method in cases.items():
        mem = by_method.get("memopt")
        if mem is None:
            continue
        if workload.endswith("@device"):
            base = {m: r["max_batch"] for m, r in by_method.items()
                    if m not in ("memopt", "exact-milp")}
            best = max(base, key=lambda m: (base[m], m))
            denom = max(base[best], 1)
            out.append({"workload": workload, "metric": "max batch", "memopt": mem["max_batch"],
                        "best_baseline": f"{best} {base[best]}",
                        "bound": mem.get("max_batch_bound"),
                        "memopt_vs_best": mem["max_batch"] / denom,
                        "bound_vs_best": (mem["max_batch_bound"] / denom
                                          if mem.get("max_batch_bound") else None),
                        "link_estimate": mem.get("max_batch_link_estimate"),
                        "link_estimate_vs_best": (mem["max_batch_link_estimate"] / denom
                                                  if mem.get("max_batch_link_estimate")
                                                  else None),
                        "target": ">= 1.15 x best baseline",
                        "met": mem["max_batch"] >= 1.15 * base[best]})
            continue
        exact = by_method.get("exact-milp")
        exact_ok = exact is not None and exact["fits"]
        ratio = (mem["step_time_s"] / exact["step_time_s"]
                 if exact_ok and mem["step_time_s"] else None)
        speedup = mem["throughput_vs_full_recompute"]    # None: full recompute does not fit
        out.append({"workload": workload, "metric": "throughput vs full recompute",
                    "memopt": speedup,
                    "exact_milp": exact["throughput_vs_full_recompute"] if exact_ok else None,
                    "memopt_step_vs_exact": ratio,
                    "target": ">= 1.2; step <= 1.03 x exact",
                    "met": (None if speedup is None and ratio is None else
                            bool((speedup is None or speedup >= 1.2)
                                 and (ratio is None or ratio <= 1.03)))})
    return out


def graph_workloads(paths: Sequence[str], graph_batch: int,
                    cluster: Optional[ClusterSpec] = None) -> List[Tuple[str, LayerProfile]]:
    """Profiles of graph files (PipeDream, OpGraph JSON, MINDIR), named by file name; nodes
    without measured times are timed from their FLOPs on ``cluster``."""
    from ms_efficient.graph import load_graph

    out = []
    for path in paths:
        if not os.path.isfile(path):
            raise ValueError(f"--graph file {path!r} does not exist.")
        graph = load_graph(path)
        name = os.path.splitext(os.path.basename(path))[0]
        out.append((name, profile_from_graph(graph, batch_size=graph_batch, cluster=cluster)))
    return out


def vision_workloads(quick: bool, cluster: ClusterSpec,
                     cache_dir: Optional[str] = None) -> List[Tuple[str, LayerProfile]]:
    """Profiles of mindcv vision models (MINDIR export of one image, so ``at_batch`` scales
    it; timed from FLOPs on ``cluster``): resnet50, plus inception_v3 unless ``quick``.
    Empty when mindcv is not installed."""
    from ms_efficient.models.zoo import mindcv_graph

    out = []
    for model in ("resnet50",) if quick else ("resnet50", "inception_v3"):
        graph = mindcv_graph(model, batch=1, cache_dir=cache_dir)
        if graph is not None:
            prof = profile_from_graph(graph, batch_size=1, cluster=cluster)
            out.append((f"{model} (mindcv)", prof.at_batch(_VISION_BATCH)))
    return out


_VISION_BATCH = 64   # images per step at which the vision models are planned


def measured_rows(rl: RLConfig, steps: int = 10) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    """Item 6 on this CPU (``ms_efficient.memopt.measure.measured_check``): (rows with
    evidence "measured", calibration info for the JSON meta). One MindSpore process of
    10-25 s per distinct recomputed Cell set (5-7 processes, ~1.5-2 min)."""
    from ms_efficient.memopt.measure import measured_check

    return measured_check(rl, steps=steps)
