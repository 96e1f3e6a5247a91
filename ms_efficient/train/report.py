"""Markdown report with PNG plots for a training run folder (see train.py for its layout).

No MindSpore dependency: the report can be rebuilt from a run folder on any machine
(``ms-efficient report RUN_DIR``).
"""
from __future__ import annotations

import json
import os
from typing import Dict, List

import numpy as np

from ms_efficient.core.fileio import atomic_write_text, atomic_write_with
from ms_efficient.moe.trace import load_trace

__all__ = ["write_report", "read_metrics"]


def read_metrics(run_dir: str) -> List[Dict]:
    """Rows of ``metrics.jsonl`` (train and val), in file order."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ValueError(f"'{run_dir}' is not a run folder: it has no metrics.jsonl.")
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _plot_losses(rows: List[Dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(m["step"], m["ce"]) for m in rows if m["kind"] == "train"]
    val = [(m["step"], m["val_loss"]) for m in rows if m["kind"] == "val"]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=110)
    if train:
        ax.plot(*zip(*train), label="train cross-entropy")
    if val:
        ax.plot(*zip(*val), "o-", label="validation cross-entropy")
    ax.set_xlabel("step")
    ax.set_ylabel("nats per byte")
    ax.set_title("Loss (measured, MindSpore on this machine)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    atomic_write_with(path, lambda tmp: fig.savefig(tmp, format="png"), suffix=".png")
    plt.close(fig)


def _plot_expert_load(load_SLE: np.ndarray, path: str) -> None:
    """Heatmap per MoE layer: share of assignments per expert (rows) over steps (columns)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    atomic_write_with(path, lambda tmp: fig.savefig(tmp, format="png"), suffix=".png")
    plt.close(fig)


def _or_dash(value) -> str:
    """A figure for a report table, "-" when not computed."""
    return "-" if value is None else f"{value:g}"


def _plot_device_load(rows: List[Dict], path: str, replan_steps: List[int] = ()) -> None:
    """Heat map of every MoE layer's rows-per-device max over mean over the logged steps,
    a dashed line after each step in ``replan_steps`` (an expert re-placement)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = np.array([[b.get("device_max_over_mean", np.nan) for b in r["balance"]]
                     for r in rows]).T                                   # [layer, step]
    fig, ax = plt.subplots(figsize=(8, 0.4 * grid.shape[0] + 1.5))
    image = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest",
                      extent=(rows[0]["step"] - 0.5, rows[-1]["step"] + 0.5,
                              grid.shape[0] - 0.5, -0.5))
    for step in replan_steps:
        ax.axvline(step + 0.5, color="white", linestyle="--", linewidth=1.0)
    ax.set_xlabel("step" + (" (dashed: expert re-placement)" if replan_steps else ""))
    ax.set_ylabel("MoE layer")
    fig.colorbar(image, ax=ax, label="rows per device, max / mean")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(run_dir: str) -> str:
    """Write ``report.md``, ``loss.png`` and ``expert_load.png`` into ``run_dir``; returns the
    report's path."""
    rows = read_metrics(run_dir)
    train = [m for m in rows if m["kind"] == "train"]
    val = [m for m in rows if m["kind"] == "val"]
    lines = [f"# Training report: {os.path.basename(os.path.abspath(run_dir))}", "",
             "All figures are **measured**: MindSpore in GRAPH_MODE on this machine's CPU.", ""]
    _plot_losses(rows, os.path.join(run_dir, "loss.png"))
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
    replans = [m for m in rows if m["kind"] == "replan"]
    balanced = [m for m in train if m.get("balance")]
    if balanced:
        last = balanced[-1]["balance"]
        lines += ["## Routing balance per MoE layer", "",
                  f"From the last logged step ({balanced[-1]['step']}); p50 / p95 over the "
                  f"{len(last)} MoE layers.", "",
                  "| figure | p50 | p95 | max |", "|---|---:|---:|---:|"]
        for key, label in (("expert_max_over_mean", "tokens per expert, max / mean"),
                           ("expert_cv", "tokens per expert, coefficient of variation"),
                           ("device_max_over_mean", "rows per device, max / mean"),
                           ("device_cv", "rows per device, coefficient of variation"),
                           ("dead_experts", "experts with no token"),
                           ("copies", "expert copies (fast level)"),
                           ("dropped", "rows dropped")):
            values = [b[key] for b in last if key in b]
            if values:
                lines.append(f"| {label} | {np.percentile(values, 50):.3g} | "
                             f"{np.percentile(values, 95):.3g} | {max(values):.3g} |")
        lines.append("")
        if any("device_max_over_mean" in b for b in last):
            _plot_device_load(balanced, os.path.join(run_dir, "device_load.png"),
                              [r["step"] for r in replans])
            lines += ["Rows per device over max over mean, every MoE layer and logged step "
                      "(the fast level's balance):", "", "![device load](device_load.png)", ""]
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
    plans = [m for m in rows if m["kind"] == "plan"]
    if plans:
        lines += ["## EfficientMoE re-plans", "",
                  "| step | slot rows before | after | expected drop | expected padding |",
                  "|---:|---:|---:|---:|---:|"]
        lines += [f"| {p['step']} | {p['rows_before']} | {p['rows_after']} | "
                  f"{p['expected_drop_rate']:.4f} | {p['expected_padding_fraction']:.3f} |"
                  for p in plans]
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
    path = os.path.join(run_dir, "report.md")
    atomic_write_text(path, "\n".join(lines))
    return path
