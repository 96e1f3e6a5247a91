"""Markdown report with PNG plots for a training run folder (see train.py for its layout).

The report itself has no MindSpore dependency: it can be rebuilt from a run folder on any
machine (``ms-efficient report RUN_DIR``). Only the optional MindInsight summaries
(``summary/``, :func:`write_summaries`) import MindSpore; without it they are skipped and the
report says why.

Balance figures come from the train rows of ``metrics.jsonl``: each carries, per MoE layer,
the routing balance of the last step of its log window (``moe.trace.layer_balance``). The
report's percentiles run over every (logged step, MoE layer) pair, the "layer-steps".
"""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
from typing import Dict, List, Optional, Tuple

import numpy as np

from ms_efficient.core.backend import ASCEND, CPU, GPU
from ms_efficient.core.fileio import (TEMP_PREFIX, atomic_write_text, atomic_write_with,
                                      fsync_path, read_yaml_document)
from ms_efficient.moe.trace import load_trace

__all__ = ["write_report", "read_metrics", "run_device", "balance_percentiles",
           "device_load_matrix", "device_load_missing_reason", "summary_scalars",
           "write_summaries", "BALANCE_FIGURES", "SUMMARY_DIR", "DEVICE_LOAD_PNG"]

logger = logging.getLogger(__name__)

# What the report writes into the run folder besides report.md, loss.png, expert_load.png.
DEVICE_LOAD_PNG = "device_load.png"
SUMMARY_DIR = "summary"
# The device targets a run config may name (core.config.ContextConfig.validate).
DEVICES = (CPU, ASCEND, GPU)
# Per-layer balance figures of a train row (key, report label), in report order.
BALANCE_FIGURES = (("expert_max_over_mean", "tokens per expert, max / mean"),
                   ("expert_cv", "tokens per expert, coefficient of variation"),
                   ("device_max_over_mean", "rows per device, max / mean"),
                   ("device_cv", "rows per device, coefficient of variation"),
                   ("dead_experts", "experts with no token"),
                   ("copies", "expert copies (fast level)"),
                   ("dropped", "rows dropped"))
# Small multiples per MoE layer in device_load.png up to this many layers (sum only above).
MAX_LAYER_PANELS = 4


def read_metrics(run_dir: str) -> List[Dict]:
    """Rows of ``metrics.jsonl`` (train and val), in file order."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ValueError(f"'{run_dir}' is not a run folder: it has no metrics.jsonl.")
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def run_device(run_dir: str) -> Tuple[Optional[str], Optional[str]]:
    """The device target and MindSpore mode the run was configured with: ``context.device_target``
    (one of :data:`DEVICES`) and ``context.mode`` of the run folder's ``config.yaml``.

    Returns (device, mode); (None, None) when the folder has no config.yaml; mode is None when
    the config names none. ValueError naming the file, field, value and the allowed values
    when config.yaml is malformed or names another device."""
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        return None, None
    config = read_yaml_document(path, "run config")
    context = config.get("context") if isinstance(config, dict) else None
    if not isinstance(context, dict):
        raise ValueError(f"run config '{path}' field 'context' must be a mapping holding "
                         f"'device_target', but got {context!r}.")
    device = context.get("device_target")
    if device not in DEVICES:
        raise ValueError(f"run config '{path}' field 'context.device_target' must be one of "
                         f"{list(DEVICES)}, but got {device!r}.")
    mode = context.get("mode")
    return device, (str(mode) if mode is not None else None)


def _number(value, step, layer, key) -> float:
    """``value`` as a float; ValueError naming the metrics row when it is not a finite number."""
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value)):
        raise ValueError(f"metrics.jsonl train row of step {step}, MoE layer {layer}: '{key}' "
                         f"must be a finite number, but got {value!r}.")
    return float(value)


def _balanced_rows(rows: List[Dict]) -> List[Dict]:
    """The train rows that carry a per-layer ``balance`` list, in file order."""
    return [m for m in rows if m.get("kind") == "train" and m.get("balance")]


def balance_percentiles(rows: List[Dict], key: str) -> Optional[Dict]:
    """p50, p95 and max of the per-layer balance figure ``key`` (e.g. ``device_max_over_mean``)
    over every logged train step and every MoE layer of ``rows`` (the metrics.jsonl rows).

    Each train row's ``balance`` holds one entry per MoE layer with the figure of the last
    step of its log window; the percentiles (numpy's linear interpolation) run over all
    these (step, layer) values, the "layer-steps". Returns ``{"p50", "p95", "max"}`` (floats,
    unit of the figure) with ``"layer_steps"`` (how many values) and ``"steps"`` (how many
    logged steps carried the figure), or None when no row carries it."""
    values, steps = [], 0
    for row in _balanced_rows(rows):
        found = [_number(b[key], row.get("step"), b.get("layer", i), key)
                 for i, b in enumerate(row["balance"]) if key in b]
        values += found
        steps += bool(found)
    if not values:
        return None
    arr = np.asarray(values, dtype=np.float64)
    return {"p50": float(np.percentile(arr, 50)), "p95": float(np.percentile(arr, 95)),
            "max": float(arr.max()), "layer_steps": arr.size, "steps": steps}


def device_load_missing_reason(rows: List[Dict]) -> Optional[str]:
    """Why ``rows`` (the metrics.jsonl rows) give no per-device load map, or None when they
    give one (some train row has ``rows_per_device``, written by expert-parallel runs)."""
    balanced = _balanced_rows(rows)
    if any("rows_per_device" in b for row in balanced for b in row["balance"]):
        return None
    if not balanced:
        return "metrics.jsonl has no train row with a per-layer 'balance'."
    if any("device_max_over_mean" in b for row in balanced for b in row["balance"]):
        return ("the train rows carry 'device_max_over_mean' but not the rows each device "
                "computed ('rows_per_device'), so there is no per-device load to map.")
    return ("this is a one-process run: every expert runs in the one process, so its train "
            "rows carry per-expert balance figures and no rows per device "
            "('rows_per_device', written by expert-parallel runs, `train --workers W`); "
            "the load per expert is in expert_load.png.")


def device_load_matrix(rows: List[Dict], per_layer: bool = False
                       ) -> Tuple[np.ndarray, np.ndarray, List[int]]:
    """The rows each device computed at each logged step, from the ``rows_per_device`` of the
    train rows of ``rows`` (the metrics.jsonl rows of an expert-parallel run).

    Returns (load, steps, replan_steps):
    load: float64 [device, logged step] rows computed, summed over the MoE layers, or with
    ``per_layer`` float64 [MoE layer, device, logged step]; NaN where a device or layer has
    no figure at that step (e.g. a run resumed at another world size);
    steps: int64 [logged step] the training step of each column (train rows that carry
    ``rows_per_device``, in file order);
    replan_steps: the steps after which an expert re-placement ran (``kind: "replan"`` rows),
    ascending.
    ValueError when no train row has ``rows_per_device`` (the message says why) or a
    ``rows_per_device`` is not a list of non-negative finite numbers."""
    reason = device_load_missing_reason(rows)
    if reason is not None:
        raise ValueError(f"no per-device load: {reason}")
    train = [r for r in _balanced_rows(rows)
             if any("rows_per_device" in b for b in r["balance"])]
    layers = max(len(r["balance"]) for r in train)
    devices = max(len(b.get("rows_per_device", ())) for r in train for b in r["balance"])
    load = np.full((layers, devices, len(train)), np.nan)
    for col, row in enumerate(train):
        for layer, entry in enumerate(row["balance"]):
            if "rows_per_device" not in entry:
                continue
            per_device = entry["rows_per_device"]
            if not isinstance(per_device, list) or not per_device:
                raise ValueError(f"metrics.jsonl train row of step {row.get('step')}, MoE "
                                 f"layer {layer}: 'rows_per_device' must be a non-empty list "
                                 f"of rows per device, but got {per_device!r}.")
            for device, value in enumerate(per_device):
                value = _number(value, row.get("step"), layer, "rows_per_device")
                if value < 0:
                    raise ValueError(f"metrics.jsonl train row of step {row.get('step')}, MoE "
                                     f"layer {layer}: 'rows_per_device' must be >= 0, but got "
                                     f"{value:g} for device {device}.")
                load[layer, device, col] = value
    steps = np.array([int(r["step"]) for r in train], dtype=np.int64)
    replan_steps = sorted(int(r["step"]) for r in rows if r.get("kind") == "replan")
    if per_layer:
        return load, steps, replan_steps
    empty = np.isnan(load).all(axis=0)
    summed = np.where(empty, np.nan, np.nansum(load, axis=0))
    return summed, steps, replan_steps


def _finite(value) -> bool:
    return (not isinstance(value, bool) and isinstance(value, (int, float))
            and math.isfinite(value))


def summary_scalars(rows: List[Dict]) -> Dict[int, Dict[str, float]]:
    """The scalars the MindInsight summaries hold, per training step (ascending): from train
    rows ``loss``, ``ce`` (nats per byte), ``tokens_per_s``, ``drop_rate`` (fraction) and, of
    each MoE-layer balance figure ``device_max_over_mean`` and ``expert_max_over_mean``, the
    p50 and p95 over the MoE layers of that step (``balance/<figure>/p50``, ``.../p95``); from
    val rows ``val_loss`` (nats per byte). Non-finite or missing values are left out; a later
    row of the same step replaces an earlier one's value (a resumed run)."""
    out: Dict[int, Dict[str, float]] = {}
    for row in rows:
        kind, step = row.get("kind"), row.get("step")
        if kind not in ("train", "val") or not isinstance(step, int):
            continue
        values = out.setdefault(step, {})
        names = ("loss", "ce", "tokens_per_s", "drop_rate") if kind == "train" else ("val_loss",)
        values.update({n: float(row[n]) for n in names if _finite(row.get(n))})
        for key in ("device_max_over_mean", "expert_max_over_mean"):
            figures = [b[key] for b in row.get("balance") or () if _finite(b.get(key))]
            if figures:
                values[f"balance/{key}/p50"] = float(np.percentile(figures, 50))
                values[f"balance/{key}/p95"] = float(np.percentile(figures, 95))
    return {step: out[step] for step in sorted(out) if out[step]}


def _event_records(path: str) -> int:
    """How many records an events file holds (each: 8-byte length, 4-byte CRC, the data,
    4-byte CRC); ValueError when the file ends inside a record."""
    size, count, offset = os.path.getsize(path), 0, 0
    with open(path, "rb") as fh:
        while offset < size:
            head = fh.read(8)
            if len(head) < 8:
                raise ValueError(f"summary file '{path}' ends inside a record header.")
            offset += 16 + int.from_bytes(head, "little")
            if offset > size:
                raise ValueError(f"summary file '{path}' ends inside a record.")
            fh.seek(offset)
            count += 1
    return count


def _replace_folder(new: str, final: str) -> None:
    """Put folder ``new`` at ``final`` (same parent), removing the folder there before."""
    parent = os.path.dirname(os.path.abspath(final))
    if os.path.lexists(final) and (os.path.islink(final) or not os.path.isdir(final)):
        raise ValueError(f"'{final}' exists and is not a folder; remove it to write summaries.")
    old = None
    if os.path.isdir(final):
        old = os.path.join(parent, f"{TEMP_PREFIX}{SUMMARY_DIR}-old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(new, final)
    fsync_path(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_summaries(run_dir: str, rows: List[Dict]) -> Tuple[Optional[str], Optional[str]]:
    """Write :func:`summary_scalars` of ``rows`` through MindSpore's ``SummaryRecord`` into
    ``run_dir/summary/`` (one events file, one record per step), for MindInsight
    (``mindinsight start --summary-base-dir RUN_DIR``).

    The events go into a fresh ``.tmp-summary-*`` folder that then replaces ``summary/``, so a
    rerun leaves one copy of each event (a process killed meanwhile leaves that folder
    behind). Optional: any failure (no MindSpore, another ``SummaryRecord`` open in this
    process, a write error) is logged and returned, not raised.
    Returns (the summary folder, None) or (None, the reason it was not written)."""
    scalars = summary_scalars(rows)
    if not scalars:
        return None, "metrics.jsonl has no train or val row with a finite value."
    final = os.path.join(run_dir, SUMMARY_DIR)
    tmp = None
    try:
        from mindspore import Tensor
        from mindspore.train.summary import SummaryRecord

        tmp = tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{SUMMARY_DIR}-", dir=run_dir)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o777 & ~mask)                 # mkdtemp makes 0700
        # num_process=1: the writer's worker pool, one process (2 shared cores)
        record = SummaryRecord(tmp, num_process=1)
        try:
            # "eval": record() then skips collecting summary-operator data from the graphs
            # of this process (and, on Ascend, the device round trip that does it); the
            # values added here are written either way
            record.set_mode("eval")
            for step, values in scalars.items():
                for tag, value in values.items():
                    record.add_value("scalar", tag, Tensor(np.float32(value)))
                record.record(step)
        finally:
            record.close()
        files = [os.path.join(tmp, n) for n in os.listdir(tmp)]
        events = sum(_event_records(f) for f in files if os.path.isfile(f))
        if events < 1 + len(scalars):              # the version record, one per step
            raise RuntimeError(f"SummaryRecord wrote {events} records for {len(scalars)} steps "
                               f"(files {sorted(os.path.basename(f) for f in files)}); its "
                               "writer process logs why.")
        _replace_folder(tmp, final)
    except Exception as err:                       # optional output: name it, do not fail
        reason = f"{type(err).__name__}: {' '.join(str(err).split())}"
        logger.warning("MindInsight summaries not written to %s: %s", final, reason)
        return None, reason
    finally:
        if tmp is not None and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("MindInsight summaries: %d steps written to %s", len(scalars), final)
    return final, None


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str) -> None:
    atomic_write_with(path, lambda tmp: fig.savefig(tmp, format="png"), suffix=".png")


def _plot_losses(rows: List[Dict], path: str, device: Optional[str]) -> None:
    plt = _pyplot()
    train = [(m["step"], m["ce"]) for m in rows if m["kind"] == "train"]
    val = [(m["step"], m["val_loss"]) for m in rows if m["kind"] == "val"]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=110)
    if train:
        ax.plot(*zip(*train), label="train cross-entropy")
    if val:
        ax.plot(*zip(*val), "o-", label="validation cross-entropy")
    ax.set_xlabel("step")
    ax.set_ylabel("nats per byte")
    ax.set_title(f"Loss (measured, MindSpore on {device or 'an unrecorded device'})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def _plot_expert_load(load_SLE: np.ndarray, path: str) -> None:
    """Heatmap per MoE layer: share of assignments per expert (rows) over steps (columns)."""
    plt = _pyplot()
    steps, layers, experts = load_SLE.shape
    share = load_SLE / np.maximum(load_SLE.sum(axis=2, keepdims=True), 1)
    fig, axes = plt.subplots(layers, 1, figsize=(7, 1.2 + 1.3 * layers), dpi=110,
                             squeeze=False, sharex=True)
    vmax = max(float(share.max()), 1e-9)
    for layer in range(layers):
        ax = axes[layer, 0]
        im = ax.imshow(share[:, layer, :].T, aspect="auto", interpolation="nearest",
                       cmap="viridis", vmin=0.0, vmax=vmax,
                       extent=(0.5, steps + 0.5, experts - 0.5, -0.5))
        ax.set_ylabel(f"layer {layer}\nexpert")
    axes[-1, 0].set_xlabel("step")
    fig.colorbar(im, ax=axes[:, 0].tolist(), label="share of assignments")
    fig.suptitle("Expert load per MoE layer (measured routing trace)")
    _save(fig, path)
    plt.close(fig)


def _plot_device_load(rows: List[Dict], path: str, device: Optional[str]) -> None:
    """device_load.png: rows each device computed at each logged step (columns, in log
    order), summed over the MoE layers, and per layer below it when there are at most
    :data:`MAX_LAYER_PANELS` layers; a dashed line before the first logged step after each
    expert re-placement."""
    import matplotlib

    plt = _pyplot()
    per_layer, steps, replans = device_load_matrix(rows, per_layer=True)
    total, _, _ = device_load_matrix(rows)
    panels = [("all MoE layers", total)]
    if per_layer.shape[0] <= MAX_LAYER_PANELS:
        panels += [(f"layer {i}", per_layer[i]) for i in range(per_layer.shape[0])]
    devices, columns = total.shape
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="0.8")      # no figure: grey
    fig, axes = plt.subplots(len(panels), 1, squeeze=False, sharex=True, dpi=100,
                             layout="constrained",
                             figsize=(8, 1.0 + len(panels) * (0.9 + 0.25 * devices)))
    # a re-plan after step s acts from the first logged step above s: a line before it
    marks = sorted({int(np.searchsorted(steps, s, side="right")) for s in replans})
    for ax, (name, grid) in zip(axes[:, 0], panels):
        image = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", cmap=cmap,
                          interpolation="nearest", extent=(-0.5, columns - 0.5,
                                                           devices - 0.5, -0.5))
        for col in marks:
            ax.axvline(col - 0.5, color="white", linestyle="--", linewidth=1.2)
        ax.set_ylabel(f"{name}\ndevice")
        ax.set_yticks(range(devices))
        fig.colorbar(image, ax=ax, label="rows")
    ticks = np.unique(np.linspace(0, columns - 1, min(columns, 12)).round().astype(int))
    axes[-1, 0].set_xticks(ticks)
    axes[-1, 0].set_xticklabels([str(steps[i]) for i in ticks])
    axes[-1, 0].set_xlabel("logged step" + (" (dashed: after an expert re-placement)"
                                            if marks else ""))
    fig.suptitle(f"Rows computed per device (expert-parallel ranks, "
                 f"{device or 'device not recorded'})")
    _save(fig, path)
    plt.close(fig)


def _or_dash(value) -> str:
    """A figure for a report table, "-" when not computed."""
    return "-" if value is None else f"{value:g}"


def _saved_world_size(run_dir: str) -> int:
    """``world_size`` of the run folder's state.json; 1 when it names none or is unreadable
    (the header then falls back to the metrics rows)."""
    try:
        with open(os.path.join(run_dir, "state.json"), encoding="utf-8") as fh:
            world = json.load(fh).get("world_size", 1)
    except (OSError, ValueError, AttributeError):
        return 1
    return world if isinstance(world, int) and world >= 1 else 1


def _header(run_dir: str, rows: List[Dict], device: Optional[str], mode: Optional[str]
            ) -> List[str]:
    """Title and the line saying what was measured, where, and what is modelled."""
    widths = [len(b["rows_per_device"]) for r in _balanced_rows(rows) for b in r["balance"]
              if isinstance(b.get("rows_per_device"), list)]
    world = max(widths, default=_saved_world_size(run_dir))
    if device is None:
        where = ("MindSpore; the device is not recorded (the run folder has no config.yaml, "
                 "whose `context.device_target` names it)")
    else:
        where = f"MindSpore on {device}" + (f" in {mode}" if mode else "")
        if world > 1:
            where += f", {world} expert-parallel ranks"
        elif _balanced_rows(rows):
            where += ", one process"
        where += " (the run's config.yaml `context`)"
    line = f"All figures are **measured** with {where}"
    if any(m.get("kind") == "replan_check" for m in rows):
        line += ("; only the home re-plan checks' gains and migration times are **modelled** "
                 "(the cost model of the run's cluster), as their table says")
    return [f"# Training report: {os.path.basename(os.path.abspath(run_dir))}", "",
            line + ".", ""]


def _balance_section(rows: List[Dict]) -> List[str]:
    """p50 / p95 / max of every per-layer balance figure over all layer-steps."""
    balanced = _balanced_rows(rows)
    if not balanced:
        return []
    layers = max(len(r["balance"]) for r in balanced)
    lines = ["## Routing balance per MoE layer", "",
             f"p50 / p95 / max over the layer-steps: every logged train step ({len(balanced)}, "
             f"steps {balanced[0]['step']} to {balanced[-1]['step']}; each row holds the last "
             f"step of its log window) x every MoE layer ({layers}), "
             f"{sum(len(r['balance']) for r in balanced)} layer-steps; the last column says "
             "how many carried the figure.", "",
             "| figure | p50 | p95 | max | layer-steps |", "|---|---:|---:|---:|---:|"]
    for key, label in BALANCE_FIGURES:
        got = balance_percentiles(rows, key)
        if got is not None:
            lines.append(f"| {label} | {got['p50']:.3g} | {got['p95']:.3g} | {got['max']:.3g} "
                         f"| {got['layer_steps']} |")
    return lines + [""]


def _device_load_section(run_dir: str, rows: List[Dict], device: Optional[str]) -> List[str]:
    """device_load.png and its caption, or the reason there is none."""
    reason = device_load_missing_reason(rows)
    lines = ["## Load per device", ""]
    if reason is not None:
        stale = os.path.join(run_dir, DEVICE_LOAD_PNG)
        if os.path.isfile(stale):               # an earlier build's map would contradict this
            os.unlink(stale)
        return lines + [f"No per-device load map: {reason}", ""]
    total, steps, replans = device_load_matrix(rows)
    layers = device_load_matrix(rows, per_layer=True)[0].shape[0]
    _plot_device_load(rows, os.path.join(run_dir, DEVICE_LOAD_PNG), device)
    per_layer = (", and per layer below it" if layers <= MAX_LAYER_PANELS else "")
    lines += [f"Rows each of the {total.shape[0]} devices computed at each of the "
              f"{steps.size} logged steps (the last step of each log window), summed over the "
              f"{layers} MoE layers{per_layer}; grey: no figure (e.g. a resume at another "
              "world size)"
              + (f"; dashed lines: expert re-placements (after steps "
                 f"{', '.join(map(str, replans))})" if replans else "") + ".", "",
              f"![device load]({DEVICE_LOAD_PNG})", ""]
    return lines


def write_report(run_dir: str, summaries: bool = True) -> str:
    """Write ``report.md``, ``loss.png``, ``expert_load.png`` (with a trace.npz),
    ``device_load.png`` (expert-parallel runs) and, with ``summaries``, the MindInsight
    summaries ``summary/`` (:func:`write_summaries`, optional: a failure is logged and named
    in the report) into ``run_dir``; returns the report's path."""
    rows = read_metrics(run_dir)
    device, mode = run_device(run_dir)
    train = [m for m in rows if m["kind"] == "train"]
    val = [m for m in rows if m["kind"] == "val"]
    lines = _header(run_dir, rows, device, mode)
    _plot_losses(rows, os.path.join(run_dir, "loss.png"), device)
    if val:
        first, last = val[0], val[-1]
        drop = first["val_loss"] - last["val_loss"]
        lines += [
            "## Loss", "",
            "| | step | validation cross-entropy (nats/byte) |", "|---|---:|---:|",
            f"| first | {first['step']} | {first['val_loss']:.4f} |",
            f"| last | {last['step']} | {last['val_loss']:.4f} |", "",
            f"Validation loss fell by {drop:.4f} nats/byte "
            f"({100 * drop / first['val_loss']:.1f}%).", "",
            "![loss](loss.png)", ""]
    if train:
        tps = [m["tokens_per_s"] for m in train[1:]] or [train[0]["tokens_per_s"]]
        drops = [m["drop_rate"] for m in train]
        pads = [m["padding_fraction"] for m in train if "padding_fraction" in m]
        lines += ["## Throughput and routing", "",
                  f"- steps: {train[-1]['step']}",
                  f"- median throughput: {np.median(tps):.0f} tokens/s "
                  "(log windows after the first, which includes graph compilation)",
                  f"- mean drop rate (assignments over capacity): {np.mean(drops):.4f}"]
        if pads:
            lines.append(f"- mean padding fraction (computed slot rows holding no token): "
                         f"{np.mean(pads):.4f}")
        lines.append("")
    lines += _balance_section(rows)
    lines += _device_load_section(run_dir, rows, device)
    replans = [m for m in rows if m["kind"] == "replan"]
    if replans:
        lines += ["## Expert re-placements (expert-parallel run)", "",
                  "What each re-plan moved and what it cost (measured wall time of the "
                  "exchange that moved the weights and optimizer state, every layer).", "",
                  "| after step | reason | slots moved | weight bytes | optimizer-state bytes "
                  "| seconds |", "|---:|---|---:|---:|---:|---:|"]
        lines += [f"| {r['step']} | {r.get('reason', '')} | {r['moved_slots']} | "
                  f"{r['moved_bytes']} | {r.get('state_bytes', 0)} | "
                  + (f"{r['seconds']:.3f}" if "seconds" in r else "-") + " |"
                  for r in replans]
        lines.append("")
    checks = [m for m in rows if m["kind"] == "replan_check"]
    if checks:
        lines += ["## Home re-plan checks (balanced run, the slow level)", "",
                  "Every check of the slow level: the modelled gain per step of the new home "
                  "table on the recent routing and the modelled time to move the changed "
                  "slots (cost model of the run's cluster); adopted when the gain over the "
                  "horizon pays for the move, or forced.", "",
                  "| after step | adopted | gain ms/step | migration ms | reason |",
                  "|---:|---|---:|---:|---|"]
        lines += [f"| {c['step']} | {'yes' if c['adopted'] else 'no'} | "
                  f"{_or_dash(c.get('modelled_gain_ms_per_step'))} | "
                  f"{_or_dash(c.get('modelled_migration_ms'))} | {c['reason']} |"
                  for c in checks]
        lines.append("")
    trace_path = os.path.join(run_dir, "trace.npz")
    if os.path.isfile(trace_path):
        trace = load_trace(trace_path)
        load = trace.expert_load()                           # [step, layer, expert]
        _plot_expert_load(load, os.path.join(run_dir, "expert_load.png"))
        mean_load = load.mean(axis=2, keepdims=True)
        imbalance = (load.max(axis=2) / np.maximum(mean_load[..., 0], 1e-9))
        lines += ["## Expert load", "",
                  f"Trace: {trace.num_steps} steps x {trace.num_layers} MoE layers x "
                  f"{trace.num_ranks} source ranks x {trace.num_experts} experts "
                  "(`trace.npz`).", "",
                  "| layer | max/mean load, first 10 steps | max/mean load, last 10 steps |",
                  "|---:|---:|---:|"]
        for layer in range(trace.num_layers):
            lines.append(f"| {layer} | {imbalance[:10, layer].mean():.2f} | "
                         f"{imbalance[-10:, layer].mean():.2f} |")
        lines += ["", "![expert load](expert_load.png)", ""]
    if summaries:
        folder, reason = write_summaries(run_dir, rows)
        lines += ["## MindInsight summaries", ""]
        if folder is not None:
            lines += [f"The scalars above per step (loss, ce, val_loss, tokens_per_s, "
                      "drop_rate, and the p50 / p95 over the MoE layers of each balance "
                      f"max / mean) are in `{SUMMARY_DIR}/`, written through MindSpore's "
                      "SummaryRecord: `mindinsight start --summary-base-dir RUN_DIR` shows "
                      "them.", ""]
        else:
            lines += [f"Not written: {reason}"
                      + (f" (`{SUMMARY_DIR}/` here is from an earlier build)"
                         if os.path.isdir(os.path.join(run_dir, SUMMARY_DIR)) else ""), ""]
    path = os.path.join(run_dir, "report.md")
    atomic_write_text(path, "\n".join(lines))
    return path
