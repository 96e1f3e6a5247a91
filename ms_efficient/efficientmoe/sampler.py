"""Routing sampler: the per-step routing counts every MoE planner reads.

The trainer, the ``RoutingTraceCallback`` and the measured bench record one row per step
(int [layer, source rank, expert], tokens each source rank sent to each expert, top-k
counted k times); the history ``counts_TLRE`` (int [step, layer, source rank, expert]) is
saved as the run's routing trace (:class:`~ms_efficient.moe.trace.RoutingTrace`), which the
slow level's layout (``plan moe``, ``efficientmoe.history``) and the ``efficientmoe`` pass
plan from.
"""
from __future__ import annotations

from typing import List

import numpy as np

from ms_efficient.moe.trace import RoutingTrace

__all__ = ["RoutingSampler"]


class RoutingSampler:
    """Per-step routing counts, the input of every MoE planner.

    ``record(counts_LRE)`` appends one step (int [layer, src_rank, expert], tokens sent by each
    source rank to each expert, top-k counted k times); ``trace()`` returns the history in the
    routing-trace format. Recording is one small host copy per step: the trainer reports its
    measured cost as ``sampler_overhead_s``.
    """

    def __init__(self) -> None:
        self._rows: List[np.ndarray] = []

    def record(self, counts_LRE: np.ndarray) -> None:
        counts = np.asarray(counts_LRE, dtype=np.int64)
        if counts.ndim != 3:
            raise ValueError(f"counts must be [layer, src_rank, expert], but got shape "
                             f"{counts.shape}.")
        if self._rows and counts.shape != self._rows[0].shape:
            raise ValueError(f"counts shape changed from {self._rows[0].shape} to "
                             f"{counts.shape}.")
        self._rows.append(counts)

    def truncate(self, steps: int) -> None:
        """Keep the first ``steps`` rows (used when a run resumes from a checkpoint)."""
        del self._rows[steps:]

    def __len__(self) -> int:
        return len(self._rows)

    def counts(self) -> np.ndarray:
        """int64 [step, layer, src_rank, expert]."""
        return np.stack(self._rows)

    def expert_load(self) -> np.ndarray:
        """int64 [step, layer, expert], tokens per expert summed over source ranks."""
        return self.counts().sum(axis=2)

    def trace(self, **meta) -> RoutingTrace:
        return RoutingTrace(counts=self.counts(), steps=np.arange(1, len(self) + 1), **meta)
