"""MoonEP's per-step rule, written from its public description (MoonshotAI/MoonEP README,
2026; no code read): the ``moonep`` baseline of ``bench moe``.

What the description fixes:
- Perfect balance: every rank receives exactly S x K rows (S tokens per rank, K top-k), however
  skewed the routing, into a fixed buffer of exactly S x K rows (static shapes).
- A small number of redundant experts, planned online from the current step's router outputs
  and prefetched before the expert compute; their gradients are reduced to the home ranks in
  backward.
- Experts keep static homes (no forecast, no re-placement): the uniform table of
  :func:`~ms_efficient.efficientmoe.layout.uniform_home`, ``E / W`` experts per rank.

What it does not say, and what this module therefore chooses: the planning kernel's algorithm
("near-optimal") is not described. :func:`moonep_balance` takes each rank's target
(the step's assignments / W, S x K on a trace whose ranks route alike; the largest remainder
one row each to the lower ranks otherwise), keeps every rank's home rows up to it, cuts each
over-full rank's surplus from its largest home pieces, and pours the pieces in order into
the under-full ranks, largest deficit first. A piece poured into a rank that does not hold
its expert is a copy (weights from the surplus rank, a home holder). Every rank then
computes exactly its target, nothing drops, and the copies number at most the surplus
pieces plus W - 1 per layer. The copies a rank receives are not capped (MoonEP sizes its
redundant slots for its balance); ``max_copies_per_device`` of the replay says how many
spare slots that took.

Costed like every two-level row (:mod:`~ms_efficient.efficientmoe.balanced_cost`): the
count-driven exchange with its dynamic-shape overhead, the copies and their gradients as
bytes sent, the fast level's time (the planning kernel) at the same charge as ours.
No MindSpore import.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ms_efficient.moe.balance import Balance, holders_of, home_split, pair_rows

__all__ = ["moonep_balance"]


def _targets(total: int, num_devices: int) -> np.ndarray:
    """Rows each device receives: total / W, the remainder one row each to the lower ones."""
    base, rest = divmod(int(total), num_devices)
    return base + (np.arange(num_devices) < rest).astype(np.int64)


def moonep_balance(counts_LRE: np.ndarray, home_LWS: np.ndarray,
                   devices_per_node: Optional[int] = None) -> Balance:
    """One step of MoonEP's rule (module docstring), every layer.

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
        target = _targets(counts_E[layer].sum(), num_devices)
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
