"""The Hierarchical planner (Mirhoseini et al., "A Hierarchical Model for Device Placement",
ICLR 2018), written from the paper's description in numpy, as a baseline for TGA.

A Grouper assigns every unit to one of G groups; a Placer assigns every group to a device;
both are stochastic policies trained jointly with REINFORCE on the reward
-sqrt(step seconds) with an exponential-moving-average baseline, the paper's recipe.
Simplifications (stated, not hidden): the Grouper is, as in the paper, a feed-forward
softmax over unit features (here one linear layer); the paper's Placer is a seq2seq LSTM
with attention over group embeddings, here a linear softmax over [mean member features,
one-hot group id] per group; optimiser Adam. Sampled plans go through the same repair as
TGA's children and are scored by the same cost model through the same
``place.cost.Evaluator``: the budget counts distinct placements scored (a plan sampled
again is answered from the cache, as for TGA), so it gets exactly as many as TGA. A
policy that keeps sampling known plans stops after ``10 x max_evaluations`` samples.
"""
from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ms_efficient.place.cost import Evaluator, SearchResult, TracePoint
from ms_efficient.place.operators import repair
from ms_efficient.place.problem import PlacementProblem

__all__ = ["HierarchicalConfig", "hierarchical"]

logger = logging.getLogger(__name__)
_TYPE_BUCKETS = 8


@dataclass(frozen=True)
class HierarchicalConfig:
    """seed; max_evaluations (cost evaluations, one per sampled plan); time_budget_s;
    batch: plans sampled per policy update; groups: G (0 = min(U, max(4 D, 16)));
    lr: Adam step size; baseline_decay: EMA factor of the reward baseline;
    entropy: entropy bonus weight (keeps early exploration)."""

    seed: int = 0
    max_evaluations: int = 4000
    time_budget_s: float = 60.0
    batch: int = 16
    groups: int = 0
    lr: float = 0.05
    baseline_decay: float = 0.9
    entropy: float = 0.01


def _features(problem: PlacementProblem, op_types) -> np.ndarray:
    """[U, F] standardised unit features: position, log costs, degrees, op-type bucket."""
    u_count = problem.num_units
    deg_in = np.diff(problem.in_indptr)
    deg_out = np.diff(problem.out_indptr)
    cols = [np.arange(u_count) / max(u_count - 1, 1), np.log1p(problem.fwd_s * 1e6),
            np.log1p(problem.bwd_s * 1e6), np.log1p(problem.static_bytes / 1e6),
            np.log1p(problem.param_bytes / 1e6), deg_in, deg_out]
    feats = np.stack(cols, axis=1)
    feats = (feats - feats.mean(0)) / (feats.std(0) + 1e-9)
    buckets = np.zeros((u_count, _TYPE_BUCKETS))
    buckets[np.arange(u_count), [zlib.crc32(t.encode()) % _TYPE_BUCKETS for t in op_types]] = 1
    return np.concatenate([feats, buckets, np.ones((u_count, 1))], axis=1)


class _Adam:
    def __init__(self, shape, lr: float):
        self.m, self.v, self.t, self.lr = np.zeros(shape), np.zeros(shape), 0, lr

    def step(self, w: np.ndarray, grad_ascent: np.ndarray) -> None:
        self.t += 1
        self.m = 0.9 * self.m + 0.1 * grad_ascent
        self.v = 0.999 * self.v + 0.001 * grad_ascent ** 2
        m_hat, v_hat = self.m / (1 - 0.9 ** self.t), self.v / (1 - 0.999 ** self.t)
        w += self.lr * m_hat / (np.sqrt(v_hat) + 1e-8)


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def _sample(probs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One categorical draw per row of probs [..., K] -> [...] ints."""
    u = rng.random(probs.shape[:-1] + (1,))
    return np.minimum((probs.cumsum(-1) < u).sum(-1), probs.shape[-1] - 1)


def hierarchical(problem: PlacementProblem, config: Optional[HierarchicalConfig] = None,
                 op_types=None) -> SearchResult:
    """Train the grouper/placer policies within the evaluation budget; return the best plan.

    op_types: [U] op type name per unit for the type feature (default: unit names).
    """
    cfg = config or HierarchicalConfig()
    rng = np.random.default_rng(cfg.seed)
    ev = Evaluator(problem, cfg.max_evaluations, cfg.time_budget_s)
    u_count, d_count = problem.num_units, problem.num_devices
    g_count = cfg.groups or min(u_count, max(4 * d_count, 16))
    feats = _features(problem, op_types or problem.unit_names)
    f_dim = feats.shape[1]
    w_group = rng.normal(0, 0.1, (f_dim, g_count))
    w_place = rng.normal(0, 0.1, (f_dim + g_count, d_count))
    opt_g, opt_p = _Adam(w_group.shape, cfg.lr), _Adam(w_place.shape, cfg.lr)
    baseline: Optional[float] = None
    best_x, best_c, sampled, trace = None, np.inf, 0, []
    eye_g = np.eye(g_count)
    while ev.left() > 0 and sampled < 10 * cfg.max_evaluations:
        b = cfg.batch
        # Step 1: sample groups for every unit, then a device for every group.
        p_group = _softmax(feats @ w_group)                           # [U, G]
        groups = _sample(np.broadcast_to(p_group, (b, u_count, g_count)), rng)  # [B, U]
        onehot_g = eye_g[groups]                                       # [B, U, G]
        sizes = onehot_g.sum(1)                                        # [B, G]
        mean_f = np.einsum("bug,uf->bgf", onehot_g, feats) / np.maximum(sizes, 1)[..., None]
        h = np.concatenate([mean_f, np.broadcast_to(eye_g, (b, g_count, g_count))], axis=2)
        p_place = _softmax(h @ w_place)                                # [B, G, D]
        devices = _sample(p_place, rng)                                # [B, G]
        plans = np.stack([repair(problem, devices[i][groups[i]]) for i in range(b)])
        costs = ev.evaluate(plans)
        sampled += b
        scored = np.isfinite(costs)  # plans past the budget get no reward
        if not scored.any():
            break
        k = int(np.argmin(costs))
        if costs[k] < best_c:
            best_x, best_c = plans[k].copy(), float(costs[k])
        trace.append(TracePoint(ev.used, ev.elapsed_s, best_c, best_c, best_c))
        if not scored.all():  # the last batch: learn from the scored plans only
            b = int(scored.sum())
            onehot_g, devices, h = onehot_g[scored], devices[scored], h[scored]
            p_place, sizes, costs = p_place[scored], sizes[scored], costs[scored]
        # Step 2: REINFORCE with an EMA baseline on reward -sqrt(seconds).
        reward = -np.sqrt(costs)
        baseline = reward.mean() if baseline is None else baseline
        adv = reward - baseline
        adv = adv / (adv.std() + 1e-12) if b > 1 else adv
        baseline = cfg.baseline_decay * baseline + (1 - cfg.baseline_decay) * reward.mean()
        g_grad = feats.T @ np.einsum("b,bug->ug", adv, onehot_g - p_group) / b
        log_p = np.log(p_group + 1e-12)  # entropy gradient wrt logits: -p (log p + H)
        g_grad += cfg.entropy * feats.T @ (-p_group * (log_p - (p_group * log_p).sum(-1, keepdims=True)))
        used_groups = (sizes > 0)[..., None]                           # [B, G, 1]
        resid = (np.eye(d_count)[devices] - p_place) * used_groups * adv[:, None, None]
        p_grad = np.einsum("bgf,bgd->fd", h, resid) / b
        opt_g.step(w_group, g_grad)
        opt_p.step(w_place, p_grad)
    logger.info("hierarchical %s: %d evaluations (%d samples), %.2f s, best %.6g s",
                problem.name, ev.used, sampled, ev.elapsed_s, best_c)
    return SearchResult("hierarchical", best_x, best_c, ev.used, ev.elapsed_s, trace)
