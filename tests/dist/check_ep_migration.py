"""msrun worker for tests/test_ep_migration.py: a re-plan moves expert rows and Adam state
between 2 CPU ranks.

Run on every rank by tests/dist/run_checks.py (alone: ``python check_ep_migration.py OUT_DIR``,
results in OUT_DIR/check_ep_migration). Rank r feeds rows
r*B:(r+1)*B of the global batches. A grouped ExpertParallelMoE of plan BEFORE takes one Adam
step (batch 0); ``set_plan(AFTER, optimizer)`` moves expert 2 from rank 0 to rank 1, swaps
experts 1 (rank 0) and 3 (rank 1) and adds a replica of expert 0 on rank 1; a second step
(batch 1) follows on the graph compiled for BEFORE. Written to ``rank<r>.npz`` in its folder: the
second step's outputs, the weights and Adam moments after it, the local slots, the
migration record, what the exchange Cell carried (counts and rows received), and the graphs
compiled after the re-plan. The test compares with MoEFeedForward trained on the whole batch
(it never moved anything). Numpy only at import (shared with the test).
"""
import os
import sys

import numpy as np

E, H, F, K = 4, 16, 32, 2
B, S = 2, 8                      # per rank: T_LOCAL = B * S tokens
T_LOCAL = B * S
WORLD = 2
LR = 1e-2
BUDGET = 3                       # S_b, weight rows per rank
# A device receives at most WORLD * K * T_LOCAL = 64 rows: buffers of 64 never drop, and both
# plans keep them (device_buffer), so set_plan needs no new shapes.
BUFFER = [WORLD * K * T_LOCAL] * WORLD
BEFORE = dict(slot_expert=[0, 1, 2, 3], slot_device=[0, 0, 0, 1], slot_capacity=[16] * 4,
              dispatch="grouped", device_buffer=BUFFER)
AFTER = dict(slot_expert=[0, 3, 1, 2, 0], slot_device=[0, 0, 1, 1, 1],
             slot_capacity=[8, 16, 16, 16, 8], dispatch="grouped", device_buffer=BUFFER)
# rank 0 rows [0, 1, 2] -> [0, 3, empty]; rank 1 rows [3] -> [1, 2, 0]: rank 1 receives
# experts 1, 2 and 0 from rank 0, rank 0 receives expert 3 from rank 1
EXPECTED_ROWS_WW = [[0, 3], [1, 0]]
PARAM_NAMES = ("router", "w1", "b1", "w2", "b2")


def logical_weights():
    """(router_EH, w1_EHF, b1_E1F, w2_EFH, b2_E1H), float32, with non-zero biases."""
    from ms_efficient.moe.ep_routing import init_expert_weights

    router, w1, b1, w2, b2 = init_expert_weights(E, H, F, init_std=0.3, seed=5)
    rng = np.random.default_rng(11)
    b1 = rng.normal(0.0, 0.1, b1.shape).astype(np.float32)
    b2 = rng.normal(0.0, 0.1, b2.shape).astype(np.float32)
    return router, w1, b1, w2, b2


def global_batch(step=0):
    """(x [W*B, S, H], dy [W*B, S, H]) of ``step``; rank r uses rows r*B:(r+1)*B."""
    rng = np.random.default_rng(200 + step)
    shape = (WORLD * B, S, H)
    return (rng.standard_normal(shape).astype(np.float32),
            rng.standard_normal(shape).astype(np.float32))


def run(out_dir, rank):
    """Train, re-plan, train; write ``rank<r>.npz``."""
    import mindspore as ms
    from mindspore import Tensor, nn, ops

    import ms_efficient.moe.ep_replan as ep_replan
    from ms_efficient.moe.ep_layer import ExpertParallelMoE
    from ms_efficient.moe.plan import ExpertPlan

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from check_ep_moe import count_compiles

    exchanges = []

    class RecordedAllToAllV(ep_replan.AllToAllV):
        """The package's AllToAllV, recording its counts and the rows it returned."""

        def __init__(self, send_counts, recv_counts, *args, **kwargs):
            super().__init__(send_counts, recv_counts, *args, **kwargs)
            exchanges.append({"send": [int(c) for c in send_counts],
                              "recv": [int(c) for c in recv_counts], "rows": None})

        def construct(self, x):
            out = super().construct(x)
            exchanges[-1]["rows"] = int(out.shape[0])
            return out

    ep_replan.AllToAllV = RecordedAllToAllV

    class WeightedOutput(nn.Cell):
        def __init__(self, layer):
            super().__init__()
            self.layer = layer

        def construct(self, x, dy):
            y, aux, counts, dropped = self.layer(x)
            return (y * dy).sum(), y, dropped

    class TrainStep(nn.Cell):
        """One Adam step on sum(y * dy); the router's gradient summed over ranks."""

        def __init__(self, layer, params):
            super().__init__()
            self.optimizer = nn.Adam(params, learning_rate=LR)
            self.value_and_grad = ms.value_and_grad(WeightedOutput(layer), None,
                                                    weights=self.optimizer.parameters,
                                                    has_aux=True)
            self.all_reduce = ops.AllReduce()

        def construct(self, x, dy):
            outputs, grads = self.value_and_grad(x, dy)
            self.optimizer((self.all_reduce(grads[0]),) + grads[1:])
            return outputs

    rows = slice(rank * B, (rank + 1) * B)
    layer = ExpertParallelMoE(H, F, E, K, ExpertPlan(**BEFORE), rank=rank,
                              slots_per_device=BUDGET)
    layer.set_weights(*logical_weights())
    params = [layer.router.weight, layer.w1, layer.b1, layer.w2, layer.b2]
    step = TrainStep(layer, params)
    x, dy = (Tensor(a[rows]) for a in global_batch(0))
    step(x, dy)
    compiled = count_compiles()
    layer.set_plan(ExpertPlan(**AFTER), optimizer=step.optimizer)
    x, dy = (Tensor(a[rows]) for a in global_batch(1))
    _, y, dropped = step(x, dy)
    out = {"y": y.asnumpy(), "dropped": dropped.asnumpy(), "local_slots": layer.local_slots,
           "compiled_after_replan": np.array(len(compiled)),
           "rows_WW": layer.last_migration.rows_WW,
           "moved_slots": np.array(layer.last_migration.moved_slots),
           "moved_bytes": np.array(layer.last_migration.moved_bytes),
           "row_bytes": np.array(layer.last_migration.row_bytes),
           "exchanges": np.array(len(exchanges)),
           "exchange_send": np.array(exchanges[0]["send"]),
           "exchange_recv": np.array(exchanges[0]["recv"]),
           "exchange_rows": np.array(exchanges[0]["rows"])}
    out.update({f"trained_{n}": p.asnumpy() for n, p in zip(PARAM_NAMES, params)})
    for kind, moments in (("m", step.optimizer.moment1), ("v", step.optimizer.moment2)):
        out.update({f"{kind}_{n}": p.asnumpy() for n, p in zip(PARAM_NAMES, moments)})
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **out)


def check(out_dir, rank, world):
    """The move on this rank (run_checks.py has called init()); the package's AllToAllV is
    put back afterwards for the checks that follow in the process."""
    from ms_efficient.moe import ep_replan

    if world != WORLD:
        raise SystemExit(f"check_ep_migration.py expects {WORLD} workers, but got {world}.")
    package_alltoallv = ep_replan.AllToAllV
    try:
        run(out_dir, rank)
    finally:
        ep_replan.AllToAllV = package_alltoallv


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import run_checks

    run_checks.main(sys.argv[1], ["check_ep_migration"])
