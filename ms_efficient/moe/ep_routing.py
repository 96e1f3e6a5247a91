"""Static dispatch tables of the expert-parallel MoE layer (numpy, computed before compilation).

Notation: W ranks in the expert-parallel group (rank = device id of the plan), E logical
experts, S physical slots of an :class:`~ms_efficient.moe.plan.ExpertPlan`, J the most
replicas of one expert a rank sends to, C_send rows per destination block of the send buffer.

Static dispatch, in three tables:

1. ``rows_RS`` (:func:`~ms_efficient.moe.split.source_rows`), int64 [W, S]: the rows of slot s
   reserved for the tokens of source rank r, so ``rows_RS[:, s].sum() == slot_capacity[s]``. Each expert's capacity
   (summed over its replicas) is first shared among the source ranks, equally by default or in
   proportion to a per-rank load forecast; every rank's share is then attributed to the
   expert's replicas with the package's dispatch rule :func:`~ms_efficient.moe.split.split_tokens`
   (own device first, then same node, then balanced by remaining room). A rank's share of an
   expert may so span several replicas: its local replica first, the overflow in a sibling.
2. Send side, per rank r (:func:`rank_dispatch`): the replicas r feeds for each expert in
   "spill order" (own device, same node, others; then slot id) with cumulative row ends.
   Assignment number p (0-based, by arrival within (r, expert e), k-major) goes to the first
   replica j whose end exceeds p, at send row ``shift_EJ[e, j] + p``; p >= the rank's rows
   for e is dropped.
3. Buffers, exact (an AlltoAllV with counts fixed before compilation,
   :class:`~ms_efficient.moe.alltoall.AllToAllV`): rank r's send buffer is the concatenation
   over destinations d of blocks of ``send_counts[d]`` rows (the rows r reserves on d's
   slots); block d holds, for every slot on rank d in slot id order, that slot's
   rows_RS[r, s] rows, so no row is padding. The receive buffer concatenates, over sources,
   ``recv_counts[src]`` rows; they are exactly the rows reserved on the local slots, so the
   receiver's slot-major buffer (slots grouped by capacity, one batched matmul per group, as
   in :class:`~ms_efficient.moe.layer.MoEFeedForward`) is a permutation of it
   (``recv_index_N``, inverse ``back_index_M``). C_send, the largest block of the group, is
   what an emulation pads every block to.

Grouped dispatch (:func:`grouped_dispatch`, plans with ``dispatch == "grouped"``): the
tables of the package's rule :func:`~ms_efficient.moe.split.grouped_assignments`, which the
layer evaluates in the graph on the step's counts. Rank r splits its c tokens of expert e over
e's replicas (ascending slot) at the cumulative integer weights ``cumw_EJ`` of
:func:`~ms_efficient.moe.split.grouped_split_weights`; device d keeps, out of what all ranks
send it (rank-major, slot-minor), the first B_d = ``plan.device_rows()[d]`` rows. The send
buffer has one block of B_d rows per device d (no rank can have more kept rows there), each
holding this rank's kept rows of d's slots in ascending slot order.

Replica gradient sync (:func:`replica_sync`): gradients of a logical expert's replicas are
summed: first over the replicas on this rank, then, for experts with replicas on more than
one rank ("cross" experts, the same list on every rank), by an AllReduce of a [X, ...] table
(X = number of cross experts) to which each rank adds its local sums.
No MindSpore import here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from ms_efficient.moe.plan import ExpertPlan
from ms_efficient.moe.split import SPLIT_UNITS, grouped_split_weights

__all__ = ["RankDispatch", "rank_dispatch", "GroupedDispatch", "grouped_dispatch",
           "ReplicaSync", "replica_sync", "capacity_groups"]


def capacity_groups(slots: np.ndarray,
                    capacity_S: np.ndarray) -> Tuple[Tuple[int, Tuple[int, ...]], ...]:
    """Slots grouped by capacity, largest capacity first, zero-capacity slots left out:
    ``((capacity, (index into slots, ...)), ...)``; slot order kept inside a group."""
    groups = {}
    for i, s in enumerate(slots):
        c = int(capacity_S[s])
        if c > 0:
            groups.setdefault(c, []).append(i)
    return tuple((c, tuple(ix)) for c, ix in sorted(groups.items(), reverse=True))


@dataclass(frozen=True)
class RankDispatch:
    """Static dispatch tables of one rank (every index table int32, ready for a Tensor).

    send_rows: C_send, the largest block any rank sends any rank (the same on every rank).
    send_counts: int64 [W], rows this rank sends to each rank (its send buffer's blocks).
    recv_counts: int64 [W], rows this rank receives from each rank.
    local_slots: int64 [S_l], global ids of the slots on this rank, ascending.
    groups: ((rows, (local slot index, ...)), ...), the batched-matmul groups of the local
        slots in slot-major order, by reserved rows (:func:`capacity_groups`).
    rows_E: int32 [E], rows this rank may send to each expert (all replicas).
    ends_EJ: int32 [E, J], cumulative row ends of the replicas this rank feeds for each expert,
        in spill order; padded with rows_E.
    shift_EJ: int32 [E, J], send row of arrival p on replica j is shift_EJ[e, j] + p.
    recv_index_N: int32 [N], N = rows reserved on the local slots (the sum of their
        capacities for rows from :func:`~ms_efficient.moe.split.source_rows`) =
        sum(recv_counts): receive-buffer row of every slot-major row (a permutation).
    back_index_M: int32 [N], slot-major row of every receive-buffer row (its inverse).
    """

    send_rows: int
    send_counts: np.ndarray
    recv_counts: np.ndarray
    local_slots: np.ndarray
    groups: Tuple[Tuple[int, Tuple[int, ...]], ...]
    rows_E: np.ndarray
    ends_EJ: np.ndarray
    shift_EJ: np.ndarray
    recv_index_N: np.ndarray
    back_index_M: np.ndarray

    @property
    def replicas_per_expert(self) -> int:
        """J, the most replicas this rank sends one expert's tokens to."""
        return int(self.ends_EJ.shape[1])


def _block_offsets(plan: ExpertPlan, rows_RS: np.ndarray) -> np.ndarray:
    """Row offset of slot s inside the destination block of source r: int64 [R, S]. Inside a
    block, the slots of the destination device follow in ascending slot id."""
    off_RS = np.zeros_like(rows_RS)
    for d in np.unique(plan.slot_device):
        on_d = np.flatnonzero(plan.slot_device == d)
        off_RS[:, on_d] = np.cumsum(rows_RS[:, on_d], axis=1) - rows_RS[:, on_d]
    return off_RS


def rank_dispatch(plan: ExpertPlan, rows_RS: np.ndarray, num_experts: int, rank: int,
                  devices_per_node: Optional[int] = None) -> RankDispatch:
    """The send and receive tables of ``rank`` for per-source rows ``rows_RS`` (int [W, S]).

    Raises ``ValueError`` when the rank hosts no slot or no rank reserves any row.
    """
    rows_RS = np.asarray(rows_RS, dtype=np.int64)
    world = rows_RS.shape[0]
    if rows_RS.shape != (world, plan.num_slots) or (rows_RS < 0).any():
        raise ValueError(f"'rows_RS' must be >= 0 with shape [ranks, {plan.num_slots}], but got "
                         f"shape {rows_RS.shape}.")
    if (rows_RS.sum(axis=0) > plan.slot_capacity).any():
        raise ValueError(f"'rows_RS' reserves more rows than the slot capacities "
                         f"{plan.slot_capacity.tolist()}: {rows_RS.sum(axis=0).tolist()}.")
    if not 0 <= rank < world:
        raise ValueError(f"'rank' must be in [0, {world}), but got {rank}.")
    local_slots = np.flatnonzero(plan.slot_device == rank)
    if local_slots.size == 0:
        raise ValueError(f"rank {rank} hosts no slot of the expert plan; every rank of the "
                         f"expert-parallel group needs at least one slot.")
    # Step 1: blocks: rank r sends to_dev_RD[r, d] rows to d; block offsets in both buffers.
    to_dev_RD = np.zeros((world, world), dtype=np.int64)
    np.add.at(to_dev_RD.T, plan.slot_device, rows_RS.T)
    send_rows = int(to_dev_RD.max())
    if send_rows == 0:
        raise ValueError("the expert plan reserves no row for any rank (all capacities are 0).")
    off_RS = _block_offsets(plan, rows_RS)
    send_counts, recv_counts = to_dev_RD[rank], to_dev_RD[:, rank]
    send_off = np.cumsum(send_counts) - send_counts     # [W] start of the block to rank d
    recv_off = np.cumsum(recv_counts) - recv_counts     # [W] start of the block from src

    # Step 2: send side: every expert's replicas in spill order, with cumulative ends.
    node = (lambda d: d // devices_per_node) if devices_per_node else (lambda d: 0)
    feeds = []
    for e in range(num_experts):
        slots = [s for s in np.flatnonzero(plan.slot_expert == e) if rows_RS[rank, s] > 0]
        tier = [0 if plan.slot_device[s] == rank else 1 if node(plan.slot_device[s]) == node(rank)
                else 2 for s in slots]
        feeds.append([s for _, s in sorted(zip(tier, slots))])
    num_j = max(1, max(len(f) for f in feeds))
    rows_E = np.array([rows_RS[rank, f].sum() for f in feeds], dtype=np.int64)
    ends_EJ = np.repeat(rows_E[:, None], num_j, axis=1)
    shift_EJ = np.zeros((num_experts, num_j), dtype=np.int64)
    for e, f in enumerate(feeds):
        start = 0
        for j, s in enumerate(f):
            shift_EJ[e, j] = send_off[plan.slot_device[s]] + off_RS[rank, s] - start
            start += rows_RS[rank, s]
            ends_EJ[e, j] = start

    # Step 3: receive side: slot-major rows (capacity groups, then slots, then sources).
    # A slot computes the rows reserved for it (its capacity when rows_RS comes from
    # source_rows); unreserved rows could never hold a token, so they are not computed.
    groups = capacity_groups(local_slots, rows_RS.sum(axis=0))
    recv = []
    for _, members in groups:
        for i in members:
            s = local_slots[i]
            for src in range(world):
                first = recv_off[src] + off_RS[src, s]
                recv.extend(range(first, first + rows_RS[src, s]))
    recv_index_N = np.array(recv, dtype=np.int64)     # every received row, once
    if recv_index_N.size == 0:
        raise ValueError(f"rank {rank} hosts only slots with no reserved row (capacity 0): "
                         f"give it a slot with capacity >= 1 or move its slots elsewhere.")
    back_index_M = np.empty(recv_index_N.size, dtype=np.int64)
    back_index_M[recv_index_N] = np.arange(recv_index_N.size)
    i32 = lambda a: np.ascontiguousarray(a, dtype=np.int32)  # noqa: E731
    return RankDispatch(send_rows, send_counts.copy(), recv_counts.copy(), local_slots, groups,
                        i32(rows_E), i32(ends_EJ), i32(shift_EJ), i32(recv_index_N),
                        i32(back_index_M))


@dataclass(frozen=True)
class GroupedDispatch:
    """Tables of one rank for ``"grouped"`` dispatch (index tables int32, ready for a Tensor).

    local_slots: int64 [S_l], global ids of the slots on this rank, ascending.
    buffer_D: int64 [W], row buffer B_d of every device (``plan.device_rows(W)``).
    slot_EJ: int32 [E, J], the replicas of every expert in ascending slot id, padded with the
        last one (J = the most replicas of an expert).
    cumw_EJ: int32 [E, J], this rank's cumulative split weights over them, in units of
        1 / SPLIT_UNITS, padded with SPLIT_UNITS (a padded replica's range is empty).
    replica_onehot_XS: int32 [E*J, S], 1 where entry (e, j) of slot_EJ is slot s (padded
        entries: zero rows), to sum per-replica counts into per-slot counts.
    device_onehot_SD: int32 [S, W], 1 where slot s is on device d.
    slot_device_S: int32 [S], device of every slot.
    earlier_on_device_SS: int32 [S, S], 1 where slot s' (row) precedes slot s (column) on the
        same device: the slot-minor order of a device's rows.
    buffer_S: int32 [S], B_d of every slot's device.
    block_start_S: int32 [S], first row of the block of every slot's device in the send
        buffer (blocks of B_d rows in device order).
    """

    local_slots: np.ndarray
    buffer_D: np.ndarray
    slot_EJ: np.ndarray
    cumw_EJ: np.ndarray
    replica_onehot_XS: np.ndarray
    device_onehot_SD: np.ndarray
    slot_device_S: np.ndarray
    earlier_on_device_SS: np.ndarray
    buffer_S: np.ndarray
    block_start_S: np.ndarray

    @property
    def replicas_per_expert(self) -> int:
        """J, the most replicas of one expert."""
        return int(self.slot_EJ.shape[1])


def grouped_dispatch(plan: ExpertPlan, num_experts: int, rank: int, world: int,
                     devices_per_node: Optional[int] = None) -> GroupedDispatch:
    """The tables of ``rank`` in a group of ``world`` ranks (rank = device) for a
    ``"grouped"`` plan (see the module docstring).

    Raises ``ValueError`` when the rank hosts no slot or a device's row buffer is 0.
    """
    if not 0 <= rank < world:
        raise ValueError(f"'rank' must be in [0, {world}), but got {rank}.")
    local_slots = np.flatnonzero(plan.slot_device == rank)
    if local_slots.size == 0:
        raise ValueError(f"rank {rank} hosts no slot of the expert plan; every rank of the "
                         f"expert-parallel group needs at least one slot.")
    buffer_D = plan.device_rows(world)
    if (buffer_D < 1).any():
        d = int(np.flatnonzero(buffer_D < 1)[0])
        raise ValueError(f"a 'grouped' ExpertPlan needs a row buffer >= 1 on every device, but "
                         f"device_rows() is {buffer_D.tolist()} (device {d} has 0): give device "
                         f"{d} a slot with capacity >= 1 or a 'device_buffer' >= 1.")
    weights_RS = grouped_split_weights(plan, num_experts, np.arange(world), devices_per_node)
    num_slots = plan.num_slots
    replicas = [plan.replicas_of(e) for e in range(num_experts)]
    num_j = max(r.size for r in replicas)
    slot_EJ = np.zeros((num_experts, num_j), dtype=np.int64)
    cumw_EJ = np.full((num_experts, num_j), SPLIT_UNITS, dtype=np.int64)
    replica_onehot_XS = np.zeros((num_experts * num_j, num_slots), dtype=np.int64)
    for e, slots in enumerate(replicas):
        slot_EJ[e] = slots[np.minimum(np.arange(num_j), slots.size - 1)]
        cumw_EJ[e, :slots.size] = np.cumsum(weights_RS[rank, slots])
        replica_onehot_XS[e * num_j + np.arange(slots.size), slots] = 1
    assert (cumw_EJ[:, -1] == SPLIT_UNITS).all(), cumw_EJ
    device_onehot_SD = np.zeros((num_slots, world), dtype=np.int64)
    device_onehot_SD[np.arange(num_slots), plan.slot_device] = 1
    same = plan.slot_device[:, None] == plan.slot_device[None, :]
    earlier = np.arange(num_slots)[:, None] < np.arange(num_slots)[None, :]
    block_start_D = np.cumsum(buffer_D) - buffer_D
    i32 = lambda a: np.ascontiguousarray(a, dtype=np.int32)  # noqa: E731
    return GroupedDispatch(local_slots, buffer_D, i32(slot_EJ), i32(cumw_EJ),
                           i32(replica_onehot_XS), i32(device_onehot_SD), i32(plan.slot_device),
                           i32(same & earlier), i32(buffer_D[plan.slot_device]),
                           i32(block_start_D[plan.slot_device]))


@dataclass(frozen=True)
class ReplicaSync:
    """How rank r sums the gradients of replicas (all int32 index tables).

    needed: False when no expert has two slots that r must agree with (then the gradient
        passes unchanged).
    unique_of_slot: int32 [S_l], index of each local slot's logical expert among the local
        experts (U of them, ascending expert id).
    num_unique: U.
    cross_experts: int64 [X], experts with replicas on more than one rank (same on every rank).
    cross_of_unique: int32 [U], index of each local expert in cross_experts, X if not cross.
    pick_U: int32 [U], row of concat(allreduced [X], local sums [U]) each local expert takes.
    """

    needed: bool
    unique_of_slot: np.ndarray
    num_unique: int
    cross_experts: np.ndarray
    cross_of_unique: np.ndarray
    pick_U: np.ndarray


def replica_sync(plan: ExpertPlan, rank: int) -> ReplicaSync:
    """Gradient-sync tables of ``rank`` (see the module docstring)."""
    local_experts = plan.slot_expert[plan.slot_device == rank]
    unique, unique_of_slot = np.unique(local_experts, return_inverse=True)
    devices_per_expert = {int(e): np.unique(plan.slot_device[plan.slot_expert == e]).size
                          for e in np.unique(plan.slot_expert)}
    cross = np.array(sorted(e for e, n in devices_per_expert.items() if n > 1), dtype=np.int64)
    cross_of_unique = np.array([np.searchsorted(cross, e) if e in cross else cross.size
                                for e in unique], dtype=np.int64)
    pick_U = np.where(cross_of_unique < cross.size, cross_of_unique,
                      cross.size + np.arange(unique.size))
    needed = bool(cross.size > 0 or unique.size < local_experts.size)
    return ReplicaSync(needed, unique_of_slot.astype(np.int32), int(unique.size), cross,
                       cross_of_unique.astype(np.int32), pick_U.astype(np.int32))
