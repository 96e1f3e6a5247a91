"""Measured check on this machine (issue item 6): train the reference model a few GRAPH-mode
steps with a plan's Cells recomputed (``Cell.recompute()``, or
``Cell.recompute(output_recompute=True)`` for recompute-all), in a fresh process, and report
the peak bytes MindSpore's allocator held during one step and the step time.

Peak memory: the MindSpore profiler (``mindspore.profiler.profile(activities=[CPU],
profile_memory=True)``) around one step after warm-up; the peak is the max of
"Total Allocated(Byte)" in ``*/FRAMEWORK/cpu_ms_memory_record_*.txt``. That is the dynamic
memory of the step (activations, gradients, workspaces); parameters live outside it.
``ru_maxrss`` is returned too but is no peak-activation measure: it is dominated by graph
compilation and framework memory (full recompute has the *higher* RSS, 1.5 vs 1.25 GB, on
the reference run because its graph is larger, while its allocator peak is 2.5x lower).

``measure_plan(model_dict, moe_dict, batch, recompute_names)`` spawns
``python -m ms_efficient.memopt.measure`` (one process per configuration) and returns
{"peak_bytes", "step_time_s", "step_cpu_s", ...}. MindSpore is imported only in the child,
which applies the plan with ``apply.apply_plan``.

``measured_check`` is the whole check:
    Step 1 measure the calibration plans (none, full recompute, recompute-only-attn,
        recompute the late half) and fit the estimated profile to them (``calibrate``);
    Step 2 budget = full + ``budget_fraction`` x (none - full), measured bytes: below the
        unoptimised peak, above what recompute on every Cell reaches; the planners get it
        less the calibration's largest residual (the model's known error);
    Step 3 plan every method on the calibrated profile, apply the plan, measure. The attn
        and ffn sub-Cells meet at residual adds outside them, so MindSpore recomputes each
        recompute-all Cell alone (``env.OUTPUTS_MEET_OUTSIDE``): the profile charges it as
        recompute, the budget-aware planners get keep / recompute, and chen-sqrt's segments
        cost what full recompute costs;
    Step 4 (``recompute_all``) recompute-all where it merges: whole blocks (each holds its
        residual adds, so block i's output is block i+1's input); recompute on every block
        and recompute-all on the first half / all but the last block, each peak as a share
        of the unoptimised one against the simulated share (``info["recompute_all_blocks"]``).
A plan measured once is not measured again (same program).

Reference model (``REFERENCE``): configs/gpt_moe_tiny.yaml (byte vocabulary, 4 blocks, 8
experts top-2 in every block, capacity 1.25) shrunk so activations dominate and a step takes
~0.5 s on 2 cores: hidden 256 -> 64, FFN 512 -> 128, seq 128 -> 256, batch 16 -> 8. Allocator
peak unoptimised ~87 MiB against 2.5 MB of parameters.
"""
from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ms_efficient.core import backend

__all__ = ["measure_plan", "measured_check", "REFERENCE"]

# model, moe and batch of the measured check (see module docs for why these sizes)
REFERENCE: Dict[str, Any] = {
    "model": dict(vocab_size=256, seq_length=256, hidden_size=64, num_layers=4, num_heads=4,
                  ffn_hidden_size=128),
    "moe": dict(num_experts=8, top_k=2, capacity_factor=1.25, moe_every=1),
    "batch_size": 8,
}
MEASURED_METHODS = ("none", "full-recompute", "chen-sqrt", "checkmate-milp", "memopt")


def measure_plan(model: Dict[str, Any], moe: Dict[str, Any], batch_size: int,
                 recompute: List[str], steps: int = 10, timeout_s: float = 300.0,
                 recompute_all: Sequence[str] = ()) -> Dict[str, float]:
    """Measure ``steps`` GRAPH-mode training steps (after one compile step) with every Cell
    named in ``recompute`` (in the profile's layer order) recomputed, in a fresh process:
    ``Cell.recompute(output_recompute=True)`` (recompute-all) on those also in
    ``recompute_all``, ``Cell.recompute()`` on the others (applied by ``apply.apply_plan``).

    Returns {"peak_bytes": allocator peak of one step, "step_time_s": fastest wall-clock step
    (s), "step_time_median_s", "step_cpu_s": least process CPU seconds of a step,
    "rss_bytes", "compile_s", "load_avg_1min"}. Other jobs share this machine's 2 cores: the
    fastest step is the least disturbed wall-clock figure, and CPU seconds are not inflated
    by waiting (a full-recompute median moved by 4x between runs). Raises RuntimeError with
    the child's stderr tail if it fails."""
    spec = json.dumps({"model": model, "moe": moe, "batch_size": batch_size,
                       "recompute": list(recompute), "recompute_all": list(recompute_all),
                       "steps": steps})
    # MindSpore's graph pipeline off (core.backend.runtime_conf): with it the Python thread
    # spins while a step runs, and "step_cpu_s" counted the spinning (0.64 against 0.31 s
    # for the unoptimised reference model, the same allocator peak: docs/results.md; compare
    # with MS_DEV_RUNTIME_CONF=graph_pipeline:True, which this keeps)
    return backend.run_json_child("ms_efficient.memopt.measure", spec, backend.CPU, timeout_s,
                                  "measurement process", extra_env={"GLOG_v": "3"})


def measured_check(rl, methods=MEASURED_METHODS, budget_fraction: float = 0.5,
                   steps: int = 10, reference: Optional[Dict[str, Any]] = None,
                   measure: Optional[Callable[..., Dict[str, float]]] = None,
                   jobs: int = 1, recompute_all: bool = True
                   ) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    """Run the measured check (module docs) and return (rows, calibration info).

    rl: RLConfig for memopt. budget_fraction in (0, 1): where the budget sits between the
    measured peaks of full recompute (0) and none (1). measure: ``measure_plan`` (default) or
    a stand-in with its signature (tests). jobs: calibration processes run at once (>1 is
    faster; peaks are unaffected, step times are disturbed, so the bench uses 1).
    Rows: {"evidence": "measured", "workload", "method", "budget_bytes", "batch",
    "peak_bytes" (measured), "simulated_peak_bytes" (calibrated model, of the plan),
    "step_time_s" (measured, fastest
    step), "step_time_median_s", "step_cpu_s", "load_avg_1min" (of the machine when the
    process ended), "fits" (measured peak <= budget), "throughput_vs_full_recompute"
    (fitting rows, from CPU seconds per step), "recomputed_cells", "planning_time_s",
    "max_batch"}; info: the budget, the planning margin, every calibration measurement and
    the fitted parameters, the Cells each method recomputed, the Step 4 rows
    ("recompute_all_blocks": method, actions, peak_bytes, simulated_peak_bytes, peak_share,
    simulated_peak_share), the number of processes. recompute_all: run Step 4.
    """
    from ms_efficient.core.cluster import get_cluster
    from ms_efficient.core.config import ModelConfig, MoEConfig
    from ms_efficient.memopt.calibrate import calibrate_profile, calibration_plans
    from ms_efficient.memopt.env import (KEEP, OUTPUTS_MEET_OUTSIDE, RECOMPUTE_ALL, evaluate,
                                         realisable_actions)
    from ms_efficient.memopt.planner import plan_with
    from ms_efficient.memopt.profile import profile_from_model

    if not 0.0 < budget_fraction < 1.0:
        raise ValueError(f"'budget_fraction' must be in (0, 1), but got {budget_fraction}.")
    ref = reference or REFERENCE
    measure = measure or measure_plan
    cpu = get_cluster("cpu-local")
    link = cpu.host_link
    estimate = profile_from_model(ModelConfig(**ref["model"]), MoEConfig(**ref["moe"]),
                                  ref["batch_size"], cpu, "float32")
    # attn and ffn sub-Cells meet at residual adds outside them: recompute-all is recompute
    estimate.meta[OUTPUTS_MEET_OUTSIDE] = True
    runs: Dict[Tuple[Tuple[str, ...], Tuple[str, ...]], Dict[str, float]] = {}

    def run(plan, names=estimate.names) -> Tuple[List[str], Dict[str, float]]:
        cells = [n for n, a in zip(names, plan.actions) if a != KEEP]
        dropped = [n for n, a in zip(names, plan.actions) if a == RECOMPUTE_ALL]
        key = (tuple(cells), tuple(dropped))
        if key not in runs:
            runs[key] = measure(ref["model"], ref["moe"], ref["batch_size"], cells,
                                steps=steps, recompute_all=dropped)
        return cells, runs[key]

    # Step 1: measure the calibration plans, fit the profile to them
    calib = calibration_plans(estimate)
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        calib_runs = dict(zip(calib, pool.map(lambda plan: run(plan)[1], calib.values())))
    profile = calibrate_profile(estimate, [(calib[n], calib_runs[n]["peak_bytes"]) for n in calib],
                                link, none_step_time_s=calib_runs["none"]["step_time_s"])
    # Step 2: the budget, in measured bytes
    none_peak = calib_runs["none"]["peak_bytes"]
    full_peak = calib_runs["full-recompute"]["peak_bytes"]
    budget = full_peak + budget_fraction * (none_peak - full_peak)
    margin = float(np.abs(profile.meta["fit_error_bytes"]).max())
    # Step 3: plan, apply, measure; recompute-all is recompute on these sub-Cells (Step 1)
    actions = tuple(a for a in realisable_actions("CPU") if a != RECOMPUTE_ALL)
    rows, applied = [], {}
    for method in methods:
        start = time.perf_counter()
        try:
            plan, _ = plan_with(method, profile, budget - margin, link, rl, actions=actions)
        except ValueError as err:
            rows.append({"evidence": "measured", "workload": "gpt-moe-tiny-cpu",
                         "method": method, "budget_bytes": int(budget), "error": str(err)})
            continue
        planning_s = time.perf_counter() - start
        cells, m = run(plan)
        applied[method] = cells
        rows.append({"evidence": "measured", "workload": "gpt-moe-tiny-cpu", "method": method,
                     "budget_bytes": int(budget), "batch": ref["batch_size"],
                     "peak_bytes": int(m["peak_bytes"]),
                     "simulated_peak_bytes": int(evaluate(profile, plan, budget,
                                                          link).peak_bytes),
                     "step_time_s": m["step_time_s"],
                     "step_time_median_s": m["step_time_median_s"],
                     "step_cpu_s": m.get("step_cpu_s"), "load_avg_1min": m.get("load_avg_1min"),
                     "fits": m["peak_bytes"] <= budget, "recomputed_cells": len(cells),
                     "planning_time_s": planning_s, "max_batch": None})
    # Step 4: recompute-all on whole blocks (chained, so MindSpore merges adjacent ones)
    blocks = (_recompute_all_rows(ref, cpu, run, runs[((), ())]["peak_bytes"])
              if recompute_all else [])
    # throughput from CPU seconds: other jobs on this machine move wall-clock steps by 2x
    full_cpu = runs[(tuple(estimate.names), ())].get("step_cpu_s") or 0.0
    for row in rows:
        if row.get("fits") and row.get("step_cpu_s") and full_cpu:
            row["throughput_vs_full_recompute"] = full_cpu / row["step_cpu_s"]
    info = {"reference": ref, "budget_bytes": budget, "planning_margin_bytes": margin,
            "calibration": {name: {"recompute": [n for n, a in zip(estimate.names, p.actions)
                                                 if a != KEEP], **calib_runs[name]}
                            for name, p in calib.items()},
            "fit": {k: profile.meta[k] for k in ("static_bytes", "interior_scale",
                                                  "workspace_per_interior", "fit_error_bytes",
                                                  "time_scale")},
            "recompute": applied, "recompute_all_blocks": blocks, "processes": len(runs)}
    return rows, info


def _recompute_all_rows(ref: Dict[str, Any], cluster, run, none_peak: float
                        ) -> List[Dict[str, Any]]:
    """Step 4 of ``measured_check``: on the whole-block profile (``blocks.{i}``, each block
    holding its residual adds, so block i's output is block i+1's input), measure recompute
    on every block and recompute-all on the first half / all but the last block, and set
    each measured peak, as a share of the measured unoptimised peak ``none_peak``, against
    the simulated share of the estimated profile (scale-free: the estimate is not
    calibrated at this granularity)."""
    from ms_efficient.core.config import ModelConfig, MoEConfig
    from ms_efficient.memopt.env import (ACTION_NAMES, KEEP, RECOMPUTE, RECOMPUTE_ALL,
                                         MemoryPlan, evaluate)
    from ms_efficient.memopt.profile import profile_from_model

    est = profile_from_model(ModelConfig(**ref["model"]), MoEConfig(**ref["moe"]),
                             ref["batch_size"], cluster, "float32", split_blocks=False)
    L = est.num_layers
    sim_none = evaluate(est, MemoryPlan(np.full(L, KEEP)), float("inf"),
                        cluster.host_link).peak_bytes
    plans = {"recompute": [RECOMPUTE] * L,
             "recompute-all-first-half": [RECOMPUTE_ALL] * (L // 2) + [RECOMPUTE] * (L - L // 2),
             "recompute-all": [RECOMPUTE_ALL] * (L - 1) + [RECOMPUTE]}
    rows = []
    for label, actions in plans.items():
        plan = MemoryPlan(np.array(actions))
        _, m = run(plan, names=est.names)
        sim = evaluate(est, plan, float("inf"), cluster.host_link).peak_bytes
        rows.append({"evidence": "measured", "workload": "gpt-moe-tiny-cpu-blocks",
                     "method": label, "actions": [ACTION_NAMES[a] for a in plan.actions],
                     "peak_bytes": int(m["peak_bytes"]), "simulated_peak_bytes": int(sim),
                     "peak_share": m["peak_bytes"] / none_peak,
                     "simulated_peak_share": sim / sim_none,
                     "step_cpu_s": m.get("step_cpu_s")})
    return rows


def _allocator_peak_bytes(profiler_dir: str) -> float:
    """Max of "Total Allocated(Byte)" over the profiler's CPU memory records."""
    import csv
    import glob

    paths = glob.glob(os.path.join(profiler_dir, "*", "FRAMEWORK", "cpu_ms_memory_record_*.txt"))
    peak = 0.0
    for path in paths:
        with open(path, newline="", encoding="utf-8") as fh:
            for row in csv.DictReader(fh):
                peak = max(peak, float(row["Total Allocated(Byte)"]))
    if not paths or peak <= 0:
        raise RuntimeError(f"no CPU memory record with allocations under {profiler_dir}.")
    return peak


def _child(spec: Dict[str, Any]) -> Dict[str, float]:
    import resource
    import shutil
    import tempfile

    import mindspore as ms
    from mindspore import Tensor, nn
    from mindspore.profiler import ProfilerActivity, tensorboard_trace_handler

    from ms_efficient.core.config import ModelConfig, MoEConfig
    from ms_efficient.memopt.apply import apply_plan
    from ms_efficient.memopt.env import RECOMPUTE, RECOMPUTE_ALL, MemoryPlan
    from ms_efficient.models.gpt_moe import build_model

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    ms.set_seed(0)
    model, moe = ModelConfig(**spec["model"]), MoEConfig(**spec["moe"])
    net = build_model(model, moe, spec["batch_size"])
    names, dropped = list(spec["recompute"]), set(spec.get("recompute_all", ()))
    actions = [RECOMPUTE_ALL if n in dropped else RECOMPUTE for n in names]
    apply_plan(net, names, MemoryPlan(np.array(actions, dtype=np.int64)), "CPU")
    optimizer = nn.SGD(net.trainable_params(), 1e-3)
    grad_fn = ms.value_and_grad(net, None, optimizer.parameters, has_aux=True)

    @ms.jit
    def train_step(tokens, targets):
        (loss, _, _, _), grads = grad_fn(tokens, targets)
        optimizer(grads)
        return loss

    rng = np.random.default_rng(0)
    shape = (spec["batch_size"], model.seq_length)
    tokens = Tensor(rng.integers(0, model.vocab_size, shape).astype(np.int32))
    start = time.perf_counter()
    train_step(tokens, tokens).asnumpy()          # compile
    compile_s = time.perf_counter() - start
    wall, cpu = [], []
    for _ in range(spec["steps"]):
        start, start_cpu = time.perf_counter(), time.process_time()
        train_step(tokens, tokens).asnumpy()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    out_dir = tempfile.mkdtemp(prefix="memopt_prof_")
    try:
        with ms.profiler.profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                                 on_trace_ready=tensorboard_trace_handler(out_dir)) as prof:
            train_step(tokens, tokens).asnumpy()
            prof.step()
        peak = _allocator_peak_bytes(out_dir)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_bytes": peak, "step_time_s": float(np.min(wall)),
            "step_time_median_s": float(np.median(wall)), "step_cpu_s": float(np.min(cpu)),
            "rss_bytes": float(rss_kib) * 1024.0, "compile_s": compile_s,
            "load_avg_1min": os.getloadavg()[0]}


if __name__ == "__main__":      # the child's one JSON line on stdout, read by the parent
    sys.stdout.write(json.dumps(_child(json.loads(sys.argv[1]))) + "\n")
