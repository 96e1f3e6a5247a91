"""EfficientMoE in a user's training: the load sampler and the online planner as MindSpore
callbacks, and the ``efficientmoe`` pass.

Any training loop that runs MindSpore callbacks (``mindspore.train.Model.train``, MindFormers'
trainer) can record the routing trace with it:

    cb = RoutingTraceCallback(network, "trace.npz")
    Model(network, optimizer=opt).train(epochs, dataset, callbacks=[cb])

Every MoE layer of the package (``MoEFeedForward``, ``BalancedExpertParallelMoE``) assigns the counts
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
tokens only, so give every rank its own ``path`` (e.g. with the rank id in it). Reused across
several ``Model.train`` calls, the callback keeps numbering steps upwards.

:class:`EfficientMoECallback` is EfficientMoE's slow level for a user's ``Model.train`` loop on
expert-parallel layers (``BalancedExpertParallelMoE``: what ``train --workers`` builds with
dispatch "balanced" and what ``adopt_moe(..., expert_parallel=True)`` puts in a user's
network): it samples like the trace callback and every ``replan_every`` steps
:class:`~ms_efficient.efficientmoe.ep_replanner.HomeReplanner` decides from the all-gathered
counts (each layer's ``world_counts``, the same on every rank) whether new home tables pay
for their move, and applies them with ``set_plan`` (weights and optimizer moments move, no
recompilation), then tells the package's ``TrainOneStepCell`` the new plans. A one-process
network has one device and nothing to place: the callback refuses it; its "static"
capacities are sized before compiling by the ``efficientmoe`` pass from a recorded trace.
"""
from __future__ import annotations

import logging
import time
from typing import List, Optional

import numpy as np
from mindspore import nn
from mindspore.train import Callback

from ms_efficient.core.config import EfficientMoEConfig, RunConfig, history_trace_path
from ms_efficient.core.registry import PassRefused, register_pass
from ms_efficient.efficientmoe.capacity import static_capacities
from ms_efficient.efficientmoe.sampler import RoutingSampler
from ms_efficient.adopt.replace import adopt_hint
from ms_efficient.moe.layer import ROUTING_COUNTS
from ms_efficient.moe.trace import RoutingTrace, load_trace, save_trace

__all__ = ["RoutingTraceCallback", "EfficientMoECallback", "efficientmoe_pass"]

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
                             f"'{ROUTING_COUNTS}' buffer (MoEFeedForward, MoEMLP, "
                             f"BalancedExpertParallelMoE).{adopt_hint(network)}")
        self.path = path
        self.save_every = save_every
        self.sampler = RoutingSampler()
        self.steps: List[int] = []
        self.overhead_s = 0.0
        self._offset = 0          # added to MindSpore's step numbers (see on_train_begin)
        self._run_start = 0       # len(steps) when the current Model.train call began

    def on_train_begin(self, run_context) -> None:
        # Model.train numbers steps from 1 in every call; the trace keeps counting up
        self._run_start = len(self.steps)
        self._offset = 0

    def on_train_step_end(self, run_context) -> None:
        start = time.perf_counter()
        counts = np.stack([getattr(layer, ROUTING_COUNTS).asnumpy() for layer in self.layers])
        self.sampler.record(counts)
        step = int(run_context.original_args().cur_step_num)
        if len(self.steps) == self._run_start and self.steps and step <= self.steps[-1]:
            self._offset = self.steps[-1]      # a new Model.train call counts from 1 again
        self.steps.append(step + self._offset)
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


class EfficientMoECallback(RoutingTraceCallback):
    """EfficientMoE's slow level inside ``Model.train`` on balanced expert-parallel layers.

    Args:
        network: the Cell being trained; its ``BalancedExpertParallelMoE`` layers (also those
            ``adopt_moe(..., expert_parallel=True)`` put in place of a user's MoE blocks)
            are re-placed.
        config: a RunConfig (its ``efficientmoe`` section and ``cluster``, whose links price
            a move) or an EfficientMoEConfig (priced on the ``cpu-local`` preset).
        path, save_every: as for :class:`RoutingTraceCallback` (the trace is kept too).

    ``plans`` lists every adopted home re-placement (every rank runs the callback):
    ``{"kind": "replan", "step", "moved_slots", "moved_bytes", "recompiled"}`` and the
    modelled gain and migration; ``checks`` every verdict of the slow level, adopted or not,
    with its reason. Raises ValueError when the network has no balanced expert-parallel
    layer (one-process layers have one device and nothing to place).
    """

    def __init__(self, network: nn.Cell, config, path: Optional[str] = None,
                 save_every: int = 0):
        super().__init__(network, path, save_every)
        if isinstance(config, RunConfig):
            em, cluster = config.efficientmoe, config.cluster_spec()
        elif isinstance(config, EfficientMoEConfig):
            from ms_efficient.core.cluster import get_cluster

            em, cluster = config, get_cluster("cpu-local")
        else:
            raise TypeError(f"'config' must be a RunConfig or an EfficientMoEConfig, but got "
                            f"{type(config).__name__}.")
        self.cfg, self.cluster = em, cluster
        self.plans: List[dict] = []
        self.checks: List[dict] = []
        balanced = [c for c in self.layers if hasattr(c, "home_table")
                    and hasattr(c, "world_counts")]
        if not balanced:
            raise ValueError(
                f"'network' ({type(network).__name__}) has no expert-parallel MoE layer "
                f"(BalancedExpertParallelMoE) to re-place: EfficientMoE places experts over "
                f"the ranks of an msrun job (adopt_moe(network, tokens=T, expert_parallel="
                f"True) after mindspore.communication.init()). One-process layers have one "
                f"device: use RoutingTraceCallback to record their routing, and size 'static' "
                f"capacities before compiling with the efficientmoe pass.")
        from ms_efficient.efficientmoe.ep_replanner import HomeReplanner, balanced_cost_model

        self.layers = balanced
        self._pending = None
        self._replanner = HomeReplanner(
            balanced, em, balanced_cost_model(
                balanced, cluster if isinstance(config, RunConfig) else None))

    def on_train_step_end(self, run_context) -> None:
        super().on_train_step_end(run_context)
        self._balanced_step(run_context)

    def _settle_pending(self, network) -> None:
        """The last applied re-plan's ``recompiled``: whether the step after it compiled a
        graph (the count of compiled graphs before the re-plan against now)."""
        if self._pending is not None:
            record, before = self._pending
            after = _compiled_graphs(network)
            record["recompiled"] = None if before is None else after != before
            self._pending = None

    def _balanced_step(self, run_context) -> None:
        """Balanced layers: the step's all-gathered counts to :class:`HomeReplanner`, which at
        its checks re-places the home experts when the modelled gain over ``replan_every``
        steps pays for the move (``set_plan`` on every layer, the optimizer's moments moved
        with the weights); the package's ``TrainOneStepCell`` then learns the new plans. Every
        rank runs it with the same counts, so every rank takes the same decision."""
        args = run_context.original_args()
        network = getattr(args, "train_network", None)
        self._settle_pending(network)
        counts_LWE = np.stack([layer.world_counts.asnumpy() for layer in self.layers])
        self._replanner.observe(counts_LWE.astype(np.int64))
        optimizer = _optimizer_of(args, network)
        # steps left in this Model.train call (its own count: a callback reused across calls
        # keeps numbering its steps upwards)
        total = getattr(args, "epoch_num", 0) * getattr(args, "batch_num", 0)
        done = getattr(args, "cur_step_num", 0)
        if total and done >= total:                   # the last step: no step left to gain
            return
        record = self._replanner.maybe_replan(len(self.steps), optimizer,
                                              total - done if total and done else None)
        check = self._replanner.last_check
        if check is not None:
            check["step"] = self.steps[-1]
            self.checks.append(check)
        if record is None:
            return
        record["step"] = self.steps[-1]
        told = 0
        for _, cell in (network.cells_and_names() if network is not None else ()):
            if callable(getattr(cell, "set_plans", None)) and hasattr(cell, "reducer"):
                cell.set_plans()
                told += 1
        if not told:
            logger.warning("step %d: the home experts moved, but the train network has no "
                           "ms_efficient.TrainOneStepCell to tell: a replicated expert's "
                           "gradients are not summed over its replicas", self.steps[-1])
        self.plans.append(record)
        self._pending = (record, _compiled_graphs(network))


def _compiled_graphs(network) -> Optional[int]:
    """Graphs compiled so far (:func:`~ms_efficient.efficientmoe.ep_replanner.
    compiled_graphs`)."""
    from ms_efficient.efficientmoe.ep_replanner import compiled_graphs

    return compiled_graphs(network)


def _optimizer_of(args, network):
    """The optimizer of ``Model.train``'s run (``args.optimizer``), else the first
    ``nn.Optimizer`` inside the train network (``Model(train_cell)``), else None."""
    optimizer = getattr(args, "optimizer", None)
    if optimizer is None and network is not None:
        optimizer = next((c for _, c in network.cells_and_names()
                          if isinstance(c, nn.Optimizer)), None)
    return optimizer


@register_pass("efficientmoe")
def efficientmoe_pass(network: nn.Cell, context) -> tuple:
    """The ``efficientmoe`` pass on a one-process network: per-expert capacities of every
    "static" ``MoEFeedForward`` (under any attribute names; the layer inside a drop-in
    ``MoEMLP`` and the layers ``ms_efficient.adopt_moe`` put in place of a user's own MoE
    blocks too), sized before compilation from the routing trace ``efficientmoe.history``:
    per layer the fewest rows whose drops over the trace's last ``efficientmoe.window`` rows
    stay within ``efficientmoe.drop_target``, in multiples of ``capacity_multiple``
    (:func:`~ms_efficient.efficientmoe.capacity.static_capacities`). Raises PassRefused (a
    ValueError) without MoE layers, with 'grouped' ones, or when the layers already have
    those capacities; ValueError without a history or for a trace of other shapes (config
    errors)."""
    from ms_efficient.moe.layer import MoEFeedForward

    layers = [(p, c) for p, c in network.cells_and_names() if isinstance(c, MoEFeedForward)]
    if not layers:
        raise PassRefused(f"efficientmoe: found no MoEFeedForward layer in the network; the pass "
                          f"sizes the capacities of the package's MoE layer (MoEFeedForward, "
                          f"or MoEMLP around one).{adopt_hint(network)}")
    grouped = [p for p, c in layers if c.dispatch == "grouped"]
    if grouped:
        raise PassRefused(f"efficientmoe: MoE layers {grouped} use dispatch 'grouped': on one "
                          f"device they compute only their routed rows and have no capacities "
                          f"to size; plan an expert-parallel run's layout with "
                          f"`ms-efficient plan moe`.")
    em = context.config.efficientmoe
    if not em.history:
        raise ValueError("efficientmoe: the pass sizes capacities before compilation from a "
                         "routing trace: set efficientmoe.history (a trace.npz written by "
                         "RoutingTraceCallback or `ms-efficient train`).")
    path = history_trace_path(em.history)
    load = load_trace(path).counts.sum(axis=2)                     # [t, layer, expert]
    want = (len(layers), layers[0][1].num_experts)
    if load.shape[1:] != want or len(load) < 1:
        raise ValueError(f"efficientmoe: trace {path} has {len(load)} rows of [layer, expert] "
                         f"= {list(load.shape[1:])}; the network needs >= 1 row of "
                         f"{list(want)}.")
    first = layers[0][1]
    tokens = int(load[-1, 0].sum()) // int(first.top_k)
    recent = load[-em.window:]
    sized = static_capacities(recent, em.drop_target, em.capacity_multiple, max_load=tokens)
    caps_LE = sized.capacity_LE
    current = np.array([c.capacities for _, c in layers], np.int64)
    if np.array_equal(current, caps_LE):
        raise PassRefused("efficientmoe: the MoE layers already have the capacities the trace "
                          "gives; nothing to change.")
    for (_, layer), caps in zip(layers, caps_LE):
        layer.set_capacities([int(c) for c in caps])
    return network, {"kind": "efficientmoe", "history": path, "trace_rows": int(len(recent)),
                     "rows_before": int(current.sum()), "rows_after": int(caps_LE.sum()),
                     "drop_rate_on_trace": sized.drop_rate,
                     "padding_fraction_on_trace": sized.padding_fraction,
                     "cells": {p: {"capacities": [int(c) for c in caps]}
                               for (p, _), caps in zip(layers, caps_LE)}}
