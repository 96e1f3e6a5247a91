"""The command line: bad input gives one clear line, exit code 2, and writes nothing."""
import os
import subprocess
import sys

import pytest
import yaml

from conftest import ROOT, tiny_config_dict
from ms_efficient.cli import main

BAD = {
    "unknown key": ({"model": {"hidden": 64}}, "Unknown config key 'model.hidden'"),
    "wrong type": ({"train": {"batch_size": "big"}}, "'train.batch_size' must be an integer"),
    "negative experts": ({"moe": {"num_experts": -1}}, "'moe.num_experts' must be a positive integer, but got -1"),
    "top_k > experts": ({"moe": {"num_experts": 4, "top_k": 6}}, "'moe.top_k' must be in [1, moe.num_experts (4)], but got 6"),
    "missing data path": ({"data": {"path": "/nonexistent/text"}}, "'data.path' must be 'stdlib' or an existing file or folder"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_config_is_one_line_and_exit_code_2(case, tmp_path, text_dir, capsys):
    data, message = BAD[case]
    cfg = tiny_config_dict(text_dir, str(tmp_path / "out"))
    for section, values in data.items():
        cfg[section].update(values)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["train", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ms-efficient: error: ")
    assert message in err[0]
    assert not (tmp_path / "out").exists()          # nothing written


def test_the_installed_command_exits_2_on_a_bad_config(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("moe:\n  num_experts: 0\n")
    proc = subprocess.run([sys.executable, "-m", "ms_efficient.cli", "train", str(path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"ms-efficient: error: {path}: 'moe.num_experts' must be a positive integer, but got 0.")


def test_train_needs_a_config_or_resume(capsys):
    assert main(["train"]) == 2
    assert "train needs CONFIG" in capsys.readouterr().err
    assert main(["train", "--resume", "/nonexistent/run"]) == 2


def test_report_of_a_non_run_folder_is_an_error(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "has no metrics.jsonl" in capsys.readouterr().err


def test_steps_must_be_positive(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "configs/gpt_moe_tiny.yaml", "--steps", "0"])
    assert exc.value.code == 2


def test_graph_command_reads_a_pipedream_profile_and_writes_json(tmp_path, capsys):
    out = tmp_path / "g.json"
    fixture = os.path.join(ROOT, "tests", "fixtures", "pipedream_tiny.txt")
    assert main(["graph", fixture, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "nodes" in text and out.is_file()
    from ms_efficient.graph import OpGraph, load_pipedream
    assert OpGraph.load_json(str(out)).summary() == load_pipedream(fixture).summary()


def test_graph_command_extracts_the_reference_model_from_a_config(tmp_path, text_dir, capsys):
    cfg = tiny_config_dict(text_dir, str(tmp_path / "run"))
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "g.json"
    assert main(["graph", str(path), "--out", str(out)]) == 0
    from ms_efficient.graph import OpGraph
    graph = OpGraph.load_json(str(out))
    counts = graph.count_by_op_type()
    # two MoE blocks: each has two BatchMatMul expert projections, two attention BatchMatMuls
    assert counts.get("BatchMatMul", 0) == 2 * 4
    # expert weights of one block: 4 experts x (32x64 + 64 + 64x32 + 32) floats
    assert graph.total_param_bytes >= 2 * 4 * (32 * 64 + 64 + 64 * 32 + 32) * 4


def test_graph_command_on_a_missing_file_is_an_error(capsys):
    assert main(["graph", "/nonexistent/graph.json"]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["plan", "memory", "configs/gpt_moe_tiny.yaml", "--budget", "1KiB"],
     "'--budget' (1KiB, 1.00 KiB) is below the feasible floor"),
    (["plan", "shard", "configs/gpt_moe_tiny.yaml", "--mesh", "3x0"],
     "'mesh' must look like DPxMP"),
    (["plan", "moe", "--trace", "/nonexistent/trace.npz"], "cannot be read as .npz"),
    (["plan", "place", "/nonexistent/graph.json"], "does not exist"),
    (["plan", "mpipe", "configs/gpt_moe_tiny.yaml", "--cluster", "ascend910b-1x8",
      "--budget", "1KiB"], "is below the least memory"),
])
def test_planner_commands_reject_bad_input_in_one_line(argv, message, tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    assert main(argv + ["--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not out.exists()


def test_bench_moe_rejects_a_skew_out_of_range_before_any_work(tmp_path, capsys):
    out = tmp_path / "moe.json"
    assert main(["bench", "moe", "--no-measured", "--skew", "1.45", "9", "--json",
                 str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'--skew' values must be in [0, 4], but got 9.0" in err[0]
    assert not out.exists()


def test_bench_moe_rejects_more_deepseek_layers_than_the_model_has(tmp_path, capsys):
    out = tmp_path / "moe.json"
    assert main(["bench", "moe", "--no-measured", "--deepseek-layers", "59", "--json",
                 str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'--deepseek-layers' must be in [0, 58]" in err[0]
    assert "got 59" in err[0] and not out.exists()


def test_bench_moe_refuses_a_cluster_too_small_for_the_deepseek_workload(tmp_path, capsys):
    out = tmp_path / "moe.json"
    assert main(["bench", "moe", "--no-measured", "--cluster", "ascend910b-4x8", "--json",
                 str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has 32 devices" in err[0] and "64 ranks" in err[0]
    assert "'--deepseek-layers 0'" in err[0] and not out.exists()


def test_bench_moe_rejects_an_unknown_method_before_any_work(tmp_path, capsys):
    out = tmp_path / "moe.json"
    assert main(["bench", "moe", "--no-measured", "--methods", "efficientmoe", "tutel",
                 "--json", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'--methods' names unknown method 'tutel'; allowed: " in err[0]
    assert not out.exists()


@pytest.mark.mindspore
def test_measured_moe_rows_train_each_method_in_its_own_process(tmp_path, text_dir):
    """``bench moe``'s measured rows (bench.run_measured), 3 steps of the tiny model: the
    padding-free grouped layer and the static layer with a capacity of every token train the
    same model with no token dropped, so the same validation loss (float32 sums in another
    order: 1e-4 relative); the grouped layer computes no padded row, the static one pads.
    Each trains in a child process (bench._run_one), which this process never compiles."""
    from ms_efficient.core.config import load_config
    from ms_efficient.efficientmoe import bench

    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config_dict(text_dir, str(tmp_path / "unused"))))
    cfg = load_config(str(path))
    kept = str(tmp_path / "trace.npz")
    rows = bench.run_measured(cfg, methods=["dropless-static", "grouped-kernel-1proc"],
                              steps=3, workload="tiny", keep_trace=kept)
    by = {r["method"]: r for r in rows}
    assert set(by) == {"dropless-static", "grouped-kernel-1proc"}
    for r in rows:
        assert r["evidence"] == "measured" and r["steps"] == 3 and r["drop_rate"] == 0.0
        assert r["step_time_s"] > 0 and r["total_wall_s"] >= r["step_time_s"]
    assert by["grouped-kernel-1proc"]["padding_fraction"] == 0.0
    # a capacity of every token: 4 experts x T rows computed for 2 x T assignments (top-2)
    assert by["dropless-static"]["padding_fraction"] == pytest.approx(1 - 2 / 4)
    assert by["grouped-kernel-1proc"]["final_val_loss"] == pytest.approx(
        by["dropless-static"]["final_val_loss"], rel=1e-4)
    assert by["dropless-static"]["step_time_vs_dropless"] == 1.0
    # the dropless grouped run's routing is kept for the simulated rows: 3 steps, 2 layers
    from ms_efficient.moe.trace import load_trace

    assert load_trace(kept).counts.shape[:2] == (3, 2)


def test_plan_bundle_writes_into_a_folder_while_file_outputs_refuse_one(tmp_path):
    from ms_efficient.cli import _check_outputs, build_parser

    parser = build_parser()
    _check_outputs(parser.parse_args(["plan", "bundle", "run.yaml", "--out", str(tmp_path)]))
    with pytest.raises(ValueError, match="'--out' must be a file to write"):
        _check_outputs(parser.parse_args(["plan", "memory", "g.json", "--budget", "50%",
                                              "--out", str(tmp_path)]))
