#!/usr/bin/env python
"""Time an msrun job that does nothing: W CPU workers import MindSpore, ``init()`` the
cluster and exit. What every multi-process test and ``train --workers`` pays before its
first compile and after its last step (scheduler start-up, the workers' connection retries,
the scheduler's finalize polls), measured (MindSpore on this CPU).

Each repeat launches ``msrun --worker_num W --local_worker_num W --join True`` through
scripts/msrun_launcher.sh in a fresh folder; wall seconds from the launch to msrun's exit,
CPU seconds of msrun and everything it started (``RUSAGE_CHILDREN``). Prints a table and
JSON (``--json``).

    PATH=.venv/bin:$PATH python scripts/time_msrun_startup.py [--workers 2] [--repeat 3]
"""
import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ms_efficient.core.fileio import atomic_write_text  # noqa: E402
from ms_efficient.train.ep_launch import _free_port  # noqa: E402  (train --workers' own)

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "msrun_launcher.sh")
WORKER = """import mindspore as ms
from mindspore.communication import init
ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
init()
"""


def time_once(workers: int) -> dict:
    """One empty job: {"wall_s", "cpu_s"}; raises RuntimeError with msrun's output if it
    fails."""
    folder = tempfile.mkdtemp(prefix="msrun_startup_")
    try:
        script = os.path.join(folder, "worker.py")
        with open(script, "w", encoding="utf-8") as fh:
            fh.write(WORKER)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        proc = subprocess.run(["bash", LAUNCHER, f"python {script}", str(workers), str(workers),
                               "127.0.0.1", str(_free_port()), "0",
                               os.path.join(folder, "log"), "True", "60"],
                              cwd=folder, capture_output=True, text=True)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode != 0:
            raise RuntimeError(f"msrun failed (rc={proc.returncode}):\n{proc.stdout[-2000:]}"
                               f"\n{proc.stderr[-2000:]}")
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2)}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2, help="msrun workers (>= 1)")
    parser.add_argument("--repeat", type=int, default=3, help="jobs to time (>= 1)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if args.workers < 1 or args.repeat < 1:
        parser.error(f"'--workers' and '--repeat' must be >= 1, but got {args.workers} and "
                     f"{args.repeat}.")
    if shutil.which("msrun") is None:
        parser.error("msrun is not on PATH; run with PATH=.venv/bin:$PATH.")
    rows = [dict(job=i, workers=args.workers, **time_once(args.workers))
            for i in range(args.repeat)]
    print("| job | workers | wall s | CPU s |\n|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['job']} | {r['workers']} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} |")
    body = {"benchmark": "msrun start-up (an empty job)", "evidence": "measured", "rows": rows}
    print(json.dumps(body, indent=1))
    if args.json:
        atomic_write_text(args.json, json.dumps(body, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
