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


def test_efficientmoe_replans_capacities_and_resume_keeps_them(tmp_path, text_dir):
    """With EfficientMoE on, the trainer re-plans per-expert capacities, recompiles, records
    the plan, and a resumed run compiles with the planned capacities."""
    from ms_efficient.core.config import load_config
    from ms_efficient.train.trainer import Trainer

    config = _write_config(tmp_path, text_dir, steps=12, save_every=12, eval_every=12,
                           log_every=4)
    cfg = load_config(config, {"efficientmoe.enabled": True, "efficientmoe.warmup_steps": 4,
                               "efficientmoe.replan_every": 4, "efficientmoe.window": 4,
                               "efficientmoe.capacity_multiple": 4,
                               "efficientmoe.drop_target": 0.0})
    out = str(tmp_path / "run")
    trainer = Trainer(cfg, out)
    start = trainer.capacities()
    assert start.tolist() == [[80, 80, 80, 80]] * 2       # ceil(1.25 * 128 * 2 / 4)
    trainer.run()
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        rows = [json.loads(line) for line in fh]
    plans = [r for r in rows if r["kind"] == "plan"]
    # plans are considered at steps 4 and 8 (not at the last step); drop_target 0 forces
    # adoption whenever the static capacities dropped anything
    assert [p["step"] for p in plans] and all(p["step"] in (4, 8) for p in plans)
    final = trainer.capacities()
    assert final.tolist() == plans[-1]["capacities"]
    assert np.all(final % 4 == 0) and np.all(final <= 128)
    with open(os.path.join(out, "state.json")) as fh:
        assert json.load(fh)["capacities"] == final.tolist()
    resumed = Trainer(cfg, out, resume=True)
    resumed._restore()
    assert resumed.capacities().tolist() == final.tolist()


def _history(tmp_path, per_rank_E, layers=2, ranks=2, steps=6):
    from ms_efficient.moe.trace import RoutingTrace, save_trace

    counts = np.broadcast_to(np.asarray(per_rank_E, np.int64),
                             (steps, layers, ranks, len(per_rank_E))).copy()
    path = str(tmp_path / "history.npz")
    save_trace(RoutingTrace(counts, top_k=2), path)
    return path


def test_efficientmoe_history_plans_before_the_first_step(tmp_path, text_dir):
    """A routing history (the run these weights continue) gives the first plan before the
    first compilation: no step runs at the static capacity factor."""
    from ms_efficient.core.config import load_config
    from ms_efficient.train.trainer import Trainer

    config = _write_config(tmp_path, text_dir, steps=3, save_every=3, eval_every=3)
    # every step of the history routes [64, 32, 16, 16] per rank: [128, 64, 32, 32] per layer
    history = _history(tmp_path, [64, 32, 16, 16])
    cfg = load_config(config, {"efficientmoe.enabled": True, "efficientmoe.history": history,
                               "efficientmoe.predictor": "last-value",
                               "efficientmoe.replan_every": 100, "efficientmoe.window": 4,
                               "efficientmoe.capacity_multiple": 4,
                               "efficientmoe.capacity_levels": 4})
    trainer = Trainer(cfg, str(tmp_path / "run"))
    assert trainer.capacities().tolist() == [[80, 80, 80, 80]] * 2    # capacity_factor 1.25
    trainer.run()
    with open(os.path.join(str(tmp_path / "run"), "metrics.jsonl")) as fh:
        plans = [r for r in map(json.loads, fh) if r["kind"] == "plan"]
    # a steady history is forecast exactly: capacities equal the loads (multiples of 4)
    assert [p["step"] for p in plans] == [0]
    assert plans[0]["capacities"] == [[128, 64, 32, 32]] * 2
    # every one of the 3 steps computed 2 layers x 256 rows, not the static 2 x 320
    assert trainer.totals["rows"] == 3 * 2 * 256


def test_efficientmoe_history_of_another_model_is_refused(tmp_path, text_dir):
    from ms_efficient.core.config import load_config
    from ms_efficient.train.trainer import Trainer

    config = _write_config(tmp_path, text_dir, steps=3)
    wrong = _history(tmp_path, [32, 32, 16, 16, 16, 16])          # 6 experts, model has 4
    cfg = load_config(config, {"efficientmoe.enabled": True, "efficientmoe.history": wrong})
    with pytest.raises(ValueError, match="efficientmoe.history.*6"):
        Trainer(cfg, str(tmp_path / "run"))
    with pytest.raises(ValueError, match="'efficientmoe.history' must be"):
        load_config(config, {"efficientmoe.enabled": True,
                             "efficientmoe.history": str(tmp_path / "missing.npz")})
