"""MoE runtime: the Cells and the formats they execute (no planning here).

``layer`` (router + top-k MoE FFN: static per-expert capacities, or padding-free grouped
compute), ``balanced_ep`` (the expert-parallel layer: EfficientMoE's two levels),
``ep_routing`` (expert-parallel slot tables), ``ep_migration`` and ``ep_replan`` (what a re-plan
moves, numpy, and moving those rows with their optimizer state), ``alltoall`` (All-to-All /
AlltoAllV and the count exchange: native on Ascend, exact emulation elsewhere), ``kernels``
(padding-free permute / combine, ``ops.Custom`` aot on CPU), ``grouped_matmul`` (the grouped
matmul whose group sizes are data: aot over OpenBLAS on CPU, ``GroupedMatmul`` on Ascend),
``plan`` (the ``ExpertPlan`` format: slots, devices, capacities, row buffers), ``split`` (the
dispatch rule that splits a rank's tokens over an expert's replicas) and ``trace`` (the
routing-trace ``.npz`` format). ``dropin`` (``MoEMLP``: the layer as a drop-in MLP returning
y only, and ``replace_cell``: put a Cell into a built network with full-path parameter
names), ``activations`` (the experts' activations, and the gated unit of SwiGLU / GeGLU
experts), ``routing`` (the routers users run: softmax or sigmoid scores, group-limited top-k,
the routed scaling factor, the auxiliary-loss-free expert bias, the balance losses, each with
its numpy reference) and ``shared`` (shared experts). A user's own MoE blocks are replaced by
the layer with ``ms_efficient.adopt_moe`` (the ``ms_efficient.adopt`` package).

``MoEMLP``, ``replace_cell`` and ``MoEFeedForward`` are importable from here; they load
MindSpore on first use only, so the numpy-only modules (``plan``, ``split``, ``trace``) stay
light.
"""
import importlib

_LAZY = {"MoEMLP": "dropin", "replace_cell": "dropin", "MoEFeedForward": "layer"}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
