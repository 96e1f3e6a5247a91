"""Shared experts: a dense FFN every token passes through beside the routed experts.

DeepSeekMoE (Dai et al. 2024, sec. 3.2; DeepSeek-V2/V3) isolates ``N_s`` shared experts that
every token uses, their outputs added to the routed experts' (N_s experts of width F are one
FFN of width N_s x F); Qwen1.5/2-MoE scales the shared expert's output by a per-token sigmoid
gate, sigmoid(x w_g), w_g [H, 1]. :class:`SharedExpert` is that FFN for the package's own
layers (``MoEFeedForward(..., shared=...)``); an adopted block passes the user's own Cell
instead, so its Parameters and names stay the user's.

Shapes: T tokens, H hidden, F the shared FFN's width (N_s x the routed experts' F).
"""
from __future__ import annotations

from typing import Optional

from mindspore import nn
from mindspore.common.initializer import Normal

from ms_efficient.moe.activations import EXPERT_KINDS, make_gelu

__all__ = ["SharedExpert"]


class SharedExpert(nn.Cell):
    """``construct(x_TH) -> y_TH``: ``down(act(gate_proj x) * up_proj x)`` (``kind="glu"``) or
    ``down(act(up_proj x))`` (``"mlp"``), times sigmoid(``gate`` x) when ``gated=True``.

    Args:
        hidden_size: H. ffn_hidden_size: F (N_s shared experts of width F_e: N_s x F_e).
        kind: "glu" (SwiGLU with the default SiLU) or "mlp" (tanh GELU by default).
        gated: scale the output by sigmoid(x w_g) per token (Qwen-MoE's shared expert gate).
        has_bias: biases on the projections (the gate has none).
        activation: the activation Cell (default: SiLU for "glu", tanh GELU for "mlp").
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, kind: str = "glu",
                 gated: bool = False, has_bias: bool = False,
                 activation: Optional[nn.Cell] = None, init_std: float = 0.02):
        super().__init__()
        if kind not in EXPERT_KINDS:
            raise ValueError(f"'kind' must be one of {list(EXPERT_KINDS)}, but got {kind!r}.")
        if hidden_size < 1 or ffn_hidden_size < 1:
            raise ValueError(f"'hidden_size' and 'ffn_hidden_size' must be >= 1, but got "
                             f"{hidden_size} and {ffn_hidden_size}.")
        h, f = hidden_size, ffn_hidden_size
        self.kind = kind
        self.glu = kind == "glu"
        self.has_gate = bool(gated)
        dense = lambda i, o, b: nn.Dense(i, o, has_bias=b, weight_init=Normal(init_std))  # noqa: E731
        if self.glu:
            self.gate_proj = dense(h, f, has_bias)
        self.up_proj = dense(h, f, has_bias)
        self.down_proj = dense(f, h, has_bias)
        if self.has_gate:
            self.gate = dense(h, 1, False)
        self.act = activation if activation is not None else (
            nn.SiLU() if self.glu else make_gelu())
        self.sigmoid = nn.Sigmoid()

    def construct(self, x):
        if self.glu:
            y = self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        else:
            y = self.down_proj(self.act(self.up_proj(x)))
        if self.has_gate:
            y = y * self.sigmoid(self.gate(x))
        return y
