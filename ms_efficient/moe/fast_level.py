"""The fast level inside the compiled graph: one layer-step of :func:`balance_step` as tables.

:func:`~ms_efficient.moe.balance.balance_step` (numpy) is the one definition of EfficientMoE's
fast level; the simulator replays it. The balanced expert-parallel layer needs it inside its
compiled step, from that step's all-gathered counts, and has two twins of it here:

- ``"host"``: :func:`fast_level_tables` runs ``balance_step`` itself as a host op in the graph
  (``ops.Custom`` of type "pyfunc"), CPU only.
- ``"aot"``: the same algorithm compiled (``kernels/cpu/fast_level.cc``, an ``ops.Custom``
  aot kernel built with g++ on first use), CPU only: one call, no Python, the tables of the
  numpy function entry for entry (the same test holds it).
- ``"ops"``: :class:`FastLevelOps` is the same algorithm written in MindSpore ops (static
  shapes, integer arithmetic, ``while`` loops with tensor conditions), so it compiles for any
  target whose kernels cover int64/float64 elementwise ops, reductions and cumsum. It is
  built to agree with the numpy function exactly (a test compares them on random counts with
  hot, cold and empty experts, tight buffers, copies and node rounds); where numpy uses
  floats (water-filling levels, the remainder order), this twin uses the exact integer forms
  of the same quantities:

    water-filling: the level over the j lowest holders is N / j with N = amount + the sum of
        their loads; a holder below it takes floor(N / j) - load, and every such holder has
        the same fractional part (N mod j) / j, so the N mod j remaining rows go one each to
        the lowest-numbered of them (numpy's "largest fraction, then lower device");
    orders (largest first, ties to the lower index) are positions counted pairwise, so no
        sort kernel is needed;
    copy targets compare load + copy cost in float64, as numpy does.

:class:`FastLevel` picks the twin: ``"auto"`` is the aot kernel on CPU (the host op when it
cannot be built, e.g. without g++) and the ops twin on any other target. Shapes: W devices (= ranks), E experts, S_h home slots, S_s spare slots.
"""
from __future__ import annotations

import logging
from typing import Dict, Optional

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

from ms_efficient.core import backend
from ms_efficient.core.config import FAST_LEVEL_IMPLS
from ms_efficient.moe.balance import SPLIT_ROUNDS, balance_step

__all__ = ["FastLevel", "FastLevelOps", "fast_level_tables", "profiled_launches",
           "FAST_LEVEL_IMPLS"]

logger = logging.getLogger(__name__)


def fast_level_tables(counts_WE: np.ndarray, home_WS: np.ndarray, spare: int,
                      buffer_W: np.ndarray, copy_cost_WW: Optional[np.ndarray] = None,
                      devices_per_node: Optional[int] = None):
    """The fast level's tables for one layer-step, int32 (what :class:`FastLevel` returns):

    sent_WEW [W, E, W]: rows rank s sends device w of expert e.
    slot_EW [E, W]: local slot of expert e on device w (home slot index, or S_h + spare
        index), -1 where w does not compute e.
    spare_WS [W, S_s]: expert of each spare slot (-1: empty), ascending expert per device.
    source_WS [W, S_s]: device whose home slot sends that copy's weights (-1: empty).
    home_slot_WE [W, E]: home slot of expert e on device w, -1 if none.
    stats [3 + W]: copies, dropped rows, kept rows, then the rows of every device.
    """
    counts = np.asarray(counts_WE, dtype=np.int64)[None]
    home = np.asarray(home_WS, dtype=np.int64)
    world, num_experts = counts.shape[1], counts.shape[2]
    slots_home = home.shape[1]
    bal = balance_step(counts, home[None], np.full(world, spare, dtype=np.int64),
                       np.asarray(buffer_W, dtype=np.int64)[None], copy_cost_WW,
                       devices_per_node=devices_per_node, by_expert=True)
    sent = bal.sent_LREW[0]
    home_slot = np.full((world, num_experts), -1, dtype=np.int64)
    for w in range(world):
        for s in range(slots_home):
            if home[w, s] >= 0 and home_slot[w, home[w, s]] < 0:
                home_slot[w, home[w, s]] = s
    slot = home_slot.T.copy()                                           # [E, W]
    spare_WS = np.full((world, spare), -1, dtype=np.int64)
    source_WS = spare_WS.copy()
    copies = bal.source_LEW[0]                                          # [E, W]
    for w in range(world):
        for j, e in enumerate(np.flatnonzero(copies[:, w] >= 0)):
            spare_WS[w, j], source_WS[w, j] = e, copies[e, w]
            slot[e, w] = slots_home + j
    stats = np.concatenate([[bal.copies_L[0], bal.dropped_L[0], bal.rows_LEW[0].sum()],
                            bal.load_LW[0]])
    i32 = lambda a: np.ascontiguousarray(a, dtype=np.int32)  # noqa: E731
    return (i32(sent), i32(slot), i32(spare_WS), i32(source_WS), i32(home_slot), i32(stats))


# ---- the twin's building blocks (MindSpore ops, int64; parsed into the graph) -------------

I64 = ms.int64


def _ahead(key_N, lower_NN, descending: bool):
    """bool [..., n, n]: entry [i, j] is True where j comes before i in the order of ``key``
    (descending or ascending), ties to the lower index (``lower_NN[i, j] = j < i``)."""
    a, b = key_N.expand_dims(-2), key_N.expand_dims(-1)        # a[.., i, j] = key_j
    first = a > b if descending else a < b
    return first | ((a == b) & lower_NN)


def _first(mask_N, index_N, n: int):
    """Lowest index where ``mask`` holds (n if none), along the last axis."""
    return ops.select(mask_N, index_N, ops.full_like(index_N, n)).min(axis=-1)


def _water_fill(load_W, mask_W, amount, lower_WW):
    """:func:`~ms_efficient.moe.balance.water_fill` of one row, in exact integers: int64 [W]
    added to the masked devices so the largest is as small as possible (module docstring)."""
    zero = ops.zeros_like(load_W)
    ahead = _ahead(load_W, lower_WW, False) & mask_W.expand_dims(0)
    pos = ahead.astype(I64).sum(axis=1)                        # place among the holders
    through = amount + ops.select(ahead, load_W.expand_dims(0).broadcast_to(ahead.shape),
                                  ops.zeros_like(ahead, dtype=I64)).sum(axis=1) + load_W
    fills = mask_W & ((load_W * (pos + 1) < through) | (pos == 0))
    n = fills.astype(I64).sum()
    total = ops.select(mask_W & (pos == n - 1), through, zero).sum()
    j = ops.maximum(n, 1)
    filled = mask_W & (load_W * j < total)
    whole = ops.select(filled, ops.floor_divide(total, j) - load_W, zero)
    left = amount - whole.sum()
    extra = filled & (ops.cumsum(filled.astype(I64), 0) <= left)
    return whole + extra.astype(I64)


def _proportional_split(total_G, room_GN, lower_NN):
    """:func:`~ms_efficient.moe.split.proportional_split`, batched: int64 [G, n]."""
    cap = room_GN.sum(axis=1, keepdims=True)
    scaled = room_GN * total_G.expand_dims(1)
    out = ops.floor_divide(scaled, ops.maximum(cap, 1))
    remainder = scaled - out * cap
    left = total_G.expand_dims(1) - out.sum(axis=1, keepdims=True)
    frac = ops.select(out < room_GN, remainder, ops.full_like(remainder, -1))
    rank = _ahead(frac, lower_NN, True).astype(I64).sum(axis=-1)
    return out + ((rank < left) & (out < room_GN)).astype(I64)


def _cut(counts_GRE, rows_GEW):
    """The contiguous cut (:func:`~ms_efficient.moe.balance.pair_rows`): each expert's tokens
    in source-rank order over its rows in device order, as interval overlaps; int64
    [G, R, E, W]."""
    a_end = ops.cumsum(counts_GRE, 1).expand_dims(-1)            # [G, R, E, 1]
    a_start = a_end - counts_GRE.expand_dims(-1)
    b_end = ops.cumsum(rows_GEW, 2).expand_dims(1)               # [G, 1, E, W]
    b_start = b_end - rows_GEW.expand_dims(1)
    overlap = ops.minimum(a_end, b_end) - ops.maximum(a_start, b_start)
    return ops.maximum(overlap, 0)


def _checked_layout(world: int, num_experts: int, spare: int, buffer_W, copy_cost_WW):
    """(buffer_W int64 [W], copy_cost_WW float64 [W, W], zeros for None), or ValueError
    naming what is wrong."""
    w = int(world)
    buffers = np.asarray(buffer_W, dtype=np.int64)
    cost = (np.zeros((w, w)) if copy_cost_WW is None
            else np.asarray(copy_cost_WW, dtype=np.float64))
    if w < 1 or num_experts < 1 or spare < 0:
        raise ValueError(f"the fast level needs world >= 1, num_experts >= 1 and spare >= 0, "
                         f"but got {w}, {num_experts} and {spare}.")
    if buffers.shape != (w,) or cost.shape != (w, w) or not np.isfinite(cost).all() \
            or (cost < 0).any():
        raise ValueError(f"'buffer_W' must be [{w}] rows and 'copy_cost_WW' [{w}, {w}] "
                         f"finite costs >= 0, but got shapes {buffers.shape} and "
                         f"{cost.shape}.")
    return buffers, cost


class FastLevelOps(nn.Cell):
    """The fast level of one layer-step in MindSpore ops (module docstring):
    ``construct(counts_WE int32 [W, E], home_WS int32 [W, S_h]) -> the tables of``
    :func:`fast_level_tables`, equal to them entry for entry.

    Args: world W, num_experts E, spare S_s, buffer_W int [W] rows, copy_cost_WW float [W, W]
    rows of expert compute per copy (None: free), devices_per_node (None: no node round),
    trips: also return int32 [4], the iterations its loops ran (``Balance.trips_L4``'s row:
    what its launched-op count grows with; the layer leaves it off)."""

    def __init__(self, world: int, num_experts: int, spare: int, buffer_W: np.ndarray,
                 copy_cost_WW: Optional[np.ndarray], devices_per_node: Optional[int],
                 trips: bool = False):
        super().__init__()
        self.trips = bool(trips)
        self.world, self.num_experts, self.spare = int(world), int(num_experts), int(spare)
        w, e = self.world, self.num_experts
        buffers, cost = _checked_layout(w, e, self.spare, buffer_W, copy_cost_WW)
        self.buffer_W = Tensor(buffers)
        self.cost_WW = Tensor(cost)
        self.inf_WW = Tensor(np.full((w, w), np.inf))
        self.inf_W = Tensor(np.full(w, np.inf))
        self.arange_W = Tensor(np.arange(w, dtype=np.int64))
        self.arange_E = Tensor(np.arange(e, dtype=np.int64))
        self.lower_WW = Tensor(np.tril(np.ones((w, w), dtype=bool), -1))
        self.lower_EE = Tensor(np.tril(np.ones((e, e), dtype=bool), -1))
        self.eye_W = Tensor(np.eye(w, dtype=np.int64))
        dpn = devices_per_node
        self.nodes = w // dpn if dpn and dpn < w and w % dpn == 0 else 0
        self.dpn = dpn if self.nodes else 0
        if self.nodes:
            self.lower_nn = Tensor(np.tril(np.ones((dpn, dpn), dtype=bool), -1))
            self.eye_N = Tensor(np.eye(self.nodes, dtype=np.int64))

    def construct(self, counts_WE, home_WS):
        w, e, spare = self.world, self.num_experts, self.spare
        counts = counts_WE.astype(I64)
        home = home_WS.astype(I64)
        slots_home = home.shape[1]
        match_WES = home.expand_dims(1) == self.arange_E.reshape(1, e, 1)
        held = match_WES.any(axis=2).transpose(1, 0)                           # [E, W]
        counts_E = counts.sum(axis=0)
        rows, fills = self._home_split(counts_E, held)
        rows, held_all, source_of, attempts = self._copies(counts_E, rows, held)
        rows, dropped, over, visited = self._fit_buffers(rows, held_all)
        sent = self._pair_rows(counts, rows)                                   # [R, E, W]
        # slot tables
        index_S = ops.arange(slots_home, dtype=I64).reshape(1, 1, -1)
        home_slot = _first(match_WES, index_S.broadcast_to(match_WES.shape), slots_home)
        home_slot = ops.select(home_slot == slots_home, ops.full_like(home_slot, -1), home_slot)
        is_copy = source_of >= 0                                               # [E, W]
        order = ops.cumsum(is_copy.astype(I64), 0) - 1
        slot = ops.select(is_copy, slots_home + order, home_slot.transpose(1, 0))
        if spare:
            pick = is_copy.expand_dims(-1) & (order.expand_dims(-1) == ops.arange(
                spare, dtype=I64).reshape(1, 1, -1))                           # [E, W, S_s]
            spare_WS = ops.select(pick, self.arange_E.reshape(e, 1, 1).broadcast_to(pick.shape)
                                  + 1, ops.zeros_like(pick, dtype=I64)).sum(axis=0) - 1
            source_WS = ops.select(pick, source_of.expand_dims(-1).broadcast_to(pick.shape) + 1,
                                   ops.zeros_like(pick, dtype=I64)).sum(axis=0) - 1
        else:
            spare_WS = ops.zeros((w, 0), I64)
            source_WS = ops.zeros((w, 0), I64)
        load = rows.sum(axis=0)
        copies = is_copy.astype(I64).sum()
        stats = ops.concat((ops.stack((copies, dropped, load.sum())), load))
        i32 = ms.int32
        tables = (sent.astype(i32), slot.astype(i32), spare_WS.astype(i32),
                  source_WS.astype(i32), home_slot.astype(i32), stats.astype(i32))
        if self.trips:
            return tables + (ops.stack((fills, attempts, over, visited)).astype(i32),)
        return tables

    def _home_split(self, counts_E, held):
        """Step 1: EPLB's even split, then water-filling of every replicated expert, largest
        first, in rounds until a round changes nothing (at most SPLIT_ROUNDS); returns (rows,
        the water-fills run: every round ends on a wrap, so rounds x replicated experts)."""
        held_i = held.astype(I64)
        holders = held_i.sum(axis=1)
        base = ops.floor_divide(counts_E, ops.maximum(holders, 1))
        index = ops.cumsum(held_i, 1) - 1
        extra = (index < (counts_E - base * holders).expand_dims(1)).astype(I64)
        rows = ops.select(held, base.expand_dims(1) + extra, ops.zeros_like(index))
        load = rows.sum(axis=0)
        shared = holders > 1
        pos = _ahead(ops.select(shared, counts_E, ops.full_like(counts_E, -1)),
                     self.lower_EE, True).astype(I64).sum(axis=1)
        n_shared = shared.astype(I64).sum()
        k = Tensor(0, I64)
        rnd = Tensor(0, I64)
        go = n_shared > 0
        changed = Tensor(False)
        while go and rnd < SPLIT_ROUNDS:
            this = pos == k
            old = ops.select(this.expand_dims(1), rows, ops.zeros_like(rows)).sum(axis=0)
            ex = (this.astype(I64) * counts_E).sum()
            mask = (this.expand_dims(1) & held).any(axis=0)
            rest = load - old
            add = _water_fill(rest, mask, ex, self.lower_WW)
            rows = ops.select(this.expand_dims(1), add.expand_dims(0).broadcast_to(rows.shape),
                              rows)
            load = rest + add
            changed = changed | (add != old).any()
            k = k + 1
            wrap = k == n_shared
            rnd = rnd + wrap.astype(I64)
            go = ops.select(wrap, changed, go)
            changed = changed & ~wrap
            k = ops.select(wrap, ops.zeros_like(k), k)
        return rows, rnd * n_shared

    def _copies(self, counts_E, rows, held):
        """Step 2: per-step copies into spare slots; returns (rows, holders with the copies,
        source_of [E, W]: the home holder sending each copy's weights, -1 elsewhere, the
        copy attempts made)."""
        w = self.world
        source_of = ops.full(held.shape, -1, dtype=I64)
        if self.spare == 0 or w < 2:
            return rows, held, source_of, Tensor(0, I64)
        home = held
        free = ops.full((w,), self.spare, dtype=I64)
        total = counts_E.sum()
        it = Tensor(0, I64)
        go = Tensor(True)
        while go and it < w * self.spare:
            load = rows.sum(axis=0)
            top = load.max()
            busiest = _first(load == top, self.arange_W, w)
            at_busiest = self.eye_W[busiest] > 0                                  # [W]
            piece = ops.select(at_busiest.expand_dims(0), rows, ops.zeros_like(rows)).sum(1)
            this = self.arange_E == _first(piece == piece.max(), self.arange_E,
                                           self.num_experts)                     # [E]
            home_e = (this.expand_dims(1) & home).any(axis=0)
            held_e = (this.expand_dims(1) & held).any(axis=0)
            reach = ops.select(home_e.expand_dims(1).broadcast_to((w, w)), self.cost_WW,
                               self.inf_WW)                                      # [src, dst]
            cost_to = reach.min(axis=0)
            source_to = _first((reach == cost_to.expand_dims(0)).transpose(1, 0),
                               self.arange_W.expand_dims(0).broadcast_to((w, w)), w)
            room = (free > 0) & ~held_e
            score = ops.select(room, load.astype(ms.float64) + cost_to, self.inf_W)
            target = _first(room & (score == score.min()), self.arange_W, w)
            can = room.any()
            at_target = (self.eye_W[ops.minimum(target, w - 1)] > 0) & can
            mask = held_e | at_target
            old = ops.select(this.expand_dims(1), rows, ops.zeros_like(rows)).sum(axis=0)
            rest = load - old
            amount = ops.select(can, (this.astype(I64) * counts_E).sum(), Tensor(0, I64))
            new = _water_fill(rest, mask, amount, self.lower_WW)
            relief = top - ((rest + new) * at_busiest.astype(I64)).sum()
            source = (source_to * at_target.astype(I64)).sum()
            cost_t = ops.select(at_target, cost_to, ops.zeros_like(cost_to)).sum()
            over = top > (self.buffer_W * at_busiest.astype(I64)).sum()
            keep = ((top * w > total) & can & (relief > 0)
                    & ((relief.astype(ms.float64) > cost_t) | over))
            put = this.expand_dims(1) & keep
            rows = ops.select(put, new.expand_dims(0).broadcast_to(rows.shape), rows)
            slot = put & at_target.expand_dims(0)
            held = held | slot
            source_of = ops.select(slot, ops.full_like(source_of, 1) * source, source_of)
            free = free - (at_target & keep).astype(I64)
            go = keep
            it = it + 1
        return rows, held, source_of, it

    def _fit_buffers(self, rows, held):
        """Step 3: a device over its buffer moves its excess to other holders of the same
        expert with room (its largest pieces first, least-loaded holders first), and drops
        what still does not fit (largest pieces first); returns (rows, dropped rows, devices
        over their buffer, pieces visited)."""
        w, e = self.world, self.num_experts
        buf = self.buffer_W
        load = rows.sum(axis=0)
        dropped = Tensor(0, I64)
        it = Tensor(0, I64)
        visited = Tensor(0, I64)
        while (load > buf).any() and it < w:
            d = _first(load > buf, self.arange_W, w)
            at_d = self.eye_W[d] > 0
            at_d_i = at_d.astype(I64)
            excess = ((load - buf) * at_d_i).sum()
            piece = (rows * at_d_i).sum(axis=1)
            pos = _ahead(piece, self.lower_EE, True).astype(I64).sum(axis=1)
            k = Tensor(0, I64)
            while excess > 0 and k < e:
                this = pos == k
                mine = (piece * this.astype(I64)).sum()           # rows of e on d now
                held_e = (this.expand_dims(1) & held).any(axis=0)
                room = ops.select(held_e & ~at_d, buf - load, ops.zeros_like(load))
                ok = room > 0
                room = ops.select(ok, room, ops.zeros_like(room))
                amount = ops.minimum(ops.minimum(excess, mine), room.sum())
                ahead = _ahead(load, self.lower_WW, False) & ok.expand_dims(0)
                before = ops.select(ahead, room.expand_dims(0).broadcast_to(ahead.shape),
                                    ops.zeros_like(ahead, dtype=I64)).sum(axis=1)
                take = ops.select(ok, ops.minimum(ops.maximum(amount - before, 0), room),
                                  ops.zeros_like(room))
                delta = take - at_d_i * amount
                rows = rows + this.astype(I64).expand_dims(1) * delta.expand_dims(0)
                piece = piece - this.astype(I64) * amount
                load = load + delta
                excess = excess - amount
                k = k + 1
            if self.trips:                       # a constant: the layer's graph has no add
                visited = visited + k
            # what no holder had room for: cut from the largest pieces
            piece = (rows * at_d_i).sum(axis=1)
            ahead = _ahead(piece, self.lower_EE, True)
            before = ops.select(ahead, piece.expand_dims(0).broadcast_to(ahead.shape),
                                ops.zeros_like(ahead, dtype=I64)).sum(axis=1)
            cut = ops.minimum(ops.maximum(excess - before, 0), piece)
            rows = rows - cut.expand_dims(1) * at_d_i.expand_dims(0)
            load = load - at_d_i * excess
            dropped = dropped + excess
            it = it + 1
        return rows, dropped, it, visited

    def _pair_rows(self, counts, rows):
        """Step 4 (:func:`~ms_efficient.moe.balance.pair_rows`, ``by_expert``): int64
        [R, E, W] rows every rank sends every device of every expert."""
        w, e = self.world, self.num_experts
        local = ops.minimum(counts, rows.transpose(1, 0))                      # [R, E]
        left = counts - local
        rest = rows - local.transpose(1, 0)                                    # [E, W]
        out = local.expand_dims(-1) * self.eye_W.expand_dims(1)                # [R, E, W]
        if self.nodes:
            nodes, n = self.nodes, self.dpn
            c = left.reshape(nodes, n, e)
            r = rest.reshape(e, nodes, n).transpose(1, 0, 2)                   # [N, E, n]
            supply = ops.minimum(c.sum(axis=1), r.sum(axis=2))                # [N, E]
            c_take = _proportional_split(supply.reshape(-1), c.transpose(0, 2, 1).reshape(
                -1, n), self.lower_nn).reshape(nodes, e, n).transpose(0, 2, 1)  # [N, n, E]
            r_take = _proportional_split(supply.reshape(-1), r.reshape(-1, n),
                                         self.lower_nn).reshape(nodes, e, n)     # [N, E, n]
            block = _cut(c_take, r_take)                                       # [N, n, E, n]
            spread = block.expand_dims(3) * self.eye_N.reshape(nodes, 1, 1, nodes, 1)
            out = out + spread.reshape(w, e, w)
            left = left - c_take.reshape(w, e)
            rest = rest - r_take.transpose(1, 0, 2).reshape(e, w)
        return out + _cut(left.expand_dims(0), rest.expand_dims(0))[0]


def profiled_launches(cell: nn.Cell, inputs, folder: str) -> Dict[str, int]:
    """Kernels a compiled CPU Cell launches, counted by MindSpore's profiler: ``cell`` is
    called on every tuple of ``inputs`` (compile it first: a first call outside) inside one
    profiling session written under ``folder``; returns {kernel's full name: launches}. A
    loop's kernels launch once per iteration, so the counts show what each loop costs
    (``scripts/time_fast_level.py --count-ops``, ``balance.OPS_TWIN_LAUNCHES``)."""
    import csv
    import glob
    import os

    from mindspore import Profiler

    profiler = Profiler(output_path=folder)
    for args in inputs:
        cell(*args)
    profiler.analyse()
    found = glob.glob(os.path.join(folder, "*", "FRAMEWORK", "cpu_op_detail_info_*.csv"))
    if len(found) != 1:
        raise RuntimeError(f"MindSpore's profiler left {len(found)} op tables under {folder}; "
                           f"expected one (a CPU run).")
    with open(found[0], newline="") as fh:
        return {row["full_op_name"]: int(row["op_occurrences"]) for row in csv.DictReader(fh)}


class FastLevel(nn.Cell):
    """``construct(counts_WE int32, home_WS int32) -> the tables of`` :func:`fast_level_tables`.

    impl "host": a host op in the compiled graph (``ops.Custom`` of type "pyfunc") running
    the numpy fast level itself, CPU only; "aot": the compiled C++ kernel
    (``kernels/cpu/fast_level.cc``), CPU only; "ops": :class:`FastLevelOps`, the
    MindSpore-ops twin, any target; "auto": aot on CPU (host when the kernel cannot be
    built), ops elsewhere. The tables are
    integers and carry no gradient (stopped on both sides)."""

    def __init__(self, world: int, num_experts: int, spare: int, buffer_W: np.ndarray,
                 copy_cost_WW: Optional[np.ndarray], devices_per_node: Optional[int],
                 impl: str = "auto"):
        super().__init__()
        if impl not in FAST_LEVEL_IMPLS:
            raise ValueError(f"'fast_level' must be one of {list(FAST_LEVEL_IMPLS)}, but got "
                             f"{impl!r}.")
        on_cpu = backend.device_target() == backend.CPU
        if impl in ("host", "aot") and not on_cpu:
            raise ValueError(f"fast_level {impl!r} runs on the host, on CPU only, but the "
                             f"target is {backend.device_target()}; use 'ops' (or 'auto').")
        self.impl = impl if impl != "auto" else ("aot" if on_cpu else "ops")
        self.spare = int(spare)
        buffers, cost = _checked_layout(world, num_experts, self.spare, buffer_W, copy_cost_WW)
        if self.impl == "ops":
            self.op = FastLevelOps(world, num_experts, spare, buffers, cost, devices_per_node)
            return
        if self.impl == "aot":
            from ms_efficient.moe.kernels import KernelBuildError

            try:
                self.op = _aot_tables(world, num_experts, spare, buffers, cost,
                                      devices_per_node)
                return
            except KernelBuildError as err:
                if impl == "aot":
                    raise
                logger.warning("fast level: the aot kernel cannot be built (%s); running the "
                               "numpy function as a host op instead", str(err).splitlines()[0])
                self.impl = "host"

        def tables(counts_WE, home_WS):
            return fast_level_tables(counts_WE, home_WS, spare, buffers, cost,
                                     devices_per_node)

        shapes = ((world, num_experts, world), (num_experts, world), (world, spare),
                  (world, spare), (world, num_experts), (3 + world,))
        self.op = ops.Custom(tables, out_shape=lambda *_: shapes,
                             out_dtype=lambda *_: (ms.int32,) * 6, func_type="pyfunc")

    def construct(self, counts_WE, home_WS):
        # integer tables, no gradient: stopped on both sides, so autodiff never enters the
        # twin's loops (a custom bprop around them fails to compile in MindSpore 2.10)
        tables = self.op(ops.stop_gradient(counts_WE), ops.stop_gradient(home_WS))
        if self.impl == "aot":                  # the kernel's spare columns are max(S_s, 1)
            tables = (tables[0], tables[1], tables[2][:, :self.spare],
                      tables[3][:, :self.spare], tables[4], tables[5])
        return tuple(ops.stop_gradient(t) for t in tables)


class _AotTables(nn.Cell):
    """``FastLevelTables`` of ``kernels/cpu/fast_level.cc`` with the layout's constants as
    inputs: ``construct(counts_WE, home_WS)`` -> the six tables (spare columns max(S_s, 1))."""

    def __init__(self, library: str, world: int, num_experts: int, spare: int,
                 buffer_W: np.ndarray, copy_cost_WW: np.ndarray,
                 devices_per_node: Optional[int]):
        """buffer_W int64 [W] and copy_cost_WW float64 [W, W]: ``_checked_layout``'s."""
        super().__init__()
        w, e, cols = world, num_experts, max(int(spare), 1)
        self.buffer_W = Tensor(buffer_W)
        self.cost_WW = Tensor(copy_cost_WW)
        self.conf = Tensor(np.array([int(spare), int(devices_per_node or 0)], dtype=np.int64))
        shapes = ((w, e, w), (e, w), (w, cols), (w, cols), (w, e), (3 + w,))
        self.op = ops.Custom(f"{library}:FastLevelTables", out_shape=lambda *_: shapes,
                             out_dtype=lambda *_: (ms.int32,) * 6, func_type="aot")

    def construct(self, counts_WE, home_WS):
        return self.op(counts_WE, home_WS, self.buffer_W, self.cost_WW, self.conf)


def _aot_tables(world, num_experts, spare, buffer_W, copy_cost_WW, devices_per_node):
    """The aot kernel's Cell, building ``kernels/cpu/fast_level.cc`` on first use."""
    from ms_efficient.moe.kernels import KERNEL_SOURCE, build_kernel_library

    source = KERNEL_SOURCE.parent / "fast_level.cc"
    return _AotTables(build_kernel_library(source), world, num_experts, spare, buffer_W,
                      copy_cost_WW, devices_per_node)
