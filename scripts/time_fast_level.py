"""Time one layer-step of EfficientMoE's fast level, both twins, on this CPU (measured).

    python scripts/time_fast_level.py [--trace TRACE.npz] [--steps 20] [--json out.json]
                                      [--count-ops]

The layout is the slow level's own (``efficientmoe.planner.plan_layout`` on the trace's first
16 rows, the 910B cluster ``bench moe`` prices that many ranks on, its default slots): the
home table, spare slots, buffers and copy costs a run would compile. Layer 0 of the next
``--steps`` rows then goes through the ``host`` twin (the numpy ``balance_step`` itself, what
the host op runs), the ``aot`` twin (``kernels/cpu/fast_level.cc`` compiled, called as a
one-op GRAPH-mode Cell: its time includes that call's launch; and inside one graph, the
per-call time of 9 chained calls less one call, over 8) and the ``ops`` twin
(``FastLevelOps`` compiled in GRAPH mode, what Ascend would compile). Without ``--trace`` the Zipf 1.45 16-rank trace of ``bench moe``
(``moe.trace.skewed_trace``). It checks that every twin gives the same tables and prints a
table of milliseconds per layer-step (compile time apart); ``--json`` writes the rows.

``--count-ops`` also counts, with MindSpore's profiler, the kernels the ops twin launches over
those layer-steps: each kernel's launches equal the calls (the fixed part) or one loop's
iterations (``Balance.trips_L4``: home-split water-fills, copy attempts, devices over their
buffer, pieces visited), which gives the kernels per iteration of each loop
(``balance.OPS_TWIN_LAUNCHES``, what a 910B preset charges at ``op_launch_s`` each).
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def planned(trace, steps: int):
    """(counts [N, W, E], spec): layer 0 of the ``steps`` rows after the 16 the layout is
    planned on, and that layout's layer 0 (home table, spare slots, buffers, copy costs,
    devices per node) as a dict."""
    from ms_efficient.efficientmoe.balanced_cost import copy_cost_rows_WW
    from ms_efficient.efficientmoe.cost import CostModel
    from ms_efficient.efficientmoe.planner import plan_layout
    from ms_efficient.efficientmoe.replay import cluster_for_ranks

    counts = np.asarray(trace.counts, dtype=np.int64)          # [T, L, R, E]
    if counts.shape[0] < 17:
        raise SystemExit(f"the trace needs >= 17 rows (16 to plan on), but has "
                         f"{counts.shape[0]}.")
    hidden = int(trace.hidden or 1024)
    model = CostModel(cluster_for_ranks(trace.num_ranks), hidden, 4 * hidden)
    layout = plan_layout(counts[:16], model)
    spec = {"home_WS": layout.home_LWS[0], "spare": int(layout.spare_W.max()),
            "buffer_W": layout.buffer_LW[0],
            "copy_cost_WW": copy_cost_rows_WW(model, layout.num_devices),
            "devices_per_node": model.cluster.devices_per_node}
    return counts[16:16 + steps, 0], spec


def kernel_call(spare: int, dpn, buffers, cost):
    """``f(counts_WE, home_WS) -> seconds``: one direct call of the compiled kernel's entry
    point through ctypes (no MindSpore), the kernel's own time."""
    import ctypes

    from ms_efficient.moe.kernels import KERNEL_SOURCE, build_kernel_library

    lib = ctypes.CDLL(build_kernel_library(KERNEL_SOURCE.parent / "fast_level.cc"))
    entry = lib.FastLevelTables
    entry.restype = ctypes.c_int

    def call(counts, home):
        world, experts = counts.shape
        cols = max(spare, 1)
        arrays = [np.ascontiguousarray(counts, np.int32), np.ascontiguousarray(home, np.int32),
                  np.ascontiguousarray(buffers, np.int64), np.ascontiguousarray(cost, np.float64),
                  np.array([spare, dpn or 0], np.int64),
                  np.zeros((world, experts, world), np.int32), np.zeros((experts, world), np.int32),
                  np.zeros((world, cols), np.int32), np.zeros((world, cols), np.int32),
                  np.zeros((world, experts), np.int32), np.zeros(3 + world, np.int32)]
        n = len(arrays)
        params = (ctypes.c_void_p * n)(*[a.ctypes.data for a in arrays])
        ndims = (ctypes.c_int * n)(*[a.ndim for a in arrays])
        dims = [(ctypes.c_int64 * max(a.ndim, 1))(*a.shape) for a in arrays]
        shapes = (ctypes.POINTER(ctypes.c_int64) * n)(
            *[ctypes.cast(d, ctypes.POINTER(ctypes.c_int64)) for d in dims])
        names = {np.dtype(np.int32): b"int32", np.dtype(np.int64): b"int64",
                 np.dtype(np.float64): b"float64"}
        dtypes = (ctypes.c_char_p * n)(*[names[a.dtype] for a in arrays])
        start = time.perf_counter()
        status = entry(n, params, ndims, shapes, dtypes, None, None)
        elapsed = time.perf_counter() - start
        if status != 0:
            raise SystemExit(f"FastLevelTables returned {status}")
        return elapsed

    return call


CHAIN = 9     # chained fast-level calls in one graph (the in-graph per-call time)


def _chained(kernel, depth: int):
    """A GRAPH-mode Cell calling ``kernel`` ``depth`` times in one graph, each call's counts
    depending on the previous call's stats (so they run one after another); returns the
    last stats."""
    from mindspore import nn

    class Chain(nn.Cell):
        def __init__(self):
            super().__init__()
            self.kernel = kernel

        def construct(self, counts, home):
            stats = None
            for _ in range(depth):
                stats = self.kernel(counts, home)[5]
                counts = counts + stats[0] * 0
            return stats

    return Chain()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default="")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="")
    parser.add_argument("--count-ops", action="store_true",
                        help="count the ops twin's launched kernels per loop (profiler)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, but got {args.steps}")

    import mindspore as ms
    from mindspore import Tensor

    from ms_efficient.core.benchio import markdown_table, write_bench_json
    from ms_efficient.moe.fast_level import FastLevel, FastLevelOps, fast_level_tables

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    from ms_efficient.moe.trace import load_trace, skewed_trace

    trace = (load_trace(args.trace) if args.trace
             else skewed_trace(steps=16 + args.steps, layers=1, seed=args.seed))
    name = (f"{'trace' if args.trace else 'zipf 1.45'} layer 0 "
            f"({trace.num_ranks}x{trace.num_experts})")
    counts, spec = planned(trace, args.steps)
    home, spare, buffers = spec["home_WS"], spec["spare"], spec["buffer_W"]
    cost, dpn = spec["copy_cost_WW"], spec["devices_per_node"]
    world, experts = counts.shape[1:]
    twin = FastLevelOps(world, experts, spare, buffers, cost, dpn)
    kernel = FastLevel(world, experts, spare, buffers, cost, dpn, impl="aot")
    kernel(Tensor(counts[0].astype(np.int32)), Tensor(home.astype(np.int32)))
    start = time.perf_counter()
    twin(Tensor(counts[0].astype(np.int32)), Tensor(home.astype(np.int32)))
    compile_s = time.perf_counter() - start
    direct = kernel_call(spare, dpn, buffers, cost)
    host_s, aot_s, ops_s, kernel_s, copies, dropped = 0.0, 0.0, 0.0, 0.0, 0, 0
    for step in counts:
        start = time.perf_counter()
        want = fast_level_tables(step, home, spare, buffers, cost, dpn)
        host_s += time.perf_counter() - start
        start = time.perf_counter()
        compiled = [t.asnumpy() for t in kernel(Tensor(step.astype(np.int32)),
                                                Tensor(home.astype(np.int32)))]
        aot_s += time.perf_counter() - start
        kernel_s += direct(step, home)
        start = time.perf_counter()
        got = [t.asnumpy() for t in twin(Tensor(step.astype(np.int32)),
                                         Tensor(home.astype(np.int32)))]
        ops_s += time.perf_counter() - start
        if any((a != b).any() or (a != c).any() for a, b, c in zip(want, got, compiled)):
            raise SystemExit(f"{name}: the twins' tables differ; this is a bug.")
        copies += int(want[5][0])
        dropped += int(want[5][1])
    chained = {depth: _chained(kernel, depth) for depth in (1, CHAIN)}
    in_graph_s = 0.0
    for step in counts:
        c, h = Tensor(step.astype(np.int32)), Tensor(home.astype(np.int32))
        times = {}
        for depth, cell in chained.items():
            cell(c, h).asnumpy()                         # compiled once per depth
            start = time.perf_counter()
            cell(c, h).asnumpy()
            times[depth] = time.perf_counter() - start
        in_graph_s += max(0.0, times[CHAIN] - times[1]) / (CHAIN - 1)
    n = len(counts)
    replicated = int((np.bincount(home[home >= 0], minlength=experts) > 1).sum())
    shared = {"evidence": "measured", "workload": name, "steps": n, "spare_slots": spare,
              "replicated_experts": replicated, "copies_per_step": copies / n,
              "dropped_rows": dropped}
    rows = [{**shared, "method": method, "ms_per_layer_step": 1e3 * seconds / n}
            for method, seconds in (("host (numpy, pyfunc)", host_s),
                                    ("aot (one-op Cell, launch included)", aot_s),
                                    ("aot kernel (direct call)", kernel_s),
                                    (f"aot in a graph (per call: {CHAIN} chained calls "
                                     f"less 1, / {CHAIN - 1})", in_graph_s),
                                    ("ops (MindSpore-ops twin)", ops_s))]
    print("Measured (MindSpore GRAPH_MODE on this CPU), every twin gave the same tables:")
    print(markdown_table(rows, ["workload", "method", "ms_per_layer_step", "replicated_experts",
                                "copies_per_step", "dropped_rows"]))
    print(f"ops twin compile: {compile_s:.2f} s")
    meta = {"trace": args.trace, "ops_compile_s": compile_s}
    if args.count_ops:
        meta["launches"] = count_launches(world, experts, spare, buffers, cost, dpn, counts,
                                          home)
    if args.json:
        write_bench_json(args.json, "fast_level", rows, meta=meta)


PARTS = ("fixed", "home-split water-fill", "copy attempt", "device over its buffer",
         "piece visited")


def count_launches(world, experts, spare, buffers, cost, dpn, counts, home) -> dict:
    """Profile the ops twin on every step of ``counts`` and print the kernels of each part
    (module docstring) against ``balance.OPS_TWIN_LAUNCHES``; returns them as a dict."""
    import tempfile

    from mindspore import Tensor

    from ms_efficient.core.benchio import markdown_table
    from ms_efficient.moe.balance import OPS_TWIN_LAUNCHES, ops_twin_launches_L
    from ms_efficient.moe.fast_level import FastLevelOps, profiled_launches

    twin = FastLevelOps(world, experts, spare, buffers, cost, dpn, trips=True)
    inputs = [(Tensor(step.astype(np.int32)), Tensor(home.astype(np.int32)))
              for step in counts]
    twin(*inputs[0])
    trips_N4 = np.stack([twin(*args)[6].asnumpy() for args in inputs])
    trips = trips_N4.sum(axis=0).astype(np.int64)
    with tempfile.TemporaryDirectory() as folder:
        per_op = profiled_launches(twin, inputs, folder)
    totals = [len(inputs)] + trips.tolist()
    kernels = [0] * len(PARTS)
    other = 0
    for launches in per_op.values():
        if launches in totals:                    # ambiguous totals go to the first match
            kernels[totals.index(launches)] += 1
        else:                                     # a loop condition that short-circuits
            other += launches
    rows = [{"part": part, "iterations": total, "kernels_each": k, "charged_each": c}
            for part, total, k, c in zip(PARTS, totals, kernels, OPS_TWIN_LAUNCHES)]
    launched = sum(per_op.values())
    charged = int(ops_twin_launches_L(trips_N4, len(inputs)).sum())
    print(f"\nops twin launches over {len(inputs)} layer-steps, MindSpore's profiler "
          f"(measured on this CPU; conditions of other iteration counts: {other} launches):")
    print(markdown_table(rows, ["part", "iterations", "kernels_each", "charged_each"]))
    print(f"launched {launched}, charged {charged} ({charged / launched - 1:+.1%}); "
          f"{launched / len(inputs):.0f} per layer-step")
    return {"per_step": launched / len(inputs), "charged": charged, "launched": launched,
            "trips": totals, "kernels_each": kernels}


if __name__ == "__main__":
    main()
