"""``MoEMLP``: the package's MoE layer as a drop-in replacement for a feed-forward block.

``y = mlp(x)`` with x and y of the same shape [..., H], like the MLP it replaces, so it fits
any user block and ``nn.WithLossCell`` unchanged. The layer's other outputs stay reachable:

- ``aux_loss`` (float32 scalar buffer) and ``dropped`` (int32 scalar buffer) hold the last
  forward's load-balancing loss and dropped assignments; the routed counts are the inner
  layer's ``routing_counts`` buffer [R, E] (read by ``RoutingTraceCallback``);
  :meth:`MoEMLP.statistics` returns all three as numpy values after a step.
- The load-balancing loss reaches the gradients with ``aux_loss_coef > 0``: the layer passes
  y through :class:`AuxLossGradient`, whose backward hands ``aux_loss_coef`` to the aux loss
  as its gradient, so training behaves as if ``aux_loss_coef * aux_loss`` were added to the
  loss of a plain ``nn.WithLossCell`` / ``TrainOneStepCell`` (Megatron-LM's
  MoEAuxLossAutoScaler does the same). The loss value the cell reports is the task loss
  alone; the aux term is in ``aux_loss``. With loss scaling (a ``sens`` other than 1) the
  injected gradient is not scaled: set the coefficient times the scale.
- A network that adds the aux loss itself calls :meth:`MoEMLP.forward_with_aux` (``(y,
  aux_loss)``, differentiable) in its block and adds ``coef * aux_loss`` to its loss, as the
  package's trainer does with its layers' outputs (``loss = ce + aux_loss_coef * sum of the
  layers' aux losses / number of MoE layers``, see ``ms_efficient.models.gpt_moe``); keep
  ``aux_loss_coef=0`` on the layer then, or the term is counted twice.

Passes and callbacks see the inner :class:`~ms_efficient.moe.layer.MoEFeedForward` (attribute
``moe``): ``efficientmoe`` sets its capacities, ``mpipe`` wraps it in ``PipelinedMoE``.
Assigning an ``MoEMLP`` into an already-built network: use :func:`replace_cell` (or call
``network.update_parameters_name()`` afterwards), else MindSpore names its parameters by the
attribute alone and two layers clash.

:func:`replace_cell`: put a Cell where another Cell of a built network was, with parameter
names that come out right. Why this is needed: MindSpore names a Parameter when its Cell
is assigned as an attribute, prefixing only that attribute's name (``Cell.__setattr__`` calls
``update_parameters_name(attr + ".")``). A network built in one go gets full paths
(``model.layers.0.mlp.w1``) because every parent is assigned into its own parent after its
children. A Cell assigned into an already-built network gets only the last segment: after
``net.model.layers[0].mlp = MoEMLP(...)`` and the same on layer 1, both layers' weights are
named ``mlp.moe.w1``, and building an optimizer (a ``ParameterTuple``) or saving a checkpoint
fails with "its name 'mlp.moe.w1' already exists". :func:`replace_cell` names them by their
full path instead, as the network built in one go would (and keeps given names, e.g. the
user's own weights an adopted layer reuses).
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence, Union

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from ms_efficient.moe.layer import ROUTING_COUNTS, MoEFeedForward

__all__ = ["MoEMLP", "AuxLossGradient", "replace_cell", "parameter_prefix"]


class AuxLossGradient(nn.Cell):
    """``construct(y, aux_loss) -> y``; backward: y's gradient passes through unchanged and
    aux_loss receives ``coef`` (the gradient of ``coef * aux_loss`` in a summed loss)."""

    def __init__(self, coef: float):
        super().__init__()
        if coef < 0:
            raise ValueError(f"'aux_loss_coef' must be >= 0, but got {coef}.")
        self.coef = float(coef)

    def construct(self, y, aux_loss):
        return y

    def bprop(self, y, aux_loss, out, dout):
        return dout, ops.ones_like(aux_loss) * self.coef


class MoEMLP(nn.Cell):
    """Drop-in MoE feed-forward: ``construct(x [..., H]) -> y [..., H]`` (see module doc).

    Args:
        hidden_size, ffn_hidden_size, num_experts, top_k, capacity, trace_ranks, init_std,
            dispatch, activation, renormalize, has_bias: as for
            :class:`~ms_efficient.moe.layer.MoEFeedForward` (ignored with ``layer``).
        aux_loss_coef: weight of the load-balancing loss in the gradients (0: none).
        layer: an existing MoE layer (``MoEFeedForward``) to wrap instead of building one.

    Inputs of rank 3 are [B, S, H]; other ranks are viewed as [-1, S, H] (rank >= 3) or
    [1, T, H] (rank 2), so the layer's trace groups and capacities see all tokens.
    """

    def __init__(self, hidden_size: int = 0, ffn_hidden_size: int = 0, num_experts: int = 0,
                 top_k: int = 0, capacity: Union[int, Sequence[int]] = 0,
                 aux_loss_coef: float = 0.0, trace_ranks: int = 1, init_std: float = 0.02,
                 dispatch: str = "static", activation: Optional[nn.Cell] = None,
                 renormalize: bool = True, has_bias: bool = True,
                 layer: Optional[nn.Cell] = None):
        super().__init__()
        if layer is None:
            layer = MoEFeedForward(hidden_size, ffn_hidden_size, num_experts, top_k, capacity,
                                   trace_ranks, init_std, dispatch, activation, renormalize,
                                   has_bias)
        elif not hasattr(layer, ROUTING_COUNTS):
            raise TypeError(f"'layer' must be an MoE layer of the package (MoEFeedForward), "
                            f"but got {type(layer).__name__}.")
        self.moe = layer
        self.use_aux_gradient = aux_loss_coef > 0
        self.aux_gradient = AuxLossGradient(aux_loss_coef)
        self.aux_loss = Parameter(Tensor(0.0, ms.float32), name="aux_loss", requires_grad=False)
        self.dropped = Parameter(Tensor(0, ms.int32), name="dropped", requires_grad=False)

    def forward_with_aux(self, x):
        """``(y, aux_loss)``: the output and the differentiable load-balancing loss (also
        kept in the buffers like ``construct``), for networks that add it to their loss."""
        shape = x.shape
        if len(shape) == 3:
            x3 = x
        elif len(shape) == 2:
            x3 = x.reshape((1,) + shape)
        else:
            x3 = x.reshape((-1,) + shape[-2:])
        y, aux, counts, dropped = self.moe(x3)
        ops.assign(self.aux_loss, ops.stop_gradient(aux))
        ops.assign(self.dropped, dropped)
        # counts are kept by the layer itself; depending on them keeps the graph from
        # pruning that output as an isolated side-effect node (a compiler warning otherwise)
        return ops.depend(y.reshape(shape), counts), aux

    def construct(self, x):
        y, aux = self.forward_with_aux(x)
        if self.use_aux_gradient:
            return self.aux_gradient(y, aux)
        return ops.depend(y, aux)        # aux's assignment stays in the graph (no gradient)

    @property
    def layer(self) -> nn.Cell:
        """The MoE layer that holds the routing buffers (the wrapped one under an mpipe
        ``PipelinedMoE``)."""
        return self.moe if hasattr(self.moe, ROUTING_COUNTS) else self.moe.layer

    def statistics(self) -> Dict[str, object]:
        """The last forward's ``{"aux_loss": float, "counts": int64 [R, E], "dropped": int}``."""
        return {"aux_loss": float(self.aux_loss.asnumpy()),
                "counts": getattr(self.layer, ROUTING_COUNTS).asnumpy().astype(np.int64),
                "dropped": int(self.dropped.asnumpy())}


def parameter_prefix(network: nn.Cell, path: str) -> str:
    """The prefix MindSpore gives the parameters of the Cell at ``path`` (dotted attribute
    path from ``network``) in a network built in one go: the path's segments, without those
    under a parent built with ``auto_prefix=False`` (``nn.WithLossCell`` names its backbone's
    parameters without ``backbone.``)."""
    cell, parts = network, []
    for name in path.split("."):
        children = cell.name_cells()
        if name not in children:
            raise ValueError(f"'path' {path!r}: {type(cell).__name__} has no sub-Cell "
                             f"{name!r} (it has {sorted(children)}).")
        # Cell keeps the flag as a private attribute (no public getter in MindSpore 2.10)
        if getattr(cell, "_auto_prefix", True):
            parts.append(name)
        cell = children[name]
    return ".".join(parts)


def replace_cell(network: nn.Cell, path: str, new: nn.Cell,
                 keep_names: Optional[Dict[int, str]] = None) -> None:
    """Put ``new`` where the Cell at ``path`` is (an attribute, or an item of a CellList /
    SequentialCell) and name its parameters ``<prefix>.<name inside new>`` with the prefix of
    :func:`parameter_prefix`, except those in ``keep_names`` (id(parameter) -> name), which
    keep the given name."""
    prefix = parameter_prefix(network, path)
    parent_path, _, attr = path.rpartition(".")
    parent = network if not parent_path else dict(network.cells_and_names())[parent_path]
    if attr.isdigit() and isinstance(parent, (nn.CellList, nn.SequentialCell)):
        parent[int(attr)] = new
    else:
        setattr(parent, attr, new)
    keep_names = keep_names or {}
    for name, param in new.parameters_and_names():
        param.name = keep_names.get(id(param), f"{prefix}.{name}" if prefix else name)
