"""Contract linear chains of an OpGraph into single group nodes (no MindSpore import).

Placement and partitioning planners scale with the number of nodes; a chain ``a -> b -> c``
where each link is the only way out of its source and the only way into its target can be
placed as one unit without losing any choice that matters for cutting the graph.
"""
from __future__ import annotations

import copy
import os
from typing import Dict, List, Optional

from ms_efficient.graph.opgraph import OpGraph, OpNode

__all__ = ["contract_chains"]


def _sum_or_none(values: List[Optional[float]]) -> Optional[float]:
    known = [v for v in values if v is not None]
    return float(sum(known)) if known else None


def _merge(members: List[OpNode]) -> OpNode:
    """One node standing for a chain: costs add up, shapes are those at the chain's ends.

    output_bytes is the sum over members (activations the chain holds); the bytes leaving
    the chain stay on its outgoing edges and in attrs['boundary_output_bytes'].
    """
    if len(members) == 1:
        return copy.deepcopy(members[0])
    first, last = members[0], members[-1]
    phases = {m.phase for m in members}
    scope = os.path.commonpath([m.scope for m in members]) if all(m.scope for m in members) \
        else ""
    return OpNode(
        name=first.name,
        op_type="Chain",
        scope=scope,
        output_shapes=list(last.output_shapes),
        output_dtypes=list(last.output_dtypes),
        flops=sum(m.flops for m in members),
        output_bytes=sum(m.output_bytes for m in members),
        param_bytes=sum(m.param_bytes for m in members),
        forward_time_s=_sum_or_none([m.forward_time_s for m in members]),
        backward_time_s=_sum_or_none([m.backward_time_s for m in members]),
        phase=phases.pop() if len(phases) == 1 else "unknown",
        attrs={"members": [m.name for m in members],
               "member_op_types": [m.op_type for m in members],
               "boundary_output_bytes": last.output_bytes},
        input_shapes=list(first.input_shapes),
    )


def contract_chains(graph: OpGraph, max_members: Optional[int] = None) -> OpGraph:
    """Return a new graph where every maximal linear chain is one node.

    A link ``u -> v`` is contracted when it is u's only outgoing and v's only incoming edge.
    A group is named after its first member; a group of one keeps the original node; larger
    groups get op_type ``"Chain"`` and ``attrs['members']`` (names in order). Totals of FLOPs,
    parameter bytes and activation bytes are preserved; edges keep their bytes.

    Args:
        graph: the graph to contract (not modified).
        max_members: cap on nodes per group (None: no cap).
    """
    if max_members is not None and max_members < 1:
        raise ValueError(f"'max_members' must be >= 1, but got {max_members}.")
    # Step 1: walk in topological order, extending the predecessor's group when allowed.
    group_of: Dict[str, str] = {}
    groups: Dict[str, List[str]] = {}
    for name in graph.topological_order():
        preds = graph.predecessors(name)
        if len(preds) == 1 and len(graph.successors(preds[0])) == 1:
            head = group_of[preds[0]]
            if max_members is None or len(groups[head]) < max_members:
                group_of[name] = head
                groups[head].append(name)
                continue
        group_of[name] = name
        groups[name] = [name]
    # Step 2: one node per group (in original node order), edges between groups.
    out = OpGraph(name=graph.name, meta={**graph.meta, "contracted_from_nodes": len(graph)})
    for name in graph.nodes:
        if name in groups:
            out.add_node(_merge([graph[m] for m in groups[name]]))
    for src, dst, nbytes in graph.edges:
        if group_of[src] != group_of[dst]:
            out.add_edge(group_of[src], group_of[dst], nbytes)
    return out
