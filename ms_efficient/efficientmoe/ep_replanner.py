"""Online EfficientMoE for expert-parallel layers: the slow level, the one place where running
expert-parallel layers are re-planned (used by ``ms_efficient.train.expert_parallel`` and by
``ms_efficient.efficientmoe.apply.EfficientMoECallback``).

Balanced layers (:class:`~ms_efficient.moe.balanced_ep.BalancedExpertParallelMoE`) read their
home table as data and balance every step inside fixed buffers (the fast level).
:class:`HomeReplanner` runs the slow level beside them: every ``efficientmoe.replan_every``
steps it asks :func:`~ms_efficient.efficientmoe.planner.decide_home` (the rule the simulator's
``efficientmoe`` row replays) whether a new home table for the recent routing pays for moving
the changed slots' weights and Adam moments over the check interval, both priced by the cost
model of the run's cluster; adopted, every layer switches through its ``set_plan`` (no shape
changes, no recompile). Every rank holds the same all-gathered counts, so every rank takes the
same decision without further communication.

Shapes: L MoE layers, W ranks (= devices), E experts, S_b slots per device, S_h of them home
slots.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from typing import Deque, Dict, List, Optional, Sequence

import numpy as np

from ms_efficient.efficientmoe.cost import CostModel
from ms_efficient.efficientmoe.planner import (Layout, LayoutConfig, decide_home,
                                              migration_time_s)
from ms_efficient.moe.balance import home_plan
from ms_efficient.moe.plan import ExpertPlan

__all__ = ["slot_budget", "compiled_graphs", "load_plans_state", "HomeReplanner", "layout_of",
           "balanced_cost_model"]

logger = logging.getLogger(__name__)


def slot_budget(num_experts: int, world: int, configured: int = 0) -> int:
    """S_b, weight slots per rank: ``configured`` (``moe.slots_per_device``) or, for 0,
    ceil(E / W) + 1 (one spare slot for the fast level's copies). Raises ValueError below
    ceil(E / W)."""
    least = -(-num_experts // world)
    if configured and configured < least:
        raise ValueError(f"'moe.slots_per_device' ({configured}) must be >= ceil(num_experts "
                         f"/ workers) = {least} (or 0 for automatic).")
    return int(configured or least + 1)


def compiled_graphs(cell=None) -> Optional[int]:
    """Graphs this process has compiled so far: MindSpore's cache of ``jit`` phases (one entry
    per fresh compile, none on a cache hit), plus ``cell``'s own cache of compiled phases
    (a ``Model.train`` network); None when MindSpore has no such cache."""
    import importlib

    cache = getattr(importlib.import_module("mindspore.graph.api"), "ms_compile_cache", None)
    if cache is None:
        return None
    return len(cache) + (len(getattr(cell, "compile_cache", ())) if cell is not None else 0)


def load_plans_state(entries: Sequence[Dict]) -> List[ExpertPlan]:
    """Plans stored in state.json (``ExpertPlan.to_dict`` per layer)."""
    return [ExpertPlan.from_dict(d) for d in entries]


# ---------------------------------------------------------------- balanced layers

def layout_of(layers: Sequence) -> Layout:
    """The :class:`~ms_efficient.efficientmoe.planner.Layout` the balanced ``layers`` run now:
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
