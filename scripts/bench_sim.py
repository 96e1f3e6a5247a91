"""Time the shared simulator: build and run N devices x L layers of forward tasks, each
activation swapped out over a d2h copy engine (measured on this CPU; the figure the tests
used to assert, now a benchmark).

    .venv/bin/python scripts/bench_sim.py [--devices 4] [--layers 2500] [--repeat 3] [--json OUT]

Prints one table row per size and writes the rows as JSON (median seconds of --repeat runs).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from ms_efficient.core.fileio import atomic_write_text  # noqa: E402
from ms_efficient.sim import Simulator  # noqa: E402

ALPHA = 10e-6      # seconds per transfer, as in tests/test_sim.py


def build(num_devices: int, num_layers: int) -> Simulator:
    sim = Simulator()
    for d in range(num_devices):
        sim.set_initial_memory(f"dev{d}", 1e9)
        sim.set_memory_capacity(f"dev{d}", 2e9)
        prev = []
        for layer in range(num_layers):
            fwd = sim.add_task(f"d{d}.fwd{layer}", f"dev{d}.compute", 1e-4, deps=prev,
                               alloc=[(f"dev{d}", 4e6)])
            sim.add_transfer(f"d{d}.swap{layer}", f"dev{d}.d2h", 4e6, ALPHA, 25e9, deps=[fwd],
                             free=[(f"dev{d}", 4e6)])
            prev = [fwd]
    return sim


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2500)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    rows = []
    for layers in sorted({max(1, args.layers // 10), args.layers}):
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            sim = build(args.devices, layers)
            sim.run()
            times.append(time.perf_counter() - t0)
        rows.append({"evidence": "measured", "tasks": len(sim), "devices": args.devices,
                     "layers": layers, "build_and_run_s": statistics.median(times)})
    print("| tasks | build + run (s, median) |\n|---:|---:|")
    for r in rows:
        print(f"| {r['tasks']} | {r['build_and_run_s']:.3f} |")
    if args.json:
        atomic_write_text(args.json, json.dumps({"rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
