"""scripts/compare_checkpoints.py on tiny synthetic run folders: expert-parallel slot rows read
back as logical experts through the plan in state.json, hand-computed differences."""
import json
from pathlib import Path

import numpy as np
import pytest

import mindspore as ms
from mindspore import Tensor

from scripts.compare_checkpoints import main

W1 = "blocks.0.ffn.w1"
M1 = "adam_m." + W1


def _save(path, tensors):
    path.parent.mkdir(parents=True, exist_ok=True)
    ms.save_checkpoint([{"name": n, "data": Tensor(np.asarray(v, np.float32))}
                        for n, v in tensors.items()], str(path))


@pytest.fixture
def runs(tmp_path):
    """One process: experts 0, 1 hold 1.0, 2.0, moments 0.5 each. Two ranks, experts swapped
    (expert 1 on rank 0, expert 0 on rank 1, a spare zero row each): the same weights, expert
    0's moment 0.8 (0.3 off: relative L2 0.3 / sqrt(0.5^2 + 0.5^2) = 0.4243)."""
    one = tmp_path / "one"
    _save(one / "ckpt" / "step_000002.ckpt",
          {W1: [[[1.0]], [[2.0]]], "embed.w": [3.0, 4.0], M1: [[[0.5]], [[0.5]]]})
    (one / "state.json").write_text(json.dumps({"step": 2}))
    ep = tmp_path / "ep"
    for rank, (w, m) in enumerate(((2.0, 0.5), (1.0, 0.8))):
        _save(ep / "ckpt" / f"rank_{rank}" / "step_000002.ckpt",
              {W1: [[[w]], [[0.0]]], "embed.w": [3.0, 4.0], M1: [[[m]], [[0.0]]],
               "blocks.0.ffn.plan_expert_V": [rank, 9, 9, 9]})
    plan = {"slot_expert": [1, 0], "slot_device": [0, 1]}
    (ep / "state.json").write_text(json.dumps({"step": 2, "world_size": 2, "plans": [plan]}))
    (ep / "metrics.jsonl").write_text(json.dumps({"kind": "replan", "step": 1}) + "\n")
    return str(ep), str(one)


def test_expert_rows_are_compared_as_logical_experts_with_hand_computed_differences(
        runs, tmp_path, capsys):
    out = tmp_path / "cmp.json"
    assert main([*runs, "--step", "2", "--json", str(out)]) == 0
    groups = {g["group"]: g for g in json.loads(out.read_text())["groups"]}
    assert (groups["weights"]["tensors"], groups["weights"]["identical"]) == (2, 2)
    assert groups["weights"]["rel_l2"] == 0.0
    m = groups["adam_m"]
    assert (m["tensors"], m["identical"], m["max_abs_at"]) == (1, 0, M1)
    assert m["rel_l2"] == pytest.approx(0.3 / np.sqrt(0.5), rel=1e-6)
    assert m["max_abs"] == pytest.approx(0.3, rel=1e-6)
    assert "4.24e-01" in capsys.readouterr().out


def test_ranks_that_disagree_are_listed_and_steps_before_a_replan_refused(runs, capsys):
    ep, one = runs
    _save(Path(ep) / "ckpt" / "rank_1" / "step_000002.ckpt",
          {W1: [[[1.0]], [[0.0]]], "embed.w": [3.0, 5.0], M1: [[[0.5]], [[0.0]]]})
    assert main([ep, one, "--step", "2"]) == 0
    assert "inconsistent in A: embed.w: rank 1 differs from rank 0" in capsys.readouterr().out
    with open(f"{ep}/metrics.jsonl", "a") as fh:
        fh.write(json.dumps({"kind": "replan", "step": 3}) + "\n")
    assert main([ep, one, "--step", "2"]) == 2
    assert "re-planned at step 3 after step 2" in capsys.readouterr().err
    assert main([ep, one, "--step", "4"]) == 2
    assert "step_000004.ckpt' does not exist" in capsys.readouterr().err
