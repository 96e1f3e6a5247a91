"""Placement benchmark: TGA against its baselines on the same problems and cost model.

Every method places the same units of the same ``PlacementProblem`` and is judged by
``simulate_placement`` (evidence: simulated). Search methods (tga, ga-single,
hierarchical) get the same number of cost evaluations: ga-single and hierarchical get
exactly the distinct evaluations TGA used, whatever time that takes (up to
``_BASELINE_TIME_FACTOR`` x the time budget); TGA's own time budget counts the time spent
building the problem. m-ETF and m-SCT are judged running each device's units in their own
list-schedule order (their plan includes it). Each workload is run at every micro-batch
count asked for: Baechi's
m-ETF and m-SCT schedule one batch, so micro_batches=1 is their own setting, while
micro-batched pipelines (e.g. 8) are what TGA's pipeline search targets; the summary
reports both. Rows follow ``ms_efficient.core.benchio``.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ms_efficient.core.cluster import ClusterSpec, get_cluster
from ms_efficient.graph.opgraph import OpGraph
from ms_efficient.place import baselines as baselines
from ms_efficient.place.cost import simulate_placement, step_time_lower_bound
from ms_efficient.place.hierarchical import HierarchicalConfig, hierarchical
from ms_efficient.place.planner import SearchResult, TGAConfig, ga_single, tga
from ms_efficient.place.problem import PlacementOptions, PlacementProblem, build_problem

__all__ = ["METHODS", "BAECHI", "cluster_with_devices", "run_methods", "bench_workload",
           "summarise", "plot_traces"]

logger = logging.getLogger(__name__)

_BASELINE_TIME_FACTOR = 5.0  # time cap of ga-single/hierarchical, x the search time budget
METHODS = ("tga", "m-topo", "m-etf", "m-sct", "hierarchical", "ga-single", "contiguous",
           "round-robin")
BAECHI = ("m-topo", "m-etf", "m-sct")
# heuristics: problem -> (placement, program order or None)
_HEURISTICS: Dict[str, Callable[[PlacementProblem], Tuple[np.ndarray, Optional[np.ndarray]]]] = {
    "m-topo": lambda p: (baselines.m_topo(p), None), "m-etf": baselines.m_etf_plan,
    "m-sct": baselines.m_sct_plan, "contiguous": lambda p: (baselines.contiguous(p), None),
    "round-robin": lambda p: (baselines.round_robin(p), None),
}


def cluster_with_devices(devices: int, base: str = "ascend910b-1x8") -> ClusterSpec:
    """The ``base`` preset resized to ``devices`` (up to 8: one node; else nodes of 8)."""
    spec = get_cluster(base)
    if devices <= spec.devices_per_node:
        return spec.with_overrides(devices_per_node=devices, name=f"{base}-as-1x{devices}")
    if devices % spec.devices_per_node:
        raise ValueError(f"'--devices' must be <= {spec.devices_per_node} or a multiple of it, "
                         f"but got {devices}.")
    return spec.with_overrides(nodes=devices // spec.devices_per_node,
                               name=f"{base}-as-{devices // spec.devices_per_node}x8")


def run_methods(problem: PlacementProblem, methods: Sequence[str], evaluations: int,
                time_budget_s: Optional[float], seed: int,
                spent_s: float = 0.0) -> Dict[str, SearchResult]:
    """Run each method on ``problem``; search methods share TGA's evaluation count.

    time_budget_s: wall-clock seconds for TGA including ``spent_s`` already spent (building
    the graph and the problem); the other searches may take up to
    ``_BASELINE_TIME_FACTOR x time_budget_s`` to use the same evaluations. None = no
    wall-clock limit: every search stops on its counts (reproducible)."""
    if time_budget_s is None:
        time_budget_s = math.inf
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise ValueError(f"unknown placement methods {unknown}; known: {list(METHODS)}.")
    out: Dict[str, SearchResult] = {}
    if "tga" in methods:
        out["tga"] = tga(problem, TGAConfig(seed=seed, max_evaluations=evaluations,
                                            time_budget_s=max(time_budget_s - spent_s, 1e-3)))
        evaluations = out["tga"].evaluations
    cap_s = _BASELINE_TIME_FACTOR * time_budget_s
    for name in methods:
        if name in _HEURISTICS:
            t0 = time.perf_counter()
            assign, order = _HEURISTICS[name](problem)
            out[name] = SearchResult(name, assign, math.nan, 0, time.perf_counter() - t0,
                                     order=order)
        elif name == "ga-single":
            out[name] = ga_single(problem, TGAConfig(seed=seed, max_evaluations=evaluations,
                                                     time_budget_s=cap_s))
        elif name == "hierarchical":
            out[name] = hierarchical(problem, HierarchicalConfig(
                seed=seed, max_evaluations=evaluations, time_budget_s=cap_s))
        if name in ("ga-single", "hierarchical") and out[name].evaluations < evaluations:
            logger.warning("%s on %s used %d of %d evaluations in %.0f s (time cap %.0f s; "
                           "else its samples kept repeating known plans)", name, problem.name,
                           out[name].evaluations, evaluations, out[name].search_time_s, cap_s)
    return out


def bench_workload(graph: OpGraph, workload: str, devices: int, methods: Sequence[str],
                   evaluations: int, time_budget_s: float, seed: int, micro_batches: int,
                   graph_s: float = 0.0) -> Tuple[List[dict], Dict[str, SearchResult]]:
    """Rows (one per method) for one workload on ``devices`` devices, plus the results.

    graph_s: seconds already spent building ``graph``; search_time_s of every row counts
    it and the problem build, and TGA's time budget includes both."""
    cluster = cluster_with_devices(devices)
    t0 = time.perf_counter()
    problem = build_problem(graph, cluster, PlacementOptions(micro_batches=micro_batches),
                            name=workload)
    build_s = time.perf_counter() - t0 + graph_s
    results = run_methods(problem, methods, evaluations, time_budget_s, seed, spent_s=build_s)
    bound_s = step_time_lower_bound(problem)
    rows = []
    for name in methods:
        res = results[name]
        cost = simulate_placement(problem, res.assign, order=res.order)
        rows.append({"evidence": "simulated", "workload": workload, "method": name,
                     "devices": devices, "step_time_s": cost.step_time_s,
                     "peak_memory_bytes": float(cost.peak_memory_bytes.max()),
                     "search_time_s": res.search_time_s + build_s,
                     "evaluations": res.evaluations, "feasible": cost.feasible,
                     "devices_used": int(len(np.unique(res.assign))),
                     "ops": len(graph), "units": problem.num_units,
                     "micro_batches": micro_batches, "step_time_bound_s": bound_s})
    return rows, results


def _geomean(values: List[float]) -> float:
    return float(np.exp(np.mean(np.log(values)))) if values else math.nan


def summarise(rows: List[dict]) -> List[dict]:
    """TGA's geometric-mean ratios to the best Baechi method and to Hierarchical (the
    issue's targets), the same for the lower bound (``step_time_lower_bound``: the best any
    planner could reach), and per method the geomean of step time / TGA's, over the cases
    (workload, devices, micro-batches): for all cases and, when several micro-batch counts
    were run, for each count (metric names end in "M=<count>")."""
    counts = sorted({r.get("micro_batches", 1) for r in rows})
    out = _summary(rows, "")
    if len(counts) > 1:
        for m in counts:
            out += _summary([r for r in rows if r.get("micro_batches", 1) == m], f", M={m}")
    return out


def _summary(rows: List[dict], tag: str) -> List[dict]:
    cases: Dict[Tuple[str, int, int], Dict[str, float]] = {}
    for r in rows:
        key = (r["workload"], r["devices"], r.get("micro_batches", 1))
        cases.setdefault(key, {})[r["method"]] = r["step_time_s"]
        if "step_time_bound_s" in r:
            cases[key]["bound"] = r["step_time_bound_s"]
    out = []
    # "best of the three Baechi methods": only cases where all three ran
    with_baechi = [c for c in cases.values() if "tga" in c and all(m in c for m in BAECHI)]
    to_baechi = [c["tga"] / min(c[m] for m in BAECHI) for c in with_baechi]
    floor = [c["bound"] / min(c[m] for m in BAECHI) for c in with_baechi if "bound" in c]
    to_hier = [c["tga"] / c["hierarchical"] for c in cases.values()
               if "tga" in c and "hierarchical" in c]
    floor_hier = [c["bound"] / c["hierarchical"] for c in cases.values()
                  if "bound" in c and "hierarchical" in c]
    out.append({"metric": f"tga / best Baechi (geomean{tag})", "value": _geomean(to_baechi),
                "best_case": min(to_baechi, default=math.nan), "target": "<= 0.8 (best <= 0.6)",
                "cases": len(to_baechi)})
    if floor:   # what any method could reach: the lower bound over the best Baechi method
        out.append({"metric": f"lower bound / best Baechi (geomean{tag})",
                    "value": _geomean(floor), "best_case": min(floor), "target": "-",
                    "cases": len(floor)})
    out.append({"metric": f"tga / hierarchical (geomean{tag})", "value": _geomean(to_hier),
                "best_case": min(to_hier, default=math.nan), "target": "<= 0.75",
                "cases": len(to_hier)})
    if floor_hier:
        out.append({"metric": f"lower bound / hierarchical (geomean{tag})",
                    "value": _geomean(floor_hier), "best_case": min(floor_hier),
                    "target": "-", "cases": len(floor_hier)})
    methods = sorted({r["method"] for r in rows} - {"tga"}, key=lambda m: METHODS.index(m))
    for m in methods:
        ratios = [c[m] / c["tga"] for c in cases.values() if m in c and "tga" in c]
        out.append({"metric": f"{m} / tga (geomean{tag})", "value": _geomean(ratios),
                    "best_case": min(ratios, default=math.nan), "target": "-",
                    "cases": len(ratios)})
    return out


def plot_traces(traces: Dict[str, Dict[str, SearchResult]], path: str) -> None:
    """Convergence of the search methods (best step time vs evaluations), one panel per
    case, saved as PNG (matplotlib Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [k for k, v in traces.items() if any(r.trace for r in v.values())]
    if not cases:
        return
    cols = min(3, len(cases))
    rows_n = -(-len(cases) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.2 * cols, 3.2 * rows_n), squeeze=False)
    for ax, case in zip(axes.ravel(), cases):
        for name, res in traces[case].items():
            if res.trace:
                ax.step([p.evaluations for p in res.trace], [p.best_s * 1e3 for p in res.trace],
                        where="post", label=name)
        tga_res = traces[case].get("tga")
        if tga_res is not None and tga_res.trace:
            ax.plot([p.evaluations for p in tga_res.trace],
                    [p.explore_best_s * 1e3 for p in tga_res.trace], ":", lw=0.8,
                    label="tga explore pop.")
        ax.set_title(case, fontsize=9)
        ax.set_xlabel("cost evaluations")
        ax.set_ylabel("best step time (ms, simulated)")
        ax.legend(fontsize=7)
    for ax in axes.ravel()[len(cases):]:
        ax.axis("off")
    fig.tight_layout()
    from ms_efficient.core.fileio import atomic_write_with

    atomic_write_with(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"), suffix=".png")
    plt.close(fig)
