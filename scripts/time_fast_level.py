"""Time one layer-step of EfficientMoE's fast level, both twins, on this CPU (measured).

    python scripts/time_fast_level.py [--trace TRACE.npz] [--steps 20] [--json out.json]

For each shape it builds a home table (experts round-robin over the devices, the spare home
slots given to the hottest experts), buffers of 1.5x the mean share and one spare slot per
device, and runs the fast level on ``--steps`` rows of counts: the ``host`` twin (the numpy
``balance_step`` itself, what a host op runs) and the ``ops`` twin (``FastLevelOps`` compiled
in GRAPH mode, what Ascend would compile). The rows come from ``--trace`` (layer 0 of every
row; the shared real trace is 16 ranks x 32 experts) or, without one, a Zipf(1.2) draw of
16,384 tokens per rank. It checks that the two give the same tables and prints a table and
JSON of milliseconds per call (compile time apart).
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np


def shapes_from(trace_path, steps, seed):
    """[(name, counts [N, W, E])]: the trace's layer 0, or Zipf draws of two shapes."""
    if trace_path:
        from ms_efficient.moe.trace import load_trace

        counts = np.asarray(load_trace(trace_path).counts)        # [T, L, R, E]
        return [(f"trace layer 0 ({counts.shape[2]}x{counts.shape[3]})",
                 counts[:steps, 0].astype(np.int64))]
    rng = np.random.default_rng(seed)
    out = []
    for world, experts in ((4, 8), (16, 32)):
        p = 1.0 / np.arange(1, experts + 1) ** 1.2
        p /= p.sum()
        rows = np.stack([np.stack([rng.multinomial(16384, rng.permutation(p))
                                   for _ in range(world)]) for _ in range(steps)])
        out.append((f"zipf 1.2 ({world}x{experts})", rows))
    return out


def layout_for(counts_NWE):
    """(home_WS, buffer_W): ceil(E / W) + 1 home slots per device, experts round-robin, the
    free home slots holding the hottest experts again; buffers 1.5x the mean share."""
    _, world, experts = counts_NWE.shape
    slots = -(-experts // world) + 1
    table = np.full(world * slots, -1)
    table[:experts] = np.arange(experts)
    hot = np.argsort(-counts_NWE.sum(axis=(0, 1)), kind="stable")
    table[experts:] = np.resize(hot, world * slots - experts)
    home = table.reshape(slots, world).T.copy()
    mean = counts_NWE.sum(axis=(1, 2)).mean() / world
    return home, np.full(world, int(np.ceil(1.5 * mean)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default="")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, but got {args.steps}")

    import mindspore as ms
    from mindspore import Tensor

    from ms_efficient.moe.fast_level import FastLevelOps, fast_level_tables

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    rows = []
    for name, counts in shapes_from(args.trace, args.steps, args.seed):
        home, buffers = layout_for(counts)
        world, experts = counts.shape[1:]
        spare = 1
        twin = FastLevelOps(world, experts, spare, buffers, None, None)
        start = time.perf_counter()
        twin(Tensor(counts[0].astype(np.int32)), Tensor(home.astype(np.int32)))
        compile_s = time.perf_counter() - start
        host_s, ops_s, copies, dropped = 0.0, 0.0, 0, 0
        for step in counts:
            start = time.perf_counter()
            want = fast_level_tables(step, home, spare, buffers)
            host_s += time.perf_counter() - start
            start = time.perf_counter()
            got = twin(Tensor(step.astype(np.int32)), Tensor(home.astype(np.int32)))
            got = [t.asnumpy() for t in got]
            ops_s += time.perf_counter() - start
            if any((a != b).any() for a, b in zip(want, got)):
                raise SystemExit(f"{name}: the twins' tables differ; this is a bug.")
            copies += int(want[5][0])
            dropped += int(want[5][1])
        n = len(counts)
        rows.append({"shape": name, "steps": n, "host_ms": 1e3 * host_s / n,
                     "ops_ms": 1e3 * ops_s / n, "ops_compile_s": compile_s,
                     "copies_per_step": copies / n, "dropped_rows": dropped,
                     "tables_equal": True})
    print(f"{'shape':<30} {'host ms':>8} {'ops ms':>8} {'compile s':>9} {'copies':>7} "
          f"{'drops':>6}  (measured, this CPU; ms per layer-step)")
    for r in rows:
        print(f"{r['shape']:<30} {r['host_ms']:>8.2f} {r['ops_ms']:>8.2f} "
              f"{r['ops_compile_s']:>9.2f} {r['copies_per_step']:>7.2f} {r['dropped_rows']:>6}")
    text = json.dumps({"kind": "measured", "rows": rows}, indent=1)
    print(text)
    if args.json:
        from ms_efficient.core.fileio import atomic_write_text

        atomic_write_text(args.json, text + "\n")


if __name__ == "__main__":
    main()
