"""The reference runs' optimizer and what of a network's parameters is state: the learning-rate
schedule, AdamWeightDecay with its decay groups, and the per-step buffers a checkpoint skips.
Shared by the one-process trainer, the expert-parallel trainer and the checkpoint tools."""
from __future__ import annotations

import math
from typing import List

from mindspore import nn

from ms_efficient.moe.layer import ROUTING_COUNTS

__all__ = ["lr_schedule", "make_optimizer", "is_scratch"]


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
