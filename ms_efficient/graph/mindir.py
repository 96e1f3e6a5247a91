"""Build an OpGraph from a MindSpore network or a MINDIR file.

The only module of ``ms_efficient.graph`` that imports MindSpore, and only inside functions.
A network is compiled by ``mindspore.export(..., file_format="MINDIR")`` and its protobuf
(``mindspore.train.mind_ir_pb2.ModelProto``) is read by ``mindir_reader.MindIRReader`` (see
there how nodes, shapes, scopes and parameters map); a MINDIR file is parsed into the same.

Caveats (MindSpore 2.10):
- Scopes are fixed when a Cell is first compiled: a network exported on its own and then
  inside a train wrapper keeps ``Default/d1-Dense`` scopes (not
  ``Default/network-WithLossCell/_backbone-Net/d1-Dense``); ``Load`` nodes often carry the
  parent's scope, parameter-free ops of a second identical block may carry the first
  block's, and weight-gradient MatMuls may carry a neighbouring layer's. Ops that load
  parameters are scoped correctly; do not key per-Cell decisions on scope alone.
- Control flow (``if`` on tensors) exports sub-graphs; their ops are read, but calls into
  them are not inlined, so edges across calls are missing.

Weights are never read or written. ``from_network`` compiles through ``mindspore.export`` and
takes the graph's ModelProto from its ``custom_func`` hook, before MindSpore serialises any
parameter data, and it keeps the compile from initialising parameters
(``Cell.init_parameters_data``): a network built under
``mindspore.nn.utils.no_init_parameters()`` (every Parameter a shape and dtype, no data) is
planned without its weights ever being allocated, and its OpGraph equals that of the same
network with real weights (parameter bytes come from the graph's parameter shapes and dtypes).
The default optimizer of ``mode="train"`` is built the same way, so its per-parameter states
(SGD's ``accum``/``stat``) hold no data either.

MINDIR files written by ``mindspore.export``: a network whose parameters exceed 1 GiB
(``mindspore.train.serialization.TOTAL_SAVE``, in KiB) is not written to ``<name>.mindir`` but
split into ``<name>_graph.mindir`` (the graph; each parameter's ``external_data`` names a
file of the folder, offset and length) and ``<name>_variables/data_0, data_1, ...`` (the
weights, about 1 GiB each; ``PARAMETER_SPLIT_SIZE``). Before this reader knew the layout,
extracting a network that large failed with ``FileNotFoundError`` on ``<name>.mindir``.
``from_mindir_file`` reads either layout, given the ``_graph.mindir`` file or the name that
was passed to export.
"""
from __future__ import annotations

import inspect
import os
import tempfile
from typing import Any, Dict, List, Set

from ms_efficient.graph.mindir_reader import MindIRReader
from ms_efficient.graph.opgraph import OpGraph

__all__ = ["from_network", "from_mindir_file", "mindir_graph_path"]


def from_network(network: Any, *inputs: Any, mode: str = "forward", optimizer: Any = None,
                 loss_fn: Any = None) -> OpGraph:
    """Export ``network`` to MINDIR and read it back as an OpGraph.

    Args:
        network: an ``nn.Cell``.
        *inputs: sample inputs (Tensors or numpy arrays) fixing every shape. In ``"train"``
            mode these are the train step's inputs: the network's inputs then the label when
            ``loss_fn`` is given (``nn.WithLossCell`` calls ``loss_fn(network(data), label)``),
            or exactly the network's inputs when ``loss_fn`` is None (the network returns
            its loss).
        mode: ``"forward"`` exports ``network`` as is (in its current train/eval mode);
            ``"train"`` exports ``nn.TrainOneStepCell`` in training mode, so backward and
            optimizer ops are in the graph (the network's train/eval flag is restored after).
        optimizer: optimizer for ``"train"``; default ``nn.SGD(lr=0.01)`` over the
            network's trainable parameters.
        loss_fn: loss Cell for ``"train"`` (e.g. ``nn.MSELoss()``), see ``inputs``.
    Returns:
        OpGraph with FLOPs, bytes and phases; ``meta`` records mode and inputs.
    """
    import mindspore as ms
    from mindspore import nn

    if mode not in ("forward", "train"):
        raise ValueError(f"'mode' must be 'forward' or 'train', but got {mode!r}.")
    if not inputs:
        raise ValueError("from_network needs sample inputs that fix every shape.")
    if mode == "forward" and (optimizer is not None or loss_fn is not None):
        raise ValueError("'optimizer' and 'loss_fn' are only used with mode='train'.")
    inputs = tuple(ms.Tensor(x) if not isinstance(x, ms.Tensor) and hasattr(x, "shape") else x
                   for x in inputs)
    cell = network
    if mode == "train":
        if optimizer is None:  # its states (accum, stat) stay uninitialised, see the module doc
            with _no_init_parameters():
                optimizer = nn.SGD(network.trainable_params(), learning_rate=0.01)
        body = network if loss_fn is None else nn.WithLossCell(network, loss_fn)
        cell = nn.TrainOneStepCell(body, optimizer)
    optimizer_classes = _optimizer_class_names(cell)
    was_training = network.training
    try:
        if mode == "train":
            cell.set_train(True)  # training-mode ops (BatchNorm statistics, dropout)
        model = _export_graph_proto(cell, inputs)
    finally:
        if mode == "train":
            network.set_train(was_training)
    graph = _read_model(model, type(network).__name__, optimizer_classes, "exported network")
    graph.meta.update({"source": "mindir", "mode": mode, "network": type(network).__name__})
    return graph


def _no_init_parameters():
    """``mindspore.nn.utils.no_init_parameters()``: Parameters made inside hold no data."""
    from mindspore.nn.utils import no_init_parameters

    return no_init_parameters()


class _GraphCaptured(Exception):
    """Raised by the export hook once it holds the graph: stops the export before MindSpore
    reads or writes any parameter data."""


def _export_graph_proto(cell: Any, inputs: tuple) -> Any:
    """Compile ``cell`` for ``inputs`` the way ``mindspore.export(..., "MINDIR")`` does and
    return the graph's ``mind_ir_pb2.ModelProto`` (parameters as names, dims and dtypes; no
    data), without initialising or reading any parameter.

    ``export`` hands the ModelProto to its ``custom_func`` before it serialises the weights;
    the hook keeps it and stops the export. The compile would also initialise every
    uninitialised Parameter (``init_parameters_data``, up to 12 bytes per fp32 weight with
    SGD's states): ``cell`` gets an instance attribute that keeps them as they are for this
    compile only. Nothing is written; export's syntax level is restored."""
    import mindspore as ms
    from mindspore import context

    captured: List[Any] = []

    def _capture(model: Any) -> None:
        captured.append(model)
        raise _GraphCaptured()

    def _keep_uninitialised(auto_parallel_mode: bool = False) -> Dict[Any, Any]:
        return {}  # no Parameter replaced: the graph needs shapes, not values

    syntax_level = context.get_context("jit_syntax_level")
    cell.init_parameters_data = _keep_uninitialised
    try:
        with tempfile.TemporaryDirectory(prefix="ms_efficient_graph_") as tmp:
            try:  # the file name is checked by export but never written (the hook stops it)
                ms.export(cell, *inputs, file_name=os.path.join(tmp, "graph"),
                          file_format="MINDIR", custom_func=_capture)
            except _GraphCaptured:
                pass
    finally:
        del cell.init_parameters_data
        context.set_context(jit_syntax_level=syntax_level)
    if not captured:
        raise RuntimeError(f"mindspore.export of {type(cell).__name__} returned without "
                           "handing its graph to custom_func; MindSpore's MINDIR export has "
                           "changed (this reader is written for MindSpore 2.10).")
    return captured[0]


def mindir_graph_path(path: str) -> str:
    """The file holding the graph of a MINDIR export named ``path``: ``path`` itself when it
    is a file, else ``<stem>_graph.mindir`` next to it (the split layout ``mindspore.export``
    writes above 1 GiB of parameters, see the module doc). No MindSpore import.

    Raises:
        ValueError: neither file exists (both are named).
    """
    if os.path.isfile(path):
        return path
    stem = path[:-len(".mindir")] if path.lower().endswith(".mindir") else path
    split = stem + "_graph.mindir"
    if os.path.isfile(split):
        return split
    raise ValueError(f"MINDIR '{path}' does not exist, nor does '{split}' (the graph file "
                     f"mindspore.export writes next to a '{os.path.basename(stem)}_variables' "
                     "folder when the parameters exceed 1 GiB).")


def from_mindir_file(path: str) -> OpGraph:
    """Read a MINDIR written by ``mindspore.export`` into an OpGraph: ``<name>.mindir``, or
    the split layout's ``<name>_graph.mindir`` (given as such or as ``<name>.mindir``/``<name>``;
    the ``<name>_variables`` weights are not read). The graph's name is ``<name>``."""
    graph_path = mindir_graph_path(path)  # before importing MindSpore: a missing file is quick
    from mindspore.train import mind_ir_pb2

    name = os.path.splitext(os.path.basename(graph_path))[0]
    variables = graph_path[:-len("_graph.mindir")] + "_variables"
    split = name.endswith("_graph") and os.path.isdir(variables)
    if split:
        name = name[:-len("_graph")]
    model = mind_ir_pb2.ModelProto()
    with open(graph_path, "rb") as fh:
        try:
            model.ParseFromString(fh.read())
        except Exception as exc:  # protobuf raises its own DecodeError
            raise ValueError(f"{graph_path}: not a MINDIR file ({exc}).") from None
    graph = _read_model(model, name, _optimizer_class_names(None), graph_path)
    graph.meta.update({"source": "mindir", "path": os.path.abspath(graph_path),
                       "layout": "split" if split else "single"})
    if split:
        graph.meta["variables"] = os.path.abspath(variables)
    return graph


def _optimizer_class_names(cell: Any) -> Set[str]:
    """Class names of MindSpore's optimizers plus those of optimizers inside ``cell``."""
    from mindspore import nn

    names = {c.__name__ for c in vars(nn).values()
             if isinstance(c, type) and issubclass(c, nn.Optimizer)}
    if cell is not None:
        names |= {type(c).__name__ for _, c in cell.cells_and_names()
                  if isinstance(c, nn.Optimizer)}
    return names


def _init_arg_names(op_type: str) -> List[str]:
    """Init arguments of ``mindspore.ops.<op_type>`` (a primitive function takes them as its
    trailing inputs), or [] when there is no such public class."""
    from mindspore import ops

    cls = getattr(ops, op_type, None)
    if not isinstance(cls, type):
        return []
    try:
        names = list(inspect.signature(cls.__init__).parameters)[1:]
    except (TypeError, ValueError):
        return []
    return [n for n in names if n not in ("args", "kwargs")]


def _read_model(model: Any, name: str, optimizer_classes: Set[str], origin: str) -> OpGraph:
    """OpGraph of a parsed ModelProto; ``origin`` names it in errors."""
    from mindspore.train import mind_ir_pb2

    if not model.HasField("graph"):
        raise ValueError(f"{origin}: MINDIR file has no graph.")
    return MindIRReader(model, mind_ir_pb2, optimizer_classes, _init_arg_names).build(name)
