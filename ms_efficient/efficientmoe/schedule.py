"""Re-plan decision: adopt a new expert plan only when it pays for moving weights and recompiling.

A new plan changes the static graph (slot counts and capacities are compiled shapes) and may
move expert weights between devices. It is adopted when

    gain_per_step_s * horizon_steps  >  migration_s + recompile_s

gain_per_step_s: predicted step time under the current plan minus under the candidate (both
    evaluated on the same predicted load, seconds).
horizon_steps: training steps the new plan is expected to serve (until the next check).
migration_s: time to copy the weights and optimizer state of every expert copy that is new on
    its device, over the cluster's links (an uneven all-to-all of those bytes). The rows are
    those of :func:`~ms_efficient.moe.ep_migration.plan_migration`, the function
    a layer's ``set_plan`` moves them by, so the charge is what a re-plan sends.
recompile_s: graph compilation of the changed network, seconds; only when a compiled shape
    changes (:func:`recompiles`): a "grouped" plan's shapes are its devices' row buffers and
    the slot budget, so moving or replicating experts within unchanged buffers costs the
    migration alone (which expert a slot holds, and how ranks split an expert over its
    replicas, are data: weights copied in and index tables).

A candidate is also adopted, whatever the arithmetic says, when the current plan is predicted
to drop, or was observed dropping, more than ``max_drop_rate`` of the tokens: capacities are
a correctness matter too.

How long should a plan live? Capacities sized for a longer horizon need more headroom (the
load drifts further), but recompilation is paid less often. :func:`choose_horizon` picks,
among candidate plans made for different horizons, the one with the least
    step_time_s + (migration_s + recompile_s) / horizon_steps.

The recompile cost's one home is :func:`recompile_time_s` (a user-given figure, the
``efficientmoe.recompile_cost_s`` config key or ``PlannerConfig.recompile_s``, overrides it):

    recompile_time_s(L) = RECOMPILE_FIXED_S + RECOMPILE_PER_LAYER_S * L = 0.8 s + 0.4 s * L

for a network of L MoE layers. A recompile compiles the whole graph, so its cost grows with
the graph: a fixed part (graph pipeline, loss and gradient wiring, what any graph pays) plus a
part per layer. Source: ``scripts/measure_recompile.py`` compiles the forward+backward graph
of L stacked ``MoEFeedForward`` layers (H=64, F=128, 8 experts, top-2, capacity 16, MindSpore
2.10 GRAPH_MODE, CPU) in fresh processes after a warm-up compile, on this 2-core build machine
while other jobs kept its load average at 4-6, so it takes each L's least contended run:

    cd /tmp && python <repo>/scripts/measure_recompile.py 1 2 4 8 --repeats 5

L = 1, 2, 4, 8 gave minima of 1.13, 1.45, 2.18, 3.39 s over 5 runs (medians 1.53, 1.71, 3.95,
6.50 s), a line of 0.82 s + 0.32 s * L; a second, busier batch of 3 runs gave 2.05 s + 0.24 s
* L. The constants take the first fit to one decimal, the per-layer part rounded up (0.8 s +
0.4 s * L), which gives L = 1 the 1.2 s used before this model (an earlier, quieter
measurement of that one layer: 0.84-0.97 s). The reference 4-layer GPT-MoE
(``configs/gpt_moe_tiny.yaml``: H=256, attention and AdamWeightDecay in its graph too) logs
4.5-9.5 s per recompile on this machine against the model's 2.4 s: whole blocks cost more
than bare MoE layers, so for a real model set the measured figure (the trainer logs its first
compile as ``compile_s``). Who passes L: the trainer, the ``EfficientMoECallback`` and the
``efficientmoe`` pass (their networks' MoE layers), ``bench mpipe`` (its workloads' layers);
the trace replay of ``bench moe`` / ``plan moe`` charges every method L = 1 for now.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from ms_efficient.efficientmoe.cost import CostModel, uneven_alltoall_time_s
from ms_efficient.moe.ep_migration import migration_bytes_WW, plan_migration
from ms_efficient.moe.plan import ExpertPlan

__all__ = ["RECOMPILE_FIXED_S", "RECOMPILE_PER_LAYER_S", "recompile_time_s", "ReplanCosts",
           "ReplanDecision", "migration_bytes_DD", "migration_time_s", "plans_equal",
           "recompiles", "decide_replan", "DropMonitor", "choose_horizon"]

logger = logging.getLogger(__name__)

# Seconds one recompile of a network of L MoE layers costs: RECOMPILE_FIXED_S +
# RECOMPILE_PER_LAYER_S * L (the fit and its measurement: module docstring).
RECOMPILE_FIXED_S = 0.8
RECOMPILE_PER_LAYER_S = 0.4


def recompile_time_s(num_layers: int = 1, given_s: Optional[float] = None) -> float:
    """Seconds one recompilation of a network of ``num_layers`` MoE layers costs:
    ``given_s`` when the user gave a figure (config key ``efficientmoe.recompile_cost_s``,
    ``PlannerConfig.recompile_s``), else RECOMPILE_FIXED_S + RECOMPILE_PER_LAYER_S *
    num_layers (module docstring: measured on one 2-core CPU, MindSpore 2.10)."""
    if given_s is not None:
        if given_s < 0:
            raise ValueError(f"a recompile cost must be >= 0 seconds, but got {given_s}.")
        return float(given_s)
    if num_layers < 1:
        raise ValueError(f"'num_layers' must be >= 1, but got {num_layers}.")
    # rounded to the nanosecond: 0.8 + 0.4 is 1.2000000000000002 in binary floats
    return round(RECOMPILE_FIXED_S + RECOMPILE_PER_LAYER_S * num_layers, 9)


@dataclass(frozen=True)
class ReplanCosts:
    """recompile_s: seconds to recompile the graph after a plan change (all its layers).
        Default: :func:`recompile_time_s` of one MoE layer (1.2 s); the planner passes the
        figure of the layers it plans (module docstring for the model and its measurement).
    bytes_per_param: bytes of one element of a migrated expert's weights, and of each of its
        optimizer state tensors: 4 (float32, what the expert-parallel layers train in).
    horizon_steps: training steps a new plan is expected to serve, >= 1.
    max_drop_rate: predicted drop rate of the current plan above which a candidate is adopted
        regardless of cost (None: never forced).
    optimizer_states: state tensors the optimizer keeps per weight, moved with it: Adam 2
        (its moments; the default), Momentum 1, plain SGD 0. A moved expert costs
        expert_params x bytes_per_param x (1 + optimizer_states) bytes: 12 per parameter for
        float32 Adam. (Mixed precision, bf16 weight + fp32 master + Adam moments = 14 bytes per
        parameter: bytes_per_param=3.5, optimizer_states=3.)
    """

    recompile_s: float = recompile_time_s(1)
    bytes_per_param: float = 4.0
    horizon_steps: int = 200
    max_drop_rate: Optional[float] = 0.01
    optimizer_states: int = 2

    def __post_init__(self) -> None:
        if (self.recompile_s < 0 or self.bytes_per_param < 0 or self.horizon_steps < 1
                or self.optimizer_states < 0):
            raise ValueError(f"ReplanCosts needs recompile_s >= 0, bytes_per_param >= 0, "
                             f"horizon_steps >= 1, optimizer_states >= 0, but got {self}.")


@dataclass(frozen=True)
class ReplanDecision:
    """The decision and its figures (seconds, bytes). cost_s = migration_s + recompile_s.
    forced: adopted for its drops (predicted or observed above max_drop_rate), not its gain."""

    replan: bool
    reason: str
    gain_per_step_s: float
    horizon_steps: int
    total_gain_s: float
    migration_bytes: float
    migration_s: float
    recompile_s: float
    forced: bool = False

    @property
    def cost_s(self) -> float:
        return self.migration_s + self.recompile_s


def migration_bytes_DD(old: Sequence[ExpertPlan], new: Sequence[ExpertPlan], model: CostModel,
                       bytes_per_param: float = 4.0, optimizer_states: int = 2) -> np.ndarray:
    """Bytes to copy between devices to go from plans ``old`` to ``new`` (one per layer):
    float64 [D, D], [src, dst].

    Per layer, the rows of :func:`~ms_efficient.moe.ep_migration.plan_migration` over D =
    ``model.cluster.num_devices`` ranks and a row budget of the most slots a device holds in
    either plan: a copy of expert e on device d in the new plan is free when d held e before;
    otherwise one row is copied from a device that held e, preferring d's node, then the
    lowest id. Each row costs ``model.expert_params`` x ``bytes_per_param`` x
    (1 + ``optimizer_states``) bytes (:func:`~ms_efficient.moe.ep_migration.migration_bytes_WW`).
    """
    if len(old) != len(new):
        raise ValueError(f"old and new plans must cover the same layers, but got {len(old)} "
                         f"and {len(new)}.")
    num_devices, dpn = model.cluster.num_devices, model.cluster.devices_per_node
    moved = np.zeros((num_devices, num_devices))
    row_bytes = model.expert_params * bytes_per_param
    for before, after in zip(old, new):
        budget = max(int(np.bincount(p.slot_device, minlength=num_devices).max())
                     for p in (before, after))
        rows_DD = plan_migration(before, after, budget, num_devices, dpn).rows_WW
        moved += migration_bytes_WW(rows_DD, row_bytes, optimizer_states)
    return moved


def migration_time_s(old: Sequence[ExpertPlan], new: Sequence[ExpertPlan], model: CostModel,
                     bytes_per_param: float = 4.0, optimizer_states: int = 2) -> float:
    """Seconds to migrate expert weights and optimizer state from ``old`` to ``new`` plans
    (all layers at once; arguments as :func:`migration_bytes_DD`)."""
    return uneven_alltoall_time_s(
        migration_bytes_DD(old, new, model, bytes_per_param, optimizer_states), model.cluster)


def plans_equal(a: Sequence[ExpertPlan], b: Sequence[ExpertPlan]) -> bool:
    """True when both plan lists have the same dispatch, slots, devices, capacities and device
    buffers, layer by layer (anything else would compile a different graph)."""
    return len(a) == len(b) and all(
        x.dispatch == y.dispatch
        and all(np.array_equal(getattr(x, f), getattr(y, f))
                for f in ("slot_expert", "slot_device", "slot_capacity"))
        and _same_shapes(x, y) for x, y in zip(a, b))


def _same_shapes(a: ExpertPlan, b: ExpertPlan) -> bool:
    """Same device buffers and send blocks (the grouped layer's compiled shapes)."""
    if (a.send_block is None) != (b.send_block is None):
        return False
    return (np.array_equal(a.device_rows(), b.device_rows())
            and (a.send_block is None or np.array_equal(a.send_block, b.send_block)))


def recompiles(current: Optional[Sequence[ExpertPlan]],
               candidate: Sequence[ExpertPlan]) -> bool:
    """True when going from ``current`` to ``candidate`` changes a compiled shape: always for
    "static" plans (slot capacities are shapes) and for a first plan (None); for "grouped"
    (and "counts") plans only when some device's row buffer or some send block changes (every device
    compiles its full slot budget, so slots filled or emptied are data)."""
    if current is None or len(current) != len(candidate):
        return True
    return not all(a.dispatch == b.dispatch and a.grouped and _same_shapes(a, b)
                   for a, b in zip(current, candidate))


def decide_replan(current_step_s: float, candidate_step_s: float,
                  current: Sequence[ExpertPlan], candidate: Sequence[ExpertPlan],
                  model: CostModel, costs: ReplanCosts = ReplanCosts(),
                  current_drop_rate: Optional[float] = None,
                  observed_drop_rate: Optional[float] = None) -> ReplanDecision:
    """Decide whether to switch from ``current`` to ``candidate`` plans (module docstring).

    current_step_s, candidate_step_s: predicted step time of each, seconds, on the same load.
    current_drop_rate: predicted drop rate of the current plan on that load, in [0, 1].
    observed_drop_rate: drop rate the current plan actually had on the recent steps (the layer
        counts drops), in [0, 1]; either rate above ``max_drop_rate`` forces the switch.
    """
    gain = current_step_s - candidate_step_s
    if plans_equal(current, candidate):
        return ReplanDecision(False, "candidate equals the current plan", gain,
                              costs.horizon_steps, 0.0, 0.0, 0.0, 0.0)
    moved = migration_bytes_DD(current, candidate, model, costs.bytes_per_param,
                               costs.optimizer_states)
    migration = uneven_alltoall_time_s(moved, model.cluster)
    recompile = costs.recompile_s if recompiles(current, candidate) else 0.0
    total_gain = gain * costs.horizon_steps
    cost = migration + recompile
    limit = costs.max_drop_rate
    over = [(what, rate) for what, rate in (("is predicted to drop", current_drop_rate),
                                            ("dropped", observed_drop_rate))
            if limit is not None and rate is not None and rate > limit]
    forced = bool(over)
    if forced:
        reason = f"current plan {over[-1][0]} {over[-1][1]:.2%} > {limit:.2%} of tokens"
    elif total_gain > cost:
        reason = f"gain {total_gain:.3g} s over {costs.horizon_steps} steps > cost {cost:.3g} s"
    else:
        reason = f"gain {total_gain:.3g} s over {costs.horizon_steps} steps <= cost {cost:.3g} s"
    decision = ReplanDecision(forced or total_gain > cost, reason, gain, costs.horizon_steps,
                              total_gain, float(moved.sum()), migration, recompile, forced)
    logger.debug("replan=%s: %s", decision.replan, reason)
    return decision


class DropMonitor:
    """Observed drop rate of the current plan, as the trainer sees it (the layers count
    dropped tokens): fires when, over at least ``rows`` steps (trace rows) since the last
    check, some layer dropped more than ``max_rate`` of the tokens routed to it; its rate
    (the worst layer's) then goes to :func:`decide_replan` as ``observed_drop_rate``. Per
    layer, because one layer dropping 5 % of its tokens hurts the model however well the
    others do. Checks are cheap (host-side numbers), re-plans are not, so the plan is
    checked as soon as drops show, not at the next period."""

    def __init__(self, rows: int, max_rate: Optional[float]):
        self.rows, self.max_rate = rows, max_rate
        self.reset()

    def reset(self) -> None:
        self.seen = 0
        self.dropped = np.zeros(1)
        self.routed = np.zeros(1)

    def record(self, dropped, routed) -> None:
        """One step: ``dropped`` and ``routed`` tokens, per layer (float [L]) or summed."""
        self.seen += 1
        self.dropped = self.dropped + np.asarray(dropped, dtype=np.float64)
        self.routed = self.routed + np.asarray(routed, dtype=np.float64)

    def rate(self) -> float:
        """The worst layer's drop rate since the last reset."""
        rates = self.dropped / np.maximum(self.routed, 1.0)
        return float(np.max(np.where(self.routed > 0, rates, 0.0)))

    def fired(self) -> bool:
        return (self.max_rate is not None and self.seen >= self.rows
                and float(np.sum(self.routed)) > 0 and self.rate() > self.max_rate)


def choose_horizon(step_time_s: Sequence[float], migration_s: Sequence[float],
                   horizon_steps: Sequence[int], recompile_s: float) -> int:
    """Index of the candidate with the least amortised step time, seconds:
    step_time_s[i] + (migration_s[i] + recompile_s) / horizon_steps[i] (ties: first)."""
    if not len(step_time_s) == len(migration_s) == len(horizon_steps) >= 1:
        raise ValueError("choose_horizon needs equal-length, non-empty candidate lists.")
    if min(horizon_steps) < 1:
        raise ValueError(f"'horizon_steps' must be >= 1, but got {list(horizon_steps)}.")
    score = [t + (m + recompile_s) / h for t, m, h in zip(step_time_s, migration_s, horizon_steps)]
    return int(np.argmin(score))
