"""Writing host values into a Parameter between training steps (:func:`write_parameter`).

MindSpore 2.10, GRAPH_MODE: ``Parameter.set_data`` (and ``Parameter.assign_value``) gives the
Parameter a new host tensor. A Cell's compiled graph (``nn.TrainOneStepCell``,
``Model.train``) reads it on its next call, but a ``@ms.jit`` function that closes over the
Parameter and has already run keeps its own device memory: it never sees the new values, and
``asnumpy`` no longer sees the updates it makes (measured on CPU: after two AdamWeightDecay
steps of a jit step closing over ``w``, ``w.set_data(0.5 * ones)`` left the next step's loss on
the old trajectory, 1.553 instead of 3.0, and ``w.asnumpy()`` stayed 0.5 after it).
``ops.assign`` writes into the Parameter's own memory, which both kinds of graph and
``asnumpy`` read, so every between-step write of a plan (expert rows, optimizer moments, plan
tables, gradient weights) goes through :func:`write_parameter`.
"""
from __future__ import annotations

import numpy as np
from mindspore import Parameter, Tensor, ops

__all__ = ["write_parameter"]


def write_parameter(param: Parameter, values) -> None:
    """Write ``values`` (array-like of ``param``'s shape; cast to its dtype) into ``param`` in
    place, visible to every compiled graph that reads it, ``ms.jit`` functions included.
    Raises ValueError naming the Parameter when the shape differs."""
    values = np.asarray(values)
    if tuple(values.shape) != tuple(param.shape):
        raise ValueError(f"values for '{param.name}' must have its shape {tuple(param.shape)}, "
                         f"but got {tuple(values.shape)}.")
    ops.assign(param, Tensor(values, dtype=param.dtype))
