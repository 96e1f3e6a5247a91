"""Online EfficientMoE for expert-parallel layers: re-placement through ``set_plan``, the one
place where running expert-parallel layers are re-planned.

An :class:`~ms_efficient.moe.ep_layer.ExpertParallelMoE` with ``dispatch`` "grouped" or
"counts" reads its plan as data, so a new placement that keeps every device's row buffer (and
at most the compiled slots per device) switches without recompiling.
:class:`ExpertParallelReplanner` runs EfficientMoE's planner
(:class:`~ms_efficient.efficientmoe.planner.EfficientMoEPlanner`, plans of the layers' dispatch
over W ranks, the same :class:`~ms_efficient.efficientmoe.planner.ReplanLoop` as the
one-process trainer) on the routing counts of every rank, keeps the compiled buffers
in every adopted plan, and applies it with :func:`apply_plan`: the layer moves the expert
weights, this module moves the optimizer's per-slot state the same way. Every rank holds the
same counts (the trainer all-gathers them in its step; :class:`EfficientMoECallback` with an
``ExpertParallelMoE`` network all-reduces them on the host), so every rank takes the same
decisions without further communication. Used by ``ms_efficient.train.expert_parallel`` and by
``ms_efficient.efficientmoe.apply.EfficientMoECallback``.

Balanced layers (:class:`~ms_efficient.moe.balanced_ep.BalancedExpertParallelMoE`) read their
home table as data and balance every step inside fixed buffers (the fast level).
:class:`HomeReplanner` runs the slow level beside them: every ``efficientmoe.replan_every``
steps it asks :func:`~ms_efficient.efficientmoe.layout.decide_home` (the rule the simulator's
``efficientmoe`` row replays) whether a new home table for the recent routing pays for moving
the changed slots' weights and Adam moments over the check interval, both priced by the cost
model of the run's cluster; adopted, every layer switches through its ``set_plan`` (no shape
changes, no recompile). Every rank holds the same all-gathered counts, so every rank takes the
same decision without further communication.

Shapes: L MoE layers, W ranks (= devices), E experts, K top-k, S_b slots per device (S_h home
slots for balanced layers).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from typing import Deque, Dict, List, Optional, Sequence

import numpy as np

from ms_efficient.efficientmoe.cost import CostModel
from ms_efficient.efficientmoe.layout import (Layout, LayoutConfig, decide_home,
                                              migration_time_s)
from ms_efficient.efficientmoe.placement import (default_slots_per_device, levelled_shares,
                                                 place_replicas, replica_counts_greedy,
                                                 uniform_placement)
from ms_efficient.efficientmoe.planner import EfficientMoEPlanner, planner_config
from ms_efficient.efficientmoe.planner import ReplanLoop
from ms_efficient.efficientmoe.sampler import RoutingSampler
from ms_efficient.efficientmoe.schedule import plans_equal
from ms_efficient.moe.balance import home_plan
from ms_efficient.moe.plan import GROUPED_DISPATCH, ExpertPlan

__all__ = ["dropless_plans", "slot_budget", "experts_to_fetch", "expert_bytes", "apply_plan",
           "compiled_graphs", "rank_counts", "ExpertParallelReplanner", "load_plans_state",
           "HomeReplanner", "layout_of", "balanced_cost_model"]

logger = logging.getLogger(__name__)


def slot_budget(num_experts: int, world: int, configured: int = 0) -> int:
    """S_b, weight slots per rank: ``configured`` (``moe.slots_per_device``) or, for 0,
    ceil(E / W) + 1 (one spare slot for a replica). Raises ValueError below ceil(E / W)."""
    least = -(-num_experts // world)
    if configured and configured < least:
        raise ValueError(f"'moe.slots_per_device' ({configured}) must be >= ceil(num_experts "
                         f"/ workers) = {least} (or 0 for automatic).")
    return int(configured or default_slots_per_device(num_experts, world))


def dropless_plans(num_layers: int, num_experts: int, world: int, top_k: int,
                   tokens_per_step: int, dispatch: str = "grouped") -> List[ExpertPlan]:
    """The initial plan of every MoE layer: experts split evenly over the W ranks (expert e on
    rank floor(e W / E)), ``dispatch`` "grouped" (or "counts": the same blocks as upper
    bounds, only the kept rows sent), every (rank, device) send block at the
    rank's assignments, tokens_per_step / W x K rows (a token reaches at most K experts, so
    a rank can never send more to one device), and every device's row buffer the sum of its
    blocks, tokens_per_step x K: no assignment can be dropped under this plan or any later
    placement, which keeps the same blocks and buffers."""
    experts, devices = uniform_placement(num_experts, np.arange(world))
    block_WD = np.full((world, world), -(-tokens_per_step // world) * top_k, np.int64)
    caps = np.full(num_experts, -(-top_k * tokens_per_step // num_experts), np.int64)
    if dispatch not in GROUPED_DISPATCH:
        raise ValueError(f"'dispatch' must be one of {list(GROUPED_DISPATCH)}, but got "
                         f"{dispatch!r}.")
    plan = ExpertPlan(experts, devices, caps, top_k, tokens_per_step, "uniform-dropless",
                      dispatch, device_buffer=block_WD.sum(axis=0), send_block=block_WD)
    return [dataclasses.replace(plan) for _ in range(num_layers)]


def experts_to_fetch(old: ExpertPlan, new: ExpertPlan, world: int) -> int:
    """Expert copies a switch from ``old`` to ``new`` must bring to a rank: per device, the
    experts of its new slots not already held there (with multiplicity), summed."""
    moved = 0
    for d in range(world):
        before = np.bincount(old.slot_expert[old.slot_device == d], minlength=1)
        after = np.bincount(new.slot_expert[new.slot_device == d], minlength=1)
        size = max(before.size, after.size)
        before, after = np.pad(before, (0, size - before.size)), np.pad(after, (0, size - after.size))
        moved += int(np.maximum(after - before, 0).sum())
    return moved


def expert_bytes(layer) -> int:
    """Bytes of one expert's weights (its rows of the layer's ``expert_params()``: w1, b1,
    w2, b2, or w1, w2 without biases; their dtype's item size)."""
    return int(sum(np.prod(p.shape[1:]) * p.itemsize for p in layer.expert_params()))


def apply_plan(layer, plan: ExpertPlan, optimizer=None) -> Dict[str, int]:
    """Switch ``layer`` to ``plan`` (:meth:`ExpertParallelMoE.set_plan`, no recompile): the
    slots whose expert changed get its weights and, with ``optimizer``, its optimizer state
    (one AlltoAllV of the rows that cross ranks, :mod:`ms_efficient.moe.ep_migration`).
    Collective: every rank calls it with the same plan. Returns ``{"moved_slots",
    "moved_bytes", "state_bytes"}`` from the layer's ``last_migration``: slots that received
    an expert (local copies included), the weight bytes the exchange carried (compare with
    the expert tables' size) and the optimizer-state bytes that travelled with them (the
    schedule charges both: :func:`~ms_efficient.moe.ep_migration.migration_bytes_WW`)."""
    layer.set_plan(plan, optimizer=optimizer)
    record = layer.last_migration
    weights = int(record.sent_rows) * int(record.row_bytes)
    return {"moved_slots": int(record.moved_slots), "moved_bytes": weights,
            "state_bytes": weights * int(record.optimizer_states)}


def compiled_graphs(cell=None) -> Optional[int]:
    """Graphs this process has compiled so far: MindSpore's cache of ``jit`` phases (one entry
    per fresh compile, none on a cache hit), plus ``cell``'s own cache of compiled phases
    (a ``Model.train`` network); None when MindSpore has no such cache."""
    import importlib

    cache = getattr(importlib.import_module("mindspore.graph.api"), "ms_compile_cache", None)
    if cache is None:
        return None
    return len(cache) + (len(getattr(cell, "compile_cache", ())) if cell is not None else 0)


def rank_counts(layers: Sequence) -> np.ndarray:
    """int64 [L, W, E]: the routing counts of every rank's last forward (each layer's
    ``routing_counts`` buffer summed over its trace groups), the same on every rank: an
    AllReduce of a zero-padded table (float32, exact for counts < 2^24). Collective."""
    from mindspore import Tensor

    first = layers[0]
    local = np.stack([layer.routing_counts.asnumpy().sum(axis=0) for layer in layers])
    table = np.zeros((len(layers), first.world, local.shape[1]), np.float32)
    table[:, first.rank] = local
    if first.world > 1:
        table = first.sum_over_ranks(Tensor(table)).asnumpy()
    return np.rint(table).astype(np.int64)


class ExpertParallelReplanner:
    """EfficientMoE's online loop over the ``ExpertParallelMoE`` layers of one network.

    Args:
        layers: the grouped or counts ``ExpertParallelMoE`` layers, in network order (L of
            them).
        em: the ``efficientmoe`` config section (EfficientMoEConfig).
        cluster: ClusterSpec that prices the plans (>= W devices).
        tokens_per_step: tokens all ranks route per layer and step, before top-k.

    ``observe(counts_LWE, dropped_L)`` after every step with every rank's counts (int [L, W,
    E], the same on all ranks) and the drops per layer; ``maybe_replan(step, optimizer,
    steps_left)`` before step ``step + 1``: None, or the record ``{"kind": "replan", "step",
    "moved_slots", "moved_bytes", ...}`` of the plan it applied (every layer). Plans always
    keep the compiled row buffers, so applying one never recompiles.
    """

    def __init__(self, layers: Sequence, em, cluster, tokens_per_step: int):
        if not layers:
            raise ValueError("expert-parallel re-planning needs at least one ExpertParallelMoE "
                             "layer with dispatch 'grouped' or 'counts', but the network has "
                             "none.")
        first = layers[0]
        kinds = sorted({layer.plan.dispatch for layer in layers})
        if len(kinds) > 1 or kinds[0] not in GROUPED_DISPATCH:
            raise ValueError(f"expert-parallel re-planning plans every layer for one dispatch, "
                             f"'grouped' or 'counts', but the layers have {kinds}.")
        self.layers, self.em = list(layers), em
        self.world = int(first.world)
        if cluster.num_devices < self.world:
            raise ValueError(_too_small(cluster, self.world))
        config = dataclasses.replace(planner_config(em), dispatch=first.plan.dispatch,
                                     slots_per_device=int(first.budget))   # the layers' own
        model = CostModel(cluster, int(first.hidden_size), int(first.w1.shape[2]), "fp32",
                          slot_budget=int(first.budget))
        self.planner = EfficientMoEPlanner(config, model, int(first.num_experts),
                                           list(range(self.world)), int(first.top_k),
                                           tokens_per_step, check_rows=em.replan_every,
                                           num_layers=len(self.layers))
        self.loop = ReplanLoop(self.planner, em.monitor_steps)
        self.sampler = RoutingSampler()

    def plans(self) -> List[ExpertPlan]:
        return [layer.plan for layer in self.layers]

    def observe(self, counts_LWE: np.ndarray, dropped_L: np.ndarray) -> None:
        counts = np.asarray(counts_LWE, np.int64)
        self.sampler.record(counts)
        self.loop.observe(np.asarray(dropped_L), counts.sum(axis=(1, 2)))

    def maybe_replan(self, step: int, optimizer=None,
                     steps_left: Optional[int] = None) -> Optional[Dict]:
        """Check (when the loop says so, or at ``efficientmoe.force_replan_step``) and apply."""
        em = self.em
        if step < max(em.warmup_steps, 3) or len(self.sampler) < 3:
            return None
        current = self.plans()
        counts = self.sampler.counts()
        polled = self.loop.poll(step, counts, current, compiled=True,
                                max_horizon_steps=steps_left)
        forced = em.force_replan_step > 0 and step == em.force_replan_step
        if polled is not None and polled[0] is not None and polled[0].replan:
            decision, cand = polled
            reason = decision.reason
        elif forced:
            cand = polled[1] if polled is not None else self.planner.propose(
                counts, current, max_horizon_steps=steps_left)
            reason = f"forced by efficientmoe.force_replan_step = {step}"
        else:
            if polled is not None:
                logger.info("step %d: EfficientMoE keeps the placement: %s", step,
                            polled[0].reason if polled[0] else "first plan")
            return None
        load_LRE = counts[-em.window:].mean(axis=0)
        plans = [self._within_buffers(self._least_moving(p, now, load), now)
                 for p, now, load in zip(cand.plans, current, load_LRE)]
        if forced and all(np.array_equal(p.slot_expert, now.slot_expert)
                          and np.array_equal(p.slot_device, now.slot_device)
                          for p, now in zip(plans, current)):
            plans = [self._within_buffers(self._least_moving(self._spread(load_RE), now,
                                                             load_RE), now)
                     for load_RE, now in zip(load_LRE, current)]
            reason += " (the planner kept the placement: spare slots filled with replicas)"
        if plans_equal(plans, current):
            logger.info("step %d: EfficientMoE proposes the current placement (%s); nothing "
                        "to move", step, reason)
            return None
        return self._apply(step, plans, optimizer, reason)

    def _least_moving(self, plan: ExpertPlan, now: ExpertPlan, load_RE: np.ndarray,
                      tolerance: float = 0.01) -> ExpertPlan:
        """``plan`` with its devices renamed (new device d' -> the old device whose experts it
        shares most, greedily) when that moves fewer expert copies and its modelled step time
        on ``load_RE`` is within ``tolerance`` of ``plan``'s: the planner places replicas
        heaviest first without regard to where experts are, so two ranks may just swap."""
        world = self.world
        overlap = np.zeros((world, world))
        for d_new in range(world):
            for d_old in range(world):
                a = np.bincount(plan.slot_expert[plan.slot_device == d_new], minlength=1)
                b = np.bincount(now.slot_expert[now.slot_device == d_old], minlength=1)
                size = max(a.size, b.size)
                overlap[d_new, d_old] = np.minimum(np.pad(a, (0, size - a.size)),
                                                   np.pad(b, (0, size - b.size))).sum()
        rename, free = np.full(world, -1), set(range(world))
        for flat in np.argsort(-overlap, axis=None, kind="stable"):
            d_new, d_old = divmod(int(flat), world)
            if rename[d_new] < 0 and d_old in free:
                rename[d_new] = d_old
                free.discard(d_old)
        if np.array_equal(rename, np.arange(world)):
            return plan
        order = np.lexsort((plan.slot_expert, rename[plan.slot_device]))
        renamed = dataclasses.replace(
            plan, slot_expert=plan.slot_expert[order],
            slot_device=rename[plan.slot_device][order], slot_capacity=plan.slot_capacity[order])
        if experts_to_fetch(now, renamed, world) >= experts_to_fetch(now, plan, world):
            return plan
        step = self.planner.step_time_s
        if step([renamed], load_RE[None]) > (1 + tolerance) * step([plan], load_RE[None]):
            return plan
        return renamed

    def _spread(self, load_RE: np.ndarray) -> ExpertPlan:
        """The placement that fills every slot of the budget: the hottest experts replicated
        (:func:`~ms_efficient.efficientmoe.placement.replica_counts_greedy`, at most one
        copy per device) and placed by :func:`~ms_efficient.efficientmoe.placement.
        place_replicas` on ``load_RE`` (float [W, E]); slot capacities are the levelled
        shares; the layers' own dispatch ("grouped" or "counts"). What a forced re-plan adopts
        when the planner's candidate moves nothing."""
        planner, budget = self.planner, int(self.layers[0].budget)
        load_E = load_RE.sum(axis=0)
        replicas = np.minimum(replica_counts_greedy(load_E, budget * self.world), self.world)
        rank_device = np.arange(self.world)
        slot_expert, slot_device = place_replicas(load_RE, replicas, planner.model, budget,
                                                  rank_device)
        rows = levelled_shares(slot_expert, slot_device, load_E, self.world)
        caps = np.maximum(np.ceil(rows - 1e-9), 1).astype(np.int64)
        return ExpertPlan(slot_expert, slot_device, caps, planner.top_k,
                          planner.tokens_per_step, "efficientmoe-spread",
                          self.layers[0].plan.dispatch, rank_share=load_RE)

    def _within_buffers(self, plan: ExpertPlan, now: ExpertPlan) -> ExpertPlan:
        """``plan`` with the compiled send blocks and buffers: the layer's graph stays as it
        is."""
        compiled = now.device_rows(self.world)
        wanted = plan.device_rows(self.world)
        if (wanted > compiled).any():
            logger.warning("EfficientMoE asks for row buffers %s, more than the compiled %s; "
                           "kept the compiled ones (no recompilation in an expert-parallel "
                           "run: restart with larger buffers for more room)", wanted.tolist(),
                           compiled.tolist())
        return dataclasses.replace(plan, device_buffer=compiled,
                                   send_block=now.send_rows(self.world, self.world))

    def _apply(self, step: int, plans: List[ExpertPlan], optimizer, reason: str) -> Dict:
        start = time.perf_counter()
        moved = [apply_plan(layer, plan, optimizer) for layer, plan in zip(self.layers, plans)]
        record = {"kind": "replan", "step": int(step),
                  "seconds": round(time.perf_counter() - start, 4),
                  "moved_slots": sum(m["moved_slots"] for m in moved),
                  "moved_bytes": sum(m["moved_bytes"] for m in moved),
                  "state_bytes": sum(m["state_bytes"] for m in moved),
                  "expert_table_bytes": sum(expert_bytes(layer) * layer.num_experts
                                            for layer in self.layers),
                  "slots": [int(p.num_slots) for p in plans], "reason": reason}
        logger.info("step %d: EfficientMoE re-placed the experts (%d slots, %d bytes moved; "
                    "%s)", step, record["moved_slots"], record["moved_bytes"], reason)
        return record

    # ------------------------------------------------------------------ resume
    def state(self) -> Dict:
        """The loop's position (JSON-ready), for state.json."""
        mon = self.loop.monitor
        return {"first_row": self.loop.first_row, "seen": int(mon.seen),
                "dropped": np.asarray(mon.dropped).tolist(),
                "routed": np.asarray(mon.routed).tolist()}

    def load_state(self, state: Dict, counts_TLWE: np.ndarray) -> None:
        """Restore :meth:`state` and the sampled history (the trace up to the checkpoint)."""
        for row in counts_TLWE:
            self.sampler.record(row)
        self.loop.first_row = state.get("first_row")
        mon = self.loop.monitor
        mon.seen = int(state.get("seen", 0))
        mon.dropped = np.asarray(state.get("dropped", [0.0]), np.float64)
        mon.routed = np.asarray(state.get("routed", [0.0]), np.float64)


def load_plans_state(entries: Sequence[Dict]) -> List[ExpertPlan]:
    """Plans stored in state.json (``ExpertPlan.to_dict`` per layer)."""
    return [ExpertPlan.from_dict(d) for d in entries]


# ---------------------------------------------------------------- balanced layers

def layout_of(layers: Sequence) -> Layout:
    """The :class:`~ms_efficient.efficientmoe.layout.Layout` the balanced ``layers`` run now:
    their home tables [L, W, S_h], spare slots and buffers; ``redundant`` = S_h - ceil(E / W)
    (the home slots beyond plain expert parallelism, which a re-plan keeps); ``sync_rows``
    the rows of their replica-gradient table (a re-plan replicates at most that many
    experts)."""
    first = layers[0]
    home = np.stack([layer.home_table.asnumpy().astype(np.int64) for layer in layers])
    buffers = np.stack([np.asarray(layer.buffer_W, dtype=np.int64) for layer in layers])
    redundant = int(first.slots_home) - -(-int(first.num_experts) // int(first.world))
    return Layout(home_LWS=home, spare_W=np.full(first.world, first.spare, dtype=np.int64),
                  buffer_LW=buffers, slack_L=np.zeros(len(layers)), redundant=redundant,
                  sync_rows=int(first.num_cross))


def balanced_cost_model(layers: Sequence, cluster=None) -> CostModel:
    """The cost model the slow level prices balanced ``layers`` with: the one they were sized
    with (``cost_model``, which ``adopt_moe(..., expert_parallel=True)`` keeps on each layer)
    unless ``cluster`` is given; otherwise ``cluster`` (a ClusterSpec; None: ``cpu-local``,
    this machine, grown to the layers' W devices on its node) with their expert sizes, kind
    and biases, float32."""
    first = layers[0]
    kept = getattr(first, "cost_model", None)
    if cluster is None and kept is not None:
        return kept
    from ms_efficient.core.cluster import for_ranks, get_cluster

    cluster = for_ranks(cluster or get_cluster("cpu-local"), int(first.world))
    return CostModel(cluster, int(first.hidden_size), int(first.ffn_hidden_size), "fp32",
                     expert_kind=first.expert_kind, expert_bias=bool(first.has_bias))


def _ms(seconds: float) -> Optional[float]:
    """Seconds as milliseconds for a log line (None for NaN: not computed)."""
    return None if not np.isfinite(seconds) else round(float(seconds) * 1e3, 4)


class HomeReplanner:
    """The slow level over the balanced layers of one network (module docstring).

    Args:
        layers: the ``BalancedExpertParallelMoE`` layers, in network order.
        em: the ``efficientmoe`` config section: ``warmup_steps`` (no check before),
            ``replan_every`` (steps between checks, and the horizon a re-plan must pay back
            over), ``window`` (rows the forecast and the replay read), ``force_replan_step``
            (adopt the candidate at that step whatever the gain).
        model: the :class:`~ms_efficient.efficientmoe.cost.CostModel` of the run's cluster and
            expert sizes (the one that sized the layout).

    ``observe(counts_LWE)`` after every step with every rank's counts (int [L, W, E], the
    same on all ranks); ``maybe_replan(step, optimizer, steps_left)`` before step
    ``step + 1``: None, or the record ``{"kind": "replan", "step", "moved_slots",
    "moved_bytes", "state_bytes", "modelled_gain_ms_per_step", "modelled_migration_ms", ...}``
    of the home tables it applied (the two modelled figures are the cost model's, on the
    run's cluster; ``seconds`` is the measured time of the move here). Every check, adopted
    or not, leaves its verdict in ``last_check`` (``{"kind": "replan_check", "step",
    "adopted", "modelled_gain_ms_per_step", "modelled_migration_ms", "reason"}``), which the
    trainer logs: a declined re-plan says why.
    """

    def __init__(self, layers: Sequence, em, model: CostModel):
        if not layers:
            raise ValueError("home re-placement needs at least one BalancedExpertParallelMoE "
                             "layer, but the network has none.")
        self.layers, self.em, self.model = list(layers), em, model
        first = self.layers[0]
        self.world, self.num_experts = int(first.world), int(first.num_experts)
        if model.cluster.num_devices < self.world:
            raise ValueError(_too_small(model.cluster, self.world))
        layout = layout_of(self.layers)
        self.config = LayoutConfig(slots=layout.redundant + int(first.spare), window=em.window,
                                   redundant=layout.redundant)
        self.counts: Deque[np.ndarray] = deque(maxlen=em.window)     # all the rule reads
        # the last check's verdict (adopted or not), JSON-ready: the trainer logs every one
        self.last_check: Optional[Dict] = None

    def observe(self, counts_LWE: np.ndarray, dropped_L: Optional[np.ndarray] = None) -> None:
        """Record one step's counts (``dropped_L``, the drops per layer, is not needed: the
        fast level's buffers are fixed, a re-plan cannot change them)."""
        self.counts.append(np.asarray(counts_LWE, dtype=np.int64))

    def maybe_replan(self, step: int, optimizer=None,
                     steps_left: Optional[int] = None) -> Optional[Dict]:
        """Check at every ``replan_every``-th step after the warm-up (or at
        ``force_replan_step``) and apply what :func:`decide_home` adopts."""
        em = self.em
        self.last_check = None
        forced = em.force_replan_step > 0 and step == em.force_replan_step
        due = step >= max(em.warmup_steps, 3) and step % em.replan_every == 0
        if not (forced or due) or len(self.counts) < 3:
            return None
        horizon = min(em.replan_every, steps_left) if steps_left else em.replan_every
        layout = layout_of(self.layers)
        decision = decide_home(np.stack(self.counts), layout, self.config, self.model,
                               horizon, always=forced)
        candidate, cost_s = decision.candidate.home_LWS, decision.cost_s
        reason = decision.reason
        if forced:
            reason = f"forced by efficientmoe.force_replan_step = {step}"
            if np.array_equal(candidate, layout.home_LWS) and self.world > 1:
                # nothing to re-place: every home table moves one device down, so a forced
                # re-plan always exercises the migration
                candidate = np.roll(layout.home_LWS, 1, axis=1)
                cost_s = migration_time_s(layout, dataclasses.replace(layout,
                                                                      home_LWS=candidate),
                                          self.model)
                reason += " (the slow level kept the home table: devices rotated by one)"
        adopt = (decision.adopt or forced) and not np.array_equal(candidate, layout.home_LWS)
        self.last_check = {"kind": "replan_check", "step": int(step), "adopted": bool(adopt),
                           "modelled_gain_ms_per_step": _ms(decision.gain_s),
                           "modelled_migration_ms": _ms(cost_s), "horizon_steps": horizon,
                           "reason": reason}
        if not adopt:
            logger.info("step %d: EfficientMoE keeps the home experts: %s", step, reason)
            return None
        return self._apply(step, candidate, optimizer, reason, decision.gain_s, cost_s)

    def _apply(self, step: int, home_LWS: np.ndarray, optimizer, reason: str, gain_s: float,
               cost_s: float) -> Dict:
        start = time.perf_counter()
        moved = []
        for layer, home in zip(self.layers, home_LWS):
            layer.set_plan(home_plan(home, self.num_experts), optimizer)
            moved.append(layer.last_migration)
        weight_bytes = sum(int(m.sent_rows) * int(m.row_bytes) for m in moved)
        record = {"kind": "replan", "step": int(step), "what": "home experts",
                  "seconds": round(time.perf_counter() - start, 4),
                  "moved_slots": sum(int(m.moved_slots) for m in moved),
                  "moved_bytes": weight_bytes,
                  "state_bytes": sum(int(m.sent_rows) * int(m.row_bytes) * m.optimizer_states
                                     for m in moved),
                  "modelled_gain_ms_per_step": _ms(gain_s),
                  "modelled_migration_ms": _ms(cost_s),
                  "reason": reason}
        logger.info("step %d: EfficientMoE re-placed the home experts (%d slots, %d bytes "
                    "moved; %s)", step, record["moved_slots"], weight_bytes, reason)
        return record

    # ------------------------------------------------------------------ resume
    def state(self) -> Dict:
        """Nothing beyond the trace (the rows are the run's trace.npz): JSON-ready."""
        return {"rows": len(self.counts)}

    def load_state(self, state: Dict, counts_TLWE: np.ndarray) -> None:
        """Restore the history rows (the trace up to the checkpoint)."""
        self.counts = deque((np.asarray(row, dtype=np.int64) for row in counts_TLWE),
                            maxlen=self.em.window)


def _too_small(cluster, world: int) -> str:
    """The refusal of a cluster with fewer devices than the run's ranks, naming the fields."""
    per_node = cluster.devices_per_node
    return (f"'cluster' ({cluster.name}) has {cluster.num_devices} devices "
            f"({cluster.nodes} x {per_node}), but the run has {world} ranks; set 'cluster.nodes' "
            f"to >= {-(-world // per_node)} or 'cluster.preset' to a cluster with >= {world} "
            f"devices (for a resumed run: in its config.yaml).")
