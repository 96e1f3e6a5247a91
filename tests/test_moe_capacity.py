"""Static capacities from a recorded trace (the efficientmoe pass's rule), the routing sampler,
and the recompile cost model bench mpipe charges."""
import itertools

import numpy as np
import pytest

from ms_efficient.efficientmoe.capacity import (expected_drop_and_padding, hindsight_capacities,
                                                round_up, static_capacities)
from ms_efficient.efficientmoe.sampler import RoutingSampler
from ms_efficient.mpipe.planner import recompile_time_s


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


def test_static_capacities_are_the_fewest_rows_within_the_drop_target_by_brute_force():
    """Every integer capacity vector of two experts over a 3-step trace: the fewest total rows
    whose drops stay within the target is what the rule gives (before rounding)."""
    loads = np.array([[10, 2], [6, 4], [8, 0]])
    total = loads.sum()
    for target in (0.0, 0.05, 0.1, 0.2, 0.3):
        best = min(sum(c) for c in itertools.product(range(11), range(5))
                   if np.maximum(loads - np.array(c), 0).sum() <= target * total + 1e-9)
        got = hindsight_capacities(loads, target)
        assert got.sum() == best, target
        assert np.maximum(loads - got, 0).sum() <= target * total + 1e-9


def test_static_capacities_round_up_cap_at_the_tokens_and_report_drops_and_padding():
    """Two layers of [T=2, E=2]: the drop-free capacities (10, 3) and (4, 4) round up to
    multiples of 8 (16, 8) and (8, 8); the tokens of a step (12) cap the 16. Hand figures of
    the drops and padding over the two rows follow."""
    load = np.array([[[10, 2], [4, 4]], [[6, 3], [1, 2]]])       # [T, L, E]
    sized = static_capacities(load, 0.0, 8, max_load=12)
    assert sized.capacity_LE.tolist() == [[12, 8], [8, 8]]
    assert sized.drop_rate == 0.0
    rows = 2 * (12 + 8 + 8 + 8)
    padding = (2 + 6) + (6 + 5) + (4 + 4) + (7 + 6)
    assert sized.padding_fraction == pytest.approx(padding / rows)
    tight = static_capacities(load, 0.25, 1)
    assert tight.drop_rate <= 0.25 and tight.capacity_LE.sum() < 20
    drop, pad = expected_drop_and_padding([5, 5], np.array([[10, 0], [0, 10]]))
    assert (drop, pad) == (0.5, 0.5)
    assert round_up([0, 1, 16, 17], 16).tolist() == [0, 16, 16, 32]


def test_recompile_cost_grows_with_the_layers_as_measured():
    assert [recompile_time_s(n) for n in (1, 2, 4)] == [1.2, 1.6, 2.4]
    with pytest.raises(ValueError, match="num_layers"):
        recompile_time_s(0)
