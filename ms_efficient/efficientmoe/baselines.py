"""Baseline expert-parallel systems, each written from its public description (no code read).

Each function gives, for one training step of every MoE layer, a
:class:`~ms_efficient.moe.balance.Balance` (where every routed row is computed and what
every rank sends every device), costed by
:func:`~ms_efficient.efficientmoe.balanced_cost.balanced_cost` like EfficientMoE's own rows:
the ``bench moe`` rows are one vectorised replay (:mod:`two_level`).

switch_balance   GShard (Lepikhin et al. 2020, sec. 2.2) and Switch Transformer (Fedus, Zoph &
                 Shazeer, JMLR 2022, sec. 2.1): experts spread evenly over the devices; every
                 source rank (a "group" in GShard) has the same static capacity
                 C = ceil(cf * tokens_per_rank * top_k / E) in every expert, fills it and drops
                 the rest; the dispatched [E, C, H] buffer is sent whole, empty rows included
                 (a static-shape exchange, no count exchange), and every expert computes R * C
                 rows. MindFormers' MoE has the same layout. Capacity factors 1.0, 1.25, 2.0.
fastermoe_balance  FasterMoE (He et al., "FasterMoE: Modeling and Optimizing Training of
                 Large-Scale Dynamic Pre-Trained Models", PPoPP 2022), dynamic shadowing: after
                 the gate has routed the step, a performance model decides which popular
                 experts to "shadow": their weights are broadcast to every device, each device
                 computes its own tokens for them locally, and their gradients are reduced
                 back to the owner. Experts are added most popular first while the modelled
                 time (here our cost model: the baseline's best case) falls; no cap on their
                 number (as in the paper). Dynamic shapes: a count exchange, then only the
                 routed tokens, no padding, no drops.
moonep_balance   MoonEP (MoonshotAI/MoonEP README, 2026; no code read), the ``moonep`` row of
                 ``bench moe``, a fast level for the two-level replay. The description fixes:
                 perfect balance (every rank receives exactly S x K rows, S tokens per rank,
                 K top-k, into a fixed buffer of S x K rows); a few redundant experts planned
                 online from the step's router outputs and prefetched before the expert
                 compute, their gradients reduced to the home ranks in backward; static homes
                 (the uniform table of :func:`~ms_efficient.efficientmoe.planner.uniform_home`,
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

from typing import Optional

import numpy as np

from ms_efficient.moe.balance import Balance, holders_of, home_split, pair_rows

__all__ = ["switch_balance", "fastermoe_balance", "shadow_rows", "moonep_balance"]


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


def switch_balance(counts_LRE: np.ndarray, home_LWS: np.ndarray, capacity: int) -> Balance:
    """One step of GShard / Switch expert parallelism (module docstring), every layer.

    counts_LRE: int [L, R, E] rows each source rank routes to each expert (R = W).
    home_LWS: int [L, W, S_h] one home slot per expert (plain expert parallelism).
    capacity: C, the static rows every rank may send every expert; the rest is dropped.
    Returns the rows as the static graph computes and sends them, padding included: every
    expert computes R x C rows on its device and every rank sends every device C rows per
    expert it holds (``rows_LEW`` and ``sent_LRW`` are the padded rows; ``dropped_L`` the
    overflow, so the kept rows are the routed less ``dropped_L``)."""
    counts = np.asarray(counts_LRE, dtype=np.int64)
    num_layers, num_ranks, num_experts = counts.shape
    held = holders_of(np.asarray(home_LWS, dtype=np.int64), num_experts)
    if (held.sum(axis=2) != 1).any():
        raise ValueError("switch_balance needs exactly one home slot per expert.")
    cap = int(capacity)
    if cap < 1:
        raise ValueError(f"'capacity' must be >= 1 rows, but got {capacity}.")
    dropped = np.maximum(counts - cap, 0).sum(axis=(1, 2))
    rows = held.astype(np.int64) * (num_ranks * cap)
    sent = np.broadcast_to((held.sum(axis=1) * cap)[:, None, :],
                           (num_layers, num_ranks, num_ranks)).copy()
    zeros_WW = np.zeros((num_layers, num_ranks, num_ranks), dtype=np.int64)
    return Balance(rows_LEW=rows, holder_LEW=held, copies_LWW=zeros_WW,
                   copied_LE=np.zeros((num_layers, num_experts), dtype=np.int64),
                   source_LEW=np.full(held.shape, -1, dtype=np.int64), sent_LRW=sent,
                   dropped_L=dropped)


def shadow_rows(counts_LRE: np.ndarray, held_LEW: np.ndarray, shadow_LE: np.ndarray,
                devices_per_node: Optional[int] = None) -> Balance:
    """FasterMoE's placement of one step: an expert in ``shadow_LE`` (bool [L, E]) is on every
    device, which computes its own rank's tokens of it; every other expert computes all its
    tokens at its one home holder (``held_LEW``). The shadows' weights are broadcast, not
    sent in the exchange, so ``copies_LWW`` is zero (the caller charges the broadcast)."""
    counts = np.asarray(counts_LRE, dtype=np.int64)
    num_layers, num_ranks, num_experts = counts.shape
    counts_E = counts.sum(axis=1)
    shadow = np.asarray(shadow_LE, dtype=bool)
    rows = np.where(shadow[..., None], np.swapaxes(counts, 1, 2),
                    held_LEW * counts_E[..., None]).astype(np.int64)
    holder = np.asarray(held_LEW, dtype=bool) | shadow[..., None]
    return Balance(rows_LEW=rows, holder_LEW=holder,
                   copies_LWW=np.zeros((num_layers, num_ranks, num_ranks), dtype=np.int64),
                   copied_LE=np.zeros((num_layers, num_experts), dtype=np.int64),
                   source_LEW=np.full(holder.shape, -1, dtype=np.int64),
                   sent_LRW=pair_rows(counts, rows, devices_per_node),
                   dropped_L=np.zeros(num_layers, dtype=np.int64))


def fastermoe_balance(counts_LRE: np.ndarray, home_LWS: np.ndarray, step_time_L,
                      broadcast_s: float, devices_per_node: Optional[int] = None):
    """FasterMoE's dynamic shadowing for one step (the module docstring's rule), every layer.

    Per layer, experts are shadowed most popular first (ties: lower id) while the modelled
    time falls: ``step_time_L(balance)`` (float [L], the layer's cost without the shadows'
    transfers) plus 2 x ``broadcast_s`` per shadow (its weights broadcast forward, its
    gradient reduced back to the owner in backward, charged alike). As many shadows as that
    takes (no slot limit, as in the paper). Returns (Balance, shadows per layer int [L])."""
    counts = np.asarray(counts_LRE, dtype=np.int64)
    num_layers, num_ranks, num_experts = counts.shape
    held = holders_of(np.asarray(home_LWS, dtype=np.int64), num_experts)
    counts_E = counts.sum(axis=1)
    order = np.lexsort((np.broadcast_to(np.arange(num_experts), counts_E.shape), -counts_E),
                       axis=1)
    popularity = np.empty_like(order)
    np.put_along_axis(popularity, order, np.arange(num_experts)[None, :], axis=1)

    def timed(k_L):
        bal = shadow_rows(counts, held, popularity < k_L[:, None], devices_per_node)
        return bal, np.asarray(step_time_L(bal), dtype=np.float64) + 2.0 * broadcast_s * k_L

    k_L = np.zeros(num_layers, dtype=np.int64)
    _, best_t = timed(k_L)
    active = np.ones(num_layers, dtype=bool)
    while active.any():
        trial = k_L + (active & (k_L < num_experts))
        if (trial == k_L).all():
            break
        _, t = timed(trial)
        better = active & (trial > k_L) & (t < best_t)
        k_L = np.where(better, trial, k_L)
        best_t = np.where(better, t, best_t)
        active = better
    best, _ = timed(k_L)
    return best, k_L
