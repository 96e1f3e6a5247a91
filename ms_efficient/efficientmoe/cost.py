"""The cluster's cost model of MoE layers: what one token, one expert and one exchange cost.

:class:`CostModel` prices a row of expert compute (``row_time_s``: ``compute_passes`` x the
expert's forward FLOPs at the cluster's peak and efficiency; the backward pass does twice the
forward FLOPs, so ``compute_passes`` = 3), a token in an All-to-All (``bytes_per_token``),
an expert's gradient (``grad_bytes``) and a copy in the balanced layer's dispatch
(``copy_bytes``). The collectives every row of ``bench moe`` is charged with live here too:

    uneven_alltoall_time_s   an All-to-All of per-pair bytes (the largest per-device sum of
                             alpha + bytes / B over each link kind)
    count_exchange_time_s    the AllGather of the int32 routing counts of every rank
    sync_time_s              the all-reduce of the replicas' gradient table

and the two per-step charges of :mod:`~ms_efficient.efficientmoe.balanced_cost` with their
sources: ``DYNAMIC_EXCHANGE_S`` (a count-driven AlltoAllV's dynamic-shape overhead, every
row whose layer uses one) and ``FAST_LEVEL_S`` (the fast level's tables per layer-step).
No MindSpore import here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from ms_efficient.core.cluster import ClusterSpec
from ms_efficient.moe.balance import ops_twin_launches_L

__all__ = ["CostModel", "DYNAMIC_EXCHANGE_S", "FAST_LEVEL_S", "uneven_alltoall_time_s",
           "count_exchange_time_s", "sync_time_s"]

_DTYPE_BYTES = {"fp16": 2, "bf16": 2, "float16": 2, "bfloat16": 2, "fp32": 4, "float32": 4}
COUNT_BYTES = 4   # one routing count in the exchange: int32
# Seconds one count-driven AlltoAllV costs beyond its rows: MindSpore's
# dynamic-shape path (run-time shape inference and allocation of a receive size that is data).
# Measured: 245, 363 and 488 us a call extra (median 363) for one data-dependent shape
# against its static twin, MindSpore 2.10 GRAPH mode on the shared 2-core CPU machine
# (scripts/measure_dynamic_shape.py, docs/results.md). Assumed the same on Ascend, where the
# count matrix must also reach the host (a device-to-host copy that drains the stream, not
# measured here): a lower bound there.
DYNAMIC_EXCHANGE_S = 363e-6
# Seconds the balanced layer's fast level (the per-step tables from the all-gathered counts)
# is charged per layer-step where it runs as one compiled host kernel (a cluster without
# ``op_launch_s``: this CPU, ``moe.fast_level: aot``). What scripts/time_fast_level.py
# measures (layer 0 of the real 16-rank x 32-expert trace, the shared 2-core CPU machine)
# for kernels/cpu/fast_level.cc: 0.08-0.14 ms called directly, 0.12-0.18 ms per call inside
# one GRAPH-mode graph (9 chained calls less one, / 8: what the layer pays in its train
# step), 1.1-1.8 ms as a one-op graph of its own (a whole graph's launch). 0.75 ms (an
# earlier session's one-op figure) is charged: several times the in-graph cost. On a cluster
# with ``op_launch_s`` (the 910B presets) the layer compiles the MindSpore-ops twin, charged
# by its launched kernels instead (:meth:`CostModel.fast_level_time_L`).
FAST_LEVEL_S = 0.75e-3


@dataclass(frozen=True)
class CostModel:
    """What one token and one expert cost on a cluster.

    cluster: the devices and links. hidden: H. ffn_hidden: F, each expert's FFN width.
    dtype: activation/weight dtype ("bf16", "fp16", "fp32"); 2 bytes per value for 16-bit.
    compute_passes: expert FLOPs of a training step per forward FLOP (3: backward = 2x fwd).
    a2a_passes: All-to-Alls per step of the dispatch's size (4: dispatch + combine, fwd + bwd).
    sync_replica_grads: charge the replicas' gradient all-reduce (:func:`sync_time_s`).
    dynamic_exchange_s: seconds each count-driven AlltoAllV costs beyond its rows
        (``DYNAMIC_EXCHANGE_S``, measured).
    fast_level_s: seconds the fast level's tables take per balanced layer-step (between the
        counts' AllGather and the dispatch; :mod:`balanced_cost`), or None (the default):
        what the twin the cluster's target compiles costs (:meth:`fast_level_time_L`);
        ``bench moe --fast-level-ms`` gives a number.
    expert_kind: "mlp" (two matrices, 4 H F FLOPs per row) or "glu" (gated: gate and up
        projections and down, 6 H F); the balanced layer's ``expert_kind``.
    expert_bias: whether the experts carry biases (what a copy sends:
        :func:`~ms_efficient.moe.exchange.copy_rows`).
    """

    cluster: ClusterSpec
    hidden: int
    ffn_hidden: int
    dtype: str = "bf16"
    compute_passes: float = 3.0
    a2a_passes: int = 4
    sync_replica_grads: bool = True
    dynamic_exchange_s: float = DYNAMIC_EXCHANGE_S
    fast_level_s: Optional[float] = None
    expert_kind: str = "mlp"
    expert_bias: bool = True

    def __post_init__(self) -> None:
        if self.expert_kind not in ("mlp", "glu"):
            raise ValueError(f"'expert_kind' must be one of ['mlp', 'glu'], but got "
                             f"{self.expert_kind!r}.")
        if self.fast_level_s is not None and not 0.0 <= self.fast_level_s < float("inf"):
            raise ValueError(f"'fast_level_s' must be a finite number >= 0 seconds, but got "
                             f"{self.fast_level_s!r}.")
        if not self.dynamic_exchange_s >= 0:
            raise ValueError(f"'dynamic_exchange_s' must be >= 0 seconds, but got "
                             f"{self.dynamic_exchange_s!r}.")
        if self.hidden < 1 or self.ffn_hidden < 1:
            raise ValueError(f"'hidden' and 'ffn_hidden' must be positive, but got "
                             f"{self.hidden} and {self.ffn_hidden}.")
        if self.dtype not in _DTYPE_BYTES:
            raise ValueError(f"'dtype' must be one of {sorted(_DTYPE_BYTES)}, but got "
                             f"{self.dtype!r}.")

    def fast_level_time_L(self, trips_L4: Optional[np.ndarray], num_layers: int) -> np.ndarray:
        """Seconds of the fast level per layer-step, float64 [L]: ``fast_level_s`` when given;
        else, on a cluster with ``op_launch_s`` (a target compiling the MindSpore-ops twin,
        kernel by kernel), the twin's launched kernels for the step's loop iterations
        (:func:`~ms_efficient.moe.balance.ops_twin_launches_L` of ``trips_L4``) times
        ``op_launch_s``; else ``FAST_LEVEL_S`` (the compiled host kernel, measured)."""
        if self.fast_level_by_launches:
            return ops_twin_launches_L(trips_L4, num_layers) * float(self.cluster.op_launch_s)
        return np.full(num_layers, FAST_LEVEL_S if self.fast_level_s is None
                       else float(self.fast_level_s))

    @property
    def fast_level_by_launches(self) -> bool:
        """Whether the fast level is charged by the ops twin's launched kernels (no
        ``fast_level_s`` given, a cluster with ``op_launch_s``)."""
        return self.fast_level_s is None and self.cluster.op_launch_s is not None

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    @property
    def flops_per_row(self) -> float:
        """Forward FLOPs of one token through one expert, 2 FLOP per MAC: its H x F1 and F x H
        matmuls (4 H F for a two-matrix expert, 6 H F for a gated one)."""
        return 2.0 * self.expert_params

    @property
    def row_time_s(self) -> float:
        """Seconds of one computed row (token or padding) per training step on one device."""
        return self.cluster.compute_time_s(self.compute_passes * self.flops_per_row, self.dtype)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token's activation in an All-to-All: dtype bytes * H."""
        return self.dtype_bytes * self.hidden

    @property
    def expert_params(self) -> int:
        """Parameters of one expert FFN (biases ignored): 2 H F, gated 3 H F."""
        return (3 if self.expert_kind == "glu" else 2) * self.hidden * self.ffn_hidden

    @property
    def grad_bytes(self) -> int:
        """Bytes of one expert's gradient (dtype)."""
        return self.dtype_bytes * self.expert_params

    @property
    def copy_bytes(self) -> int:
        """Bytes one expert copy takes in the balanced layer's dispatch, each way: its
        parameters with biases as whole rows of H (:func:`~ms_efficient.moe.exchange.
        copy_rows`, what the layer sends)."""
        from ms_efficient.moe.exchange import copy_rows

        return (copy_rows(self.hidden, self.ffn_hidden, self.expert_kind, self.expert_bias)
                * self.bytes_per_token)


def uneven_alltoall_time_s(bytes_DD: np.ndarray, cluster: ClusterSpec):
    """Seconds of an All-to-All where device i sends bytes_DD[i, j] bytes to device j.

    Each device sends to its node peers over ``intra_link`` and to other nodes over
    ``inter_link``, both directions at once; every message costs alpha + bytes / B and the
    messages of one link kind serialize on one device. The time is the largest, over devices,
    of their four sums (intra send, inter send, intra receive, inter receive). For equal
    messages this is :meth:`ClusterSpec.collective_time_s` ("alltoall"). The diagonal is local.
    bytes_DD may carry leading axes ([..., D, D], e.g. one exchange per layer): the result is
    then an array of those leading axes, else a float.
    """
    b = np.asarray(bytes_DD, dtype=np.float64)
    num_devices = cluster.num_devices
    if b.shape[-2:] != (num_devices, num_devices):
        raise ValueError(f"'bytes_DD' must be [..., {num_devices}, {num_devices}], but got "
                         f"{b.shape}.")
    node = np.arange(num_devices) // cluster.devices_per_node
    same = node[:, None] == node[None, :]
    np.fill_diagonal(same, False)
    other = node[:, None] != node[None, :]
    worst = np.zeros(b.shape[:-2])
    for mask, link in ((same, cluster.intra_link), (other, cluster.inter_link)):
        msg = np.where(mask & (b > 0), link.latency_s + b / link.bandwidth_Bps, 0.0)
        worst = np.maximum(worst, np.maximum(msg.sum(axis=-1).max(axis=-1),
                                             msg.sum(axis=-2).max(axis=-1)))
    return float(worst) if worst.ndim == 0 else worst


def count_exchange_time_s(num_ranks: int, counts_per_rank: int, model: CostModel,
                          rank_device: Sequence[int]) -> float:
    """Seconds of the AllGather of ``counts_per_rank`` int32 counts from every rank among the
    ranks' devices (what count-driven dispatch needs before it can size or place its
    messages: E routing counts per rank for the balanced layer and every count-driven
    baseline); 0 for one rank."""
    if num_ranks < 2:
        return 0.0
    return model.cluster.collective_time_s("allgather",
                                           num_ranks * counts_per_rank * COUNT_BYTES,
                                           [int(d) for d in rank_device])


def sync_time_s(rows: int, model: CostModel, devices: Sequence[int]) -> float:
    """Seconds of the replicas' gradient sync of one layer-step: an all-reduce over the
    group's ``devices`` of a table of ``rows`` experts' parameters (``model.grad_bytes``
    each), what :class:`~ms_efficient.moe.balanced_ep.ReplicaGradSum` sends
    (:func:`~ms_efficient.moe.ep_routing.sync_rows`); 0 without rows or when
    ``model.sync_replica_grads`` is off."""
    if rows <= 0 or not model.sync_replica_grads or len(devices) < 2:
        return 0.0
    return model.cluster.collective_time_s("allreduce", rows * model.grad_bytes,
                                           [int(d) for d in devices])


