"""optimize()'s memopt pass on user networks (issue 25, items 3 and 7): a budget below the
feasible floor is one error naming the floor as a share of the unoptimised peak and in bytes,
and the share it suggests plans; memopt_cells globs match one level; a network without
repeated blocks plans the Cells of its largest SequentialCell."""
import itertools

import numpy as np
import pytest

import mindspore as ms
from mindspore import nn

import ms_efficient
from ms_efficient.core.config import config_from_dict
from ms_efficient.core.units import format_size
from tests.test_user_networks import _assert_refused
from tests.user_models import llama_with_loss

pytestmark = [pytest.mark.mindspore, pytest.mark.usefixtures("shared_graphs")]
LAYERS = ["_backbone.model.layers.0", "_backbone.model.layers.1"]


def _config(**optimize):
    return config_from_dict({"optimize": optimize, "cluster": {"preset": "ascend910b-1x8"}})


@pytest.fixture(autouse=True)
def _graph_mode():
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")


def _profile(net, inputs, config):
    """The profile the memopt pass plans over (same graph, units and cluster)."""
    from ms_efficient.graph.cells import assign_units
    from ms_efficient.memopt.profile import profile_from_units
    from ms_efficient.passes import PassContext

    context = PassContext(net, config, inputs)
    graph = context.graph()
    return profile_from_units(graph, assign_units(graph, LAYERS), config.cluster_spec(),
                              batch_size=int(inputs[0].shape[0]))


def test_a_budget_below_the_floor_names_it_and_the_suggested_share_plans():
    from ms_efficient.memopt.env import KEEP, RECOMPUTE, MemoryPlan, evaluate

    net, inputs = llama_with_loss(num_layers=2)
    config = _config(passes=["memopt"], memory_budget="50%")
    prof = _profile(net, inputs, config)
    link = config.cluster_spec().host_link
    # by hand: CPU realises keep/recompute per layer; the floor is the least peak over all
    # 2^L such plans, the unoptimised peak the all-keep plan's
    peaks = {acts: evaluate(prof, MemoryPlan(np.array(acts)), float("inf"), link).peak_bytes
             for acts in itertools.product((KEEP, RECOMPUTE), repeat=prof.num_layers)}
    peak, floor = peaks[(KEEP,) * prof.num_layers], min(peaks.values())
    pct = np.ceil(floor / peak * 1000) / 10
    assert 50 < pct < 100                     # 50% cannot fit, some share below 100% does
    message = _assert_refused(net, config, inputs, "memopt", "")["memopt"]["refused"]
    assert message.startswith(
        f"'optimize.memory_budget' (50%, {format_size(0.5 * peak)}) is below the feasible "
        f"floor {pct:.1f}% ({format_size(floor)}) of the unoptimised peak "
        f"{format_size(peak)}: ") and f"set it to at least '{pct:g}%'" in message
    # with no budget (the device's 64 GiB) the network fits; the message suggests the same
    net, inputs = llama_with_loss(num_layers=2)
    _assert_refused(net, _config(passes=["memopt"]), inputs, "memopt",
                    f"already fits 'optimize.memory_budget' 64.00 GiB; .*e.g. '{pct:g}%'")
    # the suggested share plans within it on a fresh copy of the network
    net, inputs = llama_with_loss(num_layers=2)
    net, plans = ms_efficient.optimize(net, _config(passes=["memopt"],
                                                    memory_budget=f"{pct:g}%"),
                                       sample_inputs=inputs)
    mem = plans["memopt"]
    assert mem["unoptimised_peak_bytes"] == int(peak) and mem["floor_bytes"] == np.ceil(floor)
    assert mem["budget_bytes"] == pytest.approx(pct / 100 * peak, abs=1)
    assert mem["simulated"]["fits"] and mem["simulated"]["peak_bytes"] <= mem["budget_bytes"]
    assert mem["cells"] and set(mem["cells"]) <= set(LAYERS)


def test_a_bad_budget_size_is_below_the_floor_in_bytes():
    net, inputs = llama_with_loss(num_layers=2)
    _assert_refused(net, _config(passes=["memopt"], memory_budget=1000), inputs, "memopt",
                    r"^'optimize.memory_budget' \(1000 bytes\) is below the feasible floor "
                    r"\d+\.\d% \(")


def test_memopt_cells_glob_matches_one_level():
    # 'layers.*' took layers.N and every Cell below (nested units: an error) before
    net, inputs = llama_with_loss(num_layers=2)
    net, plans = ms_efficient.optimize(
        net, _config(passes=["memopt"], memory_budget="95%",
                     memopt_cells=["_backbone.model.layers.*"]), sample_inputs=inputs)
    assert [layer["name"] for layer in plans["memopt"]["layers"]] == LAYERS


def test_a_sequential_network_without_repeated_blocks_plans_its_layers():
    ms.set_seed(0)
    seq = nn.SequentialCell([nn.Dense(16, 64), nn.ReLU(), nn.Dense(64, 64), nn.ReLU(),
                             nn.Dense(64, 64), nn.ReLU(), nn.Dense(64, 4)])
    net = nn.WithLossCell(seq, nn.MSELoss())
    x, y = np.ones((32, 16), np.float32), np.ones((32, 4), np.float32)
    net, plans = ms_efficient.optimize(net, _config(passes=["memopt"], memory_budget="97%"),
                                       sample_inputs=(x, y))
    mem = plans["memopt"]
    # the units are segments of its children (>= 2 Dense/ReLU groups each), named by their
    # first Cell and listing their Cells (memopt.segments)
    children = [f"_backbone.{i}" for i in range(7)]
    assert [c for layer in mem["layers"] for c in layer["cells"]] == children
    assert [layer["name"] for layer in mem["layers"]] == [s[0] for s in mem["segments"]]
    assert all(len(layer["cells"]) >= 3 for layer in mem["layers"])
    assert mem["cells"] and set(mem["cells"]) <= set(children)
    assert mem["simulated"]["fits"] and mem["simulated"]["peak_bytes"] <= mem["budget_bytes"]


def test_the_readme_optimize_example_runs_as_written(capsys, tmp_path, monkeypatch):
    """The README's first Python block, executed with the smallest fill-ins: a 2-layer LLaMA
    with the package's MoE layer as its MLP, one batch, one epoch (in a fresh folder: the
    block records the routing trace there)."""
    import os
    import re

    from mindspore.dataset import GeneratorDataset

    from tests.user_models import LlamaForCausalLM

    readme = os.path.join(os.path.dirname(os.path.dirname(__file__)), "README.md")
    with open(readme, encoding="utf-8") as fh:
        block = re.search(r"```python\n(.*?)```", fh.read(), re.S).group(1)
    assert "ms_efficient.optimize(network, cfg" in block
    ms.set_seed(0)
    backbone = LlamaForCausalLM(num_layers=2,
                                moe={"num_experts": 4, "top_k": 2, "capacity": 16})
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 64, (2, 16)).astype(np.int32)
    labels = rng.integers(0, 64, (32,)).astype(np.int32)
    scope = {"backbone": backbone, "loss_fn": nn.CrossEntropyLoss(),
             "ids": ms.Tensor(ids), "labels": ms.Tensor(labels),
             "opt": nn.Adam(backbone.trainable_params(), 1e-3), "epochs": 1,
             "dataset": GeneratorDataset(lambda: iter([(ids, labels)] * 2),
                                         ["ids", "labels"], shuffle=False)}
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "README.md", "exec"), scope)          # noqa: S102 - the README's code
    plans = scope["plans"]
    from ms_efficient.moe.trace import load_trace

    # two steps of the two MoE layers, the input for plan moe and the efficientmoe pass
    assert load_trace(str(tmp_path / "trace.npz")).counts.shape[:2] == (2, 2)
    assert plans["memopt"]["cells"] and plans["memopt"]["simulated"]["fits"]
    assert str(plans["memopt"]["cells"]) in capsys.readouterr().out
