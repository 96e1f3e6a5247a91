"""Replay a routing trace step by step under an expert-planning method on a simulated cluster.

One source rank per device (rank r on device r); experts live on the ranks' devices only (a
4-rank trace on an 8-chip node uses 4 chips). Each row of the trace is one training step's
routing (``counts[t, layer, rank, expert]``); rows may be sampled every ``stride`` training
steps (from the trace's ``steps``, default 1). For every row from ``warmup`` on, each MoE
layer is costed by :func:`ms_efficient.efficientmoe.cost.layer_cost` (All-to-All dispatch and
combine, forward and backward; expert compute on padded capacities; replica gradient sync),
which :func:`ms_efficient.efficientmoe.cost.event_step_time_s` re-derives on the shared event
simulator (tested equal).

Methods (labels of issue 4), each run the way the system itself runs, with its own dispatch.
The two-level methods, ``efficientmoe`` (the default), ``efficientmoe-fixed-home``, ``moonep``,
``ablation-eplb-split`` and ``eplb-alltoallv``, are replayed by :mod:`ms_efficient.efficientmoe.two_level` (a fixed layout,
balanced every step from the step's counts); the others here
(:mod:`ms_efficient.moe.plan`). Static-graph methods are the package's expert-parallel layer
(``ep_layer``) with that method's plan: every rank owns fixed rows of every slot, drops its
overflow, and sends its rows full or empty (``dispatch="static"``; ``static_blocks``).
"Grouped" methods compute only the rows they receive (a grouped matmul whose group sizes are
data, each group's rows rounded up to the cube tile, ``ClusterSpec.matmul_tile_rows``) into
one static row buffer per device, after a routing-count exchange (``dispatch="grouped"``):
    efficientmoe-grouped  our earlier one-level design: predictor (ar-ridge) + scheduler (replication, placement) + one row
                     buffer per device from the capacity model, grouped dispatch, re-planned
                     through :func:`ms_efficient.efficientmoe.schedule.decide_replan`; layers
                     whose loads cannot be forecast yet get no replicas and buffers for the
                     largest counts seen.
    efficientmoe-counts  the same planner and plans with the count-driven exchange
                     (``dispatch="counts"``, Ascend ``ops.AlltoAllVC``): the kept rows
                     travel, no block padding, at the dynamic-shape overhead
                     ``CostModel.dynamic_exchange_s`` per exchange.
    efficientmoe-static  the same planner with per-rank, per-slot static capacities (padded
                     expert compute, no count exchange): the mode of earlier rounds.
    dropless-grouped MegaBlocks-style dropless grouped compute (Gale et al., "MegaBlocks:
                     Efficient Sparse Training with Mixture-of-Experts", MLSys 2023): uniform
                     placement, no replicas, every buffer as large as its device could ever
                     receive, never re-planned (what grouped dispatch gives without a planner).
    switch-cf1.0/1.25/2.0, dropless-static   GShard / Switch: uniform placement, equal
                     per-rank capacity in every expert, never re-planned (see :mod:`baselines`).
    eplb-ema         EPLB's placement policy fed by an EMA predictor, one capacity for all
                     slots, re-balanced on its own schedule as published: every check
                     interval, adopted whatever the gain (paying migration, and a
                     recompilation whenever a compiled shape changes).
    eplb-ar          EPLB fed by our predictor (ar-ridge), otherwise as eplb-ema: its
                     placement policy at its best forecast.
    eplb-ema-grouped, eplb-ar-grouped, mindspeed-greedy-grouped  the same placements with
                     grouped dispatch and the send blocks ours would give them
                     (:func:`placement.grouped_plan`, the same cost-chosen per-pair drop
                     target within ``max_block_drop_rate``): these rows differ
                     from efficientmoe only by placement and forecast.
    eplb-ema-counts, eplb-ar-counts  EPLB's placements with the count-driven exchange, the
                     same blocks as upper bounds: they differ from efficientmoe-counts only
                     by placement and forecast.
    mindspeed-greedy its greedy placement fed by an EMA predictor, one capacity for all
                     slots, re-planned by the same checks and rule as ours.
    dropless-window  a realistic dropless static graph: every expert's per-rank capacity is
                     the largest count that rank sent it over the last ``residual_window``
                     rows, re-planned by the same checks and rule as ours (dropless-static
                     sizes once, from the whole trace).
    fastermoe        per-step shadowing from the step's actual counts (its design), as many
                     experts as its performance model wants (no slot limit, as in the
                     paper), plus the per-step weight broadcast; dynamic shapes: count
                     exchange, then only the routed tokens; no padding, no drops, no compile
                     cost.
    efficientmoe-auto  ours with the dispatch chosen once at the first plan, grouped or
                     counts, whichever's plans cost less on the forecast
                     (:func:`planner.choose_dispatch`; the layers are built for one); then
                     the chosen row exactly.
    oracle           our scheduler with the true counts of each step, exact capacities, and
                     free re-planning every step (a reference, not a reachable system).
    oracle-grouped   the same with grouped dispatch (blocks of exactly the step's rows). Not
                     a bound: it pays a replica-sync table every step, and the two-level
                     rows beat it.
    oracle-bound     a true lower bound (:func:`two_level.lower_bound_step_s`): every
                     assignment computed, perfectly spread, at peak, with no exchange,
                     copy, sync or fast level; no row can beat it (a test holds every
                     method to it on random counts).
    oracle-static    ours with perfect foresight and nothing else changed: a static graph,
                     re-planned by the same checks and the same rule at the same cost, whose
                     planner is given the true counts of the rows each candidate plan would
                     serve (their mean as the forecast, their deviations from it as the
                     error samples) instead of forecasts. The gap between it and
                     efficientmoe-static is what forecasting costs; the gap between it and
                     oracle is what static shapes cost.

Re-plan checks happen every ``check_every_steps`` training steps, and as soon as the current
plan dropped more than 1 % of the tokens over ``monitor_steps`` (the drop monitor, what the
trainer sees from the layer's drop counter). Ours runs
:class:`ms_efficient.efficientmoe.planner.ReplanLoop` and ``EfficientMoEPlanner``, the loop
and planner of the trainer and the callback: at a check it sizes candidate plans for lifetimes
of 1, 2, 4 or 8 check intervals and keeps the one with the least amortised step time; the
re-planned baselines make the same choice (:meth:`_Context.baseline_candidate`). Every
method starts from a plan made at row ``warmup`` (its first compilation, not charged); an
adopted re-plan costs migration + recompilation (only when a compiled shape changes,
:func:`schedule.recompiles`, for every method alike), amortised over the training steps the
replay covers:
    iteration_time_s = mean step time + total re-plan seconds / (rows * stride).
The oracle re-plans every row for free.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np

from ms_efficient.core.cluster import PRESETS, ClusterSpec, get_cluster
from ms_efficient.efficientmoe import baselines
from ms_efficient.efficientmoe.cost import DYNAMIC_DISPATCH, FAST_LEVEL_S, CostModel, layer_cost
from ms_efficient.efficientmoe.predictor import Forecaster
from ms_efficient.efficientmoe.planner import (DispatchChoice, EfficientMoEPlanner, PlannerConfig,
                                               choose_dispatch)
from ms_efficient.efficientmoe.predictor import FLOOR_FRACTION, error_floor
from ms_efficient.efficientmoe.planner import ReplanLoop
from ms_efficient.efficientmoe.two_level import (LOWER_BOUND, TWO_LEVEL_METHODS,
                                                 replay_lower_bound, replay_two_level)
from ms_efficient.efficientmoe.schedule import (DropMonitor, ReplanDecision, choose_horizon,
                                                decide_replan, migration_time_s, plans_equal,
                                                recompiles)
from ms_efficient.moe.plan import GROUPED_DISPATCH, ExpertPlan
from ms_efficient.moe.trace import RoutingTrace

__all__ = ["METHODS", "DEFAULT_METHODS", "ReplayConfig", "ReplayResult", "cluster_for_ranks", "check_trace_fits",
           "replay", "plan_trace", "trace_dispatch_choice"]

logger = logging.getLogger(__name__)

METHODS = ("efficientmoe", "efficientmoe-fixed-home", "moonep", "ablation-eplb-split",
           "eplb-alltoallv",
           "efficientmoe-grouped", "efficientmoe-counts", "efficientmoe-static", "switch-cf1.0",
           "switch-cf1.25", "switch-cf2.0", "dropless-static", "dropless-window",
           "dropless-grouped", "fastermoe", "eplb-ema", "eplb-ar", "eplb-ema-grouped",
           "eplb-ar-grouped", "eplb-ema-counts", "eplb-ar-counts", "mindspeed-greedy",
           "mindspeed-greedy-grouped", "oracle", "oracle-grouped", "oracle-static",
           "efficientmoe-auto", "oracle-bound")
# what ``bench moe`` replays unless told (issue 32's rows): ours, ours without home re-plans
# (what train --workers runs with dispatch "balanced" today), MoonEP, the fast level under
# EPLB's placement, EPLB as published with each exchange, FasterMoE, Switch, dropless grouped,
# the lower bound; the one-level rows stay available through --methods
DEFAULT_METHODS = ("efficientmoe", "efficientmoe-fixed-home", "moonep", "ablation-eplb-split",
                   "eplb-alltoallv",
                   "eplb-ema-counts", "eplb-ema-grouped", "fastermoe", "switch-cf1.25",
                   "dropless-grouped", "oracle-bound")
_EPLB = {"eplb-ema", "eplb-ar", "eplb-ema-grouped", "eplb-ar-grouped", "eplb-ema-counts",
         "eplb-ar-counts"}                    # re-balanced on their own periodic schedule
_ADAPTIVE = _EPLB | {"efficientmoe", "efficientmoe-counts", "efficientmoe-static",
                     "mindspeed-greedy", "mindspeed-greedy-grouped", "oracle-static",
                     "dropless-window"}
# our planner (planner.EfficientMoEPlanner), and the dispatch it plans for
_OURS = {"efficientmoe-grouped": "grouped", "efficientmoe-counts": "counts",
         "efficientmoe-static": "static", "oracle-static": "static"}
_AUTO = "efficientmoe-auto"     # ours, the dispatch chosen at the first plan (choose_dispatch)
_OUR_PREDICTOR = {"eplb-ar", "eplb-ar-grouped", "eplb-ar-counts"}   # given our forecaster
# the per-step oracles (our scheduler given each row's true counts), and their dispatch
_ORACLES = {"oracle": "static", "oracle-grouped": "grouped"}


@dataclass(frozen=True)
class ReplayConfig:
    """Replay and planner settings (units in the names).

    slots_per_device: expert slots per device (None: ceil(E / D) + 1, one spare for replicas).
    capacity_multiple: capacity rounding, tokens (Ascend cube tile: 16).
    drop_target: expected drop rate the capacity model aims at.
    warmup: rows used as history only before metrics start (>= 2).
    residual_window: forecast-error origins the capacity model looks at.
    check_every_steps: training steps between re-plan checks, also the re-plan horizon.
    monitor_steps: the drop monitor forces a check when the current plan dropped more than
        ReplanCosts.max_drop_rate of the tokens over at least this many training steps.
    hidden: H (None: the trace's ``hidden``, else 1024). ffn_hidden: F (None: 4 H).
    dtype: activation/weight dtype. predictor: our load predictor's name.
    recompile_s: seconds to recompile after a plan change (see ReplanCosts).
    max_forecast_error: our planner treats a layer as unpredictable, and plans it dropless
        (every slot sized for all tokens of a step), while the root mean square of its recent
        one-step relative forecast errors is above this (PlannerConfig: chosen on held-out
        traces by scripts/tune_efficientmoe.py).
    static_blocks: how static-graph methods send the rows each rank owns (CostModel): "exact"
        (an AlltoAllV with compile-time per-peer counts, as ms_efficient.moe.ep_layer does)
        or "equal" (an equal-split AlltoAll padded to the largest block).
    sync_replica_grads: charge the all-reduce of replicated experts' gradients (False: assume
        it is hidden behind other layers' backward).
    dispatch: what ``plan moe`` (:func:`plan_trace`) plans for, "grouped", "counts",
        "static" or "auto" (grouped or counts, the one predicted cheaper:
        :func:`planner.choose_dispatch`); the replay's methods each keep their own.
    max_block_drop_rate: the most expected drops the send blocks of our "grouped"/"counts"
        plans and of the grouped baselines may cause; the per-pair target within it is chosen
        by cost (PlannerConfig, placement.choose_blocks).
    fast_level_s: the two-level methods' fast-level time per layer-step (CostModel;
        default ``FAST_LEVEL_S``, measured).
    expert_kind: "mlp" (two matrices) or "glu" (gated: Mixtral, DeepSeek); expert_bias:
        whether the experts carry biases (CostModel: FLOPs per row, a copy's bytes).
    """

    slots_per_device: Optional[int] = None
    capacity_multiple: int = 16
    drop_target: float = 0.005
    warmup: int = 16
    residual_window: int = 8
    check_every_steps: int = 200
    monitor_steps: int = 20
    hidden: Optional[int] = None
    ffn_hidden: Optional[int] = None
    dtype: str = "bf16"
    predictor: str = "ar-ridge"
    recompile_s: Optional[float] = None     # None: schedule.recompile_time_s (PlannerConfig)
    max_forecast_error: float = 0.75
    static_blocks: str = "exact"
    sync_replica_grads: bool = True
    dispatch: str = "grouped"
    max_block_drop_rate: float = 0.001
    fast_level_s: float = FAST_LEVEL_S
    expert_kind: str = "mlp"
    expert_bias: bool = True

    def planner_config(self) -> PlannerConfig:
        """The settings of our planner (the same class the trainer builds from its config)."""
        return PlannerConfig(slots_per_device=self.slots_per_device,
                             capacity_multiple=self.capacity_multiple,
                             drop_target=self.drop_target,
                             residual_window=self.residual_window, predictor=self.predictor,
                             max_forecast_error=self.max_forecast_error,
                             recompile_s=self.recompile_s, dispatch=self.dispatch,
                             max_block_drop_rate=self.max_block_drop_rate)


@dataclass
class ReplayResult:
    """Metrics of one method on one trace (seconds; fractions in [0, 1]).

    iteration_time_s: mean MoE time of a training step (all layers, fwd + bwd) plus amortised
        re-planning. a2a_time_s: its All-to-All part (routing-count exchange included).
        max_over_mean_load: tokens of the busiest device over the mean, averaged over layers
        and steps. padding_fraction: computed slot rows that held no token / computed slot
        rows. drop_rate: dropped / routed tokens. replans: adopted re-plans, forced_replans
        of them adopted for their drops rather than their gain (see decide_replan).
    """

    method: str
    iteration_time_s: float
    a2a_time_s: float
    max_over_mean_load: float
    padding_fraction: float
    drop_rate: float
    replans: int = 0
    replan_overhead_s: float = 0.0
    forced_replans: int = 0
    step_time_s: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    extra: Dict[str, float] = field(default_factory=dict)

    def metrics(self) -> Dict[str, float]:
        """The issue-4 metric fields plus re-plan figures (and, for the two-level methods,
        copies and weight bytes per step), JSON-ready."""
        return {**self.extra, "iteration_time_s": self.iteration_time_s, "a2a_time_s": self.a2a_time_s,
                "max_over_mean_load": self.max_over_mean_load,
                "padding_fraction": self.padding_fraction, "drop_rate": self.drop_rate,
                "replans": self.replans, "forced_replans": self.forced_replans,
                "replan_overhead_s": self.replan_overhead_s}


def cluster_for_ranks(num_ranks: int) -> ClusterSpec:
    """ceil(R / 8) Ascend 910B nodes of 8 devices (a preset when one matches)."""
    nodes = max(1, -(-num_ranks // 8))
    name = f"ascend910b-{nodes}x8"
    if name in PRESETS:
        return PRESETS[name]
    return get_cluster("ascend910b-1x8").with_overrides(nodes=nodes, name=name)


def check_trace_fits(trace: RoutingTrace, cluster: ClusterSpec) -> None:
    """ValueError when the trace has more source ranks than the cluster has devices."""
    if trace.num_ranks > cluster.num_devices:
        raise ValueError(f"trace has {trace.num_ranks} source ranks but cluster "
                         f"'{cluster.name}' has {cluster.num_devices} devices (one rank per "
                         f"device); use a cluster with >= {trace.num_ranks} devices.")


def _stride(trace: RoutingTrace) -> int:
    if trace.steps is None or trace.num_steps < 2:
        return 1
    diffs = np.diff(trace.steps)
    if (diffs < 1).any():
        raise ValueError("trace 'steps' must be strictly increasing.")
    return int(np.median(diffs))


def _deviations(rows: np.ndarray):
    """(mean over rows [L, ...], relative deviations of every row from it [h, L, ...]) of
    ``rows`` [h, L, ...], relative to max(mean, floor), floor = max(1, FLOOR_FRACTION x the
    layer's mean entry), as :func:`predictor.relative_residuals` floors."""
    future = np.asarray(rows, dtype=np.float64)
    mean = future.mean(axis=0)
    layers = mean.shape[0]
    floor = error_floor(mean.reshape(layers, -1), FLOOR_FRACTION)             # [L, 1]
    return mean, (future - mean) / np.maximum(mean, floor.reshape(
        (layers,) + (1,) * (mean.ndim - 1)))


class Foresight(Forecaster):
    """Perfect foresight in the form of a forecast (oracle-static), at row ``t`` of ``counts``.

    forecast: (mean true counts [L, R, E] of rows [t, t + h), their relative deviations from
    that mean [h, L, R, E]), relative to the same floored mean as
    :func:`predictor.relative_residuals` (h is cut at the end of the trace).
    one_step_errors: the same deviations of the expert totals over the coming check interval:
    a layer whose loads swing that much within one plan's life is planned dropless by an
    oracle too (a static plan sized for it would be re-planned by the drop monitor)."""

    def __init__(self, counts_TLRE: np.ndarray, t: int, check_rows: int):
        self.counts, self.t, self.check_rows = counts_TLRE, t, check_rows

    def forecast(self, counts_TLRE: np.ndarray, horizon_rows: int):
        return _deviations(self.counts[self.t:self.t + horizon_rows])

    def one_step_errors(self, counts_TLRE: np.ndarray) -> np.ndarray:
        return _deviations(self.counts[self.t:self.t + self.check_rows].sum(axis=2))[1]


class _Context:
    """Everything a method needs to plan one row: the trace, cost model and settings. Ours
    (and oracle-static) plan with :class:`planner.EfficientMoEPlanner`, the planner the
    trainer and the callback use."""

    def __init__(self, trace: RoutingTrace, cluster: ClusterSpec, config: ReplayConfig):
        if config.warmup < 2 or config.warmup >= trace.num_steps:
            raise ValueError(f"'warmup' must be in [2, {trace.num_steps - 1}] for a "
                             f"{trace.num_steps}-row trace, but got {config.warmup}.")
        self.trace, self.cluster, self.config = trace, cluster, config
        hidden = config.hidden or trace.hidden or 1024
        self.model = CostModel(cluster, hidden, config.ffn_hidden or 4 * hidden, config.dtype,
                               sync_replica_grads=config.sync_replica_grads,
                               static_blocks=config.static_blocks,
                               fast_level_s=config.fast_level_s,
                               expert_kind=config.expert_kind, expert_bias=config.expert_bias)
        self.rank_device = np.arange(trace.num_ranks)
        self.stride = _stride(trace)
        self.check_rows = max(1, round(config.check_every_steps / self.stride))
        self.monitor_rows = max(1, round(config.monitor_steps / self.stride))
        self.load = trace.expert_load()                                      # [T, L, E]
        self.top_k = trace.top_k
        # assignments (tokens x top_k) each rank routes per step, and tokens per step over
        # all ranks: no expert can receive more than the latter (None: unknown)
        per_rank = trace.counts.sum(axis=3)                                    # [T, L, R]
        if trace.tokens_per_rank and trace.top_k:
            self.assignments_per_rank = trace.tokens_per_rank * trace.top_k
            self.tokens_per_step: Optional[int] = trace.tokens_per_rank * trace.num_ranks
        else:
            self.assignments_per_rank = int(round(per_rank.mean()))
            self.tokens_per_step = (int(per_rank.sum(axis=2).max()) // trace.top_k
                                    if trace.top_k else None)
        self.planners = {
            dispatch: EfficientMoEPlanner(
                dataclasses.replace(config, dispatch=dispatch).planner_config(), self.model,
                trace.num_experts, self.rank_device, self.top_k, self.tokens_per_step,
                self.check_rows, self.stride, trace.num_layers)
            for dispatch in ("static", "grouped", "counts")}
        # the static one also evaluates the baselines (its evaluations follow each plan's
        # own dispatch)
        self.planner = self.planners["static"]
        self.placement = self.planner.placement
        self.costs = self.planner.costs

    def choose_dispatch(self, t: int) -> DispatchChoice:
        """Grouped or counts for our planner from rows < t (:func:`choose_dispatch`)."""
        return choose_dispatch({d: self.planners[d] for d in GROUPED_DISPATCH},
                               self.trace.counts[:t], self.forecaster("efficientmoe", t))

    def ours(self, method: str) -> EfficientMoEPlanner:
        """Our planner for ``method`` (one of ``_OURS``)."""
        return self.planners[_OURS[method]]

    def forecaster(self, method: str, t: int) -> Forecaster:
        if method == "oracle-static":
            return Foresight(self.trace.counts, t, self.check_rows)
        if method in _OURS or method in _OUR_PREDICTOR:      # EPLB given our predictor
            return self.planner.forecaster
        return Forecaster("ema", self.config.residual_window)

    def predicted(self, t: int, method: str, horizon_rows: int):
        """(predicted counts [L, R, E] for row t, relative errors of those per-rank forecasts
        [K, L, R, E] over the next ``horizon_rows`` rows) from rows < t; for oracle-static
        from the true rows [t, t + horizon_rows) instead (:class:`Foresight`)."""
        return self.forecaster(method, t).forecast(self.trace.counts[:t], horizon_rows)

    def baseline_plans(self, method: str, t: int, horizon_rows: Optional[int] = None):
        """(plans per layer, predicted counts [L, R, E], residuals [K, L, R, E]) of a
        re-planned baseline at row t, sized for ``horizon_rows`` rows (default one check
        interval)."""
        pred, rel = self.predicted(t, method, horizon_rows or self.check_rows)
        dispatch = method.rsplit("-", 1)[1] if method.endswith(GROUPED_DISPATCH) else "static"
        plans = []
        for layer in range(self.trace.num_layers):
            args = (pred[layer], rel[:, layer], self.model, self.placement, self.rank_device)
            sizes = {"top_k": self.top_k, "tokens_per_step": self.tokens_per_step,
                     "dispatch": dispatch}
            if method.startswith("eplb-"):
                plans.append(baselines.eplb_plan(*args, **sizes))
            elif method == "dropless-window":
                window = self.trace.counts[max(0, t - self.config.residual_window):t, layer]
                plans.append(baselines.dropless_static_plan(window, self.rank_device,
                                                            self.top_k))
            else:
                plans.append(baselines.greedy_plan(*args, **sizes))
        return plans, pred, rel

    def baseline_candidate(self, method: str, t: int, current: Optional[List[ExpertPlan]]):
        """A baseline's candidate at row t with the re-plan interval choice ours has: plans
        sized for lifetimes of ``horizon_multiples`` check intervals, the least amortised
        kept (:func:`schedule.choose_horizon`: step time + (migration + recompile, charged by
        :func:`schedule.recompiles`) / lifetime). Returns (plans, predicted counts [L, R, E],
        residuals over the next check interval [K, L, R, E], horizon_steps)."""
        options = []
        for mult in sorted(set(int(m) for m in self.planner.config.horizon_multiples)):
            rows = mult * self.check_rows
            plans, pred, _ = self.baseline_plans(method, t, rows)
            moved = 0.0 if current is None else migration_time_s(
                current, plans, self.model, self.costs.bytes_per_param,
                self.costs.optimizer_states)
            if current is not None and recompiles(current, plans):
                moved += self.costs.recompile_s
            options.append((plans, pred, rows * self.stride,
                            self.planner.step_time_s(plans, pred), moved))
        best = options[choose_horizon([o[3] for o in options], [o[4] for o in options],
                                      [o[2] for o in options], 0.0)]
        _, rel_next = self.predicted(t, method, self.check_rows)
        return best[0], best[1], rel_next, best[2]

    def propose(self, method: str, t: int, current: Optional[List[ExpertPlan]]):
        """Candidate plans at row t: (plans, predicted counts [L, R, E], horizon_steps)."""
        if method in _OURS:
            cand = self.ours(method).propose(self.trace.counts[:t], current,
                                             self.forecaster(method, t))
            return cand.plans, cand.predicted_LRE, cand.horizon_steps
        plans, pred, _, horizon = self.baseline_candidate(method, t, current)
        return plans, pred, horizon

    def check(self, method: str, t: int, current: List[ExpertPlan],
              observed_drop_rate: Optional[float] = None):
        """Re-plan check at row t: (ReplanDecision, candidate plans). ``observed_drop_rate``:
        the current plan's drop rate since the last check, when the drop monitor fired."""
        if method in _OURS:
            decision, cand = self.ours(method).check(self.trace.counts[:t], current,
                                                     observed_drop_rate,
                                                     self.forecaster(method, t))
            return decision, cand.plans
        candidate, pred, rel_next, horizon = self.baseline_candidate(method, t, current)
        costs = dataclasses.replace(self.costs, horizon_steps=horizon)
        decision = decide_replan(self.planner.step_time_s(current, pred),
                                 self.planner.step_time_s(candidate, pred),
                                 current, candidate, self.model, costs,
                                 float(self.planner.expected_drop_rate(
                                     current, pred, rel_next, per_layer=True).max()),
                                 observed_drop_rate)
        return decision, candidate

    def static_plans(self, method: str) -> List[ExpertPlan]:
        num_experts, num_ranks = self.trace.num_experts, self.trace.num_ranks
        if method.startswith("switch-cf"):
            cf = float(method[len("switch-cf"):])
            plan = baselines.switch_plan(num_experts, self.rank_device, num_ranks,
                                         self.assignments_per_rank, cf, self.top_k)
            return [plan] * self.trace.num_layers
        if method == "dropless-grouped":
            plan = baselines.dropless_grouped_plan(num_experts, self.rank_device,
                                                   self.tokens_per_step, self.top_k,
                                                   self.assignments_per_rank * num_ranks)
            return [plan] * self.trace.num_layers
        return [baselines.dropless_static_plan(self.trace.counts[:, layer], self.rank_device,
                                               self.top_k)
                for layer in range(self.trace.num_layers)]

    def step_cost(self, plans: Sequence[ExpertPlan], counts_LRE: np.ndarray):
        return [layer_cost(p, c, self.model, self.rank_device) for p, c in zip(plans, counts_LRE)]


def replay(trace: RoutingTrace, method: str, cluster: Optional[ClusterSpec] = None,
           config: ReplayConfig = ReplayConfig()) -> ReplayResult:
    """Replay ``trace`` under ``method`` (one of METHODS) on ``cluster`` (default:
    :func:`cluster_for_ranks`); returns the metrics over rows [warmup, T)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {list(METHODS)}, but got {method!r}.")
    cluster = cluster or cluster_for_ranks(trace.num_ranks)
    check_trace_fits(trace, cluster)
    ctx = _Context(trace, cluster, config)
    if method == LOWER_BOUND:
        return ReplayResult(**replay_lower_bound(trace, ctx.model, config.warmup))
    if method in TWO_LEVEL_METHODS:
        per_device = -(-trace.num_experts // trace.num_ranks)
        extra = (1 if config.slots_per_device is None
                 else config.slots_per_device - per_device)
        if extra < 0:
            raise ValueError(f"'slots_per_device' must be >= ceil(E / W) = {per_device}, but "
                             f"got {config.slots_per_device}.")
        return ReplayResult(**replay_two_level(trace, method, ctx.model, config.warmup,
                                               ctx.check_rows, ctx.stride, extra,
                                               config.residual_window))
    counts = trace.counts
    label = method
    if method == _AUTO:        # then exactly the chosen dispatch's method, labelled auto
        chosen = ctx.choose_dispatch(config.warmup).dispatch
        method = "efficientmoe-grouped" if chosen == "grouped" else "efficientmoe-counts"
    plans: List[ExpertPlan] = []
    if method.startswith("switch-cf") or method in ("dropless-static", "dropless-grouped"):
        plans = ctx.static_plans(method)
    step_times, a2a_times, imbalance, weight_bytes = [], [], [], []
    rows = computed = assigned = dropped = 0
    replans, forced, overhead = 0, 0, 0.0
    monitor = DropMonitor(ctx.monitor_rows, ctx.costs.max_drop_rate)
    loop = ReplanLoop(ctx.ours(method), ctx.monitor_rows) if method in _OURS else None

    def due(t: int) -> bool:                         # periodic re-plan check
        return (t - config.warmup) % ctx.check_rows == 0
    for t in range(config.warmup, trace.num_steps):
        extra_s = 0.0
        decision = None
        if method in _ORACLES:
            placement = ctx.planners[_ORACLES[method]].placement
            plans = [baselines.oracle_plan(counts[t, layer], ctx.model, placement,
                                           ctx.rank_device, ctx.top_k, ctx.tokens_per_step)
                     for layer in range(trace.num_layers)]
        elif method == "fastermoe":
            made = [baselines.fastermoe_plan(counts[t, layer], ctx.model, None,
                                             ctx.rank_device)
                    for layer in range(trace.num_layers)]
            plans = [p for p, _ in made]
            extra_s = sum(b for _, b in made)
            # every shadowed expert's weights reach every other device of the job
            shadows = sum(int((p.replica_counts(trace.num_experts) > 1).sum()) for p in plans)
            weight_bytes.append(shadows * ctx.model.grad_bytes * (trace.num_ranks - 1))
        elif loop is not None:                        # ours: the trainer's loop and planner
            polled = loop.poll(t, counts[:t], plans or None,
                               forecaster=ctx.forecaster(method, t))
            if polled is not None:
                decision, cand = polled
                if decision is None or decision.replan:
                    plans = cand.plans
        elif method in _ADAPTIVE and t == config.warmup:
            plans = ctx.propose(method, t, None)[0]               # first compile: not charged
        elif method in _EPLB and due(t):
            # EPLB's own rule: re-balance on its schedule, whatever the gain
            candidate = ctx.propose(method, t, plans)[0]
            if not plans_equal(plans, candidate):
                moved = migration_time_s(plans, candidate, ctx.model,
                                         ctx.costs.bytes_per_param,
                                         ctx.costs.optimizer_states)
                recompile = ctx.costs.recompile_s if recompiles(plans, candidate) else 0.0
                decision = ReplanDecision(True, "EPLB periodic re-balance", 0.0,
                                          ctx.costs.horizon_steps, 0.0, 0.0, moved, recompile)
                plans = candidate
        elif method in _ADAPTIVE and method not in _EPLB and (due(t) or monitor.fired()):
            decision, candidate = ctx.check(method, t, plans,
                                            monitor.rate() if monitor.fired() else None)
            monitor.reset()
            if decision.replan:
                plans = candidate
        if decision is not None and decision.replan:
            replans += 1
            forced += int(decision.forced)
            overhead += decision.cost_s
        costs = ctx.step_cost(plans, counts[t])
        step_times.append(sum(c.time_s for c in costs) + extra_s)
        a2a_times.append(sum(c.a2a_time_s + c.exchange_time_s for c in costs))
        hosted = [c.tokens_D[ctx.rank_device] for c in costs]        # chips of the job only
        imbalance.extend(tok.max() / max(tok.mean(), 1e-12) for tok in hosted)
        computed += sum(int(c.rows_D.sum()) for c in costs)
        assigned += sum(c.assigned for c in costs)
        dropped += sum(c.dropped for c in costs)
        dropped_L = [c.dropped for c in costs]
        monitor.record(dropped_L, counts[t].sum(axis=(1, 2)))
        if loop is not None:
            loop.observe(dropped_L, counts[t].sum(axis=(1, 2)))
        rows += 1
    routed = int(counts[config.warmup:].sum())
    dynamic = bool(plans) and plans[0].dispatch in DYNAMIC_DISPATCH
    charged = {"fast_level_s": 0.0,
               "dynamic_exchange_s": ctx.model.dynamic_exchange_s if dynamic else 0.0,
               "weight_bytes_per_step": float(np.mean(weight_bytes)) if weight_bytes else 0.0}
    return ReplayResult(
        extra=charged,
        method=label,
        iteration_time_s=float(np.mean(step_times)) + overhead / (rows * ctx.stride),
        a2a_time_s=float(np.mean(a2a_times)),
        max_over_mean_load=float(np.mean(imbalance)),
        padding_fraction=(computed - assigned) / computed if computed else 0.0,
        drop_rate=dropped / routed if routed else 0.0,
        replans=replans, replan_overhead_s=overhead, forced_replans=forced,
        step_time_s=np.array(step_times))


def _plan_context(trace: RoutingTrace, cluster: Optional[ClusterSpec],
                  config: ReplayConfig) -> _Context:
    cluster = cluster or cluster_for_ranks(trace.num_ranks)
    check_trace_fits(trace, cluster)
    if trace.num_steps < 2:
        raise ValueError(f"planning needs a trace of >= 2 steps, but got {trace.num_steps}.")
    return _Context(trace, cluster, dataclasses.replace(
        config, warmup=min(max(2, config.warmup), trace.num_steps - 1)))


def plan_trace(trace: RoutingTrace, cluster: Optional[ClusterSpec] = None,
               config: ReplayConfig = ReplayConfig()) -> List[ExpertPlan]:
    """EfficientMoE plans (one per layer) for the step after the trace's last row, for
    ``config.dispatch`` ("auto": :func:`trace_dispatch_choice`'s): what ``ms-efficient plan
    moe`` writes. Needs a trace of >= 2 rows."""
    if config.dispatch == "auto":
        return trace_dispatch_choice(trace, cluster, config).proposal.plans
    ctx = _plan_context(trace, cluster, config)
    return ctx.planners[config.dispatch].propose(trace.counts, None).plans


def trace_dispatch_choice(trace: RoutingTrace, cluster: Optional[ClusterSpec] = None,
                          config: ReplayConfig = ReplayConfig()) -> DispatchChoice:
    """Grouped or counts for the step after the trace's last row
    (:func:`planner.choose_dispatch` over the whole trace), with the chosen plans."""
    return _plan_context(trace, cluster, config).choose_dispatch(trace.num_steps)
