"""The "counts" dispatch: grouped blocks as upper bounds, exactly the kept rows on the wire.

The collective (Ascend ``ops.AlltoAllVC``) cannot run here; these tests go up to it: the rows
it would carry (exchange_rows, the cost model's charge), the per-peer counts the layer derives
in its graph, the packing before and the unpacking after it (checked against a numpy
exchange), and a one-process layer that builds and matches the grouped layer."""
import numpy as np
import pytest

from mindspore import Tensor

from ms_efficient.core import backend
from ms_efficient.core.cluster import get_cluster
from ms_efficient.efficientmoe.cost import CostModel, layer_cost, uneven_alltoall_time_s
from ms_efficient.moe.counted_alltoall import (CountedAllToAllV, block_layout, device_counts,
                                               pack_rows, unpack_rows)
from ms_efficient.moe.exchange import exchange_rows, slot_rows_by_device
from ms_efficient.moe.plan import DISPATCH_MODES, ExpertPlan
from ms_efficient.moe.split import grouped_assignments

NODE_1x8 = get_cluster("ascend910b-1x8")
BLOCKS = [[10, 3], [9, 9]]
COUNTS = np.array([[4, 4, 2, 3], [1, 1, 1, 1]])


def _plan(dispatch, blocks=BLOCKS):
    return ExpertPlan([0, 1, 2, 3], [0, 0, 1, 1], [1] * 4, dispatch=dispatch, send_block=blocks)


def test_counts_is_a_plan_dispatch_that_round_trips_with_its_reported_target(tmp_path):
    assert "counts" in DISPATCH_MODES
    plan = ExpertPlan([0, 1], [0, 1], [4, 4], dispatch="counts", send_block=[[2, 3], [4, 5]],
                      drop_target=0.0005, expected_drop_rate=0.0002)
    back = ExpertPlan.from_dict(plan.to_dict())
    assert back.dispatch == "counts" and back.grouped
    assert back.drop_target == 0.0005 and back.expected_drop_rate == 0.0002
    with pytest.raises(ValueError, match="drop_target"):
        ExpertPlan([0], [0], [1], drop_target=1.5)


def test_a_counts_plan_sends_exactly_the_kept_rows_where_grouped_sends_whole_blocks():
    """Rank 0 routes 8 rows to device 0 (block 10) and 5 to device 1 (block 3: 2 drop);
    rank 1 routes 2 and 2 (blocks 9 and 9). Grouped sends the blocks, counts the kept rows."""
    grouped = exchange_rows(_plan("grouped"), 4, [0, 1], 2, counts_RE=COUNTS)
    counts = exchange_rows(_plan("counts"), 4, [0, 1], 2, counts_RE=COUNTS)
    assert grouped.tolist() == BLOCKS
    assert counts.tolist() == [[8, 3], [2, 2]]
    with pytest.raises(ValueError, match="counts_RE"):
        exchange_rows(_plan("counts"), 4, [0, 1], 2)
    # the same drops as grouped: only the overflowing pair's tail
    assert grouped_assignments(_plan("counts"), COUNTS, [0, 1])[1] == 2


def test_the_cost_model_charges_counts_its_kept_rows_plus_the_dynamic_exchange_overhead():
    counts_RE = np.full((4, 8), 64)                      # 128 rows from every rank to every device
    model = CostModel(NODE_1x8, 256, 1024)
    kw = dict(slot_expert=list(range(8)), slot_device=[0, 0, 1, 1, 2, 2, 3, 3],
              slot_capacity=[1] * 8, send_block=np.full((4, 4), 300))
    grouped = layer_cost(ExpertPlan(dispatch="grouped", **kw), counts_RE, model, np.arange(4))
    counts = layer_cost(ExpertPlan(dispatch="counts", **kw), counts_RE, model, np.arange(4))
    sent_DD = np.zeros((8, 8))
    sent_DD[:4, :4] = 128                                # the kept rows, not the 300-row blocks
    assert counts.a2a_time_s == pytest.approx(
        model.a2a_passes * uneven_alltoall_time_s(sent_DD * 512, NODE_1x8))
    assert counts.a2a_time_s < grouped.a2a_time_s
    assert counts.exchange_time_s == pytest.approx(
        grouped.exchange_time_s + model.a2a_passes * model.dynamic_exchange_s)
    assert counts.compute_time_s == grouped.compute_time_s and counts.dropped == 0
    with pytest.raises(ValueError, match="dynamic_exchange_s"):
        CostModel(NODE_1x8, 256, 1024, dynamic_exchange_s=-1.0)


def test_the_layers_per_peer_counts_equal_exchange_rows_for_the_step():
    """The [W, W] matrix the layer passes to the collective (device_counts of the kept rows
    per slot) is exchange_rows of the "counts" plan: 3 ranks, a replicated expert, one
    overflowing pair."""
    plan = ExpertPlan([0, 1, 2, 3, 0], [0, 0, 1, 2, 2], [6, 4, 5, 5, 6], dispatch="counts",
                      send_block=[[6, 3, 5], [4, 4, 4], [2, 2, 9]])
    counts_RE = np.array([[5, 2, 4, 1], [3, 3, 3, 3], [6, 0, 1, 4]])
    kept_RS, _ = grouped_assignments(plan, counts_RE, [0, 1, 2])
    onehot_SD = (plan.slot_device[:, None] == np.arange(3)[None]).astype(np.int32)
    sent = device_counts(Tensor(kept_RS.astype(np.int32)), Tensor(onehot_SD)).asnumpy()
    expected = exchange_rows(plan, 4, [0, 1, 2], 3, counts_RE=counts_RE)
    assert sent.tolist() == expected.tolist()
    assert (expected <= plan.send_rows(3, 3)).all() and (expected < plan.send_rows(3, 3)).any()
    assert expected.tolist() == slot_rows_by_device(kept_RS, plan.slot_device, 3).tolist()


def test_packing_a_numpy_alltoallvc_and_unpacking_give_the_block_exchange():
    """What the native path does around ops.AlltoAllVC, with the collective done in numpy:
    every rank packs the real rows of its blocks to the front, rank d receives from every s
    the sent[s, d] rows of s's segment for d, in source order, and unpacks them into its
    static receive layout: equal to what the static blocks' exchange delivers."""
    rng = np.random.default_rng(3)
    block_WW = np.array([[3, 0, 2], [1, 4, 2], [2, 2, 1]])
    sent_WW = np.array([[2, 0, 2], [0, 3, 1], [2, 1, 0]])
    h, world = 5, 3
    x_by_rank, packed_by_rank = [], []
    for r in range(world):
        rows = []
        for d in range(world):
            blk = np.zeros((block_WW[r, d], h), np.float32)
            blk[:sent_WW[r, d]] = rng.normal(size=(sent_WW[r, d], h))
            rows.append(blk)
        x = np.concatenate(rows)
        x_by_rank.append(x)
        blk, q = block_layout(block_WW[r])
        packed = pack_rows(Tensor(x), Tensor(sent_WW[r].astype(np.int32)), Tensor(blk),
                           Tensor(q)).asnumpy()
        n = sent_WW[r].sum()
        assert np.array_equal(packed[:n], np.concatenate(
            [x[block_WW[r, :d].sum():block_WW[r, :d].sum() + sent_WW[r, d]]
             for d in range(world)]))
        assert not packed[n:].any()
        packed_by_rank.append(packed)
    for d in range(world):
        # numpy AlltoAllVC: from every source s, the rows s packed for d
        recv = np.concatenate([packed_by_rank[s][sent_WW[s, :d].sum():
                                                 sent_WW[s, :d].sum() + sent_WW[s, d]]
                               for s in range(world)])
        blk, q = block_layout(block_WW[:, d])
        out = unpack_rows(Tensor(recv), Tensor(sent_WW[:, d].astype(np.int32)), Tensor(blk),
                          Tensor(q)).asnumpy()
        # the static block exchange: block s of d's receive layout = s's block for d
        expected = np.concatenate([x_by_rank[s][block_WW[s, :d].sum():
                                                block_WW[s, :d].sum() + block_WW[s, d]]
                                   for s in range(world)])
        assert np.array_equal(out, expected)


def test_backend_picks_alltoallvc_on_ascend_and_the_block_emulation_elsewhere():
    assert backend.counted_alltoall_impl("Ascend") == backend.COUNTED_NATIVE
    assert backend.counted_alltoall_impl("CPU") == backend.COUNTED_BLOCK_EMULATION
    with pytest.raises(ValueError, match="impl"):
        CountedAllToAllV([[1]], 0, 4, impl="nccl")
    with pytest.raises(ValueError, match="block_WW"):
        CountedAllToAllV([[1, 2]], 0, 4)
