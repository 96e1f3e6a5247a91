"""Re-plans move only what moved: the migration table (ep_migration), the schedule's charge
built from it, and ExpertParallelMoE.set_plan moving weight rows with their Adam moments.

Numpy tests first; then one process (W = 1, GRAPH_MODE): after set_plan(plan, optimizer) a
training step equals the step of a fresh layer built with the new plan and given the same
expert weights and moments; the slow test reads tests/dist/check_ep_migration.py's results on
2 CPU workers (the session's one msrun job of the 2-worker checks, tests/workers.py) and
compares with MoEFeedForward trained on the whole batch.
"""

import numpy as np
import pytest

import mindspore as ms
from mindspore import Tensor, nn

from tests import workers
from ms_efficient.efficientmoe.cost import CostModel
from ms_efficient.efficientmoe.replay import cluster_for_ranks
from ms_efficient.efficientmoe.schedule import (ReplanCosts, decide_replan, migration_bytes_DD,
                                                migration_time_s)
from ms_efficient.moe.ep_layer import ExpertParallelMoE, init_expert_weights
from ms_efficient.moe.ep_migration import migration_bytes_WW, plan_migration, row_layout
from ms_efficient.moe.ep_replan import weight_states
from ms_efficient.moe.layer import MoEFeedForward
from ms_efficient.moe.plan import ExpertPlan

ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")


def plan(rows_per_rank, **kwargs):
    """An ExpertPlan from the experts of every rank's rows, e.g. [[0, 1], [2, 3]]."""
    experts = [e for rows in rows_per_rank for e in rows]
    devices = [d for d, rows in enumerate(rows_per_rank) for _ in rows]
    return ExpertPlan(experts, devices, [8] * len(experts), **kwargs)


# --- the migration table (numpy) ---------------------------------------------------------------


def test_an_expert_moving_to_another_rank_is_one_row_from_its_old_row():
    m = plan_migration(plan([[0, 1], [2]]), plan([[0], [2, 1]]), budget=2, world=2)
    assert m.old_expert_WB.tolist() == [[0, 1], [2, -1]]
    assert m.new_expert_WB.tolist() == [[0, -1], [2, 1]]
    assert m.src_rank_WB.tolist() == [[-1, -1], [-1, 0]]
    assert m.src_row_WB.tolist() == [[-1, -1], [-1, 1]]
    assert m.rows_WW.tolist() == [[0, 1], [0, 0]]
    assert m.cleared_WB.tolist() == [[False, True], [False, False]]
    assert m.moved_slots == 1 and m.sent_rows == 1
    assert m.send_rows(0).tolist() == [1] and m.send_rows(1).tolist() == []
    assert m.receive_index(1).tolist() == [-1, 0] and m.receive_index(0).tolist() == [-1, -1]


def test_a_replica_comes_from_its_own_rank_when_it_can_and_crosses_ranks_once():
    old = plan([[0, 1], [2, 3]])
    # rank 0 adds expert 3 (only rank 1 has it); rank 1 adds a second copy of its expert 2
    m = plan_migration(old, plan([[0, 1, 3], [2, 3, 2]]), budget=3, world=2)
    assert m.src_rank_WB.tolist() == [[-1, -1, 1], [-1, -1, 1]]
    assert m.src_row_WB.tolist() == [[-1, -1, 1], [-1, -1, 0]]
    assert m.local_WB.tolist() == [[False] * 3, [False, False, True]]
    assert m.rows_WW.tolist() == [[0, 0], [1, 0]] and m.moved_slots == 2
    # two new copies of expert 0 on rank 1, which had none: the row is sent once, used twice
    m = plan_migration(old, plan([[0, 1, 3], [2, 0, 0]]), budget=3, world=2)
    assert m.src_rank_WB[1].tolist() == [-1, 0, 0] and m.src_row_WB[1].tolist() == [-1, 0, 0]
    assert m.rows_WW.tolist() == [[0, 1], [1, 0]] and m.moved_slots == 3
    assert m.send_rows(0).tolist() == [0] and m.send_rows(1).tolist() == [1]
    assert m.receive_index(1).tolist() == [-1, 0, 0] and m.receive_index(0).tolist() == [-1, -1, 0]


def test_a_swap_across_ranks_sends_one_row_each_way_and_on_one_rank_sends_nothing():
    m = plan_migration(plan([[0, 1], [2, 3]]), plan([[0, 3], [2, 1]]), budget=2, world=2)
    assert m.src_rank_WB.tolist() == [[-1, 1], [-1, 0]]
    assert m.src_row_WB.tolist() == [[-1, 1], [-1, 1]]
    assert m.rows_WW.tolist() == [[0, 1], [1, 0]] and m.moved_slots == 2
    m = plan_migration(plan([[0, 1], [2, 3]]), plan([[1, 0], [2, 3]]), budget=2, world=2)
    assert m.src_rank_WB.tolist() == [[0, 0], [-1, -1]]
    assert m.src_row_WB.tolist() == [[1, 0], [-1, -1]]
    assert m.rows_WW.sum() == 0 and m.moved_slots == 2


def test_no_change_moves_nothing():
    p = plan([[0, 1], [2, 3, 0]])
    m = plan_migration(p, p, budget=4, world=2)
    assert m.moved_slots == 0 and m.sent_rows == 0 and not m.cleared_WB.any()
    assert (m.src_rank_WB == -1).all() and m.rows_WW.tolist() == [[0, 0], [0, 0]]


def test_rows_a_rank_sends_follow_the_order_the_destination_needs_them():
    m = plan_migration(plan([[0, 1, 2], [3]]), plan([[0], [3, 2, 1]]), budget=3, world=2)
    assert m.rows_WW.tolist() == [[0, 2], [0, 0]]
    assert m.send_rows(0).tolist() == [2, 1]
    assert m.receive_index(1).tolist() == [-1, 0, 1]


def test_a_remote_copy_prefers_the_destinations_node_then_the_lowest_rank():
    old = plan([[0], [1], [0], [2]])                   # expert 0 on ranks 0 and 2
    new = plan([[0], [1], [0], [0, 2]])                # rank 3 needs expert 0 (2 moves down)
    lowest = plan_migration(old, new, 2, 4)
    assert lowest.src_rank_WB[3].tolist() == [0, 3] and lowest.src_row_WB[3].tolist() == [0, 0]
    assert lowest.rows_WW[0, 3] == 1 and lowest.sent_rows == 1
    near = plan_migration(old, new, 2, 4, devices_per_node=2)
    assert near.src_rank_WB[3].tolist() == [2, 3] and near.rows_WW[2, 3] == 1


def test_bad_migrations_raise_value_errors_naming_the_value():
    with pytest.raises(ValueError, match=r"expert 2 has no copy in the old plan .* \(rank 1 "
                                         r"needs it in row 0"):
        plan_migration(plan([[0], [1]]), plan([[0], [2]]), 1, 2)
    with pytest.raises(ValueError, match=r"'budget' .* must be >= the most slots a rank holds, "
                                         r"3 \(per rank \[3, 1\]\), but got 2"):
        plan_migration(plan([[0, 1, 2], [3]]), plan([[0], [1, 2, 3]]), 2, 2)
    with pytest.raises(ValueError, match=r"'slot_device' must be in \[0, 2\) for 2 ranks, but "
                                         r"got \[0, 1, 2\]"):
        row_layout(plan([[0], [1], [2]]), 1, 2)
    with pytest.raises(ValueError, match=r"'optimizer_states' must be >= 0, but got 1.0 and -1"):
        migration_bytes_WW(np.zeros((2, 2)), 1.0, -1)


def test_the_schedule_charges_the_rows_of_the_migration_table_times_row_bytes():
    """Two layers on 4 devices of one node: bytes [src, dst] = the sum over layers of
    plan_migration's rows x expert_params x bytes_per_param x (1 + optimizer states)."""
    cluster = cluster_for_ranks(4)
    model = CostModel(cluster, 64, 256)
    old = [plan([[0, 1], [2], [3], [4]]), plan([[0], [1], [2], [3, 4]])]
    new = [plan([[0], [2, 1], [3], [4, 1]]), plan([[4], [1], [2, 0], [3, 0]])]
    num_devices = cluster.num_devices                  # the node's 8 chips, 4 used
    rows = [plan_migration(a, b, 2, num_devices, cluster.devices_per_node).rows_WW
            for a, b in zip(old, new)]
    assert rows[0][:4, :4].tolist() == [[0, 1, 0, 1], [0] * 4, [0] * 4, [0] * 4]
    assert rows[1][:4, :4].tolist() == [[0, 0, 1, 1], [0] * 4, [0] * 4, [1, 0, 0, 0]]
    assert rows[0].sum() + rows[1].sum() == 5
    for states, per_param in ((2, 12.0), (0, 4.0), (1, 8.0)):
        got = migration_bytes_DD(old, new, model, 4.0, states)
        expected = (rows[0] + rows[1]) * model.expert_params * per_param
        np.testing.assert_array_equal(got, expected)
        np.testing.assert_array_equal(
            got, sum(migration_bytes_WW(r, model.expert_params * 4.0, states) for r in rows))
    decision = decide_replan(1.0, 0.5, old, new, model, ReplanCosts())   # float32 + Adam
    assert decision.migration_bytes == 5 * model.expert_params * 12.0
    assert decision.migration_s == pytest.approx(migration_time_s(old, new, model))
    assert migration_bytes_DD(old, old, model).sum() == 0
    with pytest.raises(ValueError, match="optimizer_states >= 0"):
        ReplanCosts(optimizer_states=-1)


# --- one process: set_plan moves weights and Adam moments -------------------------------------

E, H, F, K = 4, 16, 32, 2
B, S = 2, 8
T = B * S
LR = 1e-2
EXPERT_PARAMS = ("w1", "b1", "w2", "b2")
# both plans: one buffer of K*T rows (dropless); B permutes the slots and replicates expert 0
PLAN_FROM = ExpertPlan([0, 1, 2, 3], [0] * 4, [8] * 4, dispatch="grouped")
PLAN_TO = ExpertPlan([3, 0, 2, 1, 0], [0] * 5, [8, 6, 8, 8, 2], dispatch="grouped")


class Loss(nn.Cell):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def construct(self, x, dy):
        y, aux, _, _ = self.layer(x)
        return (y * dy).sum() + 0.1 * aux


def weights(seed=5):
    router, w1, b1, w2, b2 = init_expert_weights(E, H, F, init_std=0.3, seed=seed)
    rng = np.random.default_rng(seed)
    return (router, w1, rng.normal(0, 0.1, b1.shape).astype(np.float32), w2,
            rng.normal(0, 0.1, b2.shape).astype(np.float32))


def batch(step):
    rng = np.random.default_rng(50 + step)
    return tuple(Tensor(rng.standard_normal((B, S, H)).astype(np.float32)) for _ in range(2))


def trained_layer(expert_plan, w):
    """(layer, Adam, train step) of a grouped layer with 5 weight rows."""
    layer = ExpertParallelMoE(H, F, E, K, expert_plan, slots_per_device=5)
    layer.set_weights(*w)
    adam = nn.Adam(layer.trainable_params(), learning_rate=LR)
    return layer, adam, nn.TrainOneStepCell(Loss(layer), adam)


def state(layer, adam):
    """{name: array} of the layer's parameters and their Adam moments (rows as stored;
    copies: asnumpy shares the parameter's memory, which later steps update in place)."""
    out = {}
    for i, p in enumerate(adam.parameters):
        out[p.name] = p.asnumpy().copy()
        out["m." + p.name] = adam.moment1[i].asnumpy().copy()
        out["v." + p.name] = adam.moment2[i].asnumpy().copy()
    return out


def count_compiles(monkeypatch):
    return workers.load_script("check_ep_moe").count_compiles(monkeypatch.setattr)


def test_a_step_after_set_plan_with_adam_equals_the_step_of_a_layer_built_with_the_new_plan(
        monkeypatch):
    """One Adam step on PLAN_FROM, set_plan(PLAN_TO, adam) (every slot permuted, expert 0
    replicated: local copies only), one more step: loss, outputs, weights and moments equal
    a fresh PLAN_TO layer whose weights and moments were set to the same expert values.
    Without the optimizer the moments stay behind and the step differs."""
    w = weights()
    layer, adam, step = trained_layer(PLAN_FROM, w)
    step(*batch(0))
    before = state(layer, adam)
    scalars = {n: getattr(adam, n).asnumpy().copy()
               for n in ("beta1_power", "beta2_power", "global_step")}
    rows_before = {e: i for i, e in enumerate(PLAN_FROM.slot_expert.tolist())}
    compiled = count_compiles(monkeypatch)
    layer.set_plan(PLAN_TO, optimizer=adam)
    assert layer.local_experts.tolist() == PLAN_TO.slot_expert.tolist()
    record = layer.last_migration
    assert (record.moved_slots, record.sent_rows, record.moved_bytes) == (4, 0, 0.0)
    assert record.optimizer_states == 2 and record.row_bytes == 4 * (2 * H * F + F + H)
    assert record.log_entry(7) == {"kind": "replan", "step": 7, "moved_slots": 4,
                                   "moved_bytes": 0.0, "recompiled": False}
    loss = step(*batch(1)).asnumpy()
    assert compiled == []                               # the compiled step ran the new plan

    fresh, fresh_adam, fresh_step = trained_layer(PLAN_TO, w)
    rows = [rows_before[int(e)] for e in PLAN_TO.slot_expert]     # each new row's old row
    for i, p in enumerate(fresh_adam.parameters):
        name = p.name
        for prefix, target in (("", p), ("m.", fresh_adam.moment1[i]),
                               ("v.", fresh_adam.moment2[i])):
            value = before[prefix + name]
            expert = name.rsplit(".", 1)[-1] in EXPERT_PARAMS          # "layer.w1"
            target.set_data(Tensor(value[rows] if expert else value))
    for name, value in scalars.items():
        getattr(fresh_adam, name).set_data(Tensor(value))
    loss_ref = fresh_step(*batch(1)).asnumpy()

    np.testing.assert_allclose(loss, loss_ref, rtol=1e-6)
    for got, ref in zip(layer(batch(2)[0]), fresh(batch(2)[0])):
        np.testing.assert_allclose(got.asnumpy(), ref.asnumpy(), rtol=1e-6, atol=1e-6)
    after, after_ref = state(layer, adam), state(fresh, fresh_adam)
    assert sorted(after) == sorted(after_ref)
    for name in after:
        np.testing.assert_allclose(after[name], after_ref[name], rtol=1e-6, atol=1e-6,
                                   err_msg=name)
    assert np.abs(after["m.layer.w1"]).max(axis=(1, 2)).min() > 0    # moments in every row

    # the control: without the optimizer, slot i keeps the moments of its old expert
    stale, stale_adam, stale_step = trained_layer(PLAN_FROM, w)
    stale_step(*batch(0))
    stale.set_plan(PLAN_TO)
    assert stale.last_migration.optimizer_states == 0
    stale_step(*batch(1))
    moved = state(stale, stale_adam)
    assert np.abs(moved["m.layer.w1"] - after_ref["m.layer.w1"]).max() > 1e-3
    assert np.abs(moved["layer.w1"] - after_ref["layer.w1"]).max() > 1e-4


def test_weight_states_finds_adam_and_momentum_state_and_refuses_foreign_optimizers():
    layer = ExpertParallelMoE(H, F, E, K, PLAN_FROM, slots_per_device=5)
    net = Loss(layer)                       # names like "layer.w1"
    weights_ = (layer.w1, layer.b1, layer.w2, layer.b2)
    adam = nn.Adam(net.trainable_params(), learning_rate=LR)
    found = weight_states(adam, weights_)
    assert [[p.name for p in kind] for kind in found] == [
        [f"moment1.{w.name}" for w in weights_], [f"moment2.{w.name}" for w in weights_]]
    momentum = nn.Momentum(net.trainable_params(), LR, 0.9)
    assert [[p.name for p in kind] for kind in weight_states(momentum, weights_)] == [
        [f"moments.{w.name}" for w in weights_]]
    sgd = weight_states(nn.SGD(net.trainable_params(), LR), weights_)     # its accum, stat
    assert [kind[0].name for kind in sgd] == ["accum.layer.w1", "stat.layer.w1"]
    # built before a wrapper renamed the weights ("w1" -> "layer.w1"): found by position
    bare = ExpertParallelMoE(H, F, E, K, PLAN_FROM, slots_per_device=5)
    early = nn.Adam(bare.trainable_params(), learning_rate=LR)
    Loss(bare)
    assert bare.w1.name == "layer.w1"
    assert [p.name for p in weight_states(early, (bare.w1, bare.b1, bare.w2, bare.b2))[1]] == [
        "moment2.w1", "moment2.b1", "moment2.w2", "moment2.b2"]
    with pytest.raises(ValueError, match=r"'optimizer' must optimize the layer's expert "
                                         r"weights, but it does not hold \['layer.w1', "):
        weight_states(nn.Adam([layer.router.weight], LR), weights_)
    with pytest.raises(ValueError, match=r"'optimizer' must be a mindspore.nn.Optimizer .* "
                                         r"but got dict"):
        layer.set_plan(PLAN_TO, optimizer={})
    assert layer.local_experts.tolist() == PLAN_FROM.slot_expert.tolist()   # unchanged


# --- 2 workers (msrun) ------------------------------------------------------------------------


@pytest.mark.slow
@workers.needs_msrun
def test_two_workers_move_experts_and_adam_state_and_train_as_if_nothing_moved(dist_checks):
    """A grouped layer on 2 ranks takes an Adam step, set_plan moves expert 2 from rank 0 to
    rank 1, swaps experts 1 and 3 and replicates expert 0 on rank 1 (one AlltoAllV whose
    counts are plan_migration's), and takes another step on the compiled graph: outputs,
    weights and Adam moments of every slot equal MoEFeedForward trained on the whole batch."""
    wk = workers.load_script("check_ep_migration")
    out_dir = dist_checks / "check_ep_migration"

    # the reference: the whole batch on one dense layer, never moved
    w = wk.logical_weights()
    ref = MoEFeedForward(wk.H, wk.F, wk.E, wk.K, capacity=wk.WORLD * wk.T_LOCAL)
    params = [ref.router.weight, ref.w1, ref.b1, ref.w2, ref.b2]
    for p, a in zip(params, w):
        p.set_data(Tensor(a))

    class RefLoss(nn.Cell):
        def __init__(self, layer):
            super().__init__()
            self.layer = layer

        def construct(self, x, dy):
            return (self.layer(x)[0] * dy).sum()

    adam = nn.Adam(params, learning_rate=wk.LR)
    step = nn.TrainOneStepCell(RefLoss(ref), adam)
    step(*(Tensor(a) for a in wk.global_batch(0)))
    x1, dy1 = wk.global_batch(1)
    y_ref = ref(Tensor(x1))[0].asnumpy()
    step(Tensor(x1), Tensor(dy1))
    trained = {n: p.asnumpy() for n, p in zip(wk.PARAM_NAMES, params)}
    moments = {f"{kind}_{n}": m.asnumpy() for kind, tup in (("m", adam.moment1),
                                                             ("v", adam.moment2))
               for n, m in zip(wk.PARAM_NAMES, tup)}
    migration = plan_migration(ExpertPlan(**wk.BEFORE), ExpertPlan(**wk.AFTER), wk.BUDGET,
                               wk.WORLD)
    assert migration.rows_WW.tolist() == wk.EXPECTED_ROWS_WW

    slot_expert = np.asarray(wk.AFTER["slot_expert"])
    for r in range(wk.WORLD):
        got = np.load(out_dir / f"rank{r}.npz")
        # what moved: the function's table, carried by one exchange
        assert got["rows_WW"].tolist() == wk.EXPECTED_ROWS_WW
        assert int(got["exchanges"]) == 1
        assert got["exchange_send"].tolist() == migration.rows_WW[r].tolist()
        assert got["exchange_recv"].tolist() == migration.rows_WW[:, r].tolist()
        assert int(got["exchange_rows"]) == migration.rows_WW[:, r].sum()
        assert int(got["moved_slots"]) == migration.moved_slots == 4
        assert float(got["moved_bytes"]) == migration_bytes_WW(
            migration.rows_WW, int(got["row_bytes"]), 2).sum() == 4 * int(got["row_bytes"]) * 3
        assert int(got["compiled_after_replan"]) == 0 and int(got["dropped"]) == 0
        # the step after the move is the step without it
        np.testing.assert_allclose(got["y"], y_ref[r * wk.B:(r + 1) * wk.B], rtol=1e-5,
                                   atol=1e-6)
        experts = slot_expert[got["local_slots"]]
        n = experts.size
        np.testing.assert_allclose(got["trained_router"], trained["router"], rtol=1e-4,
                                   atol=1e-5)
        for name in wk.PARAM_NAMES[1:]:
            for key, ref_values in ((f"trained_{name}", trained[name]),
                                    (f"m_{name}", moments[f"m_{name}"]),
                                    (f"v_{name}", moments[f"v_{name}"])):
                np.testing.assert_allclose(got[key][:n], ref_values[experts], rtol=1e-4,
                                           atol=1e-5, err_msg=f"rank {r} {key}")
                assert not got[key][n:].any(), (r, key)          # empty rows: zeros
