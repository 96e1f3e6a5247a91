"""Placement plans: YAML round trip, pipeline stages on MindSpore Cells, the CLI."""
import json

import numpy as np
import pytest

from ms_efficient.cli import main
from ms_efficient.graph import OpGraph, OpNode
from ms_efficient.place.apply import apply_pipeline_stages, load_plan, make_plan, save_plan
from ms_efficient.place.problem import build_problem
from tests.test_place_cost import chain_graph, toy_cluster


def scoped_chain():
    g = OpGraph("net")
    for i in range(4):
        g.add_node(OpNode(f"op{i}", "MatMul", scope=f"Default/{i}-Dense",
                          forward_time_s=1e-3, backward_time_s=1e-3, output_bytes=10))
        if i:
            g.add_edge(f"op{i - 1}", f"op{i}")
    return g


def test_plan_yaml_round_trip_keeps_assignment_and_stage_order(tmp_path):
    problem = build_problem(chain_graph(), toy_cluster())
    plan = make_plan(problem, np.array([1, 1, 0, 0]), "tga")
    assert plan.stage_of_device == {1: 0, 0: 1}  # device 1 runs the first ops: stage 0
    path = str(tmp_path / "plan.yaml")
    save_plan(plan, path)
    back = load_plan(path)
    assert back.assignment == {"a": 1, "b": 1, "c": 0, "d": 0}
    assert back.stage_of_device == plan.stage_of_device
    assert back.step_time_s == pytest.approx(plan.step_time_s)
    assert back.to_dict()["parallel_config"] == {"pipeline_stage": 2, "micro_batch_num": 1}


def test_pipeline_stages_set_on_mindspore_cells():
    from mindspore import nn

    net = nn.SequentialCell([nn.Dense(4, 4) for _ in range(4)])
    g = scoped_chain()
    problem = build_problem(g, toy_cluster())
    plan = make_plan(problem, np.array([0, 0, 1, 1]), "tga",
                     scopes={n.name: n.scope for n in g})
    stages = apply_pipeline_stages(net, plan)
    assert [net[i].pipeline_stage for i in range(4)] == [0, 0, 1, 1]
    assert stages["3"] == 1


def test_cli_plan_place_writes_a_plan(tmp_path, capsys):
    graph_path = str(tmp_path / "g.json")
    scoped_chain().save_json(graph_path)
    out = str(tmp_path / "plan.yaml")
    rc = main(["plan", "place", graph_path, "--cluster", "ascend910b-1x8", "--devices", "2",
               "--evaluations", "100", "--micro-batches", "4", "--out", out])
    assert rc == 0
    plan = load_plan(out)
    assert set(plan.assignment) == {"op0", "op1", "op2", "op3"}
    assert plan.devices == 2 and plan.micro_batches == 4
    # judged against the same 2 devices without a pipeline, recorded and printed
    from ms_efficient.place.commands import _load_cluster
    from ms_efficient.place.same_devices import best_replica_plan, replica_plans

    base = best_replica_plan(replica_plans(scoped_chain(), _load_cluster("ascend910b-1x8", 2)))
    same = plan.meta["same_devices"]
    assert same["baseline"]["label"] == base.label
    assert same["baseline"]["step_time_s"] == pytest.approx(base.step_time_s, rel=1e-12)
    assert same["ratio_to_baseline"] == pytest.approx(plan.step_time_s / base.step_time_s,
                                                      rel=1e-12)
    assert same["pp"] == len(plan.stages) and same["dp"] == 1
    printed = capsys.readouterr().out
    assert f"same devices without a pipeline: {base.label}, " in printed
    assert f"takes {same['ratio_to_baseline']:.3g}x its step time" in printed


def test_cli_plan_place_reports_a_cycle_in_one_line(tmp_path, capsys):
    data = scoped_chain().to_dict()
    data["edges"].append(["op3", "op0", 10])
    path = tmp_path / "cyclic.json"
    path.write_text(json.dumps(data))
    rc = main(["plan", "place", str(path), "--out", str(tmp_path / "p.yaml")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "cycle" in err[0]
    assert not (tmp_path / "p.yaml").exists()


def test_cli_plan_place_names_an_operator_too_big_for_any_device(tmp_path, capsys):
    g = scoped_chain()
    g.nodes["op2"].param_bytes = 64 * 2**30
    path = str(tmp_path / "big.json")
    g.save_json(path)
    rc = main(["plan", "place", path, "--out", str(tmp_path / "p.yaml")])
    err = capsys.readouterr().err
    assert rc == 2 and "operator 'op2' needs" in err


def test_stages_follow_the_dataflow_between_devices():
    # s2 (first in topological order) sits on device 1 but receives nothing; data flows
    # from device 0 (s1 -> x) into device 1 (y), so device 0 is stage 0.
    g = OpGraph("join")
    for name in ("s2", "s1", "x", "y"):
        g.add_node(OpNode(name, "Op", forward_time_s=1e-3, backward_time_s=1e-3, output_bytes=8))
    for s, d in (("s1", "x"), ("x", "y"), ("s2", "y")):
        g.add_edge(s, d)
    problem = build_problem(g, toy_cluster())
    assert problem.unit_names == ["s2", "s1", "x", "y"]
    plan = make_plan(problem, np.array([1, 0, 0, 1]), "tga")
    assert plan.stage_of_device == {0: 0, 1: 1} and plan.meta["pipeline"]
    cyclic = make_plan(build_problem(chain_graph(), toy_cluster()), np.array([0, 1, 0, 0]), "x")
    assert not cyclic.meta["pipeline"]


def test_cli_bench_place_refuses_a_graph_dir_that_is_not_a_folder(tmp_path, capsys):
    missing = tmp_path / "no_such_dir"
    rc = main(["bench", "place", "--quick", "--graph-dir", str(missing),
               "--json", str(tmp_path / "p.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "--graph-dir must be a folder" in err and str(missing) in err
    assert not (tmp_path / "p.json").exists()
