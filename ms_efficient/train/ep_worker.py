"""msrun entry of ``ms-efficient train --workers W``: one rank of the expert-parallel run.

    msrun --worker_num=W ... ms_efficient/train/ep_worker.py CONFIG --out DIR [--steps N]
                                                               [--overwrite]
    msrun ... ms_efficient/train/ep_worker.py --resume DIR

(on a cluster: ``bash scripts/msrun_launcher.sh "python ms_efficient/train/ep_worker.py
CONFIG --out DIR" 16 8 ...`` on every node). ``ms_efficient`` must be importable (installed,
or its parent folder on PYTHONPATH). The training itself:
:class:`ms_efficient.train.expert_parallel.ExpertParallelTrainer`.
"""
import logging
import os
import sys
from typing import List, Optional


def worker_main(argv: Optional[List[str]] = None, configure_logging: bool = False) -> int:
    """One rank of ``train --workers W``: ``CONFIG --out DIR [--steps N] [--efficientmoe
    on|off] [--overwrite]`` or ``--resume DIR [--steps N]``. Initialises the communication when started
    by msrun (``MS_ROLE`` set), else runs as the only rank; ``configure_logging``: INFO
    records to stderr with the rank in each line (the msrun entry sets it)."""
    import argparse

    from ms_efficient.core import backend
    from ms_efficient.core.config import load_config
    from ms_efficient.train.ep_launch import load_run_config
    from ms_efficient.train.expert_parallel import ExpertParallelTrainer

    parser = argparse.ArgumentParser(prog="ms_efficient.train.ep_worker")
    parser.add_argument("config", nargs="?")
    parser.add_argument("--out")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--resume")
    parser.add_argument("--efficientmoe", choices=("on", "off"))
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an earlier run in the --out folder")
    args = parser.parse_args(argv)
    if os.environ.get("MS_ROLE"):
        from mindspore.communication import init

        init()
    if configure_logging:
        logging.basicConfig(level=logging.INFO, datefmt="%H:%M:%S", format=(
            f"%(asctime)s rank {backend.group_rank()} %(levelname)s %(name)s: %(message)s"))
    overrides = {}
    if args.steps is not None:
        overrides["train.steps"] = args.steps
    if args.efficientmoe is not None:
        overrides["efficientmoe.enabled"] = args.efficientmoe == "on"
    if args.resume:
        cfg, out = load_run_config(args.resume, overrides), args.resume
    else:
        if args.out:
            overrides["train.out_dir"] = args.out
        cfg = load_config(args.config, overrides)
        out = cfg.train.out_dir
    ExpertParallelTrainer(cfg, out, resume=bool(args.resume), overwrite=args.overwrite).run()
    return 0


if __name__ == "__main__":
    # run as a script, Python puts this folder first on sys.path: drop it, so that the
    # package's modules (data, report, ...) cannot shadow top-level modules of that name
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    sys.exit(worker_main(sys.argv[1:], configure_logging=True))
