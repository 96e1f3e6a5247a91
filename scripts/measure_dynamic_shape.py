"""Measure what one data-dependent shape costs a MindSpore GRAPH-mode call on this machine.

The "counts" dispatch's exchange (ms_efficient.moe.counted_alltoall) receives a number of rows
that is data, so MindSpore runs it on its dynamic-shape path (run-time shape inference and
allocation; on Ascend also a device-to-host read of the counts). This script times two Cells
that gather the same rows and differ only in that: "static" masks rows of a fixed-size
gather, "dynamic" gathers a data-dependent number of rows (``ops.nonzero``). It prints the
microseconds per call of each and the difference, the figure ``CostModel.dynamic_exchange_s``
is set from (docs/results.md). Run: ``python scripts/measure_dynamic_shape.py``.
"""
import time

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

H, ROWS, CALLS, WARMUP = 64, 256, 400, 50


class Dynamic(nn.Cell):
    def construct(self, x, n):
        idx = ops.nonzero(ops.arange(x.shape[0]) < n).reshape(-1)   # data-dependent length
        return ops.gather(x, idx, 0).sum()


class Static(nn.Cell):
    def construct(self, x, n):
        idx = ops.arange(x.shape[0])
        return (ops.gather(x, idx, 0) * (idx < n).astype(x.dtype).reshape(-1, 1)).sum()


def main() -> None:
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    x = Tensor(np.random.RandomState(0).rand(ROWS, H).astype(np.float32))
    sizes = [Tensor(np.int32(v)) for v in np.random.RandomState(1).randint(64, ROWS, CALLS)]
    per_call = {}
    for name, net in (("static", Static()), ("dynamic", Dynamic())):
        for n in sizes[:WARMUP]:
            net(x, n).asnumpy()
        start = time.perf_counter()
        for n in sizes[WARMUP:]:
            net(x, n).asnumpy()
        per_call[name] = (time.perf_counter() - start) / (CALLS - WARMUP)
    extra = per_call["dynamic"] - per_call["static"]
    print(f"static {per_call['static'] * 1e6:.1f} us/call, dynamic "
          f"{per_call['dynamic'] * 1e6:.1f} us/call, dynamic-shape extra {extra * 1e6:.1f} us")


if __name__ == "__main__":
    main()
