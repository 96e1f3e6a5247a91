"""Analytic operator lists of GPT-style transformers (dense and MoE) for the sharding planner.

A 96-layer GPT is not exported through MINDIR to be planned: its per-layer operator list is
generated here from its dimensions, with every operator of layer ``i`` tied (``OpSpec.tie``)
to the same operator of the other layers of its kind, so the ILP solves one layer.

Dimension names used throughout (the planner shards by name):
    b batch (sequences), s sequence (t: the key sequence inside attention), h hidden,
    c the q/k/v index (3), a heads, d head dim, f FFN hidden, v vocabulary, e experts,
    k expert capacity slots per sequence.
Per dense layer (pre-LayerNorm, Korthikanti et al. 2022's operator set, no biases):
    ln1 -> qkv -> q,k,v (slices) -> scores (BMM) -> softmax -> attn_drop -> context (BMM)
    -> proj -> drop1 -> add1 -> ln2 -> fc1 -> gelu -> fc2 -> drop2 -> add2
MoE layers replace fc1/gelu/fc2 by router -> gate -> dispatch -> expert_fc1 -> expert_gelu ->
expert_fc2 -> combine (GShard-style capacity slots, top-k routing).
The model adds an embedding gather in front and ln_f -> head -> cross-entropy behind
(untied output head).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Tuple

from ms_efficient.moe.split import switch_capacity
from ms_efficient.shard.strategies import OpSpec, TensorRef

__all__ = ["TransformerDims", "PRESETS", "get_workload", "transformer_ops", "layer_ops"]


@dataclass(frozen=True)
class TransformerDims:
    """Dimensions of a GPT-style decoder; sizes are elements, counts are operators.

    batch: global batch in sequences per step (split by the plan, not per device).
    ffn: FFN hidden size (per expert for MoE layers); 0 means 4 * hidden.
    num_experts: 0 for a dense model. moe_every: every n-th layer is MoE.
    capacity_factor: expert slots per sequence, :func:`~ms_efficient.moe.split.switch_capacity`
        of the seq tokens (ceil(top_k * seq * capacity_factor / E) in [1, seq]; 0 = dropless,
        seq slots).
    include_head: embedding, final LayerNorm, output head and loss (False: layers only).
    """

    name: str
    num_layers: int
    hidden: int
    heads: int
    seq: int
    batch: int
    vocab: int = 51200          # GPT-2's 50257 padded to a multiple of 1024, as Megatron does
    ffn: int = 0
    num_experts: int = 0
    top_k: int = 2
    capacity_factor: float = 1.25
    moe_every: int = 1
    include_head: bool = True

    def __post_init__(self) -> None:
        for key in ("num_layers", "hidden", "heads", "seq", "batch", "vocab"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"'{key}' must be a positive integer, but got {value!r}.")
        if self.hidden % self.heads:
            raise ValueError(f"'hidden' ({self.hidden}) must be a multiple of 'heads' "
                             f"({self.heads}).")
        if self.num_experts and not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"'top_k' must be in [1, num_experts ({self.num_experts})], "
                             f"but got {self.top_k}.")

    @property
    def ffn_size(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def capacity(self) -> int:
        """Slots per expert and sequence (the package's one Switch formula)."""
        return switch_capacity(self.seq, self.num_experts, self.top_k, self.capacity_factor)

    def is_moe(self, layer: int) -> bool:
        return self.num_experts > 0 and (layer + 1) % self.moe_every == 0

    def param_count(self) -> int:
        """Trainable parameters of the modelled operators (elements)."""
        return sum(s.param_elems() for s in transformer_ops(self))


# Public figures: GPT-3 paper Table 2.1 (1.3B, 13B, 175B: layers, d_model, heads, 2048 ctx).
PRESETS: Dict[str, TransformerDims] = {
    "gpt-1.3b": TransformerDims("gpt-1.3b", 24, 2048, 16, 2048, batch=8),
    "gpt-13b": TransformerDims("gpt-13b", 40, 5120, 40, 2048, batch=8),
    "gpt-175b": TransformerDims("gpt-175b", 96, 12288, 96, 2048, batch=8),
    # GShard/Switch-style: the 1.3B GPT with 32 experts (top-2) in every other layer.
    "moe-1.3b-e32": TransformerDims("moe-1.3b-e32", 24, 2048, 16, 2048, batch=8,
                                    num_experts=32, top_k=2, capacity_factor=1.25,
                                    moe_every=2),
}


def get_workload(name: str, batch: Optional[int] = None, num_layers: Optional[int] = None
                 ) -> TransformerDims:
    """A preset by name, optionally with another global batch or layer count."""
    if name not in PRESETS:
        raise ValueError(f"'workload' must be one of {sorted(PRESETS)}, but got {name!r}.")
    dims = PRESETS[name]
    if batch is not None:
        dims = replace(dims, batch=batch)
    if num_layers is not None:
        dims = replace(dims, num_layers=num_layers)
    return dims


def _op(name: str, prim: str, dims: Dict[str, int], inputs: List[TensorRef],
        out: Tuple[str, ...], tie: str, **kw) -> OpSpec:
    used = set(out).union(*[t.dims for t in inputs])
    return OpSpec(name=name, prim=prim, dims=tuple((d, n) for d, n in dims.items() if d in used),
                  inputs=tuple(inputs), out=out, tie=tie, **kw)


def _act(dims: str, source: str, rename: Tuple[Tuple[str, str], ...] = ()) -> TensorRef:
    return TensorRef(tuple(dims), "act", source, rename)


def _param(dims: str) -> TensorRef:
    return TensorRef(tuple(dims), "param")


def layer_ops(m: TransformerDims, layer: int, x_in: str) -> List[OpSpec]:
    """The operators of layer ``layer`` reading the residual stream from op ``x_in``."""
    kind = "moe" if m.is_moe(layer) else "dense"
    p = f"L{layer}."
    D = dict(b=m.batch, s=m.seq, t=m.seq, h=m.hidden, c=3, a=m.heads, d=m.hidden // m.heads,
             f=m.ffn_size, e=max(m.num_experts, 1), k=m.capacity if m.num_experts else 1)

    def op(name, prim, inputs, out, **kw):
        return _op(p + name, prim, D, inputs, tuple(out), f"{kind}.{name}", **kw)

    ops = [
        # Step 1: attention block.
        op("ln1", "LayerNorm", [_act("bsh", x_in), _param("h"), _param("h")], "bsh",
           no_shard=("h",), saves=("in0",)),
        op("qkv", "MatMul", [_act("bsh", p + "ln1"), _param("hcad")], "bscad",
           contract=("h",), no_shard=("c", "d"), saves=("in0",)),
        *[op(n, "StridedSlice", [_act("bscad", p + "qkv")], "basd", no_shard=("c", "d"))
          for n in ("q", "k", "v")],
        op("scores", "BatchMatMul", [_act("basd", p + "q"), _act("batd", p + "k", (("t", "s"),))],
           "bast", contract=("d",), no_shard=("d",), saves=("in0", "in1")),
        op("softmax", "Softmax", [_act("bast", p + "scores")], "bast", no_shard=("t",),
           saves=("out",)),
        op("attn_drop", "Dropout", [_act("bast", p + "softmax")], "bast", saves=("mask",)),
        op("context", "BatchMatMul", [_act("bast", p + "attn_drop"),
                                      _act("batd", p + "v", (("t", "s"),))],
           "basd", contract=("t",), no_shard=("d",), saves=("in0", "in1")),
        op("proj", "MatMul", [_act("basd", p + "context"), _param("adh")], "bsh",
           contract=("a", "d"), no_shard=("d",), saves=("in0",)),
        op("drop1", "Dropout", [_act("bsh", p + "proj")], "bsh", saves=("mask",)),
        op("add1", "Add", [_act("bsh", x_in), _act("bsh", p + "drop1")], "bsh"),
        op("ln2", "LayerNorm", [_act("bsh", p + "add1"), _param("h"), _param("h")], "bsh",
           no_shard=("h",), saves=("in0",)),
    ]
    # Step 2: feed-forward block, dense or MoE.
    if kind == "dense":
        ops += [
            op("fc1", "MatMul", [_act("bsh", p + "ln2"), _param("hf")], "bsf", contract=("h",),
               saves=("in0",)),
            op("gelu", "GeLU", [_act("bsf", p + "fc1")], "bsf", saves=("in0",)),
            op("fc2", "MatMul", [_act("bsf", p + "gelu"), _param("fh")], "bsh", contract=("f",),
               saves=("in0",)),
        ]
        ffn_out = p + "fc2"
    else:
        ops += [
            op("router", "MatMul", [_act("bsh", p + "ln2"), _param("he")], "bse",
               contract=("h",), saves=("in0",)),
            op("gate", "TopK", [_act("bse", p + "router")], "bse", no_shard=("e",),
               saves=("out",)),
            op("dispatch", "Dispatch", [_act("bsh", p + "ln2"), _act("bse", p + "gate")], "ebkh",
               contract=("s",), scatter_dims=()),
            op("expert_fc1", "BatchMatMul", [_act("ebkh", p + "dispatch"), _param("ehf")],
               "ebkf", contract=("h",), scatter_dims=(), saves=("in0",)),
            op("expert_gelu", "GeLU", [_act("ebkf", p + "expert_fc1")], "ebkf", saves=("in0",)),
            op("expert_fc2", "BatchMatMul", [_act("ebkf", p + "expert_gelu"), _param("efh")],
               "ebkh", contract=("f",), scatter_dims=(), saves=("in0",)),
            op("combine", "Combine", [_act("ebkh", p + "expert_fc2"), _act("bse", p + "gate")],
               "bsh", contract=("e", "k"), saves=("in0", "in1")),
        ]
        ffn_out = p + "combine"
    ops += [
        op("drop2", "Dropout", [_act("bsh", ffn_out)], "bsh", saves=("mask",)),
        op("add2", "Add", [_act("bsh", p + "add1"), _act("bsh", p + "drop2")], "bsh"),
    ]
    return ops


def transformer_ops(m: TransformerDims) -> List[OpSpec]:
    """Every operator of the model in topological order (see the module docstring)."""
    D = dict(b=m.batch, s=m.seq, h=m.hidden, v=m.vocab)
    ops: List[OpSpec] = []
    if m.include_head:
        ops.append(_op("embed", "Gather", D, [_param("vh"), TensorRef(("b", "s"), "input",
                                                                        dtype_bytes=4)],
                       ("b", "s", "h"), "embed", contract=("v",)))
        x = "embed"
    else:
        # a stand-in producer of the first layer's input that keeps nothing
        ops.append(_op("input", "Identity", D, [TensorRef(("b", "s", "h"), "input")],
                       ("b", "s", "h"), "input"))
        x = "input"
    for layer in range(m.num_layers):
        ops += layer_ops(m, layer, x)
        x = f"L{layer}.add2"
    if m.include_head:
        ops += [
            _op("ln_f", "LayerNorm", D, [_act("bsh", x), _param("h"), _param("h")],
                ("b", "s", "h"), "ln_f", no_shard=("h",), saves=("in0",)),
            _op("head", "MatMul", D, [_act("bsh", "ln_f"), _param("hv")], ("b", "s", "v"),
                "head", contract=("h",), saves=("in0",)),
            _op("loss", "SoftmaxCrossEntropyWithLogits", D, [_act("bsv", "head")], ("b", "s"),
                "loss", out_bytes=4, contract=("v",), saves=("in0",)),
        ]
    return ops
