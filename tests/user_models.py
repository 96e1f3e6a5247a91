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
    def __init__(self, hidden_size: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.q_proj = nn.Dense(hidden_size, hidden_size, has_bias=False)
        self.k_proj = nn.Dense(hidden_size, hidden_size, has_bias=False)
        self.v_proj = nn.Dense(hidden_size, hidden_size, has_bias=False)
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
    def __init__(self, hidden_size, num_heads, intermediate_size, moe=None):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size)
        self.self_attn = LlamaAttention(hidden_size, num_heads)
        self.post_attention_layernorm = RMSNorm(hidden_size)
        self.mlp = (LlamaMLP(hidden_size, intermediate_size) if moe is None
                    else MoEMLP(hidden_size, intermediate_size, **moe))

    def construct(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Cell):
    def __init__(self, vocab_size, hidden_size, num_heads, intermediate_size, num_layers,
                 moe=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size, embedding_table=Normal(0.02))
        self.layers = nn.CellList([LlamaDecoderLayer(hidden_size, num_heads, intermediate_size,
                                                     moe) for _ in range(num_layers)])
        self.norm = RMSNorm(hidden_size)

    def construct(self, input_ids):
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class LlamaForCausalLM(nn.Cell):
    """``construct(input_ids [B, S] int32) -> logits [B * S, V]`` (flattened for the loss)."""

    def __init__(self, vocab_size=64, hidden_size=32, num_heads=4, intermediate_size=64,
                 num_layers=2, moe=None):
        super().__init__()
        self.model = LlamaModel(vocab_size, hidden_size, num_heads, intermediate_size,
                                num_layers, moe)
        self.lm_head = nn.Dense(hidden_size, vocab_size, has_bias=False)
        self.vocab_size = vocab_size

    def construct(self, input_ids):
        logits = self.lm_head(self.model(input_ids))
        return ops.reshape(logits, (-1, self.vocab_size))


def llama_with_loss(moe=None, num_layers=2, seed=0, batch=2):
    """(``nn.WithLossCell(LlamaForCausalLM, CrossEntropy)``, sample inputs (ids, labels))."""
    ms.set_seed(seed)
    net = LlamaForCausalLM(num_layers=num_layers, moe=moe)
    loss = nn.CrossEntropyLoss()
    rng = np.random.default_rng(seed)
    ids = ms.Tensor(rng.integers(0, 64, (batch, 16)).astype(np.int32))
    labels = ms.Tensor(rng.integers(0, 64, (batch * 16,)).astype(np.int32))
    return nn.WithLossCell(net, loss), (ids, labels)
