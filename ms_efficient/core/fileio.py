"""Atomic file writes: readers see either the old file or the whole new one, never a part."""
from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Callable, Iterator

__all__ = ["atomic_path", "atomic_write_text", "atomic_write_bytes", "atomic_write_with"]


@contextlib.contextmanager
def atomic_path(path: str, suffix: str = "") -> Iterator[str]:
    """Yield a temporary path beside ``path``; on success it is renamed onto ``path``.

    ``suffix`` keeps an extension that a writer insists on (``np.savez`` adds ``.npz``).
    On any exception the temporary file is removed and ``path`` is left untouched.
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=suffix)
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, path)
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



