"""MPipeMoE: the chunked timeline (hand cases), chunk choice, reuse strategies, online
selection, and the chunked Cell equal to the unchunked layer."""
import numpy as np
import pytest

from ms_efficient.core.cluster import ClusterSpec, Link
from ms_efficient.mpipe.planner import (ChunkSelector, MoELayerShape, choose_chunks, choose_reuse,
                                        reuse_memory_bytes, rows_per_step, simulate_layer)


def toy_cluster(latency_s=0.0, bandwidth_Bps=1e3, flops=1e6):
    link = Link(latency_s=latency_s, bandwidth_Bps=bandwidth_Bps)
    return ClusterSpec(name="toy", nodes=1, devices_per_node=2, device_memory_bytes=10**9,
                       peak_flops={"fp32": flops}, intra_link=link, inter_link=link,
                       host_link=link)


def shape(rows=100, **kw):
    # H = 5, F = 10, fp32: a row is 20 bytes; an A2A over 2 ranks sends half of it
    base = dict(rows=rows, hidden=5, ffn_hidden=10, local_experts=1, ranks=2, dtype="fp32",
                kernel_overhead_s=0.0)
    base.update(kw)
    return MoELayerShape(**base)


def test_one_chunk_is_the_sum_of_all_phases():
    # A2A: 100 rows x 20 B, half to the peer: 1000 B at 1000 B/s = 1 s.
    # forward FFN: 2 matmuls x 2 x 100 x 5 x 10 = 20000 FLOP = 0.02 s; backward 0.04 s.
    t = simulate_layer(shape(), toy_cluster(), 1)
    assert t.time_s == pytest.approx(1 + 0.02 + 1 + 1 + 0.04 + 1)
    assert t.comm_s == pytest.approx(4.0) and t.compute_s == pytest.approx(0.06)


def test_two_chunks_overlap_the_second_dispatch_with_the_first_experts():
    # compute-heavy: flops 1e4 -> forward FFN 2 s, backward 4 s (whole layer)
    cl = toy_cluster(flops=1e4)
    one = simulate_layer(shape(), cl, 1)
    assert one.time_s == pytest.approx(1 + 2 + 1 + 1 + 4 + 1)
    two = simulate_layer(shape(), cl, 2)
    # forward: D0 0-.5, E0 .5-1.5, D1 .5-1, E1 1.5-2.5, C0 1.5-2, C1 2.5-3
    # backward: G0 3-3.5, G1 3.5-4, B0 3.5-5.5, B1 5.5-7.5, Y0 5.5-6, Y1 7.5-8
    assert two.time_s == pytest.approx(8.0)
    assert two.exposed_comm_s == pytest.approx(8.0 - 6.0)
    best, table = choose_chunks(shape(), cl)
    assert best.time_s <= table[1].time_s and best.chunks > 1


def test_latency_makes_one_chunk_best():
    # each A2A pays 1 s of latency: chunking only multiplies it
    best, table = choose_chunks(shape(), toy_cluster(latency_s=1.0, bandwidth_Bps=1e9))
    assert best.chunks == 1
    assert table[2].time_s > table[1].time_s


def test_reuse_strategies_trade_memory_for_time_and_the_budget_decides():
    s = shape()
    # 100 rows, H 5, F 10, 4 B: keep 100 x 30 x 4 = 12000 B + chunk buffers 2 x 100 x 5 x 4
    assert reuse_memory_bytes(s, 1, "keep") == 12000 + 4000
    assert reuse_memory_bytes(s, 4, "both") == 2000 + 1000
    cl = toy_cluster(flops=1e4)
    roomy, _ = choose_reuse(s, cl, 1e9)
    assert roomy.strategy == "keep"
    tight, timings = choose_reuse(s, cl, 9000)
    assert tight.memory_bytes <= 9000 and tight.strategy != "keep"
    assert tight.time_s == min(t.time_s for t in timings if t.memory_bytes <= 9000)
    with pytest.raises(ValueError, match="below the least memory"):
        choose_reuse(s, cl, 100)


def test_online_selector_rechooses_only_when_rows_move():
    cl = toy_cluster(flops=1e4)
    sel = ChunkSelector(shape(), cl, tolerance=0.25)
    first = sel.choose(100)
    assert sel.choose(110) == first and sel.changes == 0     # within 25%: no recompile
    sel.choose(4)                                             # a tiny step: fewer chunks
    assert sel.chunks <= 4
    # 2 ranks send to 2 experts, one per device: expert loads 3 + 0 and 1 + 5
    assert rows_per_step(np.array([[[3, 1], [0, 5]]]), devices=2).tolist() == [6]
    assert rows_per_step(np.array([[[3, 1], [0, 5]]]), devices=1).tolist() == [9]


def test_bad_shapes_are_rejected():
    with pytest.raises(ValueError, match="'rows' must be a positive integer"):
        shape(rows=0)
    with pytest.raises(ValueError, match="'chunks' must be in"):
        simulate_layer(shape(rows=2), toy_cluster(), 4)


@pytest.mark.mindspore
@pytest.mark.parametrize("dispatch", ["static", "grouped"])
def test_chunked_layer_equals_the_unchunked_one_when_dropless(dispatch):
    """Both MoE paths: static capacities (halved per chunk) and the padding-free grouped
    path (no capacity), outputs and gradients."""
    ms = pytest.importorskip("mindspore")
    from mindspore import Tensor

    from ms_efficient.moe.layer import MoEFeedForward
    from ms_efficient.mpipe.layer import PipelinedMoE

    ms.set_context(mode=ms.GRAPH_MODE)
    b, s, h, f, e = 4, 8, 16, 32, 4
    whole = MoEFeedForward(h, f, e, 2, capacity=b * s, dispatch=dispatch)
    part = MoEFeedForward(h, f, e, 2, capacity=b * s // 2, dispatch=dispatch)
    for dst, src in zip(part.trainable_params(), whole.trainable_params()):
        dst.set_data(src.data)
    chunked = PipelinedMoE(part, chunks=2)
    x = Tensor(np.random.default_rng(0).standard_normal((b, s, h)).astype(np.float32))
    y1, _, c1, d1 = whole(x)
    y2, _, c2, d2 = chunked(x)
    np.testing.assert_allclose(y2.asnumpy(), y1.asnumpy(), rtol=1e-5, atol=1e-6)
    assert c2.asnumpy().tolist() == c1.asnumpy().tolist() and int(d2.asnumpy()) == 0

    def loss(layer):
        return lambda inp: layer(inp)[0].sum()

    g1 = ms.grad(loss(whole), grad_position=0, weights=whole.trainable_params())(x)
    g2 = ms.grad(loss(chunked), grad_position=0, weights=chunked.trainable_params())(x)
    np.testing.assert_allclose(g2[0].asnumpy(), g1[0].asnumpy(), rtol=1e-5, atol=1e-6)
    for a, c in zip(g2[1], g1[1]):
        np.testing.assert_allclose(a.asnumpy(), c.asnumpy(), rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="'chunks' must be >= 1"):
        PipelinedMoE(part, chunks=0)


def test_bench_policies_never_beat_the_oracle_and_online_tracks_warmup():
    from dataclasses import replace

    from ms_efficient.mpipe.bench import WORKLOADS, policy_rows

    w = replace(WORKLOADS[1], name="warm", warmup_from=0.125)
    # 48 rows (2,400 steps): each chunk-count change recompiles the 16-layer model,
    # recompile_time_s(16) = 7.2 s; over 24 rows two of them cost more than the fixed count
    # loses, over 48 they add 2 x 7.2 s / (2,400 x 16) = 0.37 ms (1.7%) to a 22 ms layer
    rows = {r["method"]: r for r in policy_rows(w, steps=48)}
    oracle = rows["oracle"]["layer_time_s"]
    assert all(r["layer_time_s"] >= oracle * (1 - 1e-12) for r in rows.values())
    assert rows["no-pipeline"]["speedup_vs_no_pipeline"] == pytest.approx(1.0)
    # tokens grow 8x during warm-up: both run-time choosers (ours and Tutel's per-capacity
    # table) re-choose and stay near the oracle. On the 910B preset at its cited 30 % MFU the
    # expert compute is long enough that the best count fixed in hindsight is as good
    # (within 0.5 %, the recompiles' price): re-choosing no longer pays there.
    fixed = min(rows[f"fixed-{n}"]["layer_time_s"] for n in (2, 4, 8))
    for method in ("mpipe-online", "tutel-adaptive"):
        assert rows[method]["chunk_changes"] >= 1
        assert rows[method]["layer_time_s"] <= fixed * 1.005
        assert rows[method]["layer_time_s"] <= oracle * 1.02


def test_plan_mpipe_writes_a_plan_and_rejects_an_expert_count_the_devices_do_not_divide(
        tmp_path, capsys):
    import yaml

    from ms_efficient.cli import main

    out = tmp_path / "mpipe.yaml"
    assert main(["plan", "mpipe", "configs/gpt_moe_tiny.yaml", "--cluster", "ascend910b-1x8",
                 "--out", str(out)]) == 0
    doc = yaml.safe_load(out.read_text())
    assert doc["kind"] == "mpipe" and doc["chunks"] in (1, 2, 4, 8, 16)
    assert doc["layer_time_s"] == min(t["layer_time_s"] for t in doc["table"])
    assert main(["plan", "mpipe", "configs/gpt_moe_tiny.yaml", "--cluster", "ascend910b-4x8",
                 "--out", str(tmp_path / "bad.yaml")]) == 2
    assert "'moe.num_experts' (8) must be a multiple" in capsys.readouterr().err
    assert not (tmp_path / "bad.yaml").exists()
