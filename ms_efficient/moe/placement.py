"""EfficientMoE's scheduler: replicate hot experts, place experts and replicas on devices.

Given a layer's predicted routing counts ``load_RE`` (tokens rank r sends to expert e next
step), a ClusterSpec and a slot budget per device, :func:`plan_layer` returns an ExpertPlan
that minimises the predicted MoE iteration time of the layer, evaluated by
:func:`layer_cost`, a fast analytic model of one training step of the layer:

    time = a2a_passes * A2A(dispatch bytes) + max_d compute_d + max_d sync_d
    compute_d = compute_passes * rows_d * 4 H F / (peak FLOP/s * efficiency)
    A2A       = max over devices of the per-link send/receive time (uneven all-to-all)
    sync_d    = all-reduce of an expert's gradients among its replicas' devices

rows_d is the sum of the device's slot capacities (padding rows are computed too).
Forward + backward: the backward pass does twice the forward FLOPs (compute_passes = 3) and
runs two All-to-Alls of the same size as the forward's (a2a_passes = 4). Replica gradient
sync is charged after the layer, not overlapped: a conservative choice that makes
replication pay for itself.

The search (phases marked ``# Step``): 0. each expert's capacity headroom from the capacity
model; 1. replication levels: for a grid of replica totals, refined by halving steps around
the best, hot experts get replicas greedily (the next one goes to the expert with the largest
load per replica); 2. placement: replicas, heaviest first, go to the device where they raise
a per-device time estimate (compute + received All-to-All bytes + replica sync) least,
serving their own device's and node's ranks first; 3. each candidate is scored by
:func:`layer_cost` and the best kept; 4. capacities from the capacity model. Deterministic:
no random numbers are drawn; ties go to the lower expert / device id and to fewer replicas.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import numpy as np

from ms_efficient.cluster import ClusterSpec
from ms_efficient.moe.capacity import exact_capacities, slot_capacities
from ms_efficient.moe.plan import ExpertPlan, split_tokens

__all__ = ["CostModel", "LayerCost", "PlacementConfig", "uneven_alltoall_time_s", "layer_cost",
           "device_matrix",
           "default_slots_per_device", "replica_counts_greedy", "place_replicas",
           "balanced_capacities", "expected_slot_loads", "plan_layer"]

logger = logging.getLogger(__name__)

_DTYPE_BYTES = {"fp16": 2, "bf16": 2, "float16": 2, "bfloat16": 2, "fp32": 4, "float32": 4}


@dataclass(frozen=True)
class CostModel:
    """What one token and one expert cost on a cluster.

    cluster: the devices and links. hidden: H. ffn_hidden: F, each expert's FFN width.
    dtype: activation/weight dtype ("bf16", "fp16", "fp32"); 2 bytes per value for 16-bit.
    compute_passes: expert FLOPs of a training step per forward FLOP (3: backward = 2x fwd).
    a2a_passes: All-to-Alls per step of the dispatch's size (4: dispatch + combine, fwd + bwd).
    sync_replica_grads: charge an all-reduce of each replicated expert's gradients.
    a2a_padded: False: the All-to-All carries the routed tokens only (AlltoAllV with exchanged
        counts). True: static buffers as in GShard's dense dispatch: every rank sends each slot
        capacity / R rows, full or not.
    """

    cluster: ClusterSpec
    hidden: int
    ffn_hidden: int
    dtype: str = "bf16"
    compute_passes: float = 3.0
    a2a_passes: int = 4
    sync_replica_grads: bool = True
    a2a_padded: bool = False

    def __post_init__(self) -> None:
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
        """Forward FLOPs of one token through one expert: two H x F matmuls, 2 FLOP per MAC."""
        return 4.0 * self.hidden * self.ffn_hidden

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
        """Parameters of one expert FFN (biases ignored): 2 H F."""
        return 2 * self.hidden * self.ffn_hidden

    @property
    def grad_bytes(self) -> int:
        """Bytes of one expert's gradient (dtype)."""
        return self.dtype_bytes * self.expert_params


@dataclass(frozen=True)
class LayerCost:
    """Predicted cost of one MoE layer for one training step (seconds, tokens).

    time_s = a2a_time_s + compute_time_s + sync_time_s.
    a2a_time_s: all a2a_passes All-to-Alls. compute_time_s: max over devices.
    sync_time_s: max over devices of replica gradient all-reduces.
    tokens_D: float64 [D] tokens computed per device (kept, no padding).
    rows_D: float64 [D] rows computed per device (capacities, padding included).
    assigned, dropped: tokens kept and dropped.
    """

    time_s: float
    a2a_time_s: float
    compute_time_s: float
    sync_time_s: float
    tokens_D: np.ndarray
    rows_D: np.ndarray
    assigned: int
    dropped: int


def uneven_alltoall_time_s(bytes_DD: np.ndarray, cluster: ClusterSpec) -> float:
    """Seconds of an All-to-All where device i sends bytes_DD[i, j] bytes to device j.

    Each device sends to its node peers over ``intra_link`` and to other nodes over
    ``inter_link``, both directions at once; every message costs alpha + bytes / B and the
    messages of one link kind serialize on one device. The time is the largest, over devices,
    of their four sums (intra send, inter send, intra receive, inter receive). For equal
    messages this is :meth:`ClusterSpec.collective_time_s` ("alltoall"). The diagonal is local.
    """
    b = np.asarray(bytes_DD, dtype=np.float64)
    num_devices = cluster.num_devices
    if b.shape != (num_devices, num_devices):
        raise ValueError(f"'bytes_DD' must be [{num_devices}, {num_devices}], but got {b.shape}.")
    node = np.arange(num_devices) // cluster.devices_per_node
    same = node[:, None] == node[None, :]
    np.fill_diagonal(same, False)
    other = node[:, None] != node[None, :]
    worst = 0.0
    for mask, link in ((same, cluster.intra_link), (other, cluster.inter_link)):
        msg = np.where(mask & (b > 0), link.latency_s + b / link.bandwidth_Bps, 0.0)
        worst = max(worst, float(msg.sum(axis=1).max()), float(msg.sum(axis=0).max()))
    return worst


def device_matrix(per_rank_slot_RS: np.ndarray, rank_device: np.ndarray, slot_device: np.ndarray,
                  num_devices: int) -> np.ndarray:
    """Sum a [R, S] rank-to-slot matrix into a [D, D] device-to-device one (float64)."""
    out = np.zeros((num_devices, num_devices))
    np.add.at(out, (np.asarray(rank_device)[:, None], np.asarray(slot_device)[None, :]),
              per_rank_slot_RS)
    return out


def _check_rank_device(rank_device: Optional[Sequence[int]], num_ranks: int,
                       cluster: ClusterSpec) -> np.ndarray:
    """Device of each rank, int64 [R] (default rank r on device r), checked."""
    if rank_device is None:
        if num_ranks > cluster.num_devices:
            raise ValueError(f"the load has {num_ranks} source ranks but cluster "
                             f"'{cluster.name}' has {cluster.num_devices} devices; one rank per "
                             f"device needs a cluster with >= {num_ranks} devices.")
        return np.arange(num_ranks)
    rd = np.asarray(rank_device, dtype=np.int64)
    if rd.shape != (num_ranks,) or (rd < 0).any() or (rd >= cluster.num_devices).any():
        raise ValueError(f"'rank_device' must give each of {num_ranks} ranks a device in "
                         f"[0, {cluster.num_devices}), but got {rd.tolist()}.")
    return rd


def _sync_time_D(plan: ExpertPlan, num_experts: int, model: CostModel) -> np.ndarray:
    """Seconds each device spends all-reducing replicated experts' gradients: float64 [D]."""
    sync = np.zeros(model.cluster.num_devices)
    if not model.sync_replica_grads:
        return sync
    for e in np.flatnonzero(plan.replica_counts(num_experts) > 1):
        devices = np.unique(plan.slot_device[plan.replicas_of(int(e))])
        if devices.size > 1:
            sync[devices] += model.cluster.collective_time_s("allreduce", model.grad_bytes,
                                                             devices.tolist())
    return sync


def layer_cost(plan: ExpertPlan, counts_RE: np.ndarray, model: CostModel,
               rank_device: Optional[Sequence[int]] = None) -> LayerCost:
    """Analytic cost of one training step of one MoE layer under ``plan`` (module docstring).

    counts_RE: int [R, E] tokens each source rank routes to each expert.
    rank_device: int [R] device of each rank; default rank r on device r.
    """
    counts_RE = np.rint(np.asarray(counts_RE, dtype=np.float64)).astype(np.int64)
    cluster = model.cluster
    rd = _check_rank_device(rank_device, counts_RE.shape[0], cluster)
    assigned_RS, dropped = split_tokens(plan, counts_RE, rd, cluster.devices_per_node)
    num_devices = cluster.num_devices
    # Step 1: dispatch bytes between devices, [D, D]
    tokens_DD = device_matrix(assigned_RS, rd, plan.slot_device, num_devices)
    sent_DD = tokens_DD if not model.a2a_padded else device_matrix(
        np.broadcast_to(plan.slot_capacity / rd.size, assigned_RS.shape), rd, plan.slot_device,
        num_devices)
    a2a = model.a2a_passes * uneven_alltoall_time_s(sent_DD * model.bytes_per_token, cluster)
    # Step 2: expert compute on padded capacities, and replica gradient sync
    rows_D = np.bincount(plan.slot_device, weights=plan.slot_capacity, minlength=num_devices)
    compute = float(rows_D.max()) * model.row_time_s
    sync = float(_sync_time_D(plan, counts_RE.shape[1], model).max())
    return LayerCost(time_s=a2a + compute + sync, a2a_time_s=a2a, compute_time_s=compute,
                     sync_time_s=sync, tokens_D=tokens_DD.sum(axis=0), rows_D=rows_D,
                     assigned=int(assigned_RS.sum()), dropped=int(dropped))


# ---- the scheduler ----------------------------------------------------------------------------

@dataclass(frozen=True)
class PlacementConfig:
    """slots_per_device: expert weight slots each device has memory for (>= ceil(E / D)).
    capacity_multiple: capacities are multiples of this (tokens). drop_target: expected drop
    rate the capacity model aims at. levels: points of the coarse grid of replication levels."""

    slots_per_device: int
    capacity_multiple: int = 16
    drop_target: float = 0.005
    levels: int = 5


def default_slots_per_device(num_experts: int, num_devices: int, extra: int = 1) -> int:
    """ceil(E / D) slots for the experts plus ``extra`` spare slots for replicas."""
    return -(-num_experts // num_devices) + extra


def replica_counts_greedy(load_E: np.ndarray, total_slots: int) -> np.ndarray:
    """Replicas per expert, int64 [E]: one each, then each extra slot goes to the expert with
    the largest load per replica (ties: lower id) until ``total_slots`` are used."""
    load = np.asarray(load_E, dtype=np.float64)
    if total_slots < load.size:
        raise ValueError(f"{total_slots} slots cannot hold {load.size} experts; give each "
                         f"device more slots (slots_per_device).")
    counts = np.ones(load.size, dtype=np.int64)
    for _ in range(total_slots - load.size):
        counts[int(np.argmax(load / counts))] += 1
    return counts


def place_replicas(load_RE: np.ndarray, replicas_E: np.ndarray, model: CostModel,
                   slots_per_device: int, rank_device: np.ndarray,
                   growth_E: Optional[np.ndarray] = None) -> Tuple[np.ndarray, np.ndarray]:
    """Greedy placement of ``replicas_E[e]`` replicas of each expert: (slot_expert, slot_device).

    Replicas (load L_e / n_e each, computing growth_e times as many rows: capacity headroom,
    default 1) are placed heaviest first on the device with a free slot and no copy of the
    expert that minimises its estimated time after placement:
        T_d = row_time * rows_d + 4 * (intra_recv_d * t_intra + inter_recv_d * t_inter) + sync_d
    where the replica serves its own device's ranks first, then its node's, then others'
    (the unserved demand of each rank is tracked), t_* are per-token link times, and sync_d
    adds an all-reduce of the expert's gradients when it already has replicas (inter-node if
    any of them is on another node). Ties go to the lower device id.
    """
    cluster = model.cluster
    num_devices, dpn = cluster.num_devices, cluster.devices_per_node
    load = np.asarray(load_RE, dtype=np.float64)
    num_experts = load.shape[1]
    if replicas_E.sum() > slots_per_device * num_devices or (replicas_E > num_devices).any():
        raise ValueError(f"{int(replicas_E.sum())} replicas (at most one per device per expert)"
                         f" do not fit {slots_per_device} slots x {num_devices} devices.")
    node_D = np.arange(num_devices) // dpn
    links = (cluster.intra_link, cluster.inter_link)
    t_intra, t_inter = (model.a2a_passes * model.bytes_per_token / link.bandwidth_Bps
                        for link in links)
    sync_bytes = 2 * model.grad_bytes * float(model.sync_replica_grads)   # ~ all-reduce of 2
    sync_intra, sync_inter = (sync_bytes / link.bandwidth_Bps for link in links)
    time_D = np.zeros(num_devices)
    free_D = np.full(num_devices, slots_per_device)
    hosts_DE = np.zeros((num_devices, num_experts), dtype=bool)
    unserved_RE = load.copy()
    total_E = load.sum(axis=0)
    growth = np.ones(num_experts) if growth_E is None else np.asarray(growth_E, dtype=np.float64)
    items = [(total_E[e] / replicas_E[e], e) for e in range(num_experts)
             for _ in range(replicas_E[e])]
    items.sort(key=lambda it: (-it[0] * growth[it[1]], it[1]))
    slot_expert, slot_device = [], []
    for share, e in items:                     # share: tokens this replica serves per step
        u_D = np.bincount(rank_device, weights=unserved_RE[:, e], minlength=num_devices)
        u_N = np.bincount(node_D, weights=u_D, minlength=cluster.nodes)
        local = np.minimum(u_D, share)
        intra = np.minimum(u_N[node_D] - u_D, share - local)
        inter = share - local - intra
        placed = hosts_DE[:, e]
        sync = 0.0 if not placed.any() else np.where(
            (node_D[:, None] != node_D[placed][None, :]).any(axis=1), sync_inter, sync_intra)
        score = (time_D + model.row_time_s * share * growth[e] + intra * t_intra
                 + inter * t_inter + sync)
        score = np.where((free_D > 0) & ~placed, score, np.inf)
        d = int(np.argmin(score))
        time_D[d] = score[d]
        free_D[d] -= 1
        hosts_DE[d, e] = True
        slot_expert.append(e)
        slot_device.append(d)
        # serve the unserved demand: own device, then node, then the rest, proportionally
        for mask, amount in ((rank_device == d, local[d]),
                             ((node_D[rank_device] == node_D[d]) & (rank_device != d), intra[d]),
                             (node_D[rank_device] != node_D[d], inter[d])):
            pool = unserved_RE[mask, e]
            if pool.sum() > 0:
                unserved_RE[mask, e] -= pool * min(1.0, amount / pool.sum())
    order = np.lexsort((np.array(slot_expert), np.array(slot_device)))
    return np.array(slot_expert)[order], np.array(slot_device)[order]


def balanced_capacities(slot_expert: np.ndarray, load_E: np.ndarray) -> np.ndarray:
    """Provisional capacities: each replica of e gets ceil(L_e / n_e) tokens (int64 [S])."""
    n = np.bincount(slot_expert, minlength=load_E.size)
    return np.ceil(np.asarray(load_E, dtype=np.float64)[slot_expert] / n[slot_expert]).astype(
        np.int64)


def expected_slot_loads(slot_expert: np.ndarray, slot_device: np.ndarray, load_RE: np.ndarray,
                        rank_device: np.ndarray, devices_per_node: int) -> np.ndarray:
    """Tokens each slot is expected to receive, float64 [S]: :func:`split_tokens` of the load
    with the provisional :func:`balanced_capacities` (replicas share equally, locality first)."""
    counts = np.rint(np.asarray(load_RE, dtype=np.float64)).astype(np.int64)
    caps = balanced_capacities(slot_expert, counts.sum(axis=0))
    plan = ExpertPlan(slot_expert, slot_device, caps)
    assigned_RS, _ = split_tokens(plan, counts, rank_device, devices_per_node)
    return assigned_RS.sum(axis=0).astype(np.float64)


def plan_layer(load_RE: np.ndarray, model: CostModel, config: PlacementConfig,
               rank_device: Optional[Sequence[int]] = None,
               rel_err_KE: Optional[np.ndarray] = None, method: str = "efficientmoe",
               top_k: Optional[int] = None) -> ExpertPlan:
    """EfficientMoE plan of one layer from its predicted load.

    load_RE: float [R, E] predicted tokens rank r sends to expert e per step.
    model: CostModel (cluster, H, F). config: slot budget, capacity rounding, drop target.
    rank_device: int [R] device of each rank (default: rank r on device r).
    rel_err_KE: float [K, E] recent relative forecast errors for the capacity model; None means
        the load is known exactly (the oracle): capacities fit it up to rounding.
    Returns an ExpertPlan with per-slot capacities, ``tokens_per_step`` set from the load.
    """
    load = np.asarray(load_RE, dtype=np.float64)
    if load.ndim != 2 or (load < 0).any():
        raise ValueError(f"'load_RE' must be a non-negative [rank, expert] array, but got "
                         f"shape {load.shape}.")
    cluster = model.cluster
    rd = _check_rank_device(rank_device, load.shape[0], cluster)
    num_experts, num_devices = load.shape[1], cluster.num_devices
    total_slots = config.slots_per_device * num_devices
    if total_slots < num_experts:
        raise ValueError(f"slots_per_device {config.slots_per_device} x {num_devices} devices "
                         f"< {num_experts} experts; it must be >= "
                         f"{-(-num_experts // num_devices)}.")
    load_E = load.sum(axis=0)
    # Step 0: headroom of each expert (capacity / predicted load) from the capacity model, so
    # that placement balances the rows devices will compute, padding included
    if rel_err_KE is None:
        growth_E = np.ones(num_experts)
    else:
        alone = slot_capacities(load_E, np.arange(num_experts), rel_err_KE, config.drop_target, 1)
        growth_E = np.where(load_E > 0, alone.capacity_S / np.maximum(load_E, 1e-9), 1.0)

    def candidate(extra: int) -> Tuple[float, np.ndarray, np.ndarray]:
        replicas = np.minimum(replica_counts_greedy(load_E * growth_E, num_experts + extra),
                              num_devices)
        # Step 2: placement, on the rows each replica will compute
        slot_expert, slot_device = place_replicas(load, replicas, model,
                                                  config.slots_per_device, rd, growth_E)
        # Step 3: score with the analytic cost at provisional capacities
        caps = balanced_capacities(slot_expert, np.rint(load_E * growth_E))
        cost = layer_cost(ExpertPlan(slot_expert, slot_device, caps), load, model, rd).time_s
        return cost, slot_expert, slot_device

    # Step 1: replication levels: a coarse grid from no replica to the full slot budget, then
    # halving steps around the best level (ties: fewer replicas)
    max_extra = min(total_slots, num_experts * num_devices) - num_experts
    grid = np.unique(np.round(np.linspace(0, max_extra, max(2, config.levels))).astype(int))
    scored = {int(x): candidate(int(x)) for x in grid}
    step = int(grid[1] - grid[0]) if grid.size > 1 else 1
    while step > 1:
        step //= 2
        centre = min(scored, key=lambda x: (scored[x][0], x))
        for x in (centre - step, centre + step):
            if 0 <= x <= max_extra and x not in scored:
                scored[x] = candidate(x)
    best_cost, slot_expert, slot_device = scored[min(scored, key=lambda x: (scored[x][0], x))]
    # Step 4: capacities from the capacity model (or exact for a known load)
    expected = expected_slot_loads(slot_expert, slot_device, load, rd, cluster.devices_per_node)
    if rel_err_KE is None:
        caps = exact_capacities(expected, config.capacity_multiple).capacity_S
    else:
        caps = slot_capacities(expected, slot_expert, rel_err_KE, config.drop_target,
                               config.capacity_multiple).capacity_S
    tokens = int(round(load_E.sum() / top_k)) if top_k else None
    logger.debug("plan_layer: %d slots, %d replicated experts, predicted %.3g s",
                 slot_expert.size, int((np.bincount(slot_expert) > 1).sum()), best_cost)
    return ExpertPlan(slot_expert, slot_device, caps, top_k=top_k, tokens_per_step=tokens,
                      method=method)
