"""Graphs of networks too large to hold: extraction without weights (``no_init_parameters``)
and the split MINDIR layout ``mindspore.export`` writes above 1 GiB of parameters."""
import os

import numpy as np
import pytest

from ms_efficient.graph import load_graph

pytestmark = pytest.mark.mindspore
FLOAT = 4


def _signature(graph):
    """Everything the planners read of an OpGraph, node by node in graph order."""
    nodes = [(n.name, n.op_type, n.scope, n.phase, n.output_shapes, n.output_dtypes,
              n.input_shapes, n.flops, n.output_bytes, n.param_bytes,
              n.attrs.get("params"), n.attrs.get("input_sources")) for n in graph]
    return nodes, sorted(graph.edges)


def _llama(init: bool):
    import mindspore as ms
    from mindspore import nn
    from mindspore.nn.utils import no_init_parameters

    from tests.user_models import LlamaForCausalLM

    ms.set_seed(0)
    if init:
        net = LlamaForCausalLM(num_layers=2)
    else:
        with no_init_parameters():
            net = LlamaForCausalLM(num_layers=2)
    return nn.WithLossCell(net, nn.CrossEntropyLoss())


def _inputs():
    import mindspore as ms

    rng = np.random.default_rng(0)
    return (ms.Tensor(rng.integers(0, 64, (2, 16)).astype(np.int32)),
            ms.Tensor(rng.integers(0, 64, (32,)).astype(np.int32)))


def test_a_network_without_weights_gives_the_graph_of_the_same_network_with_weights(tmp_path):
    import mindspore as ms
    from mindspore import nn

    from ms_efficient.graph import from_network

    # The ordinary path: real weights and optimizer states, written to a MINDIR file by
    # mindspore.export and read back.
    with_weights = _llama(init=True)
    step = nn.TrainOneStepCell(with_weights, nn.SGD(with_weights.trainable_params(),
                                                    learning_rate=0.01))
    step.set_train(True)
    ms.export(step, *_inputs(), file_name=str(tmp_path / "step"), file_format="MINDIR")
    assert os.path.getsize(tmp_path / "step.mindir") > 3 * FLOAT * sum(
        int(p.size) for p in with_weights.trainable_params())          # weights and SGD states
    written = load_graph(str(tmp_path / "step.mindir"))

    lazy = _llama(init=False)
    assert all(p.has_init for p in lazy.get_parameters())
    extracted = from_network(lazy, *_inputs(), mode="train")
    assert all(p.has_init for p in lazy.get_parameters()), "extraction allocated the weights"
    assert not any(p.has_init for p in with_weights.get_parameters())

    assert _signature(extracted) == _signature(written)
    assert extracted.meta["inputs"] == written.meta["inputs"]
    assert extracted.meta["unattributed_param_bytes"] == written.meta["unattributed_param_bytes"]
    # the parameter bytes, by hand: LlamaForCausalLM(vocab 64, hidden 32, FFN 64, 2 layers)
    per_layer = 4 * 32 * 32 + 3 * 32 * 64 + 2 * 32               # q k v o, MLP, two norms
    weights = (64 * 32 + 2 * per_layer + 32 + 32 * 64) * FLOAT   # + embedding, norm, lm_head
    assert sum(n.param_bytes for n in extracted if n.phase == "forward") == weights
    # SGD's accum and stat per weight, plus its learning rate and momentum (fp32 scalars)
    assert sum(n.param_bytes for n in extracted if n.op_type == "SGD") == 2 * weights + 2 * FLOAT
    assert len(extracted) > 100 and {"MatMul", "Softmax", "SGD"} <= set(
        extracted.count_by_op_type())


def test_the_split_layout_of_a_large_export_is_read_by_its_name(tmp_path, monkeypatch):
    import mindspore as ms
    from mindspore.train import serialization

    net = _llama(init=True)
    ids, _ = _inputs()
    ms.export(net._backbone, ids, file_name=str(tmp_path / "whole"), file_format="MINDIR")
    # MindSpore splits an export whose parameters exceed TOTAL_SAVE KiB (1 GiB); a 0 KiB
    # threshold gives the layout of a large model on this small one.
    monkeypatch.setattr(serialization, "TOTAL_SAVE", 0)
    ms.export(net._backbone, ids, file_name=str(tmp_path / "big"), file_format="MINDIR")
    files = sorted(os.listdir(tmp_path))
    assert files == ["big_graph.mindir", "big_variables", "whole.mindir"]
    assert os.listdir(tmp_path / "big_variables") == ["data_0"]
    weights = sum(int(p.size) for p in net.get_parameters()) * FLOAT
    # the weights moved from the graph file (which gains an external_data record per
    # parameter) into data_0
    assert os.path.getsize(tmp_path / "big_graph.mindir") < os.path.getsize(
        tmp_path / "whole.mindir") - weights * 0.9
    assert os.path.getsize(tmp_path / "big_variables" / "data_0") >= weights

    whole = load_graph(str(tmp_path / "whole.mindir"))
    for name in ("big.mindir", "big_graph.mindir"):
        split = load_graph(str(tmp_path / name))
        assert _signature(split) == _signature(whole)
        assert split.name == "big" and split.meta["layout"] == "split"
        assert split.meta["variables"] == str(tmp_path / "big_variables")
    assert whole.meta["layout"] == "single" and "variables" not in whole.meta
    assert whole.total_param_bytes == weights

    with pytest.raises(ValueError, match="'.*gone.mindir' does not exist, nor does "
                                         "'.*gone_graph.mindir'"):
        load_graph(str(tmp_path / "gone.mindir"))


def test_the_graph_command_reads_a_split_export_by_its_name(tmp_path, monkeypatch, capsys):
    import mindspore as ms
    from mindspore import nn
    from mindspore.train import serialization

    from ms_efficient.cli import main

    monkeypatch.setattr(serialization, "TOTAL_SAVE", 0)
    ms.export(nn.Dense(16, 8), ms.Tensor(np.ones((4, 16), np.float32)),
              file_name=str(tmp_path / "dense"), file_format="MINDIR")
    assert main(["graph", str(tmp_path / "dense.mindir"), "--out", str(tmp_path / "g.json")]) == 0
    assert "| MatMul | 1 |" in capsys.readouterr().out
    assert load_graph(str(tmp_path / "g.json")).total_param_bytes == (16 * 8 + 8) * FLOAT
    assert main(["graph", str(tmp_path / "gone.mindir")]) == 2
    assert "gone_graph.mindir' (the graph file" in capsys.readouterr().err
