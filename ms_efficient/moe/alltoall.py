"""All-to-All for expert parallelism, native on Ascend and emulated exactly over AllGather elsewhere.

Notation: W ranks in the group, rank r. Every rank holds a send buffer x_r of shape [W*C, ...]:
W equal blocks of C rows on dim 0, block j (x_r[j]) going to rank j. After the exchange rank r
holds y_r of shape [W*C, ...] whose block i is what rank i sent to rank r:

    y_r[i] = x_i[r]                                                   (1)

so the exchange transposes the W x W block matrix X[i][j] = x_i[j].

Gradient (why the custom bprop is the exchange applied to dout). Let g_r = dL/dy_r be the
upstream gradient on rank r. By (1), x_i[r] is copied to exactly one place, y_r[i], and
nothing else reads it, so

    dL/dx_i[r] = dL/dy_r[i] = g_r[i]                                  (2)

which is (1) with g in place of x: grad_x = AllToAll(dout). In matrix terms the exchange is a
permutation P (a block transpose), its adjoint is P^T = P^-1, and a block transpose is an
involution (P P = I), so P^T = P: AllToAll is its own adjoint and its own inverse.

Implementations (chosen in ms_efficient.core.backend.alltoall_impl):
- "native" (Ascend): ops.AlltoAll(split_count=W, split_dim=0, concat_dim=0, group).
- "allgather-emulation" (CPU/GPU, world group): AllGather the send buffers to
  [W (src), W (dst), C, ...], i.e. row block i*W + j is x_i[j], and keep my column: blocks
  i*W + r for i in range(W).
- "allreduce-emulation" (CPU/GPU, named groups; the CPU AllGather kernel takes only the world
  group): place x_r in row r of a zero [W, W*C, ...] buffer and AllReduce-sum it, which gives
  the same [W (src), W*C, ...] stack as AllGather (x + 0 == x exactly), then keep my column.
Both emulations are exact, at about W (resp. 2W) times the traffic of a real All-to-All; they
are for building and testing on CPU, not for speed. The gradient of AllGather needs
ReduceScatter, which the CPU backend lacks, so the Cell defines `bprop` from (2) instead of
differentiating through the collective; the same bprop is correct for the native op.
Works in GRAPH_MODE and PYNATIVE_MODE. With W == 1 the Cell is the identity.
"""
from typing import Optional

import numpy as np
from mindspore import Tensor, nn, ops

from ms_efficient.core import backend

__all__ = ["AllToAll", "AllToAllV", "CountExchange"]


class AllToAll(nn.Cell):
    """Exchange equal row blocks with every rank of `group`: output block i = input block r of rank i.

    Args:
        group: communication group name; default the world group of the initialised backend.
        impl: one of ``backend.ALLTOALL_IMPLS``; default ``backend.alltoall_impl(group=group)``
            for this device target. Forcing an emulation on Ascend is allowed (e.g. to compare).

    Inputs:
        x: [W*C, ...] send buffer, row block j (C rows) goes to rank j. Dim 0 must be divisible
            by the group size W; every rank must pass the same shape and dtype.

    Outputs:
        [W*C, ...] receive buffer, row block i (C rows) came from rank i.
    """

    def __init__(self, group: Optional[str] = None, impl: Optional[str] = None):
        super().__init__()
        self.group = group or backend.world_group()
        self.impl = impl or backend.alltoall_impl(group=group)
        if self.impl not in backend.ALLTOALL_IMPLS:
            raise ValueError(f"'impl' must be one of {backend.ALLTOALL_IMPLS}, but got {self.impl!r}.")
        self.world = backend.group_size(self.group)
        self.rank = backend.group_rank(self.group)
        if self.world == 1:
            return
        if self.impl == backend.ALLTOALL_NATIVE:
            self.alltoall = ops.AlltoAll(split_count=self.world, split_dim=0, concat_dim=0, group=self.group)
        elif self.impl == backend.ALLTOALL_ALLGATHER_EMULATION:
            self.all_gather = ops.AllGather(group=self.group)
        else:
            self.all_reduce = ops.AllReduce(op=ops.ReduceOp.SUM, group=self.group)
            self.my_row = Tensor(np.array([[self.rank]], dtype=np.int32))  # scatter index into [W, ...]
        self.my_column = Tensor(np.array([self.rank], dtype=np.int32))  # gather index on the dst axis

    def construct(self, x):
        return self._exchange(x)

    def bprop(self, x, out, dout):
        """Gradient of the exchange: the exchange itself, by (2) in the module docstring."""
        return (self._exchange(dout),)

    def _exchange(self, x_NX):
        """N = W*C rows; the trailing dims X are carried along."""
        if self.world == 1:
            return x_NX
        if self.impl == backend.ALLTOALL_NATIVE:
            return self.alltoall(x_NX)
        n, rest = x_NX.shape[0], x_NX.shape[1:]
        if n % self.world != 0:
            raise ValueError(f"AllToAll input dim 0 must be divisible by the group size {self.world}, but got {n}.")
        # Step 1: every rank's send buffer, stacked by source rank: [W (src), N, ...]
        if self.impl == backend.ALLTOALL_ALLGATHER_EMULATION:
            sent_WNX = self.all_gather(x_NX).reshape((self.world, n) + rest)
        else:
            zeros_WNX = ops.zeros((self.world, n) + rest, x_NX.dtype)
            mine_1NX = x_NX.reshape((1, n) + rest)
            sent_WNX = self.all_reduce(ops.tensor_scatter_update(zeros_WNX, self.my_row, mine_1NX))
        # Step 2: keep the blocks addressed to me, block r of every source: [W (src), C, ...]
        sent_WWCX = sent_WNX.reshape((self.world, self.world, n // self.world) + rest)
        mine_W1CX = ops.gather(sent_WWCX, self.my_column, 1)
        return mine_W1CX.reshape((n,) + rest)


class AllToAllV(nn.Cell):
    """Exchange row blocks of static, uneven sizes with every rank of `group` (an AlltoAllV
    whose per-peer counts are fixed before compilation, so every shape is static).

    Rank r sends ``send_counts[d]`` rows to rank d (its input is the concatenation of those
    blocks in rank order) and receives ``recv_counts[i]`` rows from rank i (its output is
    the concatenation in source order). The counts must agree across ranks: rank r's
    send_counts[d] == rank d's recv_counts[r] (the caller's static tables ensure it).

    Gradient: the adjoint of an AlltoAllV is the AlltoAllV with the two count lists
    swapped (each row is copied to exactly one place, as for AllToAll).

    Implementations (``backend.alltoall_impl``):
    - "native" (Ascend): ``ops.AlltoAllV`` on the flattened buffer, ``block_size`` = one row,
      with a bprop that runs it with the counts swapped;
    - emulations (CPU/GPU): every block is padded with zero rows to ``C = max`` rows over all
      blocks of the group, exchanged with :class:`AllToAll`, and the real rows are gathered
      out: exact, at the padded traffic (for building and testing, not for speed); gathers
      and AllToAll's own bprop give the gradient.

    Args:
        send_counts: [W] ints >= 0, rows to each rank.
        recv_counts: [W] ints >= 0, rows from each rank.
        row_numel: elements of one row (product of the trailing dims, e.g. H).
        block_rows: C, the largest block of the whole group (the same on every rank; the
            emulation's padded block); default max(send_counts, recv_counts), which is only
            the same on every rank when the caller makes it so.
        group, impl: as for :class:`AllToAll`.

    Inputs: x [sum(send_counts), ...]. Outputs: [sum(recv_counts), ...].
    """

    def __init__(self, send_counts, recv_counts, row_numel: int, block_rows: Optional[int] = None,
                 group: Optional[str] = None, impl: Optional[str] = None):
        super().__init__()
        send = np.asarray(send_counts, dtype=np.int64)
        recv = np.asarray(recv_counts, dtype=np.int64)
        self.exchange = AllToAll(group=group, impl=impl)
        self.world = self.exchange.world
        if send.shape != (self.world,) or recv.shape != (self.world,) or (send < 0).any() \
                or (recv < 0).any():
            raise ValueError(f"'send_counts' and 'recv_counts' must be {self.world} ints >= 0 "
                             f"(one per rank), but got {send.tolist()} and {recv.tolist()}.")
        block = int(max(send.max(), recv.max())) if block_rows is None else int(block_rows)
        if block < max(send.max(), recv.max()):
            raise ValueError(f"'block_rows' must be >= every count ({max(send.max(), recv.max())}), "
                             f"but got {block_rows}.")
        if row_numel < 1:
            raise ValueError(f"'row_numel' must be >= 1, but got {row_numel}.")
        self.send_total, self.recv_total = int(send.sum()), int(recv.sum())
        # rows to / from every rank: what one exchange carries (the cost model's charge)
        self.send_counts = tuple(int(c) for c in send)
        self.recv_counts = tuple(int(c) for c in recv)
        self.native = self.world > 1 and self.exchange.impl == backend.ALLTOALL_NATIVE
        if self.native:
            self.send_numel = tuple(int(c) for c in send)
            self.recv_numel = tuple(int(c) for c in recv)
            self.alltoallv = ops.AlltoAllV(group=self.exchange.group, block_size=int(row_numel))
            return
        # Emulation tables: padded row j of block d reads input row pad_index[j] (send_total
        # = a zero row); output row i reads padded receive row pick[i].
        pad_index = np.full((self.world, block), self.send_total, dtype=np.int32)
        pick = []
        start = 0
        for d in range(self.world):
            pad_index[d, :send[d]] = np.arange(start, start + send[d])
            start += int(send[d])
            pick.extend(range(d * block, d * block + int(recv[d])))
        self.padded_rows = self.world * block
        self.pad_index = Tensor(pad_index.reshape(-1))
        self.pick = Tensor(np.array(pick, dtype=np.int32))

    def construct(self, x):
        if self.native:
            return self._native(x, self.send_numel, self.recv_numel, self.recv_total)
        rest = x.shape[1:]
        x_pad = ops.concat((x, ops.zeros((1,) + rest, x.dtype)), 0)
        return ops.gather(self.exchange(ops.gather(x_pad, self.pad_index, 0)), self.pick, 0)

    def bprop(self, x, out, dout):
        """Adjoint: the exchange with the count lists swapped (native); the emulation's
        gather / pad / AllToAll chain is differentiated as written."""
        if self.native:
            return (self._native(dout, self.recv_numel, self.send_numel, self.send_total),)
        rest = dout.shape[1:]
        # transpose of "gather pick" then of "exchange" then of "gather pad_index"
        grad_pad = ops.zeros((self.padded_rows,) + rest, dout.dtype)
        grad_pad = ops.tensor_scatter_add(grad_pad, self.pick.reshape(-1, 1), dout)
        grad_sent = self.exchange(grad_pad)
        grad_x = ops.unsorted_segment_sum(grad_sent, self.pad_index, self.send_total + 1)
        return (grad_x[:self.send_total],)

    def _native(self, x, send_numel, recv_numel, rows_out):
        rest = x.shape[1:]
        out = self.alltoallv(x.reshape(-1), send_numel, recv_numel)
        return out.reshape((rows_out,) + rest)


class CountExchange(nn.Cell):
    """``construct(count_S int32 [S]) -> int32 [W, S]``: every rank's counts, row r from
    rank r (an AllGather; on a named group on CPU, an AllReduce of a zero [W, S] table with
    this rank's row filled, as :mod:`~ms_efficient.moe.alltoall`'s emulation). Counts carry no
    gradient: the backward is zero (the CPU AllGather has no backward)."""

    def __init__(self, world: int, rank: int, group: Optional[str] = None):
        super().__init__()
        self.world = world
        self.gather_rows = False
        if world == 1:
            return
        group = group or backend.world_group()
        if backend.alltoall_impl(group=group) == backend.ALLTOALL_ALLREDUCE_EMULATION:
            self.all_reduce = ops.AllReduce(op=ops.ReduceOp.SUM, group=group)
            self.my_row = Tensor(np.array([[rank]], dtype=np.int32))
        else:
            self.gather_rows = True
            self.all_gather = ops.AllGather(group=group)

    def construct(self, count_S):
        row_1S = count_S.reshape(1, -1)
        if self.world == 1:
            return row_1S
        if self.gather_rows:
            return self.all_gather(row_1S)
        table_WS = ops.zeros((self.world, row_1S.shape[1]), row_1S.dtype)
        return self.all_reduce(ops.tensor_scatter_update(table_WS, self.my_row, row_1S))

    def bprop(self, count_S, out, dout):
        """No gradient through counts."""
        return (ops.zeros_like(count_S),)
