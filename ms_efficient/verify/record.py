"""The record the verification pass writes for one compile, and which of its nodes belong to a
Cell. Pure Python (no MindSpore import).

Record file (JSON, written by kernels/cpu/verify_pass.cc): ``{"version": 1, "graph": name,
"nodes": [{"scope", "op", "graph_stage", "recomputed", "cnode_attrs", "prim_attrs", "inputs",
"output"}, ...]}``, one node per primitive call of the compiled train-step graph, taken after
autodiff and after MindSpore's recompute insertion; ``inputs`` and ``output`` are the inferred
shapes and types as MindSpore prints them (``["(32, 16)", "Tensor[Float32]"]``), which
:meth:`CompiledRecord.collectives` reads for the traffic audit.

Scopes look like ``Default/network-WithLossCell/_backbone-Net/blocks-CellList/0-Block/
fc1-Dense/MatMul-op0``: one ``<attribute>-<class>`` segment per Cell, then the op. Backward
ops start with ``Gradients/``; the nodes of a recompute Cell (and their recomputed copies)
start with ``recompute_``. A Cell path ``blocks.0.fc1`` (as ``cells_and_names`` lists it)
owns a node when its attribute names ``blocks``, ``0``, ``fc1`` appear as consecutive
segments of the node's scope. Matching segments rather than the whole prefix is what keeps
it right when a sub-Cell compiled on its own earlier keeps a shorter scope.

Scopes alone do not attribute recomputed copies: MindSpore builds one graph for identical
parameter-free Cells, so the GeLU of ``blocks.3`` is scoped ``blocks-CellList/0-Block/act-GELU``.
The ops that read a weight are scoped right, and MindSpore tags every node of one recompute
call (originals and copies; adjacent recompute-all Cells share one call) with the CNode
attribute ``recompute_sub_graph``; :meth:`CompiledRecord.recomputed_by` uses both.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["RecordedNode", "CompiledRecord", "parse_strategy", "cell_segments", "GROUP_ATTR",
           "COLLECTIVE_OPS", "tensor_shape", "tensor_itemsize"]

GROUP_ATTR = "recompute_sub_graph"

# the communication primitives of MindSpore 2.10 a compiled step can hold
COLLECTIVE_OPS = frozenset({"AllGather", "AllReduce", "AlltoAll", "AlltoAllV", "AlltoAllVC",
                            "ReduceScatter", "Broadcast", "Send", "Receive", "NeighborExchange",
                            "NeighborExchangeV2", "CollectiveScatter", "CollectiveGather",
                            "Reduce", "BatchISendIRecv", "AllGatherV", "ReduceScatterV"})
# bytes per element of the tensor types MindSpore prints (``Tensor[Float32]``)
_ITEMSIZE = {"Float16": 2, "BFloat16": 2, "Float32": 4, "Float64": 8, "Int8": 1, "UInt8": 1,
             "Int16": 2, "UInt16": 2, "Int32": 4, "UInt32": 4, "Int64": 8, "UInt64": 8,
             "Bool": 1}
_SHAPE = re.compile(r"^\(\s*(-?\d+(?:\s*,\s*-?\d+)*)?\s*,?\s*\)$")
_TENSOR_TYPE = re.compile(r"^(?:Ref\[)?Tensor\[(\w+)\]\]?$")


def tensor_shape(text: str) -> Optional[Tuple[int, ...]]:
    """A shape as the record prints it (``"(32, 16)"``, ``"(32)"``, ``"()"``) -> a tuple of
    ints; None for anything else (``"NoShape"``, tuples of shapes, ``""``)."""
    m = _SHAPE.match(str(text).strip())
    if m is None:
        return None
    return tuple(int(d) for d in m.group(1).split(",")) if m.group(1) else ()


def tensor_itemsize(text: str) -> Optional[int]:
    """Bytes per element of a tensor type as the record prints it (``"Tensor[Float32]"``,
    ``"Ref[Tensor[Int32]]"``) -> 4; None for a non-tensor or an unknown element type."""
    m = _TENSOR_TYPE.match(str(text).strip())
    return None if m is None else _ITEMSIZE.get(m.group(1))


BACKWARD_PREFIX = "Gradients/"
RECOMPUTE_PREFIX = "recompute_"


@dataclass(frozen=True)
class RecordedNode:
    """One primitive call of the compiled graph.

    scope: ``fullname_with_scope()``; op: primitive name; graph_stage: ``FuncGraph.stage()``
    of the graph holding it (-1 unset); recomputed: a copy MindSpore's recompute pass made
    (CNode attribute ``duplicated``); reads_parameter: a weight is an input (directly or
    through Load); ordered: a Depend node is an input (how MindSpore orders a recompute
    call's re-run after the backward's inputs); cnode_attrs / prim_attrs: selected
    attributes as text; inputs / output: (shape text, type text) as inferred.
    """

    scope: str
    op: str
    graph_stage: int = -1
    recomputed: bool = False
    reads_parameter: bool = False
    ordered: bool = False
    cnode_attrs: Dict[str, str] = field(default_factory=dict)
    prim_attrs: Dict[str, str] = field(default_factory=dict)
    inputs: Tuple[Tuple[str, str], ...] = ()
    output: Tuple[str, str] = ("", "")

    def operand_bytes(self, index: int = 0) -> Optional[int]:
        """Bytes of input ``index`` (its shape's elements x its element size); None when the
        record has no tensor shape and type for it."""
        if index >= len(self.inputs):
            return None
        shape, size = tensor_shape(self.inputs[index][0]), tensor_itemsize(self.inputs[index][1])
        if shape is None or size is None or any(d < 0 for d in shape):
            return None
        return int(np.prod(shape, dtype=np.int64)) * size

    @property
    def backward(self) -> bool:
        """True for ops autodiff made (scope under ``Gradients/``)."""
        return self.scope.startswith(BACKWARD_PREFIX)

    def cell_names(self) -> List[str]:
        """Attribute names of the Cell segments of the scope (the op segment dropped)."""
        scope = self.scope[len(RECOMPUTE_PREFIX):] if self.scope.startswith(
            RECOMPUTE_PREFIX) else self.scope
        return [seg.split("-", 1)[0] for seg in scope.split("/")[:-1]]


def cell_segments(path: str) -> List[str]:
    """``"blocks.0.fc1"`` -> ``["blocks", "0", "fc1"]``; ValueError for the root ("")."""
    if not path:
        raise ValueError("a Cell path must name a sub-Cell, but got '' (the root).")
    return path.split(".")


def _contains(names: List[str], parts: List[str]) -> bool:
    n = len(parts)
    return any(names[i:i + n] == parts for i in range(len(names) - n + 1))


_TOKEN = re.compile(r"\s*(?:(-?\d+)|([(),\[\]]))")


def _parse_group(tokens: List[str], i: int) -> Tuple[Any, int]:
    """One value from ``tokens[i]``: an int, or a parenthesised / bracketed group (always a
    tuple, whatever its length or trailing comma)."""
    if tokens[i] not in ("(", "["):
        return int(tokens[i]), i + 1
    close = ")" if tokens[i] == "(" else "]"
    items: List[Any] = []
    i += 1
    while tokens[i] != close:
        if tokens[i] == ",":
            raise ValueError("empty item")
        value, i = _parse_group(tokens, i)
        items.append(value)
        if tokens[i] == ",":
            i += 1
        elif tokens[i] != close:
            raise ValueError(f"unexpected {tokens[i]!r}")
    return tuple(items), i + 1


def parse_strategy(text: str) -> Optional[Tuple[Tuple[int, ...], ...]]:
    """A strategy attribute as MindSpore prints it -> nested tuples, one per input, one int
    per input dimension; None when it is not a tuple of int tuples.

    MindSpore prints a one-element tuple without a trailing comma: the strategy of a Gather
    of 1-D indices is ``"((1, 1), (8))"``, of a LayerNorm ``"((8, 1, 1), (1), (1))"``;
    every parenthesised group is read as a tuple (``(8)`` is ``(8,)``)."""
    tokens: List[str] = []
    pos = 0
    text = str(text).strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            return None
        tokens.append(m.group(1) or m.group(2))
        pos = m.end()
    try:
        value, end = _parse_group(tokens, 0) if tokens else (None, 0)
    except (ValueError, IndexError):
        return None
    if end != len(tokens) or not isinstance(value, tuple) or not value or not all(
            isinstance(t, tuple) and t and all(isinstance(d, int) for d in t) for t in value):
        return None
    return value


@dataclass
class CompiledRecord:
    """All recorded nodes of one compile."""

    nodes: List[RecordedNode]
    graph: str = ""

    @classmethod
    def from_dict(cls, doc: Dict[str, Any], source: str = "record") -> "CompiledRecord":
        if not isinstance(doc, dict) or doc.get("version") != 1 or not isinstance(
                doc.get("nodes"), list):
            raise ValueError(f"{source}: not a version-1 verification record "
                             f"(needs version: 1 and a 'nodes' list).")
        nodes = [RecordedNode(scope=str(n["scope"]), op=str(n["op"]),
                              graph_stage=int(n.get("graph_stage", -1)),
                              recomputed=bool(n.get("recomputed", False)),
                              reads_parameter=bool(n.get("reads_parameter", False)),
                              ordered=bool(n.get("ordered", False)),
                              cnode_attrs=dict(n.get("cnode_attrs") or {}),
                              prim_attrs=dict(n.get("prim_attrs") or {}),
                              inputs=tuple((str(a), str(b)) for a, b in n.get("inputs") or ()),
                              output=tuple(str(v) for v in n.get("output") or ("", "")))
                 for n in doc["nodes"]]
        return cls(nodes=nodes, graph=str(doc.get("graph", "")))

    @classmethod
    def from_file(cls, path: str) -> "CompiledRecord":
        with open(path, encoding="utf-8") as fh:
            return cls.from_dict(json.load(fh), source=path)

    def collectives(self) -> List[RecordedNode]:
        """The communication primitives of the compile (:data:`COLLECTIVE_OPS`), forward and
        backward, in graph order, with their operands' shapes and their ``group``."""
        return [n for n in self.nodes if n.op in COLLECTIVE_OPS]

    def nodes_of(self, path: str) -> List[RecordedNode]:
        """Nodes whose scope holds Cell ``path`` (see module docs), forward and backward."""
        parts = cell_segments(path)
        return [n for n in self.nodes if _contains(n.cell_names(), parts)]

    def recomputed_by(self, candidates: Sequence[str]) -> Dict[str, List[RecordedNode]]:
        """{Cell path: the recomputed copies made for it} over the Cell paths ``candidates``.

        Per recompute call (a ``recompute_sub_graph`` id): its owners are the candidates
        holding one of its weight-reading nodes (the candidate holding most of its nodes
        when none reads a weight); each copy, in graph order, goes to the deepest owner
        whose scope holds it, a copy no owner holds (a shared parameter-free op, scoped to
        another Cell) to the owner of the copy before it. Copies without an id go to every
        candidate whose scope holds them."""
        parts = {path: cell_segments(path) for path in candidates}
        out: Dict[str, List[RecordedNode]] = {path: [] for path in candidates}
        groups: Dict[str, List[RecordedNode]] = {}
        for node in self.nodes:
            if node.backward:
                continue
            group = node.cnode_attrs.get(GROUP_ATTR)
            if group is not None:
                groups.setdefault(group, []).append(node)
            elif node.recomputed:
                for path in self._holders(node, parts):
                    out[path].append(node)
        for nodes in groups.values():
            copies = [n for n in nodes if n.recomputed]
            anchors = [n for n in nodes if n.reads_parameter] or nodes
            held = {p: sum(p in self._holders(n, parts) for n in anchors) for p in parts}
            owners = [p for p in parts if held[p]]
            if not copies or not owners:
                continue
            if not any(n.reads_parameter for n in nodes):
                owners = [max(owners, key=lambda p: (held[p], len(parts[p])))]
            last = max(owners, key=lambda p: (held[p], len(parts[p])))
            for copy in copies:
                holders = [p for p in self._holders(copy, parts) if p in owners]
                if holders:
                    last = max(holders, key=lambda p: len(parts[p]))
                out[last].append(copy)
        return out

    def unordered_calls(self) -> List[str]:
        """Ids of the recompute calls none of whose copies is ordered by a Depend: MindSpore
        found no backward input to run them after ("Can not find the nodes to depend,
        please check the recompute strategy"), so they may run in the forward and free
        nothing."""
        calls: Dict[str, bool] = {}
        for node in self.nodes:
            group = node.cnode_attrs.get(GROUP_ATTR)
            if node.recomputed and group is not None:
                calls[group] = calls.get(group, False) or node.ordered
        return sorted(g for g, ordered in calls.items() if not ordered)

    @staticmethod
    def _holders(node: RecordedNode, parts: Dict[str, List[str]]) -> List[str]:
        names = node.cell_names()
        return [p for p, segs in parts.items() if _contains(names, segs)]

    def has_stage_info(self) -> bool:
        """True when any node carries a pipeline stage (a pipeline-parallel compile)."""
        return any(n.graph_stage >= 0 or "stage" in n.cnode_attrs for n in self.nodes)
