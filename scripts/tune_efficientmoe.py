#!/usr/bin/env python
"""Choose EfficientMoE's two tuned constants on traces ``bench moe`` does not report.

The constants:
- ``max_forecast_error`` (PlannerConfig / EfficientMoEConfig): a layer whose recent one-step
  relative forecast errors (rms) exceed it is planned dropless until it settles.
- ``predictor.EXTRAPOLATION_LIMIT``: forecast errors are extrapolated up to this many times
  the longest lead the history covers, then held.

Held-out traces (none of them is a trace ``bench moe`` replays: it uses synthetic seed 0 with
batch_noise 0.05 and the run folders the user passes):
- ``steady-s1``: synthetic, seed 1, batch_noise 0.05 (one-step MAPE ~7 %).
- ``noisy-s2``: synthetic, seed 2, batch_noise 0.15 (one-step MAPE ~15 %).
- ``settling-s3``: synthetic, seed 3: 32 rows of a fast-moving load (drift 0.5, persistence
  0.5: one-step MAPE ~50 % of a last-value forecast, like the demo run's router in its first
  50 steps), then 24 steady rows.
- any ``--trace FILE`` (e.g. the trace of a second training run with another seed).

Each setting is replayed on every trace (simulated, the bench's cluster model); the score is
the geometric mean over traces of the iteration time over the ``dropless-window`` baseline's
on the same trace. A setting is admissible when no trace drops more than ``--max-drops``
(default: the re-plan rule's max_drop_rate, 1 %). Coordinate search: max_forecast_error at the
shipped limit, then the limit at the best max_forecast_error. Prints a table and writes JSON.

    python scripts/tune_efficientmoe.py --json runs/tune_efficientmoe.json     # ~5 min
"""
import argparse
import contextlib
import json
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ms_efficient.core.fileio import atomic_write_text  # noqa: E402
from ms_efficient.efficientmoe import predictor  # noqa: E402
from ms_efficient.efficientmoe.replay import ReplayConfig, replay  # noqa: E402
from ms_efficient.efficientmoe.schedule import ReplanCosts  # noqa: E402
from ms_efficient.moe.trace import RoutingTrace, load_trace, synthetic_trace  # noqa: E402

MAX_FORECAST_ERRORS = (0.25, 0.35, 0.5, 0.75, 1.0, math.inf)
LIMITS = (2, 4, 8, 16)
STRIDE = 50  # training steps between trace rows, as the bench's synthetic trace


def held_out_traces(steps: int = 56):
    """[(name, RoutingTrace)]: the three synthetic held-out traces described above."""
    steady = synthetic_trace(steps=steps, seed=1, batch_noise=0.05)
    noisy = synthetic_trace(steps=steps, seed=2, batch_noise=0.15)
    fast_rows = steps * 4 // 7
    fast = synthetic_trace(steps=fast_rows, seed=3, drift=0.5, persistence=0.5)
    calm = synthetic_trace(steps=steps - fast_rows, seed=3)
    settling = RoutingTrace(counts=np.concatenate([fast.counts, calm.counts]),
                            top_k=calm.top_k, hidden=calm.hidden,
                            tokens_per_rank=calm.tokens_per_rank,
                            steps=np.arange(steps, dtype=np.int64) * STRIDE)
    return [("steady-s1", steady), ("noisy-s2", noisy), ("settling-s3", settling)]


@contextlib.contextmanager
def extrapolation_limit(value: int):
    """Set predictor.EXTRAPOLATION_LIMIT for the block (read at call time)."""
    saved = predictor.EXTRAPOLATION_LIMIT
    predictor.EXTRAPOLATION_LIMIT = value
    try:
        yield
    finally:
        predictor.EXTRAPOLATION_LIMIT = saved


def evaluate(traces, reference, max_forecast_error: float, limit: int, max_drops: float):
    """One setting on every trace: a row dict with per-trace ratios and drops."""
    config = ReplayConfig(max_forecast_error=max_forecast_error)
    ratios, drops = {}, {}
    with extrapolation_limit(limit):
        for name, trace in traces:
            result = replay(trace, "efficientmoe", config=config)
            ratios[name] = result.iteration_time_s / reference[name]
            drops[name] = result.drop_rate
    score = float(np.exp(np.mean(np.log(list(ratios.values())))))
    return {"max_forecast_error": max_forecast_error, "extrapolation_limit": limit,
            "score_vs_dropless_window": score, "max_drop_rate": max(drops.values()),
            "admissible": max(drops.values()) <= max_drops,
            "ratio": ratios, "drop_rate": drops}


def _finite(value: float):
    """JSON has no infinity: inf (never dropless for errors) is written as null."""
    return None if math.isinf(value) else value


def best(rows):
    """Least score among admissible rows (3 decimals); ties go to the smaller
    max_forecast_error (the more cautious: more layers planned dropless), then to the
    shipped extrapolation limit (no change without evidence), then the larger limit."""
    admissible = [r for r in rows if r["admissible"]] or rows
    return min(admissible, key=lambda r: (round(r["score_vs_dropless_window"], 3),
                                          r["max_forecast_error"],
                                          r["extrapolation_limit"] != predictor.EXTRAPOLATION_LIMIT,
                                          -r["extrapolation_limit"]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, help="write the sweep here")
    parser.add_argument("--trace", nargs="*", default=[], metavar="FILE",
                        help="extra held-out traces (.npz); not ones bench moe reports")
    parser.add_argument("--steps", type=int, default=56, help="rows per synthetic trace")
    parser.add_argument("--max-drops", type=float, default=ReplanCosts().max_drop_rate,
                        help="largest admissible drop rate on any trace")
    args = parser.parse_args(argv)
    if args.steps < 24:
        parser.error(f"--steps must be >= 24 (16 warm-up rows plus a re-plan), got {args.steps}")
    start = time.perf_counter()
    traces = held_out_traces(args.steps)
    traces += [(os.path.basename(p), load_trace(p)) for p in args.trace]
    reference = {name: replay(trace, "dropless-window").iteration_time_s
                 for name, trace in traces}
    shipped = (ReplayConfig().max_forecast_error, predictor.EXTRAPOLATION_LIMIT)
    rows = [evaluate(traces, reference, mfe, shipped[1], args.max_drops)
            for mfe in MAX_FORECAST_ERRORS]
    chosen_mfe = best(rows)["max_forecast_error"]
    rows += [evaluate(traces, reference, chosen_mfe, limit, args.max_drops)
             for limit in LIMITS if limit != shipped[1]]
    chosen = best(rows)

    names = [name for name, _ in traces]
    head = ["max_forecast_error", "limit", "score"] + [f"{n} ratio/drops" for n in names]
    print("Simulated (trace replay, ascend910b cluster preset): iteration time over "
          "dropless-window, drop rate")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        cells = [f"{r['max_forecast_error']:g}", str(r["extrapolation_limit"]),
                 f"{r['score_vs_dropless_window']:.3f}" + ("" if r["admissible"] else " (drops)")]
        cells += [f"{r['ratio'][n]:.3f} / {100 * r['drop_rate'][n]:.2f}%" for n in names]
        print("| " + " | ".join(cells) + " |")
    print(f"chosen: max_forecast_error={chosen['max_forecast_error']:g}, "
          f"EXTRAPOLATION_LIMIT={chosen['extrapolation_limit']} (shipped: {shipped[0]:g}, "
          f"{shipped[1]})")
    doc = {"evidence": "simulated", "traces": names, "max_drops": args.max_drops,
           "shipped": {"max_forecast_error": shipped[0], "extrapolation_limit": shipped[1]},
           "chosen": {"max_forecast_error": _finite(chosen["max_forecast_error"]),
                      "extrapolation_limit": chosen["extrapolation_limit"]},
           "rows": [dict(r, max_forecast_error=_finite(r["max_forecast_error"])) for r in rows],
           "seconds": round(time.perf_counter() - start, 1)}
    atomic_write_text(args.json, json.dumps(doc, indent=1, default=str) + "\n")
    print(f"sweep written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
