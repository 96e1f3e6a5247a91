"""Dispatch tables and slot weights of the expert-parallel MoE layer (numpy, computed before
compilation or a re-plan).

Notation: W ranks in the expert-parallel group (rank = device id of the plan), E logical
experts, S physical slots of an :class:`~ms_efficient.moe.plan.ExpertPlan`, J the most
replicas of one expert a rank sends to, C_send the largest static block any rank sends any
rank; grouped: C[r, d] = ``plan.send_rows(W)[r, d]`` the planned block rank r sends device d,
B_d = ``plan.device_rows(W)[d]`` device d's row buffer, S_b the slot budget per device.

One pass builds a layer: :func:`layer_tables` takes the plan, the rank, the world and the
routing options once and returns :class:`LayerTables`, every table below computed once
(the plan's per-source rows, buffers, blocks and split weights each read from the plan one
time and passed on as arrays); the retired one-level layer's constructor and re-plan called
it, and the one-level cost model still reads its tables; the balanced layer uses the replica
tables (:func:`replica_sync`, :func:`sync_rows`) and :func:`init_expert_weights`.

Static dispatch, in three tables:

1. ``rows_RS`` (:func:`~ms_efficient.moe.split.source_rows`), int64 [W, S]: the rows of slot s
   reserved for the tokens of source rank r, so ``rows_RS[:, s].sum() == slot_capacity[s]``.
   Each expert's capacity
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

Grouped dispatch (:func:`grouped_dispatch`, plans with ``dispatch`` "grouped" or "counts"): the
tables of the package's rule :func:`~ms_efficient.moe.split.grouped_assignments`, which the
layer evaluates in the graph on the step's counts. Rank r splits its c tokens of expert e over
e's replicas (ascending slot) at the cumulative integer weights of
:func:`~ms_efficient.moe.split.grouped_split_weights`, keeps its rows of device d's slots
(ascending slot) up to its planned block C[r, d] = ``plan.send_rows(W)[r, d]``, and device
d keeps, out of what all ranks send it (rank-major, slot-minor), the first
B_d = ``plan.device_rows()[d]`` rows; which of its rows a device keeps, every rank
derives from the per-budget-slot counts each rank sends after its block cut, all-gathered
([W, V] int32, :class:`~ms_efficient.moe.alltoall.CountExchange`). The send buffer has one
block of C[r, d] rows per device d (the rows
:func:`~ms_efficient.moe.exchange.exchange_rows` gives the plan),
holding this rank's kept rows of d's slots in ascending slot order, full or not (unfilled
rows are zeros); the receive buffer one block of C[src, r] rows per source.
The tables are laid out over a slot budget of S_b slots per device (V = W * S_b budget slots,
device-major), so their shapes depend on (W, S_b, C, B_d) only: a new plan with the same
blocks and buffers and at most S_b slots per device changes their values, not their shapes
(the layer keeps them in Parameters).

Replica gradient sync (:func:`replica_sync`): gradients of a logical expert's replicas are
summed: first over the replicas on this rank, then, for experts with replicas on more than
one rank ("cross" experts, the same list on every rank), by an AllReduce of a [X_b, ...] table
(X_b >= the number of cross experts, rows past them stay zero) to which each rank adds its
local sums.

Slot weights: :func:`init_expert_weights` seeds every expert's initial weights by its id (so
replicas start identical without communication), :func:`pad_rows` fills the empty budget
slots with zeros, :func:`expert_sources` names the one rank and row each expert is read from
when the layer rebuilds the logical [E, ...] table, and :func:`check_replan` says whether a
new plan fits a compiled grouped layer (same send blocks, buffers, budget and experts).
No MindSpore import here.
"""
from __future__ import annotations

import dataclasses

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import numpy as np

from ms_efficient.moe.exchange import slot_rows_by_device
from ms_efficient.moe.plan import ExpertPlan
from ms_efficient.moe.split import SPLIT_UNITS, grouped_split_weights, source_rows

__all__ = ["LayerTables", "layer_tables", "RankDispatch", "rank_dispatch", "GroupedDispatch",
           "grouped_dispatch", "ReplicaSync", "replica_sync", "capacity_groups", "cross_budget",
           "sync_rows", "expert_sources", "check_replan", "pad_rows",
           "init_expert_weights"]


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


def _local_slots(plan: ExpertPlan, rank: int, world: int) -> np.ndarray:
    """Slot ids on ``rank`` (int64, ascending); ValueError for a rank outside the group or one
    that hosts no slot."""
    if not 0 <= rank < world:
        raise ValueError(f"'rank' must be in [0, {world}), but got {rank}.")
    local_slots = np.flatnonzero(plan.slot_device == rank)
    if local_slots.size == 0:
        raise ValueError(f"rank {rank} hosts no slot of the expert plan; every rank of the "
                         f"expert-parallel group needs at least one slot.")
    return local_slots


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
    local_slots = _local_slots(plan, rank, world)
    # Step 1: blocks: rank r sends to_dev_RD[r, d] rows to d; block offsets in both buffers.
    to_dev_RD = slot_rows_by_device(rows_RS, plan.slot_device, world)   # exchange_rows' sum
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
    """Tables of one rank for ``"grouped"`` dispatch over a budget of S_b slots per device
    (index tables int32, ready for a Tensor). Budget slot v = d * S_b + i is the i-th slot of
    device d (V = W * S_b); the plan's slots on d fill d's first budget slots in ascending slot
    id, the others are empty (expert E, cuts 0: no token, no row).

    Fixed by (W, S_b, blocks C, buffers B), the same for every plan with these blocks and
    buffers:
    buffer_D: int64 [W], row buffer B_d of every device (``plan.device_rows(W)``).
    block_WD: int64 [W, W], rows rank r sends device d, C[r, d]
        (:func:`~ms_efficient.moe.exchange.exchange_rows`).
    pair_limit_V: int32 [V], C[rank, d] of every budget slot's device d: this rank keeps at
        most that many rows of d's slots.
    device_onehot_VD: int32 [V, W], 1 where budget slot v is on device d.
    slot_device_V: int32 [V], device of every budget slot (v // S_b).
    earlier_on_device_VV: int32 [V, V], 1 where v' (row) precedes v (column) on the same
        device: the slot-minor order of a device's rows.
    buffer_V: int32 [V], B_d of every budget slot's device.
    block_start_V: int32 [V], first row of the block of every budget slot's device in this
        rank's send buffer (blocks of C[rank, d] rows in device order).

    Set by the plan (data):
    local_slots: int64 [S_l], plan slot ids on this rank, ascending (S_l <= S_b); they fill
        this rank's budget slots rank * S_b + i, i < S_l.
    slot_of_V: int64 [V], plan slot held by every budget slot, -1 when empty.
    expert_V: int32 [V], logical expert of every budget slot, E when empty.
    cut_lo_V, cut_hi_V: int32 [V], this rank's cumulative split weights (units of
        1 / SPLIT_UNITS) of the replicas of v's expert before v and through v, in ascending
        plan slot id: of c local assignments of that expert, v takes arrivals
        [c * cut_lo // SPLIT_UNITS, c * cut_hi // SPLIT_UNITS); 0 and 0 when empty.
    """

    buffer_D: np.ndarray
    block_WD: np.ndarray
    pair_limit_V: np.ndarray
    device_onehot_VD: np.ndarray
    slot_device_V: np.ndarray
    earlier_on_device_VV: np.ndarray
    buffer_V: np.ndarray
    block_start_V: np.ndarray
    local_slots: np.ndarray
    slot_of_V: np.ndarray
    expert_V: np.ndarray
    cut_lo_V: np.ndarray
    cut_hi_V: np.ndarray

    @property
    def budget(self) -> int:
        """S_b, budget slots per device."""
        return int(self.slot_of_V.size // self.buffer_D.size)


def grouped_dispatch(plan: ExpertPlan, num_experts: int, rank: int, local_slots: np.ndarray,
                     buffer_D: np.ndarray, block_WD: np.ndarray, weights_S: np.ndarray,
                     budget: int) -> GroupedDispatch:
    """The tables of ``rank`` for a ``"grouped"`` or ``"counts"`` plan (see the module
    docstring) from what :func:`layer_tables` computed and checked once: its ``local_slots``
    (int64 [S_l]), the row buffers ``buffer_D`` (int64 [W], ``plan.device_rows(W)``), the send
    blocks ``block_WD`` (int64 [W, W], ``plan.send_rows(W, W)``), its split weights
    ``weights_S`` (int64 [S], units of 1 / SPLIT_UNITS, its row of
    :func:`~ms_efficient.moe.split.grouped_split_weights`) and the slot ``budget`` S_b."""
    world = int(buffer_D.size)
    # Step 1: the fixed layout: device-major budget slots, send blocks of C[rank, d] rows.
    num_v = world * budget
    device_V = np.arange(num_v) // budget
    device_onehot_VD = np.zeros((num_v, world), dtype=np.int64)
    device_onehot_VD[np.arange(num_v), device_V] = 1
    earlier_VV = ((device_V[:, None] == device_V[None, :])
                  & (np.arange(num_v)[:, None] < np.arange(num_v)[None, :]))
    block_start_D = np.cumsum(block_WD[rank]) - block_WD[rank]

    # Step 2: the plan's slots in the budget slots of their devices, in ascending slot id.
    slot_of_V = np.full(num_v, -1, dtype=np.int64)
    for d in range(world):
        on_d = np.flatnonzero(plan.slot_device == d)
        slot_of_V[d * budget:d * budget + on_d.size] = on_d
    used = slot_of_V >= 0
    expert_V = np.full(num_v, num_experts, dtype=np.int64)
    expert_V[used] = plan.slot_expert[slot_of_V[used]]

    # Step 3: this rank's cumulative split weights over every expert's replicas (ascending
    # slot id within an expert: a stable sort by expert, cumulative sums restarting per expert)
    order = np.argsort(plan.slot_expert, kind="stable")
    run_W = np.cumsum(weights_S[order])
    first = np.r_[True, plan.slot_expert[order][1:] != plan.slot_expert[order][:-1]]
    run_W -= np.maximum.accumulate(np.where(first, run_W - weights_S[order], 0))
    cut_hi_S = np.empty(plan.num_slots, dtype=np.int64)
    cut_hi_S[order] = run_W
    assert (run_W[np.r_[first[1:], True]] == SPLIT_UNITS).all(), weights_S   # every expert
    cut_lo_S = cut_hi_S - weights_S
    cut_lo_V, cut_hi_V = np.zeros(num_v, np.int64), np.zeros(num_v, np.int64)
    cut_lo_V[used], cut_hi_V[used] = cut_lo_S[slot_of_V[used]], cut_hi_S[slot_of_V[used]]
    i32 = lambda a: np.ascontiguousarray(a, dtype=np.int32)  # noqa: E731
    return GroupedDispatch(buffer_D, block_WD, i32(block_WD[rank][device_V]),
                           i32(device_onehot_VD), i32(device_V), i32(earlier_VV),
                           i32(buffer_D[device_V]), i32(block_start_D[device_V]), local_slots,
                           slot_of_V, i32(expert_V), i32(cut_lo_V), i32(cut_hi_V))


def cross_budget(num_experts: int, world: int, budget: int) -> int:
    """The most experts any plan of ``budget`` slots per device on ``world`` devices can
    replicate on two devices or more: each takes >= 2 of the W * S_b slots and every other
    expert >= 1, so X <= W * S_b - E (and X <= E); 0 on one device."""
    if world < 2:
        return 0
    return int(max(0, min(num_experts, world * budget - num_experts)))


def sync_rows(plan: ExpertPlan, num_experts: int, world: int,
              budget: Optional[int] = None) -> int:
    """Rows X of the gradient table :class:`~ms_efficient.moe.balanced_ep.ReplicaGradSum`
    all-reduces over the whole group in every backward step (each row one expert's
    parameters; a rank adds zeros for the experts it does not hold), whatever the step routed:

    - a layer built for any plan of ``budget`` slots per device (grouped and counts layers,
      and the balanced layer's home table: its shapes must hold every later plan):
      :func:`cross_budget` (E, W, budget);
    - a static layer (``budget`` None): the experts ``plan`` holds on more than one device.

    The cost model charges this table (``efficientmoe.cost``), so what it charges is what the
    layers send."""
    if budget is not None:
        return cross_budget(num_experts, world, budget)
    devices = [np.unique(plan.slot_device[plan.slot_expert == e]).size
               for e in np.unique(plan.slot_expert)]
    return int(sum(n > 1 for n in devices))


@dataclass(frozen=True)
class ReplicaSync:
    """How rank r sums the gradients of replicas (all int32 index tables over its S_b weight
    rows: rows i < S_l are its plan slots in ascending slot id, the others empty).

    needed: False when no expert has two slots that r must agree with (then the gradient
        passes unchanged).
    cross_experts: int64 [X], experts with replicas on more than one rank (same on every rank).
    num_cross: X_b >= X, rows of the AllReduced table (rows X.. stay zero).
    first_L: int32 [S_b], first local row holding the same expert (itself when empty).
    cross_L: int32 [S_b], row of the table a local row adds its expert's local sum to: the
        cross index of its expert for the first row of a cross expert, X_b (none) otherwise.
    pick_L: int32 [S_b], row of concat(AllReduced table [X_b], local sums [S_b]) every local
        row takes: the cross index for cross experts, X_b + first_L otherwise.
    """

    needed: bool
    cross_experts: np.ndarray
    num_cross: int
    first_L: np.ndarray
    cross_L: np.ndarray
    pick_L: np.ndarray


def replica_sync(plan: ExpertPlan, rank: int, budget: Optional[int] = None,
                 num_cross: Optional[int] = None) -> ReplicaSync:
    """Gradient-sync tables of ``rank`` over ``budget`` weight rows (default: its slot count)
    and a cross table of ``num_cross`` rows (default: the plan's cross experts); see the
    module docstring. Raises ``ValueError`` when either is too small for the plan."""
    local_experts = plan.slot_expert[plan.slot_device == rank]
    budget = local_experts.size if budget is None else int(budget)
    devices_per_expert = {int(e): np.unique(plan.slot_device[plan.slot_expert == e]).size
                          for e in np.unique(plan.slot_expert)}
    cross = np.array(sorted(e for e, n in devices_per_expert.items() if n > 1), dtype=np.int64)
    num_cross = cross.size if num_cross is None else int(num_cross)
    if budget < local_experts.size or num_cross < cross.size:
        raise ValueError(f"rank {rank} holds {local_experts.size} slots and the plan replicates "
                         f"{cross.size} experts across ranks, but the sync tables have "
                         f"{budget} rows and a cross table of {num_cross}.")
    first_L = np.arange(budget)
    cross_L = np.full(budget, num_cross)
    pick_L = num_cross + first_L
    for i, e in enumerate(local_experts):
        first_L[i] = int(np.flatnonzero(local_experts == e)[0])
        pick_L[i] = num_cross + first_L[i]
        if e in cross:
            pick_L[i] = int(np.searchsorted(cross, e))
            if first_L[i] == i:
                cross_L[i] = pick_L[i]
    needed = bool(cross.size > 0 or np.unique(local_experts).size < local_experts.size)
    i32 = lambda a: np.ascontiguousarray(a, dtype=np.int32)  # noqa: E731
    return ReplicaSync(needed, cross, num_cross, i32(first_L), i32(cross_L), i32(pick_L))


def expert_sources(plan: ExpertPlan, num_experts: int, rank: int) -> np.ndarray:
    """int64 [E]: the local weight row (index into this rank's plan slots, ascending slot id)
    this rank contributes for every expert to a logical [E, ...] weight table, -1 for the
    experts another rank contributes. Each expert comes from exactly one rank: the lowest that
    holds it, from its first slot there (replicas are identical)."""
    local = np.flatnonzero(plan.slot_device == rank)
    source_E = np.full(num_experts, -1, dtype=np.int64)
    for e in range(num_experts):
        holders = plan.slot_device[plan.slot_expert == e]
        if holders.size and holders.min() == rank:
            source_E[e] = int(np.flatnonzero(plan.slot_expert[local] == e)[0])
    return source_E


def check_replan(plan: ExpertPlan, num_experts: int, buffer_D: np.ndarray,
                 budget: int, block_WD: Optional[np.ndarray] = None,
                 layer_dispatch: str = "grouped") -> None:
    """Raise ``ValueError`` unless ``plan`` fits the shapes a grouped layer compiled: a
    plan of the layer's dispatch (``layer_dispatch``, "grouped" or "counts") with the row
    buffers ``buffer_D`` (int [W]) and send blocks ``block_WD`` (int [W, W], when given), at
    most ``budget`` slots per device and every one of the ``num_experts`` experts (ids below
    it) placed."""
    world = int(buffer_D.size)
    if plan.dispatch != layer_dispatch:
        raise ValueError(f"set_plan switches a layer to plans of its own dispatch, but the "
                         f"layer's dispatch is {layer_dispatch!r} and the plan's "
                         f"{plan.dispatch!r}.")
    new = plan.device_rows(world)
    if not np.array_equal(new, buffer_D):
        raise ValueError(f"set_plan keeps the compiled shapes, so the plan's device buffers "
                         f"'device_rows' must equal the layer's {buffer_D.tolist()}, but got "
                         f"{new.tolist()}; new buffers need a new layer (a recompile).")
    if block_WD is not None:
        new = plan.send_rows(world, world)
        if not np.array_equal(new, block_WD):
            raise ValueError(f"set_plan keeps the compiled shapes, so the plan's send blocks "
                             f"'send_rows' must equal the layer's {block_WD.tolist()}, but got "
                             f"{new.tolist()}; new blocks need a new layer (a recompile).")
    per_device = np.bincount(plan.slot_device, minlength=world)
    if per_device.max() > budget:
        raise ValueError(f"set_plan keeps the compiled shapes, so every device may hold at most "
                         f"'slots_per_device' = {budget} slots, but the plan holds "
                         f"{per_device.tolist()}; a larger budget needs a new layer (a "
                         f"recompile).")
    try:
        plan.validate(num_experts, world)
    except ValueError as err:
        raise ValueError(f"set_plan: {err} A different expert set needs a new layer (a "
                         f"recompile).") from None


@dataclass(frozen=True)
class LayerTables:
    """Every table one rank of the retired one-level expert-parallel layer
    needs, from one pass over its plan (:func:`layer_tables`); numpy.

    plan: the plan the graph runs: the given one for "grouped" / "counts"; for the others
        its slots with ``dispatch="static"`` (and ``rank_share`` = the layer's load forecast
        when one is given).
    budget: S_b, weight rows of this rank: the slot budget per device (grouped) or its slot
        count S_l (static).
    local_slots: int64 [S_l], global ids of this rank's slots, ascending.
    local_experts: int64 [S_l], logical expert of each of them.
    source_E: int64 [E], :func:`expert_sources`: the local weight row this rank contributes
        to the logical [E, ...] table for every expert, -1 where another rank does.
    sync: :class:`ReplicaSync`, the replica gradient-sum tables over the S_b weight rows
        (grouped: with a cross table of :func:`cross_budget` rows, so any plan of the
        budget fits).
    sync_needed: whether the layer sums replica gradients at all (static: this plan has
        replicas; grouped: W * S_b > E, some plan of the budget may have them).
    static: :class:`RankDispatch` of a static plan, else None.
    grouped: :class:`GroupedDispatch` of a grouped or counts plan, else None.
    """

    plan: ExpertPlan
    budget: int
    local_slots: np.ndarray
    local_experts: np.ndarray
    source_E: np.ndarray
    sync: ReplicaSync
    sync_needed: bool
    static: Optional[RankDispatch] = None
    grouped: Optional[GroupedDispatch] = None


def layer_tables(plan: ExpertPlan, num_experts: int, rank: int, world: int,
                 devices_per_node: Optional[int] = None, budget: Optional[int] = None,
                 rank_load_RE: Optional[np.ndarray] = None,
                 compiled: Optional[LayerTables] = None) -> LayerTables:
    """All tables of ``rank`` in an expert-parallel group of ``world`` ranks (rank = device),
    each computed once from ``plan``.

    budget: S_b, grouped plans only: slots every device compiles weights for (default: the
        most slots a device of ``plan`` holds).
    rank_load_RE: float [W, E] load forecast, static plans only: each expert's capacity is
        split among source ranks in proportion (:func:`~ms_efficient.moe.split.source_rows`).
    compiled: the tables of a compiled grouped layer, for a re-plan: ``plan`` must fit its
        shapes (:func:`check_replan`), and its buffers, send blocks and budget are reused.

    Static: the per-source rows (:func:`~ms_efficient.moe.split.source_rows`), then
    :func:`rank_dispatch` and :func:`replica_sync`. Grouped: the plan checked and validated,
    its buffers ``plan.device_rows(W)`` and blocks ``plan.send_rows(W, W)``, this rank's split
    weights (:func:`~ms_efficient.moe.split.grouped_split_weights`), then
    :func:`grouped_dispatch` and :func:`replica_sync`. Both: :func:`expert_sources`.
    Raises ``ValueError`` for an invalid plan or arguments (module docstring, the functions
    named above).
    """
    if compiled is None:
        plan.validate(num_experts, world)
    elif compiled.grouped is None:
        raise ValueError(f"a re-plan keeps the tables of a 'grouped' or 'counts' layer, but "
                         f"the compiled layer's dispatch is {compiled.plan.dispatch!r}.")
    else:                               # a re-plan: the compiled shapes
        check_replan(plan, num_experts, compiled.grouped.buffer_D, compiled.budget,
                     compiled.grouped.block_WD, compiled.plan.dispatch)
    if not plan.grouped:
        if budget is not None:
            raise ValueError(f"'slots_per_device' sets the slot budget of 'grouped' plans, "
                             f"but the plan's dispatch is {plan.dispatch!r} and "
                             f"slots_per_device={budget}.")
        # what the graph runs: static shapes (an "alltoallv" plan's slots with static rows)
        plan = dataclasses.replace(plan, dispatch="static")
        if rank_load_RE is not None:
            plan = dataclasses.replace(plan, rank_share=rank_load_RE)
        rows_RS = source_rows(plan, num_experts, np.arange(world), devices_per_node,
                              plan.rank_share)
        static = rank_dispatch(plan, rows_RS, num_experts, rank, devices_per_node)
        sync = replica_sync(plan, rank, num_cross=sync_rows(plan, num_experts, world))
        return LayerTables(plan, static.local_slots.size, static.local_slots,
                           plan.slot_expert[static.local_slots],
                           expert_sources(plan, num_experts, rank), sync, sync.needed,
                           static=static)
    if rank_load_RE is not None:
        raise ValueError("'rank_load_RE' splits the capacities of static plans; a "
                         "'grouped' plan splits tokens by its own 'rank_share', so "
                         "set that instead, but got rank_load_RE as well.")
    local_slots = _local_slots(plan, rank, world)
    if compiled is not None:            # checked above: the same buffers, blocks and budget
        buffer_D, block_WD = compiled.grouped.buffer_D, compiled.grouped.block_WD
        budget = compiled.budget
    else:
        buffer_D = plan.device_rows(world)
        if (buffer_D < 1).any():
            d = int(np.flatnonzero(buffer_D < 1)[0])
            raise ValueError(f"a 'grouped' ExpertPlan needs a row buffer >= 1 on every "
                             f"device, but device_rows() is {buffer_D.tolist()} (device {d} "
                             f"has 0): give device {d} a slot with capacity >= 1 or a "
                             f"'device_buffer' >= 1.")
        per_device = np.bincount(plan.slot_device, minlength=world)
        most = int(per_device.max())
        budget = most if budget is None else int(budget)
        if budget < most:
            raise ValueError(f"'slots_per_device' must be >= the most slots a device holds in "
                             f"the plan ({most}, per device {per_device.tolist()}), but got "
                             f"{budget}.")
        # the rows a "grouped" exchange carries; a "counts" plan's blocks are upper bounds
        # (only the kept rows travel): exchange_rows of the plan's grouped twin
        block_WD = np.ascontiguousarray(plan.send_rows(world, world), dtype=np.int64)
    weights_S = grouped_split_weights(plan, num_experts, np.arange(world),
                                      devices_per_node)[rank]
    grouped = grouped_dispatch(plan, num_experts, rank, local_slots, buffer_D, block_WD,
                               weights_S, budget)
    sync = replica_sync(plan, rank, budget, sync_rows(plan, num_experts, world, budget))
    return LayerTables(plan, budget, local_slots, plan.slot_expert[local_slots],
                       expert_sources(plan, num_experts, rank), sync,
                       world * budget > num_experts, grouped=grouped)


def pad_rows(rows_X: np.ndarray, budget: int) -> np.ndarray:
    """float32 [budget, ...]: the slot weight rows ``rows_X`` [X, ...] (X <= budget), then
    zero rows for the empty budget slots."""
    rows_X = np.asarray(rows_X, np.float32)
    pad = np.zeros((budget - rows_X.shape[0],) + rows_X.shape[1:], np.float32)
    return np.concatenate((rows_X, pad), axis=0)


def init_expert_weights(num_experts: int, hidden_size: int, ffn_hidden_size: int,
                        init_std: float = 0.02, seed: int = 0,
                        experts: Optional[Sequence[int]] = None, expert_kind: str = "mlp"):
    """Initial weights, float32 numpy: (router_EH, w1_XHF1, b1_X1F1, w2_XFH, b2_X1H) for the
    logical experts ``experts`` (X of them, in that order, repeats allowed; default all E);
    F1 = F, or 2F for gated experts (``expert_kind="glu"``: the fused [w_gate | w_up]).

    Expert e's weights come from the generator seeded with (seed, 0, e), the router's from
    (seed, 1), so every rank builds the same values for the experts it holds, and replicas of
    one expert on different ranks start identical without communication; a rank generates
    only the experts it holds.
    """
    h, f = hidden_size, ffn_hidden_size
    f1 = 2 * f if expert_kind == "glu" else f
    experts = list(range(num_experts)) if experts is None else [int(e) for e in experts]
    w1 = np.empty((len(experts), h, f1), np.float32)
    w2 = np.empty((len(experts), f, h), np.float32)
    for i, e in enumerate(experts):
        rng = np.random.default_rng((seed, 0, e))
        w1[i] = rng.normal(0.0, init_std, (h, f1))
        w2[i] = rng.normal(0.0, init_std, (f, h))
    router = np.random.default_rng((seed, 1)).normal(0.0, init_std, (num_experts, h))
    n = len(experts)
    return (router.astype(np.float32), w1, np.zeros((n, 1, f1), np.float32), w2,
            np.zeros((n, 1, h), np.float32))
