"""MPipeMoE's chunked MoE layer: ``PipelinedMoE`` runs an MoE layer on ``chunks`` slices of
the batch, so on Ascend the All-to-All of one chunk can overlap the expert compute of
another (the chunks are independent in the graph; MindSpore's multi-stream scheduling
runs communication and compute side by side). The chunk count is chosen by
:mod:`ms_efficient.mpipe.planner` and fixed at compile time (a new count recompiles).

Semantics: chunk i is the i-th slice of the batch dimension, each through the same layer
(same parameters), so capacities apply per chunk: build the inner layer with a chunk's
capacity (``ceil(capacity / chunks)``; dropless layers stay dropless). Outputs:
y concatenated in batch order, counts and dropped summed over chunks, aux_loss the mean of
the chunks' load-balancing losses (each is the Switch loss of its chunk's tokens).
"""
from __future__ import annotations

from mindspore import nn, ops

__all__ = ["PipelinedMoE"]


class PipelinedMoE(nn.Cell):
    """``construct(x_BSH) -> (y_BSH, aux_loss, counts_RE, dropped)`` of ``layer`` (an
    :class:`~ms_efficient.moe.layer.MoEFeedForward` or
    :class:`~ms_efficient.moe.balanced_ep.BalancedExpertParallelMoE`) over ``chunks`` equal slices of
    the batch B (B must be divisible by ``chunks``)."""

    def __init__(self, layer: nn.Cell, chunks: int):
        super().__init__()
        if chunks < 1:
            raise ValueError(f"'chunks' must be >= 1, but got {chunks}.")
        self.layer = layer
        self.chunks = int(chunks)

    def construct(self, x):
        b = x.shape[0]
        if b % self.chunks != 0:
            raise ValueError(f"PipelinedMoE: batch {b} is not divisible by chunks "
                             f"{self.chunks}.")
        step = b // self.chunks
        ys = ()
        aux = None
        counts = None
        dropped = None
        for i in range(self.chunks):
            y, a, c, d = self.layer(x[i * step:(i + 1) * step])
            ys = ys + (y,)
            aux = a if aux is None else aux + a
            counts = c if counts is None else counts + c
            dropped = d if dropped is None else dropped + d
        y_all = ys[0] if self.chunks == 1 else ops.concat(ys, 0)
        return y_all, aux / self.chunks, counts, dropped
