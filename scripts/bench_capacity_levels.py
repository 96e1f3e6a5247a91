"""Measured EfficientMoE runs at several ``efficientmoe.capacity_levels`` (distinct
capacities per layer), against dropless static capacities, on this CPU (GRAPH_MODE).

    .venv/bin/python scripts/bench_capacity_levels.py [--levels 2,4,8] [--steps 40]
        [--init-from runs/demo] [--config configs/gpt_moe_tiny.yaml] [--json OUT]

Every arm is the ``efficientmoe`` (or ``dropless-static``) row of ``ms-efficient bench moe``
(:func:`ms_efficient.efficientmoe.bench.run_measured`): same checkpoint, batches and steps;
only the number of capacity levels differs. Few levels mean few batched matmuls per layer but
more padding (every expert of a level takes the level's largest capacity). Run ``make demo``
first for ``--init-from runs/demo``.
"""
from __future__ import annotations

import argparse
import copy
import logging
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from ms_efficient.core.benchio import markdown_table, write_bench_json  # noqa: E402
from ms_efficient.core.config import load_config  # noqa: E402
from ms_efficient.efficientmoe.bench import run_measured  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="2,4,8", help="comma-separated capacity levels")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--init-from", default="runs/demo", help="run folder to continue")
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "gpt_moe_tiny.yaml"))
    parser.add_argument("--json", default="capacity_levels.json")
    args = parser.parse_args(argv)
    try:
        levels = [int(v) for v in args.levels.split(",")]
        if min(levels) < 1:
            raise ValueError
    except ValueError:
        parser.error(f"--levels must be positive integers separated by commas, "
                     f"but got {args.levels!r}")
    if not os.path.isfile(os.path.join(args.init_from, "state.json")):
        parser.error(f"--init-from {args.init_from!r} is not a run folder (run `make demo`)")
    logging.basicConfig(level=logging.WARNING)
    base = load_config(args.config)
    rows = run_measured(base, ["dropless-static"], args.steps, init_from=args.init_from)
    dropless_s = rows[0]["step_time_s"]
    rows[0]["capacity_levels"] = None
    for n in levels:
        cfg = copy.deepcopy(base)
        cfg.efficientmoe.capacity_levels = n
        row = run_measured(cfg, ["efficientmoe"], args.steps, init_from=args.init_from)[0]
        row["step_time_vs_dropless"] = row["step_time_s"] / dropless_s
        row["capacity_levels"] = n
        rows.append(row)
    print(markdown_table(rows, ["method", "capacity_levels", "step_time_s",
                                "step_time_vs_dropless", "padding_fraction", "drop_rate",
                                "replans"]))
    write_bench_json(args.json, "moe-capacity-levels", rows,
                     {"steps": args.steps, "init_from": args.init_from, "config": args.config})
    print(f"rows written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
