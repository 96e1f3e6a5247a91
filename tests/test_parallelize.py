"""parallelize(): the plans of optimize() as MindSpore 2.10's AutoParallel, constructed on CPU
(no init(); compiling it needs Ascend) and every setting read back from the wrapper, the
pipeline Cell and the primitives, then compared with the plans. Bad combinations are refused
with the rule they break."""
import copy

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")

import ms_efficient  # noqa: E402
from ms_efficient.core.config import config_from_dict  # noqa: E402
from ms_efficient.parallel.settings import settings_from_plans  # noqa: E402
from tests.user_models import wide_llama_with_loss  # noqa: E402

pytestmark = [pytest.mark.mindspore, pytest.mark.usefixtures("shared_graphs")]
# 8 CPU workers behind 200 MB/s links: a pipeline of shard's 2x1 meshes beats data parallelism
# over the 4 mesh slots there (at the preset's 2 GB/s the place pass refuses: the all-reduce
# is cheaper than the bubble)
SLOW8 = {"preset": "cpu-local", "devices_per_node": 8, "intra_link": {"bandwidth_Bps": 2e8}}


def _llama(layers=4, batch=8, seq=32):
    return wide_llama_with_loss(layers, batch, seq)


@pytest.fixture(scope="module")
def planned():
    """A user LLaMA planned by shard (mesh 2x1 per stage) and place on an 8-device cluster."""
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    net, inputs = _llama()
    cfg = config_from_dict({"optimize": {"passes": ["shard", "place"], "shard_mesh": "2x1",
                                         "micro_batches": 4},
                            "cluster": SLOW8})
    net, plans = ms_efficient.optimize(net, cfg, sample_inputs=inputs)
    return net, plans, inputs


def test_every_autoparallel_setting_is_the_plans(planned, tmp_path):
    _check_wrapper(*planned, str(tmp_path / "ms_strategy.json"))


def test_the_reference_model_s_plans_build_the_same_way(tmp_path):
    from ms_efficient.core.config import ModelConfig, MoEConfig
    from ms_efficient.models.gpt_moe import build_model

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    ms.set_seed(1)
    net = build_model(ModelConfig(vocab_size=64, seq_length=64, hidden_size=256, num_layers=4,
                                  num_heads=4, ffn_hidden_size=512),
                      MoEConfig(num_experts=4, top_k=2, moe_every=2), 16)
    tokens = ms.Tensor(np.zeros((16, 64), np.int32))
    cfg = config_from_dict({"optimize": {"passes": ["shard", "place"], "shard_mesh": "2x1",
                                         "micro_batches": 4},
                            "cluster": SLOW8})
    net, plans = ms_efficient.optimize(net, cfg, sample_inputs=(tokens, tokens))
    _check_wrapper(net, plans, (tokens, tokens), str(tmp_path / "ms_strategy.json"))


def _check_wrapper(net, plans, inputs, out):
    """parallelize() and read every setting back against the plans."""
    from mindspore.parallel.auto_parallel import AutoParallel
    from mindspore.parallel.nn import Pipeline

    wrapper = ms_efficient.parallelize(net, plans, inputs, strategy_file=out)
    place, shard = plans["place"], plans["shard"]
    stages = len(place["stages"])
    dp, mp = shard["mesh"]["dp"], shard["mesh"]["mp"]
    assert isinstance(wrapper, AutoParallel) and wrapper._parallel_mode == "semi_auto"
    # pipeline: the stage count, 1F1B, MindSpore's micro-batch Cell with the planned M
    assert wrapper.get_pipeline_stages() == stages and stages * dp * mp == place["devices"]
    assert wrapper._pipeline_scheduler == "1f1b"
    assert isinstance(wrapper.network, Pipeline)
    assert wrapper.network.micro_size == place["micro_batches"] >= stages
    # every planned Cell carries its planned stage (set by Pipeline's stage_config) ...
    cells = dict(net.cells_and_names())
    for path, entry in place["cells"].items():
        assert cells[path].pipeline_stage == entry["pipeline_stage"]
    assert {e["pipeline_stage"] for e in place["cells"].values()} == set(range(stages))
    # ... and the root, spanning every stage, none
    assert not hasattr(net, "pipeline_stage")
    # optimizer sharding: the highest planned ZeRO level; parameters planned at ZeRO 0 excluded
    zero = {}
    for entry in shard["operators"].values():
        for _, name in entry["params"]:
            zero[name] = max(zero.get(name, 0), entry["zero"])
    top = max(zero.values())
    assert top > 0 and wrapper._enable_parallel_optimizer
    assert wrapper._optimizer_level == f"level{top}"
    assert (wrapper._optimizer_weight_shard_size, wrapper._parallel_optimizer_threshold) == (-1, 0)
    params = {p.name: p for p in net.get_parameters()}
    for name, level in zero.items():
        assert params[name].parallel_optimizer == (level > 0), name
    # dataset: dim 0 of each input split over the dp replicas
    assert wrapper._dataset_strategy_config == tuple((dp,) + (1,) * (len(x.shape) - 1)
                                                     for x in inputs)
    # operator strategies: what semi_auto reads from the primitives is the plan's
    for path, entry in shard["cells"].items():
        for attr, strategy in entry["shard"].items():
            assert [list(t) for t in getattr(cells[path], attr).attrs["in_strategy"]] == strategy
    assert wrapper._save_strategy_file_path == out


def test_a_mesh_planned_for_the_whole_cluster_is_refused_with_the_fix(planned):
    net, plans, inputs = planned
    bad = copy.deepcopy(plans)
    bad["shard"]["mesh"] = {**bad["shard"]["mesh"], "dp": 8, "mp": 1}
    with pytest.raises(ValueError, match=r"mesh 8x1 x 4 pipeline stages = 32 devices, but the "
                                         r"job has 8 .*optimize.shard_mesh, e.g. '2x1'"):
        settings_from_plans(bad, [(8, 32), (256,)])


def test_fewer_micro_batches_than_stages_are_refused(planned):
    _, plans, _ = planned
    bad = copy.deepcopy(plans)
    bad["place"]["micro_batches"] = 2
    with pytest.raises(ValueError, match=r"micro_batches' 2 is below its 4 stages"):
        settings_from_plans(bad, [(8, 32), (256,)])


def test_a_batch_the_replicas_cannot_split_into_micro_batches_is_refused(planned):
    _, plans, _ = planned
    with pytest.raises(ValueError, match=r"dim 0 of input 0 \(12; the batch is 12\) must divide "
                                         r"by data_parallel x micro_batches = 2 x 4 = 8"):
        settings_from_plans(plans, [(12, 32), (12 * 32,)])


def test_a_device_count_that_does_not_split_into_the_stages_is_refused(planned):
    _, plans, _ = planned
    with pytest.raises(ValueError, match="'devices' 6 does not divide into the place plan's 4"):
        settings_from_plans(plans, [(8, 32), (256,)], devices=6)


def test_a_network_whose_strategies_differ_from_the_plan_is_refused(planned):
    net, plans, inputs = planned
    bad = copy.deepcopy(plans)
    path, entry = next(iter(bad["shard"]["cells"].items()))
    attr = next(iter(entry["shard"]))
    entry["shard"][attr] = [[1] * len(t) for t in entry["shard"][attr]]
    if entry["shard"][attr] == plans["shard"]["cells"][path]["shard"][attr]:
        entry["shard"][attr][0][0] = 2
    with pytest.raises(ValueError, match=f"'{path}.{attr}' has strategy"):
        ms_efficient.parallelize(net, bad, inputs)


def test_a_shard_plan_alone_gives_a_one_stage_wrapper():
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    net, inputs = _llama(layers=2, batch=4)
    cfg = config_from_dict({"optimize": {"passes": ["shard"], "shard_mesh": "2x2"},
                            "cluster": {"preset": "cpu-local", "devices_per_node": 4}})
    net, plans = ms_efficient.optimize(net, cfg, sample_inputs=inputs)
    wrapper = ms_efficient.parallelize(net, plans, inputs)
    assert wrapper.network is net and wrapper.get_pipeline_stages() == 1
    assert wrapper.settings.devices == 4 and wrapper._dataset_strategy_config == ((2, 1), (2,))


def test_a_refused_pass_counts_as_absent_and_a_plan_of_refusals_names_them(planned):
    _, plans, _ = planned
    # place refused: the shard plan alone, one stage of its 2x1 mesh
    only_shard = {**plans, "place": {"refused": "place: pipelining does not pay"}}
    settings = settings_from_plans(only_shard, [(8, 32), (256,)])
    assert (settings.stages, settings.devices, settings.dp, settings.mp) == (1, 2, 2, 1)
    assert settings.stage_config == {}
    refused = {"shard": {"refused": "shard: the plan on the 1x8 mesh splits no dimension"},
               "place": {"refused": "place: pipelining does not pay"}}
    with pytest.raises(ValueError, match=r"^'plans' holds no applied 'shard' or 'place' plan: "
                                         r"pass shard refused: shard: the plan on the 1x8 mesh "
                                         r"splits no dimension; pass place refused: place: "
                                         r"pipelining does not pay$"):
        settings_from_plans(refused, [(8, 32), (256,)])
