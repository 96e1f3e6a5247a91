"""GPT-style decoder with Mixture-of-Experts feed-forward layers (the reference network).

Pre-LayerNorm blocks (Radford et al. 2019): x + Attn(LN(x)), then x + FFN(LN(x)), where FFN is
a :class:`~ms_efficient.moe.layer.MoEFeedForward` in every ``moe_every``-th block and a dense
FFN elsewhere. Learned positions, tied input/output embeddings, byte-level vocabulary.
With ``plans`` (one :class:`~ms_efficient.moe.balance.BalancedSpec` per MoE block) the MoE FFNs
are :class:`~ms_efficient.moe.balanced_ep.BalancedExpertParallelMoE` layers instead, each
holding this rank's experts (an expert-parallel run: ``ms_efficient.train.expert_parallel``),
and the load-balancing loss is that of every rank's tokens (:class:`GlobalRouterAux`), as in
one process.
"""
from __future__ import annotations

import math

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Normal, initializer

from ms_efficient.core.config import ModelConfig, MoEConfig
from ms_efficient.models.dropout import StepDropout
from ms_efficient.moe.balance import BalancedSpec
from ms_efficient.moe.balanced_ep import BalancedExpertParallelMoE
from ms_efficient.moe.layer import MoEFeedForward, TopKArrival, make_gelu
from ms_efficient.moe.experts import SharedExpert
from ms_efficient.moe.split import switch_capacity

__all__ = ["GPTMoE", "CausalSelfAttention", "DenseFeedForward", "Block", "GlobalRouterAux",
           "build_model"]


class CausalSelfAttention(nn.Cell):
    """Multi-head causal self-attention: x_BSH -> y_BSH."""

    def __init__(self, hidden_size: int, num_heads: int, seq_length: int, init_std: float):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.qkv = nn.Dense(hidden_size, 3 * hidden_size, weight_init=Normal(init_std))
        self.proj = nn.Dense(hidden_size, hidden_size, weight_init=Normal(init_std))
        self.bmm_qk = ops.BatchMatMul(transpose_b=True)
        self.bmm_pv = ops.BatchMatMul()
        self.softmax = nn.Softmax(axis=-1)
        self.scale = 1.0 / math.sqrt(self.head_dim)
        mask = np.triu(np.full((seq_length, seq_length), -1e9, dtype=np.float32), k=1)
        self.mask_SS = Tensor(mask)

    def construct(self, x):
        b, s, h = x.shape
        nh, hd = self.num_heads, self.head_dim
        # split before the head transpose: three [B*S, H] blocks, not strided slices of
        # [3, B, nh, S, hd] (which the CPU backend copies slowly)
        q, k, v = ops.split(self.qkv(x.reshape(b * s, h)), h, -1)
        q = q.reshape(b, s, nh, hd).transpose(0, 2, 1, 3)                # [B, nh, S, hd]
        k = k.reshape(b, s, nh, hd).transpose(0, 2, 1, 3)
        v = v.reshape(b, s, nh, hd).transpose(0, 2, 1, 3)
        scores = self.bmm_qk(q, k) * self.scale + self.mask_SS[:s, :s]
        y = self.bmm_pv(self.softmax(scores), v)                          # [B, nh, S, hd]
        y = y.transpose(0, 2, 1, 3).reshape(b * s, h)
        return self.proj(y).reshape(b, s, h)


class DenseFeedForward(nn.Cell):
    """Dense FFN gelu(x W1 + b1) W2 + b2, returning the same 4-tuple as the MoE FFN."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int,
                 trace_ranks: int, init_std: float):
        super().__init__()
        self.fc1 = nn.Dense(hidden_size, ffn_hidden_size, weight_init=Normal(init_std))
        self.fc2 = nn.Dense(ffn_hidden_size, hidden_size, weight_init=Normal(init_std))
        self.gelu = make_gelu()
        self.zero_counts = Tensor(np.zeros((trace_ranks, num_experts), np.int32))

    def construct(self, x):
        b, s, h = x.shape
        y = self.fc2(self.gelu(self.fc1(x.reshape(b * s, h)))).reshape(b, s, h)
        return y, ops.zeros((), ms.float32), self.zero_counts, ops.zeros((), ms.int32)


class GlobalRouterAux(nn.Cell):
    """``construct(x_BSH, router_EH) -> aux``: the Switch load-balancing loss E sum_e f_e p_e
    of the tokens of ALL ranks (f_e: fraction of the top-k assignments to e, p_e: mean router
    probability of e, both averaged over the W ranks' equal token counts by one AllReduce of
    [2, E]), recomputed from this rank's tokens and router weights as the MoE layer routes
    them. An expert-parallel layer returns the loss of its own tokens; this makes the
    expert-parallel run optimise the one-process objective. Its backward AllReduces the
    gradient of the mean probabilities, so every rank's router gets the global term's
    gradient through its own tokens."""

    def __init__(self, num_experts: int, top_k: int, world: int):
        super().__init__()
        self.num_experts, self.world = num_experts, world
        self.arrival = TopKArrival(num_experts, top_k)
        self.all_reduce = ops.AllReduce(op=ops.ReduceOp.SUM)

    def construct(self, x, router):
        b, s, h = x.shape
        probs_TE, _, _, onehot_AE, _ = self.arrival(ops.matmul(x.reshape(b * s, h),
                                                               router.transpose(1, 0)))
        fp = ops.stack((ops.stop_gradient(onehot_AE.mean(axis=0)), probs_TE.mean(axis=0)))
        fp = self.all_reduce(fp) / self.world
        return self.num_experts * (fp[0] * fp[1]).sum()


class Block(nn.Cell):
    """Pre-LN transformer block: ``construct(x) -> (x, aux_loss, counts_RE, dropped)``;
    ``aux`` (a :class:`GlobalRouterAux`) replaces the FFN's load-balancing loss.

    With ``dropout`` > 0 the attention and FFN outputs go through a
    :class:`~ms_efficient.models.dropout.StepDropout` each (sites 0 and 1 of block ``index``),
    whose masks are a function of (``dropout_seed``, the step the trainer writes, block, site,
    global sample = ``sample_offset`` + row, position, channel): no random state, so a resumed
    or resized run and the one-process run draw the same masks. ``dropout`` 0: identities."""

    def __init__(self, hidden_size: int, num_heads: int, seq_length: int, ffn: nn.Cell,
                 init_std: float, dropout: float, aux=None, index: int = 0,
                 dropout_seed: int = 0, sample_offset: int = 0):
        super().__init__()
        self.ln1 = nn.LayerNorm((hidden_size,))
        self.attn = CausalSelfAttention(hidden_size, num_heads, seq_length, init_std)
        self.ln2 = nn.LayerNorm((hidden_size,))
        self.ffn = ffn
        self.aux = aux
        if dropout > 0:
            self.dropout = StepDropout(dropout, dropout_seed, index, 0, sample_offset)
            self.ffn_dropout = StepDropout(dropout, dropout_seed, index, 1, sample_offset)
        else:
            self.dropout = nn.Identity()
            self.ffn_dropout = nn.Identity()

    def construct(self, x):
        x = x + self.dropout(self.attn(self.ln1(x)))
        h = self.ln2(x)
        y, aux, counts, dropped = self.ffn(h)
        if self.aux is not None:
            aux = self.aux(h, self.ffn.router.weight)
        return x + self.ffn_dropout(y), aux, counts, dropped


class GPTMoE(nn.Cell):
    """Decoder-only LM: ``construct(tokens_BS, targets_BS) -> (loss, ce_loss, counts, dropped)``.

    loss = cross-entropy + aux_loss_coef * mean aux loss of the MoE blocks (a scalar).
    counts: int32 [L, R, E], assignments per block, trace group and expert (zero rows for
        dense blocks; ``moe_index`` lists the MoE blocks).
    dropped: int32 [L], assignments dropped per block.
    dropout_seed, sample_offset: of the blocks' dropout (``model.dropout`` > 0; see
        :class:`Block`): the run's seed and the global index of this process's first row.
    """

    def __init__(self, model: ModelConfig, moe: MoEConfig, batch_size: int,
                 trace_ranks: int = 1, plans=None,
                 dropout_seed: int = 0, sample_offset: int = 0):
        super().__init__()
        if batch_size % trace_ranks:
            raise ValueError(f"'train.batch_size' ({batch_size}) must be a multiple of "
                             f"'moe.trace_ranks' ({trace_ranks}).")
        std = 0.02
        h, tokens = model.hidden_size, batch_size * model.seq_length
        self.vocab_size = model.vocab_size
        self.aux_loss_coef = moe.aux_loss_coef
        self.embed = nn.Embedding(model.vocab_size, h, embedding_table=Normal(std))
        self.pos = Parameter(initializer(Normal(std), (1, model.seq_length, h), ms.float32),
                             name="pos_embedding")
        capacity = switch_capacity(tokens, moe.num_experts, moe.top_k, moe.capacity_factor,
                                   moe.capacity_multiple)
        blocks = []
        moe_layers = []
        num_moe = sum((i + 1) % moe.moe_every == 0 for i in range(model.num_layers))
        if plans is not None and (len(plans) != num_moe or not all(
                isinstance(p, BalancedSpec) for p in plans)):
            raise ValueError(f"'plans' must give one BalancedSpec per MoE block ({num_moe}), "
                             f"but got {[type(p).__name__ for p in plans]}.")
        for i in range(model.num_layers):
            shared = (SharedExpert(h, moe.shared_experts * model.ffn_hidden_size,
                                   kind=moe.expert_kind, init_std=std)
                      if moe.shared_experts and (i + 1) % moe.moe_every == 0 else None)
            if (i + 1) % moe.moe_every == 0 and plans is not None:
                ffn = BalancedExpertParallelMoE.from_spec(
                    h, model.ffn_hidden_size, moe.num_experts, moe.top_k,
                    plans[len(moe_layers)], trace_ranks=trace_ranks, init_std=std,
                    seed=len(moe_layers), fast_level=moe.fast_level,
                    expert_kind=moe.expert_kind, shared=shared)
                moe_layers.append(i)
            elif (i + 1) % moe.moe_every == 0:
                ffn = MoEFeedForward(h, model.ffn_hidden_size, moe.num_experts, moe.top_k,
                                     capacity, trace_ranks, std,
                                     dispatch=moe.layer_dispatch,
                                     expert_kind=moe.expert_kind, shared=shared)
                moe_layers.append(i)
            else:
                ffn = DenseFeedForward(h, model.ffn_hidden_size, moe.num_experts, trace_ranks,
                                       std)
            aux = (GlobalRouterAux(moe.num_experts, moe.top_k, ffn.world)
                   if isinstance(ffn, BalancedExpertParallelMoE) and ffn.world > 1 else None)
            blocks.append(Block(h, model.num_heads, model.seq_length, ffn, std, model.dropout,
                                aux, i, dropout_seed, sample_offset))
        self.blocks = nn.CellList(blocks)
        self.moe_index = tuple(moe_layers)
        self.num_moe = max(1, len(moe_layers))
        self.ln_f = nn.LayerNorm((h,))
        self.ce = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
        self.matmul_t = ops.MatMul(transpose_b=True)

    def logits(self, tokens):
        """tokens_BS int32 -> (logits [B*S, V], aux_sum, counts [L, R, E], dropped [L])."""
        b, s = tokens.shape
        x = self.embed(tokens) + self.pos[:, :s, :]
        aux_sum = ops.zeros((), ms.float32)
        counts = ()
        dropped = ()
        for block in self.blocks:
            x, aux, c, d = block(x)
            aux_sum = aux_sum + aux
            counts = counts + (c,)
            dropped = dropped + (d,)
        x = self.ln_f(x).reshape(b * s, -1)
        logits = self.matmul_t(x, self.embed.embedding_table)
        return logits, aux_sum, ops.stack(counts), ops.stack(dropped)

    def construct(self, tokens, targets):
        logits, aux_sum, counts, dropped = self.logits(tokens)
        ce = self.ce(logits, targets.reshape(-1))
        loss = ce + self.aux_loss_coef * aux_sum / self.num_moe
        return loss, ce, counts, dropped


def build_model(model: ModelConfig, moe: MoEConfig, batch_size: int, plans=None,
                dropout_seed: int = 0, sample_offset: int = 0) -> GPTMoE:
    """The reference network for a config (float32 master weights).

    plans: None for the one-process network (``MoEFeedForward``, ``moe.trace_ranks`` trace
    groups); else one ``BalancedSpec`` per MoE block: ``BalancedExpertParallelMoE`` layers
    (the two-level EfficientMoE) over the initialised world group (``batch_size`` is then
    this rank's batch, one trace group per rank). Their initial weights come from
    ``init_expert_weights``; load the one-process network's with ``set_weights`` to start
    from the same point (``ms_efficient.train.expert_parallel`` does).
    dropout_seed (``context.seed``) and sample_offset (rank x ``batch_size``; 0 in one
    process) fix the dropout masks (``model.dropout`` > 0): the trainers pass them, and write
    the step before each train step (:func:`~ms_efficient.models.dropout.set_dropout_step`)."""
    if plans is None:
        return GPTMoE(model, moe, batch_size, moe.trace_ranks, dropout_seed=dropout_seed,
                      sample_offset=sample_offset)
    return GPTMoE(model, moe, batch_size, 1, plans, dropout_seed, sample_offset)
