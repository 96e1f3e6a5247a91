"""Expert-parallel training of the reference GPT-MoE over W ranks (``train --workers W``).

Every rank runs this module's :class:`ExpertParallelTrainer` (started by msrun, see
:mod:`ms_efficient.train.ep_launch` and :mod:`ms_efficient.train.ep_worker`); the MoE FFNs are
:class:`~ms_efficient.moe.balanced_ep.BalancedExpertParallelMoE` layers (EfficientMoE's two
levels) holding the rank's home experts and spare slots, everything else is replicated
(data-parallel):

    global batch [B, S] (train.batch_size rows)  -> rank r takes rows [r B/W, (r+1) B/W)
    forward/backward on the local rows            -> local loss_r, grads
    dense + router grads: one flat AllReduce, / W (the gradient of the mean of the ranks'
        losses); expert grads: / W only (the All-to-All's backward already summed every
        rank's contribution into the slot that computed it: ``train.optim``);
    clipping by the global norm: dense norm^2 + AllReduce of the local expert norm^2, every
        slot weighted by 1 / (replicas of its expert), so replicas count once;
    AdamWeightDecay (as the one-process trainer), logged loss = mean over ranks.

The initial weights are the one-process model's (the same seed builds it on every rank, its
values are copied in: dense by name, experts through ``set_weights``), so the run computes
what the one-process run with a dropless MoE computes on the same global batch (no row
dropped while the fast level fits every step in its buffers). Each expert-parallel layer
returns the router's load-balancing loss of its own tokens; the model
replaces it by that of every rank's tokens (``models.gpt_moe.GlobalRouterAux``, one AllReduce
of the [2, E] routing fractions and mean probabilities per MoE block), so ``loss`` and its
gradient are the one-process run's too. (With the per-rank term instead, the mean over ranks
differs from the global one by E x a covariance over ranks, at most ``aux_loss_coef`` x E / 2
for W = 2; on the reference model that alone let the trajectories drift apart by 1 % after 10
steps at learning rate 2e-3.)

Run folder (``out_dir``) as the one-process trainer's, plus per-rank checkpoints::

    ckpt/rank_{r}/step_N.ckpt   rank r's network (its experts and plan tables) + optimizer
    state.json                  {"step", "world_size": W, "checkpoint": "ckpt/rank_{rank}/...",
                                 "plans": [home table per MoE layer, as an ExpertPlan dict],
                                 "replan": {...}}
    metrics.jsonl               train / val rows (with the fast level's figures), the slow
                                 level's checks, and {"kind": "replan", "step", "moved_slots",
                                 "moved_bytes", "recompiled": false, ...} per re-plan
    trace.npz                   routing counts [step, MoE layer, rank, expert] of every rank

Rank 0 writes the shared files after every rank has written its checkpoint. ``--resume`` with
another number of ranks reads every saved rank's checkpoint as the one-process state and lays
the experts out by this job's initial plans (:meth:`ExpertParallelTrainer._restore_resized`).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import time
from typing import Dict, List, Optional

import numpy as np
import mindspore as ms
from mindspore import Tensor, ops

from ms_efficient.core import backend
from ms_efficient.core.config import RunConfig, check_dispatch, save_config
from ms_efficient.core.fileio import atomic_write_text, atomic_write_with
from ms_efficient.core.params import write_parameter
from ms_efficient.models.dropout import dropout_cells, set_dropout_step
from ms_efficient.models.gpt_moe import build_model
from ms_efficient.moe.balanced_ep import BalancedExpertParallelMoE
from ms_efficient.moe.trace import layer_balance, load_trace, save_trace
from ms_efficient.train import checkpoint as run_ckpt
from ms_efficient.train.data import load_corpus
from ms_efficient.train.relayout import resumed_counts
from ms_efficient.efficientmoe.ep_replanner import (HomeReplanner, compiled_graphs,
                                                    load_plans_state, slot_budget)
from ms_efficient.train.optim import GradReducer, is_scratch as _is_scratch, make_optimizer
from ms_efficient.train.trainer import _fmt_eta

__all__ = ["ExpertParallelTrainer", "KEEP_CHECKPOINTS"]

logger = logging.getLogger(__name__)

KEEP_CHECKPOINTS = 2     # checkpoints each rank keeps (the one-process trainer keeps as many)


class ExpertParallelTrainer:
    """Trains ``GPTMoE`` with expert-parallel MoE layers on this rank, per ``cfg``, into
    ``out_dir``; ``resume=True`` continues from state.json; ``overwrite=True`` replaces an
    earlier run in ``out_dir`` (else a folder that holds files is refused). ``init()`` must
    have run when the job has several ranks (without it: one rank, W = 1, no collectives)."""

    def __init__(self, cfg: RunConfig, out_dir: str, resume: bool = False,
                 overwrite: bool = False):
        if resume and overwrite:
            raise ValueError("give either resume (continue the run) or overwrite (replace "
                             "it), not both.")
        self.cfg, self.out_dir, self.resume, self.overwrite = cfg, out_dir, resume, overwrite
        check_dispatch(cfg, expert_parallel=True)
        ms.set_context(mode=getattr(ms, cfg.context.mode))
        backend.use_device(cfg.context.device_target)
        self.world, self.rank = backend.group_size(), backend.group_rank()
        tr, mc, moe = cfg.train, cfg.model, cfg.moe
        if tr.batch_size % self.world:
            raise ValueError(f"'train.batch_size' ({tr.batch_size}) must be divisible by "
                             f"--workers ({self.world}).")
        self.local_batch = tr.batch_size // self.world
        self.tokens_per_step = tr.batch_size * mc.seq_length
        ms.set_seed(cfg.context.seed)
        self.corpus = load_corpus(cfg.data, mc.seq_length)
        initial = {p.name: p.asnumpy() for p in
                   build_model(mc, moe, tr.batch_size).get_parameters()}  # one-process init
        num_moe = sum((i + 1) % moe.moe_every == 0 for i in range(mc.num_layers))
        budget = slot_budget(moe.num_experts, self.world, moe.slots_per_device)
        plans = self._balanced_specs(num_moe, budget)
        # model.dropout > 0: masks of the GLOBAL row (this rank's first is rank x local
        # batch), so every world size draws the one-process masks (models/dropout.py)
        self.net = build_model(mc, moe, self.local_batch, plans,
                               dropout_seed=cfg.context.seed,
                               sample_offset=self.rank * self.local_batch)
        self.dropouts = dropout_cells(self.net)
        self.layers = [c for _, c in self.net.cells_and_names()
                       if isinstance(c, BalancedExpertParallelMoE)]
        _load_initial(self.net, self.layers, initial)
        self.optimizer = make_optimizer(self.net, tr)
        params = self.optimizer.parameters
        self.reducer = GradReducer(params, self.layers, self.world, tr.grad_clip)
        self.replanner = (HomeReplanner(self.layers, cfg.efficientmoe, self._cost_model())
                          if cfg.efficientmoe.enabled else None)
        self._build_steps()
        self.step, self.metrics, self.counts = 0, [], []
        self.trace_start = 0                         # steps before the trace's first row
        self.pending: Optional[Dict] = None          # a re-plan waiting for its next step
        self.saved_steps: List[Dict] = []            # state.json's "steps" (save())

    def _balanced_specs(self, num_moe: int, budget: int):
        """The layout of a "balanced" run (:func:`~ms_efficient.efficientmoe.planner.
        training_specs`): from ``efficientmoe.history`` when given, else plain expert
        parallelism with the extra slots as spares and buffers of the mean share x
        (1 + ``efficientmoe.buffer_slack``)."""
        from ms_efficient.core.config import history_trace_path
        from ms_efficient.efficientmoe.planner import training_specs

        cfg, moe = self.cfg, self.cfg.moe
        em = cfg.efficientmoe
        history = (load_trace(history_trace_path(em.history)).counts if em.history else None)
        model = self._cost_model()
        spare = budget - -(-moe.num_experts // self.world)
        mean_rows = self.tokens_per_step * moe.top_k / self.world
        specs = training_specs(num_moe, moe.num_experts, self.world, spare, mean_rows, model,
                               em.buffer_slack, history)
        return [dataclasses.replace(spec, sync_rows=max(spec.sync_rows, needed))
                if spec.sync_rows is not None else spec
                for spec, needed in zip(specs, self._saved_cross(num_moe))]

    def _saved_cross(self, num_moe: int) -> List[int]:
        """Per MoE layer, the experts the home table of the run being resumed at this size
        holds on more than one device (0 without one): the replica table a resumed layer
        needs at least, whatever the layout planned now (its history or cost model may
        have changed since) sizes; the most over the steps state.json describes (the one
        resumed from is the newest that verifies on every rank, not known yet here)."""
        from ms_efficient.moe.ep_routing import sync_rows

        path = os.path.join(self.out_dir, "state.json")
        if not (self.resume and os.path.isfile(path)):
            return [0] * num_moe
        with open(path, encoding="utf-8") as fh:
            state = json.load(fh)
        if int(state.get("world_size", 1)) != self.world or "plans" not in state:
            return [0] * num_moe            # resized: this job plans its own tables
        needed = [0] * num_moe
        for entry in state.get("steps") or [state]:
            needed = [max(n, sync_rows(plan, self.cfg.moe.num_experts, self.world))
                      for n, plan in zip(needed, load_plans_state(entry["plans"]))]
        return needed

    def _cost_model(self):
        """The cost model of the run's cluster and expert sizes (float32): what sizes a
        balanced run's layout and prices its home re-plans."""
        from ms_efficient.efficientmoe.cost import CostModel

        mc = self.cfg.model
        return CostModel(self._cluster(), mc.hidden_size, mc.ffn_hidden_size, "fp32",
                         expert_kind=self.cfg.moe.expert_kind)

    def _cluster(self):
        """The run's cluster for this job's W ranks. ``cpu-local`` is this machine, one rank
        per device, so it grows to W devices on its node (a run resumed at 4 ranks from a
        2-rank config); any other preset must hold W devices, or the re-planner refuses
        naming the fields to change."""
        from ms_efficient.core.cluster import for_ranks

        spec = self.cfg.cluster_spec()
        grown = for_ranks(spec, self.world)
        if grown is not spec:
            logger.info("cluster cpu-local: %d devices for the %d ranks of this job",
                        self.world, self.world)
        return grown

    def _device_rows(self) -> np.ndarray:
        """Rows every device computed in the last step, int64 [L, W]: the fast level's own
        count."""
        out = np.zeros((len(self.layers), self.world), dtype=np.int64)
        for j, layer in enumerate(self.layers):
            out[j] = layer.balance_stats.asnumpy().astype(np.int64)[3:]
        return out

    def _balance_row(self) -> List[Dict]:
        """Per MoE layer, the fast level's figures of the last step: copies made, the bytes
        the dispatch sent (all ranks, float32 here) and the copies' part of them, the fixed
        buffers, rows dropped."""
        rows = []
        for j, layer in enumerate(self.layers):
            stats = layer.balance_stats.asnumpy().astype(int)
            # read from the step's count operand of the dispatch (float32 rows of H), not
            # derived from the number of copies
            dispatch, copies = layer.exchange_bytes(4)
            rows.append({"layer": j, "copies": int(stats[0]),
                         "weight_bytes": int(copies.sum()),
                         "dispatch_bytes": int(dispatch.sum()),
                         "buffer_rows": layer.buffer_W.tolist(), "dropped": int(stats[1])})
        return rows

    def _build_steps(self) -> None:
        net, optimizer, reducer, world = self.net, self.optimizer, self.reducer, self.world
        grad_fn = ms.value_and_grad(net, None, optimizer.parameters, has_aux=True)
        all_reduce = ops.AllReduce(op=ops.ReduceOp.SUM) if world > 1 else None
        all_gather = ops.AllGather() if world > 1 else None

        @ms.jit
        def train_step(tokens, targets):
            (loss, ce, counts, dropped), grads = grad_fn(tokens, targets)
            optimizer(reducer(grads))
            stats = ops.stack((loss, ce))
            counts = counts.reshape((1,) + counts.shape)          # [1, layers, 1, E]
            if world > 1:
                stats = all_reduce(stats) / world
                counts = all_gather(counts)                        # [W, layers, 1, E]
                dropped = all_reduce(dropped.astype(ms.float32)).astype(ms.int32)
            return stats, counts, dropped

        @ms.jit
        def eval_step(tokens, targets):
            ce = net(tokens, targets)[1]
            if world > 1:
                ce = all_reduce(ce) / world
            return ce

        self.train_step, self.eval_step = train_step, eval_step
        self.barrier_op = all_reduce

    def _rows(self, a: np.ndarray) -> Tensor:
        return Tensor(a[self.rank * self.local_batch:(self.rank + 1) * self.local_batch])

    def _all_agree(self, ok: bool) -> bool:
        """True when ``ok`` holds on every rank (one AllReduce; a barrier too)."""
        if self.barrier_op is None:
            return ok
        flags = self.barrier_op(Tensor(np.array([1.0 if ok else 0.0], np.float32))).asnumpy()
        return int(round(float(flags[0]))) == self.world

    def _barrier(self) -> None:
        if self.barrier_op is not None:
            self.barrier_op(Tensor(np.ones(1, np.float32))).asnumpy()

    # ------------------------------------------------------------------ state
    def save(self) -> None:
        """Every rank its checkpoint, written and recorded through the checksummed path
        (:func:`~ms_efficient.train.checkpoint.save_checkpoint`, then the rank's own
        ``ckpt/rank_r/state.json``, which prunes only its own older records); then, after
        every rank has, rank 0 the trace, metrics and the shared state.json (last), which
        describes the newest steps (``steps``: plans, re-planner state, a pending re-plan)."""
        tensors, seen = [], set()
        for p in list(self.net.get_parameters()) + list(self.optimizer.get_parameters()):
            if p.name not in seen and not _is_scratch(p.name):
                seen.add(p.name)
                tensors.append({"name": p.name, "data": p})
        record = run_ckpt.save_checkpoint(self.out_dir, self.step,
                                          lambda tmp: ms.save_checkpoint(tensors, tmp),
                                          rank=self.rank)
        run_ckpt.commit_state(self.out_dir, record, {"world_size": self.world},
                              keep=KEEP_CHECKPOINTS, rank=self.rank)
        self._barrier()
        if self.rank != 0:
            return
        if self.counts:
            moe = self.cfg.moe
            save_trace(_trace(self.counts, moe.top_k, self.cfg.model.hidden_size,
                              self.local_batch * self.cfg.model.seq_length, self.trace_start),
                       os.path.join(self.out_dir, "trace.npz"))
        atomic_write_text(os.path.join(self.out_dir, "metrics.jsonl"),
                          "".join(json.dumps(m) + "\n" for m in self.metrics))
        entry = {"step": self.step, "plans": [layer.plan.to_dict() for layer in self.layers]}
        if self.replanner is not None:
            entry["replan"] = self.replanner.state()
        if self.pending is not None:        # applied, its next step not run yet
            entry["pending_replan"] = self.pending
        # one entry more than the ranks keep: a kill between a rank's commit and this write
        # leaves the ranks' older step described here
        self.saved_steps = [e for e in self.saved_steps if e["step"] < self.step]
        self.saved_steps = self.saved_steps[-KEEP_CHECKPOINTS:] + [entry]
        state = dict(entry, world_size=self.world,
                     checkpoint=os.path.join("ckpt", "rank_{rank}", f"step_{self.step:06d}.ckpt"),
                     steps=self.saved_steps)
        atomic_write_text(os.path.join(self.out_dir, "state.json"), json.dumps(state) + "\n")

    def _restore(self) -> None:
        from ms_efficient.train.logical_state import read_run

        if not os.path.isfile(os.path.join(self.out_dir, "state.json")):
            raise ValueError(f"--resume: '{self.out_dir}' has no state.json; nothing to resume.")
        state = run_ckpt.read_state(self.out_dir)
        saved = int(state.get("world_size", 1))
        if "plans" not in state:
            raise ValueError(f"--resume: '{self.out_dir}' was trained with world_size {saved} "
                             f"(one process) but this job has {self.world} ranks; resume it "
                             f"without --workers.")
        run = read_run(self.out_dir)        # the newest step every rank's checksums verify
        if saved != self.world:
            self._restore_resized(run)
            return
        state = run.state
        for layer, plan in zip(self.layers, run.plans):
            if plan.to_dict() != layer.plan.to_dict():
                layer.set_plan(plan)          # layout first; the checkpoint has the values
        ckpt = run.paths[self.rank]
        params = ms.load_checkpoint(ckpt)
        params.pop("learning_rate", None)
        for cell in (self.net, self.optimizer):
            missing, _ = ms.load_param_into_net(cell, params, strict_load=True)
            missing = [n for n in missing if n != "learning_rate" and not _is_scratch(n)]
            if missing:
                raise ValueError(f"checkpoint '{ckpt}' does not match the model: it lacks "
                                 f"{missing[:5]}.")
        self.reducer.set_plans(self.layers)
        self.step = run.step
        self.saved_steps = [e for e in state.get("steps", []) if e["step"] <= self.step]
        self._saved_counts(saved)
        if self.replanner is not None:
            self.replanner.load_state(state.get("replan", {}), np.array(self.counts))
        self._restore_history()
        if "pending_replan" in state:      # a restarted process compiles anyway: unknown
            self.metrics.append(dict(state["pending_replan"], recompiled=None))
        logger.info("rank %d: resumed %s at step %d", self.rank, self.out_dir, self.step)

    def _saved_counts(self, run_world: int) -> None:
        """``counts`` and ``trace_start`` from the saved trace (rows up to the restored step,
        merged to this job's ranks); when it cannot be merged the trace restarts here and
        rank 0 keeps the saved one as ``trace_world{run_world}_step{step}.npz``."""
        path = os.path.join(self.out_dir, "trace.npz")
        if not os.path.isfile(path):
            return
        trace = load_trace(path)
        counts, self.trace_start = resumed_counts(trace.counts, trace.steps, self.step,
                                                  self.world)
        self.counts = [] if counts is None else list(counts)
        if counts is None and self.rank == 0:
            kept = os.path.join(self.out_dir, f"trace_world{run_world}_step{self.step}.npz")
            atomic_write_with(kept, lambda tmp: shutil.copyfile(path, tmp), suffix=".npz")
            logger.info("routing trace of %d ranks kept as %s; the new one starts at step %d",
                        run_world, kept, self.step + 1)

    def _restore_history(self) -> None:
        """Metrics up to the restored step."""
        metrics = os.path.join(self.out_dir, "metrics.jsonl")
        if os.path.isfile(metrics):
            with open(metrics, encoding="utf-8") as fh:
                rows = [json.loads(line) for line in fh if line.strip()]
            self.metrics = [m for m in rows if m["step"] <= self.step]

    def _restore_resized(self, run) -> None:
        """Resume a run saved by another number of ranks: every rank reads all the saved
        ranks' checkpoints as the logical (one-process) state
        (:func:`~ms_efficient.train.logical_state.logical_state`) and takes its rows of the
        plans this job started with (a new run's at W ranks): dense parameters, router,
        expert weights and Adam's moments, the step (LR schedule, data position). The
        routing trace's rank axis is merged when the saved W is a multiple of this W
        (:func:`~ms_efficient.train.relayout.merge_trace_ranks`), else it restarts at this
        step and rank 0 keeps the old one as ``trace_world{W}_step{N}.npz``; the re-planner
        starts a new observation window."""
        from ms_efficient.train.logical_state import EXPERT_TABLES, MOMENTS, logical_state
        from ms_efficient.train.relayout import scatter_experts

        values = logical_state(run)
        prefixes = {id(c): n + "." for n, c in self.net.cells_and_names()}
        experts = {}                    # parameter name -> its layer
        for layer in self.layers:
            pre = prefixes[id(layer)]
            for t in EXPERT_TABLES:
                for name in [pre + t] + [m + pre + t for m in MOMENTS]:
                    experts[name] = layer
        loaded = set()
        params = list(self.net.get_parameters()) + list(self.optimizer.get_parameters())
        for p in params:
            if p.name in loaded or p.name == "learning_rate" or _is_scratch(p.name):
                continue
            if p.name in experts:
                layer = experts[p.name]
                write_parameter(p, scatter_experts(layer.plan, values[p.name], self.rank,
                                                   layer.budget))
            elif p.name in values:
                write_parameter(p, values[p.name])
            elif p.requires_grad or p.name.startswith(MOMENTS) or p.name == "global_step":
                raise ValueError(f"the checkpoints of '{self.out_dir}' lack '{p.name}' of "
                                 f"this model.")
            else:
                continue                # this layout's own tables (plan, replica sync)
            loaded.add(p.name)
        self.reducer.set_plans(self.layers)
        self.step = run.step
        self._saved_counts(run.world)
        if self.replanner is not None and self.counts:
            self.replanner.load_state({}, np.array(self.counts))
        self._restore_history()
        if "pending_replan" in run.state:     # it was made (the saved layout has it): logged
            self.metrics.append(dict(run.state["pending_replan"], recompiled=None,
                                     resized_to=self.world))
        logger.info("rank %d: resumed %s at step %d, saved by %d ranks, on %d ranks", self.rank,
                    self.out_dir, self.step, run.world, self.world)

    # ------------------------------------------------------------------ loop
    def evaluate(self) -> float:
        """Mean validation cross-entropy (nats per byte) over the fixed global batches."""
        tr, mc = self.cfg.train, self.cfg.model
        set_dropout_step(self.dropouts, None)            # no dropout in eval
        return float(np.mean([float(self.eval_step(self._rows(x), self._rows(y)).asnumpy())
                              for x, y in self.corpus.val_batches(
                                  tr.eval_batches, tr.batch_size, mc.seq_length)]))

    def _log_val(self) -> None:
        val = self.evaluate()
        self.metrics.append({"kind": "val", "step": self.step, "val_loss": round(val, 5)})
        logger.info("step %d/%d  val_loss %.4f", self.step, self.cfg.train.steps, val)

    def run(self) -> int:
        """Train until ``train.steps``; returns the step reached.

        The run folder's guarantees (:mod:`ms_efficient.train.checkpoint`), as the
        one-process trainer's: rank 0 holds the folder's lock for the job (unless the
        launcher that started the job holds it: ``FOLDER_LOCK_ENV`` names it), removes
        the temporaries of interrupted writes and refuses a folder that holds another run
        (``overwrite``: replaces it); every rank learns rank 0's verdict (one AllReduce) and
        raises with it, then holds its own rank lock while it trains."""
        from ms_efficient.train.ep_launch import FOLDER_LOCK_ENV, LOG_DIR

        os.makedirs(self.out_dir, exist_ok=True)
        error, folder_lock = None, None
        if self.rank == 0:
            lock_file = os.path.realpath(os.path.join(self.out_dir, run_ckpt.LOCK_NAME))
            try:
                if os.environ.get(FOLDER_LOCK_ENV) != lock_file:
                    folder_lock = run_ckpt.acquire_lock(self.out_dir)
                run_ckpt.clean_temporaries(self.out_dir)
                if not self.resume:
                    run_ckpt.check_fresh(self.out_dir, self.overwrite, ignore=(LOG_DIR,))
            except ValueError as err:
                error = err
        if not self._all_agree(error is None):
            if folder_lock is not None:
                folder_lock.release()
            raise error or ValueError(f"rank 0 refused the run folder '{self.out_dir}' (its "
                                      f"log says why).")
        try:
            with run_ckpt.acquire_lock(self.out_dir, self.rank):
                return self._run()
        finally:
            if folder_lock is not None:
                folder_lock.release()

    def _run(self) -> int:
        tr, mc = self.cfg.train, self.cfg.model
        if self.resume:
            self._restore()
        if self.rank == 0:
            save_config(self.cfg, os.path.join(self.out_dir, "config.yaml"))
        if not any(m["kind"] == "val" and m["step"] == 0 for m in self.metrics):
            self._log_val()
        moe_index = list(self.net.moe_index)
        window_start, window_steps, assigned, kept = time.perf_counter(), 0, 0, 0
        while self.step < tr.steps:
            x, y = self.corpus.train_batch(self.step, tr.batch_size, mc.seq_length,
                                           self.cfg.context.seed)
            set_dropout_step(self.dropouts, self.step)
            before = compiled_graphs()
            stats, counts, dropped = self.train_step(self._rows(x), self._rows(y))
            loss, ce = (float(v) for v in stats.asnumpy())
            if self.pending is not None:
                after = compiled_graphs()
                self.pending["recompiled"] = None if before is None else after != before
                self.metrics.append(self.pending)
                self.pending = None
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss is {loss} at step {self.step + 1}; lower "
                                         f"'train.learning_rate' ({tr.learning_rate}).")
            counts_LWE = counts.asnumpy()[:, moe_index, 0].transpose(1, 0, 2)
            dropped_L = dropped.asnumpy()[moe_index]
            self.counts.append(counts_LWE.astype(np.int64))
            if self.replanner is not None:
                self.replanner.observe(counts_LWE, dropped_L)
            assigned += int(counts_LWE.sum())
            kept += int(counts_LWE.sum()) - int(dropped_L.sum())
            self.step += 1
            window_steps += 1
            if self.step % tr.log_every == 0 or self.step == tr.steps:
                elapsed = time.perf_counter() - window_start
                tps = window_steps * self.tokens_per_step / max(elapsed, 1e-9)
                row = {"kind": "train", "step": self.step, "loss": round(loss, 5),
                       "ce": round(ce, 5), "tokens_per_s": round(tps, 1),
                       "drop_rate": round(1.0 - kept / max(1, assigned), 5)}
                row["balance"] = layer_balance(counts_LWE, dropped_L, self._device_rows())
                for entry, fast in zip(row["balance"], self._balance_row()):
                    entry.update(fast)      # the fast level's figures of the last step
                self.metrics.append(row)
                logger.info("step %d/%d  loss %.4f  ce %.4f  %.0f tok/s  ETA %s", self.step,
                            tr.steps, loss, ce, tps, _fmt_eta((tr.steps - self.step) * elapsed
                                                              / window_steps))
                window_start, window_steps, assigned, kept = time.perf_counter(), 0, 0, 0
            if self.step % tr.eval_every == 0 or self.step == tr.steps:
                self._log_val()
            if self.replanner is not None and self.step < tr.steps:
                record = self.replanner.maybe_replan(self.step, self.optimizer,
                                                     tr.steps - self.step)
                check = getattr(self.replanner, "last_check", None)
                if check is not None:           # the slow level's verdict, adopted or not
                    self.metrics.append(check)
                if record is not None:
                    self.reducer.set_plans(self.layers)
                    self.pending = record
            if self.step % tr.save_every == 0 or self.step == tr.steps:
                self.save()
        return self.step


def _load_initial(net, layers: List[BalancedExpertParallelMoE],
                  initial: Dict[str, np.ndarray]) -> None:
    """The one-process network's initial values: dense parameters by name, every MoE layer's
    router and experts through ``set_weights`` (each rank keeps its own slots)."""
    prefixes = {}
    for name, cell in net.cells_and_names():
        if isinstance(cell, BalancedExpertParallelMoE):
            prefixes[id(cell)] = name + "."
    for layer in layers:
        pre = prefixes[id(layer)]
        layer.set_weights(*(initial[pre + n] for n in ("router.weight",) + layer.expert_names))
    expert_names = {prefixes[id(layer)] + n for layer in layers for n in layer.expert_names}
    for p in net.trainable_params():
        if p.name in expert_names or p.name.endswith("router.weight") and any(
                p.name.startswith(v) for v in prefixes.values()):
            continue
        if p.name not in initial or initial[p.name].shape != tuple(p.shape):
            raise ValueError(f"parameter '{p.name}' {tuple(p.shape)} has no counterpart in the "
                             f"one-process model; cannot start from its initial weights.")
        p.set_data(Tensor(initial[p.name]))


def _trace(counts: List[np.ndarray], top_k: int, hidden: int, tokens_per_rank: int,
           start: int = 0):
    """The routing trace of steps start + 1 .. start + len(counts)."""
    from ms_efficient.moe.trace import RoutingTrace

    rows = np.stack(counts)
    return RoutingTrace(counts=rows, top_k=top_k, hidden=hidden, tokens_per_rank=tokens_per_rank,
                        steps=np.arange(start + 1, start + len(rows) + 1))
