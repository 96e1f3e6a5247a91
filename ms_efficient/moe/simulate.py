"""Replay a routing trace step by step under an expert-planning method on a simulated cluster.

One source rank per device (rank r on device r). Each row of the trace is one training step's
routing (``counts[t, layer, rank, expert]``); rows may be sampled every ``stride`` training
steps (from the trace's ``steps``, default 1). For every row from ``warmup`` on, each MoE
layer is costed by :func:`ms_efficient.moe.placement.layer_cost` (uneven All-to-All dispatch
and combine, forward and backward; expert compute on padded capacities; replica gradient
sync), which :func:`event_step_time_s` re-derives on the shared event simulator (tested equal).

Methods (labels of issue 4):
    efficientmoe     our predictor (ar-ridge) + scheduler + per-slot capacities, re-planned
                     through :func:`ms_efficient.moe.schedule.decide_replan`.
    switch-cf1.0/1.25/2.0, dropless-static   static plans, never re-planned.
    fastermoe        per-step shadowing from the step's actual counts (its design), plus the
                     per-step weight broadcast; no compile cost (dynamic shapes).
    eplb-ema, mindspeed-greedy   fed by an EMA predictor, re-planned by the same rule as ours.
    oracle           our scheduler with the true counts of each step, exact capacities, and
                     free re-planning every step (a reference, not a reachable system).

Re-plan checks happen every ``check_every_steps`` training steps. At a check our scheduler
sizes candidate plans for lifetimes of 1, 2, 4 or 8 check intervals and keeps the one with the
least amortised step time (:func:`ms_efficient.moe.schedule.choose_horizon`); the baselines
plan for one interval. Every method starts from a plan made at row ``warmup`` (its first
compilation, not charged); an adopted re-plan costs migration + recompilation, amortised over
the training steps the replay covers:
    iteration_time_s = mean step time + total re-plan seconds / (rows * stride).
The oracle re-plans every row for free.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np

from ms_efficient.cluster import PRESETS, ClusterSpec, get_cluster
from ms_efficient.moe import baselines
from ms_efficient.moe.capacity import expected_expert_drop_rate
from ms_efficient.moe.placement import (CostModel, PlacementConfig, default_slots_per_device,
                                        device_matrix, layer_cost, plan_layer)
from ms_efficient.moe.plan import ExpertPlan, split_tokens
from ms_efficient.moe.predictor import EMA, get_predictor, predict_counts, relative_residuals
from ms_efficient.moe.schedule import (ReplanCosts, choose_horizon, decide_replan,
                                       migration_time_s)
from ms_efficient.moe.trace import RoutingTrace
from ms_efficient.sim import Simulator

__all__ = ["METHODS", "ReplayConfig", "ReplayResult", "cluster_for_ranks", "check_trace_fits",
           "replay", "event_step_time_s", "plan_trace"]

logger = logging.getLogger(__name__)

METHODS = ("efficientmoe", "switch-cf1.0", "switch-cf1.25", "switch-cf2.0", "dropless-static",
           "fastermoe", "eplb-ema", "mindspeed-greedy", "oracle")
_ADAPTIVE = {"efficientmoe", "eplb-ema", "mindspeed-greedy"}
HORIZON_MULTIPLES = (1, 2, 4, 8)  # plan lifetimes our scheduler considers, in check intervals


@dataclass(frozen=True)
class ReplayConfig:
    """Replay and planner settings (units in the names).

    slots_per_device: expert slots per device (None: ceil(E / D) + 1, one spare for replicas).
    capacity_multiple: capacity rounding, tokens (Ascend cube tile: 16).
    drop_target: expected drop rate the capacity model aims at.
    warmup: rows used as history only before metrics start (>= 2).
    residual_window: forecast-error origins the capacity model looks at.
    check_every_steps: training steps between re-plan checks, also the re-plan horizon.
    hidden: H (None: the trace's ``hidden``, else 1024). ffn_hidden: F (None: 4 H).
    dtype: activation/weight dtype. predictor: our load predictor's name.
    recompile_s: seconds to recompile after a plan change (see ReplanCosts).
    a2a_padded: static-graph methods send padded static buffers (GShard dense dispatch)
        instead of the routed tokens only (see CostModel); FasterMoE never pads.
    sync_replica_grads: charge the all-reduce of replicated experts' gradients (False: assume
        it is hidden behind other layers' backward).
    """

    slots_per_device: Optional[int] = None
    capacity_multiple: int = 16
    drop_target: float = 0.005
    warmup: int = 16
    residual_window: int = 8
    check_every_steps: int = 200
    hidden: Optional[int] = None
    ffn_hidden: Optional[int] = None
    dtype: str = "bf16"
    predictor: str = "ar-ridge"
    recompile_s: float = 1.2
    a2a_padded: bool = False
    sync_replica_grads: bool = True


@dataclass
class ReplayResult:
    """Metrics of one method on one trace (seconds; fractions in [0, 1]).

    iteration_time_s: mean MoE time of a training step (all layers, fwd + bwd) plus amortised
        re-planning. a2a_time_s: its All-to-All part. max_over_mean_load: tokens of the busiest
        device over the mean, averaged over layers and steps. padding_fraction: computed slot
        rows that held no token / computed slot rows. drop_rate: dropped / routed tokens.
    """

    method: str
    iteration_time_s: float
    a2a_time_s: float
    max_over_mean_load: float
    padding_fraction: float
    drop_rate: float
    replans: int = 0
    replan_overhead_s: float = 0.0
    step_time_s: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)

    def metrics(self) -> Dict[str, float]:
        """The issue-4 metric fields plus re-plan figures, JSON-ready."""
        return {"iteration_time_s": self.iteration_time_s, "a2a_time_s": self.a2a_time_s,
                "max_over_mean_load": self.max_over_mean_load,
                "padding_fraction": self.padding_fraction, "drop_rate": self.drop_rate,
                "replans": self.replans, "replan_overhead_s": self.replan_overhead_s}


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


class _Context:
    """Everything a method needs to plan one row: the trace, cost model and settings."""

    def __init__(self, trace: RoutingTrace, cluster: ClusterSpec, config: ReplayConfig):
        if config.warmup < 2 or config.warmup >= trace.num_steps:
            raise ValueError(f"'warmup' must be in [2, {trace.num_steps - 1}] for a "
                             f"{trace.num_steps}-row trace, but got {config.warmup}.")
        self.trace, self.cluster, self.config = trace, cluster, config
        hidden = config.hidden or trace.hidden or 1024
        self.model = CostModel(cluster, hidden, config.ffn_hidden or 4 * hidden, config.dtype,
                               sync_replica_grads=config.sync_replica_grads,
                               a2a_padded=config.a2a_padded)
        self.dynamic_model = dataclasses.replace(self.model, a2a_padded=False)
        self.rank_device = np.arange(trace.num_ranks)
        slots = config.slots_per_device or default_slots_per_device(trace.num_experts,
                                                                    cluster.num_devices)
        self.placement = PlacementConfig(slots, config.capacity_multiple, config.drop_target)
        self.stride = _stride(trace)
        self.check_rows = max(1, round(config.check_every_steps / self.stride))
        self.costs = ReplanCosts(recompile_s=config.recompile_s,
                                 horizon_steps=self.check_rows * self.stride)
        self.load = trace.expert_load()                                      # [T, L, E]
        if trace.tokens_per_rank and trace.top_k:      # tokens x top_k routed per step
            self.assignments = trace.tokens_per_rank * trace.top_k * trace.num_ranks
        else:
            self.assignments = int(round(self.load.sum(axis=2).mean()))
        self.top_k = trace.top_k

    def predicted(self, t: int, predictor, horizon_rows: int):
        """(predicted counts [L, R, E] for row t, residuals [K, L, E] at ``horizon_rows``)
        from rows < t."""
        pred = predict_counts(self.trace.counts[:t], predictor)
        rel = relative_residuals(self.load[:t], predictor, self.config.residual_window,
                                 horizon_rows)
        return pred, rel

    def adaptive_plans(self, method: str, t: int, horizon_rows: Optional[int] = None):
        """(plans per layer, predicted counts [L, R, E], residuals [K, L, E]) at row t, with
        capacities sized for ``horizon_rows`` rows (default: until the next check)."""
        pred, rel = self.predicted(t, self._predictor(method), horizon_rows or self.check_rows)
        plans = []
        for layer in range(self.trace.num_layers):
            args = (pred[layer], rel[:, layer], self.model, self.placement, self.rank_device)
            if method == "efficientmoe":
                plans.append(plan_layer(pred[layer], self.model, self.placement,
                                        self.rank_device, rel[:, layer], top_k=self.top_k))
            elif method == "eplb-ema":
                plans.append(baselines.eplb_plan(*args, top_k=self.top_k))
            else:
                plans.append(baselines.greedy_plan(*args, top_k=self.top_k))
        return plans, pred, rel

    def _predictor(self, method: str):
        return get_predictor(self.config.predictor) if method == "efficientmoe" else EMA()

    def propose(self, method: str, t: int, current: Optional[List[ExpertPlan]]):
        """Candidate plans at row t: (plans, predicted counts [L, R, E], horizon_steps).

        Ours considers plan lifetimes of HORIZON_MULTIPLES check intervals and keeps the one
        with the least amortised step time
        (:func:`ms_efficient.moe.schedule.choose_horizon`); baselines plan for one interval.
        """
        if method != "efficientmoe":
            plans, pred, _ = self.adaptive_plans(method, t)
            return plans, pred, self.costs.horizon_steps
        options = []
        for mult in HORIZON_MULTIPLES:
            rows = mult * self.check_rows
            plans, pred, _ = self.adaptive_plans(method, t, rows)
            step = sum(c.time_s for c in self.step_cost(plans, pred))
            moved = 0.0 if current is None else migration_time_s(
                current, plans, self.model, self.costs.bytes_per_param)
            options.append((plans, pred, rows * self.stride, step, moved))
        best = choose_horizon([o[3] for o in options], [o[4] for o in options],
                              [o[2] for o in options], self.costs.recompile_s)
        return options[best][:3]

    def check(self, method: str, t: int, current: List[ExpertPlan]):
        """Re-plan check at row t: (ReplanDecision, candidate plans)."""
        candidate, pred, horizon = self.propose(method, t, current)
        _, rel_next = self.predicted(t, self._predictor(method), self.check_rows)
        costs = ReplanCosts(self.costs.recompile_s, self.costs.bytes_per_param, horizon,
                            self.costs.max_drop_rate)
        decision = decide_replan(sum(c.time_s for c in self.step_cost(current, pred)),
                                 sum(c.time_s for c in self.step_cost(candidate, pred)),
                                 current, candidate, self.model, costs,
                                 self.expected_drop_rate(current, pred, rel_next))
        return decision, candidate

    def expected_drop_rate(self, plans: Sequence[ExpertPlan], pred: np.ndarray,
                           rel: np.ndarray) -> float:
        """Expected drop rate of ``plans`` over the coming rows (mean over layers)."""
        num_experts = self.trace.num_experts
        return float(np.mean([expected_expert_drop_rate(
            np.bincount(p.slot_expert, weights=p.slot_capacity, minlength=num_experts),
            pred[layer].sum(axis=0), rel[:, layer]) for layer, p in enumerate(plans)]))

    def static_plans(self, method: str) -> List[ExpertPlan]:
        num_experts, num_devices = self.trace.num_experts, self.cluster.num_devices
        if method.startswith("switch-cf"):
            cf = float(method[len("switch-cf"):])
            plan = baselines.switch_plan(num_experts, num_devices, self.assignments, cf,
                                         self.config.capacity_multiple, self.top_k)
            return [plan] * self.trace.num_layers
        return [baselines.dropless_static_plan(self.load[:, layer], num_devices,
                                               self.config.capacity_multiple, self.top_k)
                for layer in range(self.trace.num_layers)]

    def step_cost(self, plans: Sequence[ExpertPlan], counts_LRE: np.ndarray,
                  dynamic: bool = False):
        model = self.dynamic_model if dynamic else self.model
        return [layer_cost(p, c, model, self.rank_device) for p, c in zip(plans, counts_LRE)]


def replay(trace: RoutingTrace, method: str, cluster: Optional[ClusterSpec] = None,
           config: ReplayConfig = ReplayConfig()) -> ReplayResult:
    """Replay ``trace`` under ``method`` (one of METHODS) on ``cluster`` (default:
    :func:`cluster_for_ranks`); returns the metrics over rows [warmup, T)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {list(METHODS)}, but got {method!r}.")
    cluster = cluster or cluster_for_ranks(trace.num_ranks)
    check_trace_fits(trace, cluster)
    ctx = _Context(trace, cluster, config)
    counts = trace.counts
    plans: List[ExpertPlan] = []
    if method.startswith("switch-cf") or method == "dropless-static":
        plans = ctx.static_plans(method)
    step_times, a2a_times, imbalance = [], [], []
    rows = computed = assigned = dropped = 0
    replans, overhead = 0, 0.0
    for t in range(config.warmup, trace.num_steps):
        extra_s = 0.0
        if method == "oracle":
            plans = [baselines.oracle_plan(counts[t, layer], ctx.model, ctx.placement,
                                           ctx.rank_device, ctx.top_k)
                     for layer in range(trace.num_layers)]
        elif method == "fastermoe":
            made = [baselines.fastermoe_plan(counts[t, layer], ctx.dynamic_model,
                                             ctx.placement.slots_per_device, ctx.rank_device)
                    for layer in range(trace.num_layers)]
            plans = [p for p, _ in made]
            extra_s = sum(b for _, b in made)
        elif method in _ADAPTIVE and t == config.warmup:
            plans = ctx.propose(method, t, None)[0]               # first compile: not charged
        elif method in _ADAPTIVE and (t - config.warmup) % ctx.check_rows == 0:
            decision, candidate = ctx.check(method, t, plans)
            if decision.replan:
                plans = candidate
                replans += 1
                overhead += decision.cost_s
        costs = ctx.step_cost(plans, counts[t], dynamic=method == "fastermoe")
        step_times.append(sum(c.time_s for c in costs) + extra_s)
        a2a_times.append(sum(c.a2a_time_s for c in costs))
        imbalance.extend(c.tokens_D.max() / max(c.tokens_D.mean(), 1e-12) for c in costs)
        computed += sum(int(c.rows_D.sum()) for c in costs)
        assigned += sum(c.assigned for c in costs)
        dropped += sum(c.dropped for c in costs)
        rows += 1
    routed = int(counts[config.warmup:].sum())
    return ReplayResult(
        method=method,
        iteration_time_s=float(np.mean(step_times)) + overhead / (rows * ctx.stride),
        a2a_time_s=float(np.mean(a2a_times)),
        max_over_mean_load=float(np.mean(imbalance)),
        padding_fraction=(computed - assigned) / computed if computed else 0.0,
        drop_rate=dropped / routed if routed else 0.0,
        replans=replans, replan_overhead_s=overhead, step_time_s=np.array(step_times))


def event_step_time_s(plan: ExpertPlan, counts_RE: np.ndarray, model: CostModel,
                      rank_device: Optional[Sequence[int]] = None) -> float:
    """One layer's training step on the shared event simulator, seconds.

    Phases, each waiting for the previous one to end on every device: forward dispatch
    All-to-All, forward expert compute, forward combine, backward combine-gradient All-to-All,
    backward compute (2x), backward dispatch-gradient All-to-All, replica gradient sync. Every
    message of an All-to-All is a transfer on the sender's transmit resource and one on the
    receiver's receive resource (per link kind, intra- or inter-node), so messages of one kind
    serialize per device; a replica group's all-reduce occupies each member's sync resource.
    Equal to :func:`layer_cost` ``.time_s`` (tests check it); slower, for validation.
    """
    cluster = model.cluster
    counts = np.rint(np.asarray(counts_RE, dtype=np.float64)).astype(np.int64)
    rd = np.arange(counts.shape[0]) if rank_device is None else np.asarray(rank_device)
    assigned_RS, _ = split_tokens(plan, counts, rd, cluster.devices_per_node)
    num_devices = cluster.num_devices
    if model.a2a_padded:
        assigned_RS = np.broadcast_to(plan.slot_capacity / rd.size, assigned_RS.shape)
    bytes_DD = device_matrix(assigned_RS, rd, plan.slot_device, num_devices) * \
        model.bytes_per_token
    rows_D = np.bincount(plan.slot_device, weights=plan.slot_capacity, minlength=num_devices)
    sim = Simulator()
    prev: List[int] = []

    def a2a(tag: str, b: np.ndarray) -> List[int]:
        ids = []
        for i, j in zip(*np.nonzero(b)):
            if i == j:
                continue
            kind, link = (("hccs", cluster.intra_link) if cluster.node_of(int(i)) ==
                          cluster.node_of(int(j)) else ("nic", cluster.inter_link))
            for side, dev in (("tx", i), ("rx", j)):
                ids.append(sim.add_transfer(f"{tag}.{side}.{i}->{j}", f"dev{dev}.{kind}_{side}",
                                            float(b[i, j]), link.latency_s, link.bandwidth_Bps,
                                            deps=prev))
        return ids

    def barrier(tag: str, ids: List[int]) -> List[int]:
        return [sim.add_event(f"{tag}.done", deps=ids or prev)]

    def compute(tag: str, passes: float) -> List[int]:
        return [sim.add_task(f"{tag}.dev{d}", f"dev{d}.compute",
                             rows_D[d] * passes * model.row_time_s / model.compute_passes,
                             deps=prev) for d in range(num_devices)]

    prev = barrier("start", [])
    for tag, work in (("fwd.dispatch", lambda: a2a("fwd.dispatch", bytes_DD)),
                      ("fwd.compute", lambda: compute("fwd.compute", 1.0)),
                      ("fwd.combine", lambda: a2a("fwd.combine", bytes_DD.T)),
                      ("bwd.combine", lambda: a2a("bwd.combine", bytes_DD)),
                      ("bwd.compute", lambda: compute("bwd.compute", model.compute_passes - 1)),
                      ("bwd.dispatch", lambda: a2a("bwd.dispatch", bytes_DD.T))):
        prev = barrier(tag, work())
    sync_ids = []
    if model.sync_replica_grads:
        for e in np.flatnonzero(plan.replica_counts(counts.shape[1]) > 1):
            devices = np.unique(plan.slot_device[plan.replicas_of(int(e))])
            if devices.size > 1:
                t = cluster.collective_time_s("allreduce", model.grad_bytes, devices.tolist())
                sync_ids += [sim.add_task(f"sync.e{e}.dev{d}", f"dev{d}.sync", t, deps=prev)
                             for d in devices]
    barrier("sync", sync_ids)
    return sim.run().makespan_s


def plan_trace(trace: RoutingTrace, cluster: Optional[ClusterSpec] = None,
               config: ReplayConfig = ReplayConfig()) -> List[ExpertPlan]:
    """EfficientMoE plans (one per layer) for the step after the trace's last row: what
    ``ms-efficient plan moe`` writes. Needs a trace of >= 2 rows."""
    cluster = cluster or cluster_for_ranks(trace.num_ranks)
    check_trace_fits(trace, cluster)
    if trace.num_steps < 2:
        raise ValueError(f"planning needs a trace of >= 2 steps, but got {trace.num_steps}.")
    ctx = _Context(trace, cluster, dataclasses.replace(
        config, warmup=min(max(2, config.warmup), trace.num_steps - 1)))
    return ctx.propose("efficientmoe", trace.num_steps, None)[0]
