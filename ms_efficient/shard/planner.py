"""The sharding plan: from a planning request to a YAML file and back (no MindSpore).

A request is the ``shard:`` section of a config file (``configs/shard_*.yaml``)::

    shard:
      workload: gpt-175b          # a preset of shard.workloads.PRESETS, or `model:` dims below
      batch: 4                    # global batch in sequences (default: the preset's)
      mesh: 4x8                   # dp x mp
      cluster: {preset: ascend910b-4x8}
      objective: budget           # or weighted (comm_weight_gib_per_s)
      comm_budget: {relative_to: megatron-tp, ratio: 1.2}   # or comm_budget_s: 3.0
      tie: binary                 # binary | layer | none (see ShardOptions.tie)
      dp_model_split: true        # dp may split model dims too (2-D TP); false: batch only

A training config (``configs/gpt_moe_tiny.yaml``: model/moe/train sections) is also accepted:
its model is planned at its ``train.batch_size``.

The plan YAML holds the mesh, the cost summary next to the Megatron-TP reference, one entry per
operator template (tie key) with its layout, ZeRO level and MindSpore ``in_strategy``, and a
MindFormers-like ``parallel_config`` section.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence

import yaml

from ms_efficient.core.cluster import ClusterSpec
from ms_efficient.core.config import read_yaml
from ms_efficient.core.fileio import atomic_write_text
from ms_efficient.shard.baselines import METHODS, baseline_cost
from ms_efficient.shard.cost import Cost, CostModel
from ms_efficient.shard.ilp import ShardOptions, ShardSolution, solve_sharding
from ms_efficient.shard.strategies import (AXES, Mesh, OpSpec, Strategy, parse_mesh,
                                          shard_tuple)
from ms_efficient.shard.workloads import TransformerDims, get_workload, transformer_ops

__all__ = ["ShardRequest", "load_request", "default_cluster", "plan", "plan_to_dict",
           "save_plan", "load_plan_strategies", "plan_graph", "graph_plan_to_dict"]

_REQUEST_KEYS = ("workload", "model", "batch", "mesh", "cluster", "objective", "comm_budget",
                 "comm_budget_s", "comm_weight_gib_per_s", "redundancy_weight", "tie",
                 "optimizer_shard", "dp_model_split", "time_limit_s", "mip_gap")


@dataclass
class ShardRequest:
    """A validated planning request: what to plan, on which mesh and cluster, and how."""

    dims: TransformerDims
    mesh: Mesh
    cluster: ClusterSpec
    options: ShardOptions
    budget_ratio: Optional[float] = 1.2      # comm budget relative to budget_method
    budget_method: str = "megatron-tp"


def default_cluster(devices: int) -> ClusterSpec:
    """The smallest Ascend 910B preset with at least ``devices`` devices."""
    from ms_efficient.core.cluster import get_cluster

    for nodes in (1, 4, 16):
        if devices <= nodes * 8:
            return get_cluster(f"ascend910b-{nodes}x8")
    raise ValueError(f"no cluster preset has {devices} devices; give 'cluster' explicitly.")


def _dims_from_run_config(data: Dict[str, Any]) -> TransformerDims:
    from ms_efficient.core.config import config_from_dict

    cfg = config_from_dict(data)
    m, moe = cfg.model, cfg.moe
    return TransformerDims(name=f"gpt-moe-L{m.num_layers}-h{m.hidden_size}", num_layers=m.num_layers,
                           hidden=m.hidden_size, heads=m.num_heads, seq=m.seq_length,
                           batch=cfg.train.batch_size, vocab=m.vocab_size, ffn=m.ffn_hidden_size,
                           num_experts=moe.num_experts, top_k=moe.top_k,
                           capacity_factor=moe.capacity_factor or float(moe.num_experts) / moe.top_k,
                           moe_every=moe.moe_every)


def load_request(path: str, mesh: Optional[str] = None) -> ShardRequest:
    """Read a shard config or a training config (see module docstring); ``mesh`` overrides."""
    data = read_yaml(path)
    sec = data.get("shard")
    if sec is None:          # a training config: its model, on its own cluster when it fits
        cluster = data.get("cluster") or {"preset": "cpu-local"}
        devices = ClusterSpec.from_dict(cluster).num_devices
        req = {"mesh": mesh or f"1x{devices}"}
        if parse_mesh(req["mesh"]).devices <= devices:
            req["cluster"] = cluster
        return _request(req, _dims_from_run_config(data))
    if not isinstance(sec, dict):
        raise ValueError(f"'shard' must be a mapping, but got {sec!r}.")
    unknown = sorted(set(sec) - set(_REQUEST_KEYS))
    if unknown:
        raise ValueError(f"Unknown config key 'shard.{unknown[0]}'; allowed keys in 'shard': "
                         f"{list(_REQUEST_KEYS)}.")
    sec = dict(sec)
    if mesh:
        sec["mesh"] = mesh
    if "model" in sec:
        try:
            dims = TransformerDims(**{"name": "custom", **sec["model"]})
        except TypeError as err:
            raise ValueError(f"'shard.model': {err}") from None
    else:
        dims = get_workload(sec.get("workload", "gpt-1.3b"))
    if "batch" in sec:
        dims = TransformerDims(**{**dims.__dict__, "batch": sec["batch"]})
    return _request(sec, dims)


def _request(sec: Dict[str, Any], dims: TransformerDims) -> ShardRequest:
    flags = {}
    for key in ("optimizer_shard", "dp_model_split"):
        flags[key] = sec.get(key, True)
        if not isinstance(flags[key], bool):
            raise ValueError(f"'shard.{key}' must be true or false, but got {flags[key]!r}.")
    mesh = parse_mesh(sec.get("mesh", "1x8"), **flags)
    cluster = (ClusterSpec.from_dict(sec["cluster"]) if "cluster" in sec
               else default_cluster(mesh.devices))
    ratio, method, budget_s = 1.2, "megatron-tp", sec.get("comm_budget_s")
    if "comm_budget" in sec:
        cb = sec["comm_budget"] or {}
        method = cb.get("relative_to", method)
        ratio = cb.get("ratio", ratio)
        if method not in METHODS:
            raise ValueError(f"'shard.comm_budget.relative_to' must be one of {list(METHODS)}, "
                             f"but got {method!r}.")
        if not isinstance(ratio, (int, float)) or ratio <= 0:
            raise ValueError(f"'shard.comm_budget.ratio' must be a number > 0, but got {ratio!r}.")
    if budget_s is not None:
        ratio = None
    options = ShardOptions(objective=sec.get("objective", "budget"), comm_budget_s=budget_s,
                           comm_weight_gib_per_s=float(sec.get("comm_weight_gib_per_s", 1.0)),
                           redundancy_weight=float(sec.get("redundancy_weight", 0.0)),
                           tie=sec.get("tie", "binary"),
                           time_limit_s=float(sec.get("time_limit_s", 120.0)),
                           mip_gap=float(sec.get("mip_gap", 1e-4)))
    return ShardRequest(dims, mesh, cluster, options, ratio, method)


def plan(req: ShardRequest) -> Dict[str, Any]:
    """Solve a request; returns ``{"specs", "solution", "reference", "model"}``."""
    specs = transformer_ops(req.dims)
    model = CostModel(req.mesh, req.cluster)
    reference = baseline_cost(specs, model, req.budget_method)
    options = req.options
    if req.budget_ratio is not None and options.objective == "budget":
        options = ShardOptions(**{**options.__dict__,
                                  "comm_budget_s": req.budget_ratio * reference.comm_s})
    solution = solve_sharding(specs, model, options)
    return {"specs": specs, "solution": solution, "reference": reference, "model": model,
            "options": options}


def _cost_dict(c: Cost) -> Dict[str, float]:
    d = c.as_dict()
    return {"memory_per_device_bytes": int(round(d["memory"])),
            "params_bytes": int(round(d["params"])), "grads_bytes": int(round(d["grads"])),
            "optimizer_bytes": int(round(d["optim"])),
            "activations_bytes": int(round(d["acts"])),
            "redundant_bytes": int(round(d["redundant"])), "comm_time_s": d["comm_s"]}


def _strategy_dict(spec: OpSpec, st: Strategy, mesh: Mesh) -> Dict[str, Any]:
    lay = st.layout
    return {"prim": spec.prim, "dp": lay.dp, "mp": lay.mp, "scatter": lay.scatter,
            "zero": st.zero, "in_strategy": [list(t) for t in shard_tuple(spec, lay, mesh)],
            # per input, per dim: the mesh axes splitting it (the strategy file's tensor maps)
            "in_axes": [[[a for a in AXES if lay.axis_dim(a) == d] for d in t.dims]
                        for t in spec.inputs]}


def plan_to_dict(req: ShardRequest, result: Dict[str, Any]) -> Dict[str, Any]:
    """The plan as plain YAML-ready data (see module docstring)."""
    specs: Sequence[OpSpec] = result["specs"]
    sol: ShardSolution = result["solution"]
    templates: Dict[str, Dict[str, Any]] = {}
    overrides: Dict[str, Dict[str, Any]] = {}
    for spec in specs:
        entry = _strategy_dict(spec, sol.strategies[spec.name], req.mesh)
        key = spec.tie_key
        if key not in templates:
            templates[key] = {**entry, "ops": 0}
        if {k: v for k, v in templates[key].items() if k != "ops"} == entry:
            templates[key]["ops"] += 1
        else:
            overrides[spec.name] = entry
    seq_parallel = any(t["mp"] == "s" for k, t in templates.items() if k.endswith("ln1"))
    return {
        "kind": "shard",
        "workload": dict(req.dims.__dict__),
        "mesh": {"dp": req.mesh.dp, "mp": req.mesh.mp, "optimizer_shard": req.mesh.optimizer_shard,
                 "dp_model_split": req.mesh.dp_model_split},
        "cluster": req.cluster.name,
        "objective": result["options"].objective,
        "comm_budget_s": result["options"].comm_budget_s,
        "summary": {**_cost_dict(sol.cost), "solve_time_s": sol.solve_time_s,
                    "ilp_groups": sol.groups, "ilp_variables": sol.variables},
        "reference": {"method": req.budget_method, **_cost_dict(result["reference"])},
        "templates": templates,
        "overrides": overrides,
        "keep_producer_split": sol.keep_producer,
        "parallel_config": {"data_parallel": req.mesh.dp, "model_parallel": req.mesh.mp,
                            "use_seq_parallel": seq_parallel,
                            "optimizer_shard": any(t["zero"] for t in templates.values())},
    }


def save_plan(path: str, doc: Dict[str, Any]) -> None:
    """Write the plan YAML atomically."""
    atomic_write_text(path, yaml.safe_dump(doc, sort_keys=False, default_flow_style=None))


def load_plan_strategies(path_or_doc: Any) -> Dict[str, Dict[str, Any]]:
    """``{tie key or op name: strategy entry}`` of a plan file (templates, then overrides)."""
    doc = path_or_doc
    if isinstance(path_or_doc, str):
        from ms_efficient.core.fileio import read_yaml_document

        doc = read_yaml_document(path_or_doc, "shard plan")
    if not isinstance(doc, dict) or doc.get("kind") != "shard":
        raise ValueError("not a shard plan: expected a mapping with kind: shard.")
    return {**doc.get("templates", {}), **doc.get("overrides", {})}


# ---- a user's graph ---------------------------------------------------------------------------
def plan_graph(graph, mesh: Mesh, cluster: ClusterSpec, options: ShardOptions = ShardOptions(),
               budget_ratio: Optional[float] = 1.2, budget_method: str = "megatron-tp",
               tie_units: Optional[Sequence[Sequence[str]]] = None) -> Dict[str, Any]:
    """Solve the ILP over the forward operators of ``graph`` (an ``OpGraph``).

    budget_ratio: the communication budget as a multiple of ``budget_method``'s on the same
        graph and mesh (None or 0: unconstrained, or ``options.comm_budget_s`` as given).
    tie_units: node-name groups of the repeated blocks (see ``specs_from_graph``).
    Returns ``{"ops", "specs", "solution", "reference", "baselines", "model", "options"}``;
    ``baselines`` maps each of ``GRAPH_METHODS`` to its Cost, or to the reason it cannot run.
    """
    from ms_efficient.shard.baselines import GRAPH_METHODS, graph_baseline_cost
    from ms_efficient.shard.graph_ops import specs_from_graph

    ops = specs_from_graph(graph, tie_units)
    model = CostModel(mesh, cluster)
    baselines: Dict[str, Any] = {}
    for method in GRAPH_METHODS:
        try:
            baselines[method] = graph_baseline_cost(ops.specs, model, method)
        except ValueError as err:
            baselines[method] = str(err)
    reference = baselines[budget_method]
    if budget_ratio and options.objective == "budget":
        if not isinstance(reference, Cost):
            raise ValueError(f"the communication budget is relative to {budget_method!r}, "
                             f"which cannot run here: {reference}")
        options = ShardOptions(**{**options.__dict__,
                                  "comm_budget_s": budget_ratio * reference.comm_s})
    from ms_efficient.shard.baselines import graph_baseline_strategies

    # CBC's first incumbent: the least-memory baseline within the budget (on graphs of a few
    # hundred ops CBC may otherwise stop at a worse point within its time limit)
    fits = [(c.memory, m) for m, c in baselines.items() if isinstance(c, Cost) and (
        options.comm_budget_s is None or c.comm_s <= options.comm_budget_s)]
    start = graph_baseline_strategies(ops.specs, model, min(fits)[1]) if fits else None
    solution = solve_sharding(ops.specs, model, options, start=start)
    return {"ops": ops, "specs": ops.specs, "solution": solution, "reference": reference,
            "baselines": baselines, "model": model, "options": options}


def graph_plan_to_dict(graph, result: Dict[str, Any]) -> Dict[str, Any]:
    """The graph plan as YAML-ready data: one entry per operator MindSpore takes a strategy
    for (its layout, ZeRO level, ``in_strategy`` and the parameters it reads), the costs
    next to every baseline, the op types kept whole."""
    model: CostModel = result["model"]
    sol: ShardSolution = result["solution"]
    ops = result["ops"]
    by_name = ops.by_name()
    operators: Dict[str, Dict[str, Any]] = {}
    for name in ops.shardable:
        entry = _strategy_dict(by_name[name], sol.strategies[name], model.mesh)
        entry["params"] = [[int(i), p] for i, p in ops.params.get(name, [])]
        operators[name] = entry
    baselines = {m: (_cost_dict(c) if isinstance(c, Cost) else {"error": c})
                 for m, c in result["baselines"].items()}
    mesh = model.mesh
    return {
        "kind": "shard", "source": "graph", "graph": graph.name,
        "mesh": {"dp": mesh.dp, "mp": mesh.mp, "optimizer_shard": mesh.optimizer_shard,
                 "dp_model_split": mesh.dp_model_split},
        "cluster": model.cluster.name, "evidence": "model",
        "objective": result["options"].objective,
        "comm_budget_s": result["options"].comm_budget_s,
        "summary": {**_cost_dict(sol.cost), "solve_time_s": sol.solve_time_s,
                    "ilp_groups": sol.groups, "ilp_variables": sol.variables,
                    "operators": len(ops.specs)},
        "baselines": baselines,
        "kept_whole": dict(ops.kept_whole),
        "operators": operators,
        "parallel_config": {"data_parallel": mesh.dp, "model_parallel": mesh.mp,
                            "optimizer_shard": any(e["zero"] for e in operators.values())},
    }
