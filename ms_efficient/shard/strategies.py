"""Operators as einsum-like specs, the dp x mp device mesh, and candidate sharding strategies.

Every operator the sharding planner sees is an :class:`OpSpec`: named dimensions with sizes,
input tensors and one output, each a tuple of dimension names. A strategy maps each mesh axis
(``dp``, ``mp``) to one dimension of the operator (or to none: replicated along that axis),
optionally reduce-scatters a partial-sum output onto an output dimension, and picks a ZeRO
level for the operator's parameters (the optional optimizer-state shard dimension).

The outer axis is called ``dp`` because it splits the batch in the classic layouts, but by
default (``Mesh.dp_model_split``) it may split any dimension, as MindSpore's ``shard()``
allows: ``Layout(dp="f", mp="f")`` is 2-D (dp*mp-way) tensor parallelism of a weight across
nodes, which holds no byte of it twice and needs no gradient all-reduce, at the price of
activation collectives over the dp groups. With ``dp_model_split=False`` dp splits only
``OpSpec.dp_dims`` (batch, experts): data parallelism in the usual sense::

    MatMul x(b,s,h) . w(h,f) -> y(b,s,f)      Layout(dp="b", mp="f")      Megatron column
    MatMul x(b,s,f) . w(f,h) -> y(b,s,h)      Layout(dp="b", mp="f")      row, all-reduce
    MatMul x(b,s,f) . w(f,h) -> y(b,s,h)      Layout("b", "f", scatter="s")  row + SP (RS)
    LayerNorm x(b,s,h)                        Layout(dp="b", mp="s")      sequence parallel

:func:`shard_tuple` turns a layout into MindSpore's ``Primitive.shard`` form: one tuple of
split factors per input, e.g. ``((dp, 1, 1), (1, mp))``.

Mesh convention: ``devices = dp * mp`` numbered node-major; the ``mp`` axis is contiguous
(device ``r`` has mp index ``r % mp``), so an ``mp`` group of <= 8 lies inside one node and
the ``dp`` groups are strided across nodes.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["AXES", "Mesh", "TensorRef", "OpSpec", "Layout", "Strategy", "candidate_layouts",
           "candidate_strategies", "placement", "shard_factor", "shard_tuple", "parse_mesh",
           "add_same_split", "split_at_uses"]

AXES = ("dp", "mp")
TENSOR_KINDS = ("act", "param", "input")
SAVES = ("in", "out", "mask")


@dataclass(frozen=True)
class Mesh:
    """A 2-D logical device mesh.

    dp: size of the data-parallel axis (outer, strided over nodes), >= 1.
    mp: size of the model-parallel axis (inner, contiguous), >= 1.
    optimizer_shard: allow ZeRO levels 1..3 (optimizer states / grads / params sharded over
        the devices that would otherwise hold the same parameter shard).
    dp_model_split: let the dp axis split any dimension an operator allows (model dims too:
        2-D tensor parallelism), not only the batch-like ``OpSpec.dp_dims``.
    """

    dp: int
    mp: int
    optimizer_shard: bool = True
    dp_model_split: bool = True

    def __post_init__(self) -> None:
        for name in AXES:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"mesh '{name}' must be a positive integer, but got {value!r}.")

    @property
    def devices(self) -> int:
        return self.dp * self.mp

    def size(self, axis: str) -> int:
        return getattr(self, axis)

    def group(self, axes: Sequence[str]) -> List[int]:
        """Device ids of device 0's group spanning ``axes`` (e.g. ``("dp",)`` -> strided)."""
        dps = range(self.dp) if "dp" in axes else range(1)
        mps = range(self.mp) if "mp" in axes else range(1)
        return [i * self.mp + j for i in dps for j in mps]

    def __str__(self) -> str:
        return f"{self.dp}x{self.mp}"


def parse_mesh(text: str, optimizer_shard: bool = True, dp_model_split: bool = True) -> Mesh:
    """``"4x8"`` -> ``Mesh(dp=4, mp=8)``; bad text raises ValueError naming the format."""
    parts = str(text).lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"'mesh' must look like DPxMP with positive integers (e.g. '4x8'), "
                         f"but got {text!r}.")
    return Mesh(int(parts[0]), int(parts[1]), optimizer_shard, dp_model_split)


@dataclass(frozen=True)
class TensorRef:
    """One input tensor of an operator.

    dims: dimension names in the operator's namespace, in memory order.
    kind: "act" (produced by ``source``), "param" (a trainable weight) or "input" (graph input).
    source: producing operator's name for "act", else None.
    rename: consumer dim name -> producer dim name where they differ (K's "t" is Q's "s").
    dtype_bytes: bytes per element (2 for fp16/bf16 activations and weights; 4 for int32 ids).
    """

    dims: Tuple[str, ...]
    kind: str = "act"
    source: Optional[str] = None
    rename: Tuple[Tuple[str, str], ...] = ()
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        if self.kind not in TENSOR_KINDS:
            raise ValueError(f"tensor 'kind' must be one of {TENSOR_KINDS}, but got {self.kind!r}.")
        if (self.kind == "act") != (self.source is not None):
            raise ValueError(f"tensor of kind {self.kind!r} must {'' if self.kind == 'act' else 'not '}"
                             f"name a 'source', but got {self.source!r}.")

    def producer_dim(self, dim: str) -> str:
        return dict(self.rename).get(dim, dim)


@dataclass(frozen=True)
class OpSpec:
    """An operator as an einsum: ``output[out] = sum over contract of f(inputs)``.

    name: unique operator name. prim: MindSpore primitive type it stands for ("MatMul", ...).
    dims: ((name, size), ...) every dimension the operator iterates over.
    inputs: input tensors in the primitive's argument order.
    out: output dimension names. out_bytes: bytes per output element.
    contract: dims summed over (sharding one gives a partial-sum output needing a reduction).
    no_shard: dims no mesh axis may split (the normalised dim of LayerNorm / Softmax, ...).
    dp_dims: dims the dp axis may split when the mesh's ``dp_model_split`` is off (batch-like:
        "b", experts "e"); with it on, dp may split any dim mp may.
    scatter_dims: output dims a partial sum may be reduce-scattered onto (sequence parallel).
    saves: what backward keeps: "in<i>" (input i), "out" (the output), "mask" (1 byte per
        output element: dropout).
    tie: operators with the same tie key (repeated layers) must share one strategy.
    """

    name: str
    prim: str
    dims: Tuple[Tuple[str, int], ...]
    inputs: Tuple[TensorRef, ...]
    out: Tuple[str, ...]
    out_bytes: int = 2
    contract: Tuple[str, ...] = ()
    no_shard: Tuple[str, ...] = ()
    dp_dims: Tuple[str, ...] = ("b", "e")
    scatter_dims: Tuple[str, ...] = ("s",)
    saves: Tuple[str, ...] = ()
    tie: Optional[str] = None

    def __post_init__(self) -> None:
        names = [d for d, _ in self.dims]
        used = set(self.out).union(*[t.dims for t in self.inputs])
        unknown = sorted(used - set(names))
        if unknown:
            raise ValueError(f"op {self.name!r}: dims {unknown} are used but not declared.")
        for s in self.saves:
            if s not in ("out", "mask") and not (s.startswith("in") and s[2:].isdigit()
                                                 and int(s[2:]) < len(self.inputs)):
                raise ValueError(f"op {self.name!r}: 'saves' entry {s!r} must be 'out', "
                                 f"'mask' or 'in<i>' with i < {len(self.inputs)}.")

    @property
    def size(self) -> Dict[str, int]:
        return dict(self.dims)

    @property
    def tie_key(self) -> str:
        return self.tie or self.name

    def elems(self, dims: Sequence[str]) -> int:
        n = 1
        for d in dims:
            n *= self.size[d]
        return n

    def param_elems(self) -> int:
        return sum(self.elems(t.dims) for t in self.inputs if t.kind == "param")

    def signature(self) -> tuple:
        """Everything but the name and sources: tied operators must have equal signatures."""
        return (self.prim, self.dims, tuple((t.dims, t.kind, t.rename, t.dtype_bytes)
                                            for t in self.inputs),
                self.out, self.out_bytes, self.contract, self.no_shard, self.saves)


@dataclass(frozen=True)
class Layout:
    """Where the mesh axes split one operator.

    dp, mp: dim name split by that axis, or None (the operator is replicated along the axis).
    scatter: when ``mp`` splits a contracted dim, the output dim the partial sum is
        reduce-scattered onto (None: all-reduced, output replicated over mp).
    """

    dp: Optional[str] = None
    mp: Optional[str] = None
    scatter: Optional[str] = None

    def axis_dim(self, axis: str) -> Optional[str]:
        return getattr(self, axis)

    def __str__(self) -> str:
        s = f"dp:{self.dp or '-'},mp:{self.mp or '-'}"
        return s + (f",rs:{self.scatter}" if self.scatter else "")


@dataclass(frozen=True)
class Strategy:
    """A layout plus the ZeRO level of the operator's parameters (0 for none / no params).

    zero 0: params, grads, Adam states replicated over the param's replica group;
    1: optimizer states sharded over it; 2: + gradients; 3: + parameters.
    """

    layout: Layout
    zero: int = 0

    def __str__(self) -> str:
        return f"{self.layout}" + (f",zero{self.zero}" if self.zero else "")


def _divides(spec: OpSpec, mesh: Mesh, layout: Layout) -> bool:
    split: Dict[str, int] = {}
    for axis in AXES:
        d = layout.axis_dim(axis)
        if d is not None:
            split[d] = split.get(d, 1) * mesh.size(axis)
    if layout.scatter is not None:
        split[layout.scatter] = split.get(layout.scatter, 1) * mesh.mp
    return all(spec.size[d] % n == 0 for d, n in split.items())


def candidate_layouts(spec: OpSpec, mesh: Mesh) -> List[Layout]:
    """Every legal layout of ``spec`` on ``mesh``, in a fixed (deterministic) order.

    dp splits one dim (never none: every device of a dp group computes a different part) out of
    ``no_shard``: any such dim with ``mesh.dp_model_split``, else one of ``spec.dp_dims``
    (a mesh axis of size 1 always maps to None); mp splits any dim outside ``no_shard`` (or
    none); a partial sum over mp may be reduce-scattered onto one of ``scatter_dims`` that no
    axis splits yet. Sizes must divide evenly.
    """
    names = [d for d, _ in spec.dims]
    implicit = set(names) - set(spec.out) - set(spec.contract)   # sliced away: never split
    blocked = set(spec.no_shard) | implicit
    dp_opts: List[Optional[str]] = [None] if mesh.dp == 1 else [
        d for d in names if (mesh.dp_model_split or d in spec.dp_dims) and d not in blocked]
    if not dp_opts:
        dp_opts = [None]
    mp_opts: List[Optional[str]] = [None] + ([] if mesh.mp == 1 else
                                             [d for d in names if d not in blocked])
    out: List[Layout] = []
    for dp, mp in itertools.product(dp_opts, mp_opts):
        scatters: List[Optional[str]] = [None]
        if mp in spec.contract:
            scatters += [d for d in spec.out if d in spec.scatter_dims and d != dp]
        for sc in scatters:
            layout = Layout(dp, mp, sc)
            if _divides(spec, mesh, layout):
                out.append(layout)
    if not out:
        raise ValueError(f"op {spec.name!r} has no layout on mesh {mesh}: no dimension sizes "
                         f"{dict(spec.dims)} divide evenly; choose another mesh.")
    return out


def candidate_strategies(spec: OpSpec, mesh: Mesh) -> List[Strategy]:
    """Layouts x ZeRO levels (0..3 for operators with parameters when the mesh allows it)."""
    zeros = (0, 1, 2, 3) if mesh.optimizer_shard and spec.param_elems() else (0,)
    return [Strategy(lay, z) for lay in candidate_layouts(spec, mesh) for z in zeros]


def placement(spec: OpSpec, layout: Layout, tensor: Sequence[str],
              rename: Dict[str, str] | None = None) -> Tuple[Optional[str], ...]:
    """Per mesh axis, the dim of ``tensor`` it splits (None: replicated along that axis).

    ``tensor`` is a tuple of dim names of ``spec`` (an input, or the output as computed
    before any reduction); ``rename`` maps the names to another namespace (the producer's).
    """
    rename = rename or {}
    out = []
    for axis in AXES:
        d = layout.axis_dim(axis)
        out.append(rename.get(d, d) if d is not None and d in tensor else None)
    return tuple(out)


def output_placement(spec: OpSpec, layout: Layout) -> Tuple[Optional[str], ...]:
    """Placement of the output after the op's own reduction (all-reduce or reduce-scatter)."""
    pl = list(placement(spec, layout, spec.out))
    if layout.scatter is not None:
        pl[AXES.index("mp")] = layout.scatter
    return tuple(pl)


def shard_factor(pl: Sequence[Optional[str]], mesh: Mesh) -> int:
    """Number of pieces a tensor with placement ``pl`` is split into."""
    n = 1
    for axis, d in zip(AXES, pl):
        if d is not None:
            n *= mesh.size(axis)
    return n


def shard_tuple(spec: OpSpec, layout: Layout, mesh: Mesh) -> Tuple[Tuple[int, ...], ...]:
    """MindSpore ``Primitive.shard`` in_strategy: per input, the split factor of each dim."""
    result = []
    for t in spec.inputs:
        factors = []
        for d in t.dims:
            f = 1
            for axis in AXES:
                if layout.axis_dim(axis) == d:
                    f *= mesh.size(axis)
            factors.append(f)
        result.append(tuple(factors))
    return tuple(result)


# ---- tied tensors: one Parameter read by several operators (a tied embedding table and LM
# head) gets one split at every use. ``shard.graph_ops`` records the uses (``GraphOps.tied``:
# the first use owns the parameter's memory, later uses read it as an input);
# :func:`add_same_split` adds the constraint to the ILP of ``shard.ilp`` and
# :func:`split_at_uses` reads a plan's splits back.
def add_same_split(build, groups, key_of: Dict[str, str], specs: Sequence[OpSpec],
                   mesh, same_split: Sequence[Sequence[Tuple[str, int]]]) -> None:
    """[Constraint] every use (op, input index) of one tied tensor splits it identically:
    for each split tuple t, the first use picks a strategy giving t exactly when every
    other use does (sum_c [split(c) = t] s[g0, c] = sum_c [split(c) = t] s[gk, c])."""
    by_name = {s.name: s for s in specs}

    def split_of(op: str, index: int) -> Dict[tuple, list]:
        g = key_of[op]
        out: Dict[tuple, list] = {}
        for c, cand in enumerate(build.groups[g].cands):
            t = shard_tuple(by_name[op], cand.layout, mesh)[index]
            out.setdefault(t, []).append(build.s[(g, c)])
        return out

    for ti, uses in enumerate(same_split):
        first = split_of(*uses[0])
        for ui, (op, index) in enumerate(uses[1:]):
            if key_of[op] == key_of[uses[0][0]]:
                continue
            other = split_of(op, index)
            for vi, t in enumerate(sorted(set(first) | set(other))):
                build.prob += (sum(first.get(t, [])) == sum(other.get(t, [])),
                               f"same_split_{ti}_{ui}_{vi}")


def split_at_uses(specs: Sequence, strategies: Dict[str, object], mesh,
                  uses: Sequence[Tuple[str, int]]) -> List[List[int]]:
    """The split factors of the tied tensor at each use (op name, input index), in order."""
    by_name = {s.name: s for s in specs}
    return [list(shard_tuple(by_name[op], strategies[op].layout, mesh)[index])
            for op, index in uses]
