"""EfficientMoE's scheduler: replicate hot experts, place experts and replicas on devices.

Given a layer's predicted routing counts ``load_RE`` (tokens rank r sends to expert e next
step), a ClusterSpec and a slot budget per device, :func:`plan_layer` returns an ExpertPlan
for ``PlacementConfig.dispatch`` ("static": per-rank, per-slot capacities; "grouped" or
"counts": send blocks and row buffers, :func:`grouped_plan`) that minimises the predicted MoE
iteration time of the layer, evaluated by :func:`ms_efficient.efficientmoe.cost.layer_cost`
(All-to-All of the rows each rank sends, expert compute on the padded capacities of a static
plan or the received rows of a grouped one, replica gradient sync).

Slots go only on the source ranks' devices ("hosts"): in expert-parallel training every
device of the group is also a data-parallel rank that routes tokens, and a chip that routes
none is not part of the job (a 4-rank trace on an 8-chip node uses 4 chips).

The search (phases marked ``# Step``): 0. the rows each rank should own of each expert, from
the capacity model over the per-rank loads (static dispatch drops a rank's overflow, so each
rank's part is sized for its own spread), and so each expert's rows; 1. replication levels:
for a grid of replica totals, refined by halving steps around the best, hot experts get
replicas greedily (the next one goes to the expert with the most rows per replica);
2. placement: replicas, heaviest first, go to the host where they raise a per-device time
estimate (compute + received All-to-All bytes + replica sync) least, serving their own
device's and node's ranks first; 3. each expert's rows are split over its replicas so that
device totals are level (:func:`levelled_shares`), and the candidate is scored by
``layer_cost``; the best is kept; 4. capacities: the levelled rows rounded up to the
hardware multiple, at most the tokens of a step. Deterministic: no random numbers are drawn;
ties go to the lower expert / device id and to fewer replicas.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import numpy as np

from ms_efficient.efficientmoe.capacity import (expected_pair_drop_rate, round_up, send_blocks,
                                                slot_capacities)
from ms_efficient.efficientmoe.cost import CostModel, check_rank_device, layer_cost
from ms_efficient.moe.plan import GROUPED_DISPATCH, ExpertPlan

__all__ = ["PlacementConfig", "DROP_TARGET_FRACTIONS", "choose_blocks", "BlockChoice", "default_slots_per_device", "uniform_placement",
           "replica_counts_greedy", "device_bound",
           "place_replicas", "levelled_shares", "rank_capacities", "plan_layer",
           "grouped_plan", "pair_bound", "with_blocks"]

logger = logging.getLogger(__name__)


# The per-pair drop targets the block sizing tries, as fractions of the user's maximum
# (``max_block_drop_rate``): 0.1% -> 0.01%, 0.025%, 0.05%, 0.1%.
DROP_TARGET_FRACTIONS = (0.1, 0.25, 0.5, 1.0)


@dataclass(frozen=True)
class PlacementConfig:
    """slots_per_device: expert weight slots each host has memory for (>= ceil(E / hosts)).
    capacity_multiple: capacities are multiples of this (tokens). drop_target: expected drop
    rate the capacity model aims at. levels: points of the coarse grid of replication levels.
    dispatch: "static" (per-rank, per-slot capacities), "grouped" or "counts" (send blocks
    and one row buffer per device, see :mod:`ms_efficient.moe.plan`).
    max_block_drop_rate: the most expected drops (share of assignments) the send blocks of a
    "grouped"/"counts" plan may cause: the user's constraint; the per-pair target is chosen
    by cost among ``DROP_TARGET_FRACTIONS`` of it (:func:`choose_blocks`).
    replan_penalty_s: seconds a forced re-plan costs per step of a plan's life (a recompile
    over the steps the plan serves), weighed against the padding a tighter block saves.
    forced_replan_rate: drop rate at which a re-plan is forced (``ReplanCosts.max_drop_rate``;
    None: never): a plan expecting drop rate p risks min(1, p / forced_replan_rate) of one."""

    slots_per_device: int
    capacity_multiple: int = 16
    drop_target: float = 0.005
    levels: int = 5
    dispatch: str = "static"
    max_block_drop_rate: float = 0.001
    replan_penalty_s: float = 0.0
    forced_replan_rate: Optional[float] = 0.01

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_block_drop_rate < 1.0:
            raise ValueError(f"placement 'max_block_drop_rate' must be in [0, 1), but got "
                             f"{self.max_block_drop_rate!r}.")
        if not self.replan_penalty_s >= 0.0:
            raise ValueError(f"placement 'replan_penalty_s' must be >= 0, but got "
                             f"{self.replan_penalty_s!r}.")
        if self.dispatch not in ("static",) + GROUPED_DISPATCH:
            raise ValueError(f"placement 'dispatch' must be one of "
                             f"{['static', *GROUPED_DISPATCH]}, but got {self.dispatch!r}.")


def default_slots_per_device(num_experts: int, num_hosts: int, extra: int = 1) -> int:
    """ceil(E / hosts) slots for the experts plus ``extra`` spare slots for replicas."""
    return -(-num_experts // num_hosts) + extra


def uniform_placement(num_experts: int,
                      devices: Sequence[int]) -> Tuple[np.ndarray, np.ndarray]:
    """Static expert parallelism over the hosting ``devices`` (int [H], ascending):
    (slot_expert, slot_device), int64 [S] each.

    E >= H: expert e on devices[floor(e * H / E)] (contiguous, equal counts when H divides E).
    E < H: expert-data parallel, devices[i] holds expert i mod E (H // E or more copies each).
    """
    devices = np.asarray(devices, dtype=np.int64)
    num_hosts = devices.size
    if num_experts >= num_hosts:
        experts = np.arange(num_experts)
        return experts, devices[experts * num_hosts // num_experts]
    return np.arange(num_hosts) % num_experts, devices.copy()


def replica_counts_greedy(load_E: np.ndarray, total_slots: int) -> np.ndarray:
    """Replicas per expert, int64 [E]: one each, then each extra slot goes to the expert with
    the largest load per replica (ties: lower id) until ``total_slots`` are used."""
    load = np.asarray(load_E, dtype=np.float64)
    if total_slots < load.size:
        raise ValueError(f"{total_slots} slots cannot hold {load.size} experts; give each "
                         f"device more slots (slots_per_device).")
    counts = np.ones(load.size, dtype=np.int64)
    for _ in range(total_slots - load.size):
        counts[int(np.argmax(load / counts))] += 1
    return counts


def place_replicas(load_RE: np.ndarray, replicas_E: np.ndarray, model: CostModel,
                   slots_per_device: int, rank_device: np.ndarray,
                   growth_E: Optional[np.ndarray] = None) -> Tuple[np.ndarray, np.ndarray]:
    """Greedy placement of ``replicas_E[e]`` replicas of each expert: (slot_expert, slot_device).

    Only the ranks' devices (``rank_device``, distinct) host slots, ``slots_per_device`` each.
    Replicas (load L_e / n_e each, computing growth_e times as many rows: capacity headroom,
    default 1) are placed heaviest first on the device with a free slot and no copy of the
    expert that minimises its estimated time after placement:
        T_d = row_time * rows_d + 4 * (intra_recv_d * t_intra + inter_recv_d * t_inter) + sync_d
    where the replica serves its own device's ranks first, then its node's, then others'
    (the unserved demand of each rank is tracked), t_* are per-token link times, and sync_d
    adds an all-reduce of the expert's gradients when it already has replicas (inter-node if
    any of them is on another node). Ties go to the lower device id. A replica whose only free
    slots are on devices already holding its expert is left out.
    """
    cluster = model.cluster
    num_devices, dpn = cluster.num_devices, cluster.devices_per_node
    load = np.asarray(load_RE, dtype=np.float64)
    num_experts = load.shape[1]
    num_hosts = np.unique(rank_device).size
    if replicas_E.sum() > slots_per_device * num_hosts or (replicas_E > num_hosts).any():
        raise ValueError(f"{int(replicas_E.sum())} replicas (at most one per device per expert)"
                         f" do not fit {slots_per_device} slots x {num_hosts} devices.")
    node_D = np.arange(num_devices) // dpn
    links = (cluster.intra_link, cluster.inter_link)
    t_intra, t_inter = (model.a2a_passes * model.bytes_per_token / link.bandwidth_Bps
                        for link in links)
    sync_bytes = 2 * model.grad_bytes * float(model.sync_replica_grads)   # ~ all-reduce of 2
    sync_intra, sync_inter = (sync_bytes / link.bandwidth_Bps for link in links)
    time_D = np.zeros(num_devices)
    free_D = np.zeros(num_devices, dtype=np.int64)
    free_D[rank_device] = slots_per_device
    hosts_DE = np.zeros((num_devices, num_experts), dtype=bool)
    unserved_RE = load.copy()
    total_E = load.sum(axis=0)
    growth = np.ones(num_experts) if growth_E is None else np.asarray(growth_E, dtype=np.float64)
    items = [(total_E[e] / replicas_E[e], e) for e in range(num_experts)
             for _ in range(replicas_E[e])]
    items.sort(key=lambda it: (-it[0] * growth[it[1]], it[1]))
    slot_expert, slot_device = [], []
    for share, e in items:                     # share: tokens this replica serves per step
        u_D = np.bincount(rank_device, weights=unserved_RE[:, e], minlength=num_devices)
        u_N = np.bincount(node_D, weights=u_D, minlength=cluster.nodes)
        local = np.minimum(u_D, share)
        intra = np.minimum(u_N[node_D] - u_D, share - local)
        inter = share - local - intra
        placed = hosts_DE[:, e]
        sync = 0.0 if not placed.any() else np.where(
            (node_D[:, None] != node_D[placed][None, :]).any(axis=1), sync_inter, sync_intra)
        score = (time_D + model.row_time_s * share * growth[e] + intra * t_intra
                 + inter * t_inter + sync)
        score = np.where((free_D > 0) & ~placed, score, np.inf)
        if not np.isfinite(score).any():       # the free slots all hold e already: skip it
            continue
        d = int(np.argmin(score))
        time_D[d] = score[d]
        free_D[d] -= 1
        hosts_DE[d, e] = True
        slot_expert.append(e)
        slot_device.append(d)
        # serve the unserved demand: own device, then node, then the rest, proportionally
        for mask, amount in ((rank_device == d, local[d]),
                             ((node_D[rank_device] == node_D[d]) & (rank_device != d), intra[d]),
                             (node_D[rank_device] != node_D[d], inter[d])):
            pool = unserved_RE[mask, e]
            if pool.sum() > 0:
                unserved_RE[mask, e] -= pool * min(1.0, amount / pool.sum())
    order = np.lexsort((np.array(slot_expert), np.array(slot_device)))
    return np.array(slot_expert)[order], np.array(slot_device)[order]


def _water_fill(base: np.ndarray, total: float) -> np.ndarray:
    """x >= 0 with sum x = total minimising max(base + x): x_i = max(0, level - base_i)."""
    order = np.sort(base)
    level = order[0] + total
    for k in range(1, order.size + 1):          # level with the k lowest bins filled
        level = (order[:k].sum() + total) / k
        if k == order.size or level <= order[k]:
            break
    return np.maximum(0.0, level - base)


def levelled_shares(slot_expert: np.ndarray, slot_device: np.ndarray, rows_E: np.ndarray,
                    num_devices: int, sweeps: int = 3) -> np.ndarray:
    """Rows of each slot, float64 [S]: every expert's rows ``rows_E`` split over its replicas
    so that device totals are as level as possible.

    A replica's tokens can come from any rank (the dispatch fills replicas in proportion to
    their remaining room), so an expert's load need not be split equally: a sweep visits the
    replicated experts, heaviest first, and water-fills each one's rows over its replicas'
    devices given everything else on them (the replica on the lighter device takes more).
    ``sweeps`` passes; un-replicated experts keep all their rows, and an expert with two
    replicas on one device (EPLB's packing allows it) keeps equal shares.
    """
    slot_expert = np.asarray(slot_expert)
    rows_E = np.asarray(rows_E, dtype=np.float64)
    n = np.bincount(slot_expert, minlength=rows_E.size)
    share = rows_E[slot_expert] / n[slot_expert]
    rows_D = np.bincount(slot_device, weights=share, minlength=num_devices)
    replicated = [e for e in np.argsort(-rows_E, kind="stable") if n[e] > 1]
    for _ in range(sweeps):
        for e in replicated:
            slots = np.flatnonzero(slot_expert == e)
            devices = slot_device[slots]
            if np.unique(devices).size < devices.size:
                continue                                      # equal shares, see above
            new = _water_fill(rows_D[devices] - share[slots], float(rows_E[e]))
            rows_D[devices] += new - share[slots]
            share[slots] = new
    return share


def rank_capacities(load_RE: np.ndarray, rel_err_KRE: Optional[np.ndarray], drop_target: float,
                    max_load: Optional[float] = None) -> np.ndarray:
    """Rows each source rank should own of each expert, float64 [R, E]: the capacity model
    (:func:`ms_efficient.efficientmoe.capacity.slot_capacities`, multiple 1) over the R x E per-rank
    loads and their relative forecast errors ``rel_err_KRE`` [K, R, E] (static dispatch drops a
    rank's overflow, so each rank's part is sized for its own spread); the load itself when
    ``rel_err_KRE`` is None. ``max_load``: most tokens one rank routes to one expert."""
    load = np.asarray(load_RE, dtype=np.float64)
    if rel_err_KRE is None:
        return load.copy()
    rel = np.asarray(rel_err_KRE, dtype=np.float64)
    if rel.ndim != 3 or rel.shape[1:] != load.shape:
        raise ValueError(f"'rel_err_KRE' must be [K, {load.shape[0]}, {load.shape[1]}], but got "
                         f"shape {rel.shape}.")
    res = slot_capacities(load.ravel(), np.arange(load.size), rel.reshape(rel.shape[0], -1),
                          drop_target, 1, max_load=max_load)
    return res.capacity_S.reshape(load.shape).astype(np.float64)


def _best_level(candidate, max_extra: int, levels: int):
    """The best of ``candidate(extra)`` (a tuple whose first entry is its cost) over extra
    replicas in [0, max_extra]: a coarse grid of ``levels`` points from no replica to the full
    slot budget, then halving steps around the best level (ties: fewer replicas)."""
    grid = np.unique(np.round(np.linspace(0, max_extra, max(2, levels))).astype(int))
    scored = {int(x): candidate(int(x)) for x in grid}
    step = int(grid[1] - grid[0]) if grid.size > 1 else 1
    while step > 1:
        step //= 2
        centre = min(scored, key=lambda x: (scored[x][0], x))
        for x in (centre - step, centre + step):
            if 0 <= x <= max_extra and x not in scored:
                scored[x] = candidate(x)
    return scored[min(scored, key=lambda x: (scored[x][0], x))]


def device_bound(slot_expert: np.ndarray, slot_device: np.ndarray, num_devices: int,
                  tokens_per_step: Optional[int], top_k: Optional[int]) -> Optional[np.ndarray]:
    """float64 [D]: the most rows a device can receive in a step, min(tokens x top_k, tokens x
    its distinct experts) (an expert appears at most once in a token's top-k); None when the
    tokens per step are unknown."""
    if not tokens_per_step:
        return None
    experts_D = np.zeros(num_devices)
    for d in np.unique(slot_device):
        experts_D[d] = np.unique(slot_expert[slot_device == d]).size
    return tokens_per_step * np.minimum(experts_D, top_k or experts_D.max())


def grouped_plan(slot_expert: np.ndarray, slot_device: np.ndarray, load_RE: np.ndarray,
                 model: CostModel, rank_device: np.ndarray, tokens_per_step: Optional[int],
                 top_k: Optional[int], rel_err_KRE: Optional[np.ndarray] = None,
                 drop_target: float = 0.0,
                 config: Optional[PlacementConfig] = None) -> ExpertPlan:
    """A ``"grouped"`` plan for a given placement (int [S] experts and devices of the slots)
    and forecast ``load_RE`` (float [R, E]): every slot's capacity its levelled share of
    the forecast (it sets how each rank splits an expert over its replicas), every
    (source rank, device) block sized by the capacity model over the pair's forecast rows
    and errors (:func:`~ms_efficient.efficientmoe.capacity.send_blocks`; ``rel_err_KRE``
    None: the forecast rounded up), capped at the pair bound (a rank's tokens x min(top-k,
    the device's experts)), and every device's buffer the sum of its blocks, so only a
    block's overflow drops. The one block rule of ours and of the grouped baselines.
    ``config`` given: the per-pair target is chosen by cost within its
    ``max_block_drop_rate`` (:func:`choose_blocks`; ``drop_target`` is then unused) and the
    plan takes its ``dispatch``."""
    cluster = model.cluster
    load = np.asarray(load_RE, dtype=np.float64)
    rd = np.asarray(rank_device, dtype=np.int64)
    rows = levelled_shares(slot_expert, slot_device, load.sum(axis=0), cluster.num_devices)
    caps = np.maximum(np.ceil(rows - 1e-9), 1).astype(np.int64)
    plan = ExpertPlan(slot_expert, slot_device, caps, dispatch="grouped", rank_share=load,
                      top_k=top_k, tokens_per_step=tokens_per_step)
    bound = pair_bound(slot_expert, slot_device, cluster.num_devices, rd.size,
                       tokens_per_step, top_k)
    if config is not None:
        plan = dataclasses.replace(plan, dispatch=config.dispatch)
        return choose_blocks(plan, load, rel_err_KRE, model, rd, bound, config).plan
    return with_blocks(plan, send_blocks(plan, load, rel_err_KRE, rd,
                                         cluster.devices_per_node, drop_target, bound))


@dataclass(frozen=True)
class BlockChoice:
    """The outcome of :func:`choose_blocks`: plan (with the chosen blocks, ``drop_target`` and
    ``expected_drop_rate`` set); targets: the per-pair targets tried; scores_s: float64 [N]
    the score of each (simulated layer seconds + forced re-plan risk x penalty); rates:
    float64 [N] the expected drop rate of each."""

    plan: ExpertPlan
    targets: Tuple[float, ...]
    scores_s: np.ndarray
    rates: np.ndarray


def choose_blocks(plan: ExpertPlan, load_RE: np.ndarray, rel_err_KRE: Optional[np.ndarray],
                  model: CostModel, rank_device: np.ndarray,
                  bound_RD: Optional[np.ndarray], config: PlacementConfig) -> BlockChoice:
    """The send blocks of a "grouped"/"counts" ``plan`` at the per-pair drop target that costs
    least, among ``DROP_TARGET_FRACTIONS`` x ``config.max_block_drop_rate``.

    For each target t: blocks from the capacity model
    (:func:`~ms_efficient.efficientmoe.capacity.send_blocks`, capped at ``bound_RD``), and
        score(t) = layer_cost(plan_t, load_RE).time_s                    (padding communication:
                   a "grouped" block travels full; "counts" sends the load whatever t)
                 + min(1, p_t / forced_replan_rate) x replan_penalty_s   (forced re-plans)
    with p_t the blocks' expected drop rate on the forecast
    (:func:`~ms_efficient.efficientmoe.capacity.expected_pair_drop_rate`). Targets whose p_t
    exceeds ``max_block_drop_rate`` are not kept (the user's constraint; when none meets it,
    the lowest target, with a warning); the least score wins, ties to the lower target (fewer
    drops). Deterministic. ``rel_err_KRE`` None (an exact forecast): every target gives the
    rounded-up forecast and p_t = 0, so the lowest target is reported.
    """
    cluster = model.cluster
    rd = np.asarray(rank_device, dtype=np.int64)
    targets = tuple(float(f) * config.max_block_drop_rate for f in DROP_TARGET_FRACTIONS)
    plans, scores, rates = [], [], []
    for target in targets:
        cand = with_blocks(plan, send_blocks(plan, load_RE, rel_err_KRE, rd,
                                             cluster.devices_per_node, target, bound_RD))
        rate = (0.0 if rel_err_KRE is None else
                min(1.0, expected_pair_drop_rate(cand, load_RE, rel_err_KRE, rd,
                                                 cluster.devices_per_node, bound_RD)))
        risk = (min(1.0, rate / config.forced_replan_rate) if config.forced_replan_rate
                else 0.0)
        plans.append(dataclasses.replace(cand, drop_target=target, expected_drop_rate=rate))
        scores.append(layer_cost(cand, load_RE, model, rd).time_s
                      + risk * config.replan_penalty_s)
        rates.append(rate)
    scores_s, rates = np.asarray(scores), np.asarray(rates)
    allowed = np.flatnonzero(rates <= config.max_block_drop_rate + 1e-12)
    if allowed.size == 0:
        logger.warning("choose_blocks: no per-pair target meets max_block_drop_rate %.3g "
                       "(expected %.3g at the lowest, %.3g)", config.max_block_drop_rate,
                       rates[0], targets[0])
        pick = 0
    else:
        pick = int(allowed[np.argmin(scores_s[allowed])])    # first minimum: the lower target
    return BlockChoice(plans[pick], targets, scores_s, rates)


def pair_bound(slot_expert: np.ndarray, slot_device: np.ndarray, num_devices: int,
               num_ranks: int, tokens_per_step: Optional[int],
               top_k: Optional[int]) -> Optional[np.ndarray]:
    """float64 [R, D]: the most rows a rank can send a device in a step, its share of
    :func:`device_bound` (ranks hold equal token counts); None when the tokens are unknown."""
    bound = device_bound(slot_expert, slot_device, num_devices, tokens_per_step, top_k)
    return None if bound is None else np.tile(bound / num_ranks, (num_ranks, 1))


def with_blocks(plan: ExpertPlan, blocks_RD: np.ndarray) -> ExpertPlan:
    """``plan`` with send blocks ``blocks_RD`` (int [R, D]) and buffers their column sums."""
    blocks_RD = np.asarray(blocks_RD, dtype=np.int64)
    return dataclasses.replace(plan, send_block=blocks_RD, device_buffer=blocks_RD.sum(axis=0))


def _plan_grouped(load: np.ndarray, model: CostModel, config: PlacementConfig, rd: np.ndarray,
                  rel_err_KRE: Optional[np.ndarray], sizes: dict, dropless: bool,
                  seen_max_RE: Optional[np.ndarray]) -> ExpertPlan:
    """:func:`plan_layer` for ``"grouped"`` dispatch. The grouped matmul computes the rows a
    device receives, not its buffer, so placement balances the forecast loads themselves
    (no capacity headroom in the search), and a slot's capacity is its levelled share of the
    forecast (it sets how each rank splits an expert over its replicas). The headroom goes
    into the send blocks: every (source rank, device) pair gets a block C[r, d] sized by the
    capacity model over the pair's forecast rows and errors
    (:func:`~ms_efficient.efficientmoe.capacity.send_blocks`), and every device's buffer is
    what it receives, B_d = sum_r C[r, d], so only a block's overflow drops. The search
    scores candidates with blocks at the forecast itself (no headroom yet). Dropless layers
    (the forecast is not to be trusted): uniform placement, no replicas, and every block
    sized for the largest per-rank counts seen (each rank at its largest at once; the pair
    bound, a rank's tokens x min(top-k, the device's experts), without ``seen_max_RE``):
    at the bound, the layout that cannot drop."""
    cluster = model.cluster
    num_experts = load.shape[1]
    num_hosts = rd.size
    dpn = cluster.devices_per_node
    load_E = load.sum(axis=0)
    tokens, top_k = sizes["tokens_per_step"], sizes["top_k"]

    def build(replicas: Optional[np.ndarray], slot_expert=None, slot_device=None):
        if replicas is not None:
            slot_expert, slot_device = place_replicas(load, replicas, model,
                                                      config.slots_per_device, rd)
        plan = grouped_plan(slot_expert, slot_device, load, model, rd, tokens, top_k)
        return plan, pair_bound(slot_expert, slot_device, cluster.num_devices, num_hosts,
                                tokens, top_k)

    if dropless:
        # the forecast is not to be trusted: the static layout of expert parallelism
        slot_expert, slot_device = uniform_placement(num_experts, np.sort(rd))
        plan, bound = build(None, slot_expert=slot_expert, slot_device=slot_device)
        if seen_max_RE is not None:
            seen = np.asarray(seen_max_RE, dtype=np.float64)
            if seen.shape != load.shape:
                raise ValueError(f"'seen_max_RE' must have the load's shape {load.shape}, "
                                 f"but got {seen.shape}.")
            plan = with_blocks(plan, send_blocks(plan, seen, None, rd, dpn, 0.0, bound))
        else:
            most_RD = (bound if bound is not None else   # every assignment of the rank
                       np.tile(load.sum(axis=1, keepdims=True), (1, cluster.num_devices)))
            hosts = np.zeros(cluster.num_devices, dtype=bool)
            hosts[slot_device] = True                     # no block to a device without slots
            plan = with_blocks(plan, np.where(hosts, np.maximum(np.ceil(most_RD - 1e-9), 1),
                                              0).astype(np.int64))
        return dataclasses.replace(plan, dispatch=config.dispatch, **sizes)

    def candidate(extra: int):
        replicas = np.minimum(replica_counts_greedy(load_E, num_experts + extra), num_hosts)
        plan, bound = build(replicas)
        return layer_cost(plan, load, model, rd).time_s, plan, bound, None

    max_extra = min(config.slots_per_device * num_hosts, num_experts * num_hosts) - num_experts
    best_cost, plan, bound, _ = _best_level(candidate, max_extra, config.levels)
    chosen = choose_blocks(dataclasses.replace(plan, dispatch=config.dispatch), load,
                           rel_err_KRE, model, rd, bound, config).plan
    logger.debug("plan_layer (%s): %d slots, blocks %s at per-pair target %.3g, predicted "
                 "%.3g s", config.dispatch, plan.num_slots, chosen.send_block.tolist(),
                 chosen.drop_target, best_cost)
    return dataclasses.replace(chosen, **sizes)


def plan_layer(load_RE: np.ndarray, model: CostModel, config: PlacementConfig,
               rank_device: Optional[Sequence[int]] = None,
               rel_err_KRE: Optional[np.ndarray] = None, method: str = "efficientmoe",
               top_k: Optional[int] = None, tokens_per_step: Optional[int] = None,
               dropless: bool = False,
               seen_max_RE: Optional[np.ndarray] = None) -> ExpertPlan:
    """EfficientMoE plan of one layer from its predicted load, for static dispatch.

    load_RE: float [R, E] predicted tokens rank r sends to expert e per step.
    model: CostModel (cluster, H, F). config: slot budget, capacity rounding, drop target.
    rank_device: int [R] distinct device of each rank (default: rank r on device r); slots
        go on these devices only.
    rel_err_KRE: float [K, R, E] recent relative forecast errors of the per-rank loads, for the
        capacity model; None means the load is known exactly (the oracle): capacities fit it
        up to rounding.
    top_k: experts per token, when known.
    tokens_per_step: tokens all ranks route per step (before top-k); no expert can receive
        more, so no slot gets a larger capacity. Default: total load / top_k when top_k is
        given, else no cap.
    dropless: the load cannot be forecast (the caller's judgement, e.g. early training):
        place the experts without replicas, each sized as the best static dropless graph
        the history vouches for. With ``seen_max_RE`` (int [R, E], the largest count each
        rank sent each expert in the rows seen so far) every rank gets max_r seen_max[r, e]
        rows of expert e, as the offline dropless baseline sizes it from the whole trace,
        at most round_up(tokens_per_step); without it every slot gets round_up(
        tokens_per_step) rows, a graph that never drops whatever the routing. (The latter,
        once the only fallback, pads (E - 1) / E of its rows at top-1: on a skewed trace
        whose forecasts err everywhere it made every layer several times slower than the
        dropless baseline, issue 16.)
    Returns a ``"static"`` ExpertPlan: per-slot capacities, and ``rank_share`` = the rows each
    rank should own of each expert (the layer shares each expert's capacity in proportion);
    with ``config.dispatch == "grouped"`` a ``"grouped"`` plan with one buffer per device
    (:func:`_plan_grouped`).
    """
    load = np.asarray(load_RE, dtype=np.float64)
    if load.ndim != 2 or (load < 0).any():
        raise ValueError(f"'load_RE' must be a non-negative [rank, expert] array, but got "
                         f"shape {load.shape}.")
    cluster = model.cluster
    rd = check_rank_device(rank_device, load.shape[0], cluster)
    num_ranks, num_experts = load.shape
    num_hosts = rd.size
    total_slots = config.slots_per_device * num_hosts
    if total_slots < num_experts:
        raise ValueError(f"slots_per_device {config.slots_per_device} x {num_hosts} devices "
                         f"< {num_experts} experts; it must be >= "
                         f"{-(-num_experts // num_hosts)}.")
    load_E = load.sum(axis=0)
    if tokens_per_step is None and top_k:
        tokens_per_step = int(round(load_E.sum() / top_k))
    sizes = {"top_k": top_k, "tokens_per_step": tokens_per_step, "method": method}
    if config.dispatch in GROUPED_DISPATCH:
        return _plan_grouped(load, model, config, rd, rel_err_KRE, sizes, dropless,
                             seen_max_RE)
    sizes["dispatch"] = "static"
    multiple = config.capacity_multiple
    if dropless:
        if not tokens_per_step:
            raise ValueError("a dropless plan needs 'tokens_per_step' (or 'top_k').")
        slot_expert, slot_device = place_replicas(load, np.ones(num_experts, dtype=np.int64),
                                                  model, config.slots_per_device, rd)
        bound = max(int(round_up(tokens_per_step, multiple)), multiple)
        if seen_max_RE is None:
            caps = np.full(num_experts, bound)
        else:
            seen = np.asarray(seen_max_RE, dtype=np.int64)
            if seen.shape != load.shape:
                raise ValueError(f"'seen_max_RE' must have the load's shape {load.shape}, "
                                 f"but got {seen.shape}.")
            per_expert = num_ranks * np.maximum(seen.max(axis=0), 1)   # one slot per expert
            caps = np.minimum(np.maximum(round_up(per_expert[slot_expert], multiple),
                                         multiple), bound).astype(np.int64)
        return ExpertPlan(slot_expert, slot_device, caps, **sizes)
    # Step 0: the rows each rank should own of each expert, and each expert's headroom
    # (capacity / predicted load), so that placement balances the rows devices will compute
    per_rank_max = tokens_per_step / num_ranks if tokens_per_step else None
    share_RE = rank_capacities(load, rel_err_KRE, config.drop_target, per_rank_max)
    rows_E = share_RE.sum(axis=0)
    growth_E = np.where(load_E > 0, rows_E / np.maximum(load_E, 1e-9), 1.0)

    def candidate(extra: int) -> Tuple[float, np.ndarray, np.ndarray, np.ndarray]:
        replicas = np.minimum(replica_counts_greedy(rows_E, num_experts + extra), num_hosts)
        # Step 2: placement, on the rows each replica will compute
        slot_expert, slot_device = place_replicas(load, replicas, model,
                                                  config.slots_per_device, rd, growth_E)
        # Step 3: level the replicas' rows, score with the analytic cost
        rows = levelled_shares(slot_expert, slot_device, rows_E, cluster.num_devices)
        caps = np.ceil(rows - 1e-9).astype(np.int64)
        plan = ExpertPlan(slot_expert, slot_device, caps, dispatch="static",
                          rank_share=share_RE)
        return layer_cost(plan, load, model, rd).time_s, slot_expert, slot_device, rows

    # Step 1: replication levels (:func:`_best_level`)
    max_extra = min(total_slots, num_experts * num_hosts) - num_experts
    best_cost, slot_expert, slot_device, rows = _best_level(candidate, max_extra, config.levels)
    # Step 4: capacities: the levelled rows rounded up to the hardware multiple, at most the
    # dropless bound
    caps = np.maximum(round_up(rows, multiple), multiple)
    if tokens_per_step:
        caps = np.minimum(caps, max(int(round_up(tokens_per_step, multiple)), multiple))
    logger.debug("plan_layer: %d slots, %d replicated experts, predicted %.3g s",
                 slot_expert.size, int((np.bincount(slot_expert) > 1).sum()), best_cost)
    return ExpertPlan(slot_expert, slot_device, caps, rank_share=share_RE, **sizes)
