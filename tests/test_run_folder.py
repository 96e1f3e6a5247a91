"""Issue 27: one run per folder (lock, refusal, pruning by step), checkpoints that prove
themselves (checksums, fallback to the newest good one, no temporaries left, fsync before
rename), including a SIGKILL in the middle of a checkpoint write."""
import json
import logging
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import yaml

import workers
from conftest import ROOT, tiny_config_dict, write_corpus
from ms_efficient.cli import main
from ms_efficient.train import checkpoint as ck

_ENV = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _state(run_dir):
    with open(os.path.join(run_dir, "state.json")) as fh:
        return json.load(fh)


def _temporaries(run_dir):
    return [os.path.join(d, n) for d, _, names in os.walk(run_dir) for n in names
            if n.startswith(".tmp-")]


def _write_config(folder, corpus) -> str:
    """6 steps, a checkpoint every 3 (steps 3 and 6 kept): FOLDER/tiny.yaml."""
    cfg = tiny_config_dict(corpus, str(folder / "unused"))
    cfg["train"].update(steps=6, save_every=3, eval_every=3, log_every=3)
    path = folder / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.fixture(scope="module")
def config(tmp_path_factory, corpus_dir):
    """6 steps, a checkpoint every 3 (steps 3 and 6 kept)."""
    return _write_config(tmp_path_factory.mktemp("cfg"), corpus_dir)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, config):
    """One uninterrupted 6-step run (tests copy it before changing anything)."""
    out = str(tmp_path_factory.mktemp("trained") / "run")
    assert main(["train", config, "--out", out]) == 0
    return out


# ---------------------------------------------------------------- the module on its own

def test_pruning_keeps_the_highest_steps_of_this_run_by_number_not_name(tmp_path):
    run = str(tmp_path)
    foreign = tmp_path / "ckpt" / "step_000100.ckpt"        # not listed in this run's state
    foreign.parent.mkdir()
    foreign.write_bytes(b"older run")
    for step in (999_998, 999_999, 1_000_000):               # names sort 1000000 first
        record = ck.save_checkpoint(run, step, lambda p, s=step: open(p, "w").write(str(s)))
        state = ck.commit_state(run, record, keep=2)
    assert [r["step"] for r in state["checkpoints"]] == [999_999, 1_000_000]
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step_000100.ckpt", "step_1000000.ckpt",
                                                     "step_999999.ckpt"]
    assert os.path.isfile(os.path.join(run, state["checkpoint"]))
    assert state["step"] == 1_000_000 and foreign.read_bytes() == b"older run"


def _two_ranks_at_steps_2_and_4(tmp_path) -> str:
    """A 2-rank run folder whose ranks each saved and recorded steps 2 and 4 (64 bytes each)."""
    run = str(tmp_path)
    for rank in (0, 1):
        for step in (2, 4):
            record = ck.save_checkpoint(run, step, lambda p: open(p, "wb").write(b"x" * 64),
                                        rank=rank)
            ck.commit_state(run, record, rank=rank)
    return run


def test_per_rank_checkpoints_resume_from_the_newest_step_good_on_every_rank(tmp_path):
    run = _two_ranks_at_steps_2_and_4(tmp_path)
    assert os.path.isfile(tmp_path / "ckpt" / "rank_1" / "step_000004.ckpt")
    assert {r: rec["step"] for r, rec in ck.newest_common_step(run, [0, 1]).items()} == \
        {0: 4, 1: 4}
    (tmp_path / "ckpt" / "rank_1" / "step_000004.ckpt").write_bytes(b"y" * 64)  # bad on rank 1
    assert {r: rec["step"] for r, rec in ck.newest_common_step(run, [0, 1]).items()} == \
        {0: 2, 1: 2}


def test_atomic_writes_fsync_the_data_before_the_rename(tmp_path, monkeypatch):
    from ms_efficient.core import fileio

    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(fileio.os, "fsync", lambda fd: (events.append(
        ("fsync", os.readlink(f"/proc/self/fd/{fd}"))), real_fsync(fd))[1])
    monkeypatch.setattr(fileio.os, "replace", lambda a, b: (events.append(
        ("replace", a)), real_replace(a, b))[1])
    target = tmp_path / "ckpt" / "step_000003.ckpt"
    ck.save_checkpoint(str(tmp_path), 3, lambda p: open(p, "wb").write(b"weights"))
    tmp = events[1][1]
    assert events[0] == ("fsync", tmp) and os.path.basename(tmp).startswith(".tmp-")
    assert events[1][0] == "replace"
    assert events[2] == ("fsync", str(target.parent))          # the rename is made durable
    assert target.read_bytes() == b"weights"


def test_a_second_process_is_refused_with_the_holders_pid(tmp_path, config, capsys):
    out = str(tmp_path / "run")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom ms_efficient.train.checkpoint import "
         "acquire_lock\nacquire_lock(sys.argv[1])\nprint('ready', flush=True)\ntime.sleep(120)",
         out], stdout=subprocess.PIPE, text=True, cwd=ROOT, env=_ENV)
    try:
        assert holder.stdout.readline().strip() == "ready"
        assert main(["train", config, "--out", out]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"in use by process {holder.pid}" in err[0], err
        assert os.listdir(out) == ["run.lock"]                      # nothing else written
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    ck.acquire_lock(out).release()                  # a killed holder leaves no stale lock


# ---------------------------------------------------------------- the trainer and the CLI

def test_train_into_an_older_run_refuses_then_overwrite_keeps_only_this_run(tmp_path, config,
                                                                              capsys):
    out = tmp_path / "run"
    (out / "ckpt").mkdir(parents=True)
    (out / "ckpt" / "step_000900.ckpt").write_bytes(b"older run, higher step")
    old_state = json.dumps({"step": 900, "checkpoint": "ckpt/step_000900.ckpt"})
    (out / "state.json").write_text(old_state)
    (out / "metrics.jsonl").write_text('{"kind": "val", "step": 900, "val_loss": 1.0}\n')
    assert main(["train", config, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already holds a run" in err[0] and "--overwrite" in err[0]
    assert (out / "state.json").read_text() == old_state                   # untouched
    assert main(["train", config, "--out", str(out), "--overwrite"]) == 0
    state = _state(str(out))
    assert sorted(os.listdir(out / "ckpt")) == ["step_000003.ckpt", "step_000006.ckpt"]
    assert state["step"] == 6 and os.path.isfile(out / state["checkpoint"])
    with open(out / "metrics.jsonl") as fh:
        assert max(json.loads(line)["step"] for line in fh) == 6          # old metrics gone
    # finished: a resume with nothing to train says so (exit 2, nothing written); resumable
    assert main(["train", "--resume", str(out)]) == 2
    assert "nothing to train" in capsys.readouterr().err
    assert main(["train", "--resume", str(out), "--steps", "7"]) == 0
    assert _state(str(out))["step"] == 7


def test_resume_falls_back_from_a_corrupt_or_truncated_checkpoint(tmp_path, trained, caplog):
    from ms_efficient.core.config import load_config
    from ms_efficient.train.trainer import Trainer

    state = _state(trained)
    assert [r["step"] for r in state["checkpoints"]] == [3, 6]
    assert all(len(r["sha256"]) == 64 for r in state["checkpoints"])
    for damage in ("random", "truncated"):
        run = str(tmp_path / damage)
        shutil.copytree(trained, run)
        latest = os.path.join(run, "ckpt", "step_000006.ckpt")
        size = os.path.getsize(latest)
        with open(latest, "r+b") as fh:
            if damage == "random":                    # a few KiB of noise, same size
                fh.seek(size // 2)
                fh.write(np.random.default_rng(0).bytes(4096))
            else:
                fh.truncate(size // 3)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            trainer = Trainer(load_config(os.path.join(run, "config.yaml")), run, resume=True)
            trainer._restore()
        assert trainer.step == 3, damage
        assert "step_000006.ckpt (step 6)" in caplog.text and "steps 4-6 are lost" in caplog.text
        assert [m["step"] for m in trainer.metrics if m["kind"] == "val"] == [0, 3]
        assert len(trainer.sampler) == 3
    os.unlink(os.path.join(run, "ckpt", "step_000003.ckpt"))     # nothing good left
    with pytest.raises(ValueError, match="no checkpoint of .* can be trusted"):
        Trainer(load_config(os.path.join(run, "config.yaml")), run, resume=True)._restore()


_KILL_MID_WRITE = (
    "import os, signal, sys\n"
    "from ms_efficient.train import checkpoint as ck\n"
    "save = ck.save_checkpoint\n"
    "def half_then_kill(path):\n"
    "    with open(path, 'wb') as fh:\n"
    "        fh.write(b'\\0' * (1 << 20))\n"
    "    os.kill(os.getpid(), signal.SIGKILL)\n"
    "def patched(run_dir, step, write_fn, rank=None):\n"
    "    return save(run_dir, step, half_then_kill if step == 6 else write_fn, rank)\n"
    "ck.save_checkpoint = patched\n"
    "from ms_efficient.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n")


@workers.in_background("killed_mid_write")
def _killed_mid_write():
    """``train`` of ``config``'s settings in a child process SIGKILLed while step 6's
    checkpoint is half written (in the background: tests/workers.py); (run folder, its
    CompletedProcess)."""
    folder = workers.temporary_dir("kill_mid_write_")
    config = _write_config(folder, write_corpus(folder / "corpus"))
    out = str(folder / "killed")
    return out, subprocess.run([sys.executable, "-c", _KILL_MID_WRITE, "train", config,
                                "--out", out], cwd=ROOT, env=_ENV, capture_output=True,
                               timeout=300)


@pytest.fixture(scope="module")
def killed_mid_write():
    return workers.background_result("killed_mid_write")


def test_a_kill_during_a_checkpoint_write_resumes_exactly_and_leaves_no_temporary(
        killed_mid_write, trained):
    """SIGKILL while step 6's checkpoint is half written (``_killed_mid_write``, the settings
    of ``config``): the temporary is left, state.json still names step 3; --resume removes
    the temporary and ends where the unbroken run did."""
    out, proc = killed_mid_write
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert len(_temporaries(out)) == 1 and _state(out)["step"] == 3
    assert main(["train", "--resume", out]) == 0
    assert _temporaries(out) == []
    assert _state(out)["step"] == 6
    assert sorted(os.listdir(os.path.join(out, "ckpt"))) == [
        "step_000003.ckpt", "step_000006.ckpt"]
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        got = [r for r in map(json.loads, fh) if r["kind"] == "val"]
    with open(os.path.join(trained, "metrics.jsonl")) as fh:
        want = [r for r in map(json.loads, fh) if r["kind"] == "val"]
    assert [r["step"] for r in got] == [0, 3, 6]
    assert got[-1]["val_loss"] == pytest.approx(want[-1]["val_loss"], abs=2e-3)


def test_per_rank_resume_names_the_steps_lost_only_when_some_are(tmp_path, caplog):
    """A bad newest checkpoint on one rank: the warning names it and the steps lost; a bad
    older one only: the newest step loads and no step is said lost."""
    run = _two_ranks_at_steps_2_and_4(tmp_path)
    (tmp_path / "ckpt" / "rank_1" / "step_000002.ckpt").write_bytes(b"y" * 64)
    with caplog.at_level("WARNING"):
        assert ck.newest_common_step(run, [0, 1])[1]["step"] == 4
    assert "older checkpoints cannot be trusted" in caplog.text and "lost" not in caplog.text
    caplog.clear()
    (tmp_path / "ckpt" / "rank_0" / "step_000004.ckpt").write_bytes(b"z" * 64)
    with pytest.raises(ValueError, match="no step of .* has a verified checkpoint on every"):
        ck.newest_common_step(run, [0, 1])
    (tmp_path / "ckpt" / "rank_1" / "step_000002.ckpt").write_bytes(b"x" * 64)   # repaired
    with caplog.at_level("WARNING"):
        assert ck.newest_common_step(run, [0, 1])[0]["step"] == 2
    assert ("step_000004.ckpt (step 4, rank 0) does not match its recorded SHA-256"
            in caplog.text and "steps 3-4 are lost" in caplog.text)
