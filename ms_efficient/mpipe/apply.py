"""The ``mpipe`` pass: every MoE layer of the package in a user's network, under any attribute
name, wrapped in :class:`~ms_efficient.mpipe.layer.PipelinedMoE` with the chunk count the
planner chooses for it on the config's cluster.

A drop-in ``MoEMLP`` (and a layer ``ms_efficient.adopt_moe`` put in place of a user's
own MoE block) holds its ``MoEFeedForward`` as ``moe``: that layer is wrapped, and the
``MoEMLP`` keeps returning y only. The wrapped layer's parameters keep their names
(:func:`ms_efficient.moe.dropin.replace_cell`).

Per ``MoEFeedForward`` the planner sees one rank of an expert-parallel group over all the
cluster's devices (``moe.num_experts / devices`` local experts, as ``ms-efficient plan mpipe``
models a config): rows = the layer's slot rows per step (the sum of its capacities), H and F
from its weights. Only chunk counts that divide the layer's batch are tried (a chunk is a
slice of the batch), and the wrapped layer gets a chunk's capacities, ceil(capacity / chunks).
"""
from __future__ import annotations

import logging
import math
from typing import Any, Dict, Tuple

from ms_efficient.core.registry import PassRefused, register_pass

__all__ = ["mpipe_pass"]

logger = logging.getLogger(__name__)


def _batch_of(graph, path: str, fallback: int) -> int:
    """Leading dimension of the first 3-D input of an op of the Cell at ``path``."""
    from ms_efficient.graph.cells import node_cell_path

    for name in graph.topological_order():
        node = graph[name]
        p = node_cell_path(graph, node.scope)
        if node.phase == "forward" and (p == path or p.startswith(path + ".")):
            for shape in node.input_shapes:
                if len(shape) == 3:
                    return int(shape[0])
    return fallback


@register_pass("mpipe")
def mpipe_pass(network: Any, context: Any) -> Tuple[Any, Dict[str, Any]]:
    """Wrap each MoE layer in ``PipelinedMoE`` where more than one chunk is fastest
    (simulated on the config's cluster). Raises ValueError without MoE layers or when one
    chunk is fastest for all of them (nothing to wrap): PassRefused (a ValueError)."""
    from ms_efficient.adopt.replace import adopt_hint
    from ms_efficient.moe.dropin import replace_cell
    from ms_efficient.moe.layer import MoEFeedForward
    from ms_efficient.mpipe.layer import PipelinedMoE
    from ms_efficient.mpipe.planner import CHUNK_CANDIDATES, MoELayerShape, choose_chunks

    found = [(p, c) for p, c in network.cells_and_names() if isinstance(c, MoEFeedForward)]
    if not found:
        raise PassRefused(f"mpipe: found no MoEFeedForward layer in the network; the pass "
                          f"chunks the package's MoE layer (MoEFeedForward, or MoEMLP around "
                          f"one).{adopt_hint(network)}")
    cluster = context.config.cluster_spec()
    graph = context.graph("the mpipe pass")
    first = context.sample_inputs[0]
    fallback = int(first.shape[0]) if getattr(first, "shape", None) else 1
    cells: Dict[str, Dict[str, Any]] = {}
    times: Dict[str, Dict[int, float]] = {}
    for path, layer in found:
        batch = _batch_of(graph, path, fallback)
        shape = MoELayerShape(rows=int(sum(layer.capacities)), hidden=int(layer.hidden_size),
                              ffn_hidden=int(layer.ffn_hidden_size),
                              local_experts=max(1, layer.num_experts // cluster.num_devices),
                              ranks=cluster.num_devices)
        options = [n for n in CHUNK_CANDIDATES if batch % n == 0]
        best, table = choose_chunks(shape, cluster, options)
        times[path] = {n: t.time_s for n, t in table.items()}
        if best.chunks == 1:
            continue
        layer.set_capacities([math.ceil(c / best.chunks) for c in layer.capacities])
        names = {id(p): p.name for p in layer.get_parameters()}
        replace_cell(network, path, PipelinedMoE(layer, best.chunks), names)
        cells[path] = {"wrapped_in": "PipelinedMoE", "chunks": best.chunks,
                       "layer_time_s": best.time_s, "unchunked_time_s": table[1].time_s}
    if not cells:
        raise PassRefused(f"mpipe: one chunk is fastest for every MoE layer on "
                          f"{cluster.name!r} (simulated seconds per chunk count: "
                          f"{next(iter(times.values()))}); nothing to wrap.")
    logger.info("mpipe: wrapped %d MoE layers", len(cells))
    return network, {"kind": "mpipe", "cluster": cluster.name, "evidence": "simulated",
                     "cells": cells}
