"""msrun worker for tests/test_distributed.py: data-parallel training, AllToAll and AllToAllV checks.

Run on every rank by tests/dist/run_checks.py (``check``; alone: ``python check_collectives.py
OUT_DIR [graph|pynative]``). Each rank writes its results to its folder as ``<name>_rank<r>.npy``;
the test process computes the expected values with numpy and compares. Rank r's inputs come
from seeds that depend only on r and the step, so the test can regenerate them too
(see `dp_global_batch`, `alltoall_inputs`).
"""
import os
import sys

import numpy as np

# Shared with the test (keep both sides in sync through these constants and functions).
DP_IN, DP_HIDDEN, DP_OUT = 4, 8, 2  # tiny MLP: Dense(4, 8, tanh) -> Dense(8, 2)
DP_ROWS_PER_RANK = 4  # rows of each rank's slice of the global batch
DP_STEPS = 3
DP_LR = 0.1
A2A_CHUNK, A2A_HIDDEN = 2, 3  # AllToAll input [world * A2A_CHUNK, A2A_HIDDEN]


def dp_initial_params():
    """Initial (w1 [H, I], b1 [H], w2 [O, H], b2 [O]), identical on every rank (fixed seed)."""
    rng = np.random.default_rng(0)
    return (
        rng.standard_normal((DP_HIDDEN, DP_IN)).astype(np.float32) * 0.5,
        rng.standard_normal((DP_HIDDEN,)).astype(np.float32) * 0.1,
        rng.standard_normal((DP_OUT, DP_HIDDEN)).astype(np.float32) * 0.5,
        rng.standard_normal((DP_OUT,)).astype(np.float32) * 0.1,
    )


def dp_global_batch(step, world):
    """(x [world*R, I], y [world*R, O]) of `step`; rank r trains on rows r*R:(r+1)*R."""
    rng = np.random.default_rng(100 + step)
    rows = world * DP_ROWS_PER_RANK
    return (
        rng.standard_normal((rows, DP_IN)).astype(np.float32),
        rng.standard_normal((rows, DP_OUT)).astype(np.float32),
    )


def alltoallv_counts(world):
    """[src][dst] rows of the uneven AllToAllV check: rank r sends 1 + r + 2 * d rows to d."""
    return [[1 + r + 2 * d for d in range(world)] for r in range(world)]


def alltoallv_inputs(rank, world):
    """(x [sum of rank's sends, D], w [sum of rank's receives, D]) of `rank`."""
    counts = np.array(alltoallv_counts(world))
    rng = np.random.default_rng(2000 + rank)
    return (rng.standard_normal((counts[rank].sum(), A2A_HIDDEN)).astype(np.float32),
            rng.standard_normal((counts[:, rank].sum(), A2A_HIDDEN)).astype(np.float32))


def alltoall_inputs(rank, world):
    """(x [world*C, D] send buffer, w [world*C, D] loss weights) of `rank`."""
    rng = np.random.default_rng(1000 + rank)
    shape = (world * A2A_CHUNK, A2A_HIDDEN)
    return rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)


def check_alltoall(out_dir, rank, world):
    """Forward, gradient of sum(w * AllToAll(x)), round trip; on the world group and a named group."""
    import mindspore as ms
    from mindspore import Tensor, nn, ops
    from mindspore.communication import create_group

    from ms_efficient.moe.alltoall import AllToAll

    class WeightedSum(nn.Cell):
        def __init__(self, exchange):
            super().__init__()
            self.exchange = exchange

        def construct(self, x, w):
            return ops.sum(w * self.exchange(x))

    class RoundTrip(nn.Cell):
        def __init__(self, exchange):
            super().__init__()
            self.exchange = exchange

        def construct(self, x):
            return self.exchange(self.exchange(x))

    x_np, w_np = alltoall_inputs(rank, world)
    x, w = Tensor(x_np), Tensor(w_np)
    exchange = AllToAll()
    np.save(os.path.join(out_dir, f"a2a_y_rank{rank}.npy"), exchange(x).asnumpy())
    grad_x = ms.grad(WeightedSum(exchange), grad_position=0)(x, w)
    np.save(os.path.join(out_dir, f"a2a_grad_rank{rank}.npy"), grad_x.asnumpy())
    np.save(os.path.join(out_dir, f"a2a_roundtrip_rank{rank}.npy"), RoundTrip(exchange)(x).asnumpy())

    create_group("a2a_pair", list(range(world)))
    np.save(os.path.join(out_dir, f"a2a_group_y_rank{rank}.npy"), AllToAll(group="a2a_pair")(x).asnumpy())

    # AllToAllV: uneven static blocks, forward and gradient
    from ms_efficient.moe.alltoall import AllToAllV

    counts = np.array(alltoallv_counts(world))
    xv_np, wv_np = alltoallv_inputs(rank, world)
    xv, wv = Tensor(xv_np), Tensor(wv_np)
    exchange_v = AllToAllV(counts[rank], counts[:, rank], A2A_HIDDEN, int(counts.max()))
    np.save(os.path.join(out_dir, f"a2av_y_rank{rank}.npy"), exchange_v(xv).asnumpy())
    grad_xv = ms.grad(WeightedSum(exchange_v), grad_position=0)(xv, wv)
    np.save(os.path.join(out_dir, f"a2av_grad_rank{rank}.npy"), grad_xv.asnumpy())


def check_data_parallel(out_dir, rank, world):
    """DP_STEPS SGD steps of the tiny MLP on this rank's slice, gradients averaged over ranks."""
    import mindspore as ms
    from mindspore import Tensor, nn

    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
    w1, b1, w2, b2 = dp_initial_params()
    net = nn.SequentialCell(
        nn.Dense(DP_IN, DP_HIDDEN, weight_init=Tensor(w1), bias_init=Tensor(b1), activation="tanh"),
        nn.Dense(DP_HIDDEN, DP_OUT, weight_init=Tensor(w2), bias_init=Tensor(b2)),
    )
    # TrainOneStepCell adds a DistributedGradReducer (AllReduce mean) in DATA_PARALLEL mode.
    train = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), nn.SGD(net.trainable_params(), DP_LR))
    rows = slice(rank * DP_ROWS_PER_RANK, (rank + 1) * DP_ROWS_PER_RANK)
    for step in range(DP_STEPS):
        x, y = dp_global_batch(step, world)
        train(Tensor(x[rows]), Tensor(y[rows]))
    for i, p in enumerate(net.trainable_params()):
        np.save(os.path.join(out_dir, f"dp_param{i}_rank{rank}.npy"), p.asnumpy())


def check(out_dir, rank, world):
    """Both checks on this rank (run_checks.py has called init())."""
    import mindspore as ms

    check_alltoall(out_dir, rank, world)
    check_data_parallel(out_dir, rank, world)
    mode = "graph" if ms.get_context("mode") == ms.GRAPH_MODE else "pynative"
    return {"mode": mode, "device_target": ms.get_context("device_target")}


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import run_checks

    run_checks.main(sys.argv[1], ["check_collectives"],
                    sys.argv[2] if len(sys.argv) > 2 else "graph")
