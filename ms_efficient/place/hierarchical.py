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
For a fair comparison it starts where TGA starts (TGA's structural seeds are scored first
and are the plan to beat) and ends as TGA ends: a local search on the best plan (up to
TGA's ``local_search_budget``; what it leaves goes back to the policy) and the list-order
runs (``place.planner.order_finals``) from the same reserve.
"""
from __future__ import annotations

import logging
import math
import zlib
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ms_efficient.place.cost import Evaluator, SearchResult, TracePoint
from ms_efficient.place.operators import repair
from ms_efficient.place.operators import is_monotone, local_search
from ms_efficient.place.planner import TGAConfig, order_finals, seeded_start
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
    time_budget_s: float = math.inf     # wall-clock seconds; inf = stop on counts only
    batch: int = 16
    groups: int = 0
    lr: float = 0.05
    baseline_decay: float = 0.9
    entropy: float = 0.01


def _best_distinct(x: np.ndarray, c: np.ndarray, k: int):
    """The ``k`` cheapest distinct rows of ``x`` (at least one) and their costs."""
    _, first = np.unique(x, axis=0, return_index=True)
    top = first[np.argsort(c[first], kind="stable")][:max(k, 1)]
    return x[top], c[top]


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
    tga_cfg = TGAConfig(seed=cfg.seed)
    # the budget TGA keeps for its finish: list orders, and a champion local search
    reserve = min(tga_cfg.order_candidates, cfg.max_evaluations // 2)
    finish = min(tga_cfg.local_search_budget, (cfg.max_evaluations - reserve) // 4)
    ev = Evaluator(problem, cfg.max_evaluations - reserve, cfg.time_budget_s)
    u_count, d_count = problem.num_units, problem.num_devices
    g_count = cfg.groups or min(u_count, max(4 * d_count, 16))
    feats = _features(problem, op_types or problem.unit_names)
    f_dim = feats.shape[1]
    w_group = rng.normal(0, 0.1, (f_dim, g_count))
    w_place = rng.normal(0, 0.1, (f_dim + g_count, d_count))
    opt_g, opt_p = _Adam(w_group.shape, cfg.lr), _Adam(w_place.shape, cfg.lr)
    baseline: Optional[float] = None
    best_x, best_c, sampled, trace = None, np.inf, 0, []
    # Step 0: TGA's seeds, scored first (the policy then has to beat them)
    seeds = seeded_start(problem, min(tga_cfg.pop_exploit, max(1, ev.left() // 4)), rng)
    c_seeds = ev.evaluate(seeds)
    k = int(np.argmin(c_seeds))
    best_x, best_c = seeds[k].copy(), float(c_seeds[k])
    pool_x, pool_c = _best_distinct(seeds, c_seeds, reserve)   # candidates for the list orders
    eye_g = np.eye(g_count)
    keep = finish          # evaluations kept for the local search, then 0
    while True:
        if ev.left() <= keep or sampled >= 10 * cfg.max_evaluations:
            if keep == 0 or not np.isfinite(best_c):
                break
            # TGA's finish, part 1: local search on the best plan; the policy then goes on
            # with whatever the search did not need
            best_x, best_c, _ = local_search(problem, best_x, best_c, ev, ev.left(), rng,
                                             monotone=is_monotone(problem, best_x),
                                             batch=tga_cfg.local_search_batch)
            pool_x, pool_c = _best_distinct(np.concatenate([pool_x, best_x[None]]),
                                            np.concatenate([pool_c, [best_c]]), reserve)
            keep = 0
            continue
        b = min(cfg.batch, ev.left() - keep)
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
        pool_x, pool_c = _best_distinct(np.concatenate([pool_x, plans]),
                                        np.concatenate([pool_c, costs]), reserve)
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
    # Step 3: TGA's finish, part 2: the best plan also runs in its own list order
    assign, cost, order, extra = order_finals(problem, pool_x, pool_c, reserve, ev)
    logger.info("hierarchical %s: %d evaluations (%d samples), %.2f s, best %.6g s",
                problem.name, ev.used + extra, sampled, ev.elapsed_s, cost)
    return SearchResult("hierarchical", assign, cost, ev.used + extra, ev.elapsed_s, trace,
                        order=order, stopped_by=ev.stop_reason())
