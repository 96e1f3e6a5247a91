"""Expert plan: logical experts -> physical slots (replicas) on devices (one MoE layer).

Notation (as in deepseek-ai/EPLB): E logical experts, S physical slots, D devices. A slot is
one copy of one expert's weights on one device. Replicas of one expert hold identical
weights; their gradients are summed.

    slot_expert:   int64 [S], logical expert id of each physical slot
    slot_device:   int64 [S], device that hosts each slot
    slot_capacity: int64 [S], rows of each slot per step (the balanced layer's home table
                   as a plan, :func:`~ms_efficient.moe.balance.home_plan`: its devices'
                   buffers are the layout's, so these are informational)

What it stores: an expert-parallel run's home table per MoE layer in ``state.json`` and in
its checkpoints' logical state, which ``checkpoint export`` and a resize read
(:mod:`ms_efficient.train.relayout`). Plans saved by the retired one-level planner carry more
keys (``rank_share``, ``device_buffer``, ``send_block``, ``top_k``, ``tokens_per_step``,
``drop_target``, ``expected_drop_rate``); :meth:`ExpertPlan.from_dict` reads such a plan and
drops them (where every expert lives is all a run folder needs of it).
No MindSpore import here: plans are plain numpy and YAML-ready dicts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Mapping

import numpy as np

__all__ = ["ExpertPlan", "DISPATCH_MODES"]

# the dispatch a plan names: "grouped" for the balanced layer's home tables; the others
# are read from run folders of the retired one-level layers
DISPATCH_MODES = ("alltoallv", "static", "grouped", "counts")
# keys of the retired one-level planner's plans: read and dropped (module docstring)
RETIRED_KEYS = ("rank_share", "device_buffer", "send_block", "top_k", "tokens_per_step",
                "drop_target", "expected_drop_rate")


def _int_vector(name: str, values: Any) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"ExpertPlan '{name}' must be a non-empty 1-D array, but got shape "
                         f"{arr.shape}.")
    if not np.issubdtype(arr.dtype, np.integer):
        if not np.all(np.isfinite(arr)) or not np.all(arr == np.round(arr)):
            raise ValueError(f"ExpertPlan '{name}' must hold integers, but got {arr.tolist()}.")
    return arr.astype(np.int64)


@dataclass
class ExpertPlan:
    """Where every expert replica lives (one MoE layer; module docstring).

    slot_expert: int64 [S], logical expert of each physical slot.
    slot_device: int64 [S], device id of each slot (node-major ids of a ClusterSpec).
    slot_capacity: int64 [S], rows of each slot per step (>= 0).
    method: label of what made the plan.
    dispatch: one of DISPATCH_MODES.
    """

    slot_expert: np.ndarray
    slot_device: np.ndarray
    slot_capacity: np.ndarray
    method: str = ""
    dispatch: str = "alltoallv"

    def __post_init__(self) -> None:
        if self.dispatch not in DISPATCH_MODES:
            raise ValueError(f"ExpertPlan 'dispatch' must be one of {list(DISPATCH_MODES)}, but "
                             f"got {self.dispatch!r}.")
        self.slot_expert = _int_vector("slot_expert", self.slot_expert)
        self.slot_device = _int_vector("slot_device", self.slot_device)
        self.slot_capacity = _int_vector("slot_capacity", self.slot_capacity)
        n = self.slot_expert.size
        for name in ("slot_device", "slot_capacity"):
            if getattr(self, name).size != n:
                raise ValueError(f"ExpertPlan '{name}' must have {n} entries (one per slot), "
                                 f"but got {getattr(self, name).size}.")
        for name, arr in (("slot_expert", self.slot_expert), ("slot_device", self.slot_device),
                          ("slot_capacity", self.slot_capacity)):
            if (arr < 0).any():
                raise ValueError(f"ExpertPlan '{name}' must be >= 0, but got {arr.tolist()}.")

    @property
    def num_slots(self) -> int:
        """S, the number of physical slots."""
        return int(self.slot_expert.size)

    def replica_counts(self, num_experts: int) -> np.ndarray:
        """Replicas of every expert: int64 [E]."""
        return np.bincount(self.slot_expert, minlength=num_experts)

    def to_dict(self) -> Dict[str, Any]:
        """YAML-ready dict; :meth:`from_dict` reads it back."""
        out: Dict[str, Any] = {
            "slot_expert": self.slot_expert.tolist(),
            "slot_device": self.slot_device.tolist(),
            "slot_capacity": self.slot_capacity.tolist(),
        }
        if self.method:
            out["method"] = self.method
        if self.dispatch != "alltoallv":
            out["dispatch"] = self.dispatch
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ExpertPlan":
        """Build a plan from :meth:`to_dict` output, or from a retired one-level plan (its
        extra keys dropped); other unknown keys raise ``ValueError``."""
        allowed = {"slot_expert", "slot_device", "slot_capacity", "method", "dispatch"}
        if not isinstance(d, Mapping):
            raise ValueError(f"expert plan must be a mapping, but got {d!r}.")
        unknown = sorted(set(d) - allowed - set(RETIRED_KEYS))
        if unknown:
            raise ValueError(f"expert plan has unknown keys {unknown}; allowed keys are "
                             f"{sorted(allowed)}.")
        missing = sorted({"slot_expert", "slot_device", "slot_capacity"} - set(d))
        if missing:
            raise ValueError(f"expert plan is missing {missing}.")
        return cls(**{k: v for k, v in d.items() if k in allowed})
