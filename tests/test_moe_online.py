"""EfficientMoE's one planner on a one-device network (the trainer, callback and pass case)."""
import numpy as np
import pytest

from ms_efficient.core.config import EfficientMoEConfig, RunConfig
from ms_efficient.efficientmoe.capacity import quantize_levels
from ms_efficient.efficientmoe.planner import (capacities_LE, one_device_counts,
                                               one_device_planner, single_device_plans)
from ms_efficient.efficientmoe.planner import ReplanLoop
from ms_efficient.efficientmoe.sampler import RoutingSampler


@pytest.mark.parametrize("caps, levels, expected", [
    ([10, 10, 10], 1, [10, 10, 10]),
    ([100, 20, 30, 90], 1, [100, 100, 100, 100]),
    # sorted 100, 90 | 30, 20 -> 100, 100, 30, 30: 260 rows (any other split costs more)
    ([100, 20, 30, 90], 2, [100, 30, 30, 100]),
    ([5, 1, 3], 3, [5, 1, 3]),
    ([5, 1, 3], 9, [5, 1, 3]),
    # 64 | 16, 16, 16, 8 -> 64 + 4 * 16 = 128 rows; splitting 64, 16 | 16 ... costs 64+16+... more
    ([16, 64, 8, 16, 16], 2, [16, 64, 16, 16, 16]),
])
def test_quantize_levels_finds_the_fewest_rows(caps, levels, expected):
    out = quantize_levels(np.array(caps), levels)
    assert out.tolist() == expected
    assert np.all(out >= np.array(caps))


def test_quantize_levels_matches_brute_force_on_random_cases():
    import itertools

    rng = np.random.default_rng(0)
    for _ in range(30):
        caps = rng.integers(1, 50, size=6)
        for levels in (1, 2, 3):
            best = None
            values = sorted(set(caps.tolist()))
            for chosen in itertools.combinations(values, min(levels, len(values))):
                if max(chosen) < caps.max():
                    continue
                total = sum(min(c for c in chosen if c >= v) for v in caps)
                best = total if best is None else min(best, total)
            assert quantize_levels(caps, levels).sum() == best


def test_sampler_keeps_the_trace_format():
    s = RoutingSampler()
    s.record(np.ones((2, 3, 4), np.int32))
    s.record(2 * np.ones((2, 3, 4), np.int32))
    assert s.counts().shape == (2, 2, 3, 4)
    assert s.expert_load()[1].tolist() == [[6] * 4] * 2
    with pytest.raises(ValueError, match=r"counts shape changed from \(2, 3, 4\)"):
        s.record(np.ones((2, 3, 5)))
    s.truncate(1)
    assert len(s) == 1


def _planner(**em):
    cfg = EfficientMoEConfig(enabled=True, **{"window": 8, "capacity_multiple": 16, **em})
    return one_device_planner(cfg, RunConfig().cluster_spec(), hidden=64, ffn_hidden=128,
                              num_experts=4, top_k=1, tokens_per_step=256)


def test_a_steady_load_gets_tight_capacities_and_no_padding_beyond_rounding():
    """Constant loads: the forecast is exact, so capacities are the loads rounded up to 16."""
    planner = _planner(replan_every=4, capacity_levels=4)
    load = np.tile(np.array([[300, 100, 60, 52]]), (12, 1, 1))       # [t, layer=1, E=4]
    prop = planner.propose(one_device_counts(load))
    # 300 is capped at T=256 tokens; others rounded up to multiples of 16
    assert capacities_LE(prop.plans, 4).tolist() == [[256, 112, 64, 64]]
    assert not prop.dropless_L.any()
    assert planner.expected_drop_rate(prop.plans, prop.predicted_LRE,
                                      prop.rel_KLRE) == pytest.approx(0.0)


def test_replan_is_forced_when_the_current_capacities_drop_tokens():
    planner = _planner(replan_every=4, recompile_cost_s=1e9)
    load = np.tile(np.array([[200, 20, 20, 16]]), (10, 1, 1))
    current = single_device_plans(np.array([[64, 64, 64, 64]]), 1, 256)   # drops 136 of 256
    decision, cand = planner.check(one_device_counts(load), current)
    assert decision.replan and decision.forced
    # the loads rounded up to 16 are [208, 32, 32, 16]; the error prior (no residual sample
    # says the forecast is exact yet) may add at most one multiple
    caps = capacities_LE(cand.plans, 4)[0]
    assert np.all(caps >= [208, 32, 32, 16]) and np.all(caps <= [224, 48, 48, 32])
    # an identical plan is never re-applied
    decision, _ = planner.check(one_device_counts(load), cand.plans)
    assert not decision.replan and decision.reason == "candidate equals the current plan"


@pytest.mark.parametrize("scale, adopted", [(0.9, True), (1.1, False)])
def test_replan_pays_only_when_saved_compute_beats_a_recompile(scale, adopted):
    """Current = dropless (1024 rows a step), candidate 256 rows: adopted iff the modelled
    saving over its 10-step lifetime exceeds the recompile."""
    probe = _planner(replan_every=10, capacity_levels=4)
    counts = one_device_counts(np.tile(np.array([[96, 64, 48, 48]]), (10, 1, 1)))
    current = single_device_plans(np.full((1, 4), 256), 1, 256)
    cand = probe.propose(counts, current, max_horizon_steps=10)
    assert capacities_LE(cand.plans, 4).tolist() == [[96, 64, 48, 48]]
    assert cand.horizon_steps == 10
    saving = 10 * (probe.step_time_s(current, cand.predicted_LRE)
                   - probe.step_time_s(cand.plans, cand.predicted_LRE))
    assert saving > 0
    planner = _planner(replan_every=10, capacity_levels=4, recompile_cost_s=scale * saving)
    decision, _ = planner.check(counts, current, max_horizon_steps=10)
    assert decision.replan is adopted and not decision.forced


def test_replan_loop_checks_on_schedule_and_when_drops_are_observed():
    planner = _planner(replan_every=4)
    loop = ReplanLoop(planner, monitor_rows=2)
    counts = one_device_counts(np.tile(np.array([[100, 60, 60, 36]]), (6, 1, 1)))
    decision, first = loop.poll(0, counts, None, compiled=False)
    assert decision is None                               # the first plan is free
    plans = first.plans
    assert [loop.poll(r, counts, plans) is None for r in (1, 2, 3)] == [True] * 3
    assert loop.poll(4, counts, plans) is not None        # every replan_every rows
    for _ in range(2):                                    # 10% drops for 2 rows: fires
        loop.observe(dropped=26, routed=256)
    out = loop.poll(5, counts, plans)          # off schedule: the monitor asked
    assert out is not None and not out[0].replan     # nothing better than the current plan
    assert loop.poll(6, counts, plans) is None            # monitor was reset


def test_recompile_cost_has_one_home_scaled_to_the_layers_and_a_given_value_wins():
    from ms_efficient.efficientmoe.schedule import ReplanCosts, recompile_time_s

    # 0.8 s + 0.4 s per MoE layer (schedule's module docstring: measured on this CPU)
    assert [recompile_time_s(n) for n in (1, 2, 4)] == [1.2, 1.6, 2.4]
    assert ReplanCosts().recompile_s == recompile_time_s(1)
    assert recompile_time_s(4, given_s=0.5) == 0.5
    cfg = EfficientMoEConfig(enabled=True)
    assert cfg.recompile_cost_s is None
    planner = one_device_planner(cfg, RunConfig().cluster_spec(), 64, 128, 4, 1, 256,
                                 num_layers=4)
    assert planner.costs.recompile_s == 2.4
    assert _planner(recompile_cost_s=3.0).costs.recompile_s == 3.0
