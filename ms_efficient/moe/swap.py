"""Put a Cell where another Cell of a built network was, with parameter names that come out
right.

Why this is needed: MindSpore names a Parameter when its Cell is assigned as an attribute,
prefixing only that attribute's name (``Cell.__setattr__`` calls
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

from typing import Dict, Optional

from mindspore import nn

__all__ = ["replace_cell", "parameter_prefix"]


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
