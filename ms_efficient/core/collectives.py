"""Alpha-beta link model and the cost of flat collectives over one kind of link.

A message of ``nbytes`` bytes over a :class:`Link` takes ``alpha + nbytes / B`` seconds, with
``alpha`` the per-message latency (seconds) and ``B`` the bandwidth (bytes/s). The collective
formulas below are the ring / pairwise ones of Thakur, Rabenseifner & Gropp, "Optimization of
Collective Communication Operations in MPICH" (IJHPCA 2005), with ``n`` ranks:

    all-reduce      (ring)            2(n-1)·alpha + 2(n-1)/n · nbytes/B
    all-gather      (ring)             (n-1)·alpha +  (n-1)/n · nbytes/B
    reduce-scatter  (ring)             (n-1)·alpha +  (n-1)/n · nbytes/B
    all-to-all      (pairwise)         (n-1)·alpha +  (n-1)/n · nbytes/B
    broadcast       min(binomial tree, scatter + ring all-gather), see broadcast_time_s

``nbytes`` is always a buffer size on one rank, never a sum over ranks:
    all-reduce: the tensor being reduced; all-gather: the OUTPUT (gathered) tensor;
    reduce-scatter: the INPUT tensor; all-to-all: everything one rank sends, its own share
    included; broadcast: the tensor broadcast.
A collective over one rank, or over zero bytes, costs 0 s.

:func:`hierarchical_collective_time_s` composes them for a group spanning several nodes (fast
links inside a node, slower ones between nodes); :meth:`ms_efficient.core.cluster.ClusterSpec.
collective_time_s` calls it with a cluster's links.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

__all__ = [
    "COLLECTIVE_KINDS",
    "Link",
    "LOCAL_LINK",
    "p2p_time_s",
    "allreduce_time_s",
    "allgather_time_s",
    "reduce_scatter_time_s",
    "alltoall_time_s",
    "broadcast_time_s",
    "hierarchical_collective_time_s",
]

COLLECTIVE_KINDS = ("allreduce", "allgather", "reduce_scatter", "alltoall", "broadcast")


def _check_nonnegative_number(owner: str, name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{owner} '{name}' must be a number >= 0, but got {value!r}.")


@dataclass(frozen=True)
class Link:
    """One alpha-beta link, as seen by one device sending to one peer.

    latency_s: alpha, the start-up cost of one message, seconds, finite and >= 0.
    bandwidth_Bps: 1/beta, bytes per second per direction, > 0 (``math.inf`` allowed for a
        free link, see ``LOCAL_LINK``).
    """

    latency_s: float
    bandwidth_Bps: float

    def __post_init__(self) -> None:
        _check_nonnegative_number("Link", "latency_s", self.latency_s)
        if math.isinf(self.latency_s):
            raise ValueError(f"Link 'latency_s' must be finite, but got {self.latency_s!r}.")
        _check_nonnegative_number("Link", "bandwidth_Bps", self.bandwidth_Bps)
        if self.bandwidth_Bps == 0:
            raise ValueError("Link 'bandwidth_Bps' must be > 0, but got 0.")

    def time_s(self, nbytes: float) -> float:
        """Seconds to send one message of ``nbytes`` bytes: ``latency_s + nbytes / bandwidth_Bps``.

        Zero bytes means no message and costs 0.0 s; negative sizes raise ``ValueError``.
        """
        _check_nonnegative_number("Link.time_s", "nbytes", nbytes)
        if nbytes == 0:
            return 0.0
        return self.latency_s + nbytes / self.bandwidth_Bps


# A device talking to itself: no latency, unlimited bandwidth (immutable, safe to share).
LOCAL_LINK = Link(latency_s=0.0, bandwidth_Bps=math.inf)


def _check_collective(name: str, nbytes: float, n: int) -> bool:
    """Validate arguments; return True when the collective is a no-op (n == 1 or 0 bytes)."""
    _check_nonnegative_number(name, "nbytes", nbytes)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{name} 'n' must be a positive integer, but got {n!r}.")
    return n == 1 or nbytes == 0


def _ring(steps: int, nbytes_on_wire: float, link: Link) -> float:
    """``steps`` latencies plus ``nbytes_on_wire`` bytes at the link's bandwidth, seconds."""
    return steps * link.latency_s + nbytes_on_wire / link.bandwidth_Bps


def p2p_time_s(nbytes: float, link: Link) -> float:
    """Seconds for one point-to-point send of ``nbytes`` bytes: ``alpha + nbytes / B``."""
    return link.time_s(nbytes)


def allreduce_time_s(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce of an ``nbytes``-byte tensor over ``n`` ranks, seconds.

    A reduce-scatter then an all-gather, each ``n-1`` steps of ``nbytes/n`` bytes:
    ``2(n-1)·alpha + 2(n-1)/n · nbytes/B`` (Thakur et al. 2005, ring / Rabenseifner).
    """
    if _check_collective("allreduce_time_s", nbytes, n):
        return 0.0
    return _ring(2 * (n - 1), 2 * (n - 1) / n * nbytes, link)


def allgather_time_s(nbytes: float, n: int, link: Link) -> float:
    """Ring all-gather over ``n`` ranks, seconds; ``nbytes`` is the OUTPUT (gathered) size.

    Each rank contributes ``nbytes/n``; ``n-1`` steps of ``nbytes/n`` bytes:
    ``(n-1)·alpha + (n-1)/n · nbytes/B`` (Thakur et al. 2005, ring).
    """
    if _check_collective("allgather_time_s", nbytes, n):
        return 0.0
    return _ring(n - 1, (n - 1) / n * nbytes, link)


def reduce_scatter_time_s(nbytes: float, n: int, link: Link) -> float:
    """Ring reduce-scatter over ``n`` ranks, seconds; ``nbytes`` is the INPUT size per rank.

    Each rank ends with ``nbytes/n`` reduced bytes; ``n-1`` steps of ``nbytes/n`` bytes:
    ``(n-1)·alpha + (n-1)/n · nbytes/B`` (Thakur et al. 2005, ring).
    """
    if _check_collective("reduce_scatter_time_s", nbytes, n):
        return 0.0
    return _ring(n - 1, (n - 1) / n * nbytes, link)


def alltoall_time_s(nbytes: float, n: int, link: Link) -> float:
    """Pairwise-exchange all-to-all over ``n`` ranks, seconds.

    ``nbytes`` is everything one rank sends, its own share included, split evenly: ``n-1``
    steps, each sending ``nbytes/n`` to one peer: ``(n-1)·alpha + (n-1)/n · nbytes/B``
    (Thakur et al. 2005, pairwise exchange). Uneven splits (MoE dispatch) are costed by the
    caller from the largest per-rank volume.
    """
    if _check_collective("alltoall_time_s", nbytes, n):
        return 0.0
    return _ring(n - 1, (n - 1) / n * nbytes, link)


def broadcast_time_s(nbytes: float, n: int, link: Link) -> float:
    """Broadcast of an ``nbytes``-byte tensor from one root to ``n`` ranks, seconds.

    The faster of the two MPICH algorithms (Thakur et al. 2005), as a size-adaptive library
    would pick, with ``L = ceil(log2 n)``:
        binomial tree (short messages):        L·alpha + L · nbytes/B
        scatter + ring all-gather (van de Geijn, long messages):
                                               (L + n-1)·alpha + 2(n-1)/n · nbytes/B
    """
    if _check_collective("broadcast_time_s", nbytes, n):
        return 0.0
    rounds = math.ceil(math.log2(n))
    tree = _ring(rounds, rounds * nbytes, link)
    scatter_allgather = _ring(rounds + n - 1, 2 * (n - 1) / n * nbytes, link)
    return min(tree, scatter_allgather)


_FLAT = {
    "allreduce": allreduce_time_s,
    "allgather": allgather_time_s,
    "reduce_scatter": reduce_scatter_time_s,
    "alltoall": alltoall_time_s,
    "broadcast": broadcast_time_s,
}


def hierarchical_collective_time_s(kind: str, nbytes: float, ranks_per_node: Sequence[int],
                                   intra: Link, inter: Link) -> float:
    """Seconds for a collective over a group spread across nodes, two-level model.

    kind: one of ``COLLECTIVE_KINDS``; case, '-' and '_' are ignored ("AllReduce",
        "all_to_all" are accepted).
    nbytes: per-rank size, with the convention of this module (see the module docstring).
    ranks_per_node: group members on each node the group spans, e.g. ``[8, 8]``.
    intra, inter: the link inside a node and the link between nodes (per device).

    One node: the flat formula over ``intra``. Across ``g`` nodes with ``m`` members each
    (``n = g*m`` ranks, S = nbytes):
        allreduce:      RS_intra(S, m) + AR_inter(S/m, g) + AG_intra(S, m)
        allgather:      AG_inter(S/m, g) + AG_intra(S, m)
        reduce_scatter: RS_intra(S, m) + RS_inter(S/m, g)
        broadcast:      BC_inter(S, g) + BC_intra(S, m)
        alltoall:       max(intra phase, inter phase), each rank sending S/n to every peer:
                        (m-1)·(a_intra + S/n / B_intra) vs (n-m)·(a_inter + S/n / B_inter).
                        The two phases use disjoint links (HCCS vs RoCE on Ascend) and run
                        concurrently, so the slower one sets the time.
    With unequal members per node, intra phases use the largest local group and inter phases
    the largest slice (S / smallest local group): a pessimistic bound.
    """
    key = str(kind).lower().replace("-", "").replace("_", "")
    kinds = {k.replace("_", ""): k for k in COLLECTIVE_KINDS}
    if key not in kinds:
        raise ValueError(f"collective kind must be one of {list(COLLECTIVE_KINDS)}, "
                         f"but got {kind!r}.")
    kind = kinds[key]
    _check_nonnegative_number(kind, "nbytes", nbytes)
    counts = list(ranks_per_node)
    if not counts or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts):
        raise ValueError(f"'ranks_per_node' must be a non-empty list of positive integers, "
                         f"but got {ranks_per_node!r}.")
    n, g, m_max, m_min = sum(counts), len(counts), max(counts), min(counts)
    if g == 1:
        return _FLAT[kind](nbytes, n, intra)
    if kind == "allreduce":
        # Step 1: reduce-scatter inside each node; Step 2: all-reduce of one node-local shard
        # across nodes; Step 3: all-gather inside each node.
        return (reduce_scatter_time_s(nbytes, m_max, intra)
                + allreduce_time_s(nbytes / m_min, g, inter)
                + allgather_time_s(nbytes, m_max, intra))
    if kind == "allgather":
        return allgather_time_s(nbytes / m_min, g, inter) + allgather_time_s(nbytes, m_max, intra)
    if kind == "reduce_scatter":
        return (reduce_scatter_time_s(nbytes, m_max, intra)
                + reduce_scatter_time_s(nbytes / m_min, g, inter))
    if kind == "broadcast":
        return broadcast_time_s(nbytes, g, inter) + broadcast_time_s(nbytes, m_max, intra)
    # alltoall: the worst rank has (m_max - 1) local peers or (n - m_min) remote peers.
    return max((m_max - 1) * intra.time_s(nbytes / n), (n - m_min) * inter.time_s(nbytes / n))
