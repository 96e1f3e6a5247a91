"""``train --workers W`` with ``moe.dispatch: balanced`` (BalancedExpertParallelMoE,
the fast level every step): one rank in process against the one-process trainer, and (slow)
2 and 4 msrun workers with the experts of current MoE models (SwiGLU experts and a shared
expert): loss per step equal to the one-process run with copies made and the home experts
re-placed once (the slow level, forced at step 16), the fast level's figures on every log
line, receive buffers that never change."""
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

import workers
from conftest import write_corpus
from test_ep_train import (MSRUN, _cli_env, _config, _losses, _rows, needs_msrun,
                           one_process_run)

STEPS = 20
# bytes of one gated expert (float32): w1 [H, 2F] + b1 [2F] + w2 [F, H] + b2 [H], H 32, F 64;
# a copy's rows of H hold exactly these (6304 = 197 x 32)
EXPERT_BYTES = 4 * (32 * 2 * 64 + 2 * 64 + 64 * 32 + 32)
REPLAN_STEP = 16          # the slow level re-places the home experts after this step
RESUME_STEP = 15          # a copy of the 2-worker run resumes from its checkpoint of this step
                          # (its rank-1 checkpoint of step 20 garbled)


def test_one_rank_balanced_run_equals_the_one_process_trainer(one_rank_ep_runs):
    """W = 1 with dispatch balanced against the one-process trainer with grouped experts, 4
    steps each in child processes (test_ep_train.one_rank_runs, with the other dispatches'
    W = 1 runs)."""
    one, ep = _losses(one_rank_ep_runs[0]["one"]), _losses(one_rank_ep_runs[0]["balanced"])
    assert sorted(ep) == [1, 2, 3, 4]
    for step in one:
        np.testing.assert_allclose(ep[step], one[step], rtol=1e-5)
    row = _rows(one_rank_ep_runs[0]["balanced"], "train")[-1]
    # one device: every row stays home, no copy, the buffer holds the mean share x 1.5
    assert [b["copies"] for b in row["balance"]] == [0, 0]
    assert row["balance"][0]["rows_per_device"] == [4 * 32 * 2]
    assert row["balance"][0]["buffer_rows"] == [4 * 32 * 2 * 3 // 2]


@workers.in_background("balanced_runs")
def _balanced_runs():
    """The msrun runs of ``balanced_runs`` (child processes, from the session's start:
    tests/workers.py): 2 and 4 workers, and the 2-worker run resumed from its step-15
    checkpoint; (config, {name: folder})."""
    if MSRUN is None:
        return None
    tmp = workers.temporary_dir("ep_balanced_")
    config = _config(tmp, write_corpus(tmp / "corpus"), train={"steps": STEPS},
                     # SwiGLU experts (w1 the fused [gate | up], biases kept) and a
                     # shared expert: what Mixtral / DeepSeek-style models train
                     moe={"dispatch": "balanced", "expert_kind": "glu",
                          "shared_experts": 1},
                     efficientmoe={"enabled": True, "force_replan_step": REPLAN_STEP},
                     # cpu-local grows to the job's ranks (4 workers: 4 devices)
                     cluster={"preset": "cpu-local"})
    runs = {}
    for name in (2, 4):
        runs[name] = tmp / f"ep{name}"
        proc = subprocess.run([sys.executable, "-m", "ms_efficient.cli", "train", config,
                               "--workers", str(name), "--out",
                               str(runs[name])], env=_cli_env(), capture_output=True,
                              text=True)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the 2-worker run resumed from step 15, before the re-plan (steps 16-20, the re-plan and
    # its copies, made again: reproducibility): its copy's rank-1 checkpoint of step 20 is garbled (one byte flipped in the middle, the size kept), so the
    # newest step that verifies on both ranks is 15
    runs["2-resumed"] = tmp / "ep2-resumed"
    shutil.copytree(runs[2], runs["2-resumed"])
    garbled = runs["2-resumed"] / "ckpt" / "rank_1" / f"step_{STEPS:06d}.ckpt"
    data = bytearray(garbled.read_bytes())
    data[len(data) // 2] ^= 0xFF
    garbled.write_bytes(bytes(data))
    proc = subprocess.run([sys.executable, "-m", "ms_efficient.cli", "train", "--workers", "2",
                           "--resume", str(runs["2-resumed"])], env=_cli_env(),
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return config, runs


@pytest.fixture(scope="module")
def balanced_runs(tmp_path_factory):
    """2- and 4-worker balanced runs of one config (the 2-worker one twice) and its
    one-process run (``one_process_run``: that of the 2-worker runs of test_ep_train, which
    computes the same)."""
    if MSRUN is None:
        pytest.skip("msrun is not on PATH")
    config, runs = workers.background_result("balanced_runs")
    one, _ = one_process_run(config, {"moe.dispatch": "grouped", "efficientmoe.enabled": False},
                             tmp_path_factory.mktemp("ep_balanced") / "one")
    return runs, one


@pytest.mark.slow
@needs_msrun
@pytest.mark.parametrize("world", [2, 4])
def test_balanced_workers_match_the_one_process_loss_with_copies(balanced_runs, world):
    runs, one = balanced_runs
    a, b = _losses(runs[world]), _losses(one)
    assert sorted(a) == list(range(1, STEPS + 1)) and sorted(b) == sorted(a)
    for step in a:
        np.testing.assert_allclose(a[step], b[step], rtol=1e-3, err_msg=f"step {step}")
    rows = _rows(runs[world], "train")
    copies = sum(b["copies"] for r in rows for b in r["balance"])
    assert copies > 0                                       # the fast level copied experts
    first = [b["buffer_rows"] for b in rows[0]["balance"]]
    for r in rows:
        assert [b["buffer_rows"] for b in r["balance"]] == first       # fixed shapes
        for b in r["balance"]:
            assert len(b["rows_per_device"]) == world and b["dropped"] == 0
            assert b["weight_bytes"] == b["copies"] * EXPERT_BYTES
            assert max(b["rows_per_device"]) <= b["buffer_rows"][0]
    state = json.loads((runs[world] / "state.json").read_text())
    assert state["world_size"] == world
    # the slow level's forced re-plan moved home experts (weights and Adam moments) between
    # steps 6 and 7 without recompiling, and the losses above still equal one process
    (check,) = _rows(runs[world], "replan_check")          # the only check: forced
    assert check["step"] == REPLAN_STEP and check["adopted"] is True
    (replan,) = _rows(runs[world], "replan")
    assert replan["step"] == REPLAN_STEP and replan["what"] == "home experts"
    assert replan["recompiled"] is False and replan["moved_slots"] > 0
    assert replan["moved_bytes"] % EXPERT_BYTES == 0 and replan["moved_bytes"] > 0
    assert replan["state_bytes"] == 2 * replan["moved_bytes"]
    homes = [np.array(p["slot_expert"]) for p in state["plans"]]
    assert all(sorted(set(h.tolist())) == list(range(4)) for h in homes)     # 4 experts
    # the ranks trained gated experts (w1: gate | up, 2F wide) and a data-parallel shared
    # expert, under the one-process model's names
    import mindspore as ms

    last = sorted((runs[world] / "ckpt" / "rank_0").glob("step_*.ckpt"))[-1]
    params = ms.load_checkpoint(str(last))
    assert tuple(params["blocks.0.ffn.w1"].shape[1:]) == (32, 2 * 64)
    assert tuple(params["blocks.0.ffn.shared.gate_proj.weight"].shape) == (64, 32)
    # the export (the one-process model's checkpoint) keeps the shared expert as trained
    from ms_efficient.train.logical_state import export_checkpoint

    out = str(runs[world] / "export.ckpt")
    export_checkpoint(str(runs[world]), out)
    exported = ms.load_checkpoint(out)
    for name in ("blocks.0.ffn.shared.gate_proj.weight", "blocks.1.ffn.shared.down_proj.weight"):
        np.testing.assert_array_equal(exported[name].asnumpy(), params[name].asnumpy())
    assert tuple(exported["blocks.0.ffn.w1"].shape) == (4, 32, 2 * 64)          # E, H, 2F


@pytest.mark.slow
@needs_msrun
def test_a_balanced_run_resumed_before_its_replan_is_bit_identical(balanced_runs):
    """The 2-worker run resumed from its step-15 checkpoint because rank 1's of step 20 is
    garbled: steps 16-20 (per-step copies, the home re-plan at step 16) made again give every
    logged loss and every rank's final checkpoint (weights and Adam moments) bit for bit,
    and the resumed run said which steps it lost."""
    import mindspore as ms

    runs, _ = balanced_runs
    a, b = runs[2], runs["2-resumed"]
    assert _losses(a) == _losses(b) and len(_losses(b)) == STEPS
    remade = _rows(b, "replan")[-1]                # the re-plan the resumed run made again
    assert remade["step"] == REPLAN_STEP
    assert remade["moved_slots"] == _rows(a, "replan")[0]["moved_slots"]
    for rank in range(2):
        log = (b / "msrun_log" / f"worker_{rank}.log").read_text(errors="replace")
        assert (f"rank_1/step_{STEPS:06d}.ckpt (step {STEPS}, rank 1) does not match its "
                f"recorded SHA-256 (corrupted)") in log
        assert (f"resuming from step {RESUME_STEP}, the newest with a verified checkpoint"
                in log and f"steps {RESUME_STEP + 1}-{STEPS} are lost" in log)
    for rank in range(2):
        (ckpt_a,) = sorted((a / "ckpt" / f"rank_{rank}").glob("step_*.ckpt"))[-1:]
        ckpt_b = b / "ckpt" / f"rank_{rank}" / ckpt_a.name
        pa, pb = ms.load_checkpoint(str(ckpt_a)), ms.load_checkpoint(str(ckpt_b))
        assert sorted(pa) == sorted(pb)
        for name in pa:
            assert np.array_equal(pa[name].asnumpy(), pb[name].asnumpy()), (rank, name)


def test_a_one_process_run_of_a_balanced_config_runs_grouped_experts_and_says_so(
        tmp_path, text_dir, caplog):
    """One process has one device and no exchange: a moe.dispatch balanced config runs
    there as dropless grouped experts (logged); with efficientmoe.enabled it is refused,
    naming the field (one device has no placement to change), whatever its dispatch."""
    import logging

    from ms_efficient.core.config import load_config
    from ms_efficient.train.trainer import Trainer

    config = _config(tmp_path, text_dir, moe={"dispatch": "balanced"},
                     efficientmoe={"enabled": True})
    with pytest.raises(ValueError, match=r"'efficientmoe.enabled' must be false for a "
                                         r"one-process run \(EfficientMoE places experts"):
        Trainer(load_config(config), str(tmp_path / "one"))
    with caplog.at_level(logging.INFO, logger="ms_efficient"):
        trainer = Trainer(load_config(config, {"efficientmoe.enabled": False}),
                          str(tmp_path / "one"))
    assert [layer.dispatch for layer in trainer.moe_layers] == ["grouped", "grouped"]
    assert "moe.dispatch 'balanced' names an expert-parallel exchange" in caplog.text
    plain = _config(tmp_path, text_dir, moe={"dispatch": "static"},
                    efficientmoe={"enabled": True})
    with pytest.raises(ValueError, match=r"'efficientmoe.enabled' must be false"):
        Trainer(load_config(plain), str(tmp_path / "two"))
