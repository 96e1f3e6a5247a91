"""FLOP and byte estimates for one operator from its tensor shapes (no MindSpore import).

Conventions
- One multiply-add counts as 2 FLOPs, so a ``[M, K] x [K, N]`` matmul costs ``2*M*N*K``.
- Other arithmetic counts 1 FLOP per result; ops built from several steps carry a per-element
  cost (``Softmax`` ~5: max, subtract, exp, sum, divide; ``LayerNorm`` ~8: mean, subtract,
  square, sum, rsqrt, multiply, scale, shift).
- Data movement (reshape, transpose, gather, cast, concat, ...) costs 0 FLOPs; its price is
  bytes, which the graph's ``output_bytes`` carries.
- Op types not in any table fall back to 1 FLOP per output element (a mild guess, never 0,
  so an unknown compute op is not free); ``is_known_op`` tells which ones these are.

Shapes are tuples of ints (``()`` is a scalar). Op type names are MindSpore primitive names
(``MatMul``, ``BatchMatMul``, ``Conv2D``, ``GeLU``, ...), as they appear in a MINDIR file.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

__all__ = [
    "DTYPE_BYTES",
    "dtype_bytes",
    "num_elements",
    "tensor_bytes",
    "op_flops",
    "is_known_op",
]

Shape = Tuple[int, ...]

# Bytes per element of each dtype name used in OpNode.output_dtypes.
DTYPE_BYTES: Dict[str, int] = {
    "bool": 1, "int8": 1, "uint8": 1, "qint4x2": 1,
    "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2,
    "int32": 4, "uint32": 4, "float32": 4,
    "int64": 8, "uint64": 8, "float64": 8, "complex64": 8,
    "complex128": 16,
}

# Ops that only move or relabel data: 0 FLOPs.
_ZERO_FLOP_OPS = frozenset({
    "Reshape", "Transpose", "TransposeExt", "ExpandDims", "Squeeze", "Flatten", "Cast",
    "Concat", "Stack", "Split", "StridedSlice", "Slice", "Gather", "GatherD", "GatherV2",
    "GatherNd", "Tile", "BroadcastTo", "Identity", "ZerosLike", "OnesLike", "Zeros", "Ones",
    "Fill", "FillV2", "Shape", "TensorShape", "OneHot", "ScatterNd", "TensorScatterUpdate",
    "Assign", "Padding", "Pad", "PadV3", "ReverseV2", "Embedding", "EmbeddingLookup",
    "Select", "MaskedFill", "Contiguous", "View", "Dropout", "DropoutGenMask",
    "DropoutDoMask", "Argmax", "ArgMaxWithValue", "TopK", "Sort", "StopGradient",
    "SplitWithSize", "SplitTensor", "StridedSliceGrad", "SliceGrad", "GatherDGrad",
    "GatherDGradV2", "Range", "Arange", "ScalarToTensor", "TupleToTensor",
    # control flow: the called sub-graphs carry the work
    "Call", "Partial", "Switch", "SwitchLayer",
})

# FLOPs per output element (ops whose work scales with their result).
_PER_OUTPUT_ELEMENT: Dict[str, float] = {
    # elementwise arithmetic and simple activations: 1 per element
    **{op: 1.0 for op in (
        "Add", "AddExt", "Sub", "SubExt", "Mul", "Muls", "RealDiv", "Div", "Neg", "Abs",
        "Maximum", "Minimum", "Square", "Sqrt", "Rsqrt", "Reciprocal", "Pow",
        "PowTensorScalar", "Exp", "Log", "ReLU", "ReLU6", "ReluGrad", "ReLU6Grad",
        "BiasAdd", "Greater", "Less", "Equal", "GreaterEqual", "LessEqual", "LogicalAnd",
        "LogicalOr", "LogicalNot", "Floor", "Round", "Sign", "Clip", "ClipByValue",
        "AssignAdd", "AssignSub", "LeakyReLU", "Erf", "Adds", "Subs", "Divs",
        "LessScalar", "GreaterScalar", "EqualScalar", "NotEqual", "Mod", "FloorDiv",
        "CumSum", "CumsumExt", "Atan2", "Cos", "Sin",
    )},
    # activations built from a few transcendental steps
    "Sigmoid": 4.0, "SigmoidGrad": 3.0, "Tanh": 4.0, "TanhGrad": 3.0,
    "SiLU": 5.0, "SiLUGrad": 6.0, "Swish": 5.0,
    "GeLU": 8.0, "GeLUGrad": 12.0, "FastGeLU": 6.0, "FastGeLUGrad": 10.0,
    # normalisations (forward ~8, backward about twice that)
    "Softmax": 5.0, "LogSoftmax": 5.0, "SoftmaxBackward": 4.0, "LogSoftmaxGrad": 4.0,
    "LayerNorm": 8.0, "LayerNormV3": 8.0, "LayerNormGrad": 16.0, "LayerNormGradV3": 16.0,
    "BatchNorm": 8.0, "BatchNormGrad": 16.0, "RmsNorm": 6.0, "RmsNormGrad": 12.0,
}

# FLOPs per element of the first input (reductions and losses; their output is small).
_PER_INPUT_ELEMENT: Dict[str, float] = {
    **{op: 1.0 for op in (
        "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "SumExt",
        "MeanExt", "MaxExt", "MinExt", "BiasAddGrad", "ArgMin", "ArgMax", "L2Loss",
        "AddN", "AccumulateNV2", "UnsortedSegmentSum", "ScatterAdd", "TensorScatterAdd",
    )},
    # softmax (5) + log + pick + mean over the logits
    "SoftmaxCrossEntropyWithLogits": 8.0, "SparseSoftmaxCrossEntropyWithLogits": 8.0,
}

# FLOPs per updated parameter element (optimizer update rules).
_PER_PARAM_ELEMENT: Dict[str, float] = {
    "SGD": 4.0, "ApplyMomentum": 4.0, "ApplyGradientDescent": 2.0,
    "Adam": 10.0, "ApplyAdam": 10.0, "AdamWeightDecay": 12.0, "AdamW": 12.0,
    "ApplyAdagrad": 6.0, "ApplyRMSProp": 8.0, "Lamb": 20.0, "LambApplyOptimizerAssign": 16.0,
}

_MATMUL_OPS = frozenset({"MatMul", "MatMulExt", "BatchMatMul", "BatchMatMulExt", "Bmm", "BmmExt",
                         "Dense"})
_CONV_OPS = frozenset({"Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter", "Conv3D",
                       "Conv2DTranspose", "Convolution", "ConvolutionGrad"})
_POOL_OPS = frozenset({"MaxPool", "AvgPool", "MaxPoolWithArgmax", "MaxPoolGrad", "AvgPoolGrad",
                       "MaxPoolGradWithArgmax"})


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name such as ``"float32"``."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(DTYPE_BYTES)}") from None


def num_elements(shape: Sequence[int]) -> int:
    """Number of elements of a tensor of ``shape`` (1 for a scalar ``()``)."""
    return int(math.prod(int(d) for d in shape))


def tensor_bytes(shape: Sequence[int], dtype: str) -> int:
    """Bytes held by a dense tensor of ``shape`` and ``dtype``."""
    return num_elements(shape) * dtype_bytes(dtype)


def is_known_op(op_type: str) -> bool:
    """True if ``op_flops`` has a rule for ``op_type`` (else it guesses 1 FLOP per element)."""
    return op_type in _ZERO_FLOP_OPS or op_type in _PER_OUTPUT_ELEMENT or \
        op_type in _PER_INPUT_ELEMENT or op_type in _PER_PARAM_ELEMENT or \
        op_type in _MATMUL_OPS or op_type in _CONV_OPS or op_type in _POOL_OPS


def _matmul_flops(op_type: str, input_shapes: Sequence[Shape], output_shapes: Sequence[Shape],
                  attrs: Mapping[str, Any]) -> float:
    """2 * (output elements) * K, K the contracted size of the first operand.

    Works for MatMul (2*M*N*K), batched and broadcast matmuls, and Dense (plus one add per
    output element for its bias when a third input is present). ``transpose_a``/``transpose_x1``
    set means the first operand is ``[..., K, M]``.
    """
    a = input_shapes[0]
    transpose_a = bool(attrs.get("transpose_a", attrs.get("transpose_x1", False)))
    if len(a) == 1:
        k = a[0]
    else:
        k = a[-2] if transpose_a else a[-1]
    out = num_elements(output_shapes[0])
    flops = 2.0 * out * k
    if op_type == "Dense" and len(input_shapes) > 2:
        flops += out
    return flops


def _conv_flops(op_type: str, input_shapes: Sequence[Shape],
                output_shapes: Sequence[Shape]) -> float:
    """2 * (forward output elements) * (C_in / groups) * kh * kw.

    Forward ``Conv2D(x, w)``: output ``[N, C_out, H, W]``, weight ``[C_out, C_in/g, kh, kw]``.
    ``Conv2DBackpropInput(dout, w, ...)`` and ``Conv2DBackpropFilter(dout, x, ...)`` do the same
    multiply-adds as the forward convolution whose output gradient is ``dout``.
    """
    if op_type == "Conv2DBackpropFilter":
        dout, weight = input_shapes[0], output_shapes[0]
    elif op_type == "Conv2DBackpropInput":
        dout, weight = input_shapes[0], input_shapes[1]
    else:
        dout, weight = output_shapes[0], input_shapes[1]
    return 2.0 * num_elements(dout) * num_elements(weight[1:])


def _pool_flops(input_shapes: Sequence[Shape], output_shapes: Sequence[Shape],
                attrs: Mapping[str, Any]) -> float:
    """One comparison/add per window element per output element."""
    kernel = attrs.get("kernel_size", (1, 1))
    if isinstance(kernel, int):
        kernel = (kernel, kernel)
    window = num_elements(kernel[-2:])
    return float(num_elements(output_shapes[0]) * window)


def op_flops(op_type: str, input_shapes: Sequence[Shape], output_shapes: Sequence[Shape],
             attrs: Optional[Mapping[str, Any]] = None) -> float:
    """Forward FLOPs of one op (multiply-add = 2 FLOPs).

    Args:
        op_type: MindSpore primitive name, e.g. ``"MatMul"``.
        input_shapes: shapes of the op's tensor inputs, in order (constants excluded).
        output_shapes: shapes of its outputs, in order.
        attrs: primitive attributes; ``transpose_a``/``transpose_b`` for matmuls,
            ``kernel_size`` for pooling.
    Returns:
        FLOPs as a float (0.0 for data movement; 1 per output element for unknown ops).
    """
    attrs = attrs or {}
    if not output_shapes:
        return 0.0
    if op_type in _ZERO_FLOP_OPS:
        return 0.0
    if op_type in _MATMUL_OPS and input_shapes:
        return _matmul_flops(op_type, input_shapes, output_shapes, attrs)
    if op_type in _CONV_OPS and len(input_shapes) >= 2:
        return _conv_flops(op_type, input_shapes, output_shapes)
    if op_type in _POOL_OPS:
        return _pool_flops(input_shapes, output_shapes, attrs)
    if op_type in _PER_INPUT_ELEMENT and input_shapes:
        return _PER_INPUT_ELEMENT[op_type] * num_elements(input_shapes[0])
    if op_type in _PER_PARAM_ELEMENT and input_shapes:
        return _PER_PARAM_ELEMENT[op_type] * num_elements(input_shapes[0])
    per_element = _PER_OUTPUT_ELEMENT.get(op_type, 1.0)
    return per_element * num_elements(output_shapes[0])
