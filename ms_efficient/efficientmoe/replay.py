"""Replay a routing trace step by step under an expert-planning method on a simulated cluster.

One source rank per device (rank r on device r); experts live on the ranks' devices only (a
4-rank trace on an 8-chip node uses 4 chips). Each row of the trace is one training step's
routing (``counts[t, layer, rank, expert]``); rows may be sampled every ``stride`` training
steps (from the trace's ``steps``, default 1). Every method is replayed by one vectorised
path, :func:`~ms_efficient.efficientmoe.two_level.replay_two_level`: each step gives a
:class:`~ms_efficient.moe.balance.Balance` (where every row is computed and what every rank
sends every device), costed by :func:`~ms_efficient.efficientmoe.balanced_cost.balanced_cost`
for every row alike (the counts' AllGather where the layer exchanges counts, the dynamic-shape
overhead of every count-driven exchange, the four All-to-Alls of the per-pair bytes, the
grouped compute over tile-rounded rows, the replicas' gradient sync, the fast level).

Methods:
    efficientmoe, efficientmoe-fixed-home, moonep, ablation-eplb-split, eplb-alltoallv
        the two-level methods (:mod:`~ms_efficient.efficientmoe.two_level`'s docstring).
    fastermoe        FasterMoE's dynamic shadowing (:func:`baselines.fastermoe_balance`):
                     plain expert parallelism, popular experts broadcast to every device
                     while the modelled step gets faster, count-driven exchange.
    dropless         MegaBlocks-style dropless expert parallelism on a dynamic-shape stack:
                     plain expert parallelism, every routed row computed at its expert's one
                     device (grouped compute, no padding beyond the tile), count-driven
                     exchange, no replicas, no fast level.
    switch-cf<x>     GShard / Switch (:func:`baselines.switch_balance`): plain expert
                     parallelism, a static capacity C = ceil(x * tokens * top_k / E) per rank
                     and expert, blocks sent whole (padding included) with no count exchange,
                     overflow dropped; 1.0, 1.25 (the table's reference) and 2.0.
    oracle-bound     a true lower bound (:func:`two_level.lower_bound_step_s`): every
                     assignment computed, perfectly spread, at peak, with no exchange, copy,
                     sync or fast level; no row can beat it (a test holds every method to it
                     on random counts).

Re-plans (efficientmoe, and EPLB's schedule in ablation-eplb-split and eplb-alltoallv) are
charged as they happen, amortised over the training steps the replay covers:
    iteration_time_s = mean step time + total re-plan seconds / (rows * stride).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Dict, Optional

import numpy as np

from ms_efficient.core.cluster import PRESETS, ClusterSpec, get_cluster
from ms_efficient.efficientmoe.cost import CostModel
from ms_efficient.efficientmoe.two_level import (BASELINE_ROWS, LOWER_BOUND, TWO_LEVEL_METHODS,
                                                 replay_lower_bound, replay_two_level)
from ms_efficient.moe.trace import RoutingTrace

__all__ = ["METHODS", "DEFAULT_METHODS", "ReplayConfig", "ReplayResult", "cluster_for_ranks",
           "check_trace_fits", "replay"]

logger = logging.getLogger(__name__)

METHODS = TWO_LEVEL_METHODS + BASELINE_ROWS + (LOWER_BOUND,)
# what ``bench moe`` replays unless told: ours, ours without home re-plans, MoonEP, the fast
# level under EPLB's placement, EPLB as published, FasterMoE, Switch, dropless, the bound
DEFAULT_METHODS = ("efficientmoe", "efficientmoe-fixed-home", "moonep", "ablation-eplb-split",
                   "eplb-alltoallv", "fastermoe", "switch-cf1.25", "dropless", LOWER_BOUND)


@dataclass(frozen=True)
class ReplayConfig:
    """Replay settings (units in the names).

    slots_per_device: expert slots per device (None: ceil(E / D) + 1, one spare for copies).
    drop_target: the drop rate of the static-limit yardstick rows (``bench``).
    warmup: rows used as history only before metrics start (>= 2).
    residual_window: trace rows the slow level's forecast and replays look at.
    check_every_steps: training steps between re-plan checks, also the re-plan horizon.
    hidden: H (None: the trace's ``hidden``, else 1024). ffn_hidden: F (None: 4 H).
    dtype: activation/weight dtype.
    sync_replica_grads: charge the all-reduce of replicated experts' gradients (False: assume
        it is hidden behind other layers' backward).
    fast_level_s: the two-level methods' fast-level time per layer-step, or None (the
        default: what the cluster's target compiles costs, ``CostModel.fast_level_time_L``).
    expert_kind: "mlp" (two matrices) or "glu" (gated: Mixtral, DeepSeek); expert_bias:
        whether the experts carry biases (CostModel: FLOPs per row, a copy's bytes).
    """

    slots_per_device: Optional[int] = None
    drop_target: float = 0.005
    warmup: int = 16
    residual_window: int = 8
    check_every_steps: int = 200
    hidden: Optional[int] = None
    ffn_hidden: Optional[int] = None
    dtype: str = "bf16"
    sync_replica_grads: bool = True
    fast_level_s: Optional[float] = None
    expert_kind: str = "mlp"
    expert_bias: bool = True


@dataclass
class ReplayResult:
    """Metrics of one method on one trace (seconds; fractions in [0, 1]).

    iteration_time_s: mean MoE time of a training step (all layers, fwd + bwd) plus amortised
        re-planning. a2a_time_s: its All-to-All part (routing-count exchange included).
        max_over_mean_load: tokens of the busiest device over the mean, averaged over layers
        and steps. padding_fraction: computed slot rows that held no token / computed slot
        rows. drop_rate: dropped / routed tokens. replans: adopted re-plans (home tables;
        forced_replans: 0, no row re-plans for its drops).
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


def _model(trace: RoutingTrace, cluster: ClusterSpec, config: ReplayConfig) -> CostModel:
    hidden = config.hidden or trace.hidden or 1024
    return CostModel(cluster, hidden, config.ffn_hidden or 4 * hidden, config.dtype,
                     sync_replica_grads=config.sync_replica_grads,
                     fast_level_s=config.fast_level_s, expert_kind=config.expert_kind,
                     expert_bias=config.expert_bias)


def replay(trace: RoutingTrace, method: str, cluster: Optional[ClusterSpec] = None,
           config: ReplayConfig = ReplayConfig()) -> ReplayResult:
    """Replay ``trace`` under ``method`` (one of METHODS) on ``cluster`` (default:
    :func:`cluster_for_ranks`); returns the metrics over rows [warmup, T)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {list(METHODS)}, but got {method!r}.")
    cluster = cluster or cluster_for_ranks(trace.num_ranks)
    check_trace_fits(trace, cluster)
    if config.warmup < 2 or config.warmup >= trace.num_steps:
        raise ValueError(f"'warmup' must be in [2, {trace.num_steps - 1}] for a "
                         f"{trace.num_steps}-row trace, but got {config.warmup}.")
    model = _model(trace, cluster, config)
    if method == LOWER_BOUND:
        return ReplayResult(**replay_lower_bound(trace, model, config.warmup))
    per_device = -(-trace.num_experts // trace.num_ranks)
    extra = 1 if config.slots_per_device is None else config.slots_per_device - per_device
    if extra < 0:
        raise ValueError(f"'slots_per_device' must be >= ceil(E / W) = {per_device}, but "
                         f"got {config.slots_per_device}.")
    stride = _stride(trace)
    check_rows = max(1, round(config.check_every_steps / stride))
    return ReplayResult(**replay_two_level(trace, method, model, config.warmup, check_rows,
                                           stride, extra, config.residual_window))
