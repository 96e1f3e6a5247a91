"""What an expert computes: the tanh GELU of the package's MoE experts and the choice between
it and MindSpore's kernel by device (re-exported by :mod:`ms_efficient.moe.layer`), the gated
linear unit of gated experts (:class:`GatedActivation`: SwiGLU, GeGLU), and the shared expert
(:class:`SharedExpert`: a dense FFN every token passes through beside the routed experts).

Shared experts: DeepSeekMoE (Dai et al. 2024, sec. 3.2; DeepSeek-V2/V3) isolates ``N_s``
shared experts that every token uses, their outputs added to the routed experts' (N_s experts
of width F are one FFN of width N_s x F); Qwen1.5/2-MoE scales the shared expert's output by a
per-token sigmoid gate, sigmoid(x w_g), w_g [H, 1]. :class:`SharedExpert` is that FFN for the
package's own layers (``MoEFeedForward(..., shared=...)``); an adopted block passes the user's
own Cell instead, so its Parameters and names stay the user's. Shapes: T tokens, H hidden,
F the shared FFN's width (N_s x the routed experts' F).
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import mindspore as ms
from mindspore import nn, ops
from mindspore.common.initializer import Normal

from ms_efficient.core import backend

__all__ = ["TanhGELU", "make_gelu", "GatedActivation", "uses_fused_swiglu", "swiglu_reference",
           "SharedExpert", "EXPERT_KINDS"]

# the experts' FFN: "mlp" w2(act(x w1)), "glu" w2(act(x w_gate) * (x w_up)) (Shazeer 2020,
# "GLU Variants Improve Transformer": SwiGLU with SiLU, GeGLU with GELU)
EXPERT_KINDS = ("mlp", "glu")


class TanhGELU(nn.Cell):
    """GELU in its tanh form (Hendrycks & Gimpel 2016), the function ``nn.GELU(approximate=
    True)`` computes: 0.5 x (1 + tanh(z)), z = sqrt(2 / pi) (x + 0.044715 x^3), evaluated as
    x * sigmoid(2 z) (the same function: 0.5 (1 + tanh(z)) = sigmoid(2 z)).

    Written with elementwise primitives because MindSpore 2.10's CPU GeLU / GeLUGrad kernels
    are slow: forward + backward on a [5632, 512] float32 tensor take 1.6-2.8x less time this
    way (``.venv/bin/python scripts/bench_cpu_ops.py``), and the kernels' GELU was the largest
    non-matmul cost of the reference model's step in the MindSpore profiler.

    The backward is written by hand, from x alone (as GeLUGrad's): automatic differentiation
    would keep the forward's intermediate [N, F] tensors alive until the backward, and its
    1 - tanh(z)^2 loses float32 precision where tanh saturates; sigmoid(2 z) sigmoid(-2 z)
    = (1 - tanh(z)^2) / 4 does not (the test holds it to 1e-5 of GeLUGrad).
    """

    def __init__(self):
        super().__init__()
        self.c2 = 2.0 * math.sqrt(2.0 / math.pi)

    def construct(self, x):
        return x * ops.sigmoid(self.c2 * (x + 0.044715 * x * x * x))

    def bprop(self, x, out, dout):
        """d/dx [x s(2z)] = s + x s(2z) s(-2z) 2 z'(x), z' = sqrt(2 / pi) (1 + 3 * 0.044715 x^2)."""
        x2 = x * x
        z2 = self.c2 * (x + 0.044715 * x2 * x)
        s = ops.sigmoid(z2)
        slope = s + x * s * ops.sigmoid(-z2) * (self.c2 * (1.0 + 3 * 0.044715 * x2))
        return (dout * slope,)


def make_gelu() -> nn.Cell:
    """The tanh GELU for the current device target: :class:`TanhGELU` on CPU, where the
    GeLU kernels are slow, and ``nn.GELU(approximate=True)`` elsewhere (Ascend's GeLU kernel is
    fused: one pass forward and backward, no temporaries, which the composite cannot match).
    Reads ``device_target`` when the layer is built, so set the context first."""
    if ms.get_context("device_target") == "CPU":
        return TanhGELU()
    return nn.GELU(approximate=True)


class GatedActivation(nn.Cell):
    """The gated linear unit of a gated expert on its fused first projection:
    ``construct(h_N2F) -> act(h[:, :F]) * h[:, F:]``, h_N2F = x @ [w_gate | w_up] ([N, 2F]:
    the gate projection's F columns, then the up projection's), out [N, F].

    ``act`` is the gate's activation: ``nn.SiLU()`` gives SwiGLU (Mixtral, DeepSeek, Qwen-MoE,
    LLaMA), a GELU GeGLU (Shazeer 2020, eq. 6). On CPU (and for any other activation) it is a
    split and two elementwise ops. With SiLU on Ascend it is ``ops.swiglu(h, -1)``, Ascend's
    fused kernel (one kernel forward and one backward instead of a split, a SiLU and a
    product, and no [N, F] temporaries): MindSpore 2.10 documents it, Ascend only, as
    Swish(a) * b with a the first half of ``h`` along ``dim`` and b the second, which is this
    Cell's [gate | up] order (:func:`swiglu_reference`; tests/test_moe_gated.py holds the
    split form equal to that formula; no Ascend hardware here ran the kernel itself).

    Args: act, the gate's activation Cell; fused: use ``ops.swiglu`` (default: SiLU on
    Ascend, :func:`uses_fused_swiglu`)."""

    def __init__(self, act: nn.Cell, fused: Optional[bool] = None):
        super().__init__()
        self.act = act
        self.fused = uses_fused_swiglu(act) if fused is None else bool(fused)
        if self.fused and not isinstance(act, nn.SiLU):
            raise ValueError(f"'fused' (ops.swiglu) computes SiLU gates only, but the "
                             f"activation is {type(act).__name__}.")

    def construct(self, h):
        if self.fused:
            return ops.swiglu(h, -1)
        gate, up = ops.split(h, h.shape[-1] // 2, -1)
        return self.act(gate) * up


def uses_fused_swiglu(act: nn.Cell, target: Optional[str] = None) -> bool:
    """Whether :class:`GatedActivation` runs Ascend's fused ``ops.swiglu``: a SiLU gate on
    Ascend (``target``, default this process's device target)."""
    return isinstance(act, nn.SiLU) and backend.is_ascend(target)


def swiglu_reference(h):
    """``ops.swiglu(h, -1)`` as MindSpore 2.10 documents it, numpy: with a, b the first and
    second halves of the last axis, Swish(a) * b = a * sigmoid(a) * b."""
    a, b = np.split(np.asarray(h, dtype=np.float64), 2, axis=-1)
    return a / (1.0 + np.exp(-a)) * b


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

        def dense(n_in, n_out, bias):
            return nn.Dense(n_in, n_out, has_bias=bias, weight_init=Normal(init_std))

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
