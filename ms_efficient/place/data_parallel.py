"""The non-pipeline ways to use a cluster's devices: data parallelism, plain or ZeRO-sharded
(no MindSpore import).

The ``place`` pass compares its pipelines with the best of these on the SAME devices, not with
one device. Everything is priced by the cost model every pass shares: the per-operator prices
of ``place.stages.op_prices`` (one device, whole batch) and the cluster's collective times
(``ClusterSpec.collective_time_s``, the ring formulas of ``core.collectives``).

Data parallelism over ``n`` devices (each replica runs the whole network on batch / n):

- compute, seconds: ``sum_ops (f - h) / n + h + (b - h) / n + h`` with ``f, b`` an operator's
  forward and backward seconds on the whole batch and ``h`` its launch overhead, paid in full
  whatever the batch share (``OpPrices.overhead_s``); with ``n = 1`` it is the unoptimised step.
- gradient synchronisation, seconds (:func:`gradient_sync_time_s`, not overlapped with
  compute): ZeRO level 0 all-reduces the gradients; levels 1 and 2 reduce-scatter them and
  all-gather the updated weights; level 3 gathers the weights twice more (forward and
  backward), as in Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
  Parameter Models" (SC 2020), sec. 5 and 7, and the shard pass's cost model.
- memory per device, bytes (:func:`state_bytes_per_device` + activations / n): the place cost
  model's parameter state, ``param_state_factor`` (4) bytes per parameter byte read as one
  for the weights, one for the gradients and the rest (Adam m and v) for the optimizer states;
  ZeRO level z shards over the n replicas the optimizer states (z >= 1), the gradients
  (z >= 2) and the weights (z = 3); every stashed forward output on 1/n of the batch. ZeRO-3
  also holds, while an operator runs, the rest of its weights gathered from the other
  replicas (the largest operator's, ``(1 - 1/n) x`` its parameter bytes; ZeRO paper sec. 5.3:
  parameters are broadcast to all replicas only for the layer being computed).

A plan fits when that is within the usable memory of a device, ``device_memory_bytes x
PlacementOptions.memory_fraction``, the capacity the pipeline plans are held to.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from ms_efficient.core.cluster import ClusterSpec
from ms_efficient.graph.opgraph import OpGraph
from ms_efficient.place.problem import PlacementOptions

__all__ = ["ZERO_LEVELS", "ReplicaPlan", "state_bytes_per_device", "gradient_sync_time_s",
           "replica_plan", "replica_plans", "best_replica_plan", "usable_bytes"]

logger = logging.getLogger(__name__)

ZERO_LEVELS = (0, 1, 2, 3)


def usable_bytes(cluster: ClusterSpec, options: Optional[PlacementOptions] = None) -> float:
    """Bytes a plan may use on one device: ``device_memory_bytes x memory_fraction`` (the
    capacity ``place.problem.build_problem`` gives every device)."""
    opts = options or PlacementOptions()
    return float(cluster.device_memory_bytes) * opts.memory_fraction


def _check_zero(zero: int) -> None:
    if isinstance(zero, bool) or zero not in ZERO_LEVELS:
        raise ValueError(f"'zero' must be one of {list(ZERO_LEVELS)}, but got {zero!r}.")


def state_bytes_per_device(param_bytes: float, state_factor: float, devices: int,
                           zero: int) -> float:
    """Parameter state one of ``devices`` data-parallel replicas keeps, bytes.

    param_bytes: parameter bytes of the network (or stage); state_factor: resident bytes per
    parameter byte (``PlacementOptions.param_state_factor``, >= 2: weights 1, gradients 1,
    optimizer states the rest); zero: the ZeRO level (module docstring)."""
    _check_zero(zero)
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"'devices' must be an int >= 1, but got {devices!r}.")
    if state_factor < 2:
        raise ValueError(f"'state_factor' must be >= 2 (weights and gradients), but got "
                         f"{state_factor}.")
    weights, grads, optim = 1.0, 1.0, state_factor - 2.0
    n = float(devices)
    return param_bytes * (weights / (n if zero >= 3 else 1.0) + grads / (n if zero >= 2 else 1.0)
                          + optim / (n if zero >= 1 else 1.0))


def gradient_sync_time_s(cluster: ClusterSpec, devices: Sequence[int], grad_bytes: float,
                         zero: int = 0) -> float:
    """Seconds to synchronise ``grad_bytes`` of gradients (as many bytes of weights) over the
    data-parallel replicas on ``devices`` (ids of ``cluster``) at ZeRO level ``zero``: level 0
    one all-reduce; 1 and 2 a reduce-scatter and an all-gather of the updated weights; 3 a
    reduce-scatter and two all-gathers (module docstring). One device: 0."""
    _check_zero(zero)
    devices = list(devices)
    if len(devices) < 2 or grad_bytes <= 0:
        return 0.0
    if zero == 0:
        return cluster.collective_time_s("allreduce", grad_bytes, devices)
    gathers = 2 if zero == 3 else 1
    return (cluster.collective_time_s("reduce_scatter", grad_bytes, devices)
            + gathers * cluster.collective_time_s("allgather", grad_bytes, devices))


@dataclass(frozen=True)
class ReplicaPlan:
    """One non-pipeline plan: the whole network replicated on ``devices`` devices.

    zero: ZeRO level (0 = plain data parallel). step_time_s = compute_s + sync_s, seconds per
    training step of the global batch. memory_bytes: per device (parameter state +
    activations). capacity_bytes: usable bytes per device. feasible: memory within capacity.
    """

    devices: int
    zero: int
    compute_s: float
    sync_s: float
    memory_bytes: float
    capacity_bytes: float

    @property
    def step_time_s(self) -> float:
        return self.compute_s + self.sync_s

    @property
    def feasible(self) -> bool:
        return self.memory_bytes <= self.capacity_bytes

    @property
    def label(self) -> str:
        """"one device", "data parallel over 8 devices", "ZeRO-1 data parallel over 8 devices"."""
        if self.devices == 1:
            return "one device"
        kind = "data parallel" if self.zero == 0 else f"ZeRO-{self.zero} data parallel"
        return f"{kind} over {self.devices} devices"

    def to_dict(self) -> Dict[str, Any]:
        return {"kind": "data_parallel" if self.devices > 1 else "one_device",
                "label": self.label, "devices": self.devices, "zero": self.zero,
                "step_time_s": float(self.step_time_s), "compute_s": float(self.compute_s),
                "sync_s": float(self.sync_s), "memory_bytes": float(self.memory_bytes),
                "capacity_bytes": float(self.capacity_bytes), "feasible": bool(self.feasible),
                "evidence": "model"}


def replica_plan(graph: OpGraph, cluster: ClusterSpec, devices: int, zero: int = 0,
                 prices=None) -> ReplicaPlan:
    """Price the network ``graph`` (train-step or forward graph) replicated over devices
    ``0 .. devices-1`` of ``cluster`` at ZeRO level ``zero`` (module docstring).
    prices: ``op_prices(graph, cluster)`` when the caller has it (they are the same)."""
    from ms_efficient.place.stages import op_prices

    if isinstance(devices, bool) or not isinstance(devices, int) or \
            not 1 <= devices <= cluster.num_devices:
        raise ValueError(f"'devices' must be an int in [1, {cluster.num_devices}] (the devices "
                         f"of {cluster.name!r}), but got {devices!r}.")
    p = prices if prices is not None else op_prices(graph, cluster)
    on = p.forward
    h = p.overhead_s[on]
    compute = float((((p.forward_s[on] - h) + (p.backward_s[on] - h)) / devices + 2 * h).sum())
    params = float(p.param_bytes[on].sum())
    memory = (state_bytes_per_device(params, p.param_state_factor, devices, zero)
              + float(p.output_bytes[on].sum()) / devices)
    if zero == 3 and devices > 1:        # one operator's weights gathered whole while it runs
        memory += float(p.param_bytes[on].max(initial=0.0)) * (1.0 - 1.0 / devices)
    sync = gradient_sync_time_s(cluster, range(devices), params, zero)
    return ReplicaPlan(devices=devices, zero=zero, compute_s=compute, sync_s=sync,
                       memory_bytes=memory, capacity_bytes=usable_bytes(cluster))


def replica_plans(graph: OpGraph, cluster: ClusterSpec,
                  batch: Optional[int] = None) -> List[ReplicaPlan]:
    """Every non-pipeline plan on ``cluster``: ``n`` replicas for each n in 1..D that divides
    ``batch`` (every n when the batch is not known), at each ZeRO level (level > 0 only for
    n > 1)."""
    from ms_efficient.place.stages import op_prices

    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int)
                              or batch < 1):
        raise ValueError(f"'batch' must be an int >= 1 or None, but got {batch!r}.")
    prices = op_prices(graph, cluster)
    out = []
    for n in range(1, cluster.num_devices + 1):
        if batch is not None and batch % n:
            continue
        for zero in ZERO_LEVELS if n > 1 else (0,):
            out.append(replica_plan(graph, cluster, n, zero, prices))
    return out


def best_replica_plan(plans: Sequence[ReplicaPlan]) -> ReplicaPlan:
    """The fastest plan that fits; when none fits, the one with the least memory per device.
    Ties: the lower ZeRO level (ring reduce-scatter + all-gather costs what an all-reduce
    does, so ZeRO-1 ties plain data parallelism and is chosen only for memory), then fewer
    devices."""
    if not plans:
        raise ValueError("best_replica_plan: no plan to choose from.")
    fits = [p for p in plans if p.feasible]
    if fits:
        return min(fits, key=lambda p: (p.step_time_s, p.zero, p.devices))
    return min(plans, key=lambda p: (p.memory_bytes, p.step_time_s, p.zero, p.devices))
