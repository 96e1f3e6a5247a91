"""Named baseline strategies, costed by the same model as the ILP, and their closed forms.

Methods (``METHODS``), on a dp x mp mesh unless said otherwise:
    megatron-tp          Megatron-LM tensor parallel over mp (column/row-parallel attention
                         and MLP, vocab-parallel embedding/head/loss), data parallel over dp
                         with an all-reduce of the gradients (Shoeybi et al. 2019).
    megatron-tp-sp       + sequence parallel: LayerNorm/dropout/residual split on s over mp,
                         all-reduces become reduce-scatter + all-gather (Korthikanti et al.
                         2022); inputs kept sharded and re-gathered in backward.
    megatron-tp-distopt  megatron-tp + distributed optimizer (optimizer states sharded over
                         the data-parallel replicas, ZeRO-1 style).
    megatron-tp-sp-distopt  both (the usual large-scale Megatron setting).
    dp, zero1, zero2, zero3  pure data parallelism over all devices (batch split dp*mp ways),
                         ZeRO stage 0..3 (Rajbhandari et al. 2020).
MoE layers under Megatron: router/gate/dispatch/combine follow the token layout, experts are
expert-parallel over dp (experts split across dp, All-to-All) and tensor-parallel over mp.

Closed forms used to check the cost model: :func:`zero_model_state_bytes` (ZeRO paper, Sec.
5: (2+2+K)Psi, 2Psi+2Psi+K Psi/N, 2Psi+(2+K)Psi/N, (2+2+K)Psi/N) and
:func:`megatron_activation_bytes` (Korthikanti et al. 2022, eqs. 1-4 per layer).
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

from ms_efficient.shard.cost import Cost, CostModel, evaluate
from ms_efficient.shard.graph_ops import MATMULS
from ms_efficient.shard.strategies import Layout, OpSpec, Strategy

__all__ = ["METHODS", "baseline_strategies", "baseline_cost", "zero_model_state_bytes",
           "megatron_activation_bytes", "GRAPH_METHODS", "graph_baseline_strategies",
           "graph_baseline_cost"]

METHODS = ("megatron-tp", "megatron-tp-sp", "megatron-tp-distopt", "megatron-tp-sp-distopt",
           "dp", "zero1", "zero2", "zero3")

# op short name -> the dim mp splits under Megatron tensor parallelism (None: replicated)
_TP_DIM = {
    "embed": "v", "qkv": "a", "q": "a", "k": "a", "v": "a", "scores": "a", "softmax": "a",
    "attn_drop": "a", "context": "a", "proj": "a", "fc1": "f", "gelu": "f", "fc2": "f",
    "head": "v", "loss": "v", "expert_fc1": "f", "expert_gelu": "f", "expert_fc2": "f",
}
# ops whose token-layout tensors are split on s over mp under sequence parallelism
_SP_OPS = ("ln1", "drop1", "add1", "ln2", "drop2", "add2", "ln_f", "router", "gate", "input")
# ops whose partial output is reduce-scattered onto s under sequence parallelism
_SP_SCATTER = ("embed", "proj", "fc2", "combine")
_EXPERT_OPS = ("dispatch", "expert_fc1", "expert_gelu", "expert_fc2")


def _short(spec: OpSpec) -> str:
    return spec.tie_key.split(".")[-1]


def _megatron_layout(spec: OpSpec, sp: bool, mesh) -> Layout:
    short = _short(spec)
    dp = "b" if mesh.dp > 1 else None
    if short in ("expert_fc1", "expert_gelu", "expert_fc2") and mesh.dp > 1:
        dp = "e"
    mp = _TP_DIM.get(short) if mesh.mp > 1 else None
    scatter = None
    if sp and mesh.mp > 1:
        if short in _SP_OPS:
            mp = "s"
        if short in _SP_SCATTER:
            scatter = "s"
            mp = mp or "e"    # combine: the experts' partial sums over mp, scattered on s
    if short == "combine" and not sp:
        mp = None
    return Layout(dp, mp, scatter)


def baseline_strategies(specs: Sequence[OpSpec], model: CostModel, method: str
                        ) -> Dict[str, Strategy]:
    """``{op name: Strategy}`` of a named baseline on ``model.mesh``.

    Pure data parallel methods need the batch divisible by all devices; a layout that does
    not divide raises ValueError naming the op and the method.
    """
    if method not in METHODS:
        raise ValueError(f"'method' must be one of {list(METHODS)}, but got {method!r}.")
    mesh = model.mesh
    out: Dict[str, Strategy] = {}
    for spec in specs:
        if method.startswith("megatron"):
            layout = _megatron_layout(spec, "-sp" in method, mesh)
            zero = 1 if method.endswith("distopt") and spec.param_elems() else 0
        else:
            axes = [a for a in ("dp", "mp") if mesh.size(a) > 1]
            dims = {a: "b" for a in axes}
            layout = Layout(dims.get("dp"), dims.get("mp"))
            zero = {"dp": 0, "zero1": 1, "zero2": 2, "zero3": 3}[method] if spec.param_elems() else 0
        size = spec.size
        for axis in ("dp", "mp"):
            d = layout.axis_dim(axis)
            split = mesh.size(axis) * (mesh.size("dp") if axis == "mp" and layout.dp == d else 1)
            if d is not None and (d not in size or size[d] % split):
                raise ValueError(f"method {method!r} cannot split op {spec.name!r} dim {d!r} "
                                 f"(sizes {dict(spec.dims)}) on mesh {mesh}.")
        out[spec.name] = Strategy(layout, zero)
    return out


def baseline_cost(specs: Sequence[OpSpec], model: CostModel, method: str) -> Cost:
    """Per-device cost of a baseline: sequence-parallel methods keep inputs in the finer
    (producer) split, as Megatron does; the others in the consumer's layout."""
    strategies = baseline_strategies(specs, model, method)
    return evaluate(specs, strategies, model, saved="producer" if "-sp" in method else "consumer")


def zero_model_state_bytes(params: float, devices: int, stage: int, k: int = 12) -> float:
    """ZeRO paper, per device, ``params`` elements on ``devices`` data-parallel ranks: stage 0
    (2+2+K)P, 1: 4P + KP/N, 2: 2P + (2+K)P/N, 3: (4+K)P/N bytes (fp16 weight and gradient)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"'stage' must be one of [0, 1, 2, 3], but got {stage!r}.")
    n = devices
    return {0: (4 + k) * params, 1: 4 * params + k * params / n,
            2: 2 * params + (2 + k) * params / n, 3: (4 + k) * params / n}[stage]


def megatron_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1,
                              mode: Optional[str] = None) -> float:
    """Activation bytes of one transformer layer (Korthikanti et al. 2022), per device:
    none: sbh(34 + 5as/h); "tp": sbh(10 + 24/t + 5as/(ht)); "sp": sbh(34/t + 5as/(ht))."""
    sbh = s * b * h
    if mode is None:
        return sbh * (34 + 5 * a * s / h)
    if mode == "tp":
        return sbh * (10 + 24 / t + 5 * a * s / (h * t))
    if mode == "sp":
        return sbh * (34 / t + 5 * a * s / (h * t))
    raise ValueError(f"'mode' must be None, 'tp' or 'sp', but got {mode!r}.")


# ---- the same baselines on a user's graph (specs from shard.graph_ops) -------------------------
GRAPH_METHODS = ("dp", "zero1", "zero2", "zero3", "megatron-tp")


def _first_legal(spec: OpSpec, mesh, wanted: Sequence[Layout]) -> Layout:
    from ms_efficient.shard.strategies import candidate_layouts

    legal = candidate_layouts(spec, mesh)
    for layout in wanted:       # a mesh axis of size 1 splits nothing (candidate_layouts)
        layout = Layout(layout.dp if mesh.dp > 1 else None, layout.mp if mesh.mp > 1 else None,
                        layout.scatter)
        if layout in legal:
            return layout
    return legal[0]


def graph_baseline_strategies(specs: Sequence[OpSpec], model: CostModel, method: str
                              ) -> Dict[str, Strategy]:
    """``{op name: Strategy}`` of a baseline on graph-derived specs (no templates to name
    layers by, so the rules read the operators):

    dp, zero1..3: every op splits its first batch dim (``OpSpec.dp_dims``) over all devices
        (``Layout(b, b)``), ZeRO level 0..3 on its parameters; ops without a batch dim run
        replicated. Raises ValueError when the batch does not divide the devices.
    megatron-tp: Megatron's rules propagated in topological order (Shoeybi et al. 2019): a
        MatMul with a weight is row-parallel (mp on its contracted dim, output all-reduced)
        when its input arrives split on that dim, else column-parallel (mp on its last output
        dim); an embedding Gather is vocab-parallel; every other op keeps the mp split its
        input arrives with where legal; dp splits the batch dim.
    """
    if method not in GRAPH_METHODS:
        raise ValueError(f"'method' must be one of {list(GRAPH_METHODS)}, but got {method!r}.")
    mesh = model.mesh
    out: Dict[str, Strategy] = {}
    if method != "megatron-tp":
        zero = {"dp": 0, "zero1": 1, "zero2": 2, "zero3": 3}[method]
        for spec in specs:
            b = spec.dp_dims[0] if spec.dp_dims else None
            if b is not None and spec.size[b] % mesh.devices:
                raise ValueError(f"method {method!r} cannot split op {spec.name!r} batch dim "
                                 f"of size {spec.size[b]} over {mesh.devices} devices.")
            layout = _first_legal(spec, mesh, [Layout(b, b) if b else Layout()])
            out[spec.name] = Strategy(layout, zero if spec.param_elems() else 0)
        return out
    mp_out: Dict[str, Optional[str]] = {}
    for spec in specs:
        inherited = None
        for t in spec.inputs:
            p = mp_out.get(t.source) if t.kind == "act" else None
            if p is not None:
                inherited = next((c for c, q in t.rename if q == p), None)
                if inherited is not None:
                    break
        has_param = any(t.kind == "param" for t in spec.inputs)
        mp = inherited
        if spec.prim in MATMULS and has_param and spec.contract:
            mp = spec.contract[0] if inherited == spec.contract[0] else spec.out[-1]
        elif spec.prim == "Gather" and has_param and spec.contract:
            mp = spec.contract[0]    # vocab-parallel; a Gather kept whole has no contract
        b = spec.dp_dims[0] if spec.dp_dims else None
        layout = _first_legal(spec, mesh, [Layout(b, mp), Layout(b, None), Layout(None, mp),
                                           Layout(None, None)])
        out[spec.name] = Strategy(layout, 0)
        split = layout.mp
        mp_out[spec.name] = split if split in spec.out and split not in spec.contract else None
    return out


def graph_baseline_cost(specs: Sequence[OpSpec], model: CostModel, method: str) -> Cost:
    """Per-device cost of :func:`graph_baseline_strategies` (inputs kept in the consumer's
    layout, as these methods do)."""
    return evaluate(specs, graph_baseline_strategies(specs, model, method), model,
                    saved="consumer")
