"""Atomic file writes: readers see either the old file or the whole new one, never a part.

Each write goes to a temporary ``.tmp-*`` file beside the target (:data:`TEMP_PREFIX`), is
flushed to disk (``fsync``) and only then renamed onto the target; the folder is fsynced after
the rename, so after a power loss the target is the old file or the whole new one.
A process killed mid-write leaves its temporary behind: :func:`remove_temporaries` clears
them (the trainer calls it on start, holding the run folder's lock).
"""
from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from typing import Any, Callable, Iterator

__all__ = ["atomic_path", "atomic_write_text", "atomic_write_bytes", "atomic_write_with",
           "read_yaml_document", "fsync_path", "remove_temporaries", "TEMP_PREFIX"]

# Name prefix of the temporaries atomic_path creates.
TEMP_PREFIX = ".tmp-"


def fsync_path(path: str) -> None:
    """Flush the file or folder ``path`` to disk (a folder: its entries, e.g. a rename)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_temporaries(folder: str) -> list:
    """Delete the ``.tmp-*`` files atomic writes left in ``folder`` (not recursive) when their
    process was killed; returns the removed paths. Call it only while no other process
    writes there (e.g. holding the run folder's lock)."""
    removed = []
    if not os.path.isdir(folder):
        return removed
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name.startswith(TEMP_PREFIX) and os.path.isfile(path):
            os.unlink(path)
            removed.append(path)
    return removed


@contextlib.contextmanager
def atomic_path(path: str, suffix: str = "") -> Iterator[str]:
    """Yield a temporary path beside ``path``; on success it is renamed onto ``path``.

    ``suffix`` keeps an extension that a writer insists on (``np.savez`` adds ``.npz``).
    On any exception the temporary file is removed and ``path`` is left untouched. The
    temporary is fsynced before the rename and the folder after it.
    """
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):         # name the path given, not the temporary the rename hit
        raise IsADirectoryError(errno.EISDIR, "is a folder; give a file name", path)
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=TEMP_PREFIX, suffix=suffix)
    except OSError as err:          # name the file the caller asked for, not the temp file
        raise OSError(err.errno, f"cannot write there ({err.strerror})", path) from None
    os.close(fd)
    try:
        yield tmp
        # mkstemp creates 0600; the file gets the mode open() would give it (umask)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)
        fsync_path(tmp)                 # the data is on disk before the name points at it
        os.replace(tmp, path)
        fsync_path(folder)              # and the rename itself survives a power loss
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_write_bytes(path: str, data: bytes) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as fh:
            fh.write(data)


def atomic_write_text(path: str, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_with(path: str, writer: Callable[[str], None], suffix: str = "") -> None:
    """Call ``writer(tmp_path)`` and move the result onto ``path`` atomically."""
    with atomic_path(path, suffix=suffix) as tmp:
        writer(tmp)


def read_yaml_document(path: str, what: str) -> Any:
    """The YAML document in ``path``; a missing, binary or malformed file raises ValueError
    naming the file and ``what`` it should be (one line)."""
    import yaml

    if not os.path.isfile(path):
        raise ValueError(f"{what} '{path}' does not exist.")
    try:
        with open(path, "r", encoding="utf-8") as fh:
            return yaml.safe_load(fh)
    except UnicodeDecodeError:
        raise ValueError(f"{what} '{path}' is binary, not YAML text.") from None
    except yaml.YAMLError as err:
        reason = " ".join(str(err).split())
        raise ValueError(f"{what} '{path}' is not valid YAML: {reason}") from None
