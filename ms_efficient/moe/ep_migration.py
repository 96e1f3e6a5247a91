"""Expert migration of a re-plan: which weight rows move where (numpy; the one source of truth
for what a home re-plan sends and for what the slow level charges for it).

Notation: W ranks (= devices of the plans), S_b weight rows (budget slots) per rank, B = S_b.
Row i of rank d holds the i-th slot of d in the plan, in ascending slot id, and rows past d's
slots are empty (:func:`row_layout`; the balanced layer's home table). Going from an old plan to a new one, every new row of every rank is

  kept     it holds the same expert in the same row before and after (nothing to do), or it
           is empty in the new plan (its values become zeros, no copy);
  local    its expert is new in that row, but the rank held the expert in another row in the
           old plan: copied on the rank from the first such row (no communication);
  remote   the rank did not hold the expert: copied from a rank that did, the one on the same
           node when ``devices_per_node`` is given, else (and among those) the lowest rank,
           from its first row of the expert.

The remote rows travel in ONE exchange (an uneven All-to-All, AlltoAllV): a source row that
several new rows of one rank need (replicas of the expert on the destination) is sent once and
copied on arrival, so ``rows_WW[s, d]`` counts distinct source rows of rank s that rank d
receives; the diagonal is 0 (a local copy costs nothing). Send and receive order: block d of
rank s's send buffer, and block s of rank d's receive buffer, hold those source rows in the
order of the first new row of d that needs each (both sides derive it from the same tables).

What moves with a row: the expert's weights and, when the optimizer keeps state per weight
(Adam's two moments, Momentum's one), that state, so a step after the move equals the step
without it. :func:`migration_bytes_WW` charges bytes = rows x bytes per row x (1 + optimizer
state tensors per weight); the slow level (``efficientmoe.planner``) prices re-plans with
it and ``BalancedExpertParallelMoE.set_plan`` moves exactly these rows.
No MindSpore import here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ms_efficient.moe.plan import ExpertPlan

__all__ = ["Migration", "migrate_rows", "migration_bytes_WW", "row_layout"]


def row_layout(plan: ExpertPlan, budget: int, world: int) -> np.ndarray:
    """int64 [W, S_b]: the logical expert in every weight row of every rank under ``plan``
    (row i of rank d = the i-th slot of d, ascending slot id), -1 for empty rows.

    Raises ``ValueError`` when a slot's device is outside [0, W) or a rank holds more than
    ``budget`` slots."""
    devices = np.asarray(plan.slot_device, dtype=np.int64)
    if devices.size and (devices.min() < 0 or devices.max() >= world):
        raise ValueError(f"the plan's 'slot_device' must be in [0, {world}) for {world} ranks, "
                         f"but got {sorted(set(devices.tolist()))}.")
    per_rank = np.bincount(devices, minlength=world)
    if per_rank.max(initial=0) > budget:
        raise ValueError(f"'budget' (weight rows per rank) must be >= the most slots a rank "
                         f"holds, {int(per_rank.max())} (per rank {per_rank.tolist()}), but got "
                         f"{budget}.")
    expert_WB = np.full((world, budget), -1, dtype=np.int64)
    for d in range(world):
        on_d = np.flatnonzero(devices == d)
        expert_WB[d, :on_d.size] = np.asarray(plan.slot_expert, dtype=np.int64)[on_d]
    return expert_WB


@dataclass(frozen=True)
class Migration:
    """The rows a re-plan moves (module docstring), the same on every rank.

    old_expert_WB, new_expert_WB: int64 [W, S_b], expert of every row before and after (-1
        empty).
    src_rank_WB: int64 [W, S_b], rank every new row copies from (itself for a local copy), -1
        for a kept row (unchanged, or empty in the new plan: zeros).
    src_row_WB: int64 [W, S_b], row of that rank in the OLD layout, -1 likewise.
    rows_WW: int64 [W, W], [src, dst]: rows the exchange carries (distinct source rows per
        destination; diagonal 0).
    """

    old_expert_WB: np.ndarray
    new_expert_WB: np.ndarray
    src_rank_WB: np.ndarray
    src_row_WB: np.ndarray
    rows_WW: np.ndarray

    @property
    def world(self) -> int:
        """W, ranks."""
        return int(self.rows_WW.shape[0])

    @property
    def moved_WB(self) -> np.ndarray:
        """bool [W, S_b]: rows that get another row's values (local or remote copy)."""
        return self.src_rank_WB >= 0

    @property
    def local_WB(self) -> np.ndarray:
        """bool [W, S_b]: rows copied on their own rank."""
        return self.src_rank_WB == np.arange(self.world)[:, None]

    @property
    def cleared_WB(self) -> np.ndarray:
        """bool [W, S_b]: rows empty in the new plan that held an expert (set to zeros)."""
        return (self.new_expert_WB < 0) & (self.old_expert_WB >= 0)

    @property
    def moved_slots(self) -> int:
        """Rows (slots) that received an expert's values, local and remote copies."""
        return int(self.moved_WB.sum())

    @property
    def sent_rows(self) -> int:
        """Rows carried by the exchange (sum of rows_WW)."""
        return int(self.rows_WW.sum())

    def _pairs(self, dst: int):
        """[(src rank, src row)] distinct remote sources of ``dst``, in receive order."""
        pairs = []
        for i in range(self.src_rank_WB.shape[1]):
            s, j = int(self.src_rank_WB[dst, i]), int(self.src_row_WB[dst, i])
            if s >= 0 and s != dst and (s, j) not in pairs:
                pairs.append((s, j))
        return sorted(pairs, key=lambda p: (p[0], pairs.index(p)))

    def send_rows(self, rank: int) -> np.ndarray:
        """int64 [M]: the OLD rows of ``rank`` it sends, in send-buffer order (destination
        blocks in rank order; M = rows_WW[rank].sum())."""
        rows = [j for d in range(self.world) if d != rank
                for s, j in self._pairs(d) if s == rank]
        return np.asarray(rows, dtype=np.int64)

    def receive_index(self, rank: int) -> np.ndarray:
        """int64 [S_b]: the row of ``rank``'s receive buffer (sources in rank order,
        rows_WW[:, rank].sum() rows) every new row takes, -1 for rows not received."""
        pairs = self._pairs(rank)
        index_B = np.full(self.src_rank_WB.shape[1], -1, dtype=np.int64)
        for i in range(index_B.size):
            s, j = int(self.src_rank_WB[rank, i]), int(self.src_row_WB[rank, i])
            if s >= 0 and s != rank:
                index_B[i] = pairs.index((s, j))
        return index_B


def migrate_rows(old_WB: np.ndarray, new_WB: np.ndarray,
                 devices_per_node: Optional[int] = None) -> Migration:
    """The migration from row table ``old_WB`` to ``new_WB`` (int [W, S_b], the expert of
    every weight row of every rank, -1 empty; :func:`row_layout` of a plan, or the home
    table of a :class:`~ms_efficient.moe.balanced_ep.BalancedExpertParallelMoE`), module
    docstring: what ``set_plan`` moves and the slow level's simulator charges for a home
    re-plan.

    Raises ``ValueError`` when the tables differ in shape, or an expert of ``new_WB`` has no
    copy in ``old_WB`` to come from.
    """
    old_WB, new_WB = (np.asarray(t, dtype=np.int64) for t in (old_WB, new_WB))
    if old_WB.ndim != 2 or old_WB.shape != new_WB.shape:
        raise ValueError(f"the old and new row tables must both be [W, S_b], but got "
                         f"{old_WB.shape} and {new_WB.shape}.")
    if devices_per_node is not None and devices_per_node < 1:
        raise ValueError(f"'devices_per_node' must be None or >= 1, but got "
                         f"{devices_per_node}.")
    world, budget = old_WB.shape
    src_rank_WB = np.full((world, budget), -1, dtype=np.int64)
    src_row_WB = np.full((world, budget), -1, dtype=np.int64)
    rows_WW = np.zeros((world, world), dtype=np.int64)
    first_row = {}                     # (rank, expert) -> its first old row there
    for r, i in zip(*np.nonzero(old_WB >= 0)):          # row-major: ascending rank, row
        first_row.setdefault((int(r), int(old_WB[r, i])), int(i))
    holders_E = {}                     # expert -> ranks holding it, ascending
    for r, e in first_row:
        holders_E.setdefault(e, []).append(r)
    for d in range(world):
        remote = set()
        for i in range(budget):
            e = int(new_WB[d, i])
            if e < 0 or old_WB[d, i] == e:
                continue                                           # kept (or emptied)
            if (d, e) in first_row:                                # local copy
                src_rank_WB[d, i], src_row_WB[d, i] = d, first_row[d, e]
                continue
            holders = holders_E.get(e, [])
            if not holders:
                raise ValueError(f"expert {e} has no copy in the old plan to migrate from "
                                 f"(rank {d} needs it in row {i} of the new plan).")
            near = holders
            if devices_per_node is not None:
                same = [r for r in holders if r // devices_per_node == d // devices_per_node]
                near = same or holders
            s, j = near[0], first_row[near[0], e]
            src_rank_WB[d, i], src_row_WB[d, i] = s, j
            if (s, j) not in remote:
                remote.add((s, j))
                rows_WW[s, d] += 1
    return Migration(old_WB, new_WB, src_rank_WB, src_row_WB, rows_WW)


def migration_bytes_WW(rows_WW: np.ndarray, row_bytes: float,
                       optimizer_states: int = 0) -> np.ndarray:
    """float64 [W, W], [src, dst]: bytes the exchange carries, rows_WW x ``row_bytes`` (bytes
    of one expert's weights) x (1 + ``optimizer_states``, the state tensors the optimizer
    keeps per weight: Adam 2, Momentum 1, plain SGD 0)."""
    if row_bytes < 0 or optimizer_states < 0:
        raise ValueError(f"'row_bytes' and 'optimizer_states' must be >= 0, but got "
                         f"{row_bytes} and {optimizer_states}.")
    return np.asarray(rows_WW, dtype=np.float64) * float(row_bytes) * (1 + int(optimizer_states))
