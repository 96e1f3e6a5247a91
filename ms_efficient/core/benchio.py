"""Benchmark output shared by every ``ms-efficient bench`` kind: a markdown table and JSON.

JSON layout: ``{"benchmark": NAME, "rows": [{"evidence": "measured"|"simulated"|"model",
"workload": str, "method": str, ...metrics}, ...], "meta": {...}}``.
"""
from __future__ import annotations

import json
import math
from typing import Any, Dict, List, Optional, Sequence

from ms_efficient.core.fileio import atomic_write_text

__all__ = ["markdown_table", "write_bench_json", "format_value"]

EVIDENCE = ("measured", "simulated", "model")


def format_value(value: Any) -> str:
    """Compact text for a table cell: 4 significant digits for floats, '-' for missing."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
            return f"{value:.3e}"
        return f"{value:.4g}"
    return str(value)


def markdown_table(rows: Sequence[Dict[str, Any]], columns: Optional[Sequence[str]] = None) -> str:
    """Rows as a markdown table; columns default to the union of keys in first-seen order."""
    if not rows:
        return "(no rows)"
    if columns is None:
        columns = []
        for row in rows:
            columns.extend(k for k in row if k not in columns)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(format_value(row.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def write_bench_json(path: str, benchmark: str, rows: List[Dict[str, Any]],
                     meta: Optional[Dict[str, Any]] = None) -> None:
    """Validate that every row says its evidence kind, then write the JSON atomically."""
    for i, row in enumerate(rows):
        if row.get("evidence") not in EVIDENCE:
            raise ValueError(f"bench row {i} must have 'evidence' in {list(EVIDENCE)}, "
                             f"but got {row.get('evidence')!r}.")
        for key in ("workload", "method"):
            if key not in row:
                raise ValueError(f"bench row {i} has no '{key}'.")
    doc = {"benchmark": benchmark, "rows": rows, "meta": meta or {}}
    atomic_write_text(path, json.dumps(doc, indent=1, default=_jsonable) + "\n")


def _jsonable(value: Any) -> Any:
    try:
        import numpy as np

        if isinstance(value, np.generic):
            return value.item()
        if isinstance(value, np.ndarray):
            return value.tolist()
    except ImportError:  # pragma: no cover - numpy is a hard dependency
        pass
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
