"""Measured MoE benchmark: the reference model trained on this CPU under each capacity policy.

Every method trains the same network from the same seed on the same batches for the same
number of steps; only the expert capacities differ. Rows report the median step time
(MindSpore GRAPH_MODE on CPU, excluding the compiling first step and any recompiling step),
the padding fraction (computed slot rows that held no token / computed slot rows) and the drop
rate (assignments that found no slot / assignments), both over the whole run.

Methods that differ only in where experts live on several devices (FasterMoE shadowing, EPLB,
MindSpeed placement, the oracle) have nothing to change on one CPU process; they appear in the
simulated rows only.
"""
from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import tempfile
from typing import Dict, List, Optional

import numpy as np

from ms_efficient.config import RunConfig

__all__ = ["MEASURED_METHODS", "run_measured", "quick_config"]

logger = logging.getLogger(__name__)

# method label -> (moe.capacity_factor, efficientmoe.enabled)
MEASURED_METHODS = {
    "switch-cf1.0": (1.0, False),
    "switch-cf1.25": (1.25, False),
    "switch-cf2.0": (2.0, False),
    # capacity = tokens per step: the only static capacity that can never drop for any routing
    "dropless-static": (0.0, False),
    # warm-up at CF 1.25, then per-expert capacities planned online
    "efficientmoe": (1.25, True),
}


def quick_config(cfg: RunConfig) -> RunConfig:
    """A smaller model and run for ``--quick`` (about a minute for all methods)."""
    cfg = copy.deepcopy(cfg)
    cfg.model.hidden_size, cfg.model.ffn_hidden_size, cfg.model.num_heads = 64, 128, 2
    cfg.model.num_layers, cfg.model.seq_length = 2, 64
    cfg.train.batch_size, cfg.train.steps = 8, 20
    cfg.moe.trace_ranks = 4
    cfg.efficientmoe.warmup_steps, cfg.efficientmoe.replan_every = 6, 7   # plans at 6 and 13
    cfg.efficientmoe.window = 6
    return cfg


def _run_one(cfg: RunConfig, out_dir: str, init_from: Optional[str]) -> Dict:
    from ms_efficient.train import Trainer

    trainer = Trainer(cfg, out_dir)
    if init_from:
        trainer.load_weights(init_from, keep_step=False)
    result = trainer.run()
    with open(os.path.join(out_dir, "metrics.jsonl"), encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    return {"result": result, "rows": rows, "step_times": trainer.step_times,
            "replans": [r["step"] for r in rows if r["kind"] == "plan"],
            "totals": trainer.totals}


def run_measured(base: RunConfig, methods: Optional[List[str]] = None, steps: Optional[int] = None,
                 workload: str = "gpt_moe", init_from: Optional[str] = None,
                 keep_trace: Optional[str] = None) -> List[Dict]:
    """Train ``base`` once per method; returns benchmark rows (evidence "measured").

    keep_trace: copy the routing trace of the ``efficientmoe`` run to this path.
    init_from: a run folder whose last checkpoint every method starts from (routing of a
    trained model is steadier than at initialisation, which is where static capacities are
    decided in practice); its learning rate continues at the schedule's floor (10% of peak)
    with no warm-up.
    """
    methods = list(methods or MEASURED_METHODS)
    rows = []
    for method in methods:
        if method not in MEASURED_METHODS:
            raise ValueError(f"measured method must be one of {list(MEASURED_METHODS)}, "
                             f"but got {method!r}.")
        cf, online = MEASURED_METHODS[method]
        cfg = copy.deepcopy(base)
        cfg.moe.capacity_factor = cf
        cfg.efficientmoe.enabled = online
        cfg.train.eval_every = cfg.train.steps = steps or cfg.train.steps
        cfg.train.save_every = cfg.train.steps
        if init_from:
            cfg.train.warmup_steps = 0
            cfg.train.learning_rate = 0.1 * base.train.learning_rate
            if online and not cfg.efficientmoe.history and os.path.isfile(
                    os.path.join(init_from, "trace.npz")):
                # the continued run's routing: plan before the first compilation
                cfg.efficientmoe.history = init_from
        with tempfile.TemporaryDirectory(prefix=f"bench-{method}-") as out:
            logger.info("measured run: %s (%d steps)", method, cfg.train.steps)
            run = _run_one(cfg, out, init_from)
            if keep_trace and method == "efficientmoe":
                shutil.copyfile(os.path.join(out, "trace.npz"), keep_trace)
        times = np.array(run["step_times"])
        # drop the compiling first step and every step right after a recompilation
        skip = {0} | set(run["replans"])
        steady = [t for i, t in enumerate(times) if i not in skip] or list(times)
        tot = run["totals"]
        rows.append({
            "evidence": "measured", "workload": workload, "method": method,
            "step_time_s": float(np.median(steady)),
            "padding_fraction": 1.0 - tot["kept"] / max(1, tot["rows"]),
            "drop_rate": 1.0 - tot["kept"] / max(1, tot["assigned"]),
            "final_val_loss": run["result"].final_val_loss,
            "steps": cfg.train.steps, "replans": len(run["replans"])})
    dropless = [r for r in rows if r["method"] == "dropless-static"]
    for r in rows:
        if dropless:
            r["step_time_vs_dropless"] = r["step_time_s"] / dropless[0]["step_time_s"]
    return rows
