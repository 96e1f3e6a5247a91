"""Expert-parallel MoE balanced every step inside fixed buffers (EfficientMoE's fast level).

Shapes (names carry their dimensions): T local tokens, H hidden, F expert FFN width, E logical
experts, K top-k, A = K*T assignments, W ranks (one device each), S_h home slots and S_s spare
slots per device (L = S_h + S_s local slots), B_w the fixed receive buffer of device w, P_w =
min(A, B_w) the most token rows one rank can send device w, X the parameters of one expert,
R = ceil(X / H) the rows one copy takes, M = sum_w (P_w + R S_s) (this rank's send layout;
without copies, W = 1 or S_s = 0: sum_w P_w), J = sum_src (P_me + R S_s) (the dispatch's
receive layout), I = sum_src P_me (its token rows).

The layout's shapes (home slots, spare slots, buffers; :mod:`ms_efficient.efficientmoe.planner`)
are fixed when the Cell is built. The home table is a non-trainable Parameter (data, read by
the fast level every step): :meth:`BalancedExpertParallelMoE.set_plan` re-places the home
experts between steps, moving the changed slots' weights and optimizer state
(:func:`~ms_efficient.moe.ep_migration.migrate_rows`, the rows the slow level's simulator
charges), and the compiled graph runs on unchanged. Per step, on this rank's tokens:

    x_TH -> router -> top-k (expert_ids_A, weights_TK), arrival p of each assignment
         -> counts_E -> AllGather -> counts_WE (every rank sees every rank's counts)
         -> fast level: :func:`~ms_efficient.moe.balance.balance_step` on counts_WE, the
            same function the simulator replays (``FastLevel``: a host op running it on
            CPU, or its MindSpore-ops twin on any target, equal entry for entry): per
            (source, expert, device) rows sent_WEW, the slot of every expert on every
            device, the expert and weight source of every spare slot
         -> send row of every assignment: rank r's tokens of e, in arrival order, fill
            devices in order, sent_WEW[r, e, w] each; within a (r -> w) block rows are
            expert-major; past the sum: dropped
         -> send buffer [M, H]: block w holds this rank's token rows for device w, then
            the parameters of every copy this rank is the source of for w (R =
            ``copy_rows(H, F)`` rows of H each, X values zero-padded), only the copies made
            this step -> one count-driven AlltoAllV (``CountedAllToAllV``: per-pair counts
            tokens + R x copies, every block within its bound P_w + R S_s) -> [J, H]
         -> the token rows [I, H] compacted into the fixed buffer [B_me, H], grouped by
            local slot; the copies' rows into the spare slots' weights [S_s, X]; backward,
            the exchange's adjoint returns the copies' gradients to their sources, which add
            them to the home expert's
         -> grouped FFNs over the buffer (group sizes are data) -> back to [I, H]
         -> AlltoAllV back -> every assignment reads its row, weighted; sum over K -> y_TH

Gradients: a token's gradient reaches whichever slot computed it; a copy's weight gradient
returns to its source and is summed into the home expert; redundant home replicas (several
home slots of one expert) are tied by :class:`ReplicaGradSum`.
So the layer computes the function of the unbalanced layer: every expert's output for a token
is that expert's FFN wherever it ran (tests: equal to the one-process MoE).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from ms_efficient.core import backend
from ms_efficient.core.params import write_parameter
from ms_efficient.moe.alltoall import CountExchange
from ms_efficient.moe.balance import BalancedSpec, home_plan
from ms_efficient.moe.counted_alltoall import CountedAllToAllV
from ms_efficient.moe.ep_migration import migrate_rows, row_layout
from ms_efficient.moe.ep_replan import move_rows, record, weight_states
from ms_efficient.moe.ep_routing import (init_expert_weights, pad_rows, replica_sync,
                                        sync_rows as table_rows)
from ms_efficient.moe.exchange import copy_rows, expert_numel
from ms_efficient.moe.experts import EXPERT_KINDS, GatedActivation
from ms_efficient.moe.fast_level import FastLevel, fast_level_tables
from ms_efficient.moe.grouped_matmul import GroupedMatmul, row_groups
from ms_efficient.moe.layer import (make_gelu, routing_counts_buffer, routing_statistics,
                                    set_routing, sum_choices)
from ms_efficient.moe.routing import RouterConfig, updated_bias

__all__ = ["BalancedExpertParallelMoE", "BalancedSpec", "FastLevel", "fast_level_tables",
           "home_plan"]


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


class BalancedExpertParallelMoE(nn.Cell):
    """Expert-parallel MoE FFN balanced every step (module docstring):
    ``construct(x_BSH) -> (y_BSH, aux_loss, counts_RE, dropped)``, the interface of
    :class:`~ms_efficient.moe.layer.MoEFeedForward`; the step's fast-level figures go
    to the ``balance_stats`` Parameter.

    Args:
        hidden_size, ffn_hidden_size, num_experts, top_k: H, F, E, K.
        home_WS: int [W, S_h] logical expert of every home slot of every device (-1: empty,
            last); every expert at least once. The layout's row of this layer.
        spare_slots: S_s spare slots per device (per-step copies).
        buffer_W: int [W] receive buffer of every device, rows per step (fixed shapes).
        group: expert-parallel group (default: the world group); W = its size.
        devices_per_node: for the fast level's same-node round.
        copy_cost_WW: float [W, W] an expert copy's weight transfer in rows of expert
            compute (the fast level's threshold; None: copies free).
        trace_ranks: ranks whose counts the routing trace keeps apart (``counts_RE``'s R).
        init_std, seed: the experts' initial weights (:func:`init_expert_weights`, the
            same on every rank).
        sync_rows: rows of the replica-gradient table all-reduced every step (the layout's:
            the most experts a home table of the run replicates across ranks; ``set_plan``
            refuses more); None: as many as any home table of these shapes could.
        fast_level: "auto" (aot kernel on CPU, MindSpore-ops twin elsewhere), "host", "aot"
            or "ops"
            (:class:`~ms_efficient.moe.fast_level.FastLevel`).
        expert_kind: "mlp" (w2(act(x w1))) or "glu" (gated: w2(act(x w_gate) * (x w_up)),
            w1 the fused [w_gate | w_up] of width 2F, ``activation`` the gate's, default SiLU:
            SwiGLU), as :class:`~ms_efficient.moe.layer.MoEFeedForward`.
        has_bias: whether the experts add biases (b1, b2); without them the layer holds and
            copies w1 and w2 only.
        activation: the experts' activation Cell (default: tanh GELU for "mlp", SiLU for
            "glu").
        renormalize: as :class:`~ms_efficient.moe.layer.TopKArrival` (without a
            ``router_config``).
        router_config: a :class:`~ms_efficient.moe.routing.RouterConfig` (sigmoid scores,
            group-limited top-k, scaling, the auxiliary-loss-free expert bias); None: softmax
            then top-k. With the bias on, ``expert_bias`` (float32 [E], not trainable) selects
            and, in training, takes the sign-rule update from the step's counts summed over
            every rank (the all-gathered counts), so every rank holds the same bias and it
            moves as the one-process layer's does on the global batch.
        expert_bias: an existing bias Parameter [E] to use as ``expert_bias``.
        router: the Cell mapping [T, H] to logits [T, E] (default: a bias-free Dense with the
            weights of :func:`init_expert_weights`); data-parallel.
        shared: a Cell ``x_TH -> y_TH`` (shared experts, data-parallel) added to the routed
            output; it reads only this rank's tokens, so the graph may run it while the
            dispatch is in flight (no order is imposed or claimed).

    Outputs: y_BSH; aux_loss (Switch loss of the local tokens); counts_RE int32 [R, E] of the
    local tokens; dropped int32 (local assignments no buffer held). ``balance_stats``
    (non-trainable int32 [3 + W], written every step): copies made, rows dropped, rows kept,
    then every device's rows; the same on every rank. ``exchange_rows`` (non-trainable int32
    [2, W, W], written every step): the dispatch's per-pair row counts (tokens, then the
    copies' rows), and the token rows alone (:meth:`exchange_bytes`).

    Parameters: ``router.weight`` [E, H] (data-parallel), ``w1`` [S_h, H, F1], ``b1``
    [S_h, 1, F1], ``w2`` [S_h, F, H], ``b2`` [S_h, 1, H] (this rank's home slots; an empty
    slot zeros; F1 = F, or 2F for gated experts; no biases with ``has_bias=False``:
    :attr:`expert_names`), and the non-trainable ``home_table`` int32 [W, S_h].
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int, top_k: int,
                 home_WS: np.ndarray, spare_slots: int, buffer_W: np.ndarray,
                 group: Optional[str] = None, devices_per_node: Optional[int] = None,
                 copy_cost_WW: Optional[np.ndarray] = None, trace_ranks: int = 1,
                 init_std: float = 0.02, seed: int = 0, sync_rows: Optional[int] = None,
                 fast_level: str = "auto", expert_kind: str = "mlp", has_bias: bool = True,
                 activation: Optional[nn.Cell] = None, renormalize: bool = True,
                 router_config: Optional[RouterConfig] = None,
                 expert_bias: Optional[Parameter] = None, router: Optional[nn.Cell] = None,
                 shared: Optional[nn.Cell] = None):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"'top_k' must be in [1, {num_experts}], but got {top_k}.")
        if expert_kind not in EXPERT_KINDS:
            raise ValueError(f"'expert_kind' must be one of {list(EXPERT_KINDS)}, but got "
                             f"{expert_kind!r}.")
        self.world = backend.group_size(group or backend.world_group())
        self.rank = backend.group_rank(group or backend.world_group()) if self.world > 1 else 0
        home = np.asarray(home_WS, dtype=np.int64)
        buffers = np.asarray(buffer_W, dtype=np.int64)
        if home.ndim != 2 or home.shape[0] != self.world:
            raise ValueError(f"'home_WS' must be [W={self.world}, S_h], but got {home.shape}.")
        if buffers.shape != (self.world,) or (buffers < 1).any():
            raise ValueError(f"'buffer_W' must be [{self.world}] positive row counts, but got "
                             f"{buffers.tolist()}.")
        if spare_slots < 0:
            raise ValueError(f"'spare_slots' must be >= 0, but got {spare_slots}.")
        if sync_rows is not None and sync_rows < 0:
            raise ValueError(f"'sync_rows' must be >= 0 (or None), but got {sync_rows}.")
        self.plan = home_plan(home, num_experts)
        home = row_layout(self.plan, home.shape[1], self.world)     # empty slots last
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.ffn_hidden_size = ffn_hidden_size
        self.trace_ranks, self.group = trace_ranks, group
        self.devices_per_node = devices_per_node
        self.slots_home, self.spare = home.shape[1], int(spare_slots)
        self.buffer_W = buffers
        self.num_rows = int(buffers[self.rank])
        self.home_table = Parameter(Tensor(home.astype(np.int32)), name="home_table",
                                    requires_grad=False)
        self.fast = FastLevel(self.world, num_experts, self.spare, buffers, copy_cost_WW,
                              devices_per_node, fast_level)
        self.count_exchange = CountExchange(self.world, self.rank, group)
        # the dispatch's blocks: rank s may send device w B_w token rows and, when copies can
        # happen, S_s expert copies of R rows of H each (copy_rows: an expert's X
        # parameters, zero-padded to whole rows), after its token rows
        self.expert_kind, self.has_bias = expert_kind, bool(has_bias)
        self.copy_rows = copy_rows(hidden_size, ffn_hidden_size, expert_kind, self.has_bias)
        self.copies = self.world > 1 and self.spare > 0
        token_WW = np.broadcast_to(buffers[None, :], (self.world, self.world))
        block_WW = token_WW + (self.spare * self.copy_rows if self.copies else 0)
        self.send_total = int(block_WW[self.rank].sum())
        self.token_total = int(token_WW[self.rank].sum())   # the combine's receive layout
        self.token_start_W = Tensor((np.cumsum(token_WW[self.rank])
                                     - token_WW[self.rank]).astype(np.int32))
        self.block_start_W = Tensor((np.cumsum(block_WW[self.rank])
                                     - block_WW[self.rank]).astype(np.int32))
        self.dispatch = CountedAllToAllV(block_WW, self.rank, hidden_size, group)
        self.undispatch = CountedAllToAllV(token_WW.T, self.rank, hidden_size, group)
        recv_W = token_WW[:, self.rank]              # the token rows of the receive layout
        source_I = np.repeat(np.arange(self.world), recv_W)
        first_W = np.cumsum(recv_W) - recv_W
        self.recv_source_I = Tensor(source_I.astype(np.int32))
        self.recv_row_I = Tensor((np.arange(source_I.size) - first_W[source_I]).astype(np.int32))
        block_in_W = block_WW[:, self.rank]          # the dispatch's receive blocks
        recv_start_W = np.cumsum(block_in_W) - block_in_W
        self.recv_total = int(block_in_W.sum())
        self.recv_start_W = Tensor(recv_start_W.astype(np.int32))
        self.recv_token_I = Tensor((recv_start_W[source_I] + np.arange(source_I.size)
                                    - first_W[source_I]).astype(np.int32))
        self.arange_R = Tensor(np.arange(self.copy_rows, dtype=np.int32))
        self.arange_W = Tensor(np.arange(self.world, dtype=np.int32))
        self.lower_SS = Tensor(np.tril(np.ones((self.spare, self.spare), np.int32), -1))
        # weights: this rank's home slots; replicas tied by ReplicaGradSum
        local = home[self.rank][home[self.rank] >= 0]
        self.budget, self.local_experts = self.slots_home, local      # what GradReducer reads
        # the replica-gradient table: the layout's rows (a re-plan keeps within them), by
        # default as many experts as any home table of these shapes can replicate
        self.num_cross = (table_rows(self.plan, num_experts, self.world, self.slots_home)
                          if sync_rows is None or self.world < 2 else int(sync_rows))
        sync = replica_sync(self.plan, self.rank, self.slots_home, self.num_cross)
        can_replicate = self.world * self.slots_home > num_experts
        self.sync = ReplicaGradSum(sync.num_cross, group) if can_replicate else None
        self.sync_tables = tuple(Parameter(Tensor(t), name=n, requires_grad=False) for n, t in
                                 (("sync_first_L", sync.first_L),
                                  ("sync_cross_L", sync.cross_L),
                                  ("sync_pick_L", sync.pick_L)))
        router_EH, *tables = init_expert_weights(num_experts, hidden_size, ffn_hidden_size,
                                                 init_std, seed, local, expert_kind)
        self.router = router if router is not None else nn.Dense(
            hidden_size, num_experts, has_bias=False, weight_init=Tensor(router_EH))
        # the experts' Parameters, in checkpoint order: w1 [S_h, H, F1], (b1), w2, (b2)
        self.expert_names = ("w1", "b1", "w2", "b2") if self.has_bias else ("w1", "w2")
        for name, table in zip(("w1", "b1", "w2", "b2"), tables):
            if name in self.expert_names:
                setattr(self, name, Parameter(Tensor(pad_rows(table, self.slots_home)),
                                              name=name))
        self.shapes = tuple(tuple(p.shape[1:]) for p in self.expert_params())
        self.sizes = tuple(int(np.prod(s)) for s in self.shapes)
        self.copy_numel = sum(self.sizes)                  # X: one expert's parameters
        if self.copy_numel != expert_numel(hidden_size, ffn_hidden_size, expert_kind,
                                           self.has_bias):
            raise AssertionError("expert_numel does not count the layer's expert parameters")
        self.gmm = GroupedMatmul()
        if activation is None:
            activation = nn.SiLU() if expert_kind == "glu" else make_gelu()
        self.act = GatedActivation(activation) if expert_kind == "glu" else activation
        self.shared = shared
        set_routing(self, num_experts, top_k, renormalize, router_config, expert_bias)
        self.arange_L = Tensor(np.arange(self.slots_home + self.spare, dtype=np.int32))
        self.balance_stats = Parameter(Tensor(np.zeros(3 + self.world, np.int32)),
                                       name="balance_stats", requires_grad=False)
        # the step's count operands of the exchanges (rows of H values): [0] the dispatch's
        # (tokens and copies), [1] the tokens alone (the combine sends their transpose back)
        self.exchange_rows = Parameter(Tensor(np.zeros((2, self.world, self.world), np.int32)),
                                       name="exchange_rows", requires_grad=False)
        # the last step's counts_RE, for training-loop callbacks (as MoEFeedForward's)
        self.routing_counts = routing_counts_buffer(trace_ranks, num_experts)
        # the last step's all-gathered counts_WE, the same on every rank: what the slow level
        # (EfficientMoECallback's home re-plans) reads without a collective of its own
        self.world_counts = Parameter(Tensor(np.zeros((self.world, num_experts), np.int32)),
                                      name="world_counts", requires_grad=False)

    @classmethod
    def from_spec(cls, hidden_size: int, ffn_hidden_size: int, num_experts: int, top_k: int,
                  spec: BalancedSpec, group: Optional[str] = None, **kwargs):
        """The layer of one :class:`BalancedSpec`."""
        return cls(hidden_size, ffn_hidden_size, num_experts, top_k, spec.home_WS,
                   spec.spare_slots, spec.buffer_W, group, spec.devices_per_node,
                   spec.copy_cost_WW, sync_rows=spec.sync_rows, **kwargs)

    def exchange_bytes(self, dtype_bytes: int = 4):
        """(dispatch_WW, copies_WW): bytes every rank sent every device in the last step's
        dispatch (its count operand x one row of H values of ``dtype_bytes``), and the part
        of them that were expert copies; int64 [W, W] each, read from ``exchange_rows``
        (the same on every rank). What the simulator charges
        (:func:`~ms_efficient.efficientmoe.balanced_cost.dispatch_bytes_LWW`)."""
        rows = self.exchange_rows.asnumpy().astype(np.int64)
        row_bytes = int(self.hidden_size) * int(dtype_bytes)
        return rows[0] * row_bytes, (rows[0] - rows[1]) * row_bytes

    def expert_params(self) -> tuple:
        """The experts' Parameters in :attr:`expert_names` order (w1, b1, w2, b2; w1, w2
        without biases)."""
        return tuple(getattr(self, name) for name in self.expert_names)

    def set_weights(self, router_EH, *tables_E) -> None:
        """Load logical weights (numpy, all E experts) into the router (``router_EH`` [E, H];
        None: leave it) and this rank's home slots: ``tables_E`` in :attr:`expert_names` order
        (w1 [E, H, F1], b1 [E, 1, F1], w2 [E, F, H], b2 [E, 1, H]; in place: a jitted step
        that already ran sees them)."""
        if len(tables_E) != len(self.expert_names):
            raise ValueError(f"set_weights needs the tables {list(self.expert_names)}, but got "
                             f"{len(tables_E)} tables.")
        if router_EH is not None:
            write_parameter(self.router.weight, np.asarray(router_EH, np.float32))
        for param, table in zip(self.expert_params(), tables_E):
            write_parameter(param, self.home_rows(table))

    def home_rows(self, table_E) -> np.ndarray:
        """This rank's home-slot rows of a logical table (numpy [E, ...], one row per
        expert): float32 [S_h, ...], zeros in empty slots (what :meth:`set_weights` writes,
        and what an expert weight's optimizer state holds)."""
        home = self.home_table.asnumpy()[self.rank]
        return pad_rows(np.asarray(table_E, np.float32)[home[home >= 0]], self.slots_home)

    def set_plan(self, plan, optimizer=None) -> None:
        """Re-place the home experts between steps, without recompiling: ``plan`` is an
        :class:`~ms_efficient.moe.plan.ExpertPlan` naming the same E experts with at most S_h
        slots per device (:func:`~ms_efficient.moe.balance.home_plan` of a new home table
        [W, S_h]); its row table becomes ``home_table``. The slots whose expert changed take
        its weights: a copy already on this rank locally, the others through ONE AlltoAllV of
        the moved rows (:func:`~ms_efficient.moe.ep_replan.move_rows` of
        :func:`~ms_efficient.moe.ep_migration.migrate_rows`); with ``optimizer`` (nn.Adam or
        another optimizer of w1/b1/w2/b2) its per-weight state travels with them, so a step
        after the move equals the step of a layer built with the new table. The replica-sync
        tables follow. Collective when W > 1: every rank calls it with the same plan.
        Records ``self.last_migration`` (:class:`~ms_efficient.moe.ep_replan.MigrationRecord`).
        Raises ``ValueError`` when the plan leaves an expert without a home slot, puts more
        than S_h slots on a device, or replicates an expert where these shapes cannot sync
        its gradient."""
        new_WS = row_layout(plan, self.slots_home, self.world)
        if int(new_WS.max(initial=-1)) >= self.num_experts:
            raise ValueError(f"the plan's experts must be in [0, {self.num_experts}), but got "
                             f"{int(new_WS.max())}.")
        new_plan = home_plan(new_WS, self.num_experts)       # every expert has a home
        sync = replica_sync(new_plan, self.rank, self.slots_home, self.num_cross)
        if sync.needed and self.sync is None:
            raise ValueError(f"the plan replicates experts, but this layer was built with "
                             f"{self.world} x {self.slots_home} home slots for "
                             f"{self.num_experts} experts (no room for a replica).")
        weights = self.expert_params()
        states = () if optimizer is None else weight_states(optimizer, weights)
        migration = migrate_rows(self.home_table.asnumpy(), new_WS, self.devices_per_node)
        move_rows(migration, self.rank, weights + sum(states, ()), self.group)
        self.last_migration = record(migration, weights, len(states))
        self.plan = new_plan
        self.local_experts = new_WS[self.rank][new_WS[self.rank] >= 0]
        write_parameter(self.home_table, new_WS.astype(np.int32))
        for param, values in zip(self.sync_tables, (sync.first_L, sync.cross_L, sync.pick_L)):
            write_parameter(param, values)      # in place: jit train steps see them

    def construct(self, x):
        b, s, h = x.shape
        t = b * s
        k, m, world = self.top_k, self.send_total, self.world
        x_TH = x.reshape(t, h)

        # Step 1: route, count, all-gather the counts, run the fast level on them.
        logits_TE = self.router(x_TH)
        if self.uses_bias:
            routed = self.arrival(logits_TE, self.expert_bias)
        else:
            routed = self.arrival(logits_TE)
        probs_TE, weights_TK, expert_ids_A, onehot_AE, position_A = routed
        counts_WE = self.count_exchange(onehot_AE.sum(axis=0).astype(ms.int32))
        if self.uses_bias and self.training:      # the global batch's counts, every rank
            ops.assign(self.expert_bias, updated_bias(self.expert_bias,
                                                      counts_WE.sum(axis=0), self.bias_speed))
        ops.assign(self.world_counts, counts_WE)
        sent_WEW, slot_EW, spare_WS, source_WS, home_slot_WE, stats = self.fast(
            counts_WE, self.home_table)

        # Step 2: send row of every assignment (m: the zero row, for drops).
        sent_EW = sent_WEW[self.rank]
        end_EW = ops.cumsum(sent_EW, 1)
        end_AW = ops.gather(end_EW, expert_ids_A, 0)
        dev_A = (end_AW <= position_A.reshape(-1, 1)).astype(ms.int32).sum(axis=-1)
        keep_A = dev_A < world
        dev_A = ops.minimum(dev_A, world - 1)
        flat_A = expert_ids_A * world + dev_A
        earlier_EW = ops.cumsum(sent_EW, 0) - sent_EW            # earlier experts' rows
        start_A = ops.gather(end_EW.reshape(-1) - sent_EW.reshape(-1), flat_A, 0)
        offset_A = (ops.gather(earlier_EW.reshape(-1), flat_A, 0) + position_A - start_A)
        row_A = ops.gather(self.block_start_W, dev_A, 0) + offset_A          # dispatch row
        row_A = ops.select(keep_A, row_A, ops.fill(ms.int32, row_A.shape, m))
        ret_A = ops.gather(self.token_start_W, dev_A, 0) + offset_A          # return row
        ret_A = ops.select(keep_A, ret_A, ops.fill(ms.int32, ret_A.shape, self.token_total))

        # Step 3: send buffer [M, H]: the token rows, then the weight rows of every copy this
        # rank is the source of; one count-driven exchange; the tokens compacted into the
        # fixed buffer by local slot, the copies into the spare slots.
        home = self._home_weights()
        tokens_WW = sent_WEW.sum(axis=1)                        # [source, device] rows
        token_A = ops.tile(ops.arange(t, dtype=ms.int32), (k,))
        if self.copies:
            rows_XH, pos_VR, src_VR, copies_WW = self._copy_sends(
                home, spare_WS, source_WS, home_slot_WE, tokens_WW, t, x_TH.dtype)
            source_NH = ops.concat((x_TH, rows_XH, ops.zeros((1, h), x_TH.dtype)), 0)
            row_src = ops.fill(ms.int32, (m + 1,), source_NH.shape[0] - 1)   # the zero row
            row_src = ops.tensor_scatter_update(row_src, row_A.reshape(-1, 1), token_A)
            row_src = ops.tensor_scatter_update(row_src, pos_VR.reshape(-1, 1),
                                                src_VR.reshape(-1))
            send_WW = tokens_WW + copies_WW * self.copy_rows
        else:
            source_NH = ops.concat((x_TH, ops.zeros((1, h), x_TH.dtype)), 0)
            row_src = ops.fill(ms.int32, (m + 1,), t)                        # the zero row
            row_src = ops.tensor_scatter_update(row_src, row_A.reshape(-1, 1), token_A)
            send_WW = tokens_WW
        send_MH = ops.gather(source_NH, row_src[:m], 0)
        shared_TH = self.shared(x_TH) if self.shared is not None else None
        recv_JH = self.dispatch(send_MH, send_WW)
        recv_IH = ops.gather(recv_JH, self.recv_token_I, 0)
        spare_SX = (self._copy_receives(recv_JH, spare_WS, source_WS, tokens_WW)
                    if self.copies else None)
        out_IH = self._experts(recv_IH, sent_WEW, slot_EW, spare_WS,
                               self._slot_weights(home, spare_SX))

        # Step 4: results back; every assignment reads its row, weighted; drops read 0.
        ret_MH = self.undispatch(out_IH, tokens_WW.transpose(1, 0))
        ret_pad = ops.concat((ret_MH, ops.zeros((1, h), ret_MH.dtype)), 0)
        gate_A = weights_TK.transpose(1, 0).reshape(-1) * keep_A.astype(ms.float32)
        y_AH = ops.gather(ret_pad, ret_A, 0) * gate_A.reshape(-1, 1).astype(x.dtype)
        y_TH = sum_choices(y_AH, k, t)
        if self.shared is not None:
            y_TH = y_TH + shared_TH
        aux_loss, counts_RE = routing_statistics(probs_TE, onehot_AE, k, self.trace_ranks)
        dropped = (k * t - keep_A.astype(ms.int32).sum()).astype(ms.int32)
        ops.assign(self.balance_stats, stats)
        ops.assign(self.routing_counts, counts_RE)
        ops.assign(self.exchange_rows, ops.stack((send_WW, tokens_WW)).astype(ms.int32))
        return y_TH.reshape(b, s, h), aux_loss, counts_RE, dropped

    def _experts(self, recv_IH, sent_WEW, slot_EW, spare_WS, weights):
        """Received rows [I, H] -> the fixed buffer [B_me, H] grouped by local slot -> FFNs ->
        back to the received layout [I, H] (unfilled rows: zeros). weights: (w1, b1, w2, b2)
        of the L local slots (:meth:`_slot_weights`; w1, w2 without biases)."""
        n, num_e = self.num_rows, self.num_experts
        num_local = self.slots_home + self.spare
        to_me_WE = sent_WEW[:, :, self.rank]                      # rows each source sends me
        ends_WE = ops.cumsum(to_me_WE, 1)
        ends_IE = ops.gather(ends_WE, self.recv_source_I, 0)
        e_I = (ends_IE <= self.recv_row_I.reshape(-1, 1)).astype(ms.int32).sum(axis=-1)
        valid_I = e_I < num_e
        e_I = ops.minimum(e_I, num_e - 1)
        pair_I = self.recv_source_I * num_e + e_I
        start_I = ops.gather(ends_WE.reshape(-1) - to_me_WE.reshape(-1), pair_I, 0)
        earlier_WE = ops.cumsum(to_me_WE, 0) - to_me_WE           # earlier sources' rows
        # local slot of every expert here, its group size and offset in the buffer
        slot_E = slot_EW[:, self.rank]
        rows_E = to_me_WE.sum(axis=0).astype(ms.int32)
        expert_L = ops.concat((self.home_table[self.rank], spare_WS[self.rank]), 0)
        owns_L = ops.gather(ops.concat((slot_E, ops.fill(ms.int32, (1,), -1)), 0),
                            ops.select(expert_L < 0, ops.fill(ms.int32, expert_L.shape, num_e),
                                       expert_L), 0) == self.arange_L
        size_L = ops.select(owns_L, ops.gather(ops.concat((rows_E, ops.zeros((1,), ms.int32)),
                                                          0), ops.maximum(expert_L, 0), 0),
                            ops.zeros_like(expert_L)).astype(ms.int32)
        goff_L = ops.cumsum(size_L, 0) - size_L
        slot_I = ops.maximum(ops.gather(slot_E, e_I, 0), 0)
        dest_I = (ops.gather(goff_L, slot_I, 0) + ops.gather(earlier_WE.reshape(-1), pair_I, 0)
                  + self.recv_row_I - start_I)
        dest_I = ops.select(valid_I, dest_I, ops.fill(ms.int32, dest_I.shape, n))
        index_N = ops.fill(ms.int32, (n + 1,), self.recv_row_I.shape[0])
        index_N = ops.tensor_scatter_update(index_N, dest_I.reshape(-1, 1),
                                            ops.arange(self.recv_row_I.shape[0], dtype=ms.int32))
        recv_pad = ops.concat((recv_IH, ops.zeros((1, recv_IH.shape[1]), recv_IH.dtype)), 0)
        x_NH = ops.gather(recv_pad, index_N[:n], 0)
        if self.has_bias:
            w1, b1, w2, b2 = weights
            group_N = row_groups(size_L, n)
            b1_pad = ops.concat((b1.reshape(num_local, -1),
                                 ops.zeros((1, b1.shape[2]), b1.dtype)))
            b2_pad = ops.concat((b2.reshape(num_local, -1),
                                 ops.zeros((1, b2.shape[2]), b2.dtype)))
            hid = self.act(self.gmm(x_NH, w1, size_L) + ops.gather(b1_pad, group_N, 0))
            out_NH = self.gmm(hid, w2, size_L) + ops.gather(b2_pad, group_N, 0)
        else:
            w1, w2 = weights
            out_NH = self.gmm(self.act(self.gmm(x_NH, w1, size_L)), w2, size_L)
        out_pad = ops.concat((out_NH, ops.zeros((1, out_NH.shape[1]), out_NH.dtype)), 0)
        return ops.gather(out_pad, dest_I, 0)

    def _home_weights(self):
        """The home slots' expert Parameters (:meth:`expert_params`), redundant replicas tied
        (ReplicaGradSum)."""
        weights = self.expert_params()
        if self.sync is not None:
            weights = tuple(self.sync(w, *self.sync_tables) for w in weights)
        return weights

    def _copy_sends(self, home, spare_WS, source_WS, home_slot_WE, tokens_WW, t, dtype):
        """What this rank sends of the step's copies, in the dispatch: (rows_XH [S_h R, H]
        its home slots' parameters as rows, pos_VR int32 [V, R] the send row of every row of
        every spare slot V = W x S_s it is the source of (M, the dropped row, elsewhere),
        src_VR int32 [V, R] the row of ``t + rows_XH`` it takes, copies_WW int32 [W, W] the
        copies every rank sends every device). A (source -> device) block holds the token
        rows, then the copies in the device's spare-slot order, R rows each."""
        r, m, world, spare = self.copy_rows, self.send_total, self.world, self.spare
        flat_SX = ops.concat(tuple(w.reshape(self.slots_home, -1) for w in home), 1)
        pad = r * self.hidden_size - flat_SX.shape[1]
        if pad:
            flat_SX = ops.concat((flat_SX, ops.zeros((self.slots_home, pad), flat_SX.dtype)), 1)
        rows_XH = flat_SX.reshape(self.slots_home * r, self.hidden_size).astype(dtype)
        valid_WS = spare_WS >= 0
        # copies_WW[s, w]: spare slots of device w whose source is s
        from_WWS = ((source_WS.expand_dims(0) == self.arange_W.reshape(world, 1, 1))
                    & valid_WS.expand_dims(0))
        copies_WW = from_WWS.astype(ms.int32).sum(axis=2)
        mine_WS = from_WWS[self.rank]
        order_WS = ops.cumsum(mine_WS.astype(ms.int32), 1) - 1     # my copies to w, in order
        start_W = self.block_start_W + tokens_WW[self.rank]
        pos_WS = start_W.reshape(-1, 1) + order_WS * r
        pos_WS = ops.select(mine_WS, pos_WS, ops.fill(ms.int32, pos_WS.shape, m))
        slot_WS = ops.gather(home_slot_WE[self.rank], ops.maximum(spare_WS, 0).reshape(-1), 0)
        src_WS = t + ops.maximum(slot_WS.reshape(world, spare), 0) * r
        pos_VR = pos_WS.reshape(-1, 1) + self.arange_R.reshape(1, -1)
        pos_VR = ops.select(mine_WS.reshape(-1, 1).broadcast_to(pos_VR.shape), pos_VR,
                            ops.fill(ms.int32, pos_VR.shape, m))
        src_VR = src_WS.reshape(-1, 1) + self.arange_R.reshape(1, -1)
        return rows_XH, pos_VR, src_VR, copies_WW

    def _copy_receives(self, recv_JH, spare_WS, source_WS, tokens_WW):
        """[S_s, X] the parameters of this device's spare slots, read from the dispatch's
        receive layout [J, H] (zeros for an empty slot): slot j's copy comes from rank
        source_WS[me, j], after that rank's token rows and its earlier copies to me."""
        r, spare = self.copy_rows, self.spare
        source_S = source_WS[self.rank]
        valid_S = spare_WS[self.rank] >= 0
        src_S = ops.maximum(source_S, 0)
        same_SS = (source_S.reshape(-1, 1) == source_S.reshape(1, -1)).astype(ms.int32)
        order_S = (same_SS * self.lower_SS).sum(axis=1)           # earlier slots, same source
        start_S = (ops.gather(self.recv_start_W, src_S, 0)
                   + ops.gather(tokens_WW[:, self.rank], src_S, 0) + order_S * r)
        row_SR = start_S.reshape(-1, 1) + self.arange_R.reshape(1, -1)
        row_SR = ops.select(valid_S.reshape(-1, 1).broadcast_to(row_SR.shape), row_SR,
                            ops.fill(ms.int32, row_SR.shape, self.recv_total))
        recv_pad = ops.concat((recv_JH, ops.zeros((1, recv_JH.shape[1]), recv_JH.dtype)), 0)
        rows = ops.gather(recv_pad, row_SR.reshape(-1), 0).reshape(spare, -1)
        return rows[:, :self.copy_numel].astype(self.w1.dtype)

    def _slot_weights(self, home, spare_SX):
        """The expert weights of the L local slots: the home slots' (tied replicas), then the
        spare slots' copies received this step (zeros without copies)."""
        if self.spare == 0:
            return home
        if spare_SX is None:                    # one device: no copy is ever made
            spare_SX = ops.zeros((self.spare, self.copy_numel), self.w1.dtype)
        parts = ops.split(spare_SX, self.sizes, axis=1)
        return tuple(ops.concat((w, p.reshape((self.spare,) + shape)), 0)
                     for w, p, shape in zip(home, parts, self.shapes))
