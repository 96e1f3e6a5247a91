"""A run folder's latest state in the one-process layout (the reference model's parameters).

An expert-parallel run (:mod:`ms_efficient.train.expert_parallel`) records::

    state.json      {"step", "world_size": W, "checkpoint": "ckpt/rank_{rank}/step_N.ckpt",
                     "plans": [ExpertPlan dict per MoE layer, in block order], ...,
                     "steps": [{"step", "plans", "replan", ...} per kept checkpoint]}
    ckpt/rank_r/state.json   rank r's checksummed records (:mod:`ms_efficient.train.checkpoint`)
    config.yaml     the resolved config (model, moe: the reference model's shape)
    ckpt/rank_r/step_N.ckpt   rank r's network and optimizer: dense parameters (the same on
                     every rank), per MoE layer the router and [S_b, ...] expert tables
                     laid out by its plan (:mod:`ms_efficient.train.relayout`), Adam's moments
                     ``adam_m.<name>`` / ``adam_v.<name>`` in the same layout, and the
                     layer's layout tables (``plan_*``, ``sync_*``; balanced layers: the
                     home table ``home_table`` int32 [W, S_h] and ``balance_stats``)

:func:`read_run` checks that record and picks the newest step that verifies on every rank;
:func:`logical_state` turns the W checkpoints into one
dict under the one-process model's names: dense parameters and their moments from rank 0,
every expert table [E, ...] (weights and moments) from the home copy of each expert (its
replicas checked equal), ``global_step`` from rank 0 (checked equal on every rank); layout
tables dropped. A balanced layer's plan is that of its home table, which must agree with
state.json. A one-process run (no ``plans``) is read from its verified latest checkpoint as
it is. :func:`export_checkpoint` writes that state as one checkpoint for the reference model.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np

from ms_efficient.core.config import RunConfig
from ms_efficient.moe.balance import home_plan
from ms_efficient.moe.plan import ExpertPlan
from ms_efficient.train import checkpoint as run_ckpt
from ms_efficient.train.relayout import check_run_plan, gather_experts
from ms_efficient.train.ep_launch import load_run_config

__all__ = ["RunCheckpoints", "read_run", "logical_state", "reference_network",
           "export_checkpoint", "EXPERT_TABLES", "MOMENTS"]

logger = logging.getLogger(__name__)

EXPERT_TABLES = ("w1", "b1", "w2", "b2")   # per MoE layer, [slots or E, ...]
MOMENTS = ("adam_m.", "adam_v.")           # AdamWeightDecay's state names: prefix + parameter


@dataclass
class RunCheckpoints:
    """What a run folder says about its latest checkpoint (no tensors read yet).

    world: W ranks that wrote it (1 for a one-process run); step: its step; plans: one
    :class:`ExpertPlan` per MoE layer (None for a one-process run); paths: the checkpoint
    of every rank, rank order (one path for a one-process run)."""

    run_dir: str
    cfg: RunConfig
    state: Dict
    world: int
    step: int
    plans: Optional[List[ExpertPlan]]
    paths: List[str]


def _moe_blocks(cfg: RunConfig) -> List[int]:
    """Indices of the MoE blocks (``GPTMoE.moe_index``) of the config's model."""
    return [i for i in range(cfg.model.num_layers) if (i + 1) % cfg.moe.moe_every == 0]


def read_run(run_dir: str) -> RunCheckpoints:
    """Check ``run_dir``'s state.json, config.yaml, plans and checkpoint files; ValueError
    naming the file or field, the value found and what is allowed."""
    if not os.path.isdir(run_dir):
        raise ValueError(f"run folder '{run_dir}' does not exist or is not a folder.")
    state = run_ckpt.read_state(run_dir)
    config = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(config):
        raise ValueError(f"'{run_dir}' has no config.yaml: not a run folder to load from.")
    # only the model's shape is read here: a corpus no longer on this machine does not matter
    cfg = load_run_config(run_dir, {"data.path": "stdlib"})
    step = state["step"]
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"'{run_ckpt.state_path(run_dir)}' field 'step' must be an integer "
                         f">= 0, but got {step!r}.")
    if "plans" not in state:                   # a one-process run
        record, _ = run_ckpt.verified_latest(run_dir, state)
        return RunCheckpoints(run_dir, cfg, state, 1, int(record["step"]), None,
                              [os.path.join(run_dir, record["path"])])
    where = f"'{run_ckpt.state_path(run_dir)}'"
    world = state.get("world_size")
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"{where} field 'world_size' must be an integer >= 1, but got "
                         f"{world!r}.")
    plans = _parse_plans(state["plans"], cfg, world, where)
    chosen, step, paths = _verified_step(run_dir, state, world)
    if chosen["plans"] != state["plans"]:       # an older step's layout
        plans = _parse_plans(chosen["plans"], cfg, world, where)
    return RunCheckpoints(run_dir, cfg, chosen, world, step, plans, paths)


def _parse_plans(entries, cfg: RunConfig, world: int, where: str) -> List[ExpertPlan]:
    """state.json's ``plans`` as checked ExpertPlans (ValueError naming the field)."""
    blocks = _moe_blocks(cfg)
    if not isinstance(entries, list) or len(entries) != len(blocks):
        raise ValueError(f"{where} field 'plans' must list one expert plan per MoE layer "
                         f"({len(blocks)} in config.yaml), but got "
                         f"{len(entries) if isinstance(entries, list) else repr(entries)}.")
    plans = []
    for j, entry in enumerate(entries):
        try:
            plan = ExpertPlan.from_dict(entry)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{where} field 'plans'[{j}]: {err}") from None
        check_run_plan(plan, cfg.moe.num_experts, world, plan.num_slots,
                       f"{where} field 'plans'[{j}]")
        plans.append(plan)
    return plans


def _verified_step(run_dir: str, state: Dict, world: int):
    """(the state of the step to load, that step, every rank's checkpoint path) of an
    expert-parallel run: the newest step that the shared state.json describes (its
    ``steps`` entries: plans, re-planner state) and whose checkpoint verifies on every rank
    (``ckpt/rank_r/state.json``'s checksummed records,
    :func:`~ms_efficient.train.checkpoint.newest_common_step`, which names the steps lost).
    A folder written before per-rank records existed has only ``checkpoint`` (a path with
    ``{rank}``) and is read unverified, as :func:`~ms_efficient.train.checkpoint.
    verified_latest` reads a one-process record without a checksum."""
    where = f"'{run_ckpt.state_path(run_dir)}'"
    entries = state.get("steps")
    if entries is None:
        entries = [{k: v for k, v in state.items() if k != "steps"}]
    if not isinstance(entries, list) or not all(isinstance(e, dict) and "step" in e
                                                 for e in entries):
        raise ValueError(f"{where} field 'steps' must list one object with a 'step' per "
                         f"kept checkpoint, but got {entries!r:.80}.")
    by_step = {int(e["step"]): e for e in entries}
    if all(os.path.isfile(run_ckpt.state_path(run_dir, r)) for r in range(world)):
        records = run_ckpt.newest_common_step(run_dir, range(world), by_step)
        step = int(records[0]["step"])
        paths = [os.path.join(run_dir, records[r]["path"]) for r in range(world)]
        return dict(state, **by_step[step]), step, paths
    logger.warning("%s has no per-rank checkpoint records (written before they existed); "
                   "loading step %s unverified", run_dir, state["step"])
    pattern = state["checkpoint"]
    if not isinstance(pattern, str) or "{rank}" not in pattern:
        raise ValueError(f"{where} field 'checkpoint' must be a path with '{{rank}}' (e.g. "
                         f"'ckpt/rank_{{rank}}/step_000010.ckpt'), but got {pattern!r}.")
    step = state["step"]
    paths = [os.path.join(run_dir, pattern.format(rank=r)) for r in range(world)]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise ValueError(f"{where} names {world} rank checkpoints ({pattern}), but "
                         f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                         f"missing; every rank's checkpoint of step {step} is needed.")
    return state, step, paths


def _read_checkpoint(path: str) -> Dict[str, np.ndarray]:
    import mindspore as ms

    try:
        params = ms.load_checkpoint(path)
    except (RuntimeError, ValueError) as err:
        raise ValueError(f"checkpoint '{path}' cannot be read: {err}") from None
    return {name: p.asnumpy() for name, p in params.items()}


def _layer_plan(run: RunCheckpoints, j: int, prefix: str,
                ranks: List[Dict[str, np.ndarray]]) -> ExpertPlan:
    """Plan of MoE layer j: state.json's; a balanced layer's home table (in every rank's
    checkpoint) must give the same slots."""
    plan = run.plans[j]
    name = prefix + "home_table"
    for r, params in enumerate(ranks):
        if name not in params:
            continue
        home = home_plan(params[name], run.cfg.moe.num_experts)
        if not (np.array_equal(home.slot_expert, plan.slot_expert)
                and np.array_equal(home.slot_device, plan.slot_device)):
            raise ValueError(f"'{run.paths[r]}' parameter '{name}' {params[name].tolist()} "
                             f"does not match state.json 'plans'[{j}] (slot_expert "
                             f"{plan.slot_expert.tolist()}, slot_device "
                             f"{plan.slot_device.tolist()}); the run folder is inconsistent.")
    return plan


def logical_state(run: RunCheckpoints) -> Dict[str, np.ndarray]:
    """{one-process name: numpy array} of the run's latest checkpoint (module docstring):
    network parameters and the optimizer's (``global_step``, ``adam_m.*``, ``adam_v.*``,
    ``learning_rate``); expert tables [E, ...]. No scratch buffers (routing counts)."""
    ranks = [_read_checkpoint(p) for p in run.paths]
    if run.plans is None:
        return ranks[0]
    num_experts = run.cfg.moe.num_experts
    steps = [int(np.asarray(r.get("global_step", [-1])).reshape(-1)[0]) for r in ranks]
    if len(set(steps)) != 1:
        raise ValueError(f"the rank checkpoints of '{run.run_dir}' are of different steps: "
                         f"'global_step' is {steps} on ranks 0..{run.world - 1}; all must "
                         f"be equal.")
    out, layout = {}, set()
    for j, block in enumerate(_moe_blocks(run.cfg)):
        prefix = f"blocks.{block}.ffn."
        plan = _layer_plan(run, j, prefix, ranks)
        keep = {prefix + "router.weight"} | {prefix + t for t in EXPERT_TABLES}
        # the layer's own layout buffers (home and sync tables, per-step figures); its child
        # Cells' Parameters (the router, a shared expert) are the model's
        layout |= {n for n in ranks[0] if n.startswith(prefix) and n not in keep
                   and "." not in n[len(prefix):]}
        for table in EXPERT_TABLES:
            for name in [prefix + table] + [m + prefix + table for m in MOMENTS]:
                lacking = [run.paths[r] for r, params in enumerate(ranks) if name not in params]
                if lacking:
                    raise ValueError(f"checkpoint '{lacking[0]}' lacks '{name}', an expert "
                                     f"table of MoE layer {j}; it is not a checkpoint of "
                                     f"this run's model.")
                out[name] = gather_experts(plan, [params[name] for params in ranks],
                                           num_experts, f"'{name}' of {run.run_dir}")
    for name, value in ranks[0].items():
        if name not in out and name not in layout:
            out[name] = value
    return out


def reference_network(cfg: RunConfig):
    """(net, optimizer) of the one-process reference model of ``cfg`` (the model a one-process
    run of the config trains; experts dropless "grouped")."""
    import mindspore as ms

    from ms_efficient.core import backend
    from ms_efficient.models.gpt_moe import build_model
    from ms_efficient.train.optim import make_optimizer

    backend.use_device(cfg.context.device_target)
    ms.set_seed(cfg.context.seed)
    moe = dataclasses.replace(cfg.moe, dispatch="grouped")
    net = build_model(cfg.model, moe, cfg.train.batch_size)
    return net, make_optimizer(net, cfg.train)


def export_checkpoint(run_dir: str, out: str, optimizer: bool = False) -> Dict:
    """Write the run's latest state as one checkpoint of the reference model to ``out``
    (atomically: a bad run folder leaves nothing behind). Network parameters only, or with
    ``optimizer`` also ``global_step``, Adam's moments and ``learning_rate`` (what the
    one-process trainer's checkpoints hold). Scratch buffers (routing counts) are written
    as zeros, so loading it into the reference model misses nothing. Returns {"step",
    "world_size", "parameters": count, "path": out}."""
    import mindspore as ms
    from mindspore import Parameter, Tensor

    from ms_efficient.core.fileio import atomic_write_with
    from ms_efficient.train.optim import is_scratch as _is_scratch

    run = read_run(run_dir)
    values = logical_state(run)
    net, opt = reference_network(run.cfg)
    wanted = {p.name: p for p in net.get_parameters()}
    if optimizer:
        for p in opt.get_parameters():
            wanted.setdefault(p.name, p)
    tensors = []
    for name, param in wanted.items():
        if _is_scratch(name):
            value = np.zeros(param.shape, dtype=param.asnumpy().dtype)
        elif name not in values:
            raise ValueError(f"checkpoint '{run.paths[0]}' lacks '{name}' of the reference "
                             f"model of {os.path.join(run_dir, 'config.yaml')}.")
        else:
            value = values[name]
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(f"'{name}' of '{run_dir}' has shape {list(value.shape)}, but the "
                             f"reference model's is {list(param.shape)}; config.yaml and the "
                             f"checkpoints disagree.")
        tensors.append({"name": name, "data": Parameter(Tensor(value), name=name)})
    extra = sorted(n for n in values if n not in wanted and (optimizer or not (
        n.startswith(MOMENTS) or n in ("global_step", "learning_rate"))))
    if extra:
        raise ValueError(f"checkpoint '{run.paths[0]}' holds {extra[:5]}, which the reference "
                         f"model of {os.path.join(run_dir, 'config.yaml')} does not have.")
    atomic_write_with(out, lambda tmp: ms.save_checkpoint(tensors, tmp), suffix=".ckpt")
    logger.info("exported step %d of %s (world_size %d) to %s: %d parameters", run.step,
                run_dir, run.world, out, len(tensors))
    return {"step": run.step, "world_size": run.world, "parameters": len(tensors), "path": out}
