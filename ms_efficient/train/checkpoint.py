"""One run per folder, and checkpoints that prove themselves (no MindSpore import).

A run folder (``run_dir``) belongs to one run. This module is its bookkeeping; the trainer (and
a multi-process trainer) call it with a run folder and a step, and pass the function that
writes the checkpoint bytes, so it knows nothing about networks.

Layout it manages::

    run.lock                  held (``fcntl.flock``) while a process trains; holds its pid
    state.json                {"step", "checkpoint", "sha256", "checkpoints": [record, ...],
                               ...}: what --resume reads (written last, atomically)
    ckpt/step_N.ckpt          one process
    ckpt/rank_R/step_N.ckpt   one file per rank (``rank=R``), with ckpt/rank_R/state.json
                              and ckpt/rank_R/run.lock

A *record* is ``{"step": int, "path": str (relative to run_dir), "sha256": str (hex),
"bytes": int}`` plus what the caller adds (e.g. the capacities at that step).

Promises (what MindFormers' and PyTorch Lightning's checkpointing promise their users):

* **One writer.** :func:`acquire_lock` takes an exclusive ``flock`` on ``run.lock``; the kernel
  drops it when the process ends, even by SIGKILL, so a lock is never stale. A second process
  gets ``ValueError`` naming the holder's pid. Re-entrant inside one process.
* **No mixing of runs.** :func:`check_fresh` refuses a folder that already holds files unless
  the caller resumes, or overwrites (:func:`clear_run` removes only run files).
* **Pruning by step number.** :func:`commit_state` keeps the ``keep`` records of the highest
  steps *of this run's state.json* and deletes only their files, after state.json is written:
  a kill never leaves state.json pointing at a deleted file, files the state does not list
  are never touched, and ``step_1000000`` sorts after ``step_999999``.
* **Checksums.** :func:`save_checkpoint` writes through a temporary, fsyncs it, records its
  SHA-256 and size, and renames it; :func:`verified_latest` re-hashes on resume and falls
  back to the newest checkpoint that matches, naming the steps lost.
* **No debris.** :func:`remove_temporaries` deletes ``.tmp-*`` files of an interrupted write.

Multi-process runs: every rank calls the functions with ``rank=r``; each rank has its own
lock (``ckpt/rank_r/run.lock``), state file and records, so ranks never write the same file.
Rank 0 additionally holds the folder's ``run.lock`` (``acquire_lock(run_dir)``) for the whole
job, so a second job cannot start in the folder; it calls :func:`check_fresh` (a new run) and
:func:`clean_temporaries` before the ranks take their locks (a rank lock creates
``ckpt/rank_r/``, which makes the folder non-empty). On resume every rank calls
:func:`newest_common_step`, which returns the newest step whose checkpoint verifies on every
rank (the ranks must restart from one step).
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
from typing import Callable, Dict, Iterable, List, Optional, Tuple

from ms_efficient.core.fileio import atomic_path, atomic_write_text, remove_temporaries

__all__ = ["RunLock", "acquire_lock", "check_fresh", "clear_run", "save_checkpoint",
           "commit_state", "read_state", "verified_latest", "newest_common_step",
           "clean_temporaries", "checkpoint_relpath", "state_path", "file_sha256",
           "LOCK_NAME", "RUN_FILES"]

logger = logging.getLogger(__name__)

LOCK_NAME = "run.lock"
# What a run writes into its folder (clear_run removes these and nothing else), and the
# routing traces a resume at another world size keeps (trace_world{W}_step{S}.npz, ...).
RUN_FILES = ("ckpt", "state.json", "metrics.jsonl", "trace.npz", "config.yaml", "report.md",
             "loss.png", "expert_load.png", "device_load.png", "summary")
KEPT_TRACE = re.compile(r"trace_(world|ranks)\d+_step\d+\.npz")

_HELD: Dict[str, "RunLock"] = {}       # realpath of a lock file -> this process's lock


def _rank_dir(run_dir: str, rank: Optional[int]) -> str:
    return run_dir if rank is None else os.path.join(run_dir, "ckpt", f"rank_{rank}")


def state_path(run_dir: str, rank: Optional[int] = None) -> str:
    """``run_dir/state.json``, or ``run_dir/ckpt/rank_R/state.json`` for ``rank=R``."""
    return os.path.join(_rank_dir(run_dir, rank), "state.json")


def checkpoint_relpath(step: int, rank: Optional[int] = None) -> str:
    """Path of step ``step``'s checkpoint relative to the run folder."""
    folder = "ckpt" if rank is None else os.path.join("ckpt", f"rank_{rank}")
    return os.path.join(folder, f"step_{step:06d}.ckpt")


class RunLock:
    """An exclusive lock on a run folder (or one rank of it); :meth:`release` or ``with``."""

    def __init__(self, path: str, fd: int):
        self.path, self._fd, self._count = path, fd, 1

    def release(self) -> None:
        """Give the lock up (after as many releases as acquisitions in this process)."""
        self._count -= 1
        if self._count > 0 or self._fd < 0:
            return
        _HELD.pop(os.path.realpath(self.path), None)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = -1

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def acquire_lock(run_dir: str, rank: Optional[int] = None) -> RunLock:
    """Lock ``run_dir`` (or rank ``rank``'s part of it) for this process, creating folders.

    Raises ValueError naming the pid of the process that holds it. The lock lives as long as
    the returned object is not released or the process runs; the lock file stays (harmless:
    the kernel lock, not the file, is what counts).
    """
    folder = _rank_dir(run_dir, rank)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, LOCK_NAME)
    held = _HELD.get(os.path.realpath(path))
    if held is not None:
        held._count += 1
        return held
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            os.close(fd)
            raise
        holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        raise ValueError(f"run folder '{run_dir}' is in use by process {holder} (lock "
                         f"{path}); wait for it to finish or choose another folder.") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
    lock = RunLock(path, fd)
    _HELD[os.path.realpath(path)] = lock
    return lock


def _contents(run_dir: str, ignore: Iterable[str] = ()) -> List[str]:
    if not os.path.isdir(run_dir):
        return []
    skip = {LOCK_NAME, *ignore}
    return sorted(n for n in os.listdir(run_dir) if n not in skip)


def check_fresh(run_dir: str, overwrite: bool = False, ignore: Iterable[str] = ()) -> None:
    """Refuse to start a new run in a folder that holds files (besides the lock and the
    names in ``ignore``, e.g. the launcher's ``msrun_log``).

    overwrite=True removes the run files of an earlier run (:func:`clear_run`) instead;
    other files stay where they are.
    """
    names = _contents(run_dir, ignore)
    if not names:
        return
    if overwrite:
        clear_run(run_dir)
        return
    what = ("a run (state.json)" if "state.json" in names
            else f"files ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})")
    raise ValueError(f"run folder '{run_dir}' already holds {what}; pass --resume {run_dir} "
                     f"to continue it, --overwrite to replace it, or an empty or new folder.")


def clear_run(run_dir: str) -> List[str]:
    """Delete the files of :data:`RUN_FILES` and the kept traces (:data:`KEPT_TRACE`) from
    ``run_dir``; returns the names removed."""
    removed = []
    kept_traces = sorted(n for n in _contents(run_dir) if KEPT_TRACE.fullmatch(n))
    for name in RUN_FILES + tuple(kept_traces):
        path = os.path.join(run_dir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.unlink(path)
        else:
            continue
        removed.append(name)
    if removed:
        logger.warning("--overwrite: removed %s from %s", ", ".join(removed), run_dir)
    return removed


def clean_temporaries(run_dir: str) -> List[str]:
    """Remove the ``.tmp-*`` files interrupted writes left in the run folder, ``ckpt/`` and
    ``ckpt/rank_*/``; hold the lock(s) when calling. Returns the removed paths."""
    folders = [run_dir, os.path.join(run_dir, "ckpt")]
    ckpt = folders[1]
    if os.path.isdir(ckpt):
        folders += [os.path.join(ckpt, n) for n in sorted(os.listdir(ckpt))
                    if n.startswith("rank_")]
    removed = [p for folder in folders for p in remove_temporaries(folder)]
    for path in removed:
        logger.warning("removed %s, left by an interrupted write", path)
    return removed


def file_sha256(path: str) -> str:
    """Hex SHA-256 of the file ``path`` (read in 4 MiB blocks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(4 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save_checkpoint(run_dir: str, step: int, write_fn: Callable[[str], None],
                    rank: Optional[int] = None) -> Dict:
    """Write step ``step``'s checkpoint with ``write_fn(tmp_path)``; returns its record.

    The file is written to a temporary beside its final name, hashed, fsynced and renamed,
    so the record's checksum is of exactly the bytes that land at ``record["path"]``.
    Nothing refers to it until :func:`commit_state`.
    """
    rel = checkpoint_relpath(step, rank)
    record = {"step": int(step), "path": rel}
    with atomic_path(os.path.join(run_dir, rel), suffix=".ckpt") as tmp:
        write_fn(tmp)
        record["sha256"] = file_sha256(tmp)
        record["bytes"] = os.path.getsize(tmp)
    return record


def read_state(run_dir: str, rank: Optional[int] = None) -> Dict:
    """The run's state.json; ValueError naming the file if missing or unreadable."""
    path = state_path(run_dir, rank)
    if not os.path.isfile(path):
        raise ValueError(f"'{run_dir}' has no {os.path.relpath(path, run_dir)}: not a run "
                         f"folder to load from.")
    try:
        with open(path, encoding="utf-8") as fh:
            state = json.load(fh)
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"'{path}' is not valid JSON: {err}") from None
    if not isinstance(state, dict) or "checkpoint" not in state or "step" not in state:
        raise ValueError(f"'{path}' must hold 'step' and 'checkpoint', but got {state!r:.80}.")
    return state


def _records(state: Dict) -> List[Dict]:
    """The state's checkpoint records, highest step first (a state written before records
    existed counts as one record without a checksum)."""
    records = state.get("checkpoints") or [{"step": int(state["step"]),
                                            "path": state["checkpoint"]}]
    return sorted(records, key=lambda r: int(r["step"]), reverse=True)


def commit_state(run_dir: str, record: Dict, state: Optional[Dict] = None, keep: int = 2,
                 rank: Optional[int] = None) -> Dict:
    """Make ``record`` the latest checkpoint: write state.json, then prune.

    state: fields to store beside the records (e.g. capacities); the previous records are
    read from the existing state file. The ``keep`` records of the highest steps stay;
    the others' files are deleted after state.json is written. Records of steps above
    ``record``'s are dropped too: the run went back to an earlier step (a resume from the
    newest checkpoint that verifies), so they belong to a future that was abandoned, and
    kept they would count among the highest steps and push this run's good ones out.
    Returns the written state.
    """
    if keep < 1:
        raise ValueError(f"'keep' must be a positive integer, but got {keep}.")
    path = state_path(run_dir, rank)
    old = []
    if os.path.isfile(path):
        try:
            old = [r for r in _records(read_state(run_dir, rank)) if "sha256" in r]
        except ValueError:
            old = []
    records = [r for r in old if int(r["step"]) < int(record["step"])] + [record]
    records.sort(key=lambda r: int(r["step"]), reverse=True)
    kept, dropped = records[:keep], records[keep:]
    new = dict(state or {})
    new.update({"step": int(record["step"]), "checkpoint": record["path"],
                "sha256": record["sha256"], "checkpoints": kept[::-1]})
    atomic_write_text(path, json.dumps(new) + "\n")
    keep_paths = {r["path"] for r in kept}
    for r in dropped:
        if r["path"] in keep_paths:
            continue
        full = os.path.join(run_dir, r["path"])
        if os.path.isfile(full):
            os.unlink(full)
    return new


def _verify(run_dir: str, record: Dict) -> Optional[str]:
    """None when the record's file exists and matches its checksum, else why not."""
    full = os.path.join(run_dir, record["path"])
    if not os.path.isfile(full):
        return "is missing"
    if "sha256" not in record:
        logger.warning("%s has no recorded checksum (written before checksums); loading it "
                       "unverified", full)
        return None
    size = os.path.getsize(full)
    if "bytes" in record and size != int(record["bytes"]):
        return f"has {size} bytes, not the {record['bytes']} recorded"
    if file_sha256(full) != record["sha256"]:
        return "does not match its recorded SHA-256 (corrupted)"
    return None


def verified_latest(run_dir: str, state: Dict) -> Tuple[Dict, List[int]]:
    """The newest record of ``state`` whose file verifies, and the steps lost to bad ones.

    Logs a warning naming each bad checkpoint and the steps lost; raises ValueError when no
    checkpoint of the state verifies.
    """
    bad = []
    for record in _records(state):
        why = _verify(run_dir, record)
        if why is None:
            if bad:
                lost_from, lost_to = int(record["step"]) + 1, int(state["step"])
                logger.warning("checkpoint %s; resuming from step %d instead: steps %d-%d "
                               "are lost and will be trained again", "; ".join(bad),
                               int(record["step"]), lost_from, lost_to)
            return record, list(range(int(record["step"]) + 1, int(state["step"]) + 1))
        bad.append(f"{record['path']} (step {record['step']}) {why}")
    raise ValueError(f"no checkpoint of '{run_dir}' can be trusted: {'; '.join(bad)}.")


def newest_common_step(run_dir: str, ranks: Iterable[int],
                       steps: Optional[Iterable[int]] = None) -> Dict[int, Dict]:
    """For a per-rank run: {rank: record} of the newest step whose checkpoint verifies on
    every rank of ``ranks`` (and is one of ``steps``, when given: the steps the run's shared
    state describes); ValueError when there is none. A newer step that some rank lacks or
    fails to verify is named in a warning, with the steps lost."""
    good: Dict[int, Dict[int, Dict]] = {}
    bad: List[str] = []
    allowed = None if steps is None else {int(s) for s in steps}
    for rank in ranks:
        state = read_state(run_dir, rank)
        good[rank] = {}
        for r in _records(state):
            if allowed is not None and int(r["step"]) not in allowed:
                continue
            why = _verify(run_dir, r)
            if why is None:
                good[rank][int(r["step"])] = r
            else:
                bad.append(f"{r['path']} (step {r['step']}, rank {rank}) {why}")
    common = set.intersection(*(set(g) for g in good.values())) if good else set()
    if not common:
        found = {r: sorted(g) for r, g in good.items()}
        raise ValueError(f"no step of '{run_dir}' has a verified checkpoint on every rank "
                         f"(verified steps per rank: {found}"
                         f"{'; ' + '; '.join(bad) if bad else ''}).")
    step = max(common)
    newest = max(max(g) if g else step for g in good.values())
    newest = max([newest] + [int(s) for s in allowed or ()])
    if newest > step:
        logger.warning("resuming from step %d, the newest with a verified checkpoint on every "
                       "rank%s: steps %d-%d are lost and will be trained again", step,
                       f" ({'; '.join(bad)})" if bad else "", step + 1, newest)
    elif bad:
        logger.warning("resuming from step %d; older checkpoints cannot be trusted: %s", step,
                       "; ".join(bad))
    return {rank: g[step] for rank, g in good.items()}
