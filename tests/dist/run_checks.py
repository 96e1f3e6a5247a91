"""msrun worker running several of the checks in tests/dist in one 2-worker job.

Launched on every rank as ``python run_checks.py OUT_DIR [NAME ...]`` (default: every check
in CHECKS, in that order). MindSpore starts, joins the cluster and calls ``init()`` once; then
check NAME (tests/dist/NAME.py) runs ``check(OUT_DIR/NAME, rank, world)`` and, when it
returns, this rank writes ``OUT_DIR/NAME/done_rank<r>.json`` (the check's returned dict with
rank and world). One job for all of them because each msrun launch costs ~15-20 s of start-up
on 2 cores (scheduler, two MindSpore imports, cluster build) against a few seconds of checks.
Every check's script also runs alone: ``python NAME.py OUT_DIR`` is this runner with NAME
(its results in OUT_DIR/NAME).

Checks share the process, so each leaves the context as it found it: the mode, and the
auto-parallel context is reset after every check (check_collectives sets DATA_PARALLEL).
"""
import importlib
import json
import os
import sys

# The order they run in: check_collectives' data-parallel context last (it is reset anyway).
CHECKS = ("check_balanced_ep", "check_collectives")


def main(out_dir, names=CHECKS, mode="graph"):
    """Run ``names`` on this rank, in GRAPH_MODE (``mode`` "pynative": PYNATIVE_MODE)."""
    import mindspore as ms
    from mindspore.communication import get_group_size, get_rank, init

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)
    init()
    rank, world = get_rank(), get_group_size()
    for name in names:
        check_dir = os.path.join(out_dir, name)
        os.makedirs(check_dir, exist_ok=True)
        info = importlib.import_module(name).check(check_dir, rank, world) or {}
        ms.reset_auto_parallel_context()
        with open(os.path.join(check_dir, f"done_rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "world": world, **info}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or CHECKS)
