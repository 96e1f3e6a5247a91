"""EfficientMoE's fast level: balance every step's exact routing counts inside fixed buffers.

The slow level (:mod:`ms_efficient.efficientmoe.planner`) fixes, once per run, what a compiled
graph needs to know: each device's home slots (which logical expert each holds; a re-plan
may change this table, it is data), its number of spare slots, and its receive buffer. Every
step and MoE layer, from that step's all-gathered counts, this module decides where every
token is computed, vectorised over layers. One function for the layer and the simulator:
the balanced expert-parallel layer (:mod:`ms_efficient.moe.balanced_ep`) runs
:func:`balance_step` inside its compiled graph, on the all-gathered counts (as a host op,
or as its MindSpore-ops twin :class:`~ms_efficient.moe.fast_level.FastLevelOps`, which a
test holds equal to it), and the simulator (``ms_efficient.efficientmoe.two_level``)
replays it on a trace:

    Step 1 (home split): an expert held by one home slot computes all its tokens there;
        an expert held by several (a redundant home replica) starts from an even split and
        is water-filled over its holders, largest expert first, in rounds until a round
        moves nothing (at most ``SPLIT_ROUNDS``): its tokens go to the least-loaded holders
        until they reach one level (the largest device load as small as those copies allow,
        never above the even split's).
    Step 2 (copies): while the busiest device is above the mean load, the largest expert
        piece on it is copied into a free spare slot of the device that does not hold that
        expert with the least load plus copy cost, and the expert is water-filled again over
        its holders. A copy is kept when the rows it takes off the busiest device are worth
        more compute time than its weight transfer (``copy_cost_rows_WW``), or whatever it
        costs while the busiest device is above its buffer (no row is dropped while a spare
        slot can take it); otherwise that layer stops.
        A copy's weights travel from a home holder (one on the copy's node when there is
        one) that step, and in backward the copy's gradient travels back and is added to the
        home expert's.
    Step 3 (buffers): a device above its fixed receive buffer moves its excess to other
        holders of the same expert with room, least-loaded first; what still does not fit
        is dropped and counted.
    Step 4 (per-pair rows): a holder first keeps its own rank's tokens of the expert, then
        takes its node's, then the rest (:func:`pair_rows`), giving the rows every rank
        sends every device: the per-pair counts of the exchange (on Ascend an AlltoAllV
        whose counts are tensors and whose receive size is the fixed buffer). The node
        round serves every rank and every holder of the node in proportion to what it has
        left, so the tokens that must cross nodes leave from all the node's ranks and
        arrive at all the other node's holders alike, instead of from the last ranks and
        at the last holders in order (the All-to-All's time is its busiest device's
        inter-node link).

Shapes: L layers, R source ranks (= W devices of the expert-parallel group, rank r on device
r), E logical experts, S_h home slots per device. Rows are token-expert assignments (top-k
counted k times). No MindSpore import here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ms_efficient.moe.plan import ExpertPlan
from ms_efficient.moe.split import first_n, proportional_split

SPLIT_ROUNDS = 16     # home_split's rounds at most (it stops when a round changes nothing)
# Kernels the MindSpore-ops twin (:class:`~ms_efficient.moe.fast_level.FastLevelOps`) launches
# per layer-step: a fixed part, then per iteration of each of its loops (``Balance.trips_L4``:
# home-split water-fill, copy attempt, device over its buffer, expert piece visited), each
# loop's condition included. Counted by MindSpore's profiler on its compiled CPU graph
# (``python scripts/time_fast_level.py --count-ops``: every kernel's launches, grouped by
# which loop's iterations they equal; tests/test_fast_level.py holds the count to 2 %).
OPS_TWIN_LAUNCHES = (146, 65, 134, 46, 41)

__all__ = ["Balance", "BalancedSpec", "balance_step", "home_plan", "home_split", "water_fill",
           "holders_of", "pair_rows", "ops_twin_launches_L", "OPS_TWIN_LAUNCHES"]


@dataclass(frozen=True)
class BalancedSpec:
    """What a :class:`BalancedExpertParallelMoE` is built for (one MoE layer of a layout):
    home_WS int [W, S_h], spare_slots S_s, buffer_W int [W] rows, copy_cost_WW float [W, W]
    (rows of expert compute one copy costs; None: free), devices_per_node, sync_rows (rows
    of its replica-gradient table, the layout's; None: as many as S_h allows)."""

    home_WS: np.ndarray
    spare_slots: int
    buffer_W: np.ndarray
    copy_cost_WW: Optional[np.ndarray] = None
    devices_per_node: Optional[int] = None
    sync_rows: Optional[int] = None


@dataclass
class Balance:
    """Where one step's tokens are computed, per layer (rows are token-expert assignments).

    rows_LEW: int64 [L, E, W] rows of expert e computed on device w (kept rows only).
    holder_LEW: bool [L, E, W] devices holding expert e this step (home slots and copies).
    copies_LWW: int64 [L, W, W] expert copies whose weights go from device i (a home holder)
        to device j's spare slots this step; their gradients travel back j -> i in backward.
    copied_LE: int64 [L, E] copies of each expert made this step.
    source_LEW: int64 [L, E, W] for a copy of expert e in a spare slot of device w, the
        home holder its weights come from; -1 where w holds no copy of e.
    sent_LRW: int64 [L, R, W] rows source rank r sends device w (the exchange's per-pair
        counts); ``sent_LRW.sum(1) == rows_LEW.sum(1)``.
    dropped_L: int64 [L] rows dropped (over every holder's buffer).
    sent_LREW: int64 [L, R, E, W] the same rows per expert (what the layer's send rows
        follow), when asked for (``balance_step(..., by_expert=True)``), else None.
    trips_L4: int64 [L, 4] the iterations the per-layer twins' loops run for this step
        (:class:`~ms_efficient.moe.fast_level.FastLevelOps` reports the same): home-split
        water-fills (replicated experts x rounds), copy attempts, devices over their buffer,
        and expert pieces those visit; what the ops twin's launched-op count grows with
        (:func:`ops_twin_launches_L`).
    """

    rows_LEW: np.ndarray
    holder_LEW: np.ndarray
    copies_LWW: np.ndarray
    copied_LE: np.ndarray
    source_LEW: np.ndarray
    sent_LRW: np.ndarray
    dropped_L: np.ndarray
    sent_LREW: Optional[np.ndarray] = None
    trips_L4: Optional[np.ndarray] = None

    @property
    def load_LW(self) -> np.ndarray:
        """Rows every device computes, int64 [L, W]."""
        return self.rows_LEW.sum(axis=1)

    @property
    def copies_L(self) -> np.ndarray:
        """Copies made per layer, int64 [L]."""
        return self.copied_LE.sum(axis=1)


def ops_twin_launches_L(trips_L4: Optional[np.ndarray], num_layers: int) -> np.ndarray:
    """Kernels the ops twin launches per layer-step, int64 [L]: ``OPS_TWIN_LAUNCHES`` over
    the loop iterations ``trips_L4`` (``Balance.trips_L4``); None (a rule with no such
    loops): the fixed part alone."""
    fixed, per_trip = OPS_TWIN_LAUNCHES[0], np.asarray(OPS_TWIN_LAUNCHES[1:], dtype=np.int64)
    if trips_L4 is None:
        return np.full(num_layers, fixed, dtype=np.int64)
    return fixed + np.asarray(trips_L4, dtype=np.int64) @ per_trip


def home_plan(home_WS: np.ndarray, num_experts: int) -> ExpertPlan:
    """The home table as an :class:`ExpertPlan` (slots in device order; what migration and
    the replica-sync tables read)."""
    home = np.asarray(home_WS, dtype=np.int64)
    device, _ = np.nonzero(home >= 0)
    expert = home[home >= 0]
    if not np.isin(np.arange(num_experts), expert).all():
        missing = sorted(set(range(num_experts)) - set(expert.tolist()))
        raise ValueError(f"every expert needs a home slot, but experts {missing} have none.")
    return ExpertPlan(expert, device, np.zeros(expert.size, dtype=np.int64),
                      dispatch="grouped")


def holders_of(home_LWS: np.ndarray, num_experts: int) -> np.ndarray:
    """Home holders: bool [L, E, W], True where device w has a home slot of expert e.

    home_LWS: int64 [L, W, S_h] logical expert of every home slot, -1 for an empty one."""
    home = np.asarray(home_LWS, dtype=np.int64)
    num_layers, num_devices, _ = home.shape
    held = np.zeros((num_layers, num_experts + 1, num_devices), dtype=bool)
    layer = np.arange(num_layers)[:, None, None]
    device = np.arange(num_devices)[None, :, None]
    held[layer, np.where(home < 0, num_experts, home), device] = True
    return held[:, :num_experts]


def water_fill(load_LW: np.ndarray, mask_LW: np.ndarray, amount_L: np.ndarray) -> np.ndarray:
    """Integer rows added to every masked device so the largest one is as small as possible.

    Pours ``amount_L[l]`` rows over the devices of ``mask_LW[l]`` starting from ``load_LW``:
    the least-loaded first until all reach one level lambda (sum over the mask of
    max(0, lambda - load) = amount). Rows are whole: the fractional parts are rounded down
    and the remainder goes one row each to the devices with the largest fraction (ties: the
    lower device). A layer with no masked device must have amount 0.
    Returns int64 [L, W], zero off the mask, summing to ``amount_L``.
    """
    load = np.asarray(load_LW, dtype=np.float64)
    mask = np.asarray(mask_LW, dtype=bool)
    amount = np.asarray(amount_L, dtype=np.int64)
    num_layers, num_devices = load.shape
    if (amount[~mask.any(axis=1)] > 0).any():
        raise ValueError("water_fill: a layer has rows to place but no device to hold them.")
    ordered = np.sort(np.where(mask, load, np.inf), axis=1)               # holders first
    finite = np.isfinite(ordered)
    filled = np.arange(1, num_devices + 1, dtype=np.float64)[None, :]
    level_j = (amount[:, None] + np.cumsum(np.where(finite, ordered, 0.0), axis=1)) / filled
    # the level fills the j lowest holders when each of them is below it
    fills = finite & (ordered < level_j)
    fills[:, 0] |= finite[:, 0]
    j = np.maximum(fills.sum(axis=1), 1) - 1
    level = level_j[np.arange(num_layers), j]
    share = np.where(mask, np.maximum(level[:, None] - load, 0.0), 0.0)
    whole = np.where(mask, np.floor(share), 0).astype(np.int64)
    left = amount - whole.sum(axis=1)
    # hand out the remainder, one row each, largest fraction first (ties: the lower device)
    out = whole + (first_n(np.where(mask, whole - share, np.inf), left) & mask)
    assert (out.sum(axis=1) == amount).all() and (out >= 0).all(), "water_fill lost rows"
    return out


def _cut(counts_LRE: np.ndarray, rows_LEW: np.ndarray, by_expert: bool) -> np.ndarray:
    """Contiguous cut: each expert's tokens, in source-rank order, over its rows in device
    order; int64 [L, R, W], or [L, R, E, W] ``by_expert`` (:func:`pair_rows`).

    Per (layer, expert) group, the ranks' cumulative token counts and the holders'
    cumulative rows are two sorted lists of cut points; merged, every piece between two
    consecutive points belongs to one rank (the points of the ranks at or below its start)
    and one holder. All groups are merged at once, each shifted by its own offset, so the
    work is sorting L x E x (R + H) points (H: the most holders of an expert)."""
    num_layers, num_ranks, num_experts = counts_LRE.shape
    num_devices = rows_LEW.shape[2]
    shape = ((num_layers, num_ranks, num_experts, num_devices) if by_expert
             else (num_layers, num_ranks, num_devices))
    held = rows_LEW > 0
    width = int(held.sum(axis=2).max(initial=0))
    if width == 0:
        return np.zeros(shape, dtype=np.int64)
    groups = num_layers * num_experts
    # the holders of each expert, in device order, then their rows
    device_GH = np.argsort(~held, axis=2, kind="stable")[:, :, :width].reshape(groups, width)
    rows_GH = np.take_along_axis(rows_LEW, device_GH.reshape(num_layers, num_experts, width),
                                 axis=2).reshape(groups, width)
    end_GR = np.cumsum(np.swapaxes(counts_LRE, 1, 2).reshape(groups, num_ranks), axis=1)
    end_GH = np.cumsum(rows_GH, axis=1)
    span = int(max(end_GR[:, -1].max(), end_GH[:, -1].max())) + 1
    offset = np.arange(groups, dtype=np.int64)[:, None] * span
    rank_points = (end_GR + offset).ravel()                  # sorted: groups are apart
    holder_points = (end_GH + offset).ravel()
    # three sorted runs: a stable sort merges them in linear time, then repeats are dropped
    merged = np.sort(np.concatenate([rank_points, holder_points, offset.ravel()]),
                     kind="stable")
    points = merged[np.concatenate(([True], merged[1:] != merged[:-1]))]
    start, length = points[:-1], np.diff(points)
    group = start // span
    rank = np.searchsorted(rank_points, start, side="right") - group * num_ranks
    holder = np.searchsorted(holder_points, start, side="right") - group * width
    keep = (rank < num_ranks) & (holder < width) & (length > 0)
    start, length, group, rank, holder = (a[keep] for a in (start, length, group, rank,
                                                             holder))
    device = device_GH[group, holder]
    layer, expert = group // num_experts, group % num_experts
    index = ((layer * num_ranks + rank) * num_experts + expert) * num_devices + device \
        if by_expert else (layer * num_ranks + rank) * num_devices + device
    out = np.bincount(index, weights=length, minlength=int(np.prod(shape)))
    return out.astype(np.int64).reshape(shape)


def pair_rows(counts_LRE: np.ndarray, rows_LEW: np.ndarray,
              devices_per_node: Optional[int] = None,
              by_expert: bool = False) -> np.ndarray:
    """Rows every rank sends every device, int64 [L, R, W] (R = W, rank r on device r), or
    per expert [L, R, E, W] with ``by_expert`` (what the layer's send rows follow).

    Nearest first, in three rounds:
      1. a rank that holds expert e keeps min(its tokens of e, its rows of e) at home;
      2. within each node of ``devices_per_node`` devices (None: skipped), the node serves
         min(its ranks' remaining tokens of e, its holders' remaining rows of e), taken
         from every rank and given to every holder in proportion to what each has left
         (:func:`~ms_efficient.moe.split.proportional_split`), then paired by a contiguous cut;
      3. everything left over every holder, a contiguous cut: each expert's remaining
         tokens, in source-rank order, over its holders' remaining rows in device order
         (device w takes the tokens numbered [sum_{v<w} rest[e, v], sum_{v<=w} rest[e, v]),
         rank r routed those numbered [sum_{q<r} left[q, e], sum_{q<=r} left[q, e])).
    Round 2's proportions spread the rows that must cross nodes over all of a node's ranks
    and holders; a cut in order would leave them all to the node's last ranks and holders.
    Tokens past the kept rows (a drop) are sent nowhere."""
    counts = np.asarray(counts_LRE, dtype=np.int64)
    rows = np.asarray(rows_LEW, dtype=np.int64)
    num_layers, num_ranks, num_experts = counts.shape
    num_devices = rows.shape[2]
    diagonal = np.arange(num_ranks)
    # round 1: own device
    local_LRE = np.minimum(counts, np.swapaxes(rows, 1, 2)[:, :num_ranks])
    left = counts - local_LRE
    rest = rows.copy()
    rest[:, :, :num_ranks] -= np.swapaxes(local_LRE, 1, 2)
    if by_expert:
        out = np.zeros((num_layers, num_ranks, num_experts, num_devices), dtype=np.int64)
        out[:, diagonal, :, diagonal] = np.moveaxis(local_LRE, 1, 0)
    else:
        out = np.zeros((num_layers, num_ranks, num_devices), dtype=np.int64)
        out[:, diagonal, diagonal] = local_LRE.sum(axis=2)
    # round 2: own node, every node of every layer in one cut ([L * N, n, ...] blocks)
    dpn = devices_per_node
    if dpn and dpn < num_devices and num_ranks % dpn == 0 and num_devices == num_ranks:
        nodes = num_ranks // dpn
        c = left.reshape(num_layers, nodes, dpn, num_experts)            # [L, N, n, E]
        r = rest.reshape(num_layers, num_experts, nodes, dpn)            # [L, E, N, n]
        supply = np.minimum(c.sum(axis=2), np.moveaxis(r.sum(axis=3), 2, 1))  # [L, N, E]
        # `supply` tokens of each expert from the node's ranks, into the node's rows, each
        # rank and holder in proportion to what it has left
        c_take = np.moveaxis(proportional_split(
            supply.ravel(), np.moveaxis(c, 2, 3).reshape(-1, dpn)).reshape(
                num_layers, nodes, num_experts, dpn), 3, 2)                       # [L, N, n, E]
        r_take = proportional_split(np.moveaxis(supply, 1, 2).ravel(),
                                    r.reshape(-1, dpn)).reshape(r.shape)           # [L, E, N, n]
        blocks = _cut(c_take.reshape(num_layers * nodes, dpn, num_experts),
                      np.moveaxis(r_take, 2, 1).reshape(num_layers * nodes, num_experts, dpn),
                      by_expert)
        for n in range(nodes):
            node = slice(n * dpn, (n + 1) * dpn)
            block = blocks[n::nodes]
            if by_expert:
                out[:, node, :, node] += block
            else:
                out[:, node, node] += block
        left -= c_take.reshape(left.shape)
        rest -= r_take.reshape(rest.shape)
    # round 3: the rest
    return out + _cut(left, rest, by_expert)


def _even_split(counts_E: np.ndarray, held: np.ndarray) -> np.ndarray:
    """EPLB's split: each expert's rows spread evenly over its holders, the remainder one
    row each to the lower devices; int64 [L, E, W]."""
    holders = held.sum(axis=2, keepdims=True)
    base = counts_E[..., None] // np.maximum(holders, 1)
    index = np.cumsum(held, axis=2) - 1                                  # holder index
    return np.where(held, base + (index < (counts_E[..., None] - base * holders)), 0)


def home_split(counts_E: np.ndarray, held: np.ndarray, rounds: int = SPLIT_ROUNDS) -> np.ndarray:
    """Step 1: rows_LEW from the home holders (:func:`_home_split`)."""
    return _home_split(counts_E, held, rounds)[0]


def _home_split(counts_E: np.ndarray, held: np.ndarray, rounds: int = SPLIT_ROUNDS):
    """Step 1: rows_LEW from the home holders (module docstring). From the even split, each
    replicated expert, largest first, is water-filled again over its holders given the
    others' rows; rounds of that repeat, on the layers whose rows a round changed, at most
    ``rounds`` times. No pass raises the largest load (a re-fill minimises the largest load
    of its holders, the rest stay), so the result is never worse than EPLB's even split;
    each round moves it toward the least largest load the holders allow (coordinate
    descent: experts that share devices pass load along chains of holders, one link a
    round). Returns (rows int64 [L, E, W], rounds int64 [L]: the rounds each layer ran,
    the last one changing nothing unless ``rounds`` ran out)."""
    num_layers, num_experts, num_devices = held.shape
    rows = _even_split(counts_E, held)
    load = rows.sum(axis=1)
    shared = held.sum(axis=2) > 1
    # replicated experts, largest first, the k-th of every layer at once
    order = np.lexsort((np.broadcast_to(np.arange(num_experts), counts_E.shape),
                        -np.where(shared, counts_E, -1)), axis=1)
    layers = np.arange(num_layers)
    active = shared.any(axis=1)
    # the k-th replicated expert of every layer and its holders in device order ([L, H], H the
    # most holders of an expert; ``on`` marks real holders): the re-fills work on those
    # columns only, which changes nothing (water_fill orders ties by device, and the order
    # of the gathered columns is the devices')
    width = int(held.sum(axis=2).max(initial=0))
    picks = []
    for k in range(int(shared.sum(axis=1).max(initial=0))):
        e = order[:, k]
        held_e = held[layers, e]                                            # [L, W]
        device = np.argsort(~held_e, axis=1, kind="stable")[:, :width]     # [L, H]
        on = np.take_along_axis(held_e, device, axis=1) & shared[layers, e][:, None]
        picks.append((e, device, on))
    ran = np.zeros(num_layers, dtype=np.int64)
    for _ in range(rounds):
        if not active.any():
            break
        ran += active
        changed = np.zeros(num_layers, dtype=bool)
        for e, device, on in picks:
            live = on & active[:, None]                                      # [L, H]
            old = np.where(live, rows[layers[:, None], e[:, None], device], 0)
            base = np.take_along_axis(load, device, axis=1) - old
            add = water_fill(base, live, np.where(live.any(axis=1), counts_E[layers, e], 0))
            rows[layers[:, None], e[:, None], device] += add - old       # off ``live``: 0
            load[layers[:, None], device] += add - old                      # distinct columns
            changed |= (add != old).any(axis=1)
        active &= changed
    return rows, ran


def _copies(counts_E, rows, held, spare_W, copy_cost_rows_WW, max_copies, buffer_LW=None):
    """Step 2: per-step copies into spare slots (module docstring). Mutates rows and held;
    returns (copies_LWW, copied_LE, source_LEW)."""
    num_layers, num_experts, num_devices = rows.shape
    layers = np.arange(num_layers)
    free = np.broadcast_to(np.asarray(spare_W, dtype=np.int64), (num_layers, num_devices)).copy()
    home = held.copy()
    copies = np.zeros((num_layers, num_devices, num_devices), dtype=np.int64)
    copied = np.zeros((num_layers, num_experts), dtype=np.int64)
    source_of = np.full((num_layers, num_experts, num_devices), -1, dtype=np.int64)
    mean = counts_E.sum(axis=1) / num_devices
    active = np.ones(num_layers, dtype=bool)
    for _ in range(max_copies):
        load = rows.sum(axis=1)
        busiest = np.argmax(load, axis=1)
        top = load[layers, busiest]
        active &= top > mean + 1e-9
        if not active.any():
            break
        e = np.argmax(rows[layers, :, busiest], axis=1)                     # largest piece
        # weights come from the home holder cheapest to reach each device
        reach = np.where(home[layers, e][:, :, None], copy_cost_rows_WW[None], np.inf)
        source_to = np.argmin(reach, axis=1)                                 # [L, W]
        cost_to = np.take_along_axis(reach, source_to[:, None], axis=1)[:, 0]
        room = (free > 0) & ~held[layers, e]
        target = np.argmin(np.where(room, load + cost_to, np.inf), axis=1)
        can = active & room.any(axis=1)
        mask = held[layers, e].copy()
        mask[layers, target] |= can
        base = load - rows[layers, e]
        new = water_fill(base, mask, np.where(can, counts_E[layers, e], 0))
        relief = top - (base + new)[layers, busiest]         # rows off the busiest device
        source = source_to[layers, target]
        # worth its weights, or needed: the busiest device is above its buffer (a drop
        # costs more than any copy)
        over = (np.zeros_like(can) if buffer_LW is None
                else top > buffer_LW[layers, busiest])
        keep = can & (relief > 0) & ((relief > cost_to[layers, target]) | over)
        active &= keep
        if not keep.any():
            break
        k = layers[keep]
        rows[k, e[keep]] = new[keep]
        held[k, e[keep], target[keep]] = True
        free[k, target[keep]] -= 1
        copies[k, source[keep], target[keep]] += 1
        copied[k, e[keep]] += 1
        source_of[k, e[keep], target[keep]] = source[keep]
    return copies, copied, source_of


def _fit_buffers(rows: np.ndarray, held: np.ndarray, buffer_LW: np.ndarray):
    """Step 3: move each device's rows above its buffer to other holders of the same expert
    with room (least loaded first); drop the rest. Mutates rows; returns (dropped_L, over_L:
    the devices over their buffer, visited_L: the expert pieces of those looked at, largest
    first, until the excess was placed)."""
    num_layers = rows.shape[0]
    dropped = np.zeros(num_layers, dtype=np.int64)
    visited = np.zeros(num_layers, dtype=np.int64)
    load = rows.sum(axis=1)
    over = (load > buffer_LW).sum(axis=1)
    for layer, device in zip(*np.nonzero(load > buffer_LW)):
        excess = int(load[layer, device] - buffer_LW[layer, device])
        for e in np.argsort(-rows[layer, :, device], kind="stable"):
            visited[layer] += 1
            while excess > 0 and rows[layer, e, device] > 0:
                room = np.where(held[layer, e], buffer_LW[layer] - load[layer], 0)
                room[device] = 0
                if room.max() <= 0:
                    break
                to = int(np.argmin(np.where(room > 0, load[layer], np.inf)))
                moved = int(min(excess, rows[layer, e, device], room[to]))
                rows[layer, e, device] -= moved
                rows[layer, e, to] += moved
                load[layer, device] -= moved
                load[layer, to] += moved
                excess -= moved
            if excess == 0:
                break
        if excess > 0:                        # nobody has room: drop from the largest pieces
            for e in np.argsort(-rows[layer, :, device], kind="stable"):
                cut = int(min(excess, rows[layer, e, device]))
                rows[layer, e, device] -= cut
                excess -= cut
                dropped[layer] += cut
                if excess == 0:
                    break
            load[layer, device] = buffer_LW[layer, device]
    return dropped, over, visited


def balance_step(counts_LRE: np.ndarray, home_LWS: np.ndarray, spare_W: np.ndarray,
                 buffer_LW: Optional[np.ndarray] = None,
                 copy_cost_rows_WW: Optional[np.ndarray] = None,
                 even_split: bool = False,
                 devices_per_node: Optional[int] = None,
                 by_expert: bool = False) -> Balance:
    """The fast level for one step (module docstring), every layer at once.

    counts_LRE: int [L, R, E] rows each source rank routes to each expert (R = W).
    home_LWS: int [L, W, S_h] logical expert of every home slot (-1: empty); every expert
        must have at least one home slot in every layer.
    spare_W: int [W] spare slots per device (0: no copies).
    buffer_LW: int [L, W] receive buffer of every device, rows; None: unbounded (a
        dynamic-shape system).
    copy_cost_rows_WW: float [W, W] the weight transfer of one expert copy from device i to
        device j, in rows of expert compute (seconds / seconds per row); None: copies free.
    even_split: EPLB's split, tokens spread evenly over an expert's replicas (largest
        remainder to the lower devices) instead of water-filling; no copies then.
    devices_per_node: devices of one node, for the same-node round of the per-pair cut
        (:func:`pair_rows`); None: no node round.
    by_expert: also return the per-pair rows per expert (``Balance.sent_LREW``).
    """
    counts = np.asarray(counts_LRE, dtype=np.int64)
    num_layers, num_ranks, num_experts = counts.shape
    home = np.asarray(home_LWS, dtype=np.int64)
    if home.ndim != 3 or home.shape[:2] != (num_layers, num_ranks):
        raise ValueError(f"'home_LWS' must be [{num_layers}, {num_ranks}, S_h] (one device per "
                         f"rank), but got {home.shape}.")
    held = holders_of(home, num_experts)
    if not held.any(axis=2).all():
        layer, expert = np.argwhere(~held.any(axis=2))[0]
        raise ValueError(f"expert {expert} of layer {layer} has no home slot; every expert "
                         f"needs one.")
    counts_E = counts.sum(axis=1)                                            # [L, E]
    num_devices = num_ranks
    spare = np.asarray(spare_W, dtype=np.int64)
    if spare.shape != (num_devices,) or (spare < 0).any():
        raise ValueError(f"'spare_W' must be [{num_devices}] integers >= 0, but got "
                         f"{spare.tolist()}.")
    # Step 1: home split
    if even_split:
        rows, rounds = _even_split(counts_E, held), np.zeros(num_layers, dtype=np.int64)
    else:
        rows, rounds = _home_split(counts_E, held)
    home_fills = (held.sum(axis=2) > 1).sum(axis=1) * rounds       # before copies join ``held``
    # Step 2: copies into spare slots
    cost = (np.zeros((num_devices, num_devices)) if copy_cost_rows_WW is None
            else np.asarray(copy_cost_rows_WW, dtype=np.float64))
    if even_split or not spare.any():
        copies = np.zeros((num_layers, num_devices, num_devices), dtype=np.int64)
        copied = np.zeros((num_layers, num_experts), dtype=np.int64)
        source_of = np.full((num_layers, num_experts, num_devices), -1, dtype=np.int64)
    else:
        copies, copied, source_of = _copies(
            counts_E, rows, held, spare, cost, int(spare.sum()),
            None if buffer_LW is None else np.asarray(buffer_LW, dtype=np.int64))
    # Step 3: fixed buffers
    if buffer_LW is None:
        dropped = over = visited = np.zeros(num_layers, dtype=np.int64)
    else:
        buffers = np.asarray(buffer_LW, dtype=np.int64)
        if buffers.shape != (num_layers, num_devices):
            raise ValueError(f"'buffer_LW' must be [{num_layers}, {num_devices}] rows (or None), "
                             f"but got shape {np.shape(buffer_LW)}.")
        dropped, over, visited = _fit_buffers(rows, held, buffers)
    # Step 4: per-pair rows
    per_expert = (pair_rows(counts, rows, devices_per_node, by_expert=True)
                  if by_expert else None)
    sent = (per_expert.sum(axis=2) if by_expert
            else pair_rows(counts, rows, devices_per_node))
    # the per-layer twins' loops: a copy attempt that keeps nothing ends the copies
    attempts = (np.zeros(num_layers, dtype=np.int64) if even_split or not spare.any()
                or num_devices < 2 else np.minimum(copied.sum(axis=1) + 1, spare.sum()))
    trips = np.stack([home_fills, attempts, over, visited], axis=1)
    return Balance(rows_LEW=rows, holder_LEW=held, copies_LWW=copies, copied_LE=copied,
                   source_LEW=source_of, sent_LRW=sent, dropped_L=dropped,
                   sent_LREW=per_expert, trips_L4=trips)
