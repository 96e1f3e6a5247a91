"""``adopt_moe`` on MoE blocks written the way public Mixtral, Qwen2-MoE and DeepSeek-V3 model
code writes them (here in MindSpore, from the models' published descriptions): gated experts
as lists of Dense, shared experts (plain and sigmoid-gated), a softmax router with and
without renormalising, and DeepSeek-V3's sigmoid, group-limited, bias-selected, scaled
router. The adopted network computes the original's loss and gradients (1e-4)."""
import numpy as np
import pytest

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Normal, initializer

from ms_efficient.adopt import adopt_moe
from ms_efficient.moe import MoEMLP

pytestmark = pytest.mark.mindspore

H, F, E, K, VOCAB = 16, 12, 8, 2, 32


@pytest.fixture(autouse=True)
def _pynative():
    """The numbers, not the compiler, are under test (one test below compiles a step)."""
    mode = ms.get_context("mode")
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    yield
    ms.set_context(mode=mode)


class GatedMLP(nn.Cell):
    """down(silu(gate x) * up x); ``names``: the (gate, up, down) Dense' attribute names,
    registered in ``order`` (Mixtral registers w1, w2, w3: gate, down, up)."""

    def __init__(self, hidden, ffn, names=("gate_proj", "up_proj", "down_proj"),
                 order=(0, 1, 2), bias=False):
        super().__init__()
        self.names = names
        shapes = ((hidden, ffn), (hidden, ffn), (ffn, hidden))
        for i in order:
            setattr(self, names[i], nn.Dense(*shapes[i], has_bias=bias,
                                             weight_init=Normal(0.3)))
        self.act_fn = nn.SiLU()

    def construct(self, x):
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(self.act_fn(gate(x)) * up(x))


def _combine(x_TH, experts, ids_TK, weights_TK):
    """sum_k weights[t, k] * expert_{ids[t, k]}(x_t), every expert on every token, masked."""
    out = ops.zeros_like(x_TH)
    for e, expert in enumerate(experts):
        w_T = (weights_TK * (ids_TK == e).astype(weights_TK.dtype)).sum(axis=1, keepdims=True)
        out = out + w_T * expert(x_TH)
    return out


def _mixtral_route(gate, x):
    """(x_TH, weights_TK, ids_TK): Mixtral's routing, top-K of the softmax, renormalised."""
    x_TH = x.reshape(-1, x.shape[-1])
    weights, ids = ops.topk(ops.softmax(gate(x_TH), -1), K)
    return x_TH, weights / weights.sum(axis=-1, keepdims=True), ids


class MixtralSparseMoeBlock(nn.Cell):
    """Mixtral: gate Dense H -> E without bias; experts w1 (gate), w3 (up), w2 (down) with
    SiLU; top-2 of the softmax, renormalised."""

    def __init__(self):
        super().__init__()
        self.num_experts_per_tok = K
        self.gate = nn.Dense(H, E, has_bias=False, weight_init=Normal(0.5))
        self.experts = nn.CellList([GatedMLP(H, F, ("w1", "w3", "w2"), order=(0, 2, 1))
                                    for _ in range(E)])

    def construct(self, x):
        x_TH, weights, ids = _mixtral_route(self.gate, x)
        return _combine(x_TH, self.experts, ids, weights).reshape(x.shape)


class Qwen2MoeSparseMoeBlock(nn.Cell):
    """Qwen2-MoE: softmax top-2 without renormalising, plus a shared expert scaled by
    sigmoid(shared_expert_gate(x))."""

    def __init__(self):
        super().__init__()
        self.top_k = K
        self.norm_topk_prob = False
        self.gate = nn.Dense(H, E, has_bias=False, weight_init=Normal(0.5))
        self.experts = nn.CellList([GatedMLP(H, F) for _ in range(E)])
        self.shared_expert = GatedMLP(H, 2 * F)
        self.shared_expert_gate = nn.Dense(H, 1, has_bias=False, weight_init=Normal(0.5))

    def construct(self, x):
        b, s, h = x.shape
        x_TH = x.reshape(b * s, h)
        weights, ids = ops.topk(ops.softmax(self.gate(x_TH), -1), K)
        shared = ops.sigmoid(self.shared_expert_gate(x_TH)) * self.shared_expert(x_TH)
        return (_combine(x_TH, self.experts, ids, weights) + shared).reshape(b, s, h)


class MoEGate(nn.Cell):
    """DeepSeek-V3's gate: sigmoid scores; selection on scores + e_score_correction_bias,
    limited to the best ``topk_group`` of ``n_group`` groups (a group scored by the sum of
    its two best); weights = the chosen raw scores, renormalised, times the routed scaling
    factor."""

    def __init__(self):
        super().__init__()
        self.top_k, self.n_group, self.topk_group = K, 4, 2
        self.routed_scaling_factor = 2.5
        self.scoring_func, self.topk_method, self.norm_topk_prob = "sigmoid", "noaux_tc", True
        self.weight = Parameter(initializer(Normal(0.5), (E, H), ms.float32), name="weight")
        bias = np.array([0.3, -0.2, 0.0, 0.1, -0.3, 0.2, 0.05, -0.1], np.float32)
        self.e_score_correction_bias = Parameter(Tensor(bias), name="e_score_correction_bias",
                                                 requires_grad=False)

    def construct(self, x_TH):
        scores = ops.sigmoid(ops.matmul(x_TH, self.weight.T))
        select = scores + self.e_score_correction_bias.reshape(1, -1)
        t = select.shape[0]
        grouped = select.reshape(t, self.n_group, E // self.n_group)
        group_scores = ops.topk(grouped, 2)[0].sum(axis=-1)
        _, kept = ops.topk(group_scores, self.topk_group)
        mask = ops.zeros((t, self.n_group), ms.float32)
        mask = ops.tensor_scatter_elements(mask, kept, ops.ones_like(kept, dtype=ms.float32), 1)
        mask = ops.broadcast_to(mask.reshape(t, self.n_group, 1),
                                (t, self.n_group, E // self.n_group)).reshape(t, E)
        _, ids = ops.topk(ops.select(mask > 0, select, ops.full_like(select, -1e9)), self.top_k)
        weights = ops.gather_elements(scores, 1, ids)
        weights = weights / weights.sum(axis=-1, keepdims=True)
        return ids, weights * self.routed_scaling_factor


class DeepseekV3MoE(nn.Cell):
    """DeepSeek-V3: the gate above, gated routed experts, and a shared expert added."""

    def __init__(self):
        super().__init__()
        self.gate = MoEGate()
        self.experts = nn.CellList([GatedMLP(H, F) for _ in range(E)])
        self.shared_experts = GatedMLP(H, F)

    def construct(self, x):
        b, s, h = x.shape
        x_TH = x.reshape(b * s, h)
        ids, weights = self.gate(x_TH)
        y = _combine(x_TH, self.experts, ids, weights) + self.shared_experts(x_TH)
        return y.reshape(b, s, h)


class TinyLM(nn.Cell):
    """Embedding -> x + block(norm(x)) -> logits: a user network around one MoE block."""

    def __init__(self, block):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, H, embedding_table=Normal(1.0))
        self.norm = nn.LayerNorm((H,))
        self.mlp = block
        self.head = nn.Dense(H, VOCAB, has_bias=False, weight_init=Normal(0.3))

    def construct(self, ids):
        x = self.embed(ids)
        x = x + self.mlp(self.norm(x))
        return self.head(x).reshape(-1, VOCAB)


def _net(block, seed=0):
    ms.set_seed(seed)
    net = nn.WithLossCell(TinyLM(block()), nn.CrossEntropyLoss())
    rng = np.random.default_rng(seed)
    ids = Tensor(rng.integers(0, VOCAB, (2, 8)).astype(np.int32))
    labels = Tensor(rng.integers(0, VOCAB, (16,)).astype(np.int32))
    return net, (ids, labels)


def _loss_and_grads(net, inputs, params):
    loss, grads = ms.value_and_grad(net, None, params)(*inputs)
    return float(loss.asnumpy()), [g.asnumpy() for g in grads]


@pytest.mark.parametrize("block, kind, shared, router, renormalize, dispatch", [
    (MixtralSparseMoeBlock, "glu", False, "softmax", True, "static"),
    (Qwen2MoeSparseMoeBlock, "glu", True, "softmax", False, "grouped"),
    (DeepseekV3MoE, "glu", True, "sigmoid", True, "grouped"),
])
def test_modern_blocks_are_adopted_with_the_originals_loss_gradients_and_names(
        block, kind, shared, router, renormalize, dispatch):
    net, inputs = _net(block)
    params = net.trainable_params()
    names = {id(p): p.name for p in net.get_parameters()}
    loss0, grads0 = _loss_and_grads(net, inputs, params)

    adopted, report = adopt_moe(net, tokens=16, dispatch=dispatch)
    (path, info), = report.items()
    assert path == "_backbone.mlp" and isinstance(dict(net.cells_and_names())[path], MoEMLP)
    assert (info.num_experts, info.top_k, info.hidden_size, info.ffn_hidden_size) == (E, K, H, F)
    assert (info.expert_kind, info.shared, info.renormalize) == (kind, shared, renormalize)
    assert info.router.startswith("softmax" if router == "softmax" else "RouterConfig(score='sigmoid'")
    assert info.activation == "SiLU" and info.probe_error <= 1e-4
    # the user's Parameters (the gate's bias too) are reused under their own names
    assert {id(p) for p in net.trainable_params()} == {id(p) for p in params}
    assert all(p.name == names[id(p)] for p in net.get_parameters() if id(p) in names)

    loss1, grads1 = _loss_and_grads(net, inputs, params)
    assert loss1 == pytest.approx(loss0, rel=1e-4)
    for p, g0, g1 in zip(params, grads0, grads1):
        scale = max(float(np.abs(g0).max()), 1e-6)
        np.testing.assert_allclose(g1, g0, rtol=0, atol=1e-4 * scale, err_msg=p.name)
    assert any(np.abs(g).max() > 1e-3 for p, g in zip(params, grads0) if ".experts." in p.name)


def test_an_adopted_deepseek_gate_keeps_and_updates_its_bias_in_a_compiled_training_step():
    """The gate's e_score_correction_bias is the adopted layer's expert_bias (same Parameter,
    same name, in the checkpointed parameters); one compiled training step moves it by
    gamma * sign(mean load - load) per expert; the loss falls over a few steps."""
    net, (ids, labels) = _net(DeepseekV3MoE)
    bias = net._backbone.mlp.gate.e_score_correction_bias
    before, name = bias.asnumpy().copy(), bias.name
    adopt_moe(net, tokens=16, dispatch="grouped", bias_update_speed=0.01)
    layer = dict(net.cells_and_names())["_backbone.mlp"].moe
    assert layer.expert_bias is bias and bias.name == name == "mlp.gate.e_score_correction_bias"
    assert bias.name in {p.name for p in net.get_parameters()}
    ms.set_context(mode=ms.GRAPH_MODE)
    step = nn.TrainOneStepCell(net, nn.Adam(net.trainable_params(), learning_rate=1e-2))
    step.set_train(True)
    losses = [float(step(ids, labels).asnumpy())]
    load = layer.routing_counts.asnumpy().sum(axis=0)          # the step's assignments
    expected = before + np.float32(0.01) * np.sign(load.mean() - load).astype(np.float32)
    np.testing.assert_array_equal(bias.asnumpy(), expected)
    assert (bias.asnumpy() != before).any()
    for _ in range(3):
        losses.append(float(step(ids, labels).asnumpy()))
    assert losses[-1] < losses[0]


def test_gated_experts_of_another_shape_are_refused_naming_the_expert():
    class Broken(MixtralSparseMoeBlock):
        def __init__(self):
            super().__init__()
            self.experts[3].w3 = nn.Dense(H, F + 1, has_bias=False)

    net, _ = _net(Broken)
    with pytest.raises(ValueError, match=r"expert _backbone\.mlp\.experts\.3 needs two "
                                         r"nn\.Dense.*or three for a gated expert"):
        adopt_moe(net, tokens=16)


def test_gated_experts_with_other_names_are_told_apart_by_shape():
    """Names outside the known ones: down is the Dense whose input is F (the other two share
    H), gate and up in registration order; the probe confirms the choice."""
    class Block(MixtralSparseMoeBlock):
        def __init__(self):
            super().__init__()
            self.experts = nn.CellList([GatedMLP(H, F, ("a", "b", "c"), order=(2, 0, 1))
                                        for _ in range(E)])

    net, inputs = _net(Block)
    loss0 = float(net(*inputs).asnumpy())
    _, report = adopt_moe(net, tokens=16)
    assert report["_backbone.mlp"].expert_kind == "glu"
    assert float(net(*inputs).asnumpy()) == pytest.approx(loss0, rel=1e-5)


class StackedMixtralBlock(nn.Cell):
    """Mixtral with its experts as three stacked weights (the layout of MindFormers' grouped
    MLP and of ports that batch the experts): gate and up [E, H, F], down [E, F, H], no
    biases; ``names`` (gate, up, down) registered in ``order``."""

    def __init__(self, names=("w1", "w3", "w2"), order=(0, 2, 1)):
        super().__init__()
        self.names = names
        self.num_experts_per_tok = K
        self.gate = nn.Dense(H, E, has_bias=False, weight_init=Normal(0.5))
        shapes = ((E, H, F), (E, H, F), (E, F, H))
        for i in order:
            setattr(self, names[i], Parameter(initializer(Normal(0.3), shapes[i], ms.float32),
                                              name=names[i]))
        self.act_fn = nn.SiLU()

    def construct(self, x):
        x_TH, weights, ids = _mixtral_route(self.gate, x)
        gate, up, down = (getattr(self, n) for n in self.names)
        x_ETH = ops.broadcast_to(x_TH[None], (E,) + x_TH.shape)
        y_ETH = ops.bmm(self.act_fn(ops.bmm(x_ETH, gate)) * ops.bmm(x_ETH, up), down)
        out = ops.zeros_like(x_TH)
        for e in range(E):
            w_T = (weights * (ids == e).astype(weights.dtype)).sum(axis=1, keepdims=True)
            out = out + w_T * y_ETH[e]
        return out.reshape(x.shape)


@pytest.mark.parametrize("names, order", [(("w1", "w3", "w2"), (0, 2, 1)),
                                          (("p", "q", "r"), (2, 0, 1))])
def test_stacked_gated_experts_are_adopted_with_the_originals_loss_and_gradients(names, order):
    """Three stacked weights: by name (w1 gate, w3 up, w2 down), or else by shape (down is
    the [E, F, H] one; gate and up in registration order); the user's Parameters are reused
    and loss and gradients equal the original's (1e-4)."""
    net, inputs = _net(lambda: StackedMixtralBlock(names, order))
    params = net.trainable_params()
    loss0, grads0 = _loss_and_grads(net, inputs, params)
    _, report = adopt_moe(net, tokens=16, dispatch="grouped")
    info = report["_backbone.mlp"]
    assert (info.expert_kind, info.num_experts, info.ffn_hidden_size) == ("glu", E, F)
    assert {id(p) for p in net.trainable_params()} == {id(p) for p in params}
    loss1, grads1 = _loss_and_grads(net, inputs, params)
    assert loss1 == pytest.approx(loss0, rel=1e-4)
    for p, g0, g1 in zip(params, grads0, grads1):
        scale = max(float(np.abs(g0).max()), 1e-6)
        np.testing.assert_allclose(g1, g0, rtol=0, atol=1e-4 * scale, err_msg=p.name)


def test_stacked_gated_experts_whose_shapes_cannot_tell_down_apart_need_their_names():
    """Three stacked weights of one shape (as with H == F): the shapes cannot tell down from
    gate and up, so names outside the known ones are refused."""
    class Square(StackedMixtralBlock):
        def __init__(self):
            super().__init__(("p", "q", "r"), (0, 1, 2))
            self.r = Parameter(initializer(Normal(0.3), (E, H, F), ms.float32), name="r")

    net, _ = _net(Square)
    with pytest.raises(ValueError, match=r"three stacked expert weights are gated experts"):
        adopt_moe(net, tokens=16)


@pytest.mark.parametrize("block", [MixtralSparseMoeBlock, DeepseekV3MoE])
def test_expert_parallel_adoption_at_one_rank_keeps_the_originals_loss_and_gradients(block):
    """``adopt_moe(..., expert_parallel=True)`` before ``init()`` (W = 1): the block becomes
    the balanced expert-parallel layer holding the experts as slot tables (gate | up fused),
    the router, shared expert and gate bias stay the user's Parameters under their names, and
    the network computes the original's loss and gradients (1e-4): the dense ones directly,
    every expert's gate / up / down from its rows of w1 and w2."""
    from ms_efficient.moe.balanced_ep import BalancedExpertParallelMoE

    net, inputs = _net(block)
    params = net.trainable_params()
    names = {id(p): p.name for p in net.get_parameters()}
    experts = net._backbone.mlp.experts
    gate_up_down = [tuple(getattr(ex, n).weight for n in ex.names) for ex in experts]
    loss0, grads0 = _loss_and_grads(net, inputs, params)
    g0 = dict(zip((p.name for p in params), grads0))

    adopt_moe(net, tokens=16, expert_parallel=True)
    layer = dict(net.cells_and_names())["_backbone.mlp"].moe
    assert isinstance(layer, BalancedExpertParallelMoE) and layer.world == 1
    assert layer.expert_names == ("w1", "w2") and tuple(layer.w1.shape) == (E, H, 2 * F)
    kept = [p for p in net.trainable_params() if id(p) in names]
    assert all(p.name == names[id(p)] for p in kept)
    assert {p.name for p in kept} == {p.name for p in params if ".experts." not in p.name}
    assert {p.name for p in net.trainable_params() if id(p) not in names} == {
        "mlp.moe.w1", "mlp.moe.w2"}

    new = net.trainable_params()
    loss1, grads1 = _loss_and_grads(net, inputs, new)
    assert loss1 == pytest.approx(loss0, rel=1e-4)
    g1 = dict(zip((p.name for p in new), grads1))

    def close(a, b, name):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * max(float(np.abs(b).max()), 1e-6),
                                   err_msg=name)

    for p in kept:
        close(g1[p.name], g0[p.name], p.name)
    home = layer.home_table.asnumpy()[0]                # slot s holds expert home[s]
    for slot, e in enumerate(home):
        gate, up, down = (g0[w.name] for w in gate_up_down[e])
        close(g1["mlp.moe.w1"][slot], np.concatenate((gate.T, up.T), axis=1), f"w1 of {e}")
        close(g1["mlp.moe.w2"][slot], down.T, f"w2 of {e}")


def test_the_expert_parallel_train_step_needs_the_optimizer_built_after_adoption():
    from ms_efficient import TrainOneStepCell

    net, _ = _net(MixtralSparseMoeBlock)
    early = nn.Adam(net.trainable_params(), learning_rate=1e-3)
    adopt_moe(net, tokens=16, expert_parallel=True)
    with pytest.raises(ValueError, match=r"the optimizer does not update the expert "
                                         r"Parameters \['mlp.moe.w1', 'mlp.moe.w2'\]; build it "
                                         r"after adopt_moe\(\.\.\., expert_parallel=True\)"):
        TrainOneStepCell(net, early)
    with pytest.raises(ValueError, match=r"'spare_slots' must be an int >= 0, but got -1"):
        adopt_moe(_net(MixtralSparseMoeBlock)[0], tokens=16, expert_parallel=True,
                  spare_slots=-1)


@pytest.mark.parametrize("block", [MixtralSparseMoeBlock, DeepseekV3MoE, StackedMixtralBlock])
def test_save_moe_checkpoint_writes_the_original_network_back_in_its_own_names(block,
                                                                              tmp_path):
    """Right after expert-parallel adoption (W = 1) nothing has trained, so the checkpoint
    ``save_moe_checkpoint`` writes holds exactly the original network's Parameters: the same
    names (no package buffer), the same values bit for bit (experts split from the fused
    gate | up table, transposed back to Dense layout for lists); the original network loads it
    and computes the same loss."""
    from ms_efficient import save_moe_checkpoint

    net, inputs = _net(block)
    before = {p.name: p.asnumpy().copy() for p in net.get_parameters()}
    loss0 = float(net(*inputs).asnumpy())
    adopt_moe(net, tokens=16, expert_parallel=True)
    path = str(tmp_path / "user.ckpt")
    arrays = save_moe_checkpoint(net, path)
    saved = {n: v.asnumpy() for n, v in ms.load_checkpoint(path).items()}
    assert sorted(saved) == sorted(arrays) == sorted(before)
    for name, value in before.items():
        np.testing.assert_array_equal(saved[name], value, err_msg=name)
    fresh, _ = _net(block, seed=1)                       # other initial values
    assert not ms.load_param_into_net(fresh, ms.load_checkpoint(path))[0]   # nothing left out
    assert float(fresh(*inputs).asnumpy()) == pytest.approx(loss0, rel=1e-6)


class BiasedMixtralBlock(MixtralSparseMoeBlock):
    """Mixtral's block with biases on every expert projection (b1, b3, b2 in the layer)."""

    def __init__(self):
        super().__init__()
        self.experts = nn.CellList([GatedMLP(H, F, ("w1", "w3", "w2"), order=(0, 2, 1),
                                             bias=True) for _ in range(E)])


@pytest.mark.parametrize("block, adam", [(MixtralSparseMoeBlock, "AdamWeightDecay"),
                                         (BiasedMixtralBlock, "Adam"),
                                         (StackedMixtralBlock, "Adam"),
                                         (DeepseekV3MoE, "Adam")])
def test_a_checkpoint_with_the_optimizer_state_continues_the_run_where_it_stopped(block, adam,
                                                                                 tmp_path):
    """``save_moe_checkpoint(net, path, optimizer)`` after 3 expert-parallel steps holds the
    original network's Parameters AND the state of the same optimizer built on the original
    network, under exactly its names and shapes (that optimizer loads it whole). A fresh
    network loaded from it, adopted again, with ``load_moe_optimizer_state``, continues with
    the losses of the unbroken run (same process, same kernels: 1e-6); without the state
    (Adam's moments and step restarting) the losses differ. An optimizer of another kind
    is refused, naming the state it misses."""
    from ms_efficient import TrainOneStepCell, load_moe_optimizer_state, save_moe_checkpoint

    def adopted(seed, load=None, state=True):
        net, _ = _net(block, seed)
        if load is not None:
            assert not ms.load_param_into_net(net, ms.load_checkpoint(load))[0]
        adopt_moe(net, tokens=16, expert_parallel=True)
        opt = getattr(nn, adam)(net.trainable_params(), learning_rate=1e-2)
        if load is not None and state:
            load_moe_optimizer_state(net, opt, load)
        return net, opt, TrainOneStepCell(net, opt)

    _, inputs = _net(block, 0)
    net, opt, step = adopted(0)
    for _ in range(3):
        step(*inputs)
    path = str(tmp_path / "run.ckpt")
    save_moe_checkpoint(net, path, opt)
    after = [float(step(*inputs).asnumpy()) for _ in range(3)]

    original, _ = _net(block, 0)
    own = getattr(nn, adam)(original.trainable_params(), learning_rate=1e-2)
    saved = ms.load_checkpoint(path)
    want = {p.name: tuple(p.shape) for p in
            list(original.get_parameters()) + list(own.get_parameters())}
    assert {n: tuple(v.shape) for n, v in saved.items()} == want
    assert not ms.load_param_into_net(own, saved)[0]
    assert float(saved["global_step"].asnumpy().ravel()[0]) == 3

    _, _, resumed_step = adopted(1, load=path)
    resumed = [float(resumed_step(*inputs).asnumpy()) for _ in range(3)]
    np.testing.assert_allclose(resumed, after, rtol=1e-6)
    _, _, fresh_step = adopted(1, load=path, state=False)
    fresh = [float(fresh_step(*inputs).asnumpy()) for _ in range(3)]
    assert np.abs(np.array(fresh) - after).max() > 1e-4 * abs(after[0])

    other, _, _ = adopted(2)
    momentum = nn.Momentum(other.trainable_params(), learning_rate=1e-2, momentum=0.9)
    with pytest.raises(ValueError, match=r"the checkpoint has no optimizer state '?\[?'moments\."):
        load_moe_optimizer_state(other, momentum, path)
