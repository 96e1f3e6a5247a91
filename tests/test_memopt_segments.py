"""memopt on a network without repeated blocks: contiguous segments of its largest
sequence as units (``memopt.segments``), realised on the segment's own Cells."""
import shutil

import numpy as np
import pytest

from ms_efficient.memopt.env import KEEP, RECOMPUTE, RECOMPUTE_ALL, SWAP, MemoryPlan
from ms_efficient.memopt.segments import (linear_partition, segment_cell_actions,
                                          segment_counts, segmentations)

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
pytestmark = pytest.mark.usefixtures("shared_graphs")      # tests/graph_cache.py


def test_linear_partition_minimises_the_largest_part():
    # [1, 2, 3, 4, 5] in 3 parts: 6 | 4 | 5 is the least largest part (6)
    assert linear_partition([1, 2, 3, 4, 5], 3) == [0, 3, 4]
    assert linear_partition([4, 1, 1, 4], 2) == [0, 2]
    assert linear_partition([9, 1, 1, 1], 2, min_size=2) == [0, 2]    # not [0, 1]
    assert linear_partition([9, 1, 1, 1], 2) == [0, 1]
    assert linear_partition([3, 3], 1) == [0]
    with pytest.raises(ValueError, match="got 3"):
        linear_partition([1, 1, 1, 1, 1], 3, min_size=2)


def test_segment_counts_and_segmentations_of_groups():
    assert segment_counts(2) == [1] and segment_counts(4) == [1, 2]
    assert segment_counts(9) == [1, 2, 3, 4] and segment_counts(16) == [1, 2, 4, 8]
    groups = [["f.0", "f.1"], ["f.2", "f.3"], ["f.4", "f.5"], ["f.6", "f.7"]]
    # the first group holds most bytes: still >= 2 groups per segment
    assert segmentations(groups, [8.0, 2.0, 1.0, 1.0]) == [
        ["f.0 f.1 f.2 f.3 f.4 f.5 f.6 f.7".split()],
        ["f.0 f.1 f.2 f.3".split(), "f.4 f.5 f.6 f.7".split()]]
    with pytest.raises(ValueError, match="one entry per group"):
        segmentations(groups, [1.0])


def test_a_segment_action_becomes_recompute_calls_on_its_cells():
    segs = [["a", "b", "c"], ["d", "e"], ["f", "g"]]
    names, actions = segment_cell_actions(segs, MemoryPlan(np.array([RECOMPUTE, RECOMPUTE_ALL,
                                                                     KEEP])))
    assert names == ["a", "b", "c", "d", "e"]
    # recompute keeps the segment's output (its last Cell's), recompute-all drops it too
    assert actions == [RECOMPUTE_ALL, RECOMPUTE_ALL, RECOMPUTE, RECOMPUTE_ALL, RECOMPUTE_ALL]
    with pytest.raises(ValueError, match=r"segment \['d', 'e'\]: swap has no MindSpore API"):
        segment_cell_actions(segs, MemoryPlan(np.array([KEEP, SWAP, KEEP])))


def _convnet():
    import mindspore as ms

    from tests.test_user_network_plans import ConvNet, _classifier

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    ms.set_seed(0)
    rng = np.random.default_rng(0)
    return _classifier(ConvNet(), ms.Tensor(rng.standard_normal((8, 3, 32, 32))
                                            .astype(np.float32)))


def _optimize(net, inputs, budget, **kw):
    import ms_efficient
    from ms_efficient.core.config import config_from_dict

    config = config_from_dict({"optimize": {"passes": ["memopt"], "memory_budget": budget},
                               "cluster": {"preset": "ascend910b-1x8"}})
    return ms_efficient.optimize(net, config, sample_inputs=inputs, **kw)


@pytest.mark.mindspore
def test_a_budget_below_the_segment_floor_is_one_error_naming_it_as_a_percentage():
    net, inputs = _convnet()
    _, plans = _optimize(net, inputs, "50%")          # a refusal, recorded with its reason
    assert set(plans) == {"memopt", "summary"} and set(plans["memopt"]) == {"refused"}
    msg = plans["memopt"]["refused"]
    assert msg.startswith("'optimize.memory_budget' (50%, ") and "MiB) is below the feasible " \
        "floor " in msg
    floor = float(msg.split("feasible floor ")[1].split("%")[0])
    # the whole of ``features`` recomputed keeps only its output: lower than the 89.3% that
    # single Conv2d units reached, and above 50%
    assert 50.0 < floor < 89.3
    # ... and that floor is a budget the pass plans within
    net, inputs = _convnet()
    _, plans = _optimize(net, inputs, f"{floor:g}%")
    plan = plans["memopt"]
    assert plan["simulated"]["peak_bytes"] <= plan["budget_bytes"]


@pytest.mark.mindspore
@needs_compiler
def test_convnet_at_90_percent_recomputes_a_segment_that_the_compiled_graph_shows():
    import mindspore as ms
    from mindspore import nn

    net, inputs = _convnet()
    names = {n for n, _ in net.cells_and_names()}
    params = [p.name for p in net.trainable_params()]
    net, plans = _optimize(net, inputs, "90%", verify=True)
    plan = plans["memopt"]
    assert plan["simulated"]["peak_bytes"] <= plan["budget_bytes"] < \
        plan["unoptimised_peak_bytes"]
    # segments of >= 2 (Conv2d, ReLU) groups covering ``features`` in order
    feats = [f"_backbone.features.{i}" for i in range(8)]
    assert [c for seg in plan["segments"] for c in seg] == feats
    assert all(len(seg) >= 4 for seg in plan["segments"])
    assert [layer["cells"] for layer in plan["layers"]] == plan["segments"]
    assert [layer["name"] for layer in plan["layers"]] == [s[0] for s in plan["segments"]]
    planned = [layer for layer in plan["layers"] if layer["action"] != "keep"]
    assert planned and set(plan["cells"]) == {c for layer in planned for c in layer["cells"]}
    assert set(plan["cells"]) <= names
    for layer in planned:
        cells = layer["cells"]
        # recompute: outputs dropped inside, the segment's last output kept
        assert [plan["cells"][c]["output_recompute"] for c in cells] == \
            [True] * (len(cells) - 1) + [layer["action"] == "recompute-all"]
        # the compiled graph re-runs the segment: the interior ReLU output a later Conv2D's
        # weight gradient reads is recomputed (one merged re-run for the segment)
        got = plan["verified"][cells[0]]["recompute"]
        assert got["ok"] and got["segment_recomputed_nodes"] >= 2
        assert {"Conv2D", "ReLU"} <= {op for c in cells
                                      for op in plan["verified"][c]["recompute"]["ops"]}
    assert sorted(plan["recompute_config"]["recompute"]) == sorted(plan["cells"])
    assert [p.name for p in net.trainable_params()] == params
    step = nn.TrainOneStepCell(net, nn.Momentum(net.trainable_params(), 0.01, 0.9))
    losses = [float(step(*inputs).asnumpy()) for _ in range(2)]
    assert all(np.isfinite(losses)) and ms.get_context("mode") == ms.GRAPH_MODE


def test_sequence_groups_join_each_parameter_cell_with_the_free_cells_after_it():
    from ms_efficient.graph.cells import CellTree, sequence_groups

    tree = CellTree.from_cells([("", "Net", 40), ("features", "SequentialCell", 30),
                                ("features.0", "Dropout", 0), ("features.1", "Conv2d", 10),
                                ("features.2", "ReLU", 0), ("features.3", "Conv2d", 10),
                                ("features.4", "ReLU", 0), ("features.5", "MaxPool2d", 0),
                                ("features.6", "Conv2d", 10), ("head", "Dense", 10)])
    assert sequence_groups(tree) == [["features.0", "features.1", "features.2"],
                                     ["features.3", "features.4", "features.5"],
                                     ["features.6"]]
    # a sequence with one Cell holding parameters is no sequence
    assert sequence_groups(CellTree.from_cells([("", "Net", 10), ("s", "SequentialCell", 10),
                                                ("s.0", "Dense", 10), ("s.1", "ReLU", 0)])) == []
