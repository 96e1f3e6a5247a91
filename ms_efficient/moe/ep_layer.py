"""Expert-parallel MoE layer: experts as physical slots (replicas) on the ranks of a group.

Shapes (names carry their dimensions): T local tokens, H hidden, F expert FFN width, E logical
experts, K top-k, A = K*T assignments, W ranks, S slots, S_l slots on this rank, M rows this
rank sends, N rows its local slots compute. Static: M = the rows it reserves on all slots,
N = the rows received. Grouped: C[r, d] = ``plan.send_rows(W)[r, d]`` the planned block rank r
sends device d, M = sum_d C[r, d], I = sum_src C[src, r] rows received, N = B_r =
``plan.device_rows(W)[r]`` the row buffer, S_b the slot budget per device and V = W * S_b
budget slots.

An :class:`~ms_efficient.moe.plan.ExpertPlan` maps every slot to a logical expert, a device
(= rank in the expert-parallel group) and a static capacity. Each rank holds the weights of its
own slots only, and runs, per step on its local tokens:

    x_TH -> router -> top-k (expert_ids_TK, weights_TK)
         -> arrival number p of every assignment within (this rank, expert), k-major
         -> send row from the static tables of :mod:`ms_efficient.moe.ep_routing`: the
            replicas this rank feeds for e in spill order (own device, same node, others),
            each with the rows reserved for this rank; p beyond them is dropped
         -> send buffer [M, H], block d = the rows reserved on rank d's slots -> AllToAllV
         -> received rows [N, H], permuted slot-major -> batched-matmul experts (grouped by
            capacity) -> back to receive order [N, H]                        -> AllToAllV
         -> every assignment reads its send row back, weighted; sum over K  -> y_TH

The exchanges are AlltoAllV with per-peer counts fixed before compilation
(:class:`~ms_efficient.moe.alltoall.AllToAllV`): every block holds exactly the rows reserved
for it, no padding to the largest block. Capacity split: a slot's capacity is shared among
the source ranks before compilation (:func:`~ms_efficient.moe.split.source_rows`; equal
shares of each expert's total capacity by default), because every rank must know, without
communication, how many rows it owns in every slot. Static shapes, so the graph compiles once;
a rank that routes more than its share of an expert drops the excess even if another rank
left room (the grouped path below would not: it exchanges the step's counts first). This is
the path of every plan whose ``dispatch`` is ``"static"`` or ``"alltoallv"``.

Grouped dispatch (``plan.dispatch`` ``"grouped"`` or ``"counts"``, padding-free experts) runs
the package's rule :func:`~ms_efficient.moe.split.grouped_assignments` in the graph, on the
step's counts:

    arrival p of (this rank, e) -> replica v of e by the fixed integer split (c_e local
            assignments cut at c_e * cut_v // SPLIT_UNITS, cut_v the cumulative split
            weight through v; int32, the same cuts as numpy), index q within (rank, slot)
         -> per-slot counts [V], each device's slots cut at this rank's block C[r, d]
            (slots ascending) -> AllGather -> [W, V] on every rank (alltoall.CountExchange)
         -> kept_WV: device d keeps the first B_d rows in ascending source rank, slot-minor
            (the others are dropped at the sender, which knows them from the counts; a
            planned plan has B_d = sum_r C[r, d], so only a block's overflow drops)
         -> send buffer [M = sum_d C[r, d], H], block d (C[r, d] rows, full or not) = this
            rank's kept rows of d's slots, slot-major -> "grouped": AllToAllV of the whole
            blocks; "counts": :class:`~ms_efficient.moe.counted_alltoall.CountedAllToAllV` of
            the kept rows only (AlltoAllVC on Ascend, the blocks on CPU); the rows of
            :func:`~ms_efficient.moe.exchange.exchange_rows` either way, what the cost model
            charges
         -> W blocks of C[src, r] rows -> compacted into [N = B_r, H] grouped by local slot,
            group sizes = kept rows (data) -> FFNs as two grouped matmuls
            (:class:`~ms_efficient.moe.grouped_matmul.GroupedMatmul`) -> AllToAllV back
         -> the same combine as above; dropped assignments read zeros.

All shapes stay static (C from ``plan.send_rows()``, B_d from ``plan.device_rows()``);
which rows are real is data. Slot capacities only set the split weights
(:func:`~ms_efficient.moe.split.grouped_split_weights`) and, for a plan without
``send_block`` / ``device_buffer``, the buffers. The plan itself is data too: the graph
reads its tables (expert of every budget slot, split cuts, replica-sync rows) from
non-trainable Parameters, and every device has weights for S_b slots (``slots_per_device``),
the unused ones empty groups (no rows, zero gradient). So :meth:`ExpertParallelMoE.set_plan`
switches to any plan with the same blocks C and buffers B_d, the same experts and at most S_b
slots per device without recompiling (the assumption of ``efficientmoe.schedule.recompiles``).

Gradient sync of replicas: replicas of a logical expert start identical (initialised from a
seed and the logical expert id) and get the same gradient, the sum over all replicas, so any
optimizer keeps them identical. Each weight passes through :class:`ReplicaGradSum`, an
identity whose backward sums the local replicas' gradients per expert and AllReduces, over
the group, a table of the experts that have replicas on more than one rank (X of them; a rank
adds zeros for the ones it does not hold). That is the "AllReduce the [E, ...] table" scheme
restricted to the replicated experts, so plans without cross-rank replicas communicate nothing.
A grouped layer sizes that table for any plan of its budget, X_b = min(E, W * S_b - E) rows
(:func:`~ms_efficient.moe.ep_routing.cross_budget`; 0 when S_b leaves no room for replicas).

Gradient scale: the backward of the All-to-All brings every source rank's contribution to the
slot, so the expert gradients are those of the SUM of the ranks' losses. Expert weights are not
data-parallel: do not pass them through a data-parallel gradient reducer (the router is
data-parallel; reduce it as usual). If the global loss is the mean over W ranks, scale the
expert gradients by 1/W like the rest.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from ms_efficient.core import backend
from ms_efficient.core.params import write_parameter
from ms_efficient.moe.alltoall import AllToAllV, CountExchange
from ms_efficient.moe.counted_alltoall import CountedAllToAllV, device_counts
from ms_efficient.moe.ep_migration import plan_migration
from ms_efficient.moe.ep_replan import move_rows, record, weight_states
from ms_efficient.moe.ep_routing import init_expert_weights, layer_tables, pad_rows
from ms_efficient.moe.grouped_matmul import GroupedMatmul, row_groups
from ms_efficient.moe.layer import (TopKArrival, group_tables, make_gelu, routing_counts_buffer,
                                    routing_statistics, sum_choices)
from ms_efficient.moe.plan import ExpertPlan
from ms_efficient.moe.split import SPLIT_UNITS

__all__ = ["ExpertParallelMoE", "ReplicaGradSum", "init_expert_weights"]

# Grouped splits compute count * weight in int32 with weight <= SPLIT_UNITS and count <= the
# local tokens T (an expert is chosen at most once per token): exact while T * 4096 < 2^31.
MAX_GROUPED_TOKENS = (2 ** 31 - 1) // SPLIT_UNITS


class ReplicaGradSum(nn.Cell):
    """``construct(w, first_L, cross_L, pick_L) -> w``: identity on a local weight table
    [S_b, ...]; its backward gives every local row the gradient of its logical expert summed
    over all replicas in the group. The int32 [S_b] tables of
    :func:`~ms_efficient.moe.ep_routing.replica_sync` are inputs (data, zero gradient).

    Backward, for dout [S_b, ...]:
      1. per local expert: the sum of its rows' gradients, at its first row (first_L);
      2. if ``num_cross`` (X_b) > 0: the cross experts' sums scattered into a [X_b, ...]
         table (cross_L; zeros elsewhere) and AllReduce-summed over the group;
      3. every row takes its expert's sum: row pick_L of concat(table, local sums).
    """

    def __init__(self, num_cross: int, group: Optional[str] = None):
        super().__init__()
        self.num_cross = int(num_cross)
        if self.num_cross:
            self.all_reduce = ops.AllReduce(op=ops.ReduceOp.SUM,
                                            group=group or backend.world_group())

    def construct(self, w, first_L, cross_L, pick_L):
        return w

    def bprop(self, w, first_L, cross_L, pick_L, out, dout):
        """Gradient of the tied replicas: the per-expert sum, given to every replica."""
        local_L = ops.unsorted_segment_sum(dout, first_L, dout.shape[0])
        if self.num_cross:
            table_X = ops.unsorted_segment_sum(local_L, cross_L, self.num_cross + 1)
            table_X = self.all_reduce(table_X[:self.num_cross])
            local_L = ops.concat((table_X, local_L), 0)
        return (ops.gather(local_L, pick_L, 0), ops.zeros_like(first_L),
                ops.zeros_like(cross_L), ops.zeros_like(pick_L))


class ExpertParallelMoE(nn.Cell):
    """Expert-parallel MoE FFN: ``construct(x_BSH) -> (y_BSH, aux_loss, counts_RE, dropped)``.

    Args:
        hidden_size: H.
        ffn_hidden_size: F, width of every expert's FFN.
        num_experts: E logical experts.
        top_k: K experts per token; gate weights renormalised to sum to 1.
        plan: the slots (logical expert, device = rank in ``group``, capacity); validated.
            ``plan.dispatch == "grouped"`` (or ``"counts"``: the same, exchanging only the
            kept rows, :mod:`~ms_efficient.moe.counted_alltoall`): grouped dispatch (module
            docstring); every device needs a buffer ``plan.device_rows()[d] >= 1``; others:
            static dispatch.
        group: expert-parallel communication group; default the world group. W = its size
            (1 before ``init()``: then no collective is created).
        rank: this process's rank in ``group``; default the actual one (checked when given).
        devices_per_node: devices per node, for the same-node tier of the replica choice.
        rank_load_RE: optional float [W, E] per-rank load forecast; each expert's capacity is
            split among source ranks in proportion (default equal). Must be the same on
            every rank. Static plans only (a grouped plan splits by its ``rank_share``).
        trace_ranks: R; this rank's T tokens are split into R equal groups for counts_RE.
        init_std, seed: weights from :func:`init_expert_weights` (the same on every rank).
        slots_per_device: S_b, grouped plans only: weight rows (slots) every device compiles,
            >= the most slots a device holds in ``plan`` (the default); :meth:`set_plan`
            accepts plans of at most S_b slots per device.

    Outputs (for this rank's tokens):
        y_BSH: float [B, S, H].
        aux_loss: Switch load-balancing loss E * sum_e f_e * p_e over the local tokens (as in
            :class:`~ms_efficient.moe.layer.MoEFeedForward`; average it over ranks).
        counts_RE: int32 [R, E], assignments each group of local tokens routed to each expert.
        dropped: int32 scalar, local assignments beyond the rows this rank owns (static), or
            beyond this rank's send blocks C[r, d] or the device buffers B_d (grouped:
            :func:`~ms_efficient.moe.split.grouped_assignments`, this rank's part of its drop
            count).

    Parameters: ``router.weight`` [E, H] (data-parallel), ``w1`` [S_b, H, F], ``b1``
    [S_b, 1, F], ``w2`` [S_b, F, H], ``b2`` [S_b, 1, H]: row i < S_l holds the local slot
    ``local_slots[i]`` (global slot ids, ascending) of logical expert ``local_experts[i]``,
    rows S_l.. (grouped, S_b > S_l) are empty slots (zeros, no rows, zero gradient); S_b = S_l
    for static plans. Non-trainable int32 Parameters hold the plan's tables (grouped:
    ``plan_expert_V``, ``plan_cut_lo_V``, ``plan_cut_hi_V``; both: ``sync_first_L``,
    ``sync_cross_L``, ``sync_pick_L``), so :meth:`set_plan` changes them as data.
    ``tables`` (:class:`~ms_efficient.moe.ep_routing.LayerTables`) holds every numpy table of
    this rank, from one pass over the plan (:func:`~ms_efficient.moe.ep_routing.layer_tables`)
    in the constructor and again in :meth:`set_plan`.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int, top_k: int,
                 plan: ExpertPlan, group: Optional[str] = None, rank: Optional[int] = None,
                 devices_per_node: Optional[int] = None,
                 rank_load_RE: Optional[np.ndarray] = None, trace_ranks: int = 1,
                 init_std: float = 0.02, seed: int = 0,
                 slots_per_device: Optional[int] = None):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"'top_k' must be in [1, {num_experts}], but got {top_k}.")
        self.world = backend.group_size(group or backend.world_group())
        actual = backend.group_rank(group or backend.world_group()) if self.world > 1 else 0
        if rank is not None and rank != actual:
            raise ValueError(f"'rank' must be this process's rank in the group ({actual}), "
                             f"but got {rank}.")
        self.rank = actual
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.trace_ranks = trace_ranks
        self.group, self.devices_per_node = group, devices_per_node
        self.grouped = plan.grouped               # "grouped" or "counts"
        self.counted = plan.dispatch == "counts"  # count-driven exchange (counted_alltoall)
        tables = layer_tables(plan, num_experts, self.rank, self.world, devices_per_node,
                              slots_per_device, rank_load_RE)
        self.tables, self.plan, self.budget = tables, tables.plan, tables.budget
        self.local_slots, self.local_experts = tables.local_slots, tables.local_experts
        if self.grouped:
            self._init_grouped(group, tables.grouped)
        else:
            self._init_static(group, tables.static)
        sync = tables.sync
        self.sync = ReplicaGradSum(sync.num_cross, group) if tables.sync_needed else None
        self.sync_first_L = _table("sync_first_L", sync.first_L)
        self.sync_cross_L = _table("sync_cross_L", sync.cross_L)
        self.sync_pick_L = _table("sync_pick_L", sync.pick_L)
        if self.world > 1:
            self.sum_over_ranks = ops.AllReduce(op=ops.ReduceOp.SUM,
                                                group=group or backend.world_group())

        # Parameters: the local slots' experts only (a replica is its expert's copy).
        router, w1, b1, w2, b2 = init_expert_weights(num_experts, hidden_size, ffn_hidden_size,
                                                     init_std, seed, self.local_experts)
        self.router = nn.Dense(hidden_size, num_experts, has_bias=False,
                               weight_init=Tensor(router))
        w1, b1, w2, b2 = (pad_rows(a, self.budget) for a in (w1, b1, w2, b2))
        self.w1 = Parameter(Tensor(w1), name="w1")
        self.b1 = Parameter(Tensor(b1), name="b1")
        self.w2 = Parameter(Tensor(w2), name="w2")
        self.b2 = Parameter(Tensor(b2), name="b2")
        self.bmm = ops.BatchMatMul()
        self.gelu = make_gelu()
        self.arrival = TopKArrival(num_experts, top_k)
        self.routing_counts = routing_counts_buffer(trace_ranks, num_experts)

    def _init_static(self, group, tables) -> None:
        """The static tables (:class:`~ms_efficient.moe.ep_routing.RankDispatch`) as
        constants and the two AlltoAllVs: this rank sends every rank the rows it reserves on
        that rank's slots (``send_counts``, what
        :func:`~ms_efficient.moe.exchange.exchange_rows` charges) and receives the rows
        every rank reserves on its own (``recv_counts``)."""
        h = self.hidden_size
        self.groups = tuple((c, len(ix)) for c, ix in tables.groups)
        self.send_total = int(tables.send_counts.sum())
        self.num_rows = int(tables.recv_index_N.size)
        self.dispatch = AllToAllV(tables.send_counts, tables.recv_counts, h, tables.send_rows,
                                  group)
        self.undispatch = AllToAllV(tables.recv_counts, tables.send_counts, h,
                                    tables.send_rows, group)
        self.num_j = tables.replicas_per_expert
        self.rows_E = Tensor(tables.rows_E)
        self.ends_EJ = Tensor(tables.ends_EJ)
        self.shift_X = Tensor(tables.shift_EJ.reshape(-1))
        # receive rows of every capacity group, slot-major (one gather per group)
        bounds = np.cumsum([0] + [c * len(ix) for c, ix in tables.groups])
        self.recv_index = tuple(Tensor(tables.recv_index_N[lo:hi])
                                for lo, hi in zip(bounds[:-1], bounds[1:]))
        self.back_index = Tensor(tables.back_index_M)
        self.group_members = tuple(tuple(int(i) for i in ix) for _, ix in tables.groups)

    def _init_grouped(self, group, tables) -> None:
        """The grouped tables (:class:`~ms_efficient.moe.ep_routing.GroupedDispatch`): the
        plan's in Parameters, the layout's (fixed by W, S_b, the blocks C and the buffers B)
        as constants; the count exchange and the two AlltoAllVs: block d of the send buffer
        has C[r, d] rows (M = sum_d C[r, d]), and this rank receives W blocks of C[src, r]
        rows (I in all), which it compacts into its buffer of N = B_r rows."""
        world, block_WD = self.world, tables.block_WD
        self.num_rows = int(tables.buffer_D[self.rank])                # N = B_r
        self.send_total = int(block_WD[self.rank].sum())               # M = sum_d C[r, d]
        block = int(block_WD.max())
        if self.counted:      # the same blocks as upper bounds, the kept rows on the wire
            self.dispatch = CountedAllToAllV(block_WD, self.rank, self.hidden_size, group)
            self.undispatch = CountedAllToAllV(block_WD.T, self.rank, self.hidden_size, group)
        else:
            self.dispatch = AllToAllV(block_WD[self.rank], block_WD[:, self.rank],
                                      self.hidden_size, block, group)
            self.undispatch = AllToAllV(block_WD[:, self.rank], block_WD[self.rank],
                                        self.hidden_size, block, group)
        self.count_exchange = CountExchange(world, self.rank, group)
        self.gmm = GroupedMatmul()
        self.plan_expert_V = _table("plan_expert_V", tables.expert_V)
        self.plan_cut_lo_V = _table("plan_cut_lo_V", tables.cut_lo_V)
        self.plan_cut_hi_V = _table("plan_cut_hi_V", tables.cut_hi_V)
        self.arange_V = Tensor(np.arange(tables.expert_V.size, dtype=np.int32))
        self.device_onehot_VD = Tensor(tables.device_onehot_VD)
        self.slot_device_V = Tensor(tables.slot_device_V)
        self.earlier_VV = Tensor(tables.earlier_on_device_VV)
        self.buffer_V = Tensor(tables.buffer_V)
        self.pair_limit_V = Tensor(tables.pair_limit_V)
        self.block_start_V = Tensor(tables.block_start_V)
        self.local_start = self.rank * self.budget       # this rank's budget slots start
        recv_W = block_WD[:, self.rank]                                # I = sum_src C[src, r]
        source_I = np.repeat(np.arange(world), recv_W)
        first_W = np.cumsum(recv_W) - recv_W
        self.recv_source_I = Tensor(source_I.astype(np.int32))
        self.recv_row_I = Tensor((np.arange(source_I.size) - first_W[source_I]).astype(np.int32))
        self.recv_arange_I = Tensor(np.arange(source_I.size, dtype=np.int32))

    expert_names = ("w1", "b1", "w2", "b2")

    def expert_params(self) -> tuple:
        """The experts' Parameters (w1, b1, w2, b2), as the balanced layer's method."""
        return (self.w1, self.b1, self.w2, self.b2)

    def set_weights(self, router_EH, w1_EHF, b1_E1F, w2_EFH, b2_E1H) -> None:
        """Load logical weights (numpy, all E experts): the router, and for every local slot
        its expert's rows (empty slots: zeros). Every rank must load the same values to keep
        replicas identical. Written in place (:func:`~ms_efficient.core.params.write_parameter`),
        so a jitted train step that already ran sees them too."""
        write_parameter(self.router.weight, np.asarray(router_EH, np.float32))
        self._load_experts((w1_EHF, b1_E1F, w2_EFH, b2_E1H))

    def _load_experts(self, tables_E) -> None:
        """w1, b1, w2, b2 from logical [E, ...] tables: row i < S_l takes local_experts[i]."""
        for param, table in zip((self.w1, self.b1, self.w2, self.b2), tables_E):
            rows = np.asarray(table, np.float32)[self.local_experts]
            write_parameter(param, pad_rows(rows, self.budget))

    def expert_weights(self):
        """The logical expert weights, numpy float32 (w1_EHF, b1_E1F, w2_EFH, b2_E1H), each
        expert read from the lowest rank that holds it (replicas are identical). Collective
        when W > 1: every rank of the group calls it (one AllReduce of E * (2HF + F + H)
        floats, in which every rank fills the experts it is the source of, zeros elsewhere)."""
        params = (self.w1, self.b1, self.w2, self.b2)
        source_E = self.tables.source_E
        flat = np.concatenate([p.asnumpy().reshape(self.budget, -1) for p in params], axis=1)
        table = np.where(source_E[:, None] >= 0, flat[np.maximum(source_E, 0)], 0.0)
        if self.world > 1:
            table = self.sum_over_ranks(Tensor(table.astype(np.float32))).asnumpy()
        sizes = np.cumsum([int(np.prod(p.shape[1:])) for p in params])[:-1]
        return tuple(part.reshape((self.num_experts,) + tuple(p.shape[1:]))
                     for part, p in zip(np.split(table, sizes, axis=1), params))

    def set_plan(self, plan: ExpertPlan, optimizer=None) -> None:
        """Switch a grouped layer to ``plan`` without recompiling its graph.

        The new plan must keep the send blocks and row buffers (``plan.send_rows(W)``,
        ``plan.device_rows(W)``), name the
        same E experts and hold at most S_b slots per device: then only data changes, the
        plan tables (Parameters) and the weight rows. Only the rows whose expert changed move
        (:func:`~ms_efficient.moe.ep_migration.plan_migration`): a copy already on this rank
        is copied locally, the others come in ONE AlltoAllV of the moved rows
        (:func:`~ms_efficient.moe.ep_replan.move_rows`), rows left empty become zeros.
        Collective when W > 1: every rank calls it with the same plan, between steps.

        optimizer: the optimizer (e.g. ``nn.Adam``) of w1/b1/w2/b2, or None. Given, its state
            Parameters of those weights (Adam's moments, Momentum's moments;
            :func:`~ms_efficient.moe.ep_replan.weight_states`) travel with their rows, so a
            step after the move equals the step without it. None: the weights alone move and
            the state stays behind (a slot keeps the moments of the expert it held before).
        Records ``self.last_migration`` (:class:`~ms_efficient.moe.ep_replan.MigrationRecord`:
        moved_slots, moved_bytes, ...). Raises ``ValueError`` for a static layer or plan, a
        plan that needs new shapes (then build a new layer, which compiles a new graph) or an
        optimizer that does not hold the layer's weights.
        """
        if not self.grouped:
            raise ValueError(f"set_plan switches 'grouped' layers, but this layer's dispatch is "
                             f"{self.plan.dispatch!r}; build a new ExpertParallelMoE instead.")
        tables = layer_tables(plan, self.num_experts, self.rank, self.world,
                              self.devices_per_node, compiled=self.tables)
        weights = (self.w1, self.b1, self.w2, self.b2)
        states = () if optimizer is None else weight_states(optimizer, weights)
        migration = plan_migration(self.plan, plan, self.budget, self.world,
                                   self.devices_per_node)
        move_rows(migration, self.rank, weights + sum(states, ()), self.group)
        self.last_migration = record(migration, weights, len(states))
        self.tables, self.plan = tables, plan
        self.local_slots, self.local_experts = tables.local_slots, tables.local_experts
        sync = tables.sync
        for param, values in ((self.plan_expert_V, tables.grouped.expert_V),
                              (self.plan_cut_lo_V, tables.grouped.cut_lo_V),
                              (self.plan_cut_hi_V, tables.grouped.cut_hi_V),
                              (self.sync_first_L, sync.first_L),
                              (self.sync_cross_L, sync.cross_L),
                              (self.sync_pick_L, sync.pick_L)):
            write_parameter(param, values)      # in place: jit train steps see it too

    def construct(self, x):
        b, s, h = x.shape
        t = b * s
        k, m = self.top_k, self.send_total
        x_TH = x.reshape(t, h)

        # Step 1: route top-k (A = K*T assignments, k-major, arrival position p each).
        probs_TE, weights_TK, expert_ids_A, onehot_AE, position_A = self.arrival(
            self.router(x_TH))

        # Step 2: send row of every assignment (m: the zero row, for drops).
        if self.grouped:
            keep_A, row_A, kept_WV = self._grouped_send_rows(expert_ids_A, onehot_AE,
                                                             position_A)
        else:
            keep_A, row_A = self._static_send_rows(expert_ids_A, position_A)

        # Step 3: send buffer [M, H] (token T = empty row -> zeros).
        token_A = ops.tile(ops.arange(t, dtype=ms.int32), (k,))
        row_token = ops.fill(ms.int32, (m + 1,), t)
        row_token = ops.tensor_scatter_update(row_token, row_A.reshape(-1, 1), token_A)
        x_pad = ops.concat((x_TH, ops.zeros((1, h), x_TH.dtype)), 0)
        send_MH = ops.gather(x_pad, row_token[:m], 0)

        # Step 4: exchange, local experts, results back to the send rows [M, H].
        if self.grouped:
            ret_MH = self._grouped_experts(send_MH, kept_WV)
        else:
            out_NH = self._experts(self.dispatch(send_MH))
            ret_MH = self.undispatch(ops.gather(out_NH, self.back_index, 0))

        # Step 5: combine: every assignment reads its send row back, weighted; drops read 0.
        ret_pad = ops.concat((ret_MH, ops.zeros((1, h), ret_MH.dtype)), 0)
        gate_A = weights_TK.transpose(1, 0).reshape(-1) * keep_A.astype(ms.float32)
        y_AH = ops.gather(ret_pad, row_A, 0) * gate_A.reshape(-1, 1).astype(x.dtype)
        y_TH = sum_choices(y_AH, k, t)

        # Step 6: statistics of the local tokens.
        aux_loss, counts_RE = routing_statistics(probs_TE, onehot_AE, k, self.trace_ranks)
        ops.assign(self.routing_counts, counts_RE)
        dropped = (k * t - keep_A.astype(ms.int32).sum()).astype(ms.int32)
        return y_TH.reshape(b, s, h), aux_loss, counts_RE, dropped

    def _static_send_rows(self, expert_ids_A, position_A):
        """(keep_A, row_A): the replica whose reserved rows hold arrival p (static tables);
        p beyond them is dropped (row M)."""
        keep_A = position_A < ops.gather(self.rows_E, expert_ids_A, 0)
        if self.num_j == 1:
            replica_A = expert_ids_A
        else:
            ends_AJ = ops.gather(self.ends_EJ, expert_ids_A, 0)
            past_A = (ends_AJ <= position_A.reshape(-1, 1)).astype(ms.int32).sum(axis=-1)
            replica_A = expert_ids_A * self.num_j + ops.minimum(past_A, self.num_j - 1)
        row_A = ops.select(keep_A, ops.gather(self.shift_X, replica_A, 0) + position_A,
                           ops.fill(ms.int32, position_A.shape, self.send_total))
        return keep_A, row_A

    def _grouped_send_rows(self, expert_ids_A, onehot_AE, position_A):
        """(keep_A, row_A, kept_WV) of :func:`~ms_efficient.moe.split.grouped_assignments`,
        in int32 (cuts equal numpy's: c * SPLIT_UNITS < 2^31 for c < 524,288 local
        assignments of one expert), over the V budget slots (plan tables: Parameters).

        Step 1, the split: c_e local assignments of e; budget slot v of e takes arrivals
        [c_e * lo_v // U, c_e * hi_v // U) (empty slots: none); q = p minus its slot's start.
        Step 2, the send blocks: this rank keeps its rows of device d's slots, slots
        ascending, up to C[r, d] (``pair_limit_V``): block_V = clip(C - earlier, 0, split).
        Step 3, the buffers: those per-slot counts of every rank (exchanged, [W, V]) give every
        (rank, slot) block its start in its device's rank-major, slot-minor order, and
        kept_WV = clip(B_d - start, 0, count). Arrival q of slot v is kept iff q < kept[r, v],
        at send row block_start(d) + (kept rows of d's earlier slots) + q.
        """
        tokens = position_A.shape[0] // self.top_k
        if tokens > MAX_GROUPED_TOKENS:
            raise ValueError(f"a grouped ExpertParallelMoE splits in int32, exact for at most "
                             f"{MAX_GROUPED_TOKENS} local tokens per call, but got {tokens}; "
                             f"split the batch.")
        count_E = onehot_AE.sum(axis=0).astype(ms.int32)
        count_V = ops.gather(ops.concat((count_E, ops.zeros((1,), ms.int32))),
                             self.plan_expert_V, 0)                  # empty slots: 0
        lo_V = ops.floor_div(count_V * self.plan_cut_lo_V, SPLIT_UNITS)
        hi_V = ops.floor_div(count_V * self.plan_cut_hi_V, SPLIT_UNITS)
        p_A1 = position_A.reshape(-1, 1)
        hit_AV = ((self.plan_expert_V.reshape(1, -1) == expert_ids_A.reshape(-1, 1))
                  & (lo_V.reshape(1, -1) <= p_A1) & (p_A1 < hi_V.reshape(1, -1)))
        slot_A = (hit_AV.astype(ms.int32) * self.arange_V).sum(axis=-1)  # exactly one hit
        q_A = position_A - ops.gather(lo_V, slot_A, 0)

        split_V = hi_V - lo_V                     # this rank's rows of every budget slot
        before_V = (split_V.reshape(-1, 1) * self.earlier_VV).sum(axis=0)
        block_V = ops.minimum(ops.maximum(self.pair_limit_V - before_V, 0), split_V)
        counts_WV = self.count_exchange(block_V)
        to_dev_WD = (counts_WV.reshape(self.world, -1, 1)
                     * self.device_onehot_VD.reshape(1, -1, self.world)).sum(axis=1)
        before_WD = ops.cumsum(to_dev_WD, 0) - to_dev_WD          # earlier ranks' rows
        within_WV = (counts_WV.reshape(self.world, -1, 1)
                     * self.earlier_VV.reshape((1,) + self.earlier_VV.shape)).sum(axis=1)
        start_WV = ops.gather(before_WD, self.slot_device_V, 1) + within_WV
        kept_WV = ops.minimum(ops.maximum(self.buffer_V - start_WV, 0), counts_WV)

        kept_V = kept_WV[self.rank]
        keep_A = q_A < ops.gather(kept_V, slot_A, 0)
        offset_V = self.block_start_V + (kept_V.reshape(-1, 1) * self.earlier_VV).sum(axis=0)
        row_A = ops.select(keep_A, ops.gather(offset_V, slot_A, 0) + q_A,
                           ops.fill(ms.int32, position_A.shape, self.send_total))
        return keep_A, row_A, kept_WV

    def _grouped_experts(self, send_MH, kept_WV):
        """Exchange, compact, grouped expert FFNs, exchange back: [M, H] -> [M, H].

        Received row i of I = sum_src C[src, me] (source r, row j of r's block): in r's block
        the kept rows of the local budget slots follow in slot order, so j's slot l and index
        q follow from kept_WV; it goes to buffer row goff[l] + (rows of l from earlier
        sources) + q of the [N = B_r, H] buffer grouped by local slot (group sizes size_L,
        data), the rest of r's block (unfilled rows) to none. L = S_b local budget slots; an
        empty slot is an empty group.
        """
        n, num_local = self.num_rows, self.budget
        if self.counted:
            sent_WW = device_counts(kept_WV, self.device_onehot_VD)
            recv_IH = self.dispatch(send_MH, sent_WW)
        else:
            recv_IH = self.dispatch(send_MH)
        kept_WL = kept_WV[:, self.local_start:self.local_start + num_local]
        ends_WL = ops.cumsum(kept_WL, 1)
        size_L = kept_WL.sum(axis=0).astype(ms.int32)          # the group sizes (data)
        goff_L = ops.cumsum(size_L, 0) - size_L
        shift_WL = ops.cumsum(kept_WL, 0) - kept_WL - (ends_WL - kept_WL)
        ends_IL = ops.gather(ends_WL, self.recv_source_I, 0)
        slot_I = (ends_IL <= self.recv_row_I.reshape(-1, 1)).astype(ms.int32).sum(axis=-1)
        valid_I = slot_I < num_local
        slot_I = ops.minimum(slot_I, num_local - 1)
        dest_I = (ops.gather(goff_L, slot_I, 0) + self.recv_row_I
                  + ops.gather(shift_WL.reshape(-1), self.recv_source_I * num_local + slot_I, 0))
        dest_I = ops.select(valid_I, dest_I, ops.fill(ms.int32, dest_I.shape, n))
        index_N = ops.fill(ms.int32, (n + 1,), self.recv_arange_I.shape[0])
        index_N = ops.tensor_scatter_update(index_N, dest_I.reshape(-1, 1), self.recv_arange_I)
        recv_pad = ops.concat((recv_IH, ops.zeros((1,) + recv_IH.shape[1:], recv_IH.dtype)), 0)
        out_NH = self._grouped_ffn(ops.gather(recv_pad, index_N[:n], 0), size_L)
        out_pad = ops.concat((out_NH, ops.zeros((1,) + out_NH.shape[1:], out_NH.dtype)), 0)
        if self.counted:
            return self.undispatch(ops.gather(out_pad, dest_I, 0), sent_WW.transpose(1, 0))
        return self.undispatch(ops.gather(out_pad, dest_I, 0))

    def _synced_weights(self):
        """(w1, b1, w2, b2), each through :class:`ReplicaGradSum` when replicas may exist."""
        weights = (self.w1, self.b1, self.w2, self.b2)
        if self.sync is None:
            return weights
        tables = (self.sync_first_L, self.sync_cross_L, self.sync_pick_L)
        return tuple(self.sync(w, *tables) for w in weights)

    def _grouped_ffn(self, x_NH, size_L):
        """Local slot FFNs on the grouped buffer [N, H] as two grouped matmuls (budget slot
        l owns the rows after the first l groups, size_L int32 [S_b]; rows past their sum, and
        an empty group, compute nothing and give zeros) -> [N, H]."""
        w1, b1, w2, b2 = self._synced_weights()
        group_N = row_groups(size_L, x_NH.shape[0])            # S_b for the unused tail
        b1_pad = ops.concat((b1.reshape(b1.shape[0], -1), ops.zeros((1, b1.shape[2]), b1.dtype)))
        b2_pad = ops.concat((b2.reshape(b2.shape[0], -1), ops.zeros((1, b2.shape[2]), b2.dtype)))
        hid = self.gelu(self.gmm(x_NH, w1, size_L) + ops.gather(b1_pad, group_N, 0))
        return self.gmm(hid, w2, size_L) + ops.gather(b2_pad, group_N, 0)

    def _experts(self, recv_NH):
        """Local slot FFNs on the received rows -> slot-major [N, H]: per group of equal
        capacity, its rows gathered from ``recv_NH`` and one batched matmul against the
        group's slot weights (:func:`~ms_efficient.moe.layer.group_tables`)."""
        w1, b1, w2, b2 = self._synced_weights()
        weights = group_tables((w1, b1, w2, b2), self.group_members, len(self.local_slots))
        outs = ()
        for gi in range(len(self.groups)):
            c, g = self.groups[gi]
            rows = ops.gather(recv_NH, self.recv_index[gi], 0).reshape(g, c, -1)
            gw1, gb1, gw2, gb2 = weights[gi]
            hid = self.gelu(self.bmm(rows, gw1) + gb1)
            outs = outs + ((self.bmm(hid, gw2) + gb2).reshape(g * c, -1),)
        if len(outs) == 1:
            return outs[0]
        return ops.concat(outs, 0)


def _table(name: str, values: np.ndarray) -> Parameter:
    """A plan table the graph reads as data: a non-trainable Parameter (a Tensor attribute
    would be a compile-time constant, and replacing it after compilation has no effect)."""
    return Parameter(Tensor(values), name=name, requires_grad=False)
