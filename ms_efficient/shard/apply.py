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
refused there, see MINDSPORE_CPU.md); on Ascend the same network runs under
``set_auto_parallel_context(parallel_mode="semi_auto_parallel")``.

Strategy JSON: the fields of MindSpore's strategy-checkpoint JSON
(``{"current_stage", "parallel_strategy_item": {op: {"stage", "parallel_strategy"}},
"parallel_layout_item": {param: {"dev_matrix", "tensor_map", "opt_weight_shard_size", ...}}}``),
with device matrix ``[dp, mp]`` (tensor_map counts device-matrix dims from the right: mp = 0,
dp = 1, -1 = not split). Written from the plan, not read back from a compiled Ascend graph.
"""
from __future__ import annotations

import json
import logging
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ms_efficient.core.fileio import atomic_write_text
from ms_efficient.core.registry import register_pass
from ms_efficient.graph.cells import scope_path, user_cell_path

__all__ = ["apply_shard_plan", "strategy_json", "write_strategy_json", "shard_pass"]

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


def _tensor_map(factors: Sequence[int], dp: int, mp: int) -> List[Any]:
    out: List[Any] = []
    for f in factors:
        if f == 1:
            out.append(-1)
        elif f == dp * mp and dp > 1 and mp > 1:
            out.append([1, 0])
        elif f == mp:
            out.append(0)
        else:
            out.append(1)
    return out


def strategy_json(applied: Dict[str, Tuple], plan_doc: Dict[str, Any],
                  param_names: Optional[Dict[str, List[Tuple[str, int]]]] = None) -> Dict[str, Any]:
    """The strategy-checkpoint-shaped JSON of applied strategies (see module docstring).

    param_names: ``{cell path: [(parameter name, input index), ...]}`` to emit layout items.
    """
    dp, mp = plan_doc["mesh"]["dp"], plan_doc["mesh"]["mp"]
    items = {path: {"stage": 0, "parallel_strategy": [list(t) for t in st]}
             for path, st in sorted(applied.items())}
    layouts: Dict[str, Any] = {}
    for path, params in sorted((param_names or {}).items()):
        if path not in applied:
            continue
        for name, index in params:
            layouts[name] = {"dev_matrix": [dp, mp],
                             "tensor_map": _tensor_map(applied[path][index], dp, mp),
                             "field": 0, "opt_weight_shard_size": 0,
                             "opt_weight_shard_step": 0}
    return {"current_stage": 1, "parallel_strategy_item": items, "parallel_layout_item": layouts}


def _param_names(network: Any, applied: Dict[str, Tuple]) -> Dict[str, List[Tuple[str, int]]]:
    """``{cell path: [(parameter name, input index)]}`` of the weights the primitives read."""
    out: Dict[str, List[Tuple[str, int]]] = {}
    for path in applied:
        if path.endswith(".bmm"):            # MoE experts: bmm(x, w1) (w2 shares the primitive)
            cell, names = _resolve(network, path.rsplit(".", 1)[0], ""), (("w1", 1),)
        else:
            cell, names = _resolve(network, path, ""), (("weight", 1), ("gamma", 1), ("beta", 2))
        found = [(getattr(cell, n).name, i) for n, i in names if hasattr(cell, n)]
        if found:
            out[path] = found
    return out


def write_strategy_json(path: str, network: Any, applied: Dict[str, Tuple],
                        plan_doc: Dict[str, Any]) -> None:
    """Write :func:`strategy_json` for ``network`` atomically."""
    doc = strategy_json(applied, plan_doc, _param_names(network, applied))
    atomic_write_text(path, json.dumps(doc, indent=1) + "\n")


def apply_graph_plan(network: Any, doc: Dict[str, Any]
                     ) -> Tuple[Dict[str, Tuple], Dict[str, List[Tuple[str, int]]]]:
    """Set ``shard()`` on the user's primitives from a graph plan (``graph_plan_to_dict``).

    An operator is matched to a primitive through the parameters it reads: the Cell that owns
    the parameter (by ``parameters_and_names(expand=False)``) and, in it, the one primitive
    attribute of the operator's type (``nn.Dense.matmul``, ``nn.Embedding.gather``). Operators
    without parameters, or whose Cell holds several primitives of that type, are left to
    MindSpore's sharding propagation (their strategies are in the plan). Returns
    ``({"<cell path>.<attribute>": in_strategy}, {same key: [(parameter name, input index)]})``.
    """
    holders: Dict[str, List[Tuple[str, Any]]] = {}      # a tied parameter has several
    for path, cell in network.cells_and_names():
        if path and not user_cell_path(path):         # MindSpore's recompute wrappers
            continue
        for _, p in cell.parameters_and_names(expand=False):
            holders.setdefault(p.name, []).append((path, cell))
    applied: Dict[str, Tuple] = {}
    params: Dict[str, List[Tuple[str, int]]] = {}
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
        if key in applied and applied[key] != strategy:
            logger.warning("shard: %s is called with two strategies; keeping the first", key)
            continue
        prim.shard(strategy)
        applied[key] = strategy
        params[key] = [(p, int(i)) for i, p in entry["params"]]
    return applied, params


@register_pass("shard")
def shard_pass(network: Any, context: Any) -> Tuple[Any, Dict[str, Any]]:
    """Pass: the mesh and the strategies of the network's own train-step graph, chosen
    together (``shard.mesh_search``): every dp x mp factorisation of the cluster's devices
    (or ``optimize.shard_mesh``), the minimal-memory ILP within ``optimize.shard_comm_ratio``
    x ZeRO-1's communication on that mesh (half the unoptimised simulated step where ZeRO-1
    cannot run), never more memory per device than the best baseline within that budget.
    Sets ``shard()`` on the primitives it can name and writes the strategy JSON to
    ``optimize.shard_strategy_file`` when set. Raises ValueError when no primitive of the
    network takes a strategy (nothing to set)."""
    from ms_efficient.shard.mesh_search import plan_graph_doc
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
    graph = context.graph("the shard pass")
    price = context.unoptimised("the shard pass")
    doc = plan_graph_doc(graph, cluster, price.step_time_s, float(opt.shard_comm_ratio), meshes)
    doc["unoptimised"] = price.to_dict()
    applied, params = apply_graph_plan(network, doc)
    if not applied:
        raise ValueError(f"shard: no primitive of {type(network).__name__} takes a strategy "
                         f"from the plan (looked for operators with parameters whose Cell "
                         f"holds one primitive of their type, e.g. nn.Dense.matmul); "
                         f"nothing to set.")
    strategy = strategy_json(applied, doc, params)
    if opt.shard_strategy_file:
        atomic_write_text(opt.shard_strategy_file, json.dumps(strategy, indent=1) + "\n")
    cells: Dict[str, Dict[str, Any]] = {}
    for key, st in applied.items():
        path, _, attr = key.rpartition(".")
        cells.setdefault(path, {}).setdefault("shard", {})[attr] = [list(t) for t in st]
    doc["cells"] = cells
    doc["strategy_json"] = strategy
    logger.info("shard: set %d primitives on mesh %dx%d", len(applied), doc["mesh"]["dp"],
                doc["mesh"]["mp"])
    return network, doc
