"""Placement plans: the YAML file, and pipeline stages applied to a MindSpore Cell tree.

Plan YAML (``kind: place``, version 1)::

    kind: place
    version: 1
    method: tga
    graph: GPTMoE                     # graph name
    cluster: ascend910b-1x8
    devices: 8
    micro_batches: 8
    step_time_s: 0.0123               # simulated (evidence: simulated)
    peak_memory_bytes: [..]           # per device
    stages: [{stage: 0, device: 3, ops: 41, first: node0, last: node40,
              compute_s: 0.01, memory_bytes: ...}, ...]
    assignment: {node name: device}
    parallel_config: {pipeline_stage: 4, micro_batch_num: 8}   # MindFormers shape

Stages are the used devices in a topological order of the device graph (an edge d -> d'
when data flows from d to d'; ties by the position of each device's first operator), so
stage ids follow the dataflow as MindSpore's ``pipeline_stage`` expects; parallel
branches may sit on devices of the same pipeline. When devices feed each other in a cycle
(a fine-grained model-parallel plan, not a pipeline) the stages fall back to the order of
first use and ``meta.pipeline`` is false.
``apply_pipeline_stages`` imports nothing from MindSpore: it only walks
``network.cells_and_names()`` and sets ``cell.pipeline_stage``.
"""
from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

import numpy as np

from ms_efficient.core.fileio import atomic_write_text
from ms_efficient.core.registry import PassRefused, register_pass
from ms_efficient.graph.cells import scope_path, user_cell_path
from ms_efficient.place.cost import simulate_placement
from ms_efficient.place.problem import PlacementProblem

__all__ = ["PlacementPlan", "make_plan", "save_plan", "load_plan", "apply_pipeline_stages",
           "apply_block_stages", "place_pass", "user_cell_path"]

logger = logging.getLogger(__name__)

PLAN_VERSION = 1
# The place pass's search: TGA's distinct evaluations (as `bench place --quick`) and its
# wall-time cap, seconds: none (inf), so the pass gives the same plan on a busy machine.
PLACE_PASS_EVALUATIONS = 300
PLACE_PASS_TIME_S = math.inf


@dataclass
class PlacementPlan:
    """A placement. assignment: node -> device; stage_of_device: device -> stage (used
    devices only); scopes: node -> cell scope (for apply); other fields as in the YAML."""

    method: str
    graph: str
    cluster: str
    devices: int
    micro_batches: int
    step_time_s: float
    peak_memory_bytes: List[float]
    assignment: Dict[str, int]
    stage_of_device: Dict[int, int]
    stages: List[Dict[str, Any]] = field(default_factory=list)
    scopes: Dict[str, str] = field(default_factory=dict)
    meta: Dict[str, Any] = field(default_factory=dict)

    def stage_of_node(self, name: str) -> int:
        return self.stage_of_device[self.assignment[name]]

    def to_dict(self) -> Dict[str, Any]:
        return {
            "kind": "place", "version": PLAN_VERSION, "method": self.method,
            "graph": self.graph, "cluster": self.cluster, "devices": self.devices,
            "micro_batches": self.micro_batches, "step_time_s": float(self.step_time_s),
            "peak_memory_bytes": [float(b) for b in self.peak_memory_bytes],
            "stages": self.stages, "meta": self.meta,
            "parallel_config": {"pipeline_stage": len(self.stage_of_device),
                                "micro_batch_num": self.micro_batches},
            "assignment": {k: int(v) for k, v in self.assignment.items()},
            "scopes": self.scopes,
        }


def _device_stages(problem: PlacementProblem, unit_assign: np.ndarray) -> Tuple[List[int], bool]:
    """(used devices in stage order, True when the device graph is acyclic)."""
    first_use: List[int] = []
    for u in range(problem.num_units):
        if int(unit_assign[u]) not in first_use:
            first_use.append(int(unit_assign[u]))
    rank = {d: i for i, d in enumerate(first_use)}
    src, dst = unit_assign[problem.edge_src], unit_assign[problem.edge_dst]
    flows = {(int(a), int(b)) for a, b in zip(src, dst) if a != b}
    waiting = Counter(b for _, b in flows)
    ready = sorted((rank[d] for d in first_use if not waiting[d]))
    order: List[int] = []
    while ready:  # Kahn's algorithm, earliest first use first
        d = first_use[ready.pop(0)]
        order.append(d)
        for a, b in flows:
            if a == d:
                waiting[b] -= 1
                if not waiting[b]:
                    ready = sorted(ready + [rank[b]])
    if len(order) < len(first_use):
        return first_use, False
    return order, True


def make_plan(problem: PlacementProblem, unit_assign: np.ndarray, method: str,
              scopes: Dict[str, str] = None, meta: Dict[str, Any] = None,
              order=None) -> PlacementPlan:
    """Simulate ``unit_assign`` ([U] devices, run in program ``order``, default the unit
    numbering) and describe it as a plan."""
    cost = simulate_placement(problem, unit_assign, order=order)
    assignment = problem.node_assignment(unit_assign)
    stage_devices, pipeline = _device_stages(problem, unit_assign)
    stage_of_device = {d: s for s, d in enumerate(stage_devices)}
    stages = []
    for d in stage_devices:
        units = np.flatnonzero(unit_assign == d)
        ops = int(np.isin(problem.unit_of_node, units).sum())
        stages.append({"stage": stage_of_device[d], "device": d, "ops": ops,
                       "first": problem.unit_names[units[0]],
                       "last": problem.unit_names[units[-1]],
                       "compute_s": float((problem.fwd_s + problem.bwd_s)[units].sum()),
                       "memory_bytes": float(cost.peak_memory_bytes[d])})
    return PlacementPlan(method=method, graph=problem.name, cluster=problem.cluster.name,
                         devices=problem.num_devices, micro_batches=problem.micro_batches,
                         step_time_s=cost.step_time_s,
                         peak_memory_bytes=cost.peak_memory_bytes.tolist(),
                         assignment=assignment, stage_of_device=stage_of_device, stages=stages,
                         scopes=dict(scopes or {}),
                         meta={"feasible": cost.feasible, "evidence": "simulated",
                               "pipeline": pipeline, **(meta or {})})


def save_plan(plan: PlacementPlan, path: str) -> None:
    """Write the plan YAML atomically."""
    import yaml

    atomic_write_text(path, yaml.safe_dump(plan.to_dict(), sort_keys=False))


def load_plan(path: str) -> PlacementPlan:
    """Read a plan written by ``save_plan``; ValueError names what is wrong."""
    from ms_efficient.core.fileio import read_yaml_document

    data = read_yaml_document(path, "placement plan")
    if not isinstance(data, dict) or data.get("kind") != "place":
        raise ValueError(f"{path}: not a placement plan (expected 'kind: place').")
    if data.get("version") != PLAN_VERSION:
        raise ValueError(f"{path}: unsupported plan version {data.get('version')!r}.")
    missing = [k for k in ("method", "graph", "cluster", "devices", "micro_batches",
                           "step_time_s", "peak_memory_bytes", "assignment") if k not in data]
    if missing:
        raise ValueError(f"{path}: placement plan is missing {missing}.")
    try:
        return _plan_from_data(data)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise ValueError(f"{path}: malformed placement plan ({type(err).__name__}: {err}).") \
            from None


def _plan_from_data(data: Dict[str, Any]) -> PlacementPlan:
    stage_of_device = {int(s["device"]): int(s["stage"]) for s in data.get("stages", [])}
    return PlacementPlan(method=data["method"], graph=data["graph"], cluster=data["cluster"],
                         devices=int(data["devices"]), micro_batches=int(data["micro_batches"]),
                         step_time_s=float(data["step_time_s"]),
                         peak_memory_bytes=list(data["peak_memory_bytes"]),
                         assignment={k: int(v) for k, v in data["assignment"].items()},
                         stage_of_device=stage_of_device, stages=data.get("stages", []),
                         scopes=dict(data.get("scopes") or {}), meta=data.get("meta") or {})


def apply_pipeline_stages(network: Any, plan: PlacementPlan) -> Dict[str, int]:
    """Set ``cell.pipeline_stage`` on the cells of ``network`` from a plan.

    Every cell whose scope holds planned operators gets the most common stage of those
    operators (ties: the lower stage); cells without operators inherit their parent's stage.
    Sibling cells get non-decreasing stages in registration order (the dataflow order of
    a sequential model), as pipeline parallelism needs. The root Cell spans every stage and
    keeps its own ``pipeline_stage``. Returns {cell name: stage} (the root's "" entry is the
    stage its unvoted children inherit, not set on it).
    """
    votes: Dict[str, Counter] = {}
    for node, scope in plan.scopes.items():
        if node not in plan.assignment:
            continue
        path = scope_path(scope)
        stage = plan.stage_of_node(node)
        while True:  # a node votes for its cell and every ancestor cell
            votes.setdefault(path, Counter())[stage] += 1
            if not path:
                break
            path = path.rsplit(".", 1)[0] if "." in path else ""
    if not votes:
        raise ValueError(f"plan for {plan.graph!r} has no operator scopes; build it from a "
                         "MindSpore graph (MINDIR) so cells can be matched.")
    out: Dict[str, int] = {}
    floor: Dict[str, int] = {}  # parent cell -> largest stage among its earlier children
    for name, cell in network.cells_and_names():
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        if name in votes:
            counts = votes[name]
            top = max(counts.values())
            stage = min(s for s, c in counts.items() if c == top)
        else:
            stage = out.get(parent, 0)
        if name:  # siblings follow the dataflow: stages never go back
            stage = max(stage, floor.get(parent, 0))
            floor[parent] = stage
            cell.pipeline_stage = int(stage)   # never the root: it spans every stage
        out[name] = int(stage)
    return out


def _batch_size(sample_inputs) -> int:
    shape = getattr((sample_inputs or [None])[0], "shape", None)
    if not shape:
        raise ValueError("place: the first sample input has no batch dimension to split "
                         "into micro-batches.")
    return int(shape[0])


def apply_block_stages(network: Any, block_stage: Dict[str, int],
                       op_stages: List[Tuple[str, int]]) -> Dict[str, int]:
    """Set ``cell.pipeline_stage`` from a block plan (``place.stages``).

    block_stage: {block Cell path: stage}; a block and every Cell inside it (MindSpore's
    ``_recompute_cell`` wrappers included) get the block's stage. op_stages: (Cell path, stage)
    of every planned operator; any other Cell gets the most common stage of the operators
    scoped directly to it (ties: the lower stage; operator scopes inside repeated blocks may
    name an earlier twin, so blocks are never decided by them), else its parent's stage.
    The root Cell is left alone (it spans every stage). Returns {cell path: stage} (the
    root's "" entry is what its children inherit, not set on it)."""
    blocks = sorted(block_stage, key=len, reverse=True)
    direct: Dict[str, Counter] = {}
    for path, stage in op_stages:
        direct.setdefault(path, Counter())[stage] += 1
    out: Dict[str, int] = {}
    for name, cell in network.cells_and_names():
        owner = next((b for b in blocks if name == b or name.startswith(b + ".")), None)
        if owner is not None:
            stage = block_stage[owner]
        elif name in direct:
            top = max(direct[name].values())
            stage = min(s for s, c in direct[name].items() if c == top)
        else:
            stage = out.get(name.rsplit(".", 1)[0] if "." in name else "", 0)
        if name:        # never the root: it holds every stage (MindSpore's Pipeline skips it too)
            cell.pipeline_stage = int(stage)
        out[name] = int(stage)
    return out


@register_pass("place")
def place_pass(network: Any, context: Any) -> Tuple[Any, Dict[str, Any]]:
    """The ``place`` pass: pipeline stages as contiguous groups of the network's repeated
    blocks (``place.stages``: each block with the glue around it is one unit, TGA places the
    units, every candidate micro-batch count is simulated with the bubble and the transfers),
    planned jointly with data parallelism (pp x dp <= the config cluster's devices) and kept
    only when it beats the best non-pipeline use of the same devices (data parallel, plain or
    ZeRO) or when no non-pipeline plan fits memory (``place.same_devices``); then
    ``pipeline_stage`` is set on the network's Cells.

    ``optimize.micro_batches`` fixes M per pipeline copy; 0 lets the pass choose among the
    divisors of the copy's batch. The plan records ``baseline`` (the non-pipeline plan it was
    judged against: kind, devices, ZeRO level, step time, memory per device), ``pp``, ``dp``
    and ``ratio_to_baseline`` (pipeline step / baseline step). Raises PassRefused (a
    ValueError; ``optimize`` records it as ``{"refused": reason}``) on a one-device cluster,
    a network with fewer than two repeated blocks, when the best pipeline is not faster than
    the baseline (saying by how much) or when nothing fits, before setting any stage;
    ValueError for an ``optimize.micro_batches`` that does not divide the batch.

    After the shard pass, whose dp x mp mesh runs every stage, the pass plans on D // mesh
    slots of a mesh each, pipelines only (pp x 1: shard already splits each stage's batch),
    against data parallelism over those slots (a slot: the mesh's dp rows split the batch, its
    mp columns the memory, mp x a device's); ``devices`` is then pp x the mesh's size, at
    most D. PassRefused when shard's mesh leaves no room for two slots (D // mesh < 2)."""
    from ms_efficient.graph.cells import (assign_units, forward_subgraph, node_cell_path,
                                          repeated_blocks, strip_train_root)
    from ms_efficient.place.planner import TGAConfig
    from ms_efficient.place.same_devices import plan_same_devices
    from ms_efficient.place.stages import group_of_ops

    cluster = context.config.cluster_spec()
    if cluster.num_devices < 2:
        raise PassRefused(f"place: cluster {cluster.name!r} has {cluster.num_devices} device; "
                          "pipeline stages need >= 2 (set the config's cluster, e.g. "
                          "{preset: ascend910b-1x8}).")
    full = context.graph("the place pass")
    graph = forward_subgraph(full)
    blocks = repeated_blocks(context.cell_tree())
    if len(blocks) < 2:
        raise PassRefused(f"place: found {len(blocks)} repeated blocks in "
                          f"{type(network).__name__} (children of one class in a CellList / "
                          "SequentialCell); every pipeline stage holds one, so it needs >= 2.")
    units = assign_units(graph, blocks)
    groups = group_of_ops(units.unit_of)
    micro = context.config.optimize.micro_batches
    batch = _batch_size(context.sample_inputs)
    if micro and batch % micro:
        raise ValueError(f"'optimize.micro_batches' must divide the batch size {batch} (or be 0 "
                         f"to let the place pass choose), but got {micro}.")
    mesh, slots, share = 1, cluster, 1.0
    shard = context.plans.get("shard")
    if shard is not None:      # shard's dp x mp mesh runs every stage: place plans mesh slots
        from ms_efficient.place.same_devices import sub_cluster

        mesh = int(shard["mesh"]["dp"]) * int(shard["mesh"]["mp"])
        if cluster.num_devices // mesh < 2:
            raise PassRefused(
                f"place: shard's {shard['mesh']['dp']}x{shard['mesh']['mp']} mesh runs every "
                f"pipeline stage and takes {mesh} of the {cluster.num_devices} devices of "
                f"{cluster.name!r}: no room for a second stage. To plan a pipeline of meshes, "
                f"set 'optimize.shard_mesh' to a mesh of at most {cluster.num_devices // 2} "
                f"devices; " + ("shard's plan alone already uses every device."
                                if mesh == cluster.num_devices else
                                f"shard's plan alone runs on {mesh} of them."))
        # a slot is one mesh: its dp rows split the batch (below), its mp columns split every
        # operator's weights and activations, so it holds mp devices' memory
        mp = int(shard["mesh"]["mp"])
        slots = sub_cluster(cluster, cluster.num_devices // mesh).with_overrides(
            device_memory_bytes=cluster.device_memory_bytes * mp,
            name=f"{cluster.name} as {cluster.num_devices // mesh} meshes of "
                 f"{shard['mesh']['dp']}x{mp}")
        # its dp rows split the batch: every slot runs 1 / dp of it (its compute and the
        # activations it keeps), the micro-batches it tries divide that share
        batch_dp = int(shard["mesh"]["dp"])
        batch = batch // batch_dp if batch % batch_dp == 0 else batch
        share = 1.0 / batch_dp
    decision = plan_same_devices(graph, units.order, groups, units.units, slots, batch,
                                 micro or None,
                                 TGAConfig(seed=0, max_evaluations=PLACE_PASS_EVALUATIONS,
                                           time_budget_s=PLACE_PASS_TIME_S),
                                 max_copies=1 if shard is not None else None,
                                 batch_share=share)
    stage_plan = decision.pipeline
    nodes = list(graph)
    device_of = np.asarray(stage_plan.device_of_block)[groups]
    assignment = {nodes[i].name: int(d) for i, d in zip(units.order.tolist(), device_of)}
    price = context.unoptimised("the place pass")
    plan = PlacementPlan(
        method="tga-blocks", graph=full.name, cluster=cluster.name,
        devices=len(stage_plan.stages) * stage_plan.replicas * mesh,   # the devices it runs on
        micro_batches=stage_plan.micro_batches,
        step_time_s=stage_plan.step_time_s,
        peak_memory_bytes=[s["memory_bytes"] for s in stage_plan.stages],
        assignment=assignment, stage_of_device=stage_plan.stage_of_device,
        stages=stage_plan.stages,
        scopes={n.name: strip_train_root(full, n.scope) for n in graph if n.scope},
        meta={"evidence": "simulated", "pipeline": True, "seed": 0,
              "evaluations": stage_plan.evaluations, "one_stage_s": stage_plan.one_stage_s,
              "one_stage_fits": stage_plan.one_stage_fits,
              "speedup_over_baseline": 1.0 / decision.ratio,
              "cluster_devices": cluster.num_devices,
              "micro_batches_tried": {int(k): float(v) for k, v in stage_plan.tried.items()}})
    stage_of_block = {b: s["stage"] for s in stage_plan.stages for b in s["blocks"]}
    stage_of_op = {name: plan.stage_of_node(name) for name in assignment}
    stages = apply_block_stages(network, stage_of_block, [
        (node_cell_path(full, n.scope), stage_of_op[n.name]) for n in graph
        if n.name in stage_of_op])
    doc = plan.to_dict()
    del doc["assignment"], doc["scopes"]          # per operator: in the PlacementPlan only
    doc["stage_time_s"] = stage_plan.stage_time_s
    doc["unoptimised"] = price.to_dict()
    doc.update(decision.to_dict())      # baseline, pp, dp, ratio_to_baseline, reason, ...
    doc["parallel_config"]["data_parallel"] = stage_plan.replicas
    doc["cells"] = {path: {"pipeline_stage": s} for path, s in stages.items()
                    if user_cell_path(path)}
    return network, doc
