"""MPipeMoE benchmark (simulated, Ascend 910B presets): chunk-count policies replayed over the
per-step token counts of routing traces, and reuse strategies under memory budgets. No
MindSpore import.

Per workload (an MoE layer shape, an expert-parallel group, a routing trace whose rows are
steps) every policy gets each row's rows on the busiest device (``pipeline.rows_per_step``)
and is charged :func:`~ms_efficient.mpipe.planner.simulate_layer` per layer and row, plus a
recompile each time its chunk count changes (a static graph compiles its chunks):

    no-pipeline   n = 1 (dispatch, experts, combine in sequence: GShard / DeepSpeed-MoE)
    fixed-2/4/8   a fixed chunk count set before training (FasterMoE's pipeline splits the
                  exchange into a fixed number of groups)
    tutel-adaptive  Tutel re-chooses its pipelining degree at run time, per capacity: a
                  table keyed by the row count rounded up to a power of two; a new key gets
                  the best n for its first row (given free here, from the same simulator as
                  ours, where Tutel tries the candidates on live iterations), and a change
                  of n pays the same recompile as ours (Hwang et al. 2023, "Tutel: Adaptive
                  Mixture-of-Experts at Scale", adaptive pipelining)
    mpipe-online  ours: ``ChunkSelector``, re-chosen when the rows move by more than 25%
    oracle        the best n for every row, switches for free (a reference)

Rows: {"evidence": "simulated", "workload", "method", "layer_time_s" (mean over rows,
forward + backward of one layer), "speedup_vs_no_pipeline", "exposed_comm_fraction",
"chunk_changes", "recompile_s" (seconds: changes x
:func:`~ms_efficient.mpipe.planner.recompile_time_s` of the workload's layers),
"memory_bytes" (keep strategy, at the mean chunk count), "chunks_mean"}; reuse rows:
{"method": "reuse", "budget_bytes", "chunks", "strategy", "layer_time_s", "memory_bytes"}.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import numpy as np

from ms_efficient.core.cluster import ClusterSpec, get_cluster
from ms_efficient.mpipe.planner import (CHUNK_CANDIDATES, ChunkSelector, MoELayerShape,
                                        choose_chunks, choose_reuse, recompile_time_s,
                                        reuse_memory_bytes, rows_per_step, simulate_layer)

__all__ = ["MPipeWorkload", "WORKLOADS", "POLICIES", "policy_rows", "reuse_rows",
           "STEPS_PER_ROW"]

POLICIES = ("no-pipeline", "fixed-2", "fixed-4", "fixed-8", "tutel-adaptive", "mpipe-online",
            "oracle")
STEPS_PER_ROW = 50  # training steps each synthetic trace row stands for


@dataclass(frozen=True)
class MPipeWorkload:
    """name; hidden, ffn_hidden; experts, top_k; tokens_per_rank per step; cluster preset
    (the expert-parallel group is all its devices); layers (MoE layers per step);
    warmup_from: sequence-length warm-up (Li et al. 2022, "The stability-efficiency dilemma"):
    the tokens per step start at this fraction and grow linearly to all of them over the
    first half of the trace (1.0: no warm-up)."""

    name: str
    hidden: int
    ffn_hidden: int
    experts: int
    top_k: int
    tokens_per_rank: int
    cluster: str
    layers: int
    warmup_from: float = 1.0


# GPT-3-like MoE layers (Brown et al. 2020 sizes; 2 experts per device), one 2048-token
# sequence per rank and step.
WORKLOADS = (
    MPipeWorkload("moe-1.3b-e16", 2048, 8192, 16, 2, 2048, "ascend910b-1x8", 12),
    MPipeWorkload("moe-6.7b-e64", 4096, 16384, 64, 2, 2048, "ascend910b-4x8", 16),
    MPipeWorkload("moe-6.7b-e64-seqwarmup", 4096, 16384, 64, 2, 2048, "ascend910b-4x8", 16,
                  warmup_from=0.125),
)


def _layer(w: MPipeWorkload, cluster: ClusterSpec, rows: int) -> MoELayerShape:
    return MoELayerShape(rows=max(1, int(rows)), hidden=w.hidden, ffn_hidden=w.ffn_hidden,
                         local_experts=w.experts // cluster.num_devices,
                         ranks=cluster.num_devices)


def _counts(w: MPipeWorkload, steps: int, cluster: ClusterSpec, seed: int) -> np.ndarray:
    from ms_efficient.moe.trace import synthetic_trace

    tr = synthetic_trace(steps=steps, layers=1, ranks=cluster.num_devices, experts=w.experts,
                         tokens_per_rank=w.tokens_per_rank, top_k=w.top_k, seed=seed)
    return tr.counts[:, 0]


def policy_rows(w: MPipeWorkload, steps: int = 64, seed: int = 0,
                candidates: Sequence[int] = CHUNK_CANDIDATES) -> List[Dict[str, object]]:
    """Every policy of POLICIES replayed over ``steps`` rows of a synthetic trace for ``w``."""
    cluster = get_cluster(w.cluster)
    rows = rows_per_step(_counts(w, steps, cluster, seed), cluster.num_devices)
    ramp = np.minimum(1.0, np.arange(len(rows)) / max(1.0, len(rows) / 2))
    rows = np.maximum(1, np.round(rows * (w.warmup_from + (1 - w.warmup_from) * ramp)))
    cache: Dict[Tuple[int, int], float] = {}
    exposed: Dict[Tuple[int, int], float] = {}

    def timing(r: int, n: int) -> float:
        if (r, n) not in cache:
            t = simulate_layer(_layer(w, cluster, r), cluster, min(n, r))
            cache[r, n], exposed[r, n] = t.time_s, t.exposed_comm_s
        return cache[r, n]

    def best(r: int) -> int:
        return choose_chunks(_layer(w, cluster, r), cluster, candidates)[0].chunks

    choices: Dict[str, List[int]] = {"no-pipeline": [1] * len(rows)}
    for n in (2, 4, 8):
        choices[f"fixed-{n}"] = [n] * len(rows)
    table: Dict[int, int] = {}
    tutel = []
    for r in rows:
        key = 1 << int(np.ceil(np.log2(max(1, int(r)))))
        if key not in table:
            table[key] = best(int(r))
        tutel.append(table[key])
    choices["tutel-adaptive"] = tutel
    selector = ChunkSelector(_layer(w, cluster, int(rows[0])), cluster, candidates)
    choices["mpipe-online"] = [selector.choose(int(r)) for r in rows]
    choices["oracle"] = [best(int(r)) for r in rows]
    out = []
    base = None
    for policy in POLICIES:
        ns = choices[policy]
        times = np.array([timing(int(r), n) for r, n in zip(rows, ns)])
        hidden = np.array([exposed[int(r), n] for r, n in zip(rows, ns)])
        changes = int(np.sum(np.diff(ns) != 0)) if policy != "oracle" else 0
        recompile = changes * recompile_time_s(w.layers)     # the whole w.layers-layer graph
        # mean per training step: w.layers layers, plus recompiles spread over the steps
        layer_time = float(times.mean() + recompile / (len(rows) * STEPS_PER_ROW * w.layers))
        base = layer_time if policy == "no-pipeline" else base
        mean_n = int(round(float(np.mean(ns))))
        out.append({"evidence": "simulated", "workload": w.name, "method": policy,
                    "cluster": w.cluster, "layer_time_s": layer_time,
                    "speedup_vs_no_pipeline": base / layer_time,
                    "exposed_comm_fraction": float(hidden.sum() / times.sum()),
                    "chunk_changes": changes, "recompile_s": recompile,
                    "chunks_mean": float(np.mean(ns)),
                    "memory_bytes": reuse_memory_bytes(_layer(w, cluster, int(rows.mean())),
                                                       mean_n, "keep")})
    return out


def reuse_rows(w: MPipeWorkload, fractions: Sequence[float] = (1.0, 0.6, 0.35),
               candidates: Sequence[int] = CHUNK_CANDIDATES) -> List[Dict[str, object]]:
    """The (chunks, strategy) :func:`choose_reuse` picks at budgets that are ``fractions``
    of the unchunked keep-all memory, at the balanced row count (tokens x top-k)."""
    cluster = get_cluster(w.cluster)
    shape = _layer(w, cluster, w.tokens_per_rank * w.top_k)
    full = reuse_memory_bytes(shape, 1, "keep")
    out = []
    for frac in fractions:
        best, _ = choose_reuse(shape, cluster, frac * full, candidates)
        out.append({"evidence": "simulated", "workload": w.name, "method": "reuse",
                    "budget_bytes": frac * full, "budget_fraction": frac,
                    "chunks": best.chunks, "strategy": best.strategy,
                    "layer_time_s": best.time_s, "memory_bytes": best.memory_bytes,
                    "slowdown_vs_keep": best.time_s / choose_chunks(shape, cluster,
                                                                   candidates)[0].time_s})
    return out
