"""OpGraph: a dataflow graph of operators with their costs, shared by every planner.

Units everywhere: bytes, FLOPs (one multiply-add = 2 FLOPs), seconds. No MindSpore import:
graphs come from ``mindir.from_network``/``from_mindir_file`` (MindSpore), from PipeDream
profiles (``pipedream.load_pipedream``) or from a saved JSON file (``OpGraph.load_json``).

JSON layout (``version`` 1)::

    {"format": "ms_efficient.opgraph", "version": 1, "name": "...", "meta": {...},
     "nodes": [{"name", "op_type", "scope", "output_shapes", "output_dtypes", "flops",
                "output_bytes", "param_bytes", "forward_time_s", "backward_time_s", "phase",
                "attrs", "input_shapes"}, ...],
     "edges": [[src, dst, bytes], ...]}
"""
from __future__ import annotations

import heapq
import json
import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np

from ms_efficient.core.fileio import atomic_write_text

__all__ = ["PHASES", "OpNode", "OpGraph", "GraphArrays", "JSON_FORMAT", "JSON_VERSION"]

PHASES = ("forward", "backward", "optimizer", "unknown")
JSON_FORMAT = "ms_efficient.opgraph"
JSON_VERSION = 1
_REQUIRED_NODE_KEYS = ("name", "op_type")


@dataclass
class OpNode:
    """One operator of a dataflow graph.

    name: unique id in its graph. op_type: primitive or layer type (``MatMul``, ``Conv2d``).
    scope: cell scope, e.g. ``Default/b0-Block/d1-Dense`` (may be imprecise, see MINDIR notes).
    output_shapes / output_dtypes: one entry per output tensor (empty when unknown).
    flops: forward FLOPs of this op. output_bytes: bytes of all its outputs.
    param_bytes: bytes of the parameters attributed to this op (each parameter to one op).
    forward_time_s / backward_time_s: measured seconds, None when not profiled.
    phase: "forward", "backward", "optimizer" or "unknown".
    attrs: JSON-compatible extras (primitive attributes, description, ...).
    input_shapes: shapes of the tensor inputs in order (empty when unknown).
    """

    name: str
    op_type: str
    scope: str = ""
    output_shapes: List[Tuple[int, ...]] = field(default_factory=list)
    output_dtypes: List[str] = field(default_factory=list)
    flops: float = 0.0
    output_bytes: int = 0
    param_bytes: int = 0
    forward_time_s: Optional[float] = None
    backward_time_s: Optional[float] = None
    phase: str = "unknown"
    attrs: Dict[str, Any] = field(default_factory=dict)
    input_shapes: List[Tuple[int, ...]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"OpNode 'name' must be a non-empty string, but got {self.name!r}.")
        if self.phase not in PHASES:
            raise ValueError(f"OpNode {self.name!r}: 'phase' must be one of {PHASES}, "
                             f"but got {self.phase!r}.")
        for key in ("flops", "output_bytes", "param_bytes"):
            if getattr(self, key) < 0:
                raise ValueError(f"OpNode {self.name!r}: '{key}' must be >= 0, "
                                 f"but got {getattr(self, key)}.")
        # Normalise so that a node equals itself after a JSON round trip.
        self.output_shapes = [tuple(int(d) for d in s) for s in self.output_shapes]
        self.input_shapes = [tuple(int(d) for d in s) for s in self.input_shapes]
        self.output_dtypes = [str(d) for d in self.output_dtypes]
        self.flops = float(self.flops)
        self.output_bytes = int(self.output_bytes)
        self.param_bytes = int(self.param_bytes)
        for key in ("forward_time_s", "backward_time_s"):
            value = getattr(self, key)
            if value is not None:
                setattr(self, key, float(value))

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["output_shapes"] = [list(s) for s in self.output_shapes]
        d["input_shapes"] = [list(s) for s in self.input_shapes]
        return d


@dataclass
class GraphArrays:
    """Array view of an OpGraph for planners; node ``i`` is ``names[i]`` (insertion order).

    index: name -> i. op_types: [N]. flops, param_bytes, output_bytes: [N] per node.
    forward_time_s, backward_time_s: [N], NaN where not profiled.
    succ_indptr [N+1], succ_indices [E], succ_bytes [E]: CSR successors; the successors of
    node i are ``succ_indices[succ_indptr[i]:succ_indptr[i+1]]`` with edge bytes alongside.
    pred_indptr, pred_indices, pred_bytes: the same for predecessors.
    topo_order: [N] node indices in topological order.
    """

    names: List[str]
    index: Dict[str, int]
    op_types: List[str]
    flops: np.ndarray
    param_bytes: np.ndarray
    output_bytes: np.ndarray
    forward_time_s: np.ndarray
    backward_time_s: np.ndarray
    succ_indptr: np.ndarray
    succ_indices: np.ndarray
    succ_bytes: np.ndarray
    pred_indptr: np.ndarray
    pred_indices: np.ndarray
    pred_bytes: np.ndarray
    topo_order: np.ndarray


class OpGraph:
    """Nodes (``OpNode``) and directed data edges ``src -> dst`` carrying bytes.

    An edge means an output of ``src`` is an input of ``dst``; its bytes default to
    ``src.output_bytes``. Nodes keep insertion order, which fixes every tie-break.
    """

    def __init__(self, name: str = "graph", meta: Optional[Dict[str, Any]] = None) -> None:
        self.name = name
        self.meta: Dict[str, Any] = dict(meta or {})
        self.nodes: Dict[str, OpNode] = {}
        self._succ: Dict[str, Dict[str, int]] = {}
        self._pred: Dict[str, Dict[str, int]] = {}

    # -- building ---------------------------------------------------------------------
    def add_node(self, node: OpNode) -> OpNode:
        """Add ``node``; a second node with the same name raises ValueError."""
        if node.name in self.nodes:
            raise ValueError(f"duplicate node name {node.name!r} in graph {self.name!r}.")
        self.nodes[node.name] = node
        self._succ[node.name] = {}
        self._pred[node.name] = {}
        return node

    def add_edge(self, src: str, dst: str, nbytes: Optional[int] = None) -> None:
        """Add edge ``src -> dst`` carrying ``nbytes`` bytes (default: src's output bytes).

        Adding an existing edge again keeps one edge with the larger byte count.
        """
        for end in (src, dst):
            if end not in self.nodes:
                raise ValueError(f"edge {src!r} -> {dst!r}: unknown node {end!r} "
                                 f"in graph {self.name!r}.")
        if src == dst:
            raise ValueError(f"self-loop on node {src!r}: a dataflow graph has no cycles.")
        nbytes = self.nodes[src].output_bytes if nbytes is None else int(nbytes)
        if nbytes < 0:
            raise ValueError(f"edge {src!r} -> {dst!r}: bytes must be >= 0, but got {nbytes}.")
        nbytes = max(nbytes, self._succ[src].get(dst, 0))
        self._succ[src][dst] = nbytes
        self._pred[dst][src] = nbytes

    # -- queries ----------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.nodes)

    def __contains__(self, name: object) -> bool:
        return name in self.nodes

    def __iter__(self) -> Iterator[OpNode]:
        return iter(self.nodes.values())

    def __getitem__(self, name: str) -> OpNode:
        return self.nodes[name]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OpGraph) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return f"OpGraph({self.name!r}, nodes={len(self.nodes)}, edges={self.num_edges})"

    def _check(self, name: str) -> None:
        if name not in self.nodes:
            raise KeyError(f"unknown node {name!r} in graph {self.name!r}.")

    def successors(self, name: str) -> List[str]:
        self._check(name)
        return list(self._succ[name])

    def predecessors(self, name: str) -> List[str]:
        self._check(name)
        return list(self._pred[name])

    def edge_bytes(self, src: str, dst: str) -> int:
        """Bytes carried by edge ``src -> dst`` (KeyError if there is no such edge)."""
        return self._succ[src][dst]

    @property
    def edges(self) -> List[Tuple[str, str, int]]:
        """All edges as ``(src, dst, bytes)``, grouped by source in node order."""
        return [(s, d, b) for s, out in self._succ.items() for d, b in out.items()]

    @property
    def num_edges(self) -> int:
        return sum(len(out) for out in self._succ.values())

    def topological_order(self) -> List[str]:
        """Node names so that every edge goes forward; ties keep insertion order.

        Raises ValueError naming a node on a cycle (and the cycle) if there is one.
        """
        indegree = {n: len(p) for n, p in self._pred.items()}
        position = {n: i for i, n in enumerate(self.nodes)}
        ready = [position[n] for n, d in indegree.items() if d == 0]
        heapq.heapify(ready)
        names = list(self.nodes)
        order: List[str] = []
        while ready:
            name = names[heapq.heappop(ready)]
            order.append(name)
            for succ in self._succ[name]:
                indegree[succ] -= 1
                if indegree[succ] == 0:
                    heapq.heappush(ready, position[succ])
        if len(order) < len(self.nodes):
            cycle = self._find_cycle({n for n, d in indegree.items() if d > 0})
            raise ValueError(f"graph {self.name!r} has a cycle through node {cycle[0]!r}: "
                             + " -> ".join(repr(n) for n in cycle + [cycle[0]]))
        return order

    def _find_cycle(self, remaining: set) -> List[str]:
        """Walk predecessors inside ``remaining`` (every node there has one) until a repeat."""
        node = next(n for n in self.nodes if n in remaining)
        seen: Dict[str, int] = {}
        path: List[str] = []
        while node not in seen:
            seen[node] = len(path)
            path.append(node)
            node = next(p for p in self._pred[node] if p in remaining)
        return list(reversed(path[seen[node]:]))

    # -- totals -----------------------------------------------------------------------
    @property
    def total_flops(self) -> float:
        """Sum of the nodes' forward FLOPs."""
        return float(sum(n.flops for n in self))

    @property
    def total_param_bytes(self) -> int:
        """Sum of parameter bytes (each parameter is attributed to one node)."""
        return int(sum(n.param_bytes for n in self))

    @property
    def total_activation_bytes(self) -> int:
        """Sum of the nodes' output bytes (all activations, none freed)."""
        return int(sum(n.output_bytes for n in self))

    def _total_time_s(self, key: str) -> Optional[float]:
        times = [getattr(n, key) for n in self if getattr(n, key) is not None]
        return float(sum(times)) if times else None

    def count_by_op_type(self) -> Dict[str, int]:
        """Number of nodes of each op type, most frequent first."""
        return dict(Counter(n.op_type for n in self).most_common())

    def summary(self) -> Dict[str, Any]:
        """Plain-dict overview: sizes, totals (FLOPs, bytes, seconds) and op-type counts."""
        return {
            "name": self.name,
            "nodes": len(self.nodes),
            "edges": self.num_edges,
            "flops": self.total_flops,
            "param_bytes": self.total_param_bytes,
            "activation_bytes": self.total_activation_bytes,
            "edge_bytes": int(sum(b for _, _, b in self.edges)),
            "forward_time_s": self._total_time_s("forward_time_s"),
            "backward_time_s": self._total_time_s("backward_time_s"),
            "nodes_by_phase": dict(Counter(n.phase for n in self)),
            "op_types": self.count_by_op_type(),
        }

    # -- arrays for planners ----------------------------------------------------------
    def to_arrays(self) -> GraphArrays:
        """Index mapping, per-node cost vectors and CSR adjacency (see ``GraphArrays``).

        Raises ValueError if the graph has a cycle (``topo_order`` needs a DAG).
        """
        names = list(self.nodes)
        index = {n: i for i, n in enumerate(names)}
        nodes = list(self.nodes.values())

        def times(key: str) -> np.ndarray:
            return np.array([math.nan if getattr(n, key) is None else getattr(n, key)
                             for n in nodes], dtype=np.float64)

        def csr(adj: Dict[str, Dict[str, int]]) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
            indptr = np.zeros(len(names) + 1, dtype=np.int64)
            indptr[1:] = np.cumsum([len(adj[n]) for n in names])
            indices = np.array([index[d] for n in names for d in adj[n]], dtype=np.int64)
            nbytes = np.array([b for n in names for b in adj[n].values()], dtype=np.int64)
            return indptr, indices, nbytes

        succ = csr(self._succ)
        pred = csr(self._pred)
        return GraphArrays(
            names=names, index=index, op_types=[n.op_type for n in nodes],
            flops=np.array([n.flops for n in nodes], dtype=np.float64),
            param_bytes=np.array([n.param_bytes for n in nodes], dtype=np.int64),
            output_bytes=np.array([n.output_bytes for n in nodes], dtype=np.int64),
            forward_time_s=times("forward_time_s"), backward_time_s=times("backward_time_s"),
            succ_indptr=succ[0], succ_indices=succ[1], succ_bytes=succ[2],
            pred_indptr=pred[0], pred_indices=pred[1], pred_bytes=pred[2],
            topo_order=np.array([index[n] for n in self.topological_order()], dtype=np.int64),
        )

    # -- JSON -------------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        return {
            "format": JSON_FORMAT,
            "version": JSON_VERSION,
            "name": self.name,
            "meta": self.meta,
            "nodes": [n.to_dict() for n in self],
            "edges": [[s, d, b] for s, d, b in self.edges],
        }

    @classmethod
    def from_dict(cls, data: Dict[str, Any], source: str = "graph data") -> "OpGraph":
        """Build a graph from ``to_dict`` output; ValueError names what is wrong in ``source``."""
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a JSON object, got {type(data).__name__}.")
        if "version" not in data:
            raise ValueError(f"{source}: missing 'version' field (expected {JSON_VERSION}); "
                             "is this an OpGraph JSON file?")
        if data["version"] != JSON_VERSION:
            raise ValueError(f"{source}: unsupported OpGraph version {data['version']!r}; "
                             f"this reader knows version {JSON_VERSION}.")
        for key, kind in (("nodes", list), ("edges", list)):
            if not isinstance(data.get(key), kind):
                raise ValueError(f"{source}: '{key}' must be a list, but got "
                                 f"{type(data.get(key)).__name__}.")
        graph = cls(name=str(data.get("name", "graph")), meta=data.get("meta") or {})
        fields = set(OpNode.__dataclass_fields__)
        for i, raw in enumerate(data["nodes"]):
            if not isinstance(raw, dict):
                raise ValueError(f"{source}: node {i} must be an object, got {raw!r}.")
            for key in _REQUIRED_NODE_KEYS:
                if key not in raw:
                    raise ValueError(f"{source}: node {i} ({raw.get('name', '?')!r}) is "
                                     f"missing required key {key!r}.")
            unknown = sorted(set(raw) - fields)
            if unknown:
                raise ValueError(f"{source}: node {i} ({raw['name']!r}) has unknown keys "
                                 f"{unknown}.")
            try:
                graph.add_node(OpNode(**raw))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{source}: node {i} ({raw['name']!r}): {exc}") from None
        for i, edge in enumerate(data["edges"]):
            if not isinstance(edge, (list, tuple)) or len(edge) not in (2, 3):
                raise ValueError(f"{source}: edge {i} must be [src, dst] or [src, dst, bytes], "
                                 f"but got {edge!r}.")
            if not all(isinstance(x, str) for x in edge[:2]) or (
                    len(edge) == 3 and edge[2] is not None and not isinstance(edge[2], int)):
                raise ValueError(f"{source}: edge {i} must be [src name, dst name] or [src, "
                                 f"dst, bytes] with string names and integer bytes, but got "
                                 f"{edge!r}.")
            try:
                graph.add_edge(*edge)
            except ValueError as exc:
                raise ValueError(f"{source}: edge {i}: {exc}") from None
        return graph

    def save_json(self, path: str) -> None:
        """Write the graph as JSON atomically (temp file, then rename onto ``path``)."""
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load_json(cls, path: str) -> "OpGraph":
        """Read a graph written by ``save_json``; ValueError names the file and the problem."""
        with open(path, "r", encoding="utf-8") as fh:
            try:
                data = json.load(fh)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: not valid JSON ({exc}).") from None
            except UnicodeDecodeError:
                raise ValueError(f"{path}: binary, not graph JSON text (a MINDIR file must "
                                 f"end in .mindir).") from None
        return cls.from_dict(data, source=path)
