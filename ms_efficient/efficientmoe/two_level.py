"""Replay a routing trace under the two-level methods (a slow-level layout, :mod:`planner`,
with the fast level, :mod:`balance`, every step) and under the baseline rows: every row
is a :class:`~ms_efficient.moe.balance.Balance` per step, costed by :mod:`balanced_cost`.

Methods (each given the same slots per device: ceil(E / W) + ``ReplayConfig.extra_slots``):
    efficientmoe        ours: the forecast places the home experts and splits the extra
                        slots between redundant home replicas and spare slots by replay on
                        the recent rows; buffers priced from the trace; the fast level
                        water-fills and copies hot experts into spare slots every step.
                        Re-planned (home table only, no shape change, no recompile) every
                        check interval when the replayed gain over the interval pays for
                        moving the weights and optimizer state.
    efficientmoe-fixed-home  the same, never re-planned: the home table of the first compile
                        for the whole trace. What ``train --workers`` with dispatch
                        "balanced" runs today (its layer has no home re-placement yet), so
                        the gap to ``efficientmoe`` is what those re-plans are worth.
    moonep              MoonEP as its README describes it (:func:`~ms_efficient.efficientmoe.
                        baselines.moonep_balance`): uniform static homes, no forecast; every step every rank
                        receives exactly its share (S x K rows) into a buffer of that size,
                        the surplus of over-full ranks poured into under-full ones as
                        copies planned from the step's counts (as many as that takes:
                        ``max_copies_per_device``). Never re-placed.
    ablation-eplb-split EPLB's placement (every extra slot a redundant home replica, the
                        same forecast as ours) re-balanced on EPLB's own schedule (every
                        check interval, whatever the gain, migration charged) with our
                        fast level's water-filling over those replicas (no spare slots):
                        what the fast level alone gives EPLB.
    eplb-alltoallv      EPLB as published on a dynamic-shape stack: the same placement and
                        schedule, tokens split evenly over an expert's replicas, no buffer
                        (nothing drops), a count-driven exchange that pays the measured
                        dynamic-shape overhead per All-to-All (``CostModel.dynamic_exchange_s``).

Baseline rows (:data:`BASELINE_ROWS`, :mod:`baselines`), on plain expert parallelism (the
uniform home table, no spare slot, never re-placed):
    fastermoe           shadows chosen every step (:func:`baselines.fastermoe_balance`), a
                        broadcast of each shadow's weights and a reduce of its gradient
                        (each charged as a broadcast over the ranks, in the ``copies`` term),
                        count-driven exchange (the dynamic-shape overhead), no fast level.
    dropless            every row computed at its expert's one device, count-driven exchange.
    switch-cf<x>        fixed C rows per rank and expert sent and computed whole (padding),
                        overflow dropped, no count exchange and no dynamic-shape overhead.

Metrics as :class:`~ms_efficient.efficientmoe.replay.ReplayResult`, plus ``copies_per_step``
(expert copies per training step, all layers) and ``weight_bytes_per_step`` (their bytes,
forward; the same returns as gradients in backward). No MindSpore import here.
"""
from __future__ import annotations

import logging

import numpy as np

from ms_efficient.efficientmoe.balanced_cost import (balanced_cost, copy_cost_rows_WW,
                                                     home_sync_time_L)
from ms_efficient.efficientmoe.cost import CostModel
from ms_efficient.efficientmoe.planner import LayoutConfig, decide_home, plan_layout, uniform_home
from ms_efficient.efficientmoe.baselines import fastermoe_balance, moonep_balance, switch_balance
from ms_efficient.moe.balance import balance_step, ops_twin_launches_L
from ms_efficient.moe.split import switch_capacity

__all__ = ["TWO_LEVEL_METHODS", "BASELINE_ROWS", "TERMS", "layout_config_for", "replay_two_level",
           "lower_bound_step_s", "replay_lower_bound", "LOWER_BOUND"]

# the parts of a two-level step's time (ms per iteration in a row's ``terms_ms``): the counts'
# AllGather and the dynamic-shape overhead of every count-driven pass; the token exchange;
# what the copies' weights add to it; the grouped expert compute; the replicas' gradient
# sync; the fast level
TERMS = ("exchange", "tokens", "copies", "compute", "sync", "fast_level")
LOWER_BOUND = "oracle-bound"

logger = logging.getLogger(__name__)

TWO_LEVEL_METHODS = ("efficientmoe", "efficientmoe-fixed-home", "moonep", "ablation-eplb-split",
                     "eplb-alltoallv")
_EPLB_SCHEDULE = {"ablation-eplb-split", "eplb-alltoallv"}     # re-balance whatever the gain
# the baselines replayed here on plain expert parallelism (uniform homes, never re-placed),
# each from its public description (:mod:`baselines`); "switch-cf<x>" takes any factor
BASELINE_ROWS = ("fastermoe", "dropless", "switch-cf1.0", "switch-cf1.25", "switch-cf2.0")


def layout_config_for(method: str, extra_slots: int, window: int) -> LayoutConfig:
    """The slow-level settings of a two-level method (module docstring)."""
    if method in ("efficientmoe", "efficientmoe-fixed-home"):
        return LayoutConfig(slots=extra_slots, window=window)
    if method == "moonep":
        return LayoutConfig(slots=extra_slots, window=window, forecast_home=False)
    if method in _EPLB_SCHEDULE:         # EPLB's own placement: its global policy, not refined
        return LayoutConfig(slots=extra_slots, window=window, redundant=extra_slots,
                            refine=False, node_first=False)
    raise ValueError(f"two-level method must be one of {list(TWO_LEVEL_METHODS)}, but got "
                     f"{method!r}.")


def _baseline_step(method: str, counts_LRE: np.ndarray, home_LWS: np.ndarray,
                   model: CostModel, capacity: int):
    """One step of a baseline row of :data:`BASELINE_ROWS` on plain expert parallelism
    (``home_LWS`` uniform): (Balance, BalancedCost, the shadows' transfer seconds [L],
    FasterMoE's shadows per layer [L]; zeros for the other rows)."""
    num_layers, num_ranks, _ = counts_LRE.shape
    dpn = model.cluster.devices_per_node
    no_sync = np.zeros(num_layers)
    none_L = np.zeros(num_layers)
    if method.startswith("switch-cf"):
        bal = switch_balance(counts_LRE, home_LWS, capacity)
        return bal, balanced_cost(bal, model, no_sync, dynamic=False, fast_level=False,
                                  count_exchange=False), none_L, none_L
    if method == "dropless":
        bal = balance_step(counts_LRE, home_LWS, np.zeros(num_ranks, dtype=np.int64), None,
                           even_split=True, devices_per_node=dpn)
        return bal, balanced_cost(bal, model, no_sync, dynamic=True,
                                  fast_level=False), none_L, none_L
    # fastermoe: the broadcast of one shadow's weights over every rank
    bcast = model.cluster.collective_time_s("broadcast", model.copy_bytes,
                                            list(range(num_ranks)))
    bal, shadows_L = fastermoe_balance(
        counts_LRE, home_LWS,
        lambda b: balanced_cost(b, model, no_sync, dynamic=True, fast_level=False).time_L,
        bcast, dpn)
    return (bal, balanced_cost(bal, model, no_sync, dynamic=True, fast_level=False),
            2.0 * bcast * shadows_L, shadows_L)


def replay_two_level(trace, method: str, model: CostModel, warmup: int, check_rows: int,
                     stride: int, extra_slots: int, window: int):
    """Replay ``trace`` rows [warmup, T) under ``method``, a two-level method or a baseline
    row of :data:`BASELINE_ROWS`; returns the fields of
    :class:`~ms_efficient.efficientmoe.replay.ReplayResult` as a dict (module docstring)."""
    counts = trace.counts
    baseline = method in BASELINE_ROWS or method.startswith("switch-cf")
    capacity = 0
    if baseline:
        layout = None
        home = uniform_home(trace.num_layers, trace.num_experts, trace.num_ranks)
        if method.startswith("switch-cf"):
            cf = float(method[len("switch-cf"):])
            tokens = trace.tokens_per_rank or int(round(
                counts.sum(axis=3).mean() / (trace.top_k or 1)))
            capacity = switch_capacity(tokens, trace.num_experts, trace.top_k or 1, cf)
    else:
        config = layout_config_for(method, extra_slots, window)
        layout = plan_layout(counts[:warmup], model, config, method=method)   # first compile
        unbounded = method == "eplb-alltoallv"
        copy_cost = copy_cost_rows_WW(model, layout.num_devices)
        sync = home_sync_time_L(layout.home_LWS, trace.num_experts, model, layout.sync_rows)
    dpn = model.cluster.devices_per_node
    step_times, a2a_times, imbalance, copies, weights = [], [], [], [], []
    most_copies = 0                                 # copies one device held in one step
    terms = {name: 0.0 for name in TERMS}
    computed = dropped = launches = 0
    replans, overhead = 0, 0.0
    for t in range(warmup, trace.num_steps):
        if (not baseline and config.forecast_home and method != "efficientmoe-fixed-home"
                and t > warmup and (t - warmup) % check_rows == 0):
            decision = decide_home(counts[:t], layout, config, model, check_rows * stride,
                                   always=method in _EPLB_SCHEDULE)
            if decision.adopt:
                layout, replans = decision.candidate, replans + 1
                overhead += decision.cost_s
                sync = home_sync_time_L(layout.home_LWS, trace.num_experts, model, layout.sync_rows)
        shadow_L = shadows_L = 0
        if baseline:
            bal, cost, shadow_L, shadows_L = _baseline_step(method, counts[t], home, model,
                                                            capacity)
            # a shadow's weights reach every other rank (broadcast), not the exchange
            weight_L = np.asarray(shadows_L) * (trace.num_ranks - 1) * float(model.copy_bytes)
        else:
            if method == "moonep":
                bal = moonep_balance(counts[t], layout.home_LWS, dpn)
            else:
                bal = balance_step(counts[t], layout.home_LWS,
                                   np.zeros_like(layout.spare_W) if unbounded else layout.spare_W,
                                   None if unbounded else layout.buffer_LW, copy_cost,
                                   even_split=unbounded, devices_per_node=dpn)
            # every two-level row's layer dispatches with the count-driven exchange (AlltoAllVC
            # on Ascend): each of its passes pays the dynamic-shape overhead, ours included
            cost = balanced_cost(bal, model, sync, dynamic=True, fast_level=not unbounded)
            weight_L = cost.weight_bytes_L
            if not unbounded:
                launches += int(ops_twin_launches_L(bal.trips_L4, trace.num_layers).sum())
        step_times.append(float(cost.time_L.sum() + np.sum(shadow_L)))
        for name, part in zip(TERMS, (cost.exchange_L, cost.a2a_L - cost.copies_L,
                                      cost.copies_L + shadow_L, cost.compute_L, cost.sync_L,
                                      cost.fast_L)):
            terms[name] += float(np.sum(part))
        a2a_times.append(float(cost.a2a_L.sum() + cost.exchange_L.sum()))
        load = bal.load_LW
        imbalance.extend(load.max(axis=1) / np.maximum(load.mean(axis=1), 1e-12))
        copies.append(int(bal.copies_L.sum() + np.sum(shadows_L) * (trace.num_ranks - 1)))
        most_copies = max(most_copies, int(bal.copies_LWW.sum(axis=1).max(initial=0)),
                          int(np.max(shadows_L)))     # FasterMoE: its shadows on every device
        weights.append(float(np.sum(weight_L)))
        computed += int(model.cluster.tiled_rows(bal.rows_LEW).sum())
        dropped += int(bal.dropped_L.sum())
    rows = trace.num_steps - warmup
    routed = int(counts[warmup:].sum())
    kept = routed - dropped
    layer_steps = len(step_times) * trace.num_layers
    charged = {"terms_ms": {n: 1e3 * v / len(step_times) for n, v in terms.items()},
               "fast_level_s": terms["fast_level"] / layer_steps,
               # kernels per layer-step, where that is what the fast level is charged by
               "fast_level_launches": (launches / layer_steps if launches
                                       and model.fast_level_by_launches else None),
               "dynamic_exchange_s": (0.0 if method.startswith("switch-cf")
                                      else model.dynamic_exchange_s),
               "copies_per_step": float(np.mean(copies)),
               "weight_bytes_per_step": float(np.mean(weights)),
               "recompiles": 0}
    if baseline:
        charged.update(redundant_home_slots=0, spare_slots=0,
                       max_copies_per_device=most_copies)
        if capacity:
            charged["capacity_rows"] = int(capacity)
    else:
        charged.update(redundant_home_slots=int(layout.redundant),
                       spare_slots=(most_copies if method == "moonep"
                                    else int(layout.spare_W.max())),
                       max_copies_per_device=most_copies,
                       buffer_over_mean=(1.0 if method == "moonep"
                                         else float(1.0 + layout.slack_L.mean())))
    return dict(
        method=method,
        iteration_time_s=float(np.mean(step_times)) + overhead / (rows * stride),
        a2a_time_s=float(np.mean(a2a_times)), max_over_mean_load=float(np.mean(imbalance)),
        padding_fraction=(computed - kept) / computed if computed else 0.0,
        drop_rate=dropped / routed if routed else 0.0, replans=replans,
        replan_overhead_s=overhead, step_time_s=np.array(step_times), extra=charged)


def lower_bound_step_s(counts_LRE: np.ndarray, model: CostModel) -> float:
    """A lower bound on any MoE method's time for one training step of ``counts_LRE`` (int
    [L, R, E] routed assignments), seconds: per layer, every assignment computed (no drop),
    spread perfectly over the R devices (each the mean, no tile rounding, no weight reads),
    at the cluster's peak rate; no token or weight exchange (a rank's own assignments are the
    mean, so perfect balance needs none), no count exchange, copy, sync, fast level or
    launch. Every row of ``bench moe`` computes at least this (tests/test_moe_planners.py
    checks it on random counts)."""
    counts = np.asarray(counts_LRE, dtype=np.float64)
    rows_L = counts.sum(axis=(1, 2)) / counts.shape[1]
    return float((rows_L * model.row_time_s).sum())


def replay_lower_bound(trace, model: CostModel, warmup: int):
    """The ``oracle-bound`` row: :func:`lower_bound_step_s` of rows [warmup, T), as the
    fields of :class:`~ms_efficient.efficientmoe.replay.ReplayResult`."""
    steps = np.array([lower_bound_step_s(c, model) for c in trace.counts[warmup:]])
    return dict(method=LOWER_BOUND, iteration_time_s=float(steps.mean()), a2a_time_s=0.0,
                max_over_mean_load=1.0, padding_fraction=0.0, drop_rate=0.0,
                step_time_s=steps,
                extra={"fast_level_s": 0.0, "dynamic_exchange_s": 0.0,
                       "weight_bytes_per_step": 0.0, "copies_per_step": 0.0,
                       "recompiles": 0})
