"""place against the same devices (issue 33 item 3): the pipelines are judged against the best
non-pipeline use of the same devices (data parallel, plain or ZeRO), planned jointly with data
parallelism (pp x dp), on hand-built block chains (no MindSpore) whose figures are computed by
hand below.

The chain: 6 blocks, each 1 ms forward and 2 ms backward on the whole batch (measured times:
no launch overhead, so a batch share scales them exactly), P parameter bytes, no activation
bytes (free stage-to-stage transfers). Links: no latency, 1 GB/s, so a ring all-reduce of B
bytes over n devices takes 2 (n-1)/n B / 1e9 s (Thakur et al. 2005). Total compute C = 18 ms.

- data parallel over n (batch divisible by n): C / n + allreduce(6P, n);
- a pipeline copy on 1/dp of the batch with S equal stages of busy time t each (all M
  micro-batches) runs GPipe in (M + S - 1) / M x t; plus allreduce(3P, dp) for 2 stages.
"""
import numpy as np
import pytest

from ms_efficient.core.cluster import Link, get_cluster
from ms_efficient.core.registry import PassRefused
from ms_efficient.graph.opgraph import OpGraph, OpNode
from ms_efficient.place.same_devices import (best_replica_plan, gradient_sync_time_s,
                                              replica_plan, replica_plans,
                                              state_bytes_per_device)
from ms_efficient.place.planner import TGAConfig
from ms_efficient.place.same_devices import plan_same_devices, sub_cluster
from ms_efficient.place.stages import group_of_ops, price_network

FAST = TGAConfig(seed=0, max_evaluations=200)
BW = 1e9
MS = 1e-3


def _cluster(devices=4, memory=64 * 2**30, nodes=1):
    return get_cluster("ascend910b-1x8").with_overrides(
        nodes=nodes, devices_per_node=devices, name=f"test-{nodes}x{devices}",
        intra_link=Link(latency_s=0.0, bandwidth_Bps=BW),
        inter_link=Link(latency_s=0.0, bandwidth_Bps=BW), device_memory_bytes=int(memory))


def _blocks(count=6, param_bytes=400_000, act_bytes=0):
    g = OpGraph("blocks")
    names = [f"b{i}" for i in range(count)]
    for i, name in enumerate(names):
        g.add_node(OpNode(name=name, op_type="MatMul", phase="forward", forward_time_s=1 * MS,
                          backward_time_s=2 * MS, param_bytes=param_bytes,
                          output_bytes=act_bytes))
        if i:
            g.add_edge(names[i - 1], name, act_bytes)
    order = [list(g.nodes).index(n) for n in g.topological_order()]
    groups = group_of_ops(np.arange(count))
    return g, order, groups, [f"layers.{i}" for i in range(count)]


def _ring_allreduce(nbytes, n):
    return 2 * (n - 1) / n * nbytes / BW


def test_the_data_parallel_baseline_is_compute_over_d_plus_the_gradient_allreduce():
    g, *_ = _blocks(param_bytes=400_000)
    cluster = _cluster(4)
    plan = replica_plan(g, cluster, 4)
    assert plan.compute_s == pytest.approx(18 * MS / 4, rel=1e-12)
    assert plan.sync_s == pytest.approx(_ring_allreduce(6 * 400_000, 4), rel=1e-12)
    assert plan.step_time_s == pytest.approx(4.5 * MS + 3.6 * MS, rel=1e-12)
    # memory: weights, gradients and Adam m, v (4 x parameter bytes), no activations
    assert plan.memory_bytes == pytest.approx(4 * 6 * 400_000)
    assert plan.label == "data parallel over 4 devices" and plan.feasible
    # one replica is the unoptimised step of the same cost model
    one = replica_plan(g, cluster, 1)
    price = price_network(g, cluster)
    assert one.step_time_s == pytest.approx(price.step_time_s, rel=1e-12)
    assert one.memory_bytes == pytest.approx(price.peak_memory_bytes, rel=1e-12)


def test_launch_overheads_do_not_divide_over_the_replicas():
    cluster = get_cluster("ascend910b-1x8")
    g = OpGraph("flops")
    g.add_node(OpNode(name="a", op_type="MatMul", phase="forward", flops=1e12, param_bytes=0))
    peak = cluster.peak_flops_for("fp16") * cluster.compute_efficiency
    h = 2e-6                                   # PlacementOptions().op_overhead_s
    plan = replica_plan(g, cluster, 8)
    assert plan.sync_s == 0.0                  # no parameters, nothing to all-reduce
    assert plan.step_time_s == pytest.approx(3e12 / peak / 8 + 2 * h, rel=1e-12)


def test_zero_shards_the_state_and_prices_its_collectives_with_the_cluster():
    # 4 bytes per parameter byte: weights 1, gradients 1, optimizer 2 (ZeRO paper's stages)
    assert state_bytes_per_device(100.0, 4.0, 4, 0) == 400.0
    assert state_bytes_per_device(100.0, 4.0, 4, 1) == 100 + 100 + 200 / 4
    assert state_bytes_per_device(100.0, 4.0, 4, 2) == 100 + 300 / 4
    assert state_bytes_per_device(100.0, 4.0, 4, 3) == 400 / 4
    cluster = get_cluster("ascend910b-4x8")
    devices = list(range(32))
    ar = cluster.collective_time_s("allreduce", 1e9, devices)
    rs = cluster.collective_time_s("reduce_scatter", 1e9, devices)
    ag = cluster.collective_time_s("allgather", 1e9, devices)
    assert gradient_sync_time_s(cluster, devices, 1e9, 0) == ar
    assert gradient_sync_time_s(cluster, devices, 1e9, 1) == rs + ag
    assert gradient_sync_time_s(cluster, devices, 1e9, 3) == rs + 2 * ag
    assert gradient_sync_time_s(cluster, [3], 1e9, 0) == 0.0
    with pytest.raises(ValueError, match=r"'zero' must be one of \[0, 1, 2, 3\], but got 4"):
        gradient_sync_time_s(cluster, devices, 1e9, 4)
    # ring reduce-scatter + all-gather cost what an all-reduce does: ZeRO-1 ties plain data
    # parallelism, so it is the baseline only when plain data parallelism does not fit
    g, *_ = _blocks(param_bytes=400_000)
    small = _cluster(4, memory=(4 * 6 * 400_000 - 1) / 0.9)
    plans = replica_plans(g, small, batch=8)
    assert {(p.devices, p.zero) for p in plans} == {(1, 0)} | {
        (n, z) for n in (2, 4) for z in range(4)}          # 3 does not divide the batch
    best = best_replica_plan(plans)
    assert (best.devices, best.zero) == (4, 1)
    assert best.label == "ZeRO-1 data parallel over 4 devices"
    assert best.step_time_s == pytest.approx(replica_plan(g, _cluster(4), 4).step_time_s)
    # ZeRO-3 also holds the rest of the largest operator's weights while it runs
    assert replica_plan(g, small, 4, 3).memory_bytes == pytest.approx(
        4 * 2.4e6 / 4 + 400_000 * 3 / 4)


def test_data_parallel_wins_and_place_refuses_with_the_ratio():
    # small parameters: data parallel over 4 = 4.5 ms + allreduce(2.4e5 B) = 0.36 ms;
    # pipeline 2x2 (2 stages of 3 blocks, 2 copies, 4 micro-batches): (4 + 1) / 4 x 4.5 ms
    # + allreduce(3 x 4e4 B over 2) = 5.625 + 0.12 ms; pure pipelines (dp = 1) >= 7.5 ms
    g, order, groups, names = _blocks(param_bytes=40_000)
    dp4 = 4.5 * MS + _ring_allreduce(6 * 40_000, 4)
    pipe = 5.625 * MS + _ring_allreduce(3 * 40_000, 2)
    ratio = pipe / dp4
    assert ratio == pytest.approx(5.745 / 4.86, rel=1e-12)          # 1.18x
    with pytest.raises(PassRefused) as err:
        plan_same_devices(g, order, groups, names, _cluster(4), 8, None, FAST)
    msg = str(err.value)
    assert msg.startswith("place: pipelining does not pay on 'test-1x4': the best pipeline 2x2 "
                          "(2 stages x 2 data-parallel copies, 4 micro-batches) takes "
                          f"{ratio:.3g}x the step time of data parallel over 4 devices "
                          f"({pipe * 1e3:.4g} ms against {dp4 * 1e3:.4g} ms per step"), msg


def test_pp_x_dp_beats_pure_pipelines_and_pure_data_parallelism():
    # large parameters: data parallel over 4 = 4.5 + allreduce(2.4e6 B, 4) = 4.5 + 3.6 ms;
    # pipeline 2x2 = 5.625 + allreduce(1.2e6 B, 2) = 5.625 + 1.2 = 6.825 ms; a pure pipeline
    # on 4 devices has a stage of >= 2 blocks (6 ms of busy time), so with M <= 8
    # micro-batches it takes >= (18 + 7 x 6) / 8 = 7.5 ms (2 stages: >= 10.125 ms)
    g, order, groups, names = _blocks(param_bytes=400_000)
    plan = plan_same_devices(g, order, groups, names, _cluster(4), 8, None, FAST)
    best = plan.pipeline
    assert (len(best.stages), best.replicas, best.micro_batches) == (2, 2, 4)
    assert [s["blocks"] for s in best.stages] == [names[:3], names[3:]]
    # each stage on neighbouring devices (MindSpore's rank order: stage s on ranks 2s, 2s+1)
    assert [s["devices"] for s in best.stages] == [[0, 1], [2, 3]]
    assert best.layout == "each stage's copies on neighbouring devices"
    assert best.pipeline_s == pytest.approx(5.625 * MS, rel=1e-9)
    assert best.sync_s == pytest.approx(1.2 * MS, rel=1e-9)
    assert best.step_time_s == pytest.approx(6.825 * MS, rel=1e-9)
    assert plan.baseline.label == "data parallel over 4 devices"
    assert plan.baseline.step_time_s == pytest.approx(8.1 * MS, rel=1e-12)
    assert plan.ratio == pytest.approx(6.825 / 8.1, rel=1e-9) and plan.reason == "faster"
    pure = [r for r in plan.candidates if r["dp"] == 1]
    assert len(pure) == 1 and pure[0]["step_time_s"] >= 7.5 * MS * (1 - 1e-9)
    doc = plan.to_dict()
    assert (doc["pp"], doc["dp"], doc["shape"]) == (2, 2, "2x2")
    assert doc["baseline"]["devices"] == 4 and doc["baseline"]["zero"] == 0
    assert doc["baseline"]["memory_bytes"] == pytest.approx(4 * 2.4e6)
    assert doc["ratio_to_baseline"] == pytest.approx(6.825 / 8.1, rel=1e-9)
    again = plan_same_devices(g, order, groups, names, _cluster(4), 8, None, FAST)
    assert again.pipeline.device_of_block == best.device_of_block       # deterministic


def test_memory_forces_a_pipeline_when_no_non_pipeline_plan_fits():
    # one sample per step: no data parallelism; the network's 4 x 6 x 4e5 = 9.6 MB of state
    # does not fit one device's 0.9 x 5 MB, two or more stages of <= 3 blocks (4.8 MB) do
    g, order, groups, names = _blocks(param_bytes=400_000)
    cluster = _cluster(4, memory=5e6)
    plan = plan_same_devices(g, order, groups, names, cluster, 1, None, FAST)
    assert plan.reason == "memory" and not plan.baseline.feasible
    assert plan.baseline.label == "one device"
    assert plan.baseline.memory_bytes == pytest.approx(9.6e6)
    assert len(plan.pipeline.stages) >= 2 and plan.pipeline.replicas == 1
    assert plan.pipeline.feasible
    assert all(s["memory_bytes"] <= 4.5e6 for s in plan.pipeline.stages)
    # slower than the one device that cannot hold it (no micro-batch to overlap): chosen anyway
    assert plan.ratio >= 1.0


def test_nothing_fits_is_refused_with_what_each_needs():
    g, order, groups, names = _blocks(param_bytes=400_000)
    cluster = _cluster(2, memory=2e6)        # 1.72 MiB usable, a block needs 1.6 MB of state
    with pytest.raises(PassRefused, match=r"^place: neither a pipeline nor data parallelism "
                                          r"fits the usable memory of 'test-1x2' \(1\.72 MiB per "
                                          r"device\): no pp x dp split of the blocks could be "
                                          r"built: graph 'blocks-blocks' needs 0\.01 GiB .*; the "
                                          r"leanest non-pipeline plan, ZeRO-3 data parallel over 2 "
                                          r"devices, needs 4\.77 MiB; shard or recompute first"):
        plan_same_devices(g, order, groups, names, cluster, 2, None, FAST)


def test_a_copy_holds_whole_nodes_beyond_one_node():
    cluster = get_cluster("ascend910b-4x8")
    assert sub_cluster(cluster, 4).num_devices == 4 and sub_cluster(cluster, 4).nodes == 1
    assert sub_cluster(cluster, 16).nodes == 2 and sub_cluster(cluster, 20).num_devices == 16
    with pytest.raises(ValueError, match=r"'devices' must be an int in \[1, 32\], but got 33"):
        sub_cluster(cluster, 33)


def test_on_two_nodes_each_stage_all_reduces_inside_a_node():
    # 2 nodes x 2 devices: free links inside a node (1 TB/s), 1 GB/s between nodes. Data
    # parallel over 4 all-reduces across the nodes: 4.5 ms + (RS inside, AR of 1.2 MB over the
    # 2 nodes = 1.2 ms, AG inside); pipeline 2x2 with each copy on neighbouring devices puts
    # each stage's 2 copies on the 2 nodes: 5.625 + 1.2 ms; with each stage's copies on
    # neighbouring devices a copy's 2 stages sit on the 2 nodes (0-byte transfers: free) and
    # each stage's copies share a node:
    # 5.625 ms + allreduce(1.2 MB, 2) over 1 TB/s
    g, order, groups, names = _blocks(param_bytes=400_000)
    cluster = _cluster(2, nodes=2).with_overrides(
        intra_link=Link(latency_s=0.0, bandwidth_Bps=1e12))
    plan = plan_same_devices(g, order, groups, names, cluster, 8, None, FAST)
    best = plan.pipeline
    assert (len(best.stages), best.replicas) == (2, 2)
    assert best.layout == "each stage's copies on neighbouring devices"
    assert [s["devices"] for s in best.stages] == [[0, 1], [2, 3]]
    assert best.sync_s == pytest.approx(2 * 0.5 * 1.2e6 / 1e12, rel=1e-9)
    assert best.step_time_s == pytest.approx(5.625 * MS + best.sync_s, rel=1e-9)
    dp4 = cluster.collective_time_s("allreduce", 2.4e6, [0, 1, 2, 3])
    assert dp4 == pytest.approx(1.2e6 / 1e9 + 2 * 0.5 * 2.4e6 / 1e12, rel=1e-12)
    assert plan.baseline.label == "data parallel over 4 devices"
    assert plan.baseline.step_time_s == pytest.approx(4.5 * MS + dp4, rel=1e-12)
    consecutive = [r for r in plan.candidates
                   if r["dp"] == 2 and r["layout"] == "each copy on neighbouring devices"]
    assert consecutive[0]["step_time_s"] == pytest.approx(6.825 * MS, rel=1e-6)
    assert plan.reason == "faster" and plan.ratio < 1


def test_a_batch_share_prices_the_devices_on_that_share_of_the_batch():
    """After shard, each device of place's cluster stands for one shard mesh whose dp rows
    split the batch (``place.apply`` passes batch_share = 1 / dp). Data parallel over 2 on
    half the batch, by hand: compute 18 ms x 1/2 / 2 = 4.5 ms, activations 6 x 1 MB x 1/4
    per device beside the unchanged 4 x 6 x 4e5 B of state. And the share is the batch: the
    plan (baseline, pipeline, stage memory, step) of the blocks with share 1/2 is the plan of
    blocks with half the times, activations and transfers at share 1 (measured times: no
    launch overhead keeps its size)."""
    act = 1_000_000
    g, order, groups, names = _blocks(param_bytes=400_000, act_bytes=act)
    cluster = _cluster(4)
    half = replica_plan(g, cluster, 2, 0, batch_share=0.5)
    assert half.compute_s == pytest.approx(4.5 * MS, rel=1e-12)
    assert half.memory_bytes == pytest.approx(4 * 6 * 400_000 + 6 * act / 4, rel=1e-12)
    with pytest.raises(ValueError, match=r"'batch_share' must be in \(0, 1\], but got 0"):
        replica_plan(g, cluster, 2, batch_share=0)

    h, *_ = _blocks(param_bytes=400_000, act_bytes=act // 2)
    for node in h:
        node.forward_time_s, node.backward_time_s = 0.5 * MS, 1 * MS
    shared = plan_same_devices(g, order, groups, names, cluster, 8, None, FAST, max_copies=1,
                               batch_share=0.5)
    scaled = plan_same_devices(h, order, groups, names, cluster, 8, None, FAST, max_copies=1)
    assert shared.baseline.step_time_s == pytest.approx(scaled.baseline.step_time_s, rel=1e-12)
    assert shared.baseline.memory_bytes == pytest.approx(scaled.baseline.memory_bytes,
                                                         rel=1e-12)
    a, b = shared.pipeline, scaled.pipeline
    assert a.device_of_block == b.device_of_block and a.micro_batches == b.micro_batches
    assert a.step_time_s == pytest.approx(b.step_time_s, rel=1e-12)
    assert [s["memory_bytes"] for s in a.stages] == pytest.approx(
        [s["memory_bytes"] for s in b.stages], rel=1e-12)
    full = plan_same_devices(g, order, groups, names, cluster, 8, None, FAST, max_copies=1)
    assert max(s["memory_bytes"] for s in full.pipeline.stages) > \
        max(s["memory_bytes"] for s in a.stages)
