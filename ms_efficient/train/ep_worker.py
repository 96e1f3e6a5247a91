"""msrun entry of ``ms-efficient train --workers W``: one rank of the expert-parallel run.

    msrun --worker_num=W ... ms_efficient/train/ep_worker.py CONFIG --out DIR [--steps N]
    msrun ... ms_efficient/train/ep_worker.py --resume DIR

(on a cluster: ``bash scripts/msrun_launcher.sh "python ms_efficient/train/ep_worker.py
CONFIG --out DIR" 16 8 ...`` on every node). ``ms_efficient`` must be importable (installed,
or its parent folder on PYTHONPATH). See :func:`ms_efficient.train.expert_parallel.worker_main`.
"""
import os
import sys

if __name__ == "__main__":
    # run as a script, Python puts this folder first on sys.path: drop it, so that the
    # package's modules (data, report, ...) cannot shadow top-level modules of that name
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    from ms_efficient.train.expert_parallel import worker_main

    sys.exit(worker_main(sys.argv[1:], configure_logging=True))
