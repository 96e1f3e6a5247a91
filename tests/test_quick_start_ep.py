"""The README's quick start, the commands that start msrun ranks (issue 48): ``train
--workers 2``, the user's msrun script, and the commands reading their run folders, as
written and in the README's order, with the substitutions of tests/test_quick_start.py.

They run in child processes in a temporary folder in the background from the session's
start (tests/workers.py: most of their time is msrun start-ups and the ranks' compiles);
the test reads what they left and then checks in this process that a resume of the
expert-parallel run refuses a --steps it has reached before msrun starts.
"""
import json

import pytest

import workers
from test_quick_start import QuickStart, _check_refusals, _needs_msrun, _option, shell_commands


@workers.in_background("quick_start_ep")
def _quick_start_ep():
    """(QuickStart without capsys, the commands it ran), or None without msrun."""
    if workers.MSRUN is None:
        return None
    commands = shell_commands()
    picked = [c for i, c in enumerate(commands) if i in _needs_msrun(commands)]
    quick_start = QuickStart(workers.temporary_dir("quick_start_ep_"))
    quick_start.write_configs(commands)
    for cmd in picked:
        quick_start.run(cmd)
    return quick_start, picked


@pytest.fixture(scope="module")
def quick_start_ep():
    """Named as its background computation, so conftest queues it when the session starts
    and runs the test reading it last."""
    return workers.background_result("quick_start_ep")


@pytest.mark.slow
@workers.needs_msrun
def test_expert_parallel_commands_and_msrun_run_as_written(quick_start_ep, monkeypatch, capsys):
    """The quick-start commands that start msrun ranks (``train --workers 2``, the user's
    script) and those reading their run folders ran as written; then a --workers resume of
    the expert-parallel run refuses a --steps it has reached, as does a one-process one."""
    quick_start, picked = quick_start_ep
    assert any(c["tool"] == "msrun" for c in picked)
    assert any(_option(c["argv"], "--workers") == "2" for c in picked)
    assert len(quick_start.outputs) == sum(c["tool"] == "ms-efficient" for c in picked)
    monkeypatch.chdir(quick_start.cwd)
    quick_start.capsys = capsys
    # an expert-parallel run (the README resizes it to 4 ranks) resumed on its ranks, on 2
    # and in one process: refused alike
    ep_runs = [f for f in quick_start.runs
               if json.loads((quick_start.cwd / f / "state.json").read_text()).get(
                   "world_size", 1) > 1]
    assert ep_runs, quick_start.runs
    run = ep_runs[0]
    _check_refusals(quick_start, run, quick_start.runs[run][1])
    _check_refusals(quick_start, run, quick_start.runs[run][1], extra=("--workers", "2"))
    _check_refusals(quick_start, run, quick_start.runs[run][1], extra=("--workers", "1"))
