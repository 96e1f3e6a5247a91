"""MoE that drops in (issue 25, item 6): ``adopt_moe`` replaces a user's own MoE blocks by the
package's layer with the same outputs, gradients and parameter names, the MoE passes and
callbacks plan the adopted layers, and ``MoEMLP`` drops into a built network as an MLP."""
import numpy as np
import pytest

import mindspore as ms
from mindspore import Parameter, nn, ops
from mindspore.common.initializer import Normal, initializer

import ms_efficient
from ms_efficient.core.config import config_from_dict
from ms_efficient.adopt import adopt_moe, find_moe_blocks
from ms_efficient.moe import MoEMLP, replace_cell
from tests.test_user_networks import _assert_refused, _record_trace, _train_steps
from tests.user_models import LlamaForCausalLM, UserStackedMoE, user_moe_with_loss

pytestmark = [pytest.mark.mindspore, pytest.mark.usefixtures("shared_graphs")]
BLOCKS = ["_backbone.layers.0.mlp", "_backbone.layers.1.mlp"]
TOKENS = 16                                        # user_moe_with_loss: batch 2 x seq 8


@pytest.fixture(autouse=True)
def _graph_mode():
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")


def _loss_and_grads(net, inputs, params):
    loss, grads = ms.value_and_grad(net, None, params)(*inputs)
    return float(loss.asnumpy()), [g.asnumpy() for g in grads]


@pytest.mark.parametrize("kind, moe, renormalize, activation, dispatch", [
    ("stacked", {"gating": "topk_softmax"}, True, "GELU", "static"),   # Mixtral: renormalised
    ("stacked", {"gating": "softmax_topk", "act": "relu_fn"}, False, "ReLU", "static"),
    ("stacked", {"gating": "renorm", "act": "relu_fn"}, True, "ReLU", "static"),
    ("stacked", {"bias": False}, True, "GELU", "static"),            # Mixtral: no biases
    ("list", {"norm_topk_prob": False}, False, "ReLU", "static"),     # read from the attribute
    ("list", {"norm_topk_prob": True}, True, "ReLU", "grouped"),      # padding-free layer
])
def test_adopted_network_has_the_outputs_gradients_and_names_of_the_original(
        kind, moe, renormalize, activation, dispatch):
    net, inputs = user_moe_with_loss(kind, **moe)
    params = net.trainable_params()
    names = {id(p): p.name for p in net.get_parameters()}
    loss0, grads0 = _loss_and_grads(net, inputs, params)

    adopted, report = adopt_moe(net, tokens=TOKENS, dispatch=dispatch)
    assert adopted is net and sorted(report) == BLOCKS
    for block in report.values():
        assert (block.num_experts, block.top_k, block.hidden_size, block.ffn_hidden_size) == \
            (4, 2, 16, 24)
        assert block.renormalize is renormalize and block.activation == activation
        assert block.experts == kind and block.probe_error <= 1e-4
        assert block.capacity == (TOKENS if dispatch == "static" else 0)   # dropless
    cells = dict(net.cells_and_names())
    assert all(isinstance(cells[p], MoEMLP) for p in BLOCKS)
    # the user's Parameters are reused under their own names; only buffers are new
    assert {id(p) for p in net.trainable_params()} == {id(p) for p in params}
    assert all(p.name == names[id(p)] for p in params)
    new = sorted(p.name for p in net.get_parameters() if id(p) not in names)
    assert new == sorted(f"layers.{i}.mlp.{n}" for i in (0, 1)
                         for n in ("aux_loss", "dropped", "moe.routing_counts"))

    loss1, grads1 = _loss_and_grads(net, inputs, params)
    assert loss1 == pytest.approx(loss0, abs=1e-5)
    for p, g0, g1 in zip(params, grads0, grads1):
        np.testing.assert_allclose(g1, g0, rtol=1e-4, atol=1e-5, err_msg=p.name)
    assert any(np.abs(g).max() > 1e-3 for p, g in zip(params, grads0) if ".mlp." in p.name)
    stats = cells[BLOCKS[0]].statistics()
    assert stats["dropped"] == 0 and stats["counts"].sum() == TOKENS * 2


def test_the_gating_choice_is_checked_not_assumed():
    """Forcing the other renormalisation than the block computes is refused by the probe."""
    net, _ = user_moe_with_loss("stacked", gating="softmax_topk")
    with pytest.raises(ValueError, match=r"no gating / activation reproduces MoE block "
                                         r"'_backbone.layers.0.mlp'.*renormalize \[True\]"):
        adopt_moe(net, tokens=TOKENS, renormalize=True)
    # nothing was replaced and no name changed
    assert find_moe_blocks(net) == BLOCKS
    assert "layers.0.mlp.gate.weight" in [p.name for p in net.get_parameters()]


def test_adopted_layers_are_planned_by_the_moe_passes_and_callbacks_and_train(tmp_path):
    from ms_efficient.moe.layer import MoEFeedForward

    net, inputs = user_moe_with_loss("stacked")
    for name in ("efficientmoe", "mpipe"):                 # before: a hint how to adopt
        _assert_refused(net, config_from_dict({"optimize": {"passes": [name]}}), inputs, name,
                        r"MoE blocks of its own at \['_backbone.layers.0.mlp', "
                        r"'_backbone.layers.1.mlp'\].*adopt_moe")
    net, _ = adopt_moe(net, tokens=TOKENS)
    trace = _record_trace(net, inputs, tmp_path / "trace.npz")     # RoutingTraceCallback
    assert trace.counts.shape[1:] == (2, 1, 4) and trace.top_k == 2
    assert [list(c.capacities) for _, c in net.cells_and_names()
            if isinstance(c, MoEFeedForward)] == [[TOKENS] * 4] * 2
    cfg = config_from_dict({
        "optimize": {"passes": ["efficientmoe", "mpipe"]},
        "efficientmoe": {"history": str(tmp_path / "trace.npz"), "capacity_multiple": 1,
                         "drop_target": 0.0},
        "cluster": {"preset": "ascend910b-1x8",
                    "intra_link": {"bandwidth_Bps": 1e7, "latency_s": 1e-6}}})
    net, plans = ms_efficient.optimize(net, cfg, sample_inputs=inputs)
    layers = [f"{b}.moe" for b in BLOCKS]
    em = plans["efficientmoe"]["cells"]
    assert sorted(em) == layers
    load = trace.counts.sum(axis=2)[-1]                   # the same batch every step
    for i, path in enumerate(layers):
        assert all(c >= n for c, n in zip(em[path]["capacities"], load[i]))
    rows = plans["efficientmoe"]
    assert rows["rows_after"] < rows["rows_before"] == 2 * 4 * TOKENS     # dropless before
    # the same batch every step and no drops allowed: every expert gets exactly its load
    # (at least one row: a capacity is a multiple >= 1)
    assert rows["rows_after"] == np.maximum(load, 1).sum()
    assert rows["drop_rate_on_trace"] == 0.0
    cells = dict(net.cells_and_names())
    for path, plan in plans["mpipe"]["cells"].items():
        assert path in layers and type(cells[path]).__name__ == "PipelinedMoE"
    assert plans["mpipe"]["cells"]
    losses = _train_steps(net, inputs)
    assert len(losses) >= 2 and all(np.isfinite(losses))


class GatedMoE(UserStackedMoE):
    """Three stacked weights (gate, up, down by their names w1, w3, w2) and the two-matrix
    block's biases: stacked gated experts are recognised without biases only."""

    def __init__(self):
        super().__init__(16, 24, 4, 2)
        self.w3 = Parameter(initializer(Normal(0.2), (4, 16, 24), ms.float32), name="w3")


class Wrapper(nn.Cell):
    def __init__(self, block):
        super().__init__()
        self.ffn = block

    def construct(self, x):
        return self.ffn(x)


def test_blocks_outside_the_contract_and_networks_without_moe_are_refused():
    with pytest.raises(ValueError, match=r"MoE block 'ffn': Parameters \{'b1': \(4, 24\), "
                                         r"'b2': \(4, 16\)\} are not part of the contract "
                                         r"\(stacked gated experts have no biases here\)"):
        adopt_moe(Wrapper(GatedMoE()), tokens=TOKENS)
    block = UserStackedMoE(16, 24, 4, 2)
    del block.top_k
    with pytest.raises(ValueError, match=r"'ffn' has no int attribute among \['top_k'.*"
                                         r"adopt_moe\(\.\.\., top_k=K\)"):
        adopt_moe(Wrapper(block), tokens=TOKENS)
    with pytest.raises(ValueError, match="found no MoE block in LlamaForCausalLM"):
        adopt_moe(LlamaForCausalLM(), tokens=TOKENS)
    assert find_moe_blocks(Wrapper(nn.Conv1d(4, 4, 3))) == []      # a 3-D weight alone
    with pytest.raises(ValueError, match="'tokens' must be an int >= 1"):
        adopt_moe(Wrapper(UserStackedMoE(16, 24, 4, 2)), tokens=0)


def test_moe_mlp_drops_into_a_built_network_with_full_path_names_and_trains():
    """Plain assignment names both layers' weights 'mlp.moe.w1' (MindSpore prefixes only the
    attribute) and the optimizer refuses the duplicate; replace_cell names them by path."""
    net = LlamaForCausalLM(num_layers=2)
    for i in range(2):
        net.model.layers[i].mlp = MoEMLP(32, 64, 4, 2, capacity=32)
    with pytest.raises(ValueError, match="'mlp.moe.w1' already exists"):
        nn.Adam(net.trainable_params())

    ms.set_seed(0)
    net = LlamaForCausalLM(num_layers=2)
    loss_net = nn.WithLossCell(net, nn.CrossEntropyLoss())
    for i in range(2):
        replace_cell(loss_net, f"_backbone.model.layers.{i}.mlp",
                     MoEMLP(32, 64, 4, 2, capacity=32, aux_loss_coef=0.01))
    names = [p.name for p in net.get_parameters()]
    assert "model.layers.1.mlp.moe.w1" in names and "model.layers.0.mlp.moe.router.weight" in names
    assert len(set(names)) == len(names)
    rng = np.random.default_rng(0)
    inputs = (ms.Tensor(rng.integers(0, 64, (2, 16)).astype(np.int32)),
              ms.Tensor(rng.integers(0, 64, (32,)).astype(np.int32)))
    losses = _train_steps(loss_net, inputs)
    assert len(losses) >= 2 and all(np.isfinite(losses))
    stats = net.model.layers[0].mlp.statistics()
    assert stats["counts"].sum() == 32 * 2 and stats["aux_loss"] >= 1.0 - 1e-6   # E sum f p >= 1


class AuxNet(nn.Cell):
    """y.sum() through an MoEMLP (aux gradient injected), or y.sum() + coef * aux explicitly."""

    def __init__(self, mlp, explicit_coef=0.0):
        super().__init__()
        self.mlp = mlp
        self.coef = explicit_coef

    def construct(self, x):
        if self.coef > 0:
            y, aux = self.mlp.forward_with_aux(x)
            return y.sum() + self.coef * aux
        return self.mlp(x).sum()


def test_the_aux_loss_coefficient_adds_the_gradient_of_coef_times_the_aux_loss():
    ms.set_seed(1)
    inner = MoEMLP(8, 16, 4, 2, capacity=16, init_std=0.5).moe
    x = ms.Tensor(np.random.default_rng(1).standard_normal((2, 8, 8)).astype(np.float32))
    router = [inner.router.weight]
    injected = ms.grad(AuxNet(MoEMLP(layer=inner, aux_loss_coef=0.5)), None, router)(x)
    explicit = ms.grad(AuxNet(MoEMLP(layer=inner), explicit_coef=0.5), None, router)(x)
    plain = ms.grad(AuxNet(MoEMLP(layer=inner)), None, router)(x)
    np.testing.assert_allclose(injected[0].asnumpy(), explicit[0].asnumpy(), rtol=1e-5,
                               atol=1e-6)
    assert np.abs(injected[0].asnumpy() - plain[0].asnumpy()).max() > 1e-4
    assert ops.isfinite(injected[0]).all()


def test_a_one_expert_moe_mlp_equals_the_dense_ffn_forward_and_gradient():
    """E = 1, k = 1, no biases, ReLU, gates kept as they are (the one softmax weight is 1):
    relu(x w1) w2 on a [T, H] input, and d sum(y) / dx = (relu'(x w1) * (1 w2^T)) w1^T."""
    t, h, f = 12, 8, 16
    mlp = MoEMLP(h, f, 1, 1, capacity=t, activation=nn.ReLU(), renormalize=False,
                 has_bias=False, init_std=0.5)
    x = np.random.default_rng(2).standard_normal((t, h)).astype(np.float32)
    w1, w2 = mlp.moe.w1.asnumpy()[0], mlp.moe.w2.asnumpy()[0]
    a = x @ w1
    np.testing.assert_allclose(mlp(ms.Tensor(x)).asnumpy(), np.maximum(a, 0) @ w2, rtol=1e-5,
                               atol=1e-5)
    gx = ms.grad(AuxNet(mlp), 0)(ms.Tensor(x)).asnumpy()
    np.testing.assert_allclose(gx, ((a > 0) * (np.ones((t, h)) @ w2.T)) @ w1.T, rtol=1e-4,
                               atol=1e-5)
    assert mlp.statistics()["counts"].tolist() == [[t]]
