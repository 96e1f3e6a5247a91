"""The user's Cells in a graph: operator scopes mapped to Cell paths, and the planning units.

A MINDIR scope such as ``Default/network-WithLossCell/_backbone-Net/layers-CellList/0-Block/
mlp-MLP/up_proj-Dense`` names, level by level, the attribute and the class of each Cell on the
way down. :func:`scope_segments` reads it as ``[("network", "WithLossCell"), ("_backbone",
"Net"), ...]`` and a Cell path is the attributes joined by dots, exactly as in
``network.cells_and_names()`` (``_backbone.layers.0.mlp.up_proj`` for a ``WithLossCell``).

:class:`CellTree` is the Cell tree a graph shows (paths, class names, parameter bytes), built
from the scopes alone, so a saved MINDIR or JSON graph can be planned by Cell without the
network. A train-step export (``nn.TrainOneStepCell``) roots scopes at the one-step Cell; its
``network`` level is dropped, so paths are relative to the network the user trains.

Scope caveats (MindSpore 2.10, see ``graph.mindir``): ops that load parameters carry their
own Cell's scope, but parameter-free ops of a second identical block may carry the first
block's. :func:`assign_units` therefore trusts scopes only for parameter ops and places every
other op between the units of the parameter ops before and after it in topological order.

No MindSpore import here.
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

import numpy as np

from ms_efficient.graph.opgraph import OpGraph

__all__ = ["CONTAINER_CLASSES", "scope_segments", "scope_path", "strip_train_root",
           "forward_subgraph", "CellTree", "cell_tree_from_graph",
           "repeated_blocks", "match_cells", "UnitAssignment", "assign_units"]

CONTAINER_CLASSES = ("CellList", "SequentialCell")
# Root levels of a train-step export: TrainOneStepCell's attribute for the trained network.
_TRAIN_ROOT_ATTRS = ("network",)
_RECOMPUTE_PREFIX = "recompute_"
_RECOMPUTE_CELL = "_recompute_cell"


def scope_segments(scope: str) -> List[Tuple[str, str]]:
    """``Default/a-A/b-B`` -> [("a", "A"), ("b", "B")]; a segment without ``-`` has no class.

    The attribute is everything before the LAST ``-`` (attribute names may not hold one,
    class names may not either), so ``0-Block`` is attribute ``0`` of class ``Block``.
    """
    parts = [p for p in _plain_scope(scope).split("/") if p]
    if parts and parts[0] == "Default":
        parts = parts[1:]
    out = []
    for p in parts:
        attr, sep, cls = p.rpartition("-")
        if sep and re.fullmatch(r"op\d+", cls):
            continue                      # an operator's own name (``MatMul-op0``), no Cell
        out.append((attr, cls) if sep else (p, ""))
    return out


def _plain_scope(scope: str) -> str:
    """``scope`` without the ``recompute_`` prefix MindSpore gives the operators of a Cell
    whose ``recompute()`` is set (``recompute_Default/...``): the same Cell path."""
    return scope[len(_RECOMPUTE_PREFIX):] if scope.startswith(_RECOMPUTE_PREFIX) else scope


def user_cell_path(path: str) -> bool:
    """True when ``path`` (as in ``cells_and_names()``) is a Cell of the user's network, not
    one of MindSpore's wrappers (``Cell.recompute()`` adds ``<cell>._recompute_cell`` and its
    ``wrap_cell``)."""
    return bool(path) and _RECOMPUTE_CELL not in path.split(".")


def scope_path(scope: str) -> str:
    """``Default/b0-Block/d1-Dense/MatMul-op0`` -> ``b0.d1``: the Cell path of a scope, rooted
    at the exported Cell."""
    return ".".join(a for a, _ in scope_segments(scope))


def strip_train_root(graph: OpGraph, scope: str) -> str:
    """``scope`` without the one-step Cell's ``network-...`` level when ``graph`` is a
    train-step export, so its Cell path is relative to the network the user trains."""
    parts = [p for p in _plain_scope(scope).split("/") if p]
    if _is_train_graph(graph) and len(parts) > 1 and parts[0] == "Default" and \
            parts[1].rpartition("-")[0] in _TRAIN_ROOT_ATTRS:
        parts = [parts[0]] + parts[2:]
    return "/".join(parts)


def forward_subgraph(graph: OpGraph) -> OpGraph:
    """The forward (and unknown-phase) operators of ``graph`` and the edges among them, with
    the same meta: what a placement or sharding plan partitions."""
    keep = [n for n in graph if n.phase in ("forward", "unknown")]
    out = OpGraph(name=graph.name, meta=dict(graph.meta))
    for n in keep:
        out.add_node(n)
    names = {n.name for n in keep}
    for src, dst, nbytes in graph.edges:
        if src in names and dst in names:
            out.add_edge(src, dst, nbytes)
    return out


@dataclass
class CellTree:
    """The Cells of a network as a graph or a live network shows them.

    paths: Cell paths as in ``cells_and_names()`` ("" = the root), parents before children.
    classes: {path: class name}. param_bytes: {path: parameter bytes of ops scoped directly
    to it or below (from a graph) or of its parameters (from a network)}.
    """

    paths: List[str]
    classes: Dict[str, str]
    param_bytes: Dict[str, int] = field(default_factory=dict)

    def children(self, path: str) -> List[str]:
        depth = path.count(".") + 1 if path else 0
        prefix = f"{path}." if path else ""
        return [p for p in self.paths
                if p and p.startswith(prefix) and p.count(".") == depth]

    def contains(self, path: str) -> bool:
        return path in self.classes

    @staticmethod
    def from_cells(cells: Sequence[Tuple[str, str, int]]) -> "CellTree":
        """From ``(path, class name, parameter bytes)`` triples, e.g. of ``cells_and_names()``."""
        paths = [p for p, _, _ in cells]
        return CellTree(paths=paths, classes={p: c for p, c, _ in cells},
                        param_bytes={p: int(b) for p, _, b in cells})


def _is_train_graph(graph: OpGraph) -> bool:
    return any(n.phase in ("backward", "optimizer") for n in graph) or \
        graph.meta.get("mode") == "train"


def node_cell_path(graph: OpGraph, scope: str) -> str:
    """The Cell path of a scope, relative to the trained network for train-step graphs."""
    return scope_path(strip_train_root(graph, scope))


def cell_tree_from_graph(graph: OpGraph) -> CellTree:
    """The Cell tree the scopes of ``graph`` show (forward ops; parameter bytes summed up the
    tree). Raises ValueError when the graph has no scopes (a PipeDream profile)."""
    classes: Dict[str, str] = {"": ""}
    params: Dict[str, int] = {"": 0}
    order: List[str] = [""]
    for node in graph:
        if node.phase not in ("forward", "unknown"):
            continue
        segs = scope_segments(strip_train_root(graph, node.scope))
        path = ""
        for attr, cls in segs:
            path = f"{path}.{attr}" if path else attr
            if path not in classes:
                classes[path] = cls
                params[path] = 0
                order.append(path)
        # parameters count for the op's own Cell and every Cell above it
        if node.param_bytes:
            p = path
            while True:
                params[p] += node.param_bytes
                if not p:
                    break
                p = p.rpartition(".")[0]
    if len(order) == 1:
        raise ValueError(f"graph {graph.name!r} has no Cell scopes (e.g. a PipeDream profile), "
                         "so its operators cannot be mapped to Cells.")
    # first-seen order: a Cell's path is created before any of its children's
    return CellTree(paths=order, classes=classes, param_bytes=params)


def repeated_blocks(tree: CellTree) -> List[str]:
    """The repeated blocks of every ``CellList`` / ``SequentialCell``: the children of a
    container with >= 2 children, all of one class and all holding parameters; outermost
    containers first, and nothing inside a block already taken. In the network's order."""
    taken: List[str] = []
    for path in tree.paths:
        if tree.classes.get(path) not in CONTAINER_CLASSES:
            continue
        if any(path == t or path.startswith(t + ".") for t in taken):
            continue
        kids = tree.children(path)
        if len(kids) < 2 or len({tree.classes[k] for k in kids}) != 1:
            continue
        if tree.classes[kids[0]] in CONTAINER_CLASSES:
            continue
        if any(tree.param_bytes.get(k, 0) <= 0 for k in kids):
            continue
        taken.extend(kids)
    return taken


def glob_matches(path: str, pattern: str) -> bool:
    """True when Cell ``path`` matches ``pattern`` one dot-separated level at a time: a glob
    (``*``, ``?``, ``[..]``) stays inside its level, so ``blocks.*`` matches ``blocks.0`` but
    not ``blocks.0.attn``, and ``blocks.*.attn`` matches only the ``attn`` of each block."""
    segs, pats = path.split("."), pattern.split(".")
    return len(segs) == len(pats) and all(fnmatch.fnmatchcase(s, p) for s, p in zip(segs, pats))


def largest_sequence(tree: CellTree) -> Tuple[str, List[str]]:
    """(path, children holding parameters) of the network's largest ``CellList`` /
    ``SequentialCell``: most children holding parameters, outermost first on a tie; ("", [])
    when no container has >= 2 children holding parameters."""
    best: Tuple[str, List[str]] = ("", [])
    for path in tree.paths:
        if tree.classes.get(path) not in CONTAINER_CLASSES:
            continue
        kids = [k for k in tree.children(path) if tree.param_bytes.get(k, 0) > 0]
        if len(kids) >= 2 and len(kids) > len(best[1]):
            best = (path, kids)
    return best


def sequence_units(tree: CellTree) -> List[str]:
    """Units of a network without repeated blocks: the children of its largest ``CellList`` /
    ``SequentialCell`` (:func:`largest_sequence`) that hold parameters, in the network's
    order (a parameter-free child, an activation, is priced outside the units). [] when no
    container has >= 2 children holding parameters."""
    return largest_sequence(tree)[1]


def sequence_groups(tree: CellTree) -> List[List[str]]:
    """The children of the largest sequence (:func:`largest_sequence`), ALL of them, grouped
    as each child holding parameters followed by the parameter-free children after it (a
    Conv2d and its ReLU); parameter-free children before the first go to the first group.
    The smallest pieces a segment of the sequence is made of; [] without such a sequence."""
    path, held = largest_sequence(tree)
    if not held:
        return []
    groups: List[List[str]] = []
    lead: List[str] = []
    for kid in tree.children(path):
        if kid in held:
            groups.append(lead + [kid])
            lead = []
        elif groups:
            groups[-1].append(kid)
        else:
            lead.append(kid)
    return groups


@dataclass
class UnitAssignment:
    """Forward operators grouped by planning unit.

    units: [U] Cell paths, in forward (topological) order of their first parameter op.
    order: int [n] indices (into ``graph.nodes()`` order) of the forward ops, topological.
    unit_of: int [n] unit index of each op of ``order``, -1 = outside every unit.
    """

    units: List[str]
    order: np.ndarray
    unit_of: np.ndarray

    def members(self, u: int) -> np.ndarray:
        return self.order[self.unit_of == u]


def _unit_index(path: str, units: Sequence[str]) -> int:
    for i, u in enumerate(units):
        if path == u or path.startswith(u + "."):
            return i
    return -1


def assign_units(graph: OpGraph, units: Sequence[str]) -> UnitAssignment:
    """Map the forward ops of ``graph`` to ``units`` (Cell paths).

    Step 1: an op's scope names a unit when its Cell path is the unit or below it.
    Step 2: parameter ops keep their scope's unit (their scopes are reliable); any other op
    gets its scope's unit only when that lies between the units of the nearest parameter ops
    before and after it in topological order, else the unit of the parameter op before it
    (the residual add closing a block, scoped to an earlier twin, goes to its own block).
    Raises ValueError when a unit has no parameter op in the graph.
    """
    nodes = list(graph)
    index = {n.name: i for i, n in enumerate(nodes)}
    topo = [index[name] for name in graph.topological_order()]
    order = np.array([i for i in topo if nodes[i].phase in ("forward", "unknown")],
                     dtype=np.int64)
    scoped = np.array([_unit_index(node_cell_path(graph, nodes[i].scope), units) for i in order],
                      dtype=np.int64)
    anchor = np.array([nodes[i].param_bytes > 0 for i in order]) & (scoped >= 0)
    missing = sorted(set(range(len(units))) - set(scoped[anchor].tolist()))
    if missing:
        raise ValueError(f"no parameter operator of the graph is scoped to "
                         f"{[units[m] for m in missing[:4]]}; each unit must hold parameters.")
    # forward position of each unit: its first anchor
    first = {u: int(np.flatnonzero(anchor & (scoped == u))[0]) for u in range(len(units))}
    rank = np.argsort(np.argsort([first[u] for u in range(len(units))]))   # unit -> order rank
    unit_of = np.full(order.size, -1, dtype=np.int64)
    prev = -1        # rank of the last anchor seen
    anchor_ranks = np.where(anchor, rank[np.maximum(scoped, 0)], -1)
    next_rank = np.full(order.size, len(units), dtype=np.int64)
    nxt = len(units)
    for k in range(order.size - 1, -1, -1):
        next_rank[k] = nxt
        if anchor[k]:
            nxt = anchor_ranks[k]
    by_rank = np.argsort(rank)                                               # rank -> unit
    last_anchor_pos = {u: int(np.flatnonzero(anchor & (scoped == u))[-1])
                       for u in range(len(units))}
    for k in range(order.size):
        if anchor[k]:
            prev = anchor_ranks[k]
            unit_of[k] = scoped[k]
            continue
        s = scoped[k]
        if s >= 0 and prev <= rank[s] <= next_rank[k]:
            unit_of[k] = s
        elif prev >= 0 and s >= 0:
            unit_of[k] = by_rank[prev]
        elif prev >= 0 and k <= last_anchor_pos[by_rank[prev]]:
            unit_of[k] = by_rank[prev]      # an unscoped op inside a unit's span
    ordered_units = [units[u] for u in by_rank]
    remap = {int(u): i for i, u in enumerate(by_rank)}
    unit_of = np.array([remap[int(u)] if u >= 0 else -1 for u in unit_of], dtype=np.int64)
    return UnitAssignment(units=ordered_units, order=order, unit_of=unit_of)


def assign_segments(graph: OpGraph, segments: Sequence[Sequence[str]]) -> UnitAssignment:
    """Map the forward ops of ``graph`` to segments, each a run of consecutive children of
    one sequence Cell (``[["features.0", "features.1"], ["features.2", ...]]``); a segment's
    unit name is its first child. The children holding parameters are assigned as units
    (:func:`assign_units`); every other op scoped inside the sequence goes to the segment of
    the last parameter op before it in topological order (the first segment before any), as
    parameter-free Cells of one class may all carry the first one's scope. Raises ValueError
    when a segment holds no parameter operator."""
    nodes = list(graph)
    segment_of = {c: i for i, seg in enumerate(segments) for c in seg}
    children = list(segment_of)
    container = children[0].rpartition(".")[0]
    held = {children[_unit_index(node_cell_path(graph, n.scope), children)] for n in nodes
            if n.param_bytes > 0 and n.phase in ("forward", "unknown")
            and _unit_index(node_cell_path(graph, n.scope), children) >= 0}
    empty = [seg[0] for seg in segments if not held & set(seg)]
    if empty:
        raise ValueError(f"segments starting at {empty[:4]} hold no parameter operator of the "
                         "graph; each segment must hold a Cell with parameters.")
    base = assign_units(graph, [c for c in children if c in held])
    unit_of = np.array([segment_of[base.units[u]] if u >= 0 else -1 for u in base.unit_of],
                       dtype=np.int64)
    current = 0
    for k, i in enumerate(base.order):
        if base.unit_of[k] >= 0:
            current = unit_of[k]
            continue
        path = node_cell_path(graph, nodes[i].scope)
        if container == "" or path.startswith(container + "."):
            unit_of[k] = current
    order = sorted(range(len(segments)), key=lambda s: int(np.flatnonzero(unit_of == s)[0]))
    remap = {s: r for r, s in enumerate(order)}
    return UnitAssignment(units=[segments[s][0] for s in order], order=base.order,
                          unit_of=np.array([remap[int(u)] if u >= 0 else -1 for u in unit_of],
                                           dtype=np.int64))


def match_cells(tree: CellTree, patterns: Sequence[str]) -> List[str]:
    """Cell paths matching any glob pattern (``model.layers.*.mlp``), in the network's order;
    a pattern matches Cells at its own depth only (see :func:`glob_matches`).
    Raises ValueError naming a pattern that matches nothing, with a few paths it could."""
    out = []
    for pat in patterns:
        hits = [p for p in tree.paths if p and glob_matches(p, pat)]
        if not hits:
            raise ValueError(f"Cell pattern {pat!r} matches no Cell of the network; it has "
                             f"e.g. {[p for p in tree.paths if p][:8]}.")
        out.extend(h for h in hits if h not in out)
    order = {p: i for i, p in enumerate(tree.paths)}
    nested = [p for p in out if any(p != q and p.startswith(q + ".") for q in out)]
    if nested:
        raise ValueError(f"units may not nest, but {nested[0]!r} lies inside another matched "
                         "Cell; make the patterns pick one level.")
    return sorted(out, key=order.__getitem__)


__all__ += ["node_cell_path", "user_cell_path", "glob_matches",
            "sequence_units", "largest_sequence", "sequence_groups", "assign_segments"]
