"""End-to-end training of a tiny model: files written, loss falls, resume is exact."""
import json
import os

import sys

import numpy as np
import pytest
import yaml

import workers
from conftest import ROOT, tiny_config_dict, write_corpus
from ms_efficient.cli import main
from ms_efficient.moe.trace import load_trace
from ms_efficient.train.trainer import lr_schedule


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    rates = lr_schedule(1.0, warmup=4, total=104, floor=0.1)
    assert rates[:4] == [0.25, 0.5, 0.75, 1.0]
    assert rates[4] == pytest.approx(1.0)
    assert rates[54] == pytest.approx(0.55)          # half-way through the cosine
    assert rates[-1] == pytest.approx(0.1, abs=1e-3)
    assert all(a >= b for a, b in zip(rates[4:], rates[5:]))


def _write_config(tmp_path, text_dir, **train):
    cfg = tiny_config_dict(text_dir, str(tmp_path / "run"))
    cfg["train"].update(train)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _val_losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [(r["step"], r["val_loss"]) for r in map(json.loads, fh) if r["kind"] == "val"]


def test_train_writes_the_run_folder_and_the_loss_falls(tmp_path, text_dir):
    config = _write_config(tmp_path, text_dir, steps=12, eval_every=6, save_every=6)
    out = str(tmp_path / "run")
    assert main(["train", config, "--out", out]) == 0
    for name in ("config.yaml", "metrics.jsonl", "state.json", "trace.npz", "report.md",
                 "loss.png", "expert_load.png"):
        assert os.path.isfile(os.path.join(out, name)), name
    assert len(os.listdir(os.path.join(out, "ckpt"))) == 2      # last two kept
    vals = _val_losses(out)
    assert [s for s, _ in vals] == [0, 6, 12]
    assert vals[0][1] == pytest.approx(np.log(256), abs=0.1)   # untrained: ~uniform bytes
    assert vals[-1][1] < vals[0][1] - 0.5
    trace = load_trace(os.path.join(out, "trace.npz"))
    # 12 steps x 2 MoE layers x 2 source ranks x 4 experts; each rank routes
    # batch/ranks * seq = 2 * 32 tokens, top-2 -> 128 assignments per layer and rank
    assert trace.counts.shape == (12, 2, 2, 4)
    assert np.all(trace.counts.sum(axis=3) == 128)
    assert trace.top_k == 2 and trace.hidden == 32 and trace.tokens_per_rank == 64
    with open(os.path.join(out, "report.md")) as fh:
        report = fh.read()
    assert "Validation loss fell by" in report and "expert_load.png" in report


# long enough that the kill lands mid-run even on an idle machine: it follows the first
# checkpoint (step 4) within a 20 ms poll, and the other 56 steps take ~2 s there (40 steps
# with a 1 s pause before the kill did finish first once)
KILL_STEPS = 60


@workers.in_background("sigkilled_run")
def _sigkilled_run():
    """The CLI's training run SIGKILLed as soon as its first checkpoint is recorded
    (state.json appears), then ``train --resume`` of it, and the unbroken run of the same
    config: child processes, in the background (tests/workers.py). Returns the killed run's
    state.json step and its trace's number of steps read right after the kill, the killed
    and unbroken folders, and the resume's and the unbroken run's CompletedProcess."""
    tmp = workers.temporary_dir("sigkill_")
    config = _write_config(tmp, write_corpus(tmp / "corpus"), steps=KILL_STEPS, save_every=4,
                           eval_every=KILL_STEPS, log_every=4)
    killed, full = str(tmp / "killed"), str(tmp / "full")
    workers.run_and_kill([sys.executable, "-m", "ms_efficient.cli", "train", config, "--out",
                          killed], os.path.join(killed, "state.json"), 1, poll_s=0.02,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                             p for p in [ROOT, os.environ.get("PYTHONPATH")] if p)))
    with open(os.path.join(killed, "state.json")) as fh:
        saved = json.load(fh)["step"]
    trace_steps = load_trace(os.path.join(killed, "trace.npz")).num_steps
    resumed = workers.run_cli(["train", "--resume", killed])
    unbroken = workers.run_cli(["train", config, "--out", full])
    return saved, trace_steps, killed, full, resumed, unbroken


@pytest.fixture(scope="module")
def sigkilled_run():
    return workers.background_result("sigkilled_run")


@pytest.mark.slow
def test_a_run_killed_with_sigkill_loses_at_most_one_checkpoint_interval(sigkilled_run):
    """SIGKILL the CLI after its first checkpoint, resume, and compare with an unbroken run
    (``_sigkilled_run``: in child processes, in the background)."""
    steps = KILL_STEPS
    saved, trace_steps, killed, full, resumed, unbroken = sigkilled_run
    assert 4 <= saved < steps and saved % 4 == 0
    # every file is whole: the trace and metrics load, and end at the checkpoint's step or later
    assert trace_steps == saved
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert unbroken.returncode == 0, unbroken.stdout[-3000:] + unbroken.stderr[-3000:]
    # the one-process CLI ran with MindSpore's graph pipeline off (trainer.train):
    # MindSpore prints the runtime config it parsed when its runtime starts
    assert "[MS_DEV_RUNTIME_CONF] config:  graph_pipeline:False" in (unbroken.stdout
                                                                     + unbroken.stderr)
    a = load_trace(os.path.join(full, "trace.npz")).counts
    b = load_trace(os.path.join(killed, "trace.npz")).counts
    assert a.shape == b.shape == (steps, 2, 2, 4)
    np.testing.assert_array_equal(a[:saved], b[:saved])
    # after the resume the run continues on the same data from the same state
    va, vb = _val_losses(full)[-1], _val_losses(killed)[-1]
    assert va[0] == vb[0] == steps
    assert vb[1] == pytest.approx(va[1], abs=2e-3)


def test_a_one_process_run_refuses_efficientmoe_and_keeps_capacities_it_was_given(tmp_path,
                                                                                   text_dir):
    """EfficientMoE places experts over ranks: a one-process run with it on is refused, naming
    the field, before its folder is written. Capacities set before the run (what the
    efficientmoe pass sizes from a trace) are what it computes, and a resume compiles them."""
    from ms_efficient.core.config import load_config
    from ms_efficient.train.trainer import Trainer

    config = _write_config(tmp_path, text_dir, steps=2, save_every=2, eval_every=2)
    with pytest.raises(ValueError, match=r"'efficientmoe.enabled' must be false for a "
                                         r"one-process run \(EfficientMoE places experts"):
        Trainer(load_config(config, {"efficientmoe.enabled": True}), str(tmp_path / "no"))
    assert not os.path.exists(tmp_path / "no")
    with pytest.raises(ValueError, match="'efficientmoe.history' must be"):
        load_config(config, {"efficientmoe.history": str(tmp_path / "missing.npz")})
    with pytest.raises(ValueError, match=r"'efficientmoe.predictor' belonged to the retired "
                                         r"one-process capacity planner"):
        load_config(config, {"efficientmoe.predictor": "ema"})
    cfg = load_config(config)
    out = str(tmp_path / "run")
    trainer = Trainer(cfg, out)
    assert trainer.capacities().tolist() == [[80, 80, 80, 80]] * 2    # ceil(1.25 * 128 * 2 / 4)
    sized = np.array([[96, 64, 64, 32], [64, 64, 64, 64]])
    trainer.set_capacities(sized)
    trainer.run()
    assert trainer.totals["rows"] == 2 * sized.sum()
    with open(os.path.join(out, "state.json")) as fh:
        assert json.load(fh)["capacities"] == sized.tolist()
    resumed = Trainer(cfg, out, resume=True)
    resumed._restore()
    assert resumed.capacities().tolist() == sized.tolist()
