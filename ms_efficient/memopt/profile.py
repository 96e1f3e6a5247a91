"""Layer profile: the per-layer costs MemOpt plans over (no MindSpore import).

A "layer" is a candidate Cell (a transformer block's attention or FFN sub-block, a PipeDream
layer, ...) on a chain: layer i consumes the output of layer i-1 (layer 0 reads the batch).

Memory model of one layer i (bytes):
    output_bytes  o_i: its output tensor, the input of layer i+1; the only tensor a
                  recompute checkpoint keeps.
    interior_bytes e_i: the other tensors it saves for its backward (not its input, which is
                  o_{i-1}, and not its output).
    workspace_bytes w_i: transient bytes its backward allocates (gradient buffers) and frees.
static_bytes: resident for the whole step (parameters, gradients, optimizer state, batch).

Profiles come from an OpGraph (``profile_from_graph``: PipeDream profiles carry measured
times; graph nodes are grouped into at most ``max_layers`` consecutive layers) or from the
reference GPT/MoE configuration by FLOP and activation-size estimates with a ClusterSpec
(``profile_from_model``, after Korthikanti et al. 2022 "Reducing Activation Recomputation").
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional

import numpy as np

__all__ = ["LayerProfile", "DeviceShare", "device_shares", "profile_from_graph",
           "profile_from_units", "profile_from_model"]

@dataclass(frozen=True)
class LayerProfile:
    """Costs of a chain of L layers at one batch size.

    names: [L] layer names (Cell paths such as ``blocks.3.attn``, or graph node names).
    forward_time_s, backward_time_s: [L] float64 seconds of the forward / backward pass.
    output_bytes, interior_bytes, workspace_bytes: [L] float64 bytes (see module docs).
    static_bytes: bytes resident for the whole step.
    batch_size: samples the profile stands for; ``at_batch`` rescales activations and times
        linearly (static bytes stay).
    source: where the figures come from ("estimated", "pipedream", "measured", ...).
    in_flight: micro-batches whose stored activations the device holds at once (a 1F1B
        pipeline stage s of S with M micro-batches: min(S - s, M)). With in_flight > 1 the byte
        arrays are ONE micro-batch's, the times the whole step's (every micro-batch), and the
        other in_flight - 1 micro-batches hold what the plan stores of each layer (kept: o + e,
        recomputed: o, dropped or on the host: 0) for the whole step (``memopt.env``).
    """

    names: List[str]
    forward_time_s: np.ndarray
    backward_time_s: np.ndarray
    output_bytes: np.ndarray
    interior_bytes: np.ndarray
    workspace_bytes: np.ndarray
    static_bytes: float
    batch_size: int = 1
    source: str = "estimated"
    meta: Dict[str, Any] = field(default_factory=dict)
    in_flight: int = 1

    def __post_init__(self) -> None:
        n = len(self.names)
        if n == 0:
            raise ValueError("a LayerProfile needs at least one layer, but got 0.")
        if len(set(self.names)) != n:
            raise ValueError(f"layer names must be unique, but got {self.names}.")
        for key in ("forward_time_s", "backward_time_s", "output_bytes", "interior_bytes",
                    "workspace_bytes"):
            arr = np.asarray(getattr(self, key), dtype=np.float64)
            if arr.shape != (n,):
                raise ValueError(f"'{key}' must have shape [{n}], but got {arr.shape}.")
            if not np.all(np.isfinite(arr)) or np.any(arr < 0):
                raise ValueError(f"'{key}' must be finite and >= 0, but got {arr}.")
            object.__setattr__(self, key, arr)
        if not self.static_bytes >= 0:
            raise ValueError(f"'static_bytes' must be >= 0, but got {self.static_bytes}.")
        if int(self.in_flight) != self.in_flight or self.in_flight < 1:
            raise ValueError(f"'in_flight' must be an integer >= 1, but got {self.in_flight!r}.")

    @property
    def num_layers(self) -> int:
        return len(self.names)

    @property
    def activation_bytes(self) -> np.ndarray:
        """[L] bytes layer i holds for backward when kept: o_i + e_i."""
        return self.output_bytes + self.interior_bytes

    def at_batch(self, batch_size: int) -> "LayerProfile":
        """The profile at another batch size: activations and times scale linearly."""
        if batch_size < 1:
            raise ValueError(f"'batch_size' must be >= 1, but got {batch_size}.")
        k = batch_size / self.batch_size
        return replace(self, forward_time_s=self.forward_time_s * k,
                       backward_time_s=self.backward_time_s * k,
                       output_bytes=self.output_bytes * k, interior_bytes=self.interior_bytes * k,
                       workspace_bytes=self.workspace_bytes * k, batch_size=int(batch_size))

    def index_of(self, name: str) -> int:
        """Position of layer ``name``; ValueError lists a few known names."""
        try:
            return self.names.index(name)
        except ValueError:
            raise ValueError(f"unknown layer name {name!r}; known layers: "
                             f"{self.names[:6]}{' ...' if len(self.names) > 6 else ''}.") from None


def profile_from_graph(graph, max_layers: int = 64, static_bytes: Optional[float] = None,
                       batch_size: int = 1, optimizer_bytes_per_param_byte: float = 3.0,
                       flops_dtype: str = "fp16", cluster=None) -> LayerProfile:
    """A chain profile from an OpGraph (PipeDream profile, JSON or MINDIR forward graph).

    Nodes are taken in topological order and cut into at most ``max_layers`` consecutive
    groups of about equal forward time (a layer = one group). Per group: times add up;
    output_bytes = bytes of its last node's output; interior_bytes = the other members'
    output bytes; workspace = 2 x output_bytes. Nodes without measured times are timed from
    their FLOPs with ``cluster`` (forward; backward = 2 x forward). static_bytes defaults to
    params x (1 + ``optimizer_bytes_per_param_byte``) (weights + gradients + Adam moments).
    Raises ValueError for an empty graph or one with neither times nor FLOPs.
    """
    if len(graph) == 0:
        raise ValueError(f"graph {graph.name!r} has no nodes; nothing to plan.")
    arrays = graph.to_arrays()
    order = arrays.topo_order
    fwd = arrays.forward_time_s[order].copy()
    bwd = arrays.backward_time_s[order].copy()
    missing = np.isnan(fwd)
    if missing.any():
        if cluster is None or arrays.flops[order][missing].sum() <= 0:
            raise ValueError(f"graph {graph.name!r}: {int(missing.sum())} nodes have no measured "
                             "forward time and no FLOPs to estimate one from (pass a cluster).")
        est = np.array([cluster.compute_time_s(float(f), flops_dtype) for f in arrays.flops[order]])
        fwd[missing] = est[missing]
    bwd = np.where(np.isnan(bwd), 2.0 * fwd, bwd)
    out = arrays.output_bytes[order].astype(np.float64)
    # Step 1: cut the topological order into groups of about equal forward+backward time.
    n = len(order)
    groups = min(max_layers, n)
    cost = np.cumsum(fwd + bwd + 1e-12)
    cuts = np.searchsorted(cost, cost[-1] * np.arange(1, groups) / groups, side="left")
    bounds = np.unique(np.r_[0, np.clip(cuts + 1, 1, n - 1), n])
    # Step 2: per group sums
    names, f_L, b_L, o_L, e_L = [], [], [], [], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        members = [arrays.names[i] for i in order[lo:hi]]
        names.append(members[-1] if hi - lo == 1 else f"{members[0]}..{members[-1]}")
        f_L.append(fwd[lo:hi].sum())
        b_L.append(bwd[lo:hi].sum())
        o_L.append(out[hi - 1])
        e_L.append(out[lo:hi - 1].sum())
    if static_bytes is None:
        static_bytes = float(arrays.param_bytes.sum()) * (1.0 + optimizer_bytes_per_param_byte)
    src = str(graph.meta.get("source", "graph"))
    return LayerProfile(names=names, forward_time_s=np.array(f_L), backward_time_s=np.array(b_L),
                        output_bytes=np.array(o_L), interior_bytes=np.array(e_L),
                        workspace_bytes=2.0 * np.array(o_L), static_bytes=float(static_bytes),
                        batch_size=batch_size, source=src, meta={"graph": graph.name})


@dataclass(frozen=True)
class DeviceShare:
    """What one device holds and runs of each operator once shard and place have planned
    (per node, in ``list(graph)`` order; ``ms_efficient.memopt.apply.device_shares`` builds it).

    on_device: [N] bool, the operator runs on this device (its pipeline stage).
    output_share: [N] share of the operator's output bytes (one step, whole batch) one
        micro-batch on the device keeps for backward: 1 / the output's split after shard,
        / the micro-batches per step after place.
    time_share: [N] share of the operator's compute the device runs (1 / its output split;
        its launch overhead is paid in full).
    state_bytes: [N] parameter state bytes (weights, gradients, optimizer states) the device
        keeps for the operator after shard.
    label: what the share stands for ("stage 1 of 2, 2x4 mesh", ...), for messages.
    in_flight: micro-batches the device holds at once (1F1B: min(S - s, M) on stage s of S).
    """

    on_device: np.ndarray
    output_share: np.ndarray
    time_share: np.ndarray
    state_bytes: np.ndarray
    label: str = "one device"
    in_flight: int = 1


def device_shares(graph, cluster, shard_doc: Optional[Dict[str, Any]] = None,
                  place_doc: Optional[Dict[str, Any]] = None) -> List[DeviceShare]:
    """The devices to plan memory on once shard and place have planned ``graph``: one
    :class:`DeviceShare` per pipeline stage after place (in stage order), else one for every
    device alike.

    shard_doc: the shard pass's plan (its ``device_share``: each operator's output split and
        per-device parameter state; an operator without an entry is split by the mesh's ``dp``
        (the batch) and keeps its whole parameter state). None: unsplit.
    place_doc: the place pass's plan (``stages`` with their ``blocks``, ``micro_batches`` M,
        ``dp`` data-parallel copies of the pipeline, 1 when absent). A forward operator
        belongs to the stage of its block group (``place.stages.group_of_ops``: glue with the
        block before it); each copy runs 1/dp of the batch (forward operators' outputs and
        compute split dp ways more); under 1F1B stage s of S holds min(S - s, M)
        micro-batches of 1/M of the copy's batch in flight: its output share is one
        micro-batch's (1/M) and ``in_flight`` = min(S - s, M). None: one stage.
    """
    from ms_efficient.place.stages import op_prices

    prices = op_prices(graph, cluster)
    names = [node.name for node in graph]
    n = len(names)
    split = np.ones(n)
    state = prices.param_bytes * prices.param_state_factor
    mesh = ""
    if shard_doc is not None:
        dp = int(shard_doc["mesh"]["dp"])
        mesh = f"{dp}x{int(shard_doc['mesh']['mp'])} mesh"
        given = shard_doc["device_share"]
        split = np.array([float(given["output_split"].get(name, dp)) for name in names])
        split[~prices.forward] = 1.0
        state = np.array([float(given["state_bytes"].get(name, s))
                          for name, s in zip(names, state)])
    stage_of = np.zeros(n, dtype=np.int64)
    inflight, m = [1], 1
    if place_doc is not None:
        from ms_efficient.graph.cells import assign_units
        from ms_efficient.place.stages import group_of_ops

        stages = place_doc["stages"]
        blocks = [b for stage in stages for b in stage["blocks"]]
        of_block = {b: int(stage["stage"]) for stage in stages for b in stage["blocks"]}
        units = assign_units(graph, blocks)
        groups = group_of_ops(units.unit_of)
        stage_of[:] = -1
        stage_of[units.order] = [of_block[units.units[g]] for g in groups]
        count, m = len(stages), int(place_doc["micro_batches"])
        inflight = [min(count - s, m) for s in range(count)]
        # each pipeline copy runs its share of the batch
        split = np.where(prices.forward, split * int(place_doc.get("dp", 1)), split)
    out = []
    for s, held in enumerate(inflight):
        label = ", ".join(p for p in ((f"stage {s} of {len(inflight)}"
                                       if place_doc is not None else ""), mesh) if p)
        on = stage_of == s
        out.append(DeviceShare(on_device=on, output_share=1.0 / (m * split),
                               time_share=1.0 / split, state_bytes=np.where(on, state, 0.0),
                               label=label or "one device", in_flight=held))
    return out


def profile_from_units(graph, assignment, cluster, batch_size: int = 1,
                       share: Optional[DeviceShare] = None) -> LayerProfile:
    """A chain profile whose layers are the network's own Cells (``assignment.units``),
    priced with the cost model every pass shares (``ms_efficient.place.stages.op_prices``).

    graph: OpGraph of the network, a train-step export (backward and optimizer ops present)
        or a forward one. assignment: :class:`ms_efficient.graph.cells.UnitAssignment` of its
        forward ops to the units.
    Per unit (forward ops only; backward and optimizer ops are priced, never planned):
        forward_time_s / backward_time_s = sums of its ops' shared prices, seconds;
        output_bytes = the output of its last op in topological order (what the next unit
            reads); interior_bytes = the other ops' outputs; workspace_bytes = 0 (the shared
            model, like the shard cost model, counts what backward keeps, not its transient
            buffers).
    static_bytes = the parameter state of the forward ops (4 x their parameter bytes:
    weights, gradients, Adam m and v) + the outputs of the forward ops outside every unit
    (embedding, head, loss: kept through the step). So the all-keep plan's simulated peak is
    the network's unoptimised price, and its step plus ``meta["outside_time_s"]`` (forward +
    backward seconds of the outside ops) the unoptimised step
    (``place.stages.price_network``).
    share: the device's share after shard and place (:class:`DeviceShare`); a unit whose
    first operator runs on another device is left out (its operators here count as glue), bytes and times scale by the share and the static
    bytes hold the device's parameter state. None: the whole network on one device.
    ``meta["optimizer_time_s"]``: seconds of the optimizer's ops (FLOPs / peak), reported.
    """
    from ms_efficient.place.stages import op_prices

    nodes = list(graph)
    prices = op_prices(graph, cluster)
    n = len(nodes)
    if share is None:
        share = DeviceShare(on_device=np.ones(n, dtype=bool), output_share=np.ones(n),
                            time_share=np.ones(n),
                            state_bytes=prices.param_bytes * prices.param_state_factor)
    out_b = prices.output_bytes * share.output_share
    ovh = prices.overhead_s
    fwd_s = (prices.forward_s - ovh) * share.time_share + ovh
    bwd_s = np.where(prices.backward_s > 0, (prices.backward_s - ovh) * share.time_share + ovh,
                     0.0)
    names, f_L, b_L, o_L, e_L = [], [], [], [], []
    stray = []           # ops of a unit that starts on another device: glue here
    for u, unit in enumerate(assignment.units):
        members = assignment.members(u)
        if not share.on_device[members[0]]:
            stray.append(members[share.on_device[members]])
            continue
        members = members[share.on_device[members]]
        names.append(unit)
        f_L.append(float(fwd_s[members].sum()))
        b_L.append(float(bwd_s[members].sum()))
        o_L.append(float(out_b[members[-1]]))
        e_L.append(float(out_b[members[:-1]].sum()))
    if not names:
        raise ValueError(f"no planned Cell ({assignment.units[0]} ...) has an operator on "
                         f"{share.label}.")
    outside = assignment.order[assignment.unit_of < 0]
    outside = np.concatenate([outside[share.on_device[outside]]] + stray).astype(np.int64)
    here = np.flatnonzero(share.on_device & prices.forward)
    optimizer_s = sum(cluster.compute_time_s(float(node.flops), "fp16") for node in nodes
                      if node.phase == "optimizer")
    o = np.array(o_L)
    return LayerProfile(names=names, forward_time_s=np.array(f_L),
                        backward_time_s=np.array(b_L), output_bytes=o,
                        interior_bytes=np.array(e_L), workspace_bytes=np.zeros_like(o),
                        static_bytes=float(share.state_bytes[here].sum()
                                           + share.in_flight * out_b[outside].sum()),
                        batch_size=batch_size, source=str(graph.meta.get("source", "graph")),
                        in_flight=share.in_flight,
                        meta={"graph": graph.name, "cluster": cluster.name,
                              "device": share.label, "outside_ops": int(outside.size),
                              "outside_time_s": float(fwd_s[outside].sum()
                                                      + bwd_s[outside].sum()),
                              "optimizer_time_s": optimizer_s})


def profile_from_model(model, moe=None, batch_size: int = 1, cluster=None,
                       dtype: Optional[str] = None, split_blocks: bool = True) -> LayerProfile:
    """Estimated profile of the reference GPT(-MoE) network, layers ``blocks.{i}.attn`` and
    ``blocks.{i}.ffn`` (or ``blocks.{i}`` with ``split_blocks=False``).

    model: ModelConfig (seq_length s, hidden_size h, num_heads a, ffn_hidden_size F,
        num_layers, vocab_size, dtype). moe: MoEConfig or None (dense FFN); an MoE block with
        top_k k computes and stores k expert FFN activations per token.
    Activation bytes per sub-block with b = batch, p = bytes per element (Korthikanti et al.
    2022, no sequence parallel): attention saves 11sbh/2*p... written out as
        attn: 5.5*p*sbh + 2.5*p*a*s^2*b  (LN in, QKV in, Q, K, V, scores, softmax, mask, ...)
        ffn:  2.5*p*sbh + 2*p*sbF*k       (LN in, fc1 in, fc1 out, gelu out, mask)
    of which p*sbh is the sub-block's output (o) and p*sbh its input (owned by the previous
    layer). FLOPs: attn 8sbh^2 + 4bs^2h, ffn 4sbhFk + 2sbhE (router); backward = 2 x forward;
    times = FLOPs / (peak FLOP/s of ``cluster`` for the dtype). static bytes: mixed-precision
    Adam, 16 bytes per parameter (fp32 in fp32 mode: 16 as well: weight, grad, 2 moments).
    """
    from ms_efficient.core.cluster import get_cluster

    cluster = cluster or get_cluster("ascend910b-1x8")
    dtype = dtype or model.dtype
    p = 4.0 if dtype in ("float32", "fp32") else 2.0
    s, h, a, F, b = model.seq_length, model.hidden_size, model.num_heads, model.ffn_hidden_size, batch_size
    sbh = s * b * h
    names, f_L, o_L, e_L = [], [], [], []
    params = model.vocab_size * h + s * h + 2 * h
    for i in range(model.num_layers):
        is_moe = moe is not None and (i + 1) % moe.moe_every == 0
        k = moe.top_k if is_moe else 1
        experts = moe.num_experts if is_moe else 1
        attn_bytes = 5.5 * p * sbh + 2.5 * p * a * s * s * b
        ffn_bytes = 2.5 * p * sbh + 2.0 * p * s * b * F * k
        attn_flops = 8.0 * sbh * h + 4.0 * b * s * s * h
        ffn_flops = 4.0 * sbh * F * k + (2.0 * sbh * experts if is_moe else 0.0)
        params += 4 * h * h + 4 * h + 2 * h * F * experts + (h * experts if is_moe else 0) + 4 * h
        parts = [("attn", attn_bytes, attn_flops), ("ffn", ffn_bytes, ffn_flops)]
        if not split_blocks:
            parts = [("", attn_bytes + ffn_bytes, attn_flops + ffn_flops)]
        for sub, nbytes, flops in parts:
            names.append(f"blocks.{i}.{sub}" if sub else f"blocks.{i}")
            f_L.append(cluster.compute_time_s(flops, dtype))
            o_L.append(p * sbh)
            e_L.append(nbytes - 2 * p * sbh)
    f = np.array(f_L)
    o = np.array(o_L)
    static = 16.0 * params + 2 * 4.0 * s * b      # + token ids and targets (int32)
    return LayerProfile(names=names, forward_time_s=f, backward_time_s=2.0 * f, output_bytes=o,
                        interior_bytes=np.array(e_L), workspace_bytes=2.0 * o,
                        static_bytes=static, batch_size=batch_size, source="estimated",
                        meta={"cluster": cluster.name, "dtype": dtype, "params": params})
