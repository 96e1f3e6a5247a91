"""Forward + backward time of the reference model's op choices on MindSpore's CPU backend.

    .venv/bin/python scripts/bench_cpu_ops.py [--repeat 10] [--json OUT]

Measured, GRAPH_MODE, float32, at the reference MoE's sizes (configs/gpt_moe_tiny.yaml: 2048
tokens, H = 256, F = 512, top-2, ~700 slot rows per expert). Each row times one way of
computing a piece of the layer against the way the package uses; both give the same values to
float32 rounding (the ``max_abs_diff`` column):

    gelu          nn.GELU(approximate=True) (GeLU / GeLUGrad kernels) vs TanhGELU (elementwise
                  primitives), on the expert hidden activations [5632, 512];
    combine       ReduceSum over the leading axis of [K, T, H] vs sum_choices (split + AddN);
    qkv-split     strided slices of the [3, B, nh, S, hd] projection vs a split of [B*S, 3H]
                  before the head transpose.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import mindspore as ms  # noqa: E402
from mindspore import Tensor, nn, ops  # noqa: E402

from ms_efficient.core.benchio import markdown_table, write_bench_json  # noqa: E402
from ms_efficient.moe.layer import TanhGELU, sum_choices  # noqa: E402


class _Loss(nn.Cell):
    """sum(f(x) * x): a scalar whose gradient runs f's backward on a dense cotangent."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def construct(self, x):
        y = self.fn(x)
        return (y * y).sum()


class _KernelGelu(nn.Cell):
    def __init__(self):
        super().__init__()
        self.gelu = nn.GELU(approximate=True)

    def construct(self, x):
        return self.gelu(x)


class _ReduceCombine(nn.Cell):
    def construct(self, y_AH):
        return y_AH.reshape(2, -1, y_AH.shape[1]).sum(axis=0)


class _SplitCombine(nn.Cell):
    def construct(self, y_AH):
        return sum_choices(y_AH, 2, y_AH.shape[0] // 2)


class _StridedQKV(nn.Cell):
    def construct(self, qkv):
        qkv = qkv.reshape(16, 128, 3, 4, 64).transpose(2, 0, 3, 1, 4)
        return qkv[0] + qkv[1] * qkv[2]


class _SplitQKV(nn.Cell):
    def construct(self, qkv):
        q, k, v = ops.split(qkv, 256, -1)
        q = q.reshape(16, 128, 4, 64).transpose(0, 2, 1, 3)
        k = k.reshape(16, 128, 4, 64).transpose(0, 2, 1, 3)
        v = v.reshape(16, 128, 4, 64).transpose(0, 2, 1, 3)
        return q + k * v


def _time(cell: nn.Cell, x: Tensor, repeat: int):
    """(median seconds of one forward + backward, forward output as numpy)."""
    step = ms.jit(ms.value_and_grad(_Loss(cell)))
    for _ in range(2):
        step(x)[1].asnumpy()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        step(x)[1].asnumpy()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), cell(x).asnumpy()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--json", default="cpu_ops.json")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat must be >= 1, but got {args.repeat}")
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    rng = np.random.default_rng(0)
    cases = [
        ("gelu", "[5632, 512]", _KernelGelu(), TanhGELU(), (5632, 512)),
        ("combine", "[2 x 2048, 256]", _ReduceCombine(), _SplitCombine(), (4096, 256)),
        ("qkv-split", "[2048, 768]", _StridedQKV(), _SplitQKV(), (2048, 768)),
    ]
    rows = []
    for name, shape, before, after, dims in cases:
        x = Tensor(rng.standard_normal(dims).astype(np.float32))
        t_before, y_before = _time(before, x, args.repeat)
        t_after, y_after = _time(after, x, args.repeat)
        rows.append({"evidence": "measured", "workload": name, "method": "package",
                     "shape": shape,
                     "before_ms": 1e3 * t_before, "package_ms": 1e3 * t_after,
                     "speedup": t_before / t_after,
                     "max_abs_diff": float(np.abs(y_before - y_after).max())})
    print(markdown_table(rows, ["workload", "shape", "before_ms", "package_ms", "speedup",
                                "max_abs_diff"]))
    write_bench_json(args.json, "cpu-ops", rows, {"repeat": args.repeat})
    print(f"rows written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
