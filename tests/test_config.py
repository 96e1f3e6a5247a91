import os

import pytest
import yaml

from ms_efficient.core.config import RunConfig, config_from_dict, load_config, save_config


def test_defaults_validate_and_round_trip(tmp_path):
    cfg = config_from_dict({})
    assert cfg.moe.top_k == 2 and cfg.model.hidden_size == 256
    path = tmp_path / "c.yaml"
    save_config(cfg, str(path))
    again = load_config(str(path))
    assert again == cfg


def test_shipped_config_loads():
    cfg = load_config("configs/gpt_moe_tiny.yaml")
    assert cfg.moe.num_experts == 8 and cfg.moe.top_k == 2
    assert cfg.model.num_layers == 4 and cfg.model.hidden_size == 256
    assert cfg.cluster_spec().name == "cpu-local"


@pytest.mark.parametrize("data, match", [
    ({"model": {"hiden_size": 3}}, r"Unknown config key 'model.hiden_size'"),
    ({"trainn": {}}, r"Unknown config key 'trainn'"),
    ({"moe": {"num_experts": -2}}, r"'moe.num_experts' must be a positive integer, but got -2"),
    ({"moe": {"num_experts": 4, "top_k": 5}}, r"'moe.top_k' must be in \[1, moe.num_experts \(4\)\], but got 5"),
    ({"moe": {"num_experts": "eight"}}, r"'moe.num_experts' must be an integer, but got 'eight'"),
    ({"train": {"learning_rate": "fast"}}, r"'train.learning_rate' must be a number"),
    ({"moe": {"capacity_factor": 0.5}}, r"'moe.capacity_factor' must be >= 1.0, or 0 for dropless, but got 0.5"),
    ({"data": {"path": "/no/such/folder"}}, r"'data.path' must be 'stdlib' or an existing file or folder, but got '/no/such/folder'"),
    ({"model": {"hidden_size": 30, "num_heads": 4}}, r"'model.hidden_size' must be a multiple of model.num_heads"),
    ({"train": {"batch_size": 6}, "moe": {"trace_ranks": 4}}, r"'train.batch_size' must be a multiple of moe.trace_ranks \(4\)"),
    ({"cluster": {"preset": "tpu-v9"}}, r"cluster.*tpu-v9"),
    ({"optimize": {"passes": ["warp-drive"]}}, r"'optimize.passes\[0\]' must be one of"),
    ({"model": {"dropout": True}}, r"'model.dropout' must be a number"),
    ({"moe": {"dispatch": "alltoall"}},
     r"'moe.dispatch' must be one of \['static', 'grouped', 'balanced'\], but got "
     r"'alltoall'"),
    # the key of older configs, merged into moe.dispatch: named with where it went
    ({"efficientmoe": {"dispatch": "counts"}},
     r"'efficientmoe.dispatch' \('counts'\) is now 'moe.dispatch', one of \['static', "
     r"'grouped', 'balanced'\]"),
    ({"moe": {"fast_level": "device"}},
     r"'moe.fast_level' must be one of \['auto', 'host', 'aot', 'ops'\], but got 'device'"),
    ({"efficientmoe": {"buffer_slack": -0.5}},
     r"'efficientmoe.buffer_slack' must be in \[0, 64\], but got -0.5"),
])
def test_bad_values_name_the_key_the_value_and_the_rule(data, match):
    with pytest.raises(ValueError, match=match):
        config_from_dict(data)


def test_overrides_are_validated_too(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"train": {"steps": 5}}))
    assert load_config(str(path), {"train.steps": 9}).train.steps == 9
    with pytest.raises(ValueError, match="'train.steps' must be a positive integer, but got 0"):
        load_config(str(path), {"train.steps": 0})


def test_invalid_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_config(str(bad))
    with pytest.raises(ValueError, match="does not exist"):
        load_config(str(tmp_path / "none.yaml"))


def test_section_must_be_a_mapping():
    with pytest.raises(ValueError, match="'model' must be a mapping"):
        config_from_dict({"model": [1, 2]})
    assert isinstance(config_from_dict({"model": None}), RunConfig)


@pytest.mark.parametrize("plans, dispatch", [(True, "grouped"), (False, "static")],
                         ids=["expert-parallel", "one-process"])
def test_a_run_folder_saved_with_the_older_dispatch_key_loads_as_the_run_it_was(
        tmp_path, plans, dispatch):
    """A run folder written before moe.dispatch named every run's dispatch holds both keys
    (its config.yaml is the whole resolved config): a ``train --workers`` run (state.json
    records expert plans) ran efficientmoe.dispatch, a one-process run moe.dispatch; the
    retired one-level "counts" reads as the "grouped" rows it computed. A config a user
    writes with the older key is still refused."""
    import json

    from ms_efficient.train.ep_launch import load_run_config

    data = RunConfig().to_dict()
    data["moe"]["dispatch"] = "static"
    data["efficientmoe"]["dispatch"] = "counts"
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(data))
    state = {"step": 4, "checkpoint": "ckpt/step_4.ckpt"}
    if plans:
        state.update(world_size=2, plans=[])
    (tmp_path / "state.json").write_text(json.dumps(state))
    cfg = load_run_config(str(tmp_path), {"train.steps": 9})
    assert cfg.moe.dispatch == dispatch and cfg.train.steps == 9
    with pytest.raises(ValueError, match=r"'efficientmoe.dispatch' \('counts'\) is now "
                                         r"'moe.dispatch'"):
        load_config(str(tmp_path / "config.yaml"))


@pytest.mark.parametrize("name", sorted(n for n in os.listdir(os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs"))
    if n.startswith("gpt_moe")))                    # the training configs (shard_*: `shard`)
def test_every_shipped_training_config_loads_and_validates(name):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    load_config(os.path.join(root, "configs", name))


def test_a_saved_run_of_the_retired_planner_loads_and_a_user_config_naming_its_keys_is_refused(
        tmp_path):
    """A run folder saved while the one-process capacity planner existed: its retired keys are
    dropped and its one-process EfficientMoE is off on resume (nothing left to re-plan); an
    expert-parallel run keeps its own value. A user's config naming such a key is refused."""
    saved = RunConfig().to_dict()
    saved["efficientmoe"].update(enabled=True, predictor="ar-ridge", capacity_levels=2,
                                 recompile_cost_s=None, monitor_steps=5)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(saved))
    one = load_config(str(path), saved_expert_parallel=False)
    assert one.efficientmoe.enabled is False
    assert load_config(str(path), saved_expert_parallel=True).efficientmoe.enabled is True
    with pytest.raises(ValueError, match=r"'efficientmoe.capacity_levels' belonged to the "
                                         r"retired one-process capacity planner"):
        load_config(str(path))
