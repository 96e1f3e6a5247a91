"""Walk a parsed MINDIR protobuf (``mind_ir_pb2.ModelProto``) into an OpGraph.

No MindSpore import here: ``ms_efficient.graph.mindir`` parses the file and passes in the
protobuf module and a lookup of primitive init arguments. How the protobuf maps to OpGraph:

- op type: ``node.op_type`` is ``REF::<key>``, resolved through ``model.primitives``; a key
  naming a sub-graph or a computed callable (a ``Switch`` output) is a ``Call``;
- outputs: the node attribute ``shape`` (a tensor, or a tuple of tensors);
- scope: ``node.domain`` minus its last part (``Default/d1-Dense/MatMul-op0`` ->
  ``Default/d1-Dense``); the full domain, made unique, is the node's name;
- parameters: ``graph.parameter`` (dims, dtype); each parameter's bytes go to the first
  compute op (in graph order) that reads it, directly or through ``Load``;
- constant inputs (``Constant`` nodes) become attributes: for primitive-function ops the
  trailing constants are the primitive's init arguments (MatMul's ``transpose_a``/``_b``);
  other constants are kept as ``attrs['const_inputs']`` by input position, constant
  tensors as their shapes in ``attrs['const_tensor_inputs']`` (not in ``input_shapes``);
- bookkeeping nodes (Load, Depend, UpdateState, MakeTuple, TupleGetItem, Return, ...) are
  dropped and data edges are traced through them (monad/control inputs are not edges).

Phases: scope ``Gradients/...`` -> backward; a scope part ``name-<Optimizer class>`` ->
optimizer; other scopes -> forward. Optimizer ops that update parameters in place
(``side_effect_mem``) get ``output_bytes`` 0 (their outputs alias the parameters; the
number is kept in ``attrs['aliased_output_bytes']``).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Iterable, List, Set, Tuple

from ms_efficient.graph.flops import DTYPE_BYTES, is_known_op, op_flops
from ms_efficient.graph.opgraph import OpGraph, OpNode

__all__ = ["BOOKKEEPING_OPS", "MindIRReader"]

logger = logging.getLogger(__name__)

# Nodes that only route values, order side effects or load parameters.
BOOKKEEPING_OPS = frozenset({
    "Return", "MakeTuple", "MakeList", "TupleGetItem", "ListGetItem", "Depend",
    "UpdateState", "Load",
})
_PASS_FIRST_INPUT = frozenset({"Depend", "Load"})
_GET_ITEM = frozenset({"TupleGetItem", "ListGetItem"})
_MAKE_SEQ = frozenset({"MakeTuple", "MakeList"})
# Operators whose tuple input gets a source per element (the shard pass has a rule for them);
# other operators reading a tuple see ``["other", ""]`` for each of its tensors.
_SEQ_INPUT_OPS = frozenset({"Concat"})
_SKIPPED_ATTRS = frozenset({"input_names", "output_names"})
_DTYPE_RENAMES = {"float": "float32", "double": "float64"}

Tensor = Tuple[Tuple[int, ...], str]  # (shape, dtype name)


class MindIRReader:
    """One pass over a parsed ModelProto; tables are local to this object.

    Args:
        model: a parsed ``mind_ir_pb2.ModelProto``.
        pb2: the ``mind_ir_pb2`` module (for enum names).
        optimizer_classes: class names whose scope part marks optimizer ops.
        init_arg_names: op type -> names of its primitive's init arguments, in order.
    """

    def __init__(self, model: Any, pb2: Any, optimizer_classes: Set[str],
                 init_arg_names: Callable[[str], List[str]]) -> None:
        self.pb2 = pb2
        self._lookup_init_args = init_arg_names
        self.attr_type = pb2.AttributeProto.AttributeType.Name
        self.optimizer_classes = optimizer_classes
        self.prims = {p.name: p for p in model.primitives}
        self.function_prim = pb2.PrimitiveProto.PrimType.Value("PRIMITIVE_FUNCTION")
        graphs = [model.graph, *model.functions]
        self.main_graph = model.graph.name
        self.functions = {g.name for g in model.functions}
        if self.functions:
            logger.warning("MINDIR has %d sub-graphs (control flow): their ops are read but "
                           "calls into them are not inlined, so edges across calls are "
                           "missing.", len(self.functions))
        self.nodes = [n for g in graphs for n in g.node]
        self.producer = {out: n for n in self.nodes for out in (n.output or [n.name])}
        self.params: Dict[str, Tensor] = {}
        self.inputs: Dict[str, Tensor] = {}
        self.short_name: Dict[str, str] = {}  # "<graph>:d1.weight" -> "d1.weight"
        for g in graphs:
            for p in g.parameter:
                self.params[p.name] = (tuple(p.dims), self._dtype(p.data_type))
                self.short_name[p.name] = _strip_prefix(p.name, g.name)
            for i in g.input:
                self.short_name[i.name] = _strip_prefix(i.name, g.name)
                if i.tensor:
                    self.inputs[i.name] = (tuple(i.tensor[0].dims),
                                           self._dtype(i.tensor[0].data_type))
        self.compute_name: Dict[str, str] = {}
        self.init_args: Dict[str, List[str]] = {}
        self._data_memo: Dict[str, List[Tuple[str, int]]] = {}

    # -- decoding helpers -------------------------------------------------------------
    def _dtype(self, code: int) -> str:
        name = self.pb2.TensorProto.DataType.Name(code).lower()
        return _DTYPE_RENAMES.get(name, name)

    def op_type(self, node: Any) -> str:
        """Primitive name; ``Call`` for a call of a sub-graph or of a computed callable."""
        key = node.op_type[5:] if node.op_type.startswith("REF::") else node.op_type
        prim = self.prims.get(key)
        if prim is not None:
            return prim.op_type
        if key in self.functions or key in self.producer:
            return "Call"
        return key.split(":")[0]

    def inputs_of(self, node: Any) -> List[str]:
        """Input value names; a call of a computed callable (``Switch`` output) reads it too."""
        key = node.op_type[5:] if node.op_type.startswith("REF::") else ""
        return list(node.input) + ([key] if key in self.producer else [])

    def _tensors(self, attr: Any) -> List[Tensor]:
        kind = self.attr_type(attr.type)
        if kind in ("TENSORS", "TENSOR"):
            return [(tuple(t.dims), self._dtype(t.data_type)) for t in attr.tensors]
        if kind in ("TUPLE", "LIST"):
            return [t for v in attr.values for t in self._tensors(v)]
        return []

    def _value(self, attr: Any) -> Any:
        """A JSON-compatible Python value of a scalar/sequence attribute, else raise KeyError."""
        kind = self.attr_type(attr.type)
        if kind == "BOOL":
            return bool(attr.ints[0] if len(attr.ints) == 1 else attr.i)
        if kind.startswith("INT") or kind.startswith("UINT"):
            return int(attr.ints[0] if len(attr.ints) == 1 else attr.i)
        if kind == "FLOAT":
            return float(attr.floats[0] if len(attr.floats) == 1 else attr.f)
        if kind in ("DOUBLE", "FLOAT64"):
            return float(attr.doubles[0] if len(attr.doubles) == 1 else attr.d)
        if kind == "STRING":
            raw = attr.strings[0] if len(attr.strings) == 1 else attr.s
            return raw.decode() if isinstance(raw, bytes) else str(raw)
        if kind == "NONE":
            return None
        if kind in ("TUPLE", "LIST"):
            return [self._value(v) for v in attr.values]
        raise KeyError(kind)

    def _const(self, node: Any) -> Any:
        attr = next((a for a in node.attribute if a.name == "value"), None)
        if attr is None:
            raise KeyError("no value")
        return self._value(attr)

    def _prim_attrs(self, node: Any) -> Dict[str, Any]:
        prim = self.prims.get(node.op_type[5:]) if node.op_type.startswith("REF::") else None
        attrs: Dict[str, Any] = {}
        for a in (prim.attribute if prim is not None else ()):
            if a.name not in _SKIPPED_ATTRS:
                try:
                    attrs[a.name] = self._value(a)
                except KeyError:
                    pass
        return attrs

    def _init_arg_names(self, op_type: str) -> List[str]:
        if op_type not in self.init_args:
            self.init_args[op_type] = list(self._lookup_init_args(op_type))
        return self.init_args[op_type]

    # -- tracing through bookkeeping --------------------------------------------------
    def _is_const(self, value: str) -> bool:
        node = self.producer.get(value)
        return node is not None and node.op_type == "Constant"

    def data_sources(self, value: str) -> List[Tuple[str, int]]:
        """Compute nodes whose output reaches ``value`` as data, with the bytes carried."""
        if value in self._data_memo:
            return self._data_memo[value]
        self._data_memo[value] = []  # guards against malformed cyclic files
        node = self.producer.get(value)
        result: List[Tuple[str, int]] = []
        if node is not None and node.op_type != "Constant":
            op = self.op_type(node)
            if node.name in self.compute_name:
                result = [(self.compute_name[node.name], _bytes(self.output_tensors(node)))]
            elif op in _PASS_FIRST_INPUT and node.input:
                result = self.data_sources(node.input[0])
            elif op in _MAKE_SEQ:
                result = [s for i in node.input for s in self.data_sources(i)]
            elif op in _GET_ITEM and len(node.input) == 2:
                result = self._get_item_sources(node)
        self._data_memo[value] = result
        return result

    def _get_item_sources(self, node: Any) -> List[Tuple[str, int]]:
        seq, index = node.input
        src = self.producer.get(seq)
        try:
            i = int(self._const(self.producer[index]))
        except (KeyError, TypeError, ValueError):
            return self.data_sources(seq)
        if src is not None and self.op_type(src) in _MAKE_SEQ and i < len(src.input):
            return self.data_sources(src.input[i])
        if src is not None and src.name in self.compute_name:
            outs = self.output_tensors(src)
            if i < len(outs):
                return [(self.compute_name[src.name], _bytes(outs[i:i + 1]))]
        return self.data_sources(seq)

    def param_sources(self, value: str, depth: int = 0) -> List[str]:
        """Parameters that reach ``value`` unchanged (through Load, Depend, tuples)."""
        if value in self.params:
            return [value]
        node = self.producer.get(value)
        if node is None or depth > 50 or node.name in self.compute_name:
            return []
        op = self.op_type(node)
        if op in _PASS_FIRST_INPUT and node.input:
            return self.param_sources(node.input[0], depth + 1)
        if op in _MAKE_SEQ:
            return [p for i in node.input for p in self.param_sources(i, depth + 1)]
        return []

    def input_source(self, value: str) -> List[str]:
        """Where one tensor input comes from, for planners that need argument positions:
        ``["param", name]``, ``["input", name]``, ``["op", compute node name]`` (one producer)
        or ``["other", ""]`` (a tuple, several producers, a monad)."""
        params = self.param_sources(value)
        if len(params) == 1:
            return ["param", self.short_name[params[0]]]
        if value in self.inputs:
            return ["input", self.short_name[value]]
        sources = self.data_sources(value)
        if len(sources) == 1:
            return ["op", sources[0][0]]
        return ["other", ""]

    def _sources_of(self, value: str, count: int, op_type: str) -> List[List[str]]:
        """input_source of each of the ``count`` tensors of input ``value`` of an
        ``op_type`` node: one tensor its source; a tuple built by MakeTuple, read by an op
        of ``_SEQ_INPUT_OPS``, the source of each element; any other tuple ``["other", ""]``
        per tensor."""
        if count == 1:
            return [self.input_source(value)]
        node = self.producer.get(value)
        if op_type in _SEQ_INPUT_OPS and node is not None and \
                self.op_type(node) in _MAKE_SEQ and len(node.input) == count and \
                all(len(self.value_tensors(e)) == 1 for e in node.input):
            return [self.input_source(e) for e in node.input]
        return [["other", ""]] * count

    def output_tensors(self, node: Any) -> List[Tensor]:
        attr = next((a for a in node.attribute if a.name == "shape"), None)
        return self._tensors(attr) if attr is not None else []

    def value_tensors(self, value: str) -> List[Tensor]:
        if value in self.params:
            return [self.params[value]]
        if value in self.inputs:
            return [self.inputs[value]]
        node = self.producer.get(value)
        return self.output_tensors(node) if node is not None else []

    # -- build ------------------------------------------------------------------------
    def build(self, name: str) -> OpGraph:
        compute = [n for n in self.nodes
                   if n.op_type != "Constant" and self.op_type(n) not in BOOKKEEPING_OPS]
        # Step 1: readable unique names from the domain (scope + op id).
        used: Set[str] = set()
        for n in compute:
            base = n.domain if "/" in n.domain else \
                f"{self.op_type(n)}/{_strip_prefix(n.name, self.main_graph)}"
            unique, k = base, 1
            while unique in used:
                unique, k = f"{base}#{k}", k + 1
            used.add(unique)
            self.compute_name[n.name] = unique
        graph = OpGraph(name=name)
        owner: Dict[str, str] = {}
        guessed: Set[str] = set()
        # Step 2: one OpNode per compute node; parameters go to their first reader.
        for n in compute:
            op_type = self.op_type(n)
            attrs = self._prim_attrs(n)
            attrs.update(self._constant_inputs(n, op_type))
            input_shapes, sources, dtypes = [], [], []
            for i in n.input:
                if self._is_const(i):
                    continue
                tensors = self.value_tensors(i)
                input_shapes += [shape for shape, _ in tensors]
                dtypes += [dtype for _, dtype in tensors]
                sources += self._sources_of(i, len(tensors), op_type)
            outputs = self.output_tensors(n)
            params = sorted({p for i in n.input for p in self.param_sources(i)})
            for p in params:
                owner.setdefault(p, self.compute_name[n.name])
            if params:
                attrs["params"] = [self.short_name[p] for p in params]
            attrs["input_sources"] = sources      # one per entry of input_shapes
            attrs["input_dtypes"] = dtypes
            attrs["mindir_name"] = n.name
            if op_type == "Call":
                attrs["callee"] = _strip_prefix(n.op_type[5:] if n.op_type.startswith("REF::")
                                                else n.op_type, self.main_graph)
            dynamic = any(d < 0 for s, _ in outputs for d in s) or \
                any(d < 0 for s in input_shapes for d in s)
            if dynamic:
                attrs["dynamic_shape"] = True
            if not is_known_op(op_type):
                guessed.add(op_type)
            phase = _phase(n.domain, self.optimizer_classes)
            output_bytes = 0 if dynamic else _bytes(outputs)
            if phase == "optimizer" and attrs.get("side_effect_mem"):
                # In-place parameter update: its outputs alias the parameters it writes.
                attrs["aliased_output_bytes"] = output_bytes
                output_bytes = 0
            graph.add_node(OpNode(
                name=self.compute_name[n.name],
                op_type=op_type,
                scope=n.domain.rsplit("/", 1)[0] if "/" in n.domain else "",
                output_shapes=[s for s, _ in outputs],
                output_dtypes=[d for _, d in outputs],
                flops=0.0 if dynamic else op_flops(op_type, input_shapes,
                                                   [s for s, _ in outputs], attrs),
                output_bytes=output_bytes,
                phase=phase,
                attrs=attrs,
                input_shapes=input_shapes,
            ))
        for p, node_name in owner.items():
            graph[node_name].param_bytes += _bytes([self.params[p]])
        # Step 3: data edges, traced through bookkeeping nodes.
        for n in compute:
            for i in self.inputs_of(n):
                for src, nbytes in self.data_sources(i):
                    if src != self.compute_name[n.name]:
                        graph.add_edge(src, self.compute_name[n.name], nbytes)
        unowned = [p for p in self.params if p not in owner]
        graph.meta.update({
            "inputs": [{"name": self.short_name[k], "shape": list(s), "dtype": d}
                       for k, (s, d) in self.inputs.items()
                       if k.startswith(self.main_graph + ":")],
            "unattributed_param_bytes": sum(_bytes([self.params[p]]) for p in unowned),
        })
        if guessed:
            logger.info("FLOPs guessed at 1 per output element for op types %s",
                        sorted(guessed))
        return graph

    def _constant_inputs(self, node: Any, op_type: str) -> Dict[str, Any]:
        """Constant inputs as attributes: named init arguments, else ``const_inputs``;
        the shapes of constant tensors (ids built in the network: positions) in
        ``const_tensor_inputs``, by input position (they are not in ``input_shapes``)."""
        consts: Dict[int, Any] = {}
        tensors: Dict[str, List[int]] = {}
        for idx, value in enumerate(node.input):
            if self._is_const(value):
                try:
                    consts[idx] = self._const(self.producer[value])
                except KeyError:  # tensors and monads are not attributes
                    found = [t for a in self.producer[value].attribute if a.name == "value"
                             for t in self._tensors(a)]
                    if len(found) == 1:
                        tensors[str(idx)] = [int(d) for d in found[0][0]]
        attrs: Dict[str, Any] = {}
        prim = self.prims.get(node.op_type[5:]) if node.op_type.startswith("REF::") else None
        names = self._init_arg_names(op_type) \
            if prim is not None and prim.prim_type == self.function_prim else []
        first = len(node.input) - len(names)
        if names and first >= 0 and all(first + k in consts for k in range(len(names))):
            for k, arg in enumerate(names):
                attrs[arg] = consts.pop(first + k)
        if consts:
            attrs["const_inputs"] = {str(k): v for k, v in consts.items()}
        if tensors:
            attrs["const_tensor_inputs"] = tensors
        return attrs


def _strip_prefix(name: str, graph_name: str) -> str:
    prefix = graph_name + ":"
    return name[len(prefix):] if graph_name and name.startswith(prefix) else name


def _bytes(tensors: Iterable[Tensor]) -> int:
    total = 0
    for shape, dtype in tensors:
        n = 1
        for d in shape:
            n *= max(int(d), 0)
        total += n * DTYPE_BYTES.get(dtype, 0)
    return total


def _phase(domain: str, optimizer_classes: Set[str]) -> str:
    if not domain:
        return "unknown"
    if domain.startswith("Gradients/"):
        return "backward"
    if any(part.split("-", 1)[-1] in optimizer_classes for part in domain.split("/")[:-1]):
        return "optimizer"
    return "forward"
