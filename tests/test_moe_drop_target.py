"""The per-pair drop target of grouped / counts send blocks is chosen by simulated cost within
the user's maximum drop rate (placement.choose_blocks), and reported in the plan."""
import dataclasses

import numpy as np
import pytest

from ms_efficient.core.cluster import get_cluster
from ms_efficient.efficientmoe.capacity import expected_pair_drop_rate, send_blocks
from ms_efficient.efficientmoe.cost import CostModel, layer_cost
from ms_efficient.efficientmoe.placement import (DROP_TARGET_FRACTIONS, PlacementConfig,
                                                 choose_blocks, plan_layer, with_blocks)
from ms_efficient.efficientmoe.planner import PlannerConfig
from ms_efficient.moe.plan import ExpertPlan

NODE_1x8 = get_cluster("ascend910b-1x8")
MODEL = CostModel(NODE_1x8, 256, 1024)
LOAD = np.array([[300.0, 200.0], [250.0, 350.0]])
RD = np.arange(2)


def _errors():
    """[K=16, R=2, E=2] relative errors: a spread wide enough that the targets differ."""
    rng = np.random.default_rng(0)
    return rng.normal(0.0, 0.15, size=(16, 2, 2))


def _plan(dispatch):
    return ExpertPlan([0, 1], [0, 1], [1, 1], dispatch=dispatch, rank_share=LOAD)


def test_two_targets_the_looser_one_is_cheaper_when_padding_travels_and_no_replan_is_priced():
    """Grouped blocks travel full: with no re-plan penalty the largest allowed target (the
    smallest blocks) costs least; with a prohibitive penalty the lowest target wins."""
    rel = _errors()
    free = choose_blocks(_plan("grouped"), LOAD, rel, MODEL, RD, None,
                         PlacementConfig(2, dispatch="grouped", replan_penalty_s=0.0))
    assert free.targets == pytest.approx([f * 0.001 for f in DROP_TARGET_FRACTIONS])
    tight = send_blocks(_plan("grouped"), LOAD, rel, RD, None, free.targets[0])
    loose = send_blocks(_plan("grouped"), LOAD, rel, RD, None, free.targets[-1])
    assert loose.sum() < tight.sum()                     # the looser target pads less
    assert free.plan.send_block.tolist() == loose.tolist()
    # ties go to the lower target: the lowest one that gives the loose blocks
    same = [t for t in free.targets
            if send_blocks(_plan("grouped"), LOAD, rel, RD, None, t).tolist() == loose.tolist()]
    assert free.plan.drop_target == pytest.approx(same[0])
    assert free.scores_s[free.targets.index(same[0])] < free.scores_s[0]
    feared = choose_blocks(_plan("grouped"), LOAD, rel, MODEL, RD, None,
                           PlacementConfig(2, dispatch="grouped", replan_penalty_s=1e3))
    assert feared.plan.drop_target == pytest.approx(feared.targets[0])
    assert feared.plan.send_block.tolist() == tight.tolist()


def test_the_choice_is_the_argmin_of_layer_time_plus_replan_risk_recomputed_by_hand():
    rel = _errors()
    config = PlacementConfig(2, dispatch="grouped", replan_penalty_s=2e-4,
                             forced_replan_rate=0.01)
    got = choose_blocks(_plan("grouped"), LOAD, rel, MODEL, RD, None, config)
    scores, rates = [], []
    for target in got.targets:
        cand = with_blocks(_plan("grouped"), send_blocks(_plan("grouped"), LOAD, rel, RD,
                                                         None, target))
        rate = expected_pair_drop_rate(cand, LOAD, rel, RD, None)
        rates.append(rate)
        scores.append(layer_cost(cand, LOAD, MODEL, RD).time_s
                      + min(1.0, rate / 0.01) * 2e-4)
    assert got.scores_s == pytest.approx(scores) and got.rates == pytest.approx(rates)
    best = int(np.argmin(scores))
    assert got.plan.drop_target == pytest.approx(got.targets[best])
    assert got.plan.expected_drop_rate == pytest.approx(rates[best])
    assert got.plan.expected_drop_rate <= 0.001


def test_counts_plans_pay_no_padding_so_the_lowest_target_wins_at_any_penalty():
    """A count-driven exchange sends the load whatever the blocks: every target has the same
    layer time, and the re-plan risk (or the tie rule) picks the fewest drops."""
    rel = _errors()
    for penalty in (0.0, 1e-4):
        got = choose_blocks(_plan("counts"), LOAD, rel, MODEL, RD, None,
                            PlacementConfig(2, dispatch="counts", replan_penalty_s=penalty))
        assert np.ptp(got.scores_s - penalty * np.minimum(1.0, got.rates / 0.01)) < 1e-12
        assert got.plan.drop_target == pytest.approx(got.targets[0])
        assert got.plan.dispatch == "counts"


def test_plans_report_the_chosen_target_and_expected_drops_within_the_limit():
    rel = _errors()
    for dispatch in ("grouped", "counts"):
        config = PlacementConfig(2, dispatch=dispatch, max_block_drop_rate=0.002)
        plan = plan_layer(LOAD, MODEL, config, RD, rel, top_k=1)
        assert plan.dispatch == dispatch
        assert np.isclose(plan.drop_target, [f * 0.002 for f in DROP_TARGET_FRACTIONS]).any()
        assert 0.0 <= plan.expected_drop_rate <= 0.002
        assert ExpertPlan.from_dict(plan.to_dict()).drop_target == pytest.approx(
            plan.drop_target)
    exact = plan_layer(LOAD, MODEL, dataclasses.replace(config, dispatch="grouped"), RD, None,
                       top_k=1)
    assert exact.expected_drop_rate == 0.0 and exact.drop_target == pytest.approx(0.0002)


def test_the_maximum_drop_rate_is_validated():
    with pytest.raises(ValueError, match="max_block_drop_rate"):
        PlannerConfig(max_block_drop_rate=1.5)
    with pytest.raises(ValueError, match="max_block_drop_rate"):
        PlacementConfig(2, max_block_drop_rate=-0.1)


def test_plan_moe_last_plans_from_the_recent_steps_only(tmp_path, capsys):
    # 20 volatile early steps (every rank's 4096 tokens x top-2 on two experts, which two
    # changes each step) then 40 steady ones: the layout planned from the steady tail alone
    # says it read those 40 rows; --last beyond the trace is refused
    from ms_efficient.cli import main
    from ms_efficient.moe.trace import RoutingTrace, save_trace

    rng = np.random.default_rng(0)
    early = np.zeros((20, 1, 4, 8), np.int64)
    for t in range(20):
        early[t, 0, :, [(2 * t) % 8, (2 * t + 1) % 8]] = 4096
    steady = rng.multinomial(8192, np.full(8, 1 / 8), size=(40, 1, 4)).astype(np.int64)
    path = str(tmp_path / "trace.npz")
    save_trace(RoutingTrace(np.concatenate([early, steady]), top_k=2, hidden=4096,
                            tokens_per_rank=4096), path)
    assert main(["plan", "moe", "--trace", path, "--cluster", "ascend910b-1x8", "--last",
                 "40", "--out", str(tmp_path / "plan.yaml")]) == 0
    assert "layout written to" in capsys.readouterr().out
    assert main(["plan", "moe", "--trace", path, "--last", "61", "--out",
                 str(tmp_path / "x.yaml")]) == 2
    assert "'--last' must be in [2, 60] (the trace's steps), but got 61" in capsys.readouterr().err
