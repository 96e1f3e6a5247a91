"""Tied tensors in the sharding ILP: one Parameter read by several operators (a tied
embedding table and LM head) gets one consistent split at every use.

``shard.graph_ops`` records the uses (``GraphOps.tied``: the first use owns the parameter's
memory, later uses read it as an input); :func:`add_same_split` adds the constraint to the
ILP of ``shard.ilp`` and :func:`split_at_uses` reads a plan's splits back (no MindSpore).
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import pulp

from ms_efficient.shard.strategies import shard_tuple

__all__ = ["add_same_split", "split_at_uses"]


def add_same_split(build, groups, key_of: Dict[str, str], specs: Sequence[OpSpec],
                    mesh, same_split: Sequence[Sequence[Tuple[str, int]]]) -> None:
    """[Constraint] every use (op, input index) of one tied tensor splits it identically:
    for each split tuple t, the first use picks a strategy giving t exactly when every
    other use does (sum_c [split(c) = t] s[g0, c] = sum_c [split(c) = t] s[gk, c])."""
    by_name = {s.name: s for s in specs}

    def split_of(op: str, index: int) -> Dict[tuple, list]:
        g = key_of[op]
        out: Dict[tuple, list] = {}
        for c, cand in enumerate(build.groups[g].cands):
            t = shard_tuple(by_name[op], cand.layout, mesh)[index]
            out.setdefault(t, []).append(build.s[(g, c)])
        return out

    for ti, uses in enumerate(same_split):
        first = split_of(*uses[0])
        for ui, (op, index) in enumerate(uses[1:]):
            if key_of[op] == key_of[uses[0][0]]:
                continue
            other = split_of(op, index)
            for vi, t in enumerate(sorted(set(first) | set(other))):
                build.prob += (pulp.lpSum(first.get(t, [])) == pulp.lpSum(other.get(t, [])),
                               f"same_split_{ti}_{ui}_{vi}")


def split_at_uses(specs: Sequence, strategies: Dict[str, object], mesh,
                  uses: Sequence[Tuple[str, int]]) -> List[List[int]]:
    """The split factors of the tied tensor at each use (op name, input index), in order."""
    by_name = {s.name: s for s in specs}
    return [list(shard_tuple(by_name[op], strategies[op].layout, mesh)[index])
            for op, index in uses]
