"""Run the test suite as two pytest sessions at once (what ``make test`` runs).

    python tests/run_lanes.py [PYTEST OPTIONS]

Lane A is every test module but those in LANE_B; lane B is LANE_B. Each session has the
background thread of tests/workers.py for the child processes its tests read (msrun jobs,
measurement processes). The lanes share no fixture: a module using ``shared_graphs`` or a
background fixture of lane A's stays in lane A. One session leaves a core idle whenever its
background jobs wait (an msrun job spends most of its 14-15 s start-up and shut-down
waiting, scripts/time_msrun_startup.py); the second session uses it. Lane A's output streams; lane B's
is printed when both have finished. The exit status is lane A's, or lane B's if A passed.
Extra arguments go to both sessions (e.g. ``-x``, ``--durations=15``).
"""
import os
import subprocess
import sys
import tempfile
import time

TESTS = os.path.dirname(os.path.abspath(__file__))

# About 40 % of the in-process tests' time, and background fixtures of their own (the measured
# memopt check, the mindcv children, the SIGKILL runs: about 140 s of lane A's background
# thread otherwise, which sets the suite's length); none shares a fixture with lane A.
LANE_B = ("test_cli.py", "test_dropout.py", "test_example_ep.py", "test_fast_level.py",
          "test_graph.py", "test_graph_size.py", "test_grouped_matmul.py", "test_kernels.py",
          "test_memopt.py", "test_moe_adopt_modern.py", "test_moe_balance.py",
          "test_moe_callback.py", "test_moe_capacity.py", "test_moe_counts.py",
          "test_moe_gated.py", "test_moe_grouped.py", "test_moe_layer.py", "test_moe_planners.py", "test_mpipe.py",
          "test_place_same_devices.py", "test_place_stages.py", "test_quick_start_ep.py",
          "test_routers.py", "test_run_folder.py",
          "test_shard_apply.py", "test_shard_ilp.py", "test_train.py", "test_zoo.py")


def main(argv) -> int:
    missing = [name for name in LANE_B if not os.path.isfile(os.path.join(TESTS, name))]
    if missing:
        print(f"run_lanes.py: LANE_B names missing test modules: {missing}", file=sys.stderr)
        return 4
    pytest = [sys.executable, "-m", "pytest", *argv]
    start = time.perf_counter()
    with tempfile.TemporaryFile(mode="w+") as b_out:
        lane_b = subprocess.Popen(pytest + [os.path.join(TESTS, n) for n in LANE_B],
                                  stdout=b_out, stderr=subprocess.STDOUT, text=True)
        try:
            status_a = subprocess.call(pytest + [TESTS] + [f"--ignore={os.path.join(TESTS, n)}"
                                                           for n in LANE_B])
            status_b = lane_b.wait()
        finally:
            if lane_b.poll() is None:
                lane_b.kill()
        b_out.seek(0)
        print(f"\n===== lane B ({len(LANE_B)} modules, run beside the session above) =====")
        print(b_out.read(), end="")
    print(f"\nboth lanes: {time.perf_counter() - start:.0f} s; exit status lane A {status_a}, "
          f"lane B {status_b}")
    return status_a or status_b


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
