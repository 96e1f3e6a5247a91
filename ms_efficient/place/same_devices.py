"""Pipeline or not, on the same devices: the place pass's decision (no MindSpore import).

A pipeline is worth its bubble and its stage-to-stage transfers only against what the same
devices would do without it. :func:`plan_same_devices` prices both on the cluster the pass
plans for, with one cost model (``place.stages`` / ``place.cost`` for the pipelines,
the replica plans below for the rest, the cluster's collective times for every gradient
synchronisation):

- the non-pipeline plans (:func:`replica_plans`): the whole network on one
  device, and data parallelism over n devices, plain or ZeRO-1/2/3, for every n <= D that
  divides the batch; the baseline is the fastest that fits a device's usable memory;
- the pipelines, pp x dp jointly: for every dp >= 1 that divides the batch, dp copies of a
  pipeline on D // dp devices each (``place.stages.plan_stages`` with ``replicas=dp``: TGA
  and the min-max contiguous splits into 2 .. D // dp stages, every micro-batch count that
  divides the copy's batch), so every pp x dp <= D with pp >= 2 is a candidate; its step is
  the copy's simulated pipeline step on 1 / dp of the batch plus the slowest stage's gradient
  all-reduce over its dp copies; on several nodes the copies are laid out two ways
  (:func:`copy_layouts`).

The decision, both held to the same usable bytes per device (``device_memory_bytes x
memory_fraction``):

- a pipeline that fits and is faster than the baseline is chosen ("faster");
- when no non-pipeline plan fits, the fastest pipeline that fits is chosen ("memory");
- otherwise :class:`PassRefused`, saying by how much the best pipeline loses ("pipeline 4x2
  takes 1.37x the step time of data parallel over 8 devices"), or that nothing fits.

The non-pipeline plans in detail.

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
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ms_efficient.core.cluster import ClusterSpec
from ms_efficient.core.registry import PassRefused
from ms_efficient.core.units import format_size
from ms_efficient.graph.opgraph import OpGraph
from ms_efficient.place.cost import ZERO_LEVELS, check_zero as _check_zero, gradient_sync_time_s
from ms_efficient.place.planner import TGAConfig
from ms_efficient.place.problem import PlacementOptions
from ms_efficient.place.stages import StagePlan, micro_batch_candidates, plan_stages

__all__ = ["ZERO_LEVELS", "ReplicaPlan", "state_bytes_per_device", "gradient_sync_time_s",
           "replica_plan", "replica_plans", "best_replica_plan", "usable_bytes",
           "SameDevicesPlan", "sub_cluster", "copy_layouts", "pipeline_candidates",
           "plan_same_devices"]

logger = logging.getLogger(__name__)


def usable_bytes(cluster: ClusterSpec, options: Optional[PlacementOptions] = None) -> float:
    """Bytes a plan may use on one device: ``device_memory_bytes x memory_fraction`` (the
    capacity ``place.problem.build_problem`` gives every device)."""
    opts = options or PlacementOptions()
    return float(cluster.device_memory_bytes) * opts.memory_fraction


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
                 prices=None, batch_share: float = 1.0) -> ReplicaPlan:
    """Price the network ``graph`` (train-step or forward graph) replicated over devices
    ``0 .. devices-1`` of ``cluster`` at ZeRO level ``zero`` (module docstring).
    prices: ``op_prices(graph, cluster)`` when the caller has it (they are the same).
    batch_share: the share of the graph's batch these devices run together, in (0, 1] (1 /
    the data-parallel rows of a shard mesh that each device stands for): compute apart from
    launch overheads and activations scale by it, parameters do not."""
    from ms_efficient.place.stages import op_prices

    if isinstance(devices, bool) or not isinstance(devices, int) or \
            not 1 <= devices <= cluster.num_devices:
        raise ValueError(f"'devices' must be an int in [1, {cluster.num_devices}] (the devices "
                         f"of {cluster.name!r}), but got {devices!r}.")
    if not 0 < batch_share <= 1:
        raise ValueError(f"'batch_share' must be in (0, 1], but got {batch_share!r}.")
    p = prices if prices is not None else op_prices(graph, cluster)
    on = p.forward
    h = p.overhead_s[on]
    share = batch_share / devices
    compute = float((((p.forward_s[on] - h) + (p.backward_s[on] - h)) * share + 2 * h).sum())
    params = float(p.param_bytes[on].sum())
    memory = (state_bytes_per_device(params, p.param_state_factor, devices, zero)
              + float(p.output_bytes[on].sum()) * share)
    if zero == 3 and devices > 1:        # one operator's weights gathered whole while it runs
        memory += float(p.param_bytes[on].max(initial=0.0)) * (1.0 - 1.0 / devices)
    sync = gradient_sync_time_s(cluster, range(devices), params, zero)
    return ReplicaPlan(devices=devices, zero=zero, compute_s=compute, sync_s=sync,
                       memory_bytes=memory, capacity_bytes=usable_bytes(cluster))


def replica_plans(graph: OpGraph, cluster: ClusterSpec,
                  batch: Optional[int] = None, batch_share: float = 1.0) -> List[ReplicaPlan]:
    """Every non-pipeline plan on ``cluster``: ``n`` replicas for each n in 1..D that divides
    ``batch`` (every n when the batch is not known), at each ZeRO level (level > 0 only for
    n > 1); ``batch_share`` as for :func:`replica_plan`."""
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
            out.append(replica_plan(graph, cluster, n, zero, prices, batch_share))
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

def sub_cluster(cluster: ClusterSpec, devices: int) -> ClusterSpec:
    """The first ``devices`` devices of ``cluster`` as a cluster of their own (the devices of
    one pipeline copy): one node of ``devices`` when they fit a node, else whole nodes (the
    count rounded down to a multiple of ``devices_per_node``)."""
    if isinstance(devices, bool) or not isinstance(devices, int) or \
            not 1 <= devices <= cluster.num_devices:
        raise ValueError(f"'devices' must be an int in [1, {cluster.num_devices}], but got "
                         f"{devices!r}.")
    per = cluster.devices_per_node
    if devices <= per:
        return cluster.with_overrides(nodes=1, devices_per_node=devices,
                                      name=f"{cluster.name}[:{devices}]")
    nodes = devices // per
    return cluster.with_overrides(nodes=nodes, name=f"{cluster.name}[:{nodes * per}]")


def copy_layouts(cluster: ClusterSpec, dp: int) -> List[Tuple[str, ClusterSpec, Any]]:
    """Where ``dp`` copies of a pipeline can sit on ``cluster``: (name, the cluster one copy
    sees, copy_device(d, r) -> device of ``cluster``), for ``plan_stages``.

    - "each stage's copies on neighbouring devices" (dp dividing devices_per_node): every node
      holds ``held = devices_per_node // dp`` devices of each copy, device d of copy r on node
      ``d // held`` at ``(d % held) * dp + r``, so a stage's all-reduce stays inside one node
      and on one node stage s holds devices ``s * dp .. s * dp + dp - 1``, MindSpore's rank
      order for ``pipeline_stage`` (rank // (device_num / stages));
    - "each copy on neighbouring devices": copy r holds devices ``r * k .. r * k + k - 1``
      (k = D // dp, :func:`sub_cluster`), a copy's stages inside a node when it fits one and
      each stage's all-reduce across the copies; tried when the first does not apply, or on
      several nodes (on one node both see the same links: the first is kept)."""
    out: List[Tuple[str, ClusterSpec, Any]] = []
    per = cluster.devices_per_node
    if dp > 1 and per % dp == 0:
        held = per // dp
        spread = cluster.with_overrides(devices_per_node=held,
                                        name=f"{cluster.name}[one in {dp}]")
        out.append(("each stage's copies on neighbouring devices", spread,
                    lambda d, r: (d // held) * per + (d % held) * dp + r))
    if not out or cluster.nodes > 1:
        copy = sub_cluster(cluster, cluster.num_devices // dp)
        k = copy.num_devices
        out.append(("each copy on neighbouring devices", copy, lambda d, r: d + r * k))
    return out


@dataclass
class SameDevicesPlan:
    """The place pass's choice on ``cluster``.

    pipeline: the chosen pipeline (``StagePlan``: ``len(stages)`` stages x ``replicas``
    copies). baseline: the best non-pipeline plan on the same devices. reason: "faster" (the
    pipeline beats the baseline, both within memory) or "memory" (no non-pipeline plan fits).
    ratio: pipeline step / baseline step (< 1 when the pipeline is faster).
    candidates: one row per dp tried: ``pp``, ``dp``, ``micro_batches``, ``step_time_s``,
    ``feasible`` (or ``error`` when that dp cannot hold the network).
    """

    pipeline: StagePlan
    baseline: ReplicaPlan
    reason: str
    ratio: float
    cluster: str
    candidates: List[Dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        """What the plan records: the baseline (kind, devices, ZeRO level, time, memory), the
        pp x dp chosen, the ratio and why."""
        return {"baseline": self.baseline.to_dict(),
                "pp": len(self.pipeline.stages), "dp": self.pipeline.replicas,
                "layout": self.pipeline.layout,
                "shape": self.pipeline.shape, "step_time_s": float(self.pipeline.step_time_s),
                "pipeline_s": float(self.pipeline.pipeline_s),
                "sync_s": float(self.pipeline.sync_s),
                "ratio_to_baseline": float(self.ratio), "reason": self.reason,
                "candidates": list(self.candidates)}


def pipeline_candidates(graph: OpGraph, order: Sequence[int], groups: np.ndarray,
                        names: Sequence[str], cluster: ClusterSpec, batch: Optional[int],
                        micro_batches: Optional[int] = None,
                        tga_config: Optional[TGAConfig] = None, max_copies: Optional[int] = None,
                        batch_share: float = 1.0):
    """(plans, rows): the best pipeline for every data-parallel degree dp with D // dp >= 2
    devices per copy and dp dividing ``batch`` (every dp when ``batch`` is None), and one row
    per dp tried. micro_batches: fix M per copy (a dp whose copy's batch M does not divide
    is skipped); None tries the divisors of the copy's batch (M = 1 without a batch).
    max_copies: the largest dp to try (None: D // 2). batch_share: the share of the graph's
    batch the whole cluster runs (``plan_stages``)."""
    plans: List[StagePlan] = []
    rows: List[Dict[str, Any]] = []
    top = cluster.num_devices // 2 if max_copies is None else min(max_copies,
                                                                  cluster.num_devices // 2)
    for dp in range(1, top + 1):
        if batch is not None and batch % dp:
            continue
        share = None if batch is None else batch // dp
        if micro_batches:
            if share is not None and share % micro_batches:
                continue
            ms = [micro_batches]
        else:
            ms = [1] if share is None else micro_batch_candidates(share)
        for layout, copy, copy_device in copy_layouts(cluster, dp):
            if copy.num_devices < 2:
                continue
            try:
                plan = plan_stages(graph, order, groups, names, copy, ms, tga_config,
                                   replicas=dp, whole=cluster, copy_device=copy_device,
                                   layout=layout, batch_share=batch_share)
            except PassRefused:
                raise
            except ValueError as err:       # a copy's devices cannot hold the network at all
                rows.append({"dp": dp, "layout": layout, "devices_per_copy": copy.num_devices,
                             "error": str(err)})
                continue
            plans.append(plan)
            rows.append({"pp": len(plan.stages), "dp": dp, "layout": plan.layout,
                         "micro_batches": plan.micro_batches,
                         "step_time_s": float(plan.step_time_s), "sync_s": float(plan.sync_s),
                         "feasible": bool(plan.feasible)})
    return plans, rows


def plan_same_devices(graph: OpGraph, order: Sequence[int], groups: np.ndarray,
                      names: Sequence[str], cluster: ClusterSpec, batch: Optional[int],
                      micro_batches: Optional[int] = None,
                      tga_config: Optional[TGAConfig] = None,
                      max_copies: Optional[int] = None,
                      batch_share: float = 1.0) -> SameDevicesPlan:
    """Choose a pipeline (pp x dp) on ``cluster`` or refuse (module docstring).

    graph: the forward graph; order, groups, names: as for ``place.stages.plan_stages``.
    batch: the global batch (samples per step), or None when unknown (every split allowed).
    micro_batches: M per pipeline copy, or None to try the divisors of the copy's batch.
    max_copies: the largest dp of a pipeline (None: D // 2; 1: pipelines only, as when the
    shard pass already splits every stage's batch over its own mesh). batch_share: the
    share of the graph's batch the cluster runs (1 / the data-parallel rows of shard's mesh
    when each device of ``cluster`` stands for one mesh), for the baseline and every
    pipeline alike.
    Raises PassRefused (a ValueError) when the best pipeline is not faster than the best
    non-pipeline plan that fits, or when no pipeline fits (naming what each needs)."""
    baseline = best_replica_plan(replica_plans(graph, cluster, batch, batch_share))
    plans, rows = pipeline_candidates(graph, order, groups, names, cluster, batch,
                                      micro_batches, tga_config, max_copies, batch_share)
    cap = usable_bytes(cluster)
    fits = [p for p in plans if p.feasible]
    if not fits:
        need = min((max(s["memory_bytes"] for s in p.stages) for p in plans), default=None)
        detail = ("no pp x dp split of the blocks could be built: "
                  + "; ".join(r["error"].rstrip(".") for r in rows if "error" in r)) if need is None else (
            f"the leanest needs {format_size(need)} on its fullest device")
        if baseline.feasible:
            raise PassRefused(
                f"place: no pipeline of the {len(names)} blocks fits the usable memory of "
                f"{cluster.name!r} ({format_size(cap)} per device; {detail}), while "
                f"{baseline.label} does ({baseline.step_time_s * 1e3:.4g} ms per step, "
                f"{format_size(baseline.memory_bytes)} per device); no pipeline stage to set.")
        raise PassRefused(
            f"place: neither a pipeline nor data parallelism fits the usable memory of "
            f"{cluster.name!r} ({format_size(cap)} per device): {detail}; the leanest "
            f"non-pipeline plan, {baseline.label}, needs {format_size(baseline.memory_bytes)}; "
            f"shard or recompute first.")
    best = min(fits, key=lambda p: (p.step_time_s, p.replicas))
    ratio = best.step_time_s / baseline.step_time_s
    shape = f"pipeline {best.shape} ({len(best.stages)} stages x {best.replicas} " \
            f"data-parallel {'copy' if best.replicas == 1 else 'copies'}, " \
            f"{best.micro_batches} micro-batch{'' if best.micro_batches == 1 else 'es'})"
    if baseline.feasible and best.step_time_s >= baseline.step_time_s:
        raise PassRefused(
            f"place: pipelining does not pay on {cluster.name!r}: the best {shape} takes "
            f"{ratio:.3g}x the step time of {baseline.label} ({best.step_time_s * 1e3:.4g} ms "
            f"against {baseline.step_time_s * 1e3:.4g} ms per step, "
            f"{(best.step_time_s - baseline.step_time_s) * 1e3:.4g} ms slower; both within "
            f"{format_size(cap)} usable per device); no pipeline stage to set.")
    reason = "faster" if baseline.feasible else "memory"
    logger.info("place: %s, %.4g ms per step, %.3gx %s (%s)", shape, best.step_time_s * 1e3,
                ratio, baseline.label, "faster" if reason == "faster" else
                f"which needs {format_size(baseline.memory_bytes)} > {format_size(cap)}")
    return SameDevicesPlan(pipeline=best, baseline=baseline, reason=reason, ratio=ratio,
                           cluster=cluster.name, candidates=rows)
