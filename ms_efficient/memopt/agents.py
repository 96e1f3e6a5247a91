"""MemOpt's two cooperating agents and their training by REINFORCE with a baseline.

Strategy agent: per layer i, a categorical policy over {keep, recompute, recompute-all,
swap, recompute-offload} with logits [L, 5] = MLP(phi_i) + bias[i] (phi_i: layer features,
shared weights, plus a per-layer bias table, so the policy both generalises across layers
and can settle on a specific plan). Timing agent: per layer, two categorical heads,
swap_delay [L, MAX_DELAY+1] and prefetch_lead [L, MAX_LEAD+1], same structure, whose samples
matter only where the strategy agent chose swap or recompute-offload.

Why REINFORCE with a batch-mean baseline and not PPO: an episode is one decision (a whole
plan) scored by one simulation, so there is no credit assignment over time for a critic or
GAE to help with, and the per-batch mean reward is an unbiased, low-variance baseline; PPO's
clipped multi-epoch updates add hyper-parameters without a long-horizon problem to solve.
Both agents get the same advantage (cooperative, shared reward) every iteration.

Reward of a sampled plan: -step_time / t0 if it fits, else -step_time / t0 - 1 - 5 * excess /
(budget - static) (infeasible plans are penalised; only fitting plans are ever returned).
Warm start: the bias table starts at +WARM on the warm-start plan's actions (the best fitting
heuristic / recompute-only MILP plan), so the agents explore around a known feasible plan.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ms_efficient.memopt.env import (ALL_ACTIONS, HOST_ACTIONS, MAX_DELAY, MAX_LEAD, MemoryPlan,
                                     StepResult, check_actions, evaluate, no_plan_time_s)
from ms_efficient.memopt.profile import LayerProfile

__all__ = ["RLConfig", "PolicyNet", "layer_features", "train_agents"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RLConfig:
    """Training knobs. iterations x batch plans are simulated at most, and training stops
    after ``patience`` updates without a better plan: counts, so a seed gives the same plan
    on any machine. time_limit_s optionally bounds wall time (inf, the default, = none; a
    finite limit makes the result depend on the machine's speed and load)."""

    seed: int = 0
    iterations: int = 120          # policy updates
    batch: int = 16                # plans sampled per update
    hidden: int = 16               # MLP width
    lr: float = 0.05               # Adam step size
    entropy: float = 0.01          # entropy bonus weight
    warm: float = 2.0              # initial logit bonus of the warm-start actions
    patience: int = 40             # stop after this many updates without a better plan
    time_limit_s: float = math.inf


def layer_features(profile: LayerProfile, budget_bytes: float, host_link) -> np.ndarray:
    """phi: [L, 10] features: f_i and b_i over their means, o_i, e_i, w_i over the free budget
    (budget - static), transfer time of o_i + e_i (swap) and of o_i (recompute-offload) over
    the forward / backward it could hide behind, and depth i / L."""
    f, b = profile.forward_time_s, profile.backward_time_s
    free = max(budget_bytes - profile.static_bytes, 1.0)
    t_x = host_link.latency_s + profile.activation_bytes / host_link.bandwidth_Bps
    t_o = host_link.latency_s + profile.output_bytes / host_link.bandwidth_Bps
    f_next = np.r_[f[1:], 1e-9]
    b_next2 = np.r_[b[2:], 1e-9, 1e-9][:len(b)]
    L = profile.num_layers
    phi = np.stack([f / max(f.mean(), 1e-15), b / max(b.mean(), 1e-15),
                    profile.output_bytes / free * L, profile.interior_bytes / free * L,
                    profile.workspace_bytes / free * L,
                    np.log1p(t_x / np.maximum(f_next, 1e-12)),
                    np.log1p(t_x / np.maximum(b_next2, 1e-12)),
                    np.log1p(t_o / np.maximum(f_next, 1e-12)),
                    np.log1p(t_o / np.maximum(b_next2, 1e-12)), np.arange(L) / L], axis=1)
    return np.clip(phi, -10.0, 10.0)


class PolicyNet:
    """logits [L, A] = tanh(phi W1 + c1) W2 + c2 + bias + mask; numpy, trained with Adam.

    phi: [L, F]. W1 [F, H], c1 [H], W2 [H, A], c2 [A], bias [L, A]; allowed: [A] bool or None
    (all), the actions the policy may pick (mask = 0 there, -inf elsewhere).
    """

    def __init__(self, num_layers: int, num_features: int, num_actions: int, hidden: int,
                 rng: np.random.Generator, lr: float,
                 allowed: Optional[np.ndarray] = None) -> None:
        self.params = {
            "W1": rng.normal(0.0, 1.0 / np.sqrt(num_features), (num_features, hidden)),
            "c1": np.zeros(hidden),
            "W2": rng.normal(0.0, 0.1 / np.sqrt(hidden), (hidden, num_actions)),
            "c2": np.zeros(num_actions),
            "bias": np.zeros((num_layers, num_actions)),
        }
        self.mask = (np.zeros(num_actions) if allowed is None
                     else np.where(np.asarray(allowed, bool), 0.0, -np.inf))
        self.lr = lr
        self._m = {k: np.zeros_like(v) for k, v in self.params.items()}
        self._v = {k: np.zeros_like(v) for k, v in self.params.items()}
        self._t = 0

    def probs(self, phi: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(probabilities [L, A], hidden activations [L, H])."""
        p = self.params
        h = np.tanh(phi @ p["W1"] + p["c1"])
        z = h @ p["W2"] + p["c2"] + p["bias"] + self.mask
        z = z - z.max(axis=1, keepdims=True)
        ez = np.exp(z)
        return ez / ez.sum(axis=1, keepdims=True), h

    def step(self, phi: np.ndarray, h: np.ndarray, grad_z: np.ndarray) -> None:
        """Gradient ascent with Adam given d(objective)/d(logits) grad_z [L, A]."""
        p = self.params
        dh = (grad_z @ p["W2"].T) * (1.0 - h * h)
        grads = {"W1": phi.T @ dh, "c1": dh.sum(0), "W2": h.T @ grad_z, "c2": grad_z.sum(0),
                 "bias": grad_z}
        self._t += 1
        for k, g in grads.items():
            self._m[k] = 0.9 * self._m[k] + 0.1 * g
            self._v[k] = 0.999 * self._v[k] + 0.001 * g * g
            m_hat = self._m[k] / (1 - 0.9 ** self._t)
            v_hat = self._v[k] / (1 - 0.999 ** self._t)
            p[k] += self.lr * m_hat / (np.sqrt(v_hat) + 1e-8)


def _sample(probs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One action per row of probs [L, A] (inverse-CDF sampling)."""
    u = rng.random((probs.shape[0], 1))
    return np.minimum((probs.cumsum(axis=1) < u).sum(axis=1), probs.shape[1] - 1)


def train_agents(profile: LayerProfile, budget_bytes: float, host_link,
                 warm_start: Optional[MemoryPlan], config: RLConfig = RLConfig(),
                 actions: Sequence[int] = ALL_ACTIONS
                 ) -> Tuple[Optional[MemoryPlan], Optional[StepResult], Dict]:
    """Train the strategy and timing agents on one (profile, budget, device) instance.

    actions: the action codes the strategy agent may choose (the target's realisable set,
    e.g. ``CELL_RECOMPUTE_ACTIONS`` on CPU); the warm start must keep to them.

    Returns (best fitting plan or None, its StepResult, history) where history has
    "best_step_time_s" [iterations] and "mean_reward" [iterations], "evaluations", "time_s".
    """
    start = time.perf_counter()
    rng = np.random.default_rng(config.seed)
    L = profile.num_layers
    allowed = np.isin(np.arange(len(ALL_ACTIONS)), check_actions(actions))
    if warm_start is not None and not allowed[warm_start.actions].all():
        raise ValueError(f"the warm-start plan ({warm_start.method}) uses actions outside "
                         f"{list(actions)}.")
    phi = layer_features(profile, budget_bytes, host_link)
    strategy = PolicyNet(L, phi.shape[1], len(ALL_ACTIONS), config.hidden, rng, config.lr,
                         allowed)
    delay_net = PolicyNet(L, phi.shape[1], MAX_DELAY + 1, config.hidden, rng, config.lr)
    lead_net = PolicyNet(L, phi.shape[1], MAX_LEAD + 1, config.hidden, rng, config.lr)
    lead_net.params["bias"][:, 1:3] += 1.0      # prior: issue prefetches 1-2 tasks ahead
    t0 = no_plan_time_s(profile)
    free = max(budget_bytes - profile.static_bytes, 1.0)
    cache: Dict[bytes, StepResult] = {}
    best: Tuple[Optional[MemoryPlan], Optional[StepResult]] = (None, None)

    def score(plan: MemoryPlan) -> Tuple[float, StepResult]:
        nonlocal best
        key = plan.key()
        if key not in cache:
            cache[key] = evaluate(profile, plan, budget_bytes, host_link)
        r = cache[key]
        if r.fits and (best[1] is None or r.step_time_s < best[1].step_time_s - 1e-15):
            best = (plan, r)
        reward = -r.step_time_s / t0
        if not r.fits:
            reward -= 1.0 + 5.0 * (r.peak_bytes - budget_bytes) / free
        return reward, r

    if warm_start is not None:
        strategy.params["bias"][np.arange(L), warm_start.actions] += config.warm
        score(MemoryPlan(warm_start.actions, warm_start.swap_delay, warm_start.prefetch_lead))
    history: Dict[str, List[float]] = {"best_step_time_s": [], "mean_reward": []}
    stale, stopped_by = 0, "iterations"
    for it in range(config.iterations):
        if time.perf_counter() - start > config.time_limit_s:
            logger.info("MemOpt RL: time limit %.0f s reached after %d updates",
                        config.time_limit_s, it)
            stopped_by = "time_limit"
            break
        # Step 1: sample a batch of joint plans from both agents
        p_s, h_s = strategy.probs(phi)
        p_d, h_d = delay_net.probs(phi)
        p_l, h_l = lead_net.probs(phi)
        acts = np.stack([_sample(p_s, rng) for _ in range(config.batch)])       # [N, L]
        delays = np.stack([_sample(p_d, rng) for _ in range(config.batch)])
        leads = np.stack([_sample(p_l, rng) for _ in range(config.batch)])
        before = best[1].step_time_s if best[1] is not None else np.inf
        rewards = np.array([score(MemoryPlan(acts[n], delays[n], leads[n]))[0]
                            for n in range(config.batch)])
        # Step 2: REINFORCE with the batch-mean baseline, normalised advantages
        adv = rewards - rewards.mean()
        adv = adv / (rewards.std() + 1e-8)
        swap = np.isin(acts, HOST_ACTIONS).astype(np.float64)                     # [N, L]
        for net, probs, hidden, chosen, mask in ((strategy, p_s, h_s, acts, None),
                                                 (delay_net, p_d, h_d, delays, swap),
                                                 (lead_net, p_l, h_l, leads, swap)):
            onehot = np.eye(probs.shape[1])[chosen]                                # [N, L, A]
            weight = adv[:, None] if mask is None else adv[:, None] * mask
            grad = (weight[:, :, None] * (onehot - probs[None])).mean(axis=0)
            ent_grad = -probs * (np.log(probs + 1e-12)
                                 + (-(probs * np.log(probs + 1e-12)).sum(1, keepdims=True)))
            net.step(phi, hidden, grad + config.entropy * ent_grad)
        history["mean_reward"].append(float(rewards.mean()))
        after = best[1].step_time_s if best[1] is not None else np.inf
        history["best_step_time_s"].append(float(after))
        stale = 0 if after < before - 1e-15 else stale + 1
        if stale >= config.patience:
            stopped_by = "patience"
            break
    # Step 3: the agents' greedy (most likely) plan is a candidate too
    greedy = MemoryPlan(strategy.probs(phi)[0].argmax(1), delay_net.probs(phi)[0].argmax(1),
                        lead_net.probs(phi)[0].argmax(1))
    score(greedy)
    history["evaluations"] = len(cache)
    history["stopped_by"] = stopped_by
    history["time_s"] = time.perf_counter() - start
    return best[0], best[1], history
