"""``ms-efficient train --workers W``: start W expert-parallel ranks on this machine with msrun.

The command runs ``msrun --worker_num=W --local_worker_num=W`` on 127.0.0.1 (a free port) with
:mod:`ms_efficient.train.ep_worker` as the task, waits for it, and returns its status; msrun's
logs go to ``<run folder>/msrun_log``. The launcher holds the run folder's lock
(:mod:`ms_efficient.train.checkpoint`) from its checks to msrun's end and names it to the
ranks in ``MS_EFFICIENT_RUN_LOCK`` (rank 0 takes the lock itself when started by msrun
directly); a new run into a folder that holds another is refused before msrun starts
(``overwrite``: replaced, by the launcher, and the ranks are told). The workers run the ``python`` beside this interpreter
(its folder is put first on PATH) with this package's parent folder on PYTHONPATH. No
MindSpore import here: the parent process only checks the config and launches.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
from typing import List, Optional

from ms_efficient.core import backend
from ms_efficient.core.config import check_dispatch, load_config
from ms_efficient.train import checkpoint as run_ckpt

__all__ = ["launch", "saved_world_size", "is_expert_parallel_run", "load_run_config",
           "worker_command", "LOG_DIR", "FOLDER_LOCK_ENV"]

logger = logging.getLogger(__name__)

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ep_worker.py")
LOG_DIR = "msrun_log"                  # msrun's rank logs, in the run folder
FOLDER_LOCK_ENV = "MS_EFFICIENT_RUN_LOCK"   # the run.lock the launcher holds for the ranks
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def saved_world_size(run_dir: str) -> int:
    """``world_size`` of a run folder's state.json (1 for a one-process run or none)."""
    return _saved_state(run_dir).get("world_size", 1)


def is_expert_parallel_run(run_dir: str) -> bool:
    """True when the run folder's state.json records expert plans (``train --workers``)."""
    return "plans" in _saved_state(run_dir)


def load_run_config(run_dir: str, overrides: Optional[dict] = None):
    """The run folder's config.yaml (a ``RunConfig``) with dotted ``overrides``, read as the
    run that saved it (``core.config.load_config``'s ``saved_expert_parallel``:
    :func:`is_expert_parallel_run`)."""
    return load_config(os.path.join(run_dir, "config.yaml"), overrides,
                       saved_expert_parallel=is_expert_parallel_run(run_dir))


def _saved_state(run_dir: str) -> dict:
    path = os.path.join(run_dir, "state.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as fh:
        state = json.load(fh)
    world = state.get("world_size", 1)
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"'{path}' field 'world_size' must be an integer >= 1, but got "
                         f"{world!r}.")
    return state


def worker_command(config: Optional[str], out: Optional[str], steps: Optional[int],
                   resume: Optional[str], efficientmoe: Optional[str],
                   overwrite: bool = False) -> List[str]:
    """The worker script and its arguments (absolute paths)."""
    cmd = [WORKER]
    if resume:
        cmd += ["--resume", os.path.abspath(resume)]
    else:
        cmd.append(os.path.abspath(config))
        if out:
            cmd += ["--out", os.path.abspath(out)]
        if overwrite:
            cmd.append("--overwrite")
    if steps is not None:
        cmd += ["--steps", str(steps)]
    if efficientmoe is not None:
        cmd += ["--efficientmoe", efficientmoe]
    return cmd


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(workers: int, config: Optional[str], out: Optional[str] = None,
           steps: Optional[int] = None, resume: Optional[str] = None,
           efficientmoe: Optional[str] = None, timeout_s: int = 120,
           overwrite: bool = False) -> str:
    """Run the expert-parallel training on ``workers`` local ranks; returns the run folder.

    Checks first (ValueError naming the field): the config loads, ``train.batch_size`` is
    divisible by ``workers``, ``moe.dispatch`` is an expert-parallel one, and a resumed run
    with another number of ranks was trained expert-parallel (its experts are then laid out again for ``workers`` ranks by the workers,
    :mod:`ms_efficient.train.logical_state`); the run folder is free (its lock), and a new
    run's holds no other run (``overwrite``: that run's files are removed first).
    ``timeout_s``: msrun's ``--cluster_time_out`` (seconds for every rank to join).
    Raises RuntimeError when msrun fails, with the tail of the rank logs."""
    if resume and overwrite:
        raise ValueError("give either --resume DIR (continue the run) or --overwrite "
                         "(replace it), not both.")
    if workers < 2:
        raise ValueError(f"'--workers' must be >= 2 for an expert-parallel run, but got "
                         f"{workers}; without --workers the run uses one process.")
    if resume:
        run_dir, saved = resume, saved_world_size(resume)
        if saved != workers and not is_expert_parallel_run(resume):
            raise ValueError(f"--resume: '{resume}' was trained in one process (its state.json "
                             f"has no expert 'plans'), but --workers is {workers}; resume it "
                             f"without --workers.")
        cfg = load_run_config(resume)
        if saved != workers:
            logger.info("resuming %s, saved by %d ranks, on %d ranks", resume, saved, workers)
    else:
        cfg = load_config(config)
        run_dir = out or cfg.train.out_dir
    if cfg.train.batch_size % workers:
        raise ValueError(f"'train.batch_size' ({cfg.train.batch_size}) must be divisible by "
                         f"--workers ({workers}).")
    check_dispatch(cfg, expert_parallel=True)
    msrun = shutil.which("msrun") or shutil.which("msrun", path=os.path.dirname(sys.executable))
    if msrun is None:
        raise ValueError("'msrun' is not on PATH; put the environment that has MindSpore "
                         "first on PATH (e.g. PATH=.venv/bin:$PATH).")
    with run_ckpt.acquire_lock(run_dir) as lock:
        run_ckpt.clean_temporaries(run_dir)
        if not resume:
            run_ckpt.check_fresh(run_dir, overwrite, ignore=(LOG_DIR,))
        log_dir = os.path.join(os.path.abspath(run_dir), LOG_DIR)
        if overwrite:
            shutil.rmtree(log_dir, ignore_errors=True)      # the replaced run's rank logs
        os.makedirs(log_dir, exist_ok=True)
        env = dict(os.environ)
        env[FOLDER_LOCK_ENV] = os.path.realpath(lock.path)
        _run_msrun(msrun, workers, log_dir, env, cfg, timeout_s,
                   worker_command(config, out, steps, resume, efficientmoe, overwrite))
    return run_dir


def _run_msrun(msrun: str, workers: int, log_dir: str, env: dict, cfg, timeout_s: int,
               task: List[str]) -> None:
    """msrun ``task`` on ``workers`` local ranks; RuntimeError with the rank logs' tails."""
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.path.dirname(msrun),
                                   env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(p for p in [PACKAGE_PARENT, env.get("PYTHONPATH")] if p)
    conf = backend.runtime_conf(cfg.context.device_target, env.get(backend.RUNTIME_CONF_ENV, ""))
    if conf:
        env[backend.RUNTIME_CONF_ENV] = conf
    cmd = [msrun, f"--worker_num={workers}", f"--local_worker_num={workers}",
           "--master_addr=127.0.0.1", f"--master_port={_free_port()}", "--join=True",
           f"--cluster_time_out={timeout_s}", f"--log_dir={log_dir}"] + task
    logger.info("launching %d expert-parallel ranks: %s", workers, " ".join(cmd))
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    if proc.returncode != 0:
        tails = []
        for name in sorted(os.listdir(log_dir)):
            with open(os.path.join(log_dir, name), errors="replace") as fh:
                lines = [line for line in fh if not line.startswith(("[WARNING]", "[INFO]"))]
            tails.append(f"--- {name} ---\n{''.join(lines[-25:])}")
        raise RuntimeError(f"msrun exited with status {proc.returncode}; rank logs in "
                           f"{log_dir}:\n" + "\n".join(tails))
