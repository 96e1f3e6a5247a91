"""The balanced expert-parallel layer (EfficientMoE's fast level in the graph): one process
here (W = 1); the 2- and 4-worker runs with per-step copies are in test_balanced_ep_workers."""
import numpy as np
import pytest

import mindspore as ms
from mindspore import Tensor

import workers
from conftest import assert_within_float32_bound
from moe_reference import (E, F, H, K, T, WeightedOutput, batch, dense_layer, grads,
                           moe_float32_bounds, reference, reference_bounds, weights)
from ms_efficient.efficientmoe.planner import home_move_bytes_WW
from ms_efficient.moe.balance import balance_step, home_plan
from ms_efficient.moe.balanced_ep import BalancedExpertParallelMoE, fast_level_tables

ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")


def balanced(w, home=((0, 1, 2, 3),), spare=1, buffer=(K * T,)):
    layer = BalancedExpertParallelMoE(H, F, E, K, np.array(home), spare, np.array(buffer))
    layer.set_weights(*w)
    return layer


def test_with_room_for_every_row_one_rank_equals_moe_feedforward():
    w = weights()
    x, dy = batch()
    layer = balanced(w)
    y, aux, counts, dropped = layer(x)
    stats = layer.balance_stats
    (y_ref, aux_ref, counts_ref, dropped_ref), (dx_ref, g_ref) = reference()   # dense_layer(w)
    # y: the balanced layer's cblas_sgemm grouped matmuls against the dense layer's
    # BatchMatMul: other kernels, other summation orders of x W1 (H terms) and h W2 (F
    # terms), within their chained float32 bound (moe_reference.moe_float32_bounds);
    # routing, aux loss, counts and drops are the same code: bit-exact
    bounds = reference_bounds()
    assert_within_float32_bound(y.asnumpy(), y_ref, bounds["y"], "balanced vs dense: y")
    np.testing.assert_array_equal(aux.asnumpy(), aux_ref)
    np.testing.assert_array_equal(counts.asnumpy(), counts_ref)
    assert int(dropped.asnumpy()) == 0 and stats.asnumpy().tolist()[:3] == [0, 0, K * T]
    dx, g = grads(layer, x, dy)
    # the backward's grouped products (dx, weight gradients) against BatchMatMul's: as y
    assert_within_float32_bound(dx, dx_ref, bounds["dx"], "balanced vs dense: dx")
    for name in g:
        assert_within_float32_bound(g[name], g_ref[name], bounds[name],
                                    f"balanced vs dense: {name}")


def test_replica_sync_reduces_only_experts_replicated_across_ranks():
    """The tables of ReplicaGradSum for one rank's home slots (a home table as a plan)."""
    from ms_efficient.moe.ep_routing import replica_sync
    from ms_efficient.moe.plan import ExpertPlan

    plan = ExpertPlan([0, 1, 0, 2, 3, 3], [0, 0, 1, 1, 1, 1], [4] * 6)
    r1 = replica_sync(plan, 1)                                  # rows: experts 0, 2, 3, 3
    assert r1.needed and r1.cross_experts.tolist() == [0] and r1.num_cross == 1
    assert r1.first_L.tolist() == [0, 1, 2, 2]                  # expert 3 summed at row 2
    assert r1.cross_L.tolist() == [0, 1, 1, 1]                  # only expert 0 is AllReduced
    assert r1.pick_L.tolist() == [0, 2, 3, 3]                   # expert 0 from the AllReduce
    assert not replica_sync(ExpertPlan([0, 1, 2, 3], [0, 0, 1, 1], [4] * 4), 0).needed
    # a budget of 3 rows and a cross table of 2: the empty row keeps its own (zero) gradient
    r0 = replica_sync(plan, 0, budget=3, num_cross=2)
    assert r0.first_L.tolist() == [0, 1, 2] and r0.pick_L.tolist() == [0, 3, 4]


def test_replicas_start_identical_from_the_logical_expert_seed():
    """An expert's initial weights depend on its logical id and the seed only, so every home
    slot of a replicated expert, on any rank, starts as the one-process expert."""
    from ms_efficient.moe.ep_routing import init_expert_weights

    _, w1_all, _, w2_all, _ = init_expert_weights(E, H, F, seed=9)
    _, w1, _, w2, _ = init_expert_weights(E, H, F, seed=9, experts=[2, 0, 2])
    np.testing.assert_array_equal(w1, w1_all[[2, 0, 2]])
    np.testing.assert_array_equal(w2, w2_all[[2, 0, 2]])
    assert np.abs(w1_all[0] - w1_all[1]).max() > 0


def test_a_small_buffer_drops_what_the_numpy_fast_level_drops():
    w = weights()
    x, _ = batch()
    layer = balanced(w, buffer=(20,))
    y, _, counts, dropped = layer(x)
    stats = layer.balance_stats
    counts_WE = counts.asnumpy().sum(axis=0, keepdims=True)
    bal = balance_step(counts_WE[None], np.array([[[0, 1, 2, 3]]]), np.ones(1, int),
                       np.array([[20]]))
    assert int(dropped.asnumpy()) == int(bal.dropped_L[0]) == K * T - 20
    assert stats.asnumpy().tolist() == [0, K * T - 20, 20, 20]


def test_fast_level_tables_name_every_slot_and_copy_source():
    # expert 0 hot on 2 devices: device 1's spare slot takes a copy of 0 from device 0
    counts = np.array([[50, 10, 0, 0], [50, 10, 0, 0]])
    sent, slot, spare, source, home_slot, stats = fast_level_tables(
        counts, np.array([[0, 2], [1, 3]]), 1, np.array([100, 100]))
    assert spare.tolist() == [[-1], [0]] and source.tolist() == [[-1], [0]]
    assert slot[0].tolist() == [0, 2] and slot[1].tolist() == [-1, 0]
    assert home_slot.tolist() == [[0, -1, 1, -1], [-1, 0, -1, 1]]
    assert (sent.sum(axis=(0, 2)) == counts.sum(axis=0)).all()
    assert stats.tolist() == [1, 0, 120, 60, 60]
    # what the layer's exchange sends per pair is what the simulator charges
    simulated = balance_step(counts[None], np.array([[[0, 2], [1, 3]]]), np.ones(2, int),
                             np.array([[100, 100]]))
    assert sent.sum(axis=1).tolist() == simulated.sent_LRW[0].tolist()
    assert simulated.copies_LWW[0].tolist() == [[0, 1], [0, 0]]


def test_a_home_table_missing_an_expert_is_refused():
    with pytest.raises(ValueError, match=r"experts \[3\] have none"):
        home_plan(np.array([[0, 1, 2, -1]]), 4)


@workers.in_background("balanced_layer_runs")
def _balanced_layer_runs():
    """tests/dist/check_balanced_ep.py on 4 msrun workers (child processes, from the
    session's start: tests/workers.py): its results' folder."""
    if workers.MSRUN is None:
        return None
    return workers.run("check_balanced_ep", 4)


@pytest.fixture(scope="module")
def balanced_layer_runs(dist_checks):
    """{world: the folder of check_balanced_ep's results}: 2 workers in the session's job of
    the 2-worker checks, 4 in a job of its own."""
    if workers.MSRUN is None:
        pytest.skip("msrun is not on PATH")
    return {2: dist_checks / "check_balanced_ep",
            4: workers.background_result("balanced_layer_runs")}


@pytest.mark.slow
@workers.needs_msrun
@pytest.mark.parametrize("world", [2, 4])
def test_w_workers_with_per_step_copies_equal_one_process(balanced_layer_runs, world):
    """Expert 0 is every token's first choice: the fast level copies it into spare slots
    every step (asserted), yet every rank's outputs and input gradients, the router gradient
    summed over ranks and every home expert's gradient (its own rows plus the gradients its
    copies sent back) equal MoEFeedForward on the whole batch, and after 3 Adam steps every
    home slot's weights equal the one-process run's, although the home experts were re-placed
    after the first step (weights and Adam moments moved across ranks). The buffers never
    change shape. The 2-worker run's fast level is the numpy function as a host op, the
    4-worker run's its MindSpore-ops twin."""
    wk = workers.load_script("check_balanced_ep")
    assert (wk.E, wk.H, wk.F, wk.K) == (E, H, F, K)       # moe_reference's sizes
    ref = dense_layer(wk.logical_weights(), capacity=world * wk.T_LOCAL, trace_ranks=world)
    params = [ref.router.weight, ref.w1, ref.b1, ref.w2, ref.b2]

    def weighted(x, dy):
        y, _, counts, _ = ref(x)
        return (y * dy).sum(), y, counts

    x_np, dy_np = wk.global_batch(world)
    (_, y_ref, counts_ref), (dx_ref, g_ref) = ms.value_and_grad(
        weighted, grad_position=0, weights=params, has_aux=True)(Tensor(x_np), Tensor(dy_np))
    g_ref = dict(zip(wk.PARAM_NAMES, (g.asnumpy() for g in g_ref)))

    class Loss(ms.nn.Cell):
        def __init__(self, layer):
            super().__init__()
            self.layer = layer

        def construct(self, x, dy):
            return (self.layer(x)[0] * dy).sum()

    step = ms.nn.TrainOneStepCell(Loss(ref), ms.nn.Adam(params, learning_rate=wk.LR))
    for i in range(wk.TRAIN_STEPS):
        step(*(Tensor(a) for a in wk.global_batch(world, i)))
    trained_ref = {name: p.asnumpy() for name, p in zip(wk.PARAM_NAMES, params)}

    res = [np.load(balanced_layer_runs[world] / f"rank{r}.npz") for r in range(world)]
    # each rank's grouped products on its own rows and copies, gradients summed over ranks
    # and sent back from the copies: other kernels and summation orders than the
    # one-process BatchMatMul reference, held to their chained float32 bound
    # (moe_reference.moe_float32_bounds on the whole batch); counts and drops stay exact
    bounds = moe_float32_bounds(wk.logical_weights(), x_np, dy_np, top_k=wk.K,
                                router_differs=True)
    home, after = wk.home_table(world), wk.home_after(world)
    # the re-plan moved every slot across ranks, as the simulator charges it
    slots = home.size
    charged = home_move_bytes_WW(home[None], after[None], 1.0)
    for r in res:
        assert r["home_after"].tolist() == after.tolist()
        moved_slots, sent_rows, moved_bytes, row_bytes = r["migration"]
        assert moved_slots == sent_rows == slots == charged.sum()
        assert moved_bytes == slots * row_bytes * 3                 # weights + 2 Adam moments
    assert all(str(r["fast_level"]) == wk.FAST_LEVEL[world] for r in res)
    assert all(int(r["stats"][0]) > 0 for r in res)                   # copies were made
    assert all(int(r[f"stats_{i}"][0]) > 0 for r in res for i in range(1, wk.TRAIN_STEPS))
    assert all(r["buffer_rows"].tolist() == [wk.buffers(world)[0]] * wk.TRAIN_STEPS
               for r in res)
    assert_within_float32_bound(sum(r["grad_router"] for r in res), g_ref["router"],
                                bounds["router"], f"{world} ranks: router")
    for rank, got in enumerate(res):
        rows = slice(rank * wk.B, (rank + 1) * wk.B)
        assert_within_float32_bound(got["y"], y_ref.asnumpy()[rows], bounds["y"][rows],
                                    f"{world} ranks: y")
        assert_within_float32_bound(got["dx"], dx_ref.asnumpy()[rows], bounds["dx"][rows],
                                    f"{world} ranks: dx")
        assert got["counts"].tolist() == [counts_ref.asnumpy()[rank].tolist()]
        assert int(got["dropped"]) == 0
        for name in ("w1", "b1", "w2", "b2"):
            assert_within_float32_bound(got[f"grad_{name}"], g_ref[name][home[rank]],
                                        bounds[name][home[rank]], f"{world} ranks: {name}")
            np.testing.assert_allclose(got[f"trained_{name}"], trained_ref[name][after[rank]],
                                       rtol=1e-4, atol=1e-5, err_msg=f"{world} {name}")


@pytest.mark.slow
@workers.needs_msrun
@pytest.mark.parametrize("world", [2, 4])
def test_the_bytes_each_rank_sends_are_what_the_simulator_charges_for_those_counts(
        balanced_layer_runs, world):
    """The traffic audit: every step of the 2- and 4-worker runs (copies made every step),
    the count operand of the layer's dispatch as it ran (``exchange_rows``: rows of H
    float32 values each rank sent each device, tokens and expert copies) against the
    simulator's charge for the step's routing counts (``balance_step`` on the counts all
    ranks routed, with the layer's home table, spare slot and buffers, then
    ``dispatch_bytes_LWW``), exactly, per (rank, device) pair; the copies' part is
    ``copy_bytes`` per copy made (only those: no dense exchange of spare slots), and the
    combine's operand is the token part."""
    from ms_efficient.core.cluster import get_cluster
    from ms_efficient.efficientmoe.balanced_cost import dispatch_bytes_LWW
    from ms_efficient.efficientmoe.cost import CostModel

    wk = workers.load_script("check_balanced_ep")
    res = [np.load(balanced_layer_runs[world] / f"rank{r}.npz") for r in range(world)]
    model = CostModel(get_cluster("ascend910b-1x8"), wk.H, wk.F, "fp32")
    row_bytes = wk.H * 4
    homes = [wk.home_table(world)] + [wk.home_after(world)] * (wk.TRAIN_STEPS - 1)
    for step in range(wk.TRAIN_STEPS):
        counts = np.concatenate([r["counts" if step == 0 else f"counts_{step}"]
                                 for r in res])                                  # [W, E]
        bal = balance_step(counts[None], homes[step][None], np.full(world, wk.SPARE),
                           wk.buffers(world)[None], by_expert=True)    # as fast_level_tables
        charged = dispatch_bytes_LWW(bal, model)[0]
        assert bal.copies_L[0] > 0
        for rank, got in enumerate(res):
            sent, tokens = got[f"exchange_{step}"].astype(np.int64)
            assert np.array_equal(sent * row_bytes, charged), (world, step, rank)
            assert np.array_equal(tokens * row_bytes,
                                  bal.sent_LRW[0] * model.bytes_per_token)
            # the copies' rows: copy_bytes per copy made, from its source to its device
            assert np.array_equal((sent - tokens) * row_bytes,
                                  bal.copies_LWW[0] * model.copy_bytes)
            assert int((sent - tokens).sum()) * row_bytes == \
                int(got["stats" if step == 0 else f"stats_{step}"][0]) * model.copy_bytes


@pytest.mark.slow
@workers.needs_msrun
@pytest.mark.parametrize("world", [2, 4])
def test_the_compiled_train_step_holds_only_the_exchanges_the_simulator_charges(
        balanced_layer_runs, world):
    """The traffic audit read from MindSpore's compiled graph: every rank's train step of the
    2- and 4-worker runs, recorded by the verification pass at its compile (every primitive
    with its operands' inferred shapes and types), holds exactly these collectives, in graph
    order, all on the world group: the AllGather of the E int32 routing counts, the four
    count-driven row exchanges (dispatch, combine, then in backward the combine's adjoint and
    the dispatch's), and the test's own data-parallel AllReduce of the router gradient; no
    exchange of spare slots' weights or anything else. On CPU each row exchange is emulated
    by an AllGather of its static block layout (W x the largest block; asserted); on Ascend
    it is an AlltoAllVC whose per-pair rows are the step's count operand. So: the gathered
    counts are the bytes the simulator charges for the count exchange, a row is H values of
    the graph's element type, equal to the simulator's ``bytes_per_token``, as many row
    exchanges as its ``a2a_passes``, and every step's count operands times the row bytes
    read from the graph are its charge per (rank, device) pair, exactly: the dispatch and
    the dispatch's adjoint carry the copies (``dispatch_bytes_LWW`` and its transpose), the
    combine and its adjoint the tokens alone."""
    from ms_efficient.core.cluster import get_cluster
    from ms_efficient.efficientmoe.balanced_cost import dispatch_bytes_LWW
    from ms_efficient.efficientmoe.cost import COUNT_BYTES, CostModel
    from ms_efficient.verify.record import CompiledRecord, tensor_itemsize, tensor_shape

    folder = balanced_layer_runs[world]
    if not (folder / "record0.json").is_file():
        pytest.skip("the verification pass could not be built here (it needs g++ and "
                    "MindSpore's headers), so no compiled graph was recorded")
    wk = workers.load_script("check_balanced_ep")
    model = CostModel(get_cluster("ascend910b-1x8"), wk.H, wk.F, "fp32")
    homes = [wk.home_table(world)] + [wk.home_after(world)] * (wk.TRAIN_STEPS - 1)
    for rank in range(world):
        got = np.load(folder / f"rank{rank}.npz")
        found = CompiledRecord.from_file(str(folder / f"record{rank}.json")).collectives()
        assert [n.op for n in found] == ["AllGather"] * 5 + ["AllReduce"], \
            [(n.op, n.inputs) for n in found]
        groups = {n.prim_attrs.get("group") for n in found}
        assert len(groups) == 1 and "world_group" in groups.pop()
        count, rows, router = found[0], found[1:5], found[5]
        assert tensor_shape(count.inputs[0][0]) == (1, wk.E)
        assert tensor_shape(count.output[0]) == (world, wk.E)
        assert count.operand_bytes() == wk.E * COUNT_BYTES      # W x this: the charge
        assert tensor_shape(router.inputs[0][0]) == (wk.E, wk.H)
        assert len(rows) == model.a2a_passes
        row_bytes = set()
        for node, padded in zip(rows, got["gather_rows"]):
            shape, size = tensor_shape(node.inputs[0][0]), tensor_itemsize(node.inputs[0][1])
            assert shape == (int(padded), wk.H), (node.inputs, padded)
            row_bytes.add(shape[1] * size)
        assert row_bytes == {model.bytes_per_token}
        row_bytes = row_bytes.pop()
        for step in range(wk.TRAIN_STEPS):
            counts = np.concatenate([np.load(folder / f"rank{r}.npz")[
                "counts" if step == 0 else f"counts_{step}"] for r in range(world)])
            bal = balance_step(counts[None], homes[step][None], np.full(world, wk.SPARE),
                               wk.buffers(world)[None], by_expert=True)
            dispatch = dispatch_bytes_LWW(bal, model)[0]
            tokens = bal.sent_LRW[0] * model.bytes_per_token
            sent, token_rows = got[f"exchange_{step}"].astype(np.int64)
            operands = (sent, token_rows.T, token_rows, sent.T)
            charged = (dispatch, tokens.T, tokens, dispatch.T)
            for operand, charge, padded in zip(operands, charged, got["gather_rows"]):
                assert np.array_equal(operand * row_bytes, charge), (world, step, rank)
                assert operand.max() <= padded // world       # fits the compiled blocks
            assert bal.copies_L[0] > 0


def test_the_layer_builds_the_replica_table_the_simulator_charges(monkeypatch):
    """A balanced layer of 2 ranks (the group faked: nothing is sent while it is built)
    all-reduces a table of ReplicaGradSum.num_cross expert rows each step; the simulator
    charges an all-reduce of as many rows of CostModel.grad_bytes (the weights w1, w2 of one
    expert; biases left out), with the layout's rows or by default the shapes' bound, and
    a re-plan that replicates more experts than the table holds is refused."""
    from ms_efficient.core import backend
    from ms_efficient.core.cluster import get_cluster
    from ms_efficient.core.collectives import allreduce_time_s
    from ms_efficient.efficientmoe.balanced_cost import home_sync_time_L
    from ms_efficient.efficientmoe.cost import CostModel

    monkeypatch.setattr(backend, "group_size", lambda *a, **k: 2)
    monkeypatch.setattr(backend, "group_rank", lambda *a, **k: 0)
    cluster = get_cluster("ascend910b-1x8")
    model = CostModel(cluster, H, F, "fp32")
    home = np.array([[0, 1, 2], [0, 3, -1]])             # E = 4, S_h = 3: expert 0 on both
    for rows, built in ((None, 2), (1, 1)):             # bound min(4, 2 * 3 - 4); layout's
        layer = BalancedExpertParallelMoE(H, F, E, K, home, 1, np.array([64, 64]),
                                          sync_rows=rows)
        assert layer.sync.num_cross == built
        assert model.grad_bytes == 4 * (layer.w1[0].size + layer.w2[0].size)
        assert home_sync_time_L(home[None], E, model, rows).tolist() == \
            [allreduce_time_s(built * model.grad_bytes, 2, cluster.intra_link)]
    with pytest.raises(ValueError, match="replicates 2 experts across ranks"):
        layer.set_plan(home_plan(np.array([[0, 1, 2], [0, 1, 3]]), E))


def _adam_steps(layer, steps, replan_after=None, new_home=None, move_state=True):
    """``steps`` Adam steps of sum(y * dy) on the batch of every step; with ``replan_after``,
    ``set_plan(home_plan(new_home))`` between that step and the next, with the optimizer
    (``move_state``) or without (the weights move, the moments stay in their slots)."""
    params = [layer.router.weight, layer.w1, layer.b1, layer.w2, layer.b2]

    class Loss(ms.nn.Cell):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def construct(self, x, dy):
            return (self.inner(x)[0] * dy).sum()

    optimizer = ms.nn.Adam(params, learning_rate=1e-2)
    step = ms.nn.TrainOneStepCell(Loss(layer), optimizer)
    for i in range(steps):
        step(*batch(seed=i))
        if replan_after == i:
            layer.set_plan(home_plan(np.array(new_home), E), optimizer if move_state else None)
    return layer


def test_set_plan_moves_weights_and_adam_moments_so_training_continues_exactly():
    """One rank, 4 home slots: the home table is permuted after the first of 3 Adam steps
    (every slot gets another slot's expert, a local copy each): every expert's weights
    after the 3 steps equal those of the run that kept its table, which needs its Adam
    moments to have moved with it; the one-rank migration sends nothing."""
    w = weights()
    kept = _adam_steps(balanced(w, home=((0, 1, 2, 3),), buffer=(K * T,)), 3)
    moved = _adam_steps(balanced(w, home=((0, 1, 2, 3),), buffer=(K * T,)), 3,
                        replan_after=0, new_home=((2, 3, 0, 1),))
    assert moved.home_table.asnumpy().tolist() == [[2, 3, 0, 1]]
    assert moved.last_migration.moved_slots == 4 and moved.last_migration.sent_rows == 0
    for name in ("w1", "b1", "w2", "b2"):
        np.testing.assert_allclose(getattr(moved, name).asnumpy(),
                                   getattr(kept, name).asnumpy()[[2, 3, 0, 1]],
                                   rtol=1e-6, atol=1e-7, err_msg=name)
    # without the optimizer's moments the continued training differs (the check can fail)
    stale = _adam_steps(balanced(w, home=((0, 1, 2, 3),), buffer=(K * T,)), 3,
                        replan_after=0, new_home=((2, 3, 0, 1),), move_state=False)
    assert not np.allclose(stale.w1.asnumpy(), moved.w1.asnumpy(), rtol=1e-4, atol=1e-6)


def test_set_plan_refuses_a_table_that_drops_an_expert_or_overfills_a_device():
    from ms_efficient.moe.plan import ExpertPlan

    layer = balanced(weights(), home=((0, 1, 2, 3),))
    no_three = ExpertPlan(np.array([0, 1, 2, 2]), np.zeros(4, np.int64), np.zeros(4, np.int64),
                          dispatch="grouped")
    with pytest.raises(ValueError, match=r"experts \[3\] have none"):
        layer.set_plan(no_three)
    with pytest.raises(ValueError, match="'budget'"):
        layer.set_plan(home_plan(np.array([[0, 1, 2, 3, 0]]), E))
    assert layer.home_table.asnumpy().tolist() == [[0, 1, 2, 3]]       # nothing half-done


def _gated_pair(seed=3):
    """The balanced layer (W = 1, one spare slot) and the one-process grouped layer, both
    gated (SwiGLU) without biases, with a sigmoid-gated shared expert and DeepSeek-V3's router
    (sigmoid scores, group-limited top-2, scaling 2.5, the auxiliary-loss-free bias), holding
    the same weights."""
    from ms_efficient.moe.experts import SharedExpert
    from ms_efficient.moe.layer import MoEFeedForward
    from ms_efficient.moe.routing import RouterConfig

    config = RouterConfig(score="sigmoid", scaling_factor=2.5, num_groups=2, topk_groups=1,
                          bias_update_speed=0.01)
    rng = np.random.default_rng(seed)
    layers = []
    for _ in range(2):
        ms.set_seed(seed)
        shared = SharedExpert(H, F, kind="glu", gated=True, init_std=0.3)
        layers.append(shared)
    one = MoEFeedForward(H, F, E, K, T, dispatch="grouped", expert_kind="glu",
                         has_bias=False, shared=layers[0], router_config=config)
    bal = BalancedExpertParallelMoE(H, F, E, K, np.array([[0, 1, 2, 3]]), 1,
                                    np.array([K * T]), expert_kind="glu", has_bias=False,
                                    router_config=config, shared=layers[1])
    router = rng.normal(0, 0.3, (E, H)).astype(np.float32)
    w1 = rng.normal(0, 0.3, (E, H, 2 * F)).astype(np.float32)
    w2 = rng.normal(0, 0.3, (E, F, H)).astype(np.float32)
    bias = np.array([0.05, -0.05, 0.0, 0.02], np.float32)
    one.router.weight.set_data(Tensor(router))
    one.w1.set_data(Tensor(w1))
    one.w2.set_data(Tensor(w2))
    bal.set_weights(router, w1, w2)
    for layer in (one, bal):
        layer.expert_bias.set_data(Tensor(bias))
    for a, b in zip(layers[0].get_parameters(), layers[1].get_parameters()):
        b.set_data(Tensor(a.asnumpy()))
    return one, bal


def test_gated_experts_shared_expert_and_sigmoid_router_at_one_rank_equal_the_grouped_layer():
    """Gated experts without biases, a gated shared expert and the bias-balanced sigmoid
    router in the balanced layer (W = 1) compute the one-process grouped layer's output and
    gradients, and take the same bias update. Both run the same grouped-matmul kernel but on
    rows in other orders (slot-major vs token-major) and sum the K choices in other orders:
    products of H, 2F or F terms and a K-term sum, within a few float32 ulps of each output's
    scale (max |ref|: the terms here are O(1) and few, so 2 gamma_(2F + H) ~ 6e-6 relative)."""
    one, bal = _gated_pair()
    assert bal.expert_names == ("w1", "w2") and bal.copy_numel == H * 2 * F + F * H
    x, dy = batch()
    bias0 = bal.expert_bias.asnumpy().copy()
    for layer in (one, bal):
        layer.set_train(True)
    y1, _, c1, d1 = one(x)
    y2, _, c2, d2 = bal(x)
    np.testing.assert_array_equal(c1.asnumpy(), c2.asnumpy())
    assert int(d2.asnumpy()) == 0
    ref = y1.asnumpy()
    np.testing.assert_allclose(y2.asnumpy(), ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    # the bias moved by the sign rule on the same counts, on both
    np.testing.assert_array_equal(one.expert_bias.asnumpy(), bal.expert_bias.asnumpy())
    assert not np.array_equal(bal.expert_bias.asnumpy(), bias0)

    def grads_of(layer):
        params = [layer.router.weight, layer.w1, layer.w2] + list(
            layer.shared.get_parameters())
        fn = ms.grad(WeightedOutput(layer), grad_position=0, weights=params)
        layer.set_train(False)                       # the bias stays put for the gradients
        dx, g = fn(x, dy)
        return [dx.asnumpy()] + [a.asnumpy() for a in g]

    for name, a, b in zip(["dx", "router", "w1", "w2", "shared"] * 2, grads_of(bal),
                          grads_of(one)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max(), err_msg=name)
