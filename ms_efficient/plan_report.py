"""One report for all the passes of an ``optimize()`` call: the simulated step and the peak
bytes of every device once memopt, shard and place have all planned the network.

Every figure comes from the one cost model the passes share (``place.stages.op_prices``,
run by the shared event simulator): each device's share of the network
(``memopt.profile.device_shares``: its pipeline stage after place, its split of every
operator and its parameter state after shard) is profiled by its Cells and one step of it is
simulated with memopt's plan (``memopt.env.evaluate``; all-keep when memopt did not run).

Step time, seconds:
- without place: the device's simulated busy time (its Cells, recomputation included, and
  the operators outside them) plus shard's communication per step (``summary.comm_time_s``
  of the shard plan; the shard cost model does not overlap collectives with compute);
- with place: place's simulated pipeline step (bubble and stage-to-stage transfers
  included) plus the change of the 1F1B step ``F(b) = sum_s b_s / M + (M - 1) max_s b_s / M``
  when every stage's busy time ``b_s`` (place's ``stage_time_s``) grows or shrinks by what
  shard's split and memopt's recomputation change on it, plus shard's communication.
A pass that refused (``optimize`` records ``{"refused": reason}``) is not in
``context.plans`` and changes no figure; ``refused`` names it. With no pass that changes
anything (every one refused) the report is the unoptimised price: ``step_time_s`` and
``peak_memory_bytes`` equal ``unoptimised``'s.
Peak bytes: the simulated peak of each device's share (parameter state, the activations it
keeps for backward, in-flight micro-batches under 1F1B after place); ``devices`` lists the
cluster devices each figure applies to (a stage's in every data-parallel copy of place's
pipeline). ``devices_needed``: shard's mesh size x place's stages x its copies (``dp``), at
most the cluster's devices (place plans its stages on the meshes the cluster holds and refuses
when shard's mesh leaves no room for two; plans that need more raise ValueError).
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence

import numpy as np

__all__ = ["combined_report", "pipeline_step_s"]


def pipeline_step_s(stage_busy_s: Sequence[float], micro_batches: int) -> float:
    """1F1B / GPipe step of stages busy ``stage_busy_s`` seconds each per step (all M
    micro-batches) without transfers: ``sum(b) / M + (M - 1) * max(b) / M`` seconds."""
    b = np.asarray(stage_busy_s, dtype=np.float64)
    m = int(micro_batches)
    return float(b.sum() / m + (m - 1) * b.max() / m)


def _units(context, plans: Dict[str, Any]) -> List[str]:
    """The Cells a device's share is profiled by: memopt's, else the repeated blocks, else
    the Cells of the largest sequence (the memopt pass's own choice)."""
    from ms_efficient.graph.cells import repeated_blocks, sequence_units, user_cell_path

    if "memopt" in plans:
        return list(dict.fromkeys(layer["name"] for layer in plans["memopt"]["layers"]))
    tree = context.cell_tree()
    return [u for u in repeated_blocks(tree) or sequence_units(tree) if user_cell_path(u)]


def _memory_plan(profile, plans: Dict[str, Any]):
    """memopt's actions on the Cells of ``profile`` (keep where memopt did not plan)."""
    from ms_efficient.memopt.env import ACTION_NAMES, KEEP, MemoryPlan

    chosen = {}
    for layer in (plans.get("memopt") or {}).get("layers", []):
        if layer["action"] != "keep":
            chosen[layer["name"]] = layer
    rows = [chosen.get(name, {"action": ACTION_NAMES[KEEP]}) for name in profile.names]
    return MemoryPlan(np.array([ACTION_NAMES.index(r["action"]) for r in rows]),
                      np.array([int(r.get("swap_delay", 0)) for r in rows]),
                      np.array([int(r.get("prefetch_lead", 1)) for r in rows]),
                      method="optimize")


def combined_report(context) -> Dict[str, Any]:
    """The combined report of the plans in ``context.plans`` (module docstring):
    ``{"passes" (the applied ones), "refused" (the passes that refused, ``context.refused``;
    their plans are not in the figures), "devices_needed", "step_time_s",
    "peak_memory_bytes" (the
    largest device's), "devices":
    [{"share", "devices", "peak_memory_bytes", "busy_s"}], "comm_time_s", "unoptimised",
    "evidence"}``; bytes and seconds."""
    from ms_efficient.graph.cells import assign_segments, assign_units
    from ms_efficient.memopt.env import evaluate
    from ms_efficient.memopt.profile import device_shares, profile_from_units

    plans = context.plans
    graph = context.graph("the combined report")
    cluster = context.config.cluster_spec()
    price = context.unoptimised("the combined report")
    shard, place = plans.get("shard"), plans.get("place")
    try:
        units = _units(context, plans)
        segments = (plans.get("memopt") or {}).get("segments")
        assignment = (assign_segments(graph, segments) if segments else
                      assign_units(graph, units) if units else None)
    except ValueError:              # a Cell without parameter operators: sum every operator
        assignment = None

    def busy_and_peak(share, planned: bool):
        if assignment is None:          # no Cell to plan: every operator kept, summed
            from ms_efficient.place.stages import op_prices

            p = op_prices(graph, cluster)
            on = share.on_device & p.forward
            split = (p.forward_s + p.backward_s - 2 * p.overhead_s) * share.time_share
            busy = float((split + 2 * p.overhead_s)[on].sum())
            peak = float(share.state_bytes[on].sum()
                         + share.in_flight * (p.output_bytes * share.output_share)[on].sum())
            return busy, peak
        profile = profile_from_units(graph, assignment, cluster, 1, share)
        plan = _memory_plan(profile, plans if planned else {})
        result = evaluate(profile, plan, float("inf"), cluster.host_link)
        return result.step_time_s + profile.meta["outside_time_s"], result.peak_bytes

    final = device_shares(graph, cluster, shard, place)
    rows = [busy_and_peak(share, True) for share in final]
    comm = float(shard["summary"]["comm_time_s"]) if shard else 0.0
    if place:
        plain = [busy_and_peak(share, False) for share in device_shares(graph, cluster, None,
                                                                         place)]
        before = [float(t) for t in place["stage_time_s"]]
        after = [t + busy - unsplit for t, (busy, _), (unsplit, _) in zip(before, rows, plain)]
        m = int(place["micro_batches"])
        step = (float(place["step_time_s"]) + pipeline_step_s(after, m)
                - pipeline_step_s(before, m))
        ids = [[int(d) for d in stage.get("devices", [stage["device"]])]
               for stage in place["stages"]]
    else:
        step = rows[0][0]
        ids = [list(range(int(shard["mesh"]["dp"]) * int(shard["mesh"]["mp"])))
               if shard else [0]]
    needed = ((int(shard["mesh"]["dp"]) * int(shard["mesh"]["mp"]) if shard else 1)
              * (len(place["stages"]) * int(place.get("dp", 1)) if place else 1))
    if needed > cluster.num_devices:    # place and shard plan within the cluster
        raise ValueError(f"the plans need {needed} devices (shard's mesh x place's stages x its "
                         f"copies); the cluster {cluster.name!r} has {cluster.num_devices}.")
    return {"passes": [name for name in plans],
            "refused": list(getattr(context, "refused", {})),
            "devices_needed": needed,
            "step_time_s": float(step + comm),
            "peak_memory_bytes": int(round(max(peak for _, peak in rows))),
            "comm_time_s": comm,
            "devices": [{"share": share.label, "devices": dev,
                         "peak_memory_bytes": int(round(peak)), "busy_s": float(busy)}
                        for share, dev, (busy, peak) in zip(final, ids, rows)],
            "unoptimised": price.to_dict(),
            "evidence": "simulated", "model": "ms_efficient.plan_report"}
