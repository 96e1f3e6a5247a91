"""Baseline expert planners, each written from its public description (no code copied).

Every function returns an :class:`ExpertPlan` for one MoE layer (E experts, D devices):

switch_plan      Switch Transformer (Fedus, Zoph & Shazeer, "Switch Transformers: Scaling to
                 Trillion Parameter Models with Simple and Efficient Sparsity", JMLR 2022,
                 sec. 2.1) and GShard (Lepikhin et al. 2020, sec. 2.2): experts spread evenly
                 over devices; every source rank (a "group" in GShard) has the same static
                 capacity C = ceil(cf * tokens_per_rank * top_k / E) in every expert, fills it
                 in arrival order and drops the rest; the dispatched [E, C, H] buffer is sent
                 whole, empty rows included, and every expert computes R * C rows
                 (``dispatch="static"`` with equal shares, see :mod:`ms_efficient.moe.plan`).
                 MindFormers' MoE has the same layout (capacity per data-parallel group).
                 Capacity factors 1.0, 1.25, 2.0 in the benchmark; C is not rounded to a tile
                 multiple, as in the papers.
dropless_static_plan  the same static layout with each expert's per-rank capacity set to the
                 largest count any rank sent it over the whole trace, so no step drops: offline
                 knowledge, and one capacity per expert rather than GShard's single C, the
                 cheapest static graph that never drops (a bound in the baseline's favour).
dropless_grouped_plan  MegaBlocks (Gale et al., "MegaBlocks: Efficient Sparse Training with
                 Mixture-of-Experts", MLSys 2023): dropless expert compute as a grouped
                 (block-sparse) matmul over the tokens each expert actually got, no capacity and
                 no padding beyond the kernel's tile. Uniform placement, no replicas, no
                 re-planning. In a static graph (what MindSpore's GRAPH mode compiles)
                 MegaBlocks' dynamic token exchange becomes blocks fixed before compilation,
                 so every rank sends every device the most rows it could ever send there
                 (its tokens x min(top-k, the device's experts)) and nothing drops
                 (``dispatch="grouped"`` with those ``send_block``); its dynamic-shape best
                 case is FasterMoE's exchange below.
fastermoe_plan   FasterMoE (He et al., "FasterMoE: Modeling and Optimizing Training of Large-
                 Scale Dynamic Pre-Trained Models", PPoPP 2022), dynamic shadowing: after the
                 gate has routed the step, a performance model decides which popular experts to
                 "shadow": their weights are broadcast to every device, each device computes its
                 own tokens for them locally, and their gradients are reduced back (charged as
                 an all-reduce among the copies, a slight overestimate of a reduce to the
                 owner). Experts are added most popular first while the modelled step time
                 falls (no cap on their number in the replay, as in the paper). FasterMoE runs
                 with dynamic shapes, so its slots are sized to the step's actual loads (no
                 padding, no drops) and its All-to-All carries the routed tokens after a count
                 exchange (``dispatch="alltoallv"``): the baseline's best case.
eplb_plan        DeepSeek EPLB (deepseek-ai/EPLB, "Expert Parallelism Load Balancer", 2025):
                 redundant experts are given to the experts with the heaviest load per replica,
                 then replicas are packed onto devices by greedy balanced packing (heaviest
                 replica first onto the least loaded device that still has a free slot; every
                 device gets the same number of slots). Global policy (no node grouping). In
                 the benchmark it is fed by an EMA load predictor and runs in the same static
                 graph as ours (its placement policy in our harness): having no per-replica
                 capacity, it gets one uniform capacity for all slots, each expert's capacity
                 shared among the ranks in proportion to their EMA forecast, and the smallest
                 uniform capacity whose expected per-rank drop rate meets the target; or
                 (``dispatch="grouped"`` or ``"counts"``, the "-grouped" and "-counts" rows)
                 that dispatch with the send blocks ours would give its placement
                 (:func:`placement.grouped_plan`), so those rows compare placement and
                 forecast alone.
greedy_plan      MindSpeed-style greedy expert placement: no replication; experts, heaviest
                 first, go to the least loaded device with a free slot (equal experts per
                 device); one uniform capacity, sized and shared as for EPLB, or grouped
                 dispatch as for EPLB.
oracle_plan      our scheduler (:func:`placement.plan_layer`) given the true
                 load of the step, capacities fitted exactly, re-planned every step at no
                 charge: a bound for any forecast-driven planner with the same dispatch and
                 slots (the "oracle" row: static dispatch; "oracle-grouped": grouped).
moonep_balance   MoonEP (MoonshotAI/MoonEP README, 2026; no code read), the ``moonep`` row of
                 ``bench moe``, a fast level for the two-level replay. The description fixes:
                 perfect balance (every rank receives exactly S x K rows, S tokens per rank,
                 K top-k, into a fixed buffer of S x K rows); a few redundant experts planned
                 online from the step's router outputs and prefetched before the expert
                 compute, their gradients reduced to the home ranks in backward; static homes
                 (the uniform table of :func:`~ms_efficient.efficientmoe.layout.uniform_home`,
                 no forecast). Its planning kernel ("near-optimal") is not described; this one
                 takes each rank's target (the step's assignments / W, the remainder one row
                 each to the lower ranks), keeps every rank's home rows up to it, cuts each
                 over-full rank's surplus from its largest home pieces and pours the pieces,
                 largest first, into the under-full ranks (a rank that already holds the
                 expert first, else the largest deficit). A piece poured into a rank that does
                 not hold its expert is a copy (weights from the surplus rank, a home holder).
                 Nothing drops; copies number at most the pieces plus W - 1 per layer and are
                 not capped per rank (``max_copies_per_device`` of the replay reports the
                 spare slots that took). Costed like every two-level row
                 (:mod:`~ms_efficient.efficientmoe.balanced_cost`).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Optional, Sequence, Tuple

import numpy as np

from ms_efficient.efficientmoe.capacity import round_up, uniform_capacity
from ms_efficient.efficientmoe.cost import CostModel, check_rank_device, layer_cost
from ms_efficient.efficientmoe.placement import (PlacementConfig, grouped_plan, plan_layer,
                                                 replica_counts_greedy, uniform_placement)
from ms_efficient.moe.balance import Balance, holders_of, home_split, pair_rows
from ms_efficient.moe.plan import GROUPED_DISPATCH, ExpertPlan
from ms_efficient.moe.split import largest_remainder, split_tokens, switch_capacity

__all__ = ["uniform_placement", "switch_plan", "dropless_static_plan", "dropless_grouped_plan",
           "fastermoe_plan",
           "balanced_packing", "eplb_plan", "greedy_plan", "oracle_plan", "moonep_balance"]

logger = logging.getLogger(__name__)


def _equal_per_rank(slot_expert: np.ndarray, per_rank_E: np.ndarray,
                    num_ranks: int) -> np.ndarray:
    """Slot capacities giving every rank ``per_rank_E[e]`` rows of expert e: int64 [S], each
    expert's R * per_rank_E[e] rows split over its replicas (largest remainder)."""
    caps = np.zeros(slot_expert.size, dtype=np.int64)
    for e in np.unique(slot_expert):
        slots = np.flatnonzero(slot_expert == e)
        caps[slots] = largest_remainder(int(num_ranks * per_rank_E[e]), np.ones(slots.size))
    return caps


def switch_plan(num_experts: int, devices: Sequence[int], num_ranks: int,
                assignments_per_rank: int, capacity_factor: float,
                top_k: Optional[int] = None) -> ExpertPlan:
    """Switch/GShard: uniform placement over ``devices``, per-rank capacity
    C = ceil(cf * assignments_per_rank / E) in every expert (``assignments_per_rank`` = tokens
    per rank * top_k), static dispatch with equal shares: each expert has R * C rows."""
    slot_expert, slot_device = uniform_placement(num_experts, devices)
    k = top_k or 1
    per_rank = switch_capacity(assignments_per_rank // k, num_experts, k, capacity_factor)
    caps = _equal_per_rank(slot_expert, np.full(num_experts, per_rank), num_ranks)
    tokens = num_ranks * assignments_per_rank // top_k if top_k else None
    return ExpertPlan(slot_expert, slot_device, caps, top_k=top_k, tokens_per_step=tokens,
                      method=f"switch-cf{capacity_factor:g}", dispatch="static")


def dropless_static_plan(counts_TRE: np.ndarray, devices: Sequence[int],
                         top_k: Optional[int] = None) -> ExpertPlan:
    """Uniform placement, static dispatch with equal shares; expert e's per-rank capacity is
    the largest count any rank sent it over all rows of ``counts_TRE`` (int [t, R, E], one
    layer, whole trace)."""
    counts = np.asarray(counts_TRE)
    num_ranks, num_experts = counts.shape[1:]
    slot_expert, slot_device = uniform_placement(num_experts, devices)
    caps = _equal_per_rank(slot_expert, np.maximum(counts.max(axis=(0, 1)), 1), num_ranks)
    tokens = int(counts.sum(axis=(1, 2)).max()) // top_k if top_k else None
    return ExpertPlan(slot_expert, slot_device, caps, top_k=top_k, tokens_per_step=tokens,
                      method="dropless-static", dispatch="static")


def dropless_grouped_plan(num_experts: int, devices: Sequence[int],
                          tokens_per_step: Optional[int], top_k: Optional[int],
                          assignments_per_step: int) -> ExpertPlan:
    """MegaBlocks-style dropless grouped plan: uniform placement over ``devices`` (the
    source ranks too, one per device), every slot's capacity an equal share (it only sets the
    split, there are no replicas), and every (rank, device) send block the most rows the rank
    can send there: min(its assignments, its tokens x the device's experts), each rank
    holding 1/R of ``assignments_per_step`` and ``tokens_per_step`` (all its assignments when
    the token count is unknown); a device's buffer is the sum of its blocks."""
    slot_expert, slot_device = uniform_placement(num_experts, devices)
    num_ranks = len(devices)
    experts_D = np.bincount(slot_device, minlength=int(slot_device.max()) + 1)
    most_D = np.full(experts_D.size, assignments_per_step / num_ranks)
    if tokens_per_step:
        most_D = np.minimum(most_D, tokens_per_step / num_ranks * experts_D)
    most_D = np.where(experts_D > 0, np.maximum(np.ceil(most_D - 1e-9), 1), 0)
    block_RD = np.tile(most_D.astype(np.int64), (num_ranks, 1))
    caps = np.full(slot_expert.size, max(1, assignments_per_step // num_experts))
    return ExpertPlan(slot_expert, slot_device, caps, top_k=top_k,
                      tokens_per_step=tokens_per_step, method="dropless-grouped",
                      dispatch="grouped", device_buffer=block_RD.sum(axis=0),
                      send_block=block_RD)


def fastermoe_plan(counts_RE: np.ndarray, model: CostModel, slots_per_device: Optional[int],
                   rank_device: np.ndarray) -> Tuple[ExpertPlan, float]:
    """FasterMoE shadowing for one step with the step's actual counts (int [R, E]).

    Returns (plan, broadcast_time_s): the plan's shadow slots are the extra copies; the
    broadcast of the shadowed experts' weights to all devices (seconds per step) is not part
    of :func:`layer_cost` and must be added by the caller. With ``slots_per_device`` at most
    ``slots_per_device - ceil(E / H)`` experts are shadowed (memory for their copies); None =
    as many as the model wants (the paper sets no limit). Experts and shadows live on the
    ranks' devices (H of them).
    """
    cluster = model.cluster
    counts = np.asarray(counts_RE, dtype=np.int64)
    num_experts = counts.shape[1]
    rank_device = check_rank_device(rank_device, counts.shape[0], cluster)
    hosts = np.sort(rank_device)
    base_expert, base_device = uniform_placement(num_experts, hosts)
    max_shadow = num_experts if slots_per_device is None else \
        max(0, slots_per_device - int(np.bincount(base_device).max()))
    everyone = hosts.tolist()
    bcast_one = cluster.collective_time_s("broadcast", model.grad_bytes, everyone)
    popular = np.lexsort((np.arange(num_experts), -counts.sum(axis=0)))

    def build(shadowed) -> ExpertPlan:
        extra_e, extra_d = [], []
        for e in shadowed:
            has = set(base_device[base_expert == e].tolist())
            for d in everyone:
                if d not in has:
                    extra_e.append(e)
                    extra_d.append(d)
        slot_expert = np.concatenate([base_expert, np.array(extra_e, dtype=np.int64)])
        slot_device = np.concatenate([base_device, np.array(extra_d, dtype=np.int64)])
        # dynamic shapes: every slot holds exactly the tokens it gets (local first)
        loose = ExpertPlan(slot_expert, slot_device, np.full(slot_expert.size, counts.sum()))
        assigned, _ = split_tokens(loose, counts, rank_device, cluster.devices_per_node)
        return ExpertPlan(slot_expert, slot_device, assigned.sum(axis=0), method="fastermoe")

    best_plan = build([])
    best_time = layer_cost(best_plan, counts, model, rank_device).time_s
    for k in range(1, max_shadow + 1):
        plan = build(popular[:k].tolist())
        t = layer_cost(plan, counts, model, rank_device).time_s + k * bcast_one
        if t >= best_time:
            break
        best_plan, best_time = plan, t
    shadows = int((best_plan.replica_counts(num_experts) > 1).sum())
    return best_plan, shadows * bcast_one


def balanced_packing(weights: np.ndarray, num_packs: int, items_per_pack: int) -> np.ndarray:
    """Pack of each item, int64 [N]: heaviest item first into the lightest pack that still has
    room for an item (ties: lower pack id). Requires N <= num_packs * items_per_pack."""
    w = np.asarray(weights, dtype=np.float64)
    if w.size > num_packs * items_per_pack:
        raise ValueError(f"{w.size} items do not fit {num_packs} packs of {items_per_pack}.")
    pack_of = np.empty(w.size, dtype=np.int64)
    load = np.zeros(num_packs)
    room = np.full(num_packs, items_per_pack)
    for i in np.lexsort((np.arange(w.size), -w)):
        p = int(np.argmin(np.where(room > 0, load, np.inf)))
        pack_of[i] = p
        load[p] += w[i]
        room[p] -= 1
    return pack_of


def _uniform_capacity_plan(slot_expert, slot_device, load_RE, rel_err_KRE, config, method,
                           top_k, tokens_per_step) -> ExpertPlan:
    """A static plan with one capacity C for all slots: each expert's n_e * C rows shared among
    the ranks in proportion to their forecast ``load_RE``; C is the smallest multiple of the
    capacity rounding whose expected drop rate, rank by rank ([K, R, E] relative errors
    ``rel_err_KRE``), meets the target; at most ``tokens_per_step``."""
    load = np.asarray(load_RE, dtype=np.float64)
    num_ranks, num_experts = load.shape
    if tokens_per_step is None and top_k:
        tokens_per_step = int(round(float(load.sum()) / top_k))
    replicas = np.bincount(slot_expert, minlength=num_experts)
    column = load.sum(axis=0, keepdims=True)
    weight_RE = np.where(column > 0, load / np.where(column > 0, column, 1.0), 1.0 / num_ranks)
    per_unit = np.maximum(weight_RE * replicas[None, :], 1e-9).ravel()   # rows per row of C
    rel = np.asarray(rel_err_KRE, dtype=np.float64)
    res = uniform_capacity(load.ravel(), np.arange(load.size), rel.reshape(rel.shape[0], -1),
                           config.drop_target, config.capacity_multiple,
                           max_load=tokens_per_step / num_ranks if tokens_per_step else None,
                           per_unit_S=per_unit)
    cap = res.uniform
    if tokens_per_step:
        cap = min(cap, max(int(round_up(tokens_per_step, config.capacity_multiple)),
                           config.capacity_multiple))
    return ExpertPlan(slot_expert, slot_device, np.full(slot_expert.size, cap), top_k=top_k,
                      tokens_per_step=tokens_per_step, method=method, dispatch="static",
                      rank_share=load)


def eplb_plan(load_RE: np.ndarray, rel_err_KRE: np.ndarray, model: CostModel,
              config: PlacementConfig, rank_device: np.ndarray, top_k: Optional[int] = None,
              tokens_per_step: Optional[int] = None, dispatch: str = "static") -> ExpertPlan:
    """EPLB: fill all slots of the ranks' devices (redundant experts to the heaviest load per
    replica), balanced packing of replicas (load L_e / n_e each) onto those devices; then
    the dispatch's sizing (:func:`_sized`). load_RE: float [R, E] forecast; rel_err_KRE:
    float [K, R, E] relative errors of the per-rank forecasts."""
    load = np.asarray(load_RE, dtype=np.float64)
    hosts = np.sort(check_rank_device(rank_device, load.shape[0], model.cluster))
    load_E = load.sum(axis=0)
    # Step 1: redundant experts
    replicas = replica_counts_greedy(load_E, config.slots_per_device * hosts.size)
    slot_expert = np.repeat(np.arange(load_E.size), replicas)
    # Step 2: balanced packing of the replicas onto devices
    slot_device = hosts[balanced_packing(load_E[slot_expert] / replicas[slot_expert],
                                         hosts.size, config.slots_per_device)]
    return _sized(slot_expert, slot_device, load, rel_err_KRE, model, config, rank_device,
                  "eplb-ema", top_k, tokens_per_step, dispatch)


def greedy_plan(load_RE: np.ndarray, rel_err_KRE: np.ndarray, model: CostModel,
                config: PlacementConfig, rank_device: np.ndarray, top_k: Optional[int] = None,
                tokens_per_step: Optional[int] = None, dispatch: str = "static") -> ExpertPlan:
    """Greedy placement without replication: experts, heaviest first, onto the least loaded
    of the ranks' devices with a free slot (ceil(E / H) slots each); then the dispatch's
    sizing (:func:`_sized`)."""
    load = np.asarray(load_RE, dtype=np.float64)
    hosts = np.sort(check_rank_device(rank_device, load.shape[0], model.cluster))
    num_experts = load.shape[1]
    slot_expert = np.arange(num_experts)
    slot_device = hosts[balanced_packing(load.sum(axis=0), hosts.size,
                                         -(-num_experts // hosts.size))]
    return _sized(slot_expert, slot_device, load, rel_err_KRE, model, config, rank_device,
                  "mindspeed-greedy", top_k, tokens_per_step, dispatch)


def _sized(slot_expert, slot_device, load, rel_err_KRE, model, config, rank_device, method,
           top_k, tokens_per_step, dispatch) -> ExpertPlan:
    """A placement baseline's plan for ``dispatch``: "static", one uniform capacity
    (:func:`_uniform_capacity_plan`, its published form); "grouped" or "counts", the block
    rule ours uses (:func:`~ms_efficient.efficientmoe.placement.grouped_plan`, blocks at the
    same cost-chosen per-pair drop target rule), so a grouped or counts row differs from ours
    with that dispatch by its placement and forecast only."""
    if dispatch == "static":
        return _uniform_capacity_plan(slot_expert, slot_device, load, rel_err_KRE, config,
                                      method, top_k, tokens_per_step)
    if dispatch not in GROUPED_DISPATCH:
        raise ValueError(f"'dispatch' must be one of {['static', *GROUPED_DISPATCH]}, but got "
                         f"{dispatch!r}.")
    plan = grouped_plan(slot_expert, slot_device, load, model, np.asarray(rank_device),
                        tokens_per_step, top_k, rel_err_KRE,
                        config=dataclasses.replace(config, dispatch=dispatch))
    return dataclasses.replace(plan, method=f"{method}-{dispatch}")


def oracle_plan(counts_RE: np.ndarray, model: CostModel, config: PlacementConfig,
                rank_device: np.ndarray, top_k: Optional[int] = None,
                tokens_per_step: Optional[int] = None) -> ExpertPlan:
    """Our scheduler with the step's true counts (int [R, E]) and exactly fitted capacities
    (``config.dispatch`` "grouped": blocks of exactly the step's rows, no padding, no drop)."""
    return plan_layer(counts_RE, model, config, rank_device, rel_err_KRE=None, method="oracle",
                      top_k=top_k, tokens_per_step=tokens_per_step)


def _moonep_targets(total: int, num_devices: int) -> np.ndarray:
    """Rows each device receives: total / W, the remainder one row each to the lower ones."""
    base, rest = divmod(int(total), num_devices)
    return base + (np.arange(num_devices) < rest).astype(np.int64)


def moonep_balance(counts_LRE: np.ndarray, home_LWS: np.ndarray,
                   devices_per_node: Optional[int] = None) -> Balance:
    """One step of MoonEP's rule (the module docstring's ``moonep_balance``), every layer.

    counts_LRE: int [L, R, E] rows each source rank routes to each expert (R = W).
    home_LWS: int [L, W, S_h] logical expert of every home slot (-1: empty).
    Returns a :class:`~ms_efficient.moe.balance.Balance`: ``rows_LEW.sum(1)`` is every
    device's target exactly, ``dropped_L`` zeros.
    """
    counts = np.asarray(counts_LRE, dtype=np.int64)
    num_layers, num_ranks, num_experts = counts.shape
    held = holders_of(np.asarray(home_LWS, dtype=np.int64), num_experts)
    if not held.any(axis=2).all():
        layer, expert = np.argwhere(~held.any(axis=2))[0]
        raise ValueError(f"expert {expert} of layer {layer} has no home slot; every expert "
                         f"needs one.")
    counts_E = counts.sum(axis=1)
    rows = home_split(counts_E, held)
    num_devices = num_ranks
    holder = held.copy()
    copies = np.zeros((num_layers, num_devices, num_devices), dtype=np.int64)
    copied = np.zeros((num_layers, num_experts), dtype=np.int64)
    source_of = np.full((num_layers, num_experts, num_devices), -1, dtype=np.int64)
    for layer in range(num_layers):
        r = rows[layer]                                              # [E, W], a view
        target = _moonep_targets(counts_E[layer].sum(), num_devices)
        gap = r.sum(axis=0) - target                                 # > 0 surplus, < 0 deficit
        pieces = []                                                  # (expert, from, rows)
        for w in np.nonzero(gap > 0)[0]:
            need = int(gap[w])
            for e in np.argsort(-r[:, w], kind="stable"):
                take = int(min(need, r[e, w]))
                if take <= 0:
                    break
                pieces.append((int(e), int(w), take))
                r[e, w] -= take
                need -= take
        pieces.sort(key=lambda p: -p[2])                             # largest pieces first
        deficit = {int(w): int(-gap[w]) for w in np.nonzero(gap < 0)[0]}
        for e, src, amount in pieces:
            while amount > 0:
                # a deficit device that already holds e takes it without a copy
                takers = [w for w in deficit if deficit[w] > 0]
                have = [w for w in takers if holder[layer, e, w]]
                w = (have or sorted(takers, key=lambda d: (-deficit[d], d)))[0]
                moved = min(amount, deficit[w])
                if not holder[layer, e, w]:
                    holder[layer, e, w] = True
                    copies[layer, src, w] += 1
                    copied[layer, e] += 1
                    source_of[layer, e, w] = src
                r[e, w] += moved
                deficit[w] -= moved
                amount -= moved
    sent = pair_rows(counts, rows, devices_per_node)
    return Balance(rows_LEW=rows, holder_LEW=holder, copies_LWW=copies, copied_LE=copied,
                   source_LEW=source_of, sent_LRW=sent,
                   dropped_L=np.zeros(num_layers, dtype=np.int64))
