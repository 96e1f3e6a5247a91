"""Routing traces: how many tokens each source rank sent to each expert, step by step.

File format (``.npz``, stable; any system can write one to replay it in the MoE planners):

    counts           int64 [step, layer, src_rank, expert]   tokens sent (top-k counted k times)
    top_k            int64 scalar, optional                  experts per token
    hidden           int64 scalar, optional                  model width H (bytes per token = H x dtype)
    tokens_per_rank  int64 scalar, optional                  tokens each source rank routes per step
    steps            int64 [step], optional                  training step of each row

This module has no MindSpore dependency.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ms_efficient.fileio import atomic_write_with

__all__ = ["RoutingTrace", "load_trace", "save_trace"]

_META = ("top_k", "hidden", "tokens_per_rank")


@dataclass
class RoutingTrace:
    """counts: int64 [step, layer, src_rank, expert]; optional metadata (see module doc)."""

    counts: np.ndarray
    top_k: Optional[int] = None
    hidden: Optional[int] = None
    tokens_per_rank: Optional[int] = None
    steps: Optional[np.ndarray] = None

    def __post_init__(self):
        self.counts = validate_counts(self.counts, "counts")
        for name in _META:
            value = getattr(self, name)
            if value is not None and (int(value) != value or value < 1):
                raise ValueError(f"trace '{name}' must be a positive integer, but got {value!r}.")
        if self.steps is not None:
            self.steps = np.asarray(self.steps, dtype=np.int64)
            if self.steps.shape != (self.counts.shape[0],):
                raise ValueError(f"trace 'steps' must have shape ({self.counts.shape[0]},), "
                                 f"but got {self.steps.shape}.")

    @property
    def num_steps(self) -> int:
        return self.counts.shape[0]

    @property
    def num_layers(self) -> int:
        return self.counts.shape[1]

    @property
    def num_ranks(self) -> int:
        return self.counts.shape[2]

    @property
    def num_experts(self) -> int:
        return self.counts.shape[3]

    def expert_load(self) -> np.ndarray:
        """Tokens per expert summed over source ranks: int64 [step, layer, expert]."""
        return self.counts.sum(axis=2)


def validate_counts(counts, name: str = "counts") -> np.ndarray:
    """Check a counts array: 4-D, integral, non-negative; returns it as int64."""
    arr = np.asarray(counts)
    if arr.ndim != 4:
        raise ValueError(f"trace '{name}' must be 4-D [step, layer, src_rank, expert], "
                         f"but got shape {arr.shape}.")
    if 0 in arr.shape:
        raise ValueError(f"trace '{name}' must have no empty dimension, but got shape "
                         f"{arr.shape}.")
    if not np.issubdtype(arr.dtype, np.integer):
        if not np.all(np.isfinite(arr)) or not np.all(arr == np.round(arr)):
            raise ValueError(f"trace '{name}' must hold integer token counts, but got dtype "
                             f"{arr.dtype} with fractional values.")
    if (arr < 0).any():
        where = tuple(int(i) for i in np.argwhere(arr < 0)[0])
        raise ValueError(f"trace '{name}' must be >= 0, but got {arr[where]} at "
                         f"[step, layer, src_rank, expert] = {list(where)}.")
    return arr.astype(np.int64)


def save_trace(trace: RoutingTrace, path: str) -> None:
    """Write ``trace`` to ``path`` (.npz) atomically."""
    arrays = {"counts": trace.counts}
    for name in _META:
        if getattr(trace, name) is not None:
            arrays[name] = np.int64(getattr(trace, name))
    if trace.steps is not None:
        arrays["steps"] = trace.steps

    def write(tmp: str) -> None:
        with open(tmp, "wb") as fh:
            np.savez_compressed(fh, **arrays)

    atomic_write_with(path, write)


def load_trace(path: str) -> RoutingTrace:
    """Read and validate a trace file; errors name the file and the problem."""
    try:
        with np.load(path, allow_pickle=False) as data:
            if "counts" not in data:
                raise ValueError(f"trace file '{path}' has no 'counts' array (has "
                                 f"{sorted(data.files)}).")
            kwargs = {name: int(data[name]) for name in _META if name in data}
            steps = data["steps"] if "steps" in data else None
            return RoutingTrace(counts=data["counts"], steps=steps, **kwargs)
    except (OSError, EOFError) as err:
        raise ValueError(f"trace file '{path}' cannot be read as .npz: {err}") from None
    except ValueError as err:
        if str(err).startswith("trace file"):
            raise
        raise ValueError(f"trace file '{path}': {err}") from None
