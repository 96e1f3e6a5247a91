"""Placement cost model: a hand-computed step, and the fast evaluator equals the simulator."""
import numpy as np
import pytest

from ms_efficient.core.cluster import ClusterSpec, Link
from ms_efficient.graph import OpGraph, OpNode
from ms_efficient.place.cost import (evaluate_population, memory_by_device, simulate_placement,
                                     step_time_lower_bound)
from ms_efficient.place.problem import PlacementOptions, build_problem


def toy_cluster(devices=2, memory=10**6, latency_s=1e-3, bandwidth_Bps=1e6):
    link = Link(latency_s=latency_s, bandwidth_Bps=bandwidth_Bps)
    return ClusterSpec(name="toy", nodes=1, devices_per_node=devices,
                       device_memory_bytes=memory, peak_flops={"fp16": 1e12},
                       intra_link=link, inter_link=link, host_link=link)


def chain_graph():
    """a -> b -> c -> d; forward 1, 2, 3, 4 ms; backward 2 ms each."""
    g = OpGraph("chain")
    for name, fwd, out, params in (("a", 1, 100, 50), ("b", 2, 1000, 0), ("c", 3, 100, 0),
                                   ("d", 4, 10, 0)):
        g.add_node(OpNode(name, "Op", forward_time_s=fwd * 1e-3, backward_time_s=2e-3,
                          output_bytes=out, param_bytes=params, phase="forward"))
    for s, d in (("a", "b"), ("b", "c"), ("c", "d")):
        g.add_edge(s, d)
    return g


def test_two_device_chain_step_matches_hand_computation():
    problem = build_problem(chain_graph(), toy_cluster(), PlacementOptions(memory_fraction=1.0))
    assign = np.array([0, 0, 1, 1])
    # forward: a 0-1, b 1-3, send b->c 1 ms + 1000 B / 1e6 B/s = 2 ms: 3-5, c 5-8, d 8-12;
    # backward: d 12-14, c 14-16, gradient c->b 16-18, b 18-20, a 20-22 ms.
    step, mem = evaluate_population(problem, assign[None])
    assert step[0] == pytest.approx(22e-3, rel=1e-12)
    sim = simulate_placement(problem, assign)
    assert sim.step_time_s == pytest.approx(22e-3, rel=1e-12)
    # dev0: a's state 4 x 50 + activations 100 + 1000; dev1: 100 + 10 + received 1000
    assert mem[0].tolist() == [1300.0, 1110.0]
    assert sim.peak_memory_bytes.tolist() == [1300.0, 1110.0]


def test_single_device_step_is_the_sum_of_all_compute():
    problem = build_problem(chain_graph(), toy_cluster())
    step, _ = evaluate_population(problem, np.zeros((1, 4), dtype=np.int64))
    assert step[0] == pytest.approx((1 + 2 + 3 + 4 + 4 * 2) * 1e-3)


def random_dag(n, seed, extra_edges=1.5):
    rng = np.random.default_rng(seed)
    g = OpGraph(f"dag{seed}")
    for i in range(n):
        g.add_node(OpNode(f"n{i}", "Op", forward_time_s=float(rng.uniform(1e-4, 2e-3)),
                          backward_time_s=float(rng.uniform(1e-4, 3e-3)),
                          output_bytes=int(rng.integers(0, 5000)),
                          param_bytes=int(rng.integers(0, 300)), phase="forward"))
    for i in range(1, n):
        g.add_edge(f"n{int(rng.integers(0, i))}", f"n{i}")
    for _ in range(int(extra_edges * n)):
        a, b = sorted(rng.choice(n, size=2, replace=False))
        g.add_edge(f"n{a}", f"n{b}")
    return g


@pytest.mark.parametrize("micro_batches", [1, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_fast_evaluator_equals_the_shared_simulator(seed, micro_batches):
    problem = build_problem(random_dag(30, seed), toy_cluster(devices=3),
                            PlacementOptions(micro_batches=micro_batches))
    rng = np.random.default_rng(seed)
    pop = rng.integers(0, 3, size=(6, problem.num_units))
    step, mem = evaluate_population(problem, pop)
    for i in range(len(pop)):
        sim = simulate_placement(problem, pop[i])
        assert step[i] == pytest.approx(sim.step_time_s, rel=1e-9)
        np.testing.assert_allclose(mem[i], sim.peak_memory_bytes, rtol=1e-12)


def test_a_fanned_out_tensor_is_received_once_per_destination_unit():
    # Documented model: a cut edge is one transfer per destination unit (not per device),
    # so two consumers of a on device 1 receive (and hold) two copies.
    g = OpGraph("fork")
    g.add_node(OpNode("a", "Op", forward_time_s=1e-3, backward_time_s=0, output_bytes=7))
    for name in ("b", "c"):
        g.add_node(OpNode(name, "Op", forward_time_s=1e-3, backward_time_s=0, output_bytes=1))
        g.add_edge("a", name)
    problem = build_problem(g, toy_cluster())
    assert memory_by_device(problem, np.array([0, 1, 1])).tolist() == [7.0, 2 * 7.0 + 1 + 1]


def test_devices_run_their_units_in_the_program_order_of_the_plan():
    # a (dev 0) -> b (dev 1); c (dev 1, 5 ms) independent; 1 ms latency, no backward work.
    g = OpGraph("order")
    for name, fwd in (("a", 1), ("c", 5), ("b", 1)):
        g.add_node(OpNode(name, "Op", forward_time_s=fwd * 1e-3, backward_time_s=0.0,
                          output_bytes=0))
    g.add_edge("a", "b")
    problem = build_problem(g, toy_cluster(), PlacementOptions(memory_fraction=1.0))
    assert problem.unit_names == ["a", "c", "b"]
    assign = np.array([0, 1, 1])
    # numbering a, c, b: c 0-5, b 5-6 (input at 2), gradient b -> a 6-7, a's backward at 7
    assert simulate_placement(problem, assign).step_time_s == pytest.approx(7e-3)
    # order a, b, c: b 2-3, c 3-8, then the gradient 8-9
    assert simulate_placement(problem, assign, order=[0, 2, 1]).step_time_s == pytest.approx(9e-3)
    with pytest.raises(ValueError, match="after its predecessors"):
        simulate_placement(problem, assign, order=[2, 0, 1])


def test_lower_bound_of_a_chain_is_its_work_at_one_micro_batch_and_hand_value_at_two():
    zero_latency = dict(latency_s=0.0, bandwidth_Bps=1e15)
    one = build_problem(chain_graph(), toy_cluster(**zero_latency))
    # M = 1: critical path = all work = 10 ms forward + 8 ms backward, reached by one device
    assert step_time_lower_bound(one) == pytest.approx(18e-3)
    step, _ = evaluate_population(one, np.zeros((1, one.num_units), dtype=np.int64))
    assert step[0] == pytest.approx(18e-3)
    two = build_problem(chain_graph(), toy_cluster(**zero_latency),
                        PlacementOptions(micro_batches=2))
    # M = 2, unit a: 1 ms of forwards, then (2+2 + 3+2 + 4+2) / 2 ms down and back, then
    # 2 ms of backwards = 10.5 ms (b: 0.5 + 2 + 5.5 + 2 = 10; work / 2 devices = 9)
    assert step_time_lower_bound(two) == pytest.approx(10.5e-3)


@pytest.mark.parametrize("micro_batches", [1, 4])
@pytest.mark.parametrize("seed", [0, 3])
def test_no_placement_or_program_order_beats_the_lower_bound(seed, micro_batches):
    from ms_efficient.place.baselines import m_etf_plan, m_sct_plan

    problem = build_problem(random_dag(40, seed), toy_cluster(devices=4, latency_s=0.0,
                                                              bandwidth_Bps=1e15),
                            PlacementOptions(micro_batches=micro_batches))
    bound = step_time_lower_bound(problem)
    rng = np.random.default_rng(seed)
    pop = np.concatenate([rng.integers(0, 4, size=(200, problem.num_units)),
                          np.zeros((1, problem.num_units), dtype=np.int64)])
    step, _ = evaluate_population(problem, pop)
    assert step.min() >= bound * (1 - 1e-12)
    for plan in (m_etf_plan, m_sct_plan):
        assign, order = plan(problem)
        assert simulate_placement(problem, assign, order=order).step_time_s >= bound * (1 - 1e-12)
