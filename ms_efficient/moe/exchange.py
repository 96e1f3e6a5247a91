"""What the token exchange of an MoE layer carries: rows per (source rank, device) block.

One function, :func:`exchange_rows`, answers it for every dispatch mode of an
:class:`~ms_efficient.moe.plan.ExpertPlan`, and the cost model
(:mod:`ms_efficient.efficientmoe.cost`) charges it. The expert-parallel layer
(the retired one-level ``ExpertParallelMoE``) sized its AlltoAllV Cells with the
same rules in its one pass over the plan (:func:`~ms_efficient.moe.ep_routing.layer_tables`:
the static rows summed by :func:`slot_rows_by_device`, the grouped blocks
``plan.send_rows``), so the simulated traffic is the traffic the layer's graph sends
(``tests/test_moe_exchange.py`` checks the rules):

    "static"     rank r sends, to device d, every row it owns in d's slots
                 (:func:`~ms_efficient.moe.split.source_rows`, summed over d's slots), full or
                 empty: a compile-time constant.
    "grouped"    rank r sends device d its planned block of C[r, d] rows
                 (:meth:`~ms_efficient.moe.plan.ExpertPlan.send_rows`), full or empty: a
                 compile-time constant.
    "alltoallv"  rank r sends device d exactly the tokens it keeps for d's slots this step
                 (:func:`~ms_efficient.moe.split.split_tokens`): data, so the step's routing
                 counts are needed.
    "counts"     rank r sends device d exactly the rows it keeps for d this step under the
                 "grouped" rule (:func:`~ms_efficient.moe.split.grouped_assignments`: at most
                 C[r, d], within d's buffer): data, the step's routing counts are needed;
                 what the count-driven AlltoAllV of
                 :mod:`~ms_efficient.moe.counted_alltoall` sends.

The combine sends the same blocks back (the transpose), and the backward pass runs both again.
No MindSpore import here.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ms_efficient.moe.plan import ExpertPlan
from ms_efficient.moe.split import source_rows, split_tokens

__all__ = ["exchange_rows", "slot_rows_by_device", "copy_rows", "expert_numel"]


def expert_numel(hidden: int, ffn_hidden: int, expert_kind: str = "mlp",
                 has_bias: bool = True) -> int:
    """X, the parameters of one expert: w1 [H, F1], w2 [F, H] and, with biases, b1 [F1] and
    b2 [H], where F1 = F for a two-matrix ("mlp") expert and 2F for a gated ("glu") one (its
    fused [w_gate | w_up]). The balanced layer holds exactly these
    (:class:`~ms_efficient.moe.balanced_ep.BalancedExpertParallelMoE` asserts it)."""
    if hidden < 1 or ffn_hidden < 1:
        raise ValueError(f"'hidden' and 'ffn_hidden' must be positive, but got {hidden} and "
                         f"{ffn_hidden}.")
    if expert_kind not in ("mlp", "glu"):
        raise ValueError(f"'expert_kind' must be one of ['mlp', 'glu'], but got "
                         f"{expert_kind!r}.")
    f1 = 2 * ffn_hidden if expert_kind == "glu" else ffn_hidden
    return hidden * f1 + ffn_hidden * hidden + ((f1 + hidden) if has_bias else 0)


def copy_rows(hidden: int, ffn_hidden: int, expert_kind: str = "mlp",
              has_bias: bool = True) -> int:
    """Rows of ``hidden`` values one expert copy takes in the balanced layer's dispatch: its
    X parameters (:func:`expert_numel`: 2 H F + F + H for the default two-matrix expert with
    biases), zero-padded to whole rows; the layer
    (:class:`~ms_efficient.moe.balanced_ep.BalancedExpertParallelMoE`) sends a copy as these
    rows and the simulator (:mod:`~ms_efficient.efficientmoe.balanced_cost`) charges them."""
    return -(-expert_numel(hidden, ffn_hidden, expert_kind, has_bias) // hidden)


def exchange_rows(plan: ExpertPlan, num_experts: int, rank_device: Sequence[int],
                  num_devices: int, devices_per_node: Optional[int] = None,
                  counts_RE: Optional[np.ndarray] = None) -> np.ndarray:
    """Rows of the dispatch exchange, int64 [R, D]: ``rows_RD[r, d]`` rows (of H values each)
    go from source rank r to device d in one forward dispatch (the diagonal entries of ranks
    on their own device stay local).

    plan: the layer's plan (its ``dispatch`` picks the rule, module docstring).
    num_experts: E. rank_device: int [R], device of each source rank. num_devices: D.
    devices_per_node: node tier of the static and count-based rules (None: no node tier).
    counts_RE: int [R, E], the step's routing counts; needed for ``"alltoallv"`` and
        ``"counts"`` plans (split_tokens gives "counts" plans the grouped rule).
    """
    rank_device = np.asarray(rank_device, dtype=np.int64)
    num_ranks = rank_device.size
    if plan.dispatch == "grouped":
        block_RD = plan.send_rows(num_ranks, num_devices)
        return np.ascontiguousarray(block_RD, dtype=np.int64)
    if plan.dispatch == "static":
        per_slot_RS = source_rows(plan, num_experts, rank_device, devices_per_node,
                                  plan.rank_share)
    else:
        if counts_RE is None:
            raise ValueError(f"an {plan.dispatch!r} plan sends the step's kept tokens, so "
                             f"exchange_rows needs 'counts_RE' [R, E], but got None.")
        per_slot_RS, _ = split_tokens(plan, counts_RE, rank_device, devices_per_node)
    return slot_rows_by_device(per_slot_RS, plan.slot_device, num_devices)


def slot_rows_by_device(per_slot_RS: np.ndarray, slot_device: np.ndarray,
                        num_devices: int) -> np.ndarray:
    """int64 [R, D]: a [R, S] rank-to-slot row table summed over each device's slots."""
    rows_RD = np.zeros((per_slot_RS.shape[0], num_devices), dtype=np.int64)
    np.add.at(rows_RD, (slice(None), slot_device), per_slot_RS)
    return rows_RD
