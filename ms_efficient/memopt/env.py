"""MemOpt environment: one training step of a keep/recompute/swap plan on the shared simulator.

Actions per layer i (``MemoryPlan.actions``, int codes):
    KEEP (0)           o_i and e_i stay on the device from forward i to backward i.
    RECOMPUTE (1)      e_i is freed after forward i; o_i stays (a checkpoint: MindSpore's
                       ``Cell.recompute()`` keeps the Cell's output, and its input, the
                       previous output, is kept by the layer below).
                       Before backward i the layer is re-run (forward time f_i) to rebuild e_i.
    RECOMPUTE_ALL (2)  like RECOMPUTE, and o_i is freed too once layer i+1 has read it: a run
                       of such layers is one Chen et al. segment, re-run as a whole from the
                       last checkpoint below it when backward first needs one of its outputs
                       (MindSpore: ``Cell.recompute(output_recompute=True)``, which drops the
                       output and merges adjacent such Cells into one recomputation). The
                       merge needs the Cells chained directly (one's output the next one's
                       input); where every layer's output reaches the next through ops
                       outside the layers (a residual add between attention and FFN
                       sub-Cells), MindSpore recomputes each Cell alone, which frees what
                       RECOMPUTE frees: a profile whose ``meta[OUTPUTS_MEET_OUTSIDE]`` is
                       true is charged so. Measured on the CPU reference model (whole-block
                       Cells, chained): peaks 36.4 / 66.2 / 85.7 MiB for recompute on all 4
                       blocks / recompute-all on blocks 0-1 / on blocks 0-2, none 88.7 MiB;
                       the estimated profile simulates 39.6 / 93.1 / 120.6 MiB, none 120.6 MiB
                       (shares of the unoptimised peak 0.41 / 0.75 / 0.97 measured, 0.33 /
                       0.77 / 1.00 simulated). On attn/ffn sub-Cells recompute-all and
                       recompute both measure 41.8 MiB.
    SWAP (3)           (MindSpore: ``Cell.offload``, Ascend only, inside lazy_inline Cells)
                       o_i + e_i are copied to the host on the d2h stream and freed when both
                       the copy and forward i+1 are done; a prefetch on the h2d stream brings
                       them back before the first backward task that reads them.
    OFFLOAD (4)        (modelled only: no public MindSpore API swaps a Cell's output alone,
                       so ``apply_plan`` refuses it and no target's realisable set has it)
                       "recompute-offload": e_i is recomputed as with RECOMPUTE, and the
                       checkpoint o_i is swapped like SWAP instead of staying on the device
                       (only o_i crosses the host link, prefetched before the first re-run or
                       backward that reads it). Capuchin and POET evict per tensor, so a
                       checkpoint is paged out while the rest is recomputed. On the 910B
                       preset (313 TFLOP/s, 31.5 GB/s host link) a GPT-350M attention block
                       computes its forward in 0.11 ms per sample but copying its 358 MB of
                       activations takes 11 ms; its 4 MB output copies in 0.13 ms.
Timing per swapped or offloaded layer (the timing agent's choices):
    swap_delay[i]  d: the swap-out starts after forward i+d ends (0 = right after forward i).
    prefetch_lead[i] l: the prefetch is issued l compute tasks before its first consumer
                   (0 = when the consumer is due: fully exposed; larger hides more, holds
                   the bytes longer).

Step program on one device "dev0" (streams dev0.compute, dev0.d2h, dev0.h2d; memory: static
bytes resident from t=0; a task allocates at its start and frees at its end):
    forward 0..L-1, then for p = L-1..0: [re-run what backward p needs], backward p
    (allocates w_p, frees w_p + e_p + o_p at its end).
``evaluate`` returns the step time (makespan, s) and the device's peak bytes; a plan whose
peak exceeds the budget is reported as not fitting (planners penalise it, never return it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np

from ms_efficient.core.units import format_size
from ms_efficient.memopt.profile import LayerProfile
from ms_efficient.sim import Simulator

__all__ = ["KEEP", "RECOMPUTE", "RECOMPUTE_ALL", "SWAP", "OFFLOAD", "ACTION_NAMES",
           "ALL_ACTIONS", "CELL_RECOMPUTE_ACTIONS", "HOST_ACTIONS", "REALISABLE_ACTIONS",
           "realisable_actions", "OUTPUTS_MEET_OUTSIDE", "MemoryPlan", "StepResult",
           "evaluate", "min_budget_bytes", "check_budget", "check_actions", "MAX_DELAY",
           "MAX_LEAD"]

KEEP, RECOMPUTE, RECOMPUTE_ALL, SWAP, OFFLOAD = 0, 1, 2, 3, 4
ACTION_NAMES = ("keep", "recompute", "recompute-all", "swap", "recompute-offload")
# ALL_ACTIONS: every action the simulator models (planner studies, benchmarks).
# CELL_RECOMPUTE_ACTIONS: keep / ``Cell.recompute()`` only.
# What each target realises with a MindSpore API (``memopt.apply.apply_plan``):
# ``realisable_actions``.
ALL_ACTIONS = (KEEP, RECOMPUTE, RECOMPUTE_ALL, SWAP, OFFLOAD)
HOST_ACTIONS = (SWAP, OFFLOAD)      # actions that copy to the host (have swap timing)
CELL_RECOMPUTE_ACTIONS = (KEEP, RECOMPUTE)
# recompute: Cell.recompute() (output kept); recompute-all: Cell.recompute(output_recompute=
# True) (output dropped, adjacent Cells merged into one re-run); swap: Cell.offload, which
# MindSpore applies inside lazy_inline Cells on Ascend only (lazy_inline fails on CPU);
# recompute-offload: no public API swaps a Cell's output alone, so no target realises it.
REALISABLE_ACTIONS = {"CPU": (KEEP, RECOMPUTE, RECOMPUTE_ALL),
                      "GPU": (KEEP, RECOMPUTE, RECOMPUTE_ALL),
                      "Ascend": (KEEP, RECOMPUTE, RECOMPUTE_ALL, SWAP)}
# LayerProfile.meta key: true when every layer's output reaches the next layer through ops
# outside the layers (see RECOMPUTE_ALL); recompute-all is then charged as recompute.
OUTPUTS_MEET_OUTSIDE = "outputs_meet_outside"
MAX_DELAY = 2   # swap_delay in [0, MAX_DELAY]
MAX_LEAD = 4    # prefetch_lead in [0, MAX_LEAD]
DEV = "dev0"


@dataclass
class MemoryPlan:
    """A plan for L layers.

    actions: [L] int, one of KEEP/RECOMPUTE/RECOMPUTE_ALL/SWAP/OFFLOAD per layer.
    swap_delay: [L] int in [0, MAX_DELAY] (used for SWAP and OFFLOAD layers only).
    prefetch_lead: [L] int in [0, MAX_LEAD] (used for SWAP and OFFLOAD layers only).
    method: the planner that made it. meta: free-form figures (planning time, ...).
    """

    actions: np.ndarray
    swap_delay: Optional[np.ndarray] = None
    prefetch_lead: Optional[np.ndarray] = None
    method: str = ""
    meta: Dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.actions = np.asarray(self.actions, dtype=np.int64).copy()
        n = len(self.actions)
        if np.any((self.actions < 0) | (self.actions > OFFLOAD)):
            raise ValueError(f"plan actions must be in [0, {OFFLOAD}] "
                             f"({', '.join(ACTION_NAMES)}), but got {self.actions}.")
        # The last layer's output is read at once by its own backward: dropping or offloading
        # it is recomputing.
        if n and self.actions[-1] in (RECOMPUTE_ALL, OFFLOAD):
            self.actions[-1] = RECOMPUTE
        self.swap_delay = (np.zeros(n, np.int64) if self.swap_delay is None
                           else np.clip(np.asarray(self.swap_delay, np.int64), 0, MAX_DELAY))
        self.prefetch_lead = (np.ones(n, np.int64) if self.prefetch_lead is None
                              else np.clip(np.asarray(self.prefetch_lead, np.int64), 0, MAX_LEAD))

    def counts(self) -> Dict[str, int]:
        """Number of layers per action name."""
        return {name: int(np.sum(self.actions == a)) for a, name in enumerate(ACTION_NAMES)}

    def key(self) -> bytes:
        """Hashable identity of the plan's decisions (for caches)."""
        swap = np.isin(self.actions, HOST_ACTIONS)
        return (self.actions.tobytes() + np.where(swap, self.swap_delay, 0).tobytes()
                + np.where(swap, self.prefetch_lead, 0).tobytes())


@dataclass(frozen=True)
class StepResult:
    """Simulated step: step_time_s (s), peak_bytes (device, incl. static), fits (peak <=
    budget), recompute_time_s (s of re-run forwards), swap_bytes (bytes copied to host)."""

    step_time_s: float
    peak_bytes: float
    fits: bool
    recompute_time_s: float
    swap_bytes: float


def realisable_actions(device_target: str) -> tuple:
    """Action codes ``apply_plan`` realises on ``device_target`` ("CPU", "GPU", "Ascend")
    with a MindSpore API (see REALISABLE_ACTIONS); ValueError for another target."""
    if device_target not in REALISABLE_ACTIONS:
        raise ValueError(f"'device_target' must be one of {sorted(REALISABLE_ACTIONS)}, but "
                         f"got {device_target!r}.")
    return REALISABLE_ACTIONS[device_target]


def check_actions(actions) -> tuple:
    """The sorted tuple of action codes ``actions``; ValueError unless KEEP is among them
    (every planner needs it) and all are known codes."""
    codes = tuple(sorted({int(a) for a in actions}))
    if KEEP not in codes or any(a not in ALL_ACTIONS for a in codes):
        raise ValueError(f"'actions' must include {KEEP} (keep) and be codes in {ALL_ACTIONS}, "
                         f"but got {list(actions)}.")
    return codes


def min_budget_bytes(profile: LayerProfile) -> float:
    """Bytes no plan can go below: static + the largest working set of one layer
    (forward i holds o_{i-1}, o_i, e_i; backward i holds o_{i-1}, o_i, e_i, w_i)."""
    o_prev = np.r_[0.0, profile.output_bytes[:-1]]
    need = o_prev + profile.activation_bytes + profile.workspace_bytes
    return float(profile.static_bytes + need.max())


def held_bytes(profile: LayerProfile, actions: np.ndarray) -> float:
    """Bytes the device holds all step for the other ``in_flight - 1`` micro-batches of a
    pipeline stage (``LayerProfile.in_flight``): what ``actions`` store of each layer between
    its forward and backward (KEEP: o + e, RECOMPUTE: o, RECOMPUTE_ALL / host actions: 0)."""
    if profile.in_flight <= 1:
        return 0.0
    act = np.asarray(actions)
    stored = np.where(act == KEEP, profile.activation_bytes,
                      np.where(act == RECOMPUTE, profile.output_bytes, 0.0))
    return float((profile.in_flight - 1) * stored.sum())


def check_budget(profile: LayerProfile, budget_bytes: float) -> None:
    """ValueError if ``budget_bytes`` is below ``min_budget_bytes`` (the message states it)."""
    low = min_budget_bytes(profile)
    if budget_bytes < low:
        raise ValueError(
            f"budget {format_size(budget_bytes)} ({int(budget_bytes)} bytes) is below the minimum "
            f"feasible budget {format_size(low)} ({int(np.ceil(low))} bytes) at batch "
            f"{profile.batch_size}: static {format_size(profile.static_bytes)} plus the largest "
            f"single-layer working set; raise the budget or lower the batch size.")


def _build(profile: LayerProfile, plan: MemoryPlan, host_latency_s: float,
           host_bandwidth_Bps: float) -> Simulator:
    """The simulator task graph of one step (see module docs)."""
    L = profile.num_layers
    f, b = profile.forward_time_s, profile.backward_time_s
    o, e, w = profile.output_bytes, profile.interior_bytes, profile.workspace_bytes
    act, delay, lead = plan.actions, plan.swap_delay, plan.prefetch_lead
    sim = Simulator()
    sim.set_initial_memory(DEV, profile.static_bytes + held_bytes(profile, act))
    program: List[str] = []        # compute tasks in stream order

    def compute(name: str, duration: float, extra_deps=(), alloc=0.0, free=0.0) -> str:
        deps = ([program[-1]] if program else []) + list(extra_deps)
        sim.add_task(name, f"{DEV}.compute", duration, deps=deps,
                     alloc=[(DEV, alloc)] if alloc else (), free=[(DEV, free)] if free else ())
        program.append(name)
        return name

    # Step 1: forward; frees owed by forward i+1 (a RECOMPUTE_ALL output) are attached to it
    owed = 0.0
    for i in range(L):
        free = owed + (e[i] if act[i] in (RECOMPUTE, RECOMPUTE_ALL, OFFLOAD) else 0.0)
        compute(f"fwd{i}", f[i], alloc=o[i] + e[i], free=free)
        owed = o[i] if act[i] == RECOMPUTE_ALL else 0.0
    moved = np.where(act == SWAP, o + e, o)            # bytes a SWAP / OFFLOAD layer copies
    for i in np.flatnonzero(np.isin(act, HOST_ACTIONS)):
        after = min(i + int(delay[i]), L - 1)
        sim.add_transfer(f"out{i}", f"{DEV}.d2h", moved[i], host_latency_s,
                         host_bandwidth_Bps, deps=[f"fwd{after}"])
        sim.add_event(f"freed{i}", deps=[f"out{i}", f"fwd{min(i + 1, L - 1)}"],
                      free=[(DEV, moved[i])])

    # Step 2: backward program; has_o / has_e: the tensor is on the device (or being fetched)
    has_o = ~np.isin(act, (RECOMPUTE_ALL,) + HOST_ACTIONS)
    has_e = act == KEEP
    ready: Dict[int, str] = {}     # swapped / offloaded layer -> its prefetch task

    def fetch(j: int) -> List[str]:
        """Prefetch layer j's copied bytes for the compute task about to be emitted."""
        trigger = program[max(0, len(program) - 1 - int(lead[j]))]
        sim.add_transfer(f"in{j}", f"{DEV}.h2d", moved[j], host_latency_s,
                         host_bandwidth_Bps, deps=[trigger, f"freed{j}"],
                         alloc=[(DEV, moved[j])])
        ready[j] = f"in{j}"
        has_o[j] = True
        has_e[j] = has_e[j] or act[j] == SWAP
        return [ready[j]]

    def need(j: int) -> List[str]:
        """Deps making layer j's output usable (prefetch task), [] if already resident."""
        if j < 0:
            return []
        if act[j] in HOST_ACTIONS:
            return fetch(j) if j not in ready else [ready[j]]
        return []

    def ensure_output(j: int, deps: List[str]) -> None:
        if j < 0 or act[j] in HOST_ACTIONS:
            deps.extend(need(j))
            return
        if has_o[j]:
            return
        ensure_output(j - 1, deps)            # a RECOMPUTE_ALL output: re-run from below
        compute(f"regen{j}", f[j], extra_deps=deps, alloc=o[j] + e[j])
        deps.clear()
        has_o[j] = has_e[j] = True

    for p in range(L - 1, -1, -1):
        deps: List[str] = []
        ensure_output(p, deps)
        ensure_output(p - 1, deps)
        if not has_e[p]:                      # RECOMPUTE/OFFLOAD: rebuild e_p from o_{p-1}
            compute(f"rc{p}", f[p], extra_deps=deps, alloc=e[p])
            deps = []
            has_e[p] = True
        compute(f"bwd{p}", b[p], extra_deps=deps, alloc=w[p], free=w[p] + o[p] + e[p])
    return sim


def evaluate(profile: LayerProfile, plan: MemoryPlan, budget_bytes: float,
             host_link) -> StepResult:
    """Simulate one step of ``plan`` on ``profile`` with host link ``host_link`` (a
    ``ms_efficient.core.cluster.Link``: latency_s, bandwidth_Bps); budget in bytes."""
    if len(plan.actions) != profile.num_layers:
        raise ValueError(f"plan has {len(plan.actions)} actions but the profile has "
                         f"{profile.num_layers} layers.")
    if profile.meta.get(OUTPUTS_MEET_OUTSIDE) and np.any(plan.actions == RECOMPUTE_ALL):
        plan = MemoryPlan(np.where(plan.actions == RECOMPUTE_ALL, RECOMPUTE, plan.actions),
                          plan.swap_delay, plan.prefetch_lead, plan.method, plan.meta)
    sim = _build(profile, plan, host_link.latency_s, host_link.bandwidth_Bps)
    result = sim.run()
    peak = result.peak_memory_bytes[DEV]
    rerun = [n for n in result.start_s if n.startswith(("rc", "regen"))]
    recompute_s = float(sum(result.end_s[n] - result.start_s[n] for n in rerun))
    swap_bytes = float(profile.activation_bytes[plan.actions == SWAP].sum()
                       + profile.output_bytes[plan.actions == OFFLOAD].sum())
    return StepResult(step_time_s=float(result.makespan_s), peak_bytes=float(peak),
                      fits=bool(peak <= budget_bytes * (1 + 1e-9)), recompute_time_s=recompute_s,
                      swap_bytes=swap_bytes)


def no_plan_time_s(profile: LayerProfile) -> float:
    """Step time (s) with nothing recomputed or swapped: sum of forward and backward times."""
    return float(profile.forward_time_s.sum() + profile.backward_time_s.sum())


def plan_from_names(profile: LayerProfile, mapping: Dict[str, str],
                    default: str = "keep") -> MemoryPlan:
    """A plan from ``{layer name: action name}``; unknown layer or action names raise."""
    if default not in ACTION_NAMES:
        raise ValueError(f"action must be one of {ACTION_NAMES}, but got {default!r}.")
    actions = np.full(profile.num_layers, ACTION_NAMES.index(default))
    for name, action in mapping.items():
        if action not in ACTION_NAMES:
            raise ValueError(f"action for layer {name!r} must be one of {ACTION_NAMES}, "
                             f"but got {action!r}.")
        actions[profile.index_of(name)] = ACTION_NAMES.index(action)
    return MemoryPlan(actions)


__all__ += ["no_plan_time_s", "plan_from_names", "held_bytes"]
