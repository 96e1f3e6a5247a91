"""The launch bundle: what a cluster run of the plans needs, written to one folder (no
MindSpore import; the CLI command ``ms-efficient plan bundle`` builds the plans first).

    strategy.json   MindSpore's strategy-checkpoint JSON of the shard plan, each operator with
                    its pipeline stage (``shard.apply.strategy_json``)
    run.yaml        MindFormers-style run configuration: ``use_parallel``, ``parallel``,
                    ``parallel_config``, ``recompute_config``, ``swap_config``, ``moe_config``
    launch.sh       msrun on every node of the cluster (run it once per node with NODE_RANK)

The YAML sections follow MindFormers' documented formats (their fields and types are checked
by tests/test_launch_bundle.py against the pages it cites):

- ``parallel``: the keyword arguments MindFormers passes to ``set_auto_parallel_context``
  (``parallel_mode`` 1 = semi-auto, ``full_batch`` True as MindFormers advises for it,
  ``enable_parallel_optimizer`` / ``parallel_optimizer_config.optimizer_level`` from the ZeRO
  levels, ``pipeline_config``, ``strategy_ckpt_config`` loading strategy.json); the test
  hands them to MindSpore's own ``set_auto_parallel_context``, which validates every key.

- ``parallel_config``: data_parallel, model_parallel, pipeline_stage, micro_batch_num,
  expert_parallel, use_seq_parallel, vocab_emb_dp, gradient_aggregation_group; MindFormers'
  rule device_num = data_parallel x model_parallel x pipeline_stage holds.
- ``recompute_config``: ``recompute`` is False, or one count per pipeline stage of the layers
  recomputed from the front of that stage; with swap on, MindFormers reads it instead as the
  list of recomputed layer indices, which is what is written then. select_recompute,
  parallel_optimizer_comm_recompute, mp_comm_recompute, recompute_slice_activation: bools.
- ``swap_config``: swap, default_prefetch, ``layer_swap`` (entries ``{backward_prefetch,
  layers}``: whole swapped layers) and ``op_swap`` (entries ``{op_name, backward_prefetch,
  layers}``: a Cell inside a layer, named by its path below the layer).
- ``moe_config``: expert_num, num_experts_chosen, capacity_factor (the efficientmoe plan's
  planned rows as the equivalent factor when there is one), aux_loss_factor.

Layers are numbered as MindFormers numbers them: the index of the repeated block in its
CellList (the last numeric segment of a planned Cell path). Where the plan is finer than
MindFormers can say (recompute of layers that are not the first of their stage, without swap),
:class:`Bundle` ``notes`` says so.
"""
from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ms_efficient.core.fileio import atomic_write_text
from ms_efficient.core.registry import applied_plans, refusals
from ms_efficient.parallel.settings import ParallelSettings, stage_of_keys, stage_of_path

__all__ = ["Bundle", "layer_of", "recompute_config", "swap_config", "parallel_config",
           "moe_config", "launch_script", "write_bundle"]

# memopt actions (``memopt.env.ACTION_NAMES``) as MindFormers configures them; the memopt
# pass never plans recompute-offload (no MindSpore API realises it), so a plan holding one is
# refused rather than half-expressed.
RECOMPUTE_ACTIONS = ("recompute", "recompute-all")
SWAP_ACTIONS = ("swap",)
# MindFormers' defaults for the fields no plan decides (TransformerOpParallelConfig /
# RecomputeConfig): gradient fusion groups of 4, model-parallel communication recomputed.
GRADIENT_AGGREGATION_GROUP = 4
MP_COMM_RECOMPUTE = True


@dataclass
class Bundle:
    """What :func:`write_bundle` wrote: paths of the files, the YAML content and notes on
    plan details the MindFormers formats cannot carry."""

    out_dir: str
    files: Dict[str, str] = field(default_factory=dict)
    run_yaml: Dict[str, Any] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)


def layer_of(path: str) -> Tuple[int, str]:
    """``"model.layers.3.mlp"`` -> ``(3, "mlp")``: the layer index (last numeric segment) and
    the Cell path below the layer ("" for the layer itself). ValueError without an index."""
    parts = path.split(".")
    nums = [i for i, p in enumerate(parts) if p.isdigit()]
    if not nums:
        raise ValueError(f"memopt plan Cell '{path}' has no layer index (a numeric path "
                         f"segment, as in 'layers.3'); MindFormers configures layers by index.")
    j = nums[-1]
    return int(parts[j]), ".".join(parts[j + 1:])


def _stage_of_layer(memopt: Mapping[str, Any], settings: ParallelSettings) -> Dict[int, int]:
    return {layer_of(e["name"])[0]: stage_of_path(e["name"], settings.stage_config)
            for e in memopt["layers"]}


def recompute_config(memopt: Optional[Mapping[str, Any]], settings: ParallelSettings,
                     swap_on: bool, notes: List[str]) -> Dict[str, Any]:
    """MindFormers ``recompute_config`` of a memopt plan (module docstring)."""
    out = {"recompute": False, "select_recompute": False,
           "parallel_optimizer_comm_recompute": False, "mp_comm_recompute": MP_COMM_RECOMPUTE,
           "recompute_slice_activation": False}
    if not memopt:
        return out
    allowed = ("keep",) + RECOMPUTE_ACTIONS + SWAP_ACTIONS
    bad = [e for e in memopt["layers"] if e["action"] not in allowed]
    if bad:
        raise ValueError(f"memopt plan layer '{bad[0]['name']}' has action "
                         f"{bad[0]['action']!r}; a launch bundle expresses {list(allowed)} "
                         f"(re-plan memory with the memopt pass).")
    stage_of = _stage_of_layer(memopt, settings)
    chosen = sorted({layer_of(e["name"])[0] for e in memopt["layers"]
                     if e["action"] in RECOMPUTE_ACTIONS})
    if not chosen:
        return out
    if swap_on:
        out["recompute"] = chosen
        return out
    counts = [0] * settings.stages
    for layer in chosen:
        counts[stage_of[layer]] += 1
    for s in range(settings.stages):
        layers = sorted(l for l, st in stage_of.items() if st == s)
        want = layers[:counts[s]]
        got = [l for l in chosen if stage_of[l] == s]
        if got != want:
            notes.append(f"recompute: stage {s} recomputes layers {got}, MindFormers' count "
                         f"form recomputes its first {counts[s]} ({want}) instead")
    out["recompute"] = counts
    return out


def swap_config(memopt: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """MindFormers ``swap_config`` of a memopt plan: a swapped layer is a ``layer_swap`` entry,
    a swapped Cell inside a layer an ``op_swap`` entry; layers with the same prefetch lead
    share one entry."""
    layer_swap: Dict[int, List[int]] = {}
    op_swap: Dict[Tuple[str, int], List[int]] = {}
    for entry in (memopt or {}).get("layers", []):
        if entry["action"] not in SWAP_ACTIONS:
            continue
        layer, below = layer_of(entry["name"])
        lead = int(entry.get("prefetch_lead", 1))
        if below:
            op_swap.setdefault((below, lead), []).append(layer)
        else:
            layer_swap.setdefault(lead, []).append(layer)
    swap = bool(layer_swap or op_swap)
    return {"swap": swap, "default_prefetch": 1,
            "layer_swap": [{"backward_prefetch": lead, "layers": sorted(layers)}
                           for lead, layers in sorted(layer_swap.items())] or None,
            "op_swap": [{"op_name": name, "backward_prefetch": lead, "layers": sorted(layers)}
                        for (name, lead), layers in sorted(op_swap.items())] or None}


def _records(plans: Mapping[str, Any]):
    from ms_efficient.shard.apply import records_from_plan

    shard = applied_plans(plans).get("shard")
    return records_from_plan(shard) if shard else {}


def parallel_config(plans: Mapping[str, Any], settings: ParallelSettings) -> Dict[str, Any]:
    """MindFormers ``parallel_config``. expert_parallel: dp when the shard plan splits the
    expert dim (dim 0 of a 3-D weight of a BatchMatMul) over dp, else 1. vocab_emb_dp: True
    unless the plan splits an embedding table (a Gather's parameter) over mp."""
    ep, vocab_dp = 1, True
    for rec in _records(plans).values():
        for name, index, shape in rec.params:
            axes = rec.axes[index] if rec.axes else None
            if axes is None:
                continue
            if rec.prim == "BatchMatMul" and len(shape) == 3 and "dp" in axes[0]:
                ep = settings.dp
            if rec.prim == "Gather" and any("mp" in a for a in axes):
                vocab_dp = False
    return {"data_parallel": settings.dp, "model_parallel": settings.mp,
            "pipeline_stage": settings.stages, "micro_batch_num": settings.micro_batches,
            "expert_parallel": ep, "use_seq_parallel": False, "vocab_emb_dp": vocab_dp,
            "gradient_aggregation_group": GRADIENT_AGGREGATION_GROUP}


def moe_config(moe: Optional[Mapping[str, Any]], plans: Mapping[str, Any],
               tokens_per_step: int) -> Optional[Dict[str, Any]]:
    """MindFormers ``moe_config`` of the run's MoE settings (``moe``: num_experts, top_k,
    capacity_factor (0 = dropless), aux_loss_coef, moe_layers); None without experts. The
    efficientmoe plan's planned rows (``rows_after`` over ``moe_layers`` layers) become the
    capacity factor that allots as many rows: rows / (layers x tokens x top_k / experts) /
    experts."""
    if not moe or int(moe.get("num_experts", 0)) < 2:
        return None
    experts, top_k = int(moe["num_experts"]), int(moe["top_k"])
    cf = float(moe.get("capacity_factor") or experts / top_k)     # dropless: every token fits
    plan = applied_plans(plans).get("efficientmoe")
    if plan:
        per_layer = float(plan["rows_after"]) / max(int(moe["moe_layers"]), 1)
        cf = per_layer / (tokens_per_step * top_k)
    return {"expert_num": experts, "num_experts_chosen": top_k,
            "capacity_factor": round(max(cf, 1.0), 4), "aux_loss_factor": float(
                moe.get("aux_loss_coef", 0.0))}


def launch_script(devices: int, devices_per_node: int, run_yaml: str,
                  command: Optional[str] = None, master_port: int = 8118) -> str:
    """The msrun launch script for ``devices`` ranks, ``devices_per_node`` per node (as
    scripts/msrun_launcher.sh: one msrun per node, scheduler on node 0). Run it on node i as
    ``NODE_RANK=i MASTER_ADDR=<node 0 address> bash launch.sh``."""
    if devices % devices_per_node:
        raise ValueError(f"'devices' {devices} must fill whole nodes of {devices_per_node} "
                         f"devices.")
    local = min(devices, devices_per_node)
    cmd = command or (f"run_mindformer.py --config {run_yaml} --run_mode train "
                      f"--use_parallel True")
    return f"""#!/usr/bin/env bash
# msrun launch of the planned run: {devices} ranks, {local} per node, {devices // local} node(s).
# Run once per node: NODE_RANK=<0..{devices // local - 1}> MASTER_ADDR=<node 0 address> bash launch.sh
# The training command (MindFormers' entry point by default) reads run.yaml next to this file.
set -euo pipefail
cd "$(dirname "$0")"
NODE_RANK=${{NODE_RANK:-0}}
MASTER_ADDR=${{MASTER_ADDR:-127.0.0.1}}
MASTER_PORT=${{MASTER_PORT:-{master_port}}}
LOG_DIR=${{LOG_DIR:-output/msrun_log}}
msrun --worker_num={devices} --local_worker_num={local} \\
  --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" --node_rank="$NODE_RANK" \\
  --log_dir="$LOG_DIR" --join=True --cluster_time_out=300 \\
  {' '.join(shlex.quote(w) for w in shlex.split(cmd))}
"""


def _positive(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"'{name}' must be a positive integer, but got {value!r}.")
    return value


def write_bundle(out_dir: str, plans: Mapping[str, Any], settings: ParallelSettings,
                 devices_per_node: int, moe: Optional[Mapping[str, Any]] = None,
                 tokens_per_step: int = 0, command: Optional[str] = None) -> Bundle:
    """Write strategy.json (with a shard plan), run.yaml and launch.sh into ``out_dir``
    (created; each file written atomically). settings: ``settings_from_plans`` of the plans;
    devices_per_node: the cluster's; moe / tokens_per_step: see :func:`moe_config`. A pass
    that refused (``{"refused": reason}`` in ``plans``) contributes nothing; a note names it."""
    import yaml

    _positive(devices_per_node, "devices_per_node")
    os.makedirs(out_dir, exist_ok=True)
    bundle = Bundle(out_dir=out_dir)
    bundle.notes += [f"pass {name} refused, not in the bundle: {reason}"
                     for name, reason in refusals(plans).items()]
    plans = applied_plans(plans)
    records = _records(plans)
    if records:
        from ms_efficient.shard.apply import strategy_json

        js = strategy_json(records, settings.dp, settings.mp,
                           stage_of_keys(list(records), settings.stage_config))
        path = os.path.join(out_dir, "strategy.json")
        atomic_write_text(path, json.dumps(js, indent=1) + "\n")
        bundle.files["strategy.json"] = path
    memopt = plans.get("memopt")
    swap = swap_config(memopt)
    moe_doc = moe_config(moe, plans, tokens_per_step)
    doc: Dict[str, Any] = {
        "use_parallel": True,
        "parallel": {"parallel_mode": 1, "gradients_mean": False,
                     "enable_alltoall": moe_doc is not None,
                     # MindFormers: full_batch True in semi-auto mode (each rank reads
                     # the global batch; the first operators' strategies split it)
                     "full_batch": True,
                     "enable_parallel_optimizer": settings.optimizer_level is not None,
                     "parallel_optimizer_config": {
                         "parallel_optimizer_threshold": 0,
                         "optimizer_level": settings.optimizer_level or "level1"},
                     "pipeline_config": {"pipeline_interleave": False,
                                         "pipeline_scheduler": settings.scheduler},
                     "strategy_ckpt_config": {"save_file": "./ckpt_strategy.json",
                                              "only_trainable_params": True}},
        "parallel_config": parallel_config(plans, settings),
        "recompute_config": recompute_config(memopt, settings, swap["swap"], bundle.notes),
        "swap_config": swap,
    }
    if records:
        doc["parallel"]["strategy_ckpt_config"]["load_file"] = "./strategy.json"
    if moe_doc is not None:
        doc["moe_config"] = moe_doc
    path = os.path.join(out_dir, "run.yaml")
    atomic_write_text(path, yaml.safe_dump(doc, sort_keys=False))
    bundle.files["run.yaml"] = path
    bundle.run_yaml = doc
    path = os.path.join(out_dir, "launch.sh")
    atomic_write_text(path, launch_script(settings.devices, devices_per_node, "run.yaml",
                                          command))
    os.chmod(path, 0o755)
    bundle.files["launch.sh"] = path
    return bundle
