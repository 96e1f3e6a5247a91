"""Plan files, the CLI, and shard() strategies set on a real MindSpore network (CPU)."""
import json

import pytest
import yaml

from ms_efficient.cli import main
from ms_efficient.shard.planner import load_plan_strategies


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_plan_command_writes_a_plan_that_loads_back(tmp_path, capsys):
    cfg = _write(tmp_path, "s.yaml", "shard: {workload: gpt-1.3b, batch: 8, mesh: 1x8}\n")
    out = str(tmp_path / "plan.yaml")
    assert main(["plan", "shard", cfg, "--mesh", "2x4", "--out", out]) == 0
    doc = yaml.safe_load(open(out))
    assert doc["mesh"] == {"dp": 2, "mp": 4, "optimizer_shard": True, "dp_model_split": True}
    assert doc["summary"]["comm_time_s"] <= 1.2 * doc["reference"]["comm_time_s"] * (1 + 1e-9)
    assert doc["summary"]["memory_per_device_bytes"] < doc["reference"]["memory_per_device_bytes"]
    strategies = load_plan_strategies(out)
    # every op is in its template or, where its layer class chose otherwise, an override
    assert sum(e["ops"] for e in doc["templates"].values()) + len(doc["overrides"]) == 24 * 18 + 4
    assert len(strategies["dense.qkv"]["in_strategy"]) == 2
    assert "| ilp |" in capsys.readouterr().out


def test_too_small_budget_exits_2_with_the_minimum(tmp_path, capsys):
    cfg = _write(tmp_path, "s.yaml", "shard: {workload: gpt-1.3b, batch: 8, mesh: 2x4, "
                                     "comm_budget_s: 1.0e-6}\n")
    assert main(["plan", "shard", cfg, "--out", str(tmp_path / "p.yaml")]) == 2
    err = capsys.readouterr().err
    assert "below the minimum feasible" in err and err.count("\n") == 1
    assert not (tmp_path / "p.yaml").exists()


def test_unknown_shard_key_is_named(tmp_path, capsys):
    cfg = _write(tmp_path, "s.yaml", "shard: {workload: gpt-1.3b, meshh: 4x8}\n")
    assert main(["plan", "shard", cfg]) == 2
    assert "'shard.meshh'" in capsys.readouterr().err


def test_bench_rows_carry_the_required_fields():
    from ms_efficient.shard.bench import bench_rows

    rows = bench_rows([("gpt-1.3b", 8, "1x8", "N")])
    methods = [r["method"] for r in rows]
    for m in ("ilp", "megatron-tp", "megatron-tp-sp", "megatron-tp-distopt", "dp", "zero1",
              "zero2", "zero3"):
        assert m in methods
    for r in rows:
        assert r["evidence"] == "model" and r["devices"] == 8
        assert r["memory_per_device_bytes"] > 0 and r["comm_time_s"] >= 0
    ilp = rows[methods.index("ilp")]
    # within the ILP's optimality gap (ShardOptions.mip_gap = 1e-4) of every baseline in budget
    assert ilp["memory_per_device_bytes"] <= min(r["memory_per_device_bytes"] for r in rows
                                                 if r["comm_vs_megatron_tp"] <= 1.2) * (1 + 1e-4)


def test_plan_is_set_on_the_mindspore_network_primitives(tmp_path):
    pytest.importorskip("mindspore")
    from ms_efficient.core.config import config_from_dict
    from ms_efficient.models.gpt_moe import build_model
    from ms_efficient.shard.apply import apply_shard_plan, write_strategy_json
    from ms_efficient.shard.planner import load_request, plan, plan_to_dict

    data = {"model": {"seq_length": 32, "hidden_size": 32, "num_layers": 2, "num_heads": 2,
                      "ffn_hidden_size": 64},
            "moe": {"num_experts": 4, "top_k": 2, "moe_every": 2}, "train": {"batch_size": 4}}
    cfg_path = _write(tmp_path, "tiny.yaml", yaml.safe_dump(data))
    doc = plan_to_dict(req := load_request(cfg_path, "2x2"), plan(req))
    cfg = config_from_dict(data)
    net = build_model(cfg.model, cfg.moe, cfg.train.batch_size)
    applied = apply_shard_plan(net, doc["templates"])
    # block 0 is dense, block 1 MoE: both got their attention and FFN primitives set
    assert {"blocks.0.attn.qkv", "blocks.0.ffn.fc1", "blocks.1.ffn.bmm"} <= set(applied)
    t = doc["templates"]["dense.fc1"]["in_strategy"]        # x(b,s,h), w(h,f)
    expected = ((t[0][0] * t[0][1], t[0][2]), (t[1][1], t[1][0]))
    assert net.blocks[0].ffn.fc1.matmul.in_strategy == expected
    assert applied["blocks.0.ffn.fc1"] == expected
    out = str(tmp_path / "strategy.json")
    write_strategy_json(out, net, applied, doc)
    js = json.load(open(out))
    # keyed as MindSpore keys an operator with a parameter: <primitive>_<parameter name>
    item = js["parallel_strategy_item"]["MatMul_blocks.0.ffn.fc1.weight"]
    assert item == {"stage": 0, "parallel_strategy": [list(x) for x in expected]}
    # the MoE experts' batched matmul is keyed by its primitive and first expert weight
    bmm = js["parallel_strategy_item"]["BatchMatMul_blocks.1.ffn.w1"]
    assert bmm["parallel_strategy"] == [list(x) for x in applied["blocks.1.ffn.bmm"]]
    layout = js["parallel_layout_item"]["blocks.0.ffn.fc1.weight"]
    assert layout["tensor_shape"] == [64, 32]                 # nn.Dense weight [out, in]
    # the weight's [f, h] dims carry the plan's axes for w(h, f), folded to (f, h)
    axes = doc["templates"]["dense.fc1"]["in_axes"][1]
    want = [axes[1], axes[0]]
    if ["dp", "mp"] in want or ["mp", "dp"] in want:
        assert layout["dev_matrix"] == [4]
    else:
        assert layout["dev_matrix"] == [2, 2]
        assert layout["tensor_map"] == [{"dp": 1, "mp": 0}[a[0]] if a else -1 for a in want]


def test_a_layer_override_wins_over_its_template(tmp_path):
    pytest.importorskip("mindspore")
    from ms_efficient.core.config import config_from_dict
    from ms_efficient.models.gpt_moe import build_model
    from ms_efficient.shard.apply import apply_shard_plan

    data = {"model": {"seq_length": 32, "hidden_size": 32, "num_layers": 3, "num_heads": 2,
                      "ffn_hidden_size": 64}, "moe": {"num_experts": 4, "moe_every": 3},
            "train": {"batch_size": 4}}       # blocks 0 and 1 dense, block 2 MoE
    cfg = config_from_dict(data)
    net = build_model(cfg.model, cfg.moe, cfg.train.batch_size)
    templates = {"dense.fc1": {"in_strategy": [[2, 1, 1], [1, 2]]}}    # x(b,s,h), w(h,f)
    overrides = {"L1.fc1": {"in_strategy": [[1, 1, 2], [2, 1]]}}
    applied = apply_shard_plan(net, templates, overrides)
    assert applied["blocks.0.ffn.fc1"] == ((2, 1), (2, 1))   # template: w folded to (f, h)
    assert applied["blocks.1.ffn.fc1"] == ((1, 2), (1, 2))   # its layer's own strategy
    assert net.blocks[1].ffn.fc1.matmul.in_strategy == ((1, 2), (1, 2))
