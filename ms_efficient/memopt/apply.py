"""Apply a MemOpt plan: plan files (YAML, with MindFormers-style ``recompute_config`` and
``swap_config``), each action realised on its Cell by a MindSpore API (``apply_plan``: recompute
``Cell.recompute()``, recompute-all ``Cell.recompute(output_recompute=True)``, swap
``Cell.offload`` on Ascend; recompute-offload has no API and is refused), and the ``memopt``
pass, which plans only the actions its target realises (``env.realisable_actions``).

MindSpore is imported only inside the functions that touch Cells. On CPU MindSpore has no
offload (``Cell.offload`` needs lazy_inline, which does not compile there), so a plan with
swap is refused on CPU rather than applied as a tag nothing reads.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import yaml

from ms_efficient.core.fileio import atomic_write_text
from ms_efficient.core.registry import PassRefused, register_pass
from ms_efficient.memopt.env import (ACTION_NAMES, HOST_ACTIONS, KEEP, OFFLOAD, RECOMPUTE,
                                     RECOMPUTE_ALL, SWAP, MemoryPlan, StepResult,
                                     realisable_actions)
from ms_efficient.memopt.profile import LayerProfile

__all__ = ["plan_to_dict", "plan_from_dict", "save_plan", "load_plan", "apply_plan",
           "recompute_config", "swap_config", "resolve_budget", "budget_bytes", "floor_percent",
           "check_budget_floor", "memopt_pass", "apply_actions"]

logger = logging.getLogger(__name__)


def recompute_config(profile: LayerProfile, plan: MemoryPlan) -> Dict[str, Any]:
    """MindFormers-style ``recompute_config``: ``recompute`` lists the recomputed Cells."""
    names = [n for n, a in zip(profile.names, plan.actions)
             if a in (RECOMPUTE, RECOMPUTE_ALL, OFFLOAD)]
    return {"recompute": names, "select_recompute": False,
            "parallel_optimizer_comm_recompute": False, "mp_comm_recompute": True,
            "recompute_slice_activation": False}


def swap_config(profile: LayerProfile, plan: MemoryPlan) -> Dict[str, Any]:
    """MindFormers-style ``swap_config``: one ``op_swap`` entry per swapped Cell with its
    ``backward_prefetch`` (the prefetch lead) and the swap-out delay MemOpt chose;
    ``output_only`` marks recompute-offload Cells (only their output is swapped)."""
    entries = [{"op_name": n, "backward_prefetch": int(plan.prefetch_lead[i]),
                "swap_out_delay": int(plan.swap_delay[i]),
                **({"output_only": True} if plan.actions[i] == OFFLOAD else {})}
               for i, n in enumerate(profile.names) if plan.actions[i] in HOST_ACTIONS]
    return {"swap": bool(entries), "default_prefetch": 1, "layer_swap": [], "op_swap": entries}


def plan_to_dict(profile: LayerProfile, plan: MemoryPlan, result: Optional[StepResult],
                 budget_bytes: float, extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The plan file's content (plain YAML types)."""
    layers = [{"name": n, "action": ACTION_NAMES[int(a)],
               **({"swap_delay": int(plan.swap_delay[i]),
                   "prefetch_lead": int(plan.prefetch_lead[i])} if a in HOST_ACTIONS else {})}
              for i, (n, a) in enumerate(zip(profile.names, plan.actions))]
    doc: Dict[str, Any] = {"kind": "memopt", "version": 1, "method": plan.method,
                           "batch_size": int(profile.batch_size),
                           "budget_bytes": int(budget_bytes), "layers": layers}
    if result is not None:
        doc["simulated"] = {"step_time_s": result.step_time_s,
                            "peak_bytes": int(result.peak_bytes), "fits": result.fits}
    doc["meta"] = {k: (float(v) if isinstance(v, (np.floating, float)) else v)
                   for k, v in plan.meta.items()}
    doc.update(extra or {})
    doc["recompute_config"] = recompute_config(profile, plan)
    doc["swap_config"] = swap_config(profile, plan)
    return doc


def plan_from_dict(doc: Dict[str, Any], source: str = "plan") -> Tuple[List[str], MemoryPlan]:
    """(layer names, MemoryPlan) from a plan file; ValueError names the bad entry."""
    if not isinstance(doc, dict) or doc.get("kind") != "memopt" or "layers" not in doc:
        raise ValueError(f"{source}: not a MemOpt plan (needs kind: memopt and layers).")
    names, actions, delays, leads = [], [], [], []
    if not isinstance(doc["layers"], list):
        raise ValueError(f"{source}: 'layers' must be a list, but got {doc['layers']!r}.")
    for i, layer in enumerate(doc["layers"]):
        action = layer.get("action") if isinstance(layer, dict) else None
        if action not in ACTION_NAMES:
            raise ValueError(f"{source}: layers[{i}].action must be one of {list(ACTION_NAMES)}, "
                             f"but got {action!r}.")
        names.append(str(layer.get("name")))
        actions.append(ACTION_NAMES.index(action))
        delays.append(int(layer.get("swap_delay", 0)))
        leads.append(int(layer.get("prefetch_lead", 1)))
    return names, MemoryPlan(np.array(actions), np.array(delays), np.array(leads),
                             method=str(doc.get("method", "")))


def save_plan(path: str, doc: Dict[str, Any]) -> None:
    atomic_write_text(path, yaml.safe_dump(doc, sort_keys=False))


def load_plan(path: str) -> Tuple[List[str], MemoryPlan]:
    """Read a plan written by ``plan memory``; ValueError names the file and the problem."""
    from ms_efficient.core.fileio import read_yaml_document

    doc = read_yaml_document(path, "MemOpt plan")
    try:
        return plan_from_dict(doc, source=path)
    except (TypeError, AttributeError) as err:
        raise ValueError(f"{path}: malformed MemOpt plan ({err}).") from None


def apply_plan(network, names: List[str], plan: MemoryPlan,
               device_target: str = "CPU") -> Dict[str, List[str]]:
    """Realise ``plan`` on the Cells named ``names`` (Cell paths as in
    ``network.cells_and_names()``, e.g. ``blocks.3.attn``), each action with the MindSpore
    API whose effect the simulator (``memopt.env``) charges:

        recompute       ``Cell.recompute()``: the Cell's interior is re-run in backward, its
                        output is kept (MindSpore excludes a recompute Cell's outputs).
        recompute-all   ``Cell.recompute(output_recompute=True)``: the output is not kept
                        either, and adjacent such Cells are merged into one recomputation
                        (a Chen segment re-run from the last kept output below it).
        swap            ``Cell.offload(backward_prefetch=prefetch_lead)``, Ascend only:
                        MindSpore offloads a Cell's activations only inside ``lazy_inline``
                        Cells, and lazy_inline does not compile on CPU.
        recompute-offload  no MindSpore API swaps only a Cell's output (per-primitive offload,
                        ``Primitive._offload``, is private): refused.
    Raises ValueError naming the Cell for an unknown name, an action the target cannot
    realise, or a swap on a Cell outside lazy_inline.
    Returns {"recompute": [...], "recompute_all": [...], "swap": [...]} of what was applied.
    """
    return apply_actions(network, names, plan.actions, plan.prefetch_lead, device_target)


def apply_actions(network, names: List[str], actions, prefetch_lead,
                  device_target: str = "CPU") -> Dict[str, List[str]]:
    """:func:`apply_plan` with the actions (int codes) and prefetch leads given per Cell
    as they are: no chain rule rewrites them (a MemoryPlan turns its LAST layer's
    recompute-all into recompute, right for a chain, not for a list of Cells)."""
    cells = dict(network.cells_and_names())
    unknown = [n for n in names if n not in cells]
    if unknown:
        raise ValueError(f"plan names unknown Cells {unknown[:5]}; the network has e.g. "
                         f"{[n for n in cells if n][:6]}.")
    for name, action in zip(names, actions):
        _check_realisable(name, cells, int(action), device_target)
    applied: Dict[str, List[str]] = {"recompute": [], "recompute_all": [], "swap": []}
    for i, name in enumerate(names):
        cell, action = cells[name], int(actions[i])
        if action == RECOMPUTE:
            cell.recompute()
            applied["recompute"].append(name)
        elif action == RECOMPUTE_ALL:
            cell.recompute(output_recompute=True)
            applied["recompute_all"].append(name)
        elif action == SWAP:  # pragma: no cover - Ascend only (_check_realisable)
            cell.offload(backward_prefetch=int(prefetch_lead[i]))
            applied["swap"].append(name)
    logger.info("memopt: recompute on %d Cells, recompute-all on %d, offload on %d",
                len(applied["recompute"]), len(applied["recompute_all"]), len(applied["swap"]))
    return applied


def _check_realisable(name: str, cells: Dict[str, Any], action: int, device_target: str) -> None:
    """ValueError when ``action`` on Cell ``name`` has no MindSpore API on ``device_target``;
    ``cells``: the network's ``{path: Cell}``."""
    if action == OFFLOAD:
        raise ValueError(
            f"Cell '{name}': recompute-offload needs its output alone swapped to the host, and "
            f"MindSpore has no public API for that (Cell.offload moves all the Cell's "
            f"activations); plan with {[ACTION_NAMES[a] for a in realisable_actions('Ascend')]}.")
    if action not in realisable_actions(device_target):
        raise ValueError(
            f"Cell '{name}': {ACTION_NAMES[action]} cannot run on {device_target}: MindSpore "
            f"offloads activations (Cell.offload) only on Ascend, inside lazy_inline Cells; "
            f"plan with {[ACTION_NAMES[a] for a in realisable_actions(device_target)]}.")
    if action == SWAP and not _inside_lazy_inline(cells, name):
        raise ValueError(
            f"Cell '{name}': swap uses Cell.offload, which MindSpore applies only inside a "
            f"lazy_inline Cell; decorate the __init__ of {type(cells[name]).__name__} (or of "
            f"a Cell holding it) with mindspore.lazy_inline.")


def resolve_budget(value, profile: LayerProfile, cluster) -> Tuple[float, float]:
    """(budget bytes, unoptimised simulated peak bytes) for ``optimize.memory_budget``: bytes
    or a size as given, a share of the unoptimised peak, or "" = the cluster's device memory."""
    return budget_bytes(value, profile, cluster.host_link, cluster.device_memory_bytes,
                        "optimize.memory_budget")


def budget_bytes(value, profile: LayerProfile, host_link, device_bytes: float,
                 what: str) -> Tuple[float, float]:
    """(budget bytes, unoptimised simulated peak bytes) for a budget ``value`` given as
    ``what`` (a config field or a CLI option): bytes or a size, a share such as "50%" of the
    unoptimised peak, or "" = ``device_bytes``. ValueError names ``what`` for a bad value."""
    from ms_efficient.core.units import parse_budget
    from ms_efficient.memopt.env import evaluate

    keep = MemoryPlan(np.full(profile.num_layers, KEEP))
    peak = evaluate(profile, keep, float("inf"), host_link).peak_bytes
    if value == "" or value is None:
        return float(device_bytes), peak
    nbytes, share = parse_budget(value, what)
    return (float(nbytes) if nbytes is not None else share * peak), peak


def floor_percent(floor: float, peak: float) -> float:
    """The floor as a percentage of ``peak``, rounded UP to 0.1 (a budget of that share is
    at or above the floor, float rounding of the share included)."""
    return math.ceil(floor / peak * 1000.0 * (1.0 + 1e-9)) / 10.0 if peak > 0 else 100.0


def check_budget_floor(value, what: str, budget: float, peak: float, floor: float,
                       safe: float, actions) -> None:
    """ValueError when ``budget`` is below ``floor``: one message naming ``what``, the value,
    the floor as a share of the unoptimised ``peak`` and in bytes, and a share at or above
    ``safe`` (where a recompute plan fits) to set instead."""
    from ms_efficient.core.units import format_size

    if budget >= floor:
        return
    shown = f"{value}, {format_size(budget)}" if str(value) != str(int(budget)) \
        else f"{int(budget)} bytes"
    pct, ok = floor_percent(floor, peak), floor_percent(safe, peak)
    host = bool(set(actions) & set(HOST_ACTIONS))
    how = ("static bytes plus the largest single-layer working set" if host else
           "the least peak any plan of " + "/".join(ACTION_NAMES[a] for a in actions)
           + " reaches")
    if ok >= 100:
        advice = ("no recompute plan lowers the peak on this network; lower the batch size "
                  "or leave memopt out")
    else:
        advice = (f"set it to at least '{ok:g}%' ({int(math.ceil(safe))} bytes)"
                  + (", where a recompute plan fits (below, only swapping can)"
                     if ok > pct else ""))
    raise ValueError(f"'{what}' ({shown}) is below the feasible floor {pct:.1f}% "
                     f"({format_size(floor)}) of the unoptimised peak {format_size(peak)}: "
                     f"{how}; {advice}.")


def _inside_lazy_inline(cells: Dict[str, Any], name: str) -> bool:
    """True when Cell ``name`` or a Cell holding it is lazy_inline (``mindspore.lazy_inline``
    on its ``__init__`` sets ``cell_init_args`` to "lazy_inline_<class>...")."""
    chain = [name] + [name.rsplit(".", k)[0] for k in range(1, name.count(".") + 1)] + [""]
    return any(str(getattr(cells.get(p), "cell_init_args", "") or "").startswith("lazy_inline_")
               for p in chain)


def _plan_device(profile: LayerProfile, value, cluster, actions,
                 reference_peak: Optional[float] = None) -> Dict[str, Any]:
    """Plan one device's profile within ``optimize.memory_budget`` (``value``). A share is of
    ``reference_peak`` when given (the largest unoptimised peak of several pipeline stages:
    every device has the same memory), else of this device's peak. Returns {"profile",
    "budget", "peak", "floor", "safe", "plan", "result"}; "plan" is None when the unoptimised
    peak already fits. Raises PassRefused when recompute does not pay or the budget is below
    the feasible floor (``check_budget_floor``'s one message, its shares of the reference)."""
    from ms_efficient.core.units import format_size, parse_budget
    from ms_efficient.memopt.planner import budget_floor, plan_memory

    budget, peak = resolve_budget(value, profile, cluster)
    share = None if value in ("", None) else parse_budget(value, "optimize.memory_budget")[1]
    if share is not None and reference_peak is not None:
        budget = share * reference_peak
    shown_peak = peak if reference_peak is None else reference_peak
    floor, safe, least = budget_floor(profile, cluster.host_link, actions)
    out = {"profile": profile, "budget": budget, "peak": peak, "floor": floor, "safe": safe,
           "plan": None, "result": None}
    if peak <= budget:
        return out
    where = "" if profile.meta.get("device") == "one device" else f" on {profile.meta['device']}"
    if floor_percent(safe, peak) >= 100.0:
        raise PassRefused(
            f"memopt: no plan of {profile.num_layers} Cells ({profile.names[0]} ...){where} "
            f"lowers the unoptimised simulated peak {format_size(peak)} by 0.1% or more (its "
            f"floor is {format_size(safe)}): recompute does not pay on this network; leave "
            f"memopt out.")
    try:
        check_budget_floor(value if value != "" else int(budget), "optimize.memory_budget",
                           budget, shown_peak, floor, safe, actions)
    except ValueError as err:
        note = where.strip() + ("" if reference_peak is None else
                                "; shares are of the largest stage's unoptimised peak")
        raise PassRefused(f"{err}{note and ' (' + note + ')'}") from None
    try:
        plan, result = plan_memory(profile, budget, cluster.host_link, actions=actions)
    except ValueError as err:
        if budget < safe:
            raise PassRefused(f"memopt: {err}") from None
        plan, result = plan_memory(profile, budget, cluster.host_link, actions=actions,
                                   candidates={"checkmate-milp": least})
    out.update(plan=plan, result=result)
    return out


def _device_row(got: Dict[str, Any]) -> Dict[str, Any]:
    """One device's figures in the plan (bytes, seconds; the step counts the ops outside the
    planned Cells)."""
    profile, result = got["profile"], got["result"]
    return {"device": profile.meta["device"], "budget_bytes": int(got["budget"]),
            "unoptimised_peak_bytes": int(round(got["peak"])),
            "floor_bytes": int(math.ceil(got["floor"])),
            "planned": got["plan"] is not None,
            "unoptimised_step_time_s": float(profile.forward_time_s.sum()
                                             + profile.backward_time_s.sum())
            + profile.meta["outside_time_s"],
            "peak_bytes": int(round(result.peak_bytes)) if result else int(round(got["peak"])),
            "step_time_s": (result.step_time_s if result else
                            float(profile.forward_time_s.sum() + profile.backward_time_s.sum()))
            + profile.meta["outside_time_s"],
            "layers": list(profile.names)}


def apply_segments(network, segments: List[List[str]], names: List[str], plan: MemoryPlan,
                   device_target: str = "CPU") -> Dict[str, List[str]]:
    """Realise a plan over segments (units named by their first Cell, ``names``) on every
    Cell of each planned segment (``memopt.segments.segment_cell_actions``) with
    :func:`apply_actions`; returns what it applied, per Cell."""
    from ms_efficient.memopt.segments import segment_cell_actions

    of = {seg[0]: seg for seg in segments}
    cell_names, cell_actions = segment_cell_actions([of[n] for n in names], plan)
    return apply_actions(network, cell_names, cell_actions, [1] * len(cell_names),
                         device_target)


@register_pass("memopt")
def memopt_pass(network, context) -> Tuple[Any, Dict[str, Any]]:
    """The ``memopt`` pass on the user's network: units are its repeated blocks (or the Cells
    ``optimize.memopt_cells`` names; without repeated blocks, contiguous segments of its
    largest CellList / SequentialCell, each realised on its own Cells, see
    ``memopt.segments``: the plan's ``segments``, its ``layers`` named by a segment's first Cell
    with the segment's ``cells``), profiled from its train-step graph with the cost
    model every pass shares (``memopt.profile.profile_from_units``) and planned within
    ``optimize.memory_budget`` (default: the device memory) with the actions the device target
    realises; the plan is applied by Cell path.

    Passes compose: after ``shard`` the profile holds one device's bytes and compute (each
    operator's output split and parameter state from the shard plan); after ``place`` every
    pipeline stage is planned on its own with the micro-batches it holds in flight under 1F1B
    (``memopt.profile.device_shares``, ``LayerProfile.in_flight``), and the budget (a size, a
    share of the largest stage's unoptimised peak, or the device memory) applies per stage. List memopt after
    shard and place in ``optimize.passes`` for that.

    Returns (network, plan dict with ``cells``, ``devices`` (per planned device / stage) and
    ``unoptimised`` (the network's shared price on one device)). Raises PassRefused (a
    ValueError; ``optimize`` records it as ``{"refused": reason}``) when the network has no
    Cell to plan, recompute does not pay, the budget is below the feasible floor (named as a
    share of the unoptimised peak and in bytes) or every device's unoptimised peak already
    fits it; the network is unchanged then."""
    from ms_efficient.core.units import format_size
    from ms_efficient.graph.cells import (assign_segments, assign_units, match_cells,
                                          repeated_blocks, sequence_groups, user_cell_path)
    from ms_efficient.memopt.profile import device_shares, profile_from_units

    config = context.config
    tree = context.cell_tree()
    patterns = config.optimize.memopt_cells
    units = match_cells(tree, patterns) if patterns else repeated_blocks(tree)
    # never MindSpore's own wrappers (a recomputed Cell's ``_recompute_cell``): user Cells only
    units = [u for u in units if user_cell_path(u)]
    groups = [] if patterns or units else [
        g for g in sequence_groups(tree) if all(user_cell_path(c) for c in g)]
    if not units and not groups:
        raise PassRefused(
            "memopt: found no repeated blocks (children of a CellList or SequentialCell, >= 2 "
            "of one class, holding parameters) and no CellList / SequentialCell with >= 2 "
            "Cells holding parameters; name the Cells to plan with optimize.memopt_cells, "
            "e.g. ['layers.*'].")
    graph = context.graph("the memopt pass")
    cluster = config.cluster_spec()
    first = context.sample_inputs[0]
    batch = int(first.shape[0]) if getattr(first, "shape", None) else 1
    target = config.context.device_target
    actions = realisable_actions(target)
    cells = dict(network.cells_and_names())
    value = config.optimize.memory_budget
    shares = device_shares(graph, cluster, context.plans.get("shard"),
                           context.plans.get("place"))

    def profiles_of(assignment):
        return [profile_from_units(graph, assignment, cluster, batch, share)
                for share in shares]

    def plan_devices(profiles):
        top = (None if len(profiles) == 1 else
               max(resolve_budget("", p, cluster)[1] for p in profiles))
        return [_plan_device(profile, value, cluster, actions, top) for profile in profiles]

    segments: Optional[List[List[str]]] = None
    if groups:          # no repeated blocks: contiguous segments of the top-level sequence
        from ms_efficient.memopt.segments import choose_segments, describe_segments

        actions = tuple(a for a in actions if a not in HOST_ACTIONS)
        pieces = profile_from_units(graph, assign_segments(graph, groups), cluster, batch)
        segments, profiles, devices = choose_segments(
            groups, pieces.output_bytes + pieces.interior_bytes,
            lambda segs: profiles_of(assign_segments(graph, segs)), plan_devices,
            lambda profiles: _floor_share(profiles, cluster, actions))
        units = [seg[0] for seg in segments]
    else:
        if SWAP in actions and not all(_inside_lazy_inline(cells, u) for u in units):
            actions = tuple(a for a in actions if a != SWAP)  # Cell.offload needs lazy_inline
        profiles = profiles_of(assign_units(graph, units))
        devices = plan_devices(profiles)
    planned = [got for got in devices if got["plan"] is not None]
    if not planned:
        top = max(devices, key=lambda got: got["peak"])
        where = "" if len(devices) == 1 else f" (the largest of {len(devices)} stages)"
        raise PassRefused(
            f"memopt: the unoptimised simulated peak {format_size(top['peak'])}{where} of the "
            f"{len(units)} planned Cells ({units[0]} ...) already fits 'optimize.memory_budget' "
            f"{format_size(top['budget'])}; nothing to recompute or swap. Set it between the "
            f"feasible floor and the peak, e.g. '{floor_percent(top['safe'], top['peak']):g}%'.")
    main = max(planned, key=lambda got: got["peak"])
    profile, plan = main["profile"], main["plan"]
    doc = plan_to_dict(profile, plan, main["result"], main["budget"],
                       extra={"unoptimised_peak_bytes": int(main["peak"]),
                              "floor_bytes": int(math.ceil(main["floor"])),
                              "outside_time_s": profile.meta["outside_time_s"],
                              "optimizer_time_s": profile.meta["optimizer_time_s"]})
    # the whole device's step (the Cells outside the plan included), as ``unoptimised``'s
    doc["simulated"]["step_time_s"] += profile.meta["outside_time_s"]
    actions_of: Dict[str, int] = {}
    applied: Dict[str, List[str]] = {"recompute": [], "recompute_all": [], "swap": []}
    for got in planned:
        got_applied = (apply_plan(network, got["profile"].names, got["plan"], target)
                       if segments is None else
                       apply_segments(network, segments, got["profile"].names, got["plan"],
                                      target))
        for key in applied:
            applied[key] += got_applied[key]
        actions_of.update({n: int(a) for n, a in zip(got["profile"].names, got["plan"].actions)
                           if a != KEEP})
    if len(devices) > 1:        # every stage's layers, and MindFormers' lists of all of them
        doc["layers"] = [layer for got in devices for layer in plan_to_dict(
            got["profile"], got["plan"] or MemoryPlan(np.full(got["profile"].num_layers, KEEP)),
            None, got["budget"])["layers"]]
        doc["recompute_config"]["recompute"] = applied["recompute"] + applied["recompute_all"]
        doc["swap_config"] = {**doc["swap_config"], "op_swap": [
            entry for got in planned for entry in swap_config(got["profile"], got["plan"])[
                "op_swap"]]}
        doc["swap_config"]["swap"] = bool(doc["swap_config"]["op_swap"])
    doc["device"] = profile.meta["device"]
    doc["devices"] = [_device_row(got) for got in devices]
    doc["unoptimised"] = context.unoptimised("the memopt pass").to_dict()
    recomputed = applied["recompute"] + applied["recompute_all"]
    if segments is not None:
        describe_segments(doc, segments, actions_of, applied)
        return network, doc
    doc["cells"] = {name: {"action": ACTION_NAMES[action_of],
                           "recompute": name in recomputed,
                           "output_recompute": name in applied["recompute_all"],
                           "swap": name in applied["swap"]}
                    for name, action_of in actions_of.items()}
    return network, doc


def _floor_share(profiles: List[LayerProfile], cluster, actions) -> float:
    """The largest feasible floor of ``profiles`` as a share of its unoptimised peak."""
    from ms_efficient.memopt.planner import budget_floor

    return max(budget_floor(p, cluster.host_link, actions)[0]
               / resolve_budget("", p, cluster)[1] for p in profiles)
