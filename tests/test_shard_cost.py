"""Sharding cost model vs hand-computed cases and the published Megatron / ZeRO formulas."""
import pytest

from ms_efficient.core.cluster import (allgather_time_s, allreduce_time_s, get_cluster,
                                       reduce_scatter_time_s)
from ms_efficient.shard.baselines import (baseline_cost, megatron_activation_bytes,
                                          zero_model_state_bytes)
from ms_efficient.shard.cost import CostModel, evaluate
from ms_efficient.shard.strategies import (Layout, Mesh, OpSpec, Strategy, TensorRef,
                                           candidate_layouts, shard_tuple)
from ms_efficient.shard.workloads import TransformerDims, transformer_ops

NODE = get_cluster("ascend910b-1x8")
LINK = NODE.intra_link
S, B, H, A = 512, 2, 256, 8


def one_layer(batch=B):
    return transformer_ops(TransformerDims("t", 1, H, A, S, batch, include_head=False))


def test_unsharded_layer_keeps_korthikanti_34sbh_plus_5as2b():
    specs = one_layer()
    cost = evaluate(specs, {s.name: Strategy(Layout()) for s in specs}, CostModel(Mesh(1, 1), NODE))
    assert cost.acts == pytest.approx(megatron_activation_bytes(S, B, H, A))
    assert cost.comm_s == 0 and cost.redundant == 0


@pytest.mark.parametrize("t", [2, 4, 8])
def test_tensor_parallel_layer_matches_korthikanti_tp_formula(t):
    model = CostModel(Mesh(1, t), NODE)
    assert baseline_cost(one_layer(), model, "megatron-tp").acts == pytest.approx(
        megatron_activation_bytes(S, B, H, A, t, "tp"))


@pytest.mark.parametrize("t", [2, 8])
def test_sequence_parallel_layer_matches_korthikanti_sp_formula(t):
    model = CostModel(Mesh(1, t), NODE)
    assert baseline_cost(one_layer(), model, "megatron-tp-sp").acts == pytest.approx(
        megatron_activation_bytes(S, B, H, A, t, "sp"))


def test_tensor_parallel_layer_does_four_activation_allreduces():
    # f and g of Megatron: 2 all-reduces forward (proj, fc2), 2 backward (into ln1, ln2)
    model = CostModel(Mesh(1, 8), NODE)
    expected = 4 * allreduce_time_s(2 * S * B * H, 8, LINK)
    assert baseline_cost(one_layer(), model, "megatron-tp").comm_s == pytest.approx(expected)


@pytest.mark.parametrize("stage,method", [(0, "dp"), (1, "zero1"), (2, "zero2"), (3, "zero3")])
def test_pure_data_parallel_model_states_match_zero_paper(stage, method):
    dims = TransformerDims("t", 2, H, A, S, batch=8, include_head=False)
    specs = transformer_ops(dims)
    cost = baseline_cost(specs, CostModel(Mesh(1, 8), NODE), method)
    psi = dims.param_count()
    assert cost.params + cost.grads + cost.optim == pytest.approx(
        zero_model_state_bytes(psi, 8, stage))
    # one sequence per device, nothing split inside it: two unsharded layers of b = 1
    assert cost.acts == pytest.approx(2 * megatron_activation_bytes(S, 1, H, A))


def _matmul():
    return OpSpec("mm", "MatMul", (("b", 4), ("s", 8), ("h", 64), ("f", 128)),
                  (TensorRef(("b", "s", "h"), "input"), TensorRef(("h", "f"), "param")),
                  ("b", "s", "f"), contract=("h",))


def test_row_parallel_matmul_costs_by_hand():
    spec, mesh = _matmul(), Mesh(1, 2)
    cost = CostModel(mesh, NODE).node_cost(spec, Strategy(Layout(None, "h")))
    w_elems = 64 * 128 / 2
    assert (cost.params, cost.grads, cost.optim) == (2 * w_elems, 2 * w_elems, 12 * w_elems)
    # output [4, 8, 128] fp16 is a partial sum over the 2 devices: one all-reduce of 8 KiB
    assert cost.comm_s == pytest.approx(2 * LINK.latency_s + 2 * (1 / 2) * 8192 / LINK.bandwidth_Bps)
    assert shard_tuple(spec, Layout(None, "h"), mesh) == ((1, 1, 2), (2, 1))


def test_zero3_over_dp_shards_weights_and_gathers_them_twice():
    spec, mesh = _matmul(), Mesh(2, 1)
    model = CostModel(mesh, NODE)
    cost = model.node_cost(spec, Strategy(Layout("b", None), zero=3))
    w = 64 * 128
    assert cost.params + cost.grads + cost.optim == pytest.approx(16 * w / 2)
    assert cost.redundant == 0
    assert cost.comm_s == pytest.approx(reduce_scatter_time_s(2 * w, 2, LINK)
                                        + 2 * allgather_time_s(2 * w, 2, LINK))
    plain = model.node_cost(spec, Strategy(Layout("b", None), zero=0))
    assert plain.redundant == pytest.approx(plain.memory / 2)   # every byte held twice


def test_sequence_parallel_edge_gathers_forward_and_reduce_scatters_backward():
    specs = {s.name.split(".")[-1]: s for s in one_layer()}
    model = CostModel(Mesh(1, 4), NODE)
    opts = model.edge_options(specs["ln1"], Layout(None, "s"), specs["qkv"], Layout(None, "a"), 0)
    full = 2 * S * B * H
    gather, scatter = allgather_time_s(full, 4, LINK), reduce_scatter_time_s(full, 4, LINK)
    assert [o.comm_s for o in opts] == pytest.approx([gather + scatter, 2 * gather + scatter])
    assert [o.acts for o in opts] == pytest.approx([full, full / 4])


def test_layouts_respect_divisibility_and_unshardable_dims():
    ln = {s.name.split(".")[-1]: s for s in one_layer()}["ln1"]
    layouts = candidate_layouts(ln, Mesh(2, 4))
    assert all(lay.mp != "h" for lay in layouts)                   # normalised dim stays whole
    assert Layout("b", "s") in layouts and Layout("b", "b") not in layouts   # b=2 cannot split 8


def test_two_d_tensor_parallel_matmul_costs_by_hand():
    # dp splits the weight's f, mp its h: a 4-way split of w that no two devices share
    spec, mesh = _matmul(), Mesh(2, 2)
    cost = CostModel(mesh, NODE).node_cost(spec, Strategy(Layout("f", "h")))
    w_elems = 64 * 128 / 4
    assert (cost.params, cost.grads, cost.optim) == (2 * w_elems, 2 * w_elems, 12 * w_elems)
    assert cost.redundant == 0                      # nothing kept twice, no gradient all-reduce
    # output [4, 8, 128] fp16 split on f by dp, a partial sum over mp: all-reduce of 4 KiB
    assert cost.comm_s == pytest.approx(allreduce_time_s(2 * 4 * 8 * 128 / 2, 2, LINK))
    assert shard_tuple(spec, Layout("f", "h"), mesh) == ((1, 1, 2), (2, 2))


def test_dp_splits_model_dims_only_when_the_mesh_allows_it():
    spec = _matmul()
    both = {lay.dp for lay in candidate_layouts(spec, Mesh(2, 2))}
    batch_only = {lay.dp for lay in candidate_layouts(spec, Mesh(2, 2, dp_model_split=False))}
    assert both == {"b", "s", "h", "f"} and batch_only == {"b"}


def test_moe_workload_capacity_is_the_switch_formula_of_one_sequence():
    """TransformerDims.capacity is moe.split.switch_capacity of the seq tokens: ceil(1.25 x
    2 x 100 / 8) = ceil(31.25) = 32 slots, and capacity_factor 0 is dropless (seq slots, not
    0 as the ceil of a zero product would give)."""
    dims = TransformerDims("t", 1, 16, 2, 100, batch=1, num_experts=8, capacity_factor=1.25)
    assert dims.capacity == 32
    dropless = TransformerDims("t", 1, 16, 2, 100, batch=1, num_experts=8, capacity_factor=0)
    assert dropless.capacity == 100
