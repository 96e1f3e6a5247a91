"""Resuming an expert-parallel run at another world size, and ``checkpoint export``.

Fast: the pure re-layout (:mod:`ms_efficient.train.relayout`) on hand-sized tables, and the
checks of a run folder (bad input: clear error, exit 2, nothing written). Slow (msrun): a
2-worker run with dropout resumed 4 -> 1 -> 2 -> 1 (one process) follows the losses of
continuing at 2, and its exported checkpoint gives the run's validation loss in the
one-process reference model.
"""
import json
import os

import numpy as np
import pytest
import yaml

from conftest import tiny_config_dict
from ms_efficient.cli import main
from ms_efficient.moe.plan import ExpertPlan
from ms_efficient.train.relayout import (gather_experts, home_slots, merge_trace_ranks, relayout,
                                         resumed_counts, scatter_experts)
from test_ep_train import KILL_AFTER, REPLAN_AT, STEPS, two_workers_killed  # noqa: F401
from workers import needs_msrun

# --- the re-layout (numpy) -------------------------------------------------------------------

# 4 experts on 2 ranks, 3 weight rows per rank; expert 3 has a replica on each rank:
#   rank 0 rows: slot 0 = expert 1, slot 1 = expert 3 (home: lowest rank), row 2 empty
#   rank 1 rows: slot 2 = expert 0, slot 3 = expert 2, slot 4 = expert 3 (replica)
OLD = ExpertPlan([1, 3, 0, 2, 3], [0, 0, 1, 1, 1], [8, 8, 8, 8, 8], dispatch="grouped")


def _rank_tables(offset):
    """Rows [S_b = 3, 2] per rank: expert e's row is [offset + e, -(offset + e)] (e.g. its
    weight, or with another offset its Adam moment), the empty row zeros."""
    row = {e: [offset + e, -(offset + e)] for e in range(4)}
    return [np.array([row[1], row[3], [0, 0]], np.float32),
            np.array([row[0], row[2], row[3]], np.float32)]


def test_home_copy_of_a_replicated_expert_is_on_the_lowest_rank():
    assert home_slots(OLD, 4).tolist() == [2, 0, 3, 1]


@pytest.mark.parametrize("offset", [10.0, 0.5])            # weights, then a moment
def test_two_ranks_with_a_replica_relayout_to_one_rank(offset):
    (one,) = relayout(OLD, _rank_tables(offset), ExpertPlan([0, 1, 2, 3], [0] * 4, [8] * 4),
                      new_world=1, new_budget=4, num_experts=4)
    o = offset
    assert one.tolist() == [[o, -o], [o + 1, -o - 1], [o + 2, -o - 2], [o + 3, -o - 3]]


@pytest.mark.parametrize("offset", [10.0, 0.5])
def test_two_ranks_with_a_replica_relayout_to_four_ranks(offset):
    # the new plan permutes the experts and leaves one spare row per rank
    new = ExpertPlan([2, 0, 3, 1], [0, 1, 2, 3], [8] * 4, dispatch="grouped")
    tables = relayout(OLD, _rank_tables(offset), new, new_world=4, new_budget=2, num_experts=4)
    o = offset
    assert [t.tolist() for t in tables] == [[[o + 2, -o - 2], [0, 0]], [[o, -o], [0, 0]],
                                            [[o + 3, -o - 3], [0, 0]], [[o + 1, -o - 1], [0, 0]]]


def test_scatter_puts_replicas_in_every_slot_and_gather_inverts_it():
    logical = np.arange(8, dtype=np.float32).reshape(4, 2)
    new = ExpertPlan([0, 3, 1, 2, 3], [0, 0, 1, 1, 1], [8] * 5)
    rank0, rank1 = (scatter_experts(new, logical, r, 3) for r in range(2))
    assert rank0.tolist() == [[0, 1], [6, 7], [0, 0]]
    assert rank1.tolist() == [[2, 3], [4, 5], [6, 7]]
    np.testing.assert_array_equal(gather_experts(new, [rank0, rank1], 4), logical)


def test_replicas_that_differ_are_refused_naming_the_expert_and_ranks():
    tables = _rank_tables(1.0)
    tables[1][2] += 0.01                                    # the replica of expert 3
    with pytest.raises(ValueError, match=r"replicas of expert 3 differ: slot 4 on rank 1 vs "
                                         r"its home slot 1 on rank 0, max \|difference\| 0.01"):
        gather_experts(OLD, tables, 4, "w1")


def test_inconsistent_plans_are_refused():
    tables = _rank_tables(1.0)
    with pytest.raises(ValueError, match=r"places a slot on rank 1, but the run has "
                                         r"world_size 1"):
        gather_experts(OLD, tables[:1], 4)
    no_expert_2 = ExpertPlan([1, 3, 0, 0, 3], [0, 0, 1, 1, 1], [8] * 5)
    with pytest.raises(ValueError, match=r"must name every expert 0..3"):
        gather_experts(no_expert_2, tables, 4)
    with pytest.raises(ValueError, match=r"puts 3 slots on rank 1, but its checkpoint has 2 "
                                         r"weight rows"):
        gather_experts(OLD, [t[:2] for t in tables], 4)


def test_trace_ranks_merge_exactly_or_not_at_all():
    counts = np.array([[[[1, 2], [3, 4], [5, 6], [7, 8]]]])        # [T=1, L=1, W=4, E=2]
    assert merge_trace_ranks(counts, 2).tolist() == [[[[4, 6], [12, 14]]]]
    assert merge_trace_ranks(counts, 1).tolist() == [[[[16, 20]]]]
    assert merge_trace_ranks(counts[:, :, :2], 4) is None          # a rank cannot be split
    # a trace whose rows are steps 6, 7, 8, resumed at step 7 on 2 ranks
    rows = np.concatenate([counts] * 3)
    kept, start = resumed_counts(rows, np.array([6, 7, 8]), 7, 2)
    assert start == 5 and kept.shape == (2, 1, 2, 2)
    assert resumed_counts(rows, None, 2, 3) == (None, 2)


def test_overwrite_removes_the_traces_a_resize_kept_and_nothing_else(tmp_path):
    from ms_efficient.train.checkpoint import clear_run

    for name in ("trace_world2_step7.npz", "trace_ranks4_step10.npz", "trace_notes.npz",
                 "state.json"):
        (tmp_path / name).write_text("x")
    assert sorted(clear_run(str(tmp_path))) == ["state.json", "trace_ranks4_step10.npz",
                                                "trace_world2_step7.npz"]
    assert os.listdir(tmp_path) == ["trace_notes.npz"]


# --- run folder checks (no msrun) --------------------------------------------------------------


def _fake_run(tmp_path, state):
    """A run folder with a tiny config.yaml and the given state.json."""
    run = tmp_path / "run"
    run.mkdir()
    cfg = tiny_config_dict("stdlib", str(run))
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    (run / "state.json").write_text(json.dumps(state))
    return run


PLAN = {"slot_expert": [0, 1, 2, 3], "slot_device": [0, 0, 1, 1], "slot_capacity": [8] * 4,
        "dispatch": "grouped"}
STATE = {"step": 4, "world_size": 2, "checkpoint": "ckpt/rank_{rank}/step_000004.ckpt",
         "plans": [PLAN, PLAN]}


@pytest.mark.parametrize("change, message", [
    ({"plans": [PLAN]}, "field 'plans' must list one expert plan per MoE layer (2 in "
                        "config.yaml), but got 1"),
    ({"world_size": 1}, "field 'plans'[0] 'slot_device' places a slot on rank 1, but the run "
                        "has world_size 1"),
    ({"world_size": "two"}, "field 'world_size' must be an integer >= 1, but got 'two'"),
    ({"plans": [PLAN, dict(PLAN, slot_expert=[0, 1, 1, 3])]},
     "field 'plans'[1] 'slot_expert' [0, 1, 1, 3] must name every expert 0..3"),
    ({}, "ckpt/rank_0/step_000004.ckpt, ", ),
])
def test_export_refuses_an_inconsistent_run_and_writes_nothing(tmp_path, capsys, change,
                                                               message):
    run = _fake_run(tmp_path, dict(STATE, **change))
    out = tmp_path / "model.ckpt"
    assert main(["checkpoint", "export", str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert not out.exists() and not [n for n in os.listdir(tmp_path) if n.startswith(".tmp")]


def test_export_names_a_missing_rank_checkpoint(tmp_path, capsys):
    run = _fake_run(tmp_path, STATE)
    (run / "ckpt" / "rank_0").mkdir(parents=True)
    (run / "ckpt" / "rank_0" / "step_000004.ckpt").write_bytes(b"x")
    assert main(["checkpoint", "export", str(run), "--out", str(tmp_path / "m.ckpt")]) == 2
    assert (f"{run}/ckpt/rank_1/step_000004.ckpt is missing; every rank's checkpoint of step "
            f"4 is needed") in capsys.readouterr().err


def test_export_refuses_a_folder_without_a_run(tmp_path, capsys):
    assert main(["checkpoint", "export", str(tmp_path), "--out", str(tmp_path / "m.ckpt")]) == 2
    assert "has no state.json: not a run folder" in capsys.readouterr().err
    assert main(["checkpoint", "export", str(tmp_path / "nope"), "--out",
                 str(tmp_path / "m.ckpt")]) == 2
    assert "does not exist or is not a folder" in capsys.readouterr().err
    assert not (tmp_path / "m.ckpt").exists()


# --- export of hand-made rank checkpoints (MindSpore, no msrun) ------------------------------

# layer 0: expert 3 replicated (rank 0 holds experts 1, 3; rank 1 holds 0, 2, 3); layer 1
# plain: rank 0 holds 0, 1 and rank 1 holds 2, 3; three weight rows per rank
HAND_PLANS = [([1, 3, 0, 2, 3], [0, 0, 1, 1, 1]), ([0, 1, 2, 3], [0, 0, 1, 1])]
RANK_EXPERTS = [([1, 3], [0, 2, 3]), ([0, 1], [2, 3])]       # [layer][rank], row order


def _hand_made_run(tmp_path, home_tables=None, replica_gap=0.0):
    """A 2-rank run folder of the tiny model whose checkpoints are written here from random
    logical values: (run folder, {one-process name: value}). Rank r's expert tables hold
    the rows RANK_EXPERTS[layer][r] of the logical ones, then zero rows (its corpus is gone:
    export does not need it); ``home_tables``:
    per layer an int [2, S_h] table written as ``home_table`` (a balanced layer's);
    ``replica_gap`` is added to rank 1's copy of expert 3 in adam_v of layer 0's w1."""
    import mindspore as ms

    from ms_efficient.core.config import load_config
    from ms_efficient.train.logical_state import reference_network

    run = tmp_path / "run"
    (run / "ckpt").mkdir(parents=True)
    cfg = tiny_config_dict(str(tmp_path / "corpus no longer here"), str(run))
    cfg["moe"].update(capacity_factor=0, trace_ranks=1, dispatch="grouped")
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    net, opt = reference_network(load_config(str(run / "config.yaml"),
                                             {"data.path": "stdlib"}))
    rng = np.random.default_rng(3)
    logical = {p.name: rng.standard_normal(p.shape).astype(np.float32)
               for p in opt.get_parameters()
               if p.name != "global_step" and not p.name.endswith("routing_counts")}
    logical["global_step"] = np.array([4], np.int32)
    for rank in range(2):
        values = dict(logical)
        for layer, experts in enumerate(RANK_EXPERTS):
            prefix = f"blocks.{layer}.ffn."
            values[prefix + "plan_expert_V"] = np.arange(6, dtype=np.int32)   # layout table
            if home_tables is not None:
                values[prefix + "home_table"] = np.array(home_tables[layer], np.int32)
            for name in [n for n in logical if n.endswith(tuple(prefix + t for t in
                                                                ("w1", "b1", "w2", "b2")))]:
                rows = np.zeros((3,) + logical[name].shape[1:], np.float32)
                rows[:len(experts[rank])] = logical[name][experts[rank]]
                if (replica_gap and rank == 1 and layer == 0
                        and name == "adam_v.blocks.0.ffn.w1"):
                    rows[2] += replica_gap
                values[name] = rows
        folder = run / "ckpt" / f"rank_{rank}"
        folder.mkdir()
        ms.save_checkpoint([{"name": n, "data": ms.Tensor(v)} for n, v in values.items()],
                           str(folder / "step_000004.ckpt"))
    plans = [{"slot_expert": e, "slot_device": d, "slot_capacity": [8] * len(e),
              "dispatch": "grouped"} for e, d in HAND_PLANS]
    (run / "state.json").write_text(json.dumps(dict(STATE, plans=plans)))
    return run, logical


@pytest.mark.mindspore
@pytest.mark.parametrize("optimizer", [False, True])
def test_export_gives_every_logical_expert_and_moment_back(tmp_path, optimizer):
    import mindspore as ms

    from ms_efficient.core.config import load_config
    from ms_efficient.train.logical_state import reference_network

    run, logical = _hand_made_run(tmp_path)
    out = tmp_path / "model.ckpt"
    args = ["checkpoint", "export", str(run), "--out", str(out)]
    assert main(args + (["--optimizer"] if optimizer else [])) == 0
    loaded = ms.load_checkpoint(str(out))
    net, opt = reference_network(load_config(str(run / "config.yaml"), {"data.path": "stdlib"}))
    assert ms.load_param_into_net(net, loaded, strict_load=True)[0] == []
    names = {p.name for p in net.get_parameters()}
    if optimizer:
        names |= {p.name for p in opt.get_parameters()}
        assert "adam_v.blocks.0.ffn.w1" in names and "global_step" in names
    assert set(loaded) == names
    for name, param in loaded.items():
        if name.endswith("routing_counts"):
            assert not param.asnumpy().any()
        else:
            np.testing.assert_array_equal(param.asnumpy(), logical[name], err_msg=name)


@pytest.mark.mindspore
def test_export_refuses_differing_replicas_and_a_home_table_that_contradicts_the_plan(
        tmp_path, capsys):
    run, _ = _hand_made_run(tmp_path / "a", replica_gap=0.5)
    out = tmp_path / "model.ckpt"
    assert main(["checkpoint", "export", str(run), "--out", str(out)]) == 2
    assert ("'adam_v.blocks.0.ffn.w1' of " in capsys.readouterr().err)
    # a balanced layer's home table: layer 1's says rank 1 holds experts 3, 2 (plan: 2, 3)
    run, _ = _hand_made_run(tmp_path / "b", home_tables=[[[1, 3, -1], [0, 2, 3]],
                                                         [[0, 1], [3, 2]]])
    assert main(["checkpoint", "export", str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert ("rank_0/step_000004.ckpt' parameter 'blocks.1.ffn.home_table' [[0, 1], [3, 2]] "
            "does not match state.json 'plans'[1]") in err, err
    assert not out.exists()


# --- msrun: 2 workers resumed 2 -> 4 -> 1 -> 2 -> 1 ----------------------------------------------
# The 2-worker base is test_ep_train's run killed at step KILL_AFTER (its re-plan forced at
# step REPLAN_AT re-places the home experts; dropout 0.1, every step in the warm-up); the killed run itself
# resumes on 2 (the run continued at 2), and a copy of it resumes leg by leg per RESIZE_LEGS:
# 4 workers, the expert-parallel worker alone, 2 workers, then the one-process trainer. One
# base for both modules, one chain for every size: the suite's time is mostly msrun
# start-ups and compiles (docs/testing.md).


@pytest.fixture(scope="module")
def resized_runs(two_workers_killed):  # noqa: F811 (the fixture imported above)
    """(the base's state.json, the run continued at 2, the resized chain, its legs,
    model.ckpt)."""
    killed = two_workers_killed
    assert killed["resumed"].returncode == 0, (killed["resumed"].stdout[-3000:]
                                               + killed["resumed"].stderr[-3000:])
    return (killed["base_state"], killed["part"], killed["chain"], killed["legs"],
            killed["export"])


def _rows(run_dir, kind):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [r for r in map(json.loads, fh) if r["kind"] == kind]


@pytest.mark.slow
@needs_msrun
def test_a_run_with_dropout_resumed_at_every_size_follows_the_run_continued_at_two(
        resized_runs):
    """Dropout 0.1, killed at step 10 on 2 workers, resumed 4 -> 1 (the expert-parallel
    worker alone) -> 2 -> 1 (one process): every leg's losses per step within 1e-3 relative
    of the run continued at 2, the step and the LR schedule continuing (steps 11..20, once),
    and the same validation loss at the end."""
    base, two_dir, chain, legs, _ = resized_runs
    base_step = base["step"]
    assert base_step == KILL_AFTER and base["world_size"] == 2
    (replan, *_) = _rows(two_dir, "replan")
    assert replan["step"] == REPLAN_AT < base_step and replan["moved_slots"] > 0
    # the home tables the killed run saved are the re-placed ones, not the initial layout
    assert any(p["slot_expert"] != [0, 1, 2, 3] for p in base["plans"])
    assert [(leg["state"]["step"], leg["state"].get("world_size", 1), "plans" in leg["state"])
            for leg in legs] == [(12, 4, True), (14, 1, True), (16, 2, True), (STEPS, 1, False)]
    two = {r["step"]: r["loss"] for r in _rows(two_dir, "train")}
    got = {r["step"]: r["loss"] for r in _rows(chain, "train")}
    assert sorted(got) == sorted(two) == list(range(1, STEPS + 1))
    first, report = base_step + 1, []
    for leg in legs:
        steps = range(first, leg["step"] + 1)
        gap = max(abs(got[s] - two[s]) / two[s] for s in steps)
        report.append(f"{leg['how']} x{leg['workers']} steps {first}-{leg['step']}: "
                      f"{gap:.1e} ({leg['seconds']} s)")
        assert gap <= 1e-3, report
        assert got[first] != got[first - 1]                  # it trained on
        first = leg["step"] + 1
    print("\nresized chain, worst relative loss gap per leg vs continuing at 2: "
          + "; ".join(report))
    val = {r["step"]: r["val_loss"] for r in _rows(chain, "val")}
    val2 = {r["step"]: r["val_loss"] for r in _rows(two_dir, "val")}
    assert val[STEPS] == pytest.approx(val2[STEPS], rel=1e-3)
    four = legs[0]["state"]
    assert len(four["plans"]) == 2 and all(max(p["slot_device"]) == 3 for p in four["plans"])
    state = json.loads((chain / "state.json").read_text())
    assert state["step"] == STEPS
    assert "plans" not in state and "sha256" in state      # a one-process run now
    # the run's own settings survive the resizes: one process ran with EfficientMoE off (it
    # has nothing to place there), but config.yaml keeps the run's values for later resumes
    saved = yaml.safe_load((chain / "config.yaml").read_text())
    assert saved["efficientmoe"]["enabled"] is True and saved["model"]["dropout"] == 0.1


@pytest.mark.slow
@needs_msrun
def test_exported_checkpoint_gives_the_runs_validation_loss(resized_runs):
    import mindspore as ms

    from ms_efficient.core.config import load_config
    from ms_efficient.train.trainer import Trainer

    base, two_dir, _, _, model = resized_runs
    base_step = base["step"]
    cfg = load_config(str(two_dir / "config.yaml"), {"moe.dispatch": "grouped",
                                                  "efficientmoe.enabled": False})
    trainer = Trainer(cfg, str(model.parent / "unused"))
    missing, unexpected = ms.load_param_into_net(trainer.net, ms.load_checkpoint(str(model)),
                                                 strict_load=True)
    assert missing == [] and unexpected == []
    vals = {r["step"]: r["val_loss"] for r in _rows(two_dir, "val")}
    val = trainer.evaluate()
    print(f"\nexported checkpoint: validation loss {val:.6f}, the run recorded "
          f"{vals[base_step]:.5f} (rounded to 5 decimals) at step {base_step}")
    assert val == pytest.approx(vals[base_step], abs=2e-5)
    assert vals[base_step] < vals[0] - 1e-3               # the trained state, not the initial
