"""Apply a sharding plan to a MindSpore network: ``Primitive.shard`` strategies, strategy JSON.

Two plans apply here. A graph plan (the ``shard`` pass, ``plan shard GRAPH``) names the
network's own operators: :func:`apply_graph_plan` finds each one's primitive through the Cell
that owns its parameter. A template plan (``plan shard CONFIG``) names GPT templates:
the planner's operator templates (``dense.qkv``, ``moe.expert_fc1``, ...; see
:mod:`ms_efficient.shard.workloads`) are matched to the primitives of the reference
network :class:`ms_efficient.models.gpt_moe.GPTMoE` by cell path, and the planner's
per-dimension split factors are folded into each primitive's argument shapes (``nn.Dense``
multiplies ``[B*S, H]`` by a ``[out, in]`` weight, so ``x(b,s,h)`` factors ``(fb, fs, fh)``
become ``(fb*fs, fh)``). On CPU this sets ``prim.in_strategy`` (semi-auto parallel itself is
refused there); on Ascend ``ms_efficient.parallel.parallelize`` wraps the same network in
MindSpore's ``AutoParallel(net, parallel_mode="semi_auto")``, which reads those strategies.

Strategy JSON: MindSpore's strategy-checkpoint JSON, the format ``AutoParallel.
save_param_strategy_file`` writes and ``load_param_strategy_file`` reads (MindSpore 2.10,
``StrategyCheckpointInfo::to_json`` / ``from_json``)::

    {"current_stage": 1,
     "parallel_strategy_item": {"MatMul_fc1.weight": {"stage": 0, "parallel_strategy": [[2, 1], [1, 1]]}},
     "parallel_layout_item": {"fc1.weight": {"dev_matrix": [2, 4], "tensor_map": [0, -1],
                              "tensor_shape": [64, 32], "field": 0,
                              "opt_weight_shard_step": 0, "opt_weight_shard_size": 0}}}

An operator that reads a parameter is keyed ``<primitive name>_<first parameter name>`` as
MindSpore keys it; ``current_stage`` is 1 as in MindSpore's merged (all-stage) files, each item
carries its own pipeline stage. Layouts use the device matrix ``[dp, mp]`` (device r =
dp index * mp + mp index) and a flat tensor map counting its dims from the right (mp = 0,
dp = 1, -1 = not split), read from the plan's own record of which mesh axis splits each dim
(``in_axes``), so a dp = mp mesh cannot confuse them. Written from the plan, not read back
from a compiled Ascend graph.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ms_efficient.core.fileio import atomic_write_text
from ms_efficient.core.registry import PassRefused, register_pass
from ms_efficient.graph.cells import scope_path, user_cell_path

__all__ = ["apply_shard_plan", "OpRecord", "strategy_json", "write_strategy_json", "graph_records",
           "records_from_plan", "match_graph_plan", "apply_graph_plan", "check_strategy_ranks",
           "shard_pass"]

logger = logging.getLogger(__name__)

Factors = List[List[int]]


def _prod(xs: Sequence[int]) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


# template short name -> (cell attribute path inside a Block, primitive attribute, fold)
# fold: planner in_strategy (one factor list per planner input) -> MindSpore in_strategy
_FOLDS: Dict[str, Tuple[str, str, Callable[[Factors], Tuple[Tuple[int, ...], ...]]]] = {
    # x(b,s,h) . w(h,c,a,d) -> Dense: x [B*S, H], w [3H, H]
    "qkv": ("attn.qkv", "matmul", lambda f: ((f[0][0] * f[0][1], f[0][2]),
                                             (_prod(f[1][1:]), f[1][0]))),
    "scores": ("attn.bmm_qk", "", lambda f: (tuple(f[0]), tuple(f[1]))),
    "softmax": ("attn.softmax", "softmax", lambda f: (tuple(f[0]),)),
    "context": ("attn.bmm_pv", "", lambda f: (tuple(f[0]), tuple(f[1]))),
    # x(b,a,s,d) . w(a,d,h) -> Dense: x [B*S, H], w [H, H]
    "proj": ("attn.proj", "matmul", lambda f: ((f[0][0] * f[0][2], f[0][1] * f[0][3]),
                                               (f[1][2], f[1][0] * f[1][1]))),
    "ln1": ("ln1", "layer_norm", lambda f: tuple(tuple(x) for x in f)),
    "ln2": ("ln2", "layer_norm", lambda f: tuple(tuple(x) for x in f)),
    # x(b,s,h) . w(h,f) -> Dense: x [B*S, H], w [F, H]
    "fc1": ("ffn.fc1", "matmul", lambda f: ((f[0][0] * f[0][1], f[0][2]), (f[1][1], f[1][0]))),
    "fc2": ("ffn.fc2", "matmul", lambda f: ((f[0][0] * f[0][1], f[0][2]), (f[1][1], f[1][0]))),
    "router": ("ffn.router", "matmul", lambda f: ((f[0][0] * f[0][1], f[0][2]),
                                                  (f[1][1], f[1][0]))),
    # x(e,b,k,h) . w(e,h,f) -> BatchMatMul x [E, C, H], w [E, H, F]
    "expert_fc1": ("ffn.bmm", "", lambda f: ((f[0][0], f[0][1] * f[0][2], f[0][3]),
                                             tuple(f[1]))),
}


def _resolve(cell: Any, path: str, attr: str) -> Any:
    for part in path.split("."):
        cell = getattr(cell, part, None)
        if cell is None:
            return None
    return getattr(cell, attr, None) if attr else cell


def apply_shard_plan(network: Any, templates: Dict[str, Dict[str, Any]],
                     overrides: Optional[Dict[str, Dict[str, Any]]] = None) -> Dict[str, Tuple]:
    """Set ``shard()`` on the primitives of a :class:`GPTMoE`-like network from a plan.

    network: an ``nn.Cell`` with ``blocks`` (a CellList of Blocks).
    templates: ``{tie key: {"in_strategy": [[...], ...], ...}}``, the plan's ``templates``.
    overrides: ``{op name "L<i>.<op>": entry}``, the plan's ``overrides`` (layers whose tie
        class chose another strategy); they win over the template for block i.
    Returns ``{"blocks.<i>.<cell path>": in_strategy}`` of every primitive that was set.
    """
    blocks = getattr(network, "blocks", None)
    if blocks is None:
        raise ValueError(f"network {type(network).__name__} has no 'blocks'; apply_shard_plan "
                         f"knows the GPTMoE layout (blocks.<i>.attn/ffn/ln1/ln2).")
    applied: Dict[str, Tuple] = {}
    moe_index = set(getattr(network, "moe_index", ()))
    for i, block in enumerate(blocks):
        kind = "moe" if i in moe_index else "dense"
        for short, (path, attr, fold) in _FOLDS.items():
            entry = (overrides or {}).get(f"L{i}.{short}") or templates.get(f"{kind}.{short}")
            prim = _resolve(block, path, attr)
            if entry is None or prim is None:
                continue
            strategy = fold(entry["in_strategy"])
            prim.shard(strategy)
            applied[f"blocks.{i}.{path}"] = strategy
    logger.info("set shard() on %d primitives", len(applied))
    return applied


@dataclass
class OpRecord:
    """One primitive a plan set, as the strategy file describes it.

    prim: the primitive's name (``MatMul``); strategy: its ``in_strategy``, one tuple of split
    factors per input; params: ``(parameter name, input index, full shape)`` of the weights it
    reads (the first names the op in the file); axes: per input, per dim, the mesh axes
    (``"dp"``, ``"mp"``) splitting it, or None when the plan does not say; zero: the ZeRO
    level the plan chose for its parameters (0-3).
    """

    prim: str
    strategy: Tuple[Tuple[int, ...], ...]
    params: List[Tuple[str, int, Tuple[int, ...]]] = field(default_factory=list)
    axes: Optional[List[List[List[str]]]] = None
    zero: int = 0

    def key(self, fallback: str) -> str:
        """MindSpore's strategy-file key of an operator that reads a parameter:
        ``<primitive name>_<first parameter name>``; ``fallback`` for one that reads none."""
        return f"{self.prim}_{self.params[0][0]}" if self.params else fallback


def _layout(axes: Sequence[Sequence[str]], dp: int, mp: int) -> Tuple[List[int], List[int]]:
    """(dev_matrix, tensor_map) of a tensor whose dims are split by ``axes`` on the dp x mp
    mesh. The device matrix is ``[dp, mp]`` (device r = dp index * mp + mp index, as
    ``shard.strategies.Mesh`` numbers them) and tensor_map counts its dims from the right:
    mp = 0, dp = 1, -1 = not split. A dim split by both axes is split dp*mp ways in device
    order, which MindSpore's flat tensor map writes as ``dev_matrix [dp*mp]``, map 0."""
    if any(set(a) == {"dp", "mp"} for a in axes):
        return [dp * mp], [0 if a else -1 for a in axes]
    index = {"dp": 1, "mp": 0}
    return [dp, mp], [index[a[0]] if a else -1 for a in axes]


def _axes_from_factors(factors: Sequence[int], dp: int, mp: int) -> List[List[str]]:
    """Axes of each dim read from split factors alone, for plans without ``in_axes``; refuses
    a factor that could be either axis (dp == mp) rather than guess."""
    out: List[List[str]] = []
    for f in factors:
        if f == 1:
            out.append([])
        elif f == dp * mp and dp > 1 and mp > 1:
            out.append(["dp", "mp"])
        elif f == dp and f == mp:
            raise ValueError(f"a split factor {f} on a {dp}x{mp} mesh could be either axis; "
                             "the plan needs 'in_axes' (re-plan with this version).")
        elif f in (dp, mp):
            out.append(["dp"] if f == dp else ["mp"])
        else:
            raise ValueError(f"split factor {f} is neither dp={dp}, mp={mp} nor their product.")
    return out


def _opt_shard(axes: Sequence[Sequence[str]], zero: int, dp: int, mp: int) -> Tuple[int, int]:
    """(opt_weight_shard_size, opt_weight_shard_step) of a parameter: with ZeRO >= 1 its
    optimizer state is split over the devices holding the same slice (the mesh axes that do
    not split it: dp alone -> dp devices mp apart, mp alone -> mp adjacent devices, both ->
    every device); (0, 0) without ZeRO or without replicas."""
    used = {a for dim in axes for a in dim}
    size = (dp if "dp" not in used else 1) * (mp if "mp" not in used else 1)
    if not zero or size == 1:
        return 0, 0
    return size, (mp if used == {"mp"} else 1)


def strategy_json(ops: Dict[str, OpRecord], dp: int, mp: int,
                  stage_of: Optional[Dict[str, int]] = None) -> Dict[str, Any]:
    """MindSpore's strategy-checkpoint JSON of the applied strategies (module docstring).

    ops: ``{cell path.attribute: OpRecord}``; dp, mp: the mesh; stage_of: ``{same key:
    pipeline stage}`` (default stage 0). ``parallel_strategy_item`` is keyed as MindSpore
    keys it (``OpRecord.key``); ``parallel_layout_item`` has one entry per parameter with
    ``dev_matrix``, ``tensor_map``, ``tensor_shape``, ``field`` and the optimizer shard
    group (``opt_weight_shard_size`` / ``_step``), the fields MindSpore's reader requires.
    """
    items: Dict[str, Any] = {}
    layouts: Dict[str, Any] = {}
    for path, rec in sorted(ops.items()):
        items[rec.key(path)] = {"stage": int((stage_of or {}).get(path, 0)),
                                "parallel_strategy": [list(t) for t in rec.strategy]}
        for name, index, shape in rec.params:
            axes = (rec.axes[index] if rec.axes is not None
                    else _axes_from_factors(rec.strategy[index], dp, mp))
            dev_matrix, tensor_map = _layout(axes, dp, mp)
            size, step = _opt_shard(axes, rec.zero, dp, mp)
            layouts[name] = {"dev_matrix": dev_matrix, "tensor_map": tensor_map,
                             "tensor_shape": [int(d) for d in shape], "field": 0,
                             "opt_weight_shard_step": step, "opt_weight_shard_size": size}
    return {"current_stage": 1, "parallel_strategy_item": items,
            "parallel_layout_item": layouts}


class _Axes(tuple):
    """Mesh axes of one dim under the template folds: merging dims (``a * b``) unites them."""

    def __mul__(self, other):
        return _Axes(tuple(self) + tuple(other)) if isinstance(other, tuple) else self

    __rmul__ = __mul__


def _template_records(network: Any, applied: Dict[str, Tuple],
                      plan_doc: Dict[str, Any]) -> Dict[str, OpRecord]:
    """OpRecords of a template plan's primitives on ``network`` (``apply_shard_plan``'s
    result): the weights each reads and, folded like the strategies, their axes."""
    records: Dict[str, OpRecord] = {}
    entries = {**plan_doc.get("templates", {}), **plan_doc.get("overrides", {})}
    moe_index = set(getattr(network, "moe_index", ()))
    for path, strategy in applied.items():
        i, short = int(path.split(".")[1]), None
        for name, (cell_path, attr, fold) in _FOLDS.items():
            if path == f"blocks.{i}.{cell_path}":
                short, prim_attr, fold_fn = name, attr, fold
        kind = "moe" if i in moe_index else "dense"
        entry = entries.get(f"L{i}.{short}") or entries.get(f"{kind}.{short}") or {}
        prim = _resolve(network, path, prim_attr)   # attr "": the path names the primitive
        axes = None
        if entry.get("in_axes"):
            axes = [list(map(list, t)) for t in
                    fold_fn([[_Axes(a) for a in t] for t in entry["in_axes"]])]
        params = [(n, i_, tuple(getattr(p, "shape", ()))) for n, i_, p in
                  _param_uses(network, path)]
        records[path] = OpRecord(prim=getattr(prim, "name", short), strategy=strategy,
                                 params=params, axes=axes, zero=int(entry.get("zero", 0)))
    return records


def _param_uses(network: Any, path: str) -> List[Tuple[str, int, Any]]:
    """(parameter name, input index, Parameter) of the weights the primitive at ``path``
    reads: a Dense/LayerNorm's ``weight`` / ``gamma`` (input 1) and ``beta`` (input 2); the
    MoE experts' ``w1`` (``bmm(x, w1)``; w2 shares the primitive)."""
    if path.endswith(".bmm"):
        cell, names = _resolve(network, path.rsplit(".", 1)[0], ""), (("w1", 1),)
    else:
        cell, names = _resolve(network, path, ""), (("weight", 1), ("gamma", 1), ("beta", 2))
    return [(getattr(cell, n).name, i, getattr(cell, n)) for n, i in names if hasattr(cell, n)]


def write_strategy_json(path: str, network: Any, applied: Dict[str, Tuple],
                        plan_doc: Dict[str, Any]) -> None:
    """Write :func:`strategy_json` of a template plan on ``network`` atomically."""
    doc = strategy_json(_template_records(network, applied, plan_doc),
                        plan_doc["mesh"]["dp"], plan_doc["mesh"]["mp"])
    atomic_write_text(path, json.dumps(doc, indent=1) + "\n")


def graph_records(network: Any, applied: Dict[str, Tuple], doc: Dict[str, Any],
                  op_of: Dict[str, str]) -> Dict[str, OpRecord]:
    """OpRecords of a graph plan's primitives: ``op_of`` maps each applied key to the plan
    operator it came from (``apply_graph_plan``); shapes from the network's Parameters."""
    shapes = {p.name: tuple(p.shape) for p in network.get_parameters()}
    out: Dict[str, OpRecord] = {}
    for key, strategy in applied.items():
        entry = doc["operators"][op_of[key]]
        params = [(name, int(i), shapes.get(name, ())) for i, name in entry["params"]]
        out[key] = OpRecord(prim=entry["prim"], strategy=strategy, params=params,
                            axes=entry.get("in_axes"), zero=int(entry.get("zero", 0)))
    return out


def records_from_plan(doc: Dict[str, Any]) -> Dict[str, OpRecord]:
    """The OpRecords a shard pass plan carries (its ``applied`` section)."""
    return {key: OpRecord(prim=r["prim"], strategy=tuple(tuple(t) for t in r["strategy"]),
                          params=[(n, int(i), tuple(s)) for n, i, s in r["params"]],
                          axes=r.get("axes"), zero=int(r.get("zero", 0)))
            for key, r in doc.get("applied", {}).items()}


def apply_graph_plan(network: Any, doc: Dict[str, Any]
                     ) -> Tuple[Dict[str, Tuple], Dict[str, str]]:
    """Set ``shard()`` on the user's primitives from a graph plan (``graph_plan_to_dict``):
    those :func:`match_graph_plan` finds. Returns ``({"<cell path>.<attribute>":
    in_strategy}, {same key: the plan operator's name})``."""
    found, op_of = match_graph_plan(network, doc)
    for prim, strategy in found.values():
        prim.shard(strategy)
    return {key: strategy for key, (_, strategy) in found.items()}, op_of


def match_graph_plan(network: Any, doc: Dict[str, Any]
                     ) -> Tuple[Dict[str, Tuple[Any, Tuple]], Dict[str, str]]:
    """The user's primitives a graph plan (``graph_plan_to_dict``) sets, and their strategies;
    sets nothing.

    An operator is matched to a primitive through the parameters it reads: the Cell that owns
    the parameter (by ``parameters_and_names(expand=False)``) and, in it, the one primitive
    attribute of the operator's type (``nn.Dense.matmul``, ``nn.Embedding.gather``). Operators
    without parameters, or whose Cell holds several primitives of that type, are left to
    MindSpore's sharding propagation (their strategies are in the plan). Returns
    ``({"<cell path>.<attribute>": (primitive, in_strategy)}, {same key: the plan operator's
    name})``.
    """
    holders: Dict[str, List[Tuple[str, Any]]] = {}      # a tied parameter has several
    for path, cell in network.cells_and_names():
        if path and not user_cell_path(path):         # MindSpore's recompute wrappers
            continue
        for _, p in cell.parameters_and_names(expand=False):
            holders.setdefault(p.name, []).append((path, cell))
    applied: Dict[str, Tuple[Any, Tuple]] = {}
    op_of: Dict[str, str] = {}
    for op_name, entry in doc["operators"].items():
        if not entry["params"]:
            continue
        index, name = entry["params"][0]
        found = []
        for path, cell in holders.get(name, []):
            prims = [(attr, prim) for attr, prim in getattr(cell, "_primitives", {}).items()
                     if prim is not None and getattr(prim, "name", None) == entry["prim"]]
            if len(prims) == 1:
                found.append((path, prims[0]))
        if len(found) > 1:       # a tied parameter: the holder the operator's scope names
            scope = scope_path(op_name)
            found = [f for f in found if scope == f[0] or scope.endswith("." + f[0])]
        if len(found) != 1:
            continue
        path, (attr, prim) = found[0]
        strategy = tuple(tuple(int(f) for f in t) for t in entry["in_strategy"])
        key = f"{path}.{attr}" if path else attr
        if key in applied:
            if applied[key][1] != strategy:
                logger.warning("shard: %s is called with two strategies; keeping the first",
                               key)
            continue
        applied[key] = (prim, strategy)
        op_of[key] = op_name
    return applied, op_of


def check_strategy_ranks(graph: Any, found: Dict[str, Tuple[Any, Tuple]],
                         op_of: Dict[str, str]) -> None:
    """ValueError naming the primitive, its strategy and the operator's input shapes when a
    strategy does not have one entry per tensor input and one factor per input dimension of
    the graph operator it was planned for (the operator the compiled graph runs: nn.Embedding
    flattens its ids, so its Gather takes 1-D indices whatever the ids' rank). Operators
    whose input shapes the graph does not know are not checked."""
    for key, (_, strategy) in found.items():
        node = graph[op_of[key]] if op_of[key] in graph else None
        shapes = [tuple(s) for s in getattr(node, "input_shapes", None) or []]
        if not shapes:
            continue
        ranks = [len(s) for s in shapes]
        if [len(t) for t in strategy] != ranks:
            raise ValueError(
                f"shard: the strategy {[list(t) for t in strategy]} planned for '{key}' "
                f"({node.op_type} '{node.name}') has {[len(t) for t in strategy]} factors per "
                f"input, but its inputs {shapes} have ranks {ranks}: a strategy needs one "
                f"entry per input and one factor per input dimension.")


@register_pass("shard")
def shard_pass(network: Any, context: Any) -> Tuple[Any, Dict[str, Any]]:
    """Pass: the mesh and the strategies of the network's own train-step graph, chosen
    together (``shard.mesh_search``): every dp x mp factorisation of the cluster's devices
    (or ``optimize.shard_mesh``), the minimal-memory ILP within ``optimize.shard_comm_ratio``
    x ZeRO-1's communication on that mesh (half the unoptimised simulated step where ZeRO-1
    cannot run), never more memory per device than the best baseline within that budget.
    Sets ``shard()`` on the primitives it can name and writes the strategy JSON to
    ``optimize.shard_strategy_file`` when set. Raises PassRefused (a ValueError; ``optimize``
    records it as ``{"refused": reason}``), setting nothing, when no primitive of the network
    takes a strategy or when every strategy it would set is all ones (the plan splits no
    dimension of any operator: each device would run the whole network, as without the
    pass); ValueError when ``optimize.shard_mesh`` needs more devices than the cluster.
    After the place pass, the meshes are those of one stage's devices (the cluster's divided
    by place's stages x copies); PassRefused when that leaves fewer than 2."""
    from ms_efficient.shard.mesh_search import mesh_factorisations, plan_graph_doc
    from ms_efficient.shard.strategies import parse_mesh

    config = context.config
    cluster = config.cluster_spec()
    opt = config.optimize
    meshes = None
    if opt.shard_mesh:
        mesh = parse_mesh(opt.shard_mesh, dp_model_split=False)
        if mesh.devices > cluster.num_devices:
            raise ValueError(f"'optimize.shard_mesh' {opt.shard_mesh!r} needs {mesh.devices} "
                             f"devices; cluster {cluster.name!r} has {cluster.num_devices}.")
        meshes = [mesh]
    place = context.plans.get("place")
    if place is not None:      # after place: a mesh runs one stage of one pipeline copy
        held = len(place["stages"]) * int(place.get("dp", 1))
        per_stage = cluster.num_devices // held
        if per_stage < 2:
            copies = int(place.get("dp", 1))
            raise PassRefused(
                f"shard: place's pipeline ({len(place['stages'])} stages x {copies} "
                f"{'copy' if copies == 1 else 'copies'}) holds {held} of the "
                f"{cluster.num_devices} devices of {cluster.name!r}, one per stage: no room "
                f"for a mesh of 2. Run "
                f"shard before place (place then plans its stages on shard's meshes).")
        if meshes is None:
            meshes = mesh_factorisations(per_stage)
        elif meshes[0].devices > per_stage:
            raise ValueError(f"'optimize.shard_mesh' {opt.shard_mesh!r} needs "
                             f"{meshes[0].devices} devices; after place's pipeline a stage "
                             f"has {per_stage} of the cluster's {cluster.num_devices}.")
    graph = context.graph("the shard pass")
    price = context.unoptimised("the shard pass")
    doc = plan_graph_doc(graph, cluster, price.step_time_s, float(opt.shard_comm_ratio), meshes)
    doc["unoptimised"] = price.to_dict()
    found, op_of = match_graph_plan(network, doc)
    check_strategy_ranks(graph, found, op_of)
    if not found:
        raise PassRefused(f"shard: no primitive of {type(network).__name__} takes a strategy "
                          f"from the plan (looked for operators with parameters whose Cell "
                          f"holds one primitive of their type, e.g. nn.Dense.matmul); "
                          f"nothing to set.")
    if all(f == 1 for _, strategy in found.values() for t in strategy for f in t):
        dp, mp = doc["mesh"]["dp"], doc["mesh"]["mp"]
        keys = sorted(found)
        raise PassRefused(
            f"shard: the plan on the {dp}x{mp} mesh splits no dimension: all {len(found)} "
            f"strategies it would set ({keys[0]} {[list(t) for t in found[keys[0]][1]]}"
            f"{', ...' if len(keys) > 1 else ''}) are all ones, so every device would run "
            f"the whole network, as without the pass; nothing to set.")
    for prim, st in found.values():
        prim.shard(st)
    applied = {key: st for key, (_, st) in found.items()}
    records = graph_records(network, applied, doc, op_of)
    strategy = strategy_json(records, doc["mesh"]["dp"], doc["mesh"]["mp"])
    if opt.shard_strategy_file:
        atomic_write_text(opt.shard_strategy_file, json.dumps(strategy, indent=1) + "\n")
    cells: Dict[str, Dict[str, Any]] = {}
    for key, st in applied.items():
        path, _, attr = key.rpartition(".")
        cells.setdefault(path, {}).setdefault("shard", {})[attr] = [list(t) for t in st]
    doc["cells"] = cells
    doc["strategy_json"] = strategy
    doc["applied"] = {key: {"prim": r.prim, "strategy": [list(t) for t in r.strategy],
                            "params": [[n, i, list(sh)] for n, i, sh in r.params],
                            "axes": r.axes, "zero": r.zero} for key, r in records.items()}
    logger.info("shard: set %d primitives on mesh %dx%d", len(applied), doc["mesh"]["dp"],
                doc["mesh"]["mp"])
    return network, doc
