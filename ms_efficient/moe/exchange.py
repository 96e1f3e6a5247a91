"""What one expert is in an exchange: its parameter count and the rows a copy takes.

The balanced layer (:class:`~ms_efficient.moe.balanced_ep.BalancedExpertParallelMoE`) sends a
hot expert's copy to a spare slot as rows of H values inside its dispatch; the simulator
(:mod:`~ms_efficient.efficientmoe.balanced_cost`, ``CostModel.copy_bytes``) charges the same
rows, from these two functions. No MindSpore import here.
"""
from __future__ import annotations

__all__ = ["copy_rows", "expert_numel"]


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
