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

    "static"     what a static graph runs (this package's expert-parallel layer,
                 ``ms_efficient.moe.ep_layer``, and GShard / Switch / MindFormers): every
                 source rank owns, before compilation, a fixed number of rows of every slot
                 (:func:`static_rank_rows`: each expert's capacity shared among the ranks,
                 equally or in proportion to ``rank_share``, then attributed to the expert's
                 replicas own device first, same node next, then by remaining room). A rank
                 fills its rows in arrival order and drops what does not fit, even when another
                 rank left rows of the same slot empty. Every owned row travels, full or
                 empty (zero rows included): GShard / Switch send equal blocks of a
                 [W, C, H] buffer (Lepikhin et al., "GShard", 2020, sec. 2.2 and Algorithm 1;
                 Fedus et al., "Switch Transformers", JMLR 2022, sec. 2.1); ep_layer sends each
                 peer exactly the rows it owns there, an AlltoAllV with compile-time counts.
    "alltoallv"  dynamic, counts first: every rank learns the step's routing counts [R, E] (an
                 AllGather of R x E integers), applies :func:`split_tokens`, and sends each peer
                 exactly the tokens it keeps for that peer's slots; a slot's capacity is shared
                 by all ranks, so one rank's overflow can use another's unused rows. What
                 dynamic-shape systems run (FasterMoE's count exchange then token exchange); the
                 default, because :func:`split_tokens` is also the rule that attributes static
                 rows to replicas.

:func:`split_tokens` is the dispatch rule both the planners and the MoE layer follow: it turns
per-rank routing counts ``counts_RE`` into per-slot assignments ``assigned_RS``.
No MindSpore import here: plans are plain numpy and YAML.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import yaml

from ms_efficient.fileio import atomic_write_text

__all__ = ["ExpertPlan", "DISPATCH_MODES", "split_tokens", "static_rank_rows", "static_assignments",
           "largest_remainder", "proportional_split", "save_plans", "load_plans"]

logger = logging.getLogger(__name__)

DISPATCH_MODES = ("alltoallv", "static")   # see the module docstring


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
    """

    slot_expert: np.ndarray
    slot_device: np.ndarray
    slot_capacity: np.ndarray
    top_k: Optional[int] = None
    tokens_per_step: Optional[int] = None
    method: str = ""
    dispatch: str = "alltoallv"
    rank_share: Optional[np.ndarray] = None

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
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ExpertPlan":
        """Build a plan from :meth:`to_dict` output (unknown keys raise ``ValueError``)."""
        allowed = {"slot_expert", "slot_device", "slot_capacity", "top_k", "tokens_per_step",
                   "method", "dispatch", "rank_share"}
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
    with open(path, "r", encoding="utf-8") as fh:
        doc = yaml.safe_load(fh)
    if not isinstance(doc, Mapping) or "expert_plan" not in doc:
        raise ValueError(f"plan file '{path}' has no 'expert_plan' section.")
    section = doc["expert_plan"]
    num_experts = int(section["num_experts"])
    plans = [ExpertPlan.from_dict(d) for d in section["layers"]]
    for plan in plans:
        plan.validate(num_experts, int(plan.slot_device.max()) + 1)
    return plans, num_experts


# ---- the dispatch rule ------------------------------------------------------------------------

def proportional_split(total: int, room: np.ndarray) -> np.ndarray:
    """Split ``total`` integer tokens over bins in proportion to ``room`` (int [n]), never
    exceeding a bin's room: floors first, then the leftover one by one to the largest
    fractional parts (ties: lower index). Requires ``total <= room.sum()``."""
    room = np.asarray(room, dtype=np.int64)
    cap = int(room.sum())
    assert 0 <= total <= cap, (total, cap)
    if total == 0:
        return np.zeros_like(room)
    exact = room * (total / cap)
    out = np.minimum(np.floor(exact).astype(np.int64), room)
    left = total - int(out.sum())
    if left:
        order = np.lexsort((np.arange(room.size), -(exact - out)))
        order = order[out[order] < room[order]][:left]
        out[order] += 1
    return out


def _fill_rank_order(assigned_RS: np.ndarray, ranks: np.ndarray, demand_R: np.ndarray,
                     slots: np.ndarray, intake_S: np.ndarray) -> None:
    """Attribute each slot's intake to ranks, ranks and slots in ascending order (the
    north-west corner rule); updates ``assigned_RS`` and ``demand_R`` in place."""
    left = intake_S.copy()
    si = 0
    for r in ranks:
        while demand_R[r] > 0 and si < slots.size:
            take = min(int(demand_R[r]), int(left[si]))
            assigned_RS[r, slots[si]] += take
            demand_R[r] -= take
            left[si] -= take
            if left[si] == 0:
                si += 1


def largest_remainder(total: int, weights: np.ndarray) -> np.ndarray:
    """Split ``total`` integers in proportion to ``weights`` (>= 0, float [n]); equal split when
    every weight is 0. Leftovers go to the largest fractional parts, ties to the lower index."""
    w = np.asarray(weights, dtype=np.float64)
    if w.sum() <= 0:
        w = np.ones_like(w)
    exact = total * w / w.sum()
    out = np.floor(exact).astype(np.int64)
    left = total - int(out.sum())
    order = np.lexsort((np.arange(w.size), -(exact - out)))
    out[order[:left]] += 1
    return out


def static_rank_rows(plan: ExpertPlan, rank_device: Sequence[int],
                     devices_per_node: Optional[int] = None) -> np.ndarray:
    """Rows of every slot each source rank owns under ``"static"`` dispatch: int64 [R, S].

    Step 1: each expert's capacity (summed over its replicas) is shared among the R ranks in
    proportion to ``plan.rank_share[:, e]`` (equal shares when None), largest remainder.
    Step 2: every rank's share is attributed to the expert's replicas by the count-based rule
    of :func:`split_tokens` (own device, same node, then by remaining room); the shares add up
    to the capacities, so every row of every slot is owned by exactly one rank.
    The same rule as ``ms_efficient.moe.ep_routing.source_rows`` of the layer.
    """
    rank_device = np.asarray(rank_device, dtype=np.int64)
    num_ranks = rank_device.size
    num_experts = int(plan.slot_expert.max()) + 1
    total_E = np.bincount(plan.slot_expert, weights=plan.slot_capacity,
                          minlength=num_experts).astype(np.int64)
    weights = (np.ones((num_ranks, num_experts)) if plan.rank_share is None
               else plan.rank_share)
    if weights.shape != (num_ranks, num_experts):
        raise ValueError(f"ExpertPlan 'rank_share' must have shape {(num_ranks, num_experts)}, "
                         f"but got {weights.shape}.")
    # Step 1: largest remainder, all experts at once (as largest_remainder column by column)
    w = np.where(weights.sum(axis=0) > 0, weights, 1.0)
    exact = total_E * w / w.sum(axis=0)
    share_RE = np.floor(exact).astype(np.int64)
    left = total_E - share_RE.sum(axis=0)
    rank_of = np.lexsort((np.broadcast_to(np.arange(num_ranks)[:, None], w.shape),
                          -(exact - share_RE)), axis=0)                  # per column
    share_RE[rank_of, np.arange(num_experts)[None, :]] += (
        np.arange(num_ranks)[:, None] < left[None, :])
    counted = ExpertPlan(plan.slot_expert, plan.slot_device, plan.slot_capacity)
    rows_RS, dropped = split_tokens(counted, share_RE, rank_device, devices_per_node)
    assert dropped == 0 and np.array_equal(rows_RS.sum(axis=0), plan.slot_capacity)
    return rows_RS


def static_assignments(plan: ExpertPlan, counts_RE: np.ndarray, rows_RS: np.ndarray,
                       rank_device: np.ndarray,
                       devices_per_node: Optional[int]) -> Tuple[np.ndarray, int]:
    """:func:`split_tokens` for ``"static"`` dispatch, given the rows each rank owns
    (``rows_RS``, :func:`static_rank_rows`): rank r's tokens for e fill its rows in e's
    replicas in spill order (own device, same node, others; then slot id); the rest drop.
    Returns (assigned_RS int64 [R, S], dropped)."""
    counts_RE = np.asarray(counts_RE, dtype=np.int64)
    rank_device = np.asarray(rank_device, dtype=np.int64)
    replicas = plan.replica_counts(counts_RE.shape[1])
    single = replicas[plan.slot_expert] == 1
    assigned_RS = np.zeros_like(rows_RS)
    assigned_RS[:, single] = np.minimum(counts_RE[:, plan.slot_expert[single]],
                                        rows_RS[:, single])
    dpn = devices_per_node or (int(max(plan.slot_device.max(), rank_device.max())) + 1)
    for e in np.flatnonzero(replicas > 1):
        slots = plan.replicas_of(int(e))                                     # ascending
        dev = plan.slot_device[slots][None, :]
        tier = np.where(dev == rank_device[:, None], 0,
                        np.where(dev // dpn == rank_device[:, None] // dpn, 1, 2))   # [R, n]
        order = np.argsort(tier * slots.size + np.arange(slots.size), axis=1)  # spill order
        rows = np.take_along_axis(rows_RS[:, slots], order, axis=1)
        before = np.cumsum(rows, axis=1) - rows
        kept = np.clip(counts_RE[:, [e]] - before, 0, rows)
        block = np.zeros_like(kept)
        np.put_along_axis(block, order, kept, axis=1)
        assigned_RS[:, slots] = block
    return assigned_RS, int(counts_RE.sum() - assigned_RS.sum())


def split_tokens(plan: ExpertPlan, counts_RE: np.ndarray, rank_device: Sequence[int],
                 devices_per_node: Optional[int] = None) -> Tuple[np.ndarray, int]:
    """Assign every rank's tokens to the slots of their expert; count drops.

    plan: the layer's ExpertPlan (capacities are hard limits).
    counts_RE: int [R, E], tokens rank r routes to expert e this step (top-k counted k times).
    rank_device: int [R], device of each source rank.
    devices_per_node: devices per node (node of device d = d // devices_per_node); None: no
        node tier (every other device is equally far).

    Returns ``(assigned_RS, dropped)``: int64 [R, S] tokens of rank r computed by slot s, and
    the number of tokens no slot had room for.

    ``"static"`` plans: each rank fills the rows it owns (:func:`static_rank_rows`) in spill
    order and drops the rest. ``"alltoallv"`` plans, the rule per expert, in three tiers;
    each tier only uses room left by the previous one:
      1. own device: a rank's tokens go to the expert's replica(s) on its own device;
      2. same node: what is left goes to replicas on the rank's node;
      3. anywhere: what is left goes to any replica with room.
    Within tiers 2 and 3 the tokens that fit are split over the candidate replicas in
    proportion to their remaining room (largest remainder rounding), so every replica ends the
    tier with the same fraction of its room left: with capacities sized to predicted loads this
    balances the replicas. When a tier cannot take all tokens, lower-numbered ranks are served
    first (the receiver concatenates its buffers by source rank). Tokens beyond all replicas'
    capacity are dropped. An un-replicated expert is the special case with one slot: it serves
    its own device's ranks, then its node's, then the others', ascending rank in each group.
    """
    counts_RE = np.asarray(counts_RE)
    if counts_RE.ndim != 2:
        raise ValueError(f"'counts_RE' must be 2-D [rank, expert], but got shape "
                         f"{counts_RE.shape}.")
    if (counts_RE < 0).any():
        raise ValueError("'counts_RE' must be >= 0, but got a negative count.")
    counts_RE = counts_RE.astype(np.int64)
    num_ranks, num_experts = counts_RE.shape
    rank_device = np.asarray(rank_device, dtype=np.int64)
    if rank_device.shape != (num_ranks,):
        raise ValueError(f"'rank_device' must have {num_ranks} entries (one per rank), but "
                         f"got shape {rank_device.shape}.")
    plan.validate(num_experts, max(int(plan.slot_device.max()), int(rank_device.max())) + 1)
    if plan.dispatch == "static":
        rows_RS = static_rank_rows(plan, rank_device, devices_per_node)
        return static_assignments(plan, counts_RE, rows_RS, rank_device, devices_per_node)
    caps = plan.slot_capacity
    assigned_RS = np.zeros((num_ranks, plan.num_slots), dtype=np.int64)
    replicas = plan.replica_counts(num_experts)

    node_of_dev = np.arange(max(int(plan.slot_device.max()), int(rank_device.max())) + 1)
    node_of_dev = node_of_dev // (devices_per_node or node_of_dev.size)

    # Step 1: experts with one slot, all at once: serve ranks in tier order (own device, same
    # node, others; ascending rank inside a tier) up to the capacity.
    single = np.flatnonzero(replicas == 1)
    slot_of = np.zeros(num_experts, dtype=np.int64)
    slot_of[plan.slot_expert[::-1]] = np.arange(plan.num_slots)[::-1]   # first slot of e
    s1 = slot_of[single]
    dev1 = plan.slot_device[s1][None, :]
    tier = np.where(rank_device[:, None] == dev1, 0,
                    np.where(node_of_dev[rank_device][:, None] == node_of_dev[dev1], 1, 2))
    order = np.argsort(tier * num_ranks + np.arange(num_ranks)[:, None], axis=0, kind="stable")
    c = np.take_along_axis(counts_RE[:, single], order, axis=0)
    kept = np.clip(caps[s1][None, :] - (np.cumsum(c, axis=0) - c), 0, c)
    block = np.zeros_like(kept)
    np.put_along_axis(block, order, kept, axis=0)
    assigned_RS[:, s1] = block
    dropped = int(c.sum() - kept.sum())

    # Step 2: replicated experts, tier by tier.
    for e in np.flatnonzero(replicas > 1):
        slots = plan.replicas_of(int(e))
        room = caps[slots].copy()
        demand = counts_RE[:, e].copy()
        # Tier 1: own device
        for i, s in enumerate(slots):
            for r in np.flatnonzero(rank_device == plan.slot_device[s]):
                take = min(int(demand[r]), int(room[i]))
                assigned_RS[r, s] += take
                demand[r] -= take
                room[i] -= take
        # Tier 2: same node (groups of ranks and slots by node), then Tier 3: anywhere
        groups: List[Tuple[np.ndarray, np.ndarray]] = []
        if devices_per_node is not None:
            slot_node = node_of_dev[plan.slot_device[slots]]
            rank_node = node_of_dev[rank_device]
            groups = [(np.flatnonzero(rank_node == n), np.flatnonzero(slot_node == n))
                      for n in np.unique(slot_node)]
        groups.append((np.arange(num_ranks), np.arange(slots.size)))
        for ranks, local in groups:
            want = int(demand[ranks].sum())
            have = int(room[local].sum())
            if want == 0 or have == 0:
                continue
            intake = proportional_split(min(want, have), room[local])
            _fill_rank_order(assigned_RS, ranks, demand, slots[local], intake)
            room[local] -= intake
        dropped += int(demand.sum())
    return assigned_RS, dropped
