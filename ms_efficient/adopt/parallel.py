"""An adopted MoE block as EfficientMoE's balanced expert-parallel layer, inside the user's own
msrun-launched process (``adopt_moe(..., expert_parallel=True)``).

After ``mindspore.communication.init()``, every rank of the world group holds the whole
network; the recognised block (:mod:`ms_efficient.adopt.blocks`) becomes a
:class:`~ms_efficient.moe.balanced_ep.BalancedExpertParallelMoE` over that group:

- **router, shared expert, expert bias**: the user's Cells and Parameters, reused (same
  objects, same names); they are data-parallel, so their gradients are averaged over the ranks
  (:class:`ms_efficient.train.optim.TrainOneStepCell` does it).
- **experts**: the user's E experts (a list of Dense or stacked weights; a gated expert's gate
  and up projections fused as [w_gate | w_up]) are read once as logical tables and laid out
  by plain expert parallelism (expert e on rank floor(e W / E), ceil(E / W) home slots per
  rank) with ``spare_slots`` spare slots for the per-step copies; each rank keeps the rows of
  its home slots in new Parameters ``<block>.moe.w1``, ``b1``, ``w2``, ``b2`` (w1, w2 only
  without biases). The user's own expert Parameters leave the network: build the optimizer
  after adoption. ``logical_expert_weights`` reads the experts back as the user's tables.
- **buffers**: every device's receive buffer is the mean share (T K rows of this rank's T
  tokens) x (1 + ``buffer_slack``), on the cluster's matmul tile; rows beyond a buffer drop
  (the layer's ``dropped`` output; the fast level balances into the buffers first).

The layer's cost model is the cluster's (``cluster``: a preset name or ClusterSpec; on CPU
the default is ``cpu-local`` grown to the W ranks of the job) and the expert sizes of the block.
"""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
from mindspore import Parameter, nn

from ms_efficient.adopt.blocks import BlockSpec
from ms_efficient.core import backend
from ms_efficient.core.cluster import ClusterSpec, get_cluster
from ms_efficient.efficientmoe.cost import CostModel
from ms_efficient.efficientmoe.layout import training_specs
from ms_efficient.moe.balanced_ep import BalancedExpertParallelMoE

__all__ = ["expert_parallel_layer", "logical_tables", "ep_cluster"]


def _stacked(value, dense_layout: bool) -> np.ndarray:
    """float32 numpy of a stacked Parameter, or of E per-expert Dense-layout Parameters
    ([out, in] each, transposed to [in, out]; biases [out])."""
    if isinstance(value, (tuple, list)):
        arrays = [p.asnumpy() for p in value]
        if dense_layout:
            arrays = [a.T for a in arrays]
        return np.stack(arrays).astype(np.float32)
    return value.asnumpy().astype(np.float32)


def logical_tables(spec: BlockSpec) -> Tuple[np.ndarray, ...]:
    """The block's experts as the balanced layer's logical tables, float32 numpy: (w1 [E, H,
    F1], b1 [E, 1, F1], w2 [E, F, H], b2 [E, 1, H]) or (w1, w2) without biases; F1 = 2F for
    gated experts (gate then up)."""
    e = spec.num_experts
    w1_raw, b1_raw, w2_raw, b2_raw = spec.weights
    w1, w2 = _stacked(w1_raw, True), _stacked(w2_raw, True)
    if spec.up is not None:
        w1 = np.concatenate((w1, _stacked(spec.up[0], True)), axis=2)
    if not spec.has_bias:
        return w1, w2
    b1 = _stacked(b1_raw, False).reshape(e, 1, -1)
    if spec.up is not None:
        b1 = np.concatenate((b1, _stacked(spec.up[1], False).reshape(e, 1, -1)), axis=2)
    return w1, b1, w2, _stacked(b2_raw, False).reshape(e, 1, -1)


def ep_cluster(cluster, world: int) -> ClusterSpec:
    """The cluster the layers are priced on: ``cluster`` (a preset name or ClusterSpec), by
    default ``cpu-local`` grown to ``world`` devices (this machine's ranks). One that cannot
    hold the W ranks is a ValueError naming what to change."""
    if cluster is None:
        spec = get_cluster("cpu-local")
        if spec.num_devices < world:
            spec = spec.with_overrides(devices_per_node=world)
        return spec
    spec = get_cluster(cluster) if isinstance(cluster, str) else cluster
    if not isinstance(spec, ClusterSpec):
        raise ValueError(f"'cluster' must be a preset name or a ClusterSpec, but got "
                         f"{type(cluster).__name__}.")
    if spec.num_devices < world:
        raise ValueError(f"'cluster' ({spec.name}) has {spec.num_devices} devices, but the job "
                         f"has {world} ranks; pass a cluster with >= {world} devices.")
    return spec


def expert_parallel_layer(spec: BlockSpec, tokens: int, activation: nn.Cell,
                          renormalize: bool, router_config, spare_slots: int,
                          buffer_slack: float, cluster, trace_ranks: int = 1,
                          fast_level: str = "auto") -> BalancedExpertParallelMoE:
    """The balanced expert-parallel layer of one recognised block over the world group
    (module doc), its home slots loaded with the block's experts. ``tokens``: T, this rank's
    tokens per forward."""
    world = backend.group_size()                  # 1 before init(): one process
    kind = spec.expert_kind
    model = CostModel(ep_cluster(cluster, world), spec.hidden, spec.ffn, "fp32",
                      expert_kind=kind, expert_bias=spec.has_bias)
    (layout,) = training_specs(1, spec.num_experts, world, spare_slots,
                               float(tokens * spec.top_k), model, buffer_slack)
    bias: Optional[Parameter] = (spec.expert_bias if router_config is not None
                                 and router_config.uses_bias else None)
    layer = BalancedExpertParallelMoE.from_spec(
        spec.hidden, spec.ffn, spec.num_experts, spec.top_k, layout, trace_ranks=trace_ranks,
        fast_level=fast_level, expert_kind=kind, has_bias=spec.has_bias,
        activation=activation, renormalize=renormalize, router_config=router_config,
        expert_bias=bias, router=spec.router, shared=spec.shared)
    layer.set_weights(None, *logical_tables(spec))
    return layer
