"""Will a training config fit this machine? An estimate made before any work starts.

The reference model (``models/gpt_moe.py``) trained with AdamWeightDecay keeps, per float32
parameter, the weight, its gradient and two moments: 16 bytes. Activations kept for the
backward pass, per block, are counted from the largest tensors of the step (float32):

* attention: ``B x heads x S x S`` scores, softmax and their gradient (3 copies) and about
  16 ``T x H`` tensors (T = B x S tokens);
* MoE FFN: the one-hot routing table ``T x top_k x E`` (3 copies) and the expert rows
  ``E x capacity`` of width ``H + F`` (3 copies); dropless (capacity factor 0) gives every
  expert ``T`` rows;
* dense FFN: ``T x F`` (3 copies).

The estimate is deliberately a lower bound of what MindSpore allocates (no workspace, no
graph-compiler copies), so a refused config certainly does not fit; it is compared with the
machine's physical memory (``/proc/meminfo`` MemTotal), not with what is free right now,
so the decision is the same on a busy machine.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Optional, Tuple

from ms_efficient.moe.split import switch_capacity

__all__ = ["Footprint", "estimate_footprint", "machine_memory_bytes", "check_fits_machine"]

_F32 = 4                 # bytes per float32 value
_ADAM_COPIES = 4         # weight, gradient, first and second moment


@dataclass
class Footprint:
    """Estimated bytes of one training process. params: parameter count; state_bytes:
    weights + gradients + optimizer moments; activation_bytes: kept for the backward pass."""

    params: int
    state_bytes: int
    activation_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.activation_bytes


def estimate_footprint(cfg) -> Footprint:
    """Estimate the memory (bytes) that training ``cfg`` (a RunConfig) needs; see module doc."""
    m, moe, tr = cfg.model, cfg.moe, cfg.train
    h, f, e, k, L = m.hidden_size, m.ffn_hidden_size, moe.num_experts, moe.top_k, m.num_layers
    moe_layers = sum(1 for i in range(L) if (i + 1) % moe.moe_every == 0)
    dense_layers = L - moe_layers
    t = tr.batch_size * m.seq_length
    embed = m.vocab_size * h + m.seq_length * h
    attn = L * (4 * h * h + 4 * h + 4 * h)                      # qkv, proj, two LayerNorms
    gated = moe.expert_kind == "glu"                  # w_gate | w_up [H, 2F] and w2 [F, H]
    f1 = 2 * f if gated else f
    experts = moe_layers * (e * (h * f1 + f1 + f * h + h) + h * e)
    fs = moe.shared_experts * f                       # shared experts: one FFN of width fs
    shared = moe_layers * ((3 if gated else 2) * h * fs)
    dense = dense_layers * (2 * h * f + f + h)
    params = embed + attn + experts + shared + dense + 2 * h
    cap = switch_capacity(t, e, k, moe.capacity_factor, moe.capacity_multiple)
    act_attn = L * (3 * tr.batch_size * m.num_heads * m.seq_length ** 2 + 16 * t * h)
    act_route = moe_layers * 3 * t * k * e
    rows = t * k if moe.layer_dispatch == "grouped" else e * cap   # dropless: every row
    act_rows = moe_layers * 3 * rows * (h + f1 + (f if gated else 0))
    act_shared = moe_layers * 3 * t * ((2 if gated else 1) * fs)
    act_dense = dense_layers * 3 * t * f
    return Footprint(params=params, state_bytes=_F32 * _ADAM_COPIES * params,
                     activation_bytes=_F32 * (act_attn + act_route + act_rows + act_shared
                                              + act_dense))


def machine_memory_bytes() -> int:
    """Physical memory of this machine in bytes (MemTotal; sysconf where /proc is absent)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# Fields that size the run; the one named is the one whose default shrinks the estimate most.
_SIZE_FIELDS = ("moe.num_experts", "model.ffn_hidden_size", "model.hidden_size",
                "model.num_layers", "model.vocab_size", "model.seq_length", "train.batch_size")


def _culprit(cfg) -> Tuple[str, object]:
    """(field, value) of the size field whose default value lowers the estimate the most."""
    best = (estimate_footprint(cfg).total_bytes, _SIZE_FIELDS[-1])
    for field in _SIZE_FIELDS:
        section, name = field.split(".")
        part = getattr(cfg, section)
        default = getattr(type(part)(), name)
        if default >= getattr(part, name):
            continue
        trial = dataclasses.replace(cfg, **{section: dataclasses.replace(part, **{name: default})})
        best = min(best, (estimate_footprint(trial).total_bytes, field))
    section, name = best[1].split(".")
    return best[1], getattr(getattr(cfg, section), name)


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_fits_machine(cfg, source: str = "", memory_bytes: Optional[int] = None) -> Footprint:
    """Raise ValueError (one line: ``source``, the size field whose default value would lower
    the estimate most, its value, the estimate and the machine's memory) when training ``cfg`` cannot fit in
    ``memory_bytes`` (default: this machine's physical memory). Returns the estimate."""
    fp = estimate_footprint(cfg)
    limit = machine_memory_bytes() if memory_bytes is None else memory_bytes
    if fp.total_bytes <= limit:
        return fp
    field, value = _culprit(cfg)
    where = f"{source}: " if source else ""
    raise ValueError(
        f"{where}'{field}' must be small enough for the run to fit this machine's "
        f"{_gib(limit)} of memory, but got {value}: training needs at least "
        f"{_gib(fp.total_bytes)} ({fp.params / 1e9:.2f} G parameters x 16 bytes = "
        f"{_gib(fp.state_bytes)} of weights, gradients and Adam moments, plus "
        f"{_gib(fp.activation_bytes)} of activations).")
