"""Expert tables between a run's per-rank layout and the logical layout (pure numpy).

An expert-parallel rank r of a run holds, for every MoE layer, weight tables of S_b rows
(``moe.slots_per_device``, the slot budget): row i < S_l is plan slot ``rank_slots(plan, r)[i]``
(the plan's slots on r, ascending slot id) holding logical expert ``plan.slot_expert`` of that
slot; rows S_l..S_b - 1 are empty (zeros). That is the layout of
:class:`~ms_efficient.moe.balanced_ep.BalancedExpertParallelMoE` with the plan
:func:`~ms_efficient.moe.balance.home_plan` of its home table. Every tensor that follows the
weight rows (w1, b1, w2, b2 and Adam's two moments of each) has this layout.

The logical layout is the one-process model's: an [E, ...] table, row e = expert e.

    gather_experts:  per-rank tables [W][S_b, ...] + the run's plan -> logical [E, ...]
                     (each expert from its home copy, every other replica checked equal)
    scatter_experts: logical [E, ...] + a plan -> one rank's table [S_b, ...]
    relayout:        per-rank tables of one plan -> per-rank tables of another, on any
                     number of ranks (the two above)
    merge_trace_ranks: a routing trace's per-rank counts summed to fewer source ranks
    resumed_counts:    the part of a saved trace a resumed run keeps, on its source ranks

No MindSpore import: the callers read and write the checkpoints.
"""
from __future__ import annotations

from typing import List, Sequence

import numpy as np

from ms_efficient.moe.ep_routing import expert_sources
from ms_efficient.moe.plan import ExpertPlan

__all__ = ["rank_slots", "home_slots", "check_run_plan", "gather_experts", "scatter_experts",
           "relayout", "merge_trace_ranks", "resumed_counts"]

# Replicas of one expert receive the same summed gradient and the same optimizer update, so
# they stay bit-identical; these tolerances only absorb a different summation order.
REPLICA_RTOL = 1e-5
REPLICA_ATOL = 1e-7


def rank_slots(plan: ExpertPlan, rank: int) -> np.ndarray:
    """int64 [S_l]: the plan's slot ids on ``rank`` in the order of the rank's weight rows."""
    return np.flatnonzero(plan.slot_device == rank)


def home_slots(plan: ExpertPlan, num_experts: int, where: str = "expert plan") -> np.ndarray:
    """int64 [E]: the home copy of every expert, the slot read for it: its replica on the
    lowest rank holding it, first row there (:func:`~ms_efficient.moe.ep_routing.
    expert_sources`, the rule the layer reads logical weights by). ValueError (naming the
    plan as ``where``) unless every expert 0..E-1, and no other, has a slot."""
    replicas = plan.replica_counts(num_experts)
    if replicas.size > num_experts or (replicas == 0).any():
        raise ValueError(f"{where} 'slot_expert' {plan.slot_expert.tolist()} must name "
                         f"every expert 0..{num_experts - 1} at least once and no other.")
    home = np.empty(num_experts, dtype=np.int64)
    for rank in np.unique(plan.slot_device):           # the layer's own rule, rank by rank
        source = expert_sources(plan, num_experts, int(rank))
        mine = source >= 0
        home[mine] = rank_slots(plan, int(rank))[source[mine]]
    return home


def check_run_plan(plan: ExpertPlan, num_experts: int, world: int, budget: int,
                   where: str) -> None:
    """ValueError unless ``plan`` fits a run of ``world`` ranks with ``budget`` weight rows
    per rank, every expert placed; ``where`` names the plan in the message (e.g.
    "state.json 'plans'[1]")."""
    if plan.slot_device.size and int(plan.slot_device.max()) >= world:
        raise ValueError(f"{where} 'slot_device' places a slot on rank "
                         f"{int(plan.slot_device.max())}, but the run has world_size {world} "
                         f"(ranks 0..{world - 1}).")
    held = np.bincount(plan.slot_device, minlength=world)
    if held.max(initial=0) > budget:
        r = int(np.argmax(held))
        raise ValueError(f"{where} puts {int(held[r])} slots on rank {r}, but its checkpoint "
                         f"has {budget} weight rows per MoE table (at most {budget} allowed).")
    home_slots(plan, num_experts, where)     # every expert has a slot, no unknown expert


def gather_experts(plan: ExpertPlan, tables: Sequence[np.ndarray], num_experts: int,
                   name: str = "expert table") -> np.ndarray:
    """Logical [E, ...] table from the per-rank tables of a run under ``plan``.

    tables: one array per rank r (W = len(tables)), shape [S_b, ...], rows in the order of
        :func:`rank_slots`. Expert e is read from its home copy (:func:`home_slots`); every
        other replica must equal it (``REPLICA_RTOL``, ``REPLICA_ATOL``), else ValueError
        naming ``name``, the expert, both copies' ranks and the largest difference.
    """
    world = len(tables)
    budgets = {int(np.shape(t)[0]) for t in tables}
    if len(budgets) != 1:
        raise ValueError(f"{name}: every rank must hold the same number of rows, but the "
                         f"ranks hold {[int(np.shape(t)[0]) for t in tables]}.")
    check_run_plan(plan, num_experts, world, budgets.pop(), name)
    row_of = np.empty(plan.num_slots, dtype=np.int64)    # slot -> its row on its rank
    for r in range(world):
        row_of[rank_slots(plan, r)] = np.arange(rank_slots(plan, r).size)
    home = home_slots(plan, num_experts)
    out = np.stack([np.asarray(tables[plan.slot_device[s]])[row_of[s]] for s in home])
    for s in range(plan.num_slots):
        e = int(plan.slot_expert[s])
        if s == home[e]:
            continue
        copy = np.asarray(tables[plan.slot_device[s]])[row_of[s]]
        if not np.allclose(copy, out[e], rtol=REPLICA_RTOL, atol=REPLICA_ATOL):
            gap = float(np.max(np.abs(copy - out[e])))
            raise ValueError(f"{name}: the replicas of expert {e} differ: slot {s} on rank "
                             f"{int(plan.slot_device[s])} vs its home slot {int(home[e])} on "
                             f"rank {int(plan.slot_device[home[e]])}, max |difference| "
                             f"{gap:.3g} (allowed {REPLICA_ATOL} + {REPLICA_RTOL} x |value|); "
                             f"the checkpoints are inconsistent.")
    return out


def scatter_experts(plan: ExpertPlan, table_E: np.ndarray, rank: int, budget: int) -> np.ndarray:
    """Rank ``rank``'s table [budget, ...] under ``plan`` from the logical [E, ...] table:
    row i = expert ``plan.slot_expert[rank_slots(plan, rank)[i]]``, the rest zeros."""
    table = np.asarray(table_E)
    experts = plan.slot_expert[rank_slots(plan, rank)]
    if experts.size > budget:
        raise ValueError(f"the plan puts {experts.size} slots on rank {rank}, but the layer has "
                         f"{budget} weight rows per rank.")
    out = np.zeros((budget,) + table.shape[1:], dtype=table.dtype)
    out[:experts.size] = table[experts]
    return out


def relayout(old_plan: ExpertPlan, tables: Sequence[np.ndarray], new_plan: ExpertPlan,
             new_world: int, new_budget: int, num_experts: int,
             name: str = "expert table") -> List[np.ndarray]:
    """The per-rank tables of ``new_plan`` on ``new_world`` ranks (``new_budget`` rows each)
    holding the experts of the per-rank ``tables`` of ``old_plan``."""
    check_run_plan(new_plan, num_experts, new_world, new_budget, f"new plan of {name}")
    logical = gather_experts(old_plan, tables, num_experts, name)
    return [scatter_experts(new_plan, logical, r, new_budget) for r in range(new_world)]


def merge_trace_ranks(counts_TLWE: np.ndarray, ranks: int):
    """Routing counts int64 [T, L, W, E] of W source ranks as [T, L, ranks, E], or None.

    Rank r of W takes the batch rows [r B / W, (r + 1) B / W), trace group g of ``ranks`` the
    rows [g B / ranks, ...): when W is a multiple of ``ranks`` group g is exactly ranks
    g W / ranks .. (g + 1) W / ranks - 1, summed; otherwise a group would need part of a
    rank's counts, which the trace does not record, and the result is None."""
    counts = np.asarray(counts_TLWE)
    steps, layers, world, experts = counts.shape
    if ranks < 1 or world % ranks:
        return None
    return counts.reshape(steps, layers, ranks, world // ranks, experts).sum(axis=3)


def resumed_counts(counts_TLWE: np.ndarray, steps_T, step: int, ranks: int):
    """What a run resumed at ``step`` on ``ranks`` source ranks keeps of a saved trace:
    (counts [t, L, ranks, E] of the steps start + 1 .. step, start), the trace's first step
    being start + 1 (``steps_T``: the trace's step numbers, or None for 1, 2, ...); the
    rank axis merged by :func:`merge_trace_ranks`. When it cannot be merged: (None, step),
    the trace restarts after ``step``."""
    start = int(steps_T[0]) - 1 if steps_T is not None and len(steps_T) else 0
    rows = np.asarray(counts_TLWE)[:max(0, step - start)]
    merged = merge_trace_ranks(rows, ranks)
    return (None, step) if merged is None else (merged, start)
