"""Byte-level text corpus: any file or folder of text, split deterministically by file.

The default corpus is the ``.py`` sources of this Python's standard library, which exist on
every machine with Python, so the reference model trains on real text with no download.
"""
from __future__ import annotations

import hashlib
import logging
import os
import sysconfig
from dataclasses import dataclass
from typing import List, Tuple

import numpy as np

from ms_efficient.core.config import DataConfig

__all__ = ["Corpus", "load_corpus", "corpus_files"]

logger = logging.getLogger(__name__)

# A separator between files, so a window that spans two files sees a clear boundary.
_FILE_SEP = b"\n\n"


@dataclass
class Corpus:
    """Training and validation bytes.

    train, val: uint8 arrays [n_bytes] of concatenated file contents.
    files: number of files read; source: the resolved path that was read.
    """

    train: np.ndarray
    val: np.ndarray
    files: int
    source: str

    def train_batch(self, step: int, batch_size: int, seq_length: int, seed: int
                    ) -> Tuple[np.ndarray, np.ndarray]:
        """Random windows for ``step``: (inputs, targets), int32 [batch, seq_length] each.

        The batch depends only on (seed, step), so a resumed run sees the same data as an
        uninterrupted one.
        """
        rng = np.random.default_rng([seed, step])
        return _windows(self.train, rng.integers(0, len(self.train) - seq_length - 1,
                                                 size=batch_size), seq_length)

    def val_batches(self, n_batches: int, batch_size: int, seq_length: int
                    ) -> List[Tuple[np.ndarray, np.ndarray]]:
        """``n_batches`` fixed, evenly spaced validation batches (same on every call)."""
        n = n_batches * batch_size
        last = len(self.val) - seq_length - 1
        starts = np.linspace(0, last, num=n).astype(np.int64)
        return [_windows(self.val, starts[i * batch_size:(i + 1) * batch_size], seq_length)
                for i in range(n_batches)]


def _windows(data: np.ndarray, starts: np.ndarray, seq_length: int
             ) -> Tuple[np.ndarray, np.ndarray]:
    idx = starts[:, None] + np.arange(seq_length + 1)[None, :]
    chunk = data[idx].astype(np.int32)
    return chunk[:, :-1], chunk[:, 1:]


def _resolve(path: str) -> str:
    if path == "stdlib":
        return sysconfig.get_paths()["stdlib"]
    return os.path.abspath(os.path.expanduser(path))


def corpus_files(cfg: DataConfig) -> List[str]:
    """Files of the corpus, relative to its root, in a deterministic order.

    The order is by a hash of the relative path, so a ``max_bytes`` cap samples across the
    whole tree instead of taking one alphabetical corner of it.
    """
    root = _resolve(cfg.path)
    if os.path.isfile(root):
        return [os.path.basename(root)]
    names = []
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        # Skip caches and installed third-party packages.
        dirs[:] = [d for d in dirs if d not in ("__pycache__", "site-packages", ".git")]
        for name in sorted(files):
            if name.endswith(tuple(cfg.suffixes)):
                names.append(os.path.relpath(os.path.join(folder, name), root))
    return sorted(names, key=lambda rel: hashlib.md5(rel.encode()).hexdigest())


def _is_val(rel: str, val_fraction: float) -> bool:
    bucket = int(hashlib.md5(("val:" + rel).encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return bucket < val_fraction


def load_corpus(cfg: DataConfig, seq_length: int) -> Corpus:
    """Read the corpus named by ``cfg`` and split it into train/validation bytes.

    A single file is split by position (the last ``val_fraction`` of its bytes); a folder is
    split by file. Raises ValueError when there is too little text for one window.
    """
    root = _resolve(cfg.path)
    files = corpus_files(cfg)
    if not files:
        raise ValueError(f"'data.path' ({cfg.path!r}) holds no files ending in "
                         f"{cfg.suffixes}.")
    if os.path.isfile(root):
        with open(root, "rb") as fh:
            blob = np.frombuffer(fh.read(cfg.max_bytes), dtype=np.uint8)
        cut = int(len(blob) * (1.0 - cfg.val_fraction))
        train, val = blob[:cut], blob[cut:]
        read = 1
    else:
        # The byte cap is shared out between the splits, so validation never comes up empty.
        budget = {False: cfg.max_bytes * (1.0 - cfg.val_fraction),
                  True: cfg.max_bytes * cfg.val_fraction}
        parts = {True: [], False: []}
        used = {True: 0, False: 0}
        read = 0
        for rel in files:
            if used[True] >= budget[True] and used[False] >= budget[False]:
                break
            split = _is_val(rel, cfg.val_fraction)
            if used[split] >= budget[split]:
                continue
            try:
                with open(os.path.join(root, rel), "rb") as fh:
                    data = fh.read()
            except OSError as err:  # unreadable file: skip it, say so
                logger.warning("skipping %s: %s", rel, err)
                continue
            parts[split].append(data)
            used[split] += len(data)
            read += 1
        train = np.frombuffer(_FILE_SEP.join(parts[False]), dtype=np.uint8)
        val = np.frombuffer(_FILE_SEP.join(parts[True]), dtype=np.uint8)
    need = 2 * (seq_length + 1)
    if len(train) < need or len(val) < need:
        raise ValueError(
            f"'data.path' ({cfg.path!r}) has too little text: {len(train)} train and "
            f"{len(val)} validation bytes, need at least {need} of each "
            f"(seq_length {seq_length}).")
    logger.info("corpus %s: %d files read, %.1f MB train, %.2f MB validation", root, read,
                len(train) / 1e6, len(val) / 1e6)
    return Corpus(train=train, val=val, files=read, source=root)
