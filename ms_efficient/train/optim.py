"""How a training step updates the weights: the reference runs' optimizer (the learning-rate
schedule, AdamWeightDecay with its decay groups) and what of a network's parameters is state
(the per-step buffers a checkpoint skips), shared by the one-process trainer, the
expert-parallel trainer and the checkpoint tools; and the gradient reduction of networks with
expert-parallel MoE layers with the ``TrainOneStepCell`` users train them with.

In a W-rank job every rank computes the loss of its own rows of the global batch. The mean of
the ranks' losses is the one-process loss of the global batch (equal rows per rank), so:

    dense gradients (everything outside the experts: attention, norms, embeddings, routers,
        shared experts): one flat AllReduce, / W (data parallelism);
    expert gradients (the rows of each rank's home slots): / W only: the All-to-All's
        backward already summed every rank's contribution into the slot that computed it;
    optionally clipped by the global norm, every slot weighted by 1 / (replicas of its
        expert) so a replicated expert counts once.

:class:`TrainOneStepCell` is the drop-in for ``nn.TrainOneStepCell`` in a user's msrun script
(after ``ms_efficient.adopt_moe(network, tokens=T, expert_parallel=True)``); with one rank it
is ``nn.TrainOneStepCell``'s step.
"""
from __future__ import annotations

import math
from typing import List

import numpy as np
import mindspore as ms
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops
from mindspore.ops import composite as C, functional as F

from ms_efficient.core import backend
from ms_efficient.core.params import write_parameter
from ms_efficient.moe.balanced_ep import BalancedExpertParallelMoE
from ms_efficient.moe.layer import ROUTING_COUNTS

__all__ = ["lr_schedule", "make_optimizer", "is_scratch", "GradReducer", "TrainOneStepCell",
           "expert_parallel_layers"]

EP_LAYERS = (BalancedExpertParallelMoE,)


def lr_schedule(peak: float, warmup: int, total: int, floor: float = 0.1) -> List[float]:
    """Per-step learning rate: linear warm-up to ``peak``, cosine decay to ``floor * peak``."""
    rates = []
    for step in range(total):
        if step < warmup:
            rates.append(peak * (step + 1) / warmup)
        else:
            progress = (step - warmup) / max(1, total - warmup)
            rates.append(peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))))
    return rates


def make_optimizer(net: nn.Cell, tr) -> nn.AdamWeightDecay:
    """AdamWeightDecay of the reference runs over ``net``'s trainable parameters: weight decay
    ``tr.weight_decay`` on matrices (ndim >= 2) except embeddings, none elsewhere; the
    learning rate of :func:`lr_schedule` per step (``tr``: the ``train`` config section)."""
    params = net.trainable_params()
    decay = [p for p in params if p.ndim >= 2 and "embedding" not in p.name]
    no_decay = [p for p in params if not (p.ndim >= 2 and "embedding" not in p.name)]
    return nn.AdamWeightDecay(
        [{"params": decay, "weight_decay": tr.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        learning_rate=lr_schedule(tr.learning_rate, tr.warmup_steps, tr.steps),
        beta1=0.9, beta2=0.95, eps=1e-8)


def is_scratch(name: str) -> bool:
    """Parameters that are per-step buffers, not state: the MoE layers' last routing counts,
    and the step a dropout site draws its mask for (the trainers set it before every step)."""
    return name.rsplit(".", 1)[-1] in (ROUTING_COUNTS, "dropout_step")



def expert_parallel_layers(network: nn.Cell) -> list:
    """The expert-parallel MoE layers of ``network``, in ``cells_and_names`` order."""
    return [c for _, c in network.cells_and_names() if isinstance(c, EP_LAYERS)]


_unflatten = C.MultitypeFuncGraph("_unflatten")


@_unflatten.register("Tensor", "Number", "Number", "Tuple", "Number", "Tensor")
def _unflatten_one(flat, offset, size, shape, world, grad):
    """One gradient of a W-rank step: a dense one (``size`` > 0) read back from ``flat``, the
    AllReduce-summed dense gradients / W, at ``offset``; an expert one / W (the All-to-All's
    backward summed it)."""
    if size > 0:
        return ops.reshape(ops.slice(flat, (offset,), (size,)), shape)
    return grad / world


_dense_square = C.MultitypeFuncGraph("_dense_square")


@_dense_square.register("Number", "Tensor")
def _dense_square_one(size, grad):
    """Squared norm of a dense gradient (``size`` > 0), 0 for an expert one (``size`` 0:
    weighted per slot apart)."""
    if size > 0:
        return (grad * grad).sum()
    return ops.zeros((), ms.float32)


_scale = C.MultitypeFuncGraph("_scale")


@_scale.register("Tensor", "Tensor")
def _scale_one(scale, grad):
    return grad * scale


class GradReducer(nn.Cell):
    """``construct(grads) -> grads`` for ``params`` (the optimizer's order): dense gradients
    averaged over the W ranks (one AllReduce of them flattened), expert gradients divided by W,
    then all clipped by the global norm ``clip`` (0: no clipping) as
    ``ops.clip_by_global_norm`` clips the one-process gradients. ``norm_weight_{j}`` float32
    [S_b] of MoE layer j: 1 / replicas of the slot's expert, 0 for empty slots; data
    (Parameters): call :meth:`set_plans` after every re-plan (the trainer does; in a
    ``Model.train`` loop with ``EfficientMoECallback``, do it when its ``plans`` grows).
    ``grads``: the tuple of gradients, one per parameter, each of its parameter's shape.

    Built from ``HyperMap`` over the gradient tuple, not a Python loop, because every EP rank
    compiles it: the loop (index the tuple, split the flat buffer, rebuild the tuple) took 3.6
    of the 8.4 CPU-s of a W = 1 train-step compile (scripts/time_test_compiles.py at commit
    a7f48c6). With one rank nothing is reduced."""

    def __init__(self, params, layers: List[BalancedExpertParallelMoE], world: int,
                 clip: float):
        super().__init__()
        owner = {}
        for j, layer in enumerate(layers):
            for p in layer.expert_params():
                owner[id(p)] = j
        kind = [owner.get(id(p), -1) for p in params]        # -1: dense
        self.dense = tuple(i for i, k in enumerate(kind) if k < 0)
        self.experts = tuple((i, k) for i, k in enumerate(kind) if k >= 0)
        # dense gradient i at flat[offsets[i]:offsets[i] + sizes[i]] (size 0: an expert's)
        self.sizes = tuple(int(np.prod(p.shape)) if k < 0 else 0 for p, k in zip(params, kind))
        self.offsets = tuple(int(o) for o in np.cumsum((0,) + self.sizes)[:-1])
        self.shapes = tuple(tuple(p.shape) for p in params)
        self.world, self.clip = world, float(clip)
        self.worlds = (world,) * len(params)                     # HyperMap's per-gradient W
        self.weights = ParameterTuple([Parameter(Tensor(np.zeros(layer.budget, np.float32)),
                                                 name=f"norm_weight_{j}", requires_grad=False)
                                       for j, layer in enumerate(layers)])
        self.set_plans(layers)
        self.hyper_map = C.HyperMap()
        if world > 1:
            self.all_reduce = ops.AllReduce(op=ops.ReduceOp.SUM)

    def set_plans(self, layers: List[BalancedExpertParallelMoE]) -> None:
        """Slot weights of the layers' current plans (call after every ``set_plan``)."""
        for layer, weight in zip(layers, self.weights):
            local = np.asarray(layer.local_experts)
            replicas = layer.plan.replica_counts(layer.num_experts)
            values = np.zeros(layer.budget, np.float32)
            values[:local.size] = 1.0 / replicas[local]
            write_parameter(weight, values)     # in place: the jit train step sees it

    def construct(self, grads):
        if self.world > 1:
            flat = ops.concat([grads[i].reshape(-1) for i in self.dense])
            flat = self.all_reduce(flat) / self.world
            grads = self.hyper_map(F.partial(_unflatten, flat), self.offsets, self.sizes,
                                   self.shapes, self.worlds, grads)
        if self.clip <= 0:
            return grads
        sq = ops.addn(self.hyper_map(_dense_square, self.sizes, grads))
        expert_sq = ops.zeros((), ms.float32)
        for i, j in self.experts:
            g = grads[i]
            rows = (g * g).reshape(g.shape[0], -1).sum(axis=1)
            expert_sq = expert_sq + (rows * self.weights[j]).sum()
        if self.world > 1:
            expert_sq = self.all_reduce(expert_sq)
        norm = ops.sqrt(sq + expert_sq)
        norm = ops.select(norm >= self.clip, norm, ops.fill(ms.float32, (), self.clip))
        return self.hyper_map(F.partial(_scale, self.clip / norm), grads)


class TrainOneStepCell(nn.Cell):
    """``construct(*inputs) -> loss``: one optimizer step of ``network`` (a Cell returning
    this rank's scalar loss), as ``nn.TrainOneStepCell`` but with the gradients of a network
    holding expert-parallel MoE layers reduced over the world group (:class:`GradReducer`:
    dense ones averaged over the ranks, expert ones / W), then clipped by the global norm
    ``clip`` (0: none). Returns this rank's loss (the mean over ranks is the global batch's).

    Args:
        network: the loss Cell (``nn.WithLossCell`` or the user's own).
        optimizer: built over the network's Parameters after ``adopt_moe(...,
            expert_parallel=True)`` (the adopted layers hold new expert Parameters).
        sens: the loss's gradient scale (as ``nn.TrainOneStepCell``).
        clip: the global gradient-norm bound (0: no clipping).

    After a re-plan moves experts (``EfficientMoECallback`` or ``layer.set_plan``), call
    :meth:`set_plans` so the clipping weights follow (data: no recompile).
    """

    def __init__(self, network: nn.Cell, optimizer: nn.Optimizer, sens: float = 1.0,
                 clip: float = 0.0):
        super().__init__(auto_prefix=False)
        if not clip >= 0:
            raise ValueError(f"'clip' must be >= 0 (0: no clipping), but got {clip!r}.")
        self.network = network
        self.network.set_grad()
        self.optimizer = optimizer
        self.weights = optimizer.parameters
        self.layers = expert_parallel_layers(network)
        self.world = backend.group_size()
        known = {id(p) for p in self.weights}
        missing = sorted(p.name for layer in self.layers for p in layer.expert_params()
                         if id(p) not in known)
        if missing:
            raise ValueError(f"the optimizer does not update the expert Parameters {missing}; "
                             f"build it after adopt_moe(..., expert_parallel=True).")
        self.reducer = GradReducer(self.weights, self.layers, self.world, clip)
        self.grad = C.GradOperation(get_by_list=True, sens_param=True)
        self.sens = float(sens)

    def set_plans(self) -> None:
        """The clipping weights of the layers' current plans (after a re-plan)."""
        self.reducer.set_plans(self.layers)

    def construct(self, *inputs):
        loss = self.network(*inputs)
        sens = ops.fill(loss.dtype, loss.shape, self.sens)
        grads = self.grad(self.network, self.weights)(*inputs, sens)
        grads = self.reducer(grads)
        self.optimizer(grads)
        return loss
