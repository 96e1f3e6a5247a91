"""Top-k routed Mixture-of-Experts feed-forward layer with static per-expert capacity.

Shapes (names carry their dimensions): T tokens, H hidden, F expert FFN width, E experts,
K top-k, C slots per expert, R trace source ranks.

    x_TH -> router logits_TE -> top-k (expert_ids_TK, weights_TK)
         -> slot of every (token, choice) by arrival order inside its expert (k-major, so
            first choices of all tokens are served before second choices, as in GShard)
         -> gather into expert_in_ECH (empty slots read a zero row)
         -> batched matmul experts -> expert_out_ECH
         -> gather back per (token, choice), weight, sum over K -> y_TH

Assignments beyond an expert's capacity are dropped (their weight is zero; the residual
connection of the block carries the token on), and counted.

``dispatch="grouped"`` has no capacities and no padding: the T*K assignments are permuted by
expert with the padding-free kernels of :mod:`ms_efficient.moe.kernels` (rows grouped by
expert, N = T*K), both FFN matmuls run as grouped matmuls over all N rows with the per-expert
counts as group sizes (:mod:`ms_efficient.moe.grouped_matmul`: sizes are data, not compiled
shapes, so every shape is static; on CPU a C++ kernel over OpenBLAS, on Ascend A2/A3
``GroupedMatmul`` with a group list behind ``core.backend``, untested here: no Ascend
hardware), each row's biases are gathered by its expert, and the rows are combined back by
the kernels. Nothing is dropped.

Experts are two-matrix FFNs w2(act(x w1)) (``expert_kind="mlp"``) or gated ones,
w2(act(x w_gate) * (x w_up)) (``"glu"``: SwiGLU with SiLU, GeGLU with GELU; Shazeer 2020). A
gated expert's first matmul is one product against the fused [H, 2F] table [w_gate | w_up]
(stored fused, or as two tables or per-expert Dense weights concatenated on every forward, so
the gradients reach the user's own Parameters), then :class:`GatedActivation` halves it: every
dispatch path runs both kinds with the same two (grouped) matmuls. A ``shared`` Cell (shared
experts: dense FFNs every token passes through, e.g. DeepSeek's, optionally scaled by a
sigmoid gate as in Qwen-MoE) adds its output to the routed one.

Capacities may differ per expert (``capacity`` given as a sequence of E ints): the slots of all
experts then form one buffer of sum(C_e) rows, expert e owning rows [off_e, off_e + C_e), and
each expert's FFN runs on its own rows only, so no compute is spent on padding beyond what
its capacity allows. Capacities are static: changing them changes the compiled graph.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import numpy as np
import mindspore as ms
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops
from mindspore.common.initializer import Normal, initializer

from ms_efficient.moe.experts import EXPERT_KINDS, GatedActivation, TanhGELU, make_gelu
from ms_efficient.moe.grouped_matmul import GroupedMatmul, row_groups
from ms_efficient.moe.kernels import MoeTokenPermute, MoeTokenUnpermute
from ms_efficient.moe.routing import Router, RouterConfig, expert_bias_parameter, updated_bias

__all__ = ["MoEFeedForward", "LAYER_DISPATCH", "TopKArrival", "TanhGELU", "routing_statistics", "sum_choices",
           "ROUTING_COUNTS", "routing_counts_buffer", "make_gelu",
           "group_tables"]

# name of the per-layer buffer holding the last forward's counts [R, E] (int32): read by
# ms_efficient.efficientmoe.apply.RoutingTraceCallback, never checkpointed (not model state)
ROUTING_COUNTS = "routing_counts"
# MoEFeedForward's dispatch: per-expert capacities / padding-free grouped rows (moe.dispatch
# "balanced" builds "grouped" layers in one process: MoEConfig.layer_dispatch)
LAYER_DISPATCH = ("static", "grouped")


class TopKArrival(nn.Cell):
    """Top-k routing with arrival order, shared by every MoE layer of the package.

    ``construct(logits_TE) -> (probs_TE, weights_TK, expert_ids_A, onehot_AE, position_A)``:
    router probabilities (float32), the top-k gate weights (softmax, then top-k; renormalised to
    sum to 1 unless ``renormalize=False``, which keeps the softmax probabilities), and for
    every assignment A = K*T in k-major order (first choices of all tokens before second
    choices, as in GShard) its expert, one-hot row and position among the earlier assignments
    to the same expert. Parameter-free: the router's weights stay in the layer.
    """

    def __init__(self, num_experts: int, top_k: int, renormalize: bool = True):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = bool(renormalize)
        self.softmax = nn.Softmax(axis=-1)
        self.one_hot = ops.OneHot()
        self.on = Tensor(1.0, ms.float32)
        self.off = Tensor(0.0, ms.float32)

    def construct(self, logits_TE):
        probs_TE = self.softmax(logits_TE.astype(ms.float32))
        weights_TK, expert_ids_TK = ops.topk(probs_TE, self.top_k)
        if self.renormalize:
            weights_TK = weights_TK / weights_TK.sum(axis=-1, keepdims=True)
        expert_ids_A = expert_ids_TK.transpose(1, 0).reshape(-1)
        onehot_AE = self.one_hot(expert_ids_A, self.num_experts, self.on, self.off)
        position_A = ((ops.cumsum(onehot_AE, 0) - 1.0) * onehot_AE).sum(axis=-1)
        return probs_TE, weights_TK, expert_ids_A, onehot_AE, position_A.astype(ms.int32)


def set_routing(layer: nn.Cell, num_experts: int, top_k: int, renormalize: bool,
                router_config: Optional[RouterConfig],
                expert_bias: Optional[Parameter]) -> None:
    """Give an MoE layer its top-k rule, shared by every layer of the package: ``arrival``
    (:class:`TopKArrival` without a ``router_config``, else :class:`Router`), ``uses_bias``,
    and with the auxiliary-loss-free bias ``bias_speed`` and ``expert_bias`` (float32 [E], the
    given Parameter or a new one). ValueError for a bias of another shape, or one given without
    a router_config that uses it."""
    layer.uses_bias = router_config is not None and router_config.uses_bias
    layer.arrival = (TopKArrival(num_experts, top_k, renormalize) if router_config is None
                     else Router(num_experts, top_k, router_config))
    if layer.uses_bias:
        layer.bias_speed = float(router_config.bias_update_speed)
        layer.expert_bias = (expert_bias if expert_bias is not None
                             else expert_bias_parameter(num_experts))
        if tuple(layer.expert_bias.shape) != (num_experts,):
            raise ValueError(f"'expert_bias' must be [{num_experts}], but got "
                             f"{tuple(layer.expert_bias.shape)}.")
    elif expert_bias is not None:
        raise ValueError("'expert_bias' needs a router_config with bias_update_speed > 0.")


def sum_choices(y_AH, top_k: int, tokens: int):
    """Sum the K = ``top_k`` weighted expert outputs of every token: [K * T, H] k-major ->
    [T, H]. Split + AddN: the CPU backend's ReduceSum over the leading axis of [K, T, H] is
    slower than adding K contiguous blocks (0.9-1.2x apart alone in
    ``scripts/bench_cpu_ops.py``, but among the step's slowest ops in the profiler)."""
    if top_k == 1:
        return y_AH
    return ops.addn(ops.split(y_AH, tokens, 0))


def group_tables(tables, groups, total: int):
    """Per capacity group, the rows of every expert table [X, ...] (X = ``total`` experts or
    slots) that its members use: a tuple over groups of tuples over ``tables``.

    groups: a tuple of member-index tuples (Python ints). One group holding 0..X-1 in order
    gets the tables themselves; otherwise they are unstacked once and each group's members
    stacked, so the backward is a stack plus an unstack per group. Gathering each group's
    rows instead scatters a full-size gradient per group and adds them up, which on this CPU
    made more than two capacity levels markedly slower.
    """
    if len(groups) == 1 and tuple(groups[0]) == tuple(range(total)):
        return (tuple(tables),)
    parts = [ops.unstack(table, 0) for table in tables]
    return tuple(tuple(ops.stack([part[i] for i in members]) for part in parts)
                 for members in groups)


def routing_counts_buffer(ranks: int, num_experts: int) -> Parameter:
    """The non-trainable int32 [ranks, E] Parameter an MoE layer assigns its counts to on
    every forward, so a training-loop callback can read them (see ROUTING_COUNTS)."""
    return Parameter(Tensor(np.zeros((ranks, num_experts), np.int32)), name=ROUTING_COUNTS,
                     requires_grad=False)


def routing_statistics(probs_TE, onehot_AE, top_k: int, ranks: int):
    """(aux_loss, counts_RE): the Switch load-balancing loss E * sum_e f_e * p_e and the
    assignments each of ``ranks`` equal token groups routed to each expert (int32 [R, E])."""
    e = onehot_AE.shape[1]
    t = probs_TE.shape[0]
    aux_loss = e * (onehot_AE.mean(axis=0) * probs_TE.mean(axis=0)).sum()
    counts_RE = onehot_AE.reshape(top_k, ranks, t // ranks, e).sum(axis=(0, 2)).astype(ms.int32)
    return aux_loss, counts_RE


class MoEFeedForward(nn.Cell):
    """MoE FFN: ``construct(x_BSH) -> (y_BSH, aux_loss, counts_RE, dropped)``.

    Args:
        hidden_size: H.
        ffn_hidden_size: F, width of every expert's FFN.
        num_experts: E.
        top_k: K experts per token (gate weights: see ``renormalize``).
        capacity: C slots per expert (see :func:`~ms_efficient.moe.split.switch_capacity`), or a sequence of E
            per-expert capacities C_e >= 1.
        trace_ranks: R; the T tokens are split into R equal groups (R virtual source ranks,
            as data-parallel ranks would see them) and per-group expert counts are returned.
        dispatch: "static" (per-expert capacities, padded and dropping) or "grouped" (no
            capacity, no padding, no drops; ``capacity`` is then ignored, see module doc).
        activation: the experts' activation, a parameter-free Cell (default: tanh GELU,
            :func:`make_gelu`).
        renormalize: renormalise the top-k softmax probabilities to sum to 1 (True, as
            Mixtral's softmax over the top-k logits) or keep them (False, Switch / GShard
            top-1 and HF Qwen-MoE ``norm_topk_prob=False``).
        has_bias: whether the experts' two matmuls add biases.
        expert_kind: "mlp" (w2(act(x w1))) or "glu" (gated: w2(act(x w_gate) * (x w_up)),
            ``activation`` the gate's, default SiLU: SwiGLU). A gated layer's w1 is the fused
            [E, H, 2F] table [w_gate | w_up] (b1 [E, 1, 2F]) unless ``up_weights`` is given.
        up_weights: a gated layer's up projection kept apart from its gate (``weights``' w1
            and b1 are then the gate's, [E, H, F]): ``(w3, b3)`` in the layout of w1 and b1
            (stacked, or E per-expert Dense-layout Parameters); concatenated with the gate's
            on every forward.
        shared: a Cell ``x_TH -> y_TH`` (shared experts) added to the routed output, or None.
        router_config: a :class:`~ms_efficient.moe.routing.RouterConfig` (sigmoid scores,
            top-k then softmax, a routed scaling factor, group-limited top-k, the
            auxiliary-loss-free expert bias); None: softmax then top-k with ``renormalize``
            (:class:`TopKArrival`). With the bias on (``bias_update_speed`` > 0) the layer
            holds it as ``expert_bias`` (float32 [E], not trainable, checkpointed), selects
            with it and, in training, assigns the sign-rule update from the forward's counts
            after routing (the next forward uses it). The config's own losses are
            :meth:`Router.aux_losses`; the layer's ``aux_loss`` output stays the Switch
            statistic below.
        expert_bias: an existing bias Parameter [E] to use as ``expert_bias`` (an adopted
            DeepSeek-V3 gate's ``e_score_correction_bias``).
        router: a Cell mapping [T, H] to logits [T, E] (default: a bias-free Dense); an
            adopted layer keeps the user's router here.
        weights: the experts' weights to use instead of new ones (an adopted layer's):
            ``(w1, b1, w2, b2)`` stacked Parameters w1 [E, H, F], b1 [E, F] or [E, 1, F],
            w2 [E, F, H], b2 [E, H] or [E, 1, H]; or four tuples of E per-expert Parameters in
            nn.Dense layout (w1_e [F, H], b1_e [F], w2_e [H, F], b2_e [H]). Biases are None
            when ``has_bias=False``.

    Outputs:
        y_BSH: float [B, S, H].
        aux_loss: Switch-Transformer load-balancing loss E * sum_e f_e * p_e, where f_e is the
            fraction of assignments routed to e and p_e the mean router probability of e
            (Fedus et al. 2021, eq. 4, with top-k assignments counted k times).
        counts_RE: int32 [R, E], assignments each group routed to each expert (before drops);
            also kept in the ``routing_counts`` buffer for training-loop callbacks.
        dropped: int32 scalar, assignments that found no free slot.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int, top_k: int,
                 capacity: Union[int, Sequence[int]], trace_ranks: int = 1,
                 init_std: float = 0.02, dispatch: str = "static",
                 activation: Optional[nn.Cell] = None, renormalize: bool = True,
                 has_bias: bool = True, router: Optional[nn.Cell] = None,
                 weights: Optional[tuple] = None, expert_kind: str = "mlp",
                 up_weights: Optional[tuple] = None, shared: Optional[nn.Cell] = None,
                 router_config: Optional[RouterConfig] = None,
                 expert_bias: Optional[Parameter] = None):
        super().__init__()
        if expert_kind not in EXPERT_KINDS:
            raise ValueError(f"'expert_kind' must be one of {list(EXPERT_KINDS)}, but got "
                             f"{expert_kind!r}.")
        if up_weights is not None and expert_kind != "glu":
            raise ValueError("'up_weights' (a separate up projection) needs expert_kind="
                             "'glu'.")
        self.expert_kind = expert_kind
        self.gated = expert_kind == "glu"
        if dispatch not in LAYER_DISPATCH:
            raise ValueError(f"'dispatch' must be one of {list(LAYER_DISPATCH)}, but got "
                             f"{dispatch!r}.")
        self.dispatch = dispatch
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.num_experts = num_experts
        self.top_k = top_k
        if dispatch == "grouped":
            self.permute = MoeTokenPermute()
            self.gmm = GroupedMatmul()
            self.unpermute = MoeTokenUnpermute()
            self.capacities = ()
            self.num_slots = 0
        else:
            self.set_capacities(capacity)
        self.trace_ranks = trace_ranks
        e, h, f = num_experts, hidden_size, ffn_hidden_size
        self.router = router if router is not None else nn.Dense(
            h, e, has_bias=False, weight_init=Normal(init_std))
        self.has_bias = bool(has_bias)
        # per_expert: the weights are E separate Dense-layout Parameters, stacked every step
        self.per_expert = weights is not None and isinstance(weights[0], (tuple, list))
        if weights is None:
            normal, zeros = Normal(init_std), "zeros"
            f1 = 2 * f if self.gated else f                    # fused [w_gate | w_up]
            weights = tuple(Parameter(initializer(init, shape, ms.float32), name=name)
                            for init, shape, name in ((normal, (e, h, f1), "w1"),
                                                      (zeros, (e, 1, f1), "b1"),
                                                      (normal, (e, f, h), "w2"),
                                                      (zeros, (e, 1, h), "b2")))
        wrap = ParameterTuple if self.per_expert else (lambda p: p)
        for name, value in zip(("w1", "b1", "w2", "b2"), weights):   # checkpoint order
            if self.has_bias or name[0] == "w":
                setattr(self, name, wrap(value))
        self.separate_up = up_weights is not None
        if self.separate_up:
            for name, value in zip(("w3", "b3"), up_weights):
                if self.has_bias or name[0] == "w":
                    setattr(self, name, wrap(value))
        self.bmm = ops.BatchMatMul()
        if activation is None:
            activation = nn.SiLU() if self.gated else make_gelu()
        self.activation = GatedActivation(activation) if self.gated else activation
        self.shared = shared
        self.router_config = router_config
        set_routing(self, num_experts, top_k, renormalize, router_config, expert_bias)
        self.routing_counts = routing_counts_buffer(trace_ranks, num_experts)

    def expert_tables(self):
        """The experts' weights as stacked tables: (w1 [E, H, F], b1 [E, 1, F], w2 [E, F, H],
        b2 [E, 1, H]), or (w1, w2) for a layer without biases. Stacked Parameters are used as
        they are (biases of shape [E, F] / [E, H] reshaped); per-expert weights (Dense layout:
        w1_e [F, H], b1_e [F], w2_e [H, F], b2_e [H], see ``weights``) are stacked and
        transposed on every forward, so their gradients reach each expert's Parameters."""
        e, h = self.num_experts, self.hidden_size
        f1 = 2 * self.ffn_hidden_size if self.gated else self.ffn_hidden_size
        if self.per_expert:
            w1 = ops.stack(self.w1).transpose(0, 2, 1)
            w2 = ops.stack(self.w2).transpose(0, 2, 1)
        else:
            w1, w2 = self.w1, self.w2
        if self.separate_up:                 # [gate | up]: the fused table of a gated expert
            w3 = ops.stack(self.w3).transpose(0, 2, 1) if self.per_expert else self.w3
            w1 = ops.concat((w1, w3), 2)
        if not self.has_bias:
            return w1, w2
        if self.per_expert:
            b1, b2 = ops.stack(self.b1), ops.stack(self.b2)
        else:
            b1, b2 = self.b1, self.b2
        if self.separate_up:
            b3 = ops.stack(self.b3) if self.per_expert else self.b3
            b1 = ops.concat((b1.reshape(e, 1, -1), b3.reshape(e, 1, -1)), 2)
        return w1, b1.reshape(e, 1, f1), w2, b2.reshape(e, 1, h)

    def construct(self, x):
        if self.dispatch == "grouped":
            return self._grouped(x)
        b, s, h = x.shape
        t = b * s
        k, n = self.top_k, self.num_slots
        x_TH = x.reshape(t, h)

        # Steps 1-2: route top-k, then the slot of every assignment (A = K*T, k-major):
        # its expert's offset plus its arrival position, if that is within the capacity.
        probs_TE, weights_TK, expert_ids_A, onehot_AE, position_A = self._route(x_TH)
        keep_A = position_A < ops.gather(self.cap_E, expert_ids_A, 0)
        dummy = n                                                          # the zero row
        slot_A = ops.select(keep_A, ops.gather(self.off_E, expert_ids_A, 0) + position_A,
                            ops.fill(ms.int32, (k * t,), dummy))

        # Step 3: dispatch: token index held by every slot (T = empty slot -> zero row).
        token_A = ops.tile(ops.arange(t, dtype=ms.int32), (k,))
        slot_token = ops.fill(ms.int32, (n + 1,), t)
        slot_token = ops.tensor_scatter_update(slot_token, slot_A.reshape(-1, 1), token_A)
        x_pad = ops.concat((x_TH, ops.zeros((1, h), x_TH.dtype)), 0)

        # Step 4: experts on their own slot rows, gathered group by group.
        expert_out_NH = self._experts(x_pad, slot_token)

        # Step 5: combine: every assignment reads its slot back, weighted; drops read zeros.
        out_pad = ops.concat((expert_out_NH, ops.zeros((1, h), expert_out_NH.dtype)), 0)
        gate_A = weights_TK.transpose(1, 0).reshape(-1) * keep_A.astype(ms.float32)
        y_AH = ops.gather(out_pad, slot_A, 0) * gate_A.reshape(-1, 1).astype(x.dtype)
        y_TH = sum_choices(y_AH, k, t)
        if self.shared is not None:
            y_TH = y_TH + self.shared(x_TH)

        # Step 6: statistics: load-balancing loss, per-group counts, drops.
        aux_loss, counts_RE = routing_statistics(probs_TE, onehot_AE, k, self.trace_ranks)
        ops.assign(self.routing_counts, counts_RE)
        dropped = (k * t - keep_A.astype(ms.int32).sum()).astype(ms.int32)
        return y_TH.reshape(b, s, h), aux_loss, counts_RE, dropped

    def _route(self, x_TH):
        """The router's logits through the top-k rule; with the expert bias, select with it,
        then (training only) assign its update from this forward's counts."""
        logits_TE = self.router(x_TH)
        if not self.uses_bias:
            return self.arrival(logits_TE)
        routed = self.arrival(logits_TE, self.expert_bias)
        if self.training:
            counts_E = routed[3].sum(axis=0)
            ops.assign(self.expert_bias, updated_bias(self.expert_bias, counts_E,
                                                      self.bias_speed))
        return routed

    def _grouped(self, x):
        """The padding-free path: permute by expert, the expert FFNs as two grouped matmuls
        over all N = T*K rows (group sizes = per-expert counts), combine. Same outputs as
        ``construct``'s static path. An expert with no row is an empty group: it computes
        nothing and gets zero gradients."""
        b, s, h = x.shape
        t = b * s
        k, e = self.top_k, self.num_experts
        x_TH = x.reshape(t, h)
        probs_TE, weights_TK, expert_ids_A, onehot_AE, _ = self._route(x_TH)
        # Step 1: rows sorted by expert (t-major assignments a = t*K + k, stable)
        expert_ids_TK = expert_ids_A.reshape(k, t).transpose(1, 0)
        x_NH, rows_N = self.permute(x_TH, expert_ids_TK)
        sizes_E = onehot_AE.sum(axis=0).astype(ms.int32)
        expert_N = row_groups(sizes_E, t * k)
        # Step 2: expert FFNs on their own rows, biases gathered by each row's expert
        tables = self.expert_tables()
        hidden_NF = self.gmm(x_NH, tables[0], sizes_E)
        if self.has_bias:
            hidden_NF = hidden_NF + ops.gather(tables[1].reshape(e, -1), expert_N, 0)
        y_NH = self.gmm(self.activation(hidden_NF), tables[2 if self.has_bias else 1], sizes_E)
        if self.has_bias:
            y_NH = y_NH + ops.gather(tables[3].reshape(e, h), expert_N, 0)
        # Step 3: combine: out[t] = sum_k weights_TK[t, k] * y_NH[row of (t, k)]
        y_TH = self.unpermute(y_NH, rows_N, weights_TK.astype(y_NH.dtype))
        if self.shared is not None:
            y_TH = y_TH + self.shared(x_TH)
        aux_loss, counts_RE = routing_statistics(probs_TE, onehot_AE, k, self.trace_ranks)
        ops.assign(self.routing_counts, counts_RE)
        return y_TH.reshape(b, s, h), aux_loss, counts_RE, ops.zeros((), ms.int32)

    def set_capacities(self, capacity: Union[int, Sequence[int]]) -> None:
        """Set the static capacity of every expert (an int, or E ints >= 1).

        Slot rows are laid out by capacity group (experts of equal capacity side by side), so
        every group runs as one batched matmul. Takes effect when the network is next
        compiled: a jitted step function built before the change keeps its old graph, so
        rebuild it (the trainer does). A ``dispatch="grouped"`` layer has no capacities.
        """
        if self.dispatch == "grouped":
            raise ValueError("a dispatch='grouped' MoE layer has no capacities to set; "
                             "build it with dispatch='static' to plan capacities.")
        caps = _capacities(capacity, self.num_experts)
        self.capacities = caps
        # groups: (capacity, experts with that capacity), largest capacity first
        groups = {}
        for e, c in enumerate(caps):
            groups.setdefault(c, []).append(e)
        self.groups = tuple((c, tuple(es)) for c, es in sorted(groups.items(), reverse=True))
        self.group_members = tuple(es for _, es in self.groups)
        order = [e for _, es in self.groups for e in es]
        offsets = np.zeros(self.num_experts, np.int64)
        offsets[order] = np.cumsum([0] + [caps[e] for e in order[:-1]])
        self.offsets = tuple(int(v) for v in offsets)
        self.num_slots = sum(caps)
        self.cap_E = Tensor(np.array(caps, np.int32))
        self.off_E = Tensor(np.array(self.offsets, np.int32))

    def _experts(self, x_pad, slot_token):
        """Expert FFNs on the slot rows -> [N, H] (N = sum of capacities).

        x_pad: [T + 1, H] tokens and a zero row (index T); slot_token: int32 [N + 1], the token
        each slot holds (T when empty). One batched matmul per capacity group: the group's
        rows gathered straight from the tokens as [g, c, H] (slicing an [N, H] buffer instead
        costs a copy the CPU backend does slowly) against its experts' weights [g, H, F]
        (:func:`group_tables`).
        """
        weights = group_tables(self.expert_tables(), self.group_members, self.num_experts)
        outs = ()
        start = 0
        for gi in range(len(self.groups)):
            c, experts = self.groups[gi]
            g = len(experts)
            rows = ops.gather(x_pad, slot_token[start:start + g * c], 0).reshape(g, c, -1)
            start = start + g * c
            tables = weights[gi]
            hid = self.bmm(rows, tables[0])
            if self.has_bias:
                hid = hid + tables[1]
            out = self.bmm(self.activation(hid), tables[2 if self.has_bias else 1])
            if self.has_bias:
                out = out + tables[3]
            outs = outs + (out.reshape(g * c, -1),)
        if len(outs) == 1:
            return outs[0]
        return ops.concat(outs, 0)


def _capacities(capacity: Union[int, Sequence[int]], num_experts: int) -> Tuple[int, ...]:
    if isinstance(capacity, (int, np.integer)):
        caps = (int(capacity),) * num_experts
    else:
        caps = tuple(int(c) for c in capacity)
        if len(caps) != num_experts:
            raise ValueError(f"'capacity' must give one value per expert ({num_experts}), "
                             f"but got {len(caps)}.")
    if min(caps) < 1:
        raise ValueError(f"every expert capacity must be >= 1, but got {list(caps)}.")
    return caps

