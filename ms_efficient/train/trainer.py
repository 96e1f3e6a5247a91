"""Trainer for the reference MoE language model: GRAPH_MODE steps, evaluation, checkpoints,
metrics, the routing trace and the report.

Run folder layout (``out_dir``)::

    run.lock           held while a process trains in the folder (train/checkpoint.py)
    config.yaml        resolved config of the run
    metrics.jsonl      one JSON object per line: {"kind": "train"|"val", "step", ...}
    ckpt/step_N.ckpt   network + optimizer state (the two of the highest steps are kept)
    state.json         {"step": N, "checkpoint": "ckpt/step_N.ckpt", "sha256", "checkpoints":
                       [records with checksums]}: what --resume reads and verifies
    trace.npz          routing trace counts[step, layer, src_rank, expert] (moe/trace.py)
    report.md, *.png   written by ms_efficient.train.report at the end

Checkpoint, trace and state are written atomically every ``train.save_every`` steps, so a run
killed with SIGKILL loses at most that many steps and resumes from the checkpointed state (restored
bit for bit) on the same data. A new run refuses a folder that holds files (``overwrite``
clears them); --resume falls back to the newest checkpoint that matches its checksum.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np
import mindspore as ms
from mindspore import Tensor, ops

from ms_efficient.core import backend
from ms_efficient.core.config import RunConfig, check_dispatch, load_config, save_config
from ms_efficient.core.fileio import atomic_write_text
from ms_efficient.efficientmoe.sampler import RoutingSampler
from ms_efficient.models.dropout import dropout_cells, set_dropout_step
from ms_efficient.models.gpt_moe import build_model
from ms_efficient.moe.layer import MoEFeedForward
from ms_efficient.train.optim import is_scratch as _is_scratch, lr_schedule, make_optimizer
from ms_efficient.moe.trace import layer_balance, load_trace, save_trace
from ms_efficient.train import checkpoint as run_ckpt
from ms_efficient.train.data import Corpus, load_corpus
from ms_efficient.train.ep_launch import load_run_config
from ms_efficient.train.footprint import check_fits_machine
from ms_efficient.train.relayout import resumed_counts

__all__ = ["Trainer", "TrainResult", "lr_schedule", "make_optimizer", "train"]

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What a finished run reports: losses (nats/byte) and where its files are."""

    out_dir: str
    steps: int
    first_val_loss: float
    final_val_loss: float
    tokens_per_s: float
    step_time_s: float


class Trainer:
    """Trains ``GPTMoE`` per ``cfg`` into ``out_dir``; ``resume=True`` continues from state.json;
    ``overwrite=True`` replaces an earlier run in ``out_dir`` (else a non-empty folder is
    refused)."""

    def __init__(self, cfg: RunConfig, out_dir: str, resume: bool = False,
                 overwrite: bool = False, saved_cfg: Optional[RunConfig] = None):
        self.cfg = cfg
        self.saved_cfg = saved_cfg or cfg        # what config.yaml records (train())
        self.out_dir = out_dir
        self.resume = resume
        self.overwrite = overwrite
        check_dispatch(cfg, expert_parallel=False)
        check_fits_machine(cfg)                   # before any tensor is allocated
        if cfg.moe.dispatch != cfg.moe.layer_dispatch:
            logger.info("moe.dispatch %r names an expert-parallel exchange; one process has "
                        "none and runs its experts %r (the same rows, dropless).",
                        cfg.moe.dispatch, cfg.moe.layer_dispatch)
        ms.set_context(mode=getattr(ms, cfg.context.mode))
        backend.use_device(cfg.context.device_target)
        ms.set_seed(cfg.context.seed)
        self.corpus: Corpus = load_corpus(cfg.data, cfg.model.seq_length)
        tr = cfg.train
        self.net = build_model(cfg.model, cfg.moe, tr.batch_size, dropout_seed=cfg.context.seed)
        # model.dropout > 0: masks of (seed, step, block, global row, ...); the step is set
        # before every train step, eval mode before every evaluation (models/dropout.py)
        self.dropouts = dropout_cells(self.net)
        self.optimizer = make_optimizer(self.net, tr)
        self.moe_layers = [c for _, c in self.net.cells_and_names()
                           if isinstance(c, MoEFeedForward)]
        self._build_steps()
        self.step = 0
        self.trace_start = 0        # steps before the routing trace's first row (resumed)
        self.sampler = RoutingSampler()
        self.metrics: List[Dict] = []
        self.compile_s = 0.0
        # per-step wall times of this process (seconds) and run totals of routed assignments,
        # kept assignments and computed slot rows, summed over MoE layers
        self.step_times: List[float] = []
        self.totals = {"assigned": 0, "kept": 0, "rows": 0}

    # ------------------------------------------------------------------ capacities
    def capacities(self) -> np.ndarray:
        """int64 [moe layer, expert] static capacities the network is compiled with (shape
        [L, 0] for grouped layers, which have none)."""
        return np.array([layer.capacities for layer in self.moe_layers], np.int64).reshape(
            len(self.moe_layers), -1)

    def computed_rows(self, assigned: int) -> int:
        """Expert rows one step computes: the static capacities, or for grouped layers the
        ``assigned`` assignments themselves (no padding)."""
        if self.moe_layers and getattr(self.moe_layers[0], "dispatch", "static") == "grouped":
            return assigned
        return int(self.capacities().sum())

    def set_capacities(self, capacity_LE: np.ndarray) -> None:
        """Apply per-expert capacities to every MoE layer and recompile the step functions
        (a resumed run's saved capacities, e.g. those the efficientmoe pass sized)."""
        for layer, caps in zip(self.moe_layers, np.asarray(capacity_LE)):
            layer.set_capacities([int(c) for c in caps])
        self._build_steps()

    # ------------------------------------------------------------------ compiled functions
    def _build_steps(self) -> None:
        net, optimizer, clip = self.net, self.optimizer, self.cfg.train.grad_clip
        grad_fn = ms.value_and_grad(net, None, optimizer.parameters, has_aux=True)

        @ms.jit
        def train_step(tokens, targets):
            (loss, ce, counts, dropped), grads = grad_fn(tokens, targets)
            if clip > 0:
                grads = ops.clip_by_global_norm(grads, clip)
            optimizer(grads)
            return loss, ce, counts, dropped

        @ms.jit
        def eval_step(tokens, targets):
            _, ce, _, _ = net(tokens, targets)
            return ce

        self.train_step = train_step
        self.eval_step = eval_step

    # ------------------------------------------------------------------ state
    def _state_tensors(self) -> List[Dict]:
        seen, out = set(), []
        for p in list(self.net.get_parameters()) + list(self.optimizer.get_parameters()):
            if p.name not in seen and not _is_scratch(p.name):
                seen.add(p.name)
                out.append({"name": p.name, "data": p})
        return out

    def save(self) -> None:
        """Checkpoint (fsynced, checksummed), trace, metrics and state, each written atomically;
        state.json last, then the checkpoints of all but the two highest steps are pruned."""
        tensors = self._state_tensors()
        record = run_ckpt.save_checkpoint(self.out_dir, self.step,
                                          lambda tmp: ms.save_checkpoint(tensors, tmp))
        record["capacities"] = self.capacities().tolist()
        self._save_trace()
        self._save_metrics()
        run_ckpt.commit_state(self.out_dir, record,
                              {"capacities": record["capacities"]}, keep=2)

    def _save_trace(self) -> None:
        if not len(self.sampler):
            return
        mc = self.cfg.moe
        trace = self.sampler.trace(
            top_k=mc.top_k, hidden=self.cfg.model.hidden_size,
            tokens_per_rank=self.cfg.train.batch_size * self.cfg.model.seq_length // mc.trace_ranks)
        trace.steps = trace.steps + self.trace_start
        save_trace(trace, os.path.join(self.out_dir, "trace.npz"))

    def _save_metrics(self) -> None:
        text = "".join(json.dumps(m) + "\n" for m in self.metrics)
        atomic_write_text(os.path.join(self.out_dir, "metrics.jsonl"), text)

    def load_weights(self, run_dir: str, keep_step: bool = True) -> Dict:
        """Load network and optimizer state from the last checkpoint of ``run_dir``.

        keep_step=False leaves the optimizer's step counter at 0, so a new run (a benchmark
        arm, a fine-tune) starts its own learning-rate schedule from trained weights.
        Returns the run's state.json.

        The checkpoint is verified against its checksum; a bad latest one gives way to the
        newest good one (the returned state then names that one: its ``step``,
        ``checkpoint`` and ``capacities``).
        """
        state = run_ckpt.read_state(run_dir)
        if "plans" in state:        # expert-parallel: all ranks' checkpoints, logical layout
            from ms_efficient.train.logical_state import logical_state, read_run

            run = read_run(run_dir)
            params = {n: ms.Parameter(Tensor(v), name=n)
                      for n, v in logical_state(run).items()}
            state = dict(state, step=run.step)
        else:
            record, _ = run_ckpt.verified_latest(run_dir, state)
            state = dict(state, step=int(record["step"]), checkpoint=record["path"],
                         **({"capacities": record["capacities"]} if "capacities" in record
                            else {}))
            params = ms.load_checkpoint(os.path.join(run_dir, state["checkpoint"]))
        # The learning-rate table is rebuilt from the config (--steps may have changed it).
        skip = {"learning_rate"} if keep_step else {"learning_rate", "global_step"}
        for name in skip:
            params.pop(name, None)
        for cell in (self.net, self.optimizer):
            not_loaded, _ = ms.load_param_into_net(cell, params, strict_load=True)
            missing = [name for name in not_loaded
                       if name not in skip and not _is_scratch(name)]
            if missing:
                raise ValueError(f"checkpoint '{state['checkpoint']}' in '{run_dir}' does "
                                 f"not match the model: it lacks {missing[:5]}.")
        return state

    def _restore(self) -> None:
        if not os.path.isfile(os.path.join(self.out_dir, "state.json")):
            raise ValueError(f"--resume: '{self.out_dir}' has no state.json; nothing to resume.")
        state = self.load_weights(self.out_dir)
        self.step = int(state["step"])
        if "capacities" in state and state["capacities"] != self.capacities().tolist():
            self.set_capacities(np.array(state["capacities"], np.int64))
        trace_path = os.path.join(self.out_dir, "trace.npz")
        if os.path.isfile(trace_path):
            trace = load_trace(trace_path)     # an expert-parallel run's: one group per rank
            rows, self.trace_start = resumed_counts(trace.counts, trace.steps, self.step,
                                                    self.cfg.moe.trace_ranks)
            if rows is None:
                kept = os.path.join(self.out_dir, f"trace_ranks{trace.counts.shape[2]}_step"
                                                  f"{self.step}.npz")
                os.replace(trace_path, kept)
                logger.info("routing trace of %d source ranks kept as %s; the new one starts "
                            "at step %d", trace.counts.shape[2], kept, self.step + 1)
            for row in [] if rows is None else rows:
                self.sampler.record(row)
        metrics_path = os.path.join(self.out_dir, "metrics.jsonl")
        if os.path.isfile(metrics_path):
            with open(metrics_path, encoding="utf-8") as fh:
                rows = [json.loads(line) for line in fh if line.strip()]
            self.metrics = [m for m in rows if m["step"] <= self.step]
        logger.info("resumed %s at step %d", self.out_dir, self.step)

    # ------------------------------------------------------------------ loop
    def evaluate(self) -> float:
        """Mean validation cross-entropy (nats per byte) over the fixed validation batches."""
        tr, mc = self.cfg.train, self.cfg.model
        set_dropout_step(self.dropouts, None)            # no dropout in eval
        losses = [float(self.eval_step(Tensor(x), Tensor(y)).asnumpy())
                  for x, y in self.corpus.val_batches(tr.eval_batches, tr.batch_size,
                                                      mc.seq_length)]
        return float(np.mean(losses))

    def _log_val(self) -> float:
        val = self.evaluate()
        self.metrics.append({"kind": "val", "step": self.step, "val_loss": round(val, 5)})
        logger.info("step %d/%d  val_loss %.4f", self.step, self.cfg.train.steps, val)
        return val

    def run(self) -> TrainResult:
        """Train until ``train.steps``; returns the run's figures."""
        with run_ckpt.acquire_lock(self.out_dir):
            run_ckpt.clean_temporaries(self.out_dir)
            if self.resume:
                self._restore()
            else:
                run_ckpt.check_fresh(self.out_dir, self.overwrite)
            return self._run()

    def _run(self) -> TrainResult:
        tr, mc = self.cfg.train, self.cfg.model
        total = tr.steps
        save_config(self.saved_cfg, os.path.join(self.out_dir, "config.yaml"))
        if not any(m["kind"] == "val" and m["step"] == 0 for m in self.metrics):
            self._log_val()
        moe_index = list(self.net.moe_index)
        tokens_per_step = tr.batch_size * mc.seq_length
        window_start, window_steps = time.perf_counter(), 0
        step_times = self.step_times
        sample_s, kept, rows, assigned = 0.0, 0, 0, 0
        compiled = False
        while self.step < total:
            x, y = self.corpus.train_batch(self.step, tr.batch_size, mc.seq_length,
                                           self.cfg.context.seed)
            set_dropout_step(self.dropouts, self.step)
            t0 = time.perf_counter()
            loss, ce, counts, dropped = self.train_step(Tensor(x), Tensor(y))
            loss = float(loss.asnumpy())
            step_times.append(time.perf_counter() - t0)
            if not compiled and len(step_times) >= 2:
                # first call compiles: its excess over a steady step is the compile time
                self.compile_s = max(0.0, step_times[0] - step_times[1])
                compiled = True
                logger.info("graph compile took about %.2f s (first step minus second)",
                            self.compile_s)
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss is {loss} at step {self.step + 1}; lower "
                                         f"'train.learning_rate' ({tr.learning_rate}).")
            t1 = time.perf_counter()
            counts = counts.asnumpy()[moe_index]
            self.sampler.record(counts)
            sample_s += time.perf_counter() - t1
            dropped_L = dropped.asnumpy()[moe_index]
            step_dropped = int(dropped_L.sum())
            assigned += int(counts.sum())
            kept += int(counts.sum()) - step_dropped
            step_rows = self.computed_rows(int(counts.sum()))
            rows += step_rows
            for key, value in (("assigned", int(counts.sum())), ("kept", int(counts.sum()) -
                               step_dropped), ("rows", step_rows)):
                self.totals[key] += value
            self.step += 1
            window_steps += 1
            if self.step % tr.log_every == 0 or self.step == total:
                elapsed = time.perf_counter() - window_start
                tps = window_steps * tokens_per_step / max(elapsed, 1e-9)
                drop = 1.0 - kept / max(1, assigned)
                row = {"kind": "train", "step": self.step, "loss": round(loss, 5),
                       "ce": round(float(ce.asnumpy()), 5), "tokens_per_s": round(tps, 1),
                       "drop_rate": round(drop, 5),
                       "padding_fraction": round(1.0 - kept / max(1, rows), 5),
                       "sampler_overhead_s": round(sample_s / window_steps, 6),
                       # the last step's routing balance, per MoE layer
                       "balance": layer_balance(counts, dropped_L)}
                sample_s, kept, rows, assigned = 0.0, 0, 0, 0
                self.metrics.append(row)
                eta = (total - self.step) * elapsed / max(1, window_steps)
                logger.info("step %d/%d  loss %.4f  ce %.4f  %.0f tok/s  drop %.3f  ETA %s",
                            self.step, total, loss, row["ce"], tps, drop, _fmt_eta(eta))
                window_start, window_steps = time.perf_counter(), 0
            if self.step % tr.eval_every == 0 or self.step == total:
                self._log_val()
            if self.step % tr.save_every == 0 or self.step == total:
                self.save()
        vals = [m["val_loss"] for m in self.metrics if m["kind"] == "val"]
        steady = step_times[1:] or step_times or [float("nan")]
        step_time = float(np.median(steady))
        return TrainResult(out_dir=self.out_dir, steps=self.step, first_val_loss=vals[0],
                           final_val_loss=vals[-1], step_time_s=step_time,
                           tokens_per_s=tokens_per_step / step_time)


def _fmt_eta(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s"


def train(config_path: str, out_dir: Optional[str] = None, steps: Optional[int] = None,
          resume: Optional[str] = None, overrides: Optional[Dict] = None,
          overwrite: bool = False, transient: Optional[Dict] = None) -> TrainResult:
    """Train from a config file (or resume the run folder ``resume``) and write the report.

    transient: dotted config keys set for this process only, not recorded in the run's
    config.yaml (``train --resume DIR --workers 1`` of an expert-parallel run turns
    ``efficientmoe.enabled`` off here, and the run keeps its own value for a later resume
    on several workers).

    steps: the total step count the run trains to (``train.steps``), on ``resume`` too:
    not steps to add; a total the resumed run has already reached is refused (ValueError),
    before anything is written.
    overrides: dotted config keys to set, e.g. ``{"moe.dispatch": "grouped"}``.
    overwrite: replace an earlier run in the output folder (else a non-empty one is refused).
    The folder is locked and checked before the model is built.
    On CPU it turns MindSpore's graph pipeline off in this process's environment, as
    ``train --workers`` does for its ranks (``core.backend.set_runtime_conf``): with it on,
    the Python thread waiting for a step's outputs spins on a core the step needs (50 steps
    of configs/gpt_moe_tiny.yaml: the same losses, 108 -> 68 CPU-s on 2 cores,
    scripts/time_test_compiles.py). It takes effect when this is the process's first
    MindSpore work, as in ``ms-efficient train``.
    """
    from ms_efficient.train.report import write_report

    overrides = dict(overrides or {})
    if steps is not None:
        overrides["train.steps"] = steps
    if resume:
        config_path = os.path.join(resume, "config.yaml")
        cfg = load_run_config(resume, {**overrides, **(transient or {})})
        saved_cfg = load_run_config(resume, overrides) if transient else None
        out = resume
        if os.path.isfile(run_ckpt.state_path(resume)):
            # steps is the total to train to; one already reached would train nothing
            reached = int(run_ckpt.read_state(resume)["step"])
            if cfg.train.steps <= reached:
                from ms_efficient.train.logical_state import read_run

                reached = read_run(resume).step      # the step the resume would load
            if cfg.train.steps <= reached:
                given = (f"--steps {steps} is the total step count the run trains to, not "
                         f"steps to add, but" if steps is not None else
                         f"its train.steps is {cfg.train.steps}, and")
                raise ValueError(f"--resume: {given} '{resume}' has already reached step "
                                 f"{reached}: nothing would be trained. Pass --steps N with "
                                 f"N > {reached}, the total to train to.")
    else:
        if out_dir:
            overrides["train.out_dir"] = out_dir
        cfg = load_config(config_path, {**overrides, **(transient or {})})
        saved_cfg = load_config(config_path, overrides) if transient else None
        out = cfg.train.out_dir
    check_fits_machine(cfg, config_path)
    backend.set_runtime_conf(cfg.context.device_target)
    if not resume and not overwrite:
        run_ckpt.check_fresh(out)             # refuse before any work (checked again locked)
    with run_ckpt.acquire_lock(out):
        result = Trainer(cfg, out, resume=bool(resume), overwrite=overwrite,
                         saved_cfg=saved_cfg).run()
        write_report(out)
    return result
