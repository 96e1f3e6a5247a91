"""Networks the package did not write, for the tests of ``ms_efficient.optimize`` on a user's
network: a LLaMA-shaped decoder with the Cell names of HF / MindFormers checkpoints
(``model.layers.N.self_attn.q_proj``, ``mlp.up_proj``, ``input_layernorm``), optionally with the
package's MoE layer in place of its MLP. Written here from the LLaMA paper's description
(pre-norm RMSNorm, SwiGLU MLP, no biases); rotary embeddings are left out (they change no
shape and no Cell name)."""
import numpy as np

import mindspore as ms
from mindspore import Parameter, nn, ops
from mindspore.common.initializer import Normal, initializer


class RMSNorm(nn.Cell):
    """x / rms(x) * weight over the last axis."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = Parameter(initializer("ones", (hidden_size,), ms.float32), name="weight")
        self.eps = eps

    def construct(self, x):
        var = ops.mean(x * x, axis=-1, keep_dims=True)
        return x * ops.rsqrt(var + self.eps) * self.weight


class LlamaAttention(nn.Cell):
    """Multi-head attention of [B, S, H]; ``bias``: q/k/v projections with biases (Qwen2's
    ``attention_bias``), o_proj without."""

    def __init__(self, hidden_size: int, num_heads: int, bias: bool = False):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.q_proj = nn.Dense(hidden_size, hidden_size, has_bias=bias)
        self.k_proj = nn.Dense(hidden_size, hidden_size, has_bias=bias)
        self.v_proj = nn.Dense(hidden_size, hidden_size, has_bias=bias)
        self.o_proj = nn.Dense(hidden_size, hidden_size, has_bias=False)
        self.softmax = nn.Softmax(axis=-1)
        self.scale = 1.0 / float(np.sqrt(self.head_dim))

    def _heads(self, x, b, s):
        return ops.transpose(ops.reshape(x, (b, s, self.num_heads, self.head_dim)), (0, 2, 1, 3))

    def construct(self, x):
        b, s, h = x.shape
        q = self._heads(self.q_proj(x), b, s)
        k = self._heads(self.k_proj(x), b, s)
        v = self._heads(self.v_proj(x), b, s)
        scores = ops.matmul(q, ops.transpose(k, (0, 1, 3, 2))) * self.scale
        ctx = ops.matmul(self.softmax(scores), v)
        return self.o_proj(ops.reshape(ops.transpose(ctx, (0, 2, 1, 3)), (b, s, h)))


class LlamaMLP(nn.Cell):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Dense(hidden_size, intermediate_size, has_bias=False)
        self.up_proj = nn.Dense(hidden_size, intermediate_size, has_bias=False)
        self.down_proj = nn.Dense(intermediate_size, hidden_size, has_bias=False)
        self.silu = nn.SiLU()

    def construct(self, x):
        return self.down_proj(self.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEMLP(nn.Cell):
    """The package's MoE layer where the MLP was: returns only its output (the user's block
    ignores the auxiliary outputs, as a user's would)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 capacity: int):
        super().__init__()
        from ms_efficient.moe.layer import MoEFeedForward

        self.experts = MoEFeedForward(hidden_size, intermediate_size, num_experts, top_k,
                                      capacity)

    def construct(self, x):
        y, _, _, _ = self.experts(x)
        return y


class LlamaDecoderLayer(nn.Cell):
    def __init__(self, hidden_size, num_heads, intermediate_size, moe=None, bias=False):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size)
        self.self_attn = LlamaAttention(hidden_size, num_heads, bias)
        self.post_attention_layernorm = RMSNorm(hidden_size)
        self.mlp = (LlamaMLP(hidden_size, intermediate_size) if moe is None
                    else MoEMLP(hidden_size, intermediate_size, **moe))

    def construct(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Cell):
    def __init__(self, vocab_size, hidden_size, num_heads, intermediate_size, num_layers,
                 moe=None, bias=False):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size, embedding_table=Normal(0.02))
        self.layers = nn.CellList([LlamaDecoderLayer(hidden_size, num_heads, intermediate_size,
                                                     moe, bias) for _ in range(num_layers)])
        self.norm = RMSNorm(hidden_size)

    def construct(self, input_ids):
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class LlamaForCausalLM(nn.Cell):
    """``construct(input_ids [B, S] int32) -> logits [B * S, V]`` (flattened for the loss).
    ``bias``: the attention's q/k/v projections with biases (Qwen2-style)."""

    def __init__(self, vocab_size=64, hidden_size=32, num_heads=4, intermediate_size=64,
                 num_layers=2, moe=None, bias=False):
        super().__init__()
        self.model = LlamaModel(vocab_size, hidden_size, num_heads, intermediate_size,
                                num_layers, moe, bias)
        self.lm_head = nn.Dense(hidden_size, vocab_size, has_bias=False)
        self.vocab_size = vocab_size

    def construct(self, input_ids):
        logits = self.lm_head(self.model(input_ids))
        return ops.reshape(logits, (-1, self.vocab_size))


def llama_with_loss(moe=None, num_layers=2, seed=0, batch=2, bias=False):
    """(``nn.WithLossCell(LlamaForCausalLM, CrossEntropy)``, sample inputs (ids [batch, 16],
    labels [batch * 16])); ``bias``: q/k/v projections with biases."""
    ms.set_seed(seed)
    net = LlamaForCausalLM(num_layers=num_layers, moe=moe, bias=bias)
    loss = nn.CrossEntropyLoss()
    rng = np.random.default_rng(seed)
    ids = ms.Tensor(rng.integers(0, 64, (batch, 16)).astype(np.int32))
    labels = ms.Tensor(rng.integers(0, 64, (batch * 16,)).astype(np.int32))
    return nn.WithLossCell(net, loss), (ids, labels)


def wide_llama_with_loss(layers=6, batch=8, seq=32):
    """A wider LLaMA (hidden 128, 4 heads, FFN 256) with loss and inputs (ids [batch, seq],
    labels [batch * seq]): big enough that pipelining and sharding pay on the presets."""
    ms.set_seed(0)
    net = LlamaForCausalLM(vocab_size=64, hidden_size=128, num_heads=4, intermediate_size=256,
                           num_layers=layers)
    rng = np.random.default_rng(0)
    ids = ms.Tensor(rng.integers(0, 64, (batch, seq)).astype(np.int32))
    labels = ms.Tensor(rng.integers(0, 64, (batch * seq,)).astype(np.int32))
    return nn.WithLossCell(net, nn.CrossEntropyLoss()), (ids, labels)


class NormMLP(nn.Cell):
    """An everyday block of MindSpore's own Cells: nn.LayerNorm, nn.Dense (with bias),
    nn.GELU, nn.Dense."""

    def __init__(self, hidden):
        super().__init__()
        self.norm = nn.LayerNorm((hidden,))
        self.fc1 = nn.Dense(hidden, 2 * hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Dense(2 * hidden, hidden)

    def construct(self, x):
        return self.fc2(self.act(self.fc1(self.norm(x))))


class EmbedNormDense(nn.Cell):
    """nn.Embedding, 4 residual NormMLP blocks, a final nn.LayerNorm and an nn.Dense head."""

    def __init__(self, vocab=128, hidden=64, layers=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.blocks = nn.CellList([NormMLP(hidden) for _ in range(layers)])
        self.norm = nn.LayerNorm((hidden,))
        self.head = nn.Dense(hidden, vocab)
        self.vocab = vocab

    def construct(self, ids):
        x = self.emb(ids)
        for block in self.blocks:
            x = x + block(x)
        return ops.reshape(self.head(self.norm(x)), (-1, self.vocab))


def embed_norm_dense_with_loss(batch=8, seq=32):
    """(``nn.WithLossCell(EmbedNormDense, CrossEntropy)``, (ids [batch, seq], labels))."""
    ms.set_seed(0)
    rng = np.random.default_rng(0)
    ids = ms.Tensor(rng.integers(0, 128, (batch, seq)).astype(np.int32))
    labels = ms.Tensor(rng.integers(0, 128, (batch * seq,)).astype(np.int32))
    return nn.WithLossCell(EmbedNormDense(), nn.CrossEntropyLoss()), (ids, labels)


class PatchEncoder(nn.Cell):
    """ViT-like: patches [B, P, 48] -> Dense -> nn.TransformerEncoder -> mean -> classifier."""

    def __init__(self, dim=64, layers=4):
        super().__init__()
        self.patch_embed = nn.Dense(48, dim)
        layer = nn.TransformerEncoderLayer(dim, 4, dim_feedforward=2 * dim, dropout=0.0,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.head = nn.Dense(dim, 10)

    def construct(self, x):
        return self.head(ops.mean(self.encoder(self.patch_embed(x)), 1))


def classifier_with_loss(backbone, x, classes=10):
    """(``nn.WithLossCell(backbone, sparse softmax cross-entropy)``, (x, labels [B] int32
    cycling through ``classes``)) for a classifier of inputs ``x`` [B, ...]."""
    y = ms.Tensor(np.arange(x.shape[0], dtype=np.int32) % classes)
    loss = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    return nn.WithLossCell(backbone, loss), (x, y)


# --------------------------------------------------------------------------- user-written MoE
class UserStackedMoE(nn.Cell):
    """A user's own MoE FFN as written without the package: a Dense router ``gate``, stacked
    expert weights w1 [E, H, F], b1 [E, F], w2 [E, F, H], b2 [E, H] (biases unless
    ``bias=False``, as in Mixtral), every expert computed on
    every token and masked by its gate (dense, as simple user code does).

    gating: "topk_softmax" (Mixtral: top-k of the logits, softmax over those k), "renorm"
    (softmax, top-k, renormalised) or "softmax_topk" (softmax, top-k, kept as they are). The
    choice is stored as ``gating``, not under a name ``adopt_moe`` reads, so it is detected.
    act: "gelu" (nn.GELU, tanh form) or "relu_fn" (ops.relu in construct, no Cell)."""

    def __init__(self, hidden_size, ffn_size, num_experts, top_k, gating="topk_softmax",
                 act="gelu", bias=True):
        super().__init__()
        e, h, f = num_experts, hidden_size, ffn_size
        self.gate = nn.Dense(h, e, has_bias=False, weight_init=Normal(0.5))
        self.w1 = Parameter(initializer(Normal(0.2), (e, h, f), ms.float32), name="w1")
        self.w2 = Parameter(initializer(Normal(0.2), (e, f, h), ms.float32), name="w2")
        self.bias = bias
        if bias:
            self.b1 = Parameter(initializer(Normal(0.1), (e, f), ms.float32), name="b1")
            self.b2 = Parameter(initializer(Normal(0.1), (e, h), ms.float32), name="b2")
        self.top_k = top_k
        self.num_experts = num_experts
        self.gating = gating
        self.use_gelu = act == "gelu"
        self.act = nn.GELU()
        self.bmm = ops.BatchMatMul()

    def gates(self, x_TH):
        """[T, E] gate of every expert for every token (zero outside the top k)."""
        logits = self.gate(x_TH)
        if self.gating == "topk_softmax":
            top, ids = ops.topk(logits, self.top_k)
            weights = ops.softmax(top, axis=-1)
        else:
            weights, ids = ops.topk(ops.softmax(logits, axis=-1), self.top_k)
            if self.gating == "renorm":
                weights = weights / weights.sum(axis=-1, keepdims=True)
        onehot = ops.one_hot(ids, self.num_experts, ms.Tensor(1.0, ms.float32),
                             ms.Tensor(0.0, ms.float32))                  # [T, K, E]
        return (onehot * weights.expand_dims(-1)).sum(axis=1)

    def construct(self, x):
        b, s, h = x.shape
        x_TH = x.reshape(b * s, h)
        x_ETH = ops.broadcast_to(x_TH.expand_dims(0), (self.num_experts, b * s, h))
        hid = self.bmm(x_ETH, self.w1)
        if self.bias:
            hid = hid + self.b1.expand_dims(1)
        hid = self.act(hid) if self.use_gelu else ops.relu(hid)
        out_ETH = self.bmm(hid, self.w2)
        if self.bias:
            out_ETH = out_ETH + self.b2.expand_dims(1)
        gates_ET = self.gates(x_TH).transpose(1, 0)
        return (out_ETH * gates_ET.expand_dims(-1)).sum(axis=0).reshape(b, s, h)


class UserListMoE(nn.Cell):
    """A user's own MoE FFN with a CellList of Dense experts (Dense -> ReLU -> Dense) and a
    router Parameter ``router_weight`` [E, H]; softmax -> top-k, renormalised as HF's
    ``norm_topk_prob`` says (an attribute ``adopt_moe`` reads)."""

    def __init__(self, hidden_size, ffn_size, num_experts, top_k, norm_topk_prob=True):
        super().__init__()
        self.router_weight = Parameter(initializer(Normal(0.5), (num_experts, hidden_size),
                                                   ms.float32), name="router_weight")
        self.experts = nn.CellList([nn.SequentialCell([
            nn.Dense(hidden_size, ffn_size, weight_init=Normal(0.2), bias_init=Normal(0.1)),
            nn.ReLU(),
            nn.Dense(ffn_size, hidden_size, weight_init=Normal(0.2), bias_init=Normal(0.1))])
            for _ in range(num_experts)])
        self.num_experts_per_tok = top_k
        self.num_experts = num_experts
        self.norm_topk_prob = norm_topk_prob

    def construct(self, x):
        b, s, h = x.shape
        x_TH = x.reshape(b * s, h)
        probs = ops.softmax(ops.matmul(x_TH, self.router_weight.transpose(1, 0)), axis=-1)
        weights, ids = ops.topk(probs, self.num_experts_per_tok)
        if self.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        y = ops.zeros_like(x_TH)
        for e in range(self.num_experts):
            gate = (weights * (ids == e).astype(ms.float32)).sum(axis=-1, keepdims=True)
            y = y + gate * self.experts[e](x_TH)
        return y.reshape(b, s, h)


class UserMoEDecoderLayer(nn.Cell):
    def __init__(self, hidden_size, num_heads, moe_cell):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size)
        self.self_attn = LlamaAttention(hidden_size, num_heads)
        self.post_attention_layernorm = RMSNorm(hidden_size)
        self.mlp = moe_cell

    def construct(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class UserMoEForCausalLM(nn.Cell):
    """A decoder whose MLPs are the user's own MoE (``UserStackedMoE`` or ``UserListMoE``):
    ``construct(input_ids [B, S] int32) -> logits [B * S, V]``."""

    def __init__(self, kind="stacked", vocab_size=64, hidden_size=16, num_heads=2,
                 ffn_size=24, num_experts=4, top_k=2, num_layers=2, **moe):
        super().__init__()
        cls = UserStackedMoE if kind == "stacked" else UserListMoE
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size, embedding_table=Normal(1.0))
        self.layers = nn.CellList([UserMoEDecoderLayer(
            hidden_size, num_heads, cls(hidden_size, ffn_size, num_experts, top_k, **moe))
            for _ in range(num_layers)])
        self.norm = RMSNorm(hidden_size)
        self.lm_head = nn.Dense(hidden_size, vocab_size, has_bias=False)
        self.vocab_size = vocab_size

    def construct(self, input_ids):
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return ops.reshape(self.lm_head(self.norm(x)), (-1, self.vocab_size))


def user_moe_with_loss(kind="stacked", seed=0, batch=2, seq=8, **moe):
    """(``nn.WithLossCell(UserMoEForCausalLM, CrossEntropy)``, sample inputs (ids, labels))."""
    ms.set_seed(seed)
    net = UserMoEForCausalLM(kind, **moe)
    rng = np.random.default_rng(seed)
    ids = ms.Tensor(rng.integers(0, 64, (batch, seq)).astype(np.int32))
    labels = ms.Tensor(rng.integers(0, 64, (batch * seq,)).astype(np.int32))
    return nn.WithLossCell(net, nn.CrossEntropyLoss()), (ids, labels)


# --------------------------------------------------------------------------- a GPT with MoE
class GPTAttention(nn.Cell):
    """GPT-2's causal self-attention of x [B, S, H]: one fused ``c_attn`` Dense H -> 3H and a
    ``c_proj`` Dense H -> H (both with biases), a fixed causal mask (-1e4 above the
    diagonal, added to the scores)."""

    def __init__(self, hidden_size, num_heads, seq_length):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.c_attn = nn.Dense(hidden_size, 3 * hidden_size)
        self.c_proj = nn.Dense(hidden_size, hidden_size)
        self.softmax = nn.Softmax(axis=-1)
        self.scale = 1.0 / float(np.sqrt(self.head_dim))
        upper = np.triu(np.ones((seq_length, seq_length), np.float32), k=1)
        self.mask = ms.Tensor(-1e4 * upper)

    def construct(self, x):
        b, s, h = x.shape
        qkv = ops.reshape(self.c_attn(x), (b, s, 3, self.num_heads, self.head_dim))
        qkv = ops.transpose(qkv, (2, 0, 3, 1, 4))                      # [3, B, A, S, D]
        q, k, v = qkv[0], qkv[1], qkv[2]
        scores = ops.matmul(q, ops.transpose(k, (0, 1, 3, 2))) * self.scale + self.mask
        ctx = ops.matmul(self.softmax(scores), v)
        return self.c_proj(ops.reshape(ops.transpose(ctx, (0, 2, 1, 3)), (b, s, h)))


class GPTMoEBlock(nn.Cell):
    """Pre-LayerNorm GPT block whose MLP is the user's own ``UserStackedMoE``."""

    def __init__(self, hidden_size, num_heads, seq_length, ffn_size, num_experts, top_k):
        super().__init__()
        self.ln_1 = nn.LayerNorm((hidden_size,))
        self.attn = GPTAttention(hidden_size, num_heads, seq_length)
        self.ln_2 = nn.LayerNorm((hidden_size,))
        self.mlp = UserStackedMoE(hidden_size, ffn_size, num_experts, top_k, gating="renorm")

    def construct(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class UserMoEGPT(nn.Cell):
    """A GPT whose MLPs are MoE blocks its user wrote (``UserStackedMoE``: softmax, top-2,
    renormalised, GELU experts with biases), for ``ms_efficient.adopt_moe``: token and
    learned position embeddings (``nn.Embedding`` each), GPT blocks, a final LayerNorm and
    an LM head. ``construct(input_ids [B, S] int32) -> logits [B * S, V]``."""

    def __init__(self, vocab_size=64, hidden_size=32, num_heads=4, seq_length=16, ffn_size=64,
                 num_experts=4, top_k=2, num_layers=2):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, hidden_size, embedding_table=Normal(0.02))
        self.wpe = nn.Embedding(seq_length, hidden_size, embedding_table=Normal(0.02))
        self.positions = ms.Tensor(np.arange(seq_length, dtype=np.int32).reshape(1, -1))
        self.h = nn.CellList([GPTMoEBlock(hidden_size, num_heads, seq_length, ffn_size,
                                          num_experts, top_k) for _ in range(num_layers)])
        self.ln_f = nn.LayerNorm((hidden_size,))
        self.lm_head = nn.Dense(hidden_size, vocab_size, has_bias=False)
        self.vocab_size = vocab_size

    def construct(self, input_ids):
        x = self.wte(input_ids) + self.wpe(self.positions)
        for block in self.h:
            x = block(x)
        return ops.reshape(self.lm_head(self.ln_f(x)), (-1, self.vocab_size))


def moe_gpt_with_loss(batch=8, seq=16, seed=0):
    """(``nn.WithLossCell(UserMoEGPT, CrossEntropy)``, (ids [batch, seq], labels
    [batch * seq])), the user's MoE blocks not adopted yet."""
    ms.set_seed(seed)
    net = UserMoEGPT(seq_length=seq)
    rng = np.random.default_rng(seed)
    ids = ms.Tensor(rng.integers(0, 64, (batch, seq)).astype(np.int32))
    labels = ms.Tensor(rng.integers(0, 64, (batch * seq,)).astype(np.int32))
    return nn.WithLossCell(net, nn.CrossEntropyLoss()), (ids, labels)
