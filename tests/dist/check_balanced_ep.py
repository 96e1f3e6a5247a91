"""msrun worker for tests/test_balanced_ep.py: the balanced expert-parallel layer on W CPU ranks
(W from the launch), with a hot expert that the fast level copies into spare slots.

On 2 ranks it runs in the session's job of the 2-worker checks (tests/dist/run_checks.py); on
4 alone, launched on every rank as ``python check_balanced_ep.py OUT_DIR`` (results in
OUT_DIR/check_balanced_ep). Rank r feeds rows r*B:(r+1)*B of a global batch. It writes
``rank<r>.npz`` in its folder: the outputs, the fast level's stats, every step's routing
counts and exchange count operands (``exchange_rows``), and the gradients of
sum(y * dy) (x, router, home slot weights) of the first of TRAIN_STEPS Adam steps (router
gradient summed over ranks, as data parallelism does), and the home slots' weights after them;
and ``record<r>.json``, the verification pass's record of the train step's compile (every
primitive with its operands' shapes: what the traffic audit reads) where the pass can be built.
The test computes the one-process reference with MoEFeedForward on the whole batch. Inputs and
weights come from seeded generators (numpy only at import), shared with the test.
"""
import os
import sys

import numpy as np

E, H, F, K = 4, 16, 32, 2
B, S = 2, 8                      # per rank: T_LOCAL = B * S tokens
T_LOCAL = B * S
TRAIN_STEPS, LR = 3, 1e-2
SPARE = 1
# the fast level of each size: 2 ranks run the numpy function as a host op, 4 the
# MindSpore-ops twin compiled into the graph (the twin Ascend would run); the training runs
# of tests/test_ep_balanced_train.py run the compiled C++ kernel (auto on CPU)
FAST_LEVEL = {2: "host", 4: "ops"}
PARAM_NAMES = ("router", "w1", "b1", "w2", "b2")


def home_table(world):
    """Plain expert parallelism: E / W experts per device (W in 2, 4)."""
    return np.arange(E).reshape(world, E // world)


def home_after(world):
    """The home table of the re-plan after the first step: device w takes device w+1's
    experts (mod W)."""
    return np.roll(home_table(world), -1, axis=0)


def buffers(world):
    """Every device's buffer: twice its mean share (K * T_LOCAL rows), so nothing drops."""
    return np.full(world, 2 * K * T_LOCAL)


def logical_weights():
    """(router_EH, w1_EHF, b1_E1F, w2_EFH, b2_E1H), float32; expert 0's router row points at
    the inputs' mean, so expert 0 is every token's first choice (a hot expert)."""
    from ms_efficient.moe.ep_routing import init_expert_weights

    router, w1, b1, w2, b2 = init_expert_weights(E, H, F, init_std=0.3, seed=5)
    router[0] += 0.5
    rng = np.random.default_rng(11)
    b1 = rng.normal(0.0, 0.1, b1.shape).astype(np.float32)
    b2 = rng.normal(0.0, 0.1, b2.shape).astype(np.float32)
    return router, w1, b1, w2, b2


def global_batch(world, step=0):
    """(x [W*B, S, H] with mean 1, dy [W*B, S, H]) of ``step``; rank r uses rows
    r*B:(r+1)*B."""
    rng = np.random.default_rng(100 + step)
    shape = (world * B, S, H)
    return (1.0 + rng.standard_normal(shape).astype(np.float32),
            rng.standard_normal(shape).astype(np.float32))


def run(out_dir, rank, world):
    import mindspore as ms
    from mindspore import Tensor, nn, ops

    from ms_efficient.moe.balance import home_plan
    from ms_efficient.moe.balanced_ep import BalancedExpertParallelMoE

    class WeightedOutput(nn.Cell):
        def __init__(self, layer):
            super().__init__()
            self.layer = layer

        def construct(self, x, dy):
            y, aux, counts, dropped = self.layer(x)
            return (y * dy).sum(), y, counts, dropped

    class TrainStep(nn.Cell):
        def __init__(self, layer, params):
            super().__init__()
            self.optimizer = nn.Adam(params, learning_rate=LR)
            self.value_and_grad = ms.value_and_grad(WeightedOutput(layer), grad_position=0,
                                                    weights=self.optimizer.parameters,
                                                    has_aux=True)
            self.all_reduce = ops.AllReduce()

        def construct(self, x, dy):
            outputs, (dx, grads) = self.value_and_grad(x, dy)
            self.optimizer((self.all_reduce(grads[0]),) + grads[1:])
            return outputs, (dx, grads)

    layer = BalancedExpertParallelMoE(H, F, E, K, home_table(world), SPARE, buffers(world),
                                      fast_level=FAST_LEVEL[world])
    layer.set_weights(*logical_weights())
    params = [layer.router.weight, layer.w1, layer.b1, layer.w2, layer.b2]
    step = TrainStep(layer, params)
    rows = slice(rank * B, (rank + 1) * B)
    x, dy = (Tensor(a[rows]) for a in global_batch(world))
    # the compile of the train step, recorded by the verification pass (the collectives'
    # operands, read by the traffic audit) where it can be built
    from ms_efficient.verify import plugin
    if plugin.verify_available():
        plugin.ensure_registered()
        with plugin.recording(os.path.join(out_dir, f"record{rank}.json")):
            (_, y, counts, dropped), (dx, grads) = step(x, dy)
    else:
        (_, y, counts, dropped), (dx, grads) = step(x, dy)
    out = {"y": y, "counts": counts, "dropped": dropped, "stats": layer.balance_stats,
           "dx": dx, "exchange_0": layer.exchange_rows}
    out.update({f"grad_{n}": g for n, g in zip(PARAM_NAMES, grads)})
    out = {k: v.asnumpy().copy() for k, v in out.items()}  # a Parameter's array is a view
    out["fast_level"] = np.array(layer.fast.impl)
    # rows of the AllGather each of the four row exchanges is emulated by on CPU (W x its
    # largest block): dispatch, combine, the combine's adjoint, the dispatch's adjoint
    out["gather_rows"] = np.array([layer.dispatch.forward.padded_rows,
                                   layer.undispatch.forward.padded_rows,
                                   layer.undispatch.adjoint.padded_rows,
                                   layer.dispatch.adjoint.padded_rows])
    buffer_shape = [layer.num_rows]
    layer.set_plan(home_plan(home_after(world), E), step.optimizer)
    migration = layer.last_migration
    out["migration"] = np.array([migration.moved_slots, migration.sent_rows,
                                 migration.moved_bytes, migration.row_bytes])
    out["home_after"] = layer.home_table.asnumpy()
    for i in range(1, TRAIN_STEPS):
        xs, dys = global_batch(world, i)
        (_, _, counts_i, _), _ = step(Tensor(xs[rows]), Tensor(dys[rows]))
        out[f"stats_{i}"] = layer.balance_stats.asnumpy().copy()
        out[f"counts_{i}"] = counts_i.asnumpy()
        out[f"exchange_{i}"] = layer.exchange_rows.asnumpy().copy()
        buffer_shape.append(layer.num_rows)
    out.update({f"trained_{n}": p.asnumpy() for n, p in zip(PARAM_NAMES, params)})
    out["buffer_rows"] = np.array(buffer_shape)
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **out)


def check(out_dir, rank, world):
    """The layer on this rank (run_checks.py has called init())."""
    run(out_dir, rank, world)
    return {}


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import run_checks

    run_checks.main(sys.argv[1], ["check_balanced_ep"])
