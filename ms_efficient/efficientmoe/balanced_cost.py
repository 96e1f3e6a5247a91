"""Cost of one training step of balanced MoE layers (:mod:`balance`), every layer at once.

What a layer built on the fast level does each step, and what this module charges for it
(seconds, vectorised over layers; ``model`` is the :class:`~ms_efficient.efficientmoe.cost.
CostModel` of the other MoE rows):

    exchange   AllGather of the int32 routing counts [R, E] (static shape), once per step;
               a dynamic-shape system (``dynamic=True``) also pays ``dynamic_exchange_s``
               per count-driven All-to-All, as every data-sized exchange in this package.
    fast       the fast level's own computation of the tables per layer-step,
               :meth:`~ms_efficient.efficientmoe.cost.CostModel.fast_level_time_L` of the
               step's loop iterations (the ops twin's launched kernels on a 910B preset, the
               measured host kernel on CPU; ``fast_level=False`` for EPLB's even split,
               which computes no per-step tables beyond a division); not part of the
               exchange's share.
    a2a        four All-to-Alls of the per-pair rows (dispatch and combine, forward and
               backward; :func:`~ms_efficient.efficientmoe.cost.uneven_alltoall_time_s`):
               the forward dispatch also carries the step's expert copies (each
               ``model.copy_bytes``: its parameters as whole rows of H, home holder -> spare
               slot, only the copies made, as the layer sends them in its one count-driven
               dispatch) and the backward dispatch-gradient carries their gradients back
               (spare slot -> home holder). Charged on the same links
               as the tokens, serially: no overlap with compute is claimed (on Ascend a copy
               could start with the dispatch and overlap the home slots' compute; the model
               does not count on it).
    compute    per device, the grouped matmul over the rows it really computes, each expert
               piece rounded up to the cube tile (``ClusterSpec.tiled_rows``), as the
               roofline max(FLOPs at peak x efficiency, bytes moved / HBM bandwidth) of
               :func:`~ms_efficient.efficientmoe.cost.compute_time_D`; the fixed buffer's
               unused rows cost memory, not time; the largest device counts.
    sync       the all-reduce of the redundant home replicas' gradients as the layer sends
               it (:func:`home_sync_time_L`): one table sized for any home table of the
               layout's shapes, over every rank, every step; a copy's gradient is the
               backward transfer above, added into its home expert.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ms_efficient.efficientmoe.cost import (CostModel, count_exchange_time_s, sync_time_s,
                                            uneven_alltoall_time_s)
from ms_efficient.moe.balance import Balance
from ms_efficient.moe.ep_routing import cross_budget

__all__ = ["BalancedCost", "balanced_cost", "dispatch_bytes_LWW", "home_sync_time_L",
           "copy_cost_rows_WW"]


@dataclass
class BalancedCost:
    """One step's cost per layer, seconds, float64 [L] each (time = the sum of the others).

    weight_bytes_L: bytes of expert copies sent this step (forward, ``model.copy_bytes``
    each; the same bytes of gradients return in backward). fast_L: the fast level's own time.
    copies_L: what the copies add to a2a_L (a2a_L less the same exchanges without them)."""

    time_L: np.ndarray
    exchange_L: np.ndarray
    a2a_L: np.ndarray
    compute_L: np.ndarray
    sync_L: np.ndarray
    weight_bytes_L: np.ndarray
    fast_L: np.ndarray
    copies_L: np.ndarray = None      # the part of a2a_L the copies' weights add (seconds)


def _embed(matrix_LWW: np.ndarray, num_devices: int) -> np.ndarray:
    """[L, W, W] on the first W devices of a D-device cluster (rank r on device r)."""
    num_layers, width, _ = matrix_LWW.shape
    out = np.zeros((num_layers, num_devices, num_devices))
    out[:, :width, :width] = matrix_LWW
    return out


def home_sync_time_L(home_LWS: np.ndarray, num_experts: int, model: CostModel,
                     rows: Optional[int] = None) -> np.ndarray:
    """Seconds per layer of the replicas' gradient sync, float64 [L] (a constant of the
    layout): the balanced layer all-reduces, over its W ranks, a table of ``rows`` experts'
    parameters every step, whichever experts the home table replicates now (the layout's
    ``sync_rows``; None: as many as any home table of S_h slots per device could replicate,
    :func:`~ms_efficient.moe.ep_routing.sync_rows`); no table without rows
    (:func:`~ms_efficient.efficientmoe.cost.sync_time_s`)."""
    num_layers, world, slots = np.shape(home_LWS)
    if rows is None:                       # sync_rows of a layer built for S_h slots
        rows = cross_budget(num_experts, world, slots)
    return np.full(num_layers, sync_time_s(int(rows), model, list(range(world))))


def copy_cost_rows_WW(model: CostModel, num_devices: int) -> np.ndarray:
    """One expert copy from device i to device j in rows of expert compute, float64 [W, W]:
    the weight transfer forward plus its gradient's return in backward, each alpha + bytes / B
    over the link between them, over ``model.row_time_s`` (what the fast level weighs a copy
    against the rows it moves)."""
    cluster = model.cluster
    node = np.arange(num_devices) // cluster.devices_per_node
    same = node[:, None] == node[None, :]
    link_s = np.where(same, cluster.intra_link.latency_s
                      + model.copy_bytes / cluster.intra_link.bandwidth_Bps,
                      cluster.inter_link.latency_s
                      + model.copy_bytes / cluster.inter_link.bandwidth_Bps)
    return 2.0 * link_s / model.row_time_s


def dispatch_bytes_LWW(balance: Balance, model: CostModel) -> np.ndarray:
    """Bytes every rank sends every device in each layer's dispatch, int64 [L, W, W]: its
    token rows (``bytes_per_token`` each), then the weights of every expert copy it is the
    source of for that device (``copy_bytes`` each: whole rows of H). What the balanced
    layer's count-driven dispatch sends (its ``exchange_bytes``; tests/test_balanced_ep.py
    holds the two equal on a run with copies); the combine sends the token part back."""
    return (balance.sent_LRW.astype(np.int64) * int(model.bytes_per_token)
            + balance.copies_LWW.astype(np.int64) * int(model.copy_bytes))


def balanced_cost(balance: Balance, model: CostModel, sync_L: np.ndarray,
                  dynamic: bool = False, fast_level: bool = True,
                  count_exchange: bool = True) -> BalancedCost:
    """The cost of one balanced step (module docstring). sync_L: :func:`home_sync_time_L` of
    the layout; dynamic: charge the dynamic-shape overhead of count-driven exchanges;
    fast_level: charge the fast level's tables per layer (``model.fast_level_time_L``);
    count_exchange: charge the counts' AllGather (False for a static-shape layer that sends
    fixed blocks, e.g. GShard's, whose ``sent_LRW`` are then the padded rows)."""
    cluster = model.cluster
    num_layers, num_ranks, _ = balance.sent_LRW.shape
    num_experts = balance.rows_LEW.shape[1]
    exchange = (count_exchange_time_s(num_ranks, num_experts, model, list(range(num_ranks)))
                if count_exchange else 0.0)
    if dynamic and num_ranks > 1:
        exchange += model.a2a_passes * model.dynamic_exchange_s
    fast_L = (model.fast_level_time_L(balance.trips_L4, num_layers) if fast_level
              else np.zeros(num_layers))
    tokens = _embed(balance.sent_LRW * float(model.bytes_per_token), cluster.num_devices)
    dispatch = _embed(dispatch_bytes_LWW(balance, model).astype(np.float64),
                      cluster.num_devices)
    weights = dispatch - tokens
    back = np.swapaxes(tokens, 1, 2)
    a2a = (uneven_alltoall_time_s(dispatch, cluster)                        # fwd dispatch
           + uneven_alltoall_time_s(back, cluster)                          # fwd combine
           + uneven_alltoall_time_s(tokens, cluster)                        # bwd combine-grad
           + uneven_alltoall_time_s(back + np.swapaxes(weights, 1, 2), cluster))
    a2a = a2a * (model.a2a_passes / 4.0)
    tokens_only = (2 * uneven_alltoall_time_s(tokens, cluster)
                   + 2 * uneven_alltoall_time_s(back, cluster)) * (model.a2a_passes / 4.0)
    rows = cluster.tiled_rows(balance.rows_LEW).astype(np.float64)           # [L, E, W]
    h, f = model.hidden, model.ffn_hidden
    flops_LW = rows.sum(axis=1) * model.row_time_s
    bytes_LW = np.where(rows > 0, 2.0 * (rows * (h + f) + h * f) * model.dtype_bytes,
                        0.0).sum(axis=1)
    memory_LW = cluster.memory_time_s(model.compute_passes * bytes_LW)
    compute = np.maximum(flops_LW, memory_LW).max(axis=1)
    sync = np.asarray(sync_L, dtype=np.float64)
    exchange_L = np.full(num_layers, exchange)
    return BalancedCost(time_L=exchange_L + a2a + compute + sync + fast_L,
                        exchange_L=exchange_L, a2a_L=a2a, compute_L=compute, sync_L=sync,
                        weight_bytes_L=balance.copies_LWW.sum(axis=(1, 2))
                        * float(model.copy_bytes), fast_L=fast_L,
                        copies_L=np.maximum(a2a - tokens_only, 0.0))
