"""The padding-free grouped MoE path: equivalences with a dense FFN, with a per-assignment
numpy loop and with the static-capacity layer when nothing drops (outputs and gradients)."""
import numpy as np
import pytest

import mindspore as ms
from mindspore import Tensor, nn

from ms_efficient.moe.layer import MoEFeedForward

ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")


def gelu_tanh(a):
    return 0.5 * a * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (a + 0.044715 * a ** 3)))


def layer_pair(h=16, f=32, e=4, k=2, tokens=24, seed=0):
    """A grouped layer and a static dropless one (capacity = tokens) with the same weights,
    biases set non-zero so that they matter."""
    rng = np.random.default_rng(seed)
    grouped = MoEFeedForward(h, f, e, k, capacity=tokens, dispatch="grouped")
    static = MoEFeedForward(h, f, e, k, capacity=tokens)
    for name, shape in (("b1", (e, 1, f)), ("b2", (e, 1, h))):
        getattr(grouped, name).set_data(Tensor(0.1 * rng.standard_normal(shape), ms.float32))
    router = Tensor(rng.standard_normal((e, h)), ms.float32)      # a spread-out routing
    grouped.router.weight.set_data(router)
    for src, dst in zip(grouped.get_parameters(), static.get_parameters()):
        dst.set_data(src.data.copy())
    return grouped, static


def reference(layer, x_TH):
    """Per assignment, in numpy: out[t] = sum_k w[t, k] * FFN_{e[t, k]}(x[t])."""
    w1, b1, w2, b2 = (getattr(layer, n).asnumpy() for n in ("w1", "b1", "w2", "b2"))
    logits = x_TH @ layer.router.weight.asnumpy().T
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    top = np.argsort(-p, axis=-1, kind="stable")[:, :layer.top_k]
    gate = np.take_along_axis(p, top, -1)
    gate /= gate.sum(-1, keepdims=True)
    out = np.zeros_like(x_TH)
    for t in range(x_TH.shape[0]):
        for j, e in enumerate(top[t]):
            out[t] += gate[t, j] * (gelu_tanh(x_TH[t] @ w1[e] + b1[e, 0]) @ w2[e] + b2[e, 0])
    return out


class Loss(nn.Cell):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def construct(self, x):
        y, aux, _, _ = self.layer(x)
        return (y * y).sum() + aux


def test_grouped_path_matches_a_per_assignment_loop_and_never_drops():
    grouped, _ = layer_pair()
    x = np.random.default_rng(1).standard_normal((2, 12, 16)).astype(np.float32)
    y, aux, counts, dropped = grouped(Tensor(x))
    ref = reference(grouped, x.reshape(-1, 16)).reshape(x.shape)
    np.testing.assert_allclose(y.asnumpy(), ref, rtol=1e-4, atol=1e-5)
    assert int(dropped.asnumpy()) == 0 and int(counts.asnumpy().sum()) == 24 * 2


def test_one_expert_grouped_layer_is_the_dense_ffn():
    grouped, _ = layer_pair(e=1, k=1)
    x = np.random.default_rng(2).standard_normal((1, 24, 16)).astype(np.float32)
    w1, b1, w2, b2 = (getattr(grouped, n).asnumpy()[0] for n in ("w1", "b1", "w2", "b2"))
    dense = gelu_tanh(x[0] @ w1 + b1) @ w2 + b2
    np.testing.assert_allclose(grouped(Tensor(x))[0].asnumpy()[0], dense, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("empty_experts", [False, True])
def test_grouped_equals_the_static_layer_when_nothing_drops_outputs_and_gradients(empty_experts):
    """empty_experts: positive inputs and a router that sends every token to experts 0 and
    1, so experts 2 and 3 get no row (an empty group must still train)."""
    grouped, static = layer_pair(seed=3)
    x = np.random.default_rng(4).standard_normal((2, 12, 16))
    if empty_experts:
        x = np.abs(x)
        router = np.stack([np.full(16, 1.0), np.full(16, 0.9), np.full(16, -1.0),
                           np.full(16, -1.0)]).astype(np.float32)
        for layer in (grouped, static):
            layer.router.weight.set_data(Tensor(router))
    x = Tensor(x, ms.float32)
    yg, auxg, cg, _ = grouped(x)
    ys, auxs, cs, ds = static(x)
    assert int(ds.asnumpy()) == 0
    np.testing.assert_allclose(yg.asnumpy(), ys.asnumpy(), rtol=1e-5, atol=1e-6)
    assert float(auxg.asnumpy()) == pytest.approx(float(auxs.asnumpy()), rel=1e-6)
    assert np.array_equal(cg.asnumpy(), cs.asnumpy())
    if empty_experts:
        assert cg.asnumpy()[0, 2:].tolist() == [0, 0]
    grads = []
    for layer in (grouped, static):
        net = Loss(layer)
        fn = ms.value_and_grad(net, 0, net.trainable_params())
        _, (gx, gw) = fn(x)
        grads.append((gx.asnumpy(), [g.asnumpy() for g in gw]))
    np.testing.assert_allclose(grads[0][0], grads[1][0], rtol=1e-4, atol=1e-6)
    for a, b in zip(grads[0][1], grads[1][1]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_a_grouped_layer_has_no_capacities_to_set_and_bad_modes_are_named():
    grouped, _ = layer_pair()
    with pytest.raises(ValueError, match="no capacities to set"):
        grouped.set_capacities(8)
    with pytest.raises(ValueError, match=r"'dispatch' must be one of \['static', 'grouped'\], "
                                         r"but got 'padded'"):
        MoEFeedForward(16, 32, 4, 2, capacity=8, dispatch="padded")


def test_a_grouped_model_trains_with_no_padding_and_no_drops(tmp_path, text_dir):
    """moe.dispatch 'grouped' through the config, the model and the trainer: the logged
    padding and drop rates are exactly 0 and the loss falls; the same seed with static
    dropless capacities (capacity = 128 tokens per expert, 4 experts, top-2) pads 50 %."""
    import json
    import os

    import yaml
    from conftest import tiny_config_dict
    from ms_efficient.core.config import load_config
    from ms_efficient.train.trainer import Trainer

    cfg = tiny_config_dict(text_dir, str(tmp_path / "run"))
    cfg["train"].update(steps=8, save_every=8, eval_every=8, log_every=8)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    logged = {}
    for dispatch in ("grouped", "static"):
        run = load_config(str(path), {"moe.dispatch": dispatch, "moe.capacity_factor": 0})
        out = str(tmp_path / dispatch)
        Trainer(run, out).run()
        with open(os.path.join(out, "metrics.jsonl")) as fh:
            logged[dispatch] = [r for r in map(json.loads, fh) if r["kind"] == "train"][-1]
    assert logged["grouped"]["padding_fraction"] == 0.0 and logged["grouped"]["drop_rate"] == 0.0
    assert logged["static"]["padding_fraction"] == pytest.approx(0.5)
    assert logged["grouped"]["loss"] == pytest.approx(logged["static"]["loss"], rel=1e-3)


def test_config_names_a_bad_dispatch_and_the_run_it_does_not_suit(tmp_path, text_dir):
    """One vocabulary for every run (config.DISPATCH_NAMES); check_dispatch says which of it
    suits the run: balanced only expert-parallel (grouped and static are one-process
    dispatches), EfficientMoE in one process with static only. The trainers and the
    launcher call it before building anything."""
    import yaml
    from conftest import tiny_config_dict
    from ms_efficient.core.config import check_dispatch, load_config

    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config_dict(text_dir, str(tmp_path / "run"))))
    with pytest.raises(ValueError, match=r"'moe.dispatch' must be one of \['static', "
                                         r"'grouped', 'balanced'\], but got 'padless'"):
        load_config(str(path), {"moe.dispatch": "padless"})
    grouped_on = load_config(str(path), {"moe.dispatch": "grouped", "efficientmoe.enabled": True})
    with pytest.raises(ValueError, match=r"'efficientmoe.enabled' must be false for a "
                                         r"one-process run \(EfficientMoE places experts"):
        check_dispatch(grouped_on, expert_parallel=False)
    static = load_config(str(path))
    check_dispatch(static, expert_parallel=False)
    balanced = load_config(str(path), {"moe.dispatch": "balanced"})
    check_dispatch(balanced, expert_parallel=True)
    for cfg in (static, grouped_on):
        with pytest.raises(ValueError, match=r"'moe.dispatch' must be 'balanced' for an "
                                             r"expert-parallel run .*; 'static' and 'grouped' "
                                             r"are one-process dispatches, but got "):
            check_dispatch(cfg, expert_parallel=True)
