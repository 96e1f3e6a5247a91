"""MPipeMoE: overlap the All-to-All of one token chunk with the expert compute of another, the
chunk count chosen from the step's token counts, and activation memory reused by a strategy
chosen from its cost (after Zhang et al., "MPipeMoE: Memory Efficient MoE for Pre-trained
Models with Adaptive Pipeline Parallelism", IPDPS 2023; written from the paper's
description). No MindSpore import: the Cell that runs chunks is
:class:`ms_efficient.mpipe.layer.PipelinedMoE`.

One expert-parallel MoE layer on one rank of a group of W ranks, per training step
(``MoELayerShape``): R rows (kept token assignments) leave and come back, H hidden, F the
expert FFN width, X local experts. Split into n chunks of R/n rows, each chunk i runs

    forward:   dispatch A2A D_i  ->  experts E_i  ->  combine A2A C_i
    backward:  combine-grad A2A  ->  experts' backward (2x the forward FLOPs)  ->  dispatch-grad A2A

on two serial resources of the device: the communication stream (every A2A, in the order
they become ready) and the compute stream. Chunk i's compute overlaps chunk i+1's
dispatch, so with n chunks the step approaches max(comm, compute) instead of their sum,
while every chunk pays the A2A latency (W-1 alphas) and the kernel launches again: the best
n balances the two (:func:`choose_chunks`). The timeline is built on the shared simulator
(:func:`simulate_layer`), and A2A times come from ``ClusterSpec.collective_time_s`` over
the group's devices. Because the token counts change from step to step, the chunk count is
chosen online from each step's rows (or their forecast) among power-of-two candidates.

Memory reuse (the paper's strategies, one layer, bytes per rank; b = bytes per element):
backward needs each chunk's dispatched input x (R/n x H, for dW1), its FFN hidden h = W1 x
and gelu(h) (2 x R/n x F) and its expert output y (R/n x H, for the gate gradient).

    keep          keep all of them:                              R (2H + 2F) b
    recomm        drop x, fetch it again by re-running the dispatch A2A in backward
                  (one more A2A per chunk):                      R (H + 2F) b
    recompute     drop h and gelu(h), re-run FFN1 + GeLU in backward
                  (2 R H F more FLOPs):                          R (2H) b
    both          drop x, h, gelu(h):                            R H b

Chunking also bounds the transient buffers (the send/receive buffers of a chunk) to R/n
rows, which are reused by every chunk: 2 (R/n) H b. :func:`choose_reuse` picks the fastest
strategy whose memory fits a budget.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ms_efficient.core.cluster import ClusterSpec
from ms_efficient.sim import Simulator

__all__ = ["MoELayerShape", "LayerTiming", "REUSE_STRATEGIES", "CHUNK_CANDIDATES",
           "simulate_layer", "choose_chunks", "choose_reuse", "reuse_memory_bytes",
           "ChunkSelector", "rows_per_step", "recompile_time_s"]

# Seconds one recompile of a network of L MoE layers costs: RECOMPILE_FIXED_S +
# RECOMPILE_PER_LAYER_S * L (what a static graph pays each time its chunk count changes).
# Source: scripts/measure_recompile.py compiles the forward+backward graph of L stacked
# MoEFeedForward layers (H=64, F=128, 8 experts, top-2, capacity 16, MindSpore 2.10
# GRAPH_MODE, CPU) in fresh processes after a warm-up compile; L = 1, 2, 4, 8 gave minima of
# 1.13, 1.45, 2.18, 3.39 s over 5 runs on a loaded 2-core machine, a line of 0.82 s + 0.32 s
# * L, rounded to 0.8 s + 0.4 s * L. Whole transformer blocks cost more (the 4-layer
# reference GPT-MoE logged 4.5-9.5 s per recompile there), so this is a lower bound.
RECOMPILE_FIXED_S = 0.8
RECOMPILE_PER_LAYER_S = 0.4

REUSE_STRATEGIES = ("keep", "recomm", "recompute", "both")
CHUNK_CANDIDATES = (1, 2, 4, 8, 16)
_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}


@dataclass(frozen=True)
class MoELayerShape:
    """One expert-parallel MoE layer's work on one rank per step.

    rows: R, token assignments this rank dispatches (and gets back) per step.
    hidden, ffn_hidden: H and F. local_experts: X experts on this rank (kernel launches).
    ranks: W, size of the expert-parallel group (devices 0..W-1 of the cluster).
    dtype: "bf16", "fp16" or "fp32". kernel_overhead_s: launch cost of one kernel on the
        device, seconds (a modelling choice of the order of an NPU kernel launch; each chunk
        launches 3 kernels per local expert forward, 6 backward).
    """

    rows: int
    hidden: int
    ffn_hidden: int
    local_experts: int
    ranks: int
    dtype: str = "bf16"
    kernel_overhead_s: float = 5e-6

    def __post_init__(self) -> None:
        for key in ("rows", "hidden", "ffn_hidden", "local_experts", "ranks"):
            if getattr(self, key) < 1:
                raise ValueError(f"'{key}' must be a positive integer, but got "
                                 f"{getattr(self, key)}.")
        if self.dtype not in _BYTES:
            raise ValueError(f"'dtype' must be one of {sorted(_BYTES)}, but got {self.dtype!r}.")
        if not self.kernel_overhead_s >= 0:
            raise ValueError(f"'kernel_overhead_s' must be >= 0, but got {self.kernel_overhead_s}.")

    @property
    def element_bytes(self) -> int:
        return _BYTES[self.dtype]


@dataclass(frozen=True)
class LayerTiming:
    """Simulated step of one layer: chunks n, reuse strategy, time_s (forward + backward),
    comm_s and compute_s (busy seconds of each stream), exposed_comm_s (time_s - compute_s:
    the communication not hidden behind compute), memory_bytes (kept activations plus the
    reused chunk buffers, see the module docstring)."""

    chunks: int
    strategy: str
    time_s: float
    comm_s: float
    compute_s: float
    exposed_comm_s: float
    memory_bytes: float


def _a2a_s(shape: MoELayerShape, cluster: ClusterSpec, rows: float) -> float:
    nbytes = rows * shape.hidden * shape.element_bytes
    return cluster.collective_time_s("alltoall", nbytes, list(range(shape.ranks)))


def _ffn_s(shape: MoELayerShape, cluster: ClusterSpec, rows: float, matmuls: float,
           kernels: int) -> float:
    """``matmuls`` R x H x F matmuls' worth of FLOPs (2 R H F each) plus kernel launches."""
    flops = matmuls * 2.0 * rows * shape.hidden * shape.ffn_hidden
    return (cluster.compute_time_s(flops, shape.dtype)
            + kernels * shape.local_experts * shape.kernel_overhead_s)


def reuse_memory_bytes(shape: MoELayerShape, chunks: int, strategy: str) -> float:
    """Bytes per rank a layer keeps for backward under ``strategy`` plus the reused chunk
    send/receive buffers (module docstring)."""
    if strategy not in REUSE_STRATEGIES:
        raise ValueError(f"'strategy' must be one of {list(REUSE_STRATEGIES)}, but got "
                         f"{strategy!r}.")
    r, h, f, b = shape.rows, shape.hidden, shape.ffn_hidden, shape.element_bytes
    kept = {"keep": 2 * h + 2 * f, "recomm": h + 2 * f, "recompute": 2 * h, "both": h}
    return float(r * kept[strategy] * b + 2 * (r / chunks) * h * b)


def simulate_layer(shape: MoELayerShape, cluster: ClusterSpec, chunks: int,
                   strategy: str = "keep") -> LayerTiming:
    """Forward + backward of one layer in ``chunks`` chunks on the shared simulator.

    Tasks per chunk i (resource "comm" or "compute", deps in brackets):
        forward:  D_i comm; E_i compute [D_i]; C_i comm [E_i]
        backward: G_i comm [last forward task]; (strategy recomm/both: X_i comm, the
                  dispatch again [G_i]); B_i compute [G_i, X_i] (2 matmuls' backward = 4
                  R/n H F-FLOP matmuls, plus FFN1 again for recompute/both); Y_i comm [B_i]
    Each stream runs its tasks in the order they become ready (FIFO), so the dispatches of
    later chunks overlap the compute of earlier ones.
    """
    if chunks < 1 or chunks > shape.rows:
        raise ValueError(f"'chunks' must be in [1, rows ({shape.rows})], but got {chunks}.")
    memory = reuse_memory_bytes(shape, chunks, strategy)
    rows = shape.rows / chunks
    a2a = _a2a_s(shape, cluster, rows)
    fwd = _ffn_s(shape, cluster, rows, 2.0, 3)
    extra = 1.0 if strategy in ("recompute", "both") else 0.0
    bwd = _ffn_s(shape, cluster, rows, 4.0 + extra, 6 + 2 * int(extra))
    sim = Simulator()
    last_fwd: List[str] = []
    for i in range(chunks):
        sim.add_task(f"D{i}", "comm", a2a)
        sim.add_task(f"E{i}", "compute", fwd, deps=[f"D{i}"])
        sim.add_task(f"C{i}", "comm", a2a, deps=[f"E{i}"])
        last_fwd.append(f"C{i}")
    for i in range(chunks):
        sim.add_task(f"G{i}", "comm", a2a, deps=last_fwd)
        deps = [f"G{i}"]
        if strategy in ("recomm", "both"):
            sim.add_task(f"X{i}", "comm", a2a, deps=[f"G{i}"])
            deps.append(f"X{i}")
        sim.add_task(f"B{i}", "compute", bwd, deps=deps)
        sim.add_task(f"Y{i}", "comm", a2a, deps=[f"B{i}"])
    res = sim.run()
    comm_s, compute_s = res.busy_s.get("comm", 0.0), res.busy_s.get("compute", 0.0)
    return LayerTiming(chunks, strategy, res.makespan_s, comm_s, compute_s,
                       res.makespan_s - compute_s, memory)


def choose_chunks(shape: MoELayerShape, cluster: ClusterSpec,
                  candidates: Sequence[int] = CHUNK_CANDIDATES,
                  strategy: str = "keep") -> Tuple[LayerTiming, Dict[int, LayerTiming]]:
    """(the fastest timing, {n: timing}) over the candidate chunk counts that do not exceed
    the rows; ties go to the fewer chunks."""
    options = sorted({int(n) for n in candidates if 1 <= int(n) <= shape.rows})
    if not options:
        raise ValueError(f"no chunk count in {list(candidates)} fits {shape.rows} rows.")
    table = {n: simulate_layer(shape, cluster, n, strategy) for n in options}
    best = min(options, key=lambda n: (table[n].time_s, n))
    return table[best], table


def choose_reuse(shape: MoELayerShape, cluster: ClusterSpec, memory_budget_bytes: float,
                 candidates: Sequence[int] = CHUNK_CANDIDATES
                 ) -> Tuple[LayerTiming, List[LayerTiming]]:
    """(the fastest (chunks, strategy) whose memory fits ``memory_budget_bytes``, every
    timing tried). ValueError naming the least memory any option needs when none fits."""
    tried = [choose_chunks(shape, cluster, candidates, s)[1] for s in REUSE_STRATEGIES]
    timings = [t for table in tried for t in table.values()]
    fitting = [t for t in timings if t.memory_bytes <= memory_budget_bytes]
    if not fitting:
        least = min(t.memory_bytes for t in timings)
        raise ValueError(f"'memory_budget_bytes' {memory_budget_bytes:.4g} is below the least "
                         f"memory of any chunking and reuse strategy, {least:.4g} bytes.")
    best = min(fitting, key=lambda t: (t.time_s, REUSE_STRATEGIES.index(t.strategy), t.chunks))
    return best, timings


class ChunkSelector:
    """Online chunk count: re-chosen when a step's rows move more than ``tolerance``
    (relative) from the rows it was last chosen for, since a static graph recompiles when the
    count changes; ``choose(rows)`` returns the count for a step with that many rows.

    shape: the layer at some row count (its ``rows`` is replaced per step).
    """

    def __init__(self, shape: MoELayerShape, cluster: ClusterSpec,
                 candidates: Sequence[int] = CHUNK_CANDIDATES, strategy: str = "keep",
                 tolerance: float = 0.25):
        if not tolerance >= 0:
            raise ValueError(f"'tolerance' must be >= 0, but got {tolerance}.")
        self.shape, self.cluster = shape, cluster
        self.candidates, self.strategy, self.tolerance = tuple(candidates), strategy, tolerance
        self.chunks: Optional[int] = None
        self._rows: Optional[float] = None
        self.changes = 0

    def choose(self, rows: float) -> int:
        rows = max(1, int(round(rows)))
        if self._rows is None or abs(rows - self._rows) > self.tolerance * self._rows:
            shape = MoELayerShape(rows, self.shape.hidden, self.shape.ffn_hidden,
                                  self.shape.local_experts, self.shape.ranks, self.shape.dtype,
                                  self.shape.kernel_overhead_s)
            best, _ = choose_chunks(shape, self.cluster, self.candidates, self.strategy)
            self.changes += int(self.chunks is not None and best.chunks != self.chunks)
            self.chunks, self._rows = best.chunks, float(rows)
        return int(self.chunks)


def rows_per_step(counts_SRE: np.ndarray, devices: int) -> np.ndarray:
    """Rows the busiest device receives each step: counts [steps, ranks, experts] of one
    layer of a routing trace, experts placed contiguously (E / devices per device) -> [steps].
    The busiest device sets the pace of the All-to-All and of the expert compute."""
    counts = np.asarray(counts_SRE)
    if counts.ndim != 3:
        raise ValueError(f"'counts_SRE' must be [steps, ranks, experts], but got shape "
                         f"{counts.shape}.")
    experts = counts.shape[2]
    if devices < 1 or experts % devices:
        raise ValueError(f"'devices' must divide the {experts} experts, but got {devices}.")
    load_SE = counts.sum(axis=1)
    return load_SE.reshape(load_SE.shape[0], devices, experts // devices).sum(axis=2).max(axis=1)


def recompile_time_s(num_layers: int = 1) -> float:
    """Seconds one recompilation of a network of ``num_layers`` MoE layers costs:
    RECOMPILE_FIXED_S + RECOMPILE_PER_LAYER_S * num_layers (measured; see the constants)."""
    if num_layers < 1:
        raise ValueError(f"'num_layers' must be >= 1, but got {num_layers}.")
    # rounded to the nanosecond: 0.8 + 0.4 is 1.2000000000000002 in binary floats
    return round(RECOMPILE_FIXED_S + RECOMPILE_PER_LAYER_S * num_layers, 9)
