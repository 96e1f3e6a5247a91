"""Adopt a network's own MoE blocks: :func:`adopt_moe` replaces each with the package's layer
(:class:`~ms_efficient.moe.dropin.MoEMLP` around
:class:`~ms_efficient.moe.layer.MoEFeedForward`) that reuses the block's own Parameters, so
weights, parameter names, checkpoints and optimizer state stay the user's, and the
``efficientmoe`` / ``mpipe`` passes and the routing callbacks plan the layers.

The recognised block (any Cell of the network, under any attribute names):

- **router**: a direct ``nn.Dense`` child H -> E (bias allowed), or a direct Parameter
  [E, H] whose attribute name contains "router" or "gate" (logits = x @ w^T);
- **experts**, either stacked: two direct Parameters w1 [E, H, F] and w2 [E, F, H] (w1 is
  the one whose second dimension is H; registration order if H == F) with optional biases
  b1 [E, F] or [E, 1, F] and b2 [E, H] or [E, 1, H] (both or none), or a list: a direct
  ``nn.CellList`` / ``nn.SequentialCell`` child of E experts, each holding exactly two
  ``nn.Dense``, H -> F then F -> H (biases on both or neither, the same for every expert);
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
  of gate * expert(x): no residual, shared expert, noise or capacity inside the block.

Every replacement is checked before anything is changed: the block and the candidate layer
(dropless) run on the same probe input [2, 8, H] in PYNATIVE mode (the context mode is
restored afterwards), and the first gating / activation choice whose output matches the
block's within 1e-4 of its largest value is used; none matching is a ValueError naming the
block and the smallest difference. A block that looks like an MoE (two or more stacked 3-D
weights with one leading size, or a list of experts beside a router or a top-k attribute) but breaks the contract is a ValueError
naming its path and the shape expected; a network without MoE blocks is a ValueError.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from ms_efficient.moe.dropin import MoEMLP
from ms_efficient.moe.layer import (DISPATCH_MODES, ROUTING_COUNTS, MoEFeedForward,
                                    expert_capacity, make_gelu)
from ms_efficient.moe.swap import replace_cell

__all__ = ["adopt_moe", "find_moe_blocks", "adopt_hint", "AdoptedBlock", "TOP_K_ATTRIBUTES",
           "RENORMALIZE_ATTRIBUTES"]

TOP_K_ATTRIBUTES = ("top_k", "num_experts_per_tok", "topk", "k")
RENORMALIZE_ATTRIBUTES = ("norm_topk_prob", "renormalize")
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


class ParameterRouter(nn.Cell):
    """Router logits from a user's Parameter [E, H]: ``construct(x_TH) -> x_TH @ w^T``."""

    def __init__(self, weight: Parameter):
        super().__init__()
        self.weight = weight
        self.matmul = ops.MatMul(transpose_b=True)

    def construct(self, x):
        return self.matmul(x, self.weight)


@dataclasses.dataclass
class _Spec:
    """A recognised block: everything needed to build its replacement."""
    path: str
    cell: nn.Cell
    num_experts: int
    hidden: int
    ffn: int
    router: nn.Cell
    weights: tuple               # (w1, b1, w2, b2), Parameters or tuples of per-expert ones
    has_bias: bool
    layout: str
    top_k: Optional[int]
    renormalize: Tuple[bool, ...]
    activations: Tuple[nn.Cell, ...]


def _direct_params(cell: nn.Cell) -> Dict[str, Parameter]:
    return dict(cell.parameters_and_names(expand=False))


def _own_params(cell: nn.Cell) -> bool:
    return bool(list(cell.get_parameters()))


def _activation_cells(cell: nn.Cell) -> List[nn.Cell]:
    """Parameter-free leaf Cells directly under ``cell`` (activation candidates)."""
    return [c for c in cell.name_cells().values()
            if not _own_params(c) and not c.name_cells()]


def _router(path: str, cell: nn.Cell, params: Dict[str, Parameter], e: Optional[int],
            h: Optional[int]) -> Tuple[nn.Cell, str, int, int]:
    """(router Cell, name of its Parameter or child, E, H): the direct Dense child with E
    outputs, or the direct 2-D Parameter named *router* / *gate*."""
    found = []
    for name, child in cell.name_cells().items():
        if isinstance(child, nn.Dense) and (e is None or child.out_channels == e) \
                and (h is None or child.in_channels == h):
            found.append((child, name, child.out_channels, child.in_channels))
    for name, p in params.items():
        if p.ndim == 2 and ("router" in name.lower() or "gate" in name.lower()) \
                and (e is None or p.shape[0] == e) and (h is None or p.shape[1] == h):
            found.append((ParameterRouter(p), name, p.shape[0], p.shape[1]))
    if len(found) != 1:
        want = f"[{e if e else 'E'}, {h if h else 'H'}]"
        raise ValueError(f"adopt_moe: MoE block {path!r} ({type(cell).__name__}) needs one "
                         f"router: a direct nn.Dense child H -> E or a Parameter {want} named "
                         f"*router* / *gate*; found "
                         f"{[n for _, n, _, _ in found] or 'none'}.")
    return found[0]


def _expert_list(cell: nn.Cell) -> Optional[Tuple[str, nn.Cell]]:
    for name, child in cell.name_cells().items():
        if isinstance(child, (nn.CellList, nn.SequentialCell)) and len(child) > 0 and all(
                any(isinstance(c, nn.Dense) for _, c in item.cells_and_names())
                for item in child):
            return name, child
    return None


def _looks_like_moe(cell: nn.Cell) -> bool:
    """Stacked: two or more direct 3-D Parameters with one leading size E (a single 3-D
    Parameter, e.g. a position bias, is not an MoE); list: see module doc. MindSpore's own
    layers (``nn.Conv1d``'s 3-D weight) never are."""
    if type(cell).__module__.startswith("mindspore."):
        return False
    leading = [p.shape[0] for p in _direct_params(cell).values() if p.ndim == 3]
    if len(leading) >= 2 and len(set(leading)) < len(leading):
        return True
    found = _expert_list(cell)
    if found is None:
        return False
    e = len(found[1])
    return any(hasattr(cell, a) for a in TOP_K_ATTRIBUTES) or any(
        isinstance(c, nn.Dense) and c.out_channels == e for c in cell.name_cells().values())


def _stacked_spec(path: str, cell: nn.Cell) -> _Spec:
    params = _direct_params(cell)
    stacked = [(n, p) for n, p in params.items() if p.ndim == 3]
    shapes = {n: tuple(p.shape) for n, p in stacked}
    if len(stacked) != 2 or stacked[0][1].shape[0] != stacked[1][1].shape[0] \
            or tuple(stacked[0][1].shape[1:]) != tuple(stacked[1][1].shape[:0:-1]):
        raise ValueError(f"adopt_moe: MoE block {path!r} ({type(cell).__name__}) needs two "
                         f"stacked expert weights [E, H, F] and [E, F, H]; found {shapes} "
                         f"(gated experts with three weights are not recognised).")
    e = int(stacked[0][1].shape[0])
    router, router_name, _, h = _router(path, cell, params, e, None)
    (n1, w1), (n2, w2) = stacked if stacked[0][1].shape[1] == h else stacked[::-1]
    if w1.shape[1] != h:
        raise ValueError(f"adopt_moe: MoE block {path!r}: expert weights {shapes} do not "
                         f"match the router's hidden size H={h} ([E, H, F], [E, F, H]).")
    f = int(w1.shape[2])
    rest = [(n, p) for n, p in params.items() if n not in (n1, n2, router_name)]
    b1 = next((p for n, p in rest if tuple(p.shape) in ((e, f), (e, 1, f))), None)
    b2 = next((p for n, p in rest if p is not b1 and tuple(p.shape) in ((e, h), (e, 1, h))),
              None)
    unknown = {n: tuple(p.shape) for n, p in rest if p is not b1 and p is not b2}
    if unknown or (b1 is None) != (b2 is None):
        raise ValueError(f"adopt_moe: MoE block {path!r}: Parameters {unknown or shapes} are "
                         f"not part of the contract (biases b1 [E, F] or [E, 1, F] and b2 "
                         f"[E, H] or [E, 1, H], both or none, with E={e}, H={h}, F={f}).")
    _check_children(path, cell, (router_name,))
    return _Spec(path, cell, e, h, f, router, (w1, b1, w2, b2), b1 is not None, "stacked",
                 None, (), tuple(_activation_cells(cell)))


def _list_spec(path: str, cell: nn.Cell) -> _Spec:
    list_name, experts = _expert_list(cell)
    e = len(experts)
    pairs, acts = [], []
    for i, expert in enumerate(experts):
        dense = [c for _, c in expert.cells_and_names() if isinstance(c, nn.Dense)]
        dense_params = {id(p) for d in dense for p in d.get_parameters()}
        extra = [p.name for p in expert.get_parameters() if id(p) not in dense_params]
        ok = len(dense) == 2 and not extra and dense[0].out_channels == dense[1].in_channels \
            and dense[0].in_channels == dense[1].out_channels \
            and dense[0].has_bias == dense[1].has_bias and not dense[1].activation_flag
        if not ok:
            raise ValueError(f"adopt_moe: expert {path}.{list_name}.{i} needs exactly two "
                             f"nn.Dense, H -> F then F -> H (biases on both or neither, no "
                             f"activation on the second) and no other Parameters; found "
                             f"{[(d.in_channels, d.out_channels) for d in dense]}"
                             f"{' and ' + str(extra) if extra else ''}.")
        pairs.append(dense)
        if i == 0:
            acts = ([dense[0].activation] if dense[0].activation_flag else []) + \
                _activation_cells(expert)
    h, f = pairs[0][0].in_channels, pairs[0][0].out_channels
    if any((d[0].in_channels, d[0].out_channels, d[0].has_bias) != (h, f, pairs[0][0].has_bias)
           for d in pairs):
        raise ValueError(f"adopt_moe: the experts of {path!r} differ in shape or bias; every "
                         f"expert must be Dense {h} -> {f} -> {h} alike.")
    router, router_name, _, _ = _router(path, cell, _direct_params(cell), e, h)
    extra = {n: tuple(p.shape) for n, p in _direct_params(cell).items() if n != router_name}
    if extra:
        raise ValueError(f"adopt_moe: MoE block {path!r}: Parameters {extra} are not part of "
                         f"the contract (a router, and experts in {list_name!r}).")
    _check_children(path, cell, (router_name, list_name))
    bias = bool(pairs[0][0].has_bias)
    weights = (tuple(d[0].weight for d in pairs),
               tuple(d[0].bias for d in pairs) if bias else None,
               tuple(d[1].weight for d in pairs),
               tuple(d[1].bias for d in pairs) if bias else None)
    return _Spec(path, cell, e, h, f, router, weights, bias, "list", None, (),
                 tuple(acts) + tuple(_activation_cells(cell)))


def _check_children(path: str, cell: nn.Cell, allowed: Tuple[str, ...]) -> None:
    other = [n for n, c in cell.name_cells().items() if n not in allowed and _own_params(c)]
    if other:
        raise ValueError(f"adopt_moe: MoE block {path!r} has sub-Cells with Parameters "
                         f"{other} besides its router and experts (e.g. a shared expert), "
                         f"which the package's layer cannot hold.")


def _gating(spec: _Spec, top_k: Optional[int], renormalize: Optional[bool],
            activation: Optional[nn.Cell]) -> _Spec:
    cell, path = spec.cell, spec.path
    if top_k is None:
        top_k = next((getattr(cell, a) for a in TOP_K_ATTRIBUTES
                      if isinstance(getattr(cell, a, None), int)), None)
    if top_k is None:
        raise ValueError(f"adopt_moe: MoE block {path!r} has no int attribute among "
                         f"{list(TOP_K_ATTRIBUTES)}; pass adopt_moe(..., top_k=K).")
    if not 1 <= int(top_k) <= spec.num_experts:
        raise ValueError(f"adopt_moe: 'top_k' of {path!r} must be in [1, "
                         f"{spec.num_experts}], but got {top_k}.")
    if renormalize is None:
        renormalize = next((getattr(cell, a) for a in RENORMALIZE_ATTRIBUTES
                            if isinstance(getattr(cell, a, None), bool)), None)
    renorm = (True, False) if renormalize is None else (bool(renormalize),)
    acts = (activation,) if activation is not None else spec.activations + (
        make_gelu(), nn.GELU(approximate=False), nn.ReLU(), nn.SiLU())
    return dataclasses.replace(spec, top_k=int(top_k), renormalize=renorm, activations=acts)


def _layer(spec: _Spec, capacity: int, activation: nn.Cell, renormalize: bool,
           trace_ranks: int = 1, dispatch: str = "static") -> MoEFeedForward:
    return MoEFeedForward(spec.hidden, spec.ffn, spec.num_experts, spec.top_k, capacity,
                          trace_ranks, dispatch=dispatch, activation=activation,
                          renormalize=renormalize, has_bias=spec.has_bias, router=spec.router,
                          weights=spec.weights)


def _probe(spec: _Spec) -> Tuple[nn.Cell, bool, float]:
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
                     f"expert(x) (see ms_efficient.moe.adopt).")


def _package_layer(cell: nn.Cell) -> bool:
    from ms_efficient.mpipe.layer import PipelinedMoE

    return hasattr(cell, ROUTING_COUNTS) or isinstance(cell, (MoEMLP, PipelinedMoE))


def _blocks(network: nn.Cell) -> List[Tuple[str, nn.Cell]]:
    """(path, Cell) of every Cell that looks like a user's MoE block, outermost only."""
    found, skip = [], []
    for path, cell in network.cells_and_names():
        if any(path == s or path.startswith(s + ".") for s in skip):
            continue
        if _package_layer(cell):
            skip.append(path)
        elif _looks_like_moe(cell):
            found.append((path, cell))
            skip.append(path)
    return found


def find_moe_blocks(network: nn.Cell) -> List[str]:
    """Paths of the Cells of ``network`` that look like a user's own MoE block (what
    :func:`adopt_moe` would try to replace), without checking or changing anything."""
    return [p for p, _ in _blocks(network)]


def adopt_hint(network: nn.Cell) -> str:
    """A sentence for the error of a pass or callback that found no package MoE layer: where
    ``network`` has MoE blocks of its own and how to adopt them ("" when it has none)."""
    paths = find_moe_blocks(network)
    if not paths:
        return ""
    return (f" The network has MoE blocks of its own at {paths}: put the package's layer in "
            f"their place first with `network, report = ms_efficient.moe.adopt_moe(network, "
            f"tokens=B * S)`.")


def adopt_moe(network: nn.Cell, tokens: int, capacity_factor: float = 0.0,
              top_k: Optional[int] = None, renormalize: Optional[bool] = None,
              activation: Optional[nn.Cell] = None, aux_loss_coef: float = 0.0,
              trace_ranks: int = 1, dispatch: str = "static"
              ) -> Tuple[nn.Cell, Dict[str, AdoptedBlock]]:
    """Replace every MoE block of ``network`` (the contract: module doc) by the package's
    layer, in place; returns ``(network, {path: AdoptedBlock})``.

    Args:
        network: the user's Cell (a ``nn.WithLossCell`` around it works too).
        tokens: T = B * S tokens one forward of each block sees; sets the capacities.
        capacity_factor: slots per expert ceil(cf * T * k / E) (:func:`expert_capacity`);
            0 (default) is dropless: the adopted network computes what the original did.
        top_k, renormalize, activation: override the block's attributes / detection.
        aux_loss_coef: the load-balancing loss's weight in the gradients (see
            :class:`~ms_efficient.moe.dropin.MoEMLP`); 0 keeps the original's gradients.
        trace_ranks: R trace groups of the layers' routing counts (must divide T).
        dispatch: "static" (plannable capacities) or "grouped" (padding-free, dropless).

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
    if dispatch not in DISPATCH_MODES:
        raise ValueError(f"'dispatch' must be one of {list(DISPATCH_MODES)}, but got "
                         f"{dispatch!r}.")
    blocks = _blocks(network)
    if not blocks:
        raise ValueError(f"adopt_moe: found no MoE block in {type(network).__name__}: looked "
                         f"for Cells with stacked expert weights [E, H, F] / [E, F, H] or a "
                         f"list of Dense experts beside a router (see ms_efficient.moe.adopt).")
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
            stacked = sum(p.ndim == 3 for p in _direct_params(cell).values()) >= 2
            spec = (_stacked_spec if stacked else _list_spec)(path, cell)
            spec = _gating(spec, top_k, renormalize, activation)
            chosen.append((spec,) + _probe(spec))
        # Step 2: replace
        for spec, act, renorm, err in chosen:
            cap = expert_capacity(tokens, spec.num_experts, spec.top_k, capacity_factor)
            layer = _layer(spec, cap, act, renorm, trace_ranks, dispatch)
            replace_cell(network, spec.path, MoEMLP(layer=layer, aux_loss_coef=aux_loss_coef),
                         names)
            report[spec.path] = AdoptedBlock(
                spec.num_experts, spec.top_k, spec.hidden, spec.ffn, spec.layout, renorm,
                type(act).__name__, spec.has_bias, cap if dispatch == "static" else 0, err)
    finally:
        for p in params:               # building candidates renamed the reused Parameters
            p.name = names[id(p)]
    return network, report
