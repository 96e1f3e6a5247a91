"""The token exchange of ``"counts"`` plans: an AlltoAllV whose per-peer counts are data.

A ``"counts"`` plan (:mod:`ms_efficient.moe.plan`) keeps the ``"grouped"`` layout: rank r owns
a send block of C[r, d] rows for device d (the plan's upper bound, ``plan.send_rows(W)``) and
device d a receive buffer of sum_src C[src, d] rows, all static shapes. What differs is the
wire: rank r sends d only the n[r, d] <= C[r, d] rows it keeps this step, where n = the
``sent_WW`` count matrix every rank derives from the count exchange the grouped layer already
runs (:func:`device_counts`). These are exactly the rows
:func:`~ms_efficient.moe.exchange.exchange_rows` gives a "counts" plan, what the cost model
charges.

Shapes: W ranks, H = ``row_numel``, M = sum_d C[r, d] rows of this rank's send layout (block d
at offset sum_{d' < d} C[r, d'], its first n[r, d] rows real), I = sum_s C[s, r] rows of its
receive layout (block s at offset sum_{s' < s} C[s', r], its first n[s, r] rows real, the rest
zeros).

Implementations (``backend.counted_alltoall_impl``):
- "native" (Ascend): the real rows are packed to the front (:func:`pack_rows`), sent by
  ``ops.AlltoAllVC`` with the Tensor count matrix n (``block_size`` = one row; MindSpore 2.10
  documents it for Ascend, GRAPH mode, with a registered bprop), and the received rows, whose
  number is data (a dynamic shape), are placed back into the static receive layout
  (:func:`unpack_rows`). The adjoint runs the same chain with n transposed. Not run here (no
  Ascend); the packing and unpacking are tested on CPU against a numpy exchange.
- "block-emulation" (CPU / GPU, no count-driven collective): the static blocks C go through
  :class:`~ms_efficient.moe.alltoall.AllToAllV`. The same values (the unfilled rows of a block
  are zeros on both sides), the padded traffic: for building and testing.

Cost of the native path beyond its rows: the count matrix must reach the host to size the
receive buffer and the collective's messages before each of the step's exchanges (a
device-to-host copy that drains the stream). The cost model charges it as
``CostModel.dynamic_exchange_s`` per exchange (:mod:`ms_efficient.efficientmoe.cost`).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

from ms_efficient.core import backend
from ms_efficient.moe.alltoall import AllToAllV

__all__ = ["CountedAllToAllV", "device_counts", "pack_rows", "unpack_rows", "block_layout"]


def block_layout(block_W: np.ndarray):
    """(block_M int32 [M], q_M int32 [M]): the block and the index within it of every row of a
    layout of consecutive blocks of ``block_W`` (int [W]) rows."""
    block_W = np.asarray(block_W, dtype=np.int64)
    block_M = np.repeat(np.arange(block_W.size), block_W)
    start_W = np.cumsum(block_W) - block_W
    return block_M.astype(np.int32), (np.arange(block_M.size) - start_W[block_M]).astype(np.int32)


def device_counts(kept_WV, device_onehot_VD):
    """int32 [W, D]: rows every rank sends every device, from the kept rows of every (rank,
    budget slot) ``kept_WV`` int32 [W, V] and the slots' devices ``device_onehot_VD`` int32
    [V, D] (what the grouped layer computes from its count exchange)."""
    num_ranks = kept_WV.shape[0]
    per_WVD = kept_WV.reshape(num_ranks, -1, 1) * device_onehot_VD.reshape(
        (1,) + device_onehot_VD.shape)
    return per_WVD.sum(axis=1).astype(ms.int32)


def pack_rows(x_MH, count_W, block_M, q_M):
    """[M, H]: the first count_W[b] rows of every block b of ``x_MH`` (blocks as given by
    ``block_M``, ``q_M`` from :func:`block_layout`), moved to the front in block order; the
    tail is zeros. count_W: int32 [W], at most the blocks' sizes."""
    m = x_MH.shape[0]
    start_W = ops.cumsum(count_W, 0) - count_W
    valid_M = q_M < ops.gather(count_W, block_M, 0)
    dest_M = ops.select(valid_M, ops.gather(start_W, block_M, 0) + q_M,
                        ops.fill(ms.int32, q_M.shape, m))
    packed = ops.zeros((m + 1,) + x_MH.shape[1:], x_MH.dtype)
    packed = ops.tensor_scatter_update(packed, dest_M.reshape(-1, 1), x_MH)
    return packed[:m]


def unpack_rows(packed_NH, count_W, block_I, q_I):
    """[I, H]: the inverse of :func:`pack_rows` into a layout of I rows (``block_I``, ``q_I``
    from :func:`block_layout`): row q of block b takes packed row sum(count_W[:b]) + q when
    q < count_W[b], else zeros. ``packed_NH`` may have any number N >= sum(count_W) of rows
    (a dynamic shape on Ascend, N = sum(count_W)); its rows past sum(count_W) must be zeros
    (:func:`pack_rows` leaves them so), as row sum(count_W) is the one read for zeros."""
    start_W = ops.cumsum(count_W, 0) - count_W
    valid_I = q_I < ops.gather(count_W, block_I, 0)
    zero_row = ops.fill(ms.int32, q_I.shape, 0) + count_W.sum().astype(ms.int32)
    src_I = ops.select(valid_I, ops.gather(start_W, block_I, 0) + q_I, zero_row)
    padded = ops.concat((packed_NH, ops.zeros((1,) + packed_NH.shape[1:], packed_NH.dtype)), 0)
    return ops.gather(padded, src_I, 0)


class CountedAllToAllV(nn.Cell):
    """``construct(x_MH, sent_WW) -> y_IH``: rank ``rank`` sends every rank d the first
    sent_WW[rank, d] rows of its block d and receives the first sent_WW[s, rank] rows of
    every rank s's block (module docstring).

    Args:
        block_WW: int [W, W], C[s, d]: the rows rank s may send rank d (the plan's
            ``send_rows(W)``), the same on every rank; sets the static layouts.
        rank: this process's rank in ``group``.
        row_numel: H, elements of one row.
        group: communication group (default: the world group).
        impl: "native" or "block-emulation" (default: ``backend.counted_alltoall_impl()``).

    Inputs: x_MH [M, H]; sent_WW int32 [W, W], sent_WW <= C, the same on every rank (data).
    Outputs: y_IH [I, H]. Gradient: the adjoint exchange (counts transposed); none for counts.
    """

    def __init__(self, block_WW, rank: int, row_numel: int, group: Optional[str] = None,
                 impl: Optional[str] = None):
        super().__init__()
        block = np.asarray(block_WW, dtype=np.int64)
        if block.ndim != 2 or block.shape[0] != block.shape[1] or (block < 0).any():
            raise ValueError(f"'block_WW' must be a square [rank, rank] array of ints >= 0, but "
                             f"got {block.tolist()}.")
        self.world = block.shape[0]
        if not 0 <= rank < self.world:
            raise ValueError(f"'rank' must be in [0, {self.world}), but got {rank}.")
        self.impl = impl or backend.counted_alltoall_impl()
        if self.impl not in (backend.COUNTED_NATIVE, backend.COUNTED_BLOCK_EMULATION):
            raise ValueError(f"'impl' must be {backend.COUNTED_NATIVE!r} or "
                             f"{backend.COUNTED_BLOCK_EMULATION!r}, but got {self.impl!r}.")
        self.rank, self.row_numel = int(rank), int(row_numel)
        self.send_W, self.recv_W = block[self.rank], block[:, self.rank]
        self.native = self.world > 1 and self.impl == backend.COUNTED_NATIVE
        self.identity = self.world == 1
        if self.identity:
            return
        if not self.native:
            cap = int(block.max())
            self.forward = AllToAllV(self.send_W, self.recv_W, row_numel, cap, group)
            self.adjoint = AllToAllV(self.recv_W, self.send_W, row_numel, cap, group)
            return
        send_block, send_q = block_layout(self.send_W)
        recv_block, recv_q = block_layout(self.recv_W)
        self.send_block_M, self.send_q_M = Tensor(send_block), Tensor(send_q)
        self.recv_block_I, self.recv_q_I = Tensor(recv_block), Tensor(recv_q)
        group = group or backend.world_group()
        self.alltoallvc = ops.AlltoAllVC(group=group, block_size=self.row_numel)
        self.alltoallvc_t = ops.AlltoAllVC(group=group, block_size=self.row_numel,
                                           transpose=True)

    def construct(self, x_MH, sent_WW):
        if self.identity:
            return x_MH
        if not self.native:
            return self.forward(x_MH)
        return self._exchange(x_MH, sent_WW, self.alltoallvc, sent_WW[self.rank],
                              sent_WW[:, self.rank], self.send_block_M, self.send_q_M,
                              self.recv_block_I, self.recv_q_I)

    def bprop(self, x_MH, sent_WW, out, dout):
        """Adjoint: the exchange back (receive layout -> send layout), counts transposed."""
        if self.identity:
            return dout, ops.zeros_like(sent_WW)
        if not self.native:
            return self.adjoint(dout), ops.zeros_like(sent_WW)
        grad = self._exchange(dout, sent_WW, self.alltoallvc_t, sent_WW[:, self.rank],
                              sent_WW[self.rank], self.recv_block_I, self.recv_q_I,
                              self.send_block_M, self.send_q_M)
        return grad, ops.zeros_like(sent_WW)

    def _exchange(self, x, sent_WW, collective, out_W, in_W, out_block, out_q, in_block,
                  in_q):
        """pack the out_W real rows of x's blocks -> count-driven AlltoAllVC -> unpack the
        in_W received rows into the static layout of (in_block, in_q)."""
        packed = pack_rows(x, out_W, out_block, out_q)
        flat = collective(packed.reshape(-1), sent_WW.reshape(-1).astype(ms.int64))
        return unpack_rows(flat.reshape(-1, self.row_numel), in_W, in_block, in_q)
