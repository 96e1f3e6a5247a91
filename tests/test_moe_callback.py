"""RoutingTraceCallback: the per-step load sampler inside MindSpore's Model.train."""
import numpy as np
import pytest
import mindspore as ms
import mindspore.dataset as ds
from mindspore import Tensor, nn
from mindspore.train import Model

from ms_efficient.efficientmoe.apply import RoutingTraceCallback
from ms_efficient.moe.layer import MoEFeedForward
from ms_efficient.moe.trace import load_trace


class _Regression(nn.Cell):
    """An MoE layer fitted to targets: returns the scalar loss Model.train expects."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def construct(self, x, target):
        y, aux, _, _ = self.layer(x)
        return ((y - target) ** 2).mean() + 0.01 * aux


def test_callback_records_every_steps_counts_in_model_train(tmp_path):
    """Learning rate 0 keeps the router fixed, so step i's row must equal the counts the
    layer gives for batch i afterwards: 2 source ranks x 4 experts, 8 tokens x top-2."""
    ms.set_seed(0)
    rng = np.random.default_rng(0)
    layer = MoEFeedForward(8, 16, num_experts=4, top_k=2, capacity=16, trace_ranks=2,
                           init_std=0.5)
    net = _Regression(layer)
    xs = rng.standard_normal((3, 2, 4, 8)).astype(np.float32)        # 3 batches [2, 4, 8]
    data = ds.NumpySlicesDataset({"x": xs, "target": np.zeros_like(xs)}, shuffle=False)
    path = tmp_path / "trace.npz"
    cb = RoutingTraceCallback(net, str(path))
    Model(net, optimizer=nn.SGD(net.trainable_params(), learning_rate=0.0)).train(
        1, data, callbacks=[cb], dataset_sink_mode=False)
    trace = load_trace(str(path))
    assert trace.counts.shape == (3, 1, 2, 4)
    assert trace.steps.tolist() == [1, 2, 3]
    assert trace.top_k == 2 and trace.hidden == 8 and trace.tokens_per_rank == 4
    for i in range(3):
        want = layer(Tensor(xs[i]))[2].asnumpy()
        assert trace.counts[i, 0].tolist() == want.tolist()
        assert trace.counts[i, 0].sum() == 2 * 8
    assert len({tuple(trace.counts[i].ravel()) for i in range(3)}) > 1   # rows differ
    assert cb.overhead_s > 0


def test_callback_needs_an_moe_layer_and_a_valid_period():
    with pytest.raises(ValueError, match="has no MoE layer"):
        RoutingTraceCallback(nn.Dense(4, 4))
    layer = MoEFeedForward(8, 16, num_experts=4, top_k=1, capacity=8)
    with pytest.raises(ValueError, match="'save_every' must be an integer >= 0, but got -1"):
        RoutingTraceCallback(layer, save_every=-1)
    with pytest.raises(ValueError, match="no training step"):
        RoutingTraceCallback(layer).trace()


def test_efficientmoe_callback_refuses_a_network_with_only_grouped_layers():
    from ms_efficient.core.config import EfficientMoEConfig
    from ms_efficient.efficientmoe.apply import EfficientMoECallback

    grouped = MoEFeedForward(8, 16, num_experts=4, top_k=1, capacity=8, dispatch="grouped")
    with pytest.raises(ValueError, match="dispatch 'static'.*no capacity to plan"):
        EfficientMoECallback(grouped, EfficientMoEConfig(enabled=True))


def test_trace_steps_keep_counting_up_across_model_train_calls(tmp_path):
    from ms_efficient.cli import main

    ms.set_seed(0)
    layer = MoEFeedForward(8, 16, num_experts=4, top_k=2, capacity=16, trace_ranks=2)
    net = _Regression(layer)
    xs = np.random.default_rng(1).standard_normal((3, 2, 4, 8)).astype(np.float32)
    data = ds.NumpySlicesDataset({"x": xs, "target": np.zeros_like(xs)}, shuffle=False)
    path = tmp_path / "trace.npz"
    cb = RoutingTraceCallback(net, str(path))
    model = Model(net, optimizer=nn.SGD(net.trainable_params(), learning_rate=0.01))
    model.train(1, data, callbacks=[cb], dataset_sink_mode=False)
    model.train(1, data, callbacks=[cb], dataset_sink_mode=False)
    assert load_trace(str(path)).steps.tolist() == [1, 2, 3, 4, 5, 6]
    out = tmp_path / "moe.yaml"
    assert main(["plan", "moe", "--trace", str(path), "--cluster", "ascend910b-1x8",
                 "--out", str(out)]) == 0


class _PhaseLog(ms.train.Callback):
    """The compiled graph's phase after every step: it changes when the step recompiled."""

    def __init__(self):
        super().__init__()
        self.phases = []

    def on_train_step_end(self, run_context):
        self.phases.append(run_context.original_args().train_network.compile_phase)


class _RowAware(nn.Cell):
    """Loss plus 1e-3 x the slot rows the compiled graph computes: ``num_slots`` is read at
    compile time, so the loss shows which capacities the running graph was compiled with."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def construct(self, x, target):
        y, aux, _, _ = self.layer(x)
        return ((y - target) ** 2).mean() + 0.01 * aux + 0.001 * self.layer.num_slots


@pytest.fixture
def graph_mode():
    before = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    yield
    ms.set_context(mode=before)


def test_efficientmoe_callback_replans_capacities_and_the_next_step_recompiles(graph_mode):
    from ms_efficient.core.config import EfficientMoEConfig
    from ms_efficient.efficientmoe.apply import EfficientMoECallback

    ms.set_seed(0)
    layer = MoEFeedForward(8, 16, num_experts=4, top_k=2, capacity=16, init_std=0.5)
    net = _RowAware(layer)
    x = np.random.default_rng(2).standard_normal((2, 8, 8)).astype(np.float32)
    xs = np.stack([x] * 8)                      # one batch 8 times: the same loads each step
    data = ds.NumpySlicesDataset({"x": xs, "target": np.zeros_like(xs)}, shuffle=False)
    # no recompile price: the first plan that saves rows is adopted
    cfg = EfficientMoEConfig(enabled=True, warmup_steps=3, replan_every=4, window=3,
                             capacity_multiple=1, capacity_levels=4, recompile_cost_s=0.0,
                             predictor="last-value")
    cb, phases = EfficientMoECallback(net, cfg), _PhaseLog()

    class _Losses(ms.train.Callback):
        losses = []

        def on_train_step_end(self, run_context):
            self.losses.append(float(run_context.original_args().net_outputs.asnumpy()))

    losses = _Losses()
    Model(net, optimizer=nn.SGD(net.trainable_params(), learning_rate=0.0)).train(
        1, data, callbacks=[cb, phases, losses], dataset_sink_mode=False)
    assert [p["step"] for p in cb.plans] == [3]            # after warm-up; then nothing new
    # the same batch every step, forecast exactly: capacities = the loads, no padding
    load = cb.trace().counts.sum(axis=2)[0, 0]
    assert cb.plans[0]["capacities"] == [load.tolist()] and list(layer.capacities) == load.tolist()
    assert cb.plans[0]["rows_before"] == 4 * 16 and cb.plans[0]["rows_after"] == load.sum()
    # steps 1-3 ran one graph, step 4 compiled the new one and later steps reuse it
    assert len(set(phases.phases[:3])) == 1 and phases.phases[3] != phases.phases[2]
    assert len(set(phases.phases[3:])) == 1
    # lr 0, same batch: the loss moves by exactly 1e-3 x the rows the new graph computes
    assert len(set(losses.losses[:3])) == 1 and len(set(losses.losses[3:])) == 1
    assert losses.losses[2] - losses.losses[3] == pytest.approx(1e-3 * (64 - load.sum()),
                                                                abs=1e-5)
