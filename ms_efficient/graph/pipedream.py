"""Reader for PipeDream profile files (no MindSpore import).

Format: one node per line, then tab-indented edges::

    node4 -- Conv2d(3, 64, kernel_size=(3, 3)) -- forward_compute_time=1.2, backward_compute_time=2.5, activation_size=8192.0, parameter_size=7168.000
    node7 -- LSTM(2048, 1024) -- forward_compute_time=3.1, backward_compute_time=5.3, activation_size=[6291456.0; 131072.0], parameter_size=50364416.0
    \tnode4 -- node7

Times are milliseconds (stored as seconds in ``forward_time_s``/``backward_time_s``), sizes
are bytes; a list of activation sizes (one per output) is summed into ``output_bytes``.
``op_type`` is the description up to its first ``(`` (``Conv2d``, ``ReLU``, ``LSTM``).
Each node is a forward layer (``phase="forward"``) carrying its measured backward time.
The profiles carry no shapes, so ``flops`` is 0.0: planners use the measured times.
"""
from __future__ import annotations

import os
import re
from typing import Dict, List, Tuple

from ms_efficient.graph.opgraph import OpGraph, OpNode

__all__ = ["load_pipedream", "parse_pipedream"]

_EDGE = re.compile(r"^\s+(\S+)\s+--\s+(\S+)\s*$")
_METRIC = re.compile(r"(\w+)=(\[[^\]]*\]|[^,]*)")
_REQUIRED = ("forward_compute_time", "backward_compute_time", "activation_size",
             "parameter_size")


def _number(text: str, key: str, where: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{where}: {key}={text!r} is not a number.") from None
    if value < 0:
        raise ValueError(f"{where}: {key} must be >= 0, but got {value}.")
    return value


def _parse_node(line: str, where: str) -> OpNode:
    parts = line.split(" -- ")
    if len(parts) < 3:
        raise ValueError(f"{where}: expected 'nodeN -- description -- key=value, ...' or a "
                         f"tab-indented 'nodeA -- nodeB' edge, but got {line.strip()[:80]!r}.")
    name, description, metrics_text = parts[0].strip(), " -- ".join(parts[1:-1]).strip(), parts[-1]
    if not name or any(c.isspace() for c in name):
        raise ValueError(f"{where}: bad node name {name!r}.")
    metrics = {k: v.strip() for k, v in _METRIC.findall(metrics_text)}
    missing = [k for k in _REQUIRED if k not in metrics]
    if missing:
        raise ValueError(f"{where}: node {name!r} is missing {', '.join(missing)}.")
    activation = metrics["activation_size"]
    if activation.startswith("["):
        sizes = [_number(s.strip(), "activation_size", where)
                 for s in activation.strip("[]").split(";") if s.strip()]
    else:
        sizes = [_number(activation, "activation_size", where)]
    attrs = {"description": description}
    if activation.startswith("["):
        attrs["activation_sizes"] = [int(round(s)) for s in sizes]
    return OpNode(
        name=name,
        op_type=description.split("(")[0].strip() or "Unknown",
        output_bytes=int(round(sum(sizes))),
        param_bytes=int(round(_number(metrics["parameter_size"], "parameter_size", where))),
        forward_time_s=_number(metrics["forward_compute_time"], "forward_compute_time",
                               where) / 1e3,
        backward_time_s=_number(metrics["backward_compute_time"], "backward_compute_time",
                                where) / 1e3,
        phase="forward",
        attrs=attrs,
    )


def parse_pipedream(text: str, source: str = "<string>") -> OpGraph:
    """Parse PipeDream profile text; ``source`` names it in errors (``file:line: ...``)."""
    name = os.path.splitext(os.path.basename(source))[0] or "pipedream"
    graph = OpGraph(name=name, meta={"source": "pipedream", "path": source})
    edges: List[Tuple[str, str, str]] = []
    lines: Dict[str, int] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        where = f"{source}:{lineno}"
        if not line.strip():
            continue
        if line[0].isspace():
            match = _EDGE.match(line)
            if not match:
                raise ValueError(f"{where}: an indented line must be an edge 'nodeA -- nodeB', "
                                 f"but got {line.strip()[:80]!r}.")
            edges.append((match.group(1), match.group(2), where))
            continue
        node = _parse_node(line, where)
        if node.name in lines:
            raise ValueError(f"{where}: node {node.name!r} already defined on line "
                             f"{lines[node.name]}.")
        lines[node.name] = lineno
        graph.add_node(node)
    # Step 2: edges after all nodes, so a file may list them in any order.
    for src, dst, where in edges:
        try:
            graph.add_edge(src, dst)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    return graph


def load_pipedream(path: str) -> OpGraph:
    """Read a PipeDream profile file into an OpGraph (times in seconds, sizes in bytes)."""
    with open(path, "r", encoding="utf-8") as fh:
        try:
            text = fh.read()
        except UnicodeDecodeError:
            raise ValueError(f"{path}: binary, not a PipeDream profile nor graph JSON (a "
                             f"MINDIR file must end in .mindir).") from None
    return parse_pipedream(text, source=path)
