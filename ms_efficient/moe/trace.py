"""Routing traces: how many tokens each source rank sent to each expert, step by step.

File format (``.npz``, stable; any system can write one to replay it in the MoE planners):

    counts           int64 [step, layer, src_rank, expert]   tokens sent (top-k counted k times)
    top_k            int64 scalar, optional                  experts per token
    hidden           int64 scalar, optional                  model width H (bytes per token = H x dtype)
    tokens_per_rank  int64 scalar, optional                  tokens each source rank routes per step
    steps            int64 [step], optional                  training step of each row

This module has no MindSpore dependency at import. :func:`synthetic_trace` makes traces with
drifting Zipf-like skew, so benchmarks and tests have inputs without a training run;
:func:`group_limited_trace` routes token by token with DeepSeek-V3's sigmoid, group-limited
router and its balancing bias (the router's numpy reference, imported when it is called).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import zipfile

import numpy as np

from ms_efficient.core.fileio import atomic_write_with

__all__ = ["layer_balance", "RoutingTrace", "load_trace", "save_trace", "synthetic_trace", "skewed_trace",
           "group_limited_trace"]

_META = ("top_k", "hidden", "tokens_per_rank")
# Largest token count a trace may hold per step and layer (and the largest metadata value):
# byte sizes the planners derive (tokens x hidden x 8 bytes) then stay far below 2**63.
MAX_TOKENS = 2 ** 40


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
            if value is None:
                continue
            if (isinstance(value, (bool, np.bool_))
                    or not isinstance(value, (int, np.integer, float, np.floating))
                    or not 1 <= value <= MAX_TOKENS or int(value) != value):
                raise ValueError(f"trace '{name}' must be an integer in [1, 2**40], but got "
                                 f"{value!r}.")
        if self.top_k is not None and self.top_k > self.num_experts:
            raise ValueError(f"trace 'top_k' must be <= the number of experts "
                             f"({self.num_experts}, the last axis of 'counts'), but got "
                             f"{self.top_k}.")
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
    """Check a counts array: 4-D, numeric and integral, non-negative, at most
    :data:`MAX_TOKENS` per step and layer; returns it as int64."""
    arr = np.asarray(counts)
    if arr.dtype.kind not in "iuf":
        raise ValueError(f"trace '{name}' must hold integer token counts, but got dtype "
                         f"{arr.dtype}.")
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
    # summed as floats: an int64 or uint64 sum could itself wrap around
    per_row = arr.astype(np.float64).sum(axis=(2, 3))
    if per_row.max() > MAX_TOKENS:
        where = tuple(int(i) for i in np.argwhere(per_row > MAX_TOKENS)[0])
        raise ValueError(f"trace '{name}' must sum to at most 2**40 tokens per step and layer, "
                         f"but got {per_row[where]:.4g} at [step, layer] = {list(where)}.")
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
        loaded = np.load(path, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):
            raise ValueError(f"trace file '{path}' is a single .npy array, not a trace .npz "
                             f"(arrays 'counts' [T, L, R, E] and its metadata).")
        with loaded as data:
            if "counts" not in data:
                raise ValueError(f"trace file '{path}' has no 'counts' array (has "
                                 f"{sorted(data.files)}).")
            if data["counts"].dtype.kind not in "iu":
                raise ValueError(f"trace file '{path}': 'counts' must be an integer array, "
                                 f"but has dtype {data['counts'].dtype}.")
            kwargs = {}
            for name in _META:
                if name in data:
                    value = data[name]
                    if value.size != 1 or value.dtype.kind not in "iub":
                        raise ValueError(f"trace file '{path}': '{name}' must be one integer, "
                                         f"but has shape {list(value.shape)} and dtype "
                                         f"{value.dtype}.")
                    kwargs[name] = int(value.reshape(()))
            # 'iterations': the training iteration of each row, as some recordings name it
            steps = next((data[k] for k in ("steps", "iterations") if k in data), None)
            return RoutingTrace(counts=data["counts"], steps=steps, **kwargs)
    except (OSError, EOFError, zipfile.BadZipFile) as err:     # missing, truncated, not a zip
        raise ValueError(f"trace file '{path}' cannot be read as .npz: {err}") from None
    except ValueError as err:
        if str(err).startswith("trace file"):
            raise
        raise ValueError(f"trace file '{path}': {err}") from None


def synthetic_trace(steps: int = 64, layers: int = 2, ranks: int = 32, experts: int = 64,
                    skew: float = 0.4, drift: float = 0.05, seed: int = 0,
                    tokens_per_rank: int = 4096, top_k: int = 2, hidden: int = 2048,
                    rank_affinity: float = 0.3, persistence: float = 0.95,
                    batch_noise: float = 0.05, step_stride: int = 50) -> RoutingTrace:
    """A routing trace with Zipf-like expert popularity that drifts over time.

    Per layer, expert e has log-popularity  w_t[e] = -skew * log(1 + rank[e]) + u_t[e]:
    rank is a random permutation of 0..E-1 (Zipf exponent ``skew``), u is a mean-reverting
    random walk  u_t = persistence * u_{t-1} + drift * N(0, 1)  (u_0 ~ N(0, drift^2)).
    Each source rank adds a fixed affinity  a[r, e] ~ N(0, rank_affinity^2)  (data locality),
    and each step a transient batch effect  b_t[e] ~ N(0, batch_noise^2)  (what the batch is
    about), shared by the ranks. Routing probabilities are softmax(w_t + b_t + a[r]) capped at
    1 / top_k (an expert appears once per token's top-k); counts[t, l, r] ~
    Multinomial(tokens_per_rank * top_k, p). Rows are recorded every ``step_stride`` training
    steps (the ``steps`` field).

    The defaults are a modelling choice, not a measurement: skewed loads (skew 0.4, the
    hottest of 64 experts gets ~3.6x the mean) that shift gradually (drift 0.05 per row) with
    small step-to-step noise (batch_noise 0.05: one-step MAPE ~7 %); ``batch_noise=0.15``
    gives a noisier workload (one-step MAPE ~15 %).
    Returns a RoutingTrace with counts int64 [steps, layers, ranks, experts].
    """
    if min(steps, layers, ranks, experts, tokens_per_rank, top_k, step_stride) < 1:
        raise ValueError("synthetic_trace sizes must all be positive integers.")
    if top_k > experts or skew < 0 or drift < 0 or not 0 <= persistence < 1:
        raise ValueError(f"synthetic_trace needs top_k <= experts, skew >= 0, drift >= 0 and "
                         f"persistence in [0, 1), but got top_k={top_k}, skew={skew}, "
                         f"drift={drift}, persistence={persistence}.")
    rng = np.random.default_rng(seed)
    base_LE = -skew * np.log1p(np.stack([rng.permutation(experts) for _ in range(layers)]))
    affinity_LRE = rank_affinity * rng.standard_normal((layers, ranks, experts))
    u_LE = drift * rng.standard_normal((layers, experts))
    counts = np.zeros((steps, layers, ranks, experts), dtype=np.int64)
    for t in range(steps):
        if t:
            u_LE = persistence * u_LE + drift * rng.standard_normal((layers, experts))
        batch_LE = batch_noise * rng.standard_normal((layers, experts))
        logits = (base_LE + u_LE + batch_LE)[:, None, :] + affinity_LRE
        p = np.exp(logits - logits.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        for _ in range(4):                           # cap at 1/top_k, renormalise
            p = np.minimum(p, 1.0 / top_k)
            p /= p.sum(axis=-1, keepdims=True)
        counts[t] = rng.multinomial(tokens_per_rank * top_k, p)
    return RoutingTrace(counts=counts, top_k=top_k, hidden=hidden,
                        tokens_per_rank=tokens_per_rank,
                        steps=np.arange(steps, dtype=np.int64) * step_stride)


def skewed_trace(steps: int = 100, seed: int = 0, skew: float = 1.45, layers: int = 24,
                 hidden: int = 2048) -> RoutingTrace:
    """A heavily skewed top-1 routing trace shaped like a real public one (issue 16): 16 ranks
    x ``layers`` layers x 32 experts, top-1, 16,384 tokens per rank, rows 5 training steps
    apart, max/mean expert load ~12.8 and the top-2 experts of a layer carrying a median 57 %
    of its tokens. :func:`synthetic_trace` with Zipf exponent ``skew``: 1.45 gives max/mean
    13.2 and a median top-2 share of 56 % (seed 0; 1.2 gives 10.3 and 47 %, 1.5 13.9 and
    59 %). Sweep ``skew`` for milder or harsher profiles.
    Returns a RoutingTrace with counts int64 [steps, layers, 16, 32]."""
    return synthetic_trace(steps=steps, layers=layers, ranks=16, experts=32, skew=skew,
                           seed=seed, tokens_per_rank=16384, top_k=1, hidden=hidden,
                           step_stride=5)


def group_limited_trace(steps: int = 40, layers: int = 58, ranks: int = 64,
                        experts: int = 256, top_k: int = 8, num_groups: int = 8,
                        topk_groups: int = 4, tokens_per_rank: int = 4096, hidden: int = 7168,
                        skew: float = 0.5, drift: float = 0.05, token_types: int = 512,
                        type_spread: float = 1.0, rank_affinity: float = 1.0,
                        bias_update_speed: float = 0.001, step_stride: int = 10,
                        burn_in: int = 60, seed: int = 0) -> RoutingTrace:
    """A routing trace of DeepSeek-V3's shape, routed token by token by its router.

    Defaults: DeepSeek-V3's MoE layers (58 of its 61 layers, 256 routed experts, top-8, 8
    groups of 32 of which a token may use 4, hidden 7168; DeepSeek-V3 technical report,
    DeepSeek-AI 2024, sec. 2.1.2 and 4.2) on 64 expert-parallel ranks (its training used 64-way
    expert parallelism over 8 nodes, sec. 3.2), 4,096 tokens per rank per step. With 64 ranks on nodes of 8 devices, a group's
    32 experts are one node's (4 per device), so the group limit is V3's node limit.

    Routing model (a modelling choice, not a recording): the tokens of a layer come in
    ``token_types`` kinds; kind k has router logits x_k[e] = p_t[e] + type_spread * z_k[e]
    (z fixed, N(0, 1)), where p_t[e] = -skew * log(1 + rank[e]) + u_t[e] is the experts'
    popularity (rank: a random permutation; u: a mean-reverting random walk of step ``drift``,
    as :func:`synthetic_trace`). Every kind is routed by
    :func:`~ms_efficient.moe.routing.route_reference` with
    ``RouterConfig(score="sigmoid", num_groups, topk_groups)`` on s = sigmoid(x) plus the
    layer's balancing bias b: its groups scored by the sum of their two best, the best
    ``topk_groups`` kept, the top-k of those chosen. Each source rank draws its tokens'
    kinds from its own mix (softmax of ``rank_affinity`` * N(0, 1) over the kinds: data
    locality), a multinomial of ``tokens_per_rank`` every row. After every row the bias moves
    by V3's auxiliary-loss-free rule, b_e += gamma * sign(mean load - load_e), with gamma =
    ``bias_update_speed`` x ``step_stride`` (the row stands for that many training steps;
    :func:`~ms_efficient.moe.routing.bias_update_reference`). Rows are ``step_stride``
    training steps apart. ``burn_in`` rows are routed (the bias and the walk move) but not
    recorded: a trace from the middle of a run, its bias already near balance, rather than
    from the first step, where every token picks the same few experts.

    Returns a RoutingTrace with counts int64 [steps, layers, ranks, experts] (each rank's
    row sums to tokens_per_rank x top_k; no token uses more than ``topk_groups`` groups).
    Imports :mod:`ms_efficient.moe.routing` (and so MindSpore) when called.
    """
    from ms_efficient.moe.routing import (RouterConfig, bias_update_reference,
                                          route_reference)

    if min(steps, layers, ranks, experts, top_k, num_groups, topk_groups, tokens_per_rank,
           token_types, step_stride) < 1 or burn_in < 0:
        raise ValueError("group_limited_trace sizes must all be positive integers (burn_in "
                         ">= 0).")
    if skew < 0 or drift < 0 or type_spread < 0 or rank_affinity < 0 or bias_update_speed < 0:
        raise ValueError(f"group_limited_trace needs skew, drift, type_spread, rank_affinity "
                         f"and bias_update_speed >= 0, but got {skew}, {drift}, "
                         f"{type_spread}, {rank_affinity} and {bias_update_speed}.")
    config = RouterConfig(score="sigmoid", num_groups=num_groups, topk_groups=topk_groups,
                          bias_update_speed=bias_update_speed)
    config.check(experts, top_k)       # groups divide E, top-k fits the kept groups
    rng = np.random.default_rng(seed)
    base_LE = -skew * np.log1p(np.stack([rng.permutation(experts) for _ in range(layers)]))
    kinds_LKE = type_spread * rng.standard_normal((layers, token_types, experts))
    mix = rank_affinity * rng.standard_normal((layers, ranks, token_types))
    mix_LRK = np.exp(mix - mix.max(axis=-1, keepdims=True))
    mix_LRK /= mix_LRK.sum(axis=-1, keepdims=True)
    u_LE = drift * rng.standard_normal((layers, experts))
    bias_LE = np.zeros((layers, experts), dtype=np.float32)
    gamma = bias_update_speed * step_stride
    counts = np.zeros((burn_in + steps, layers, ranks, experts), dtype=np.int64)
    for t in range(burn_in + steps):
        if t:
            u_LE = 0.95 * u_LE + drift * rng.standard_normal((layers, experts))
        tokens_LRK = rng.multinomial(tokens_per_rank, mix_LRK).astype(np.float64)
        for layer in range(layers):
            logits = base_LE[layer] + u_LE[layer] + kinds_LKE[layer]
            _, ids_KK = route_reference(logits, config, top_k, bias_E=bias_LE[layer])
            chosen_KE = np.zeros((token_types, experts))
            np.put_along_axis(chosen_KE, ids_KK, 1.0, axis=1)
            # float64 BLAS: every sum is an integer far below 2**53, so exact
            counts[t, layer] = np.rint(tokens_LRK[layer] @ chosen_KE).astype(np.int64)
            if gamma:
                bias_LE[layer] = bias_update_reference(bias_LE[layer],
                                                       counts[t, layer].sum(axis=0), gamma)
    return RoutingTrace(counts=counts[burn_in:], top_k=top_k, hidden=hidden,
                        tokens_per_rank=tokens_per_rank,
                        steps=(burn_in + np.arange(steps, dtype=np.int64)) * step_stride)


def layer_balance(counts_LRE: np.ndarray, dropped_L: Optional[np.ndarray] = None,
                  device_rows_LW: Optional[np.ndarray] = None) -> list:
    """Per MoE layer, the balance of one step's routing (what every train row of
    ``metrics.jsonl`` carries): tokens per expert, max over mean and coefficient of variation
    (std / mean), experts that got no token (dead), the rows dropped and, given the rows each
    device computed, the same per device.

    counts_LRE: int [L, R, E] rows each source rank routed to each expert (top-k counted
    k times). dropped_L: int [L] rows dropped, or None. device_rows_LW: int [L, W] rows every
    device of the expert-parallel group computed, or None. Returns one dict per layer."""
    counts = np.asarray(counts_LRE, dtype=np.int64)
    per_expert = counts.sum(axis=1).astype(np.float64)                  # [L, E]
    mean = np.maximum(per_expert.mean(axis=1), 1e-12)
    devices = None if device_rows_LW is None else np.asarray(device_rows_LW, dtype=np.int64)
    out = []
    for layer in range(counts.shape[0]):
        row = {"layer": layer,
               "expert_max_over_mean": round(float(per_expert[layer].max() / mean[layer]), 4),
               "expert_cv": round(float(per_expert[layer].std() / mean[layer]), 4),
               "dead_experts": int((per_expert[layer] == 0).sum())}
        if dropped_L is not None:
            row["dropped"] = int(dropped_L[layer])
        if devices is not None:
            rows = devices[layer]
            device_mean = max(float(rows.mean()), 1e-12)
            row.update({"rows_per_device": rows.tolist(),
                        "device_max_over_mean": round(float(rows.max()) / device_mean, 4),
                        "device_cv": round(float(rows.std()) / device_mean, 4)})
        out.append(row)
    return out
