"""MoE layer: equivalences with a dense FFN and hand-counted routing statistics."""
import numpy as np
import pytest

import mindspore as ms
from mindspore import Tensor

from ms_efficient.moe.layer import MoEFeedForward
from ms_efficient.moe.split import switch_capacity

ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")


def gelu_tanh(a):
    return 0.5 * a * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (a + 0.044715 * a ** 3)))


def dense_ffn(x_TH, w1, b1, w2, b2):
    """The dense FFN written out in numpy."""
    return gelu_tanh(x_TH @ w1 + b1) @ w2 + b2


@pytest.mark.parametrize("tokens, experts, k, cf, multiple, expected", [
    (1024, 8, 2, 1.25, 1, 320),     # ceil(1.25 * 1024 * 2 / 8)
    (1024, 8, 2, 1.0, 1, 256),
    (100, 8, 1, 1.25, 8, 16),       # ceil(15.625) = 16, already a multiple of 8
    (100, 8, 1, 1.3, 8, 24),        # ceil(16.25) = 17 -> 24
    (64, 4, 2, 0, 1, 64),           # dropless: every token
    (10, 2, 2, 4.0, 1, 10),         # never more slots than tokens
])
def test_switch_capacity(tokens, experts, k, cf, multiple, expected):
    assert switch_capacity(tokens, experts, k, cf, multiple) == expected


def test_one_expert_moe_equals_the_dense_ffn_forward_and_gradients():
    rng = np.random.default_rng(0)
    b, s, h, f = 2, 8, 16, 32
    layer = MoEFeedForward(h, f, num_experts=1, top_k=1, capacity=b * s)
    x = rng.standard_normal((b, s, h)).astype(np.float32)
    w1, w2 = layer.w1.asnumpy()[0], layer.w2.asnumpy()[0]
    b1 = rng.standard_normal(f).astype(np.float32) * 0.1
    b2 = rng.standard_normal(h).astype(np.float32) * 0.1
    layer.b1.set_data(Tensor(b1.reshape(1, 1, f)))
    layer.b2.set_data(Tensor(b2.reshape(1, 1, h)))
    y, aux, counts, dropped = layer(Tensor(x))
    ref = dense_ffn(x.reshape(-1, h), w1, b1, w2, b2).reshape(b, s, h)
    np.testing.assert_allclose(y.asnumpy(), ref, rtol=1e-5, atol=1e-5)
    assert int(dropped.asnumpy()) == 0
    assert counts.asnumpy().tolist() == [[b * s]]
    assert float(aux.asnumpy()) == pytest.approx(1.0)   # E * f * p = 1 * 1 * 1

    # gradients w.r.t. w1 and x match the dense FFN's, taken by central differences in numpy
    def loss_fn(inp):
        return layer(inp)[0].sum()

    grad_fn = ms.grad(loss_fn, grad_position=0, weights=[layer.w1])
    gx, (gw1,) = grad_fn(Tensor(x))
    eps = 1e-2
    idx = (0, 3, 5)
    xp, xm = x.copy(), x.copy()
    xp[idx] += eps
    xm[idx] -= eps
    num = (dense_ffn(xp.reshape(-1, h), w1, b1, w2, b2).sum()
           - dense_ffn(xm.reshape(-1, h), w1, b1, w2, b2).sum()) / (2 * eps)
    assert gx.asnumpy()[idx] == pytest.approx(num, rel=2e-2, abs=1e-3)
    # analytic dense gradient of sum(y) w.r.t. w1: x^T (gelu'(a) * (1 w2^T))
    a = x.reshape(-1, h) @ w1 + b1
    t = np.tanh(np.sqrt(2 / np.pi) * (a + 0.044715 * a ** 3))
    dgelu = 0.5 * (1 + t) + 0.5 * a * (1 - t ** 2) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * a ** 2)
    g_a = dgelu * (np.ones((b * s, h)) @ w2.T)
    np.testing.assert_allclose(gw1.asnumpy()[0], x.reshape(-1, h).T @ g_a, rtol=1e-3, atol=1e-4)


def test_drops_and_counts_follow_the_capacity():
    """Steer every token to expert 0 (top-1): only the first C assignments are served."""
    b, s, h, f, e, c = 1, 12, 8, 16, 4, 5
    layer = MoEFeedForward(h, f, num_experts=e, top_k=1, capacity=c, trace_ranks=2)
    w = np.zeros((e, h), np.float32)
    w[0, :] = 5.0                               # router weight [E, H]: expert 0 wins for x > 0
    layer.router.weight.set_data(Tensor(w))
    x = np.abs(np.random.default_rng(1).standard_normal((b, s, h))).astype(np.float32) + 0.1
    y, _, counts, dropped = layer(Tensor(x))
    assert counts.asnumpy().tolist() == [[6, 0, 0, 0], [6, 0, 0, 0]]
    assert int(dropped.asnumpy()) == s - c
    y = y.asnumpy()[0]
    assert np.abs(y[:c]).sum() > 0                # served tokens get expert output
    assert np.all(y[c:] == 0)                     # dropped tokens get exactly zero


def test_top2_counts_every_token_twice_and_dropless_drops_nothing():
    b, s, h, e = 2, 16, 8, 4
    layer = MoEFeedForward(h, 16, num_experts=e, top_k=2, capacity=b * s, trace_ranks=4)
    x = np.random.default_rng(2).standard_normal((b, s, h)).astype(np.float32)
    _, _, counts, dropped = layer(Tensor(x))
    counts = counts.asnumpy()
    assert counts.shape == (4, e)
    assert counts.sum(axis=1).tolist() == [2 * 8] * 4     # 8 tokens per group, 2 choices each
    assert int(dropped.asnumpy()) == 0


def test_capacities_fitted_to_the_exact_loads_change_nothing_and_leave_no_padding():
    """Per-expert capacities equal to each expert's load: same output as a dropless layer,
    no drop, and every computed slot row holds a token."""
    b, s, h, e = 2, 16, 8, 4
    x = Tensor(np.random.default_rng(3).standard_normal((b, s, h)).astype(np.float32))
    ms.set_seed(11)
    dropless = MoEFeedForward(h, 16, num_experts=e, top_k=2, capacity=b * s)
    y_ref, _, counts, dropped = dropless(x)
    assert int(dropped.asnumpy()) == 0
    loads = counts.asnumpy().sum(axis=0)
    assert loads.sum() == 2 * b * s and len(set(loads.tolist())) > 1
    fitted = MoEFeedForward(h, 16, num_experts=e, top_k=2, capacity=loads.tolist())
    for p, q in zip(dropless.get_parameters(), fitted.get_parameters()):
        q.set_data(p.data.copy())
    assert fitted.num_slots == 2 * b * s            # no padding row at all
    y, _, c2, d2 = fitted(x)
    np.testing.assert_allclose(y.asnumpy(), y_ref.asnumpy(), rtol=1e-5, atol=1e-6)
    assert int(d2.asnumpy()) == 0 and c2.asnumpy().tolist() == counts.asnumpy().tolist()


def test_each_expert_drops_beyond_its_own_capacity():
    """Top-1, all tokens to expert 0 (capacity 7) except those steered to expert 2 (capacity 2)."""
    h, e = 8, 4
    layer = MoEFeedForward(h, 16, num_experts=e, top_k=1, capacity=[7, 1, 2, 1])
    w = np.zeros((e, h), np.float32)
    w[0, 0] = 5.0                               # feature 0 votes for expert 0
    w[2, 1] = 5.0                               # feature 1 votes for expert 2
    layer.router.weight.set_data(Tensor(w))
    x = np.zeros((1, 12, h), np.float32)
    x[0, :8, 0] = 1.0                           # 8 tokens -> expert 0 (capacity 7: 1 dropped)
    x[0, 8:, 1] = 1.0                           # 4 tokens -> expert 2 (capacity 2: 2 dropped)
    y, _, counts, dropped = layer(Tensor(x))
    assert counts.asnumpy().tolist() == [[8, 0, 4, 0]]
    assert int(dropped.asnumpy()) == 1 + 2
    y = y.asnumpy()[0]
    served = np.abs(y).sum(axis=1) > 0
    assert served.tolist() == [True] * 7 + [False] + [True] * 2 + [False] * 2


def test_capacities_are_part_of_the_compiled_graph():
    """A new capacity plan compiles a graph whose expert inputs have the planned static sizes
    (read back from the exported MINDIR graph): one gather of tokens per capacity group,
    g * c rows for g experts of capacity c, largest capacity first."""
    from ms_efficient.graph import from_network

    x = Tensor(np.ones((1, 8, 8), np.float32))
    for caps, want in (([6, 2, 3, 5], [6, 5, 3, 2]), ([1, 9, 2, 4], [9, 4, 2, 1]),
                       ([3, 3, 3, 3, 3, 3], [18]), ([4, 2, 4, 2], [8, 4])):
        layer = MoEFeedForward(8, 16, num_experts=len(caps), top_k=1, capacity=caps)
        graph = from_network(layer, x)
        rows = [v.output_shapes[0][0] for v in graph.nodes.values()
                if v.op_type == "Gather" and v.input_shapes[0] == (8 + 1, 8)]  # tokens + 0 row
        assert rows == want


def test_bad_capacity_lists_are_rejected():
    with pytest.raises(ValueError, match=r"one value per expert \(4\), but got 3"):
        MoEFeedForward(8, 16, num_experts=4, top_k=1, capacity=[1, 2, 3])
    with pytest.raises(ValueError, match=r"every expert capacity must be >= 1"):
        MoEFeedForward(8, 16, num_experts=4, top_k=1, capacity=[1, 0, 3, 2])


def test_cpu_gelu_matches_the_gelu_kernel_in_value_and_gradient():
    """make_gelu() on CPU is the composite TanhGELU with a hand-written backward; both must
    agree with MindSpore's GeLU / GeLUGrad kernels (nn.GELU(approximate=True))."""
    import mindspore as ms
    from mindspore import nn

    from ms_efficient.moe.layer import TanhGELU, make_gelu

    ours = make_gelu()
    assert isinstance(ours, TanhGELU)
    kernel = nn.GELU(approximate=True)
    x = Tensor(np.random.default_rng(0).normal(0, 3, (64, 32)).astype(np.float32))
    assert np.allclose(ours(x).asnumpy(), kernel(x).asnumpy(), atol=1e-5)
    weights = Tensor(np.random.default_rng(1).normal(0, 1, (64, 32)).astype(np.float32))

    def loss_ours(a):
        return (ours(a) * weights).sum()

    def loss_kernel(a):
        return (kernel(a) * weights).sum()

    grad_ours = ms.grad(loss_ours)(x).asnumpy()
    grad_kernel = ms.grad(loss_kernel)(x).asnumpy()
    assert np.allclose(grad_ours, grad_kernel, atol=1e-5)
    assert np.abs(grad_ours).max() > 0.5                      # not a vanishing gradient
