"""Scopes -> Cell paths, repeated blocks and unit assignment (numpy, hand-built graphs)."""
import pytest

from ms_efficient.graph import OpGraph, OpNode
from ms_efficient.graph.cells import (CellTree, assign_units, cell_tree_from_graph,
                                      forward_subgraph, match_cells, node_cell_path,
                                      repeated_blocks, scope_segments, sequence_units)

ROOT = "Default/network-WithLossCell/_backbone-Net"


def test_scope_segments_split_attribute_and_class_at_the_last_dash():
    assert scope_segments("Default/layers-CellList/0-Block/up_proj-Dense/MatMul-op12") == [
        ("layers", "CellList"), ("0", "Block"), ("up_proj", "Dense")]
    assert scope_segments("Default") == []


def _train_graph():
    """Two blocks of a CellList, embedding before, head after; one backward op. The second
    block's residual add and norm op carry block 0's scope (as MindSpore exports them)."""
    g = OpGraph("toy", meta={"mode": "train"})
    blk = f"{ROOT}/layers-CellList"
    rows = [  # name, scope, param bytes, output bytes
        ("emb", f"{ROOT}/embed-Embedding", 400, 64),
        ("n0", f"{blk}/0-Block/norm-Norm", 0, 64),
        ("w0", f"{blk}/0-Block/fc-Dense", 100, 128),
        ("r0", f"{blk}/0-Block", 0, 64),
        ("n1", f"{blk}/0-Block/norm-Norm", 0, 64),          # block 1's op, block 0's scope
        ("w1", f"{blk}/1-Block/fc-Dense", 100, 128),
        ("r1", f"{blk}/0-Block", 0, 64),                    # block 1's residual add
        ("head", f"{ROOT}/head-Dense", 200, 32),
    ]
    for name, scope, params, out in rows:
        g.add_node(OpNode(name, "Op", scope=scope, param_bytes=params, output_bytes=out,
                          flops=1000.0, phase="forward"))
    for a, b in zip(rows, rows[1:]):
        g.add_edge(a[0], b[0], a[3])
    g.add_node(OpNode("grad", "MatMul", scope=f"Gradients/{ROOT}", phase="backward",
                      flops=2000.0))
    g.add_edge("head", "grad", 32)
    return g


def test_train_graph_paths_are_relative_to_the_trained_network():
    g = _train_graph()
    assert node_cell_path(g, g["w1"].scope) == "_backbone.layers.1.fc"
    tree = cell_tree_from_graph(g)
    assert tree.classes["_backbone.layers"] == "CellList"
    assert tree.param_bytes["_backbone.layers.0"] == 100
    assert tree.param_bytes[""] == 800


def test_repeated_blocks_are_the_children_of_a_list_of_one_class():
    g = _train_graph()
    assert repeated_blocks(cell_tree_from_graph(g)) == ["_backbone.layers.0",
                                                        "_backbone.layers.1"]
    # children of different classes (a conv + norm downsample) are no repeated block
    tree = CellTree.from_cells([("", "Net", 10), ("down", "SequentialCell", 10),
                                ("down.0", "Conv2d", 8), ("down.1", "BatchNorm2d", 2)])
    assert repeated_blocks(tree) == []


def test_a_network_without_repeated_blocks_is_cut_at_its_largest_sequence():
    # a Sequential of Dense/ReLU (no two children of one class all holding parameters) and a
    # smaller head Sequential: the units are the larger one's Cells holding parameters
    tree = CellTree.from_cells([("", "Net", 30), ("body", "SequentialCell", 24),
                                ("body.0", "Dense", 8), ("body.1", "ReLU", 0),
                                ("body.2", "Conv2d", 8), ("body.3", "ReLU", 0),
                                ("body.4", "Dense", 8),
                                ("head", "SequentialCell", 6), ("head.0", "Dense", 3),
                                ("head.1", "Dense", 3)])
    assert repeated_blocks(tree) == ["head.0", "head.1"]
    del tree.classes["head"]                               # head as a plain Cell
    tree.paths.remove("head")
    assert repeated_blocks(tree) == []
    assert sequence_units(tree) == ["body.0", "body.2", "body.4"]
    # one Cell holding parameters is no sequence to cut
    lone = CellTree.from_cells([("", "Net", 8), ("seq", "SequentialCell", 8),
                                ("seq.0", "Dense", 8), ("seq.1", "ReLU", 0)])
    assert sequence_units(lone) == []


def test_mis_scoped_ops_go_to_the_block_that_runs_them():
    g = _train_graph()
    a = assign_units(g, ["_backbone.layers.0", "_backbone.layers.1"])
    names = [n.name for n in g]
    got = {names[i]: int(u) for i, u in zip(a.order, a.unit_of)}
    # n1 lies between block 0's and block 1's weights: its block-0 scope is kept; r1 comes
    # after block 1's weight, so its block-0 scope is wrong and it joins block 1
    assert got == {"emb": -1, "n0": 0, "w0": 0, "r0": 0, "n1": 0, "w1": 1, "r1": 1,
                   "head": -1}
    assert "grad" not in got                                     # forward ops only


def test_a_unit_without_parameters_in_the_graph_is_refused():
    with pytest.raises(ValueError, match="no parameter operator .*_backbone.missing"):
        assign_units(_train_graph(), ["_backbone.layers.0", "_backbone.missing"])


def test_cell_patterns_match_in_network_order_and_name_a_pattern_that_matches_nothing():
    tree = cell_tree_from_graph(_train_graph())
    assert match_cells(tree, ["_backbone.layers.*.fc"]) == ["_backbone.layers.0.fc",
                                                            "_backbone.layers.1.fc"]
    with pytest.raises(ValueError, match="'blocks.\\*' matches no Cell"):
        match_cells(tree, ["blocks.*"])
    with pytest.raises(ValueError, match="'\\*.fc' matches no Cell"):
        match_cells(tree, ["*.fc"])                 # '*' is one level: no top-level fc
    # '*' stays at its level: the blocks, not their fc (today's fnmatch took both and nested)
    assert match_cells(tree, ["_backbone.layers.*"]) == ["_backbone.layers.0",
                                                         "_backbone.layers.1"]
    with pytest.raises(ValueError, match="may not nest"):
        match_cells(tree, ["_backbone.layers.*", "_backbone.layers.*.fc"])


def test_forward_subgraph_drops_backward_ops_and_their_edges():
    sub = forward_subgraph(_train_graph())
    assert len(sub) == 8 and "grad" not in sub and sub.num_edges == 7
