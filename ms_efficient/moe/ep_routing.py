"""Replica tables and slot weights of the balanced expert-parallel layer (numpy, computed
before compilation or a re-plan).

Notation: W ranks in the expert-parallel group (rank = device id of the plan), E logical
experts, S physical slots of an :class:`~ms_efficient.moe.plan.ExpertPlan` (the home table as
a plan: :func:`~ms_efficient.moe.balance.home_plan`), S_b the slot budget per device.

Replica gradient sync (:func:`replica_sync`): gradients of a logical expert's replicas are
summed: first over the replicas on this rank, then, for experts with replicas on more than
one rank ("cross" experts, the same list on every rank), by an AllReduce of a [X_b, ...] table
(X_b >= the number of cross experts, rows past them stay zero) to which each rank adds its
local sums. :func:`sync_rows` is X_b, what the cost model charges for that AllReduce.

Slot weights: :func:`init_expert_weights` seeds every expert's initial weights by its id (so
replicas start identical without communication), :func:`pad_rows` fills the empty budget
slots with zeros, and :func:`expert_sources` names the one rank and row each expert is read
from when a logical [E, ...] table is rebuilt (``checkpoint export``, a resize).
No MindSpore import here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from ms_efficient.moe.plan import ExpertPlan

__all__ = ["ReplicaSync", "replica_sync", "cross_budget", "sync_rows", "expert_sources",
           "pad_rows", "init_expert_weights"]


def cross_budget(num_experts: int, world: int, budget: int) -> int:
    """The most experts any plan of ``budget`` slots per device on ``world`` devices can
    replicate on two devices or more: each takes >= 2 of the W * S_b slots and every other
    expert >= 1, so X <= W * S_b - E (and X <= E); 0 on one device."""
    if world < 2:
        return 0
    return int(max(0, min(num_experts, world * budget - num_experts)))


def sync_rows(plan: ExpertPlan, num_experts: int, world: int,
              budget: Optional[int] = None) -> int:
    """Rows X of the gradient table :class:`~ms_efficient.moe.balanced_ep.ReplicaGradSum`
    all-reduces over the whole group in every backward step (each row one expert's
    parameters; a rank adds zeros for the experts it does not hold), whatever the step routed:

    - a layer built for any plan of ``budget`` slots per device (the balanced layer's home
      table: its shapes must hold every later plan): :func:`cross_budget` (E, W, budget);
    - a fixed plan (``budget`` None: a baseline row's placement): the experts ``plan``
      holds on more than one device.

    The cost model charges this table (``efficientmoe.cost``), so what it charges is what the
    layers send."""
    if budget is not None:
        return cross_budget(num_experts, world, budget)
    devices = [np.unique(plan.slot_device[plan.slot_expert == e]).size
               for e in np.unique(plan.slot_expert)]
    return int(sum(n > 1 for n in devices))


@dataclass(frozen=True)
class ReplicaSync:
    """How rank r sums the gradients of replicas (all int32 index tables over its S_b weight
    rows: rows i < S_l are its plan slots in ascending slot id, the others empty).

    needed: False when no expert has two slots that r must agree with (then the gradient
        passes unchanged).
    cross_experts: int64 [X], experts with replicas on more than one rank (same on every rank).
    num_cross: X_b >= X, rows of the AllReduced table (rows X.. stay zero).
    first_L: int32 [S_b], first local row holding the same expert (itself when empty).
    cross_L: int32 [S_b], row of the table a local row adds its expert's local sum to: the
        cross index of its expert for the first row of a cross expert, X_b (none) otherwise.
    pick_L: int32 [S_b], row of concat(AllReduced table [X_b], local sums [S_b]) every local
        row takes: the cross index for cross experts, X_b + first_L otherwise.
    """

    needed: bool
    cross_experts: np.ndarray
    num_cross: int
    first_L: np.ndarray
    cross_L: np.ndarray
    pick_L: np.ndarray


def replica_sync(plan: ExpertPlan, rank: int, budget: Optional[int] = None,
                 num_cross: Optional[int] = None) -> ReplicaSync:
    """Gradient-sync tables of ``rank`` over ``budget`` weight rows (default: its slot count)
    and a cross table of ``num_cross`` rows (default: the plan's cross experts); see the
    module docstring. Raises ``ValueError`` when either is too small for the plan."""
    local_experts = plan.slot_expert[plan.slot_device == rank]
    budget = local_experts.size if budget is None else int(budget)
    devices_per_expert = {int(e): np.unique(plan.slot_device[plan.slot_expert == e]).size
                          for e in np.unique(plan.slot_expert)}
    cross = np.array(sorted(e for e, n in devices_per_expert.items() if n > 1), dtype=np.int64)
    num_cross = cross.size if num_cross is None else int(num_cross)
    if budget < local_experts.size or num_cross < cross.size:
        raise ValueError(f"rank {rank} holds {local_experts.size} slots and the plan replicates "
                         f"{cross.size} experts across ranks, but the sync tables have "
                         f"{budget} rows and a cross table of {num_cross}.")
    first_L = np.arange(budget)
    cross_L = np.full(budget, num_cross)
    pick_L = num_cross + first_L
    for i, e in enumerate(local_experts):
        first_L[i] = int(np.flatnonzero(local_experts == e)[0])
        pick_L[i] = num_cross + first_L[i]
        if e in cross:
            pick_L[i] = int(np.searchsorted(cross, e))
            if first_L[i] == i:
                cross_L[i] = pick_L[i]
    needed = bool(cross.size > 0 or np.unique(local_experts).size < local_experts.size)
    i32 = lambda a: np.ascontiguousarray(a, dtype=np.int32)  # noqa: E731
    return ReplicaSync(needed, cross, num_cross, i32(first_L), i32(cross_L), i32(pick_L))


def expert_sources(plan: ExpertPlan, num_experts: int, rank: int) -> np.ndarray:
    """int64 [E]: the local weight row (index into this rank's plan slots, ascending slot id)
    this rank contributes for every expert to a logical [E, ...] weight table, -1 for the
    experts another rank contributes. Each expert comes from exactly one rank: the lowest that
    holds it, from its first slot there (replicas are identical)."""
    local = np.flatnonzero(plan.slot_device == rank)
    source_E = np.full(num_experts, -1, dtype=np.int64)
    for e in range(num_experts):
        holders = plan.slot_device[plan.slot_expert == e]
        if holders.size and holders.min() == rank:
            source_E[e] = int(np.flatnonzero(plan.slot_expert[local] == e)[0])
    return source_E


def pad_rows(rows_X: np.ndarray, budget: int) -> np.ndarray:
    """float32 [budget, ...]: the slot weight rows ``rows_X`` [X, ...] (X <= budget), then
    zero rows for the empty budget slots."""
    rows_X = np.asarray(rows_X, np.float32)
    pad = np.zeros((budget - rows_X.shape[0],) + rows_X.shape[1:], np.float32)
    return np.concatenate((rows_X, pad), axis=0)


def init_expert_weights(num_experts: int, hidden_size: int, ffn_hidden_size: int,
                        init_std: float = 0.02, seed: int = 0,
                        experts: Optional[Sequence[int]] = None, expert_kind: str = "mlp"):
    """Initial weights, float32 numpy: (router_EH, w1_XHF1, b1_X1F1, w2_XFH, b2_X1H) for the
    logical experts ``experts`` (X of them, in that order, repeats allowed; default all E);
    F1 = F, or 2F for gated experts (``expert_kind="glu"``: the fused [w_gate | w_up]).

    Expert e's weights come from the generator seeded with (seed, 0, e), the router's from
    (seed, 1), so every rank builds the same values for the experts it holds, and replicas of
    one expert on different ranks start identical without communication; a rank generates
    only the experts it holds.
    """
    h, f = hidden_size, ffn_hidden_size
    f1 = 2 * f if expert_kind == "glu" else f
    experts = list(range(num_experts)) if experts is None else [int(e) for e in experts]
    w1 = np.empty((len(experts), h, f1), np.float32)
    w2 = np.empty((len(experts), f, h), np.float32)
    for i, e in enumerate(experts):
        rng = np.random.default_rng((seed, 0, e))
        w1[i] = rng.normal(0.0, init_std, (h, f1))
        w2[i] = rng.normal(0.0, init_std, (f, h))
    router = np.random.default_rng((seed, 1)).normal(0.0, init_std, (num_experts, h))
    n = len(experts)
    return (router.astype(np.float32), w1, np.zeros((n, 1, f1), np.float32), w2,
            np.zeros((n, 1, h), np.float32))
