"""Adopt a network's own MoE blocks: :func:`adopt_moe` replaces each with the package's layer
(:class:`~ms_efficient.moe.dropin.MoEMLP` around
:class:`~ms_efficient.moe.layer.MoEFeedForward`) that reuses the block's own Parameters, so
weights, parameter names, checkpoints and optimizer state stay the user's, and the
``efficientmoe`` / ``mpipe`` passes and the routing callbacks plan the layers.

The recognised block (any Cell of the network, under any attribute names):

- **router**: a direct ``nn.Dense`` child H -> E (bias allowed), or a direct Parameter
  [E, H] whose attribute name contains "router" or "gate" (logits = x @ w^T);
- **router** of DeepSeek-V2/V3 style: a direct child Cell named ``gate`` / ``router`` holding
  one Parameter [E, H] (logits = x @ w^T), with its routing attributes on it or on the block
  (``scoring_func`` "softmax" / "sigmoid", ``n_group``, ``topk_group``, ``topk_method``
  "group_limited_greedy" for V2's group max, ``routed_scaling_factor``, ``norm_topk_prob``)
  and an optional ``e_score_correction_bias`` [E] (selection only; kept and updated by the
  adopted layer, ``bias_update_speed``);
- **experts**, either stacked: two direct Parameters w1 [E, H, F] and w2 [E, F, H] (w1 is
  the one whose second dimension is H; registration order if H == F) with optional biases
  b1 [E, F] or [E, 1, F] and b2 [E, H] or [E, 1, H] (both or none), or a list: a direct
  ``nn.CellList`` / ``nn.SequentialCell`` child of E experts, each holding exactly two
  ``nn.Dense``, H -> F then F -> H, or three for gated experts (Mixtral / MindFormers
  w1 gate, w3 up, w2 down; DeepSeek / Qwen gate_proj, up_proj, down_proj; other names in
  registration order: gate, up, down) computing down(act(gate x) * up x), biases on all or
  none, the same for every expert;
- **shared expert** (optional): a direct child ``shared_experts`` / ``shared_expert``
  (any Cell [.., H] -> [.., H], used as it is), scaled by sigmoid(``shared_expert_gate``(x))
  when the block has that Dense H -> 1 (Qwen-MoE), added to the routed output;
- **top_k**: an int attribute ``top_k``, ``num_experts_per_tok``, ``topk`` or ``k`` (or
  ``adopt_moe(top_k=...)``);
- **gating**: softmax over the E router logits, then the top k, the k gate weights either
  renormalised to sum to 1 (Mixtral's softmax over the top-k logits is the same) or not:
  from a bool attribute ``norm_topk_prob`` or ``renormalize``, from
  ``adopt_moe(renormalize=...)``, else detected by the probe below;
- **activation** between the two matmuls: a parameter-free Cell of the block or of the first
  expert (e.g. ``nn.GELU``, a Dense's own ``activation``), ``adopt_moe(activation=...)``,
  else detected among tanh GELU, erf GELU, ReLU and SiLU;
- **output**: ``construct(x [B, S, H]) -> y [B, S, H]`` with y = sum over the k chosen experts
  of gate * expert(x) (plus the shared expert): no residual, noise or capacity inside the
  block.

Every replacement is checked before anything is changed: the block and the candidate layer
(dropless) run on the same probe input [2, 8, H] in PYNATIVE mode (the context mode is
restored afterwards), and the first gating / activation choice whose output matches the
block's within 1e-4 of its largest value is used; none matching is a ValueError naming the
block and the smallest difference. A block that looks like an MoE (two or more stacked 3-D
weights with one leading size, or a list of experts beside a router or a top-k attribute)
but breaks the contract is a ValueError naming its path and the shape expected; a network
without MoE blocks is a ValueError. Recognition is :mod:`ms_efficient.adopt.blocks`.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn

from ms_efficient.adopt.blocks import (BlockSpec, block_spec, find_moe_blocks, moe_blocks,
                                     with_gating)
from ms_efficient.adopt.parallel import expert_parallel_layer
from ms_efficient.moe.dropin import MoEMLP, replace_cell
from ms_efficient.moe.layer import LAYER_DISPATCH, MoEFeedForward
from ms_efficient.moe.split import switch_capacity

__all__ = ["adopt_moe", "find_moe_blocks", "adopt_hint", "AdoptedBlock"]

PROBE_SHAPE = (2, 8)            # [B, S] of the probe input
PROBE_RTOL = 1e-4               # |y_layer - y_block| <= rtol * max |y_block|


@dataclasses.dataclass(frozen=True)
class AdoptedBlock:
    """What :func:`adopt_moe` replaced at one path (sizes in elements)."""
    num_experts: int
    top_k: int
    hidden_size: int
    ffn_hidden_size: int
    experts: str                 # "stacked" ([E, H, F] Parameters) or "list" (Dense experts)
    renormalize: bool
    activation: str              # class name of the activation Cell used
    has_bias: bool
    capacity: int                # slots per expert (0 for dispatch "grouped")
    probe_error: float           # max |y_layer - y_block| / max |y_block| on the probe
    expert_kind: str = "mlp"     # "glu": gated experts
    shared: bool = False         # a shared expert is added
    router: str = "softmax"      # "softmax", or the RouterConfig of a DeepSeek-style gate


def _layer(spec: BlockSpec, capacity: int, activation: nn.Cell, renormalize: bool,
           trace_ranks: int = 1, dispatch: str = "static") -> MoEFeedForward:
    config = (None if spec.router_config is None
              else dataclasses.replace(spec.router_config, renormalize=renormalize))
    return MoEFeedForward(spec.hidden, spec.ffn, spec.num_experts, spec.top_k, capacity,
                          trace_ranks, dispatch=dispatch, activation=activation,
                          renormalize=renormalize, has_bias=spec.has_bias, router=spec.router,
                          weights=spec.weights, expert_kind=spec.expert_kind,
                          up_weights=spec.up, shared=spec.shared, router_config=config,
                          expert_bias=spec.expert_bias if config is not None
                          and config.uses_bias else None)


def _probe(spec: BlockSpec) -> Tuple[nn.Cell, bool, float]:
    """(activation, renormalize, relative error) of the first candidate whose dropless layer
    reproduces the block's output on a probe input (see module doc)."""
    w1 = spec.weights[0]
    w1_EHF = (np.stack([w.asnumpy().T for w in w1]) if isinstance(w1, tuple)
              else w1.asnumpy())
    x = np.random.default_rng(0).standard_normal(PROBE_SHAPE + (spec.hidden,))
    pre = np.einsum("bsh,ehf->ebsf", x, w1_EHF)
    # pre-activations of order 1.5, where tanh GELU, erf GELU, ReLU and SiLU differ
    x = Tensor((x * 1.5 / max(float(pre.std()), 1e-12)).astype(np.float32))
    tokens = PROBE_SHAPE[0] * PROBE_SHAPE[1]
    mode = ms.get_context("mode")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        y_ref = spec.cell(x)
        if not isinstance(y_ref, Tensor) or tuple(y_ref.shape) != tuple(x.shape):
            raise ValueError(f"adopt_moe: MoE block {spec.path!r} must return y of its input's "
                             f"shape {tuple(x.shape)}, but returned "
                             f"{getattr(y_ref, 'shape', type(y_ref).__name__)}.")
        y_ref = y_ref.asnumpy()
        scale = max(float(np.abs(y_ref).max()), 1e-12)
        best = (None, None, np.inf)
        for act in spec.activations:
            for renorm in spec.renormalize:
                y = _layer(spec, tokens, act, renorm)(x)[0].asnumpy()
                err = float(np.abs(y - y_ref).max()) / scale
                if err < best[2]:
                    best = (act, renorm, err)
                if err <= PROBE_RTOL:
                    return act, renorm, err
    finally:
        ms.set_context(mode=mode)
    raise ValueError(f"adopt_moe: no gating / activation reproduces MoE block {spec.path!r}: "
                     f"tried renormalize {list(spec.renormalize)} x activations "
                     f"{[type(a).__name__ for a in spec.activations]}, smallest relative "
                     f"difference {best[2]:.3g} (at {type(best[0]).__name__}, renormalize="
                     f"{best[1]}); the block must compute softmax -> top-k -> sum of gate * "
                     f"expert(x) (see ms_efficient.adopt).")


def adopt_hint(network: nn.Cell) -> str:
    """A sentence for the error of a pass or callback that found no package MoE layer: where
    ``network`` has MoE blocks of its own and how to adopt them ("" when it has none)."""
    paths = find_moe_blocks(network)
    if not paths:
        return ""
    return (f" The network has MoE blocks of its own at {paths}: put the package's layer in "
            f"their place first with `network, report = ms_efficient.adopt_moe(network, "
            f"tokens=B * S)`.")


def adopt_moe(network: nn.Cell, tokens: int, capacity_factor: float = 0.0,
              top_k: Optional[int] = None, renormalize: Optional[bool] = None,
              activation: Optional[nn.Cell] = None, aux_loss_coef: float = 0.0,
              trace_ranks: int = 1, dispatch: str = "static",
              bias_update_speed: float = 1e-3, expert_parallel: bool = False,
              spare_slots: int = 1, buffer_slack: float = 0.5, cluster=None,
              fast_level: str = "auto"
              ) -> Tuple[nn.Cell, Dict[str, AdoptedBlock]]:
    """Replace every MoE block of ``network`` (the contract: module doc) by the package's
    layer, in place; returns ``(network, {path: AdoptedBlock})``.

    Args:
        network: the user's Cell (a ``nn.WithLossCell`` around it works too).
        tokens: T = B * S tokens one forward of each block sees; sets the capacities.
        capacity_factor: slots per expert ceil(cf * T * k / E) (:func:`switch_capacity`);
            0 (default) is dropless: the adopted network computes what the original did.
        top_k, renormalize, activation: override the block's attributes / detection.
        aux_loss_coef: the load-balancing loss's weight in the gradients (see
            :class:`~ms_efficient.moe.dropin.MoEMLP`); 0 keeps the original's gradients.
        trace_ranks: R trace groups of the layers' routing counts (must divide T).
        dispatch: "static" (plannable capacities) or "grouped" (padding-free, dropless).
        bias_update_speed: gamma of the auxiliary-loss-free balancing of a gate that holds an
            ``e_score_correction_bias`` (DeepSeek-V3's 0.001): the adopted layer selects with
            the user's bias and updates it after each training forward.
        expert_parallel: in an msrun-launched process after ``mindspore.communication.
            init()``: each block becomes EfficientMoE's balanced expert-parallel layer over
            the world group (:mod:`ms_efficient.adopt.parallel`: each rank keeps its experts,
            copies of hot experts every step); ``tokens`` is then this rank's T, and
            ``capacity_factor``, ``dispatch`` do not apply. Train with
            :class:`ms_efficient.TrainOneStepCell`; build the optimizer after adoption.
        spare_slots, buffer_slack, cluster, fast_level: the expert-parallel layout: spare
            slots per rank for the per-step copies, receive buffers of the mean share x
            (1 + buffer_slack), the cluster the copies are priced on (a preset name or
            ClusterSpec; default cpu-local grown to the job's ranks), the fast level's
            implementation (:class:`~ms_efficient.moe.fast_level.FastLevel`).

    Parameter names: the block's own Parameters keep theirs (the same objects: an optimizer
    built before adoption still updates them); the new buffers, not trainable, are named by
    the block's path (``<path>.aux_loss``, ``<path>.dropped``, ``<path>.moe.routing_counts``).
    With a list of Dense experts ``get_parameters()`` lists them grouped by kind (every
    expert's first weight, then biases, ...), not expert by expert; checkpoints load by name.
    Raises ValueError for a block that breaks the contract, one whose output no gating /
    activation choice reproduces, or a network without MoE blocks.
    """
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"'tokens' must be an int >= 1 (B * S of one forward), but got "
                         f"{tokens!r}.")
    if capacity_factor < 0:
        raise ValueError(f"'capacity_factor' must be >= 0 (0: dropless), but got "
                         f"{capacity_factor}.")
    if trace_ranks < 1 or tokens % trace_ranks:
        raise ValueError(f"'trace_ranks' must divide 'tokens' ({tokens}), but got "
                         f"{trace_ranks}.")
    if dispatch not in LAYER_DISPATCH:
        raise ValueError(f"'dispatch' must be one of {list(LAYER_DISPATCH)}, but got "
                         f"{dispatch!r}.")
    if expert_parallel and (isinstance(spare_slots, bool) or not isinstance(spare_slots, int)
                            or spare_slots < 0):
        raise ValueError(f"'spare_slots' must be an int >= 0, but got {spare_slots!r}.")
    if expert_parallel and not 0 <= buffer_slack < float("inf"):
        raise ValueError(f"'buffer_slack' must be a finite number >= 0, but got "
                         f"{buffer_slack!r}.")
    blocks = moe_blocks(network)
    if not blocks:
        raise ValueError(f"adopt_moe: found no MoE block in {type(network).__name__}: looked "
                         f"for Cells with stacked expert weights [E, H, F] / [E, F, H] or a "
                         f"list of Dense experts beside a router (see ms_efficient.adopt).")
    if any(not p for p, _ in blocks):
        raise ValueError("adopt_moe: the network itself is an MoE block; pass the network "
                         "that contains it.")
    names = {id(p): p.name for p in network.get_parameters()}
    params = list(network.get_parameters())
    report: Dict[str, AdoptedBlock] = {}
    try:
        # Step 1: recognise and check every block before changing anything
        chosen = []
        for path, cell in blocks:
            spec = block_spec(path, cell)
            spec = with_gating(spec, top_k, renormalize, activation, bias_update_speed)
            chosen.append((spec,) + _probe(spec))
        # Step 2: replace
        for spec, act, renorm, err in chosen:
            if expert_parallel:
                cap = 0
                config = (None if spec.router_config is None else
                          dataclasses.replace(spec.router_config, renormalize=renorm))
                layer = expert_parallel_layer(spec, tokens, act, renorm, config, spare_slots,
                                              buffer_slack, cluster, trace_ranks, fast_level,
                                              names)
            else:
                cap = switch_capacity(tokens, spec.num_experts, spec.top_k, capacity_factor)
                layer = _layer(spec, cap, act, renorm, trace_ranks, dispatch)
            replace_cell(network, spec.path, MoEMLP(layer=layer, aux_loss_coef=aux_loss_coef),
                         names)
            report[spec.path] = AdoptedBlock(
                spec.num_experts, spec.top_k, spec.hidden, spec.ffn, spec.layout, renorm,
                type(act).__name__, spec.has_bias,
                cap if dispatch == "static" and not expert_parallel else 0, err,
                spec.expert_kind, spec.shared is not None,
                "softmax" if spec.router_config is None else str(spec.router_config))
    finally:
        for p in params:               # building candidates renamed the reused Parameters
            p.name = names[id(p)]
    return network, report
