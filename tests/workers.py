"""Launching the 2-worker msrun checks of the tests (tests/dist/*.py) through
scripts/msrun_launcher.sh: one place for the worker-script loader, the free port, the launch
and the wait that fails with the workers' logs."""
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

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


def start(name: str, run_dir: Path, world: int):
    """Launch ``python tests/dist/<name>.py OUT_DIR`` on ``world`` local workers without
    waiting: (process, out_dir, log_dir)."""
    out_dir, log_dir = run_dir / "out", run_dir / "log"
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([os.path.dirname(MSRUN), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH", "")] if p)
    script = REPO / "tests" / "dist" / f"{name}.py"
    command = ["bash", str(LAUNCHER), f"python {script} {out_dir}", str(world), str(world),
               "127.0.0.1", str(free_port()), "0", str(log_dir), "True", "60"]
    proc = subprocess.Popen(command, cwd=run_dir, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    return proc, out_dir, log_dir


def finish(proc, out_dir: Path, log_dir: Path, world: int, timeout_s: float = 240) -> None:
    """Wait for the workers; fail with their logs unless every rank wrote done_rank<r>.json."""
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    if proc.returncode != 0 or not all((out_dir / f"done_rank{r}.json").exists()
                                       for r in range(world)):
        logs = "\n".join(f"--- {p.name} ---\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted(log_dir.glob("*.log")))
        pytest.fail(f"msrun failed (rc={proc.returncode}).\n{stdout[-2000:]}\n"
                    f"{stderr[-2000:]}\n{logs}")
