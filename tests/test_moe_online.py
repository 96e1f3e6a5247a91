"""EfficientMoE online capacity planning (numpy side)."""
import numpy as np
import pytest

from ms_efficient.core.config import EfficientMoEConfig
from ms_efficient.efficientmoe.planner import CapacityPlanner, RoutingSampler, quantize_levels


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


def test_a_steady_load_gets_tight_capacities_and_no_padding_beyond_rounding():
    """Constant loads: the forecast is exact, so capacities are the loads rounded up to 16."""
    cfg = EfficientMoEConfig(enabled=True, window=8, replan_every=4, capacity_multiple=16,
                             capacity_levels=4)
    load = np.tile(np.array([[300, 100, 60, 52]]), (12, 1, 1))       # [t, layer=1, E=4]
    plan = CapacityPlanner(cfg, tokens_per_step=256).plan(load)
    # 300 is capped at T=256 tokens; others rounded up to multiples of 16
    assert plan.capacity_LE.tolist() == [[256, 112, 64, 64]]
    assert plan.expected_drop_rate[0] == pytest.approx(0.0)


def test_replan_is_forced_when_the_current_capacities_drop_tokens():
    cfg = EfficientMoEConfig(enabled=True, window=8, replan_every=4, capacity_multiple=16)
    load = np.tile(np.array([[200, 20, 20, 16]]), (10, 1, 1))
    planner = CapacityPlanner(cfg, tokens_per_step=256)
    plan = planner.plan(load)
    current = np.array([[64, 64, 64, 64]])                              # drops 136 of 256
    assert planner.worth_applying(current, plan, load, row_time_s=0.0, recompile_s=1e9)
    # an identical plan is never re-applied
    assert not planner.worth_applying(plan.capacity_LE, plan, load, 1.0, 0.0)


def test_replan_pays_only_when_saved_compute_beats_a_recompile():
    cfg = EfficientMoEConfig(enabled=True, window=8, replan_every=10, capacity_multiple=16,
                             capacity_levels=4)
    load = np.tile(np.array([[96, 64, 48, 48]]), (10, 1, 1))
    planner = CapacityPlanner(cfg, tokens_per_step=256)
    plan = planner.plan(load)
    assert plan.capacity_LE.tolist() == [[96, 64, 48, 48]]
    current = np.full((1, 4), 256)                 # dropless: 1024 rows, plan: 256 rows
    # saves 768 rows x 10 steps x 1 ms = 7.68 s
    assert planner.worth_applying(current, plan, load, row_time_s=1e-3, recompile_s=7.0)
    assert not planner.worth_applying(current, plan, load, row_time_s=1e-3, recompile_s=8.0)
