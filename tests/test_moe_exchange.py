"""The one-level plans' token exchange as the cost model charges it (one function,
moe.exchange.exchange_rows), and planned send blocks bound it (numpy)."""
import numpy as np
import pytest

from ms_efficient.core.cluster import get_cluster
from ms_efficient.efficientmoe.cost import CostModel, layer_cost, uneven_alltoall_time_s
from ms_efficient.efficientmoe.replay import ReplayConfig, plan_trace
from ms_efficient.moe.exchange import exchange_rows
from ms_efficient.moe.plan import ExpertPlan
from ms_efficient.moe.split import grouped_assignments
from ms_efficient.moe.trace import RoutingTrace

NODE_1x8 = get_cluster("ascend910b-1x8")
E, H, F, K = 4, 16, 32, 2


def test_a_plan_without_send_blocks_sends_every_peer_the_whole_buffer():
    """The finding that opened the issue: buffers [4096, 2048, 4096, 4096] on 4 ranks, each
    rank routing 1024 assignments, made every rank send 14,336 rows per exchange."""
    plan = ExpertPlan(list(range(8)), [0, 0, 1, 1, 2, 2, 3, 3], [1] * 8, dispatch="grouped",
                      device_buffer=[4096, 2048, 4096, 4096])
    rows_RD = exchange_rows(plan, 8, np.arange(4), 4)
    assert rows_RD.sum(axis=1).tolist() == [14336] * 4
    blocks = ExpertPlan(list(range(8)), [0, 0, 1, 1, 2, 2, 3, 3], [1] * 8, dispatch="grouped",
                        send_block=np.full((4, 4), 256))
    assert exchange_rows(blocks, 8, np.arange(4), 4).sum(axis=1).tolist() == [1024] * 4
    assert blocks.device_rows(4).tolist() == [1024] * 4          # buffers = column sums


def test_the_cost_model_charges_the_planned_blocks_full_or_empty():
    """Blocks of 300 rows to every peer while only 128 are routed: the All-to-All is charged
    300 rows a message (padding travels), the compute only the 128 x 2 kept rows."""
    plan = ExpertPlan(list(range(8)), [0, 0, 1, 1, 2, 2, 3, 3], [1] * 8, dispatch="grouped",
                      send_block=np.full((4, 4), 300))
    counts = np.full((4, 8), 64)                  # 128 rows from every rank to every device
    model = CostModel(NODE_1x8, 256, 1024)
    cost = layer_cost(plan, counts, model, np.arange(4))
    sent_DD = np.zeros((8, 8))
    sent_DD[:4, :4] = 300
    expected = model.a2a_passes * uneven_alltoall_time_s(sent_DD * 512, NODE_1x8)
    assert cost.a2a_time_s == pytest.approx(expected) and cost.dropped == 0
    assert cost.rows_D[:4].tolist() == [512.0] * 4                 # 4 x 128, whole tiles


def test_a_block_that_overflows_drops_only_that_pairs_tail():
    """Rank 0 routes 5 rows to device 1 (experts 2, 3) with a block of 3: 2 drop there; its
    block of 10 to device 0 holds all 8 rows it routes to device 0."""
    plan = ExpertPlan([0, 1, 2, 3], [0, 0, 1, 1], [1] * 4, dispatch="grouped",
                      send_block=[[10, 3], [9, 9]])
    counts = np.array([[4, 4, 2, 3], [1, 1, 1, 1]])
    assigned_RS, dropped = grouped_assignments(plan, counts, [0, 1])
    assert dropped == 2
    assert assigned_RS.tolist() == [[4, 4, 2, 1], [1, 1, 1, 1]]   # slots ascending in a block


def test_a_steady_trace_is_planned_blocks_of_exactly_the_routed_rows():
    """Every rank sends 128 of its 1024 assignments to every expert, every step: the
    forecast is exact, so every (rank, device) block holds exactly the 256 rows routed
    there and each rank sends 1024 rows per exchange, no padding."""
    counts = np.full((24, 1, 4, 8), 128)
    trace = RoutingTrace(counts=counts, top_k=2, hidden=256, tokens_per_rank=512,
                         steps=np.arange(1, 25))
    plan = plan_trace(trace, NODE_1x8, ReplayConfig(warmup=8))[0]
    rows_RD = exchange_rows(plan, 8, np.arange(4), 8)
    assert rows_RD[:, :4].tolist() == [[256] * 4] * 4 and not rows_RD[:, 4:].any()


def weights(seed=5):
    rng = np.random.default_rng(seed)
    return (rng.normal(0, 0.3, (E, H)).astype(np.float32),
            rng.normal(0, 0.3, (E, H, F)).astype(np.float32),
            rng.normal(0, 0.1, (E, 1, F)).astype(np.float32),
            rng.normal(0, 0.3, (E, F, H)).astype(np.float32),
            rng.normal(0, 0.1, (E, 1, H)).astype(np.float32))


def test_bad_send_blocks_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="'send_block' must be a non-empty"):
        ExpertPlan([0], [0], [1], dispatch="grouped", send_block=[[-1]])
    with pytest.raises(ValueError, match=r"'send_block' must be \[2 ranks"):
        ExpertPlan([0, 1], [0, 1], [1, 1], dispatch="grouped",
                   send_block=[[1, 1]]).send_rows(2)
