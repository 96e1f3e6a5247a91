"""Segments of a network's top-level sequence as memopt units, for networks without repeated
blocks (a VGG / mobilenet-style ``features`` SequentialCell of Conv2d / ReLU pairs).

Single operators make poor units: recomputing one Conv2d frees nothing its backward does not
need anyway. Chen et al. 2016 ("Training Deep Nets with Sublinear Memory Cost", sec. 4.1)
instead cut a chain of n layers into about sqrt(n) segments, keep each segment's output and
re-run its interior in the backward. Here the pieces are the sequence's groups
(``graph.cells.sequence_groups``: a child holding parameters and the parameter-free children
after it); a segmentation into k segments balances their forward activation bytes
(:func:`linear_partition`), and the memopt pass plans k in {1, 2, ceil(sqrt(n)), n}, keeping
the segmentation whose plan within the budget simulates the shortest step
(:func:`choose_segments`).

A segment ``c1 .. ck`` is realised on the user's own Cells (:func:`segment_cell_actions`):
    recompute       ``c1 .. c(k-1)``: ``Cell.recompute(output_recompute=True)`` (outputs
                    dropped), ``ck``: ``Cell.recompute()`` (its output, the segment's, kept).
                    MindSpore 2.10 merges adjacent recomputed Cells into one re-run, so the
                    segment's interior is re-run once from the kept output before it.
    recompute-all   every ``ci``: ``Cell.recompute(output_recompute=True)``.
    keep            nothing.
Swap is left out for segments: ``Cell.offload`` acts only inside lazy_inline Cells on Ascend,
and a sequence of a user's leaf Cells is not one.

Planner parts are pure numpy; MindSpore is never imported here.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Sequence, Tuple

import numpy as np

from ms_efficient.memopt.env import KEEP, RECOMPUTE, RECOMPUTE_ALL, MemoryPlan

__all__ = ["linear_partition", "segment_counts", "segmentations", "segment_cell_actions",
           "choose_segments", "describe_segments"]


def linear_partition(weights: Sequence[float], k: int, min_size: int = 1) -> List[int]:
    """Start indices of ``k`` contiguous parts of ``weights``, each of at least ``min_size``
    entries (n >= k * min_size), whose largest sum is least (dynamic programme, O(k n^2));
    on a tie the earliest cut. E.g. ``linear_partition([4, 1, 1, 4], 2) == [0, 2]``,
    ``linear_partition([9, 1, 1, 1], 2, min_size=2) == [0, 2]``."""
    w = np.asarray(weights, dtype=np.float64)
    n = w.size
    if k < 1 or min_size < 1 or k * min_size > n:
        raise ValueError(f"k must be between 1 and the {n} weights / min_size {min_size}, "
                         f"but got {k}.")
    prefix = np.concatenate([[0.0], np.cumsum(w)])
    # best[j][i]: least largest part of the first i weights in j parts; cut[j][i]: last start
    best = np.full((k + 1, n + 1), np.inf)
    cut = np.zeros((k + 1, n + 1), dtype=np.int64)
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j * min_size, n + 1):
            for s in range((j - 1) * min_size, i - min_size + 1):
                cost = max(best[j - 1][s], prefix[i] - prefix[s])
                if cost < best[j][i] - 1e-12 * max(1.0, abs(cost)):
                    best[j][i], cut[j][i] = cost, s
    starts, i = [], n
    for j in range(k, 0, -1):
        starts.append(int(cut[j][i]))
        i = int(cut[j][i])
    return starts[::-1]


def segment_counts(n: int) -> List[int]:
    """The segment counts planned for ``n`` >= 2 groups, each segment of >= 2 groups (see
    :func:`segmentations`): {1, 2, ceil(sqrt(n)), n // 2} within 1 .. n // 2 (Chen et al.'s
    sqrt(n), one segment and the finest), ascending."""
    top = max(1, n // 2)
    return sorted({k for k in (1, 2, math.ceil(math.sqrt(n)), top) if 1 <= k <= top})


def segmentations(groups: Sequence[Sequence[str]], group_bytes: Sequence[float]
                  ) -> List[List[List[str]]]:
    """One segmentation per count of :func:`segment_counts`: ``groups`` (Cell paths, in the
    sequence's order) joined into k contiguous segments balanced by ``group_bytes`` (the
    forward activation bytes of each group), each of at least 2 groups (1 when there is
    one): inside such a segment the output of a group is the input of the next group's
    parameter operator, whose weight gradient reads it, so re-running the segment always
    frees a tensor the backward would hold. A segment of one group (a Conv2d and its ReLU)
    may free nothing: ReLU's backward reads its own output and Conv2D's its input, so the
    Conv2D output inside is never held, whatever the shared cost model charges for it."""
    if len(groups) != len(group_bytes):
        raise ValueError(f"group_bytes must have one entry per group ({len(groups)}), but got "
                         f"{len(group_bytes)}.")
    out = []
    for k in segment_counts(len(groups)):
        starts = linear_partition(group_bytes, k, min(2, len(groups))) + [len(groups)]
        out.append([[c for g in groups[a:b] for c in g] for a, b in zip(starts, starts[1:])])
    return out


def segment_cell_actions(segments: Sequence[Sequence[str]], plan: MemoryPlan
                         ) -> Tuple[List[str], List[int]]:
    """The per-Cell actions realising a plan over ``segments`` (module docs): (Cell paths,
    their RECOMPUTE / RECOMPUTE_ALL codes), kept segments left out. Raises ValueError for an
    action a segment cannot take (swap, recompute-offload)."""
    from ms_efficient.memopt.env import ACTION_NAMES

    names: List[str] = []
    actions: List[int] = []
    for seg, action in zip(segments, plan.actions):
        action = int(action)
        if action == KEEP:
            continue
        if action == RECOMPUTE:
            names += list(seg)
            actions += [RECOMPUTE_ALL] * (len(seg) - 1) + [RECOMPUTE]
        elif action == RECOMPUTE_ALL:
            names += list(seg)
            actions += [RECOMPUTE_ALL] * len(seg)
        else:
            raise ValueError(f"segment {list(seg)}: {ACTION_NAMES[action]} has no MindSpore "
                             f"API on a run of Cells; segments take keep, recompute or "
                             f"recompute-all.")
    return names, actions


def choose_segments(groups: Sequence[Sequence[str]], group_bytes: Sequence[float],
                    profile_with: Callable[[List[List[str]]], List[Any]],
                    plan_with: Callable[[List[Any]], List[Dict[str, Any]]],
                    floor_share: Callable[[List[Any]], float]):
    """The segmentation (of :func:`segmentations`) whose plan simulates the shortest step.

    profile_with(segments) -> one LayerProfile per device; plan_with(profiles) -> the memopt
    pass's plan of every device (``devices[d]["result"]``: a StepResult, None when that
    device needed no plan) or a ValueError (budget below the floor, recompute does not pay);
    floor_share(profiles): the feasible floor as a share of the unoptimised peak. Returns
    (segments, profiles, devices) of the winner, the fewest segments on a tie; when every
    segmentation fails, re-raises the error of the one with the lowest floor."""
    best, failed = None, None
    for segs in segmentations(groups, group_bytes):
        profiles = profile_with(segs)
        try:
            devices = plan_with(profiles)
        except ValueError as err:
            share = floor_share(profiles)
            if failed is None or share < failed[0]:
                failed = (share, err)
            continue
        step = sum(got["result"].step_time_s if got["result"] is not None
                   else float(got["profile"].forward_time_s.sum()
                              + got["profile"].backward_time_s.sum()) for got in devices)
        if best is None or step < best[0] * (1 - 1e-12):
            best = (step, segs, profiles, devices)
    if best is None:
        raise failed[1]
    return best[1], best[2], best[3]


def describe_segments(doc: Dict[str, Any], segments: List[List[str]],
                      actions_of: Dict[str, int], applied: Dict[str, List[str]]) -> None:
    """Name a segment plan's Cells: each ``layers`` entry (named by the segment's first Cell)
    lists its ``cells``; ``cells`` has one entry per Cell of a planned segment, with the
    segment it belongs to (``segment``: its first Cell; the compiled-graph check counts the
    segment's recomputed copies together, as MindSpore merges them into one re-run); the
    MindFormers-style ``recompute`` list names those Cells."""
    from ms_efficient.memopt.env import ACTION_NAMES

    of = {seg[0]: seg for seg in segments}
    for layer in doc["layers"]:
        layer["cells"] = list(of[layer["name"]])
    doc["segments"] = [list(seg) for seg in segments]
    doc["cells"] = {cell: {"action": ACTION_NAMES[action], "segment": name,
                           "recompute": True,
                           "output_recompute": cell in applied["recompute_all"],
                           "swap": False}
                    for name, action in actions_of.items() for cell in of[name]}
    doc["recompute_config"]["recompute"] = applied["recompute"] + applied["recompute_all"]
