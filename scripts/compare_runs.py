#!/usr/bin/env python
"""Compare the per-step training losses of two run folders (their ``metrics.jsonl``).

For every step range (``--ranges 1-20,21-30,31-60``; default: every step both runs logged)
it reports the largest relative difference |loss_a - loss_b| / |loss_b| over the steps both
runs logged (run B is the reference), and the step where it occurs; ``--steps`` adds single
steps (e.g. the first steps after a re-plan). Re-plan steps (rows of kind "replan") and the
validation losses of both runs are listed too. The trainers log losses rounded to 5 decimals,
so relative differences below about 0.5e-5 / loss (~1.5e-6 at loss 3.3) are rounding.

    python scripts/compare_runs.py runs/ep2 runs/one --ranges 1-20,21-30,31-60 \
        --steps 31,32,41,42,51,52 [--json out.json]

Prints a table, then the same figures as JSON (also written to ``--json`` when given).
Exits 2 with a message naming the file when a folder or its metrics.jsonl is missing or
unreadable.
"""
import argparse
import json
import os
import sys
from typing import Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ms_efficient.core.fileio import atomic_write_text  # noqa: E402


def load_metrics(run_dir: str) -> List[dict]:
    """The rows of ``run_dir``/metrics.jsonl (one JSON object per line, blank lines skipped)."""
    if not os.path.isdir(run_dir):
        raise ValueError(f"run folder '{run_dir}' does not exist.")
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ValueError(f"'{path}' does not exist; is '{run_dir}' a finished run folder?")
    rows = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"'{path}' line {n} is not JSON: {err.msg}.") from None
            if not isinstance(row, dict):
                raise ValueError(f"'{path}' line {n} must be a JSON object, but got "
                                 f"{type(row).__name__}.")
            rows.append(row)
    return rows


def train_losses(rows: Sequence[dict], source: str = "metrics") -> Dict[int, float]:
    """{step: loss} of the rows of kind "train" (a row without "kind" counts as train)."""
    losses = {}
    for row in rows:
        if row.get("kind", "train") == "train" and "loss" in row:
            losses[int(row["step"])] = float(row["loss"])
    if not losses:
        raise ValueError(f"{source} has no training rows (kind \"train\" with a \"loss\").")
    return losses


def parse_ranges(text: str) -> List[Tuple[int, int]]:
    """``"1-20,21-30,31-60"`` -> [(1, 20), (21, 30), (31, 60)] (inclusive; "5" = (5, 5))."""
    ranges = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"'--ranges' item '{part}' must be STEP or FIRST-LAST (integers), "
                             f"e.g. 1-20.") from None
        if first < 1 or last < first:
            raise ValueError(f"'--ranges' item '{part}' must have 1 <= FIRST <= LAST.")
        ranges.append((first, last))
    return ranges


def relative_differences(a: Dict[int, float], b: Dict[int, float]) -> Dict[int, float]:
    """{step: |a - b| / |b|} over the steps both runs logged (b: the reference)."""
    out = {}
    for step in sorted(set(a) & set(b)):
        if b[step] == 0.0:
            raise ValueError(f"reference loss at step {step} is 0; the relative difference "
                             f"is undefined.")
        out[step] = abs(a[step] - b[step]) / abs(b[step])
    return out


def range_maxima(rel: Dict[int, float], ranges: Sequence[Tuple[int, int]]) -> List[dict]:
    """Per range: {"range", "steps" compared, "max_rel_diff", "at_step"} (None when no step of
    the range was logged by both runs)."""
    out = []
    for first, last in ranges:
        steps = [s for s in rel if first <= s <= last]
        worst = max(steps, key=lambda s: (rel[s], -s)) if steps else None
        out.append({"range": f"{first}-{last}", "steps": len(steps),
                    "max_rel_diff": rel[worst] if steps else None, "at_step": worst})
    return out


def compare(run_a: str, run_b: str, ranges: Optional[Sequence[Tuple[int, int]]] = None,
            steps: Sequence[int] = ()) -> dict:
    """The comparison of ``run_a`` against the reference ``run_b`` as a JSON-ready dict."""
    rows_a, rows_b = load_metrics(run_a), load_metrics(run_b)
    loss_a = train_losses(rows_a, f"'{run_a}/metrics.jsonl'")
    loss_b = train_losses(rows_b, f"'{run_b}/metrics.jsonl'")
    rel = relative_differences(loss_a, loss_b)
    if not rel:
        raise ValueError(f"'{run_a}' and '{run_b}' have no training step in common.")
    if ranges is None:
        ranges = [(min(rel), max(rel))]
    missing = [s for s in steps if s not in rel]
    if missing:
        raise ValueError(f"'--steps' {missing} were not logged by both runs (common steps "
                         f"{min(rel)}-{max(rel)}).")
    vals = {}
    for name, rows in (("a", rows_a), ("b", rows_b)):
        for r in rows:
            if r.get("kind") == "val":
                vals.setdefault(int(r["step"]), {})[name] = r["val_loss"]
    return {
        "run_a": run_a, "run_b": run_b,
        "ranges": range_maxima(rel, ranges),
        "steps": [{"step": s, "loss_a": loss_a[s], "loss_b": loss_b[s], "rel_diff": rel[s]}
                  for s in steps],
        "replans_a": [int(r["step"]) for r in rows_a if r.get("kind") == "replan"],
        "replans_b": [int(r["step"]) for r in rows_b if r.get("kind") == "replan"],
        "val": [{"step": s, "val_a": v.get("a"), "val_b": v.get("b")}
                for s, v in sorted(vals.items())],
    }


def format_table(result: dict) -> str:
    """The comparison as a plain-text table."""
    def fmt(x):
        return "-" if x is None else f"{x:.2e}"

    lines = [f"A: {result['run_a']}", f"B: {result['run_b']} (reference)",
             f"{'steps':>10} {'compared':>8} {'max |A-B|/|B|':>14} {'at step':>7}"]
    for r in result["ranges"]:
        at = "-" if r["at_step"] is None else str(r["at_step"])
        lines.append(f"{r['range']:>10} {r['steps']:>8} {fmt(r['max_rel_diff']):>14} {at:>7}")
    for s in result["steps"]:
        lines.append(f"{'step ' + str(s['step']):>10} {'A ' + str(s['loss_a']):>12} "
                     f"{'B ' + str(s['loss_b']):>12} {fmt(s['rel_diff']):>10}")
    lines.append(f"re-plans: A at steps {result['replans_a'] or 'none'}, "
                 f"B at steps {result['replans_b'] or 'none'}")
    for v in result["val"]:
        lines.append(f"val loss at step {v['step']}: A {v['val_a']}, B {v['val_b']}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_a", help="run folder whose losses are compared")
    parser.add_argument("run_b", help="reference run folder")
    parser.add_argument("--ranges", help="step ranges, e.g. 1-20,21-30,31-60 "
                                         "(default: all common steps)")
    parser.add_argument("--steps", default="", help="single steps to list, e.g. 31,32")
    parser.add_argument("--json", help="also write the JSON here")
    args = parser.parse_args(argv)
    try:
        ranges = parse_ranges(args.ranges) if args.ranges else None
        try:
            steps = [int(s) for s in args.steps.split(",") if s.strip()]
        except ValueError:
            raise ValueError(f"'--steps' must be integers separated by commas, but got "
                             f"'{args.steps}'.") from None
        result = compare(args.run_a, args.run_b, ranges, steps)
        text = json.dumps(result, indent=1)
        if args.json:
            atomic_write_text(args.json, text + "\n")
    except (ValueError, OSError) as err:
        print(f"compare_runs: error: {err}", file=sys.stderr)
        return 2
    print(format_table(result))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
