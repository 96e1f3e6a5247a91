"""RoutingTraceCallback: the EfficientMoE load sampler as a MindSpore training callback.

Any training loop that runs MindSpore callbacks (``mindspore.train.Model.train``, MindFormers'
trainer) can record the routing trace with it:

    cb = RoutingTraceCallback(network, "trace.npz")
    Model(network, optimizer=opt).train(epochs, dataset, callbacks=[cb])

Every MoE layer of the package (``MoEFeedForward``, ``ExpertParallelMoE``) assigns the counts
of its last forward to its ``routing_counts`` buffer (int32 [R, E], R = its ``trace_ranks``);
at the end of each training step the callback copies those buffers to the host, stacks them
as one trace row [layer, src_rank, expert] and keeps it in a :class:`RoutingSampler`. The file,
in the trace format of :mod:`ms_efficient.moe.trace`, is written atomically at the end of
training and every ``save_every`` steps. ``overhead_s`` is the host time the callback took
(the cost of leaving it on); the trainer of this package records the same counts from its
step outputs instead.

Two things the callback cannot change: with ``dataset_sink_mode=True`` MindSpore runs step
callbacks once per sink, so only every ``sink_size``-th step is recorded (use sink_size=1, or
no sink, for every step); and in an expert-parallel run each rank's layers count that rank's
tokens only, so give every rank its own ``path`` (e.g. with the rank id in it).
"""
from __future__ import annotations

import logging
import time
from typing import List, Optional

import numpy as np
from mindspore import nn
from mindspore.train import Callback

from ms_efficient.efficientmoe.planner import RoutingSampler
from ms_efficient.moe.layer import ROUTING_COUNTS
from ms_efficient.moe.trace import RoutingTrace, save_trace

__all__ = ["RoutingTraceCallback"]

logger = logging.getLogger(__name__)


class RoutingTraceCallback(Callback):
    """Record per-step routing counts of every MoE layer of ``network`` into a trace.

    Args:
        network: the Cell being trained (or any Cell containing its MoE layers).
        path: ``.npz`` file the trace is written to (None: keep it in memory, see ``trace()``).
        save_every: also write the file every this many steps (0: at the end only).

    Raises ValueError when ``network`` has no MoE layer with a ``routing_counts`` buffer.
    """

    def __init__(self, network: nn.Cell, path: Optional[str] = None, save_every: int = 0):
        super().__init__()
        if isinstance(save_every, bool) or not isinstance(save_every, int) or save_every < 0:
            raise ValueError(f"'save_every' must be an integer >= 0, but got {save_every!r}.")
        self.layers: List[nn.Cell] = [c for _, c in network.cells_and_names()
                                      if hasattr(c, ROUTING_COUNTS)]
        if not self.layers:
            raise ValueError(f"'network' ({type(network).__name__}) has no MoE layer with a "
                             f"'{ROUTING_COUNTS}' buffer (MoEFeedForward, ExpertParallelMoE).")
        self.path = path
        self.save_every = save_every
        self.sampler = RoutingSampler()
        self.steps: List[int] = []
        self.overhead_s = 0.0

    def on_train_step_end(self, run_context) -> None:
        start = time.perf_counter()
        counts = np.stack([getattr(layer, ROUTING_COUNTS).asnumpy() for layer in self.layers])
        self.sampler.record(counts)
        self.steps.append(int(run_context.original_args().cur_step_num))
        if self.path and self.save_every and len(self.steps) % self.save_every == 0:
            save_trace(self.trace(), self.path)
        self.overhead_s += time.perf_counter() - start

    def on_train_end(self, run_context) -> None:
        if self.path and len(self.sampler):
            save_trace(self.trace(), self.path)
            logger.info("routing trace of %d steps written to %s (sampler host time %.3f ms "
                        "per step)", len(self.steps), self.path,
                        1e3 * self.overhead_s / len(self.steps))

    def trace(self) -> RoutingTrace:
        """The recorded steps as a RoutingTrace (top_k, hidden and tokens per source rank
        from the first layer and the first step)."""
        if not len(self.sampler):
            raise ValueError("no training step has been recorded yet.")
        counts = self.sampler.counts()
        first = self.layers[0]
        top_k = int(first.top_k)
        return RoutingTrace(counts=counts, top_k=top_k, hidden=int(first.hidden_size),
                            tokens_per_rank=int(counts[0, 0, 0].sum()) // top_k,
                            steps=np.array(self.steps, np.int64))
