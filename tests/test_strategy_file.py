"""The strategy JSON in MindSpore's strategy-checkpoint format: keys, tensor maps on a dp = mp
mesh (where split factors alone cannot tell the axes apart), optimizer shard groups."""
import json

import pytest

from ms_efficient.shard.apply import OpRecord, strategy_json

pytestmark = pytest.mark.usefixtures("shared_graphs")      # tests/graph_cache.py


def test_a_dp_split_weight_on_a_square_mesh_maps_to_the_dp_dim():
    # Dense weight [out=8, in=4] split 2 ways on dim 0 by dp, on a 2x2 mesh: the factor (2)
    # equals both dp and mp; the map must say dp (device-matrix dim 1 from the right)
    dp_rec = OpRecord("MatMul", ((2, 1), (2, 1)), [("fc.weight", 1, (8, 4))],
                      axes=[[["dp"], []], [["dp"], []]])
    mp_rec = OpRecord("MatMul", ((1, 2), (2, 1)), [("fc2.weight", 1, (8, 4))],
                      axes=[[[], ["mp"]], [["mp"], []]])
    js = strategy_json({"fc.matmul": dp_rec, "fc2.matmul": mp_rec}, 2, 2)
    assert js["parallel_layout_item"]["fc.weight"]["tensor_map"] == [1, -1]
    assert js["parallel_layout_item"]["fc2.weight"]["tensor_map"] == [0, -1]
    assert js["parallel_layout_item"]["fc.weight"]["dev_matrix"] == [2, 2]
    assert set(js["parallel_strategy_item"]) == {"MatMul_fc.weight", "MatMul_fc2.weight"}


def test_factors_alone_on_a_square_mesh_are_refused_not_guessed():
    rec = OpRecord("MatMul", ((2, 1), (2, 1)), [("w", 1, (8, 4))])      # no axes recorded
    with pytest.raises(ValueError, match="either axis"):
        strategy_json({"fc.matmul": rec}, 2, 2)
    # on a 2x4 mesh the factors are unambiguous: 4 is mp
    js = strategy_json({"fc.matmul": OpRecord("MatMul", ((1, 1), (4, 1)),
                                              [("w", 1, (8, 4))])}, 2, 4)
    assert js["parallel_layout_item"]["w"]["tensor_map"] == [0, -1]


def test_a_dim_split_by_both_axes_is_one_device_dim_in_rank_order():
    rec = OpRecord("Gather", ((4, 1), (1,)), [("emb", 0, (64, 8))], axes=[[["dp", "mp"], []], [[]]])
    layout = strategy_json({"e.gather": rec}, 2, 2)["parallel_layout_item"]["emb"]
    assert layout["dev_matrix"] == [4] and layout["tensor_map"] == [0, -1]


def test_zero_shards_the_optimizer_state_over_the_replica_group():
    # weight split by mp on a 4x2 mesh: its replicas are the 4 dp ranks, mp=2 apart
    rec = OpRecord("MatMul", ((1, 2), (2, 1)), [("w", 1, (8, 4))], axes=[[[], ["mp"]], [["mp"], []]],
                   zero=1)
    layout = strategy_json({"m": rec}, 4, 2)["parallel_layout_item"]["w"]
    assert (layout["opt_weight_shard_size"], layout["opt_weight_shard_step"]) == (4, 2)
    rec0 = OpRecord("MatMul", rec.strategy, rec.params, rec.axes, zero=0)
    layout = strategy_json({"m": rec0}, 4, 2)["parallel_layout_item"]["w"]
    assert (layout["opt_weight_shard_size"], layout["opt_weight_shard_step"]) == (0, 0)


@pytest.mark.mindspore
def test_the_shard_pass_on_a_2x2_mesh_writes_maps_that_agree_with_its_strategies(tmp_path):
    ms = pytest.importorskip("mindspore")

    import ms_efficient
    from ms_efficient.core.config import config_from_dict
    from tests.user_models import llama_with_loss

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    net, inputs = llama_with_loss(batch=4)
    out = str(tmp_path / "strategy.json")
    cfg = config_from_dict({"optimize": {"passes": ["shard"], "shard_mesh": "2x2",
                                         "shard_strategy_file": out},
                            "cluster": {"preset": "cpu-local", "devices_per_node": 4}})
    net, plans = ms_efficient.optimize(net, cfg, sample_inputs=inputs)
    js = json.load(open(out))
    shapes = {p.name: list(p.shape) for p in net.get_parameters()}
    assert js["parallel_layout_item"]
    for key, rec in plans["shard"]["applied"].items():
        item = js["parallel_strategy_item"][f"{rec['prim']}_{rec['params'][0][0]}"]
        assert item["parallel_strategy"] == rec["strategy"]
        for name, index, _ in rec["params"]:
            layout = js["parallel_layout_item"][name]
            assert layout["tensor_shape"] == shapes[name]
            # every dim's split = the product of the device-matrix dims its map names
            dev = layout["dev_matrix"][::-1]
            got = [dev[m] if m >= 0 else 1 for m in layout["tensor_map"]]
            assert got == rec["strategy"][index]
            # and the axis is the plan's: dp is map 1, mp map 0 on the [2, 2] matrix
            if layout["dev_matrix"] == [2, 2]:
                want = [{"dp": 1, "mp": 0}[a[0]] if a else -1 for a in rec["axes"][index]]
                assert layout["tensor_map"] == want


def test_plan_shard_strategy_json_of_an_analytic_workload_lists_every_template(tmp_path):
    import yaml

    from ms_efficient.cli import main

    cfg = tmp_path / "shard.yaml"
    cfg.write_text(yaml.safe_dump({"shard": {"workload": "gpt-1.3b", "batch": 8, "mesh": "1x8",
                                             "cluster": {"preset": "ascend910b-1x8"}}}))
    out, js_path = tmp_path / "plan.yaml", tmp_path / "s.json"
    assert main(["plan", "shard", str(cfg), "--out", str(out),
                 "--strategy-json", str(js_path)]) == 0
    doc, js = yaml.safe_load(open(out)), json.load(open(js_path))
    entries = {**doc["templates"], **doc.get("overrides", {})}
    assert set(js["parallel_strategy_item"]) == set(entries)   # no network: keyed by template
    for name, e in entries.items():
        assert js["parallel_strategy_item"][name]["parallel_strategy"] == e["in_strategy"]
        assert len(e["in_axes"]) == len(e["in_strategy"])
