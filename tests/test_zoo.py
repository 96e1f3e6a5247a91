"""The zoo (issue 33 item 5): six networks the package did not write (``tests/zoo.py``: a
LLaMA-shaped decoder with biased q/k/v, an nn.TransformerEncoder encoder, a GPT whose own MoE
blocks ``adopt_moe`` replaced, mindcv's resnet18, a small mindcv ViT, mobilenet_v2) x the pass
sets {memopt}, {shard}, {place}, {shard, place, memopt}, each ``optimize(..., verify=True)``
on ascend910b-1x8. Every case's outcome is pinned: the plan the compiled graph was checked
against (its units, recomputed Cells and node counts, mesh, strategies, primitives) or the
pass's refusal with its cause and figures.

Each network's graph is extracted once for its four cases (``optimize(..., graph=...)``) and
each case is compiled once for the check. The mindcv networks run in one child process
(``scripts/zoo.py``) in the background thread (tests/workers.py): mindcv's Cells must not
outlive MindSpore at interpreter exit. The network of the resnet18's last case then trains 2
steps (what tests/test_user_networks.py's resnet18 child checked before)."""
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import workers
from ms_efficient.verify.plugin import RECORD_ENV
from tests import zoo

# verify=True builds the check's graph pass with g++ (tests/test_verify.py)
pytestmark = [pytest.mark.mindspore,
              pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")]

# --- pinned outcomes ----------------------------------------------------------------------
# memopt alone and after shard (one device's share): (units, {Cell: action}, {Cell: recomputed
# nodes in the compiled graph}, ops every recomputed Cell's copies include)
_L, _E, _H = "_backbone.model.layers", "_backbone.encoder.layers", "_backbone.h"
RESNET_BLOCKS = [f"_backbone.layer{i}.{j}" for i in range(1, 5) for j in range(2)]
MEMOPT = {
    "llama": ([f"{_L}.0", f"{_L}.1"], {f"{_L}.0": "recompute"}, {f"{_L}.0": 43},
              {"BiasAdd", "MatMul", "Softmax", "SiLU", "Rsqrt"}),
    "encoder": ([f"{_E}.0", f"{_E}.1"], {f"{_E}.0": "recompute"}, {f"{_E}.0": 62},
                {"BiasAdd", "MatMul", "Softmax", "LayerNorm", "ReLU"}),
    # the adopted MoE layer is re-run with its block: routing (TopK), experts (BatchMatMul)
    "moe_gpt": ([f"{_H}.0", f"{_H}.1"], {f"{_H}.0": "recompute"}, {f"{_H}.0": 63},
                {"BatchMatMul", "TopK", "GeLU", "LayerNorm", "Softmax"}),
    "resnet18": (RESNET_BLOCKS,
                 {"_backbone.layer1.0": "recompute-all", "_backbone.layer1.1": "recompute",
                  "_backbone.layer3.1": "recompute"},
                 {"_backbone.layer1.0": 8, "_backbone.layer1.1": 9, "_backbone.layer3.1": 8},
                 {"Conv2D", "BatchNorm", "ReLU"}),
    # the attention's BatchMatMul, Softmax and the q/k/v Unstack are re-run
    "vit": (["_backbone.blocks.0", "_backbone.blocks.1"], {"_backbone.blocks.0": "recompute"},
            {"_backbone.blocks.0": 29}, {"BatchMatMul", "Softmax", "Unstack", "LayerNorm",
                                         "GeLU"}),
    # no repeated blocks: segments of `features` (Chen et al.); features.3-4, one segment,
    # recompute-all: depthwise and pointwise Conv2D, BatchNorm, ReLU6 re-run
    "mobilenet_v2": (["_backbone.features.0", "_backbone.features.3", "_backbone.features.5",
                      "_backbone.features.7", "_backbone.features.9"],
                     {"_backbone.features.3": "recompute-all",
                      "_backbone.features.4": "recompute-all"},
                     {"_backbone.features.3": 9, "_backbone.features.4": 14},
                     {"Conv2D", "BatchNorm", "ReLU6"}),
}
# shard alone and first of all: (mesh, strategies set, their primitives, op types kept whole,
# {Cell: strategies} pinned)
SHARD = {
    "llama": ("8x1", 22, {"Gather", "MatMul", "BiasAdd"}, {},
              {"_backbone.model.embed_tokens": {"gather": [[1, 1], [8]]},
               f"{_L}.1.self_attn.v_proj": {"matmul": [[8, 1], [1, 1]],
                                            "bias_add": [[8, 1], [1]]}}),
    "encoder": ("8x1", 16, {"MatMul", "BiasAdd", "LayerNorm"}, {},
                {f"{_E}.0.norm1": {"layer_norm": [[8, 1, 1], [1], [1]]},
                 f"{_E}.1.dense2": {"matmul": [[8, 1], [1, 1]], "bias_add": [[8, 1], [1]]}}),
    # the routing's ops are kept whole; wpe gathers constant position ids: no strategy
    "moe_gpt": ("4x2", 19, {"Gather", "MatMul", "BiasAdd", "LayerNorm", "BatchMatMul"},
                {"Gather": 5, "StridedSlice": 6, "TopK": 2, "OneHot": 2,
                 "CumSum": 2, "TensorScatterUpdate": 2, "AddN": 4},
                {"_backbone.wte": {"gather": [[1, 2], [4]]},
                 f"{_H}.0.mlp.moe": {"bmm": [[2, 1, 1], [2, 1, 1]]},
                 f"{_H}.1.attn.c_attn": {"matmul": [[4, 1], [2, 1]], "bias_add": [[4, 2], [2]]}}),
    # the residual `out += identity` (InplaceAddExt) splits with the batch
    "resnet18": ("8x1", 22, {"Conv2D", "MatMul", "BiasAdd"}, {},
                 {"_backbone.conv1": {"conv2d": [[8, 1, 1, 1], [1, 1, 1, 1]]},
                  "_backbone.classifier": {"matmul": [[8, 1], [1, 1]],
                                           "bias_add": [[8, 1], [1]]}}),
    # the class token's BroadcastTo and the head's x[:, 0] are kept whole; the Concat of class
    # token and patches joins its tuple's tensors along the tokens (a source per element),
    # so the batch split reaches the blocks
    "vit": ("8x1", 25, {"Conv2D", "MatMul", "BiasAdd", "LayerNorm"},
            {"BroadcastTo": 1, "StridedSlice": 1},
            {"_backbone.patch_embed.proj": {"conv2d": [[8, 1, 1, 1], [1, 1, 1, 1]],
                                            "bias_add": [[8, 1, 1, 1], [1]]},
             "_backbone.blocks.0.attn.qkv": {"matmul": [[8, 1], [1, 1]],
                                             "bias_add": [[8, 1], [1]]}}),
    # ReLU6 splits with its input; the depthwise Conv2D (group = channels) splits its batch
    "mobilenet_v2": ("8x1", 54, {"Conv2D", "MatMul", "BiasAdd"}, {},
                     {"_backbone.features.4.layers.3": {"conv2d": [[8, 1, 1, 1],
                                                                   [1, 1, 1, 1]]},
                      "_backbone.classifier.1": {"matmul": [[8, 1], [1, 1]],
                                                 "bias_add": [[8, 1], [1]]}}),
}
# place, alone and after shard: the best pipeline's step over one device's ("x.xx")
NOT_PAY = {"llama": "1.02", "encoder": "1.03", "moe_gpt": "1.01", "resnet18": "1.04",
           "vit": "1.04"}
NO_BLOCKS = ("place: found 0 repeated blocks in WithLossCell (children of one class in a "
             "CellList / SequentialCell); every pipeline stage holds one, so it needs >= 2.")
# resnet18 after shard: 99.3% of its device's peak is weights, gradients, optimizer states
RESNET_ALL_MEMOPT = (r"^'optimize.memory_budget' \(99%, 40.27 MiB\) is below the feasible "
                     r"floor 99.3% \(40.35 MiB\) of the unoptimised peak 40.67 MiB: .* \(on 8x1 "
                     r"mesh\)$")


# --- the records --------------------------------------------------------------------------
_RECORDS = {}


@pytest.fixture(scope="module", params=zoo.IN_PROCESS)
def in_process(request):
    """(name, tests.zoo.run_network(name)) of a network that runs in this process, computed
    once per session."""
    name = request.param
    if name not in _RECORDS:
        _RECORDS[name] = zoo.run_network(name)
    return name, _RECORDS[name]


@workers.in_background("zoo_mindcv")
def _zoo_mindcv():
    """scripts/zoo.py on the mindcv networks in a child process, in the background
    (tests/workers.py); (CompletedProcess, records) or None without mindcv."""
    import importlib.util

    if importlib.util.find_spec("mindcv") is None:
        return None
    out = workers.temporary_dir("zoo_") / "zoo.json"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # The child inherits a record path whose folder is gone, as it would from a parent that
    # was compiling under verify when it started the child (this suite's background thread
    # did, once): the child must ignore it, not fail its next compile on it.
    env = dict(os.environ, **{RECORD_ENV: str(out.parent / "gone" / "record.json")})
    proc = subprocess.run([sys.executable, os.path.join(root, "scripts", "zoo.py"),
                           "--networks", ",".join(zoo.MINDCV), "--train", "resnet18",
                           "--json", str(out)], capture_output=True, text=True, cwd=root,
                          env=env, timeout=900)
    return proc, (json.loads(out.read_text()) if out.is_file() else None)


@pytest.fixture(scope="module")
def zoo_mindcv():
    """The mindcv networks' records; named as its background computation, so conftest queues
    it when the session starts and runs the tests reading it last."""
    proc, records = workers.background_result("zoo_mindcv",
                                              skip_if_none="mindcv is not installed")
    assert proc.returncode == 0 and records, proc.stderr[-3000:]
    return records


# --- the checks ---------------------------------------------------------------------------
def _check_memopt(name, pass_set, plan, rec):
    if (name, pass_set) == ("resnet18", "all"):
        assert set(plan) == {"refused"} and re.search(RESNET_ALL_MEMOPT, plan["refused"]), plan
        return
    units, actions, nodes, ops = MEMOPT[name]
    assert [layer["name"] for layer in plan["layers"]] == units
    assert {path: c["action"] for path, c in plan["cells"].items()} == actions
    assert set(plan["verified"]) == set(actions)
    for path, entry in plan["verified"].items():
        got = entry["recompute"]
        assert got["ok"] and got["ordered"] and entry["unchecked"] == [], (path, entry)
        assert got["recomputed_nodes"] == nodes[path], (path, got)
        assert got["recomputed_nodes"] < entry["forward_nodes"] + entry["backward_nodes"]
    rerun = {op for entry in plan["verified"].values() for op in entry["recompute"]["ops"]}
    assert ops <= rerun, rerun
    # within the budget, 90% (resnet18: 99%) of the unoptimised simulated peak
    share = float(zoo.BUDGET[name].rstrip("%")) / 100
    assert abs(plan["budget_bytes"] - share * plan["unoptimised_peak_bytes"]) <= 1
    assert plan["simulated"]["fits"]
    assert plan["simulated"]["peak_bytes"] <= plan["budget_bytes"]
    if pass_set == "all":      # after shard: one device's share of the network, less than half
        alone = rec["cases"]["memopt"]["memopt"]["unoptimised_peak_bytes"]
        assert plan["unoptimised_peak_bytes"] < alone / 2


def _check_shard(name, pass_set, plan, rec):
    mesh, count, prims, kept, pinned = SHARD[name]
    assert f"{plan['mesh']['dp']}x{plan['mesh']['mp']}" == mesh
    assert len(plan["applied"]) == count
    assert {r["prim"] for r in plan["applied"].values()} == prims
    assert plan["kept_whole"] == kept
    for path, strategies in pinned.items():
        assert plan["cells"][path]["shard"] == strategies, path
    assert "_backbone.wpe" not in plan["cells"]
    # every strategy is on its primitive in the compiled graph, every node of it carrying it
    assert set(plan["verified"]) == set(plan["cells"])
    for key, applied in plan["applied"].items():
        path, _, attr = key.rpartition(".")
        entry = plan["verified"][path]["shard"][attr]
        assert entry["ok"] and entry["primitive"] == applied["prim"], (key, entry)
        assert entry["planned"] == applied["strategy"] == plan["cells"][path]["shard"][attr]
        assert entry["seen"] and all(s == entry["planned"] for s in entry["seen"]), key
    # within ZeRO-1's communication, no more memory per device than a baseline within it
    budget = plan["comm_budget_s"]
    assert plan["budget"]["from"] == "zero1"
    assert plan["summary"]["comm_time_s"] <= budget * (1 + 1e-6)
    fits = [b["memory_per_device_bytes"] for b in plan["baselines"].values()
            if "error" not in b and b["comm_time_s"] <= budget * (1 + 1e-9)]
    assert plan["summary"]["memory_per_device_bytes"] <= min(fits) * (1 + 1e-4)
    if pass_set == "all":
        assert plan["applied"] == rec["cases"]["shard"]["shard"]["applied"]


def _check_place(name, pass_set, plan, rec):
    assert set(plan) == {"refused"}, plan
    reason = plan["refused"]
    if name == "mobilenet_v2":
        assert reason == NO_BLOCKS
        return
    if pass_set == "all":      # after shard, whose mesh takes all 8 devices: no room for stages
        mesh = rec["cases"]["all"]["shard"]["mesh"]
        assert mesh["dp"] * mesh["mp"] == 8
        assert reason == (
            f"place: shard's {mesh['dp']}x{mesh['mp']} mesh runs every pipeline stage and takes "
            f"8 of the 8 devices of 'ascend910b-1x8': no room for a second stage. To plan a "
            f"pipeline of meshes, set 'optimize.shard_mesh' to a mesh of at most 4 devices; "
            f"shard's plan alone already uses every device.")
        assert rec["cases"]["all"]["summary"]["devices_needed"] == 8
        return
    found = re.fullmatch(
        r"place: pipelining does not pay on 'ascend910b-1x8': the best pipeline 2x1 \(2 stages "
        r"x 1 data-parallel copy, 1 micro-batch\) takes (\d\.\d\d)x the step time of one device "
        r"\(([\d.]+) ms against ([\d.]+) ms per step, ([\d.]+) ms slower; both within 57.60 "
        r"GiB usable per device\); no pipeline stage to set\.", reason)
    assert found, reason
    ratio, piped, alone, slower = (float(g) for g in found.groups())
    assert found.group(1) == NOT_PAY[name]
    assert ratio == pytest.approx(piped / alone, abs=0.006)
    assert slower == pytest.approx(piped - alone, abs=2e-4)


CHECKS = {"memopt": _check_memopt, "shard": _check_shard, "place": _check_place}


def _check_case(name, pass_set, rec):
    case = rec["cases"][pass_set]
    assert "error" not in case, f"{name} x {pass_set}: {case.get('error')}"
    passes = zoo.PASS_SETS[pass_set]
    assert list(case) == passes + ["summary"]
    for pass_name in passes:
        CHECKS[pass_name](name, pass_set, case[pass_name], rec)
    refused = [p for p in passes if "refused" in case[p]]
    assert case["summary"]["refused"] == refused
    assert case["summary"]["passes"] == [p for p in passes if p not in refused]
    # one graph for the four cases, unchanged by them
    assert rec["graph_unchanged"]


@pytest.mark.parametrize("pass_set", list(zoo.PASS_SETS))
def test_every_case_of_the_in_process_networks_is_its_pinned_plan_or_refusal(in_process,
                                                                              pass_set):
    name, rec = in_process
    _check_case(name, pass_set, rec)


@pytest.mark.parametrize("name", zoo.MINDCV)
@pytest.mark.parametrize("pass_set", list(zoo.PASS_SETS))
def test_every_case_of_the_mindcv_networks_is_its_pinned_plan_or_refusal(zoo_mindcv, name,
                                                                         pass_set):
    _check_case(name, pass_set, zoo_mindcv[name])


def test_resnet18_planned_by_its_residual_blocks_still_trains(zoo_mindcv):
    """After shard (its strategies set) and the place and memopt refusals: 2 steps."""
    losses = zoo_mindcv["resnet18"]["losses"]
    assert len(losses) == 2 and all(np.isfinite(losses)), losses


@pytest.mark.parametrize("in_process", ["llama"], indirect=True)
def test_a_shared_graph_plans_as_the_networks_own_export(in_process):
    """optimize(..., graph=) plans what optimize() plans exporting the network itself."""
    import ms_efficient

    name, rec = in_process
    net, inputs = zoo.build(name)
    _, plans = ms_efficient.optimize(net, zoo.config(name, "memopt"), sample_inputs=inputs)
    shared = rec["cases"]["memopt"]["memopt"]
    assert plans["memopt"]["cells"] == shared["cells"]
    for key in ("budget_bytes", "unoptimised_peak_bytes", "simulated"):
        assert zoo._jsonable(plans["memopt"][key]) == shared[key], key


def test_a_graph_that_is_not_the_networks_train_step_is_an_error():
    import ms_efficient
    from ms_efficient.graph.opgraph import OpGraph

    net, inputs = zoo.build("llama")
    cfg = zoo.config("llama", "memopt")
    with pytest.raises(TypeError, match=r"takes the OpGraph of the network's train step, but "
                                        r"got dict"):
        ms_efficient.optimize(net, cfg, sample_inputs=inputs, graph={})
    forward = OpGraph("g", meta={"mode": "forward", "network": "WithLossCell"})
    with pytest.raises(ValueError, match=r"got graph 'g' with mode 'forward' extracted from "
                                         r"'WithLossCell', for a WithLossCell"):
        ms_efficient.optimize(net, cfg, sample_inputs=inputs, graph=forward)
    other = OpGraph("h", meta={"mode": "train", "network": "TrainOneStepCell"})
    with pytest.raises(ValueError, match=r"with mode 'train' extracted from 'TrainOneStepCell'"):
        ms_efficient.optimize(net, cfg, sample_inputs=inputs, graph=other)
