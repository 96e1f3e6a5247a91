"""EfficientMoE's slow level: the layout the compiled graph is built for, from a routing trace.

A layout fixes, for every MoE layer, what a static graph must know before it compiles:

    home_LWS:  int64 [L, W, S_h] logical expert of each home slot (-1: empty). Data, not a
               shape: a re-plan rewrites this table (and moves weights), never recompiles.
    spare_W:   int64 [W] spare slots per device, which the fast level (:mod:`balance`) fills
               with copies of hot experts each step. Fixed for the run.
    buffer_LW: int64 [L, W] each device's receive buffer, rows per step: its mean share
               (R x tokens per rank x top-k / W) x (1 + slack), rounded up to the cube tile.
               Fixed for the run.

How it is planned (:func:`plan_layout`), every step a pure function of the trace:

    Step 1 (forecast): each layer's expert loads [L, E], the mean of the last ``window``
        rows of the trace.
    Step 2 (home placement): with ``redundant`` extra home slots per device, EPLB's two rules
        on the forecast (deepseek-ai/EPLB): each extra slot goes to the expert with the
        largest load per replica, then replicas, heaviest first, go to the least-loaded
        device with a free slot. ``redundant = 0`` is plain expert parallelism balanced by
        the forecast. Then ours (``refine``, :func:`refine_home`): EPLB packs the mean load,
        but the fast level splits each step's tokens only among an expert's holders, so
        devices whose replicas belong to the same few experts form islands that cannot
        shed load to the rest. Swaps of two home slots between each layer's busiest device
        and another device of its node are kept while they lower the largest device load
        the fast level's home split gives, averaged over the last ``window`` rows.
    Step 3 (the slot budget): every device has ``slots`` expert slots beyond ceil(E / W);
        each split between redundant home slots (replicas chosen by the forecast, kept with
        their optimizer state) and spare slots (copies chosen each step from exact counts)
        is replayed through the fast level on the last ``window`` rows, beside plain expert
        parallelism with every extra slot a spare (no forecast), and the cheapest kept: the
        forecast earns a slot, and its placement, only where it beats per-step copies on
        the recent routing.
    Step 4 (buffers, priced from the trace): the fast level, replayed on those rows with no
        buffer, gives each layer's largest device load over its mean; the slack is that
        ratio's maximum over the rows plus ``margin`` (a device can only drop what exceeds
        a load seen in the recent trace by more than the margin).

A re-plan (:func:`replan_home`) repeats steps 1-2 with the same split and keeps the buffers
and the replica-gradient table (``Layout.sync_rows``, set by step 3: the most experts the
chosen placement replicates across devices; a re-plan replicates no more);
it is adopted when the replayed gain over its horizon pays for moving the weights and
optimizer state (:func:`decide_home`, the rows :func:`~ms_efficient.moe.ep_migration.
migrate_rows` moves): the one rule of the simulator and of training. No MindSpore import
here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping, Optional

import numpy as np
import yaml

from ms_efficient.core.fileio import atomic_write_text
from ms_efficient.efficientmoe.balanced_cost import (balanced_cost, copy_cost_rows_WW,
                                                     home_sync_time_L)
from ms_efficient.efficientmoe.cost import CostModel, uneven_alltoall_time_s
from ms_efficient.moe.ep_migration import migrate_rows
from ms_efficient.moe.balance import (BalancedSpec, balance_step, holders_of, home_split,
                                      water_fill)

__all__ = ["Layout", "LayoutConfig", "plan_layout", "place_home", "refine_home", "uniform_home",
           "cross_experts_L",
           "replan_home", "home_move_bytes_WW", "migration_time_s", "HomeDecision",
           "decide_home", "size_buffers", "replay_cost_s",
           "save_layout", "load_layout", "training_specs"]


@dataclass(frozen=True)
class LayoutConfig:
    """Slow-level settings.

    slots: expert slots per device beyond ceil(E / W) (memory for replicas or copies: one
        expert's weights and gradients each), >= 0.
    window: trace rows the forecast and the replays look at, >= 1.
    margin: buffer slack added to the largest balanced load seen (fraction of the mean).
    redundant: redundant home slots per device (None: chosen by replay, step 3).
    forecast_home: False places experts uniformly (no forecast: MoonEP's home layout).
    refine: swap home slots after EPLB's packing (step 2, :func:`refine_home`); False keeps
        EPLB's placement as published.
    node_first: pack replicas onto nodes, then onto each node's devices (ours); False packs
        them onto the devices directly, EPLB's global policy for routing without expert
        groups (replicate the heaviest load per replica, then balanced packing onto devices).
    """

    slots: int = 1
    window: int = 8
    margin: float = 0.20
    redundant: Optional[int] = None
    forecast_home: bool = True
    refine: bool = True
    node_first: bool = True

    def __post_init__(self) -> None:
        if self.slots < 0 or self.window < 1 or not self.margin >= 0:
            raise ValueError(f"LayoutConfig needs slots >= 0, window >= 1 and margin >= 0, "
                             f"but got slots={self.slots}, window={self.window}, "
                             f"margin={self.margin}.")
        if self.redundant is not None and not 0 <= self.redundant <= self.slots:
            raise ValueError(f"'redundant' must be in [0, slots ({self.slots})], but got "
                             f"{self.redundant}.")


@dataclass
class Layout:
    """The slow level's plan (module docstring for the fields); slack_L: float [L], the
    buffer slack over the mean share; redundant: redundant home slots per device;
    sync_rows: rows of the table the layers all-reduce for their replicas' gradients (the
    most experts a layer's home table may hold on more than one device, fixed for the run:
    a re-plan keeps within it); None: as many as the shapes allow
    (:func:`~ms_efficient.moe.ep_routing.cross_budget`)."""

    home_LWS: np.ndarray
    spare_W: np.ndarray
    buffer_LW: np.ndarray
    slack_L: np.ndarray
    redundant: int
    method: str = "efficientmoe"
    sync_rows: Optional[int] = None

    @property
    def num_layers(self) -> int:
        return self.home_LWS.shape[0]

    @property
    def num_devices(self) -> int:
        return self.home_LWS.shape[1]

    def to_dict(self) -> dict:
        """YAML-ready: the fixed shapes and the home table."""
        return {"method": self.method, "redundant_home_slots": self.redundant,
                "sync_rows": self.sync_rows,
                "spare_slots": self.spare_W.tolist(), "buffer_rows": self.buffer_LW.tolist(),
                "slack": [round(float(s), 4) for s in self.slack_L],
                "home_experts": self.home_LWS.tolist()}


def save_layout(path: str, layout: Layout, extra: Optional[Mapping] = None) -> None:
    """Write ``layout`` as YAML (atomically): ``{kind: efficientmoe-layout, ...}``."""
    body = {"kind": "efficientmoe-layout", **dict(extra or {}), **layout.to_dict()}
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)     # libyaml's, when built
    atomic_write_text(path, yaml.dump(body, Dumper=dumper, sort_keys=False,
                                      default_flow_style=None))


def load_layout(path: str) -> Layout:
    """Read a layout written by :func:`save_layout`; errors name the file and the field."""
    with open(path, encoding="utf-8") as fh:
        body = yaml.safe_load(fh)
    if not isinstance(body, dict) or body.get("kind") != "efficientmoe-layout":
        raise ValueError(f"'{path}' is not an EfficientMoE layout (kind: efficientmoe-layout).")
    try:
        home = np.asarray(body["home_experts"], dtype=np.int64)
        buffers = np.asarray(body["buffer_rows"], dtype=np.int64)
        spare = np.asarray(body["spare_slots"], dtype=np.int64)
        slack = np.asarray(body["slack"], dtype=np.float64)
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"'{path}': a layout needs integer 'home_experts' [L, W, S_h], "
                         f"'buffer_rows' [L, W], 'spare_slots' [W] and 'slack' [L] ({err}).")
    if (home.ndim != 3 or buffers.shape != home.shape[:2] or spare.shape != home.shape[1:2]
            or slack.shape != home.shape[:1]):
        raise ValueError(f"'{path}': layout shapes disagree: home_experts {home.shape}, "
                         f"buffer_rows {buffers.shape}, spare_slots {spare.shape}, slack "
                         f"{slack.shape}.")
    sync_rows = body.get("sync_rows")
    if sync_rows is not None and (isinstance(sync_rows, bool) or not isinstance(sync_rows, int)
                                  or sync_rows < 0):
        raise ValueError(f"'{path}': 'sync_rows' must be an integer >= 0 (or null: as many as "
                         f"the shapes allow), but got {sync_rows!r}.")
    return Layout(home_LWS=home, spare_W=spare, buffer_LW=buffers, slack_L=slack,
                  redundant=int(body.get("redundant_home_slots", 0)),
                  method=str(body.get("method", "efficientmoe")), sync_rows=sync_rows)


def _packing_LS(weights_LS: np.ndarray, num_devices: int, per_device: int,
                group_LS: Optional[np.ndarray] = None) -> np.ndarray:
    """Balanced packing of every layer's items at once: heaviest first onto the least-loaded
    device with a free place (ties: lower device) that holds no item of the same group
    (``group_LS``, int [L, S] >= 0: replicas of one expert; relaxed only when every device
    with room has one). Returns the device of each item, [L, S]."""
    num_layers, num_items = weights_LS.shape
    layers = np.arange(num_layers)
    order = np.lexsort((np.broadcast_to(np.arange(num_items), weights_LS.shape),
                        -weights_LS), axis=1)
    load = np.zeros((num_layers, num_devices))
    room = np.full((num_layers, num_devices), per_device)
    groups = None if group_LS is None else int(group_LS.max()) + 1
    holds = None if groups is None else np.zeros((num_layers, num_devices, groups), bool)
    device_of = np.zeros((num_layers, num_items), dtype=np.int64)
    for k in range(num_items):
        item = order[:, k]
        free = room > 0
        if holds is not None:
            group = group_LS[layers, item]
            apart = free & ~holds[layers, :, group]
            free = np.where(apart.any(axis=1)[:, None], apart, free)
        d = np.argmin(np.where(free, load, np.inf), axis=1)
        device_of[layers, item] = d
        load[layers, d] += weights_LS[layers, item]
        room[layers, d] -= 1
        if holds is not None:
            holds[layers, d, group] = True
    return device_of


def _table(slot_expert_LS: np.ndarray, device_LS: np.ndarray, num_devices: int,
           per_device: int) -> np.ndarray:
    """home_LWS from each layer's slots' experts and devices (ascending expert within a
    device; -1 fills)."""
    num_layers = slot_expert_LS.shape[0]
    home = np.full((num_layers, num_devices, per_device), -1, dtype=np.int64)
    for layer in range(num_layers):
        expert = slot_expert_LS[layer]
        order = np.lexsort((np.where(expert < 0, np.iinfo(np.int64).max, expert),
                            device_LS[layer]))
        devices = device_LS[layer, order]
        position = np.arange(order.size) - np.searchsorted(devices, devices)
        home[layer, devices, position] = slot_expert_LS[layer, order]
    return home


def uniform_home(num_layers: int, num_experts: int, num_devices: int) -> np.ndarray:
    """Plain expert parallelism: expert e on device floor(e W / E), int64 [L, W, ceil(E/W)]."""
    per_device = -(-num_experts // num_devices)
    experts = np.arange(num_experts)
    devices = experts * num_devices // num_experts
    return _table(np.broadcast_to(experts, (num_layers, num_experts)),
                  np.broadcast_to(devices, (num_layers, num_experts)), num_devices,
                  per_device)


def cross_experts_L(home_LWS: np.ndarray, num_experts: int) -> np.ndarray:
    """Experts each layer's home table holds on more than one device, int64 [L] (the rows
    of the layer's replica-gradient table they need)."""
    return (holders_of(home_LWS, num_experts).sum(axis=2) > 1).sum(axis=1)


def place_home(load_LE: np.ndarray, num_devices: int, redundant: int,
               devices_per_node: Optional[int] = None,
               max_cross: Optional[int] = None) -> np.ndarray:
    """EPLB's placement of every layer (module docstring, step 2): int64 [L, W, S_h] with
    S_h = ceil(E / W) + ``redundant``. load_LE: float [L, E] forecast rows per expert.
    devices_per_node: pack replicas onto nodes first, then onto the devices of each node
    (hot experts spread over nodes, so tokens and copies cross fewer node links; this is
    ours, not EPLB's hierarchical policy, which packs expert groups onto nodes for
    group-limited routing and replicates within a node); None or W: one level. max_cross: replicas go to at most this many
    experts of a layer (the rows of a layout's replica-gradient table; None: any); an extra
    slot that no expert may take under it (an expert holds at most W slots) stays empty."""
    load = np.asarray(load_LE, dtype=np.float64)
    num_layers, num_experts = load.shape
    per_device = -(-num_experts // num_devices) + redundant
    total = per_device * num_devices
    layers = np.arange(num_layers)
    replicas = np.ones((num_layers, num_experts), dtype=np.int64)
    for _ in range(total - num_experts):       # each extra slot: the largest load per replica
        ratio = load / replicas
        if max_cross is not None:              # only experts replicated already, when full,
            full = (replicas > 1).sum(axis=1, keepdims=True) >= max_cross
            ratio = np.where((full & (replicas == 1)) | (replicas >= num_devices), -np.inf,
                             ratio)            # and never twice on one device
        e = np.argmax(ratio, axis=1)
        take = np.isfinite(ratio[layers, e])   # else the slot stays empty
        replicas[layers[take], e[take]] += 1
    # every layer's slots: its experts' replicas, then empty slots (-1, no load)
    slot_expert = np.stack([np.concatenate([np.repeat(np.arange(num_experts), r),
                                            np.full(total - r.sum(), -1)]) for r in replicas])
    empty = slot_expert < 0
    per_replica = np.where(empty, 0.0, np.take_along_axis(
        load / replicas, np.where(empty, 0, slot_expert), axis=1))
    # packing groups: an expert's replicas apart; every empty slot a group of its own
    group = np.where(empty, num_experts + np.cumsum(empty, axis=1), slot_expert)
    dpn = devices_per_node or num_devices
    if num_devices % dpn or dpn >= num_devices:
        return _table(slot_expert, _packing_LS(per_replica, num_devices, per_device,
                                               group), num_devices, per_device)
    node = _packing_LS(per_replica, num_devices // dpn, per_device * dpn)       # [L, S]
    device = np.zeros_like(node)
    for n in range(num_devices // dpn):
        # every node holds exactly per_device * dpn replicas: gather them per layer
        items = np.argsort(node != n, axis=1, kind="stable")[:, :per_device * dpn]
        local = _packing_LS(np.take_along_axis(per_replica, items, axis=1), dpn, per_device,
                            np.take_along_axis(group, items, axis=1))
        np.put_along_axis(device, items, n * dpn + local, axis=1)
    return _table(slot_expert, device, num_devices, per_device)


_FULL_CHECKS = 4      # swaps re-split in full per layer and round (refine_home)
_REFINE_CELLS = 2_000_000    # refine_home's rows x layers x experts x devices at full detail


def _swap_candidates(num_slots: int, partners: int) -> tuple:
    """(busiest device's slot, partner index, partner's slot) of every candidate swap, int
    [C] each, C = num_slots^2 x partners."""
    s, p, s2 = np.meshgrid(np.arange(num_slots), np.arange(partners), np.arange(num_slots),
                           indexing="ij")
    return s.ravel(), p.ravel(), s2.ravel()


def refine_home(home_LWS: np.ndarray, rows_TLE: np.ndarray,
                devices_per_node: Optional[int] = None,
                max_rounds: Optional[int] = None,
                max_cells: int = _REFINE_CELLS) -> np.ndarray:
    """Swap home slots so that the fast level's home split balances (module docstring, step
    2). Every layer at once, round after round: on each layer's busiest device (the largest
    mean load over the rows under :func:`~ms_efficient.moe.balance.home_split`), every swap
    of one of its slots with a slot of another device of its node (of any device when
    ``devices_per_node`` is None or W) that holds neither expert is priced by re-splitting
    the two swapped experts over their new holders, the other experts' rows kept; the
    ``_FULL_CHECKS`` cheapest by that price are re-split in full, and the one that most
    lowers the mean over the rows of the largest device load is made. A layer stops at the
    first round where none of them lowers it.

    home_LWS: int [L, W, S_h] (-1: empty). rows_TLE: int [T, L, E] rows per expert of the
    rows to balance. max_rounds: swaps per layer at most (None: W x S_h). max_cells: above
    T x L x E x W cells (a DeepSeek-V3-sized layout: 58 x 256 x 64 per row) the rows are
    replaced by their mean and one swap per layer and round is re-split in full, so that a
    re-plan of that shape stays within seconds.
    Returns the new int64 [L, W, S_h]; deterministic (ties: lower slot and device)."""
    home = np.array(home_LWS, dtype=np.int64)
    rows = np.asarray(rows_TLE, dtype=np.int64)
    num_layers, num_devices, num_slots = home.shape
    checks = _FULL_CHECKS
    if rows.size * num_devices > max_cells:
        rows, checks = np.rint(rows.mean(axis=0, keepdims=True)).astype(np.int64), 1
    num_rows, num_experts = rows.shape[0], rows.shape[2]
    dpn = devices_per_node if devices_per_node and num_devices % devices_per_node == 0 \
        else num_devices
    partners = dpn - 1
    if partners < 1 or num_slots < 1:
        return home
    s_C, p_C, s2_C = _swap_candidates(num_slots, partners)
    num_cand = s_C.size

    def split(table_nWS, which_n):      # home split of tables of layers ``which``
        # -> rows_TnEW, loads_TnW
        held = np.tile(holders_of(table_nWS, num_experts), (num_rows, 1, 1))
        counts = rows[:, which_n].reshape(-1, num_experts)
        out = home_split(counts, held).reshape(num_rows, len(which_n), num_experts,
                                                num_devices)
        return out, out.sum(axis=2)

    layers = np.arange(num_layers)
    split_TLEW, load_TLW = split(home, layers)
    objective = load_TLW.max(axis=2).mean(axis=0)                               # [L]
    active = np.ones(num_layers, dtype=bool)
    pad = num_experts              # the expert index of an empty slot: no rows, never held
    for _ in range(max_rounds or num_devices * num_slots):
        live = layers[active]
        if live.size == 0:
            break
        n = live.size
        busiest = np.argmax(load_TLW[:, live].mean(axis=0), axis=1)               # [n]
        # the other devices of the busiest one's node, in device order
        others = busiest[:, None] // dpn * dpn + np.arange(dpn)[None, :]
        others = np.sort(np.where(others == busiest[:, None], -1, others), axis=1)[:, 1:]
        a = home[live, busiest][:, s_C]                                         # [n, C]
        partner = others[:, p_C]                                               # [n, C]
        b = home[live[:, None], partner, s2_C[None, :]]                         # [n, C]
        a_i, b_i = np.where(a < 0, pad, a), np.where(b < 0, pad, b)
        n_i = np.arange(n)[:, None]
        slots_of = np.zeros((n, num_experts + 1, num_devices), dtype=np.int64)
        np.add.at(slots_of, (n_i[:, :, None], np.where(home[live] < 0, pad, home[live]),
                             np.arange(num_devices)[None, :, None]), 1)
        valid = ((a != b) & ((a >= 0) | (b >= 0))
                 & (slots_of[n_i, a_i, partner] == 0)
                 & (slots_of[n_i, b_i, busiest[:, None]] == 0))
        # holders of a and b after the swap, [n, C, W]
        cand = np.arange(num_cand)[None, :]
        hold_a, hold_b = slots_of[n_i, a_i], slots_of[n_i, b_i]
        hold_a[n_i, cand, busiest[:, None]] -= 1
        hold_a[n_i, cand, partner] += 1
        hold_b[n_i, cand, partner] -= 1
        hold_b[n_i, cand, busiest[:, None]] += 1
        # price every candidate on every row: a, then b, re-split over their new holders,
        # the other experts' rows kept
        zero = np.zeros((num_rows, n, 1, num_devices), dtype=np.int64)
        pieces = np.concatenate([split_TLEW[:, live], zero], axis=2)           # [T, n, E+1, W]
        count = np.concatenate([rows[:, live], zero[..., 0]], axis=2)          # [T, n, E+1]
        base = (load_TLW[:, live][:, :, None, :] - pieces[:, n_i, a_i]
                - pieces[:, n_i, b_i] * (a_i != b_i)[None, :, :, None])        # [T, n, C, W]
        shape = base.shape
        ok = np.broadcast_to(valid[None], shape[:3]).reshape(-1)
        flat = base.reshape(-1, num_devices).astype(np.float64)
        for hold, amount in ((hold_a, count[:, n_i, a_i]), (hold_b, count[:, n_i, b_i])):
            mask = np.broadcast_to(hold[None] > 0, shape).reshape(-1, num_devices)
            flat = flat + water_fill(flat, mask | ~ok[:, None],
                                     np.where(ok, amount.reshape(-1), 0))
        price = np.where(valid, flat.max(axis=1).reshape(shape[:3]).mean(axis=0), np.inf)
        # the few cheapest by that price, re-split in full at once: the best that helps is
        # made
        order = np.argsort(price, axis=1, kind="stable")[:, :checks]      # [n, J]
        jobs = order.shape[1]
        kc = order.ravel()
        kn = np.repeat(np.arange(n), jobs)
        trial = np.repeat(home[live], jobs, axis=0)                             # [n J, W, S]
        j_i = np.arange(n * jobs)
        trial[j_i, busiest[kn], s_C[kc]] = b[kn, kc]
        trial[j_i, partner[kn, kc], s2_C[kc]] = a[kn, kc]
        new_split, new_load = split(trial, np.repeat(live, jobs))
        new_objective = new_load.max(axis=2).mean(axis=0).reshape(n, jobs)
        new_objective = np.where(np.isfinite(price[n_i, order]), new_objective, np.inf)
        pick = np.argmin(new_objective, axis=1)
        gain = new_objective[np.arange(n), pick] < objective[live] * (1 - 1e-9)
        chosen = np.arange(n)[gain] * jobs + pick[gain]
        k = live[gain]
        home[k] = trial[chosen]
        split_TLEW[:, k], load_TLW[:, k] = new_split[:, chosen], new_load[:, chosen]
        objective[k] = new_objective[gain, pick[gain]]
        active[live[~gain]] = False
    return home


def size_buffers(max_over_mean_L: np.ndarray, mean_rows: float, margin: float,
                 tile: int) -> tuple:
    """(buffer_LW row counts int64 [L] per device, slack_L) from each layer's largest
    balanced device load over its mean seen in the trace (step 4)."""
    slack = np.maximum(np.asarray(max_over_mean_L, dtype=np.float64) - 1.0, 0.0) + margin
    rows = np.ceil(mean_rows * (1.0 + slack) / tile) * tile
    return rows.astype(np.int64), slack


def replay_cost_s(rows_TLRE: np.ndarray, home_LWS: np.ndarray, spare_W: np.ndarray,
                  model: CostModel, buffer_LW: Optional[np.ndarray] = None,
                  sync_rows: Optional[int] = None):
    """(mean step seconds over the rows, largest load over mean per layer [L]) of the fast
    level with this layout (its replica-gradient table of ``sync_rows`` rows) on
    ``rows_TLRE`` [T, L, R, E]."""
    num_experts = rows_TLRE.shape[-1]
    sync = home_sync_time_L(home_LWS, num_experts, model, sync_rows)
    copy_cost = copy_cost_rows_WW(model, home_LWS.shape[1])
    total, worst = 0.0, np.zeros(home_LWS.shape[0])
    for counts in rows_TLRE:
        bal = balance_step(counts, home_LWS, spare_W, buffer_LW, copy_cost,
                           devices_per_node=model.cluster.devices_per_node)
        total += float(balanced_cost(bal, model, sync).time_L.sum())
        load = bal.load_LW
        worst = np.maximum(worst, load.max(axis=1) / np.maximum(load.mean(axis=1), 1e-12))
    return total / len(rows_TLRE), worst


def _forecast(history_TLRE: np.ndarray, window: int) -> np.ndarray:
    """Step 1: mean expert load of the last ``window`` rows, float64 [L, E]."""
    return history_TLRE[-window:].sum(axis=2).mean(axis=0)


def _placed(load_LE: np.ndarray, recent_TLRE: np.ndarray, redundant: int,
            config: LayoutConfig, devices_per_node: Optional[int],
            max_cross: Optional[int] = None) -> np.ndarray:
    """Step 2: EPLB's placement of the forecast (replicas of at most ``max_cross`` experts
    per layer), refined on the recent rows when ``config.refine``."""
    home = place_home(load_LE, recent_TLRE.shape[2], redundant,
                      devices_per_node if config.node_first else None, max_cross)
    if config.refine:
        home = refine_home(home, recent_TLRE.sum(axis=2), devices_per_node)
    return home


def plan_layout(history_TLRE: np.ndarray, model: CostModel,
                config: LayoutConfig = LayoutConfig(), method: str = "efficientmoe",
                tile: Optional[int] = None) -> Layout:
    """The slow level's layout from a trace's rows ``history_TLRE`` (int [T, L, R, E], R = W
    ranks, one per device); module docstring. Deterministic: same rows, same layout."""
    history = np.asarray(history_TLRE, dtype=np.int64)
    if history.ndim != 4 or history.shape[0] < 1:
        raise ValueError(f"the layout needs a trace of >= 1 row [T, L, R, E], but got shape "
                         f"{history.shape}.")
    _, num_layers, num_devices, num_experts = history.shape
    recent = history[-config.window:]
    load = _forecast(history, config.window)
    tile = tile or model.cluster.matmul_tile_rows
    if config.forecast_home:
        splits = (range(config.slots + 1) if config.redundant is None
                  else [config.redundant])
    else:
        splits = [0]
    dpn = model.cluster.devices_per_node
    candidates = [(r, _placed(load, recent, r, config, dpn)) for r in splits] \
        if config.forecast_home else []
    if config.redundant is None or not config.forecast_home:
        # the forecast earns its place: plain expert parallelism stays a candidate
        candidates.append((0, uniform_home(num_layers, num_experts, num_devices)))
    best = None
    for redundant, home in candidates:
        spare = np.full(num_devices, config.slots - redundant, dtype=np.int64)
        # the replica-gradient table holds the experts this placement replicates, the most
        # of any layer; re-plans keep within it (replan_home)
        sync_rows = int(cross_experts_L(home, num_experts).max())
        cost, worst = replay_cost_s(recent, home, spare, model, sync_rows=sync_rows)
        if best is None or cost < best[0] - 1e-12:
            best = (cost, redundant, home, spare, worst, sync_rows)
    _, redundant, home, spare, worst, sync_rows = best
    mean_rows = recent.sum(axis=(2, 3)).mean() / num_devices
    buffer_L, slack = size_buffers(worst, mean_rows, config.margin, tile)
    return Layout(home_LWS=home, spare_W=spare,
                  buffer_LW=np.repeat(buffer_L[:, None], num_devices, axis=1),
                  slack_L=slack, redundant=redundant, method=method, sync_rows=sync_rows)


def home_move_bytes_WW(old_LWS: np.ndarray, new_LWS: np.ndarray, bytes_per_slot: float,
                       devices_per_node: Optional[int] = None) -> np.ndarray:
    """Bytes to move from home table ``old`` to ``new``: float64 [W, W] [src, dst], summed over
    layers. Per layer, the rows :func:`~ms_efficient.moe.ep_migration.migrate_rows` moves
    (what :meth:`~ms_efficient.moe.balanced_ep.BalancedExpertParallelMoE.set_plan` sends): a
    new home slot of expert e on device d is free when d held e before; otherwise its weights
    and optimizer state (``bytes_per_slot``) come from a device of d's node that held e, else
    the lowest id, once per destination."""
    old_LWS, new_LWS = np.asarray(old_LWS), np.asarray(new_LWS)
    num_devices = old_LWS.shape[1]
    moved = np.zeros((num_devices, num_devices))
    for before, after in zip(old_LWS, new_LWS):
        if not np.array_equal(before, after):
            moved += migrate_rows(before, after, devices_per_node).rows_WW * bytes_per_slot
    return moved


def migration_time_s(old: Layout, new: Layout, model: CostModel, bytes_per_param: float = 4.0,
                     optimizer_states: int = 2) -> float:
    """Seconds to move the weights and optimizer state of the home slots that change
    (float32 weights plus ``optimizer_states`` tensors per parameter, as the trainer keeps
    them), all layers at once over the cluster's links (one uneven All-to-All)."""
    per_slot = model.expert_params * bytes_per_param * (1 + optimizer_states)
    moved = home_move_bytes_WW(old.home_LWS, new.home_LWS, per_slot,
                               model.cluster.devices_per_node)
    full = np.zeros((model.cluster.num_devices,) * 2)
    full[:moved.shape[0], :moved.shape[1]] = moved
    return uneven_alltoall_time_s(full, model.cluster)


@dataclass(frozen=True)
class HomeDecision:
    """One slow-level re-plan check (:func:`decide_home`).

    candidate: the layout it proposes (the current one's spare slots and buffers).
    gain_s: modelled seconds per step the candidate saves on the recent rows (may be < 0;
        NaN when adopted whatever the gain, which does not replay it).
    cost_s: modelled seconds to move the changed home slots' weights and optimizer state.
    adopt: whether to switch; reason: why, in words (logged and recorded).
    """

    candidate: Layout
    gain_s: float
    cost_s: float
    adopt: bool
    reason: str


def decide_home(history_TLRE: np.ndarray, layout: Layout, config: LayoutConfig,
                model: CostModel, horizon_steps: float, always: bool = False) -> HomeDecision:
    """Whether to re-place the home experts now: the candidate of :func:`replan_home` on
    ``history_TLRE`` (int [T, L, R, E], the rows so far), adopted when its replayed gain per
    step on the last ``config.window`` rows times ``horizon_steps`` (training steps until the
    next check) exceeds the migration's modelled seconds (:func:`migration_time_s`);
    ``always`` (EPLB's schedule, or a forced re-plan) adopts any candidate that moves
    something. The one rule of the simulator (:mod:`~ms_efficient.efficientmoe.two_level`)
    and of training (:class:`~ms_efficient.efficientmoe.ep_replanner.HomeReplanner`)."""
    history = np.asarray(history_TLRE, dtype=np.int64)
    candidate = replan_home(history, layout, config, model.cluster.devices_per_node)
    if np.array_equal(candidate.home_LWS, layout.home_LWS):
        return HomeDecision(candidate, 0.0, 0.0, False,
                            "the slow level proposes the current home table")
    cost_s = migration_time_s(layout, candidate, model)
    if always:                     # the gain is not needed: not replayed (NaN)
        return HomeDecision(candidate, float("nan"), cost_s, True,
                            "re-placed whatever the gain")
    recent = history[-config.window:]
    gain_s = (replay_cost_s(recent, layout.home_LWS, layout.spare_W, model, layout.buffer_LW,
                            layout.sync_rows)[0]
              - replay_cost_s(recent, candidate.home_LWS, candidate.spare_W, model,
                              layout.buffer_LW, layout.sync_rows)[0])
    adopt = gain_s * horizon_steps > cost_s
    verdict = "pays" if adopt else "does not pay"
    return HomeDecision(candidate, gain_s, cost_s, adopt,
                        f"the new home table {verdict}: {gain_s * 1e3:.3f} ms per step x "
                        f"{horizon_steps:g} steps against {cost_s * 1e3:.3f} ms of migration "
                        f"(modelled)")


def replan_home(history_TLRE: np.ndarray, layout: Layout, config: LayoutConfig,
                devices_per_node: Optional[int] = None) -> Layout:
    """A candidate re-plan: steps 1-2 on the recent rows with the layout's split, replicas
    of at most ``layout.sync_rows`` experts per layer; spare slots, buffers and the replica
    table (the compiled shapes) unchanged. The current layout when no such home table is
    found."""
    if not config.forecast_home:
        return layout
    history = np.asarray(history_TLRE, dtype=np.int64)
    home = _placed(_forecast(history, config.window), history[-config.window:],
                   layout.redundant, config, devices_per_node, layout.sync_rows)
    if (layout.sync_rows is not None
            and cross_experts_L(home, int(history.shape[-1])).max() > layout.sync_rows):
        return layout
    return dataclasses.replace(layout, home_LWS=home)


def training_specs(num_layers: int, num_experts: int, world: int, spare_slots: int,
                   mean_rows: float, model: CostModel, buffer_slack: float,
                   history_TLRE: Optional[np.ndarray] = None) -> list:
    """One :class:`~ms_efficient.moe.balance.BalancedSpec` per MoE layer of a training run
    on ``world`` ranks: with ``history_TLRE`` (int [T, L, W, E], the run's ranks), the layout
    :func:`plan_layout` makes of it (``spare_slots`` extra slots per device, split by
    replay); without, plain expert parallelism (:func:`uniform_home`), ``spare_slots`` spare
    slots and buffers of ``mean_rows`` (rows a device computes per step on average) x
    (1 + ``buffer_slack``), on the cube tile. The copy cost follows ``model``'s cluster."""
    tile = model.cluster.matmul_tile_rows
    if history_TLRE is not None:
        history = np.asarray(history_TLRE, dtype=np.int64)
        if history.shape[1:] != (num_layers, world, num_experts):
            raise ValueError(f"the history trace must be [T, {num_layers} MoE layers, {world} "
                             f"ranks, {num_experts} experts], but got {history.shape}.")
        layout = plan_layout(history, model, LayoutConfig(slots=spare_slots), tile=tile)
        homes, spares, buffers = layout.home_LWS, layout.spare_W, layout.buffer_LW
        sync_rows = layout.sync_rows
    else:
        homes = uniform_home(num_layers, num_experts, world)
        spares = np.full(world, spare_slots, dtype=np.int64)
        rows = int(np.ceil(mean_rows * (1.0 + buffer_slack) / tile) * tile)
        buffers = np.full((num_layers, world), rows, dtype=np.int64)
        sync_rows = None
    cost = copy_cost_rows_WW(model, world)
    return [BalancedSpec(homes[layer], int(spares[0]), buffers[layer], cost,
                         model.cluster.devices_per_node, sync_rows)
            for layer in range(num_layers)]
