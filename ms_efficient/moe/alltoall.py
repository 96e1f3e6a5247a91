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

Implementations (chosen in ms_efficient.backend.alltoall_impl):
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

from ms_efficient import backend

__all__ = ["AllToAll"]


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
