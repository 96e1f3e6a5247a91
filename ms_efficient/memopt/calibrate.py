"""Calibrate an estimated layer profile to measured peak memory (no MindSpore import).

``profile_from_model`` estimates the tensors a layer produces from its shapes; what
MindSpore's allocator really holds differs by Cell kind. On the CPU reference run of the
measured check the allocator frees per Cell, when that Cell is recomputed, 0.45x of the
estimated attention interior and 1.73x of the estimated MoE FFN interior (the estimate
ignores routing and capacity-padded dispatch buffers), so the raw estimate would recompute
the wrong Cells. The measured check therefore plans with a calibrated profile:

    unknowns theta = [S, c_1..c_K, omega]: S static bytes; c_k the scale of the estimated
        interior bytes of layers of kind k (the name's last part, ``attn`` / ``ffn``);
        omega the extra backward workspace per estimated interior byte (the backward of a
        layer allocates gradients shaped like the tensors it produced):
            interior_i  := c_k(i) * interior_est_i
            workspace_i := workspace_est_i + omega * interior_est_i
        output bytes stay as estimated.
    data: measured peaks of K + 2 or more plans (``calibration_plans``).
    fit: a plan's simulated peak is a max over the step of terms linear in S and c (and in
        omega), so it is piecewise linear in theta; Newton's method with a finite-difference
        Jacobian (least squares, projected on theta >= 0) converges in a few steps.
    check: every measured peak within ``rtol`` (2%) of its simulated one, else ValueError.
On the reference run the fit reproduces the four calibration peaks within 0.3% and predicts
two held-out plans (recompute every FFN; recompute the first half) within 0.8%.
Times are scaled by one factor so the simulated unoptimised step equals its measured time
(a recompute-only plan on one device is chosen the same under a common time scale; the
factor only makes simulated times read as seconds).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ms_efficient.core.units import format_size
from ms_efficient.memopt.env import RECOMPUTE, MemoryPlan, evaluate, no_plan_time_s
from ms_efficient.memopt.profile import LayerProfile

__all__ = ["layer_kinds", "kind_plans", "calibration_plans", "calibrate_profile"]


def layer_kinds(profile: LayerProfile) -> List[str]:
    """[L] kind of each layer: the last dotted part of its name (``blocks.3.attn`` -> attn)."""
    return [name.rsplit(".", 1)[-1] for name in profile.names]


def kind_plans(profile: LayerProfile, action: int) -> Dict[str, MemoryPlan]:
    """{kind: plan applying ``action`` to every layer of that kind, keep elsewhere}."""
    kinds = np.array(layer_kinds(profile))
    return {k: MemoryPlan(np.where(kinds == k, action, 0), method=f"{k}-only")
            for k in dict.fromkeys(kinds)}


def _with_params(profile: LayerProfile, kinds: np.ndarray, names: Sequence[str],
                 theta: np.ndarray) -> LayerProfile:
    """The profile for theta = [S, c_1..c_K, omega] (see module docs)."""
    scale = np.ones(profile.num_layers)
    for k, c in zip(names, theta[1:-1]):
        scale[kinds == k] = c
    interior = profile.interior_bytes * scale
    return replace(profile, static_bytes=float(theta[0]), interior_bytes=interior,
                   workspace_bytes=profile.workspace_bytes + theta[-1] * profile.interior_bytes)


def calibration_plans(profile: LayerProfile) -> Dict[str, MemoryPlan]:
    """The plans to measure for ``calibrate_profile``, K + 2 of them for K layer kinds:
    none, full recompute, recompute-only-kind for all kinds but the last (full recompute
    covers it) and recompute of the last half of the layers (puts the peak at a re-run in
    backward, which tells the workspace apart from the interior bytes)."""
    L = profile.num_layers
    plans = {"none": MemoryPlan(np.zeros(L), method="none"),
             "full-recompute": MemoryPlan(np.full(L, RECOMPUTE), method="full-recompute")}
    plans.update(list(kind_plans(profile, RECOMPUTE).items())[:-1])
    late = np.zeros(L)
    late[L // 2:] = RECOMPUTE
    plans["late-half"] = MemoryPlan(late, method="late-half")
    return plans


def calibrate_profile(profile: LayerProfile, measured: Sequence[Tuple[MemoryPlan, float]],
                      host_link, none_step_time_s: Optional[float] = None,
                      iterations: int = 50, rtol: float = 0.02) -> LayerProfile:
    """The profile whose simulated peaks match ``measured`` [(plan, peak bytes)].

    Needs at least K + 2 plans (K layer kinds) that tell the unknowns apart, e.g.
    ``calibration_plans``. ``none_step_time_s``: measured seconds of the unoptimised step, to
    scale all layer times (None: keep them). Returns a profile with source "calibrated" and
    meta {"interior_scale": {kind: c_k}, "workspace_per_interior": omega, "static_bytes",
    "fit_error_bytes": [per plan, simulated - measured], "time_scale"}. Raises ValueError if
    the fit needs negative bytes or misses a measured peak by more than ``rtol``.
    """
    kinds = np.array(layer_kinds(profile))
    kind_names = list(dict.fromkeys(kinds))
    if len(measured) < 2 + len(kind_names):
        raise ValueError(f"calibration needs at least {2 + len(kind_names)} measured plans "
                         f"(layer kinds {kind_names}), but got {len(measured)}.")
    target = np.array([float(peak) for _, peak in measured])
    big = float(target.max()) * 1e3 + 1.0          # a budget no plan reaches: peaks only

    def peaks(theta: np.ndarray) -> np.ndarray:
        prof = _with_params(profile, kinds, kind_names, theta)
        return np.array([evaluate(prof, plan, big, host_link).peak_bytes for plan, _ in measured])

    # Step 1: Newton on the piecewise-linear peaks, from the estimate (S = 0, c = 1,
    # omega = 0), projected on S >= 0, c_k > 0, omega >= 0; keep the closest fit seen
    theta = np.r_[0.0, np.ones(len(kind_names)), 0.0]
    lower = np.r_[0.0, np.full(len(kind_names), 1e-6), 0.0]
    current = peaks(theta)
    best = (np.abs(current - target).max(), theta, current)
    for _ in range(iterations):
        residual = target - current
        jac = np.empty((len(measured), theta.size))
        for j in range(theta.size):
            step = 1.0 if j == 0 else 1e-6 * max(abs(theta[j]), 1.0)
            probe = theta.copy()
            probe[j] += step
            jac[:, j] = (peaks(probe) - current) / step
        new = np.maximum(theta + np.linalg.lstsq(jac, residual, rcond=None)[0], lower)
        if np.allclose(new, theta, rtol=1e-9, atol=1e-9):
            break
        theta, current = new, peaks(new)
        if np.abs(current - target).max() < best[0]:
            best = (np.abs(current - target).max(), theta, current)
    _, theta, current = best
    # Step 2: check the fit is close
    error = current - target
    fitted = {"static_bytes": float(theta[0]),
              "interior_scale": dict(zip(kind_names, theta[1:-1].tolist())),
              "workspace_per_interior": float(theta[-1])}
    if np.any(np.abs(error) > rtol * target):
        raise ValueError(f"calibrated peaks miss the measured ones "
                         f"{[format_size(t) for t in target]} by up to "
                         f"{format_size(np.abs(error).max())} (> {rtol:.0%}) at {fitted}; the "
                         "layer model does not explain these measurements (does recompute "
                         "lower the measured peak?).")
    calibrated = _with_params(profile, kinds, kind_names, theta)
    time_scale = 1.0
    if none_step_time_s is not None:
        time_scale = float(none_step_time_s) / no_plan_time_s(profile)
        calibrated = replace(calibrated, forward_time_s=profile.forward_time_s * time_scale,
                             backward_time_s=profile.backward_time_s * time_scale)
    meta = dict(profile.meta, **fitted, fit_error_bytes=error.tolist(), time_scale=time_scale)
    return replace(calibrated, source="calibrated", meta=meta)
