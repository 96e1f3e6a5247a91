"""The count-driven exchange the balanced layer dispatches with (``CountedAllToAllV``).

The collective (Ascend ``ops.AlltoAllVC``) cannot run here; these tests go up to it: the
packing before and the unpacking after it (checked against a numpy exchange), and which
implementation the backend picks."""
import numpy as np
import pytest

from mindspore import Tensor

from ms_efficient.core import backend
from ms_efficient.moe.counted_alltoall import (CountedAllToAllV, block_layout, pack_rows,
                                               unpack_rows)


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
