"""scripts/compare_runs.py: per-range maxima of the relative loss difference of two run folders,
on synthetic metrics.jsonl files with hand-computed differences."""
import json

import pytest

from scripts.compare_runs import compare, main, parse_ranges


def _run(folder, losses, replans=(), vals=()):
    folder.mkdir()
    rows = [{"kind": "val", "step": s, "val_loss": v} for s, v in vals]
    rows += [{"kind": "train", "step": s, "loss": v} for s, v in losses.items()]
    rows += [{"kind": "replan", "step": s, "moved_slots": 2} for s in replans]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    return str(folder)


@pytest.fixture
def runs(tmp_path):
    # Reference B: loss 4.0 at every step. A differs at step 2 by 0.002 (5e-4 relative),
    # at step 3 by 0.004 (1e-3), at step 5 by 0.02 (5e-3) and step 6 by 0.01 (2.5e-3).
    ref = {s: 4.0 for s in range(1, 7)}
    other = dict(ref)
    other.update({2: 4.002, 3: 3.996, 5: 4.02, 6: 3.99})
    a = _run(tmp_path / "a", other, replans=(4,), vals=((0, 5.5), (6, 3.2)))
    b = _run(tmp_path / "b", ref, vals=((0, 5.5), (6, 3.1)))
    return a, b


def test_range_maxima_are_the_hand_computed_relative_differences(runs):
    result = compare(*runs, parse_ranges("1-3,4,5-6"), steps=[5])
    got = [(r["range"], r["steps"], r["max_rel_diff"], r["at_step"]) for r in result["ranges"]]
    assert [g[:2] for g in got] == [("1-3", 3), ("4-4", 1), ("5-6", 2)]
    assert got[0][2] == pytest.approx(1e-3) and got[0][3] == 3
    assert got[1][2] == 0.0 and got[1][3] == 4
    assert got[2][2] == pytest.approx(5e-3) and got[2][3] == 5
    assert result["steps"][0]["rel_diff"] == pytest.approx(5e-3)
    assert result["replans_a"] == [4] and result["replans_b"] == []
    assert result["val"] == [{"step": 0, "val_a": 5.5, "val_b": 5.5},
                             {"step": 6, "val_a": 3.2, "val_b": 3.1}]


def test_cli_prints_table_and_json_and_writes_json(runs, tmp_path, capsys):
    out = tmp_path / "cmp.json"
    assert main([*runs, "--json", str(out)]) == 0          # default: one range, all steps
    printed = capsys.readouterr().out
    assert "1-6" in printed and "5.00e-03" in printed
    saved = json.loads(out.read_text())
    assert saved["ranges"] == [{"range": "1-6", "steps": 6, "max_rel_diff": pytest.approx(5e-3),
                                "at_step": 5}]


def test_missing_folder_or_metrics_file_is_named(runs, tmp_path, capsys):
    assert main([runs[0], str(tmp_path / "nope")]) == 2
    assert "nope' does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main([runs[0], str(tmp_path / "empty")]) == 2
    assert "metrics.jsonl' does not exist" in capsys.readouterr().err
    assert main([*runs, "--ranges", "5-2"]) == 2
    assert "'--ranges' item '5-2'" in capsys.readouterr().err
    assert main([*runs, "--steps", "9"]) == 2
    assert "[9] were not logged" in capsys.readouterr().err
