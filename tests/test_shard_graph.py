"""The sharding ILP over a graph's own operators (shard.graph_ops): specs from shapes, the
renames across reshapes, the batch dims, a hand-solved optimum and the graph baselines."""
import pytest

from ms_efficient.core.cluster import get_cluster
from ms_efficient.graph.opgraph import OpGraph, OpNode
from ms_efficient.shard.baselines import graph_baseline_cost, graph_baseline_strategies
from ms_efficient.shard.cost import CostModel
from ms_efficient.shard.graph_ops import prefix_rename, refine_shapes, specs_from_graph
from ms_efficient.shard.ilp import ShardOptions, solve_sharding
from ms_efficient.shard.planner import graph_plan_to_dict, plan_graph
from ms_efficient.shard.strategies import Layout, Mesh


def _node(graph, name, op, ins, out, sources, **attrs):
    graph.add_node(OpNode(name=name, op_type=op, phase="forward", input_shapes=ins,
                          output_shapes=[out], output_dtypes=["float32"],
                          attrs={"input_sources": sources,
                                 "input_dtypes": ["float32"] * len(ins), **attrs}))
    for kind, src in sources:
        if kind == "op":
            graph.add_edge(src, name)


def _mlp_graph(batch=8, hidden=4, ffn=8):
    """x[B, H] -> fc1 (w1 [H, F]) -> SiLU -> fc2 (w2 [F, H]) -> ReduceMean (a scalar)."""
    g = OpGraph("mlp", meta={"inputs": [{"name": "x", "shape": [batch, hidden],
                                         "dtype": "float32"}]})
    _node(g, "fc1", "MatMul", [(batch, hidden), (hidden, ffn)], (batch, ffn),
          [["input", "x"], ["param", "w1"]], transpose_a=False, transpose_b=False)
    _node(g, "act", "SiLU", [(batch, ffn)], (batch, ffn), [["op", "fc1"]])
    _node(g, "fc2", "MatMul", [(batch, ffn), (ffn, hidden)], (batch, hidden),
          [["op", "act"], ["param", "w2"]], transpose_a=False, transpose_b=False)
    _node(g, "loss", "ReduceMean", [(batch, hidden)], (), [["op", "fc2"]],
          keep_dims=False, const_inputs={"1": []})
    return g


def test_common_refinement_and_flat_offset_renames():
    assert refine_shapes((32, 32), (2, 16, 4, 8)) == [2, 16, 4, 8]
    assert refine_shapes((2, 16, 32), (32, 32)) == [2, 16, 32]
    assert refine_shapes((6, 4), (4, 6)) is None            # no common refinement
    assert refine_shapes((6, 4), (25,)) is None             # different sizes
    # [B*S, H] read as [B, S, A, D]: B starts where B*S does, A where H does
    assert prefix_rename([("b", 2), ("s", 16), ("a", 4), ("d", 8)], [("m", 32), ("n", 32)]) \
        == (("b", "m"), ("s", "~s"), ("a", "n"), ("d", "~d"))
    # different sizes: nothing lines up
    assert prefix_rename([("x", 4)], [("y", 8)]) == (("x", "~x"),)


def test_specs_follow_shapes_params_and_batch_dims():
    ops = specs_from_graph(_mlp_graph())
    fc1, act, fc2, loss = ops.specs
    assert fc1.prim == "MatMul" and fc1.contract == ("d1",) and fc1.size == {
        "d0": 8, "d1": 4, "d2": 8}
    assert [t.kind for t in fc1.inputs] == ["input", "param"] and fc1.saves == ("in0",)
    assert fc1.dp_dims == ("d0",)                  # axis 0 of the graph input
    assert act.inputs[0].rename == (("d0", "d0"), ("d1", "d2"))   # SiLU's d1 is fc1's n
    assert fc2.dp_dims == ("d0",) and loss.contract == ("d0", "d1") and loss.out == ()
    assert ops.params == {"fc1": [(1, "w1")], "fc2": [(1, "w2")]}
    assert ops.kept_whole == {} and ops.shardable == ["fc1", "act", "fc2", "loss"]


def test_a_single_matmul_reaches_its_hand_solved_optimum():
    # x[8, 4] (a graph input, kept for backward) . w[4, 2] on a 1x2 mesh; floats plan at 2 B,
    # a weight element costs 16 B (fp16 weight + grad, fp32 master + Adam m, v).
    # Replicated: x 64 B + w 128 B = 192. Split k: x/2 + w/2 = 32 + 64 = 96. Split n: x whole
    # = 64 + 64 = 128. Split m with ZeRO-3: 32 + 128/2 = 96. Optimum: 96 B.
    g = OpGraph("one", meta={"inputs": [{"name": "x", "shape": [8, 4], "dtype": "float32"}]})
    _node(g, "mm", "MatMul", [(8, 4), (4, 2)], (8, 2), [["input", "x"], ["param", "w"]],
          transpose_a=False, transpose_b=False)
    ops = specs_from_graph(g)
    model = CostModel(Mesh(1, 2), get_cluster("ascend910b-1x8"))
    sol = solve_sharding(ops.specs, model, ShardOptions(tie="none"))
    assert sol.cost.memory == pytest.approx(96.0)
    dp = graph_baseline_cost(ops.specs, model, "dp")
    assert dp.memory == pytest.approx(32 + 128)             # x split on m, w replicated


def test_megatron_on_a_graph_is_column_then_row_and_dp_needs_a_divisible_batch():
    ops = specs_from_graph(_mlp_graph())
    model = CostModel(Mesh(2, 2, dp_model_split=False), get_cluster("ascend910b-1x8"))
    st = graph_baseline_strategies(ops.specs, model, "megatron-tp")
    assert st["fc1"].layout == Layout("d0", "d2")     # column: mp on F, dp on the batch
    assert st["act"].layout == Layout("d0", "d1")     # follows F
    assert st["fc2"].layout == Layout("d0", "d1")     # row: mp on its contracted F
    assert st["loss"].layout.mp is None               # fc2's output is all-reduced
    odd = specs_from_graph(_mlp_graph(batch=6))
    with pytest.raises(ValueError, match="cannot split op 'fc1' batch dim of size 6 over 4"):
        graph_baseline_strategies(odd.specs, model, "zero3")


def test_graph_plan_memory_is_at_most_every_baseline_and_names_operators():
    g = _mlp_graph(batch=16, hidden=64, ffn=256)
    cluster = get_cluster("ascend910b-1x8")
    result = plan_graph(g, Mesh(2, 4, dp_model_split=False), cluster, budget_ratio=None)
    best = min(c.memory for c in result["baselines"].values())
    assert result["solution"].cost.memory <= best * (1 + 1e-4) + 2048
    doc = graph_plan_to_dict(g, result)
    assert set(doc["operators"]) == {"fc1", "act", "fc2", "loss"}
    assert doc["operators"]["fc1"]["params"] == [[1, "w1"]]
    assert set(doc["baselines"]) == {"dp", "zero1", "zero2", "zero3", "megatron-tp"}
    # within 1.2 x Megatron's communication it is never worse than Megatron
    budgeted = plan_graph(g, Mesh(2, 4, dp_model_split=False), cluster, budget_ratio=1.2)
    assert budgeted["solution"].cost.comm_s <= 1.2 * budgeted["reference"].comm_s * (1 + 1e-6)
    assert budgeted["solution"].cost.memory <= budgeted["reference"].memory


def test_a_graph_without_input_sources_is_refused_by_name():
    g = OpGraph("old")
    g.add_node(OpNode(name="a", op_type="MatMul", phase="forward"))
    with pytest.raises(ValueError, match="'a' has no 'input_sources'; export the graph again"):
        specs_from_graph(g)


def test_plan_shard_on_a_graph_file_and_files_it_cannot_read(tmp_path, capsys):
    import yaml

    from ms_efficient.cli import main

    path = str(tmp_path / "mlp.json")
    _mlp_graph(batch=16, hidden=64, ffn=256).save_json(path)
    out = str(tmp_path / "plan.yaml")
    assert main(["plan", "shard", path, "--mesh", "2x4", "--out", out]) == 0
    with open(out, encoding="utf-8") as fh:
        doc = yaml.safe_load(fh)
    assert doc["source"] == "graph" and set(doc["operators"]) == {"fc1", "act", "fc2", "loss"}
    assert doc["summary"]["memory_per_device_bytes"] <= \
        doc["baselines"]["megatron-tp"]["memory_per_device_bytes"]
    capsys.readouterr()
    binary = tmp_path / "model.json"
    binary.write_bytes(b"\x08\x01\x12\xff\xfe MINDIR-ish protobuf bytes")
    mindir = tmp_path / "model.mindir"
    mindir.write_bytes(b"\xff\xfe\x00 not a protobuf")
    for bad in (str(binary), str(mindir), str(tmp_path / "missing.json")):
        assert main(["plan", "shard", bad, "--out", out]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and bad in err


def test_truncated_traces_and_binary_configs_are_one_line_errors(tmp_path, capsys):
    import numpy as np

    from ms_efficient.cli import main

    trace = tmp_path / "trace.npz"
    np.savez(trace, counts=np.ones((4, 2, 1, 4), np.int64))
    data = trace.read_bytes()
    trace.write_bytes(data[: len(data) // 2])                  # truncated
    out = str(tmp_path / "moe.yaml")
    assert main(["plan", "moe", "--trace", str(trace), "--out", out]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "trace.npz' cannot be read as .npz" in err
    binary = tmp_path / "run.yaml"
    binary.write_bytes(b"\xff\xfe\x00\x01 binary where a config belongs")
    assert main(["train", str(binary)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "run.yaml' is binary, not YAML text" in err
    zeros = tmp_path / "zeros.yaml"
    zeros.write_bytes(b"\x00\x00 nul bytes")
    assert main(["train", str(zeros)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "zeros.yaml' is not valid YAML" in err
    import os
    assert not os.path.exists(out)                                 # nothing half-written


def test_blocks_whose_scopes_hold_a_neighbours_ops_tie_the_middle_blocks():
    """Exported LLaMA blocks: the first block's scope also holds the start of its norm (every
    later block's export files that under the block before), the last holds the final norm.
    The blocks with the common op sequence are tied op by op; the first and last stay untied
    (their own strategies, as before any tying)."""
    from ms_efficient.shard.graph_ops import _tie
    from ms_efficient.shard.strategies import OpSpec, TensorRef

    def op(name, prim, h):
        return OpSpec(name, prim, (("b", 2), ("h", h)), (TensorRef(("b", "h"), "input"),),
                      ("b", "h"))

    body = [("Mul", 8), ("MatMul", 8), ("SiLU", 16), ("MatMul", 16)]

    def tie_keys(n_blocks, middle=body):
        units = []
        for i in range(n_blocks):
            ops = ([("ReduceMean", 8), ("Rsqrt", 8)] + body if i == 0 else
                   body + [("Add", 8), ("Mul", 4)] if i == n_blocks - 1 else middle)
            units.append([op(f"L{i}.{k}", prim, h) for k, (prim, h) in enumerate(ops)])
        specs = {s.name: s for unit in units for s in unit}
        _tie(specs, [[s.name for s in unit] for unit in units])
        return [[specs[s.name].tie_key for s in unit] for unit in units]

    keys = tie_keys(5)
    assert keys[1] == keys[2] == keys[3] == ["tie0:Mul", "tie1:MatMul", "tie2:SiLU",
                                             "tie3:MatMul"]
    assert keys[0] == [f"L0.{k}" for k in range(6)] and keys[4] == [f"L4.{k}" for k in range(6)]
    # one middle block: nothing to tie it to
    keys = tie_keys(3)
    assert all(key.startswith("L") for unit in keys for key in unit)
    # the middle blocks tie among themselves whatever the first and last blocks hold
    keys = tie_keys(4, middle=[("Mul", 8), ("MatMul", 8), ("SiLU", 32), ("MatMul", 32)])
    assert keys[1] == keys[2] == ["tie0:Mul", "tie1:MatMul", "tie2:SiLU", "tie3:MatMul"]


def _conv_graph(group):
    """x[8, 4, 6, 6] -> Conv2D (4 -> 4 channels, ``group`` groups) -> ReLU6 -> += x ->
    Unstack of a [2, 8, 4, 6, 6] view along axis 0 (shapes only)."""
    g = OpGraph("conv", meta={"inputs": [{"name": "x", "shape": [8, 4, 6, 6],
                                          "dtype": "float32"}]})
    _node(g, "conv", "Conv2D", [(8, 4, 6, 6), (4, 4 // group, 3, 3)], (8, 4, 6, 6),
          [["input", "x"], ["param", "w"]], group=group)
    _node(g, "act", "ReLU6", [(8, 4, 6, 6)], (8, 4, 6, 6), [["op", "conv"]])
    _node(g, "res", "InplaceAddExt", [(8, 4, 6, 6), (8, 4, 6, 6)], (8, 4, 6, 6),
          [["op", "act"], ["input", "x"]])
    _node(g, "view", "Reshape", [(8, 4, 6, 6)], (2, 4, 4, 6, 6), [["op", "res"]])
    g.add_node(OpNode(name="split", op_type="Unstack", phase="forward",
                      input_shapes=[(2, 4, 4, 6, 6)], output_shapes=[(4, 4, 6, 6)] * 2,
                      output_dtypes=["float32"] * 2,
                      attrs={"input_sources": [["op", "view"]], "axis": 0,
                             "input_dtypes": ["float32"]}))
    g.add_edge("view", "split")
    return g


def test_depthwise_conv_relu6_residual_add_and_unstack_have_rules():
    """mobilenet_v2's depthwise Conv2D splits only its batch (MindSpore's Conv2DInfo refuses a
    split cout / cin when the group is not 1), ReLU6 and the residual ``+=`` (InplaceAddExt)
    are elementwise, Unstack shares every dim but the unstacked one: none is kept whole."""
    for group in (1, 4):
        ops = specs_from_graph(_conv_graph(group))
        assert ops.kept_whole == {}
        conv, act, res, _, split = ops.specs
        assert conv.dp_dims == (conv.inputs[0].dims[0],)
        assert act.saves == ("in0",) and res.saves == ()
        channels = {conv.inputs[0].dims[1], conv.inputs[1].dims[0], conv.inputs[1].dims[1]}
        assert channels & set(conv.no_shard) == (set() if group == 1 else channels)
        assert conv.dp_dims[0] not in conv.no_shard
        stacked = split.inputs[0].dims
        assert split.no_shard == stacked[:1] and split.out == stacked[1:]
    model = CostModel(Mesh(1, 4, dp_model_split=False), get_cluster("ascend910b-1x8"))
    depthwise = specs_from_graph(_conv_graph(4))
    st = graph_baseline_strategies(depthwise.specs, model, "megatron-tp")
    assert st["conv"].layout.mp is None            # no channel split on a depthwise conv


def test_an_operator_reading_a_constant_tensor_takes_no_strategy_and_megatron_plans_it():
    """GPT positions: nn.Embedding over constant ids (the export records the ids' shape in
    ``const_tensor_inputs``, not in ``input_shapes``): the Gather is kept whole, gets no
    strategy (MindSpore's would need an entry for the constant) and Megatron's baseline,
    which makes an embedding Gather vocab-parallel, leaves it replicated (was IndexError)."""
    g = _mlp_graph()
    _node(g, "pos", "Gather", [(16, 8)], (16, 8), [["param", "wpe"]],
          const_inputs={"2": 0}, const_tensor_inputs={"1": [16]})
    ops = specs_from_graph(g)
    assert ops.kept_whole == {"Gather": 1} and "pos" not in ops.shardable
    model = CostModel(Mesh(2, 2, dp_model_split=False), get_cluster("ascend910b-1x8"))
    st = graph_baseline_strategies(ops.specs, model, "megatron-tp")
    assert st["pos"].layout == Layout()
    assert graph_baseline_cost(ops.specs, model, "megatron-tp").memory > 0


def test_a_concat_of_class_token_and_patches_carries_the_batch_dim_to_the_blocks():
    """ViT's ``concat((cls, patches), axis=1)``: the batch and feature axes are shared by both
    inputs and the output (the batch dim reaches the consumer), the token axis is each
    tensor's own and never splits; mismatched shapes or a bad axis keep it whole."""
    g = OpGraph("vit", meta={"inputs": [{"name": "x", "shape": [8, 16, 4],
                                         "dtype": "float32"}]})
    _node(g, "proj", "MatMul", [(8, 16, 4), (4, 4)], (8, 16, 4),
          [["input", "x"], ["param", "w"]], transpose_a=False, transpose_b=False)
    _node(g, "cls", "BroadcastTo", [(1, 1, 4)], (8, 1, 4), [["param", "cls"]])
    _node(g, "cat", "Concat", [(8, 1, 4), (8, 16, 4)], (8, 17, 4),
          [["op", "cls"], ["op", "proj"]], axis=1)
    _node(g, "fc", "MatMul", [(8, 17, 4), (4, 4)], (8, 17, 4),
          [["op", "cat"], ["param", "w2"]], transpose_a=False, transpose_b=False)
    ops = specs_from_graph(g)
    assert ops.kept_whole == {"BroadcastTo": 1}
    proj, _, cat, fc = ops.specs
    (b1, t1, h1), (b2, t2, h2) = cat.inputs[0].dims, cat.inputs[1].dims
    assert (b1, h1) == (b2, h2) and cat.out == (b1, cat.out[1], h1)
    assert set(cat.no_shard) == {t1, t2, cat.out[1]} and b1 not in cat.no_shard
    assert cat.size[t1] == 1 and cat.size[t2] == 16 and cat.size[cat.out[1]] == 17
    assert cat.dp_dims == (b2,) and fc.dp_dims == (fc.inputs[0].dims[0],)
    for bad in ({"axis": 3}, {"axis": True}):
        g2 = OpGraph("bad", meta=g.meta)
        _node(g2, "cat", "Concat", [(8, 1, 4), (8, 16, 4)], (8, 17, 4),
              [["input", "x"], ["input", "x"]], **bad)
        assert specs_from_graph(g2).kept_whole == {"Concat": 1}
    g3 = OpGraph("sizes", meta=g.meta)
    _node(g3, "cat", "Concat", [(8, 1, 4), (8, 16, 4)], (8, 18, 4),
          [["input", "x"], ["input", "x"]], axis=1)
    assert specs_from_graph(g3).kept_whole == {"Concat": 1}
