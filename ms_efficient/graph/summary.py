"""Human-readable summary of an OpGraph for the command line and reports."""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Optional

from ms_efficient.graph.opgraph import OpGraph

__all__ = ["format_bytes", "format_flops", "graph_summary_table"]


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.50 KiB'`` (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024.0
    raise AssertionError("unreachable")


def format_flops(n: float) -> str:
    """``2.5e9`` -> ``'2.50 GFLOP'`` (decimal units)."""
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6),
                        ("KFLOP", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} FLOP"


def _seconds(t: Optional[float]) -> str:
    return "-" if t is None else f"{t * 1e3:.3f} ms"


def graph_summary_table(graph: OpGraph, top: int = 12) -> str:
    """Markdown text: totals, nodes per phase, and the ``top`` op types by FLOPs then count."""
    s = graph.summary()
    lines: List[str] = [
        f"graph {s['name']!r}: {s['nodes']} nodes, {s['edges']} edges",
        "",
        "| quantity | value |",
        "|---|---|",
        f"| FLOPs (sum over nodes) | {format_flops(s['flops'])} |",
        f"| parameter bytes | {format_bytes(s['param_bytes'])} |",
        f"| activation bytes | {format_bytes(s['activation_bytes'])} |",
        f"| edge bytes | {format_bytes(s['edge_bytes'])} |",
        f"| forward time (profiled) | {_seconds(s['forward_time_s'])} |",
        f"| backward time (profiled) | {_seconds(s['backward_time_s'])} |",
        "| nodes by phase | " + ", ".join(f"{k} {v}" for k, v in s["nodes_by_phase"].items())
        + " |",
        "",
        "| op type | nodes | FLOPs | param bytes | activation bytes |",
        "|---|---:|---:|---:|---:|",
    ]
    per_type: Dict[str, List[float]] = defaultdict(lambda: [0, 0.0, 0, 0])
    for node in graph:
        row = per_type[node.op_type]
        row[0] += 1
        row[1] += node.flops
        row[2] += node.param_bytes
        row[3] += node.output_bytes
    ranked = sorted(per_type.items(), key=lambda kv: (-kv[1][1], -kv[1][0], kv[0]))
    for op_type, (count, flops, pbytes, abytes) in ranked[:top]:
        lines.append(f"| {op_type} | {count} | {format_flops(flops)} | {format_bytes(pbytes)} "
                     f"| {format_bytes(abytes)} |")
    if len(ranked) > top:
        rest = ranked[top:]
        lines.append(f"| ({len(rest)} more types) | {sum(r[1][0] for r in rest)} | "
                     f"{format_flops(sum(r[1][1] for r in rest))} | "
                     f"{format_bytes(sum(r[1][2] for r in rest))} | "
                     f"{format_bytes(sum(r[1][3] for r in rest))} |")
    return "\n".join(lines)
