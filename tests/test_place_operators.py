"""Placement operators: pipeline order, closure moves, crossover, repair, the evaluator."""
import numpy as np
import pytest

from ms_efficient.place.cost import memory_by_device
from ms_efficient.place.cost import Evaluator
from ms_efficient.place.operators import (crossover_stages, is_monotone, move_with_closure, repair,
                                          spread_all, stage_sort)
from ms_efficient.place.problem import PlacementOptions, build_problem
from ms_efficient.place.workloads import TransformerShape, transformer_graph
from tests.test_place_cost import random_dag, toy_cluster
from tests.test_place_planners import chain


def dag_problem(seed=0, devices=4, memory=10**6):
    return build_problem(random_dag(40, seed), toy_cluster(devices=devices, memory=memory),
                         PlacementOptions(micro_batches=2, memory_fraction=1.0))


def test_stage_sort_gives_a_pipeline_with_the_same_units_per_device():
    problem = dag_problem()
    rng = np.random.default_rng(0)
    for _ in range(20):
        x = rng.integers(0, 4, problem.num_units)
        y = stage_sort(problem, x)
        assert is_monotone(problem, y)
        assert np.bincount(y, minlength=4).tolist() == np.bincount(x, minlength=4).tolist()
        assert stage_sort(problem, y) is y  # monotone input comes back unchanged
    line = build_problem(chain([1] * 6), toy_cluster(devices=3))
    x = np.array([2, 0, 1, 0, 2, 1])
    assert stage_sort(line, x).tolist() == sorted(x.tolist())


def test_closure_moves_and_stage_crossover_keep_pipelines_monotone():
    problem = dag_problem(seed=1)
    rng = np.random.default_rng(1)
    parents = [stage_sort(problem, rng.integers(0, 4, problem.num_units)) for _ in range(10)]
    for x, y in zip(parents, parents[1:]):
        child = crossover_stages(x, y, 4, rng)
        assert is_monotone(problem, child)
        u = int(rng.integers(problem.num_units))
        for t in range(4):
            moved = move_with_closure(problem, x, u, t)
            assert moved[u] == t and is_monotone(problem, moved)
            # only units that had to follow u changed, and only towards t
            changed = np.flatnonzero(moved != x)
            assert all(min(x[v], t) <= moved[v] <= max(x[v], t) for v in changed)


@pytest.mark.parametrize("monotone", [False, True])
def test_memory_repair_never_adds_excess_and_keeps_the_pipeline_order(monotone):
    problem = dag_problem(seed=3, memory=70_000)
    rng = np.random.default_rng(3)
    fits = 0
    for _ in range(10):
        x = rng.integers(0, 4, problem.num_units)
        if monotone:
            x = stage_sort(problem, x)
        before = np.clip(memory_by_device(problem, x) - problem.capacity_bytes, 0, None).sum()
        y = repair(problem, x, monotone=monotone)
        after = np.clip(memory_by_device(problem, y) - problem.capacity_bytes, 0, None).sum()
        assert after <= before
        fits += after == 0
        if monotone:
            assert is_monotone(problem, y)
    assert fits >= 8  # greedy: most random placements of this tight toy fit


def test_spread_all_puts_the_experts_of_a_layer_on_different_devices():
    shape = TransformerShape(layers=2, hidden=64, heads=2, ffn=128, seq=16, batch=2,
                             experts=4, vocab=100)
    problem = build_problem(transformer_graph(shape), toy_cluster(devices=4, memory=10**9))
    groups = problem.sibling_groups()
    names = [[problem.unit_names[u] for u in g] for g in groups]
    assert sorted(names) == [[f"layer{i}.ffn.expert{j}" for j in range(4)] for i in range(2)]
    spread = spread_all(problem, np.zeros(problem.num_units, dtype=np.int64))
    assert all(sorted(spread[g].tolist()) == [0, 1, 2, 3] for g in groups)


def test_evaluator_scores_each_distinct_placement_once_within_its_budget():
    problem = dag_problem()
    rng = np.random.default_rng(0)
    pop = rng.integers(0, 4, (6, problem.num_units))
    ev = Evaluator(problem, max_evaluations=8, time_budget_s=60)
    first = ev.evaluate(np.concatenate([pop, pop[:2]]))  # two repeats inside the batch
    assert ev.used == 6 and np.array_equal(first[:2], first[6:])
    again = ev.evaluate(pop)
    assert ev.used == 6 and np.array_equal(again, first[:6])
    more = ev.evaluate(rng.integers(0, 4, (5, problem.num_units)))
    assert ev.used == 8 and np.isfinite(more[:2]).all() and np.isinf(more[2:]).all()


def test_evaluator_stops_scoring_when_time_is_up():
    ev = Evaluator(dag_problem(), max_evaluations=100, time_budget_s=1e-9)
    assert ev.left() == 100                     # the first call always scores
    pop = np.zeros((3, ev.problem.num_units), dtype=np.int64)
    pop[1, 0] = pop[2, 1] = 1
    assert np.isfinite(ev.evaluate(pop)).all()
    assert ev.left() == 0                       # then the time is up
    assert np.isinf(ev.evaluate(pop + 1)).all()
