"""The forward operators of a user's graph (an exported ``OpGraph``) as sharding ``OpSpec``\\ s.

The template workloads (:mod:`ms_efficient.shard.workloads`) name a GPT's dimensions by hand;
this module derives them from the graph's own shapes, so the same ILP
(:func:`~ms_efficient.shard.ilp.solve_sharding`) plans any network MindSpore can export.

Per operator, from ``input_shapes`` / ``output_shapes`` and the reader's ``input_sources``
(``["op" | "param" | "input" | "other", name]`` per input):

    MatMul / Dense x[m,k] . w[k,n] (transpose flags)     contract k; saves x
    BatchMatMul / MatMulExt / BatchMatMulExt [..., m, k]  batch dims broadcast from the right
    elementwise (Add, Mul, SiLU, Cast, MaskedFill, ...)   inputs broadcast from the right
    ReduceSum/Mean/Max/Min, SumExt, MeanExt               reduced dims contracted (a split
                                                          one gives a partial result)
    Softmax / LogSoftmax                                  the softmax axes never split
    LayerNorm / RmsNorm                                   the normalised axes never split
    Gather (axis 0: embedding), GatherD                   the gathered axis contracted
                                                          (vocab-parallel embedding / loss)
    BiasAdd                                               the bias on the channel / last axis
    Conv2D (one group), BatchNorm, MaxPool / AvgPool      batch and channels split, spatial
                                                          and kernel dims never
    Conv2D (g > 1 groups: depthwise)                      batch only
    Unstack                                               the unstacked axis never split
    Split / StridedSlice / Slice                          full-size axes shared, sliced own
    Concat (a tuple of one rank)                          other axes shared, joined own
    (Sparse)SoftmaxCrossEntropyWithLogits                 rows and vocabulary contracted
    Transpose                                             output dims permute the input's
    Reshape / ExpandDims / Squeeze / Flatten              dims are the common refinement of
                                                          the two shapes (below)
    anything else                                         kept whole: replicated only

An operator reading a constant tensor (``attrs['const_tensor_inputs']``: position ids the
network builds, ``nn.Embedding(...)(Tensor(arange))``) is planned on its other inputs but
takes no strategy (not in ``GraphOps.shardable``): MindSpore's ``in_strategy`` has an entry
per tensor input, the constant's too, and the graph gives the constant no layout.

Dimension names are local to an operator (``d0``, ``d1``, ...), so repeated layers have equal
signatures and can be tied. An input edge renames each consumer dim to the producer's dim that
starts at the same flat offset (equal product of the sizes before it, both sizes > 1): splitting
either into k contiguous blocks then gives the same elements on every device, so ``[B*S, H]``
split on its first axis is ``[B, S, H]`` split on ``B``, and ``H`` split is ``[..., A, D]``
split on ``A``. Consumer dims with no such partner get a name no producer uses (``~d2``): the
cost model then charges the redistribution. A reshape whose two shapes have no common
refinement (``[6, 4] -> [4, 6]``) is kept whole.

Bytes: planned for mixed-precision training on Ascend, whatever dtype the CPU export used:
floating tensors 2 B per element, int32/int64 ids 4 B, bool and 8-bit 1 B. A parameter read by
several operators (tied embedding and head) counts once, at its first reader; later readers see
it as an input tensor. Batch dims (``OpSpec.dp_dims``) are the images of axis 0 of the graph's
inputs, carried through the renames; data-parallel baselines split them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ms_efficient.shard.strategies import OpSpec, TensorRef

__all__ = ["GraphOps", "specs_from_graph", "refine_shapes", "prefix_rename", "planned_bytes",
           "MATMULS"]

logger = logging.getLogger(__name__)

_ELEMENTWISE_SAVES: Dict[str, Tuple[str, ...]] = {
    # op type -> what its backward reads: "in" (its non-parameter inputs), "out", "mask" or ()
    **{op: () for op in ("Add", "AddExt", "InplaceAddExt", "Adds", "Sub", "SubExt", "Neg",
                         "Cast", "Muls",
                         "Identity", "Depend", "Equal", "NotEqual", "Less", "LessEqual",
                         "Greater", "GreaterEqual", "LogicalAnd", "LogicalOr", "LogicalNot",
                         "OnesLike", "ZerosLike", "StopGradient", "Assign")},
    **{op: ("in",) for op in ("Mul", "MulExt", "Div", "RealDiv", "DivMod", "Maximum",
                              "Minimum", "Pow", "SiLU", "GeLU", "FastGeLU", "ReLU", "Log",
                              "Square", "Abs", "Erf", "Sin", "Cos", "Select", "Swish",
                              "SquaredDifference", "LeakyReLU", "HSwish", "Softplus",
                              "ReLU6")},
    **{op: ("out",) for op in ("Exp", "Sigmoid", "Tanh", "Sqrt", "Rsqrt", "Reciprocal",
                               "Inv")},
    "MaskedFill": ("in1",), "Dropout": ("mask",), "DropoutExt": ("mask",),
}
MATMULS = ("MatMul", "MatMulExt", "BatchMatMul", "BatchMatMulExt", "Dense", "BatchMatMulV2")
_REDUCES = ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "SumExt", "MeanExt",
            "ReduceProd", "ReduceAll", "ReduceAny")
_RESHAPES = ("Reshape", "ExpandDims", "Squeeze", "Flatten", "View")
_NO_STRATEGY = _RESHAPES + ("Depend", "Identity", "StopGradient", "Cast")
Shape = Tuple[int, ...]


@dataclass
class GraphOps:
    """A graph's forward operators as specs.

    specs: topological order, names = graph node names. params: {spec name: [(input index,
    parameter name)]} of the parameters each spec owns. kept_whole: {op type: count} of
    operators no rule above covers (replicated only). shardable: spec names MindSpore's
    ``shard()`` takes a strategy for (not reshapes/casts, nor operators reading a constant
    tensor).
    """

    specs: List[OpSpec]
    params: Dict[str, List[Tuple[int, str]]]
    kept_whole: Dict[str, int]
    shardable: List[str]
    # {parameter name: [(spec name, input index), ...]} of parameters read by >= 2 ops (a
    # tied embedding / LM head), first use first; later uses read it as an "input" (its
    # memory counts once) and the ILP gives every use the same split (``same_split``)
    tied: Dict[str, List[Tuple[str, int]]] = field(default_factory=dict)

    def by_name(self) -> Dict[str, OpSpec]:
        return {s.name: s for s in self.specs}


def planned_bytes(dtype: str) -> int:
    """Planned bytes per element (mixed precision, see the module docstring); not the
    export's own size, which is ``graph.flops.dtype_bytes``."""
    d = str(dtype).lower()
    if d.startswith(("float", "bfloat", "complex")):
        return 2
    if d in ("bool", "int8", "uint8"):
        return 1
    return 4


def refine_shapes(a: Shape, b: Shape) -> Optional[List[int]]:
    """Sizes of the common refinement of two shapes of equal size (``[32, 32]`` and
    ``[2, 16, 4, 8]`` -> ``[2, 16, 4, 8]``; ``[2, 16, 32]`` and ``[32, 32]`` -> ``[2, 16, 32]``);
    None when the sizes differ or there is none (the prefix products of ``a`` and ``b`` do
    not form one divisibility chain, as in ``[6, 4]`` and ``[4, 6]``)."""
    def prefixes(s: Shape) -> List[int]:
        out, p = [], 1
        for n in s:
            p *= n
            out.append(p)
        return out

    pa, pb = prefixes(a), prefixes(b)
    total = pa[-1] if pa else 1
    if total != (pb[-1] if pb else 1):
        return None
    sizes, prev = [], 1
    for c in sorted(set(pa) | set(pb) | {total}):
        if c % prev:
            return None
        if c != prev:
            sizes.append(c // prev)
        prev = c
    return sizes or [1]


def prefix_rename(consumer: Sequence[Tuple[str, int]], producer: Sequence[Tuple[str, int]]
                  ) -> Tuple[Tuple[str, str], ...]:
    """Consumer dim -> producer dim starting at the same flat offset (see module docstring);
    every other consumer dim -> ``"~" + name`` (matches no producer dim)."""
    def starts(dims: Sequence[Tuple[str, int]]) -> Dict[int, str]:
        out, p = {}, 1
        for name, n in dims:
            if n > 1:
                out[p] = name
            p *= n
        return out

    total_c = 1
    for _, n in consumer:
        total_c *= n
    total_p = 1
    for _, n in producer:
        total_p *= n
    prod = starts(producer) if total_c == total_p else {}
    out, p = [], 1
    for name, n in consumer:
        out.append((name, prod.get(p, "~" + name) if n > 1 else "~" + name))
        p *= n
    return tuple(out)


class _Dims:
    """Local dim names d0, d1, ... of one operator."""

    def __init__(self) -> None:
        self.sizes: List[Tuple[str, int]] = []

    def new(self, size: int) -> str:
        name = f"d{len(self.sizes)}"
        self.sizes.append((name, int(size)))
        return name


@dataclass
class _Rule:
    ins: List[Tuple[str, ...]]
    out: Tuple[str, ...]
    contract: Tuple[str, ...] = ()
    no_shard: Tuple[str, ...] = ()
    saves: Tuple[str, ...] = ()


def _axis_list(value: Any, rank: int) -> Optional[List[int]]:
    if value is None or value == []:
        return list(range(rank))
    values = value if isinstance(value, (list, tuple)) else [value]
    try:
        return sorted({int(v) % rank for v in values}) if rank else []
    except (TypeError, ValueError):
        return None


def _const(node, index: int, attr: str, default: Any = None) -> Any:
    consts = node.attrs.get("const_inputs", {})
    if str(index) in consts:
        return consts[str(index)]
    return node.attrs.get(attr, default)


def _broadcast(dims: _Dims, out_names: Sequence[str], out_shape: Shape, shape: Shape
               ) -> Optional[Tuple[str, ...]]:
    if len(shape) > len(out_shape):
        return None
    names, off = [], len(out_shape) - len(shape)
    for j, n in enumerate(shape):
        if n == out_shape[off + j]:
            names.append(out_names[off + j])
        elif n == 1:
            names.append(dims.new(1))
        else:
            return None
    return tuple(names)


def _elementwise(node, dims: _Dims) -> Optional[_Rule]:
    if not node.output_shapes:
        return None
    out_shape = node.output_shapes[0]
    out = tuple(dims.new(n) for n in out_shape)
    ins = []
    for shape in node.input_shapes:
        names = _broadcast(dims, out, out_shape, shape)
        if names is None:
            return None
        ins.append(names)
    kind = _ELEMENTWISE_SAVES[node.op_type]
    saves: Tuple[str, ...] = ()
    if kind == ("in",):
        saves = tuple(f"in{i}" for i in range(len(ins)))
    elif kind:
        saves = kind if kind[0] != "in1" or len(ins) > 1 else ()
    return _Rule(ins, out, saves=saves)


def _matmul(node, dims: _Dims) -> Optional[_Rule]:
    shapes, op = node.input_shapes, node.op_type
    if len(shapes) < 2 or not node.output_shapes or min(len(shapes[0]), len(shapes[1])) < 2:
        return None
    ta = bool(node.attrs.get("transpose_a", node.attrs.get("transpose_x1", False)))
    tb = bool(node.attrs.get("transpose_b", node.attrs.get("transpose_x2", op == "Dense")))
    x, w, out_shape = shapes[0], shapes[1], node.output_shapes[0]
    m, k = (x[-1], x[-2]) if ta else (x[-2], x[-1])
    k2, n = (w[-1], w[-2]) if tb else (w[-2], w[-1])
    if k != k2 or tuple(out_shape[-2:]) != (m, n):
        return None
    batch_shape = tuple(out_shape[:-2])
    batch = tuple(dims.new(b) for b in batch_shape)
    dm, dk, dn = dims.new(m), dims.new(k), dims.new(n)
    bx = _broadcast(dims, batch, batch_shape, tuple(x[:-2]))
    bw = _broadcast(dims, batch, batch_shape, tuple(w[:-2]))
    if bx is None or bw is None:
        return None
    ins = [bx + ((dk, dm) if ta else (dm, dk)), bw + ((dn, dk) if tb else (dk, dn))]
    if op == "Dense" and len(shapes) > 2:
        ins.append((dn,))
    return _Rule(ins, batch + (dm, dn), contract=(dk,), saves=("in0", "in1"))


def _reduce(node, dims: _Dims) -> Optional[_Rule]:
    if not node.input_shapes or not node.output_shapes:
        return None
    shape = node.input_shapes[0]
    axes = _axis_list(_const(node, 1, "axis"), len(shape))
    if axes is None:
        return None
    keep = bool(_const(node, 2, "keep_dims", False))
    names = [dims.new(n) for n in shape]
    out = []
    for j, name in enumerate(names):
        if j not in axes:
            out.append(name)
        elif keep:
            out.append(dims.new(1))
    if tuple(dict(dims.sizes)[d] for d in out) != tuple(node.output_shapes[0]):
        return None
    saves = ("in0", "out") if node.op_type in ("ReduceMax", "ReduceMin") else ()
    return _Rule([tuple(names)], tuple(out), contract=tuple(names[j] for j in axes),
                 saves=saves)


def _normalised(node, dims: _Dims) -> Optional[_Rule]:
    if not node.input_shapes:
        return None
    shape = node.input_shapes[0]
    names = tuple(dims.new(n) for n in shape)
    rank = len(shape)
    if node.op_type in ("Softmax", "LogSoftmax"):
        axes = _axis_list(node.attrs.get("axis", -1), rank)
        if axes is None:
            return None
        return _Rule([names], names, no_shard=tuple(names[a] for a in axes), saves=("out",))
    if node.op_type == "LayerNorm":
        begin = int(node.attrs.get("begin_norm_axis", -1)) % rank
        pbegin = int(node.attrs.get("begin_params_axis", -1)) % rank
    else:   # RmsNorm: the gamma's rank
        gamma = node.input_shapes[1] if len(node.input_shapes) > 1 else (shape[-1],)
        begin = pbegin = rank - len(gamma)
    ins = [names] + [names[pbegin:] for _ in node.input_shapes[1:]]
    for s, t in zip(node.input_shapes[1:], ins[1:]):
        if tuple(s) != tuple(dict(dims.sizes)[d] for d in t):
            return None
    return _Rule(ins, names, no_shard=names[begin:], saves=("in0",))


def _gather(node, dims: _Dims) -> Optional[_Rule]:
    shapes = node.input_shapes
    if len(shapes) != 2 or not node.output_shapes:
        return None
    if node.op_type == "Gather":
        axis = _const(node, 2, "axis", 0)
        if axis != 0 or node.attrs.get("batch_dims", 0):
            return None
        table, idx = shapes
        v = dims.new(table[0])
        rest = tuple(dims.new(n) for n in table[1:])
        ids = tuple(dims.new(n) for n in idx)
        if tuple(node.output_shapes[0]) != tuple(idx) + tuple(table[1:]):
            return None
        return _Rule([(v,) + rest, ids], ids + rest, contract=(v,), saves=("in1",))
    # GatherD(x, dim, index): out has index's shape; x equals it off the gathered axis
    x, idx = shapes
    axis = _const(node, 1, "dim", None)
    if axis is None or len(x) != len(idx):
        return None
    axis = int(axis) % len(x)
    out = tuple(dims.new(n) for n in idx)
    xs = []
    for j, n in enumerate(x):
        if j == axis:
            xs.append(dims.new(n))
        elif n == idx[j]:
            xs.append(out[j])
        else:
            return None
    return _Rule([tuple(xs), out], out, contract=(xs[axis],), saves=("in1",))


def _transpose(node, dims: _Dims) -> Optional[_Rule]:
    if not node.input_shapes:
        return None
    perm = _const(node, 1, "perm")
    shape = node.input_shapes[0]
    if not isinstance(perm, (list, tuple)) or sorted(int(p) for p in perm) != list(range(len(shape))):
        return None
    names = tuple(dims.new(n) for n in shape)
    return _Rule([names], tuple(names[int(p)] for p in perm))


def _reshape(node, dims: _Dims) -> Optional[_Rule]:
    if not node.input_shapes or not node.output_shapes:
        return None
    sizes = refine_shapes(tuple(node.input_shapes[0]), tuple(node.output_shapes[0]))
    if sizes is None:
        return None
    names = tuple(dims.new(n) for n in sizes)
    return _Rule([names], names)


def _bias_add(node, dims: _Dims) -> Optional[_Rule]:
    shapes = node.input_shapes
    if len(shapes) != 2 or len(shapes[1]) != 1 or not shapes[0]:
        return None
    names = tuple(dims.new(n) for n in shapes[0])
    axis = 1 if len(names) > 2 and node.attrs.get("data_format", 0) in (0, "NCHW") else -1
    if shapes[1][0] != shapes[0][axis]:
        return None
    return _Rule([names, (names[axis],)], names)


def _slice_like(node, dims: _Dims) -> Optional[_Rule]:
    """Split / StridedSlice / Slice: axes that keep their full size are shared, the sliced
    ones are the input's and the output's own (never split)."""
    shapes = node.input_shapes
    if not shapes or not node.output_shapes or len(shapes[0]) != len(node.output_shapes[0]):
        return None
    x, y = shapes[0], node.output_shapes[0]
    xs, ys, own = [], [], []
    for a, b in zip(x, y):
        if a == b:
            d = dims.new(a)
            xs.append(d)
            ys.append(d)
        else:
            xs.append(dims.new(a))
            ys.append(dims.new(b))
            own += [xs[-1], ys[-1]]
    return _Rule([tuple(xs)] + [tuple(dims.new(n) for n in s) for s in shapes[1:]], tuple(ys),
                 no_shard=tuple(own))


def _concat(node, dims: _Dims) -> Optional[_Rule]:
    """Concat of tensors of one rank along ``axis`` (ViT's class token and patches): the other
    axes are shared by every input and the output, the joined axis is each tensor's own and
    never splits."""
    shapes, out = node.input_shapes, node.output_shapes
    if len(shapes) < 2 or not out or any(len(s) != len(out[0]) for s in shapes):
        return None
    y = out[0]
    axis = node.attrs.get("axis", 0)
    if isinstance(axis, bool) or not isinstance(axis, int) or not -len(y) <= axis < len(y):
        return None
    axis %= len(y)
    if any(tuple(s[:axis]) + tuple(s[axis + 1:]) != tuple(y[:axis]) + tuple(y[axis + 1:])
           for s in shapes) or sum(s[axis] for s in shapes) != y[axis]:
        return None
    shared = [dims.new(n) for n in y]
    own = [dims.new(s[axis]) for s in shapes]
    ins = [tuple(shared[:axis] + [a] + shared[axis + 1:]) for a in own]
    return _Rule(ins, tuple(shared), no_shard=tuple(own) + (shared[axis],))


def _cross_entropy(node, dims: _Dims) -> Optional[_Rule]:
    """(Sparse)SoftmaxCrossEntropyWithLogits: logits [M, V], labels [M] or [M, V] -> the mean
    (a scalar) or per-row losses; a split V or M gives partial sums (vocab-parallel loss)."""
    shapes = node.input_shapes
    if len(shapes) != 2 or len(shapes[0]) != 2 or not node.output_shapes:
        return None
    m, v = dims.new(shapes[0][0]), dims.new(shapes[0][1])
    labels = (m,) if len(shapes[1]) == 1 else (m, v)
    if tuple(shapes[1]) != tuple(dict(dims.sizes)[d] for d in labels):
        return None
    out = tuple(node.output_shapes[0])
    if out == ():
        return _Rule([(m, v), labels], (), contract=(m, v), saves=("in0", "in1"))
    if out == (shapes[0][0],):
        return _Rule([(m, v), labels], (m,), contract=(v,), saves=("in0", "in1"))
    return None


def _conv(node, dims: _Dims) -> Optional[_Rule]:
    """Conv2D x[N, C, H, W] . w[O, C / g, kh, kw]: batch N; with one group contract C and
    split the output channels O; with g > 1 groups (depthwise: g = C) neither channel dim
    splits (MindSpore's Conv2DInfo refuses a split cout or cin when the group is not 1), so
    only the batch does. Spatial and kernel dims never split."""
    shapes = node.input_shapes
    if len(shapes) < 2 or len(shapes[0]) != 4 or len(shapes[1]) != 4 or not node.output_shapes:
        return None
    x, w, y = shapes[0], shapes[1], node.output_shapes[0]
    group = int(node.attrs.get("group", 1))
    if group < 1 or w[1] * group != x[1] or len(y) != 4 or tuple(y[:2]) != (x[0], w[0]):
        return None
    n, c, o = dims.new(x[0]), dims.new(x[1]), dims.new(w[0])
    cw = c if group == 1 else dims.new(w[1])
    xs = (dims.new(x[2]), dims.new(x[3]))
    ks = (dims.new(w[2]), dims.new(w[3]))
    ys = (dims.new(y[2]), dims.new(y[3]))
    channels = () if group == 1 else (c, cw, o)
    return _Rule([(n, c) + xs, (o, cw) + ks], (n, o) + ys, contract=(cw,) + ks,
                 no_shard=channels + xs + ks + ys, saves=("in0", "in1"))


def _unstack(node, dims: _Dims) -> Optional[_Rule]:
    """Unstack x along ``axis`` into tensors of x's shape without it (ViT's q, k, v): the
    other dims are shared with every output, the unstacked one never splits."""
    if not node.input_shapes or not node.output_shapes:
        return None
    x = node.input_shapes[0]
    axis = node.attrs.get("axis", 0)
    if not isinstance(axis, int) or not -len(x) <= axis < len(x):
        return None
    axis %= len(x)
    names = tuple(dims.new(n) for n in x)
    out = names[:axis] + names[axis + 1:]
    if any(tuple(s) != tuple(x[:axis]) + tuple(x[axis + 1:]) for s in node.output_shapes):
        return None
    return _Rule([names], out, no_shard=(names[axis],))


def _channels(node, dims: _Dims) -> Optional[_Rule]:
    """BatchNorm x[N, C, ...] with per-channel parameters; MaxPool / AvgPool x[N, C, H, W]:
    batch and channels split, spatial dims never."""
    shapes = node.input_shapes
    if not shapes or len(shapes[0]) < 2 or not node.output_shapes:
        return None
    x, y = shapes[0], node.output_shapes[0]
    n, c = dims.new(x[0]), dims.new(x[1])
    if node.op_type == "BatchNorm":
        if tuple(y) != tuple(x) or any(tuple(s) != (x[1],) for s in shapes[1:]):
            return None
        rest = tuple(dims.new(d) for d in x[2:])
        return _Rule([(n, c) + rest] + [(c,)] * (len(shapes) - 1), (n, c) + rest,
                     saves=("in0",))
    if len(x) != 4 or len(y) != 4 or tuple(y[:2]) != tuple(x[:2]):
        return None
    xs = (dims.new(x[2]), dims.new(x[3]))
    ys = (dims.new(y[2]), dims.new(y[3]))
    return _Rule([(n, c) + xs], (n, c) + ys, no_shard=xs + ys, saves=("in0",))


def _rule_for(op_type: str) -> Optional[Callable[[Any, _Dims], Optional[_Rule]]]:
    if op_type in MATMULS:
        return _matmul
    if op_type in _ELEMENTWISE_SAVES:
        return _elementwise
    if op_type in _REDUCES:
        return _reduce
    if op_type in ("Softmax", "LogSoftmax", "LayerNorm", "RmsNorm"):
        return _normalised
    if op_type in ("Gather", "GatherD"):
        return _gather
    if op_type == "Transpose":
        return _transpose
    if op_type in _RESHAPES:
        return _reshape
    if op_type == "BiasAdd":
        return _bias_add
    if op_type == "Conv2D":
        return _conv
    if op_type == "Unstack":
        return _unstack
    if op_type in ("BatchNorm", "MaxPool", "AvgPool"):
        return _channels
    if op_type in ("Split", "StridedSlice", "Slice", "SplitWithSize"):
        return _slice_like
    if op_type == "Concat":
        return _concat
    if op_type in ("SparseSoftmaxCrossEntropyWithLogits", "SoftmaxCrossEntropyWithLogits"):
        return _cross_entropy
    return None


def _whole(node, dims: _Dims) -> _Rule:
    """An operator no rule covers: every dim its own, none split."""
    ins = [tuple(dims.new(n) for n in s) for s in node.input_shapes]
    out = tuple(dims.new(n) for n in (node.output_shapes[0] if node.output_shapes else ()))
    all_dims = tuple(d for d, _ in dims.sizes)
    return _Rule(ins, out, no_shard=all_dims,
                 saves=tuple(f"in{i}" for i in range(len(ins))))


def specs_from_graph(graph, tie_units: Optional[Sequence[Sequence[str]]] = None) -> GraphOps:
    """Specs of the forward operators of ``graph`` (a train-step or forward ``OpGraph``
    exported with input sources, see :mod:`ms_efficient.graph.mindir_reader`).

    tie_units: optional groups of node names, one sequence per repeated block in the same
        order (e.g. the members of each ``layers.N``); the k-th specs of all blocks get one
        tie key when their signatures are equal (the ILP then plans them as one).
    Raises ValueError for a graph without forward operators or without input sources.
    """
    nodes = [graph[n] for n in graph.topological_order()
             if graph[n].phase in ("forward", "unknown")]
    if not nodes:
        raise ValueError(f"graph {graph.name!r} has no forward operators to shard.")
    missing = [n.name for n in nodes if "input_sources" not in n.attrs]
    if missing:
        raise ValueError(f"graph {graph.name!r}: operator {missing[0]!r} has no "
                         f"'input_sources'; export the graph again with this version "
                         f"(ms-efficient graph ... or graph.from_network) to shard it.")
    specs: Dict[str, OpSpec] = {}
    order: List[str] = []
    params: Dict[str, List[Tuple[int, str]]] = {}
    seen_params: set = set()
    first_use: Dict[str, Tuple[str, int]] = {}
    tied: Dict[str, List[Tuple[str, int]]] = {}
    kept_whole: Dict[str, int] = {}
    shardable: List[str] = []
    batch_of: Dict[str, set] = {}                     # spec name -> its batch dim names
    input_dtypes = {i["name"]: i.get("dtype", "float32") for i in graph.meta.get("inputs", [])}
    for node in nodes:
        sources = node.attrs["input_sources"]
        dtypes = node.attrs.get("input_dtypes", [])
        if len(sources) != len(node.input_shapes):
            sources = [["other", ""]] * len(node.input_shapes)
        dims = _Dims()
        rule_fn = _rule_for(node.op_type)
        rule = rule_fn(node, dims) if rule_fn else None
        if rule is None:
            dims = _Dims()
            rule = _whole(node, dims)
            kept_whole[node.op_type] = kept_whole.get(node.op_type, 0) + 1
        size = dict(dims.sizes)
        refs, owned, batch = [], [], set()
        for i, (names, (kind, source)) in enumerate(zip(rule.ins, sources)):
            nbytes = planned_bytes(dtypes[i] if i < len(dtypes) else
                                 input_dtypes.get(source, "float32"))
            if kind == "op" and source in specs:
                prod = specs[source]
                rename = prefix_rename([(d, size[d]) for d in names],
                                       [(d, prod.size[d]) for d in prod.out])
                refs.append(TensorRef(names, "act", source, rename, nbytes))
                batch |= {c for c, p in rename if p in batch_of[source]}
            elif kind == "param" and source not in seen_params:
                seen_params.add(source)
                first_use[source] = (node.name, i)
                owned.append((i, source))
                refs.append(TensorRef(names, "param", dtype_bytes=nbytes))
            else:
                if kind == "param":           # a tied parameter's later use
                    tied.setdefault(source, [first_use[source]]).append((node.name, i))
                    owned.append((i, source))
                refs.append(TensorRef(names, "input", dtype_bytes=nbytes))
                if kind == "input" and names and size[names[0]] > 1:
                    batch.add(names[0])
        out_bytes = planned_bytes(node.output_dtypes[0]) if node.output_dtypes else 2
        saves = tuple(s for s in rule.saves if not (
            s.startswith("in") and refs[int(s[2:])].kind == "param"))
        dp_dims = tuple(d for d, _ in dims.sizes if d in batch)
        spec = OpSpec(name=node.name, prim=node.op_type, dims=tuple(dims.sizes),
                      inputs=tuple(refs), out=rule.out, out_bytes=out_bytes,
                      contract=rule.contract, no_shard=rule.no_shard, dp_dims=dp_dims,
                      scatter_dims=(), saves=saves)
        specs[node.name] = spec
        order.append(node.name)
        batch_of[node.name] = set(dp_dims)
        if owned:
            params[node.name] = owned
        if node.op_type not in _NO_STRATEGY and rule_fn is not None and \
                not node.attrs.get("const_tensor_inputs"):
            shardable.append(node.name)
    if tie_units:
        _tie(specs, tie_units)
    if kept_whole:
        logger.info("sharding keeps whole (replicated) the op types %s", kept_whole)
    return GraphOps([specs[n] for n in order], params, kept_whole, shardable, tied)


def _tie(specs: Dict[str, OpSpec], units: Sequence[Sequence[str]]) -> None:
    """Tie the k-th specs of the units when their signatures match (in place).

    Equally long units are tied position by position. When the lengths differ (a block's
    scope also names a neighbour's parameter-free ops: in an exported LLaMA the first block
    holds the start of its own RMSNorm, which every later block's export files under the
    block before it, and the last holds the final norm), the units whose whole signature
    sequence is the most common one are tied and the others (those boundary blocks) are left
    untied: they keep their own strategies, as every op did before, and the ILP has one copy
    of the middle blocks instead of one per block."""
    members = [[n for n in unit if n in specs] for unit in units]
    if len(members) < 2:
        return
    tied = members
    if len({len(m) for m in members}) > 1:
        sequences = [tuple(specs[n].signature() for n in m) for m in members]
        counts: Dict[tuple, int] = {}
        for seq in sequences:
            counts[seq] = counts.get(seq, 0) + 1
        common = max(counts, key=lambda seq: (counts[seq], len(seq)))
        tied = [m for m, seq in zip(members, sequences) if seq == common]
        if len(tied) < 2 or not common:
            return
        logger.info("tied %d of %d repeated blocks (%d ops each); the %d others have "
                    "other op sequences and are planned op by op", len(tied), len(members),
                    len(common), len(members) - len(tied))
    for k in range(len(tied[0])):
        group = [specs[m[k]] for m in tied]
        if len({s.signature() for s in group}) == 1:
            key = f"tie{k}:{group[0].prim}"
            for s in group:
                specs[s.name] = replace(s, tie=key)
