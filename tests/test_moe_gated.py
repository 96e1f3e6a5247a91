"""Gated experts (SwiGLU, GeGLU) and shared experts in the one-process MoE layer: equivalences
with dense numpy FFNs written from the formulas, and the storage layouts of the up
projection (fused, separate stacked, per-expert Dense) giving the same function and
gradients."""
import numpy as np
import pytest

import mindspore as ms
from mindspore import Tensor, nn

from ms_efficient.moe.layer import MoEFeedForward
from ms_efficient.moe.experts import SharedExpert

ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")

pytestmark = pytest.mark.mindspore


@pytest.fixture
def pynative():
    """Run a test eagerly (the functions, not the graph compiler, are under test: the
    one-expert test above runs the grouped path compiled), restoring the mode after."""
    mode = ms.get_context("mode")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    yield
    ms.set_context(mode=mode)


def silu(a):
    return a / (1.0 + np.exp(-a))


def gelu_tanh(a):
    return 0.5 * a * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (a + 0.044715 * a ** 3)))


def glu_ffn(x, w_gate, w_up, w_down, act=silu):
    """w_down(act(x w_gate) * (x w_up)) (Shazeer 2020), numpy float64."""
    return (act(x @ w_gate) * (x @ w_up)) @ w_down


def _weight_grads(layer, x, weights):
    """Gradients of sum(layer(x)[0]) with respect to ``weights`` (a list of Parameters)."""
    def loss(inp):
        return layer(inp)[0].sum()

    return ms.grad(loss, grad_position=None, weights=weights)(x)


def _x(b=2, s=8, h=16, seed=0):
    return np.random.default_rng(seed).standard_normal((b, s, h)).astype(np.float32)


@pytest.mark.parametrize("dispatch, mode", [("grouped", ms.GRAPH_MODE),
                                            ("static", ms.PYNATIVE_MODE)])
def test_one_gated_expert_equals_the_dense_swiglu_ffn_with_gradients(dispatch, mode):
    """E = 1, K = 1: every token's gate weight is 1, so the layer is the dense SwiGLU FFN;
    its gradient with respect to the fused w1 is the numpy gradient of that FFN (the grouped
    path compiled, the static one eagerly)."""
    old = ms.get_context("mode")
    ms.set_context(mode=mode)
    try:
        _check_one_gated_expert(dispatch)
    finally:
        ms.set_context(mode=old)


def _check_one_gated_expert(dispatch):
    h, f = 16, 12
    layer = MoEFeedForward(h, f, 1, 1, 16, dispatch=dispatch, expert_kind="glu",
                           has_bias=False)
    x = _x(h=h)
    w1 = layer.w1.asnumpy()[0].astype(np.float64)                  # [H, 2F]: gate | up
    w2 = layer.w2.asnumpy()[0].astype(np.float64)
    y = layer(Tensor(x))[0].asnumpy()
    xt = x.reshape(-1, h).astype(np.float64)
    ref = glu_ffn(xt, w1[:, :f], w1[:, f:], w2)
    # float32 products of length H and 2F against a float64 reference: a few ulps of the
    # output's scale
    np.testing.assert_allclose(y.reshape(-1, h), ref, rtol=0, atol=1e-5 * np.abs(ref).max())

    grad = _weight_grads(layer, Tensor(x), [layer.w1])[0].asnumpy()[0]
    g, u = xt @ w1[:, :f], xt @ w1[:, f:]
    upstream = np.ones((xt.shape[0], h)) @ w2.T                      # d sum / d (act(g) * u)
    sig = 1.0 / (1.0 + np.exp(-g))
    d_g = upstream * u * (sig + g * sig * (1 - sig))
    d_u = upstream * silu(g)
    ref_grad = np.concatenate((xt.T @ d_g, xt.T @ d_u), axis=1)
    np.testing.assert_allclose(grad, ref_grad, rtol=0, atol=1e-4 * np.abs(ref_grad).max())


def test_geglu_with_biases_top2_matches_numpy_routing(pynative):
    """E = 4, K = 2, GELU gate (GeGLU) with biases on both matmuls, dropless capacity."""
    h, f, e, k = 16, 8, 4, 2
    layer = MoEFeedForward(h, f, e, k, 32, expert_kind="glu",
                           activation=nn.GELU(approximate=True))
    rng = np.random.default_rng(1)
    layer.b1.set_data(Tensor(rng.standard_normal((e, 1, 2 * f)).astype(np.float32) * 0.1))
    layer.b2.set_data(Tensor(rng.standard_normal((e, 1, h)).astype(np.float32) * 0.1))
    x = _x(h=h, seed=2)
    y = layer(Tensor(x))[0].asnumpy().reshape(-1, h)
    w1, b1, w2, b2 = (p.asnumpy().astype(np.float64) for p in
                      (layer.w1, layer.b1, layer.w2, layer.b2))
    xt = x.reshape(-1, h).astype(np.float64)
    logits = xt @ layer.router.weight.asnumpy().T.astype(np.float64)
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    ids = np.argsort(-p, axis=1, kind="stable")[:, :k]
    gate = np.take_along_axis(p, ids, 1)
    gate /= gate.sum(1, keepdims=True)
    ref = np.zeros_like(xt)
    for t in range(xt.shape[0]):
        for j in range(k):
            i = ids[t, j]
            hid = xt[t] @ w1[i] + b1[i, 0]
            ref[t] += gate[t, j] * ((gelu_tanh(hid[:f]) * hid[f:]) @ w2[i] + b2[i, 0])
    np.testing.assert_allclose(y, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


def test_separate_up_projections_per_expert_equal_the_fused_table(pynative, dispatch="grouped"):
    """Mixtral's layout (per-expert Dense w1 = gate, w3 = up, w2 = down) and the stacked
    separate layout compute the fused layer's output, and each gets its own part of the
    fused gradient."""
    h, f, e, k = 16, 8, 4, 2
    fused = MoEFeedForward(h, f, e, k, 32, dispatch=dispatch, expert_kind="glu",
                           has_bias=False)
    w1 = fused.w1.asnumpy()
    gate, up, down = w1[:, :, :f], w1[:, :, f:], fused.w2.asnumpy()
    P = ms.Parameter
    stacked = MoEFeedForward(h, f, e, k, 32, dispatch=dispatch, expert_kind="glu",
                             has_bias=False, router=fused.router,
                             weights=(P(Tensor(gate), name="g"), None, P(Tensor(down), name="d"),
                                      None),
                             up_weights=(P(Tensor(up), name="u"), None))
    dense = lambda a, n: tuple(P(Tensor(np.ascontiguousarray(a[i].T)), name=f"{n}{i}")  # noqa: E731
                               for i in range(e))
    listed = MoEFeedForward(h, f, e, k, 32, dispatch=dispatch, expert_kind="glu",
                            has_bias=False, router=fused.router,
                            weights=(dense(gate, "g"), None, dense(down, "d"), None),
                            up_weights=(dense(up, "u"), None))
    x = Tensor(_x(h=h, seed=3))
    y = fused(x)[0].asnumpy()
    np.testing.assert_array_equal(stacked(x)[0].asnumpy(), y)
    np.testing.assert_array_equal(listed(x)[0].asnumpy(), y)
    g_fused = _weight_grads(fused, x, [fused.w1])[0].asnumpy()
    g_gate, g_up = _weight_grads(stacked, x, [stacked.w1, stacked.w3])
    np.testing.assert_array_equal(g_gate.asnumpy(), g_fused[:, :, :f])
    np.testing.assert_array_equal(g_up.asnumpy(), g_fused[:, :, f:])
    g_list = _weight_grads(listed, x, list(listed.w3))
    for i in range(e):
        np.testing.assert_array_equal(g_list[i].asnumpy(), g_fused[i, :, f:].T)


@pytest.mark.parametrize("gated", [False, True])
def test_shared_expert_adds_its_dense_output_to_the_routed_one(pynative, gated):
    """y(layer with shared) - y(the same layer without) = the shared SwiGLU FFN's output,
    times sigmoid(x w_g) per token when gated (Qwen-MoE)."""
    h, f, e, k = 16, 8, 4, 2
    shared = SharedExpert(h, 2 * f, kind="glu", gated=gated)
    plain = MoEFeedForward(h, f, e, k, 32, dispatch="grouped", expert_kind="glu")
    with_shared = MoEFeedForward(h, f, e, k, 32, dispatch="grouped", expert_kind="glu",
                                 router=plain.router,
                                 weights=(plain.w1, plain.b1, plain.w2, plain.b2),
                                 shared=shared)
    x = _x(h=h, seed=4)
    diff = (with_shared(Tensor(x))[0].asnumpy() - plain(Tensor(x))[0].asnumpy()).reshape(-1, h)
    xt = x.reshape(-1, h).astype(np.float64)
    ref = glu_ffn(xt, shared.gate_proj.weight.asnumpy().T, shared.up_proj.weight.asnumpy().T,
                  shared.down_proj.weight.asnumpy().T)
    if gated:
        ref = ref / (1.0 + np.exp(-(xt @ shared.gate.weight.asnumpy().T)))
    # a difference of two float32 outputs of scale |y|: a few ulps of |y| apart
    scale = np.abs(with_shared(Tensor(x))[0].asnumpy()).max()
    np.testing.assert_allclose(diff, ref, rtol=0, atol=4e-6 * scale)


def test_bad_expert_kinds_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="'expert_kind' must be one of"):
        MoEFeedForward(16, 8, 4, 2, 32, expert_kind="swiglu")
    with pytest.raises(ValueError, match="'up_weights'.*needs expert_kind='glu'"):
        MoEFeedForward(16, 8, 4, 2, 32, up_weights=(None, None))
    with pytest.raises(ValueError, match="'kind' must be one of"):
        SharedExpert(16, 8, kind="gated")


@pytest.mark.parametrize("e, k, groups, kept, mode", [
    (8, 2, 4, 2, ms.PYNATIVE_MODE),
    (256, 8, 8, 4, ms.GRAPH_MODE)])                    # DeepSeek-V3's routing shape, compiled
def test_deepseek_v3_router_in_the_layer_and_its_bias_update(e, k, groups, kept, mode):
    """A DeepSeek-V3-style layer (sigmoid scores, ``groups`` groups with the best ``kept``
    kept, top-k, renormalised x 2.5, the expert bias on): the output is the numpy
    reference's routing (moe.routing.route_reference with the bias before the step) through
    gated experts, and a training forward moves the bias by exactly +-gamma, toward the less
    loaded experts. At 8 experts top-2 eagerly; at V3's 256 experts top-8 (8 groups, 4
    kept) in a compiled graph."""
    from ms_efficient.moe.routing import RouterConfig, route_reference

    h, f = 16, 8
    config = RouterConfig(score="sigmoid", scaling_factor=2.5, num_groups=groups,
                          topk_groups=kept, bias_update_speed=1e-3)
    before = ms.get_context("mode")
    ms.set_context(mode=mode)
    try:
        _deepseek_layer_check(h, f, e, k, config, route_reference)
    finally:
        ms.set_context(mode=before)


def _deepseek_layer_check(h, f, e, k, config, route_reference):
    layer = MoEFeedForward(h, f, e, k, 64, dispatch="grouped", expert_kind="glu",
                           has_bias=False, router_config=config)
    bias = (np.array([0.3, -0.2, 0.0, 0.1, -0.3, 0.2, 0.0, -0.1], np.float32) if e == 8
            else np.random.default_rng(3).uniform(-0.3, 0.3, e).astype(np.float32))
    layer.expert_bias.set_data(Tensor(bias))
    layer.set_train(True)
    x = _x(h=h, seed=5)
    y = layer(Tensor(x))[0].asnumpy().reshape(-1, h)
    xt = x.reshape(-1, h).astype(np.float64)
    logits = xt @ layer.router.weight.asnumpy().T.astype(np.float64)
    weights, ids = route_reference(logits, config, k, bias)
    w1, w2 = layer.w1.asnumpy().astype(np.float64), layer.w2.asnumpy().astype(np.float64)
    ref = np.zeros_like(xt)
    for t in range(xt.shape[0]):
        for j in range(k):
            i = ids[t, j]
            ref[t] += weights[t, j] * glu_ffn(xt[t], w1[i][:, :f], w1[i][:, f:], w2[i])
    np.testing.assert_allclose(y, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    load = np.bincount(ids.ravel(), minlength=e)
    expected = bias + np.float32(1e-3) * np.sign(load.mean() - load).astype(np.float32)
    np.testing.assert_array_equal(layer.expert_bias.asnumpy(), expected)
    layer.set_train(False)                         # evaluation leaves the bias alone
    layer(Tensor(x))
    np.testing.assert_array_equal(layer.expert_bias.asnumpy(), expected)


def test_the_reference_model_trains_with_gated_and_shared_experts(tmp_path, text_dir):
    """moe.expert_kind 'glu' and moe.shared_experts 1 (the config keys): the checkpoint holds
    the fused [E, H, 2F] expert tables and the shared expert's projections, and the
    validation loss falls; an expert-parallel run of it is refused naming the key."""
    import json
    import os

    import yaml

    from conftest import tiny_config_dict
    from ms_efficient.cli import main
    from ms_efficient.core.config import check_dispatch, config_from_dict

    cfg = tiny_config_dict(text_dir, str(tmp_path / "run"))
    cfg["moe"].update(expert_kind="glu", shared_experts=1, dispatch="grouped")
    cfg["train"].update(steps=12, eval_every=6, save_every=12)
    path = tmp_path / "glu.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = str(tmp_path / "run")
    assert main(["train", str(path), "--out", out]) == 0
    ckpt_dir = os.path.join(out, "ckpt")
    params = ms.load_checkpoint(os.path.join(ckpt_dir, sorted(os.listdir(ckpt_dir))[-1]))
    assert tuple(params["blocks.0.ffn.w1"].shape) == (4, 32, 128)          # E, H, 2F
    assert tuple(params["blocks.0.ffn.shared.gate_proj.weight"].shape) == (64, 32)
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        vals = [r["val_loss"] for r in map(json.loads, fh) if r["kind"] == "val"]
    assert vals[-1] < vals[0] - 0.5
    # expert-parallel: the balanced layer runs gated and shared experts; a one-process
    # dispatch is refused naming the field and the dispatch that runs expert-parallel
    with pytest.raises(ValueError, match="'moe.dispatch' must be 'balanced' for an "
                                         "expert-parallel run"):
        check_dispatch(config_from_dict(cfg), expert_parallel=True)
    cfg["moe"].update(expert_kind="glu", dispatch="balanced")
    check_dispatch(config_from_dict(cfg), expert_parallel=True)


def test_the_config_names_the_expert_kinds_the_layer_builds():
    import dataclasses

    from ms_efficient.core.config import MoEConfig
    from ms_efficient.moe.experts import EXPERT_KINDS

    for kind in EXPERT_KINDS:
        dataclasses.replace(MoEConfig(), expert_kind=kind).validate("moe")
    with pytest.raises(ValueError, match=r"'moe.expert_kind' must be one of \['mlp', 'glu'\]"):
        dataclasses.replace(MoEConfig(), expert_kind="swiglu").validate("moe")


def test_the_gated_unit_is_swiglu_as_mindspore_documents_it_and_fused_only_on_ascend(
        pynative, monkeypatch):
    """``GatedActivation`` runs Ascend's ``ops.swiglu(h, -1)`` for a SiLU gate on Ascend and
    its split form elsewhere. The fused kernel cannot run here (MindSpore 2.10: Ascend only),
    so the test holds the boundary: the split form equals the documented formula of
    ``ops.swiglu`` (Swish of the FIRST half times the second: the [gate | up] order of the
    fused projection), the choice of form by target and activation, and the refusal of a
    fused non-SiLU gate. Tolerance: float32 elementwise ops against a float64 formula, one
    rounding per op on values below 10 (rtol 1e-6 of |out| plus 1e-6)."""
    from ms_efficient.core import backend
    from ms_efficient.moe.experts import GatedActivation, swiglu_reference, uses_fused_swiglu

    h = np.random.default_rng(0).normal(0, 2, (5, 8)).astype(np.float32)
    unit = GatedActivation(nn.SiLU())
    assert not unit.fused                                                  # CPU: split form
    out = unit(Tensor(h)).asnumpy()
    want = swiglu_reference(h)
    assert out.shape == (5, 4)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    # the halves swapped (up first) is a different function: the order is what is checked
    assert np.abs(swiglu_reference(np.concatenate([h[:, 4:], h[:, :4]], 1)) - want).max() > 0.1
    assert uses_fused_swiglu(nn.SiLU(), backend.ASCEND)
    assert not uses_fused_swiglu(nn.GELU(), backend.ASCEND)
    assert not uses_fused_swiglu(nn.SiLU(), backend.CPU)
    monkeypatch.setattr(backend, "device_target", lambda: backend.ASCEND)
    assert GatedActivation(nn.SiLU()).fused
    assert not GatedActivation(nn.GELU(approximate=True)).fused
    with pytest.raises(ValueError, match="SiLU gates only, but the activation is GELU"):
        GatedActivation(nn.GELU(), fused=True)
