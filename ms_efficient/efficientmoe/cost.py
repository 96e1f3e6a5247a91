"""Cost of one MoE layer for one training step: the analytic model the planners optimise, and
the same schedule on the shared event simulator (to validate it).

For a layer with plan ``plan`` (:class:`ms_efficient.moe.plan.ExpertPlan`) and routing counts
``counts_RE`` (tokens each source rank sends to each expert, top-k counted k times):

    time      = exchange + a2a_passes * A2A(dispatch bytes) + max_d compute_d + max_d sync_d
    exchange  = AllGather of the int32 counts, once per step: [R, E] routing counts ("alltoallv");
                [R, R * S_b] per-slot block counts ("grouped" and "counts", S_b the most
                slots a device holds: what the grouped layer's CountExchange gathers); for
                "counts" and "alltoallv" plus ``a2a_passes`` x ``dynamic_exchange_s``, the
                dynamic-shape overhead of each count-driven AlltoAllV (its receive size is
                data, so the count matrix is read on the host before it runs; the [W, W]
                matrix itself is derived from the gathered counts, no extra collective).
                One rule for every data-dependent exchange: FasterMoE's ("alltoallv") pays
                it as ours ("counts") does, the cost of running that exchange on this stack
    dispatch  = rows device r sends to device d (:func:`~ms_efficient.moe.exchange.exchange_rows`,
                what the expert-parallel layer's AlltoAllV Cells are built from): the
                kept tokens ("alltoallv"); the planned block C[r, d], full or empty
                ("grouped"); the kept rows of the grouped rule, no padding ("counts":
                ``ms_efficient.moe.counted_alltoall``, Ascend ``ops.AlltoAllVC``);
                for "static" plans every row rank r owns in d's slots, full
                or empty, sent
                  static_blocks="exact" (default): as exactly those rows (an AlltoAllV whose
                    per-peer counts are compile-time constants, ``mindspore.ops.AlltoAllV``
                    with tuple counts: still static shapes, no padding to the largest block;
                    what the retired one-level layer sent);
                  static_blocks="equal": as C_send rows to every device of the group, C_send
                    the largest number of rows any rank owns on any one device (an
                    equal-split AlltoAll of a [W, C_send, H] buffer, as GShard, whose blocks
                    are all equal anyway)
    A2A       = max over devices of the per-link send/receive time (uneven all-to-all)
    compute_d = max(compute_passes * rows_d * 4 H F / (peak FLOP/s * efficiency),
                    compute_passes * bytes its GEMMs move / HBM bandwidth)  (compute_time_D)
    sync_d    = all-reduce, over every device of the group, of the replica-gradient
                table the layer builds: ep_routing.sync_rows experts (sync_time_s)

rows_d sums the device's slots' rows, each rounded up to the matrix unit's tile
(``ClusterSpec.tiled_rows``: a matmul over m rows computes ceil(m / 16) * 16 of them on
Ascend's cube): a static graph computes every compiled row of a slot, token or padding, so a
slot's rows are its capacity (a dynamic-shape system such as FasterMoE is modelled with
capacities equal to the step's loads); a "grouped" plan's grouped matmul computes each
slot's kept tokens only (its group size is data), its buffer's unused rows cost memory, not
time. Forward + backward: the backward pass does twice the forward FLOPs
(compute_passes = 3) and runs two All-to-Alls of the forward's size (a2a_passes = 4:
dispatch and combine, forward and backward). The backward pass reuses the forward's counts,
so the exchange is paid once. Replica gradient sync is charged after the layer, not
overlapped: a conservative choice that makes replication pay for itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np

from ms_efficient.core.cluster import ClusterSpec
from ms_efficient.moe.ep_routing import sync_rows
from ms_efficient.moe.exchange import exchange_rows
from ms_efficient.moe.plan import ExpertPlan
from ms_efficient.moe.split import source_rows, split_tokens, static_assignments
from ms_efficient.sim import Simulator

__all__ = ["CostModel", "LayerCost", "DYNAMIC_EXCHANGE_S", "FAST_LEVEL_S", "DYNAMIC_DISPATCH", "uneven_alltoall_time_s", "computed_rows_D",
           "compute_time_D",
           "check_rank_device", "count_exchange_time_s", "layer_cost", "event_step_time_s"]

_DTYPE_BYTES = {"fp16": 2, "bf16": 2, "float16": 2, "bfloat16": 2, "fp32": 4, "float32": 4}
COUNT_BYTES = 4   # one routing count in the exchange: int32
# Seconds one count-driven AlltoAllV ("counts" plans) costs beyond its rows: MindSpore's
# dynamic-shape path (run-time shape inference and allocation of a receive size that is data).
# Measured: 245, 363 and 488 us a call extra (median 363) for one data-dependent shape
# against its static twin, MindSpore 2.10 GRAPH mode on the shared 2-core CPU machine
# (scripts/measure_dynamic_shape.py, docs/results.md). Assumed the same on Ascend, where the
# count matrix must also reach the host (a device-to-host copy that drains the stream, not
# measured here): a lower bound there.
DYNAMIC_EXCHANGE_S = 363e-6
# the dispatch modes whose All-to-All sizes are data (a dynamic shape), charged the above
DYNAMIC_DISPATCH = ("counts", "alltoallv")
# Seconds the balanced layer's fast level (the per-step tables from the all-gathered counts)
# is charged per layer-step. What scripts/time_fast_level.py measures (layer 0 of the real
# 16-rank x 32-expert trace, the shared 2-core CPU machine) for the compiled C++ kernel
# (kernels/cpu/fast_level.cc, ``moe.fast_level: aot``): 0.08-0.14 ms called directly,
# 0.12-0.18 ms per call inside one GRAPH-mode graph (9 chained calls less one, / 8: what
# the layer pays in its train step), 1.1-1.8 ms as a one-op graph of its own (a whole
# graph's launch). 0.75 ms (an earlier session's one-op figure) is charged: several times
# the in-graph cost. On Ascend the layer compiles the MindSpore-ops twin (13-21 ms per call
# on this CPU, its data-dependent loops; not measured on Ascend), so a 910B row's fast level
# may cost more than charged; the default of every preset, overridden by
# ``bench moe --fast-level-ms``.
FAST_LEVEL_S = 0.75e-3


@dataclass(frozen=True)
class CostModel:
    """What one token and one expert cost on a cluster.

    cluster: the devices and links. hidden: H. ffn_hidden: F, each expert's FFN width.
    dtype: activation/weight dtype ("bf16", "fp16", "fp32"); 2 bytes per value for 16-bit.
    compute_passes: expert FLOPs of a training step per forward FLOP (3: backward = 2x fwd).
    a2a_passes: All-to-Alls per step of the dispatch's size (4: dispatch + combine, fwd + bwd).
    sync_replica_grads: charge the replicas' gradient all-reduce (:func:`sync_time_s`).
    static_blocks: how "static" plans send their rows, "equal" or "exact" (module docstring).
    dynamic_exchange_s: seconds each count-driven AlltoAllV of a "counts" or "alltoallv" plan
        costs beyond its rows (``DYNAMIC_EXCHANGE_S``, measured; module docstring).
    slot_budget: the slot budget S_b grouped and counts layers are built with (their replica
        table holds any plan of it); None: the most slots a device of the plan holds.
    fast_level_s: seconds the fast level's tables take per balanced layer-step (between the
        counts' AllGather and the dispatch; :mod:`balanced_cost`); ``FAST_LEVEL_S`` (measured
        on CPU, in a graph) unless given (``bench moe --fast-level-ms``).
    expert_kind: "mlp" (two matrices, 4 H F FLOPs per row) or "glu" (gated: gate and up
        projections and down, 6 H F); the balanced layer's ``expert_kind``.
    expert_bias: whether the experts carry biases (what a copy sends:
        :func:`~ms_efficient.moe.exchange.copy_rows`).
    """

    cluster: ClusterSpec
    hidden: int
    ffn_hidden: int
    dtype: str = "bf16"
    compute_passes: float = 3.0
    a2a_passes: int = 4
    sync_replica_grads: bool = True
    static_blocks: str = "exact"
    dynamic_exchange_s: float = DYNAMIC_EXCHANGE_S
    slot_budget: Optional[int] = None
    fast_level_s: float = FAST_LEVEL_S
    expert_kind: str = "mlp"
    expert_bias: bool = True

    def __post_init__(self) -> None:
        if self.expert_kind not in ("mlp", "glu"):
            raise ValueError(f"'expert_kind' must be one of ['mlp', 'glu'], but got "
                             f"{self.expert_kind!r}.")
        if not 0.0 <= self.fast_level_s < float("inf"):
            raise ValueError(f"'fast_level_s' must be a finite number >= 0 seconds, but got "
                             f"{self.fast_level_s!r}.")
        if not self.dynamic_exchange_s >= 0:
            raise ValueError(f"'dynamic_exchange_s' must be >= 0 seconds, but got "
                             f"{self.dynamic_exchange_s!r}.")
        if self.static_blocks not in ("equal", "exact"):
            raise ValueError(f"'static_blocks' must be 'equal' or 'exact', but got "
                             f"{self.static_blocks!r}.")
        if self.hidden < 1 or self.ffn_hidden < 1:
            raise ValueError(f"'hidden' and 'ffn_hidden' must be positive, but got "
                             f"{self.hidden} and {self.ffn_hidden}.")
        if self.dtype not in _DTYPE_BYTES:
            raise ValueError(f"'dtype' must be one of {sorted(_DTYPE_BYTES)}, but got "
                             f"{self.dtype!r}.")

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    @property
    def flops_per_row(self) -> float:
        """Forward FLOPs of one token through one expert, 2 FLOP per MAC: its H x F1 and F x H
        matmuls (4 H F for a two-matrix expert, 6 H F for a gated one)."""
        return 2.0 * self.expert_params

    @property
    def row_time_s(self) -> float:
        """Seconds of one computed row (token or padding) per training step on one device."""
        return self.cluster.compute_time_s(self.compute_passes * self.flops_per_row, self.dtype)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token's activation in an All-to-All: dtype bytes * H."""
        return self.dtype_bytes * self.hidden

    @property
    def expert_params(self) -> int:
        """Parameters of one expert FFN (biases ignored): 2 H F, gated 3 H F."""
        return (3 if self.expert_kind == "glu" else 2) * self.hidden * self.ffn_hidden

    @property
    def grad_bytes(self) -> int:
        """Bytes of one expert's gradient (dtype)."""
        return self.dtype_bytes * self.expert_params

    @property
    def copy_bytes(self) -> int:
        """Bytes one expert copy takes in the balanced layer's dispatch, each way: its
        parameters with biases as whole rows of H (:func:`~ms_efficient.moe.exchange.
        copy_rows`, what the layer sends)."""
        from ms_efficient.moe.exchange import copy_rows

        return (copy_rows(self.hidden, self.ffn_hidden, self.expert_kind, self.expert_bias)
                * self.bytes_per_token)


@dataclass(frozen=True)
class LayerCost:
    """Predicted cost of one MoE layer for one training step (seconds, tokens).

    time_s = exchange_time_s + a2a_time_s + compute_time_s + sync_time_s.
    exchange_time_s: the routing-count AllGather. a2a_time_s: all a2a_passes All-to-Alls.
    compute_time_s: max over devices. sync_time_s: max over devices of replica all-reduces.
    tokens_D: float64 [D] tokens computed per device (kept, no padding).
    rows_D: float64 [D] rows computed per device (tiled capacities, padding included; for
        "grouped" plans the tiled kept tokens).
    assigned, dropped: tokens kept and dropped.
    """

    time_s: float
    exchange_time_s: float
    a2a_time_s: float
    compute_time_s: float
    sync_time_s: float
    tokens_D: np.ndarray
    rows_D: np.ndarray
    assigned: int
    dropped: int


def uneven_alltoall_time_s(bytes_DD: np.ndarray, cluster: ClusterSpec):
    """Seconds of an All-to-All where device i sends bytes_DD[i, j] bytes to device j.

    Each device sends to its node peers over ``intra_link`` and to other nodes over
    ``inter_link``, both directions at once; every message costs alpha + bytes / B and the
    messages of one link kind serialize on one device. The time is the largest, over devices,
    of their four sums (intra send, inter send, intra receive, inter receive). For equal
    messages this is :meth:`ClusterSpec.collective_time_s` ("alltoall"). The diagonal is local.
    bytes_DD may carry leading axes ([..., D, D], e.g. one exchange per layer): the result is
    then an array of those leading axes, else a float.
    """
    b = np.asarray(bytes_DD, dtype=np.float64)
    num_devices = cluster.num_devices
    if b.shape[-2:] != (num_devices, num_devices):
        raise ValueError(f"'bytes_DD' must be [..., {num_devices}, {num_devices}], but got "
                         f"{b.shape}.")
    node = np.arange(num_devices) // cluster.devices_per_node
    same = node[:, None] == node[None, :]
    np.fill_diagonal(same, False)
    other = node[:, None] != node[None, :]
    worst = np.zeros(b.shape[:-2])
    for mask, link in ((same, cluster.intra_link), (other, cluster.inter_link)):
        msg = np.where(mask & (b > 0), link.latency_s + b / link.bandwidth_Bps, 0.0)
        worst = np.maximum(worst, np.maximum(msg.sum(axis=-1).max(axis=-1),
                                             msg.sum(axis=-2).max(axis=-1)))
    return float(worst) if worst.ndim == 0 else worst


def check_rank_device(rank_device: Optional[Sequence[int]], num_ranks: int,
                      cluster: ClusterSpec) -> np.ndarray:
    """Device of each source rank, int64 [R] (default rank r on device r), checked: ranks
    must sit on distinct devices of the cluster (one rank per chip)."""
    if rank_device is None:
        if num_ranks > cluster.num_devices:
            raise ValueError(f"the load has {num_ranks} source ranks but cluster "
                             f"'{cluster.name}' has {cluster.num_devices} devices; one rank per "
                             f"device needs a cluster with >= {num_ranks} devices.")
        return np.arange(num_ranks)
    rd = np.asarray(rank_device, dtype=np.int64)
    if (rd.shape != (num_ranks,) or (rd < 0).any() or (rd >= cluster.num_devices).any()
            or np.unique(rd).size != rd.size):
        raise ValueError(f"'rank_device' must give each of {num_ranks} ranks its own device in "
                         f"[0, {cluster.num_devices}), but got {rd.tolist()}.")
    return rd


def count_exchange_time_s(num_ranks: int, counts_per_rank: int, model: CostModel,
                          rank_device: Sequence[int]) -> float:
    """Seconds of the AllGather of ``counts_per_rank`` int32 counts from every rank among the
    ranks' devices (what count-driven dispatch needs before it can size or place its
    messages: E routing counts for "alltoallv", the W x S_b per-slot block counts the
    grouped layer gathers); 0 for one rank."""
    if num_ranks < 2:
        return 0.0
    return model.cluster.collective_time_s("allgather",
                                           num_ranks * counts_per_rank * COUNT_BYTES,
                                           [int(d) for d in rank_device])


def sync_time_s(rows: int, model: CostModel, devices: Sequence[int]) -> float:
    """Seconds of the replicas' gradient sync of one layer-step: an all-reduce over the
    group's ``devices`` of a table of ``rows`` experts' parameters (``model.grad_bytes``
    each), what :class:`~ms_efficient.moe.balanced_ep.ReplicaGradSum` sends
    (:func:`~ms_efficient.moe.ep_routing.sync_rows`); 0 without rows or when
    ``model.sync_replica_grads`` is off."""
    if rows <= 0 or not model.sync_replica_grads or len(devices) < 2:
        return 0.0
    return model.cluster.collective_time_s("allreduce", rows * model.grad_bytes,
                                           [int(d) for d in devices])


def _sync_time_D(plan: ExpertPlan, num_experts: int, model: CostModel,
                 rank_device: np.ndarray) -> np.ndarray:
    """Seconds each device of the group (``rank_device``) spends in the replicas' gradient
    sync of the one-level layer built for ``plan`` (:func:`sync_time_s`; a grouped or counts
    layer's table holds any plan of its slot budget, a static layer's its cross experts):
    float64 [D]."""
    sync = np.zeros(model.cluster.num_devices)
    # a grouped or counts layer's slot budget: the one it is built with, at least the most
    # slots a device of the plan holds (ep_routing.layer_tables)
    budget = (max(int(np.bincount(plan.slot_device).max()), model.slot_budget or 0)
              if plan.grouped else None)
    rows = sync_rows(plan, num_experts, len(rank_device), budget)
    sync[np.asarray(rank_device)] = sync_time_s(rows, model, rank_device)
    return sync


def _dispatch(plan: ExpertPlan, counts_RE: np.ndarray, model: CostModel, rd: np.ndarray):
    """(assigned_RS, dropped, sent_DD rows, exchange seconds) of one step; sent_DD sums
    :func:`~ms_efficient.moe.exchange.exchange_rows` (what the layer's AlltoAllV carries)
    over the ranks' devices."""
    dpn, num_devices = model.cluster.devices_per_node, model.cluster.num_devices
    num_experts = counts_RE.shape[1]
    if plan.dispatch == "static" and not np.isin(plan.slot_device, rd).all():
        raise ValueError(f"a 'static' plan must keep its slots on the ranks' devices "
                         f"{sorted(rd.tolist())}, but got {sorted(set(plan.slot_device))}.")
    rows_RD = exchange_rows(plan, num_experts, rd, num_devices, dpn, counts_RE)
    sent_DD = np.zeros((num_devices, num_devices))
    sent_DD[rd] = rows_RD
    if plan.dispatch == "static":
        rows_RS = source_rows(plan, num_experts, rd, dpn, plan.rank_share)
        assigned_RS, dropped = static_assignments(plan, counts_RE, rows_RS, rd, dpn)
        if model.static_blocks == "equal":
            sent_DD[np.ix_(rd, rd)] = sent_DD.max()            # C_send rows, every pair
        return assigned_RS, dropped, sent_DD, 0.0
    assigned_RS, dropped = split_tokens(plan, counts_RE, rd, dpn)
    num_ranks = counts_RE.shape[0]
    counts_per_rank = (num_ranks * int(np.bincount(plan.slot_device).max())   # [W * S_b]
                       if plan.grouped else num_experts)
    exchange = count_exchange_time_s(num_ranks, counts_per_rank, model, rd)
    if plan.dispatch in DYNAMIC_DISPATCH and num_ranks > 1:
        exchange += model.a2a_passes * model.dynamic_exchange_s
    return assigned_RS, dropped, sent_DD, exchange


def computed_rows_D(plan: ExpertPlan, assigned_RS: np.ndarray, model: CostModel) -> np.ndarray:
    """Rows every device computes in one forward pass, float64 [D] (module docstring): the
    tiled capacities of its slots, or for a "grouped" plan the tiled kept tokens of each."""
    rows_S = assigned_RS.sum(axis=0) if plan.grouped else plan.slot_capacity
    return np.bincount(plan.slot_device, weights=model.cluster.tiled_rows(rows_S),
                       minlength=model.cluster.num_devices).astype(np.float64)


def compute_time_D(plan: ExpertPlan, assigned_RS: np.ndarray, model: CostModel) -> np.ndarray:
    """Seconds of expert compute every device spends in one training step (forward and
    backward), float64 [D]: the roofline of its slots' GEMMs, the larger of
      compute: computed rows (:func:`computed_rows_D`) x ``model.row_time_s`` and
      memory:  compute_passes x the bytes its FFN GEMMs move, per slot with m > 0 computed
               rows 2 (m (H + F) + H F) dtype bytes (two GEMMs, each reading its input and
               weight and writing its output), over ``cluster.hbm_bandwidth_Bps``.
    A slot that computes no row (a grouped slot with no token) reads no weight."""
    rows_S = (model.cluster.tiled_rows(assigned_RS.sum(axis=0)) if plan.grouped
              else model.cluster.tiled_rows(plan.slot_capacity)).astype(np.float64)
    h, f = model.hidden, model.ffn_hidden
    bytes_S = np.where(rows_S > 0, 2.0 * (rows_S * (h + f) + h * f) * model.dtype_bytes, 0.0)
    num_devices = model.cluster.num_devices
    flops_D = computed_rows_D(plan, assigned_RS, model) * model.row_time_s
    bytes_D = np.bincount(plan.slot_device, weights=bytes_S, minlength=num_devices)
    memory_D = model.cluster.memory_time_s(model.compute_passes * bytes_D)
    return np.maximum(flops_D, memory_D)


def layer_cost(plan: ExpertPlan, counts_RE: np.ndarray, model: CostModel,
               rank_device: Optional[Sequence[int]] = None) -> LayerCost:
    """Analytic cost of one training step of one MoE layer under ``plan`` (module docstring).

    counts_RE: int [R, E] tokens each source rank routes to each expert.
    rank_device: int [R] device of each rank; default rank r on device r.
    """
    counts_RE = np.rint(np.asarray(counts_RE, dtype=np.float64)).astype(np.int64)
    cluster = model.cluster
    rd = check_rank_device(rank_device, counts_RE.shape[0], cluster)
    num_devices = cluster.num_devices
    # Step 1: dispatch rows between devices [D, D], and the count exchange
    assigned_RS, dropped, sent_DD, exchange = _dispatch(plan, counts_RE, model, rd)
    a2a = model.a2a_passes * uneven_alltoall_time_s(sent_DD * model.bytes_per_token, cluster)
    # Step 2: expert compute (padded capacities, or grouped kept rows), replica gradient sync
    rows_D = computed_rows_D(plan, assigned_RS, model)
    compute = float(compute_time_D(plan, assigned_RS, model).max())
    sync = float(_sync_time_D(plan, counts_RE.shape[1], model, rd).max())
    tokens_D = np.bincount(plan.slot_device, weights=assigned_RS.sum(axis=0),
                           minlength=num_devices)
    return LayerCost(time_s=exchange + a2a + compute + sync, exchange_time_s=exchange,
                     a2a_time_s=a2a, compute_time_s=compute, sync_time_s=sync,
                     tokens_D=tokens_D, rows_D=rows_D, assigned=int(assigned_RS.sum()),
                     dropped=int(dropped))


def event_step_time_s(plan: ExpertPlan, counts_RE: np.ndarray, model: CostModel,
                      rank_device: Optional[Sequence[int]] = None) -> float:
    """One layer's training step on the shared event simulator, seconds.

    Phases, each waiting for the previous one to end on every device: count exchange
    ("alltoallv" and "grouped" plans), forward dispatch All-to-All, forward expert compute, forward combine,
    backward combine-gradient All-to-All, backward compute (2x), backward dispatch-gradient
    All-to-All, replica gradient sync. Every message of an All-to-All is a transfer on the
    sender's transmit resource and one on the receiver's receive resource (per link kind,
    intra- or inter-node), so messages of one kind serialize per device; a replica group's
    all-reduce occupies each member's sync resource. Equal to :func:`layer_cost` ``.time_s``
    (tests check it); slower, for validation.
    """
    cluster = model.cluster
    counts = np.rint(np.asarray(counts_RE, dtype=np.float64)).astype(np.int64)
    rd = check_rank_device(rank_device, counts.shape[0], cluster)
    assigned_RS, _, sent_DD, exchange = _dispatch(plan, counts, model, rd)
    bytes_DD = sent_DD * model.bytes_per_token
    num_devices = cluster.num_devices
    compute_D = compute_time_D(plan, assigned_RS, model)
    sim = Simulator()
    prev: List[int] = []

    def a2a(tag: str, b: np.ndarray) -> List[int]:
        ids = []
        for i, j in zip(*np.nonzero(b)):
            if i == j:
                continue
            kind, link = (("hccs", cluster.intra_link) if cluster.node_of(int(i)) ==
                          cluster.node_of(int(j)) else ("nic", cluster.inter_link))
            for side, dev in (("tx", i), ("rx", j)):
                ids.append(sim.add_transfer(f"{tag}.{side}.{i}->{j}", f"dev{dev}.{kind}_{side}",
                                            float(b[i, j]), link.latency_s, link.bandwidth_Bps,
                                            deps=prev))
        return ids

    def barrier(tag: str, ids: List[int]) -> List[int]:
        return [sim.add_event(f"{tag}.done", deps=ids or prev)]

    def compute(tag: str, passes: float) -> List[int]:
        return [sim.add_task(f"{tag}.dev{d}", f"dev{d}.compute",
                             compute_D[d] * passes / model.compute_passes,
                             deps=prev) for d in range(num_devices)]

    def counts_exchange() -> List[int]:
        return [sim.add_task(f"counts.dev{d}", f"dev{d}.sync", exchange, deps=prev)
                for d in rd] if exchange > 0 else []

    prev = barrier("start", [])
    for tag, work in (("counts", counts_exchange),
                      ("fwd.dispatch", lambda: a2a("fwd.dispatch", bytes_DD)),
                      ("fwd.compute", lambda: compute("fwd.compute", 1.0)),
                      ("fwd.combine", lambda: a2a("fwd.combine", bytes_DD.T)),
                      ("bwd.combine", lambda: a2a("bwd.combine", bytes_DD)),
                      ("bwd.compute", lambda: compute("bwd.compute", model.compute_passes - 1)),
                      ("bwd.dispatch", lambda: a2a("bwd.dispatch", bytes_DD.T))):
        prev = barrier(tag, work())
    sync_D = _sync_time_D(plan, counts.shape[1], model, rd)
    barrier("sync", [sim.add_task(f"sync.dev{d}", f"dev{d}.sync", float(sync_D[d]), deps=prev)
                     for d in rd if sync_D[d] > 0])
    return sim.run().makespan_s
