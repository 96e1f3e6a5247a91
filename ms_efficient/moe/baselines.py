"""Baseline expert planners, each written from its public description (no code copied).

Every function returns an :class:`ExpertPlan` for one MoE layer (E experts, D devices):

switch_plan      Switch Transformer (Fedus, Zoph & Shazeer, "Switch Transformers: Scaling to
                 Trillion Parameter Models with Simple and Efficient Sparsity", JMLR 2022,
                 arXiv 2021) and GShard: experts spread evenly over devices, every expert gets
                 the same static capacity ceil(cf * tokens * top_k / E); tokens beyond it are
                 dropped. Capacity factors 1.0, 1.25, 2.0 in the benchmark.
dropless_static_plan  the same placement with each expert's capacity sized to its largest
                 load over the whole trace, so no step drops (offline knowledge: a bound on
                 what a static graph needs to be dropless).
fastermoe_plan   FasterMoE (He et al., "FasterMoE: Modeling and Optimizing Training of Large-
                 Scale Dynamic Pre-Trained Models", PPoPP 2022), dynamic shadowing: after the
                 gate has routed the step, a performance model decides which popular experts to
                 "shadow": their weights are broadcast to every device, each device computes its
                 own tokens for them locally, and their gradients are reduced back (charged as
                 an all-reduce among the copies, a slight overestimate of a reduce to the
                 owner). Experts are added most popular first while the modelled step time
                 falls; shadows need a free slot on every device. FasterMoE runs
                 with dynamic shapes, so its slots are sized to the step's actual loads (no
                 padding, no drops): the baseline's best case.
eplb_plan        DeepSeek EPLB (deepseek-ai/EPLB, "Expert Parallelism Load Balancer", 2025):
                 redundant experts are given to the experts with the heaviest load per replica,
                 then replicas are packed onto devices by greedy balanced packing (heaviest
                 replica first onto the least loaded device that still has a free slot; every
                 device gets the same number of slots). Global policy (no node grouping). In
                 the benchmark it is fed by an EMA load predictor and, having no per-replica
                 capacity, gets one uniform capacity for all slots.
greedy_plan      MindSpeed-style greedy expert placement: no replication; experts, heaviest
                 first, go to the least loaded device with a free slot (equal experts per
                 device); one uniform capacity.
oracle_plan      our scheduler (:func:`ms_efficient.moe.placement.plan_layer`) given the true
                 load of the step, capacities fitted exactly: a reference for the planner.
"""
from __future__ import annotations

import logging
from typing import Optional, Tuple

import numpy as np

from ms_efficient.moe.capacity import round_up, switch_capacity, uniform_capacity
from ms_efficient.moe.placement import (CostModel, PlacementConfig, expected_slot_loads,
                                        layer_cost, plan_layer, replica_counts_greedy)
from ms_efficient.moe.plan import ExpertPlan, split_tokens

__all__ = ["uniform_placement", "switch_plan", "dropless_static_plan", "fastermoe_plan",
           "balanced_packing", "eplb_plan", "greedy_plan", "oracle_plan"]

logger = logging.getLogger(__name__)


def uniform_placement(num_experts: int, num_devices: int) -> Tuple[np.ndarray, np.ndarray]:
    """Static expert parallelism: (slot_expert, slot_device), int64 [S] each.

    E >= D: expert e on device floor(e * D / E) (contiguous, equal counts when D divides E).
    E < D: expert-data parallel, device d holds expert d mod E (D // E or more copies each).
    """
    if num_experts >= num_devices:
        experts = np.arange(num_experts)
        return experts, experts * num_devices // num_experts
    devices = np.arange(num_devices)
    return devices % num_experts, devices


def _equal_share_capacity(slot_expert: np.ndarray, per_expert: np.ndarray,
                          multiple: int) -> np.ndarray:
    n = np.bincount(slot_expert, minlength=per_expert.size)
    return round_up(np.asarray(per_expert, dtype=np.float64)[slot_expert] / n[slot_expert],
                    multiple)


def switch_plan(num_experts: int, num_devices: int, assignments_per_step: int,
                capacity_factor: float, multiple: int = 1,
                top_k: Optional[int] = None) -> ExpertPlan:
    """Switch/GShard: uniform placement, capacity ceil(cf * assignments / E) per expert (split
    equally among an expert's copies when E < D). ``assignments_per_step`` = tokens * top_k
    over all ranks."""
    slot_expert, slot_device = uniform_placement(num_experts, num_devices)
    per_expert = np.full(num_experts, switch_capacity(assignments_per_step, num_experts,
                                                      capacity_factor))
    caps = _equal_share_capacity(slot_expert, per_expert, multiple)
    tokens = assignments_per_step // top_k if top_k else None
    return ExpertPlan(slot_expert, slot_device, caps, top_k=top_k, tokens_per_step=tokens,
                      method=f"switch-cf{capacity_factor:g}")


def dropless_static_plan(load_TE: np.ndarray, num_devices: int, multiple: int = 1,
                         top_k: Optional[int] = None) -> ExpertPlan:
    """Uniform placement; each expert's capacity = its largest load over all rows of
    ``load_TE`` (int [t, E], the whole trace), split equally among its copies."""
    load = np.asarray(load_TE)
    slot_expert, slot_device = uniform_placement(load.shape[1], num_devices)
    caps = np.maximum(_equal_share_capacity(slot_expert, load.max(axis=0), multiple), multiple)
    tokens = int(load.sum(axis=1).max()) // top_k if top_k else None
    return ExpertPlan(slot_expert, slot_device, caps, top_k=top_k, tokens_per_step=tokens,
                      method="dropless-static")


def fastermoe_plan(counts_RE: np.ndarray, model: CostModel, slots_per_device: int,
                   rank_device: np.ndarray) -> Tuple[ExpertPlan, float]:
    """FasterMoE shadowing for one step with the step's actual counts (int [R, E]).

    Returns (plan, broadcast_time_s): the plan's shadow slots are the extra copies; the
    broadcast of the shadowed experts' weights to all devices (seconds per step) is not part
    of :func:`layer_cost` and must be added by the caller. At most
    ``slots_per_device - ceil(E / D)`` experts are shadowed (memory for their copies).
    """
    cluster = model.cluster
    counts = np.asarray(counts_RE, dtype=np.int64)
    num_experts, num_devices = counts.shape[1], cluster.num_devices
    base_expert, base_device = uniform_placement(num_experts, num_devices)
    max_shadow = max(0, slots_per_device - int(np.bincount(base_device).max()))
    everyone = list(range(num_devices))
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


def _uniform_capacity_plan(slot_expert, slot_device, load_RE, rel_err_KE, model, config,
                           rank_device, method, top_k) -> ExpertPlan:
    """One capacity for all slots from the expected per-slot loads and the residuals."""
    expected = expected_slot_loads(slot_expert, slot_device, load_RE, rank_device,
                                   model.cluster.devices_per_node)
    caps = uniform_capacity(expected, slot_expert, rel_err_KE, config.drop_target,
                            config.capacity_multiple).capacity_S
    load_total = float(np.asarray(load_RE).sum())
    tokens = int(round(load_total / top_k)) if top_k else None
    return ExpertPlan(slot_expert, slot_device, caps, top_k=top_k, tokens_per_step=tokens,
                      method=method)


def eplb_plan(load_RE: np.ndarray, rel_err_KE: np.ndarray, model: CostModel,
              config: PlacementConfig, rank_device: np.ndarray,
              top_k: Optional[int] = None) -> ExpertPlan:
    """EPLB: fill all slots (redundant experts to the heaviest load per replica), balanced
    packing of replicas (load L_e / n_e each) onto devices, one uniform capacity."""
    load = np.asarray(load_RE, dtype=np.float64)
    num_devices = model.cluster.num_devices
    load_E = load.sum(axis=0)
    # Step 1: redundant experts
    replicas = replica_counts_greedy(load_E, config.slots_per_device * num_devices)
    slot_expert = np.repeat(np.arange(load_E.size), replicas)
    # Step 2: balanced packing of the replicas onto devices
    slot_device = balanced_packing(load_E[slot_expert] / replicas[slot_expert], num_devices,
                                   config.slots_per_device)
    return _uniform_capacity_plan(slot_expert, slot_device, load, rel_err_KE, model, config,
                                  rank_device, "eplb-ema", top_k)


def greedy_plan(load_RE: np.ndarray, rel_err_KE: np.ndarray, model: CostModel,
                config: PlacementConfig, rank_device: np.ndarray,
                top_k: Optional[int] = None) -> ExpertPlan:
    """Greedy placement without replication: experts, heaviest first, onto the least loaded
    device with a free slot (ceil(E / D) slots each); one uniform capacity."""
    load = np.asarray(load_RE, dtype=np.float64)
    num_experts, num_devices = load.shape[1], model.cluster.num_devices
    slot_expert = np.arange(num_experts)
    slot_device = balanced_packing(load.sum(axis=0), num_devices, -(-num_experts // num_devices))
    return _uniform_capacity_plan(slot_expert, slot_device, load, rel_err_KE, model, config,
                                  rank_device, "mindspeed-greedy", top_k)


def oracle_plan(counts_RE: np.ndarray, model: CostModel, config: PlacementConfig,
                rank_device: np.ndarray, top_k: Optional[int] = None) -> ExpertPlan:
    """Our scheduler with the step's true counts (int [R, E]) and exactly fitted capacities."""
    return plan_layer(counts_RE, model, config, rank_device, rel_err_KE=None, method="oracle",
                      top_k=top_k)
