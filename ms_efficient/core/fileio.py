"""Atomic file writes: readers see either the old file or the whole new one, never a part."""
from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any, Callable, Iterator

__all__ = ["atomic_path", "atomic_write_text", "atomic_write_bytes", "atomic_write_with",
           "read_yaml_document"]


@contextlib.contextmanager
def atomic_path(path: str, suffix: str = "") -> Iterator[str]:
    """Yield a temporary path beside ``path``; on success it is renamed onto ``path``.

    ``suffix`` keeps an extension that a writer insists on (``np.savez`` adds ``.npz``).
    On any exception the temporary file is removed and ``path`` is left untouched.
    """
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=suffix)
    except OSError as err:          # name the file the caller asked for, not the temp file
        raise OSError(err.errno, f"cannot write there ({err.strerror})", path) from None
    os.close(fd)
    try:
        yield tmp
        # mkstemp creates 0600; the file gets the mode open() would give it (umask)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)
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
