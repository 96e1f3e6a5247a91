"""Open any supported graph file: OpGraph JSON, MINDIR, or a PipeDream profile."""
from __future__ import annotations

import os

from ms_efficient.graph.opgraph import OpGraph
from ms_efficient.graph.pipedream import load_pipedream

__all__ = ["load_graph"]


def load_graph(path: str) -> OpGraph:
    """Read ``path`` by extension: ``.json`` -> OpGraph JSON, ``.mindir`` -> MINDIR (needs
    MindSpore; ``x.mindir`` also opens the split export ``x_graph.mindir`` + ``x_variables/``
    that ``mindspore.export`` writes above 1 GiB of parameters); anything else is sniffed: JSON
    if it starts with ``{``, else PipeDream text.
    """
    ext = os.path.splitext(path)[1].lower()
    if ext == ".mindir":
        from ms_efficient.graph.mindir import from_mindir_file
        return from_mindir_file(path)
    if not os.path.isfile(path):
        raise ValueError(f"graph file '{path}' does not exist.")
    if ext == ".json":
        return OpGraph.load_json(path)
    with open(path, "rb") as fh:
        head = fh.read(64).lstrip()
    if head.startswith(b"{"):
        return OpGraph.load_json(path)
    return load_pipedream(path)
