"""OpGraph, PipeDream reader, FLOP estimates and MINDIR extraction, checked against hand counts."""
import ast
import json
import math
import os

import numpy as np
import pytest

import workers
from ms_efficient.graph import (OpGraph, OpNode, contract_chains, graph_summary_table, load_graph,
                                load_pipedream, parse_pipedream)
from ms_efficient.graph.flops import op_flops, tensor_bytes

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "pipedream_tiny.txt")
GRAPH_DIR = os.path.join(os.path.dirname(__file__), os.pardir, "ms_efficient", "graph")


def chain_graph(names, edges):
    graph = OpGraph(name="toy")
    for i, name in enumerate(names):
        graph.add_node(OpNode(name=name, op_type="Add", flops=10.0 * (i + 1),
                              output_bytes=100 * (i + 1), param_bytes=i, phase="forward"))
    for src, dst in edges:
        graph.add_edge(src, dst)
    return graph


# ---------------------------------------------------------------------------------------
# OpGraph
# ---------------------------------------------------------------------------------------
def test_edge_to_an_unknown_node_is_refused_by_name():
    graph = chain_graph(["a", "b"], [("a", "b")])
    with pytest.raises(ValueError, match="unknown node 'ghost'"):
        graph.add_edge("a", "ghost")


def test_edges_default_to_the_source_output_bytes_and_keep_the_larger_duplicate():
    graph = chain_graph(["a", "b"], [("a", "b")])
    assert graph.edge_bytes("a", "b") == 100
    graph.add_edge("a", "b", 250)
    graph.add_edge("a", "b", 7)
    assert graph.edges == [("a", "b", 250)]
    assert graph.successors("a") == ["b"] and graph.predecessors("b") == ["a"]


def test_topological_order_follows_edges_and_breaks_ties_by_insertion_order():
    graph = chain_graph(["d", "c", "b", "a"], [("c", "a"), ("d", "a"), ("b", "d")])
    assert graph.topological_order() == ["c", "b", "d", "a"]


def test_a_cycle_is_reported_with_a_node_on_it():
    graph = chain_graph(["start", "x", "y", "z", "end"],
                        [("start", "x"), ("x", "y"), ("y", "z"), ("z", "x"), ("z", "end")])
    with pytest.raises(ValueError, match="cycle through node '[xyz]'") as info:
        graph.topological_order()
    assert "'start'" not in str(info.value) and "'end'" not in str(info.value)


def test_totals_and_summary_add_up_node_costs():
    graph = chain_graph(["a", "b", "c"], [("a", "b"), ("b", "c")])
    assert graph.total_flops == 60.0
    assert graph.total_activation_bytes == 600
    assert graph.total_param_bytes == 3
    summary = graph.summary()
    assert (summary["nodes"], summary["edges"], summary["edge_bytes"]) == (3, 2, 300)
    assert summary["op_types"] == {"Add": 3}
    assert summary["forward_time_s"] is None


def test_to_arrays_gives_csr_adjacency_matching_the_edges():
    graph = chain_graph(["a", "b", "c", "d"], [("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")])
    arrays = graph.to_arrays()
    assert arrays.names == ["a", "b", "c", "d"]
    rebuilt = sorted((arrays.names[i], arrays.names[arrays.succ_indices[k]], arrays.succ_bytes[k])
                     for i in range(4)
                     for k in range(arrays.succ_indptr[i], arrays.succ_indptr[i + 1]))
    assert rebuilt == sorted(graph.edges)
    d = arrays.index["d"]
    preds = arrays.pred_indices[arrays.pred_indptr[d]:arrays.pred_indptr[d + 1]]
    assert sorted(arrays.names[p] for p in preds) == ["b", "c"]
    assert list(arrays.topo_order) == [0, 1, 2, 3]
    assert np.isnan(arrays.forward_time_s).all()
    np.testing.assert_array_equal(arrays.flops, [10.0, 20.0, 30.0, 40.0])


def test_json_round_trip_gives_an_equal_graph(tmp_path):
    graph = load_pipedream(FIXTURE)
    graph.meta["note"] = "round trip"
    path = tmp_path / "g.json"
    graph.save_json(str(path))
    assert os.listdir(tmp_path) == ["g.json"]  # the temporary file was renamed away
    again = OpGraph.load_json(str(path))
    assert again == graph
    assert again.edges == graph.edges


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.pop("version"), "missing 'version'"),
    (lambda d: d.update(version=99), "unsupported OpGraph version 99"),
    (lambda d: d["nodes"][1].pop("op_type"), "node 1 \\('node2'\\) is missing required key "
                                             "'op_type'"),
    (lambda d: d["nodes"][0].update(phase="sideways"), "node 0 \\('node1'\\).*phase"),
    (lambda d: d["edges"].append(["node1", "nowhere", 3]), "edge 5: .*unknown node 'nowhere'"),
])
def test_load_json_names_what_is_wrong(tmp_path, mutate, message):
    data = load_pipedream(FIXTURE).to_dict()
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message) as info:
        OpGraph.load_json(str(path))
    assert "bad.json" in str(info.value)


def test_contract_chains_merges_linear_runs_and_keeps_totals():
    graph = load_pipedream(FIXTURE)
    small = contract_chains(graph)
    # node1->node2 and node3->node4 are chains; node2 fans out, node5 fans in.
    assert list(small.nodes) == ["node1", "node3", "node5"]
    assert small["node1"].attrs["members"] == ["node1", "node2"]
    assert small["node3"].attrs["members"] == ["node3", "node4"]
    assert sorted(small.edges) == [("node1", "node3", 4096), ("node1", "node5", 4096),
                                   ("node3", "node5", 3072)]
    assert small.total_param_bytes == graph.total_param_bytes
    assert small.total_activation_bytes == graph.total_activation_bytes
    assert small["node3"].forward_time_s == pytest.approx(2.25e-3)
    assert len(contract_chains(graph, max_members=1)) == len(graph)


# ---------------------------------------------------------------------------------------
# PipeDream profiles
# ---------------------------------------------------------------------------------------
def test_pipedream_fixture_totals_match_hand_counts():
    graph = load_pipedream(FIXTURE)
    assert len(graph) == 5 and graph.num_edges == 5
    # Conv2d(3, 8, 3x3) 224 floats, LSTM(8, 16) 1664 floats, Linear(16, 10) 170 floats.
    assert graph.total_param_bytes == (224 + 1664 + 170) * 4
    assert graph.total_activation_bytes == 0 + 4096 + 4096 + (2048 + 512 + 512) + 1280
    summary = graph.summary()
    assert summary["forward_time_s"] == pytest.approx((1.5 + 0.25 + 2.0 + 0.125) / 1e3)
    assert summary["backward_time_s"] == pytest.approx((3.0 + 0.5 + 4.25 + 0.25) / 1e3)
    assert [n.op_type for n in graph] == ["Input0", "Conv2d", "ReLU", "LSTM", "Linear"]
    assert graph["node4"].attrs["activation_sizes"] == [2048, 512, 512]
    assert graph.edge_bytes("node2", "node5") == 4096
    assert graph.topological_order() == ["node1", "node2", "node3", "node4", "node5"]


@pytest.mark.parametrize("text, line, message", [
    ("node1 -- ReLU -- forward_compute_time=1, backward_compute_time=1, activation_size=4, "
     "parameter_size=0\nnode2 -- ReLU\n", 2, "expected 'nodeN -- description"),
    ("node1 -- ReLU -- forward_compute_time=1, activation_size=4, parameter_size=0\n", 1,
     "missing backward_compute_time"),
    ("node1 -- ReLU -- forward_compute_time=fast, backward_compute_time=1, activation_size=4, "
     "parameter_size=0\n", 1, "forward_compute_time='fast' is not a number"),
    ("node1 -- ReLU -- forward_compute_time=1, backward_compute_time=1, activation_size=4, "
     "parameter_size=0\n\tnode1 -> node2\n", 2, "must be an edge"),
    ("node1 -- ReLU -- forward_compute_time=1, backward_compute_time=1, activation_size=4, "
     "parameter_size=0\n\tnode1 -- node9\n", 2, "unknown node 'node9'"),
])
def test_malformed_pipedream_lines_are_reported_with_file_and_line(tmp_path, text, line, message):
    path = tmp_path / "bad_profile.txt"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as info:
        load_pipedream(str(path))
    assert f"bad_profile.txt:{line}:" in str(info.value)


def test_pipedream_description_may_contain_the_separator():
    graph = parse_pipedream("node1 -- Odd(a -- b) -- forward_compute_time=2, "
                            "backward_compute_time=4, activation_size=8, parameter_size=0\n")
    node = graph["node1"]
    assert (node.op_type, node.attrs["description"]) == ("Odd", "Odd(a -- b)")
    assert (node.forward_time_s, node.backward_time_s) == (0.002, 0.004)


def test_load_graph_dispatches_on_extension_and_content(tmp_path):
    graph = load_pipedream(FIXTURE)
    graph.save_json(str(tmp_path / "g.json"))
    graph.save_json(str(tmp_path / "g_no_ext"))
    assert load_graph(str(tmp_path / "g.json")) == graph
    assert load_graph(str(tmp_path / "g_no_ext")) == graph
    assert load_graph(FIXTURE) == graph
    with pytest.raises(ValueError, match="missing.json' does not exist"):
        load_graph(str(tmp_path / "missing.json"))


# ---------------------------------------------------------------------------------------
# FLOP estimates (multiply-add = 2 FLOPs)
# ---------------------------------------------------------------------------------------
def test_matmul_flops_respect_transposes():
    assert op_flops("MatMul", [(8, 64), (32, 64)], [(8, 32)],
                    {"transpose_b": True}) == 2 * 8 * 64 * 32
    assert op_flops("MatMul", [(64, 8), (64, 32)], [(8, 32)],
                    {"transpose_a": True}) == 2 * 8 * 64 * 32
    assert op_flops("BatchMatMul", [(4, 5, 6), (4, 7, 6)], [(4, 5, 7)],
                    {"transpose_b": True}) == 2 * 4 * 5 * 7 * 6


def test_conv_and_its_gradients_cost_the_same_multiply_adds():
    forward = op_flops("Conv2D", [(2, 3, 8, 8), (4, 3, 3, 3)], [(2, 4, 8, 8)])
    assert forward == 2 * (2 * 4 * 8 * 8) * (3 * 3 * 3)
    assert op_flops("Conv2DBackpropInput", [(2, 4, 8, 8), (4, 3, 3, 3)], [(2, 3, 8, 8)]) == forward
    assert op_flops("Conv2DBackpropFilter", [(2, 4, 8, 8), (2, 3, 8, 8)], [(4, 3, 3, 3)]) == forward
    grouped = op_flops("Conv2D", [(1, 4, 5, 5), (4, 1, 3, 3)], [(1, 4, 5, 5)])  # depthwise
    assert grouped == 2 * 100 * 9


def test_per_element_costs_and_data_movement():
    assert op_flops("ReLU", [(8, 32)], [(8, 32)]) == 256
    assert op_flops("Softmax", [(2, 10)], [(2, 10)]) == 5 * 20
    assert op_flops("LayerNorm", [(4, 16), (16,), (16,)], [(4, 16), (4, 1), (4, 1)]) == 8 * 64
    assert op_flops("ReduceSum", [(4, 16)], [(4,)]) == 64
    assert op_flops("Reshape", [(4, 16)], [(64,)]) == 0
    assert op_flops("SomethingNew", [(3,)], [(3, 3)]) == 9
    assert tensor_bytes((8, 32), "float16") == 512
    assert tensor_bytes((), "float32") == 4


def test_planner_side_modules_do_not_import_mindspore_at_top_level():
    for name in sorted(os.listdir(GRAPH_DIR)):
        if not name.endswith(".py"):
            continue
        tree = ast.parse(open(os.path.join(GRAPH_DIR, name)).read())
        for stmt in tree.body:
            modules = [a.name for a in getattr(stmt, "names", [])] \
                if isinstance(stmt, ast.Import) else [getattr(stmt, "module", "") or ""]
            if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                assert not any(m.split(".")[0] == "mindspore" for m in modules), name


# ---------------------------------------------------------------------------------------
# MINDIR extraction (MindSpore on CPU)
# ---------------------------------------------------------------------------------------
BATCH, D_IN, D_HID, D_OUT = 8, 64, 32, 16
FLOAT = 4  # bytes


@pytest.fixture(scope="module")
def ms_graphs():
    ms = pytest.importorskip("mindspore")
    from mindspore import nn

    from ms_efficient.graph import from_network

    class TwoLayer(nn.Cell):
        def __init__(self):
            super().__init__()
            self.d1 = nn.Dense(D_IN, D_HID)
            self.relu = nn.ReLU()
            self.d2 = nn.Dense(D_HID, D_OUT)

        def construct(self, x):
            return self.d2(self.relu(self.d1(x)))

    x = ms.Tensor(np.ones((BATCH, D_IN), np.float32))
    y = ms.Tensor(np.zeros((BATCH, D_OUT), np.float32))
    forward = from_network(TwoLayer(), x)
    net = TwoLayer()
    train = from_network(net, x, y, mode="train", loss_fn=nn.MSELoss(),
                         optimizer=nn.SGD(net.trainable_params(), learning_rate=0.1))
    return forward, train


def by_type(graph, op_type, phase=None):
    return [n for n in graph if n.op_type == op_type and (phase is None or n.phase == phase)]


@pytest.mark.mindspore
def test_forward_graph_of_two_dense_layers_matches_hand_counts(ms_graphs):
    graph, _ = ms_graphs
    assert graph.count_by_op_type() == {"MatMul": 2, "BiasAdd": 2, "ReLU": 1}
    matmul_flops = sorted(n.flops for n in by_type(graph, "MatMul"))
    assert matmul_flops == [2 * BATCH * D_HID * D_OUT, 2 * BATCH * D_IN * D_HID]
    assert graph.total_flops == (2 * BATCH * D_IN * D_HID + 2 * BATCH * D_HID * D_OUT
                                 + BATCH * D_HID + BATCH * D_OUT  # bias adds
                                 + BATCH * D_HID)  # ReLU
    params = D_IN * D_HID + D_HID + D_HID * D_OUT + D_OUT
    assert graph.total_param_bytes == params * FLOAT
    assert sorted(n.param_bytes for n in by_type(graph, "MatMul")) == \
        [D_HID * D_OUT * FLOAT, D_IN * D_HID * FLOAT]
    # MatMul, BiasAdd, ReLU each [8, 32]; MatMul, BiasAdd each [8, 16].
    assert graph.total_activation_bytes == (3 * BATCH * D_HID + 2 * BATCH * D_OUT) * FLOAT
    relu = by_type(graph, "ReLU")[0]
    assert relu.output_shapes == [(BATCH, D_HID)] and relu.output_dtypes == ["float32"]
    assert relu.scope.endswith("relu-ReLU")
    # A chain of five ops: Load/Depend/MakeTuple/UpdateState are traced through, not kept.
    assert [graph[n].op_type for n in graph.topological_order()] == \
        ["MatMul", "BiasAdd", "ReLU", "MatMul", "BiasAdd"]
    assert graph.edge_bytes(relu.name, graph.successors(relu.name)[0]) == BATCH * D_HID * FLOAT
    assert {n.phase for n in graph} == {"forward"}
    assert graph.meta["inputs"] == [{"name": "x", "shape": [BATCH, D_IN], "dtype": "float32"}]


@pytest.mark.mindspore
def test_train_graph_adds_backward_matmuls_and_one_update_per_parameter(ms_graphs):
    forward, train = ms_graphs
    assert len(train) > len(forward)
    assert {"forward", "backward", "optimizer"} <= {n.phase for n in train}
    forward_matmuls = by_type(train, "MatMul", "forward")
    assert sorted(n.flops for n in forward_matmuls) == sorted(n.flops for n in
                                                              by_type(forward, "MatMul"))
    # dX of d2, dW of d2, dW of d1 (no dX of d1: x is an input), 2*M*N*K each.
    assert sorted(n.flops for n in by_type(train, "MatMul", "backward")) == sorted([
        2 * BATCH * D_OUT * D_HID, 2 * D_OUT * BATCH * D_HID, 2 * D_HID * BATCH * D_IN])
    assert len(by_type(train, "SGD", "optimizer")) == 4
    assert train.total_param_bytes >= forward.total_param_bytes
    train.topological_order()  # a DAG


@pytest.mark.mindspore
def test_mindir_graph_survives_json_and_reads_back_from_a_mindir_file(ms_graphs, tmp_path):
    import mindspore as ms
    from mindspore import nn

    graph, _ = ms_graphs
    graph.save_json(str(tmp_path / "net.json"))
    assert OpGraph.load_json(str(tmp_path / "net.json")) == graph

    net = nn.Dense(D_IN, D_HID)
    ms.export(net, ms.Tensor(np.ones((BATCH, D_IN), np.float32)),
              file_name=str(tmp_path / "dense"), file_format="MINDIR")
    dense = load_graph(str(tmp_path / "dense.mindir"))
    assert dense.count_by_op_type() == {"MatMul": 1, "BiasAdd": 1}
    assert dense.total_param_bytes == (D_IN * D_HID + D_HID) * FLOAT
    assert math.isclose(dense.total_flops, 2 * BATCH * D_IN * D_HID + BATCH * D_HID)
    (tmp_path / "junk.mindir").write_bytes(b"not a protobuf at all")
    with pytest.raises(ValueError, match="junk.mindir"):
        load_graph(str(tmp_path / "junk.mindir"))
    table = graph_summary_table(graph)
    assert "41.60 KFLOP" in table and "| MatMul | 2 |" in table


@pytest.mark.mindspore
def test_from_network_rejects_an_unknown_mode(ms_graphs):
    from mindspore import nn

    from ms_efficient.graph import from_network

    with pytest.raises(ValueError, match="'mode' must be 'forward' or 'train'"):
        from_network(nn.ReLU(), np.ones((2, 2), np.float32), mode="backward")


@workers.in_background("mindcv_graph")
def _mindcv_graph():
    """resnet18's graph twice (extracted, then from its cache) and an unknown model's error,
    in a child process: mindcv's Cells otherwise outlive MindSpore at interpreter exit and
    print destructor errors after pytest's summary. In the background (tests/workers.py);
    None without mindcv (not imported here: see above)."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("mindcv") is None:
        return None
    cache = str(workers.temporary_dir("mindcv_graph_"))
    code = f"""
import json
import mindcv
from ms_efficient.models.zoo import mindcv_graph
g = mindcv_graph("resnet18", image_size=32, batch=2, cache_dir={cache!r})
net = mindcv.create_model("resnet18", pretrained=False)
c = mindcv_graph("resnet18", image_size=32, batch=2, cache_dir={cache!r})
try:
    mindcv_graph("resnet-nine", cache_dir={cache!r})
    err = ""
except ValueError as e:
    err = str(e)
print(json.dumps({{"bytes": g.total_param_bytes, "expected": 4 * sum(p.size for p in
                  net.get_parameters()), "meta": g.meta, "nodes": [len(g), len(c)],
                  "cached_bytes": c.total_param_bytes, "err": err}}))
"""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          timeout=300)


@pytest.fixture(scope="module")
def mindcv_graph():
    return workers.background_result("mindcv_graph", skip_if_none="mindcv is not installed")


@pytest.mark.mindspore
def test_mindcv_graph_counts_every_parameter_and_reloads_from_its_cache(mindcv_graph):
    out = mindcv_graph
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["bytes"] == got["expected"] == got["cached_bytes"]
    assert got["meta"]["model"] == "mindcv/resnet18" and got["meta"]["batch"] == 2
    assert got["nodes"][0] == got["nodes"][1]
    assert "mindcv has no model 'resnet-nine'" in got["err"]
