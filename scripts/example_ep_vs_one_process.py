#!/usr/bin/env python
"""Measure examples/moe_expert_parallel.py on W msrun workers against the same script in one
process (MindSpore on this CPU): per model, the largest relative difference over the steps
between the mean of the ranks' losses and the one-process loss of the global batch, the steps
in which the fast level copied an expert, and rows dropped. Prints a table and JSON
(``--json``).

    PATH=.venv/bin:$PATH python scripts/example_ep_vs_one_process.py \
        [--runs mixtral:2 deepseek:4] [--steps 20] [--json out.json]
"""
import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "moe_expert_parallel.py")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(command, cwd):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [ROOT, env.get("PYTHONPATH", "")] if p)
    proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"failed: {' '.join(command)}\n{proc.stdout[-2000:]}"
                         f"{proc.stderr[-2000:]}")


def measure(model: str, world: int, steps: int, root: str) -> dict:
    one, many = os.path.join(root, f"{model}_1"), os.path.join(root, f"{model}_{world}")
    _run([sys.executable, EXAMPLE, "--model", model, "--steps", str(steps), "--out", one], root)
    msrun = shutil.which("msrun") or os.path.join(os.path.dirname(sys.executable), "msrun")
    _run([msrun, "--worker_num", str(world), "--local_worker_num", str(world),
          "--master_port", str(_port()), "--log_dir", os.path.join(root, f"log_{model}"),
          "--join", "True", EXAMPLE, "--model", model, "--steps", str(steps), "--out", many],
         root)

    def rows(folder, rank):
        with open(os.path.join(folder, f"losses_rank{rank}.json")) as fh:
            return json.load(fh)["steps"]

    ref = rows(one, 0)
    ranks = [rows(many, r) for r in range(world)]
    worst = max(abs(sum(r[i]["loss"] for r in ranks) / world - ref[i]["loss"]) / ref[i]["loss"]
                for i in range(steps))
    return {"model": model, "workers": world, "steps": steps, "max_rel_loss_diff": worst,
            "steps_with_copies": sum(s["copies"] > 0 for s in ranks[0]),
            "rows_dropped": sum(s["dropped"] for s in ranks[0]),
            "first_loss": ref[0]["loss"], "last_loss": ref[-1]["loss"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="+", default=["mixtral:2", "deepseek:4"],
                        help="MODEL:WORKERS pairs")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="example_ep_") as root:
        results = [measure(m, int(w), args.steps, root)
                   for m, w in (r.split(":") for r in args.runs)]
    print("measured (MindSpore on this CPU): examples/moe_expert_parallel.py, W workers vs "
          "one process")
    print(f"{'model':<9}{'W':>3}{'steps':>7}{'max rel diff':>14}{'copy steps':>12}"
          f"{'dropped':>9}")
    for r in results:
        print(f"{r['model']:<9}{r['workers']:>3}{r['steps']:>7}{r['max_rel_loss_diff']:>14.2e}"
              f"{r['steps_with_copies']:>12}{r['rows_dropped']:>9}")
    print(json.dumps(results))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
