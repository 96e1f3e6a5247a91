"""The shard pass's search: the mesh (dp x mp) chosen together with the strategies, within a
communication budget every user can run, never worse than its own baselines (no MindSpore).

For every factorisation ``dp x mp`` of the cluster's devices (:func:`mesh_factorisations`):

1. the baselines of ``shard.baselines.GRAPH_METHODS`` (DP, ZeRO-1/2/3, Megatron-TP) are costed
   on that mesh by the ILP's own cost model;
2. the communication budget is ``comm_ratio`` x ZeRO-1's communication on that mesh (data
   parallelism with the optimizer states sharded: what any user can run); where ZeRO-1 cannot
   run (the batch does not divide the devices) it is ``comm_ratio x STEP_SHARE`` x the
   network's unoptimised simulated step time (``place.stages.price_network``); a ratio of 0
   leaves the communication unconstrained;
3. the minimal-memory ILP (``shard.ilp``) solves within that budget, started from the
   least-memory baseline that fits it; when its answer keeps more memory per device than that
   baseline (CBC's time limit, an infeasible budget), the baseline's strategies are the plan
   and ``fallback`` names it.

The chosen mesh keeps the least memory per device, where plans within 1% of the device's
memory of the least count as equal (``_TIE_SHARE_OF_DEVICE``) as long as they keep no more
than the best baseline within its budget on any mesh; then it has the larger dp (data
parallelism needs no operator splitting), then the least communication.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from ms_efficient.core.cluster import ClusterSpec
from ms_efficient.shard.baselines import (GRAPH_METHODS, graph_baseline_cost,
                                          graph_baseline_strategies)
from ms_efficient.shard.cost import Cost, CostModel
from ms_efficient.shard.ilp import ShardOptions, ShardSolution, solve_sharding
from ms_efficient.shard.strategies import Mesh

__all__ = ["STEP_SHARE", "mesh_factorisations", "MeshResult", "plan_on_mesh", "search_meshes",
           "plan_graph_doc"]

logger = logging.getLogger(__name__)

# Share of the unoptimised simulated step time the communication may take where ZeRO-1 cannot
# run on a mesh (half: collectives at most double the step, before any overlap).
STEP_SHARE = 0.5
# Memory per device within 1% of the device's memory of the least counts as a tie (a few MiB
# on a 64 GiB device are not worth splitting operators for): then the larger dp wins (data
# parallelism splits no operator), then the least communication.
_TIE_SHARE_OF_DEVICE = 0.01


def mesh_factorisations(devices: int, dp_model_split: bool = False) -> List[Mesh]:
    """Every ``Mesh(dp, mp)`` with ``dp * mp == devices``, dp descending."""
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"'devices' must be a positive integer, but got {devices!r}.")
    return [Mesh(dp, devices // dp, dp_model_split=dp_model_split)
            for dp in range(devices, 0, -1) if devices % dp == 0]


@dataclass
class MeshResult:
    """One mesh's plan. budget_s: communication allowed, seconds per step; budget_from:
    "zero1" or "step_share". fallback: the baseline whose strategies replaced the ILP's
    answer, or None. baselines: method -> Cost, or the reason it cannot run."""

    mesh: Mesh
    model: CostModel
    solution: ShardSolution
    baselines: Dict[str, Any]
    budget_s: float
    budget_from: str
    fallback: Optional[str]
    options: ShardOptions

    def best_baseline(self):
        """(method, Cost) of the least-memory baseline within the budget, or None."""
        fits = [(c.memory, m) for m, c in self.baselines.items()
                if isinstance(c, Cost) and c.comm_s <= self.budget_s * (1 + 1e-9)]
        return (min(fits)[1], self.baselines[min(fits)[1]]) if fits else None

    def summary(self) -> Dict[str, Any]:
        best = self.best_baseline()
        return {"mesh": f"{self.mesh.dp}x{self.mesh.mp}",
                "memory_per_device_bytes": int(round(self.solution.cost.memory)),
                "comm_time_s": float(self.solution.cost.comm_s),
                "budget_s": float(self.budget_s), "budget_from": self.budget_from,
                "best_baseline": None if best is None else best[0],
                "best_baseline_memory_bytes": None if best is None
                else int(round(best[1].memory)),
                "fallback": self.fallback}


def plan_on_mesh(specs, mesh: Mesh, cluster: ClusterSpec, options: ShardOptions,
                 step_time_s: float, comm_ratio: float = 1.0,
                 same_split: Sequence[Sequence] = ()) -> Optional[MeshResult]:
    """Plan ``specs`` (``shard.graph_ops``) on one mesh (module docstring, steps 1-3);
    ``same_split``: uses of tied tensors (``GraphOps.tied``), split alike at every use.
    Returns None when neither the ILP nor any baseline fits the budget."""
    from ms_efficient.shard.cost import evaluate

    model = CostModel(mesh, cluster)
    baselines: Dict[str, Any] = {}
    for method in GRAPH_METHODS:
        try:
            baselines[method] = graph_baseline_cost(specs, model, method)
        except ValueError as err:
            baselines[method] = str(err)
    zero1 = baselines["zero1"]
    if not comm_ratio:
        budget, source = float("inf"), "unconstrained"
    elif isinstance(zero1, Cost):
        budget, source = comm_ratio * zero1.comm_s, "zero1"
    else:
        budget, source = comm_ratio * STEP_SHARE * step_time_s, "step_share"
    opts = ShardOptions(**{**options.__dict__, "objective": "budget",
                           "comm_budget_s": None if budget == float("inf") else budget})
    result = MeshResult(mesh, model, None, baselines, budget, source, None, opts)
    best = result.best_baseline()
    start = graph_baseline_strategies(specs, model, best[0]) if best else None
    try:
        solution = solve_sharding(specs, model, opts, start=start, same_split=same_split)
    except ValueError as err:                  # the budget admits no ILP point
        logger.info("shard: mesh %s: %s", mesh, err)
        solution = None
    if best is not None and (solution is None or
                             solution.cost.memory > best[1].memory * (1 + 1e-9)):
        strategies = graph_baseline_strategies(specs, model, best[0])
        cost = evaluate(specs, strategies, model, saved="consumer")
        solution = ShardSolution(strategies, cost, 0.0 if solution is None else
                                 solution.solve_time_s, f"baseline {best[0]}",
                                 0 if solution is None else solution.groups,
                                 0 if solution is None else solution.variables)
        result.fallback = best[0]
    if solution is None:
        return None
    result.solution = solution
    return result


def search_meshes(specs, cluster: ClusterSpec, options: ShardOptions, step_time_s: float,
                  comm_ratio: float = 1.0, meshes: Optional[Sequence[Mesh]] = None,
                  same_split: Sequence[Sequence] = ()) -> Dict[str, Any]:
    """Plan every mesh (default: :func:`mesh_factorisations` of the cluster) and choose one.

    Returns ``{"best": MeshResult, "meshes": [MeshResult.summary() ...],
    "baseline_bound_bytes": the least memory of a baseline within its budget on any mesh}``;
    raises ValueError
    when no mesh has a plan within its budget."""
    meshes = list(meshes or mesh_factorisations(cluster.num_devices))
    results: List[MeshResult] = []
    rows: List[Dict[str, Any]] = []
    for mesh in meshes:
        got = plan_on_mesh(specs, mesh, cluster, options, step_time_s, comm_ratio, same_split)
        if got is None:
            rows.append({"mesh": f"{mesh.dp}x{mesh.mp}", "error": "nothing fits the budget"})
            continue
        results.append(got)
        rows.append(got.summary())
        logger.info("shard: mesh %s -> %.4g MiB/device, comm %.4g ms (budget %.4g ms, %s)",
                    mesh, got.solution.cost.memory / 2**20, got.solution.cost.comm_s * 1e3,
                    got.budget_s * 1e3, got.budget_from)
    if not results:
        raise ValueError(f"shard: no mesh of {cluster.num_devices} devices has a plan within "
                         f"its communication budget ({rows}).")
    low = min(r.solution.cost.memory for r in results)
    tie = _TIE_SHARE_OF_DEVICE * float(cluster.device_memory_bytes)
    # never more than a baseline within its budget on ANY mesh (the least-memory plan is not)
    bound = min([r.best_baseline()[1].memory for r in results if r.best_baseline()] or
                [float("inf")])
    near = [r for r in results if r.solution.cost.memory <= low + tie and
            r.solution.cost.memory <= bound * (1 + 1e-9)]
    best = min(near, key=lambda r: (-r.mesh.dp, r.solution.cost.comm_s))
    return {"best": best, "meshes": rows, "baseline_bound_bytes": bound}


def _tie_units(graph) -> Optional[List[List[str]]]:
    """Node-name groups of the graph's repeated blocks (``specs_from_graph``'s tie_units)."""
    from ms_efficient.graph.cells import assign_units, cell_tree_from_graph, repeated_blocks

    try:
        blocks = repeated_blocks(cell_tree_from_graph(graph))
        if not blocks:
            return None
        units = assign_units(graph, blocks)
    except ValueError:              # no Cell scopes, or a block without parameter operators
        return None
    names = [n.name for n in graph]
    return [[names[i] for i in units.members(u)] for u in range(len(units.units))]


def device_share(ops, best: "MeshResult") -> Dict[str, Dict[str, Any]]:
    """What one device keeps of each forward operator under the chosen plan, for the passes
    that plan after shard (``memopt``, the combined report): ``output_split`` {op name: the
    number of pieces its output is split into (its strategy's output placement)} and
    ``state_bytes`` {op name: parameter state bytes per device (weights, gradients, optimizer
    states; ``shard.cost.CostModel.node_cost``)}, for ops that differ from one unsplit device
    (split > 1, or state bytes of a parameter-loading op)."""
    from ms_efficient.shard.strategies import output_placement, shard_factor

    split: Dict[str, int] = {}
    state: Dict[str, int] = {}
    mesh, model = best.mesh, best.model
    for spec in ops.specs:
        strategy = best.solution.strategies[spec.name]
        k = shard_factor(output_placement(spec, strategy.layout), mesh)
        if k > 1:
            split[spec.name] = int(k)
        cost = model.node_cost(spec, strategy)
        if cost.params + cost.grads + cost.optim > 0:
            state[spec.name] = int(round(cost.params + cost.grads + cost.optim))
    return {"output_split": split, "state_bytes": state}


def plan_graph_doc(graph, cluster: ClusterSpec, step_time_s: float, comm_ratio: float = 1.0,
                   meshes: Optional[Sequence[Mesh]] = None, time_limit_s: float = 30.0
                   ) -> Dict[str, Any]:
    """The shard plan of a graph (an ``OpGraph``, train-step or forward) as the shard pass and
    ``ms-efficient plan shard GRAPH`` write it: :func:`search_meshes` over the operators of
    ``shard.graph_ops`` (repeated blocks tied to one strategy, tied parameters split alike),
    then ``shard.planner.graph_plan_to_dict`` of the chosen mesh plus ``budget``,
    ``fallback`` (and a ``note`` when set), ``meshes``, ``baseline_bound_bytes`` and ``tied``
    (each tied parameter's uses by Cell path and their splits). step_time_s: the unoptimised
    simulated step (``place.stages.price_network``), seconds."""
    from ms_efficient.graph.cells import node_cell_path
    from ms_efficient.shard.graph_ops import specs_from_graph
    from ms_efficient.shard.planner import graph_plan_to_dict
    from ms_efficient.shard.strategies import split_at_uses

    ops = specs_from_graph(graph, _tie_units(graph))
    found = search_meshes(ops.specs, cluster, ShardOptions(tie="layer", time_limit_s=time_limit_s),
                          step_time_s, comm_ratio, meshes, same_split=list(ops.tied.values()))
    best = found["best"]
    doc = graph_plan_to_dict(graph, {"ops": ops, "solution": best.solution,
                                     "baselines": best.baselines, "model": best.model,
                                     "options": best.options})
    doc["comm_budget_s"] = best.budget_s
    doc["budget"] = {"comm_s": best.budget_s, "from": best.budget_from, "ratio": comm_ratio}
    doc["fallback"] = best.fallback
    if best.fallback:
        doc["note"] = (f"the ILP's answer kept more memory per device than the "
                       f"{best.fallback} baseline within the same budget; the plan is "
                       f"{best.fallback}'s strategies")
    doc["meshes"] = found["meshes"]
    doc["baseline_bound_bytes"] = found["baseline_bound_bytes"]   # best baseline, any mesh
    doc["device_share"] = device_share(ops, best)
    doc["tied"] = {}
    for name, uses in ops.tied.items():
        splits = split_at_uses(ops.specs, best.solution.strategies, best.mesh, uses)
        doc["tied"][name] = {"uses": [node_cell_path(graph, graph[op].scope) for op, _ in uses],
                             "in_strategy": splits,
                             "consistent": all(t == splits[0] for t in splits)}
    return doc
