"""The launch bundle (``ms-efficient plan bundle``): strategy.json, a MindFormers-style
run.yaml and an msrun launch.sh. The YAML is checked against MindFormers' documented formats,
written down here as a schema from these pages:

- Configuration File Descriptions (parallel_config, moe_config, recompute_config tables and
  "device_num = data_parallel x model_parallel x context_parallel x pipeline_stage"):
  https://www.mindspore.cn/mindformers/docs/en/dev/appendix/conf_files.html
  (source: mindspore-ai/docs, docs/mindformers/docs/source_en/appendix/conf_files.md)
- TransformerOpParallelConfig, the class ``parallel_config`` is read into (data_parallel,
  model_parallel, expert_parallel, pipeline_stage, micro_batch_num, use_seq_parallel,
  gradient_aggregation_group, vocab_emb_dp): MindFormers source
  mindformers/modules/transformer/transformer.py
- Memory Optimization, recompute_config (``recompute``: bool, or one layer count per
  pipeline stage): https://www.mindspore.cn/mindformers/docs/en/r1.9.0/feature/memory_optimization.html
- Fine-Grained Activations SWAP (swap_config: swap, default_prefetch, layer_swap entries
  {backward_prefetch, layers}, op_swap entries {op_name, backward_prefetch, layers}; with swap
  on, ``recompute`` is a bool or a list of layer indices):
  https://www.mindspore.cn/mindformers/docs/en/r1.5.0/function/fine_grained_activations_swap.html
"""
import json
import os
import subprocess
import sys

import pytest
import yaml

from ms_efficient.parallel.bundle import recompute_config, swap_config
from ms_efficient.parallel.settings import ParallelSettings

pytestmark = pytest.mark.usefixtures("shared_graphs")      # tests/graph_cache.py


def _int(v):
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _int_list(v):
    return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool)
                                       and x >= 0 for x in v)


PARALLEL_CONFIG = {"data_parallel": _int, "model_parallel": _int, "pipeline_stage": _int,
                   "micro_batch_num": _int, "expert_parallel": _int,
                   "use_seq_parallel": lambda v: isinstance(v, bool),
                   "vocab_emb_dp": lambda v: isinstance(v, bool),
                   "gradient_aggregation_group": _int}
RECOMPUTE_FLAGS = {"select_recompute": (bool, list),
                   "parallel_optimizer_comm_recompute": (bool, list),
                   "mp_comm_recompute": (bool,), "recompute_slice_activation": (bool,)}
MOE_CONFIG = {"expert_num": _int, "num_experts_chosen": _int,
              "capacity_factor": lambda v: isinstance(v, (int, float)) and v >= 1.0,
              "aux_loss_factor": lambda v: isinstance(v, (int, float)) and v >= 0}
LAYER_SWAP_KEYS = {"backward_prefetch", "layers"}
# 8 CPU workers behind 200 MB/s links: a pipeline of shard's 2x1 meshes beats data parallelism
# over the 4 mesh slots there (at the preset's 2 GB/s the place pass refuses: the all-reduce
# is cheaper than the bubble)
SLOW8 = {"preset": "cpu-local", "devices_per_node": 8, "intra_link": {"bandwidth_Bps": 2e8}}
OP_SWAP_KEYS = {"op_name", "backward_prefetch", "layers"}


def mindformers_violations(doc, device_num, num_layers):
    """Every way ``doc`` breaks the documented formats (module docstring), as messages."""
    bad = []
    pc = doc.get("parallel_config", {})
    for key, ok in PARALLEL_CONFIG.items():
        if key not in pc or not ok(pc[key]):
            bad.append(f"parallel_config.{key} = {pc.get(key)!r}")
    unknown = set(pc) - set(PARALLEL_CONFIG)
    bad += [f"parallel_config.{k} is not a documented field" for k in sorted(unknown)]
    if not bad:
        if pc["data_parallel"] * pc["model_parallel"] * pc["pipeline_stage"] != device_num:
            bad.append("device_num != data_parallel x model_parallel x pipeline_stage")
        if pc["pipeline_stage"] > 1 and pc["micro_batch_num"] < pc["pipeline_stage"]:
            bad.append("micro_batch_num < pipeline_stage")
    rc = doc.get("recompute_config", {})
    sc = doc.get("swap_config", {})
    swap_on = sc.get("swap") is True
    r = rc.get("recompute")
    if swap_on:
        if not (isinstance(r, bool) or (_int_list(r) and all(x < num_layers for x in r))):
            bad.append(f"recompute {r!r}: with swap on, a bool or a list of layer indices")
    elif not (isinstance(r, bool) or (_int_list(r) and len(r) == pc.get("pipeline_stage"))):
        bad.append(f"recompute {r!r}: a bool or one layer count per pipeline stage")
    for key, types in RECOMPUTE_FLAGS.items():
        if not isinstance(rc.get(key), types):
            bad.append(f"recompute_config.{key} = {rc.get(key)!r}")
    if not isinstance(sc.get("swap"), bool) or not _int(sc.get("default_prefetch")):
        bad.append(f"swap_config swap/default_prefetch = {sc.get('swap')!r}/"
                   f"{sc.get('default_prefetch')!r}")
    for key, fields in (("layer_swap", LAYER_SWAP_KEYS), ("op_swap", OP_SWAP_KEYS)):
        entries = sc.get(key)
        if entries is None:
            continue
        if not isinstance(entries, list):
            bad.append(f"swap_config.{key} must be None or a list")
            continue
        for e in entries:
            if not isinstance(e, dict) or set(e) != fields:
                bad.append(f"swap_config.{key} entry {e!r} must have exactly {sorted(fields)}")
            elif not (isinstance(e["backward_prefetch"], int) and _int_list(e["layers"])
                      and all(x < num_layers for x in e["layers"])):
                bad.append(f"swap_config.{key} entry {e!r}: int prefetch, layer indices")
    if "moe_config" in doc:
        for key, ok in MOE_CONFIG.items():
            if not ok(doc["moe_config"].get(key)):
                bad.append(f"moe_config.{key} = {doc['moe_config'].get(key)!r}")
    return bad


def _settings(stages=2, layers=4, prefix="m.layers"):
    per = layers // stages
    return ParallelSettings(devices=2 * stages, stages=stages, micro_batches=stages, dp=2, mp=1,
                            batch=8, stage_config={f"{prefix}.{i}": i // per
                                                   for i in range(layers)})


def _memopt(*actions, **extra):
    rows = [{"name": f"m.layers.{i}", "action": a} for i, a in enumerate(actions)]
    return {"layers": rows + [{"name": n, **e} for n, e in extra.items()]}


def test_the_schema_catches_the_formats_mindformers_does_not_read():
    doc = {"parallel_config": {"data_parallel": 2, "model_parallel": 1, "pipeline_stage": 2,
                               "micro_batch_num": 1, "expert_parallel": 1,
                               "use_seq_parallel": False, "vocab_emb_dp": True,
                               "gradient_aggregation_group": 4},
           "recompute_config": {"recompute": ["m.layers.0"], "select_recompute": False,
                                "parallel_optimizer_comm_recompute": False,
                                "mp_comm_recompute": True, "recompute_slice_activation": False},
           "swap_config": {"swap": True, "default_prefetch": 1, "layer_swap": None,
                           "op_swap": [{"op_name": "m.layers.1", "backward_prefetch": 1,
                                        "swap_out_delay": 0}]}}
    bad = mindformers_violations(doc, device_num=4, num_layers=4)
    assert "micro_batch_num < pipeline_stage" in bad
    assert any(b.startswith("recompute ['m.layers.0']") for b in bad)      # Cell names
    assert any("op_swap entry" in b and "exactly" in b for b in bad)        # unknown fields


def test_recompute_is_one_count_per_stage_from_the_front():
    notes = []
    rc = recompute_config(_memopt("recompute", "keep", "recompute-all", "keep"),
                          _settings(), swap_on=False, notes=notes)
    assert rc["recompute"] == [1, 1] and notes == []
    # layer 1 is not the first of stage 0: the count form cannot say so, and the notes do
    rc = recompute_config(_memopt("keep", "recompute", "keep", "keep"), _settings(),
                          swap_on=False, notes=notes)
    assert rc["recompute"] == [1, 0]
    assert notes and "stage 0 recomputes layers [1]" in notes[0]


def test_swapped_layers_and_cells_become_layer_swap_and_op_swap_entries():
    memopt = _memopt("recompute", "keep", "keep", "swap")
    memopt["layers"][3]["prefetch_lead"] = 2
    memopt["layers"].append({"name": "m.layers.1.mlp", "action": "swap", "prefetch_lead": 1})
    sc = swap_config(memopt)
    assert sc == {"swap": True, "default_prefetch": 1,
                  "layer_swap": [{"backward_prefetch": 2, "layers": [3]}],
                  "op_swap": [{"op_name": "mlp", "backward_prefetch": 1, "layers": [1]}]}
    # with swap on, MindFormers reads recompute as layer indices, stage-agnostic
    rc = recompute_config(memopt, _settings(), swap_on=True, notes=[])
    assert rc["recompute"] == [0]


ms = pytest.importorskip("mindspore")


@pytest.mark.mindspore
def test_the_bundle_of_a_planned_user_network_follows_the_documented_formats(tmp_path):
    import numpy as np
    from mindspore import nn

    import ms_efficient
    from ms_efficient.core.config import config_from_dict
    from ms_efficient.parallel.bundle import write_bundle
    from tests.user_models import LlamaForCausalLM

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    ms.set_seed(0)
    net = nn.WithLossCell(LlamaForCausalLM(vocab_size=64, hidden_size=128, num_heads=4,
                                           intermediate_size=256, num_layers=4),
                          nn.CrossEntropyLoss())
    rng = np.random.default_rng(0)
    inputs = (ms.Tensor(rng.integers(0, 64, (8, 32)).astype(np.int32)),
              ms.Tensor(rng.integers(0, 64, (256,)).astype(np.int32)))
    # planned for Ascend (memopt may swap there), on one node of 8 devices
    cfg = config_from_dict({"context": {"device_target": "Ascend"},
                            "optimize": {"passes": ["shard", "place", "memopt"],
                                         "shard_mesh": "2x1", "micro_batches": 4,
                                         "memory_budget": "70%"},
                            "cluster": SLOW8})
    net, plans = ms_efficient.optimize(net, cfg, sample_inputs=inputs)
    wrapper = ms_efficient.parallelize(net, plans, inputs)
    bundle = write_bundle(str(tmp_path / "b"), plans, wrapper.settings, devices_per_node=8)
    doc = yaml.safe_load(open(bundle.files["run.yaml"]))
    assert mindformers_violations(doc, device_num=8, num_layers=4) == []
    pc = doc["parallel_config"]
    assert (pc["pipeline_stage"], pc["micro_batch_num"]) == (len(plans["place"]["stages"]),
                                                              plans["place"]["micro_batches"])
    assert (pc["data_parallel"], pc["model_parallel"]) == (2, 1)
    # the memopt plan's swaps and recomputes, by layer index
    actions = {int(e["name"].split(".")[-1]): e["action"] for e in plans["memopt"]["layers"]}
    swapped = sorted(i for i, a in actions.items() if a == "swap")
    assert doc["swap_config"]["swap"] == bool(swapped)
    assert sorted(x for e in doc["swap_config"]["layer_swap"] or [] for x in e["layers"]) == swapped
    # strategy.json: every item carries the stage of the Cell it belongs to
    js = json.load(open(bundle.files["strategy.json"]))
    stage_of = {p: e["pipeline_stage"] for p, e in plans["place"]["cells"].items()}
    for key, rec in plans["shard"]["applied"].items():
        cell = key.rsplit(".", 1)[0]
        item = js["parallel_strategy_item"][f"{rec['prim']}_{rec['params'][0][0]}"]
        assert item["stage"] == stage_of[cell]
    assert {i["stage"] for i in js["parallel_strategy_item"].values()} == set(range(4))
    # MindSpore's own validation of the `parallel` section (set_auto_parallel_context; in a
    # child process: the context is global); MindFormers turns parallel_mode 1 into semi-auto
    code = ("import sys, yaml, mindspore as ms\n"
            "par = yaml.safe_load(open(sys.argv[1]))['parallel']\n"
            "assert par.pop('parallel_mode') == 1\n"
            "ms.set_auto_parallel_context(parallel_mode='semi_auto_parallel', **par)\n"
            "print(ms.get_auto_parallel_context('enable_parallel_optimizer'),"
            " ms.get_auto_parallel_context('strategy_ckpt_config')['load_file'])\n")
    child = subprocess.run([sys.executable, "-c", code, bundle.files["run.yaml"]],
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split()[-2:] == [str(wrapper.settings.optimizer_level is not None),
                                         "./strategy.json"]
    script = open(bundle.files["launch.sh"]).read()
    assert "--worker_num=8 --local_worker_num=8" in script
    assert subprocess.run(["bash", "-n", bundle.files["launch.sh"]]).returncode == 0
    assert os.access(bundle.files["launch.sh"], os.X_OK)


@pytest.mark.mindspore
def test_plan_bundle_on_the_reference_model(tmp_path):
    from ms_efficient.cli import main

    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({
        "context": {"mode": "GRAPH_MODE", "device_target": "CPU", "seed": 1},
        "model": {"vocab_size": 64, "seq_length": 64, "hidden_size": 256, "num_layers": 4,
                  "num_heads": 4, "ffn_hidden_size": 512},
        "moe": {"num_experts": 4, "top_k": 2, "capacity_factor": 1.25, "moe_every": 2},
        "train": {"batch_size": 16},
        "cluster": SLOW8,
        "optimize": {"passes": ["shard", "place"], "shard_mesh": "2x1", "micro_batches": 4}}))
    out = tmp_path / "bundle"
    assert main(["plan", "bundle", str(cfg), "--out", str(out)]) == 0
    doc = yaml.safe_load(open(out / "run.yaml"))
    assert mindformers_violations(doc, device_num=8, num_layers=4) == []
    assert doc["moe_config"] == {"expert_num": 4, "num_experts_chosen": 2,
                                 "capacity_factor": 1.25, "aux_loss_factor": 0.01}
    assert doc["parallel"]["enable_alltoall"] is True
    assert sorted(os.listdir(out)) == ["launch.sh", "run.yaml", "strategy.json"]


def test_plan_bundle_without_shard_or_place_names_the_field(tmp_path, capsys):
    from ms_efficient.cli import main

    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"optimize": {"passes": ["memopt"]}}))
    assert main(["plan", "bundle", str(cfg), "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "'optimize.passes'" in err and "shard and/or place" in err
    assert not (tmp_path / "b").exists()


@pytest.mark.mindspore
def test_plan_bundle_whose_passes_all_refuse_fails_naming_the_refusal(tmp_path, capsys):
    from ms_efficient.cli import main

    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({
        "context": {"mode": "GRAPH_MODE", "device_target": "CPU", "seed": 1},
        "model": {"vocab_size": 64, "seq_length": 16, "hidden_size": 32, "num_layers": 2,
                  "num_heads": 2, "ffn_hidden_size": 64},
        "moe": {"num_experts": 4, "top_k": 2},
        "train": {"batch_size": 4},
        "cluster": {"preset": "cpu-local", "devices_per_node": 1},
        "optimize": {"passes": ["place"]}}))
    # place refuses on one device; optimize records it, and with nothing applied there is
    # nothing to launch: a failure, not a bundle of no plan
    assert main(["plan", "bundle", str(cfg), "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert f"'optimize.passes' of {cfg} is ['place'], but no pass a launch bundle needs " \
           f"applied (place refused: place: cluster 'cpu-local' has 1 device; pipeline " \
           f"stages need >= 2" in err and "nothing to launch" in err
    assert not (tmp_path / "b").exists()


def test_a_plan_action_the_bundle_cannot_express_is_refused():
    settings = ParallelSettings(devices=1, stages=1, micro_batches=1, dp=1, mp=1, batch=8)
    plan = {"layers": [{"name": "blocks.0", "action": "recompute", "prefetch_lead": 1},
                       {"name": "blocks.1", "action": "recompute-offload", "prefetch_lead": 1}]}
    with pytest.raises(ValueError, match="memopt plan layer 'blocks.1' has action "
                                         "'recompute-offload'"):
        recompute_config(plan, settings, False, [])
    plan["layers"].pop()
    assert recompute_config(plan, settings, False, [])["recompute"] == [1]   # one layer, 1 stage
