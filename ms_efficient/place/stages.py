"""Pipeline stages as contiguous groups of a network's repeated blocks (no MindSpore import).

The ``place`` pass does not place single operators: it places *block groups*. A block group is
one repeated block of the network (a decoder layer, a residual block) together with the glue
operators around it (embedding lookups, reshapes, the final norm and head, the loss): glue
goes with the block before it, glue ahead of the first block with the first block, so no glue
operator can become a stage of its own and every stage holds at least one repeated block.

:func:`group_graph` contracts a forward graph to one node per block group (its forward and
backward seconds and bytes are the sums of its operators' costs under the placement cost
model, ``place.problem``), :func:`plan_stages` searches the placement of those groups on the
cluster's devices with TGA (``place.planner``; its starting population holds the min-max
contiguous splits of ``place.baselines.contiguous``, a linear partition of the blocks by
compute), for every candidate number of micro-batches, scores each plan with the shared
simulator (``place.cost.simulate_placement``: the pipeline bubble and the stage-to-stage
transfers included) and keeps the fastest; run as several data-parallel copies, each on its
share of the batch, it adds every stage's gradient all-reduce over its copies. Whether that
pipeline pays against the same devices used without one is decided by ``place.same_devices``.

Micro-batching cost: every operator of a FLOP-costed graph pays its launch overhead
(``PlacementOptions.op_overhead_s``) once per micro-batch, so a group's whole-step seconds at
M micro-batches are ``flops / peak + M * ops * overhead`` (forward; backward likewise at twice
the FLOPs). With M = 1 the group costs are exactly the per-operator costs of
:func:`price_network`, so one stage at M = 1 is the unoptimised step.

The unoptimised price of a network (:func:`price_network`): one step of its graph on one
device, simulated once.

Every pass of ``ms_efficient.optimize`` reports the network's unoptimised step time and peak
from this one function (``PassContext.unoptimised``), so the figures agree across passes for
the same network, cluster and batch. The model is the placement cost model
(``ms_efficient.place.problem`` / ``place.cost``) run by the shared event simulator
(``ms_efficient.sim.Simulator``): the forward operators of the train-step graph, each costing
``flops / (peak * compute_efficiency) + op_overhead_s`` seconds forward and twice the FLOPs
(plus the overhead) backward, all on device 0 with one micro-batch; the peak is the parameter
state (weights, gradients, two Adam moments: 4 x parameter bytes) plus every forward output
stashed for backward, bytes. No MindSpore import.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from ms_efficient.core.cluster import ClusterSpec
from ms_efficient.core.registry import PassRefused
from ms_efficient.graph.opgraph import OpGraph, OpNode
from ms_efficient.place.baselines import contiguous
from ms_efficient.place.cost import simulate_placement
from ms_efficient.place.planner import TGAConfig, tga
from ms_efficient.place.problem import PlacementOptions, _node_costs, build_problem

__all__ = ["group_of_ops", "group_graph", "micro_batch_candidates", "StagePlan", "plan_stages",
           "NetworkPrice", "price_network", "OpPrices", "op_prices", "PRICE_OPTIONS"]

logger = logging.getLogger(__name__)


def group_of_ops(unit_of: np.ndarray) -> np.ndarray:
    """Block group of each forward op, from ``UnitAssignment.unit_of`` (topological order,
    -1 = glue outside every block): glue joins the block before it, leading glue the first
    block; the result is non-decreasing (a running maximum), so every edge goes from a group
    to the same or a later one. Raises ValueError when no op belongs to a block."""
    unit_of = np.asarray(unit_of, dtype=np.int64)
    if unit_of.size == 0 or unit_of.max() < 0:
        raise ValueError("group_of_ops: no forward operator belongs to a repeated block.")
    first = int(unit_of[unit_of >= 0][0])
    out = np.maximum.accumulate(np.where(unit_of >= 0, unit_of, -1))
    return np.where(out < 0, first, out)


def group_graph(graph: OpGraph, order: Sequence[int], groups: np.ndarray, names: Sequence[str],
                cluster: ClusterSpec, micro_batches: int = 1,
                options: Optional[PlacementOptions] = None,
                batch_share: float = 1.0) -> OpGraph:
    """A graph with one node per block group.

    graph: the forward graph; order: [n] indices (into ``graph`` node order) of its ops in
    topological order; groups: [n] group of each of them (:func:`group_of_ops`); names: [B]
    block Cell paths. Node ``g`` (named ``names[g]``) carries the group's forward and backward
    seconds per step at ``micro_batches`` (module docstring), its parameter bytes and its
    stashed activation bytes; an edge carries the bytes of every tensor one group sends to a
    later one (each tensor once per receiving group).

    batch_share: the share of the batch the pipeline runs, in (0, 1] (1 / its data-parallel
    replicas): compute apart from the launch overheads, activations and edge bytes scale by
    it; the overheads and the parameters do not."""
    if not 0 < batch_share <= 1:
        raise ValueError(f"'batch_share' must be in (0, 1], but got {batch_share!r}.")
    opts = options or PlacementOptions()
    arr, fwd, bwd, _, params, acts = _node_costs(graph, cluster, opts)
    flop_costed = np.isnan(arr.forward_time_s)
    launch = opts.op_overhead_s * flop_costed
    fwd = (fwd - launch) * batch_share + micro_batches * launch
    bwd = np.where(bwd > 0, (bwd - launch) * batch_share + micro_batches * launch, bwd)
    acts = acts * batch_share
    nodes = list(graph)
    pos_group = np.full(len(nodes), -1, dtype=np.int64)
    pos_group[np.asarray(order, dtype=np.int64)] = groups
    count = len(names)

    def total(values: np.ndarray) -> np.ndarray:
        keep = pos_group >= 0
        return np.bincount(pos_group[keep], weights=values[keep], minlength=count)

    g_fwd, g_bwd, g_par, g_act = total(fwd), total(bwd), total(params), total(acts)
    out = OpGraph(name=f"{graph.name}-blocks", meta=dict(graph.meta))
    for g in range(count):
        out.add_node(OpNode(name=names[g], op_type="BlockGroup", phase="forward",
                            forward_time_s=float(g_fwd[g]), backward_time_s=float(g_bwd[g]),
                            param_bytes=int(round(g_par[g])), output_bytes=int(round(g_act[g]))))
    sent: Dict[tuple, float] = {}
    for src, dst, nbytes in graph.edges:
        gs, gd = pos_group[arr.index[src]], pos_group[arr.index[dst]]
        if gs < 0 or gd < 0 or gs == gd:
            continue
        key = (src, int(gd))
        sent[key] = max(sent.get(key, 0.0), float(nbytes or 0) * batch_share)
    pairs: Dict[tuple, float] = {}
    for (src, gd), nbytes in sent.items():
        gs = int(pos_group[arr.index[src]])
        pairs[gs, gd] = pairs.get((gs, gd), 0.0) + nbytes
    for (gs, gd), nbytes in sorted(pairs.items()):
        out.add_edge(names[gs], names[gd], int(round(nbytes)))
    return out


def micro_batch_candidates(batch: int, limit: int = 32) -> List[int]:
    """Micro-batch counts to try for a global ``batch``: its divisors up to ``limit``."""
    if batch < 1:
        raise ValueError(f"'batch' must be >= 1, but got {batch}.")
    return [m for m in range(1, min(batch, limit) + 1) if batch % m == 0]


@dataclass
class StagePlan:
    """The chosen pipeline (one replica of it when ``replicas`` > 1).

    blocks: [B] block Cell paths; device_of_block: [B] device of each block group (devices of
    one copy; ``stages[s]["devices"]`` lists the stage's device in every copy). micro_batches:
    M per copy.
    pipeline_s: simulated step of one replica on its share of the batch (bubble and
    transfers included), seconds. sync_s: the slowest stage's gradient all-reduce over its
    replicas, seconds (0 with one replica). step_time_s = pipeline_s + sync_s.
    one_stage_s: simulated step of every group on one device (whole batch, M = 1), seconds.
    stages: one dict per stage in dataflow order: ``stage``, ``device``, ``blocks`` (paths),
        ``stage_time_s`` (simulated busy seconds of the stage's device per step),
        ``memory_bytes`` (simulated peak), ``sync_s`` (its all-reduce, seconds) and
        ``devices`` (the stage's device in every replica). tried: {M: best step at M, s}.
    replicas: data-parallel copies of the pipeline (dp). layout: where the copies sit.
    feasible: every stage within the devices' usable memory.
    one_stage_fits: False when the whole network does not fit one device's usable memory.
    """

    blocks: List[str]
    device_of_block: List[int]
    micro_batches: int
    step_time_s: float
    one_stage_s: float
    stages: List[Dict[str, Any]]
    tried: Dict[int, float] = field(default_factory=dict)
    evaluations: int = 0
    one_stage_fits: bool = True      # the whole network fits one device's usable memory
    replicas: int = 1
    layout: str = "one copy"
    pipeline_s: float = 0.0
    sync_s: float = 0.0
    feasible: bool = True

    @property
    def stage_time_s(self) -> List[float]:
        return [s["stage_time_s"] for s in self.stages]

    @property
    def stage_of_device(self) -> Dict[int, int]:
        return {s["device"]: s["stage"] for s in self.stages}

    @property
    def shape(self) -> str:
        """"PPxDP": stages x data-parallel replicas."""
        return f"{len(self.stages)}x{self.replicas}"


def plan_stages(graph: OpGraph, order: Sequence[int], groups: np.ndarray, names: Sequence[str],
                cluster: ClusterSpec, micro_batches: Sequence[int],
                tga_config: Optional[TGAConfig] = None, replicas: int = 1,
                whole: Optional[ClusterSpec] = None,
                copy_device: Optional[Callable[[int, int], int]] = None,
                layout: str = "each copy on neighbouring devices",
                batch_share: float = 1.0) -> StagePlan:
    """The fastest pipeline of >= 2 stages of the block groups on the devices of ``cluster``
    (see module docstring), run as ``replicas`` data-parallel copies.

    micro_batches: the M values to try per replica (e.g. :func:`micro_batch_candidates` of
    the replica's batch). replicas: each copy runs 1 / replicas of the batch
    (``group_graph(batch_share=...)``) and every stage all-reduces its gradients over its
    copies (``place.cost.gradient_sync_time_s``), which adds the slowest stage's
    all-reduce to the step. whole: the cluster the copies live on (default ``cluster``, whose
    links one copy sees). copy_device(d, r): the device of ``whole`` that is device d of copy
    r (default ``d + r * cluster.num_devices``: each copy on neighbouring devices); layout names
    that arrangement in the plan. batch_share: the share of the graph's batch all the copies
    run together (1 / shard's data-parallel rows when each device is one shard mesh); a
    copy runs batch_share / replicas of it.
    Plans within device memory win over plans beyond it (``feasible`` says which was
    found). Whether the pipeline pays, against one device or the same devices used without
    a pipeline, is for the caller (``place.same_devices``). Raises PassRefused (a
    ValueError) when the cluster has one device or there are fewer than two blocks;
    ValueError for bad ``micro_batches``, ``replicas`` or a ``whole`` too small.
    """
    from ms_efficient.place.cost import gradient_sync_time_s

    if cluster.num_devices < 2:
        raise PassRefused(f"place: cluster {cluster.name!r} has {cluster.num_devices} device; "
                          "pipeline stages need >= 2.")
    if len(names) < 2:
        raise PassRefused(f"place: the network has {len(names)} repeated block; pipeline "
                          "stages each hold a repeated block, so they need >= 2.")
    if not micro_batches or min(micro_batches) < 1:
        raise ValueError(f"'micro_batches' must be positive integers, but got "
                         f"{list(micro_batches)}.")
    whole = whole or cluster
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1 or \
            replicas * cluster.num_devices > whole.num_devices:
        raise ValueError(f"'replicas' must be an int in [1, {whole.num_devices // cluster.num_devices}]"
                         f" ({whole.name!r} holds that many copies of {cluster.num_devices} "
                         f"devices), but got {replicas!r}.")
    stride = cluster.num_devices
    if copy_device is None:
        def copy_device(d: int, r: int) -> int:
            return d + r * stride
    cfg = tga_config or TGAConfig(seed=0, max_evaluations=300, time_budget_s=60.0)
    one = build_problem(group_graph(graph, order, groups, names, cluster, 1,
                                    batch_share=batch_share), cluster,
                        PlacementOptions(micro_batches=1, contiguous=True))
    one_cost = simulate_placement(one, np.zeros(len(names), dtype=np.int64))

    def sync_by_device(problem, assign: np.ndarray) -> Dict[int, float]:
        grads = np.bincount(assign, weights=problem.param_bytes, minlength=stride)
        return {int(d): gradient_sync_time_s(whole, [copy_device(int(d), r)
                                                     for r in range(replicas)], float(grads[d]))
                for d in np.unique(assign)}

    best = None
    tried: Dict[int, float] = {}
    evaluations = 0
    for m in sorted(set(int(v) for v in micro_batches)):
        problem = build_problem(group_graph(graph, order, groups, names, cluster, m,
                                            batch_share=batch_share / replicas), cluster,
                                PlacementOptions(micro_batches=m, contiguous=True))
        result = tga(problem, cfg)
        evaluations += result.evaluations
        # TGA's answer, and the min-max contiguous splits over 2..D stages: the best plan
        # with >= 2 stages is compared with one stage even when TGA prefers one device
        candidates = [(result.assign, result.order)] + [
            (contiguous(problem, k), None) for k in range(2, min(cluster.num_devices,
                                                                 len(names)) + 1)]
        for assign, prog in candidates:
            if len(set(assign.tolist())) < 2:
                continue
            cost = simulate_placement(problem, assign, order=prog)
            sync = sync_by_device(problem, np.asarray(assign))
            step = cost.step_time_s + max(sync.values())
            if step < tried.get(m, np.inf):
                tried[m] = step
            if best is None or (not cost.feasible, step) < (not best[1].feasible, best[4]):
                best = (m, cost, np.asarray(assign), sync, step)
        logger.info("place: %d replica(s), %d micro-batches -> best pipeline %.4g ms", replicas,
                    m, tried.get(m, np.nan) * 1e3)
    if best is None:
        raise PassRefused(f"place: no split of the {len(names)} blocks into >= 2 stages on "
                          f"{cluster.name!r}; no pipeline stage to set.")
    m, cost, assign, sync, step = best
    used: List[int] = []
    for d in assign.tolist():
        if d not in used:
            used.append(d)
    stages = []
    for s, d in enumerate(used):
        stages.append({"stage": s, "device": int(d),
                       "blocks": [names[g] for g in np.flatnonzero(assign == d)],
                       "stage_time_s": float(cost.busy_s.get(f"dev{d}.compute", 0.0)),
                       "memory_bytes": float(cost.peak_memory_bytes[d]),
                       "sync_s": float(sync[d]),
                       "devices": [copy_device(int(d), r) for r in range(replicas)]})
    return StagePlan(blocks=list(names), device_of_block=[int(d) for d in assign],
                     micro_batches=m, step_time_s=float(step),
                     one_stage_s=float(one_cost.step_time_s), stages=stages, tried=tried,
                     evaluations=evaluations, one_stage_fits=bool(one_cost.feasible),
                     replicas=replicas, layout=layout if replicas > 1 else "one copy",
                     pipeline_s=float(cost.step_time_s),
                     sync_s=float(max(sync.values())), feasible=bool(cost.feasible))


# The one cost model every pass prices a network's operators with (place's defaults: launch
# overhead per operator, fp16 peak FLOP/s x the cluster's compute efficiency, 4 bytes of
# parameter state per parameter byte; transient backward buffers are not counted, as in the
# shard cost model).
PRICE_OPTIONS = PlacementOptions(micro_batches=1)


@dataclass(frozen=True)
class OpPrices:
    """Per node of a graph, in ``list(graph)`` order (operators outside the forward pass: 0).

    forward_s, backward_s: [N] seconds of its forward / backward (``flops / (peak x
    compute_efficiency) + op_overhead_s``, backward at twice the FLOPs). param_bytes: [N]
    parameter bytes it loads; output_bytes: [N] bytes of its output (stashed for backward).
    forward: [N] bool, the operator is priced (forward or unknown phase).
    overhead_s: [N] launch overhead included once in each of forward_s and backward_s
        (FLOP-costed operators), seconds: splitting an operator over devices divides the
        rest, not this.
    param_state_factor: resident bytes per parameter byte (weights, gradients, Adam m, v)."""

    forward_s: np.ndarray
    backward_s: np.ndarray
    param_bytes: np.ndarray
    output_bytes: np.ndarray
    forward: np.ndarray
    overhead_s: np.ndarray
    param_state_factor: float


def op_prices(graph: OpGraph, cluster: ClusterSpec) -> OpPrices:
    """The shared per-operator prices of ``graph`` (a train-step or forward graph) on one
    device of ``cluster`` (see :class:`OpPrices`); the sums over the forward operators are
    :func:`price_network`'s unoptimised step and peak."""
    from ms_efficient.graph.cells import forward_subgraph

    fwd_graph = forward_subgraph(graph)
    nodes = list(graph)
    n = len(nodes)
    out = {k: np.zeros(n) for k in ("f", "b", "p", "o", "h")}
    forward = np.zeros(n, dtype=bool)
    if len(fwd_graph):
        arr, f, b, _, params, acts = _node_costs(fwd_graph, cluster, PRICE_OPTIONS)
        overhead = np.where(np.isnan(arr.forward_time_s), PRICE_OPTIONS.op_overhead_s, 0.0)
        index = {node.name: i for i, node in enumerate(nodes)}
        at = np.array([index[name] for name in arr.names], dtype=np.int64)
        for key, values in zip("fbpoh", (f, b, params, acts, overhead)):
            out[key][at] = values
        forward[at] = True
    return OpPrices(forward_s=out["f"], backward_s=out["b"], param_bytes=out["p"],
                    output_bytes=out["o"], forward=forward, overhead_s=out["h"],
                    param_state_factor=PRICE_OPTIONS.param_state_factor)


@dataclass(frozen=True)
class NetworkPrice:
    """step_time_s: simulated seconds of one unoptimised training step. peak_memory_bytes:
    its simulated peak on the one device. forward_ops: operators priced. cluster: its name."""

    step_time_s: float
    peak_memory_bytes: float
    forward_ops: int
    cluster: str

    def to_dict(self) -> Dict[str, Any]:
        return {"step_time_s": float(self.step_time_s),
                "peak_memory_bytes": int(round(self.peak_memory_bytes)),
                "forward_ops": int(self.forward_ops), "cluster": self.cluster,
                "evidence": "simulated", "simulator": "ms_efficient.place.stages.price_network"}


def price_network(graph: OpGraph, cluster: ClusterSpec) -> NetworkPrice:
    """Simulate one unoptimised step of ``graph`` (a train-step or forward graph) on one
    device of ``cluster`` (module docstring). Raises ValueError for a graph without
    forward operators."""
    from ms_efficient.graph.cells import forward_subgraph

    fwd = forward_subgraph(graph)
    if len(fwd) == 0:
        raise ValueError(f"graph {graph.name!r} has no forward operator to price.")
    one = cluster.with_overrides(nodes=1, devices_per_node=1, name=cluster.name)
    # the whole network on one device: its memory is reported, not enforced
    big = one.with_overrides(device_memory_bytes=max(int(one.device_memory_bytes), 1 << 62))
    problem = build_problem(fwd, big, PRICE_OPTIONS)
    cost = simulate_placement(problem, np.zeros(problem.num_units, dtype=np.int64))
    return NetworkPrice(step_time_s=float(cost.step_time_s),
                        peak_memory_bytes=float(cost.peak_memory_bytes[0]),
                        forward_ops=len(fwd), cluster=cluster.name)
