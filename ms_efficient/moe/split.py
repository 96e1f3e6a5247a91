"""The integer splits of the fast level and the Switch capacity, written once.

- :func:`proportional_split`: ``total`` tokens over bins in proportion to their room, floors
  first, then the leftover one each by largest remainder (exact integer remainders; the fast
  level's home split, :mod:`ms_efficient.moe.balance`, and its MindSpore-ops twin,
  :mod:`ms_efficient.moe.fast_level`);
- :func:`first_n`: the ``n`` smallest keys of each row, ties to the lower index (how every
  largest-remainder rule hands out its leftover units);
- :func:`switch_capacity`: the Switch / GShard capacity of one expert, the package's one
  formula (one-process layers, the Switch baseline, the memory estimate, the shard workloads).
No MindSpore import here.
"""
from __future__ import annotations

import numpy as np

__all__ = ["switch_capacity", "proportional_split", "first_n"]


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
