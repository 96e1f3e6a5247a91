"""Workload graphs for the placement benchmark (planners never import MindSpore; the MINDIR
and mindcv loaders here import it only when called).

- ``transformer_graph``: an analytic OpGraph of a GPT-style decoder (dense or MoE FFN),
  FLOPs and bytes from the layer shapes (fp16): for configurations too large to export on
  this CPU. Every node is a forward op; the cost model derives backward = 2 x forward.
- ``reference_model_graph``, ``mindcv_graph``: real MindSpore networks exported to MINDIR
  (``ms_efficient.models.zoo``, re-exported here).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

from ms_efficient.graph.opgraph import OpGraph, OpNode
from ms_efficient.models.zoo import mindcv_graph, reference_model_graph

__all__ = ["TransformerShape", "TRANSFORMER_CONFIGS", "transformer_graph",
           "reference_model_graph", "mindcv_graph"]



@dataclass(frozen=True)
class TransformerShape:
    """Decoder shape. batch: samples per step; seq: tokens per sample; hidden: H;
    heads; ffn: FFN hidden size (per expert); layers; experts: 0 = dense FFN, else E
    experts with top_k routing (each expert its own op, so experts can spread); vocab."""

    layers: int
    hidden: int
    heads: int
    ffn: int
    seq: int
    batch: int
    experts: int = 0
    top_k: int = 2
    vocab: int = 50304


# Larger configs than the CPU reference model; sizes follow GPT-3 (Brown et al. 2020, table
# 2.1) at reduced batch so each still fits 4-8 x 64 GB devices with pipeline splitting.
TRANSFORMER_CONFIGS: Dict[str, TransformerShape] = {
    "gpt-1.3b": TransformerShape(layers=24, hidden=2048, heads=16, ffn=8192, seq=2048, batch=8),
    "gpt-6.7b": TransformerShape(layers=32, hidden=4096, heads=32, ffn=16384, seq=2048, batch=2),
    "gpt-moe-16e": TransformerShape(layers=8, hidden=2048, heads=16, ffn=8192, seq=2048,
                                    batch=8, experts=16),
    # ~10k operators (360 MoE layers of 28 ops): the search-time scaling workload.
    "moe-10k-ops": TransformerShape(layers=360, hidden=512, heads=8, ffn=1024, seq=512,
                                    batch=4, experts=16),
}

_B = 2  # bytes per fp16 element


def transformer_graph(shape: TransformerShape, name: str = "transformer") -> OpGraph:
    """Analytic forward graph of ``shape`` (FLOPs: 2 per multiply-add; bytes: fp16)."""
    b, s, h, f, v = shape.batch, shape.seq, shape.hidden, shape.ffn, shape.vocab
    tok, act = b * s, b * s * h * _B
    g = OpGraph(name=name, meta={"source": "analytic", "shape": shape.__dict__})

    def node(nm: str, op: str, flops: float, out: float, params: float = 0.0, *preds: str) -> str:
        g.add_node(OpNode(name=nm, op_type=op, scope=nm.rsplit(".", 1)[0], flops=flops,
                          output_bytes=int(out), param_bytes=int(params), phase="forward"))
        for p in preds:
            g.add_edge(p, nm)
        return nm

    x = node("embed", "Gather", 0.0, act, (v + s) * h * _B)
    for i in range(shape.layers):
        p = f"layer{i}"
        ln1 = node(f"{p}.attn.ln", "LayerNorm", 5.0 * tok * h, act, 2 * h * _B, x)
        qkv = node(f"{p}.attn.qkv", "MatMul", 2.0 * tok * h * 3 * h, 3 * act, 3 * h * h * _B, ln1)
        score = node(f"{p}.attn.score", "BatchMatMul", 2.0 * b * s * s * h,
                     b * shape.heads * s * s * _B, 0, qkv)
        soft = node(f"{p}.attn.softmax", "Softmax", 5.0 * b * shape.heads * s * s,
                    b * shape.heads * s * s * _B, 0, score)
        ctx = node(f"{p}.attn.ctx", "BatchMatMul", 2.0 * b * s * s * h, act, 0, soft, qkv)
        proj = node(f"{p}.attn.proj", "MatMul", 2.0 * tok * h * h, act, h * h * _B, ctx)
        add1 = node(f"{p}.attn.add", "Add", tok * h, act, 0, proj, x)
        ln2 = node(f"{p}.ffn.ln", "LayerNorm", 5.0 * tok * h, act, 2 * h * _B, add1)
        if shape.experts:
            e = shape.experts
            router = node(f"{p}.ffn.router", "MatMul", 2.0 * tok * h * e, tok * e * 4,
                          h * e * _B, ln2)
            t_e = tok * shape.top_k / e  # tokens per expert with balanced routing
            experts = [node(f"{p}.ffn.expert{j}", "Expert", 2.0 * 2 * t_e * h * f,
                            t_e * (h + f) * _B, 2 * h * f * _B, router, ln2) for j in range(e)]
            ffn = node(f"{p}.ffn.combine", "Combine", tok * h * shape.top_k, act, 0,
                       router, *experts)
        else:
            fc1 = node(f"{p}.ffn.fc1", "MatMul", 2.0 * tok * h * f, tok * f * _B, h * f * _B, ln2)
            gelu = node(f"{p}.ffn.gelu", "GeLU", 8.0 * tok * f, tok * f * _B, 0, fc1)
            ffn = node(f"{p}.ffn.fc2", "MatMul", 2.0 * tok * f * h, act, f * h * _B, gelu)
        x = node(f"{p}.ffn.add", "Add", tok * h, act, 0, ffn, add1)
    ln = node("final.ln", "LayerNorm", 5.0 * tok * h, act, 2 * h * _B, x)
    logits = node("head", "MatMul", 2.0 * tok * h * v, tok * v * _B, 0, ln)
    node("loss", "SoftmaxCrossEntropy", 5.0 * tok * v, 4, 0, logits)
    return g
