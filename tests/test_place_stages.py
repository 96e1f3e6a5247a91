"""place.stages: pipeline stages as contiguous groups of repeated blocks, on hand-built graphs
(no MindSpore): glue goes with its neighbours, group costs are the operators' costs (plus one
launch overhead per operator and extra micro-batch; a data-parallel copy's batch share scales
all but the overheads), the stages add up to the one-stage step, and a network where pipelining
does not pay is refused with the figures (by ``place.same_devices``, against the best
non-pipeline use of the same devices: tests/test_place_same_devices.py)."""
import numpy as np
import pytest

from ms_efficient.core.cluster import get_cluster
from ms_efficient.graph.opgraph import OpGraph, OpNode
from ms_efficient.place.planner import TGAConfig
from ms_efficient.place.problem import PlacementOptions
from ms_efficient.place.stages import (group_graph, group_of_ops, micro_batch_candidates,
                                       plan_stages)
from ms_efficient.place.stages import price_network
from ms_efficient.place.same_devices import plan_same_devices

OVERHEAD = PlacementOptions().op_overhead_s
FAST = TGAConfig(seed=0, max_evaluations=200, time_budget_s=20.0)


def _cluster(devices=4, **links):
    spec = get_cluster("ascend910b-1x8").with_overrides(devices_per_node=devices,
                                                        name=f"test-1x{devices}")
    return spec.with_overrides(**links) if links else spec


def _chain(flops, glue_flops=0.0, act_bytes=1024):
    """embed (glue) -> b0 -> b1 -> ... -> head (glue): one MatMul per block, ``flops`` each."""
    g = OpGraph("chain")
    names = ["embed"] + [f"b{i}" for i in range(len(flops))] + ["head"]
    for i, name in enumerate(names):
        block = name.startswith("b")
        g.add_node(OpNode(name=name, op_type="MatMul" if block else "Reshape", phase="forward",
                          flops=flops[i - 1] if block else glue_flops, output_bytes=act_bytes,
                          param_bytes=4096 if block else 0))
        if i:
            g.add_edge(names[i - 1], name, act_bytes)
    unit_of = np.array([-1] + list(range(len(flops))) + [-1])
    return g, unit_of, [f"layers.{i}" for i in range(len(flops))]


def test_glue_joins_the_block_before_it_and_leading_glue_the_first():
    got = group_of_ops(np.array([-1, -1, 0, 0, -1, 1, 1, -1, 2, -1]))
    assert got.tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="no forward operator belongs to a repeated block"):
        group_of_ops(np.array([-1, -1]))


def test_group_costs_are_the_operator_costs_plus_an_overhead_per_micro_batch():
    cluster = _cluster()
    peak = cluster.peak_flops_for("fp16") * cluster.compute_efficiency
    g, unit_of, names = _chain([1e9, 2e9], glue_flops=1e6)
    order = [list(g.nodes).index(n) for n in g.topological_order()]
    groups = group_of_ops(unit_of)
    for m in (1, 4):
        grouped = group_graph(g, order, groups, names, cluster, micro_batches=m)
        # group 0 = embed + b0, group 1 = b1 + head
        f0 = (1e6 + 1e9) / peak + 2 * m * OVERHEAD
        f1 = (2e9 + 1e6) / peak + 2 * m * OVERHEAD
        assert grouped["layers.0"].forward_time_s == pytest.approx(f0, rel=1e-12)
        assert grouped["layers.1"].forward_time_s == pytest.approx(f1, rel=1e-12)
        b0 = 2 * (1e6 + 1e9) / peak + 2 * m * OVERHEAD
        assert grouped["layers.0"].backward_time_s == pytest.approx(b0, rel=1e-12)
        assert grouped["layers.0"].param_bytes == 4096
        assert grouped["layers.0"].output_bytes == 2048
        assert grouped.edges == [("layers.0", "layers.1", 1024)]   # b0 -> b1 only
        # a copy on a quarter of the batch: compute, activations and transfers / 4, the
        # launch overheads and the parameters whole
        quarter = group_graph(g, order, groups, names, cluster, micro_batches=m,
                              batch_share=0.25)
        assert quarter["layers.0"].forward_time_s == pytest.approx(
            (1e6 + 1e9) / peak / 4 + 2 * m * OVERHEAD, rel=1e-12)
        assert quarter["layers.0"].backward_time_s == pytest.approx(
            2 * (1e6 + 1e9) / peak / 4 + 2 * m * OVERHEAD, rel=1e-12)
        assert quarter["layers.0"].param_bytes == 4096
        assert quarter["layers.0"].output_bytes == 512
        assert quarter.edges == [("layers.0", "layers.1", 256)]
    with pytest.raises(ValueError, match=r"'batch_share' must be in \(0, 1\], but got 0"):
        group_graph(g, order, groups, names, cluster, batch_share=0)


def test_stages_hold_blocks_add_up_to_one_stage_and_beat_it_when_compute_dominates():
    cluster = _cluster(4)
    g, unit_of, names = _chain([4e11] * 8)             # ~1.3 ms per block forward
    order = [list(g.nodes).index(n) for n in g.topological_order()]
    groups = group_of_ops(unit_of)
    plan = plan_stages(g, order, groups, names, cluster, [1, 2, 4, 8], FAST)
    assert len(plan.stages) >= 2
    held = [b for s in plan.stages for b in s["blocks"]]
    assert held == names                                       # contiguous, in order, all
    assert all(s["blocks"] for s in plan.stages)
    # the one-stage step is the unoptimised price of the same graph (one simulator)
    assert plan.one_stage_s == pytest.approx(price_network(g, cluster).step_time_s, rel=1e-9)
    # every group pays its 10 operators' launch (fwd + bwd) once more per extra micro-batch
    extra = 2 * 10 * (plan.micro_batches - 1) * OVERHEAD
    assert sum(plan.stage_time_s) == pytest.approx(plan.one_stage_s + extra, rel=1e-9)
    # a device runs its stage serially: the step is at least the busiest stage, and the
    # pipeline is faster than one stage
    assert max(plan.stage_time_s) <= plan.step_time_s < plan.one_stage_s
    assert plan.tried[plan.micro_batches] == plan.step_time_s == min(plan.tried.values())
    again = plan_stages(g, order, groups, names, cluster, [1, 2, 4, 8], FAST)
    assert again.device_of_block == plan.device_of_block           # deterministic (seed 0)


def test_pipelining_that_does_not_pay_is_refused_with_the_gap():
    # launch-bound blocks behind a slow link: every stage boundary costs more than it saves,
    # and every gradient all-reduce too: the best use of the 4 devices is one of them
    from ms_efficient.core.cluster import Link

    cluster = _cluster(4, intra_link=Link(latency_s=1e-3, bandwidth_Bps=1e6))
    g, unit_of, names = _chain([1e3] * 4)
    order = [list(g.nodes).index(n) for n in g.topological_order()]
    plan = plan_stages(g, order, group_of_ops(unit_of), names, cluster, [1, 2, 4], FAST)
    assert plan.step_time_s > plan.one_stage_s          # the search still returns its best
    with pytest.raises(ValueError, match=r"^place: pipelining does not pay on 'test-1x4': the "
                                         r"best pipeline 2x1 \(2 stages x 1 data-parallel copy, "
                                         r"\d micro-batch(es)?\) takes \d+(\.\d+)?x the step time "
                                         r"of one device \([\d.]+ ms against [\d.]+ ms per step"):
        plan_same_devices(g, order, group_of_ops(unit_of), names, cluster, 4, None, FAST)
    with pytest.raises(ValueError, match="pipeline stages need >= 2"):
        plan_stages(g, order, group_of_ops(unit_of), names, _cluster(1), [1], FAST)
    with pytest.raises(ValueError, match=r"'micro_batches' must be positive integers, but got \[0\]"):
        plan_stages(g, order, group_of_ops(unit_of), names, cluster, [0], FAST)


def test_a_network_too_big_for_one_device_gets_stages_even_when_they_cost_time():
    from ms_efficient.core.cluster import Link

    # 4 blocks of 4096 parameter bytes (x4 for weights, grads, Adam) + 1 KiB activations
    # each, 2 KiB of glue: 71680 B against 0.9 x 50000 = 45000 B usable per device
    cluster = _cluster(4, intra_link=Link(latency_s=1e-3, bandwidth_Bps=1e6),
                       device_memory_bytes=50000)
    g, unit_of, names = _chain([1e3] * 4)
    order = [list(g.nodes).index(n) for n in g.topological_order()]
    plan = plan_stages(g, order, group_of_ops(unit_of), names, cluster, [1, 2], FAST)
    assert not plan.one_stage_fits and len(plan.stages) >= 2
    assert all(s["memory_bytes"] <= 45000 for s in plan.stages)
    assert plan.step_time_s > plan.one_stage_s              # slower, but the only fit


def test_no_pipeline_within_memory_is_refused_with_the_need():
    # two devices of 35900 usable bytes: each half of the 71680 B fits only without the
    # 1 KiB activation it receives from the other stage
    cluster = _cluster(2, device_memory_bytes=int(35900 / 0.9) + 1)
    g, unit_of, names = _chain([1e3] * 4)
    order = [list(g.nodes).index(n) for n in g.topological_order()]
    plan = plan_stages(g, order, group_of_ops(unit_of), names, cluster, [1], FAST)
    assert not plan.feasible and not plan.one_stage_fits
    # the leaner stage needs 35840 B + the 1 KiB it receives = 36864 B; ZeRO-3 over both
    # devices needs 65536 / 2 + 6144 / 2 + 4096 / 2 = 37888 B: no plan fits
    with pytest.raises(ValueError, match=r"^place: neither a pipeline nor data parallelism fits "
                                         r"the usable memory of 'test-1x2' \(35\.06 KiB per "
                                         r"device\): the leanest needs 36\.00 KiB on its "
                                         r"fullest device; the leanest non-pipeline plan, ZeRO-3 "
                                         r"data parallel over 2 devices, needs 37\.00 KiB"):
        plan_same_devices(g, order, group_of_ops(unit_of), names, cluster, 2, 1, FAST)


def test_micro_batch_candidates_divide_the_batch():
    assert micro_batch_candidates(12) == [1, 2, 3, 4, 6, 12]
    assert micro_batch_candidates(64, limit=16) == [1, 2, 4, 8, 16]
    with pytest.raises(ValueError, match="'batch' must be >= 1, but got 0"):
        micro_batch_candidates(0)
