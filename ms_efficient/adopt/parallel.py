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
  after adoption. :func:`save_moe_checkpoint` writes the network back in the user's own
  layout and names (one checkpoint of the original network, whatever W), so a run resumes at
  another size by loading it into the original network and adopting again.
- **buffers**: every device's receive buffer is the mean share (T K rows of this rank's T
  tokens) x (1 + ``buffer_slack``), on the cluster's matmul tile; rows beyond a buffer drop
  (the layer's ``dropped`` output; the fast level balances into the buffers first).

The layer's cost model is the cluster's (``cluster``: a preset name or ClusterSpec; on CPU
the default is ``cpu-local`` grown to the W ranks of the job) and the expert sizes of the block.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from ms_efficient.adopt.blocks import BlockSpec
from ms_efficient.core import backend
from ms_efficient.core.cluster import ClusterSpec, for_ranks, get_cluster
from ms_efficient.core.fileio import atomic_write_with
from ms_efficient.efficientmoe.cost import CostModel
from ms_efficient.efficientmoe.planner import training_specs
from ms_efficient.moe.balanced_ep import BalancedExpertParallelMoE

__all__ = ["expert_parallel_layer", "logical_tables", "ep_cluster", "UserExperts",
           "save_moe_checkpoint", "load_moe_optimizer_state"]


@dataclasses.dataclass(frozen=True)
class UserExperts:
    """Where an adopted block's experts came from: ``layout`` "list" (E experts of Dense,
    weights [out, in]) or "stacked" ([E, ...] Parameters); ``names[role]`` the user's
    Parameter name(s) of each role ("w1" gate or first matrix, "w3" up, "w2" down, "b1",
    "b3", "b2"; a tuple of E names for a list), ``shapes[role]`` their shapes; the network's
    Parameter names before adoption (``network_names``)."""
    layout: str
    names: Dict[str, object]
    shapes: Dict[str, tuple]
    network_names: frozenset


def user_experts(spec: BlockSpec, names: Dict[int, str]) -> UserExperts:
    """The :class:`UserExperts` of a block, ``names`` the user's names by Parameter id."""
    roles = dict(zip(("w1", "b1", "w2", "b2"), spec.weights))
    if spec.up is not None:
        roles.update(zip(("w3", "b3"), spec.up))
    listed = spec.layout == "list"
    out_names, shapes = {}, {}
    for role, value in roles.items():
        if value is None:
            continue
        params = tuple(value) if listed else (value,)
        out_names[role] = tuple(names[id(p)] for p in params) if listed else names[id(value)]
        shapes[role] = tuple(params[0].shape)
    return UserExperts(spec.layout, out_names, shapes, frozenset(names.values()))


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
    w1, b1, w2, b2 = spec.weights
    parts = {"w1": _stacked(w1, True), "w2": _stacked(w2, True)}
    if spec.up is not None:
        parts["w3"] = _stacked(spec.up[0], True)
    if spec.has_bias:
        parts.update(b1=_stacked(b1, False), b2=_stacked(b2, False))
        if spec.up is not None:
            parts["b3"] = _stacked(spec.up[1], False)
    return _compose(parts, spec.num_experts, spec.has_bias)


def _compose(parts: Dict[str, np.ndarray], num_experts: int,
             has_bias: bool) -> Tuple[np.ndarray, ...]:
    """The logical tables from the experts' parts by role (w1 [E, H, F] the gate or first
    matrix, w3 the up projection of a gated expert, w2 [E, F, H]; biases b1, b3, b2 [E, n]):
    w1 | w3 fused along F, biases as [E, 1, n]."""
    e = num_experts
    w1 = parts["w1"] if "w3" not in parts else np.concatenate((parts["w1"], parts["w3"]), 2)
    if not has_bias:
        return w1, parts["w2"]
    b1 = parts["b1"].reshape(e, -1)
    if "b3" in parts:
        b1 = np.concatenate((b1, parts["b3"].reshape(e, -1)), 1)
    return w1, b1.reshape(e, 1, -1), parts["w2"], parts["b2"].reshape(e, 1, -1)


def ep_cluster(cluster, world: int) -> ClusterSpec:
    """The cluster the layers are priced on: ``cluster`` (a preset name or ClusterSpec), by
    default ``cpu-local`` grown to ``world`` devices (this machine's ranks). One that cannot
    hold the W ranks is a ValueError naming what to change."""
    if cluster is None:
        return for_ranks(get_cluster("cpu-local"), world)
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
                          fast_level: str = "auto",
                          names: Optional[Dict[int, str]] = None) -> BalancedExpertParallelMoE:
    """The balanced expert-parallel layer of one recognised block over the world group
    (module doc), its home slots loaded with the block's experts. ``tokens``: T, this rank's
    tokens per forward; ``names``: the user's Parameter names by id (recorded for
    :func:`save_moe_checkpoint`)."""
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
    layer.cost_model = model                 # what EfficientMoECallback's re-plans price with
    layer.user_experts = user_experts(spec, names if names is not None else
                                      {id(p): p.name for p in spec.cell.get_parameters()})
    return layer


def gathered_tables(layer: BalancedExpertParallelMoE,
                    params: Optional[Tuple[Parameter, ...]] = None) -> Tuple[np.ndarray, ...]:
    """Every expert's rows of ``params`` (default the layer's weights; or an optimizer's state
    of them, in the same :attr:`expert_names` order) from the ranks' home slots, float32
    numpy [E, ...] each (collective when W > 1: one AllGather per table; every rank gets
    them)."""
    home = layer.home_table.asnumpy()                      # [W, S_h]
    tables = []
    for param in params if params is not None else layer.expert_params():
        local = param.asnumpy()
        if layer.world > 1:
            rows = ops.AllGather()(Tensor(local)).asnumpy()
        else:
            rows = local
        rows = rows.reshape(home.shape + local.shape[1:])
        table = np.zeros((layer.num_experts,) + local.shape[1:], np.float32)
        for w, s in zip(*np.nonzero(home >= 0)):
            table[home[w, s]] = rows[w, s]
        tables.append(table)
    return tuple(tables)


def user_arrays(layer: BalancedExpertParallelMoE, tables: Optional[Tuple[np.ndarray, ...]] = None,
                prefix: str = "") -> Dict[str, np.ndarray]:
    """{prefix + the user's expert Parameter name: its value} of an adopted layer, from
    ``tables`` (logical, :attr:`expert_names` order; default the weights, gathered: collective)."""
    info: UserExperts = layer.user_experts
    tables = dict(zip(layer.expert_names, tables if tables is not None
                      else gathered_tables(layer)))
    gated = layer.expert_kind == "glu"
    ffn = tables["w2"].shape[1]
    parts = {"w1": tables["w1"][:, :, :ffn] if gated else tables["w1"], "w2": tables["w2"]}
    if gated:
        parts["w3"] = tables["w1"][:, :, ffn:]
    if layer.has_bias:
        b1 = tables["b1"].reshape(layer.num_experts, -1)
        parts["b1"] = b1[:, :ffn] if gated else b1
        parts["b2"] = tables["b2"].reshape(layer.num_experts, -1)
        if gated:
            parts["b3"] = b1[:, ffn:]
    out = {}
    for role, name in info.names.items():
        value = parts[role]
        if info.layout == "list":            # Dense layout: weights [out, in], biases [out]
            for e, each in enumerate(name):
                out[prefix + each] = value[e].T.copy() if value.ndim == 3 else value[e].copy()
        else:
            out[prefix + name] = value.reshape(info.shapes[role])
    return out


def _user_tables(layer: BalancedExpertParallelMoE, arrays: Dict[str, np.ndarray],
                 prefix: str) -> Tuple[np.ndarray, ...]:
    """The inverse of :func:`user_arrays`: the logical tables (:attr:`expert_names` order)
    from ``arrays`` holding prefix + every user expert name; KeyError naming a missing one."""
    info: UserExperts = layer.user_experts
    e = layer.num_experts
    parts = {}
    for role, name in info.names.items():
        if info.layout == "list":
            values = [np.asarray(arrays[prefix + each], np.float32) for each in name]
            parts[role] = np.stack([v.T if v.ndim == 2 else v for v in values])
        else:                                 # stacked: the logical tables, reshaped
            h, f = layer.hidden_size, layer.w2.shape[1]
            shape = {"w1": (h, f), "w3": (h, f), "w2": (f, h)}.get(role, (-1,))
            parts[role] = np.asarray(arrays[prefix + name], np.float32).reshape(e, *shape)
    return _compose(parts, e, layer.has_bias)


def _adopted_layers(network: nn.Cell):
    return [c for _, c in network.cells_and_names()
            if isinstance(c, BalancedExpertParallelMoE) and hasattr(c, "user_experts")]


def _expert_states(optimizer, layer: BalancedExpertParallelMoE):
    """[(state name prefix, the state Parameters in expert_names order)] of ``optimizer`` for
    the layer's expert weights (``moe.ep_replan.weight_states``; the prefix as the optimizer
    names them: ``adam_m``, ``moment1``, ...)."""
    from ms_efficient.moe.ep_replan import weight_states

    weights = layer.expert_params()
    out = []
    for kind in weight_states(optimizer, weights):
        prefix = {s.name[:-len(w.name)] for s, w in zip(kind, weights)
                  if s.name.endswith("." + w.name)}
        if len(prefix) != 1:
            raise ValueError(f"save_moe_checkpoint: the optimizer's state "
                             f"{[s.name for s in kind]} is not named '<kind>.<weight name>'; "
                             f"the checkpoint could not name it for the original network.")
        out.append((prefix.pop(), kind))
    return out


def _optimizer_split(network: nn.Cell, optimizer, layers):
    """(the expert states per layer, every other optimizer Parameter: the dense Parameters'
    state and the scalars, by name)."""
    experts = [_expert_states(optimizer, layer) for layer in layers]
    taken = {id(p) for states in experts for _, kind in states for p in kind}
    taken |= {id(p) for p in network.get_parameters()}
    others = {p.name: p for p in optimizer.get_parameters() if id(p) not in taken}
    return experts, others


def save_moe_checkpoint(network: nn.Cell, path: str, optimizer=None) -> Dict[str, np.ndarray]:
    """Write ``network`` (adopted with ``expert_parallel=True``) as ONE checkpoint of the
    user's original network: its own Parameters under their names (the router, shared expert
    and gate bias as trained; dense ones from this rank, the same on every rank) and every
    expert in the user's layout and names, read from the ranks' home slots. With
    ``optimizer`` (the one training ``network``: nn.Adam, AdamWeightDecay, Momentum, ...)
    its state too, named as that optimizer built on the ORIGINAL network names it
    (``adam_m.<user's expert weight name>``, ``moment1.<router weight name>``, its step and
    scalars), the experts' state gathered like their weights. Collective: every rank calls
    it; rank 0 writes ``path`` (atomically), every rank returns the arrays. To continue at
    any number of ranks: load it into the original network (``mindspore.load_checkpoint`` +
    ``load_param_into_net``), ``adopt_moe`` again, build the optimizer, then
    :func:`load_moe_optimizer_state`."""
    layers = _adopted_layers(network)
    if not layers:
        raise ValueError("save_moe_checkpoint: the network has no layer adopted with "
                         "adopt_moe(..., expert_parallel=True).")
    original = frozenset().union(*(layer.user_experts.network_names for layer in layers))
    arrays = {p.name: p.asnumpy() for p in network.get_parameters() if p.name in original}
    for layer in layers:
        arrays.update(user_arrays(layer))
    if optimizer is not None:
        experts, others = _optimizer_split(network, optimizer, layers)
        for layer, states in zip(layers, experts):
            for prefix, kind in states:
                arrays.update(user_arrays(layer, gathered_tables(layer, kind), prefix))
        arrays.update({name: p.asnumpy() for name, p in others.items()})
    if backend.group_size() == 1 or backend.group_rank() == 0:
        entries = [{"name": n, "data": Tensor(v)} for n, v in arrays.items()]
        atomic_write_with(path, lambda tmp: ms.save_checkpoint(entries, tmp), suffix=".ckpt")
    return arrays


def load_moe_optimizer_state(network: nn.Cell, optimizer, checkpoint) -> None:
    """Fill ``optimizer`` (built after ``adopt_moe(..., expert_parallel=True)`` on
    ``network``) from a :func:`save_moe_checkpoint` written with an optimizer of the same kind,
    at any number of ranks: the experts' state of this rank's home slots from the user-named
    entries, every other state Parameter (the dense Parameters', the step, the scalars) by
    name. ``checkpoint``: its path, or the dict ``mindspore.load_checkpoint`` returns.
    A network without adopted expert-parallel layers loads everything by name. Checks every
    entry before writing any: a missing name or a wrong shape is a ValueError naming it, and
    nothing is written."""
    from ms_efficient.core.params import write_parameter

    raw = ms.load_checkpoint(checkpoint) if isinstance(checkpoint, str) else checkpoint
    arrays = {n: (v.asnumpy() if hasattr(v, "asnumpy") else np.asarray(v))
              for n, v in raw.items()}
    layers = _adopted_layers(network)
    experts, others = _optimizer_split(network, optimizer, layers)
    writes = []
    for layer, states in zip(layers, experts):
        for prefix, kind in states:
            try:
                tables = _user_tables(layer, arrays, prefix)
            except KeyError as err:
                raise ValueError(f"load_moe_optimizer_state: the checkpoint has no optimizer "
                                 f"state {err.args[0]!r}; it must be written by "
                                 f"save_moe_checkpoint(..., optimizer=) with an optimizer of "
                                 f"the same kind.") from None
            writes += [(p, layer.home_rows(t)) for p, t in zip(kind, tables)]
    missing = sorted(n for n in others if n not in arrays)
    if missing:
        raise ValueError(f"load_moe_optimizer_state: the checkpoint has no optimizer state "
                         f"{missing[:6]}{'...' if len(missing) > 6 else ''}; it must be written "
                         f"by save_moe_checkpoint(..., optimizer=) with an optimizer of the "
                         f"same kind.")
    writes += [(p, arrays[n]) for n, p in others.items()]
    for param, value in writes:
        if tuple(np.shape(value)) != tuple(param.shape):
            raise ValueError(f"load_moe_optimizer_state: '{param.name}' is {tuple(param.shape)}"
                             f" but the checkpoint holds {tuple(np.shape(value))}.")
    for param, value in writes:
        write_parameter(param, value)
