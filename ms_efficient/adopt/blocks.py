"""A user's MoE block, recognised: the contract of :mod:`ms_efficient.adopt` as code.

:func:`moe_blocks` finds the Cells that look like an MoE block, :func:`block_spec` checks one
against the contract and returns its :class:`BlockSpec` (sizes, router, the block's own
Parameters in the layer's ``weights`` format, activation candidates), or raises a ValueError
naming the block's path and the shape expected; :func:`with_gating` adds top-k and the
renormalisation choices. Nothing here changes the network.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

from mindspore import Parameter, nn, ops

from ms_efficient.moe.experts import make_gelu
from ms_efficient.moe.dropin import MoEMLP
from ms_efficient.moe.layer import ROUTING_COUNTS
from ms_efficient.moe.routing import RouterConfig

__all__ = ["BlockSpec", "ParameterRouter", "block_spec", "moe_blocks", "find_moe_blocks",
           "with_gating", "TOP_K_ATTRIBUTES", "RENORMALIZE_ATTRIBUTES"]

TOP_K_ATTRIBUTES = ("top_k", "num_experts_per_tok", "topk", "k")
RENORMALIZE_ATTRIBUTES = ("norm_topk_prob", "renormalize")
# a gated expert's three Dense, by the names public MoE code gives them (Mixtral / MindFormers:
# w1 gate, w3 up, w2 down; DeepSeek / Qwen-MoE: gate_proj, up_proj, down_proj)
GATE_NAMES, UP_NAMES = ("w1", "gate_proj"), ("w3", "up_proj")
DOWN_NAMES = ("w2", "down_proj")
# shared experts beside the routed ones (DeepSeek: shared_experts; Qwen-MoE: shared_expert,
# scaled by sigmoid(shared_expert_gate(x)))
SHARED_NAMES, SHARED_GATE_NAMES = ("shared_experts", "shared_expert"), ("shared_expert_gate",)
# the routing attributes of DeepSeek-V2/V3-style gates (on the gate Cell or the block)
BIAS_NAMES = ("e_score_correction_bias", "expert_bias")


class GatedShared(nn.Cell):
    """A user's shared expert scaled per token by sigmoid(gate(x)) (Qwen-MoE): both Cells are
    the user's own, so their Parameters and names stay."""

    def __init__(self, expert: nn.Cell, gate: nn.Cell):
        super().__init__(auto_prefix=False)
        self.expert = expert
        self.gate = gate
        self.sigmoid = nn.Sigmoid()

    def construct(self, x):
        return self.sigmoid(self.gate(x)) * self.expert(x)


class ParameterRouter(nn.Cell):
    """Router logits from a user's Parameter [E, H]: ``construct(x_TH) -> x_TH @ w^T``."""

    def __init__(self, weight: Parameter):
        super().__init__()
        self.weight = weight
        self.matmul = ops.MatMul(transpose_b=True)

    def construct(self, x):
        return self.matmul(x, self.weight)


@dataclasses.dataclass
class BlockSpec:
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
    expert_kind: str = "mlp"     # "glu": gated experts, ``weights``' w1/b1 their gate
    up: Optional[tuple] = None   # (w3, b3): a gated expert's up projection, when apart
    shared: Optional[nn.Cell] = None           # the user's shared expert(s), added
    gate_cell: Optional[nn.Cell] = None        # a gate Cell holding the router's weight
    expert_bias: Optional[Parameter] = None    # its auxiliary-loss-free balancing bias
    router_config: Optional[RouterConfig] = None


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
    for name, child in cell.name_cells().items():       # a gate Cell (DeepSeek's MoEGate)
        if isinstance(child, nn.Dense) or not ("router" in name.lower()
                                               or name.lower() == "gate"):
            continue
        weights = [p for p in _direct_params(child).values() if p.ndim == 2
                   and (e is None or p.shape[0] == e) and (h is None or p.shape[1] == h)]
        if len(weights) == 1:
            found.append((ParameterRouter(weights[0]), name, weights[0].shape[0],
                          weights[0].shape[1]))
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
        (isinstance(c, nn.Dense) and c.out_channels == e)
        or (n.lower() in ("gate", "router")
            and any(p.ndim == 2 and p.shape[0] == e for p in _direct_params(c).values()))
        for n, c in cell.name_cells().items())


def _stacked_spec(path: str, cell: nn.Cell) -> BlockSpec:
    params = _direct_params(cell)
    stacked = [(n, p) for n, p in params.items() if p.ndim == 3]
    shapes = {n: tuple(p.shape) for n, p in stacked}
    if len(stacked) == 3:
        return _stacked_gated_spec(path, cell, params, stacked)
    if len(stacked) != 2 or stacked[0][1].shape[0] != stacked[1][1].shape[0] \
            or tuple(stacked[0][1].shape[1:]) != tuple(stacked[1][1].shape[:0:-1]):
        raise ValueError(f"adopt_moe: MoE block {path!r} ({type(cell).__name__}) needs two "
                         f"stacked expert weights [E, H, F] and [E, F, H], or three for gated "
                         f"experts (gate and up [E, H, F], down [E, F, H]); found {shapes}.")
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
    return _block_spec(path, cell, router, router_name, (e, h, f), (w1, b1, w2, b2), None,
                       "stacked")


def _stacked_gated_spec(path: str, cell: nn.Cell, params: Dict[str, Parameter],
                        stacked: List[Tuple[str, Parameter]]) -> BlockSpec:
    """Gated experts as three stacked weights (MindFormers' and Mixtral ports' layout):
    gate and up [E, H, F], down [E, F, H], without biases. Roles by name (``GATE_NAMES``,
    ``UP_NAMES``, ``DOWN_NAMES``), else by shape: down is the one [E, F, H] when H != F,
    gate and up the other two in registration order."""
    names = [n for n, _ in stacked]
    shapes = {n: tuple(p.shape) for n, p in stacked}
    by_name = [next((i for i, n in enumerate(names) if n in group), None)
               for group in (GATE_NAMES, UP_NAMES, DOWN_NAMES)]
    if None in by_name or len(set(by_name)) != 3:
        outer = [tuple(p.shape[1:]) for _, p in stacked]
        pairs = [s for s in set(outer) if outer.count(s) == 2]
        single = [i for i, s in enumerate(outer) if s not in pairs]
        if len(pairs) != 1 or len(single) != 1 or pairs[0] != outer[single[0]][::-1]:
            raise ValueError(f"adopt_moe: MoE block {path!r}: three stacked expert weights "
                             f"are gated experts: gate and up [E, H, F] and down [E, F, H], "
                             f"named {list(GATE_NAMES)}, {list(UP_NAMES)} and "
                             f"{list(DOWN_NAMES)} when H == F; found {shapes}.")
        gate, up = (i for i in range(3) if i != single[0])
        by_name = [gate, up, single[0]]
    (ng, wg), (nu, wu), (nd, wd) = (stacked[i] for i in by_name)
    e, h, f = (int(d) for d in wg.shape)
    if tuple(wu.shape) != (e, h, f) or tuple(wd.shape) != (e, f, h):
        raise ValueError(f"adopt_moe: MoE block {path!r}: gated expert weights {shapes} need "
                         f"gate {ng!r} and up {nu!r} [E, H, F] and down {nd!r} [E, F, H] "
                         f"alike.")
    router, router_name, _, _ = _router(path, cell, params, e, h)
    rest = {n: tuple(p.shape) for n, p in params.items() if n not in (ng, nu, nd, router_name)}
    if rest:
        raise ValueError(f"adopt_moe: MoE block {path!r}: Parameters {rest} are not part of "
                         f"the contract (stacked gated experts have no biases here).")
    return _block_spec(path, cell, router, router_name, (e, h, f), (wg, None, wd, None),
                       (wu, None), "stacked")


def _block_spec(path, cell, router, router_name, sizes, weights, up, layout,
                experts_name=None, expert_acts=()) -> BlockSpec:
    """The BlockSpec of a recognised block (``layout`` "stacked" or "list", the experts'
    CellList ``experts_name``; ``sizes`` (E, H, F); ``up`` the gated experts' up projection,
    None for two-matrix experts), with its shared expert, its gate Cell and that gate's
    selection bias; any other sub-Cell with Parameters is refused."""
    e, h, f = sizes
    shared = _shared(path, cell)
    own = (router_name,) + ((experts_name,) if experts_name else ())
    _check_children(path, cell, own + SHARED_NAMES + SHARED_GATE_NAMES)
    gate_cell = cell.name_cells().get(router_name)
    gate_cell = gate_cell if gate_cell is not None and not isinstance(gate_cell, nn.Dense) \
        else None
    return BlockSpec(path, cell, e, h, f, router, weights, weights[1] is not None, layout,
                     None, (), tuple(expert_acts) + tuple(_activation_cells(cell)),
                     expert_kind="mlp" if up is None else "glu", up=up, shared=shared,
                     gate_cell=gate_cell, expert_bias=_expert_bias(gate_cell, cell, e))


def _gated_roles(path: str, names: List[str], dense: List[nn.Dense]):
    """(gate, up, down) of a gated expert's three Dense. By name first (``GATE_NAMES``,
    ``UP_NAMES``, ``DOWN_NAMES``); else by shape: H is the input width two of them share and
    down the third (F -> H), the gate and up in registration order."""
    short = [n.split(".")[-1] for n in names]
    by_name = [next((i for i in range(3) if short[i] in group), None)
               for group in (GATE_NAMES, UP_NAMES, DOWN_NAMES)]
    if None not in by_name and len(set(by_name)) == 3:
        return tuple(dense[i] for i in by_name)
    ins = [d.in_channels for d in dense]
    hidden = [h for h in set(ins) if ins.count(h) == 2]
    if len(hidden) != 1:
        raise ValueError(f"adopt_moe: gated expert {path} needs two nn.Dense H -> F (gate, up) "
                         f"and one F -> H (down), named {list(GATE_NAMES)}, {list(UP_NAMES)} "
                         f"and {list(DOWN_NAMES)} when H == F; found "
                         f"{[(n, d.in_channels, d.out_channels) for n, d in zip(short, dense)]}.")
    gate, up = (i for i in range(3) if ins[i] == hidden[0])
    down = next(i for i in range(3) if ins[i] != hidden[0])
    return dense[gate], dense[up], dense[down]


def _list_spec(path: str, cell: nn.Cell) -> BlockSpec:
    list_name, experts = _expert_list(cell)
    e = len(experts)
    roles, acts = [], []
    for i, expert in enumerate(experts):
        named = [(n, c) for n, c in expert.cells_and_names() if isinstance(c, nn.Dense)]
        dense = [c for _, c in named]
        dense_params = {id(p) for d in dense for p in d.get_parameters()}
        extra = [p.name for p in expert.get_parameters() if id(p) not in dense_params]
        if len(dense) == 3 and not extra:
            gate, up, down = _gated_roles(f"{path}.{list_name}.{i}", [n for n, _ in named],
                                          dense)
            ok = (gate.in_channels == up.in_channels == down.out_channels
                  and gate.out_channels == up.out_channels == down.in_channels
                  and gate.has_bias == up.has_bias == down.has_bias
                  and not (up.activation_flag or down.activation_flag))
            role = (gate, up, down)
        else:
            ok = len(dense) == 2 and not extra \
                and dense[0].out_channels == dense[1].in_channels \
                and dense[0].in_channels == dense[1].out_channels \
                and dense[0].has_bias == dense[1].has_bias and not dense[1].activation_flag
            role = (dense[0], None, dense[-1]) if dense else ()
        if not ok:
            raise ValueError(f"adopt_moe: expert {path}.{list_name}.{i} needs two nn.Dense, "
                             f"H -> F then F -> H, or three for a gated expert (gate and up "
                             f"H -> F, down F -> H), biases on all or none, no activation on "
                             f"the up or down projection, and no other Parameters; found "
                             f"{[(d.in_channels, d.out_channels) for d in dense]}"
                             f"{' and ' + str(extra) if extra else ''}.")
        roles.append(role)
        if i == 0:
            acts = ([role[0].activation] if role[0].activation_flag else []) + \
                _activation_cells(expert)
    gated = roles[0][1] is not None
    first = roles[0][0]
    h, f = first.in_channels, first.out_channels
    if any(len(r) != 3 or (r[1] is not None) != gated
           or (r[0].in_channels, r[0].out_channels, r[0].has_bias) != (h, f, first.has_bias)
           for r in roles):
        raise ValueError(f"adopt_moe: the experts of {path!r} differ in kind, shape or bias; "
                         f"every expert must be Dense {h} -> {f} -> {h} alike"
                         f"{' (gated)' if gated else ''}.")
    router, router_name, _, _ = _router(path, cell, _direct_params(cell), e, h)
    extra = {n: tuple(p.shape) for n, p in _direct_params(cell).items() if n != router_name}
    if extra:
        raise ValueError(f"adopt_moe: MoE block {path!r}: Parameters {extra} are not part of "
                         f"the contract (a router, and experts in {list_name!r}).")
    bias = bool(first.has_bias)
    weights = (tuple(r[0].weight for r in roles),
               tuple(r[0].bias for r in roles) if bias else None,
               tuple(r[2].weight for r in roles),
               tuple(r[2].bias for r in roles) if bias else None)
    up = ((tuple(r[1].weight for r in roles), tuple(r[1].bias for r in roles) if bias else None)
          if gated else None)
    return _block_spec(path, cell, router, router_name, (e, h, f), weights, up, "list",
                       list_name, acts)


def _shared(path: str, cell: nn.Cell) -> Optional[nn.Cell]:
    """The block's shared expert Cell (``SHARED_NAMES``), scaled by its sigmoid gate
    (``SHARED_GATE_NAMES``, Dense H -> 1) when it has one; None without one."""
    children = cell.name_cells()
    expert = next((children[n] for n in SHARED_NAMES if n in children), None)
    gate = next((children[n] for n in SHARED_GATE_NAMES if n in children), None)
    if gate is not None and (expert is None or not isinstance(gate, nn.Dense)
                             or gate.out_channels != 1):
        raise ValueError(f"adopt_moe: MoE block {path!r}: a shared expert gate must be an "
                         f"nn.Dense H -> 1 beside a shared expert named one of "
                         f"{list(SHARED_NAMES)}.")
    if expert is None:
        return None
    return GatedShared(expert, gate) if gate is not None else expert


def _expert_bias(gate_cell: Optional[nn.Cell], cell: nn.Cell, e: int) -> Optional[Parameter]:
    """A DeepSeek-V3 gate's non-trainable selection bias [E] (``BIAS_NAMES``), or None."""
    for owner in (gate_cell, cell):
        if owner is None:
            continue
        for name, p in _direct_params(owner).items():
            if name in BIAS_NAMES and tuple(p.shape) == (e,):
                return p
    return None


def _check_children(path: str, cell: nn.Cell, allowed: Tuple[str, ...]) -> None:
    other = [n for n, c in cell.name_cells().items() if n not in allowed and _own_params(c)]
    if other:
        raise ValueError(f"adopt_moe: MoE block {path!r} has sub-Cells with Parameters "
                         f"{other} besides its router and experts (e.g. a shared expert), "
                         f"which the package's layer cannot hold.")


def _attribute(spec: BlockSpec, names, kind):
    """The first attribute among ``names`` of type ``kind`` on the block, then on its gate
    Cell; None when neither has one."""
    for owner in (spec.cell, spec.gate_cell):
        for name in names:
            value = getattr(owner, name, None) if owner is not None else None
            if isinstance(value, kind) and not (kind is not bool and isinstance(value, bool)):
                return value
    return None


def _router_config(spec: BlockSpec, bias_update_speed: float) -> Optional[RouterConfig]:
    """The RouterConfig of a DeepSeek-style gate, from its attributes (``scoring_func``,
    ``n_group``, ``topk_group``, ``topk_method``, ``routed_scaling_factor``) and its bias;
    None for a plain softmax router (renormalisation is probed)."""
    score = _attribute(spec, ("scoring_func", "score_func"), str) or "softmax"
    groups = _attribute(spec, ("n_group", "num_groups"), int) or 1
    kept = _attribute(spec, ("topk_group", "topk_groups"), int) or groups
    factor = _attribute(spec, ("routed_scaling_factor", "scaling_factor"), (int, float)) or 1.0
    method = _attribute(spec, ("topk_method",), str) or ""
    if score == "softmax" and groups == 1 and float(factor) == 1.0 and spec.expert_bias is None:
        return None
    try:
        return RouterConfig(score=score, scaling_factor=float(factor), num_groups=groups,
                            topk_groups=kept,
                            group_score="max" if method == "group_limited_greedy" else "top2-sum",
                            bias_update_speed=(bias_update_speed if spec.expert_bias is not None
                                               else 0.0))
    except ValueError as err:
        raise ValueError(f"adopt_moe: the router of MoE block {spec.path!r}: {err}") from None


def with_gating(spec: BlockSpec, top_k: Optional[int], renormalize: Optional[bool],
                activation: Optional[nn.Cell], bias_update_speed: float = 1e-3) -> BlockSpec:
    """``spec`` with its top-k (``top_k`` or the block's attribute), the renormalisation
    choices to probe (``renormalize``, the block's attribute, else both) and the activation
    candidates (``activation``, else the block's own activation Cells, then tanh GELU, erf
    GELU, ReLU, SiLU)."""
    cell, path = spec.cell, spec.path
    if top_k is None:
        top_k = _attribute(spec, TOP_K_ATTRIBUTES, int)
    if top_k is None:
        raise ValueError(f"adopt_moe: MoE block {path!r} has no int attribute among "
                         f"{list(TOP_K_ATTRIBUTES)}; pass adopt_moe(..., top_k=K).")
    if not 1 <= int(top_k) <= spec.num_experts:
        raise ValueError(f"adopt_moe: 'top_k' of {path!r} must be in [1, "
                         f"{spec.num_experts}], but got {top_k}.")
    if renormalize is None:
        renormalize = _attribute(spec, RENORMALIZE_ATTRIBUTES, bool)
    renorm = (True, False) if renormalize is None else (bool(renormalize),)
    defaults = (nn.SiLU(), make_gelu(), nn.GELU(approximate=False), nn.ReLU()) \
        if spec.expert_kind == "glu" else (make_gelu(), nn.GELU(approximate=False), nn.ReLU(),
                                           nn.SiLU())
    acts = (activation,) if activation is not None else spec.activations + defaults
    config = _router_config(spec, bias_update_speed)
    if config is not None:
        config.check(spec.num_experts, int(top_k))
    return dataclasses.replace(spec, top_k=int(top_k), renormalize=renorm, activations=acts,
                               router_config=config)


def _package_layer(cell: nn.Cell) -> bool:
    from ms_efficient.mpipe.layer import PipelinedMoE

    return hasattr(cell, ROUTING_COUNTS) or isinstance(cell, (MoEMLP, PipelinedMoE))


def moe_blocks(network: nn.Cell) -> List[Tuple[str, nn.Cell]]:
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
    return [p for p, _ in moe_blocks(network)]


def block_spec(path: str, cell: nn.Cell) -> BlockSpec:
    """The BlockSpec of the MoE block ``cell`` at ``path`` (stacked experts when it has two
    or more direct 3-D Parameters, else a list of Dense experts); ValueError when it breaks
    the contract."""
    stacked = sum(p.ndim == 3 for p in _direct_params(cell).values()) >= 2
    return (_stacked_spec if stacked else _list_spec)(path, cell)
