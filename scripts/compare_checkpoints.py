#!/usr/bin/env python
"""Compare the parameters and Adam moments two run folders saved at one step.

A run folder is one-process (``ckpt/step_N.ckpt``) or expert-parallel (``state.json``
``world_size`` W > 1, ``ckpt/rank_{r}/step_N.ckpt``). Expert-parallel checkpoints are read as
the one-process model's: dense parameters from rank 0 (every rank must hold the same values),
every MoE layer's slot rows (w1, b1, w2, b2 and their moments) gathered into logical [E, ...]
tables through the layer's plan in state.json (rank r's rows are its slots in plan order);
copies of one expert must be identical. The plan in state.json is the one of the checkpoint
at ``--step`` only if no re-plan (metrics.jsonl rows of kind "replan") came after that step,
so other steps are refused.

For each group (weights, adam_m, adam_v): tensors compared, how many are bit-identical, the
relative L2 difference ||A - B|| / ||B|| over the whole group and the largest absolute
difference (and where). Inconsistencies inside a run (replicas or ranks that differ) are
listed. Prints a table, then JSON (also written to ``--json``).

    python scripts/compare_checkpoints.py runs/ep2 runs/one --step 60
"""
import argparse
import json
import os
import sys
from typing import Dict, List, Optional, Tuple

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ms_efficient.core.fileio import atomic_write_text  # noqa: E402

EXPERT_TABLES = ("w1", "b1", "w2", "b2")
SKIPPED = ("learning_rate", "global_step")          # schedule, not state
GROUPS = ("weights", "adam_m", "adam_v")


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        raise ValueError(f"'{path}' does not exist; is '{os.path.dirname(path)}' a run folder?")
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def _load_ckpt(path: str) -> Dict[str, np.ndarray]:
    import mindspore as ms

    if not os.path.isfile(path):
        raise ValueError(f"checkpoint '{path}' does not exist (runs keep their last two).")
    return {k: v.asnumpy() for k, v in ms.load_checkpoint(path).items() if k not in SKIPPED}


def _expert_layer(name: str) -> Optional[int]:
    """MoE layer index of an expert table name (``[adam_m.]blocks.{i}.ffn.w1``), else None."""
    parts = name.split(".")
    if parts[-1] in EXPERT_TABLES and "ffn" in parts and "blocks" in parts:
        return int(parts[parts.index("blocks") + 1])
    return None


def logical_state(run_dir: str, step: int) -> Tuple[Dict[str, np.ndarray], List[str]]:
    """({name: array} as the one-process model names and shapes them, [inconsistencies])."""
    state = _read_json(os.path.join(run_dir, "state.json"))
    world = int(state.get("world_size", 1))
    if world == 1:
        return _load_ckpt(os.path.join(run_dir, "ckpt", f"step_{step:06d}.ckpt")), []
    later = []
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if os.path.isfile(metrics):
        with open(metrics, encoding="utf-8") as fh:
            later = [r["step"] for r in map(json.loads, filter(str.strip, fh))
                     if r.get("kind") == "replan" and r["step"] > step]
    if later:
        raise ValueError(f"'{run_dir}' re-planned at step {later[0]} after step {step}; "
                         f"state.json holds the plan of step {state['step']} only.")
    plans = state["plans"]
    ranks = [_load_ckpt(os.path.join(run_dir, "ckpt", f"rank_{r}", f"step_{step:06d}.ckpt"))
             for r in range(world)]
    out, problems = {}, []
    for name, value in ranks[0].items():
        if ".plan_" in name or ".sync_" in name:              # plan tables: per-rank data
            continue
        layer = _expert_layer(name)
        if layer is None:
            for r in range(1, world):
                if not np.array_equal(value, ranks[r][name]):
                    problems.append(f"{name}: rank {r} differs from rank 0")
            out[name] = value
            continue
        expert = np.asarray(plans[layer]["slot_expert"])
        device = np.asarray(plans[layer]["slot_device"])
        table: Dict[int, np.ndarray] = {}
        for r in range(world):
            for row, e in enumerate(expert[device == r]):
                got = ranks[r][name][row]
                if int(e) in table and not np.array_equal(table[int(e)], got):
                    problems.append(f"{name}: copies of expert {e} differ")
                table.setdefault(int(e), got)
        out[name] = np.stack([table[e] for e in range(len(table))])
    return out, problems


def _group(name: str) -> str:
    return name.split(".", 1)[0] if name.startswith(("adam_m.", "adam_v.")) else "weights"


def compare(a: Dict[str, np.ndarray], b: Dict[str, np.ndarray]) -> List[dict]:
    """Per group: {"group", "tensors", "identical", "rel_l2", "max_abs", "max_abs_at"}."""
    if set(a) != set(b):
        raise ValueError(f"the checkpoints hold different parameters: "
                         f"{sorted(set(a) ^ set(b))[:5]}")
    rows = []
    for group in GROUPS:
        names = sorted(n for n in a if _group(n) == group)
        if not names:
            continue
        diff = {n: np.abs(a[n].astype(np.float64) - b[n]) for n in names}
        num = sum(float((d ** 2).sum()) for d in diff.values())
        den = sum(float((b[n].astype(np.float64) ** 2).sum()) for n in names)
        worst = max(names, key=lambda n: float(diff[n].max()))
        rows.append({"group": group, "tensors": len(names),
                     "identical": sum(np.array_equal(a[n], b[n]) for n in names),
                     "rel_l2": float(np.sqrt(num / den)) if den else float("nan"),
                     "max_abs": float(diff[worst].max()), "max_abs_at": worst})
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_a", help="run folder compared")
    parser.add_argument("run_b", help="reference run folder")
    parser.add_argument("--step", type=int, required=True, help="checkpoint step, e.g. 60")
    parser.add_argument("--json", help="also write the JSON here")
    args = parser.parse_args(argv)
    try:
        a, problems_a = logical_state(args.run_a, args.step)
        b, problems_b = logical_state(args.run_b, args.step)
        result = {"run_a": args.run_a, "run_b": args.run_b, "step": args.step,
                  "groups": compare(a, b), "problems_a": problems_a, "problems_b": problems_b}
        text = json.dumps(result, indent=1)
        if args.json:
            atomic_write_text(args.json, text + "\n")
    except (ValueError, OSError) as err:
        print(f"compare_checkpoints: error: {err}", file=sys.stderr)
        return 2
    print(f"A: {args.run_a}\nB: {args.run_b} (reference), step {args.step}")
    print(f"{'group':>8} {'tensors':>7} {'identical':>9} {'rel L2':>9} {'max |A-B|':>9}  at")
    for g in result["groups"]:
        print(f"{g['group']:>8} {g['tensors']:>7} {g['identical']:>9} {g['rel_l2']:>9.2e} "
              f"{g['max_abs']:>9.2e}  {g['max_abs_at']}")
    for run, problems in (("A", problems_a), ("B", problems_b)):
        for p in problems:
            print(f"inconsistent in {run}: {p}")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
