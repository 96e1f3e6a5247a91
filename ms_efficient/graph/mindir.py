"""Build an OpGraph from a MindSpore network or a MINDIR file.

The only module of ``ms_efficient.graph`` that imports MindSpore, and only inside functions.
A network is exported with ``mindspore.export(..., file_format="MINDIR")`` into a temporary
folder and the protobuf (``mindspore.train.mind_ir_pb2.ModelProto``) is read back by
``mindir_reader.MindIRReader`` (see there how nodes, shapes, scopes and parameters map).

Caveats (MindSpore 2.10):
- Scopes are fixed when a Cell is first compiled: a network exported on its own and then
  inside a train wrapper keeps ``Default/d1-Dense`` scopes (not
  ``Default/network-WithLossCell/_backbone-Net/d1-Dense``); ``Load`` nodes often carry the
  parent's scope, parameter-free ops of a second identical block may carry the first
  block's, and weight-gradient MatMuls may carry a neighbouring layer's. Ops that load
  parameters are scoped correctly; do not key per-Cell decisions on scope alone.
- Control flow (``if`` on tensors) exports sub-graphs; their ops are read, but calls into
  them are not inlined, so edges across calls are missing.
- Export serialises the weights too: use small sample shapes (batch) for big models.
"""
from __future__ import annotations

import inspect
import os
import tempfile
from typing import Any, List, Set

from ms_efficient.graph.mindir_reader import MindIRReader
from ms_efficient.graph.opgraph import OpGraph

__all__ = ["from_network", "from_mindir_file"]


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
        if optimizer is None:
            optimizer = nn.SGD(network.trainable_params(), learning_rate=0.01)
        body = network if loss_fn is None else nn.WithLossCell(network, loss_fn)
        cell = nn.TrainOneStepCell(body, optimizer)
    optimizer_classes = _optimizer_class_names(cell)
    was_training = network.training
    try:
        if mode == "train":
            cell.set_train(True)  # training-mode ops (BatchNorm statistics, dropout)
        with tempfile.TemporaryDirectory(prefix="ms_efficient_graph_") as tmp:
            stem = os.path.join(tmp, "graph")
            ms.export(cell, *inputs, file_name=stem, file_format="MINDIR")
            graph = _read_mindir(stem + ".mindir", type(network).__name__, optimizer_classes)
    finally:
        if mode == "train":
            network.set_train(was_training)
    del graph.meta["path"]  # the temporary file is gone
    graph.meta.update({"mode": mode, "network": type(network).__name__})
    return graph


def from_mindir_file(path: str) -> OpGraph:
    """Read a ``.mindir`` file written by ``mindspore.export`` into an OpGraph."""
    name = os.path.splitext(os.path.basename(path))[0]
    return _read_mindir(path, name, _optimizer_class_names(None))


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


def _read_mindir(path: str, name: str, optimizer_classes: Set[str]) -> OpGraph:
    from mindspore.train import mind_ir_pb2

    model = mind_ir_pb2.ModelProto()
    with open(path, "rb") as fh:
        try:
            model.ParseFromString(fh.read())
        except Exception as exc:  # protobuf raises its own DecodeError
            raise ValueError(f"{path}: not a MINDIR file ({exc}).") from None
    if not model.HasField("graph"):
        raise ValueError(f"{path}: MINDIR file has no graph.")
    graph = MindIRReader(model, mind_ir_pb2, optimizer_classes, _init_arg_names).build(name)
    graph.meta.update({"source": "mindir", "path": os.path.abspath(path)})
    return graph
