"""The placement problem: an OpGraph and a ClusterSpec turned into arrays (no MindSpore import).

TGA (and every baseline) assigns *units* to devices. A unit is a group of operators placed
together: a maximal linear chain (``OpGraph.contract_chains``), and, for graphs too large for
the search, a run of consecutive chains in topological order (``max_units``). Both
groupings keep the unit graph acyclic, and units are numbered in a topological order, so
every unit edge goes from a smaller to a larger index.

ILP view (the formulation the GA searches; variables named as in the TGA notes)::

    x[u, d] in {0, 1}                       # x_ud: 1 if unit u runs on device d
    sum_d x[u, d] = 1                       # [Constraint] every unit on exactly one device
    sum_u x[u, d] * mem[u]
      + sum_{(u,v) cut into d} bytes[u,v] <= cap[d]   # [Constraint] device memory
    x[u, d] = x[v, d]  for (u, v) colocated # [Constraint] op and its parameter update /
                                            #   user colocation groups share a device
    x[v, d] <= sum_{d' <= d} x[u, d']       # [Constraint, optional] contiguity, every edge
      for (u, v) in edges                   #   (u, v): stages follow the dataflow
    minimise  step makespan(x)              # cost model, see place/cost.py

A gene of the chromosome is ``assign[u]`` = the device of unit u, so the first constraint
holds by construction; the others are restored by ``place.operators.repair``.

Costs of one unit (whole mini-batch; the cost model divides by the number of micro-batches):
    fwd_s, bwd_s: seconds, measured (``forward_time_s``/``backward_time_s``) or
        ``flops / peak`` (+ ``op_overhead_s`` per operator); backward = 2 x forward
        unless the graph already holds backward/optimizer ops (then 0: they are explicit).
    static_bytes: parameter state (``param_bytes * param_state_factor``: weights, gradients
        and two Adam moments) + activations (``output_bytes``) stashed until backward.
The optimizer update of a parameter runs on the device holding the parameter (colocation),
its time is not modelled.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ms_efficient.core.cluster import ClusterSpec
from ms_efficient.graph.contract import contract_chains
from ms_efficient.graph.opgraph import OpGraph

__all__ = ["PlacementOptions", "PlacementProblem", "build_problem"]

logger = logging.getLogger(__name__)
_GiB = float(2**30)


@dataclass(frozen=True)
class PlacementOptions:
    """How a graph becomes a placement problem.

    micro_batches: GPipe micro-batches per step (1 = plain model parallelism).
    max_units: cap on genes; a larger graph is contracted along chains, then chains are
        merged into runs in topological order. 512 keeps a cost-model call on 48
        placements near 0.1 s on one CPU core; on the 10k-operator MoE graph it found
        better plans in 60 s than 256 (coarser balance) or 1024 and 2048 (fewer
        evaluations).
    max_chain: cap on operators per contracted chain (None: ceil(N / max_units)).
    memory_fraction: share of device memory a plan may use (the rest is framework reserve).
    param_state_factor: resident bytes per parameter byte (4: weights, grads, Adam m and v).
    op_overhead_s: launch overhead added per operator for FLOP-costed graphs, seconds.
    dtype: compute dtype for ``ClusterSpec.compute_time_s``.
    contiguous: require pipeline stages: every edge goes to the same or a later device
        (the contiguity constraint below; parallel branches may share a stage).
    colocate: groups of node names that must share a device.
    """

    micro_batches: int = 1
    max_units: int = 512
    max_chain: Optional[int] = None
    memory_fraction: float = 0.9
    param_state_factor: float = 4.0
    op_overhead_s: float = 2e-6
    dtype: str = "fp16"
    contiguous: bool = False
    colocate: Sequence[Sequence[str]] = ()

    def __post_init__(self) -> None:
        if isinstance(self.micro_batches, bool) or not isinstance(self.micro_batches, int) \
                or self.micro_batches < 1:
            raise ValueError(f"'micro_batches' must be an int >= 1, but got {self.micro_batches!r}.")
        if not isinstance(self.max_units, int) or self.max_units < 2:
            raise ValueError(f"'max_units' must be an int >= 2, but got {self.max_units!r}.")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"'memory_fraction' must be in (0, 1], but got {self.memory_fraction}.")
        if self.param_state_factor < 1:
            raise ValueError(f"'param_state_factor' must be >= 1.0, but got {self.param_state_factor}.")


@dataclass
class PlacementProblem:
    """Arrays of one placement problem. U units, E unit edges, D devices, N graph nodes.

    node_names: [N] graph node names; unit_of_node: [N] unit of each node.
    unit_names: [U] name of each unit's first node; units are in topological order.
    fwd_s, bwd_s: [U] seconds per step (whole mini-batch). static_bytes: [U] bytes.
    param_bytes: [U] parameter bytes. act_bytes: [U] stashed activation bytes.
    edge_src, edge_dst: [E] unit ids (src < dst), sorted by (src, dst); edge_bytes: [E].
    out_indptr: [U+1] edges of unit u are ``out_indptr[u]:out_indptr[u+1]``.
    in_indptr: [U+1], in_edges: [E] edge ids into each unit (CSR by dst).
    capacity_bytes: [D] usable memory per device. latency_s, inv_bw_s_per_B: [D, D] link
        alpha and 1/bandwidth (0 on the diagonal: no transfer).
    colocate: list of [k] unit-id arrays that must share a device.
    """

    name: str
    cluster: ClusterSpec
    options: PlacementOptions
    node_names: List[str]
    unit_of_node: np.ndarray
    unit_names: List[str]
    fwd_s: np.ndarray
    bwd_s: np.ndarray
    static_bytes: np.ndarray
    param_bytes: np.ndarray
    act_bytes: np.ndarray
    edge_src: np.ndarray
    edge_dst: np.ndarray
    edge_bytes: np.ndarray
    out_indptr: np.ndarray
    in_indptr: np.ndarray
    in_edges: np.ndarray
    capacity_bytes: np.ndarray
    latency_s: np.ndarray
    inv_bw_s_per_B: np.ndarray
    colocate: List[np.ndarray] = field(default_factory=list)

    @property
    def num_units(self) -> int:
        return len(self.unit_names)

    @property
    def num_devices(self) -> int:
        return len(self.capacity_bytes)

    @property
    def micro_batches(self) -> int:
        return self.options.micro_batches

    @property
    def contiguous(self) -> bool:
        return self.options.contiguous

    def neighbours(self) -> List[np.ndarray]:
        """[U] arrays of unit ids adjacent to each unit (either direction)."""
        if not hasattr(self, "_nbrs"):
            adj: List[List[int]] = [[] for _ in range(self.num_units)]
            for s, d in zip(self.edge_src.tolist(), self.edge_dst.tolist()):
                adj[s].append(d)
                adj[d].append(s)
            self._nbrs = [np.array(sorted(set(a)), dtype=np.int64) for a in adj]
        return self._nbrs

    def adjacency(self) -> Tuple[List[List[int]], List[List[int]]]:
        """(preds, succs): [U] lists of unit ids feeding / fed by each unit."""
        if not hasattr(self, "_adj"):
            preds: List[List[int]] = [[] for _ in range(self.num_units)]
            succs: List[List[int]] = [[] for _ in range(self.num_units)]
            for s, d in zip(self.edge_src.tolist(), self.edge_dst.tolist()):
                preds[d].append(s)
                succs[s].append(d)
            self._adj = (preds, succs)
        return self._adj

    def sibling_groups(self) -> List[np.ndarray]:
        """Groups (>= 2 units) with identical predecessors and successors: parallel
        branches such as the experts of one MoE layer, which may run on different devices."""
        if not hasattr(self, "_siblings"):
            preds, succs = self.adjacency()
            groups: Dict[tuple, List[int]] = {}
            for u in range(self.num_units):
                if preds[u] or succs[u]:
                    groups.setdefault((tuple(preds[u]), tuple(succs[u])), []).append(u)
            self._siblings = [np.array(g, dtype=np.int64) for g in groups.values() if len(g) > 1]
        return self._siblings

    @property
    def uniform_links(self) -> bool:
        """True when every device pair has the same link (one node): relabelling devices
        then changes nothing."""
        off = ~np.eye(self.num_devices, dtype=bool)
        lat, inv_bw = self.latency_s[off], self.inv_bw_s_per_B[off]
        return lat.size == 0 or bool(lat.min() == lat.max() and inv_bw.min() == inv_bw.max())

    def node_assignment(self, unit_assign: np.ndarray) -> Dict[str, int]:
        """Device of every graph node, from a [U] unit assignment."""
        dev = np.asarray(unit_assign)[self.unit_of_node]
        return dict(zip(self.node_names, dev.tolist()))

    def unit_assignment(self, node_assign: Dict[str, int]) -> np.ndarray:
        """[U] unit assignment from a node -> device map (a unit takes its first node's)."""
        out = np.full(self.num_units, -1, dtype=np.int64)
        for name, u in zip(self.node_names, self.unit_of_node.tolist()):
            if out[u] < 0:
                out[u] = int(node_assign[name])
        return out


def _node_costs(graph: OpGraph, cluster: ClusterSpec, opts: PlacementOptions):
    """[N] forward seconds, backward seconds, static bytes, param bytes, activation bytes."""
    arr = graph.to_arrays()
    peak = cluster.peak_flops_for(opts.dtype) * cluster.compute_efficiency
    fwd = np.where(np.isnan(arr.forward_time_s), arr.flops / peak + opts.op_overhead_s,
                   arr.forward_time_s)
    explicit = any(n.phase in ("backward", "optimizer") for n in graph)
    if explicit:
        bwd = np.zeros_like(fwd)
    else:
        bwd = np.where(np.isnan(arr.backward_time_s), 2.0 * arr.flops / peak + opts.op_overhead_s,
                       arr.backward_time_s)
    params = arr.param_bytes.astype(np.float64)
    acts = arr.output_bytes.astype(np.float64)
    return arr, fwd, bwd, params * opts.param_state_factor + acts, params, acts


def _units(graph: OpGraph, arr, weight: np.ndarray, max_chain, max_units: int) -> np.ndarray:
    """[N] unit id per node, units numbered in topological order.

    Small graphs (N <= max_units) keep one unit per node. Larger ones contract linear chains
    (at most ``max_chain`` members, default ceil(N / max_units), so long chains stay
    cuttable for pipeline stages), then merge consecutive chains into runs."""
    if len(arr.names) <= max_units:
        unit = np.empty(len(arr.names), dtype=np.int64)
        unit[arr.topo_order] = np.arange(len(arr.names))
        return unit
    if max_chain is None:
        max_chain = -(-len(arr.names) // max_units)
    contracted = contract_chains(graph, max_members=max_chain)
    head_of = {}
    for node in contracted:
        for member in node.attrs.get("members", [node.name]) if node.op_type == "Chain" \
                else [node.name]:
            head_of[member] = node.name
    order = contracted.topological_order()
    chain_pos = {name: i for i, name in enumerate(order)}
    chain_of_node = np.array([chain_pos[head_of[n]] for n in arr.names], dtype=np.int64)
    c = len(order)
    if c <= max_units:
        return chain_of_node
    # Step 2: merge consecutive chains into max_units runs of about equal weight, where a
    # chain weighs its share of time plus its share of count (so zero-cost ops spread too).
    w = np.bincount(chain_of_node, weights=weight, minlength=c)
    w = w / max(w.sum(), 1e-300) + 1.0 / c
    cum = np.cumsum(w) - w / 2
    run = np.minimum((cum / cum[-1] * max_units).astype(np.int64), max_units - 1)
    _, run = np.unique(run, return_inverse=True)
    return run[chain_of_node]


def build_problem(graph: OpGraph, cluster: ClusterSpec,
                  options: Optional[PlacementOptions] = None,
                  name: Optional[str] = None) -> PlacementProblem:
    """Build the arrays of placing ``graph`` on ``cluster`` (see module docstring).

    Raises ValueError for an empty graph, a cycle (naming it), an unknown node in a
    colocation group, or a unit (operator, chain, or colocation group) whose memory exceeds
    every device's usable memory, or a model larger than the whole cluster.
    """
    opts = options or PlacementOptions()
    if len(graph) == 0:
        raise ValueError(f"graph {graph.name!r} has no nodes to place.")
    arr, fwd, bwd, static, params, acts = _node_costs(graph, cluster, opts)
    cap = float(cluster.device_memory_bytes) * opts.memory_fraction
    # Step 1: every single operator must fit on a device.
    worst = int(np.argmax(static))
    if static[worst] > cap:
        raise ValueError(
            f"operator {arr.names[worst]!r} needs {static[worst] / _GiB:.2f} GiB "
            f"(parameter state + activations), more than the {cap / _GiB:.2f} GiB usable on "
            f"any device of cluster {cluster.name!r}; split the operator (sharding) or use "
            f"devices with more memory.")
    if static.sum() > cap * cluster.num_devices:
        raise ValueError(
            f"graph {graph.name!r} needs {static.sum() / _GiB:.2f} GiB but the "
            f"{cluster.num_devices} devices of {cluster.name!r} offer {cap * cluster.num_devices / _GiB:.2f} "
            f"GiB usable; add devices or micro-batch with recomputation.")
    # Step 2: units and their costs.
    unit_of_node = _units(graph, arr, fwd + bwd, opts.max_chain, opts.max_units)
    u_count = int(unit_of_node.max()) + 1

    def per_unit(values: np.ndarray) -> np.ndarray:
        return np.bincount(unit_of_node, weights=values, minlength=u_count)

    u_static = per_unit(static)
    big = int(np.argmax(u_static))
    if u_static[big] > cap:  # a merged run is too large: merge less
        raise ValueError(f"unit {big} (chain or run of chains) needs {u_static[big] / _GiB:.2f} "
                         f"GiB > {cap / _GiB:.2f} GiB per device; raise 'max_units' or set "
                         f"'max_chain'.")
    first = np.full(u_count, len(arr.names), dtype=np.int64)
    np.minimum.at(first, unit_of_node, np.arange(len(arr.names)))
    unit_names = [arr.names[i] for i in first]
    # Step 3: unit edges; one tensor (source node) sent once to each destination unit.
    src_nodes = np.repeat(np.arange(len(arr.names)), np.diff(arr.succ_indptr))
    us, ud = unit_of_node[src_nodes], unit_of_node[arr.succ_indices]
    cut = us != ud
    key = np.unique(np.stack([src_nodes[cut], ud[cut]], axis=1), axis=0)
    nbytes_of = {}
    for s, d, b in zip(src_nodes[cut].tolist(), ud[cut].tolist(), arr.succ_bytes[cut].tolist()):
        nbytes_of[(s, d)] = max(nbytes_of.get((s, d), 0), b)
    agg: Dict[tuple, float] = {}
    for s, d in key.tolist():
        k = (int(unit_of_node[s]), d)
        agg[k] = agg.get(k, 0.0) + nbytes_of[(s, d)]
    pairs = sorted(agg)
    assert all(a < b for a, b in pairs), "unit numbering must be topological"
    e_src = np.array([p[0] for p in pairs], dtype=np.int64)
    e_dst = np.array([p[1] for p in pairs], dtype=np.int64)
    e_bytes = np.array([agg[p] for p in pairs], dtype=np.float64)
    out_indptr = np.searchsorted(e_src, np.arange(u_count + 1)).astype(np.int64)
    in_edges = np.argsort(e_dst, kind="stable").astype(np.int64)
    in_indptr = np.searchsorted(e_dst[in_edges], np.arange(u_count + 1)).astype(np.int64)
    # Step 4: cluster arrays.
    d_count = cluster.num_devices
    lat = np.zeros((d_count, d_count))
    inv_bw = np.zeros((d_count, d_count))
    for a in range(d_count):
        for b in range(d_count):
            if a != b:
                link = cluster.link_between(a, b)
                lat[a, b], inv_bw[a, b] = link.latency_s, 1.0 / link.bandwidth_Bps
    # Step 5: colocation groups (user groups, and each optimizer op with its parameter op).
    groups = [list(g) for g in opts.colocate]
    for i, node in enumerate(graph):
        if node.phase == "optimizer":
            owners = [p for p in graph.predecessors(node.name) if graph[p].param_bytes > 0]
            if owners:
                groups.append([owners[0], node.name])
    colocate = []
    for g in groups:
        missing = [n for n in g if n not in arr.index]
        if missing:
            raise ValueError(f"colocation group {list(g)} names unknown node(s) {missing}.")
        units = np.unique(unit_of_node[[arr.index[n] for n in g]])
        if len(units) > 1:
            colocate.append(units)
    if colocate and float(max(u_static[g].sum() for g in colocate)) > cap:
        raise ValueError("a colocation group needs more memory than one device offers.")
    logger.debug("placement problem %s: %d nodes -> %d units, %d unit edges, %d devices",
                 graph.name, len(arr.names), u_count, len(pairs), d_count)
    return PlacementProblem(
        name=name or graph.name, cluster=cluster, options=opts, node_names=list(arr.names),
        unit_of_node=unit_of_node, unit_names=unit_names, fwd_s=per_unit(fwd),
        bwd_s=per_unit(bwd), static_bytes=u_static, param_bytes=per_unit(params),
        act_bytes=per_unit(acts), edge_src=e_src, edge_dst=e_dst, edge_bytes=e_bytes,
        out_indptr=out_indptr, in_indptr=in_indptr, in_edges=in_edges,
        capacity_bytes=np.full(d_count, cap), latency_s=lat, inv_bw_s_per_B=inv_bw,
        colocate=colocate)
