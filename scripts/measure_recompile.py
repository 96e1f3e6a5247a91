#!/usr/bin/env python
"""Measure how a recompile's cost grows with the MoE layers of a graph (the model of
``ms_efficient.mpipe.planner.recompile_time_s``).

For each layer count L, a fresh process builds L stacked ``MoEFeedForward`` layers (H=64,
F=128, 8 experts, top-2, capacity 16: the small CPU layer the recompile figure was first
measured on), compiles one warm-up graph (the process's first jit pays one-off set-up that a
re-compile does not), then times the first call of the forward+backward graph minus a
steady call: the compile, seconds. Fresh processes, so no compile cache carries over from
another L. Prints every run, the minimum and median per L, and the least-squares line
a + b * L through the minima (the least contended runs: other jobs share the machine).

    cd /tmp && python /path/to/repo/scripts/measure_recompile.py 1 2 4 8 --repeats 5   # ~2 min

Run it from a scratch folder: MindSpore writes ``rank_0/`` into the working folder when a
graph fails to compile.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

import numpy as np

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO)

__all__ = ["compile_s", "main"]


def compile_s(num_layers: int) -> float:
    """Seconds the first forward+backward call of ``num_layers`` stacked MoE layers spends
    beyond a steady call (in this process, after a warm-up compile)."""
    import mindspore as ms
    from mindspore import Tensor, nn

    from ms_efficient.moe.layer import MoEFeedForward

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")

    class Stack(nn.Cell):
        def __init__(self, n):
            super().__init__()
            self.layers = nn.CellList([MoEFeedForward(64, 128, 8, 2, 16) for _ in range(n)])

        def construct(self, x):
            loss = 0.0
            for layer in self.layers:
                y, aux, _, _ = layer(x)
                x = x + y
                loss = loss + aux
            return x.sum() + loss

    warm = nn.SequentialCell([nn.Dense(64, 64), nn.ReLU()])
    ms.jit(ms.value_and_grad(warm, None, warm.trainable_params()))(
        Tensor(np.ones((2, 64), np.float32)))
    net = Stack(num_layers)
    step = ms.jit(ms.value_and_grad(net, None, net.trainable_params()))
    x = Tensor(np.random.default_rng(0).random((2, 32, 64), dtype=np.float32))
    start = time.perf_counter()
    step(x)
    first = time.perf_counter() - start
    start = time.perf_counter()
    step(x)
    return first - (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("layers", type=int, nargs="+", help="MoE layer counts to compile")
    parser.add_argument("--repeats", type=int, default=5, help="fresh processes per count")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)   # the child's job
    args = parser.parse_args()
    if args.one is not None:
        print(f"{compile_s(args.one):.4f}")
        return
    runs = {n: [] for n in args.layers}
    for _ in range(args.repeats):
        for n in args.layers:
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "0", "--one",
                                  str(n)], capture_output=True, text=True, check=True)
            runs[n].append(float(out.stdout.strip().splitlines()[-1]))
            print(f"layers={n} compile={runs[n][-1]:.2f}s load_avg={os.getloadavg()[0]:.1f}",
                  flush=True)
    lows = np.array([min(runs[n]) for n in args.layers])
    for n, low in zip(args.layers, lows):
        print(f"layers={n} min={low:.2f}s median={statistics.median(runs[n]):.2f}s")
    if len(args.layers) >= 2:
        slope, fixed = np.polyfit(np.array(args.layers, float), lows, 1)
        print(f"fit through the minima: {fixed:.2f} s + {slope:.2f} s x layers")


if __name__ == "__main__":
    main()
