"""The 2-worker msrun checks of the tests (tests/dist/*.py): the worker-script loader, and the
one msrun job that runs all of them (tests/dist/run_checks.py, through
scripts/msrun_launcher.sh, so the launcher is tested too).

Each msrun launch costs ~15-20 s of start-up on 2 cores, so the checks share one job
(``start_checks``, ``checks_dir``): check NAME's results are in ``checks_dir() / NAME``. A
failed job fails every test that reads it, with the workers' logs.

That job and the other slow fixtures whose work is child processes are computed in a
background thread while the suite runs: ``in_background`` registers the function of a
fixture, conftest moves the tests that use one to the end of the session and queues the
functions once the selected tests are known, and ``background_result`` waits for a value (or
re-raises its exception). The session fixture ``dist_checks`` is the checks' folder.
"""
import functools
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ms_efficient.core import backend

REPO = Path(__file__).resolve().parents[1]
LAUNCHER = REPO / "scripts" / "msrun_launcher.sh"
# msrun from PATH, else the one installed beside this interpreter (the project's venv)
MSRUN = shutil.which("msrun") or shutil.which("msrun", path=os.path.dirname(sys.executable))
needs_msrun = pytest.mark.skipif(MSRUN is None,
                                 reason="msrun is not on PATH (e.g. PATH=.venv/bin:$PATH)")


def load_script(name: str):
    """tests/dist/<name>.py as a module (its constants and numpy input generators)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "tests" / "dist" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


WORLD = 2                    # workers of the checks' job
TIMEOUT_S = 480              # for the whole job (each check alone took 20-45 s, 80 s loaded)


class _Job:
    """The checks' msrun job: Popen, its run folder, and the failure message once finished."""
    proc = run_dir = error = None
    finished = False


_job = _Job()


def start_checks() -> None:
    """Launch ``python tests/dist/run_checks.py OUT_DIR`` on WORLD local workers in a fresh
    temporary folder (msrun's working dir: MindSpore may write rank_*/ there), without
    waiting; once per session."""
    if _job.proc is not None or MSRUN is None:
        return
    _job.run_dir = temporary_dir("checks_")
    _job.proc = launch("run_checks", _job.run_dir, WORLD)


@functools.lru_cache(maxsize=None)
def _verify_pass_built() -> bool:
    """Build the verification pass here (cached for every process) before the first job, so
    that its ranks (check_balanced_ep records its compile) load it instead of all building it
    at once; False where it cannot be built (the ranks then record nothing)."""
    from ms_efficient.verify import plugin

    if not plugin.verify_available():
        return False
    try:
        plugin.build_plugin()
    except plugin.VerifyUnavailable:
        return False
    return True


def launch(name: str, run_dir: Path, world: int) -> subprocess.Popen:
    """Start ``python tests/dist/<name>.py RUN_DIR/out`` on ``world`` local msrun workers
    (logs in RUN_DIR/log, msrun's working dir RUN_DIR), without waiting."""
    _verify_pass_built()
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([os.path.dirname(MSRUN), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH", "")] if p)
    # CPU ranks as `train --workers` starts them: MindSpore's graph pipeline off
    env["MS_DEV_RUNTIME_CONF"] = backend.runtime_conf("CPU", env.get("MS_DEV_RUNTIME_CONF", ""))
    script = REPO / "tests" / "dist" / f"{name}.py"
    command = ["bash", str(LAUNCHER), f"python {script} {run_dir / 'out'}", str(world),
               str(world), "127.0.0.1", str(free_port()), "0", str(run_dir / "log"),
               "True", "60"]
    return subprocess.Popen(command, cwd=run_dir, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def run(name: str, world: int, timeout_s: float = TIMEOUT_S) -> Path:
    """:func:`launch` of check ``name`` alone (its script runs run_checks.main on it) in a
    fresh temporary folder and wait: the check's folder OUT_DIR/NAME once every rank wrote
    done_rank<r>.json there; else an AssertionError with the workers' logs."""
    run_dir = temporary_dir(f"{name}_{world}_")
    proc = launch(name, run_dir, world)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
    out_dir = run_dir / "out" / name
    if proc.returncode != 0 or not all((out_dir / f"done_rank{r}.json").exists()
                                       for r in range(world)):
        logs = "\n".join(f"--- {p.name} ---\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted((run_dir / "log").glob("*.log")))
        raise AssertionError(f"msrun {name} on {world} workers failed (rc={proc.returncode})."
                             f"\n{stdout[-2000:]}\n{stderr[-2000:]}\n{logs}")
    return out_dir


def checks_dir() -> Path:
    """Wait for the job (starting it if nobody has) and return its OUT_DIR; fail with the
    workers' logs unless every rank finished every check (wrote NAME/done_rank<r>.json)."""
    if MSRUN is None:
        pytest.skip("msrun is not on PATH")
    start_checks()
    out_dir, log_dir = _job.run_dir / "out", _job.run_dir / "log"
    if not _job.finished:
        _job.finished = True
        try:
            stdout, stderr = _job.proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            stop_checks()
            stdout, stderr = _job.proc.communicate()
        names = load_script("run_checks").CHECKS
        if _job.proc.returncode != 0 or not all((out_dir / n / f"done_rank{r}.json").exists()
                                                for n in names for r in range(WORLD)):
            logs = "\n".join(f"--- {p.name} ---\n{p.read_text(errors='replace')[-3000:]}"
                             for p in sorted(log_dir.glob("*.log")))
            _job.error = (f"msrun failed (rc={_job.proc.returncode}).\n{stdout[-2000:]}\n"
                          f"{stderr[-2000:]}\n{logs}")
    if _job.error:
        pytest.fail(_job.error)
    return out_dir


def stop_checks() -> None:
    """Kill the job if it still runs (msrun, its scheduler and workers: its process group)."""
    if _job.proc is not None and _job.proc.poll() is None:
        os.killpg(_job.proc.pid, signal.SIGKILL)
        _job.proc.wait()


_KILL_WATCHER = """
import json, os, signal, subprocess, sys, time
state, step, poll_s, timeout_s, marker = (sys.argv[1], int(sys.argv[2]), float(sys.argv[3]),
                                          float(sys.argv[4]), sys.argv[5])
proc = subprocess.Popen(sys.argv[6:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                        start_new_session=True)

def tree(root):
    # root and every process descending from it (msrun starts its ranks in new sessions,
    # so a process group does not reach them)
    children = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(pid))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out

def read_step():
    if not os.path.isfile(state):
        return 0
    with open(state) as fh:
        return json.load(fh)["step"]

reached, deadline = 0, time.monotonic() + timeout_s
try:
    while time.monotonic() < deadline and proc.poll() is None:
        if marker != "-":
            if os.path.exists(marker):
                reached = read_step()
                break
        else:
            reached = read_step()
            if reached >= step:
                break
        time.sleep(poll_s)
finally:
    if proc.poll() is None:
        for pid in tree(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    proc.wait()
print(reached)
"""


def run_and_kill(command, state_path, step: int, poll_s: float, env=None,
                 timeout_s: float = 240, marker=None) -> int:
    """Start ``command`` (in its own session) and SIGKILL it and every process descending
    from it (msrun's ranks too) once ``state_path`` (a run's state.json) names ``step`` or a
    later one, or, given ``marker``, once that file exists; the step state.json named then
    (0 if it never appeared). The polling and the kill are done by a small watcher process,
    not by this thread: a background thread could be held back by the main thread's
    MindSpore calls and kill late."""
    out = subprocess.run([sys.executable, "-c", _KILL_WATCHER, str(state_path), str(step),
                          str(poll_s), str(timeout_s), str(marker or "-"), *map(str, command)],
                         env=env, capture_output=True, text=True, timeout=timeout_s + 60)
    assert out.returncode == 0, out.stderr[-3000:]
    return int(out.stdout.split()[-1])


def run_cli(args, env=None, cwd=None) -> subprocess.CompletedProcess:
    """``python -m ms_efficient.cli ARGS`` in a child process with this repository first on
    PYTHONPATH (stdout and stderr captured)."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH", "")] if p)
    return subprocess.run([sys.executable, "-m", "ms_efficient.cli", *map(str, args)], env=env,
                          cwd=cwd, capture_output=True, text=True)


_BACKGROUND = {}             # fixture name -> the function computing its value
_FUTURES = {}                # fixture name -> its Future, once queued
_POOL = None                 # the thread that computes them
_DIRS = []                   # temporary_dir's folders


def temporary_dir(prefix: str) -> Path:
    """A fresh folder for work started before any test (no tmp_path yet), deleted by
    ``cleanup`` at the session's end."""
    _DIRS.append(Path(tempfile.mkdtemp(prefix="ms_efficient_" + prefix)))
    return _DIRS[-1]


def cleanup() -> None:
    """At the session's end (also an early one, -x or Ctrl-C): drop the background
    computations not started yet, stop the checks' job if it still runs, delete the
    folders."""
    if _POOL is not None:
        _POOL.shutdown(wait=False, cancel_futures=True)
    stop_checks()
    for folder in _DIRS:
        shutil.rmtree(folder, ignore_errors=True)


def in_background(fixture_name: str):
    """Decorator: ``fn()`` computes the value of fixture ``fixture_name`` in the background
    thread, queued when collection ends if a selected test uses that fixture (conftest), so
    its child processes overlap the tests that run before it."""
    def register(fn):
        _BACKGROUND[fixture_name] = fn
        return fn
    return register


def start_background(fixture_names) -> None:
    """Queue the registered computations of ``fixture_names`` (in that order) that are not
    queued yet. One thread runs them one after another: with the tests in the main thread,
    that is about what 2 cores hold."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="background")
    for name in fixture_names:
        if name in _BACKGROUND and name not in _FUTURES:
            _FUTURES[name] = _POOL.submit(_timed, name)


_TIMES = {}                  # fixture name -> (start, end) of its computation (perf_counter)
_T0 = time.perf_counter()    # about when the session started (this module's import)


def _timed(name: str):
    start = time.perf_counter()
    try:
        return _BACKGROUND[name]()
    finally:
        _TIMES[name] = (start - _T0, time.perf_counter() - _T0)


def timeline() -> str:
    """When each background computation ran, in seconds from the session's start (the
    terminal summary shows it: whether the background thread or the main one sets the
    session's length)."""
    return ", ".join(f"{name} {a:.0f}-{b:.0f} s" for name, (a, b) in
                     sorted(_TIMES.items(), key=lambda kv: kv[1]))


def background_result(fixture_name: str, skip_if_none: str = ""):
    """The value of a registered computation (queueing it if nobody has); re-raises its
    exception. A None value skips the test with the reason ``skip_if_none`` if one is given
    (the computation found nothing to run, e.g. an optional package missing)."""
    start_background([fixture_name])
    value = _FUTURES[fixture_name].result()
    if value is None and skip_if_none:
        pytest.skip(skip_if_none)
    return value


@in_background("dist_checks")
def _run_checks() -> Path:
    start_checks()
    return checks_dir()
