"""argparse value types shared by the ``ms-efficient`` sub-commands: each refuses what the
option cannot mean (zero, negative, nan, inf) with MindSpore-style wording, e.g.
``must be a finite number > 0, but got 0.0``."""
from __future__ import annotations

import argparse
import math

__all__ = ["positive_int", "positive_float", "non_negative_float"]


def positive_int(text: str) -> int:
    """An integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, but got {text!r}")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, but got {value}")
    return value


def _float(text: str, rule: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {rule}, but got {text!r}") from None


def positive_float(text: str) -> float:
    """A finite number > 0 (seconds, ratios)."""
    value = _float(text, "a finite number > 0")
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, but got {value}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    value = _float(text, "a finite number >= 0")
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, but got {value}")
    return value
