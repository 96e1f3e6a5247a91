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


def test_efficientmoe_callback_refuses_a_network_without_expert_parallel_layers():
    from ms_efficient.core.config import EfficientMoEConfig
    from ms_efficient.efficientmoe.apply import EfficientMoECallback

    for dispatch in ("static", "grouped"):
        layer = MoEFeedForward(8, 16, num_experts=4, top_k=1, capacity=8, dispatch=dispatch)
        with pytest.raises(ValueError, match=r"has no expert-parallel MoE layer "
                                             r"\(BalancedExpertParallelMoE\) to re-place.*"
                                             r"One-process layers have one device"):
            EfficientMoECallback(layer, EfficientMoEConfig(enabled=True))


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


