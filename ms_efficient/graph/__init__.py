"""Dataflow graphs of operators with FLOP, byte and time costs, for every planner.

``OpGraph`` (JSON save/load, arrays for planners, chain contraction) is built from a MindSpore
network (``from_network``, which imports MindSpore only when called), a MINDIR file, or a
PipeDream profile; ``load_graph`` opens any of these files.
"""
from __future__ import annotations

from typing import Any

from ms_efficient.graph.contract import contract_chains
from ms_efficient.graph.flops import op_flops, tensor_bytes
from ms_efficient.graph.load import load_graph
from ms_efficient.graph.opgraph import PHASES, GraphArrays, OpGraph, OpNode
from ms_efficient.graph.pipedream import load_pipedream, parse_pipedream
from ms_efficient.graph.summary import graph_summary_table

__all__ = [
    "PHASES", "OpNode", "OpGraph", "GraphArrays", "contract_chains", "op_flops",
    "tensor_bytes", "load_graph", "load_pipedream", "parse_pipedream", "graph_summary_table",
    "from_network", "from_mindir_file",
]


def from_network(network: Any, *inputs: Any, mode: str = "forward", optimizer: Any = None,
                 loss_fn: Any = None) -> OpGraph:
    """See ``ms_efficient.graph.mindir.from_network`` (imports MindSpore on first call)."""
    from ms_efficient.graph.mindir import from_network as _from_network
    return _from_network(network, *inputs, mode=mode, optimizer=optimizer, loss_fn=loss_fn)


def from_mindir_file(path: str) -> OpGraph:
    """See ``ms_efficient.graph.mindir.from_mindir_file`` (imports MindSpore)."""
    from ms_efficient.graph.mindir import from_mindir_file as _from_mindir_file
    return _from_mindir_file(path)
