"""Compile the optimised network once with the verification pass on, and check every plan
against what the compiled graph shows (``optimize(..., verify=True)``).

What is checked, per Cell a plan names in its ``cells`` (the key the plan set there):
    ``recompute: true``  the compiled graph holds recomputed copies (CNode attribute
                         ``duplicated``) made for a call of the Cell (attributed per
                         recompute call, ``CompiledRecord.recomputed_by``). MindSpore
                         keeps a recompute Cell's output, so it copies only the nodes whose
                         outputs the backward reads inside the Cell; a Cell whose backward
                         reads nothing but its input and output (one Dense, say) gets no
                         copy, and its recompute is a no-op: reported as not realised.
                         Each recompute call must also be ordered after the backward's
                         inputs (a Depend on a copy); a call MindSpore could not order (its
                         "Can not find the nodes to depend" warning) is reported too.
    ``shard: {attr: strategy}``  a forward primitive under the Cell's scope carries that
                         strategy in its ``in_strategy`` attribute, one entry per input
                         dimension as MindSpore prints it (``((1, 1), (8))``: a one-element
                         tuple has no trailing comma). When the plan records the primitive
                         of ``<path>.<attr>`` (the shard pass's ``applied[...]["prim"]``),
                         only nodes of that primitive count: a BiasAdd strategy equal to
                         the MatMul's beside it is not taken for it. Read at
                         :data:`RECORD_STAGE`, before any backend rewrites the graph (the
                         CPU backend's fusions are not what Ascend compiles).
    ``swap: true``       a forward primitive under the Cell's scope carries ``offload``
                         (``Cell.offload``). That the tag reached the graph is all this shows:
                         MindSpore offloads only inside lazy_inline Cells, on Ascend.
    ``pipeline_stage: s``  a node under the Cell's scope carries stage s (its graph's stage or
                         a ``stage`` attribute). Only a pipeline-parallel compile
                         (semi-auto / auto parallel, Ascend or GPU; CPU refuses it) carries
                         stages at all; without one the entry says it was not checked.
Other keys (MoE capacities, wrappers) leave nothing this pass records; the entry lists them
under ``unchecked``. MindSpore's own "Can not find the nodes to depend" warning is printed
once per process without the Cell, through glog, whose destination is fixed when MindSpore
is imported, so it is not read: the missing Depend in the record is the check.

Each plan gets ``verified``: {Cell path: {"forward_nodes": n, "backward_nodes": n,
"recompute": {...}, "shard": {...}, "swap": {...}, "pipeline_stage": {...},
"unchecked": [...]}}.
A planned action with no trace raises :class:`PlanNotRealised` naming the pass and the Cell.
"""
from __future__ import annotations

import logging
import os
import tempfile
from typing import Any, Dict, List, Sequence

from ms_efficient.verify.plugin import VerifyUnavailable, ensure_registered, recording
from ms_efficient.verify.record import GROUP_ATTR, CompiledRecord, RecordedNode, parse_strategy

__all__ = ["PlanNotRealised", "RECORD_STAGE", "compile_record", "check_plans", "verify_plans",
           "verify_after_optimize"]

logger = logging.getLogger(__name__)

CHECKED_KEYS = ("recompute", "shard", "pipeline_stage", "swap")
# where in the compile the record is taken (kernels/cpu/verify_pass.cc): the shard entries
# say it, so a user can tell a strategy missing from the graph from one a backend rewrote
RECORD_STAGE = ("frontend graph (MindSpore FULL_GRAPH custom pass): after autodiff and "
                "recompute insertion, before backend fusion and kernel selection")
# "action" names an action whose parts are the keys above; "output_recompute" (recompute-all)
# shows as recomputed copies like any recompute: the record cannot tell a Cell's output node
# from its interior, so it is checked through "recompute".
# "segment" (memopt's segments of a sequence: its first Cell) makes the recompute check count
# the copies of the segment's Cells together: MindSpore merges adjacent recomputed Cells into
# one re-run, attributed to whichever of them holds its nodes.
DESCRIPTIVE_KEYS = ("action", "output_recompute", "segment")


class PlanNotRealised(RuntimeError):
    """A planned action left no trace in the compiled graph. ``failures``: one message per
    (pass, Cell); ``plans``: the plans with their ``verified`` entries."""

    def __init__(self, failures: List[str], plans: Dict[str, Any]):
        super().__init__("the compiled graph does not show every planned action:\n  "
                         + "\n  ".join(failures))
        self.failures = failures
        self.plans = plans


def compile_record(network: Any, sample_inputs: Sequence[Any]) -> CompiledRecord:
    """Compile the train step of ``network`` (``nn.TrainOneStepCell`` with SGD, in training
    mode, as ``optimize`` extracts the graph) on ``sample_inputs`` with the pass on, and
    return its record. Compiling only: no step runs, no weight changes."""
    import mindspore as ms
    from mindspore import nn

    ensure_registered()
    inputs = tuple(ms.Tensor(x) if not isinstance(x, ms.Tensor) and hasattr(x, "shape") else x
                   for x in sample_inputs)
    step = nn.TrainOneStepCell(network, nn.SGD(network.trainable_params(), learning_rate=0.0))
    was_training = network.training
    step.set_train(True)
    try:
        with tempfile.TemporaryDirectory(prefix="ms_efficient_verify_") as tmp:
            path = os.path.join(tmp, "record.json")
            with recording(path):
                step.compile(*inputs)
            if not os.path.isfile(path):
                raise VerifyUnavailable("the verification pass wrote no record: MindSpore did "
                                        "not run it on this compile (a cached graph?).")
            return CompiledRecord.from_file(path)
    finally:
        network.set_train(was_training)


def _check_recompute(copies: List[RecordedNode], unordered: List[str]) -> Dict[str, Any]:
    calls = {n.cnode_attrs.get(GROUP_ATTR) for n in copies} - {None}
    floating = bool(calls) and calls <= set(unordered)
    return {"recomputed_nodes": len(copies), "ops": sorted({n.op for n in copies}),
            "ordered": not floating, "ok": bool(copies) and not floating}


def _strategies(nodes: List[RecordedNode], op: Any = None) -> List[List[List[int]]]:
    """The ``in_strategy`` of the forward nodes (of primitive ``op`` when given), as lists."""
    seen = [parse_strategy(n.prim_attrs["in_strategy"]) for n in nodes
            if not n.backward and "in_strategy" in n.prim_attrs and op in (None, n.op)]
    return [[list(t) for t in s] for s in seen if s is not None]


def _check_shard(nodes: List[RecordedNode], planned: Dict[str, Any],
                 prims: Dict[str, str]) -> Dict[str, Any]:
    """{attr: {"planned", "primitive", "seen", "ok"}, "seen": every strategy under the
    scope, "stage": RECORD_STAGE}; ``prims``: {attr: primitive name} where the plan says."""
    out: Dict[str, Any] = {}
    for attr, strategy in planned.items():
        want = [list(t) for t in strategy]
        seen = _strategies(nodes, prims.get(attr))
        out[attr] = {"planned": want, "primitive": prims.get(attr), "seen": seen,
                     "ok": want in seen}
    out["seen"] = _strategies(nodes)
    out["stage"] = RECORD_STAGE
    return out


def _check_stage(nodes: List[RecordedNode], stage: int, staged: bool) -> Dict[str, Any]:
    if not staged:
        return {"planned": stage, "checked": False,
                "reason": "no node of this compile carries a pipeline stage: MindSpore reads "
                          "Cell.pipeline_stage only in semi-auto/auto parallel (Ascend/GPU)"}
    seen = sorted({n.graph_stage for n in nodes if n.graph_stage >= 0}
                  | {int(n.cnode_attrs["stage"]) for n in nodes
                     if n.cnode_attrs.get("stage", "").lstrip("-").isdigit()})
    return {"planned": stage, "checked": True, "seen": seen,
            "ok": not nodes or stage in seen}


def check_plans(record: CompiledRecord, plans: Dict[str, Any]) -> List[str]:
    """Add ``verified`` to every plan (module docs) and return the failures (one message per
    planned action with no trace, naming the pass and the Cell); [] when all show."""
    failures: List[str] = []
    staged = record.has_stage_info()
    unordered = record.unordered_calls()
    recomputed = record.recomputed_by(sorted({
        path for plan in plans.values() for path, actions in (plan.get("cells") or {}).items()
        if path and actions.get("recompute")}))
    for name, plan in plans.items():
        verified: Dict[str, Any] = {}
        for path, actions in (plan.get("cells") or {}).items():
            if not path:
                continue
            nodes = record.nodes_of(path)
            entry: Dict[str, Any] = {"forward_nodes": sum(not n.backward and not n.recomputed
                                                          for n in nodes),
                                     "backward_nodes": sum(n.backward for n in nodes)}
            if actions.get("recompute"):
                entry["recompute"] = _check_recompute(recomputed[path], unordered)
                if actions.get("segment"):
                    together = [n for p, a in plan["cells"].items()
                                if a.get("segment") == actions["segment"] and a.get("recompute")
                                for n in recomputed[p]]
                    entry["recompute"]["segment_recomputed_nodes"] = len(together)
                    entry["recompute"]["ok"] = bool(together)
                if not entry["recompute"]["ordered"]:
                    failures.append(
                        f"pass '{name}' planned recompute on Cell '{path}', but MindSpore found "
                        f"no backward node to run its re-run after (its 'Can not find the "
                        f"nodes to depend' warning): the {entry['recompute']['recomputed_nodes']}"
                        f" recomputed nodes may run in the forward and free nothing.")
                elif not entry["recompute"]["ok"]:
                    failures.append(
                        f"pass '{name}' planned recompute on Cell '{path}', but the compiled "
                        f"graph holds no recomputed copy of its nodes ({entry['forward_nodes']}"
                        f" forward nodes under its scope): MindSpore keeps a recompute Cell's "
                        f"output and found nothing inside it to recompute, so the plan frees "
                        f"no memory.")
            if actions.get("shard"):
                applied = plan.get("applied") or {}
                prims = {attr: applied[f"{path}.{attr}"]["prim"] for attr in actions["shard"]
                         if isinstance(applied.get(f"{path}.{attr}"), dict)
                         and applied[f"{path}.{attr}"].get("prim")}
                entry["shard"] = _check_shard(nodes, actions["shard"], prims)
                for attr, got in entry["shard"].items():
                    if attr in ("seen", "stage") or got["ok"]:
                        continue
                    which = (f"forward {got['primitive']}" if got["primitive"]
                             else "forward primitive")
                    failures.append(
                        f"pass '{name}' set strategy {got['planned']} on '{path}.{attr}', "
                        f"but no {which} under the Cell's scope carries it (seen: "
                        f"{got['seen']}; read in the {RECORD_STAGE}).")
            if actions.get("swap"):
                tagged = sum(not n.backward and n.prim_attrs.get("offload") == "true"
                             for n in nodes)
                entry["swap"] = {"offload_nodes": tagged, "ok": tagged > 0}
                if not tagged:
                    failures.append(f"pass '{name}' planned swap on Cell '{path}', but no "
                                    f"forward primitive under its scope carries 'offload'.")
            if "pipeline_stage" in actions:
                entry["pipeline_stage"] = _check_stage(nodes, int(actions["pipeline_stage"]),
                                                       staged)
                if entry["pipeline_stage"].get("ok") is False:
                    failures.append(
                        f"pass '{name}' put Cell '{path}' on pipeline stage "
                        f"{actions['pipeline_stage']}, but its compiled nodes carry stages "
                        f"{entry['pipeline_stage']['seen']}.")
            entry["unchecked"] = sorted(k for k, v in actions.items()
                                        if k not in CHECKED_KEYS + DESCRIPTIVE_KEYS
                                        and v not in (False, None))
            verified[path] = entry
        plan["verified"] = verified
    return failures


def verify_plans(network: Any, plans: Dict[str, Any], sample_inputs: Sequence[Any]
                 ) -> Dict[str, Any]:
    """Compile ``network`` once with the pass on, add ``verified`` to every plan, and raise
    :class:`PlanNotRealised` naming each Cell whose planned action left no trace. Raises
    VerifyUnavailable when the pass cannot be built or run here. Returns ``plans``."""
    if not sample_inputs:
        raise ValueError("verify=True compiles the network: call optimize(network, config, "
                         "sample_inputs=(batch...), verify=True) with one batch of its inputs.")
    record = compile_record(network, sample_inputs)
    logger.info("verify: %d nodes in the compiled graph", len(record.nodes))
    failures = check_plans(record, plans)
    if failures:
        raise PlanNotRealised(failures, plans)
    return plans


def verify_after_optimize(network: Any, plans: Dict[str, Any],
                          sample_inputs: Sequence[Any], verify: bool) -> None:
    """What ``optimize(..., verify=...)`` does after its passes. verify=True: the check
    (:func:`verify_plans`); VerifyUnavailable (no compiler, no headers) or PlanNotRealised
    propagate. verify=False: plans get no ``verified``; a warning says so when the check could
    not run here anyway (no compiler), so a user relying on it learns it is off."""
    from ms_efficient.verify.plugin import verify_available

    if verify:
        if not plans:
            raise ValueError("optimize(..., verify=True) has no plan to verify: "
                             "'optimize.passes' enabled no pass.")
        verify_plans(network, plans, sample_inputs)
        return
    if not verify_available():
        logger.warning("the compiled-graph check of the plans is off: it needs a C++ compiler "
                       "(g++) and MindSpore's custom-pass headers; plans carry no 'verified'.")
    else:
        logger.info("the compiled-graph check of the plans is off (optimize(..., verify=True) "
                    "turns it on); plans carry no 'verified'.")
