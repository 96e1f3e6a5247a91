"""Issue 27: every bad value is refused before work starts (config values, config files,
traces, CLI options: one line naming the file or option, the value and what is allowed,
exit 2, nothing written), and the planners give the same plan on a busy machine."""
import math
import os

import numpy as np
import pytest
import yaml

from conftest import tiny_config_dict
from ms_efficient.cli import main
from ms_efficient.core.config import load_config


def _one_line(capsys, *needles):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    for needle in needles:
        assert needle in err[0], err[0]
    return err[0]


def _train_refuses(tmp_path, text, capsys, *needles):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    out = tmp_path / "out"
    assert main(["train", str(path), "--out", str(out)]) == 2
    line = _one_line(capsys, *needles)
    assert not out.exists()                                  # nothing written, no folder
    return line


# ---------------------------------------------------------------- config values and files

@pytest.mark.parametrize("section, key, text, shown", [
    ("train", "learning_rate", ".nan", "nan"),
    ("train", "learning_rate", ".inf", "inf"),
    ("train", "grad_clip", ".nan", "nan"),
    ("moe", "capacity_factor", ".nan", "nan"),
])
def test_non_finite_config_values_are_refused_naming_file_field_and_value(
        tmp_path, text_dir, capsys, section, key, text, shown):
    cfg = tiny_config_dict(text_dir, str(tmp_path / "out"))
    cfg[section][key] = 1.0
    body = yaml.safe_dump(cfg).replace(f"{key}: 1.0", f"{key}: {text}")
    assert f"{key}: {text}" in body
    line = _train_refuses(tmp_path, body, capsys, "bad.yaml",
                          f"'{section}.{key}' must be a finite number, but got {shown}.")
    assert line.startswith("ms-efficient: error: ")


def test_sections_of_the_wrong_type_are_refused_and_a_null_section_means_defaults(tmp_path,
                                                                                   capsys):
    _train_refuses(tmp_path, "train: [1, 2]\n", capsys, "bad.yaml",
                   "'train' must be a mapping of keys to values, but got [1, 2].")
    path = tmp_path / "null.yaml"
    path.write_text("train: null\nmoe: {top_k: 1}\n")
    cfg = load_config(str(path), {"train.out_dir": "runs/x"})        # what --out does
    assert cfg.train.out_dir == "runs/x" and cfg.train.steps == 300 and cfg.moe.top_k == 1


def test_an_empty_config_file_or_a_folder_is_refused(tmp_path, capsys):
    _train_refuses(tmp_path, "", capsys, "bad.yaml", "is empty")
    _train_refuses(tmp_path, "# only a comment\n", capsys, "bad.yaml", "is empty")
    folder = tmp_path / "configs"
    folder.mkdir()
    assert main(["train", str(folder), "--out", str(tmp_path / "out")]) == 2
    _one_line(capsys, f"Config file '{folder}' is a folder, not a YAML file.")
    assert not (tmp_path / "out").exists()


def test_a_model_too_big_for_the_machine_is_refused_before_any_allocation(tmp_path, capsys):
    line = _train_refuses(tmp_path, "moe: {num_experts: 100000}\n", capsys, "bad.yaml",
                          "'moe.num_experts' must be small enough", "but got 100000",
                          "G parameters x 16 bytes")
    assert "GiB of memory" in line


@pytest.mark.parametrize("experts", [{}, {"expert_kind": "glu", "shared_experts": 2},
                                     {"shared_experts": 1}])
def test_the_footprint_estimate_counts_the_models_parameters_exactly(tmp_path, text_dir,
                                                                     experts):
    from ms_efficient.core.config import config_from_dict
    from ms_efficient.models.gpt_moe import build_model
    from ms_efficient.train.footprint import check_fits_machine, estimate_footprint

    data = tiny_config_dict(text_dir, str(tmp_path / "run"))
    data["moe"]["moe_every"] = 2                         # one MoE block, one dense block
    data["moe"].update(experts)                          # gated and shared experts
    cfg = config_from_dict(data)
    net = build_model(cfg.model, cfg.moe, cfg.train.batch_size)
    counted = sum(int(np.prod(p.shape)) for p in net.trainable_params())
    fp = estimate_footprint(cfg)
    assert fp.params == counted
    if experts:
        return
    assert fp.state_bytes == 16 * counted
    assert check_fits_machine(cfg, memory_bytes=1 << 30).total_bytes == fp.total_bytes
    # the field named is the one whose default (4 layers here) would shrink the run most
    deep = config_from_dict(dict(data, model=dict(data["model"], num_layers=100_000)))
    with pytest.raises(ValueError, match=r"^x.yaml: 'model.num_layers' must be small enough "
                                         r"for the run to fit this machine's 1.0 GiB of "
                                         r"memory, but got 100000: training needs at least"):
        check_fits_machine(deep, "x.yaml", memory_bytes=1 << 30)


# ---------------------------------------------------------------- traces

@pytest.mark.parametrize("arrays, needle", [
    ({"counts": np.ones((2, 1, 1, 4), np.int64), "top_k": np.int64(6)},
     "'top_k' must be <= the number of experts (4"),
    ({"counts": np.array([[[["1", "2"]]]])}, "'counts' must be an integer array, but has "
                                             "dtype <U1"),
    ({"counts": np.full((2, 1, 2, 4), 2 ** 62, np.int64)}, "must sum to at most 2**40 tokens"),
    ({"counts": np.full((2, 1, 1, 4), 2 ** 63 + 5, np.uint64)}, "must sum to at most 2**40"),
])
def test_bad_traces_are_refused_naming_the_file(tmp_path, capsys, arrays, needle):
    path = tmp_path / "bad_trace.npz"
    np.savez(path, **arrays)
    out = tmp_path / "moe.yaml"
    assert main(["plan", "moe", "--trace", str(path), "--out", str(out)]) == 2
    _one_line(capsys, str(path), needle)
    assert not out.exists()


# ---------------------------------------------------------------- CLI options

@pytest.mark.parametrize("argv, needle", [
    (["plan", "place", "G", "--time-budget", "0"], "--time-budget: must be a finite number > 0, "
                                                   "but got 0.0"),
    (["plan", "place", "G", "--time-budget", "-5"], "but got -5.0"),
    (["plan", "place", "G", "--time-budget", "nan"], "but got nan"),
    (["plan", "memory", "C", "--budget", "1GiB", "--time-limit", "-1"],
     "--time-limit: must be a finite number > 0, but got -1.0"),
    (["plan", "memory", "C", "--budget", "1GiB", "--batch", "0"],
     "--batch: must be a positive integer, but got 0"),
])
def test_bad_option_values_exit_2_in_one_line(tmp_path, capsys, argv, needle):
    from conftest import ROOT

    graph = os.path.join(ROOT, "tests", "fixtures", "pipedream_tiny.txt")
    config = os.path.join(ROOT, "configs", "gpt_moe_tiny.yaml")
    argv = [graph if a == "G" else config if a == "C" else a for a in argv]
    out = tmp_path / "plan.yaml"
    with pytest.raises(SystemExit) as exc:
        main(argv + ["--out", str(out)])
    assert exc.value.code == 2
    _one_line(capsys, "ms-efficient: error: ", needle)
    assert not out.exists()


def test_an_output_that_is_a_folder_is_named_before_any_work(tmp_path, capsys):
    from conftest import ROOT

    graph = os.path.join(ROOT, "tests", "fixtures", "pipedream_tiny.txt")
    assert main(["plan", "place", graph, "--out", str(tmp_path)]) == 2
    line = _one_line(capsys, f"'--out' must be a file to write, but '{tmp_path}' is a folder.")
    assert ".tmp-" not in line and os.listdir(tmp_path) == []


def test_an_atomic_write_onto_a_folder_names_the_folder(tmp_path):
    from ms_efficient.core.fileio import atomic_write_text

    with pytest.raises(IsADirectoryError) as exc:
        atomic_write_text(str(tmp_path), "x")
    assert exc.value.filename == str(tmp_path) and os.listdir(tmp_path) == []


# ---------------------------------------------------------------- planners' stopping rule

class _BusyClock:
    """perf_counter of a machine so busy that every reading is 10 s after the last."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        self.now += 10.0
        return self.now


def test_placement_gives_the_same_plan_on_a_busy_machine_and_says_why_it_stopped(
        monkeypatch):
    from ms_efficient.place import cost as place_cost
    from ms_efficient.place.bench import run_methods
    from ms_efficient.place.planner import TGAConfig, tga
    from ms_efficient.place.problem import PlacementOptions, build_problem
    from tests.test_place_cost import random_dag, toy_cluster

    problem = build_problem(random_dag(60, seed=3), toy_cluster(devices=4),
                            PlacementOptions(micro_batches=2))
    idle = run_methods(problem, ["tga"], 400, None, seed=0)["tga"]
    monkeypatch.setattr(place_cost.time, "perf_counter", _BusyClock())
    busy = run_methods(problem, ["tga"], 400, None, seed=0)["tga"]
    assert busy.evaluations == idle.evaluations == 400
    assert np.array_equal(busy.assign, idle.assign) and busy.cost_s == idle.cost_s
    assert idle.stopped_by == busy.stopped_by == "evaluations"
    assert TGAConfig().time_budget_s == math.inf
    timed = tga(problem, TGAConfig(seed=0, max_evaluations=400, time_budget_s=30.0))
    assert timed.stopped_by == "time_budget" and timed.evaluations < 400   # the option works


def test_plan_place_records_the_stopping_rule_in_the_plan(tmp_path, capsys):
    from conftest import ROOT

    graph = os.path.join(ROOT, "tests", "fixtures", "pipedream_tiny.txt")
    out = tmp_path / "place.yaml"
    assert main(["plan", "place", graph, "--devices", "4", "--evaluations", "200",
                 "--out", str(out)]) == 0
    meta = yaml.safe_load(out.read_text())["meta"]
    assert meta["stopped_by"] == "evaluations" and meta["evaluations"] == 200
    assert meta["time_budget_s"] is None
    assert "(stopped by evaluations)" in capsys.readouterr().out


def test_memopt_gives_the_same_plan_on_a_busy_machine_and_says_why_it_stopped(monkeypatch):
    from ms_efficient.core.collectives import Link
    from ms_efficient.memopt import agents
    from ms_efficient.memopt.agents import RLConfig
    from ms_efficient.memopt.baselines import no_optimization
    from ms_efficient.memopt.env import evaluate
    from ms_efficient.memopt.planner import plan_memory
    from ms_efficient.memopt.profile import LayerProfile

    rng = np.random.default_rng(5)
    n = 10
    prof = LayerProfile(names=[f"l{i}" for i in range(n)], forward_time_s=rng.uniform(1, 3, n),
                        backward_time_s=rng.uniform(2, 6, n),
                        output_bytes=rng.uniform(5, 20, n), interior_bytes=rng.uniform(20, 100, n),
                        workspace_bytes=rng.uniform(5, 20, n), static_bytes=100.0)
    link = Link(latency_s=0.0, bandwidth_Bps=100.0)
    budget = 0.8 * evaluate(prof, no_optimization(prof), 1e9, link).peak_bytes
    cfg = RLConfig(seed=3, iterations=30, batch=8)
    assert cfg.time_limit_s == math.inf
    idle, _ = plan_memory(prof, budget, link, cfg)
    monkeypatch.setattr(agents.time, "perf_counter", _BusyClock())
    busy, _ = plan_memory(prof, budget, link, cfg)
    assert np.array_equal(busy.actions, idle.actions)
    assert busy.meta["updates"] == idle.meta["updates"] > 1
    assert idle.meta["stopped_by"] in ("patience", "iterations")
    timed, _ = plan_memory(prof, budget, link, RLConfig(seed=3, iterations=30, batch=8,
                                                        time_limit_s=15.0))
    assert timed.meta["stopped_by"] == "time_limit" and timed.meta["time_limit_s"] == 15.0
