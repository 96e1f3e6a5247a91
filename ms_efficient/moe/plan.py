"""Expert plan: logical experts -> physical slots (replicas) on devices, each with a capacity.

Notation (as in deepseek-ai/EPLB): E logical experts, S physical slots, D devices, R source
ranks. A slot is one copy of one expert's weights on one device, with its own static capacity
(the rows its expert FFN computes per step, fixed before graph compilation). Replicas of one
expert hold identical weights; their gradients are summed.

    slot_expert:   int64 [S], logical expert id of each physical slot
    slot_device:   int64 [S], device that hosts each slot
    slot_capacity: int64 [S], static capacity of each slot, tokens (rows) per step

How tokens reach the slots is part of the plan (``dispatch``), because it decides both which
tokens are dropped and what the All-to-All carries:

    "static"     what a static graph runs (this package's retired one-level
                 expert-parallel layer, and GShard / Switch / MindFormers): every
                 source rank owns, before compilation, a fixed number of rows of every slot
                 (:func:`~ms_efficient.moe.split.source_rows`: each expert's capacity shared
                 among the ranks, equally or in proportion to ``rank_share``, then attributed
                 to the expert's replicas: own device first, same node next, then by
                 remaining room). A rank
                 fills its rows in arrival order and drops what does not fit, even when another
                 rank left rows of the same slot empty. Every owned row travels, full or
                 empty (zero rows included): GShard / Switch send equal blocks of a
                 [W, C, H] buffer (Lepikhin et al., "GShard", 2020, sec. 2.2 and Algorithm 1;
                 Fedus et al., "Switch Transformers", JMLR 2022, sec. 2.1); that layer sent each
                 peer exactly the rows it owns there, an AlltoAllV with compile-time counts.
    "alltoallv"  dynamic, counts first: every rank learns the step's routing counts [R, E] (an
                 AllGather of R x E integers), applies
                 :func:`~ms_efficient.moe.split.split_tokens`, and sends each peer exactly
                 the tokens it keeps for that peer's slots; a slot's capacity is shared by
                 all ranks, so one rank's overflow can use another's unused rows. What
                 dynamic-shape systems run (FasterMoE's count exchange then token exchange); the
                 default, because ``split_tokens`` is also the rule that attributes static
                 rows to replicas. The cost model charges it as such; that layer had static
                 shapes, so it runs an "alltoallv" plan's slots as a "static" plan.
    "grouped"    padding-free expert compute over one static row buffer per device
                 (MegaBlocks-style grouped matmul, group sizes are data) fed by a static
                 exchange of planned send blocks: rank r sends device d a block of exactly
                 ``send_rows()[r, d]`` = C[r, d] rows every step, full or not (an AlltoAllV
                 with compile-time counts), and device d computes at most
                 ``device_rows()[d]`` = B_d of the rows it receives. Each rank splits its
                 tokens of an expert over the expert's replicas by fixed integer weights
                 (:func:`~ms_efficient.moe.split.grouped_split_weights`, from the plan, so no
                 communication decides the split), keeps its rows for d's slots (ascending
                 slot) up to C[r, d], and device d keeps, in ascending source rank, up to B_d
                 of them (:func:`~ms_efficient.moe.split.grouped_assignments`). A planned
                 plan (``send_block`` set, no ``device_buffer``) has B_d = sum_r C[r, d],
                 so drops happen only where a pair's block overflows; a plan without
                 ``send_block`` lets every rank fill a whole buffer (C[r, d] = B_d), which
                 cannot drop more than the buffer but sends R x B_d rows to every device.
                 Counts are exchanged before the rows: in that layer every rank
                 all-gathers its per-slot counts after the block cut over the slot budget
                 (int32 [R, R * S_b], S_b slots per device), from which every rank derives
                 what each device keeps (so senders know their drops and receivers their
                 group sizes), and the experts compute exactly the kept rows (no per-expert
                 padding). What the token exchange carries, per (rank, device) block, is
                 :func:`~ms_efficient.moe.exchange.exchange_rows` for every mode: for
                 "grouped" the planned blocks C[r, d] = ``send_rows()``.
    "counts"     "grouped" with a count-driven token exchange (Ascend only): the same blocks
                 C[r, d], buffers B_d, split, drops and grouped matmul, but rank r sends
                 device d only the rows it keeps for d this step (at most C[r, d]): an
                 AlltoAllV whose per-peer counts are data (``ops.AlltoAllVC`` with the
                 [W, W] count matrix every rank derives from the count exchange; output
                 rows placed back into the static blocks, so every buffer keeps the plan's
                 upper bound). Sent rows are exactly the kept rows, no padding; the price is
                 a dynamic-shape collective (the receive size is data: a host read of the
                 counts before each exchange), see ``ms_efficient.moe.counted_alltoall``.

``ms_efficient.moe.split`` holds the dispatch rule both the planners and the MoE layer follow:
it turns per-rank routing counts ``counts_RE`` into per-slot assignments ``assigned_RS``.
No MindSpore import here: plans are plain numpy and YAML.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import yaml

from ms_efficient.core.fileio import atomic_write_text

__all__ = ["ExpertPlan", "DISPATCH_MODES", "GROUPED_DISPATCH", "save_plans", "load_plans"]

logger = logging.getLogger(__name__)

DISPATCH_MODES = ("alltoallv", "static", "grouped", "counts")   # see the module docstring
# modes with send blocks C[r, d], row buffers B_d and grouped expert compute
GROUPED_DISPATCH = ("grouped", "counts")


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
    """Where every expert replica lives and how many tokens it computes per step (one MoE layer).

    slot_expert: int64 [S], logical expert of each physical slot.
    slot_device: int64 [S], device id of each slot (node-major ids of a ClusterSpec).
    slot_capacity: int64 [S], static capacity of each slot, tokens per step (>= 0).
    top_k: experts per token, when known (MindFormers ``num_experts_chosen``).
    tokens_per_step: tokens routed per step over all ranks, before top-k, when known; with
        ``top_k`` it gives the capacity factor equivalent of the plan.
    method: label of the planner that made the plan ("efficientmoe", "eplb-ema", ...).
    dispatch: how tokens reach the slots, one of DISPATCH_MODES (module docstring).
    rank_share: float [R, E] >= 0, optional ("static" plans): each expert's capacity is shared
        among the source ranks in proportion to its column (a per-rank load forecast); None:
        equal shares.
    device_buffer: int64 [D] >= 0, optional ("grouped" plans): the row buffer of every device
        (rows it computes at most per step); None: the column sums of ``send_block`` when
        given, else the sum of its slots' capacities.
    send_block: int64 [R, D] >= 0, optional ("grouped" plans): rows source rank r sends to
        device d every step (C[r, d], the block of a static AlltoAllV); None: every rank may
        fill a device's whole buffer, C[r, d] = B_d.
    """

    slot_expert: np.ndarray
    slot_device: np.ndarray
    slot_capacity: np.ndarray
    top_k: Optional[int] = None
    tokens_per_step: Optional[int] = None
    method: str = ""
    dispatch: str = "alltoallv"
    rank_share: Optional[np.ndarray] = None
    device_buffer: Optional[np.ndarray] = None
    send_block: Optional[np.ndarray] = None
    drop_target: Optional[float] = None
    expected_drop_rate: Optional[float] = None

    @property
    def grouped(self) -> bool:
        """True for the modes with send blocks, row buffers and grouped expert compute
        (GROUPED_DISPATCH: "grouped", "counts")."""
        return self.dispatch in GROUPED_DISPATCH

    def __post_init__(self) -> None:
        if self.dispatch not in DISPATCH_MODES:
            raise ValueError(f"ExpertPlan 'dispatch' must be one of {list(DISPATCH_MODES)}, but "
                             f"got {self.dispatch!r}.")
        if self.rank_share is not None:
            self.rank_share = np.asarray(self.rank_share, dtype=np.float64)
            if (self.rank_share.ndim != 2 or not np.all(np.isfinite(self.rank_share))
                    or (self.rank_share < 0).any()):
                raise ValueError(f"ExpertPlan 'rank_share' must be a finite, non-negative "
                                 f"[rank, expert] array, but got shape {self.rank_share.shape}.")
        if self.device_buffer is not None:
            self.device_buffer = _int_vector("device_buffer", self.device_buffer)
            if (self.device_buffer < 0).any():
                raise ValueError(f"ExpertPlan 'device_buffer' must be >= 0, but got "
                                 f"{self.device_buffer.tolist()}.")
        if self.send_block is not None:
            block = np.asarray(self.send_block)
            if (block.ndim != 2 or block.size == 0
                    or not np.all(np.isfinite(block.astype(np.float64)))
                    or not np.all(block == np.round(block)) or (block < 0).any()):
                raise ValueError(f"ExpertPlan 'send_block' must be a non-empty [rank, device] "
                                 f"array of integers >= 0, but got {block.tolist()}.")
            self.send_block = block.astype(np.int64)
        for name in ("drop_target", "expected_drop_rate"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= float(value) <= 1.0:
                raise ValueError(f"ExpertPlan '{name}' must be in [0, 1], but got {value!r}.")
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

    def replicas_of(self, expert: int) -> np.ndarray:
        """Slot ids holding ``expert``, ascending: int64 [n_e]."""
        return np.flatnonzero(self.slot_expert == expert)

    def replica_counts(self, num_experts: int) -> np.ndarray:
        """Replicas of every expert: int64 [E]."""
        return np.bincount(self.slot_expert, minlength=num_experts)

    def validate(self, num_experts: int, num_devices: int) -> "ExpertPlan":
        """Check the plan against a layer of ``num_experts`` experts on ``num_devices`` devices.

        Every expert needs at least one slot; expert and device ids must be in range.
        Raises ``ValueError`` naming the problem; returns ``self``.
        """
        if self.slot_expert.max() >= num_experts:
            raise ValueError(f"ExpertPlan names expert {int(self.slot_expert.max())}, but the "
                             f"layer has {num_experts} experts (ids 0..{num_experts - 1}).")
        if self.slot_device.max() >= num_devices:
            raise ValueError(f"ExpertPlan places a slot on device {int(self.slot_device.max())}, "
                             f"but the cluster has {num_devices} devices.")
        missing = np.flatnonzero(self.replica_counts(num_experts) == 0)
        if missing.size:
            raise ValueError(f"ExpertPlan gives experts {missing.tolist()} no slot; every expert "
                             f"needs at least one replica.")
        return self

    def device_rows(self, num_devices: Optional[int] = None) -> np.ndarray:
        """int64 [D]: the row buffer B_d of every device of a ``"grouped"`` plan:
        ``device_buffer`` when given, else the column sums of ``send_block`` when given
        (B_d = sum_r C[r, d]), else the capacities of the device's slots summed; D =
        ``num_devices`` or the largest device id + 1."""
        size = int(self.slot_device.max()) + 1 if num_devices is None else int(num_devices)
        if self.device_buffer is None and self.send_block is not None:
            out = np.zeros(max(size, self.send_block.shape[1]), dtype=np.int64)
            out[:self.send_block.shape[1]] = self.send_block.sum(axis=0)
            return out[:size]
        if self.device_buffer is not None:
            out = np.zeros(max(size, self.device_buffer.size), dtype=np.int64)
            out[:self.device_buffer.size] = self.device_buffer
            return out[:size]
        return np.bincount(self.slot_device, weights=self.slot_capacity,
                           minlength=size).astype(np.int64)

    def send_rows(self, num_ranks: int, num_devices: Optional[int] = None) -> np.ndarray:
        """int64 [R, D]: rows source rank r sends device d every step under ``"grouped"``
        dispatch (C[r, d]): ``send_block`` when given (its shape must be [R, >= D'], D' the
        devices holding slots), else every rank may fill d's whole buffer, C[r, d] = B_d
        (:meth:`device_rows`). Raises ``ValueError`` on a block of the wrong shape."""
        size = int(self.slot_device.max()) + 1 if num_devices is None else int(num_devices)
        if self.send_block is None:
            return np.tile(self.device_rows(size), (int(num_ranks), 1))
        if self.send_block.shape[0] != num_ranks or self.send_block.shape[1] < \
                int(self.slot_device.max()) + 1:
            raise ValueError(f"ExpertPlan 'send_block' must be [{num_ranks} ranks, >= "
                             f"{int(self.slot_device.max()) + 1} devices], but got shape "
                             f"{list(self.send_block.shape)}.")
        out = np.zeros((int(num_ranks), max(size, self.send_block.shape[1])), dtype=np.int64)
        out[:, :self.send_block.shape[1]] = self.send_block
        return out[:, :size]

    def capacity_factor(self) -> Optional[float]:
        """Total capacity / (tokens_per_step * top_k): the Switch/MindFormers capacity factor
        that allots the same total slots; None when the token count or top_k is unknown."""
        if not self.top_k or not self.tokens_per_step:
            return None
        return float(self.slot_capacity.sum()) / (self.tokens_per_step * self.top_k)

    def moe_config(self, num_experts: int) -> Dict[str, Any]:
        """MindFormers-style ``moe_config`` fields this plan can be expressed in (approximately:
        MindFormers has one capacity factor for hot and one for cold experts, not per replica).

        expert_num, num_experts_chosen (top_k), capacity_factor (equivalent, for hot experts),
        enable_cold_hot_expert / hot_expert_num (replicated experts), cold_token_percent
        (cold experts' capacity factor over the hot experts').
        """
        out: Dict[str, Any] = {"expert_num": int(num_experts)}
        if self.top_k:
            out["num_experts_chosen"] = int(self.top_k)
        replicas = self.replica_counts(num_experts)
        hot = replicas > 1
        out["enable_cold_hot_expert"] = bool(hot.any())
        out["hot_expert_num"] = int(hot.sum())
        cf = self.capacity_factor()
        if cf is None:
            return out
        per_expert = np.bincount(self.slot_expert, weights=self.slot_capacity,
                                 minlength=num_experts)
        mean_share = self.tokens_per_step * self.top_k / num_experts   # CF 1.0 capacity
        cf_hot = per_expert[hot].mean() / mean_share if hot.any() else cf
        cf_cold = per_expert[~hot].mean() / mean_share if (~hot).any() else cf_hot
        out["capacity_factor"] = round(float(cf_hot), 4)
        if hot.any():
            out["cold_token_percent"] = round(float(min(1.0, cf_cold / cf_hot)), 4)
        return out

    def to_dict(self) -> Dict[str, Any]:
        """YAML-ready dict; :meth:`from_dict` reads it back."""
        out: Dict[str, Any] = {
            "slot_expert": self.slot_expert.tolist(),
            "slot_device": self.slot_device.tolist(),
            "slot_capacity": self.slot_capacity.tolist(),
        }
        for name in ("top_k", "tokens_per_step"):
            if getattr(self, name) is not None:
                out[name] = int(getattr(self, name))
        if self.method:
            out["method"] = self.method
        if self.dispatch != "alltoallv":
            out["dispatch"] = self.dispatch
        if self.rank_share is not None:
            out["rank_share"] = np.round(self.rank_share, 3).tolist()
        if self.device_buffer is not None:
            out["device_buffer"] = self.device_buffer.tolist()
        if self.send_block is not None:
            out["send_block"] = self.send_block.tolist()
        for name in ("drop_target", "expected_drop_rate"):
            if getattr(self, name) is not None:
                out[name] = float(getattr(self, name))
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ExpertPlan":
        """Build a plan from :meth:`to_dict` output (unknown keys raise ``ValueError``)."""
        allowed = {"slot_expert", "slot_device", "slot_capacity", "top_k", "tokens_per_step",
                   "method", "dispatch", "rank_share", "device_buffer", "send_block",
                   "drop_target", "expected_drop_rate"}
        if not isinstance(d, Mapping):
            raise ValueError(f"expert plan must be a mapping, but got {d!r}.")
        unknown = sorted(set(d) - allowed)
        if unknown:
            raise ValueError(f"expert plan has unknown keys {unknown}; allowed keys are "
                             f"{sorted(allowed)}.")
        missing = sorted({"slot_expert", "slot_device", "slot_capacity"} - set(d))
        if missing:
            raise ValueError(f"expert plan is missing {missing}.")
        return cls(**dict(d))


def save_plans(path: str, plans: Sequence[ExpertPlan], num_experts: int,
               extra: Optional[Mapping[str, Any]] = None) -> None:
    """Write one plan per MoE layer to a YAML file (atomically).

    Layout: ``{expert_plan: {num_experts, layers: [plan dict, ...], **extra}, moe_config:
    {...}}``; ``moe_config`` is the MindFormers-style summary of layer 0's plan.
    """
    if not plans:
        raise ValueError("save_plans needs at least one layer plan, but got none.")
    for plan in plans:
        plan.validate(num_experts, int(plan.slot_device.max()) + 1)
    doc = {"expert_plan": {"num_experts": int(num_experts), **dict(extra or {}),
                           "layers": [p.to_dict() for p in plans]},
           "moe_config": plans[0].moe_config(num_experts)}
    atomic_write_text(path, yaml.safe_dump(doc, sort_keys=False, default_flow_style=None))


def load_plans(path: str) -> Tuple[List[ExpertPlan], int]:
    """Read a file written by :func:`save_plans`: (plans per layer, num_experts)."""
    from ms_efficient.core.fileio import read_yaml_document

    doc = read_yaml_document(path, "expert plan file")
    if not isinstance(doc, Mapping) or not isinstance(doc.get("expert_plan"), Mapping):
        raise ValueError(f"plan file '{path}' has no 'expert_plan' section.")
    section = doc["expert_plan"]
    missing = [k for k in ("num_experts", "layers") if k not in section]
    if missing:
        raise ValueError(f"plan file '{path}': 'expert_plan' is missing {missing}.")
    try:
        num_experts = int(section["num_experts"])
        plans = [ExpertPlan.from_dict(d) for d in section["layers"]]
        for plan in plans:
            plan.validate(num_experts, int(plan.slot_device.max()) + 1)
    except (TypeError, ValueError, AttributeError) as err:
        raise ValueError(f"plan file '{path}': {err}") from None
    return plans, num_experts
