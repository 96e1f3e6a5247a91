#!/usr/bin/env python
"""Where the test suite's CPU goes in its expert-parallel ranks, measured (MindSpore on this CPU).

Measurements on the tests' tiny expert-parallel config (2 layers, 4 experts; grouped
dispatch at W = 1 without msrun for the first two), each in fresh child processes,
``--repeat`` times:

- ``worker``: CPU seconds (user + system) of a whole W = 1 run of ``ep_worker.worker_main``
  (3 steps: imports, both graph compiles, the steps), with glibc's malloc and with mimalloc
  preloaded as ``make test`` does (``LD_PRELOAD`` of the venv's cmeel-mimalloc,
  ``MIMALLOC_ALLOW_THP=0 MIMALLOC_PURGE_DELAY=-1``; also with transparent huge pages allowed);
- ``compile``: CPU seconds of the first ``train_step`` call (its compile) of
  ``ExpertParallelTrainer``, as built and with ``GradReducer.construct`` replaced by the
  identity: the reducer's share of the compile;
- ``one-process``: CPU and wall seconds of the one-process ``ms-efficient train
  configs/gpt_moe_tiny.yaml --steps N`` (the demo's model; ``--steps``, default 50), with the
  graph pipeline off (what ``train`` sets in its process on CPU) and on (the user's
  ``MS_DEV_RUNTIME_CONF=graph_pipeline:True``, which it keeps); ``same_losses``: every
  logged loss of the setting's last run equals the first run's with the pipeline off;
- ``workers`` (when msrun is on PATH): CPU and wall seconds of ``ms-efficient train --workers
  W`` (W = 2 and 4, 20 steps, the tests' config with a forced re-plan), with MindSpore's graph
  pipeline off (what the launcher sets on CPU: ``core.backend.runtime_conf``) and on (the
  user's ``MS_DEV_RUNTIME_CONF=graph_pipeline:True``, which the launcher keeps).

Prints a table and JSON (``core.benchio`` rows, evidence "measured"; ``--json`` writes it).

    PATH=.venv/bin:$PATH python scripts/time_test_compiles.py [--repeat 3] [--json out.json]
        [--only worker|compile|one-process|workers ...] [--steps 50]
"""
import argparse
import glob
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from conftest import tiny_config_dict, write_corpus  # noqa: E402  (the tests' own config)
from ms_efficient.core.benchio import markdown_table, write_bench_json  # noqa: E402
from ms_efficient.train.report import read_metrics  # noqa: E402

PARTS = ("worker", "compile", "one-process", "workers")
WORKER = ("import sys\n"
          "from ms_efficient.train.ep_worker import worker_main\n"
          "sys.exit(worker_main(sys.argv[1:]))\n")
COMPILE = ("import sys, time\n"
           "import numpy as np\n"
           "from mindspore import Tensor\n"
           "from ms_efficient.core.config import load_config\n"
           "from ms_efficient.train import expert_parallel as ep\n"
           "def identity(self, grads):\n"
           "    return grads\n"
           "if sys.argv[3] == 'identity':\n"
           "    ep.GradReducer.construct = identity\n"
           "cfg = load_config(sys.argv[1])\n"
           "t = ep.ExpertParallelTrainer(cfg, sys.argv[2])\n"
           "x = Tensor(np.zeros((t.local_batch, cfg.model.seq_length), np.int32))\n"
           "start = time.process_time()\n"
           "t.train_step(x, x)\n"
           "print('compile_cpu_s', time.process_time() - start)\n")


def mimalloc() -> str:
    """The venv's libmimalloc (what ``make test`` preloads), or ''."""
    found = glob.glob(os.path.join(os.path.dirname(os.path.dirname(sys.executable)), "lib",
                                   "python3*", "site-packages", "cmeel.prefix", "lib",
                                   "libmimalloc.so.3"))
    return found[0] if found else ""


def child(code: str, args, env_extra) -> tuple:
    """Run ``code`` as a script file (MindSpore parses the source of what it compiles) with
    ``args`` and ``env_extra``: (CPU seconds of the child, stdout)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               GLOG_v="3", **env_extra)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as fh:
        fh.write(code)
    try:
        proc = subprocess.run([sys.executable, fh.name, *map(str, args)], env=env,
                              capture_output=True, text=True)
    finally:
        os.unlink(fh.name)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"child failed (rc={proc.returncode}):\n{proc.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, proc.stdout


def launch(config: str, workers, out: str, pipeline: str, extra=()) -> tuple:
    """``ms-efficient train CONFIG --workers W --out OUT EXTRA`` (no ``--workers`` when
    ``workers`` is None: one process) with ``MS_DEV_RUNTIME_CONF`` set to ``pipeline`` (""
    leaves it unset): (CPU seconds of the launch and its ranks, wall seconds)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               GLOG_v="3")
    env.pop("MS_DEV_RUNTIME_CONF", None)
    if pipeline:
        env["MS_DEV_RUNTIME_CONF"] = pipeline
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "ms_efficient.cli", "train", config, "--out", out, *extra]
    if workers is not None:
        cmd += ["--workers", str(workers)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"train --workers {workers} failed (rc={proc.returncode}):\n"
                           f"{proc.stderr[-2000:]}")
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), wall


def _losses(run_dir: str) -> list:
    """The (step, loss) of every train row of ``run_dir``'s metrics.jsonl."""
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir) if r["kind"] == "train"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs of each row (>= 1)")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--only", choices=PARTS, action="append",
                        help="measure only these parts (repeatable; default: all)")
    parser.add_argument("--steps", type=int, default=50,
                        help="steps of the one-process runs of configs/gpt_moe_tiny.yaml")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"'--repeat' must be >= 1, but got {args.repeat}.")
    if args.steps < 1:
        parser.error(f"'--steps' must be >= 1, but got {args.steps}.")
    tmp = tempfile.mkdtemp(prefix="time_test_compiles_")
    cfg = tiny_config_dict(write_corpus(__import__("pathlib").Path(tmp) / "corpus"),
                           os.path.join(tmp, "run"))
    cfg["moe"].update(trace_ranks=1, dispatch="grouped")
    cfg["train"].update(steps=3, log_every=1, eval_every=3, save_every=3)
    config = os.path.join(tmp, "ep.yaml")
    with open(config, "w", encoding="utf-8") as fh:
        yaml.safe_dump(cfg, fh)

    lib = mimalloc()
    allocators = {"glibc": {}}
    if lib:
        allocators["mimalloc (make test)"] = {"LD_PRELOAD": lib, "MIMALLOC_ALLOW_THP": "0",
                                              "MIMALLOC_PURGE_DELAY": "-1"}
        allocators["mimalloc, THP allowed"] = {"LD_PRELOAD": lib, "MIMALLOC_PURGE_DELAY": "-1"}
    parts = set(args.only or PARTS)
    rows = []
    for name, extra in (allocators.items() if "worker" in parts else ()):
        runs = [child(WORKER, [config, "--out", os.path.join(tmp, f"w{len(rows)}_{i}")],
                      extra)[0] for i in range(args.repeat)]
        rows.append({"evidence": "measured", "workload": "W=1 EP worker, 3 steps",
                     "method": name, "cpu_s_mean": round(sum(runs) / len(runs), 2),
                     "cpu_s_runs": [round(r, 2) for r in runs]})
    for reducer in (("as built", "identity") if "compile" in parts else ()):
        runs = []
        for i in range(args.repeat):
            out = child(COMPILE, [config, os.path.join(tmp, f"c{reducer[0]}{i}"), reducer],
                        {})[1]
            runs.append(float(out.split("compile_cpu_s")[-1].split()[0]))
        rows.append({"evidence": "measured", "workload": "EP train_step compile (W=1)",
                     "method": f"GradReducer {reducer}",
                     "cpu_s_mean": round(sum(runs) / len(runs), 2),
                     "cpu_s_runs": [round(r, 2) for r in runs]})
    demo = os.path.join(ROOT, "configs", "gpt_moe_tiny.yaml")
    for tag, name, pipeline in ((("off", "graph pipeline off (train's default on CPU)", ""),
                                 ("on", "graph pipeline on", "graph_pipeline:True"))
                                if "one-process" in parts else ()):
        runs = [launch(demo, None, os.path.join(tmp, f"one_{tag}_{i}"), pipeline,
                       ["--steps", str(args.steps)]) for i in range(args.repeat)]
        cpu = [r[0] for r in runs]
        rows.append({"evidence": "measured",
                     "workload": f"train configs/gpt_moe_tiny.yaml, {args.steps} steps, "
                                 "one process",
                     "method": name, "cpu_s_mean": round(sum(cpu) / len(cpu), 2),
                     "cpu_s_runs": [round(c, 2) for c in cpu],
                     "wall_s_runs": [round(r[1], 1) for r in runs],
                     # every logged loss of every run of either setting, the same?
                     "same_losses": _losses(os.path.join(tmp, f"one_{tag}_{args.repeat - 1}"))
                     == _losses(os.path.join(tmp, "one_off_0"))})
    msrun = shutil.which("msrun") or shutil.which("msrun", path=os.path.dirname(sys.executable))
    if "workers" in parts and msrun:
        cfg["moe"]["dispatch"] = "balanced"
        cfg["train"].update(steps=20, log_every=1, eval_every=10, save_every=5)
        cfg["efficientmoe"] = {"enabled": True, "force_replan_step": 16}
        cfg["cluster"] = {"preset": "cpu-local", "devices_per_node": 4}
        config = os.path.join(tmp, "ep_workers.yaml")
        with open(config, "w", encoding="utf-8") as fh:
            yaml.safe_dump(cfg, fh)
        for workers in (2, 4):
            for tag, name, pipeline in (
                    ("off", "graph pipeline off (launcher default on CPU)", ""),
                    ("on", "graph pipeline on", "graph_pipeline:True")):
                runs = [launch(config, workers, os.path.join(tmp, f"w{workers}_{tag}_{i}"),
                               pipeline) for i in range(args.repeat)]
                cpu = [r[0] for r in runs]
                rows.append({"evidence": "measured",
                             "workload": f"train --workers {workers}, 20 steps (balanced)",
                             "method": name, "cpu_s_mean": round(sum(cpu) / len(cpu), 2),
                             "cpu_s_runs": [round(c, 2) for c in cpu],
                             "wall_s_runs": [round(r[1], 1) for r in runs]})
    elif "workers" in parts:
        print("msrun is not on PATH: no 'train --workers' rows (PATH=.venv/bin:$PATH)")
    print(markdown_table(rows))
    print(json.dumps({"benchmark": "test suite CPU parts", "rows": rows}, indent=1))
    if args.json:
        write_bench_json(args.json, "test suite CPU parts", rows, {"mimalloc": lib})
    return 0


if __name__ == "__main__":
    sys.exit(main())
