"""EfficientMoE's planner: predict -> replicate/place -> capacities -> re-plan decision.

One algorithm, used by every consumer: the trainer (``ms-efficient train``), the
``EfficientMoECallback`` of ``Model.train``, the ``efficientmoe`` pass, ``plan moe`` and the
trace replay of ``bench moe``. The measured and simulated EfficientMoE rows therefore come
from the same code; they differ only in the cost model's cluster and in how many source
ranks/devices a layer has (one device in the measured runs: no replicas are possible there,
so a plan is capacities only).

:class:`EfficientMoEPlanner` over a routing history ``counts_TLRE`` (int [step, layer,
source rank, expert]):
    1. forecast: the predictor's next-row per-rank counts and the relative errors of its
       recent forecasts over the plan's lifetime (:func:`predictor.relative_residuals`);
    2. layers whose one-step forecast errors (rms, relative) exceed ``max_forecast_error``
       are planned dropless: no replicas, each expert sized for the largest per-rank count
       the history holds (the offline dropless baseline's rule on the rows seen so far);
    3. every other layer: replication + placement + per-rank, per-slot capacities
       (:func:`placement.plan_layer`), optionally raised to ``capacity_levels`` distinct
       values per device (:func:`levels.quantize_levels`, fewer batched matmuls);
    4. lifetimes of ``horizon_multiples`` check intervals are sized and the least amortised
       one is kept (:func:`schedule.choose_horizon`);
    5. adopted only when it pays for migration + recompilation over its lifetime, or when the
       current plan is predicted or observed to drop more than ``max_drop_rate``
       (:func:`schedule.decide_replan`).

Its neighbours, one concept each: :mod:`~ms_efficient.efficientmoe.sampler` records the
history, :class:`~ms_efficient.efficientmoe.predictor.Forecaster` forecasts it (step 1),
:func:`~ms_efficient.efficientmoe.capacity.quantize_levels` quantizes capacities (step 3),
:mod:`~ms_efficient.efficientmoe.schedule` prices a re-plan (steps 4-5) and
:class:`~ms_efficient.efficientmoe.planner.ReplanLoop` says when to check: the first plan
(free: before the first compile), then every ``check_rows`` rows, and as soon as the drop
monitor fires.

No MindSpore here: the trainer and the callback turn a one-device plan into
``MoEFeedForward.set_capacities`` (:func:`capacities_LE`) and recompile.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import numpy as np

from ms_efficient.efficientmoe.capacity import (expected_expert_drop_rate, expected_pair_drop_rate,
                                                quantize_levels)
from ms_efficient.efficientmoe.cost import CostModel, check_rank_device, layer_cost
from ms_efficient.efficientmoe.placement import (PlacementConfig, default_slots_per_device,
                                                 device_bound, plan_layer)
from ms_efficient.efficientmoe.predictor import PREDICTOR_NAMES, Forecaster
from ms_efficient.efficientmoe.schedule import (DropMonitor, ReplanCosts, ReplanDecision,
                                                choose_horizon, decide_replan, migration_time_s,
                                                recompile_time_s, recompiles)
from ms_efficient.moe.plan import GROUPED_DISPATCH, ExpertPlan
from ms_efficient.moe.split import source_rows

__all__ = ["ReplanLoop", "PlannerConfig", "Proposal", "EfficientMoEPlanner", "single_device_plans",
           "capacities_LE", "planner_config", "one_device_planner", "one_device_counts",
           "DispatchChoice", "choose_dispatch"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlannerConfig:
    """Settings of the EfficientMoE planner (units in the names).

    slots_per_device: expert slots per device (None: ceil(E / devices) + 1, one spare slot
        for replicas; on one device: E).
    capacity_multiple: capacities are multiples of this (tokens; Ascend cube tile: 16).
    drop_target: expected drop rate the capacity model aims at.
    residual_window: forecast-error origins the capacity model looks at.
    predictor: load predictor name (see ``predictor.PREDICTOR_NAMES``).
    max_forecast_error: a layer whose recent one-step relative forecast errors (rms) exceed
        this is planned dropless. 0.75 was chosen on held-out synthetic traces the benchmark
        does not report (steady, noisy, and a router settling at one-step MAPE ~50 %) by a
        sweep over the one-level replay (docs/results.md, "Tuned constants"): below 0.75
        the settling trace's fast phase goes dropless and costs 3.8-4.5x the windowed
        dropless baseline; 0.75, 1 and never tie (0.45x there, 0.74 % drops).
    horizon_multiples: plan lifetimes considered, in check intervals.
    capacity_levels: at most this many distinct capacities per device (None: no limit);
        equal capacities run as one batched matmul in ``MoEFeedForward``.
    recompile_s: seconds one recompilation costs (None: :func:`schedule.recompile_time_s` of
        the planner's ``num_layers``, the measured model; a value overrides it).
    bytes_per_param, max_drop_rate, optimizer_states: see :class:`schedule.ReplanCosts`.
    dispatch: "static" (per-rank, per-slot capacities, padded), "grouped" (padding-free
        grouped expert compute over one row buffer per device; the capacity model sizes the
        buffers, ``capacity_levels`` does not apply) or "counts" (the same plans with a
        count-driven exchange, Ascend only: :mod:`ms_efficient.moe.plan`).
    max_block_drop_rate: the most expected drops (share of assignments) the send blocks of
        "grouped"/"counts" plans may cause (the user's constraint, default 0.1%); the
        per-pair target is chosen by simulated cost among fractions of it
        (:func:`placement.choose_blocks`: block padding against the risk of a forced
        re-plan, priced as one recompile over a check interval) and reported in the plan
        (``drop_target``, ``expected_drop_rate``).
    """

    slots_per_device: Optional[int] = None
    capacity_multiple: int = 16
    drop_target: float = 0.005
    residual_window: int = 8
    predictor: str = "ar-ridge"
    max_forecast_error: float = 0.75
    horizon_multiples: Tuple[int, ...] = (1, 2, 4, 8)
    capacity_levels: Optional[int] = None
    recompile_s: Optional[float] = None
    bytes_per_param: float = 4.0
    max_drop_rate: Optional[float] = 0.01
    dispatch: str = "static"
    max_block_drop_rate: float = 0.001
    optimizer_states: int = 2

    def __post_init__(self) -> None:
        checks = [
            ("capacity_multiple", self.capacity_multiple >= 1, ">= 1"),
            ("drop_target", 0.0 <= self.drop_target < 1.0, "in [0, 1)"),
            ("max_block_drop_rate", 0.0 <= self.max_block_drop_rate < 1.0, "in [0, 1)"),
            ("residual_window", self.residual_window >= 1, ">= 1"),
            ("predictor", self.predictor in PREDICTOR_NAMES, f"one of {list(PREDICTOR_NAMES)}"),
            ("max_forecast_error", self.max_forecast_error > 0, "> 0"),
            ("horizon_multiples", len(self.horizon_multiples) >= 1
             and all(int(m) >= 1 for m in self.horizon_multiples), "positive integers"),
            ("capacity_levels", self.capacity_levels is None or self.capacity_levels >= 1,
             "None or >= 1"),
            ("recompile_s", self.recompile_s is None or self.recompile_s >= 0,
             "None or >= 0"),
            ("optimizer_states", self.optimizer_states >= 0, ">= 0"),
            ("dispatch", self.dispatch in ("static",) + GROUPED_DISPATCH,
             "'static', 'grouped' or 'counts'"),
        ]
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"planner '{name}' must be {allowed}, but got "
                                 f"{getattr(self, name)!r}.")


@dataclass
class Proposal:
    """A candidate plan for every layer.

    plans: one ExpertPlan per layer. predicted_LRE: float64 [L, R, E] forecast it was sized
    from. rel_KLRE: relative errors for the next check interval. horizon_steps: training
    steps it is sized to serve. dropless_L: bool [L], layers planned dropless."""

    plans: List[ExpertPlan]
    predicted_LRE: np.ndarray
    rel_KLRE: np.ndarray
    horizon_steps: int
    dropless_L: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))


class EfficientMoEPlanner:
    """EfficientMoE plans of every MoE layer from a routing history (module docstring).

    model: CostModel (cluster, H, F, dtype) every candidate is scored with.
    num_experts: E. rank_device: int [R] device of each source rank (default rank r on r).
    top_k: experts per token. tokens_per_step: tokens all ranks route per layer and step
        (before top-k; None: unknown, then no dropless fallback).
    check_rows: trace rows between periodic checks (a plan lives >= this long).
    stride: training steps per trace row (1 when every step is sampled).
    num_layers: MoE layers of the network whose recompile a re-plan pays, sizing the default
        recompile cost (:func:`schedule.recompile_time_s`; None: 1, the figure the replay
        charges every method alike).
    """

    def __init__(self, config: PlannerConfig, model: CostModel, num_experts: int,
                 rank_device: Optional[Sequence[int]] = None, top_k: Optional[int] = None,
                 tokens_per_step: Optional[int] = None, check_rows: int = 1, stride: int = 1,
                 num_layers: Optional[int] = None):
        if check_rows < 1 or stride < 1:
            raise ValueError(f"'check_rows' and 'stride' must be >= 1, but got {check_rows} "
                             f"and {stride}.")
        self.config, self.model = config, model
        self.num_experts, self.top_k, self.tokens_per_step = num_experts, top_k, tokens_per_step
        num_ranks = len(rank_device) if rank_device is not None else model.cluster.num_devices
        self.rank_device = check_rank_device(rank_device, num_ranks, model.cluster)
        hosts = int(np.unique(self.rank_device).size)
        slots = config.slots_per_device or (
            num_experts if hosts == 1 else default_slots_per_device(num_experts, hosts))
        self.check_rows, self.stride = check_rows, stride
        self.costs = ReplanCosts(recompile_time_s(num_layers or 1, config.recompile_s),
                                 config.bytes_per_param,
                                 check_rows * stride, config.max_drop_rate,
                                 config.optimizer_states)
        # a forced re-plan: one recompile, over the shortest life of a plan (one interval)
        self.placement = PlacementConfig(slots, config.capacity_multiple, config.drop_target,
                                         dispatch=config.dispatch,
                                         max_block_drop_rate=config.max_block_drop_rate,
                                         replan_penalty_s=self.costs.recompile_s
                                         / (check_rows * stride),
                                         forced_replan_rate=config.max_drop_rate)
        self.forecaster = Forecaster(config.predictor, config.residual_window)

    # ------------------------------------------------------------------ one candidate
    def unpredictable_layers(self, counts_TLRE: np.ndarray,
                             forecaster: Optional[Forecaster] = None) -> np.ndarray:
        """bool [L]: layers planned dropless (their rms one-step relative forecast error is
        above ``max_forecast_error``); none while there is no error sample yet or the tokens
        per step are unknown."""
        rel = (forecaster or self.forecaster).one_step_errors(counts_TLRE)
        layers = np.asarray(counts_TLRE).shape[1]
        if rel.shape[0] == 0 or not self.tokens_per_step:
            return np.zeros(layers, dtype=bool)
        return np.sqrt(np.mean(rel ** 2, axis=(0, 2))) > self.config.max_forecast_error

    def plans_for(self, pred_LRE: np.ndarray, rel_KLRE: np.ndarray,
                  dropless_L: np.ndarray,
                  seen_max_LRE: Optional[np.ndarray] = None) -> List[ExpertPlan]:
        """One plan per layer: :func:`plan_layer`, then ``capacity_levels`` per device.
        seen_max_LRE: the largest count of each (layer, rank, expert) in the history, which
        sizes the layers planned dropless (None: all tokens of a step per slot)."""
        plans = []
        for layer in range(pred_LRE.shape[0]):
            plan = plan_layer(pred_LRE[layer], self.model, self.placement, self.rank_device,
                              rel_KLRE[:, layer], top_k=self.top_k,
                              tokens_per_step=self.tokens_per_step,
                              dropless=bool(dropless_L[layer]),
                              seen_max_RE=None if seen_max_LRE is None else seen_max_LRE[layer])
            levels = self.config.capacity_levels
            if levels and plan.dispatch == "static":
                caps = plan.slot_capacity.copy()
                for device in np.unique(plan.slot_device):
                    on = plan.slot_device == device
                    caps[on] = quantize_levels(np.maximum(caps[on], 1), levels)
                plan = ExpertPlan(plan.slot_expert, plan.slot_device, caps, plan.top_k,
                                  plan.tokens_per_step, plan.method, plan.dispatch,
                                  plan.rank_share)
            plans.append(plan)
        return plans

    def keep_buffers(self, plans: List[ExpertPlan], current: Optional[Sequence[ExpertPlan]],
                     pred_LRE: np.ndarray, rel_KLRE: np.ndarray) -> List[ExpertPlan]:
        """``plans`` with the current plan's row buffers wherever they still serve: a
        "grouped"/"counts" layer whose new placement is expected to drop at most
        ``max_block_drop_rate`` within the current buffers keeps them (the re-plan then needs no recompilation,
        :func:`schedule.recompiles`), so buffers change only when the forecast asks for
        more room."""
        if current is None or len(current) != len(plans):
            return plans
        out = []
        for layer, (plan, now) in enumerate(zip(plans, current)):
            if plan.dispatch == now.dispatch and plan.grouped:
                size = max(int(plan.slot_device.max()), int(now.slot_device.max())) + 1
                kept = dataclasses.replace(plan, device_buffer=now.device_rows(size),
                                           send_block=now.send_rows(self.rank_device.size,
                                                                    size))
                rate = self.expected_drop_rate([kept], pred_LRE[layer:layer + 1],
                                               rel_KLRE[:, layer:layer + 1])
                if rate <= self.config.max_block_drop_rate:
                    plan = dataclasses.replace(kept, expected_drop_rate=min(1.0, rate))
            out.append(plan)
        return out

    # ------------------------------------------------------------------ the loop's calls
    def propose(self, counts_TLRE: np.ndarray, current: Optional[Sequence[ExpertPlan]] = None,
                forecaster: Optional[Forecaster] = None,
                max_horizon_steps: Optional[int] = None) -> Proposal:
        """The candidate at the end of ``counts_TLRE``: every lifetime of
        ``horizon_multiples`` check intervals is sized, the least amortised kept.
        max_horizon_steps: steps left to serve (e.g. the end of a run): longer lifetimes are
        not considered (the shortest always is)."""
        fc = forecaster or self.forecaster
        dropless = self.unpredictable_layers(counts_TLRE, fc)
        seen_max = np.asarray(counts_TLRE).max(axis=0)        # [L, R, E], sizes dropless layers
        options = []
        multiples = sorted(set(int(m) for m in self.config.horizon_multiples))
        for mult in multiples:
            rows = mult * self.check_rows
            if options and max_horizon_steps is not None and rows * self.stride > max_horizon_steps:
                break
            pred, rel = fc.forecast(counts_TLRE, rows)
            plans = self.keep_buffers(self.plans_for(pred, rel, dropless, seen_max), current,
                                      pred, rel)
            step = self.step_time_s(plans, pred)
            moved = 0.0 if current is None else migration_time_s(
                current, plans, self.model, self.costs.bytes_per_param,
                self.costs.optimizer_states)
            if recompiles(current, plans):
                moved += self.costs.recompile_s
            options.append((plans, pred, rows * self.stride, step, moved))
        best = options[choose_horizon([o[3] for o in options], [o[4] for o in options],
                                      [o[2] for o in options], 0.0)]
        _, rel_next = fc.forecast(counts_TLRE, self.check_rows)
        # Safer alternatives, safest first: every layer at the dropless bound (all tokens of
        # a step per slot: never drops, never needs a re-plan), then every layer at the
        # largest per-rank counts seen (the best static dropless graph the history vouches
        # for). Each riskier option is taken only if, over its lifetime, it saves more than
        # the re-plan its drops may force: one recompile, weighted by how close its expected
        # drop rate comes to the rate that forces a re-plan, min(1, drops / max_drop_rate).
        # A tight plan that cannot pay for that is a bet, not a saving (on the demo trace's
        # 0.5 ms simulated steps a 1.2 s recompile needs 2,400 steps to pay back); an exact
        # forecast (no expected drops) risks nothing and is always kept.
        if self.tokens_per_step:
            layers = np.asarray(counts_TLRE).shape[1]
            every = np.ones(layers, dtype=bool)
            kept = (self.keep_buffers(self.plans_for(best[1], rel_next, every, None), current,
                                      best[1], rel_next), every)
            kept_s = self.step_time_s(kept[0], best[1])
            seen = self.keep_buffers(self.plans_for(best[1], rel_next, every, seen_max),
                                     current, best[1], rel_next)
            for plans, flags in ((seen, every), (best[0], dropless)):
                step_s = self.step_time_s(plans, best[1])
                risk = (min(1.0, self.expected_drop_rate(plans, best[1], rel_next)
                            / self.costs.max_drop_rate) if self.costs.max_drop_rate else 1.0)
                if (kept_s - step_s) * best[2] >= risk * self.costs.recompile_s:
                    kept, kept_s = (plans, flags), step_s
            if kept[0] is not best[0]:
                logger.debug("propose: a safer plan kept (%.3g s a step against %.3g s)",
                             kept_s, best[3])
            return Proposal(kept[0], best[1], rel_next, best[2], kept[1])
        return Proposal(best[0], best[1], rel_next, best[2], dropless)

    def check(self, counts_TLRE: np.ndarray, current: Sequence[ExpertPlan],
              observed_drop_rate: Optional[float] = None,
              forecaster: Optional[Forecaster] = None,
              max_horizon_steps: Optional[int] = None) -> Tuple[ReplanDecision, Proposal]:
        """Re-plan check: (decision, candidate). ``observed_drop_rate``: the current plan's
        drop rate since the last check (from the layers' drop counters), when known."""
        cand = self.propose(counts_TLRE, current, forecaster, max_horizon_steps)
        costs = ReplanCosts(self.costs.recompile_s, self.costs.bytes_per_param,
                            cand.horizon_steps, self.costs.max_drop_rate,
                            self.costs.optimizer_states)
        pred = cand.predicted_LRE
        worst = float(self.expected_drop_rate(current, pred, cand.rel_KLRE,
                                              per_layer=True).max())
        decision = decide_replan(self.step_time_s(current, pred),
                                 self.step_time_s(cand.plans, pred), current, cand.plans,
                                 self.model, costs, worst, observed_drop_rate)
        return decision, cand

    # ------------------------------------------------------------------ evaluation
    def step_time_s(self, plans: Sequence[ExpertPlan], counts_LRE: np.ndarray) -> float:
        """Modelled MoE seconds of one training step (all layers) under ``plans``."""
        return float(sum(layer_cost(p, c, self.model, self.rank_device).time_s
                         for p, c in zip(plans, counts_LRE)))

    def expected_drop_rate(self, plans: Sequence[ExpertPlan], pred_LRE: np.ndarray,
                           rel_KLRE: np.ndarray, per_layer: bool = False):
        """Expected drop rate of static ``plans`` over the coming rows, rank by rank (each rank
        drops what exceeds the rows it owns of an expert): the mean over layers, or float64
        [L] with ``per_layer``."""
        num_ranks = self.rank_device.size
        per_rank = self.tokens_per_step / num_ranks if self.tokens_per_step else None
        dpn = self.model.cluster.devices_per_node
        rates = []
        for layer, plan in enumerate(plans):
            if plan.grouped:                      # a pair drops what exceeds its block
                bound = device_bound(plan.slot_expert, plan.slot_device,
                                     int(plan.slot_device.max()) + 1, self.tokens_per_step,
                                     self.top_k)
                rates.append(expected_pair_drop_rate(
                    plan, pred_LRE[layer], rel_KLRE[:, layer], self.rank_device, dpn,
                    None if bound is None else np.tile(bound / num_ranks, (num_ranks, 1))))
                continue
            rows_RS = source_rows(plan, self.num_experts, self.rank_device, dpn,
                                  plan.rank_share)
            owned_RE = np.zeros((num_ranks, self.num_experts))
            np.add.at(owned_RE, (slice(None), plan.slot_expert), rows_RS)
            rates.append(expected_expert_drop_rate(
                owned_RE.ravel(), pred_LRE[layer].ravel(),
                rel_KLRE[:, layer].reshape(rel_KLRE.shape[0], -1), per_rank))
        return np.array(rates) if per_layer else float(np.mean(rates))

    def expected_padding_fraction(self, plans: Sequence[ExpertPlan],
                                  pred_LRE: np.ndarray) -> np.ndarray:
        """float64 [L]: computed rows that would hold no token on the forecast load."""
        out = []
        for plan, pred in zip(plans, pred_LRE):
            cost = layer_cost(plan, pred, self.model, self.rank_device)
            rows = float(cost.rows_D.sum())
            out.append((rows - cost.assigned) / rows if rows else 0.0)
        return np.array(out)


def single_device_plans(capacity_LE: np.ndarray, top_k: Optional[int] = None,
                        tokens_per_step: Optional[int] = None) -> List[ExpertPlan]:
    """The plans of a one-device network whose layers have per-expert ``capacity_LE``
    (int [L, E]): every expert one slot on device 0."""
    caps = np.asarray(capacity_LE, dtype=np.int64)
    experts = caps.shape[1]
    return [ExpertPlan(np.arange(experts), np.zeros(experts, np.int64), row, top_k,
                       tokens_per_step, "efficientmoe", "static") for row in caps]


def capacities_LE(plans: Sequence[ExpertPlan], num_experts: int) -> np.ndarray:
    """int64 [L, E] per-expert capacities of one-device plans (replica capacities summed)."""
    out = np.zeros((len(plans), num_experts), np.int64)
    for layer, plan in enumerate(plans):
        np.add.at(out[layer], plan.slot_expert, plan.slot_capacity)
    return out


def planner_config(em) -> PlannerConfig:
    """PlannerConfig of an ``efficientmoe:`` config section (EfficientMoEConfig)."""
    return PlannerConfig(capacity_multiple=em.capacity_multiple, drop_target=em.drop_target,
                         max_block_drop_rate=em.max_block_drop_rate,
                         residual_window=em.window, predictor=em.predictor,
                         max_forecast_error=em.max_forecast_error,
                         capacity_levels=em.capacity_levels, recompile_s=em.recompile_cost_s)


def one_device_planner(em, cluster, hidden: int, ffn_hidden: int, num_experts: int,
                       top_k: int, tokens_per_step: int,
                       num_layers: Optional[int] = None) -> EfficientMoEPlanner:
    """The planner of a network whose MoE layers run on one device (the trainer, the
    callback and the pass): every expert one slot on device 0, capacities only, scored on
    ``cluster`` (a ClusterSpec; fp32, as MindSpore's CPU kernels compute); a check every
    ``em.replan_every`` steps. num_layers: the network's MoE layers, which size the default
    recompile cost (``em.recompile_cost_s`` unset)."""
    model = CostModel(cluster, hidden, ffn_hidden, "fp32")
    return EfficientMoEPlanner(planner_config(em), model, num_experts, [0], top_k,
                               tokens_per_step, check_rows=em.replan_every,
                               num_layers=num_layers)


def one_device_counts(load_TLE: np.ndarray) -> np.ndarray:
    """[t, L, E] expert loads (or [t, L, R, E] counts) -> [t, L, 1, E]: one source rank."""
    load = np.asarray(load_TLE)
    if load.ndim == 4:
        load = load.sum(axis=2)
    return load[:, :, None, :]


@dataclass(frozen=True)
class DispatchChoice:
    """The outcome of :func:`choose_dispatch`: dispatch ("grouped" or "counts"), the chosen
    planner's proposal, and predicted_s: {dispatch: modelled MoE seconds of one step of
    that dispatch's proposal on the shared forecast}."""

    dispatch: str
    proposal: Proposal
    predicted_s: dict


def choose_dispatch(planners: dict, counts_TLRE: np.ndarray,
                    forecaster: Optional[Forecaster] = None) -> DispatchChoice:
    """Grouped or count-driven exchange for a run, chosen once, before the layers are built
    (the two are different graphs). ``planners``: {"grouped": planner, "counts": planner},
    the same settings but the dispatch. Each proposes plans for the history ``counts_TLRE``
    (int [T, L, R, E]) with the same forecaster; the one whose plans cost least on that
    forecast (:meth:`EfficientMoEPlanner.step_time_s`: a grouped block travels full, a
    counts exchange sends the kept rows plus its dynamic-shape overhead) wins, ties to
    "grouped" (static shapes). Deterministic. Big layers gain from sending no padding; small,
    latency-bound ones lose the overhead (measured per exchange, ``cost.DYNAMIC_EXCHANGE_S``)."""
    missing = [d for d in GROUPED_DISPATCH if d not in planners]
    if missing:
        raise ValueError(f"'planners' must hold a planner for each of {list(GROUPED_DISPATCH)}, "
                         f"but lacks {missing}.")
    proposals = {d: planners[d].propose(counts_TLRE, None, forecaster)
                 for d in GROUPED_DISPATCH}
    predicted = {d: planners[d].step_time_s(p.plans, p.predicted_LRE)
                 for d, p in proposals.items()}
    pick = min(GROUPED_DISPATCH, key=lambda d: (predicted[d], GROUPED_DISPATCH.index(d)))
    logger.info("choose_dispatch: %s (predicted %s)", pick,
                ", ".join(f"{d} {1e3 * t:.4g} ms" for d, t in predicted.items()))
    return DispatchChoice(pick, proposals[pick], predicted)


# ---- re-plan loop: when the planner is asked for a new plan ----------------------------
# The first plan is free (nothing is compiled yet); then a check every ``check_rows`` trace
# rows after it, and as soon as the drop monitor (schedule.DropMonitor) fires. The trainer,
# the EfficientMoECallback and the replay of ``bench moe`` all drive the planner through
# this loop, so they check at the same rows.
class ReplanLoop:
    """When the planner is asked: the first plan (free, nothing compiled yet), then a check
    every ``check_rows`` rows after it, and as soon as the drop monitor fires (the current
    plan dropped more than ``max_drop_rate`` of the tokens over >= ``monitor_rows`` rows)."""

    def __init__(self, planner: EfficientMoEPlanner, monitor_rows: int):
        self.planner = planner
        self.monitor = DropMonitor(max(1, monitor_rows), planner.config.max_drop_rate)
        self.first_row: Optional[int] = None

    def observe(self, dropped, routed) -> None:
        """Drops the current plan had on one row: per layer (int [L]) or summed."""
        self.monitor.record(dropped, routed)

    def poll(self, row: int, counts_TLRE: np.ndarray, current: Optional[Sequence[ExpertPlan]],
             compiled: bool = True, forecaster: Optional[Forecaster] = None,
             max_horizon_steps: Optional[int] = None
             ) -> Optional[Tuple[Optional[ReplanDecision], Proposal]]:
        """At ``row`` (before it runs): None when no check is due; else (decision, candidate),
        decision None for a first plan (``current`` None or not ``compiled``), which is
        adopted as is. The first poll of a network already compiled with ``current`` (e.g.
        after warm-up steps at a static capacity) checks at once."""
        first = self.first_row is None
        if first or current is None or not compiled:
            self.first_row = row
        if current is None or not compiled:
            self.monitor.reset()
            return None, self.planner.propose(counts_TLRE, None, forecaster, max_horizon_steps)
        fired = self.monitor.fired()
        due = first or (row - self.first_row) % self.planner.check_rows == 0
        if not (due or fired):
            return None
        observed = self.monitor.rate() if fired else None
        self.monitor.reset()
        return self.planner.check(counts_TLRE, current, observed, forecaster,
                                  max_horizon_steps)
