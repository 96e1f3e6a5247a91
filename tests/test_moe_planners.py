"""EfficientMoE's simulated side: the expert plan format, the cost model, the baseline rows
and the trace replay. Values are hand-computed or known optima."""
import math

import numpy as np
import pytest

from ms_efficient.core.cluster import get_cluster
from ms_efficient.efficientmoe import baselines
from ms_efficient.efficientmoe.balanced_cost import balanced_cost
from ms_efficient.efficientmoe.bench import _truncate, markdown_table, run_simulated, speedups
from ms_efficient.efficientmoe.cost import DYNAMIC_EXCHANGE_S, CostModel, uneven_alltoall_time_s
from ms_efficient.efficientmoe.planner import uniform_home
from ms_efficient.efficientmoe.replay import ReplayConfig, cluster_for_ranks, replay
from ms_efficient.moe.balance import balance_step
from ms_efficient.moe.plan import ExpertPlan
from ms_efficient.moe.split import switch_capacity
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


def test_a_plan_round_trips_and_a_retired_one_level_plan_reads_as_its_slots():
    plan = ExpertPlan([0, 0, 1, 2, 3], [0, 1, 1, 2, 3], [64, 64, 48, 32, 16],
                      method="efficientmoe", dispatch="grouped")
    assert ExpertPlan.from_dict(plan.to_dict()).to_dict() == plan.to_dict()
    assert plan.replica_counts(5).tolist() == [2, 1, 1, 1, 0]
    # a state.json plan of the retired one-level planner: its blocks and forecasts dropped
    old = {**plan.to_dict(), "send_block": [[1, 2], [3, 4]], "top_k": 2, "tokens_per_step": 9,
           "rank_share": [[1.0]], "drop_target": 0.01}
    assert ExpertPlan.from_dict(old).to_dict() == plan.to_dict()
    with pytest.raises(ValueError, match=r"unknown keys \['bogus'\]"):
        ExpertPlan.from_dict({**plan.to_dict(), "bogus": 1})


# ---------------------------------------------------------------- cost model and baselines
def test_uneven_alltoall_of_equal_messages_is_the_collective_formula():
    cluster = cluster_for_ranks(16)
    nbytes = 16e6
    equal = np.full((16, 16), nbytes / 16)
    expected = cluster.collective_time_s("alltoall", nbytes, list(range(16)))
    assert uneven_alltoall_time_s(equal, cluster) == pytest.approx(expected)


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
    with pytest.raises(ValueError, match="method must be one of"):
        replay(small_trace, "round-robin", CLUSTER_2x8)
    with pytest.raises(ValueError, match="slots_per_device"):
        replay(small_trace, "efficientmoe", CLUSTER_2x8,
               ReplayConfig(warmup=12, slots_per_device=0))


# ---------------------------------------------------------------- bench
def test_bench_rows_follow_the_issue_format(small_trace):
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
    limits = [r for r in rows if r["method"] == "static-limit"]
    assert limits and all(r["drop_rate"] <= 0.005 + 1e-12 for r in limits)
    table = markdown_table(rows)
    assert "| small.npz | efficientmoe |" in table and "1.00x" in table
    assert set(speedups(rows)["small.npz"]) == {"switch-cf1.25"}


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
