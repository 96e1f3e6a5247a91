#!/usr/bin/env python
"""Time EfficientMoE's slow level (``efficientmoe.planner.plan_layout``: one re-plan of every
layer, its buffers priced by replaying the fast level on the last window of rows), and one
re-plan check during a run (``efficientmoe.planner.decide_home``: the new home table of the
last rows and the replayed gain against the layout of the trace's first half, what a
balanced training run's slow level does every ``efficientmoe.replan_every`` steps) on:

- a routing trace given by path (``--trace``, e.g. a 24-layer x 16-rank x 32-expert recording),
- a synthetic trace of DeepSeek-V3's shape: 58 MoE layers x 64 ranks x 256 experts, top-8,
  4,096 tokens per rank, hidden 7,168, expert FFN 2,048 (``moe.trace.synthetic_trace``).

Each case runs in a fresh process (so peak memory is its own: ``ru_maxrss``) twice, and the
two layouts must be identical (deterministic planner). Then the whole command a user runs,
``ms-efficient plan moe --trace T --out layout.yaml`` (imports, the layout, the replay it
prints, the YAML), in a fresh process per run, three runs, the worst of the last two reported
with its peak memory (the first run writes Python's byte-code cache, as Python does by
default: ``PYTHONDONTWRITEBYTECODE`` is removed from the command's environment); the
DeepSeek-V3 case's trace is written to a temporary .npz with ``save_trace`` for it. Prints a
table and JSON (``--json``).

    python scripts/time_moe_planner.py --trace TRACE.npz [--json out.json]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ms_efficient.core.fileio import atomic_write_text  # noqa: E402

CHILD = r"""
import hashlib, json, resource, sys, time
import numpy as np
from ms_efficient.efficientmoe.cost import CostModel
from ms_efficient.efficientmoe.planner import LayoutConfig, decide_home, plan_layout
from ms_efficient.efficientmoe.replay import cluster_for_ranks
from ms_efficient.moe.trace import load_trace, synthetic_trace
case = sys.argv[1]
if case == "deepseek-v3":
    trace = synthetic_trace(steps=8, layers=58, ranks=64, experts=256, top_k=8,
                            tokens_per_rank=4096, hidden=7168)
    hidden, ffn = 7168, 2048
else:
    trace = load_trace(case)
    hidden = trace.hidden or 1024
    ffn = 4 * hidden
model = CostModel(cluster_for_ranks(trace.num_ranks), hidden, ffn)
digests, seconds, cpu = [], [], []
for _ in range(2):
    start, start_cpu = time.perf_counter(), time.process_time()
    layout = plan_layout(trace.counts, model, LayoutConfig())
    seconds.append(time.perf_counter() - start)
    cpu.append(time.process_time() - start_cpu)
    digests.append(hashlib.sha256(layout.home_LWS.tobytes() + layout.buffer_LW.tobytes()
                                  + layout.spare_W.tobytes()).hexdigest())
first = plan_layout(trace.counts[:max(1, trace.num_steps // 2)], model, LayoutConfig())
start, start_cpu = time.perf_counter(), time.process_time()
decide_home(trace.counts, first, LayoutConfig(), model, 200)
check_s, check_cpu = time.perf_counter() - start, time.process_time() - start_cpu
print(json.dumps({"layers": trace.num_layers, "ranks": trace.num_ranks,
                  "experts": trace.num_experts, "top_k": trace.top_k,
                  "seconds": max(seconds), "cpu_seconds": max(cpu), "check_seconds": check_s,
                  "check_cpu_seconds": check_cpu, "peak_rss_bytes":
                  resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "deterministic": digests[0] == digests[1]}))
"""


WRITE_DEEPSEEK = r"""
import sys
from ms_efficient.moe.trace import save_trace, synthetic_trace
save_trace(synthetic_trace(steps=8, layers=58, ranks=64, experts=256, top_k=8,
                           tokens_per_rank=4096, hidden=7168), sys.argv[1])
"""


def time_command(trace_path: str, root: str, runs: int = 3):
    """(wall seconds, peak RSS bytes) of ``ms-efficient plan moe`` on ``trace_path``: the
    worst of runs 2..``runs`` (module docstring)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = root
    command = [sys.executable, "-m", "ms_efficient.cli", "plan", "moe", "--trace", trace_path]
    results = []
    with tempfile.TemporaryDirectory(prefix="time_plan_moe_") as tmp:
        for _ in range(runs):
            start = time.perf_counter()
            proc = subprocess.Popen(command + ["--out", os.path.join(tmp, "layout.yaml")],
                                    cwd=root, env=env, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE)
            _, status, usage = os.wait4(proc.pid, 0)
            seconds = time.perf_counter() - start
            if status != 0:
                raise RuntimeError(f"ms-efficient plan moe failed on {trace_path}: "
                                   f"{proc.stderr.read().decode()[-2000:]}")
            proc.stderr.close()
            results.append((seconds, usage.ru_maxrss * 1024))
    return max(r[0] for r in results[1:]), max(r[1] for r in results[1:])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", action="append", default=[], help="routing trace .npz")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    rows = []
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    for case in args.trace + ["deepseek-v3"]:
        if case != "deepseek-v3" and not os.path.isfile(case):
            print(f"time_moe_planner: error: '--trace' {case!r} is not a file.", file=sys.stderr)
            return 2
        out = subprocess.run([sys.executable, "-c", CHILD, case], capture_output=True,
                             text=True, cwd=root, env=dict(os.environ, PYTHONPATH=root))
        if out.returncode != 0:
            print(out.stderr[-2000:], file=sys.stderr)
            return 1
        row = {"case": os.path.basename(case), **json.loads(out.stdout.splitlines()[-1])}
        with tempfile.TemporaryDirectory(prefix="time_moe_planner_") as tmp:
            path = case
            if case == "deepseek-v3":
                path = os.path.join(tmp, "deepseek_v3.npz")
                subprocess.run([sys.executable, "-c", WRITE_DEEPSEEK, path], check=True,
                               cwd=root, env=dict(os.environ, PYTHONPATH=root))
            row["command_seconds"], row["command_peak_rss_bytes"] = time_command(path, root)
        rows.append(row)
    print("| case | layers x ranks x experts, top-k | one re-plan, s (worst of 2; CPU s) | "
          "one re-plan check, s (CPU s) | peak memory, MiB | same plan twice | "
          "`plan moe` command, s | its peak memory, MiB |")
    print("|---|---|---:|---:|---:|---|---:|---:|")
    for r in rows:
        print(f"| {r['case']} | {r['layers']} x {r['ranks']} x {r['experts']}, top-{r['top_k']}"
              f" | {r['seconds']:.2f} ({r['cpu_seconds']:.2f}) | {r['check_seconds']:.2f} "
              f"({r['check_cpu_seconds']:.2f}) | {r['peak_rss_bytes'] / 2**20:.0f} | "
              f"{r['deterministic']} | {r['command_seconds']:.2f} | "
              f"{r['command_peak_rss_bytes'] / 2**20:.0f} |")
    text = json.dumps({"evidence": "measured (planner wall time on this CPU)", "rows": rows},
                      indent=1)
    print(text)
    if args.json:
        atomic_write_text(args.json, text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
