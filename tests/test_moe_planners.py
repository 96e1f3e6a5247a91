"""EfficientMoE planner side: dispatch rule, predictors, capacity model, scheduler, baselines,
re-plan decision and the trace replay. Values are hand-computed or known optima."""
import math

import numpy as np
import pytest

from ms_efficient.core.cluster import get_cluster
from ms_efficient.efficientmoe import baselines
from ms_efficient.efficientmoe.balanced_cost import balanced_cost
from ms_efficient.efficientmoe.bench import _truncate, markdown_table, run_simulated, speedups
from ms_efficient.efficientmoe.capacity import (expected_drop_and_padding, load_samples, round_up,
                                                slot_capacities)
from ms_efficient.efficientmoe.cost import (DYNAMIC_EXCHANGE_S, CostModel, event_step_time_s, layer_cost,
                                            uneven_alltoall_time_s)
from ms_efficient.efficientmoe.layout import uniform_home
from ms_efficient.efficientmoe.placement import (PlacementConfig, levelled_shares, plan_layer,
                                                 replica_counts_greedy, uniform_placement)
from ms_efficient.efficientmoe.predictor import (EMA, EXTRAPOLATED_LEADS, EXTRAPOLATION_LIMIT,
                                                 ARRidge, LastValue, evaluate_predictors,
                                                 mape_percent, predict_counts, relative_residuals)
from ms_efficient.efficientmoe.replay import ReplayConfig, cluster_for_ranks, plan_trace, replay
from ms_efficient.efficientmoe.schedule import (ReplanCosts, choose_horizon, decide_replan,
                                                migration_bytes_DD)
from ms_efficient.moe.balance import balance_step
from ms_efficient.moe.plan import ExpertPlan, load_plans, save_plans
from ms_efficient.moe.split import largest_remainder, source_rows, split_tokens, switch_capacity
from ms_efficient.moe.trace import RoutingTrace, synthetic_trace

CLUSTER_2x8 = cluster_for_ranks(16)
NODE_1x8 = cluster_for_ranks(4)          # a 4-rank run uses 4 of the node's 8 chips


def demo_shaped_trace(counts_RE, rows=24):
    """A trace shaped like the demo run's: 4 ranks, 8 experts, top-2, H = 256, 512 tokens per
    rank per step, one layer, ``counts_RE`` [4, 8] (or [rows, 4, 8]) every step."""
    counts = np.broadcast_to(np.asarray(counts_RE, dtype=np.int64), (rows, 4, 8))
    return RoutingTrace(counts=counts[:, None].copy(), top_k=2, hidden=256, tokens_per_rank=512,
                        steps=np.arange(1, rows + 1))


@pytest.fixture(scope="module")
def small_trace():
    """16 ranks on 2 nodes, 16 experts, 1 layer, 28 rows sampled every 50 steps."""
    return synthetic_trace(steps=28, layers=1, ranks=16, experts=16, hidden=1024,
                           tokens_per_rank=2048, step_stride=50, seed=1)


def model_for(cluster, hidden=1024):
    return CostModel(cluster, hidden, 4 * hidden)


# ---------------------------------------------------------------- split_tokens
def test_split_tokens_serves_own_device_then_node_by_hand():
    # expert 0 on devices 0 and 1 (cap 10 each), expert 1 on device 1 (cap 100); one node
    plan = ExpertPlan([0, 0, 1], [0, 1, 1], [10, 10, 100])
    assigned, dropped = split_tokens(plan, [[12, 3], [4, 5]], [0, 1], devices_per_node=2)
    # rank 0: 10 local, its 2 left go to the same-node replica; rank 1: 4 local
    assert assigned.tolist() == [[10, 2, 3], [0, 4, 5]]
    assert dropped == 0


def test_split_tokens_drops_what_no_replica_has_room_for_by_hand():
    plan = ExpertPlan([0, 0, 1], [0, 1, 1], [10, 5, 4])
    assigned, dropped = split_tokens(plan, [[12, 3], [4, 5]], [0, 1], devices_per_node=2)
    # expert 0: rank0 10 local, rank1 4 local, 1 room left on slot 1 -> rank0's 12th token
    # goes there, 1 dropped; expert 1 (cap 4, device 1): rank 1 (local) first takes 4, its
    # 5th and rank 0's 3 are dropped
    assert assigned.tolist() == [[10, 1, 0], [0, 4, 4]]
    assert dropped == 1 + 4


def test_split_tokens_splits_remote_tokens_by_remaining_room():
    # one device per node: rank 0's 20 tokens have neither a local nor a same-node replica
    plan = ExpertPlan([0, 0, 1], [1, 2, 0], [10, 30, 5])
    assigned, dropped = split_tokens(plan, [[20, 1], [0, 0], [0, 0]], [0, 1, 2],
                                     devices_per_node=1)
    assert assigned.tolist() == [[5, 15, 1], [0, 0, 0], [0, 0, 0]]   # 20 x 10/40, 20 x 30/40
    assert dropped == 0


def test_split_tokens_prefers_the_node_over_remote_replicas():
    # 2 nodes of 2 devices; expert 0 on device 1 (node 0) and device 2 (node 1)
    plan = ExpertPlan([0, 0], [1, 2], [100, 100])
    assigned, _ = split_tokens(plan, [[8], [0], [0], [6]], [0, 1, 2, 3], devices_per_node=2)
    assert assigned.tolist() == [[8, 0], [0, 0], [0, 0], [0, 6]]


def test_replicated_expert_gets_half_the_tokens_on_a_balanced_two_rank_case():
    counts = [[100, 40], [100, 40]]
    single = ExpertPlan([0, 1], [0, 1], [1000, 1000])
    double = ExpertPlan([0, 0, 1], [0, 1, 1], [1000, 1000, 1000])
    a1, _ = split_tokens(single, counts, [0, 1], 2)
    a2, _ = split_tokens(double, counts, [0, 1], 2)
    assert a1.sum(axis=0)[0] == 200
    assert a2.sum(axis=0)[:2].tolist() == [100, 100]          # each replica: half
    assert a2[:, 0].tolist() == [100, 0] and a2[:, 1].tolist() == [0, 100]   # all local


def test_static_dispatch_drops_a_ranks_overflow_even_when_other_ranks_left_room():
    # GShard/Switch: 2 ranks share expert 0's slot of 200 rows, 100 rows each
    caps = [200, 200]
    static = ExpertPlan([0, 1], [0, 1], caps, dispatch="static")
    assigned, dropped = split_tokens(static, [[130, 10], [50, 10]], [0, 1], 2)
    assert assigned.tolist() == [[100, 10], [50, 10]] and dropped == 30
    # counts-first dispatch fills the same capacity from both ranks: nothing dropped
    shared = ExpertPlan([0, 1], [0, 1], caps)
    assert split_tokens(shared, [[130, 10], [50, 10]], [0, 1], 2)[1] == 0


def test_static_rows_follow_the_rank_shares_and_spill_to_a_sibling_replica_by_hand():
    # expert 0 on devices 0 and 1 (60 + 40 rows), expert 1 on device 1 (50 rows); rank 0 is
    # forecast to send 3x what rank 1 sends to expert 0 -> 75 and 25 of its 100 rows: rank 0
    # gets all 60 rows of its local replica and 15 of the sibling, rank 1 the other 25
    plan = ExpertPlan([0, 0, 1], [0, 1, 1], [60, 40, 50], dispatch="static",
                      rank_share=[[3.0, 1.0], [1.0, 1.0]])
    rows = source_rows(plan, 2, [0, 1], 2, plan.rank_share)
    assert rows.tolist() == [[60, 15, 25], [0, 25, 25]]
    # rank 0 sends 70 to expert 0: 60 local, then 10 in its rows on device 1
    assigned, dropped = split_tokens(plan, [[70, 30], [30, 20]], [0, 1], 2)
    assert assigned.tolist() == [[60, 10, 25], [0, 25, 20]] and dropped == 5 + 5


def test_static_rows_equal_a_column_by_column_largest_remainder_split():
    # source_rows shares every expert's capacity with one vectorised largest remainder; the
    # naive form splits expert by expert, then attributes the shares with split_tokens
    rng = np.random.default_rng(4)
    checked = 0
    for _ in range(10):
        slot_expert = np.concatenate([np.arange(6), rng.integers(0, 6, 4)])
        plan = ExpertPlan(slot_expert, rng.permutation(10) % 4, rng.integers(1, 90, 10),
                          dispatch="static", rank_share=rng.uniform(0, 5, (4, 6)))
        plan.rank_share[:, 5] = 0.0                   # an all-zero column: equal shares
        total_E = np.bincount(slot_expert, weights=plan.slot_capacity, minlength=6)
        share_RE = np.stack([largest_remainder(int(total_E[e]), plan.rank_share[:, e])
                             for e in range(6)], axis=1)
        counted = ExpertPlan(plan.slot_expert, plan.slot_device, plan.slot_capacity)
        expected, dropped = split_tokens(counted, share_RE, np.arange(4), 2)
        assert dropped == 0
        np.testing.assert_array_equal(source_rows(plan, 6, 4, 2, plan.rank_share), expected)
        checked += 1
    assert checked == 10


def test_split_tokens_matches_a_naive_loop_on_random_cases():
    rng = np.random.default_rng(0)
    for _ in range(20):
        num_ranks, num_experts = 4, 5
        slot_expert = np.concatenate([np.arange(num_experts), rng.integers(0, num_experts, 3)])
        plan = ExpertPlan(slot_expert, rng.integers(0, 4, slot_expert.size),
                          rng.integers(0, 30, slot_expert.size))
        counts = rng.integers(0, 25, (num_ranks, num_experts))
        assigned, dropped = split_tokens(plan, counts, np.arange(num_ranks), 2)
        # invariants: per rank and expert, assigned + dropped = counts; slots within capacity
        per_expert = np.zeros((num_ranks, num_experts), dtype=np.int64)
        for s, e in enumerate(plan.slot_expert):
            per_expert[:, e] += assigned[:, s]
        assert (per_expert <= counts).all()
        assert int(counts.sum() - per_expert.sum()) == dropped
        assert (assigned.sum(axis=0) <= plan.slot_capacity).all()
        # no expert drops while one of its replicas has room
        for e in range(num_experts):
            slots = plan.replicas_of(e)
            if per_expert[:, e].sum() < counts[:, e].sum():
                assert (assigned[:, slots].sum(axis=0) == plan.slot_capacity[slots]).all()


# ---------------------------------------------------------------- plan
def test_plan_validate_names_experts_without_a_slot():
    with pytest.raises(ValueError, match=r"experts \[1, 3\] no slot"):
        ExpertPlan([0, 2, 0], [0, 1, 1], [8, 8, 8]).validate(4, 2)
    with pytest.raises(ValueError, match="device 5"):
        ExpertPlan([0, 1], [0, 5], [8, 8]).validate(2, 2)


def test_plan_round_trips_through_yaml_with_moe_config(tmp_path):
    plan = ExpertPlan([0, 0, 1, 2, 3], [0, 1, 1, 2, 3], [64, 64, 48, 32, 16], top_k=2,
                      tokens_per_step=100, method="efficientmoe")
    assert ExpertPlan.from_dict(plan.to_dict()).to_dict() == plan.to_dict()
    cfg = plan.moe_config(4)
    assert cfg["expert_num"] == 4 and cfg["num_experts_chosen"] == 2
    assert cfg["enable_cold_hot_expert"] is True and cfg["hot_expert_num"] == 1
    assert plan.capacity_factor() == pytest.approx(224 / 200)
    assert cfg["capacity_factor"] == pytest.approx(128 / 50)      # hot: 128 rows, CF1.0 = 50
    assert cfg["cold_token_percent"] == pytest.approx((96 / 3) / 128)
    path = tmp_path / "plan.yaml"
    save_plans(str(path), [plan, plan], 4)
    loaded, num_experts = load_plans(str(path))
    assert num_experts == 4 and [p.to_dict() for p in loaded] == [plan.to_dict()] * 2


# ---------------------------------------------------------------- predictors
def test_every_predictor_has_zero_mape_on_a_constant_trace():
    load = np.tile(np.array([[40.0, 10.0, 30.0, 20.0]]), (20, 2, 1)).reshape(20, 2, 4)
    mape = evaluate_predictors(load, [LastValue(), EMA(0.3), ARRidge()], warmup=1)
    for name, per_layer in mape.items():
        np.testing.assert_allclose(per_layer, 0.0, atol=1e-9, err_msg=name)


def test_ema_mape_on_a_step_change_by_hand():
    load = np.array([10.0, 10.0, 20.0, 20.0]).reshape(4, 1, 1)
    # forecasts for t = 1, 2, 3: 10, 10, 0.5 * 20 + 0.5 * 10 = 15 -> errors 0, 10/20, 5/20
    mape = evaluate_predictors(load, [EMA(alpha=0.5)], warmup=1)["ema"]
    assert mape == pytest.approx([100 * (0 + 0.5 + 0.25) / 3])


def test_mape_floors_near_zero_loads():
    actual = np.array([[[0.0, 100.0]]])
    pred = np.array([[[10.0, 100.0]]])
    # floor = max(1, 0.05 * mean 50) = 2.5 -> errors 10 / 2.5 and 0 -> mean 2.0 = 200 %
    assert mape_percent(pred, actual) == pytest.approx([200.0])


def test_predict_counts_spreads_the_forecast_by_rank_shares():
    counts = np.zeros((3, 1, 2, 2))
    counts[:, 0, 0, 0], counts[:, 0, 1, 0] = 30, 10        # expert 0: rank 0 has 3/4
    counts[:, 0, :, 1] = 5
    pred = predict_counts(counts, LastValue(), share_window=3)
    np.testing.assert_allclose(pred[0], [[30, 5], [10, 5]])


def test_residuals_extrapolate_leads_beyond_the_history():
    rng = np.random.default_rng(0)
    load = 100 + rng.normal(0, 5, (6, 1, 8))
    rel = relative_residuals(load, LastValue(), window=3, horizon=10)
    assert rel.shape[1:] == (1, 8) and rel.shape[0] > 0
    assert relative_residuals(load[:1], LastValue(), 3, 2).shape == (0, 1, 8)


def test_far_leads_reuse_every_observed_sample_and_stop_growing_at_the_limit():
    # a random walk: last-value errors grow with the lead
    rng = np.random.default_rng(1)
    load = 1000 + np.cumsum(rng.normal(0, 20, (12, 1, 8)), axis=0)
    observed = 11                                 # lead l has origins 1..12 - l, at most 4
    pool = sum(min(4, 12 - lead) for lead in range(1, observed + 1))   # 4 * 8 + 3 + 2 + 1
    far = relative_residuals(load, LastValue(), window=4, horizon=1000)
    farther = relative_residuals(load, LastValue(), window=4, horizon=5000)
    assert far.shape[0] == EXTRAPOLATED_LEADS * pool      # the pool, not the last origin only
    # the last lead point of both is beyond EXTRAPOLATION_LIMIT * 11 leads: the same scale
    assert min(1000, 5000) > EXTRAPOLATION_LIMIT * observed
    np.testing.assert_allclose(far[-pool:], farther[-pool:])
    # ... and it is no smaller than the longest lead the history shows
    longest = relative_residuals(load, LastValue(), window=4, horizon=observed)[-2:]
    assert np.mean(far[-pool:] ** 2) >= np.mean(longest ** 2)


# ---------------------------------------------------------------- capacity
def test_capacity_rounding_to_hardware_multiples():
    assert round_up([0, 1, 16, 17, 33.5], 16).tolist() == [0, 16, 16, 32, 48]
    assert switch_capacity(1024, 8, 2, 1.25) == 320           # ceil(1.25 * 2048 / 8)
    assert switch_capacity(100, 8, 1, 1.3, multiple=8) == 24   # ceil(16.25) = 17 -> 24
    assert switch_capacity(100, 4, 1, 1.1) == 28              # 27.500000000000004: 28
    assert switch_capacity(100, 10, 1, 1.1) == 11             # 11.000000000000002: 11
    # no forecast error: capacity = prediction rounded up, at least one multiple
    res = slot_capacities(np.array([100.0, 0.0, 33.0]), np.arange(3), np.zeros((4, 3)))
    assert res.capacity_S.tolist() == [112, 16, 48]
    assert res.expected_drop_rate == 0.0


def test_no_slot_gets_more_rows_than_the_tokens_of_a_step():
    # wild forecast errors (early training): capacities stop at the dropless bound, 2048 tokens
    rel = np.array([[40.0, -0.9, 3.0], [-0.5, 20.0, -0.9]])
    res = slot_capacities(np.array([1000.0, 600.0, 20.0]), np.arange(3), rel, 0.005, 16,
                          max_load=2048)
    assert res.capacity_S.max() == 2048 and res.expected_drop_rate <= 0.005
    assert (load_samples([1000.0, 600.0, 20.0], np.arange(3), rel, max_load=2048) <= 2048).all()


def test_an_expert_predicted_idle_keeps_an_error_scale_of_the_floor():
    # floor = max(1, 5 % of the mean expert load (200 + 0) / 2) = 5 tokens; expert 1 was
    # predicted idle and received 4 floors, twice: its largest plausible load is 5 * 4 = 20
    # tokens (sigma * z = the relative error), not 0 * (1 + ...) = 0
    rel = np.array([[0.0, 4.0], [0.0, 4.0]])
    samples = load_samples([200.0, 0.0], [0, 1], rel)
    assert samples[:, 1].max() == pytest.approx(20.0)
    assert slot_capacities(np.array([200.0, 0.0]), np.arange(2), rel, 0.0,
                           multiple=1).capacity_S[1] == 20


def test_expected_drop_and_padding_by_hand():
    drop, pad = expected_drop_and_padding([16, 32], np.array([[10.0, 40.0]]))
    assert drop == pytest.approx(8 / 50) and pad == pytest.approx(6 / 48)


def test_closed_form_capacity_figures_equal_explicit_samples():
    rng = np.random.default_rng(3)
    pred, slot_expert = rng.uniform(0, 400, 12), rng.integers(0, 5, 12)
    rel = rng.normal(0, 0.2, (9, 5))
    res = slot_capacities(pred, slot_expert, rel, drop_target=0.01)
    drop, pad = expected_drop_and_padding(res.capacity_S, load_samples(pred, slot_expert, rel))
    assert res.expected_drop_rate == pytest.approx(drop) and drop <= 0.01
    assert res.expected_padding_fraction == pytest.approx(pad)


# ---------------------------------------------------------------- cost model and baselines
def test_uneven_alltoall_of_equal_messages_is_the_collective_formula():
    cluster = cluster_for_ranks(16)
    nbytes = 16e6
    equal = np.full((16, 16), nbytes / 16)
    expected = cluster.collective_time_s("alltoall", nbytes, list(range(16)))
    assert uneven_alltoall_time_s(equal, cluster) == pytest.approx(expected)


def test_eplb_gives_redundant_slots_to_the_heaviest_load_per_replica():
    # one redundant slot goes to the hot expert; replicas 6, 6, 4, 4 -> optimum 10 per device
    replicas = replica_counts_greedy(np.array([12.0, 4.0, 4.0]), 4)
    assert replicas.tolist() == [2, 1, 1]
    # then to whichever has the heaviest load per replica: 12 / 2 = 6 > 5
    assert replica_counts_greedy(np.array([12.0, 5.0, 4.0]), 5).tolist() == [3, 1, 1]


def _plain_cost(model, no_sync=None):
    """The dynamic-shape cost FasterMoE's shadowing weighs (no fast level, no sync)."""
    return lambda bal: balanced_cost(bal, model, np.zeros(bal.rows_LEW.shape[0]),
                                     dynamic=True, fast_level=False).time_L


def test_fastermoe_shadows_a_very_hot_expert_when_weights_are_cheap():
    """8 ranks x 8 experts, 100 rows each, expert 3 gets 20000 from every rank: with tiny
    experts (H 64, F 256) shadowing expert 3 on every device beats sending 140000 rows to
    one chip, and each device then computes its own 20000 rows of it locally."""
    cluster = get_cluster("ascend910b-1x8")
    model = CostModel(cluster, hidden=64, ffn_hidden=256)     # tiny experts: cheap broadcast
    counts = np.full((1, 8, 8), 100)
    counts[0, :, 3] = 20000
    home = uniform_home(1, 8, 8)
    bcast = cluster.collective_time_s("broadcast", model.copy_bytes, list(range(8)))
    bal, shadows = baselines.fastermoe_balance(counts, home, _plain_cost(model), bcast, 8)
    assert shadows.tolist() == [1] and bal.holder_LEW[0, 3].all()
    assert bal.rows_LEW[0, 3].tolist() == [20000] * 8            # every rank's own rows
    assert (bal.rows_LEW.sum(axis=(0, 2)) == counts.sum(axis=(0, 1))).all()   # no drop
    assert bal.sent_LRW[0, np.arange(8), np.arange(8)].min() >= 20000
    # with 100 rows of every expert everywhere, no shadow pays its broadcast
    flat = np.full((1, 8, 8), 100)
    assert baselines.fastermoe_balance(flat, home, _plain_cost(model), bcast, 8)[1].tolist() \
        == [0]


def test_event_simulator_schedule_equals_the_analytic_layer_cost():
    cluster = CLUSTER_2x8
    model = model_for(cluster)
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 300, (16, 16))
    counts[:, 2] *= 6
    plan = plan_layer(counts, model, PlacementConfig(slots_per_device=2), rel_err_KRE=None)
    assert (plan.replica_counts(16) > 1).any()
    analytic = layer_cost(plan, counts, model).time_s
    assert event_step_time_s(plan, counts, model) == pytest.approx(analytic, rel=1e-9)


def test_switch_pays_its_padded_buffers_and_dropless_the_count_exchange_by_hand():
    """4 ranks x 8 experts, every rank sends 128 tokens to every expert (H = 256, bf16)."""
    model = CostModel(NODE_1x8, hidden=256, ffn_hidden=1024)
    counts = np.full((1, 4, 8), 128)
    home = uniform_home(1, 8, 4)
    intra = NODE_1x8.intra_link
    row_s = 3 * 4 * 256 * 1024 / (0.3 * 313e12)                # fwd + bwd FLOPs of one row
    assert model.row_time_s == pytest.approx(row_s)
    # Switch CF 1.25: C = ceil(1.25 * 1024 / 8) = 160 rows per rank per expert, 2 experts per
    # device -> 320 rows to each of 3 peers, 4 All-to-Alls; 4 x 160 = 640 rows per expert
    capacity = switch_capacity(512, 8, 2, 1.25)
    switch = baselines.switch_balance(counts, home, capacity)
    assert capacity == 160 and switch.rows_LEW[0].max(axis=1).tolist() == [640] * 8
    assert switch.sent_LRW[0].tolist() == [[320] * 4] * 4 and switch.dropped_L.tolist() == [0]
    a2a = 4 * 3 * (intra.latency_s + 320 * 512 / intra.bandwidth_Bps)
    cost = balanced_cost(switch, model, np.zeros(1), dynamic=False, fast_level=False,
                         count_exchange=False)
    assert cost.exchange_L[0] == 0.0 and cost.a2a_L[0] == pytest.approx(a2a)
    assert cost.time_L[0] == pytest.approx(a2a + 1280 * row_s)
    # a rank over C drops its overflow: 100 rows of expert 0 past 160
    over = counts.copy()
    over[0, 2, 0] = 260
    assert baselines.switch_balance(over, home, capacity).dropped_L.tolist() == [100]
    # dropless, counts first: 256 routed rows to each peer, 512 rows per expert, plus the
    # AllGather of the 4 x 8 int32 counts and the dynamic-shape overhead of its 4
    # data-dependent All-to-Alls
    dropless = balance_step(counts, home, np.zeros(4, dtype=np.int64), None, even_split=True,
                            devices_per_node=8)
    a2a = 4 * 3 * (intra.latency_s + 256 * 512 / intra.bandwidth_Bps)
    exchange = (NODE_1x8.collective_time_s("allgather", 4 * 8 * 4, [0, 1, 2, 3])
                + 4 * DYNAMIC_EXCHANGE_S)
    cost = balanced_cost(dropless, model, np.zeros(1), dynamic=True, fast_level=False)
    assert exchange > 0 and cost.exchange_L[0] == pytest.approx(exchange)
    assert cost.time_L[0] == pytest.approx(exchange + a2a + 1024 * row_s)


def test_an_equal_split_all_to_all_pads_every_block_to_the_largest_by_hand():
    """4 experts, one per chip; rank r owns 100 rows of expert r + 1 (mod 4) and 10 of each
    other one. An equal-split AlltoAll sends 100-row blocks to all 3 peers; an AlltoAllV with
    compile-time counts sends one 100-row and two 10-row blocks."""
    share = np.full((4, 4), 10.0)
    share[np.arange(4), (np.arange(4) + 1) % 4] = 100.0
    plan = ExpertPlan([0, 1, 2, 3], [0, 1, 2, 3], [130] * 4, dispatch="static", rank_share=share)
    counts = share.astype(int)
    intra = NODE_1x8.intra_link
    per_row = 256 * 2 / intra.bandwidth_Bps
    equal = layer_cost(plan, counts, CostModel(NODE_1x8, 256, 1024, static_blocks="equal"))
    exact = layer_cost(plan, counts, CostModel(NODE_1x8, 256, 1024, static_blocks="exact"))
    assert equal.a2a_time_s == pytest.approx(4 * 3 * (intra.latency_s + 100 * per_row))
    assert exact.a2a_time_s == pytest.approx(4 * (3 * intra.latency_s + 120 * per_row))
    assert equal.dropped == exact.dropped == 0 and equal.exchange_time_s == 0.0


def test_levelled_shares_reach_the_level_optimum_by_hand():
    # expert 0 (20 rows) on devices 0 and 1; device 0 also holds expert 1 (10 rows):
    # 5 + 10 on device 0 and 15 on device 1 levels both at 15
    shares = levelled_shares(np.array([0, 0, 1]), np.array([0, 1, 0]), np.array([20.0, 10.0]), 2)
    assert shares.tolist() == [5.0, 15.0, 10.0]


# ---------------------------------------------------------------- scheduler
def test_scheduler_is_deterministic_and_beats_uniform_placement_on_skewed_load():
    model = model_for(CLUSTER_2x8)
    rng = np.random.default_rng(1)
    counts = rng.integers(100, 400, (16, 16))
    counts[:, 5] *= 8
    config = PlacementConfig(slots_per_device=2)
    first = plan_layer(counts, model, config, rel_err_KRE=None)
    second = plan_layer(counts, model, config, rel_err_KRE=None)
    assert first.to_dict() == second.to_dict()
    first.validate(16, 16)
    slot_expert, slot_device = uniform_placement(16, np.arange(16))
    exact = ExpertPlan(slot_expert, slot_device, counts.sum(axis=0))
    assert layer_cost(first, counts, model).time_s < layer_cost(exact, counts, model).time_s


def test_replay_is_deterministic_and_reports_bounded_metrics(small_trace):
    config = ReplayConfig(warmup=12)
    for method in ("fastermoe", "eplb-alltoallv"):
        a = replay(small_trace, method, CLUSTER_2x8, config)
        b = replay(small_trace, method, CLUSTER_2x8, config)
        assert a.metrics() == b.metrics(), method
        assert 0 <= a.padding_fraction < 1 and a.drop_rate == 0.0 and a.max_over_mean_load >= 1
    switch = replay(small_trace, "switch-cf1.0", CLUSTER_2x8, config)
    dropless = replay(small_trace, "dropless", CLUSTER_2x8, config)
    assert dropless.drop_rate == 0.0 and switch.drop_rate > 0.0
    assert switch.extra["dynamic_exchange_s"] == 0.0 and dropless.extra["dynamic_exchange_s"] > 0


def test_a_steady_demo_shaped_load_is_planned_exactly_with_no_padding():
    """Every rank sends 128 of its 512 x 2 assignments to every expert: the one-level static
    plan gives each of the 8 experts 512 rows (a multiple of 16), 128 owned by each rank, on
    the 4 chips of the run. Replayed, dropless is 4 All-to-Alls of 2 x 128 rows to each of 3
    peers plus 1024 rows of compute per chip, after the counts' AllGather and the
    dynamic-shape overhead; Switch CF 1.25 sends and computes 160-row blocks, no counts."""
    trace = demo_shaped_trace(np.full((4, 8), 128))
    plan = plan_trace(trace, NODE_1x8, ReplayConfig(warmup=8, dispatch="static"))[0]
    assert plan.slot_capacity.tolist() == [512] * 8 and plan.dispatch == "static"
    assert sorted(plan.slot_device.tolist()) == [0, 0, 1, 1, 2, 2, 3, 3]   # not chips 4-7
    intra = NODE_1x8.intra_link
    row_s = 3 * 4 * 256 * 1024 / (0.3 * 313e12)
    dropless = replay(trace, "dropless", NODE_1x8, ReplayConfig(warmup=8))
    assert dropless.padding_fraction == 0.0 and dropless.drop_rate == 0.0
    assert dropless.iteration_time_s == pytest.approx(
        NODE_1x8.collective_time_s("allgather", 4 * 8 * 4, [0, 1, 2, 3])
        + 4 * DYNAMIC_EXCHANGE_S
        + 4 * 3 * (intra.latency_s + 256 * 512 / intra.bandwidth_Bps) + 1024 * row_s)
    switch = replay(trace, "switch-cf1.25", NODE_1x8, ReplayConfig(warmup=8))
    assert switch.padding_fraction == pytest.approx(1 - 512 / 640) and switch.drop_rate == 0.0
    assert switch.iteration_time_s == pytest.approx(
        4 * 3 * (intra.latency_s + 320 * 512 / intra.bandwidth_Bps) + 1280 * row_s)


def test_the_one_level_plans_keep_their_slots_on_the_chips_of_the_run():
    trace = demo_shaped_trace(np.random.default_rng(2).multinomial(1024, [1 / 8] * 8, (20, 4)),
                              rows=20)
    for dispatch in ("static", "grouped", "counts"):
        plan = plan_trace(trace, NODE_1x8, ReplayConfig(warmup=8, dispatch=dispatch))[0]
        assert set(plan.slot_device.tolist()) <= {0, 1, 2, 3}, dispatch


def test_an_unpredictable_layer_gets_a_dropless_plan():
    model = CostModel(NODE_1x8, 256, 1024)
    load = np.full((4, 8), 128.0)
    plan = plan_layer(load, model, PlacementConfig(slots_per_device=3), np.arange(4),
                      np.zeros((2, 8)), top_k=2, dropless=True)
    assert plan.slot_capacity.tolist() == [2048] * 8 and plan.num_slots == 8
    # sized by the largest count any rank sent each expert so far (x 4 ranks, to 16 rows),
    # never above all tokens of a step: the offline dropless baseline's rule, online
    seen = np.zeros((4, 8), dtype=np.int64)
    seen[:, 0] = [10, 50, 20, 5]                  # 4 x 50 = 200 -> 208
    seen[1, 1] = 900                              # 4 x 900 = 3600 -> the 2048 bound
    plan = plan_layer(load, model, PlacementConfig(slots_per_device=3), np.arange(4),
                      np.zeros((2, 8)), top_k=2, dropless=True, seen_max_RE=seen)
    caps = dict(zip(plan.slot_expert.tolist(), plan.slot_capacity.tolist()))
    assert caps == {0: 208, 1: 2048, **{e: 16 for e in range(2, 8)}}
    with pytest.raises(ValueError, match="seen_max_RE"):
        plan_layer(load, model, PlacementConfig(slots_per_device=3), np.arange(4),
                   np.zeros((2, 8)), top_k=2, dropless=True, seen_max_RE=seen[:2])


def test_quick_replays_the_last_rows_of_a_trace():
    trace = synthetic_trace(steps=10, layers=3, ranks=4, experts=8, step_stride=5)
    short = _truncate(trace, 4, 2)
    assert short.steps.tolist() == [30, 35, 40, 45]
    assert np.array_equal(short.counts, trace.counts[-4:, :2])


def test_synthetic_trace_is_deterministic_for_a_seed():
    a = synthetic_trace(steps=5, layers=1, ranks=4, experts=8, seed=7)
    b = synthetic_trace(steps=5, layers=1, ranks=4, experts=8, seed=7)
    c = synthetic_trace(steps=5, layers=1, ranks=4, experts=8, seed=8)
    assert np.array_equal(a.counts, b.counts) and not np.array_equal(a.counts, c.counts)
    assert (a.counts.sum(axis=3) == 4096 * 2).all()               # tokens x top_k per rank


# ---------------------------------------------------------------- re-plan decision
def test_replan_only_when_gain_over_the_horizon_exceeds_migration_plus_recompile():
    cluster = CLUSTER_2x8
    model = model_for(cluster)
    old = [ExpertPlan([0, 1], [0, 8], [64, 64])]
    new = [ExpertPlan([0, 1, 0], [0, 8, 9], [32, 64, 32])]          # expert 0 copied node0->1
    moved = migration_bytes_DD(old, new, model, 4.0, 2)          # float32 + Adam's 2 moments
    nbytes = model.expert_params * 4.0 * 3
    assert moved[0, 9] == nbytes and moved.sum() == nbytes
    migration = cluster.inter_link.latency_s + nbytes / cluster.inter_link.bandwidth_Bps
    costs = ReplanCosts(recompile_s=1.2, horizon_steps=100)
    cost = migration + 1.2
    yes = decide_replan(0.030, 0.030 - 1.01 * cost / 100, old, new, model, costs)
    no = decide_replan(0.030, 0.030 - 0.99 * cost / 100, old, new, model, costs)
    assert yes.replan and not no.replan and not yes.forced
    assert yes.migration_s == pytest.approx(migration) and yes.cost_s == pytest.approx(cost)
    forced = decide_replan(0.03, 0.04, old, new, model, costs, current_drop_rate=0.05)
    assert forced.replan and forced.forced and "predicted to drop 5.00%" in forced.reason
    observed = decide_replan(0.03, 0.04, old, new, model, costs, current_drop_rate=0.0,
                             observed_drop_rate=0.02)
    assert observed.replan and observed.forced and "dropped 2.00%" in observed.reason
    assert not decide_replan(0.03, 0.04, old, new, model, costs, 0.01, 0.01).replan   # = limit
    assert not decide_replan(0.03, 0.01, old, old, model, costs).replan


def test_choose_horizon_trades_padding_for_fewer_recompiles():
    # 10 ms/step for 200 steps vs 11 ms/step for 800 steps, recompile 1.2 s:
    # 0.010 + 1.2/200 = 0.016  >  0.011 + 1.2/800 = 0.0125
    assert choose_horizon([0.010, 0.011], [0.0, 0.0], [200, 800], 1.2) == 1
    assert choose_horizon([0.010, 0.011], [0.0, 0.0], [200, 800], 0.0) == 0


# ---------------------------------------------------------------- bad inputs
def test_bad_traces_raise_value_errors_naming_the_problem(small_trace):
    with pytest.raises(ValueError, match="16 source ranks but cluster 'ascend910b-1x8' has 8"):
        replay(small_trace, "switch-cf1.25", get_cluster("ascend910b-1x8"))
    counts = np.ones((3, 1, 2, 4), dtype=np.int64)
    counts[1, 0, 1, 2] = -5
    with pytest.raises(ValueError, match=r"must be >= 0, but got -5 at .* \[1, 0, 1, 2\]"):
        RoutingTrace(counts=counts)
    with pytest.raises(ValueError, match="4-D"):
        RoutingTrace(counts=np.ones((3, 2, 4)))
    with pytest.raises(ValueError, match="negative"):
        split_tokens(ExpertPlan([0], [0], [4]), [[-1]], [0])
    with pytest.raises(ValueError, match="method must be one of"):
        replay(small_trace, "round-robin", CLUSTER_2x8)
    with pytest.raises(ValueError, match="slots_per_device"):
        plan_layer(np.ones((2, 8)), model_for(get_cluster("ascend910b-1x8")),
                   PlacementConfig(slots_per_device=0))


# ---------------------------------------------------------------- bench
def test_bench_rows_follow_the_issue_format_and_plan_trace_writes_plans(small_trace, tmp_path):
    rows = run_simulated([("small.npz", small_trace)], CLUSTER_2x8, quick=True,
                         methods=("efficientmoe", "switch-cf1.25"),
                         config=ReplayConfig(warmup=12))
    timed = [r for r in rows if "iteration_time_s" in r]
    assert {r["method"] for r in timed} == {"efficientmoe", "switch-cf1.25"}
    for r in timed:
        assert r["evidence"] == "simulated" and r["workload"] == "small.npz"
        for key in ("iteration_time_s", "a2a_time_s", "max_over_mean_load",
                    "padding_fraction", "drop_rate"):
            assert isinstance(r[key], float) and math.isfinite(r[key])
    assert {r["method"] for r in rows if "mape" in r} == {"last-value", "ema", "ar-ridge"}
    table = markdown_table(rows)
    assert "| small.npz | efficientmoe |" in table and "1.00x" in table
    assert set(speedups(rows)["small.npz"]) == {"switch-cf1.25"}
    plans = plan_trace(small_trace, CLUSTER_2x8, ReplayConfig(warmup=12))
    assert len(plans) == 1
    plans[0].validate(16, 16)
    save_plans(str(tmp_path / "p.yaml"), plans, 16)


def test_a_fast_level_time_adds_exactly_its_layers_to_the_rows_that_run_one():
    """ReplayConfig.fast_level_s (bench moe --fast-level-ms) charges every layer of every
    step of a two-level row once, changes no decision (it is a constant of every step), and
    leaves EPLB's even split untouched."""
    from ms_efficient.efficientmoe.cost import DYNAMIC_EXCHANGE_S

    trace = synthetic_trace(steps=20, layers=2, ranks=16, experts=16, hidden=1024,
                            tokens_per_rank=2048, step_stride=50, seed=1)
    base, timed = (ReplayConfig(warmup=12, fast_level_s=0.0),
                   ReplayConfig(warmup=12, fast_level_s=1e-3))
    for method, charged in (("efficientmoe", True), ("moonep", True),
                            ("eplb-alltoallv", False)):
        a = replay(trace, method, CLUSTER_2x8, base)
        b = replay(trace, method, CLUSTER_2x8, timed)
        added = trace.num_layers * 1e-3 if charged else 0.0
        assert b.iteration_time_s - a.iteration_time_s == pytest.approx(added, abs=1e-12)
        assert (b.replans, b.drop_rate) == (a.replans, a.drop_rate)
        # the row says what it was charged: every two-level layer dispatches count-driven
        assert b.extra["fast_level_s"] == (1e-3 if charged else 0.0)
        assert b.extra["dynamic_exchange_s"] == DYNAMIC_EXCHANGE_S


def test_hindsight_capacities_hand_case_and_brute_force_optimum():
    import itertools

    from ms_efficient.efficientmoe.capacity import hindsight_capacities, static_capacity_limit

    loads = np.array([[10, 20], [10, 20], [10, 20], [30, 20]], dtype=float)   # [T, E]
    none = hindsight_capacities(loads, 0.0)
    assert none.capacity_S.tolist() == [30, 20] and none.expected_drop_rate == 0.0
    assert none.expected_padding_fraction == pytest.approx(60 / 200)   # 3 x 20 empty of 4 x 50
    # 20 of 140 tokens may drop: cutting expert 0 from 30 to 10 costs exactly those 20
    cut = hindsight_capacities(loads, 20 / 140)
    assert cut.capacity_S.tolist() == [10, 20] and cut.expected_padding_fraction == 0.0
    rng = np.random.default_rng(3)
    for _ in range(5):
        small = rng.integers(0, 9, size=(5, 3)).astype(float)
        target = 0.1
        got = hindsight_capacities(small, target)
        assert got.expected_drop_rate <= target + 1e-12
        best = min(sum(c) for c in itertools.product(range(9), repeat=3)
                   if np.maximum(small - np.array(c), 0).sum() <= target * small.sum())
        assert best <= got.capacity_S.sum() <= best + 2      # continuous optimum, rounded up
    # re-planned every step, hindsight capacities fit every load: no padding, no drop
    pad, drop = static_capacity_limit(loads[:, None, :], 0.0, window=1)
    assert pad == 0.0 and drop == 0.0


def test_no_method_beats_the_lower_bound_on_random_counts():
    """``oracle-bound`` (two_level.lower_bound_step_s) is a true bound: on random routing
    (Dirichlet-skewed counts, 16 ranks x 16 experts, top-2) every default row's time of
    every step is at least the bound's for that step, and the bound is the hand figure:
    the mean rows per device x one row's time, summed over the layers."""
    from ms_efficient.efficientmoe.replay import DEFAULT_METHODS
    from ms_efficient.efficientmoe.two_level import LOWER_BOUND, lower_bound_step_s

    rng = np.random.default_rng(7)
    steps, layers, ranks, experts, tokens = 16, 2, 16, 16, 512
    probs = rng.dirichlet(np.full(experts, 0.3), size=(steps, layers, ranks))
    counts = np.stack([[[rng.multinomial(2 * tokens, p) for p in layer] for layer in step]
                       for step in probs])
    trace = RoutingTrace(counts=counts, top_k=2, hidden=1024, tokens_per_rank=tokens,
                         steps=np.arange(1, steps + 1) * 10)
    config = ReplayConfig(warmup=8)
    bound = replay(trace, LOWER_BOUND, CLUSTER_2x8, config)
    model = CostModel(CLUSTER_2x8, 1024, 4096, "bf16")
    assert bound.step_time_s[0] == pytest.approx(
        layers * (2 * tokens * ranks / ranks) * model.row_time_s, rel=1e-12)
    assert lower_bound_step_s(counts[8], model) == pytest.approx(bound.step_time_s[0])
    for method in DEFAULT_METHODS:
        if method == LOWER_BOUND:
            continue
        got = replay(trace, method, CLUSTER_2x8, config)
        assert (got.step_time_s >= bound.step_time_s).all(), method
        assert got.iteration_time_s >= bound.iteration_time_s, method


def test_fastermoe_without_a_shadow_is_the_dropless_row_and_a_shadow_moves_only_its_rows():
    """Equivalences of the shared replay: on even routing no shadow pays its broadcast, so
    FasterMoE's row is the dropless row exactly; on a hot expert, shadowing it leaves every
    other expert's rows where dropless computes them."""
    trace = demo_shaped_trace(np.full((4, 8), 128))
    config = ReplayConfig(warmup=8)
    faster = replay(trace, "fastermoe", NODE_1x8, config)
    dropless = replay(trace, "dropless", NODE_1x8, config)
    np.testing.assert_array_equal(faster.step_time_s, dropless.step_time_s)
    assert faster.extra["copies_per_step"] == 0.0
    model = CostModel(get_cluster("ascend910b-1x8"), hidden=64, ffn_hidden=256)
    counts = np.full((1, 4, 8), 50)
    counts[0, :, 5] = 5000
    home = uniform_home(1, 8, 4)
    bcast = model.cluster.collective_time_s("broadcast", model.copy_bytes, list(range(4)))
    shadowed, k = baselines.fastermoe_balance(counts, home, _plain_cost(model), bcast, 8)
    plain = balance_step(counts, home, np.zeros(4, dtype=np.int64), None, even_split=True,
                         devices_per_node=8)
    assert k.tolist() == [1] and shadowed.rows_LEW[0, 5].tolist() == [5000] * 4
    others = np.arange(8) != 5
    np.testing.assert_array_equal(shadowed.rows_LEW[0, others], plain.rows_LEW[0, others])
