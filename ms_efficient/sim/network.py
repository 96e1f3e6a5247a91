"""The unoptimised price of a network: one step of its graph on one device, simulated once.

Every pass of ``ms_efficient.optimize`` reports the network's unoptimised step time and peak
from this one function (``PassContext.unoptimised``), so the figures agree across passes for
the same network, cluster and batch. The model is the placement cost model
(``ms_efficient.place.problem`` / ``place.cost``) run by the shared event simulator
(``ms_efficient.sim.Simulator``): the forward operators of the train-step graph, each costing
``flops / (peak * compute_efficiency) + op_overhead_s`` seconds forward and twice the FLOPs
(plus the overhead) backward, all on device 0 with one micro-batch; the peak is the parameter
state (weights, gradients, two Adam moments: 4 x parameter bytes) plus every forward output
stashed for backward, bytes. No MindSpore import.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict

import numpy as np

from ms_efficient.core.cluster import ClusterSpec
from ms_efficient.graph.opgraph import OpGraph

__all__ = ["NetworkPrice", "price_network"]


@dataclass(frozen=True)
class NetworkPrice:
    """step_time_s: simulated seconds of one unoptimised training step. peak_memory_bytes:
    its simulated peak on the one device. forward_ops: operators priced. cluster: its name."""

    step_time_s: float
    peak_memory_bytes: float
    forward_ops: int
    cluster: str

    def to_dict(self) -> Dict[str, Any]:
        return {"step_time_s": float(self.step_time_s),
                "peak_memory_bytes": int(round(self.peak_memory_bytes)),
                "forward_ops": int(self.forward_ops), "cluster": self.cluster,
                "evidence": "simulated", "simulator": "ms_efficient.sim.network.price_network"}


def price_network(graph: OpGraph, cluster: ClusterSpec) -> NetworkPrice:
    """Simulate one unoptimised step of ``graph`` (a train-step or forward graph) on one
    device of ``cluster`` (module docstring). Raises ValueError for a graph without
    forward operators."""
    from ms_efficient.graph.cells import forward_subgraph
    from ms_efficient.place.cost import simulate_placement
    from ms_efficient.place.problem import PlacementOptions, build_problem

    fwd = forward_subgraph(graph)
    if len(fwd) == 0:
        raise ValueError(f"graph {graph.name!r} has no forward operator to price.")
    one = cluster.with_overrides(nodes=1, devices_per_node=1, name=cluster.name)
    # the whole network on one device: its memory is reported, not enforced
    big = one.with_overrides(device_memory_bytes=max(int(one.device_memory_bytes), 1 << 62))
    problem = build_problem(fwd, big, PlacementOptions(micro_batches=1))
    cost = simulate_placement(problem, np.zeros(problem.num_units, dtype=np.int64))
    return NetworkPrice(step_time_s=float(cost.step_time_s),
                        peak_memory_bytes=float(cost.peak_memory_bytes[0]),
                        forward_ops=len(fwd), cluster=cluster.name)
