"""msrun worker for tests/test_ep_layer.py: the expert-parallel MoE layer on 2 CPU ranks.

Run on every rank by tests/dist/run_checks.py (alone: ``python check_ep_moe.py OUT_DIR``,
results in OUT_DIR/check_ep_moe). Rank r feeds rows
r*B:(r+1)*B of a global batch; for every plan in PLANS it writes, to
``<plan>_rank<r>.npz`` in its folder: the layer's outputs, the gradients of sum(y * dy) (x, router,
local slot weights) and the local slot ids. On TRAIN_PLAN these come from the first of
TRAIN_STEPS Adam steps on batches 0, 1, ... (the router's gradient summed over ranks, as data
parallelism does; the experts' summed by the layer), and the final weights are saved too.
The test computes the single-process reference with MoEFeedForward. Inputs and weights come
from seeded generators here (numpy only at import), shared with the test.
"""
import os
import sys

import numpy as np

# Shared with the test.
E, H, F, K = 4, 16, 32, 2
B, S = 2, 8                      # per rank: T_LOCAL = B * S tokens
T_LOCAL = B * S
WORLD = 2
TRAIN_STEPS, LR = 3, 1e-2
# Dropless plans (capacities never exceeded): a single slot holds W * T_LOCAL rows, so every
# rank's equal share is T_LOCAL, the most one rank can route to one expert.
FULL = WORLD * T_LOCAL
PLANS = {
    # one slot per expert, two experts per rank
    "spread": dict(slot_expert=[0, 1, 2, 3], slot_device=[0, 0, 1, 1], slot_capacity=[FULL] * 4),
    # hot expert 0 on both ranks; rank 1's replica is too small for rank 1's share, so its
    # first 8 arrivals stay local and the rest spill to rank 0's replica
    "hot": dict(slot_expert=[0, 1, 2, 0, 3], slot_device=[0, 0, 0, 1, 1],
                slot_capacity=[T_LOCAL + 8, FULL, FULL, T_LOCAL - 8, FULL]),
}
# Grouped dispatch (one row buffer per device, a fixed split over replicas): the hot layout,
# rank 0 keeping expert 0 on its own replica and rank 1 splitting it half/half (its static
# share spills 8 of 16 rows); buffers 88 and 40 rows hold everything a device can receive
# (device 1: at most 2 * T_LOCAL rows of expert 3 and T_LOCAL / 2 of expert 0).
PLANS["grouped-hot"] = dict(PLANS["hot"], dispatch="grouped")
# The same with buffers of 24 and 12 rows: both devices drop (rank 1's rows: buffers fill
# rank-major); the test checks which assignments against split.grouped_assignments.
PLANS["grouped-tight"] = dict(PLANS["hot"], slot_capacity=[8, 8, 8, 4, 8], dispatch="grouped")
# Planned send blocks: rank r sends device d exactly C[r, d] rows (an AlltoAllV of those
# constant counts) and each device computes what it receives (buffers = column sums), so only
# a pair's overflow drops: rank 0's 10-row block to device 0 and rank 1's 5-row one both do.
PLANS["grouped-blocks"] = dict(PLANS["hot"], dispatch="grouped",
                               send_block=[[10, 6], [5, 9]], device_buffer=[15, 15])
DROPPING = ("grouped-tight", "grouped-blocks")
# MPipeMoE: the spread plan in 2 chunks of the batch (one sample each), every slot sized for a
# chunk (still dropless: a rank routes at most T_LOCAL / 2 tokens to an expert per chunk)
PLANS["spread-chunked"] = dict(PLANS["spread"], slot_capacity=[FULL // 2] * 4)
CHUNKS = {"spread-chunked": 2}
# Re-plan without recompiling: "grouped-replan" compiles with REPLAN_FROM (expert 3 on rank 0,
# expert 0 on rank 1 only; the same buffers 88 and 40, at most 3 slots per device), takes one
# step, then set_plan switches it to the grouped-hot plan: expert 3's weights move to rank 1
# and expert 0's reach rank 0 (the moved rows only, one AlltoAllV). Its results, from the
# already compiled step, must be those of the grouped-hot plan; no graph may compile again.
PLANS["grouped-replan"] = PLANS["grouped-hot"]
REPLAN_FROM = {"grouped-replan": dict(slot_expert=[3, 1, 2, 0], slot_device=[0, 0, 0, 1],
                                      slot_capacity=[24, 32, 32, 40], dispatch="grouped")}
TRAIN_PLAN = "hot"
PARAM_NAMES = ("router", "w1", "b1", "w2", "b2")   # saved as grad_<name>, trained_<name>


def logical_weights():
    """(router_EH, w1_EHF, b1_E1F, w2_EFH, b2_E1H), float32, with non-zero biases."""
    from ms_efficient.moe.ep_layer import init_expert_weights

    router, w1, b1, w2, b2 = init_expert_weights(E, H, F, init_std=0.3, seed=5)
    rng = np.random.default_rng(11)
    b1 = rng.normal(0.0, 0.1, b1.shape).astype(np.float32)
    b2 = rng.normal(0.0, 0.1, b2.shape).astype(np.float32)
    return router, w1, b1, w2, b2


def global_batch(step=0):
    """(x [W*B, S, H], dy [W*B, S, H]) of ``step``; rank r uses rows r*B:(r+1)*B."""
    rng = np.random.default_rng(100 + step)
    shape = (WORLD * B, S, H)
    return (rng.standard_normal(shape).astype(np.float32),
            rng.standard_normal(shape).astype(np.float32))


def run(out_dir, rank, world):
    """Write the results of every plan; return wall-clock seconds per phase."""
    import time

    import mindspore as ms
    from mindspore import Tensor, nn, ops

    from ms_efficient.moe.ep_layer import ExpertParallelMoE
    from ms_efficient.moe.plan import ExpertPlan
    from ms_efficient.mpipe.layer import PipelinedMoE

    class WeightedOutput(nn.Cell):
        """sum(y * dy), and the layer's outputs as auxiliary results."""

        def __init__(self, layer):
            super().__init__()
            self.layer = layer

        def construct(self, x, dy):
            y, aux, counts, dropped = self.layer(x)
            return (y * dy).sum(), y, aux, counts, dropped

    class GradStep(nn.Cell):
        """value_and_grad of WeightedOutput as one compiled graph (a Cell)."""

        def __init__(self, layer, params):
            super().__init__()
            self.value_and_grad = ms.value_and_grad(WeightedOutput(layer), grad_position=0,
                                                    weights=params, has_aux=True)

        def construct(self, x, dy):
            return self.value_and_grad(x, dy)

    class TrainStep(nn.Cell):
        """One Adam step on sum(y * dy); returns the layer's outputs and the gradients taken
        before the update. The router is data-parallel: its gradient is summed over ranks."""

        def __init__(self, layer, params):
            super().__init__()
            self.optimizer = nn.Adam(params, learning_rate=LR)
            self.value_and_grad = ms.value_and_grad(WeightedOutput(layer), grad_position=0,
                                                    weights=self.optimizer.parameters,
                                                    has_aux=True)
            self.all_reduce = ops.AllReduce()

        def construct(self, x, dy):
            outputs, (dx, grads) = self.value_and_grad(x, dy)
            router = self.all_reduce(grads[0])   # PARAM_NAMES[0]
            self.optimizer((router,) + grads[1:])
            return outputs, (dx, grads)

    rows = slice(rank * B, (rank + 1) * B)
    weights = logical_weights()
    seconds = {}
    for name, fields in PLANS.items():
        start = time.perf_counter()
        first = REPLAN_FROM.get(name, fields)
        inner = ExpertParallelMoE(H, F, E, K, ExpertPlan(**first), rank=rank)
        inner.set_weights(*weights)
        layer = PipelinedMoE(inner, CHUNKS[name]) if name in CHUNKS else inner
        x, dy = (Tensor(a[rows]) for a in global_batch())
        params = [inner.router.weight, inner.w1, inner.b1, inner.w2, inner.b2]
        if name == TRAIN_PLAN:   # the first step's gradients are the checked ones
            step = TrainStep(layer, params)
        elif name in REPLAN_FROM:
            step = GradStep(layer, params)
            step(x, dy)                                   # compiled with the first plan
            compiled = count_compiles()
            inner.set_plan(ExpertPlan(**fields))
        else:
            step = ms.value_and_grad(WeightedOutput(layer), grad_position=0, weights=params,
                                     has_aux=True)
        (_, y, aux, counts, dropped), (dx, grads) = step(x, dy)
        out = {"y": y, "aux": aux, "counts": counts, "dropped": dropped, "dx": dx}
        out.update({f"grad_{n}": g for n, g in zip(PARAM_NAMES, grads)})
        out = {k: v.asnumpy() for k, v in out.items()}
        out["local_slots"] = inner.local_slots
        out["send_counts"] = np.array(inner.dispatch.send_counts)   # rows to every rank
        out["recv_counts"] = np.array(inner.dispatch.recv_counts)
        if name in REPLAN_FROM:
            out["compiled_after_replan"] = np.array(len(compiled))
        if name == TRAIN_PLAN:
            for i in range(1, TRAIN_STEPS):
                xs, dys = global_batch(i)
                step(Tensor(xs[rows]), Tensor(dys[rows]))
            out.update({f"trained_{n}": p.asnumpy() for n, p in zip(PARAM_NAMES, params)})
        seconds[f"{name}_s"] = time.perf_counter() - start
        np.savez(os.path.join(out_dir, f"{name}_rank{rank}.npz"), **out)
    return seconds


def count_compiles(patch=setattr):
    """A list that records every graph compiled from now on (the executor's compile returns
    (phase, True) only for a fresh compile, (phase, False) for a compile-cache hit; no public
    hook exists, hence the private name). ``patch(obj, name, value)`` installs the recorder:
    ``setattr`` in a worker, pytest's ``monkeypatch.setattr`` in a test (undone after it)."""
    from mindspore.graph.api import _cell_graph_executor as executor

    compiled, real = [], executor.compile

    def compile_and_record(obj, *args, **kwargs):
        phase, fresh = real(obj, *args, **kwargs)
        if fresh:
            compiled.append(type(obj).__name__)
        return phase, fresh

    patch(executor, "compile", compile_and_record)
    return compiled


def check(out_dir, rank, world):
    """Every plan on this rank (run_checks.py has called init()); seconds per phase."""
    if world != WORLD:
        raise SystemExit(f"check_ep_moe.py expects {WORLD} workers, but got {world}.")
    return run(out_dir, rank, world)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import run_checks

    run_checks.main(sys.argv[1], ["check_ep_moe"])
