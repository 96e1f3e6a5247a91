"""MemOpt on a 1F1B pipeline stage: the other in-flight micro-batches hold what the plan
stores of each layer (``LayerProfile.in_flight``, ``memopt.env.held_bytes``), in the simulator
and in the MILP alike. Hand-computed on a two-layer chain (bytes: o = 1, e = 4, no workspace)."""
import numpy as np
import pytest

from ms_efficient.memopt.env import KEEP, RECOMPUTE, MemoryPlan, evaluate, held_bytes
from ms_efficient.memopt.milp import checkmate_min_peak
from ms_efficient.memopt.profile import LayerProfile
from tests.test_memopt import LINK


def _stage(in_flight):
    return LayerProfile(names=["l0", "l1"], forward_time_s=np.ones(2),
                        backward_time_s=np.ones(2) * 2, output_bytes=np.ones(2),
                        interior_bytes=np.ones(2) * 4, workspace_bytes=np.zeros(2),
                        static_bytes=0.0, in_flight=in_flight)


@pytest.mark.parametrize("actions, held, chain", [
    # kept: 2 other micro-batches x (5 + 5); this one's chain peaks at 10 (both kept)
    ((KEEP, KEEP), 20.0, 10.0),
    # l0 recomputed: others keep o0 + a1 = 6 each; the chain peaks at 6 after forward 1
    ((RECOMPUTE, KEEP), 12.0, 6.0),
    # l1 recomputed: others keep a0 + o1 = 6; the chain peaks at 10 when e1 is rebuilt
    ((KEEP, RECOMPUTE), 12.0, 10.0),
    # both: others keep o0 + o1 = 2; the chain peaks at 6
    ((RECOMPUTE, RECOMPUTE), 4.0, 6.0),
])
def test_in_flight_micro_batches_hold_what_the_plan_stores(actions, held, chain):
    plan = MemoryPlan(np.array(actions))
    assert held_bytes(_stage(3), plan.actions) == held
    assert held_bytes(_stage(1), plan.actions) == 0.0
    assert evaluate(_stage(3), plan, np.inf, LINK).peak_bytes == held + chain
    assert evaluate(_stage(1), plan, np.inf, LINK).peak_bytes == chain


def test_the_milp_counts_the_held_micro_batches():
    # one micro-batch: recompute l0 and recompute both tie at 6; with 3 in flight only
    # recompute-both reaches the least peak, 4 + 6 = 10 (recompute l0 alone: 12 + 6)
    plan = checkmate_min_peak(_stage(3), LINK, allow_drop=False)
    assert list(plan.actions) == [RECOMPUTE, RECOMPUTE]
    assert plan.meta["peak_bytes"] == pytest.approx(10.0)
    assert evaluate(_stage(3), plan, np.inf, LINK).peak_bytes == pytest.approx(10.0)


def test_in_flight_must_be_a_positive_integer():
    with pytest.raises(ValueError, match="'in_flight' must be an integer >= 1, but got 0"):
        _stage(0)
