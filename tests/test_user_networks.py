"""optimize() on networks the package did not write: a LLaMA-shaped decoder with HF /
MindFormers Cell names (dense, and with the package's MoE layer as its MLP). The passes plan
each network's own train-step graph and change its own Cells; the network then still trains
in GRAPH_MODE. mindcv's resnet18 is in the zoo (tests/test_zoo.py)."""
import json
import re

import numpy as np
import pytest

import mindspore as ms
from mindspore import nn

import ms_efficient
from ms_efficient.core.config import config_from_dict
from tests.user_models import llama_with_loss

pytestmark = [pytest.mark.mindspore, pytest.mark.usefixtures("shared_graphs")]
MOE = {"num_experts": 4, "top_k": 2, "capacity": 16}
BLOCKS = [f"_backbone.model.layers.{i}" for i in range(3)]


def _config(**optimize):
    return config_from_dict({"optimize": optimize, "cluster": {"preset": "ascend910b-1x8"}})


def _train_steps(net, inputs, steps=3):
    step = nn.TrainOneStepCell(net, nn.Adam(net.trainable_params(), 1e-3))
    return [float(step(*inputs).asnumpy()) for _ in range(steps)]


@pytest.fixture(autouse=True)
def _graph_mode():
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")


@pytest.mark.parametrize("moe", [None, MOE], ids=["dense", "moe"])
def test_shard_and_memopt_plan_a_llama_decoder_by_its_own_cell_names(moe):
    # place on this small decoder does not pay (tests/test_user_network_plans.py)
    net, inputs = llama_with_loss(moe=moe, num_layers=3)
    names = {n for n, _ in net.cells_and_names()}
    net, plans = ms_efficient.optimize(net, _config(passes=["shard", "memopt"],
                                                    memory_budget="92%"),
                                       sample_inputs=inputs)
    sharded = set(plans["shard"]["cells"])       # the user's projections, by their paths
    assert {f"{b}.self_attn.o_proj" for b in BLOCKS} <= sharded <= names
    assert moe or {f"{b}.mlp.down_proj" for b in BLOCKS} <= sharded
    mem = plans["memopt"]
    # the units are the decoder layers, by the names the user gave them
    assert [layer["name"] for layer in mem["layers"]] == BLOCKS
    assert mem["cells"] and set(mem["cells"]) <= set(BLOCKS) <= names
    assert all(c["recompute"] for c in mem["cells"].values())
    # the plan fits its budget (92% of the unoptimised simulated peak) and needed to change
    assert mem["budget_bytes"] == pytest.approx(0.92 * mem["unoptimised_peak_bytes"], rel=1e-6)
    assert mem["simulated"]["fits"] and mem["simulated"]["peak_bytes"] <= mem["budget_bytes"]
    losses = _train_steps(net, inputs)
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_memopt_cells_patterns_plan_sub_blocks_and_units_must_hold_parameters():
    net, inputs = llama_with_loss(num_layers=2)
    patterns = ["_backbone.model.layers.*.self_attn", "_backbone.model.layers.*.mlp"]
    net, plans = ms_efficient.optimize(net, _config(passes=["memopt"], memory_budget="95%",
                                                    memopt_cells=patterns),
                                       sample_inputs=inputs)
    assert [layer["name"] for layer in plans["memopt"]["layers"]] == [
        "_backbone.model.layers.0.self_attn", "_backbone.model.layers.0.mlp",
        "_backbone.model.layers.1.self_attn", "_backbone.model.layers.1.mlp"]
    assert plans["memopt"]["simulated"]["fits"]


def test_passes_that_find_nothing_to_change_say_what_they_looked_for():
    net, inputs = llama_with_loss(num_layers=2)
    with pytest.raises(ValueError, match="needs sample_inputs|sample_inputs=\\(batch"):
        ms_efficient.optimize(net, _config(passes=["memopt"], memory_budget="50%"))
    # each a refusal: recorded with its reason (strict=True raises it), nothing applied
    _assert_refused(net, _config(passes=["memopt"]), inputs, "memopt",
                    "already fits 'optimize.memory_budget' .*nothing to recompute")
    dense = nn.WithLossCell(nn.Dense(4, 2), nn.MSELoss())
    x, y = np.ones((2, 4), np.float32), np.ones((2, 2), np.float32)
    _assert_refused(dense, _config(passes=["memopt"], memory_budget="50%"), (x, y), "memopt",
                    "^memopt: found no repeated blocks")
    one_device = config_from_dict({"optimize": {"passes": ["place"]},
                                   "cluster": {"preset": "ascend910b-1x8",
                                               "devices_per_node": 1}})
    _assert_refused(net, one_device, inputs, "place", "pipeline stages need >= 2")
    functional = nn.WithLossCell(_FunctionalNet(), nn.MSELoss())
    _assert_refused(functional, _config(passes=["shard"]), (x, y), "shard",
                    "^shard: no primitive of WithLossCell takes a strategy")


def _assert_refused(net, config, inputs, name, pattern):
    """The passes of ``config`` (``name`` among them) leave ``name`` refused with a reason
    matching ``pattern``: recorded as {"refused": reason} without strict, raised with
    strict=True when it is the only pass."""
    from ms_efficient.passes import PassRefused

    _, plans = ms_efficient.optimize(net, config, sample_inputs=inputs)
    assert set(plans[name]) == {"refused"}, plans[name]
    reason = plans[name]["refused"]
    assert re.search(pattern, reason), reason
    if list(config.optimize.passes) == [name]:
        with pytest.raises(PassRefused) as err:
            ms_efficient.optimize(net, config, sample_inputs=inputs, strict=True)
        assert str(err.value) == reason
    return plans


class _FunctionalNet(nn.Cell):
    """A weight used through a functional matmul: no primitive attribute to shard()."""

    def __init__(self):
        super().__init__()
        self.w = ms.Parameter(ms.Tensor(np.ones((4, 2), np.float32)), name="w")

    def construct(self, x):
        return ms.ops.matmul(x, self.w)


@pytest.mark.parametrize("moe", [None, MOE], ids=["dense", "moe"])
def test_shard_plans_the_llama_graphs_own_operators_and_sets_its_primitives(moe, tmp_path):
    from ms_efficient.core.cluster import get_cluster
    from ms_efficient.graph import from_network
    from ms_efficient.shard.planner import plan_graph
    from ms_efficient.shard.strategies import Mesh

    net, inputs = llama_with_loss(moe=moe, num_layers=2, batch=8)
    graph = from_network(net, *inputs, mode="train")
    out = str(tmp_path / "strategy.json")
    net, plans = ms_efficient.optimize(net, _config(passes=["shard"], shard_mesh="2x4",
                                                    shard_strategy_file=out),
                                       sample_inputs=inputs)
    plan = plans["shard"]
    cells = dict(net.cells_and_names())
    projections = [f"_backbone.model.layers.{i}.self_attn.{p}_proj" for i in range(2)
                   for p in "qkvo"]
    assert set(projections) <= set(plan["cells"]) <= set(cells)
    for path, entry in plan["cells"].items():          # the strategies are on the primitives
        for attr, strategy in entry["shard"].items():
            got = getattr(cells[path], attr).attrs["in_strategy"]
            assert [list(t) for t in got] == strategy
    # memory per device: no more than the best baseline within the budget ...
    summary, base = plan["summary"], plan["baselines"]
    fits = [b["memory_per_device_bytes"] for b in base.values()
            if "error" not in b and b["comm_time_s"] <= plan["comm_budget_s"] * (1 + 1e-9)]
    assert base["zero1"]["comm_time_s"] == pytest.approx(plan["comm_budget_s"])
    assert summary["memory_per_device_bytes"] <= min(fits) * (1 + 1e-4)
    # ... and, unconstrained, than the best of DP / ZeRO-3 / Megatron-TP on the same graph
    free = plan_graph(graph, Mesh(2, 4, dp_model_split=False), get_cluster("ascend910b-1x8"),
                      budget_ratio=None)
    best = min(free["baselines"][m].memory for m in ("dp", "zero3", "megatron-tp"))
    assert free["solution"].cost.memory <= best * (1 + 1e-4)
    with open(out, encoding="utf-8") as fh:
        layouts = json.load(fh)["parallel_layout_item"]
    assert "model.layers.0.self_attn.q_proj.weight" in layouts
    losses = _train_steps(net, inputs)
    assert all(np.isfinite(losses))


def test_a_bad_memory_budget_names_the_field():
    with pytest.raises(ValueError, match="'optimize.memory_budget' must be a percentage"):
        config_from_dict({"optimize": {"memory_budget": "150%"}})
    with pytest.raises(ValueError, match="'optimize.memory_budget' must be a size"):
        config_from_dict({"optimize": {"memory_budget": "lots"}})


def test_plan_memory_on_a_saved_graph_names_cells_that_apply_plan_accepts(tmp_path):
    from ms_efficient.cli import main
    from ms_efficient.core.cluster import get_cluster
    from ms_efficient.graph import from_network
    from ms_efficient.graph.cells import assign_units, cell_tree_from_graph, repeated_blocks
    from ms_efficient.memopt.apply import apply_plan, load_plan, resolve_budget
    from ms_efficient.memopt.profile import profile_from_units

    net, inputs = llama_with_loss(num_layers=3)
    graph = from_network(net, *inputs, mode="train")
    path = str(tmp_path / "llama.json")
    graph.save_json(path)
    cluster = get_cluster("ascend910b-1x8")
    profile = profile_from_units(graph, assign_units(graph, repeated_blocks(
        cell_tree_from_graph(graph))), cluster, batch_size=2)
    budget, _ = resolve_budget("95%", profile, cluster)
    out = str(tmp_path / "plan.yaml")
    assert main(["plan", "memory", path, "--budget", str(int(budget)), "--batch", "2",
                 "--out", out]) == 0
    names, plan = load_plan(out)
    assert names == BLOCKS                      # forward Cells only, no backward "layers"
    applied = apply_plan(net, names, plan)
    assert applied["recompute"] and set(applied["recompute"]) <= set(BLOCKS)
    assert main(["plan", "memory", path, "--budget", "1GiB", "--cells", "blocks.*",
                 "--out", out]) == 2                    # a pattern that matches no Cell


def _record_trace(net, inputs, path, steps=4):
    """A routing trace of the network's own training (Model.train + RoutingTraceCallback)."""
    import mindspore.dataset as ds
    from mindspore.train import Model

    from ms_efficient.efficientmoe.apply import RoutingTraceCallback

    ids, labels = (x.asnumpy() for x in inputs)
    data = ds.NumpySlicesDataset({"ids": np.stack([ids] * steps),
                                  "labels": np.stack([labels] * steps)}, shuffle=False)
    cb = RoutingTraceCallback(net, str(path))
    Model(net, optimizer=nn.SGD(net.trainable_params(), 0.0)).train(
        1, data, callbacks=[cb], dataset_sink_mode=False)
    return cb.trace()


def test_all_passes_together_plan_a_llama_moe_then_it_still_trains(tmp_path):
    net, inputs = llama_with_loss(moe=MOE, num_layers=3)
    trace = _record_trace(net, inputs, tmp_path / "trace.npz")
    experts = [f"{b}.mlp.experts" for b in BLOCKS]
    # a cluster whose links are slow enough that overlapping the All-to-All pays
    cfg = config_from_dict({
        "optimize": {"passes": ["efficientmoe", "mpipe", "shard", "memopt"],
                     "memory_budget": "95%"},
        "efficientmoe": {"history": str(tmp_path / "trace.npz"), "capacity_multiple": 1,
                         "drop_target": 0.0},
        "cluster": {"preset": "ascend910b-1x8",
                    "intra_link": {"bandwidth_Bps": 1e7, "latency_s": 1e-6}}})
    net, plans = ms_efficient.optimize(net, cfg, sample_inputs=inputs)
    # efficientmoe: capacities from the trace, by the layers' own paths
    em = plans["efficientmoe"]["cells"]
    assert sorted(em) == experts
    load = trace.counts.sum(axis=2)[-1]                  # [layer, expert], same batch each step
    for i, path in enumerate(experts):
        assert all(c >= n for c, n in zip(em[path]["capacities"], load[i]))
    assert plans["efficientmoe"]["rows_before"] == 3 * 4 * MOE["capacity"]
    assert plans["efficientmoe"]["rows_after"] == sum(sum(em[p]["capacities"]) for p in em)
    # the trace repeats one batch and drops none: every expert gets exactly its load (at
    # least one row: a capacity is a multiple >= 1)
    assert [em[p]["capacities"] for p in experts] == np.maximum(load, 1).tolist()
    assert plans["efficientmoe"]["drop_rate_on_trace"] == 0.0
    # mpipe: the layers are wrapped in PipelinedMoE with a chunk's capacities
    cells = dict(net.cells_and_names())
    for path in plans["mpipe"]["cells"]:
        wrapped = cells[path]
        chunks = plans["mpipe"]["cells"][path]["chunks"]
        assert type(wrapped).__name__ == "PipelinedMoE" and wrapped.chunks == chunks == 2
        assert list(wrapped.layer.capacities) == [-(-c // 2) for c in em[path]["capacities"]]
    assert plans["mpipe"]["cells"]
    assert "_backbone.model.layers.0.self_attn.q_proj" in plans["shard"]["cells"]
    assert set(plans["memopt"]["cells"]) <= set(BLOCKS) and plans["memopt"]["simulated"]["fits"]
    losses = _train_steps(net, inputs)
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_moe_passes_say_what_they_need():
    net, inputs = llama_with_loss(moe=None, num_layers=2)
    for name in ("efficientmoe", "mpipe"):
        _assert_refused(net, _config(passes=[name]), inputs, name,
                        f"^{name}: found no MoEFeedForward")
    moe, inputs = llama_with_loss(moe=MOE, num_layers=2)
    with pytest.raises(ValueError, match="set efficientmoe.history"):
        ms_efficient.optimize(moe, _config(passes=["efficientmoe"]), sample_inputs=inputs)
    _assert_refused(moe, _config(passes=["mpipe"]), inputs, "mpipe",
                    "one chunk is fastest .*nothing to wrap")
