"""Pipeline or not, on the same devices: the place pass's decision (no MindSpore import).

A pipeline is worth its bubble and its stage-to-stage transfers only against what the same
devices would do without it. :func:`plan_same_devices` prices both on the cluster the pass
plans for, with one cost model (``place.stages`` / ``place.cost`` for the pipelines,
``place.data_parallel`` for the rest, the cluster's collective times for every gradient
synchronisation):

- the non-pipeline plans (``place.data_parallel.replica_plans``): the whole network on one
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
from ms_efficient.place.data_parallel import (ReplicaPlan, best_replica_plan, replica_plans,
                                              usable_bytes)
from ms_efficient.place.planner import TGAConfig
from ms_efficient.place.stages import StagePlan, micro_batch_candidates, plan_stages

__all__ = ["SameDevicesPlan", "sub_cluster", "copy_layouts", "pipeline_candidates",
           "plan_same_devices"]

logger = logging.getLogger(__name__)


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
                        tga_config: Optional[TGAConfig] = None, max_copies: Optional[int] = None):
    """(plans, rows): the best pipeline for every data-parallel degree dp with D // dp >= 2
    devices per copy and dp dividing ``batch`` (every dp when ``batch`` is None), and one row
    per dp tried. micro_batches: fix M per copy (a dp whose copy's batch M does not divide
    is skipped); None tries the divisors of the copy's batch (M = 1 without a batch).
    max_copies: the largest dp to try (None: D // 2)."""
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
                                   layout=layout)
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
                      max_copies: Optional[int] = None) -> SameDevicesPlan:
    """Choose a pipeline (pp x dp) on ``cluster`` or refuse (module docstring).

    graph: the forward graph; order, groups, names: as for ``place.stages.plan_stages``.
    batch: the global batch (samples per step), or None when unknown (every split allowed).
    micro_batches: M per pipeline copy, or None to try the divisors of the copy's batch.
    max_copies: the largest dp of a pipeline (None: D // 2; 1: pipelines only, as when the
    shard pass already splits every stage's batch over its own mesh).
    Raises PassRefused (a ValueError) when the best pipeline is not faster than the best
    non-pipeline plan that fits, or when no pipeline fits (naming what each needs)."""
    baseline = best_replica_plan(replica_plans(graph, cluster, batch))
    plans, rows = pipeline_candidates(graph, order, groups, names, cluster, batch,
                                      micro_batches, tga_config, max_copies)
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
