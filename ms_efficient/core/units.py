"""Byte sizes as users write them (``12GiB``, ``800MB``, ``1.5e9``) and as tables show them."""
from __future__ import annotations

import math
import re
from typing import Any, Optional, Tuple

__all__ = ["parse_size", "format_size", "parse_budget"]

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: Any, what: str = "budget") -> int:
    """Bytes from ``12GiB``, ``800MB``, ``1.5e9`` or an int; ValueError names ``what``."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        match = re.fullmatch(r"\s*([0-9.]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
        unit = match.group(2).lower() if match else None
        if not match or unit not in _UNITS:
            raise ValueError(f"'{what}' must be a size like 12GiB, 800MB or a number of bytes, "
                             f"but got {text!r}.")
        value = float(match.group(1)) * _UNITS[unit]
    if not value > 0 or math.isinf(value):
        raise ValueError(f"'{what}' must be > 0 bytes, but got {text!r}.")
    return int(value)


def format_size(nbytes: float) -> str:
    """``12.00 GiB`` style text for error messages and tables."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def parse_budget(value: Any, what: str = "budget") -> Tuple[Optional[int], Optional[float]]:
    """A memory budget as bytes or as a share of a reference: ``(bytes, None)`` for ``12GiB``,
    ``8e9`` or an int; ``(None, 0.5)`` for ``"50%"`` (share in (0, 1]). ValueError names
    ``what`` and the value."""
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            share = float(value.strip()[:-1]) / 100.0
        except ValueError:
            share = math.nan
        if not 0.0 < share <= 1.0:
            raise ValueError(f"'{what}' must be a percentage in (0%, 100%], a size like 12GiB "
                             f"or a number of bytes, but got {value!r}.")
        return None, share
    return parse_size(value, what), None
