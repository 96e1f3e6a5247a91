"""The MoE layers' shared reference case: sizes, weights, a batch, the dense reference layer
(MoEFeedForward with room for every row) and its outputs and gradients, computed once per
session, and the float32 rounding bounds two evaluations of the layer must agree within
(tests/conftest.py: float32_bound). test_balanced_ep and the 2-worker checks compare the
expert-parallel layer with it."""
import functools

import numpy as np

import mindspore as ms
from mindspore import Tensor, nn

from conftest import float32_bound
from ms_efficient.moe.ep_routing import init_expert_weights
from ms_efficient.moe.layer import MoEFeedForward

E, H, F, K = 4, 16, 32, 2
B, S = 2, 8
T = B * S


def weights(seed=5):
    """Logical weights (router, w1, b1, w2, b2) with non-zero biases."""
    router, w1, b1, w2, b2 = init_expert_weights(E, H, F, init_std=0.3, seed=seed)
    rng = np.random.default_rng(seed)
    return (router, w1, rng.normal(0, 0.1, b1.shape).astype(np.float32), w2,
            rng.normal(0, 0.1, b2.shape).astype(np.float32))


def dense_layer(w, capacity=T, trace_ranks=1):
    layer = MoEFeedForward(H, F, E, K, capacity=capacity, trace_ranks=trace_ranks)
    layer.router.weight.set_data(Tensor(w[0]))
    for p, a in zip((layer.w1, layer.b1, layer.w2, layer.b2), w[1:]):
        p.set_data(Tensor(a))
    return layer


def batch(seed=0):
    rng = np.random.default_rng(seed)
    return (Tensor(rng.standard_normal((B, S, H)).astype(np.float32)),
            Tensor(rng.standard_normal((B, S, H)).astype(np.float32)))


class WeightedOutput(nn.Cell):
    """sum(y * dy) + 0.1 * aux_loss: a loss that reaches every output and the router."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def construct(self, x, dy):
        y, aux, _, _ = self.layer(x)
        return (y * dy).sum() + 0.1 * aux


def grads(layer, x, dy):
    """(dx, {name: grad}) of WeightedOutput for router, w1, b1, w2, b2."""
    params = [layer.router.weight, layer.w1, layer.b1, layer.w2, layer.b2]
    dx, g = ms.grad(WeightedOutput(layer), grad_position=0, weights=params)(x, dy)
    return dx.asnumpy(), dict(zip(("router", "w1", "b1", "w2", "b2"), (a.asnumpy() for a in g)))


def outputs_and_grads(layer, x, dy):
    """([y, aux, counts, dropped] as numpy, grads(layer, x, dy))."""
    return [a.asnumpy() for a in layer(x)], grads(layer, x, dy)


# --- float32 rounding bounds of the MoE layer (tests/conftest.py: float32_bound) ------------

GELU_CURVE = 0.80   # max |gelu''| of the tanh GELU (0.798, at u = 0): how fast its slope moves
ACT_ROUNDINGS = 10  # roundings in TanhGELU's forward (x*x*x, * c, + x, * c2, sigmoid, * x) or
                    # its slope: each side within gamma_10 of the exact function, relatively


def _numpy(a):
    return np.asarray(a.asnumpy() if isinstance(a, Tensor) else a, np.float64)


def moe_float32_bounds(w, x, dy=None, top_k=K, router_differs=False, numpy_gelu=False):
    """Per-element bounds on |a - b| for two float32 evaluations of the MoE layer with weights
    ``w`` = (router, w1, b1, w2, b2) on tokens ``x`` that route every token alike but sum in
    other orders or with other kernels (conftest.float32_bound: 2 gamma_n sum |terms| for a
    sum of n products): {"y": shaped as x} and, with ``dy``, the gradients of
    sum(y * dy) + 0.1 aux: "dx" (as x), "router" [E, H], "w1", "b1", "w2", "b2" (as in w).

    Every sum of the layer is bounded in turn, and an error reaches the next sum through that
    sum's other factor (|W2| for the hidden units; the GELU's slope, at most its value plus
    GELU_CURVE times the input's error). Along one chain the bounds add up: y's through
    u = x W1 + b1 (H + 1 terms), the GELU (ACT_ROUNDINGS), out = h W2 + b2 (F + 1 terms) and
    the K gate products summed: about gamma_(H+F) of |x||W1||W2| + |h||W2| + |b2|.
    Routing-free: each token's K gates are <= 1 and sum to 1, so a token's bound is its
    largest over the E experts, and a weight gradient's sum over an expert's rows is bounded
    by its sum over every token at gate 1 (at most T rows: n = T). The gate path's backward
    (renormalisation, softmax) is a linear map of norm <= 2 on d gate = dy . out
    (|d logit_e| = (p_e / sum_k p_k) |dg_e - sum_k g_k dg_k| for a chosen expert, 0 for the
    others); the aux loss adds at most 2 * 0.1 * E / T per logit.

    router_differs: the two sides' router logits come from different matmuls (numpy, or each
        rank's own rows against the whole batch): logits within 2 gamma_H sum |x||router|,
        probabilities within a relative expm1(2 dl) plus the softmax's rounding, gates twice
        that after the top-k renormalisation; the gates' error is added everywhere they reach.
    numpy_gelu: one side evaluates GELU as 0.5 u (1 + tanh z) (numpy_grouped_moe), which
        cancels where tanh -> -1: its rounding is bounded by |u| there, not by |gelu(u)|.
    """
    router, w1, b1, w2, b2 = (_numpy(a) for a in w)
    e, h, f = w1.shape
    b1_shape, b2_shape = b1.shape, b2.shape
    b1, b2 = b1.reshape(e, f), b2.reshape(e, h)
    x_shape = np.shape(x)
    x = _numpy(x).reshape(-1, h)
    t = x.shape[0]
    ax, aw1, aw2, ar = np.abs(x), np.abs(w1), np.abs(w2), np.abs(router)
    # the gates' relative error per token (0 when both sides compute the same logits)
    d_gate = np.zeros(t)
    if router_differs:
        d_logit = float32_bound(h, ax @ ar.T).max(axis=1)
        d_gate = (2 * (np.expm1(2 * d_logit) + float32_bound(e + 3, 1.0))
                  + float32_bound(top_k + 1, 1.0))
    # forward, every token through every expert: [T, E, F] hidden, [T, E, H] expert outputs
    u = np.einsum("th,ehf->tef", x, w1) + b1
    d_u = float32_bound(h + 1, np.einsum("th,ehf->tef", ax, aw1) + np.abs(b1))
    c2 = 2 * np.sqrt(2 / np.pi)
    sig = 1 / (1 + np.exp(-c2 * (u + 0.044715 * u ** 3)))
    hid = u * sig                                              # TanhGELU = u sigmoid(2 z)
    slope_terms = (sig, u * sig * (1 - sig) * c2 * (1 + 3 * 0.044715 * u ** 2))
    slope = slope_terms[0] + slope_terms[1]
    act_scale = np.abs(hid) + (np.abs(u) if numpy_gelu else 0)
    d_hid = (np.abs(slope) + GELU_CURVE * d_u) * d_u + float32_bound(ACT_ROUNDINGS, act_scale)
    out_abs = np.einsum("tef,efh->teh", np.abs(hid), aw2) + np.abs(b2)
    d_out = float32_bound(f + 1, out_abs) + np.einsum("tef,efh->teh", d_hid, aw2)
    # y_t = sum_k g_k out_k: K gate products summed, sum_k g_k = 1 (+ the gates' own error)
    bounds = {"y": (d_out + float32_bound(top_k, out_abs)
                    + d_gate[:, None, None] * out_abs).max(axis=1).reshape(x_shape)}
    if dy is None:
        return bounds
    ady = np.abs(_numpy(dy).reshape(t, h))
    dy_g = ady * (1 + d_gate[:, None])           # |dy| times the gates (<= 1) and their error
    # backward at gate <= 1: dh = g dy W2^T (H terms), du = dh * slope
    dh_abs = np.einsum("th,efh->tef", ady, aw2)
    d_dh = float32_bound(h, dh_abs) + d_gate[:, None, None] * dh_abs
    d_du = (np.abs(slope) * d_dh + dh_abs * (
        GELU_CURVE * d_u + float32_bound(ACT_ROUNDINGS + 1, np.abs(slope_terms[0])
                                         + np.abs(slope_terms[1]))))
    du_abs = dh_abs * np.abs(slope)
    # dx: the experts' du W1^T (F terms), the gate path's d logit R (E terms), K + 1 added
    dx_abs = np.einsum("tef,ehf->teh", du_abs, aw1)
    d_dx = (float32_bound(f, dx_abs) + np.einsum("tef,ehf->teh", d_du, aw1)).max(axis=1)
    dg_abs = np.einsum("th,teh->te", ady, out_abs)
    d_dg = (float32_bound(h, dg_abs) + np.einsum("th,teh->te", ady, d_out)).max(axis=1)
    logit_abs = 2 * (top_k + 1) * dg_abs.max(axis=1) + 0.2 * e / t       # [T]
    d_dlogit = (2 * d_dg + float32_bound(e + top_k + 4, logit_abs)
                + 2 * d_gate * logit_abs)          # the probabilities' own error, if any
    r_abs = ar.sum(axis=0)                                               # [H]
    d_dx = (d_dx + d_dlogit[:, None] * r_abs + float32_bound(e, logit_abs[:, None] * r_abs)
            + float32_bound(top_k + 1, dx_abs.max(axis=1) + logit_abs[:, None] * r_abs))
    bounds["dx"] = d_dx.reshape(x_shape)
    # gradients: sums over an expert's rows (<= T of them, gate <= 1)
    bounds["router"] = np.broadcast_to(
        float32_bound(t, logit_abs @ ax) + d_dlogit @ ax, (e, h)).copy()
    bounds["w1"] = (float32_bound(t, np.einsum("th,tef->ehf", ax, du_abs))
                    + np.einsum("th,tef->ehf", ax, d_du))
    bounds["b1"] = (float32_bound(t, du_abs.sum(axis=0)) + d_du.sum(axis=0)).reshape(b1_shape)
    bounds["w2"] = (float32_bound(t, np.einsum("tef,th->efh", np.abs(hid), dy_g))
                    + np.einsum("tef,th->efh", d_hid, ady)
                    + np.einsum("tef,th->efh", np.abs(hid), ady * d_gate[:, None]))
    bounds["b2"] = np.broadcast_to(float32_bound(t, dy_g.sum(axis=0))
                                   + (ady * d_gate[:, None]).sum(axis=0), (e, h)).reshape(
        b2_shape).copy()
    return bounds


@functools.lru_cache(maxsize=None)
def reference_bounds(skewed=False):
    """moe_float32_bounds of ``reference(skewed)``'s weights and batch."""
    w, x, dy = skewed_inputs() if skewed else (weights(), *batch())
    return moe_float32_bounds(w, x, dy)


@functools.lru_cache(maxsize=None)
def reference(skewed=False):
    """outputs_and_grads of the dense reference layer (MoEFeedForward, capacity T) on
    ``weights()`` and ``batch()`` (``skewed_inputs()`` if ``skewed``) in GRAPH_MODE, computed
    once for the tests that compare their layers with it (two compiles each time otherwise)."""
    w, x, dy = skewed_inputs() if skewed else (weights(), *batch())
    mode = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        return outputs_and_grads(dense_layer(w), x, dy)
    finally:
        ms.set_context(mode=mode)


def skewed_inputs(seed=0):
    """(weights, x, dy) where expert 3 never makes a token's top 2: x carries +4 on feature 0,
    which the router scores +1 for experts 0-2 and -3 for expert 3."""
    w = list(weights())
    w[0] = w[0].copy()
    w[0][:3, 0] += 1.0
    w[0][3, 0] = -3.0
    x, dy = batch(seed)
    shift = np.zeros(H, np.float32)
    shift[0] = 4.0
    return tuple(w), Tensor(x.asnumpy() + shift), dy
