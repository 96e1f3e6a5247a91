"""Tests for ms_efficient.core.cluster and ms_efficient.core.collectives (pure Python, fast)."""
import dataclasses
import math
import re

import pytest
import yaml

from ms_efficient.core.cluster import (LOCAL_LINK, PRESETS, ClusterSpec, Link, allgather_time_s,
                                       allreduce_time_s, alltoall_time_s, broadcast_time_s,
                                       cluster_names, get_cluster, hierarchical_collective_time_s,
                                       p2p_time_s, reduce_scatter_time_s)

# The running example: alpha = 10 us, B = 1 GB/s, n = 4 ranks, a 4 MB buffer.
LINK = Link(latency_s=1e-5, bandwidth_Bps=1e9)
N = 4
NBYTES = 4e6
BOTH_NODES = [0, 1, 2, 3]  # every device of two_by_two()
FLAT = [allreduce_time_s, allgather_time_s, reduce_scatter_time_s, alltoall_time_s,
        broadcast_time_s]


def two_by_two() -> ClusterSpec:
    """2 nodes x 2 devices; intra 1 us, 10 GB/s; inter 10 us, 1 GB/s."""
    return ClusterSpec(
        name="test-2x2", nodes=2, devices_per_node=2, device_memory_bytes=2**30,
        peak_flops={"fp16": 1e12, "fp32": 0.5e12},
        intra_link=Link(1e-6, 1e10), inter_link=Link(1e-5, 1e9), host_link=Link(1e-6, 1e9),
    )


# ---- Link and flat collectives ------------------------------------------------------------

def test_link_time_is_latency_plus_bytes_over_bandwidth():
    # 1e-5 + 4e6 / 1e9 = 1e-5 + 4e-3 = 0.00401 s
    assert LINK.time_s(NBYTES) == pytest.approx(0.00401)
    assert p2p_time_s(NBYTES, LINK) == pytest.approx(0.00401)


def test_link_sends_nothing_for_zero_bytes_and_rejects_negative_sizes():
    assert LINK.time_s(0) == 0.0
    with pytest.raises(ValueError, match=r"'nbytes' must be a number >= 0, but got -1"):
        LINK.time_s(-1)


@pytest.mark.parametrize("kwargs, match", [
    ({"latency_s": -1e-6, "bandwidth_Bps": 1e9},
     r"Link 'latency_s' must be a number >= 0, but got -1e-06\."),
    ({"latency_s": 1e-6, "bandwidth_Bps": 0}, r"Link 'bandwidth_Bps' must be > 0, but got 0\."),
    ({"latency_s": 1e-6, "bandwidth_Bps": "fast"}, r"Link 'bandwidth_Bps' .* but got 'fast'\."),
])
def test_link_validation_names_field_and_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Link(**kwargs)


def test_ring_allreduce_hand_computed():
    # 2(n-1)·alpha + 2(n-1)/n · S/B = 6·1e-5 + 1.5·(4e6/1e9) = 6e-5 + 6e-3 = 0.00606 s
    assert allreduce_time_s(NBYTES, N, LINK) == pytest.approx(0.00606)


@pytest.mark.parametrize("fn", [allgather_time_s, reduce_scatter_time_s, alltoall_time_s])
def test_allgather_reduce_scatter_alltoall_hand_computed(fn):
    # (n-1)·alpha + (n-1)/n · S/B = 3·1e-5 + 0.75·4e-3 = 3e-5 + 3e-3 = 0.00303 s
    assert fn(NBYTES, N, LINK) == pytest.approx(0.00303)


def test_broadcast_of_a_long_message_uses_scatter_allgather():
    # L = ceil(log2 4) = 2. tree: 2·1e-5 + 2·4e-3 = 0.00802 s;
    # scatter + allgather: (2 + 3)·1e-5 + 1.5·4e-3 = 5e-5 + 6e-3 = 0.00605 s -> the minimum.
    assert broadcast_time_s(NBYTES, N, LINK) == pytest.approx(0.00605)


def test_broadcast_of_a_short_message_uses_binomial_tree():
    # 8 bytes. tree: 2·1e-5 + 2·8/1e9 = 2.0016e-5 s; scatter + allgather: >= 5e-5 s.
    assert broadcast_time_s(8, N, LINK) == pytest.approx(2.0016e-5)


@pytest.mark.parametrize("n", [2, 3, 4, 8, 16])
def test_ring_formulas_equal_a_naive_step_by_step_ring(n):
    # Each ring step sends one nbytes/n chunk to the next rank: one message on the link.
    step = LINK.time_s(NBYTES / n)
    assert allreduce_time_s(NBYTES, n, LINK) == pytest.approx(sum(step for _ in range(2 * (n - 1))))
    assert allgather_time_s(NBYTES, n, LINK) == pytest.approx(sum(step for _ in range(n - 1)))
    assert alltoall_time_s(NBYTES, n, LINK) == pytest.approx(sum(step for _ in range(n - 1)))


@pytest.mark.parametrize("fn", FLAT)
def test_collective_over_one_rank_or_zero_bytes_is_free(fn):
    assert fn(NBYTES, 1, LINK) == 0.0
    assert fn(0, N, LINK) == 0.0


@pytest.mark.parametrize("fn", FLAT)
def test_collective_rejects_bad_rank_count_and_size(fn):
    with pytest.raises(ValueError, match=r"'n' must be a positive integer, but got 0\."):
        fn(NBYTES, 0, LINK)
    with pytest.raises(ValueError, match=r"'nbytes' must be a number >= 0, but got -5"):
        fn(-5, N, LINK)


# ---- hierarchical collectives -------------------------------------------------------------

def test_hierarchical_allreduce_on_two_nodes_hand_computed():
    # S = 4e6, m = 2 per node, g = 2 nodes.
    # RS_intra(S, 2) = 1e-6 + 0.5·4e6/1e10 = 1e-6 + 2e-4 = 2.01e-4
    # AR_inter(S/2, 2) = 2·1e-5 + 2·0.5·2e6/1e9 = 2e-5 + 2e-3 = 2.02e-3
    # AG_intra(S, 2) = 2.01e-4                  total = 2·2.01e-4 + 2.02e-3 = 2.422e-3 s
    t = two_by_two().collective_time_s("allreduce", NBYTES, BOTH_NODES)
    assert t == pytest.approx(2.422e-3)


@pytest.mark.parametrize("kind", ["allgather", "reduce_scatter"])
def test_hierarchical_allgather_and_reduce_scatter_on_two_nodes_hand_computed(kind):
    # inter phase on S/2: 1e-5 + 0.5·2e6/1e9 = 1.01e-3; intra phase on S: 2.01e-4
    # total = 1.01e-3 + 2.01e-4 = 1.211e-3 s
    assert two_by_two().collective_time_s(kind, NBYTES, BOTH_NODES) == pytest.approx(1.211e-3)


def test_hierarchical_alltoall_is_the_slower_of_the_two_phases():
    # n = 4, each rank sends S/4 = 1e6 bytes to every peer.
    # intra: 1 local peer  · (1e-6 + 1e6/1e10) = 1.01e-4
    # inter: 2 remote peers · (1e-5 + 1e6/1e9) = 2.02e-3  -> max = 2.02e-3 s
    t = two_by_two().collective_time_s("all_to_all", NBYTES, BOTH_NODES)
    assert t == pytest.approx(2.02e-3)


def test_hierarchical_broadcast_on_two_nodes_hand_computed():
    # BC_inter(S, 2) = min(tree 1e-5 + 4e-3, s+ag (1+1)·1e-5 + 1·4e-3) = 4.01e-3
    # BC_intra(S, 2) = min(1e-6 + 4e-4, 2e-6 + 4e-4) = 4.01e-4   total = 4.411e-3 s
    t = two_by_two().collective_time_s("broadcast", NBYTES, BOTH_NODES)
    assert t == pytest.approx(4.411e-3)


def test_group_on_one_node_uses_the_intra_link_flat_formula():
    # allreduce n = 2 over intra: 2·1e-6 + 2·0.5·4e6/1e10 = 2e-6 + 4e-4 = 4.02e-4 s
    assert two_by_two().collective_time_s("AllReduce", NBYTES, [2, 3]) == pytest.approx(4.02e-4)


@pytest.mark.parametrize("kind, fn", zip(
    ["allreduce", "allgather", "reduce_scatter", "alltoall", "broadcast"], FLAT))
def test_one_device_per_node_reduces_to_the_flat_formula_over_the_inter_link(kind, fn):
    spec = two_by_two()
    expected = fn(NBYTES, 2, spec.inter_link)
    assert spec.collective_time_s(kind, NBYTES, [0, 2]) == pytest.approx(expected)


def test_hierarchical_allreduce_beats_a_flat_ring_over_the_inter_link():
    spec = get_cluster("ascend910b-4x8")
    hier = spec.collective_time_s("allreduce", 1e9, range(32))
    assert hier < allreduce_time_s(1e9, 32, spec.inter_link)
    assert hier > allreduce_time_s(1e9, 8, spec.intra_link)  # slower than one node alone


def test_uneven_groups_are_costed_by_the_largest_local_group_and_slice():
    # ranks_per_node [2, 1]: intra uses m = 2, inter uses S / 1.
    # RS_intra(S, 2) + AR_inter(S, 2) + AG_intra(S, 2) = 2.01e-4 + (2e-5 + 4e-3) + 2.01e-4
    t = hierarchical_collective_time_s("allreduce", NBYTES, [2, 1],
                                       Link(1e-6, 1e10), Link(1e-5, 1e9))
    assert t == pytest.approx(4.422e-3)


def test_collective_time_rejects_unknown_kind_and_bad_devices():
    spec = two_by_two()
    with pytest.raises(ValueError,
                       match=r"must be one of \['allreduce', .*'broadcast'\], but got 'gossip'"):
        spec.collective_time_s("gossip", NBYTES, [0, 1])
    with pytest.raises(ValueError, match=r"distinct device ids, but got \[0, 0\]"):
        spec.collective_time_s("allreduce", NBYTES, [0, 0])
    with pytest.raises(ValueError, match=r"device id must be an integer in \[0, 4\), but got 4\."):
        spec.collective_time_s("allreduce", NBYTES, [0, 4])


# ---- ClusterSpec: devices, links, compute -------------------------------------------------

def test_ascend_4x8_preset_has_32_devices_on_4_nodes():
    spec = get_cluster("ascend910b-4x8")
    assert (spec.nodes, spec.devices_per_node, spec.num_devices) == (4, 8, 32)
    assert [spec.node_of(d) for d in (0, 7, 8, 9, 31)] == [0, 0, 1, 1, 3]
    assert list(spec.node_devices(1)) == list(range(8, 16))
    assert get_cluster("ascend910b-16x8").num_devices == 128


def test_link_between_same_node_cross_node_and_self():
    spec = get_cluster("ascend910b-4x8")
    assert spec.link_between(0, 7) == spec.intra_link
    assert spec.link_between(7, 8) == spec.inter_link
    assert spec.link_between(3, 3) is LOCAL_LINK and LOCAL_LINK.time_s(1e9) == 0.0
    # 64 MiB cross node at 25 GB/s: 10e-6 + 2**26 / 25e9 = 10e-6 + 2.68435456e-3
    assert spec.transfer_time_s(2**26, 0, 8) == pytest.approx(2.69435456e-3)
    with pytest.raises(ValueError, match=r"must be an integer in \[0, 32\), but got 32\."):
        spec.node_of(32)


def test_a_kernel_launch_figure_is_carried_by_the_910b_presets_and_checked():
    """The 910B presets carry the per-kernel launch charge (19 us, cited in the preset);
    cpu-local has none (its fast level is one compiled kernel); a YAML override is read and
    a bad one names the field."""
    assert get_cluster("ascend910b-4x8").op_launch_s == 19e-6
    assert get_cluster("cpu-local").op_launch_s is None
    spec = ClusterSpec.from_dict({"preset": "ascend910b-1x8", "op_launch_s": 5e-6})
    assert spec.op_launch_s == 5e-6 and spec.to_dict()["op_launch_s"] == 5e-6
    assert ClusterSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(ValueError, match=r"ClusterSpec 'op_launch_s' must be a finite number "
                                         r"of seconds >= 0 or null, but got -1e-06"):
        ClusterSpec.from_dict({"preset": "ascend910b-1x8", "op_launch_s": -1e-6})


def test_compute_time_divides_flops_by_peak_and_efficiency():
    spec = get_cluster("ascend910b-1x8")
    # 313 TFLOP at 30 % (the preset's cited MFU) of 313 TFLOP/s
    assert spec.compute_time_s(313e12, "fp16") == pytest.approx(1 / 0.3)
    assert spec.compute_time_s(313e12, "float16") == pytest.approx(1 / 0.3)  # MindSpore spelling
    assert spec.with_overrides(compute_efficiency=0.5).compute_time_s(313e12) == pytest.approx(2.0)
    assert spec.memory_time_s(1.6e12) == pytest.approx(1.0)          # 1.6 TB at 1.6 TB/s
    assert spec.with_overrides(hbm_bandwidth_Bps=None).memory_time_s(1e12) == 0.0
    with pytest.raises(ValueError, match=r"no peak FLOP/s for dtype 'int4'; "
                                         r"known dtypes are \['bf16', 'fp16', 'fp32'\]"):
        spec.compute_time_s(1.0, "int4")


def test_spec_is_frozen_and_hashable():
    spec = get_cluster("cpu-local")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.nodes = 3
    assert {spec: 1}[get_cluster("cpu-local")] == 1


# ---- validation ---------------------------------------------------------------------------

@pytest.mark.parametrize("override, message", [
    ({"nodes": 0}, "ClusterSpec 'nodes' must be a positive integer, but got 0."),
    ({"devices_per_node": 2.5},
     "ClusterSpec 'devices_per_node' must be a positive integer, but got 2.5."),
    ({"device_memory_bytes": -1},
     "ClusterSpec 'device_memory_bytes' must be a positive integer number of bytes, but got -1."),
    ({"compute_efficiency": 1.5},
     "ClusterSpec 'compute_efficiency' must be a number in (0, 1], but got 1.5."),
    ({"peak_flops": {}},
     "ClusterSpec 'peak_flops' must be a non-empty mapping of dtype name to FLOP/s, but got {}."),
    ({"peak_flops": {"fp16": 0}},
     "ClusterSpec 'peak_flops.fp16' must be a positive finite number of FLOP/s, but got 0."),
    ({"intra_link": 5}, "ClusterSpec 'intra_link' must be a Link, but got 5."),
    ({"name": ""}, "ClusterSpec 'name' must be a non-empty string, but got ''."),
])
def test_validation_error_names_the_field_the_value_and_the_allowed_range(override, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        two_by_two().with_overrides(**override)


# ---- presets, from_dict / to_dict, overrides ----------------------------------------------

def test_preset_names_and_unknown_preset_lists_them():
    assert cluster_names() == ("cpu-local", "ascend910b-1x8", "ascend910b-4x8", "ascend910b-16x8")
    with pytest.raises(ValueError, match=r"must be one of \['cpu-local', 'ascend910b-1x8', "
                                         r"'ascend910b-4x8', 'ascend910b-16x8'\], "
                                         r"but got 'tpu-v4'\."):
        get_cluster("tpu-v4")
    with pytest.raises(TypeError):
        PRESETS["mine"] = two_by_two()  # the registry is read-only


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_round_trips_through_a_yaml_dict(name):
    spec = get_cluster(name)
    assert ClusterSpec.from_dict(yaml.safe_load(yaml.safe_dump(spec.to_dict()))) == spec
    assert ClusterSpec.from_dict({"preset": name}) == spec


def test_from_dict_applies_overrides_to_a_preset_and_merges_nested_links():
    spec = ClusterSpec.from_dict({"preset": "ascend910b-1x8", "nodes": 2,
                                  "inter_link": {"bandwidth_Bps": "12.5e9"}})  # YAML 1.1 string
    base = get_cluster("ascend910b-1x8")
    assert spec.num_devices == 16 and spec.name == base.name
    assert spec.inter_link == Link(base.inter_link.latency_s, 12.5e9)  # latency kept
    assert spec.intra_link == base.intra_link
    assert spec == base.with_overrides(nodes=2, inter_link=Link(base.inter_link.latency_s, 12.5e9))


def test_from_dict_merges_peak_flops_by_dtype():
    spec = ClusterSpec.from_dict({"preset": "ascend910b-1x8", "peak_flops": {"float16": 280e12}})
    assert spec.peak_flops_for("fp16") == 280e12
    assert spec.peak_flops_for("bf16") == 313e12


def test_from_dict_reads_a_full_spec_without_preset():
    d = two_by_two().to_dict()
    del d["compute_efficiency"]  # optional, defaults to 1.0
    assert ClusterSpec.from_dict(d) == two_by_two()


@pytest.mark.parametrize("d, match", [
    ({"preset": "cpu-local", "gpus": 4},
     r"unknown keys \['gpus'\]; allowed keys are \['preset', 'name'"),
    ({"name": "x", "nodes": 1},
     r"without 'preset' must give \['devices_per_node', 'device_memory_bytes'"),
    ({"preset": "cpu-local", "host_link": {"latency": 1}},
     r"'host_link' has unknown keys \['latency'\]"),
    ({"preset": "cpu-local", "nodes": 0},
     r"ClusterSpec 'nodes' must be a positive integer, but got 0\."),
    ({"preset": "cpu-local", "inter_link": {"bandwidth_Bps": 0}},
     r"ClusterSpec 'inter_link': Link 'bandwidth_Bps' must be > 0, but got 0"),
    ({"preset": "nope"}, r"must be one of \['cpu-local'"),
    (["cpu-local"], r"cluster config must be a mapping"),
])
def test_from_dict_rejects_bad_sections_with_a_clear_message(d, match):
    with pytest.raises(ValueError, match=match):
        ClusterSpec.from_dict(d)


def test_with_overrides_revalidates_and_rejects_unknown_fields():
    spec = get_cluster("ascend910b-1x8")
    four_nodes = get_cluster("ascend910b-4x8").with_overrides(name=spec.name)
    assert spec.with_overrides(nodes=4) == four_nodes
    with pytest.raises(ValueError, match=r"has no fields \['gpus'\]"):
        spec.with_overrides(gpus=2)


def test_ascend_preset_figures_are_the_documented_ones():
    spec = get_cluster("ascend910b-1x8")
    assert spec.device_memory_bytes == 64 * 2**30
    assert spec.inter_link.bandwidth_Bps == 200e9 / 8  # 200 Gb/s RoCE = 25 GB/s
    # HCCS 196 GB/s > PCIe 4.0 x16 31.5 GB/s > RoCE 25 GB/s
    intra, host, inter = (spec.intra_link, spec.host_link, spec.inter_link)
    assert intra.bandwidth_Bps > host.bandwidth_Bps > inter.bandwidth_Bps
    assert math.isclose(spec.peak_flops_for("bf16"), 313e12)
