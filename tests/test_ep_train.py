"""Expert-parallel training (``ms-efficient train --workers W``, balanced layers): the
launcher's checks, the run folder's guarantees on every rank, and (slow) 2 msrun workers with
dropout: loss per step equal to the one-process run on the same global batch, the slow level's
forced re-plan without recompiling, and ``--resume`` after kill -9 (during a save) continuing
with the same losses. tests/test_ep_balanced_train.py checks the balanced runs with gated and
shared experts on 2 and 4 workers.
"""
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml

import workers
from conftest import tiny_config_dict, write_corpus
from ms_efficient.cli import main
from ms_efficient.efficientmoe.ep_replanner import slot_budget
from ms_efficient.train.checkpoint import file_sha256
from workers import MSRUN, needs_msrun

STEPS = 20          # steps compared with the one-process run
REPLAN_AT = 6       # efficientmoe.force_replan_step
KILL_AFTER = 10     # the interrupted run is killed once its state.json reaches this step
# A copy of the killed run resumed leg by leg: (how, workers, the step the leg trains to).
# "ep_worker" is the expert-parallel worker alone (W = 1, no msrun: the run stays
# expert-parallel, so the next leg can grow it to 2 again); the last leg is the one-process
# trainer (`train --resume --workers 1`), whose rows are the whole global batch.
RESIZE_LEGS = (("msrun", 4, 12), ("ep_worker", 1, 14), ("msrun", 2, 16), ("one_process", 1, STEPS))


def _config(tmp_path, text_dir, **sections):
    cfg = tiny_config_dict(text_dir, str(tmp_path / "run"))
    cfg["moe"].update(trace_ranks=1, dispatch="balanced")     # an expert-parallel config
    cfg["train"].update(steps=STEPS, log_every=1, eval_every=10, save_every=5)
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    path = tmp_path / "ep.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _rows(run_dir, kind):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [r for r in map(json.loads, fh) if r["kind"] == kind]


def _losses(run_dir):
    """{step: (loss, ce)} of the train rows."""
    return {r["step"]: (r["loss"], r["ce"]) for r in _rows(run_dir, "train")}


# --- plans and checks (no MindSpore run) -----------------------------------------------------


def test_slot_budget_defaults_to_one_spare_slot_and_rejects_too_few():
    assert slot_budget(4, 2) == 3
    assert slot_budget(4, 2, 5) == 5
    with pytest.raises(ValueError, match=r"'moe.slots_per_device' \(1\) must be >= "):
        slot_budget(4, 2, 1)


def test_workers_must_divide_the_batch(tmp_path, text_dir, capsys):
    config = _config(tmp_path, text_dir)
    assert main(["train", config, "--workers", "3", "--out", str(tmp_path / "x")]) == 2
    assert ("'train.batch_size' (4) must be divisible by --workers (3)."
            in capsys.readouterr().err)


@pytest.mark.parametrize("dispatch", ["static", "grouped"])
def test_an_expert_parallel_run_of_a_one_process_dispatch_is_refused_naming_the_field(
        tmp_path, text_dir, capsys, dispatch):
    """``moe.dispatch`` static (per-expert capacities) and grouped are one-process
    dispatches: the launcher says so before starting msrun, and writes nothing."""
    config = _config(tmp_path, text_dir, moe={"dispatch": dispatch})
    assert main(["train", config, "--workers", "2", "--out", str(tmp_path / "x")]) == 2
    assert ("'moe.dispatch' must be 'balanced' for an expert-parallel run (train --workers W: "
            "EfficientMoE's two levels over the ranks); 'static' and 'grouped' are one-process "
            f"dispatches, but got '{dispatch}'." in capsys.readouterr().err)
    assert not (tmp_path / "x").exists()


def test_resume_of_a_state_without_plans_on_other_workers_is_refused(tmp_path, capsys):
    """Only an expert-parallel run (expert plans in state.json) can change its world size
    (tests/test_ep_resize.py)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "state.json").write_text(json.dumps({"step": 5, "world_size": 2}))
    assert main(["train", "--resume", str(run), "--workers", "4"]) == 2
    assert "has no expert 'plans'), but --workers is 4" in capsys.readouterr().err


# --- one rank in process ---------------------------------------------------------------------


_RUNS = ("import sys\n"
         "from ms_efficient.core.config import load_config\n"
         "from ms_efficient.train.ep_worker import worker_main\n"
         "from ms_efficient.train.trainer import Trainer\n"
         "for config, out, how in zip(*[iter(sys.argv[1:])] * 3):\n"
         "    if how == 'one':\n"
         "        Trainer(load_config(config, {'moe.dispatch': 'grouped'}), out).run()\n"
         "        continue\n"
         "    if how == 'overwrite':\n"
         "        try:\n"
         "            worker_main([config, '--out', out])\n"
         "            sys.exit('a new run into an old run\\'s folder was not refused')\n"
         "        except ValueError as err:\n"
         "            print('REFUSED:', err)\n"
         "    if worker_main([config, '--out', out] + (['--overwrite'] if how == 'overwrite'\n"
         "                                            else [])) != 0:\n"
         "        sys.exit(1)\n")


def _old_run(folder):
    """An earlier 2-rank run's files in ``folder`` (step 40), and a file of the user's."""
    for rank in range(2):
        (folder / "ckpt" / f"rank_{rank}").mkdir(parents=True)
        (folder / "ckpt" / f"rank_{rank}" / "step_000040.ckpt").write_bytes(b"old run")
    (folder / "state.json").write_text(json.dumps({"step": 40, "world_size": 2, "plans": []}))
    (folder / "metrics.jsonl").write_text("")
    (folder / "notes.txt").write_text("mine")


def one_rank_runs(prefix, dispatches, overwrite=None):
    """The one-process trainer with grouped (dropless) experts (``moe.dispatch`` grouped)
    and the W = 1 expert-parallel
    worker (``worker_main``, no msrun) with each of ``dispatches``, 4 steps of one config on
    the same corpus, one after another in one child process (one MindSpore start-up for all;
    the background thread runs it while the main thread runs other tests:
    tests/workers.py); ({"one" or dispatch: run folder}, the child's stdout). The run of
    dispatch ``overwrite`` goes into a folder that holds an older run (``_old_run``): first
    without ``--overwrite`` (refused: the child prints ``REFUSED: <message>``), then
    with it."""
    tmp = workers.temporary_dir(prefix)
    corpus = write_corpus(tmp / "corpus")
    runs, args = {}, []
    for name in ("one", *dispatches):
        folder = tmp / name
        folder.mkdir()
        sections = {} if name == "one" else {"moe": {"dispatch": name}}
        config = _config(folder, corpus, train={"steps": 4, "save_every": 4}, **sections)
        runs[name] = folder / "run"
        how = "one" if name == "one" else "overwrite" if name == overwrite else "ep"
        if how == "overwrite":
            _old_run(runs[name])
        args += [config, runs[name], how]
    proc = subprocess.run([sys.executable, "-c", _RUNS, *map(str, args)], env=_cli_env(),
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return runs, proc.stdout


@workers.in_background("one_rank_ep_runs")
def _one_rank_ep_runs():
    """The one-process run and the W = 1 balanced run the tests compare with it
    (tests/test_ep_balanced_train.py), the latter into an old run's folder."""
    return one_rank_runs("one_rank_ep_", ("balanced",), overwrite="balanced")


@pytest.mark.mindspore
def test_a_rank_refuses_an_old_runs_folder_and_overwrite_replaces_only_its_files(
        one_rank_ep_runs):
    """The worker itself (msrun started directly, no launcher): a new run into a folder
    holding an older 2-rank run is refused before any step; with ``--overwrite`` the old
    run's files go (its step-40 checkpoints, its rank-1 folder) and the user's stay."""
    runs, stdout = one_rank_ep_runs
    folder = runs["balanced"]
    assert (f"REFUSED: run folder '{folder}' already holds a run (state.json); pass --resume "
            f"{folder} to continue it, --overwrite to replace it") in stdout
    assert (folder / "notes.txt").read_text() == "mine"
    assert not (folder / "ckpt" / "rank_1").exists()
    assert sorted(os.listdir(folder / "ckpt" / "rank_0")) == [
        "run.lock", "state.json", "step_000004.ckpt"]
    assert json.loads((folder / "state.json").read_text())["step"] == 4


def test_a_new_expert_parallel_run_into_an_old_runs_folder_is_refused_untouched(
        tmp_path, text_dir, capsys):
    """The launcher refuses before msrun starts, and changes no file of the old run."""
    config = _config(tmp_path, text_dir)
    old = tmp_path / "old"
    _old_run(old)
    files = lambda: {p: p.read_bytes() for p in old.rglob("*") if p.is_file()}  # noqa: E731
    before = files()
    assert main(["train", config, "--workers", "2", "--out", str(old)]) == 2
    assert (f"run folder '{old}' already holds a run (state.json); pass --resume {old} to "
            f"continue it, --overwrite to replace it") in capsys.readouterr().err
    after = files()
    assert after.pop(old / "run.lock") == str(os.getpid()).encode() + b"\n"   # the launcher's
    assert after == before
    assert sorted(os.listdir(old)) == ["ckpt", "metrics.jsonl", "notes.txt", "run.lock",
                                       "state.json"]


def test_an_expert_parallel_run_into_a_folder_in_use_is_refused_with_the_holders_pid(
        tmp_path, text_dir, capsys):
    config = _config(tmp_path, text_dir)
    out = tmp_path / "busy"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom ms_efficient.train.checkpoint import "
         "acquire_lock\nacquire_lock(sys.argv[1])\nprint('locked', flush=True)\n"
         "time.sleep(60)\n", str(out)], stdout=subprocess.PIPE, text=True, env=_cli_env())
    try:
        assert holder.stdout.readline().strip() == "locked"
        for extra in ([], ["--overwrite"]):
            assert main(["train", config, "--workers", "2", "--out", str(out)] + extra) == 2
            assert (f"run folder '{out}' is in use by process {holder.pid}"
                    in capsys.readouterr().err)
    finally:
        holder.kill()
        holder.wait()


def test_worker_command_passes_overwrite_to_the_ranks():
    from ms_efficient.train.ep_launch import worker_command

    cmd = worker_command("c.yaml", "out", 5, None, None, overwrite=True)
    assert cmd[1:] == [os.path.abspath("c.yaml"), "--out", os.path.abspath("out"),
                       "--overwrite", "--steps", "5"]
    assert "--overwrite" not in worker_command("c.yaml", "out", None, None, None)


# --- 2 msrun workers -------------------------------------------------------------------------


def _cli_env():
    """This environment with the repository first on PYTHONPATH (for ``python -m``)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    env.get("PYTHONPATH")] if p)
    return env


_RUN = {}           # the 2-worker runs' folder and config, made by the first that needs them


def _two_workers_config():
    """(folder, config) of the 2-worker runs below: one config for the session, written by
    the first background function that needs it (both run in the one background thread)."""
    if not _RUN:
        tmp = workers.temporary_dir("ep_train_")
        _RUN.update(tmp=tmp, config=_config(
            tmp, write_corpus(tmp / "corpus"),
            # dropout 0.1: its masks are a function of (seed, step, block, site, GLOBAL
            # sample, position, channel) with no random state (ms_efficient/models/
            # dropout.py), so every size, and one process, draws the masks of this run; every
            # step in the learning-rate warm-up, whose rate does not depend on train.steps,
            # so the resized legs stopped by --steps (test_ep_resize) train on this schedule
            model={"dropout": 0.1}, train={"warmup_steps": STEPS},
            efficientmoe={"enabled": True, "warmup_steps": 4, "replan_every": 4, "window": 4,
                          "force_replan_step": REPLAN_AT},
            # the README's cluster (cpu-local, 2 devices): copies of the killed run resume on
            # 4 workers, where it grows to 4 (ExpertParallelTrainer._cluster)
            cluster={"preset": "cpu-local"}))
    return _RUN["tmp"], _RUN["config"]


@workers.in_background("two_workers")
def _two_workers_run():
    """The 2-worker run of ``two_workers`` (``ms-efficient train --workers 2`` in a child
    process, from the session's start: tests/workers.py): (config, run folder, seconds)."""
    if MSRUN is None:
        return None
    tmp, config = _two_workers_config()
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "ms_efficient.cli", "train", config,
                           "--workers", "2", "--out", str(tmp / "ep")], env=_cli_env(),
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return config, tmp / "ep", time.perf_counter() - start


@workers.in_background("two_workers_killed")
def _two_workers_killed_run():
    """The same config on 2 workers killed with SIGKILL (msrun, its scheduler and both
    ranks) while rank 1 writes the checkpoint after step KILL_AFTER's, then ``train
    --resume`` of it (the run continued at 2), a copy of the killed run exported, and a
    copy resumed leg by leg per RESIZE_LEGS (tests/test_ep_resize.py: the killed run is
    their 2-worker base); all in child processes, in the background (tests/workers.py).
    Returns {"part": the killed run resumed, "reached": the step state.json named when the
    kill was sent, "half_written": the temporaries rank 1 left, "resumed": the resume's
    CompletedProcess, "base_state": the killed run's state.json, "export": model.ckpt of the
    killed run, "chain": the resized copy, "legs": [per leg: {"how", "workers", "step",
    "state": state.json after it, "seconds"}], "seconds": the resume at 2}."""
    if MSRUN is None:
        return None
    tmp, config = _two_workers_config()
    part = tmp / "part"
    # The kill lands while rank 1 writes step KILL_AFTER + 5's checkpoint (a hook that
    # writes half of it, then waits to be killed), so state.json names KILL_AFTER, rank 0
    # may have written and recorded the later step, and rank 1 leaves a temporary.
    hook = tmp / "kill_hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_KILL_DURING_SAVE)
    marker = tmp / "rank1_half_written"
    env = _cli_env()
    env.update(PYTHONPATH=os.pathsep.join([str(hook), env["PYTHONPATH"]]),
               EP_KILL_SAVE_STEP=str(KILL_AFTER + 5), EP_KILL_MARKER=str(marker))
    reached = workers.run_and_kill(
        [sys.executable, "-m", "ms_efficient.cli", "train", config, "--workers", "2",
         "--out", part], part / "state.json", KILL_AFTER, poll_s=0.02, env=env, marker=marker)
    base_state = json.loads((part / "state.json").read_text())
    half_written = sorted(n for n in os.listdir(part / "ckpt" / "rank_1") if n.startswith(".tmp"))
    chain = tmp / "chain"                  # before the resume below changes the folder
    shutil.copytree(part, chain, ignore=shutil.ignore_patterns("msrun_log"))
    export = tmp / "model.ckpt"
    done = workers.run_cli(["checkpoint", "export", chain, "--out", export], env=_cli_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    start = time.perf_counter()
    resumed = workers.run_cli(["train", "--resume", part], env=_cli_env())
    seconds = time.perf_counter() - start
    legs = []
    for how, n, steps in RESIZE_LEGS:
        start = time.perf_counter()
        if how == "ep_worker":
            done = subprocess.run([sys.executable, "-m", "ms_efficient.train.ep_worker",
                                   "--resume", str(chain), "--steps", str(steps)],
                                  env=_cli_env(), capture_output=True, text=True)
        else:
            done = workers.run_cli(["train", "--resume", chain, "--workers", n, "--steps",
                                    steps], env=_cli_env())
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        legs.append({"how": how, "workers": n, "step": steps,
                     "state": json.loads((chain / "state.json").read_text()),
                     "seconds": round(time.perf_counter() - start, 1)})
    return {"part": part, "reached": reached, "resumed": resumed, "base_state": base_state,
            "chain": chain, "legs": legs, "export": export, "seconds": seconds,
            "half_written": half_written}


# sitecustomize of the killed run's processes: on rank 1 (msrun's MS_NODE_ID), the save of
# step EP_KILL_SAVE_STEP writes 64 KiB of its checkpoint, creates EP_KILL_MARKER and waits
# for the test's watcher to SIGKILL the job (tests/workers.py, run_and_kill)
_KILL_DURING_SAVE = """
import os
if os.environ.get("MS_NODE_ID") == "1" and os.environ.get("EP_KILL_SAVE_STEP"):
    import time
    from ms_efficient.train import checkpoint as _ck
    _save = _ck.save_checkpoint

    def _half_then_wait(path):
        with open(path, "wb") as fh:
            fh.write(b"\\0" * (1 << 16))
        open(os.environ["EP_KILL_MARKER"], "w").close()
        time.sleep(600)

    def _patched(run_dir, step, write_fn, rank=None):
        if step == int(os.environ["EP_KILL_SAVE_STEP"]):
            write_fn = _half_then_wait
        return _save(run_dir, step, write_fn, rank)

    _ck.save_checkpoint = _patched
"""


_REFERENCES = {}     # what the one-process trainer computes -> (its run folder, seconds)


def one_process_run(config, overrides, folder):
    """(run folder, seconds) of the one-process trainer on ``config`` with ``overrides``, run
    into ``folder``, or of an earlier run in this session that computes the same: the same
    resolved config but for where it writes and which corpus folder it reads (the same files,
    names and bytes), and but for an EfficientMoE section the run leaves off (the one-process
    trainer reads none of it then, nor the cluster, which only its planner prices with). The
    reference of the 2-worker runs here and of the balanced ones
    (tests/test_ep_balanced_train.py): one 20-step run for both."""
    from ms_efficient.core.config import load_config
    from ms_efficient.train.trainer import Trainer

    cfg = load_config(config, overrides)
    what = cfg.to_dict()
    what["train"].pop("out_dir")
    what["data"]["path"] = _digest(what["data"]["path"])
    if not cfg.efficientmoe.enabled:     # no planner: the trainer reads neither section
        what.pop("efficientmoe")
        what.pop("cluster")
    key = json.dumps(what, sort_keys=True)
    if key not in _REFERENCES:
        start = time.perf_counter()
        Trainer(cfg, str(folder)).run()
        _REFERENCES[key] = (folder, time.perf_counter() - start)
    return _REFERENCES[key]


def _digest(folder):
    """sha256 of the relative names and bytes of every file under ``folder``."""
    import hashlib

    h = hashlib.sha256()
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            h.update(os.path.relpath(path, folder).encode() + b"\0")
            with open(path, "rb") as fh:
                h.update(fh.read())
    return h.hexdigest()


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    """One uninterrupted 2-worker run with EfficientMoE (a re-plan forced at step 6) and the
    one-process run of the same config (EfficientMoE off: nothing to plan on one device
    with grouped experts); returns (config, ep run, one-process run, seconds of each)."""
    if MSRUN is None:
        pytest.skip("msrun is not on PATH")
    config, ep, ep_s = workers.background_result("two_workers")
    one, one_s = one_process_run(config, {"moe.dispatch": "grouped",
                                          "efficientmoe.enabled": False},
                                 tmp_path_factory.mktemp("ep_train") / "one")
    return config, ep, one, (ep_s, one_s)


@pytest.fixture(scope="module")
def two_workers_killed():
    """The killed 2-worker run, its resume and its resized copy
    (``_two_workers_killed_run``)."""
    if MSRUN is None:
        pytest.skip("msrun is not on PATH")
    return workers.background_result("two_workers_killed")


@pytest.mark.slow
@needs_msrun
def test_two_workers_match_the_one_process_loss_per_step(two_workers):
    """Loss and cross-entropy per step within 1e-3 relative for 20 steps, re-plans included;
    the load-balancing term (loss - ce) is that of all ranks' tokens (GlobalRouterAux), so it
    agrees too (to 1e-4 absolute, against ~1e-2 for the term itself)."""
    config, ep, one, seconds = two_workers
    a, b = _losses(ep), _losses(one)
    assert sorted(a) == list(range(1, STEPS + 1)) and sorted(b) == sorted(a)
    for step in a:
        np.testing.assert_allclose(a[step], b[step], rtol=1e-3, err_msg=f"step {step}")
    aux_gap = max(abs((a[s][0] - a[s][1]) - (b[s][0] - b[s][1])) for s in a)
    assert aux_gap <= 1e-4
    worst = max(abs(a[s][0] - b[s][0]) / b[s][0] for s in a)
    print(f"\n2 workers vs 1 process: worst relative loss gap {worst:.2e} over {STEPS} steps, "
          f"aux term gap {aux_gap:.2e}; runs took {seconds[0]:.0f} s and {seconds[1]:.0f} s")
    vals = {r["step"]: r["val_loss"] for r in _rows(ep, "val")}
    for r in _rows(one, "val"):
        assert vals[r["step"]] == pytest.approx(r["val_loss"], rel=1e-3)


@pytest.mark.slow
@needs_msrun
def test_two_workers_replan_without_recompiling_and_save_every_rank(two_workers):
    config, ep, _, _ = two_workers
    replans = _rows(ep, "replan")
    assert replans and replans[0]["step"] == REPLAN_AT and all(r["step"] <= 60 for r in replans)
    cfg = yaml.safe_load(open(config))
    h, f = cfg["model"]["hidden_size"], cfg["model"]["ffn_hidden_size"]
    e = cfg["moe"]["num_experts"]
    table = cfg["model"]["num_layers"] * e * (2 * h * f + f + h) * 4      # float32, all layers
    for r in replans:
        assert r["recompiled"] is False
        assert 0 <= r["moved_bytes"] < table
        # bytes cross ranks only for slots that moved (a local copy is free), and Adam's two
        # moments travel with every weight row
        assert r["moved_bytes"] == 0 or r["moved_slots"] > 0
        assert r["state_bytes"] == 2 * r["moved_bytes"]
    assert replans[0]["moved_slots"] >= 1
    state = json.loads((ep / "state.json").read_text())
    assert state["world_size"] == 2 and state["step"] == STEPS
    for rank in range(2):
        assert (ep / state["checkpoint"].format(rank=rank)).is_file()
        # the launcher ran the CPU ranks with MindSpore's graph pipeline off (core.backend.
        # runtime_conf): MindSpore prints the runtime config it parsed into the rank's log
        log = (ep / "msrun_log" / f"worker_{rank}.log").read_text(errors="replace")
        assert "[MS_DEV_RUNTIME_CONF] config:  graph_pipeline:False" in log
    from ms_efficient.moe.trace import load_trace

    trace = load_trace(str(ep / "trace.npz"))
    assert trace.counts.shape == (STEPS, 2, 2, e)          # step, layer, rank, expert
    assert np.all(trace.counts.sum(axis=3) == 2 * 32 * 2)  # 2 rows x 32 tokens x top-2
    # every log line: the rows each device computed, which with the drops are every routed row
    for r in _rows(ep, "train"):
        for b in r["balance"]:
            assert len(b["rows_per_device"]) == 2
            assert sum(b["rows_per_device"]) + b["dropped"] == 2 * 2 * 32 * 2
            assert b["device_max_over_mean"] >= 1.0 and b["device_cv"] >= 0.0


@pytest.mark.slow
@needs_msrun
def test_resume_after_kill_9_continues_with_the_same_losses(two_workers, two_workers_killed):
    config, ep, _, _ = two_workers
    killed = two_workers_killed
    part, reached, resumed = killed["part"], killed["reached"], killed["resumed"]
    state_path = part / "state.json"
    # killed while rank 1 wrote step KILL_AFTER + 5: the shared state names KILL_AFTER, and
    # the resume started there, every rank's checkpoint of it verified, the temporary gone
    assert reached == KILL_AFTER and killed["base_state"]["step"] == KILL_AFTER
    assert len(killed["half_written"]) == 1, killed["half_written"]
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    for rank in range(2):
        folder = part / "ckpt" / f"rank_{rank}"
        assert not [n for n in os.listdir(folder) if n.startswith(".tmp")]
        records = json.loads((folder / "state.json").read_text())["checkpoints"]
        assert [r["step"] for r in records] == [STEPS - 5, STEPS]
        # the files of the kept records; a kill landing on rank 0 between writing its state
        # (steps 10, 15) and deleting step 5's file leaves that file, which no state lists
        # and pruning never touches (checkpoint.commit_state): the only other file allowed
        kept = {f"step_{STEPS - 5:06d}.ckpt", f"step_{STEPS:06d}.ckpt"}
        files = {n for n in os.listdir(folder) if n.endswith(".ckpt")}
        assert kept <= files and files - kept <= {f"step_{KILL_AFTER - 5:06d}.ckpt"}, \
            (rank, records, sorted(files))
        for r in records:
            assert r["sha256"] == file_sha256(str(part / r["path"]))
    a, b = _losses(ep), _losses(part)
    # up to the kill the two runs are the same config run twice, the re-plan at REPLAN_AT
    # included: every logged loss is bit-identical
    assert REPLAN_AT < KILL_AFTER and all(b[s] == a[s] for s in range(1, reached + 1))
    assert [r["step"] for r in _rows(part, "replan")][:1] == [REPLAN_AT]
    a, b = _losses(ep), _losses(part)
    assert sorted(b) == list(range(1, STEPS + 1))
    for step in range(reached + 1, STEPS + 1):
        np.testing.assert_allclose(b[step], a[step], rtol=0, atol=2e-5, err_msg=f"step {step}")
    assert [(r["step"], r["moved_slots"]) for r in _rows(part, "replan")] == \
        [(r["step"], r["moved_slots"]) for r in _rows(ep, "replan")]
    assert json.loads(state_path.read_text())["plans"] == \
        json.loads((ep / "state.json").read_text())["plans"]
