"""One graph extraction per distinct network for the test modules that opt in.

The tests of ``optimize()`` on user networks build the same network (``llama_with_loss(...)``,
``_deep_llama()``, ...) afresh in test after test, and every ``optimize`` call extracts its
train-step graph again: a MINDIR export, i.e. a full MindSpore compile, 1-8 s each. In the
modules that opt in (``pytest.mark.usefixtures("shared_graphs")``, tests/conftest.py) each
distinct request is exported once per session: ``install`` wraps
``ms_efficient.graph.mindir._export_graph_proto`` (the compile ``from_network`` reads the graph
from) and answers a later request with the same key with a copy of the first one's ModelProto,
leaving the network's Cells as that compile would (their scopes, ``Cell.generate_scope``).
Everything after it (reading the graph, the passes, the plans) runs as before.

``network_key`` is equal for two requests only when it can tell that both compile to the same
graph: it holds every Cell's path, class and the scope the compile gives it (a Cell compiled
before keeps its first scope, see ``ms_efficient.graph.mindir``), every attribute (primitives
with their attributes, e.g. shard strategies; recompute flags and wrappers; numbers, lists,
arrays and tensors by value; functions and classes by identity, with closures and defaults),
every Parameter's name, shape, dtype and flags, the inputs' shapes and dtypes, and the
MindSpore context and ``MS_*`` environment of the compile. An attribute of a kind it does not
know leaves the request to a real export.

``MS_EFFICIENT_TEST_GRAPH_CACHE=check`` also exports every answered request for real and fails
unless both give the same OpGraph (a run of the suite so checks every key it shares);
``=off`` shares nothing.
"""
import dataclasses
import enum
import hashlib
import os
import types

import numpy as np

MODE = os.environ.get("MS_EFFICIENT_TEST_GRAPH_CACHE", "on")
STATS = {"shared": 0, "exported": 0, "unshared": 0}
REASONS = {}                 # why requests were not shared: count

_PROTOS = {}                 # key -> the first export's ModelProto, serialised
_KEEP = []                   # classes and functions named in keys by id: never freed, so an id
                             # in a key cannot be reused by another object

# Cell attributes that change with every instance or compile, not with the graph (ids, times,
# compile caches and phase names); scopes, sub-Cells and Parameters enter the key on their own.
# A compile also turns the hook tables ``_lazy_*`` from None into empty dicts: the same.
_CELL_INTERNALS = {"_create_time", "_id", "_cell_init_args", "_compile_cache", "_compile_phase",
                   "_compiled", "_phase_cache", "arguments_key", "_scope", "_cells", "_params",
                   "_params_list", "_buffers"}
_CONTEXT_KEYS = ("mode", "device_target", "jit_syntax_level", "jit_config", "max_call_depth")
_PARALLEL_KEYS = ("parallel_mode", "device_num", "full_batch", "search_mode",
                  "dataset_strategy", "pipeline_stages", "gradients_mean")


class Unshared(Exception):
    """The request holds something ``network_key`` cannot compare: export it."""


def _scopes_after_compile(cell) -> dict:
    """{id of a Cell under ``cell``: its scope once ``cell`` is compiled}: MindSpore's parser
    gives every Cell the scope of its path in the compiled Cell unless it has one already (a
    compile before, in this or another wrapper), and a recompute Cell's ``recompute_`` mark
    is kept in front (``Cell.generate_scope``, ``Cell._set_scope``)."""
    after = {}
    for name, c in cell._children_scope_recursive():
        if id(c) not in after:
            after[id(c)] = (name if c._scope is None else
                            c._scope + name if c._scope == "recompute_" else c._scope)
    return after


def network_key(cell, inputs):
    """A key that equals that of another request only if both export the same graph;
    raises Unshared when it cannot tell (an attribute of an unknown kind)."""
    import mindspore as ms

    cells = list(cell.cells_and_names())
    scopes = _scopes_after_compile(cell)
    canon = _Canon({id(c): path for path, c in cells})
    parts = []
    for path, c in cells:
        params = tuple((k, p.name, tuple(p.shape), str(p.dtype), p.requires_grad,
                        bool(p.has_init), bool(p.layerwise_parallel),
                        bool(getattr(p, "parallel_optimizer", True)))
                       for k, p in c._params.items() if p is not None)
        attrs = tuple((k, canon(None if k.startswith("_lazy_") and not v else v))
                      for k, v in sorted(vars(c).items()) if k not in _CELL_INTERNALS)
        parts.append((path, canon.type_id(type(c)), scopes.get(id(c)), tuple(c._cells), params,
                      attrs))
    args = tuple(("tensor", tuple(x.shape), str(x.dtype)) if isinstance(x, ms.Tensor)
                 else canon(x) for x in inputs)
    context = tuple((k, repr(ms.get_context(k))) for k in _CONTEXT_KEYS)
    parallel = tuple((k, repr(ms.get_auto_parallel_context(k))) for k in _PARALLEL_KEYS)
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("MS_")))
    return hashlib.sha256(repr((parts, args, context, parallel, env)).encode()).hexdigest()


class _Canon:
    """Attribute values as plain tuples: Cells of the network by path, everything else by
    value (functions and classes by identity, with closure and defaults); an object met again
    (a cycle, a shared primitive) by the order it was first met in."""

    def __init__(self, cell_paths):
        self.cell_paths = cell_paths
        self.seen = {}

    @staticmethod
    def type_id(cls):
        _KEEP.append(cls)
        return (cls.__module__, cls.__qualname__, id(cls))

    def __call__(self, v):
        import mindspore as ms
        from mindspore import nn
        from mindspore.common.initializer import Initializer
        from mindspore.ops import Primitive

        if v is None or isinstance(v, (bool, int, float, str, bytes, complex)):
            return (type(v).__name__, v)
        if isinstance(v, enum.Enum) or hasattr(type(v), "__members__"):   # also C++ enums
            return ("enum", self.type_id(type(v)), v.name)
        if id(v) in self.cell_paths:
            return ("cell", self.cell_paths[id(v)])
        if id(v) in self.seen:
            return ("ref", self.seen[id(v)][0])
        self.seen[id(v)] = (len(self.seen), v)    # v kept alive: its id is not reused
        if isinstance(v, (list, tuple)):
            return (type(v).__name__, tuple(self(x) for x in v))
        if isinstance(v, (set, frozenset)):
            return ("set", tuple(sorted(repr(self(x)) for x in v)))
        if isinstance(v, dict):
            return ("dict", tuple((self(k), self(x)) for k, x in v.items()))
        if isinstance(v, np.ndarray):
            return ("ndarray", str(v.dtype), v.shape, hashlib.sha256(v.tobytes()).hexdigest())
        if isinstance(v, np.generic):
            return ("np", str(v.dtype), v.item())
        if isinstance(v, ms.Parameter):
            return ("parameter", v.name, tuple(v.shape), str(v.dtype))
        if isinstance(v, ms.Tensor):
            if v.has_init:
                raise Unshared("a tensor without data")
            return ("tensor", self(v.asnumpy()))
        if isinstance(v, ms.dtype.Type):
            return ("dtype", str(v))
        if isinstance(v, Primitive):
            return ("primitive", self.type_id(type(v)), v.name, self(dict(v.attrs)),
                    self({k: x for k, x in vars(v).items() if k != "attrs"}))
        if isinstance(v, nn.Cell):
            # a Cell outside cells_and_names (e.g. a recompute wrapper): by value
            return ("cell", self.type_id(type(v)), tuple(
                (k, self(x)) for k, x in sorted(vars(v).items()) if k not in _CELL_INTERNALS),
                tuple((k, self(x)) for k, x in v._cells.items()),
                tuple((k, self(p)) for k, p in v._params.items()))
        if isinstance(v, (types.FunctionType, types.MethodType)):
            fn = v.__func__ if isinstance(v, types.MethodType) else v
            _KEEP.append(fn)
            owner = self(v.__self__) if isinstance(v, types.MethodType) else None
            cells = tuple(self(c.cell_contents) for c in fn.__closure__ or ())
            return ("function", fn.__module__, fn.__qualname__, id(fn), owner, cells,
                    self(fn.__defaults__), self(fn.__kwdefaults__))
        if isinstance(v, (types.BuiltinFunctionType, type)):
            _KEEP.append(v)
            return ("builtin", getattr(v, "__module__", None), v.__qualname__, id(v))
        if isinstance(v, Initializer):       # a Parameter's initial values, not the graph
            return ("initializer", self.type_id(type(v)), self(vars(v)))
        if dataclasses.is_dataclass(v):
            return ("dataclass", self.type_id(type(v)),
                    tuple((f.name, self(getattr(v, f.name))) for f in dataclasses.fields(v)))
        if type(v).__module__.startswith("mindspore.ops.composite") and hasattr(v, "__dict__"):
            # GradOperation, HyperMap, MultitypeFuncGraph...: their settings are attributes
            return ("composite", self.type_id(type(v)), self(vars(v)))
        if isinstance(v, types.ModuleType):
            return ("module", v.__name__)
        raise Unshared(f"an attribute of type {type(v).__module__}.{type(v).__qualname__}")


def install(monkeypatch) -> None:
    """Answer ``_export_graph_proto`` requests with the key of an earlier one from its result
    (module doc), while ``monkeypatch`` holds."""
    from ms_efficient.graph import mindir

    if MODE == "off":
        return
    export = mindir._export_graph_proto

    def shared_export(cell, inputs):
        try:
            key = network_key(cell, inputs)
        except Unshared as why:
            STATS["unshared"] += 1
            REASONS[str(why)] = REASONS.get(str(why), 0) + 1
            return export(cell, inputs)
        if key not in _PROTOS:
            model = export(cell, inputs)
            _PROTOS[key] = (model.SerializeToString(), _scopes(cell))
            STATS["exported"] += 1
            return model
        STATS["shared"] += 1
        data, scopes = _PROTOS[key]
        model = _model_class()()
        model.ParseFromString(data)
        # what the compile would leave behind: every Cell's scope, set by MindSpore's parser
        # (generate_scope) on a Cell's first compile and kept after (later compiles and
        # requests of this network see it as without sharing)
        cell.generate_scope()
        assert _scopes(cell) == scopes, "a shared request's Cells got other scopes"
        if MODE == "check":
            real = export(cell, inputs)
            names = mindir._optimizer_class_names(cell)
            got, want = (_comparable(mindir._read_model(m, "net", names, "check"))
                         for m in (model, real))
            assert got == want, (f"the shared graph of {type(cell).__name__} differs from its "
                                 f"export")
        return model

    monkeypatch.setattr(mindir, "_export_graph_proto", shared_export)


def _scopes(cell) -> dict:
    """{path: scope} of the Cells of ``cell``."""
    return {path: c._scope for path, c in cell.cells_and_names()}


def _comparable(graph) -> dict:
    """``graph.to_dict()`` without the MINDIR node names, which carry MindSpore's graph
    counters (two exports of one network differ in them only; nothing reads them)."""
    d = graph.to_dict()
    for node in d["nodes"]:
        node.get("attrs", {}).pop("mindir_name", None)
    return d


def _model_class():
    """MindSpore's MINDIR ModelProto class."""
    from mindspore.train import mind_ir_pb2

    return mind_ir_pb2.ModelProto
