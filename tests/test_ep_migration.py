"""Re-plans move only what moved: the migration table (ep_migration; the slow level's charge
built from it is in test_moe_balance), and the optimizer state a layer's ``set_plan`` moves with the weights
(``ep_replan.weight_states``). A balanced layer's ``set_plan`` training on exactly is in
test_balanced_ep (one process) and test_ep_balanced_train (2 and 4 workers).
"""

import numpy as np
import pytest

import mindspore as ms
from mindspore import nn

from moe_reference import E, F, H, K, WeightedOutput
from ms_efficient.moe.ep_migration import migrate_rows, migration_bytes_WW, row_layout
from ms_efficient.moe.ep_replan import weight_states
from ms_efficient.moe.plan import ExpertPlan

ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")


def plan(rows_per_rank, **kwargs):
    """An ExpertPlan from the experts of every rank's rows, e.g. [[0, 1], [2, 3]]."""
    experts = [e for rows in rows_per_rank for e in rows]
    devices = [d for d, rows in enumerate(rows_per_rank) for _ in rows]
    return ExpertPlan(experts, devices, [8] * len(experts), **kwargs)


def plan_migration(old, new, budget, world, devices_per_node=None):
    """The migration between two plans laid out over ``budget`` rows of ``world`` ranks."""
    return migrate_rows(row_layout(old, budget, world), row_layout(new, budget, world),
                        devices_per_node)


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


# --- the optimizer's state of the expert weights (what set_plan moves with them) ------------

LR = 1e-2


def balanced_layer():
    """A balanced layer on one rank: the 4 experts at home, one spare slot."""
    from ms_efficient.moe.balanced_ep import BalancedExpertParallelMoE

    return BalancedExpertParallelMoE(H, F, E, K, np.array([[0, 1, 2, 3]]), 1, np.array([64]))


def test_weight_states_finds_adam_and_momentum_state_and_refuses_foreign_optimizers():
    from ms_efficient.moe.balance import home_plan

    layer = balanced_layer()
    net = WeightedOutput(layer)             # names like "layer.w1"
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
    bare = balanced_layer()
    early = nn.Adam(bare.trainable_params(), learning_rate=LR)
    WeightedOutput(bare)
    assert bare.w1.name == "layer.w1"
    assert [p.name for p in weight_states(early, (bare.w1, bare.b1, bare.w2, bare.b2))[1]] == [
        "moment2.w1", "moment2.b1", "moment2.w2", "moment2.b2"]
    with pytest.raises(ValueError, match=r"'optimizer' must optimize the layer's expert "
                                         r"weights, but it does not hold \['layer.w1', "):
        weight_states(nn.Adam([layer.router.weight], LR), weights_)
    with pytest.raises(ValueError, match=r"'optimizer' must be a mindspore.nn.Optimizer .* "
                                         r"but got dict"):
        layer.set_plan(home_plan(np.array([[3, 0, 2, 1]]), E), optimizer={})
    assert layer.home_table.asnumpy().tolist() == [[0, 1, 2, 3]]          # unchanged
