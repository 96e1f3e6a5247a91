"""place and shard on networks the package did not write: a deeper LLaMA (tests.user_models),
an encoder built from MindSpore's own ``nn.TransformerEncoder``, a small conv net and a
decoder with a tied embedding / LM head. Every pass plans something real or refuses saying why
it does not pay (recorded in the plans, the other passes still applied); both price the
unoptimised network with the same simulator."""
import numpy as np
import pytest

import mindspore as ms
from mindspore import nn, ops

import ms_efficient
from ms_efficient.core.config import config_from_dict
from ms_efficient.passes import PassRefused
from ms_efficient.place.problem import PlacementOptions
from tests.test_user_networks import _assert_refused
from tests.user_models import (NormMLP, PatchEncoder, classifier_with_loss,
                               llama_with_loss, wide_llama_with_loss)

pytestmark = [pytest.mark.mindspore, pytest.mark.usefixtures("shared_graphs")]
# 4 CPU workers: compute dominates the launch overhead at these sizes, so pipelining can pay
CPU4 = {"preset": "cpu-local", "devices_per_node": 4}
SLOW4 = {**CPU4, "intra_link": {"bandwidth_Bps": 2e8}}     # the same workers, 200 MB/s links


@pytest.fixture(autouse=True)
def _graph_mode():
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")


def _config(cluster, **optimize):
    return config_from_dict({"optimize": optimize, "cluster": cluster})


def _deep_llama(layers=6, batch=8, seq=32):
    return wide_llama_with_loss(layers, batch, seq)


class ConvNet(nn.Cell):
    def __init__(self):
        super().__init__()
        self.features = nn.SequentialCell([
            nn.Conv2d(3, 16, 3), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2), nn.ReLU(),
            nn.Conv2d(32, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3, stride=2), nn.ReLU()])
        self.flatten = nn.Flatten()
        self.classifier = nn.Dense(64 * 8 * 8, 10)

    def construct(self, x):
        return self.classifier(self.flatten(self.features(x)))


class TiedLM(nn.Cell):
    """Embedding and LM head share one Parameter (``head.weight = embed.embedding_table``)."""

    def __init__(self, vocab=64, hidden=32, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.CellList([nn.SequentialCell([nn.Dense(hidden, 2 * hidden), nn.GELU(),
                                                      nn.Dense(2 * hidden, hidden)])
                                   for _ in range(layers)])
        self.head = nn.Dense(hidden, vocab, has_bias=False)
        self.head.weight = self.embed.embedding_table
        self.vocab = vocab

    def construct(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return ops.reshape(self.head(x), (-1, self.vocab))


class BranchyTiedLM(TiedLM):
    """Control flow and tied weights: a data-dependent branch after each of 4 blocks (each a
    LayerNorm and two Dense: 12 Cells) and an LM head sharing the embedding table."""

    def __init__(self, vocab=64, hidden=32, layers=4):
        super().__init__(vocab, hidden, layers)
        self.blocks = nn.CellList([NormMLP(hidden) for _ in range(layers)])

    def construct(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            y = block(x)
            if y.sum() > 0:
                x = x + y
            else:
                x = x - y
        return ops.reshape(self.head(x), (-1, self.vocab))


def _branchy(batch):
    ms.set_seed(0)
    rng = np.random.default_rng(0)
    net = nn.WithLossCell(BranchyTiedLM(), nn.CrossEntropyLoss())
    ids = ms.Tensor(rng.integers(0, 64, (batch, 16)).astype(np.int32))
    labels = ms.Tensor(rng.integers(0, 64, (batch * 16,)).astype(np.int32))
    return net, (ids, labels)


_classifier = classifier_with_loss


def _conv_classifier():
    """The ConvNet with its loss and one batch of 8 images (seeded)."""
    rng = np.random.default_rng(0)
    ms.set_seed(0)
    return _classifier(ConvNet(), ms.Tensor(
        rng.standard_normal((8, 3, 32, 32)).astype(np.float32)))


def _check_shard(plan, names):
    """Memory per device at most the best baseline within the budget; the budget admits
    ZeRO-1 (or, where ZeRO-1 cannot run, is the documented share of the step)."""
    assert plan["cells"] and set(plan["cells"]) <= names
    base, budget = plan["baselines"], plan["comm_budget_s"]
    fits = [b["memory_per_device_bytes"] for b in base.values()
            if "error" not in b and b["comm_time_s"] <= budget * (1 + 1e-9)]
    if plan["budget"]["from"] == "zero1":
        assert base["zero1"]["comm_time_s"] == pytest.approx(budget, rel=1e-12)
        assert fits
    assert plan["summary"]["comm_time_s"] <= budget * (1 + 1e-6)
    assert not fits or plan["summary"]["memory_per_device_bytes"] <= min(fits) * (1 + 1e-9)
    # ... and no more than a baseline within its budget on any other mesh
    assert plan["summary"]["memory_per_device_bytes"] <= \
        plan["baseline_bound_bytes"] * (1 + 1e-9) + 1          # the summary rounds to bytes


def test_place_plans_block_stages_on_a_deeper_llama_and_both_passes_price_it_alike():
    net, inputs = _deep_llama()
    backbone = net._backbone
    for i in (0, 1):                      # a user's (or memopt's) recompute: MindSpore wrappers
        backbone.model.layers[i].recompute()
    names = {n for n, _ in net.cells_and_names()}
    # on 4 CPU workers' 2 GB/s links data parallelism beats every pipeline (place refuses,
    # see the encoder below); behind 200 MB/s links its all-reduce of ~4 MB of gradients costs
    # more than a pipeline's 128 KiB transfers, so a pipeline pays against the same devices
    # shard's mesh runs every stage: a 2-device mesh leaves the 4 workers room for 2 stages
    net, plans = ms_efficient.optimize(net, _config(SLOW4, passes=["shard", "place"],
                                                    shard_mesh="1x2"),
                                       sample_inputs=inputs)
    place, shard = plans["place"], plans["shard"]
    blocks = [f"_backbone.model.layers.{i}" for i in range(6)]
    assert len(place["stages"]) >= 2 and place["pp"] == len(place["stages"])
    assert [b for s in place["stages"] for b in s["blocks"]] == blocks   # contiguous, all
    assert all(s["blocks"] for s in place["stages"])                    # a block per stage
    assert len(place["stage_time_s"]) == len(place["stages"])
    assert 8 % (place["micro_batches"] * place["dp"]) == 0
    # each stage on a 2-device mesh: 2 stages, one copy, the 4 workers; a stage's mesh splits
    # every operator over its mp = 2 devices, so it holds 2 devices' memory
    assert (shard["mesh"]["dp"], shard["mesh"]["mp"]) == (1, 2)
    assert (place["pp"], place["dp"], place["devices"]) == (2, 1, 4)
    assert plans["summary"]["devices_needed"] == 4
    spec = _config(SLOW4).cluster_spec()
    assert place["baseline"]["capacity_bytes"] == pytest.approx(
        2 * spec.device_memory_bytes * PlacementOptions().memory_fraction, rel=1e-12)
    # judged against the best non-pipeline use of the same 4 devices, and faster than it
    base = place["baseline"]
    assert place["reason"] == "faster" and base["feasible"]
    assert place["ratio_to_baseline"] == pytest.approx(
        place["step_time_s"] / base["step_time_s"], rel=1e-12)
    assert place["ratio_to_baseline"] < 1.0
    assert base["step_time_s"] <= place["meta"]["one_stage_s"] * (1 + 1e-9)
    assert max(place["stage_time_s"]) <= place["step_time_s"]
    cells = place["cells"]
    assert set(cells) <= names and not any("_recompute_cell" in c for c in cells)
    for stage in place["stages"]:
        for block in stage["blocks"]:
            assert cells[block]["pipeline_stage"] == stage["stage"]
            assert all(v["pipeline_stage"] == stage["stage"] for c, v in cells.items()
                       if c.startswith(block + "."))
    # one simulator: the same unoptimised figures in both plans, and place's one stage is it
    assert place["unoptimised"] == shard["unoptimised"]
    assert place["meta"]["one_stage_s"] == pytest.approx(
        place["unoptimised"]["step_time_s"], rel=1e-9)
    _check_shard(shard, names)
    step = nn.TrainOneStepCell(net, nn.Adam(net.trainable_params(), 1e-3))
    losses = [float(step(*inputs).asnumpy()) for _ in range(2)]
    assert all(np.isfinite(losses))


def test_place_replicates_a_pipeline_when_pp_x_dp_beats_both_on_8_workers():
    """8 CPU workers behind 1 GB/s links: data parallel over 8 pays the all-reduce of ~4 MB, a
    pure 6-stage pipeline its bubble; 4 stages x 2 copies (each stage all-reduced over its 2
    copies) beat both. The plan, the summary and MindSpore's settings all read pp x dp."""
    from ms_efficient.parallel.settings import settings_from_plans

    net, inputs = _deep_llama()
    cluster = {"preset": "cpu-local", "devices_per_node": 8, "intra_link": {"bandwidth_Bps": 1e9}}
    net, plans = ms_efficient.optimize(net, _config(cluster, passes=["place"]),
                                       sample_inputs=inputs)
    place, summary = plans["place"], plans["summary"]
    assert (place["pp"], place["dp"], place["shape"]) == (4, 2, "4x2")
    assert place["devices"] == 8 and place["parallel_config"]["data_parallel"] == 2
    assert place["reason"] == "faster" and place["baseline"]["label"] == \
        "data parallel over 8 devices"
    pure = [r for r in place["candidates"] if r["dp"] == 1]
    assert place["step_time_s"] < min(r["step_time_s"] for r in pure)       # beats pure pp
    assert place["ratio_to_baseline"] < 1.0                                 # and pure dp
    assert [s["devices"] for s in place["stages"]] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert all(s["sync_s"] > 0 for s in place["stages"])
    # the summary: each stage on its two copies' devices, the pipeline's step
    assert [d["devices"] for d in summary["devices"]] == [s["devices"] for s in place["stages"]]
    assert summary["devices_needed"] == 8
    assert summary["step_time_s"] == pytest.approx(place["step_time_s"], rel=1e-9)
    # MindSpore's settings: 4 stages x dp 2 = 8 ranks, each copy splits its 4 samples in M
    settings = settings_from_plans(plans, [tuple(t.shape) for t in inputs])
    assert (settings.devices, settings.stages, settings.dp) == (8, 4, 2)
    assert settings.micro_batches == place["micro_batches"]


# a 3-layer LLaMA of hidden 32 on a batch of 2: too small for any gradient all-reduce or
# stage-to-stage transfer to pay, so the best use of the 8 devices is one of them
NOT_PAY = (r"^place: pipelining does not pay on 'ascend910b-1x8': the best pipeline \dx\d "
           r"\(\d stages x \d data-parallel cop(y|ies), \d+ micro-batch(es)?\) takes "
           r"[\d.]+x the step time of one device \([\d.]+ ms against [\d.]+ ms per step, "
           r"[\d.e-]+ ms slower")


def test_place_says_by_how_much_pipelining_loses_on_a_small_llama():
    net, inputs = llama_with_loss(num_layers=3)
    _assert_refused(net, _config({"preset": "ascend910b-1x8"}, passes=["place"]), inputs,
                    "place", NOT_PAY)
    # a config error is not a refusal: it raises without strict too
    with pytest.raises(ValueError, match=r"'optimize.micro_batches' must divide the batch size "
                                         r"2 \(or be 0 to let the place pass choose\), but got 3"):
        ms_efficient.optimize(net, _config({"preset": "ascend910b-1x8"}, passes=["place"],
                                           micro_batches=3), sample_inputs=inputs)


def test_shard_picks_a_data_parallel_mesh_for_a_cnn_and_place_says_it_has_no_blocks():
    net, inputs = _conv_classifier()
    names = {n for n, _ in net.cells_and_names()}
    cfg = _config({"preset": "ascend910b-1x8"}, passes=["shard"])
    net, plans = ms_efficient.optimize(net, cfg, sample_inputs=inputs)
    plan = plans["shard"]
    assert plan["mesh"]["dp"] > plan["mesh"]["mp"]                    # not 1x8 model-parallel
    assert {r["mesh"] for r in plan["meshes"]} == {"8x1", "4x2", "2x4", "1x8"}
    _check_shard(plan, names)
    assert plan["budget"]["from"] == "zero1"
    _assert_refused(net, _config({"preset": "ascend910b-1x8"}, passes=["place"]), inputs,
                    "place", "^place: found 0 repeated blocks in WithLossCell")


def test_an_nn_transformer_encoder_is_sharded_and_staged_by_its_layers():
    rng = np.random.default_rng(0)
    ms.set_seed(0)
    net, inputs = _classifier(PatchEncoder(), ms.Tensor(
        rng.standard_normal((8, 16, 48)).astype(np.float32)))
    names = {n for n, _ in net.cells_and_names()}
    net, plans = ms_efficient.optimize(net, _config({"preset": "ascend910b-1x8"},
                                                    passes=["shard"]), sample_inputs=inputs)
    _check_shard(plans["shard"], names)
    # place on 4 CPU workers: its 4 layers are blocks, but data parallelism over the same 4
    # workers is faster than the best pipeline (2 stages x 2 copies): a refusal with figures
    placed = _assert_refused(net, _config(CPU4, passes=["place"]), inputs, "place",
                             r"^place: pipelining does not pay on 'cpu-local': the best "
                             r"pipeline 2x2 \(2 stages x 2 data-parallel copies, 1 micro-batch\) "
                             r"takes [\d.]+x the step time of data parallel over 4 devices "
                             r"\([\d.]+ ms against [\d.]+ ms per step, [\d.]+ ms slower")
    slower = float(placed["place"]["refused"].split(" takes ")[1].split("x ")[0])
    assert 1.0 < slower < 1.2
    # the summary is the unoptimised price: the network is unchanged, its blocks are named
    assert placed["summary"]["refused"] == ["place"] and placed["summary"]["passes"] == []
    assert placed["summary"]["step_time_s"] == pytest.approx(
        placed["summary"]["unoptimised"]["step_time_s"], rel=1e-9)
    assert not any(hasattr(c, "pipeline_stage") for _, c in net.cells_and_names())


def test_a_tied_embedding_and_head_get_one_strategy_on_both_primitives():
    ms.set_seed(0)
    rng = np.random.default_rng(0)
    net = nn.WithLossCell(TiedLM(), nn.CrossEntropyLoss())
    ids = ms.Tensor(rng.integers(0, 64, (8, 16)).astype(np.int32))
    labels = ms.Tensor(rng.integers(0, 64, (128,)).astype(np.int32))
    names = {n for n, _ in net.cells_and_names()}
    net, plans = ms_efficient.optimize(net, _config({"preset": "ascend910b-1x8"},
                                                    passes=["shard"], shard_mesh="1x8"),
                                       sample_inputs=(ids, labels))
    plan = plans["shard"]
    assert plan["meshes"][0]["mesh"] == "1x8" and len(plan["meshes"]) == 1
    tied = plan["tied"]["embed.embedding_table"]
    assert tied["uses"] == ["_backbone.embed", "_backbone.head"] and tied["consistent"]
    cells = plan["cells"]
    table_at_gather = cells["_backbone.embed"]["shard"]["gather"][0]
    table_at_head = cells["_backbone.head"]["shard"]["matmul"][1]
    assert table_at_gather == table_at_head == tied["in_strategy"][0] != [1, 1]   # split
    _check_shard(plan, names)


def test_memopt_plans_segments_of_a_cnn_sequence_after_shard_and_it_still_trains():
    net, inputs = _conv_classifier()
    names = {n for n, _ in net.cells_and_names()}
    params = [p.name for p in net.trainable_params()]
    net, plans = ms_efficient.optimize(
        net, _config({"preset": "ascend910b-1x8"}, passes=["shard", "memopt"],
                     memory_budget="90%"), sample_inputs=inputs)
    plan = plans["memopt"]
    # units: segments of features' (Conv2d, ReLU) pairs, not single Conv2d Cells
    assert [c for seg in plan["segments"] for c in seg] == \
        [f"_backbone.features.{i}" for i in range(8)]
    assert all(len(layer["cells"]) >= 4 for layer in plan["layers"])
    assert set(plan["cells"]) <= names and plan["cells"]
    assert plan["simulated"]["peak_bytes"] <= plan["budget_bytes"] < \
        plan["unoptimised_peak_bytes"]
    # the combined report prices the same segments: its peak is memopt's
    assert plans["summary"]["peak_memory_bytes"] == plan["simulated"]["peak_bytes"]
    assert [p.name for p in net.trainable_params()] == params
    step = nn.TrainOneStepCell(net, nn.Adam(net.trainable_params(), 1e-3))
    losses = [float(step(*inputs).asnumpy()) for _ in range(2)]
    assert all(np.isfinite(losses))


def _strategies(net):
    """{Cell path.attribute: in_strategy} of every primitive of ``net`` that has one."""
    return {f"{path}.{attr}": prim.attrs["in_strategy"]
            for path, cell in net.cells_and_names()
            for attr, prim in getattr(cell, "_primitives", {}).items()
            if prim is not None and prim.attrs.get("in_strategy") is not None}


def test_place_refusing_keeps_the_memopt_and_shard_plans_applied(caplog):
    """Issue 33 item 4: passes [memopt, shard, place] on a small LLaMA where place correctly
    says a pipeline does not pay: place is recorded as refused, memopt's recompute and shard's
    strategies stay applied, the summary combines the two; strict=True raises."""
    import logging

    cfg = _config({"preset": "ascend910b-1x8"}, passes=["memopt", "shard", "place"],
                  memory_budget="90%")
    net, inputs = llama_with_loss(num_layers=3)
    with caplog.at_level(logging.WARNING, logger="ms_efficient.passes"):
        net, plans = ms_efficient.optimize(net, cfg, sample_inputs=inputs)
    assert list(plans) == ["memopt", "shard", "place", "summary"]
    assert set(plans["place"]) == {"refused"}
    # shard's mesh takes the 8 devices: no room for a pipeline of meshes
    assert plans["place"]["refused"].startswith(
        f"place: shard's {plans['shard']['mesh']['dp']}x{plans['shard']['mesh']['mp']} mesh "
        f"runs every pipeline stage and takes 8 of the 8 devices of 'ascend910b-1x8': no room "
        f"for a second stage.")
    assert plans["place"]["refused"] in caplog.text
    memopt, shard, summary = plans["memopt"], plans["shard"], plans["summary"]
    # both applied: recompute on the planned blocks, the strategies on the primitives
    cells = dict(net.cells_and_names())
    recomputed = {p for p, c in cells.items() if "output_recompute" in c.get_flags()}
    assert recomputed and recomputed == {p for p, a in memopt["cells"].items()
                                         if a["recompute"]}
    set_on = _strategies(net)
    assert set_on and {k: [list(t) for t in v] for k, v in set_on.items()} == {
        f"{path}.{attr}": st for path, e in shard["cells"].items()
        for attr, st in e["shard"].items()}
    assert any(f > 1 for st in set_on.values() for t in st for f in t)      # a real split
    assert not any(hasattr(c, "pipeline_stage") for c in cells.values())    # no stage set
    # the summary: the two applied passes, the refusal named, figures as without place
    assert summary["passes"] == ["memopt", "shard"] and summary["refused"] == ["place"]
    assert summary["comm_time_s"] == shard["summary"]["comm_time_s"] > 0
    assert summary["devices_needed"] == shard["mesh"]["dp"] * shard["mesh"]["mp"]
    net2, inputs2 = llama_with_loss(num_layers=3)
    _, without = ms_efficient.optimize(net2, _config({"preset": "ascend910b-1x8"},
                                                     passes=["memopt", "shard"],
                                                     memory_budget="90%"),
                                       sample_inputs=inputs2)
    assert without["summary"]["refused"] == []
    for key in ("step_time_s", "peak_memory_bytes", "comm_time_s", "devices", "unoptimised"):
        assert summary[key] == without["summary"][key], key
    # strict: the refusal raises, as before this change
    net3, inputs3 = llama_with_loss(num_layers=3)
    with pytest.raises(PassRefused, match="no room for a second stage"):
        ms_efficient.optimize(net3, cfg, sample_inputs=inputs3, strict=True)


def test_a_shard_plan_that_splits_nothing_is_a_refusal_not_12_changed_cells():
    """Issue 33 item 4: on a network with control flow and tied weights at batch 2 the shard
    plan of ascend910b-1x8 gives every one of the 12 Cells' primitives an all-ones strategy
    (nothing split): a refusal with its reason, no strategy set. At batch 8 the same
    network's plan splits, and applies."""
    net, inputs = _branchy(2)
    plans = _assert_refused(net, _config({"preset": "ascend910b-1x8"}, passes=["shard"]),
                            inputs, "shard",
                            r"^shard: the plan on the 1x8 mesh splits no dimension: all 20 "
                            r"strategies it would set \(_backbone\.blocks\.0\.fc1\.bias_add "
                            r"\[\[1, 1\], \[1\]\], \.\.\.\) are all ones, so every device "
                            r"would run the whole network, as without the pass; nothing to set\.$")
    assert plans["summary"]["passes"] == [] and plans["summary"]["refused"] == ["shard"]
    assert _strategies(net) == {}                         # refused before setting anything
    net, inputs = _branchy(8)
    _, plans = ms_efficient.optimize(net, _config({"preset": "ascend910b-1x8"},
                                                  passes=["shard"]), sample_inputs=inputs)
    shard = plans["shard"]
    assert len(shard["cells"]) == 12 and (shard["mesh"]["dp"], shard["mesh"]["mp"]) == (4, 2)
    assert all(any(f > 1 for st in entry["shard"].values() for t in st for f in t)
               for entry in shard["cells"].values())      # every Cell it names is split
