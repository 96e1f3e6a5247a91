"""The dispatch rule: how each source rank's tokens are split over an expert's replicas.

Both the planners (cost model, replay) and the expert-parallel layer follow it, so what is
simulated is what runs. Notation as in :mod:`ms_efficient.moe.plan` (R source ranks, E experts,
S slots).

- :func:`split_tokens`: per-rank routing counts ``counts_RE`` -> per-slot assignments
  ``assigned_RS`` and the drop count, for the dispatch mode of the plan (``"alltoallv"``,
  ``"static"``, ``"grouped"`` or ``"counts"``; the two-level layer's rule is
  :mod:`ms_efficient.moe.balance`);
- :func:`source_rows`: the rows of every slot each rank owns under ``"static"`` dispatch
  (fixed before compilation), and :func:`static_assignments`, a step's tokens in those rows;
- :func:`grouped_split_weights` and :func:`grouped_assignments`: the same for ``"grouped"``
  dispatch (a fixed split over replicas, one row buffer per device);
- :func:`largest_remainder`, :func:`proportional_split`: the integer splits they use;
- :func:`switch_capacity`: the Switch / GShard capacity of one expert, the package's one
  formula (one-process layers, the Switch baseline, the memory estimate, the shard workloads).
No MindSpore import here.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import numpy as np

from ms_efficient.moe.plan import ExpertPlan

__all__ = ["switch_capacity", "split_tokens", "source_rows", "static_assignments",
           "largest_remainder", "proportional_split", "first_n", "SPLIT_UNITS",
           "grouped_split_weights", "grouped_split", "grouped_assignments"]

# ``"grouped"`` dispatch splits a rank's tokens of an expert over its replicas in integer
# units of 1 / SPLIT_UNITS, so the layer (int32 arithmetic in the graph) and the planners
# (numpy) cut at the same positions: count * SPLIT_UNITS stays below 2^31 for any count up
# to 524,287 assignments of one rank.
SPLIT_UNITS = 4096



def switch_capacity(tokens: int, num_experts: int, top_k: int, capacity_factor: float,
                    multiple: int = 1) -> int:
    """Switch / GShard capacity of every expert, rows: ceil(cf * tokens * top_k / E), at least
    1 and at most ``tokens`` (an expert appears at most once in a token's top-k), rounded up
    to ``multiple``; ``capacity_factor == 0`` means dropless (``tokens`` rows). The one
    formula every capacity of the package uses (the MoE layer, the Switch baseline, the
    memory estimate); a 1e-9 tolerance keeps float products such as 1.1 * 100 from rounding
    up past an exact integer."""
    if capacity_factor < 0 or not np.isfinite(capacity_factor):
        raise ValueError(f"'capacity_factor' must be >= 0 (0: dropless), but got "
                         f"{capacity_factor!r}.")
    if capacity_factor == 0:
        cap = tokens
    else:
        cap = int(np.ceil(capacity_factor * tokens * top_k / num_experts - 1e-9))
    cap = max(1, min(cap, tokens))
    return int(-(-cap // multiple) * multiple)

def first_n(key_GN: np.ndarray, n_G: np.ndarray) -> np.ndarray:
    """bool [G, N]: True at the ``n_G[g]`` entries of row g with the smallest keys, ties to the
    lower index (a stable sort): how every largest-remainder rule here hands out its
    leftover units, one each (keys: the negated remainders)."""
    key = np.asarray(key_GN)
    order = np.argsort(key, axis=1, kind="stable")
    out = np.zeros(key.shape, dtype=bool)
    out[np.arange(key.shape[0])[:, None], order] = \
        np.arange(key.shape[1])[None, :] < np.asarray(n_G)[:, None]
    return out


def proportional_split(total, room: np.ndarray) -> np.ndarray:
    """Split ``total`` integer tokens over bins in proportion to ``room`` (int [n]), never
    exceeding a bin's room: floors first, then the leftover one by one to the largest
    fractional parts (ties: lower index; the parts are exact integer remainders).
    Requires 0 <= ``total`` <= ``room.sum()``.

    Batched: ``total`` int [G] and ``room`` int [G, n] split every group at once (int64
    [G, n]); a scalar total and room [n] give int64 [n]."""
    room = np.asarray(room, dtype=np.int64)
    single = room.ndim == 1
    room2 = room[None] if single else room
    total2 = np.asarray(total, dtype=np.int64).reshape(-1)
    if total2.size != room2.shape[0]:
        raise ValueError(f"proportional_split: {total2.size} totals for {room2.shape[0]} "
                         f"groups of bins; give one total per row of 'room'.")
    cap = room2.sum(axis=1)
    if (total2 < 0).any() or (total2 > cap).any():
        raise ValueError(f"proportional_split: every total must be in [0, the room's sum], but "
                         f"got totals {total2[(total2 < 0) | (total2 > cap)][:4].tolist()} "
                         f"for rooms of {cap[(total2 < 0) | (total2 > cap)][:4].tolist()}.")
    # exact integer shares: room * total / cap = out + remainder / cap (no float ties)
    scaled = room2 * total2[:, None]
    out = scaled // np.maximum(cap, 1)[:, None]
    remainder = scaled - out * cap[:, None]
    left = total2 - out.sum(axis=1)
    has_room = out < room2                                   # largest remainder first
    out = out + (first_n(np.where(has_room, -remainder, 1), left) & has_room)
    return out[0] if single else out


def _fill_rank_order(assigned_RS: np.ndarray, ranks: np.ndarray, demand_R: np.ndarray,
                     slots: np.ndarray, intake_S: np.ndarray) -> None:
    """Attribute each slot's intake to ranks, ranks and slots in ascending order (the
    north-west corner rule); updates ``assigned_RS`` and ``demand_R`` in place."""
    left = intake_S.copy()
    si = 0
    for r in ranks:
        while demand_R[r] > 0 and si < slots.size:
            take = min(int(demand_R[r]), int(left[si]))
            assigned_RS[r, slots[si]] += take
            demand_R[r] -= take
            left[si] -= take
            if left[si] == 0:
                si += 1


def largest_remainder(total: int, weights: np.ndarray) -> np.ndarray:
    """Split ``total`` integers in proportion to ``weights`` (>= 0, float [n]); equal split when
    every weight is 0. Leftovers go to the largest fractional parts, ties to the lower index."""
    w = np.asarray(weights, dtype=np.float64)
    if w.sum() <= 0:
        w = np.ones_like(w)
    exact = total * w / w.sum()
    out = np.floor(exact).astype(np.int64)
    left = total - int(out.sum())
    return out + first_n((out - exact)[None], np.array([left]))[0]


def source_rows(plan: ExpertPlan, num_experts: int, rank_device: Union[int, Sequence[int]],
                devices_per_node: Optional[int] = None,
                rank_load_RE: Optional[np.ndarray] = None) -> np.ndarray:
    """Rows of every slot reserved for every source rank under ``"static"`` dispatch: int64
    [R, S]; every slot's rows sum to its capacity.

    rank_device: R (rank r on device r, as in the expert-parallel layer) or int [R], the
        device of each source rank.
    devices_per_node: devices per node for the same-node tier; None: no node tier.
    rank_load_RE: optional float [R, E] forecast of the tokens each rank routes to each expert
        (a plan's ``rank_share``); default: equal shares (the lower ranks take the remainder).

    Step 1: each expert's capacity (summed over its replicas) is shared among the R ranks in
    proportion to ``rank_load_RE``, largest remainder (ties to the lower rank).
    Step 2: every rank's share is attributed to the expert's replicas by the count-based rule
    of :func:`split_tokens` (own device, same node, then by remaining room); the shares add up
    to the capacities, so every row of every slot is reserved for exactly one rank.
    """
    if isinstance(rank_device, (int, np.integer)):
        plan.validate(num_experts, int(rank_device))
        rank_device = np.arange(int(rank_device))
    else:
        rank_device = np.asarray(rank_device, dtype=np.int64)
        plan.validate(num_experts, max(int(plan.slot_device.max()), int(rank_device.max())) + 1)
    num_ranks = rank_device.size
    total_E = np.bincount(plan.slot_expert, weights=plan.slot_capacity,
                          minlength=num_experts).astype(np.int64)
    if rank_load_RE is None:
        weights = np.ones((num_ranks, num_experts))
    else:
        weights = np.asarray(rank_load_RE, dtype=np.float64)
        if weights.shape != (num_ranks, num_experts):
            raise ValueError(f"'rank_load_RE' must have shape {(num_ranks, num_experts)}, but "
                             f"got {weights.shape}.")
        if not np.all(np.isfinite(weights)) or (weights < 0).any():
            raise ValueError("'rank_load_RE' must be finite and >= 0.")
    # Step 1: largest remainder, all experts at once (as largest_remainder column by column)
    w = np.where(weights.sum(axis=0) > 0, weights, 1.0)
    exact = total_E * w / w.sum(axis=0)
    share_RE = np.floor(exact).astype(np.int64)
    left = total_E - share_RE.sum(axis=0)
    share_RE += first_n((share_RE - exact).T, left).T                     # per column
    # Step 2: shares to replicas by the count-based rule
    rows_RS, dropped = _tiered_assignments(plan, share_RE, rank_device, devices_per_node)
    assert dropped == 0 and np.array_equal(rows_RS.sum(axis=0), plan.slot_capacity)
    return rows_RS


def static_assignments(plan: ExpertPlan, counts_RE: np.ndarray, rows_RS: np.ndarray,
                       rank_device: np.ndarray,
                       devices_per_node: Optional[int]) -> Tuple[np.ndarray, int]:
    """:func:`split_tokens` for ``"static"`` dispatch, given the rows each rank owns
    (``rows_RS``, :func:`source_rows`): rank r's tokens for e fill its rows in e's
    replicas in spill order (own device, same node, others; then slot id); the rest drop.
    Returns (assigned_RS int64 [R, S], dropped)."""
    counts_RE = np.asarray(counts_RE, dtype=np.int64)
    rank_device = np.asarray(rank_device, dtype=np.int64)
    replicas = plan.replica_counts(counts_RE.shape[1])
    single = replicas[plan.slot_expert] == 1
    assigned_RS = np.zeros_like(rows_RS)
    assigned_RS[:, single] = np.minimum(counts_RE[:, plan.slot_expert[single]],
                                        rows_RS[:, single])
    dpn = devices_per_node or (int(max(plan.slot_device.max(), rank_device.max())) + 1)
    for e in np.flatnonzero(replicas > 1):
        slots = plan.replicas_of(int(e))                                     # ascending
        dev = plan.slot_device[slots][None, :]
        tier = np.where(dev == rank_device[:, None], 0,
                        np.where(dev // dpn == rank_device[:, None] // dpn, 1, 2))   # [R, n]
        order = np.argsort(tier * slots.size + np.arange(slots.size), axis=1)  # spill order
        rows = np.take_along_axis(rows_RS[:, slots], order, axis=1)
        before = np.cumsum(rows, axis=1) - rows
        kept = np.clip(counts_RE[:, [e]] - before, 0, rows)
        block = np.zeros_like(kept)
        np.put_along_axis(block, order, kept, axis=1)
        assigned_RS[:, slots] = block
    return assigned_RS, int(counts_RE.sum() - assigned_RS.sum())


def grouped_split_weights(plan: ExpertPlan, num_experts: int, rank_device: Sequence[int],
                          devices_per_node: Optional[int] = None) -> np.ndarray:
    """How every rank splits its tokens of an expert over the expert's replicas under
    ``"grouped"`` dispatch: int64 [R, S], in units of 1 / SPLIT_UNITS, summing to SPLIT_UNITS
    over each expert's slots for every rank.

    The weights are the rows each rank would own of each replica under ``"static"`` dispatch
    (:func:`source_rows` with the plan's ``rank_share``: own device first, then same node,
    then by room), rounded by largest remainder; a rank that would own none of an expert
    splits it equally. An un-replicated expert's slot gets everything. Memoised on the plan's
    values (the planners ask for the same plan's weights many times); the result is
    read-only."""
    rank_device = np.asarray(rank_device, dtype=np.int64)
    share = None if plan.rank_share is None else np.asarray(plan.rank_share, np.float64)
    key = (plan.slot_expert.tobytes(), plan.slot_device.tobytes(),
           plan.slot_capacity.tobytes(), None if share is None else (share.shape,
                                                                      share.tobytes()),
           int(num_experts), rank_device.tobytes(), devices_per_node)
    cached = _SPLIT_CACHE.get(key)
    if cached is not None:
        return cached
    weights = _split_weights(plan, num_experts, rank_device, devices_per_node)
    weights.setflags(write=False)
    if len(_SPLIT_CACHE) >= _SPLIT_CACHE_SIZE:
        _SPLIT_CACHE.pop(next(iter(_SPLIT_CACHE)))                 # oldest first
    _SPLIT_CACHE[key] = weights
    return weights


_SPLIT_CACHE: dict = {}
_SPLIT_CACHE_SIZE = 512


def _split_weights(plan: ExpertPlan, num_experts: int, rank_device: np.ndarray,
                   devices_per_node: Optional[int]) -> np.ndarray:
    """:func:`grouped_split_weights` without the memo."""
    rows_RS = source_rows(plan, num_experts, rank_device, devices_per_node, plan.rank_share)
    weights = np.zeros(rows_RS.shape, dtype=np.int64)
    replicas = plan.replica_counts(num_experts)
    single = replicas[plan.slot_expert] == 1
    weights[:, single] = SPLIT_UNITS
    for e in np.flatnonzero(replicas > 1):
        slots = plan.replicas_of(int(e))
        for r in range(rank_device.size):
            weights[r, slots] = largest_remainder(SPLIT_UNITS, rows_RS[r, slots])
    return weights


def grouped_split(plan: ExpertPlan, counts_RE: np.ndarray, rank_device: Sequence[int],
                  devices_per_node: Optional[int] = None) -> np.ndarray:
    """Step 1 of :func:`grouped_assignments`, int64 [R, S]: rank r's c = counts_RE[r, e]
    tokens of expert e over e's replicas in ascending slot order, replica j taking the arrival
    positions [c * W_{j-1} // SPLIT_UNITS, c * W_j // SPLIT_UNITS) (W_j: cumulative
    :func:`grouped_split_weights`), before any block or buffer limit."""
    counts_RE = np.asarray(counts_RE, dtype=np.int64)
    rank_device = np.asarray(rank_device, dtype=np.int64)
    num_experts = counts_RE.shape[1]
    weights_RS = grouped_split_weights(plan, num_experts, rank_device, devices_per_node)
    assigned_RS = np.zeros(weights_RS.shape, dtype=np.int64)
    for e in range(num_experts):
        slots = plan.replicas_of(e)
        bounds = counts_RE[:, [e]] * np.cumsum(weights_RS[:, slots], axis=1) // SPLIT_UNITS
        assigned_RS[:, slots] = np.diff(bounds, axis=1, prepend=0)
    return assigned_RS


def grouped_assignments(plan: ExpertPlan, counts_RE: np.ndarray, rank_device: Sequence[int],
                        devices_per_node: Optional[int] = None) -> Tuple[np.ndarray, int]:
    """:func:`split_tokens` for ``"grouped"`` dispatch: (assigned_RS int64 [R, S], dropped).

    Step 1, the split: rank r's c = counts_RE[r, e] tokens of expert e go to e's replicas in
    ascending slot order, replica j taking the arrival positions
    [c * W_{j-1} // SPLIT_UNITS, c * W_j // SPLIT_UNITS), W_j the cumulative
    :func:`grouped_split_weights` of r over e's first j + 1 replicas.
    Step 2, the send blocks: rank r keeps its rows of device d's slots, slots ascending, up to
    its block ``plan.send_rows(R)[r, d]`` (C[r, d]); the rest drop at the sender.
    Step 3, the buffers: device d computes the rows it receives in ascending source rank
    (slots ascending within a rank) up to ``plan.device_rows()[d]`` (B_d); the rest drop.
    A planned plan has B_d = sum_r C[r, d], so step 3 drops nothing and only a pair's
    overflow drops."""
    counts_RE = np.asarray(counts_RE, dtype=np.int64)
    num_ranks = counts_RE.shape[0]
    # Step 1: the fixed split over replicas
    assigned_RS = grouped_split(plan, counts_RE, rank_device, devices_per_node)
    buffer_D = plan.device_rows()
    block_RD = plan.send_rows(num_ranks, buffer_D.size)
    for d in np.unique(plan.slot_device):
        slots = np.flatnonzero(plan.slot_device == d)
        # Step 2: every rank's block to d, slots ascending
        rows_RS = assigned_RS[:, slots]
        before_RS = np.cumsum(rows_RS, axis=1) - rows_RS
        rows_RS = np.clip(block_RD[:, [d]] - before_RS, 0, rows_RS)
        # Step 3: d's buffer, filled rank-major
        rows = rows_RS.ravel()                                    # rank-major, slot-minor
        before = np.cumsum(rows) - rows
        assigned_RS[:, slots] = np.clip(buffer_D[d] - before, 0, rows).reshape(-1, slots.size)
    return assigned_RS, int(counts_RE.sum() - assigned_RS.sum())


def split_tokens(plan: ExpertPlan, counts_RE: np.ndarray, rank_device: Sequence[int],
                 devices_per_node: Optional[int] = None) -> Tuple[np.ndarray, int]:
    """Assign every rank's tokens to the slots of their expert; count drops.

    plan: the layer's ExpertPlan (capacities are hard limits).
    counts_RE: int [R, E], tokens rank r routes to expert e this step (top-k counted k times).
    rank_device: int [R], device of each source rank.
    devices_per_node: devices per node (node of device d = d // devices_per_node); None: no
        node tier (every other device is equally far).

    Returns ``(assigned_RS, dropped)``: int64 [R, S] tokens of rank r computed by slot s, and
    the number of tokens no slot had room for.

    ``"static"`` plans: each rank fills the rows it owns (:func:`source_rows`) in spill
    order and drops the rest. ``"grouped"`` plans: :func:`grouped_assignments`.
    ``"alltoallv"`` plans, the rule per expert, in three tiers;
    each tier only uses room left by the previous one:
      1. own device: a rank's tokens go to the expert's replica(s) on its own device;
      2. same node: what is left goes to replicas on the rank's node;
      3. anywhere: what is left goes to any replica with room.
    Within tiers 2 and 3 the tokens that fit are split over the candidate replicas in
    proportion to their remaining room (largest remainder rounding), so every replica ends the
    tier with the same fraction of its room left: with capacities sized to predicted loads this
    balances the replicas. When a tier cannot take all tokens, lower-numbered ranks are served
    first (the receiver concatenates its buffers by source rank). Tokens beyond all replicas'
    capacity are dropped. An un-replicated expert is the special case with one slot: it serves
    its own device's ranks, then its node's, then the others', ascending rank in each group.
    """
    counts_RE = np.asarray(counts_RE)
    if counts_RE.ndim != 2:
        raise ValueError(f"'counts_RE' must be 2-D [rank, expert], but got shape "
                         f"{counts_RE.shape}.")
    if (counts_RE < 0).any():
        raise ValueError("'counts_RE' must be >= 0, but got a negative count.")
    counts_RE = counts_RE.astype(np.int64)
    num_ranks, num_experts = counts_RE.shape
    rank_device = np.asarray(rank_device, dtype=np.int64)
    if rank_device.shape != (num_ranks,):
        raise ValueError(f"'rank_device' must have {num_ranks} entries (one per rank), but "
                         f"got shape {rank_device.shape}.")
    plan.validate(num_experts, max(int(plan.slot_device.max()), int(rank_device.max())) + 1)
    if plan.dispatch == "static":
        rows_RS = source_rows(plan, num_experts, rank_device, devices_per_node, plan.rank_share)
        return static_assignments(plan, counts_RE, rows_RS, rank_device, devices_per_node)
    if plan.grouped:                      # "grouped" and "counts": the same drops
        return grouped_assignments(plan, counts_RE, rank_device, devices_per_node)
    return _tiered_assignments(plan, counts_RE, rank_device, devices_per_node)


def _tiered_assignments(plan: ExpertPlan, counts_RE: np.ndarray, rank_device: np.ndarray,
                        devices_per_node: Optional[int]) -> Tuple[np.ndarray, int]:
    """The ``"alltoallv"`` rule of :func:`split_tokens` (own device, same node, anywhere) for
    any plan's slots, on checked inputs: counts_RE int64 [R, E], rank_device int64 [R].
    Returns (assigned_RS int64 [R, S], dropped)."""
    num_ranks, num_experts = counts_RE.shape
    caps = plan.slot_capacity
    assigned_RS = np.zeros((num_ranks, plan.num_slots), dtype=np.int64)
    replicas = plan.replica_counts(num_experts)

    node_of_dev = np.arange(max(int(plan.slot_device.max()), int(rank_device.max())) + 1)
    node_of_dev = node_of_dev // (devices_per_node or node_of_dev.size)

    # Step 1: experts with one slot, all at once: serve ranks in tier order (own device, same
    # node, others; ascending rank inside a tier) up to the capacity.
    single = np.flatnonzero(replicas == 1)
    slot_of = np.zeros(num_experts, dtype=np.int64)
    slot_of[plan.slot_expert[::-1]] = np.arange(plan.num_slots)[::-1]   # first slot of e
    s1 = slot_of[single]
    dev1 = plan.slot_device[s1][None, :]
    tier = np.where(rank_device[:, None] == dev1, 0,
                    np.where(node_of_dev[rank_device][:, None] == node_of_dev[dev1], 1, 2))
    order = np.argsort(tier * num_ranks + np.arange(num_ranks)[:, None], axis=0, kind="stable")
    c = np.take_along_axis(counts_RE[:, single], order, axis=0)
    kept = np.clip(caps[s1][None, :] - (np.cumsum(c, axis=0) - c), 0, c)
    block = np.zeros_like(kept)
    np.put_along_axis(block, order, kept, axis=0)
    assigned_RS[:, s1] = block
    dropped = int(c.sum() - kept.sum())

    # Step 2: replicated experts, tier by tier.
    for e in np.flatnonzero(replicas > 1):
        slots = plan.replicas_of(int(e))
        room = caps[slots].copy()
        demand = counts_RE[:, e].copy()
        # Tier 1: own device
        for i, s in enumerate(slots):
            for r in np.flatnonzero(rank_device == plan.slot_device[s]):
                take = min(int(demand[r]), int(room[i]))
                assigned_RS[r, s] += take
                demand[r] -= take
                room[i] -= take
        # Tier 2: same node (groups of ranks and slots by node), then Tier 3: anywhere
        groups: List[Tuple[np.ndarray, np.ndarray]] = []
        if devices_per_node is not None:
            slot_node = node_of_dev[plan.slot_device[slots]]
            rank_node = node_of_dev[rank_device]
            groups = [(np.flatnonzero(rank_node == n), np.flatnonzero(slot_node == n))
                      for n in np.unique(slot_node)]
        groups.append((np.arange(num_ranks), np.arange(slots.size)))
        for ranks, local in groups:
            want = int(demand[ranks].sum())
            have = int(room[local].sum())
            if want == 0 or have == 0:
                continue
            intake = proportional_split(min(want, have), room[local])
            _fill_rank_order(assigned_RS, ranks, demand, slots[local], intake)
            room[local] -= intake
        dropped += int(demand.sum())
    return assigned_RS, dropped
