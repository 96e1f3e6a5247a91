"""Expert-parallel MoE layer: static routing tables, equivalence with MoEFeedForward, tied
replicas, grouped dispatch (drops as split.grouped_assignments), and a 2-worker msrun run
compared with one process.

Fast tests run in one process (W = 1, no communication init) in GRAPH_MODE. The slow test
reads tests/dist/check_ep_moe.py's results on 2 CPU workers (the session's one msrun job of
the 2-worker checks, tests/workers.py) and compares with MoEFeedForward on the whole batch here.
"""
import dataclasses
import functools

import numpy as np
import pytest

import mindspore as ms
from mindspore import ParameterTuple, Tensor, nn, ops

from tests import workers
from conftest import assert_within_float32_bound, float32_bound
from ms_efficient.core.cluster import get_cluster
from ms_efficient.efficientmoe.cost import CostModel, layer_cost, uneven_alltoall_time_s
from ms_efficient.moe.ep_layer import ExpertParallelMoE, init_expert_weights
from ms_efficient.moe.exchange import exchange_rows
from ms_efficient.moe.ep_routing import layer_tables, rank_dispatch, replica_sync
from ms_efficient.moe.layer import MoEFeedForward
from ms_efficient.moe.plan import ExpertPlan
from ms_efficient.moe.split import (SPLIT_UNITS, grouped_assignments, grouped_split_weights,
                                    source_rows)

ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")

E, H, F, K = 4, 16, 32, 2
B, S = 2, 8
T = B * S


def weights(seed=5):
    """Logical weights (router, w1, b1, w2, b2) with non-zero biases."""
    router, w1, b1, w2, b2 = init_expert_weights(E, H, F, init_std=0.3, seed=seed)
    rng = np.random.default_rng(seed)
    return (router, w1, rng.normal(0, 0.1, b1.shape).astype(np.float32), w2,
            rng.normal(0, 0.1, b2.shape).astype(np.float32))


def dense_layer(w, capacity=T, trace_ranks=1):
    layer = MoEFeedForward(H, F, E, K, capacity=capacity, trace_ranks=trace_ranks)
    layer.router.weight.set_data(Tensor(w[0]))
    for p, a in zip((layer.w1, layer.b1, layer.w2, layer.b2), w[1:]):
        p.set_data(Tensor(a))
    return layer


def ep_layer(w, slot_expert, slot_capacity, **kwargs):
    plan = ExpertPlan(slot_expert, [0] * len(slot_expert), slot_capacity)
    layer = ExpertParallelMoE(H, F, E, K, plan, **kwargs)
    layer.set_weights(*w)
    return layer


def batch(seed=0):
    rng = np.random.default_rng(seed)
    return (Tensor(rng.standard_normal((B, S, H)).astype(np.float32)),
            Tensor(rng.standard_normal((B, S, H)).astype(np.float32)))


class WeightedOutput(nn.Cell):
    """sum(y * dy) + 0.1 * aux_loss: a loss that reaches every output and the router."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def construct(self, x, dy):
        y, aux, _, _ = self.layer(x)
        return (y * dy).sum() + 0.1 * aux


def grads(layer, x, dy):
    """(dx, {name: grad}) of WeightedOutput for router, w1, b1, w2, b2."""
    params = [layer.router.weight, layer.w1, layer.b1, layer.w2, layer.b2]
    dx, g = ms.grad(WeightedOutput(layer), grad_position=0, weights=params)(x, dy)
    return dx.asnumpy(), dict(zip(("router", "w1", "b1", "w2", "b2"), (a.asnumpy() for a in g)))


def outputs_and_grads(layer, x, dy):
    """([y, aux, counts, dropped] as numpy, grads(layer, x, dy))."""
    return [a.asnumpy() for a in layer(x)], grads(layer, x, dy)


# --- float32 rounding bounds of the MoE layer (tests/conftest.py: float32_bound) ------------

GELU_CURVE = 0.80   # max |gelu''| of the tanh GELU (0.798, at u = 0): how fast its slope moves
ACT_ROUNDINGS = 10  # roundings in TanhGELU's forward (x*x*x, * c, + x, * c2, sigmoid, * x) or
                    # its slope: each side within gamma_10 of the exact function, relatively


def _numpy(a):
    return np.asarray(a.asnumpy() if isinstance(a, Tensor) else a, np.float64)


def moe_float32_bounds(w, x, dy=None, top_k=K, router_differs=False, numpy_gelu=False):
    """Per-element bounds on |a - b| for two float32 evaluations of the MoE layer with weights
    ``w`` = (router, w1, b1, w2, b2) on tokens ``x`` that route every token alike but sum in
    other orders or with other kernels (conftest.float32_bound: 2 gamma_n sum |terms| for a
    sum of n products): {"y": shaped as x} and, with ``dy``, the gradients of
    sum(y * dy) + 0.1 aux: "dx" (as x), "router" [E, H], "w1", "b1", "w2", "b2" (as in w).

    Every sum of the layer is bounded in turn, and an error reaches the next sum through that
    sum's other factor (|W2| for the hidden units; the GELU's slope, at most its value plus
    GELU_CURVE times the input's error). Along one chain the bounds add up: y's through
    u = x W1 + b1 (H + 1 terms), the GELU (ACT_ROUNDINGS), out = h W2 + b2 (F + 1 terms) and
    the K gate products summed: about gamma_(H+F) of |x||W1||W2| + |h||W2| + |b2|.
    Routing-free: each token's K gates are <= 1 and sum to 1, so a token's bound is its
    largest over the E experts, and a weight gradient's sum over an expert's rows is bounded
    by its sum over every token at gate 1 (at most T rows: n = T). The gate path's backward
    (renormalisation, softmax) is a linear map of norm <= 2 on d gate = dy . out
    (|d logit_e| = (p_e / sum_k p_k) |dg_e - sum_k g_k dg_k| for a chosen expert, 0 for the
    others); the aux loss adds at most 2 * 0.1 * E / T per logit.

    router_differs: the two sides' router logits come from different matmuls (numpy, or each
        rank's own rows against the whole batch): logits within 2 gamma_H sum |x||router|,
        probabilities within a relative expm1(2 dl) plus the softmax's rounding, gates twice
        that after the top-k renormalisation; the gates' error is added everywhere they reach.
    numpy_gelu: one side evaluates GELU as 0.5 u (1 + tanh z) (numpy_grouped_moe), which
        cancels where tanh -> -1: its rounding is bounded by |u| there, not by |gelu(u)|.
    """
    router, w1, b1, w2, b2 = (_numpy(a) for a in w)
    e, h, f = w1.shape
    b1_shape, b2_shape = b1.shape, b2.shape
    b1, b2 = b1.reshape(e, f), b2.reshape(e, h)
    x_shape = np.shape(x)
    x = _numpy(x).reshape(-1, h)
    t = x.shape[0]
    ax, aw1, aw2, ar = np.abs(x), np.abs(w1), np.abs(w2), np.abs(router)
    # the gates' relative error per token (0 when both sides compute the same logits)
    d_gate = np.zeros(t)
    if router_differs:
        d_logit = float32_bound(h, ax @ ar.T).max(axis=1)
        d_gate = (2 * (np.expm1(2 * d_logit) + float32_bound(e + 3, 1.0))
                  + float32_bound(top_k + 1, 1.0))
    # forward, every token through every expert: [T, E, F] hidden, [T, E, H] expert outputs
    u = np.einsum("th,ehf->tef", x, w1) + b1
    d_u = float32_bound(h + 1, np.einsum("th,ehf->tef", ax, aw1) + np.abs(b1))
    c2 = 2 * np.sqrt(2 / np.pi)
    sig = 1 / (1 + np.exp(-c2 * (u + 0.044715 * u ** 3)))
    hid = u * sig                                              # TanhGELU = u sigmoid(2 z)
    slope_terms = (sig, u * sig * (1 - sig) * c2 * (1 + 3 * 0.044715 * u ** 2))
    slope = slope_terms[0] + slope_terms[1]
    act_scale = np.abs(hid) + (np.abs(u) if numpy_gelu else 0)
    d_hid = (np.abs(slope) + GELU_CURVE * d_u) * d_u + float32_bound(ACT_ROUNDINGS, act_scale)
    out_abs = np.einsum("tef,efh->teh", np.abs(hid), aw2) + np.abs(b2)
    d_out = float32_bound(f + 1, out_abs) + np.einsum("tef,efh->teh", d_hid, aw2)
    # y_t = sum_k g_k out_k: K gate products summed, sum_k g_k = 1 (+ the gates' own error)
    bounds = {"y": (d_out + float32_bound(top_k, out_abs)
                    + d_gate[:, None, None] * out_abs).max(axis=1).reshape(x_shape)}
    if dy is None:
        return bounds
    ady = np.abs(_numpy(dy).reshape(t, h))
    dy_g = ady * (1 + d_gate[:, None])           # |dy| times the gates (<= 1) and their error
    # backward at gate <= 1: dh = g dy W2^T (H terms), du = dh * slope
    dh_abs = np.einsum("th,efh->tef", ady, aw2)
    d_dh = float32_bound(h, dh_abs) + d_gate[:, None, None] * dh_abs
    d_du = (np.abs(slope) * d_dh + dh_abs * (
        GELU_CURVE * d_u + float32_bound(ACT_ROUNDINGS + 1, np.abs(slope_terms[0])
                                         + np.abs(slope_terms[1]))))
    du_abs = dh_abs * np.abs(slope)
    # dx: the experts' du W1^T (F terms), the gate path's d logit R (E terms), K + 1 added
    dx_abs = np.einsum("tef,ehf->teh", du_abs, aw1)
    d_dx = (float32_bound(f, dx_abs) + np.einsum("tef,ehf->teh", d_du, aw1)).max(axis=1)
    dg_abs = np.einsum("th,teh->te", ady, out_abs)
    d_dg = (float32_bound(h, dg_abs) + np.einsum("th,teh->te", ady, d_out)).max(axis=1)
    logit_abs = 2 * (top_k + 1) * dg_abs.max(axis=1) + 0.2 * e / t       # [T]
    d_dlogit = (2 * d_dg + float32_bound(e + top_k + 4, logit_abs)
                + 2 * d_gate * logit_abs)          # the probabilities' own error, if any
    r_abs = ar.sum(axis=0)                                               # [H]
    d_dx = (d_dx + d_dlogit[:, None] * r_abs + float32_bound(e, logit_abs[:, None] * r_abs)
            + float32_bound(top_k + 1, dx_abs.max(axis=1) + logit_abs[:, None] * r_abs))
    bounds["dx"] = d_dx.reshape(x_shape)
    # gradients: sums over an expert's rows (<= T of them, gate <= 1)
    bounds["router"] = np.broadcast_to(
        float32_bound(t, logit_abs @ ax) + d_dlogit @ ax, (e, h)).copy()
    bounds["w1"] = (float32_bound(t, np.einsum("th,tef->ehf", ax, du_abs))
                    + np.einsum("th,tef->ehf", ax, d_du))
    bounds["b1"] = (float32_bound(t, du_abs.sum(axis=0)) + d_du.sum(axis=0)).reshape(b1_shape)
    bounds["w2"] = (float32_bound(t, np.einsum("tef,th->efh", np.abs(hid), dy_g))
                    + np.einsum("tef,th->efh", d_hid, ady)
                    + np.einsum("tef,th->efh", np.abs(hid), ady * d_gate[:, None]))
    bounds["b2"] = np.broadcast_to(float32_bound(t, dy_g.sum(axis=0))
                                   + (ady * d_gate[:, None]).sum(axis=0), (e, h)).reshape(
        b2_shape).copy()
    return bounds


@functools.lru_cache(maxsize=None)
def reference_bounds(skewed=False):
    """moe_float32_bounds of ``reference(skewed)``'s weights and batch."""
    w, x, dy = skewed_inputs() if skewed else (weights(), *batch())
    return moe_float32_bounds(w, x, dy)


@functools.lru_cache(maxsize=None)
def reference(skewed=False):
    """outputs_and_grads of the dense reference layer (MoEFeedForward, capacity T) on
    ``weights()`` and ``batch()`` (``skewed_inputs()`` if ``skewed``) in GRAPH_MODE, computed
    once for the tests that compare their layers with it (two compiles each time otherwise)."""
    w, x, dy = skewed_inputs() if skewed else (weights(), *batch())
    mode = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        return outputs_and_grads(dense_layer(w), x, dy)
    finally:
        ms.set_context(mode=mode)


# --- static tables (numpy) --------------------------------------------------------------------


def simulate_dispatch(plan, rows_RS, world):
    """Follow every reservable arrival (rank r, expert e, p) through the tables of both ends:
    returns {(r, e, p): (slot, row within the slot's computed rows)}."""
    tables = [rank_dispatch(plan, rows_RS, E, r) for r in range(world)]
    for r, tab in enumerate(tables):       # AlltoAllV counts agree across the group
        assert [t.recv_counts[r] for t in tables] == tab.send_counts.tolist()
        assert tab.recv_index_N.size == tab.recv_counts.sum()      # no padding row
    landing = {}
    for r, tab in enumerate(tables):
        send_end = np.cumsum(tab.send_counts)
        for e in range(E):
            for p in range(int(tab.rows_E[e])):
                j = int((tab.ends_EJ[e] <= p).sum())
                row = int(tab.shift_EJ[e, j]) + p
                assert 0 <= row < send_end[-1]
                dest = int(np.searchsorted(send_end, row, side="right"))
                offset = row - (send_end[dest] - tab.send_counts[dest])
                recv = tables[dest]
                recv_start = int(recv.recv_counts[:r].sum())
                n = int(np.flatnonzero(recv.recv_index_N == recv_start + offset)[0])
                start = 0          # slot-major layout: groups, then slots of a group
                for cap, members in recv.groups:
                    if n < start + cap * len(members):
                        slot = int(recv.local_slots[members[(n - start) // cap]])
                        landing[(r, e, p)] = (slot, (n - start) % cap)
                        break
                    start += cap * len(members)
    return landing


@pytest.mark.parametrize("slot_expert, slot_device, slot_capacity", [
    ([0, 1, 2, 3], [0, 0, 1, 1], [8, 8, 8, 8]),
    ([0, 1, 2, 0, 3], [0, 0, 0, 1, 1], [12, 7, 9, 4, 10]),     # rank 1 spills expert 0
    ([0, 0, 1, 2, 3, 3], [0, 1, 1, 0, 1, 0], [5, 5, 6, 6, 3, 9]),
])
def test_every_reserved_row_lands_once_on_a_slot_of_its_expert(slot_expert, slot_device,
                                                               slot_capacity):
    plan = ExpertPlan(slot_expert, slot_device, slot_capacity)
    rows_RS = source_rows(plan, E, 2)
    np.testing.assert_array_equal(rows_RS.sum(axis=0), slot_capacity)
    landing = simulate_dispatch(plan, rows_RS, 2)
    assert len(set(landing.values())) == len(landing) == sum(slot_capacity)
    for (r, e, _), (slot, _) in landing.items():
        assert plan.slot_expert[slot] == e
    got = np.zeros_like(rows_RS)
    for (r, _, _), (slot, _) in landing.items():
        got[r, slot] += 1
    np.testing.assert_array_equal(got, rows_RS)


def test_a_replica_on_every_rank_keeps_each_ranks_tokens_local():
    plan = ExpertPlan([0, 1, 0, 2, 3], [0, 0, 1, 1, 1], [8, 16, 8, 16, 16])
    rows_RS = source_rows(plan, E, 2)
    assert rows_RS[:, [0, 2]].tolist() == [[8, 0], [0, 8]]       # expert 0: own replica only
    assert rows_RS[:, 1].tolist() == [8, 8]                      # single slots: equal shares


def test_a_small_local_replica_spills_to_its_sibling_after_its_own_rows():
    plan = ExpertPlan([0, 1, 2, 0, 3], [0, 0, 0, 1, 1], [12, 8, 8, 4, 8])
    rows_RS = source_rows(plan, E, 2)
    assert rows_RS[:, [0, 3]].tolist() == [[8, 0], [4, 4]]
    tab = rank_dispatch(plan, rows_RS, E, 1)
    assert tab.ends_EJ[0].tolist() == [4, 8]                     # local slot 3 first, then slot 0


def test_a_load_forecast_splits_capacity_in_proportion():
    plan = ExpertPlan([0, 1, 2, 3], [0, 0, 1, 1], [10, 8, 8, 8])
    load = np.array([[3.0, 1, 1, 1], [1.0, 1, 1, 1]])
    rows_RS = source_rows(plan, E, 2, rank_load_RE=load)
    assert rows_RS[:, 0].tolist() == [8, 2]   # 10 * 3/4 = 7.5 -> 8 (lower index on a tie)


def test_replica_sync_reduces_only_experts_replicated_across_ranks():
    plan = ExpertPlan([0, 1, 0, 2, 3, 3], [0, 0, 1, 1, 1, 1], [4] * 6)
    r1 = replica_sync(plan, 1)                                  # rows: experts 0, 2, 3, 3
    assert r1.needed and r1.cross_experts.tolist() == [0] and r1.num_cross == 1
    assert r1.first_L.tolist() == [0, 1, 2, 2]                  # expert 3 summed at row 2
    assert r1.cross_L.tolist() == [0, 1, 1, 1]                  # only expert 0 is AllReduced
    assert r1.pick_L.tolist() == [0, 2, 3, 3]                   # expert 0 from the AllReduce
    assert not replica_sync(ExpertPlan([0, 1, 2, 3], [0, 0, 1, 1], [4] * 4), 0).needed
    # a budget of 3 rows and a cross table of 2: the empty row keeps its own (zero) gradient
    r0 = replica_sync(plan, 0, budget=3, num_cross=2)
    assert r0.first_L.tolist() == [0, 1, 2] and r0.pick_L.tolist() == [0, 3, 4]


def test_bad_plans_and_arguments_are_rejected():
    plan = ExpertPlan([0, 1, 2, 3], [0, 0, 1, 1], [4] * 4)
    with pytest.raises(ValueError, match="but the cluster has 1 devices"):
        ExpertParallelMoE(H, F, E, K, plan)                     # W = 1, slots on device 1
    with pytest.raises(ValueError, match="rank 2 hosts no slot"):
        rank_dispatch(plan, source_rows(plan, E, 3), E, 2)
    cold = ExpertPlan([0, 1, 2, 3], [0, 0, 1, 1], [8, 8, 0, 0])
    with pytest.raises(ValueError, match="rank 1 hosts only slots with no reserved row"):
        rank_dispatch(cold, source_rows(cold, E, 2), E, 1)
    with pytest.raises(ValueError, match="'top_k' must be in"):
        ExpertParallelMoE(H, F, E, 5, ExpertPlan([0, 1, 2, 3], [0] * 4, [4] * 4))
    with pytest.raises(ValueError, match="'rank' must be this process's rank"):
        ExpertParallelMoE(H, F, E, K, ExpertPlan([0, 1, 2, 3], [0] * 4, [4] * 4), rank=1)
    with pytest.raises(ValueError, match="'rank_load_RE' must have shape"):
        source_rows(plan, E, 2, rank_load_RE=np.ones((2, 3)))


# --- one process (W = 1) ----------------------------------------------------------------------


def test_replicas_start_identical_from_the_logical_expert_seed():
    layer = ExpertParallelMoE(H, F, E, K, ExpertPlan([2, 0, 1, 3, 2], [0] * 5, [4] * 5), seed=9)
    assert layer.local_experts.tolist() == [2, 0, 1, 3, 2]
    _, w1, _, w2, _ = init_expert_weights(E, H, F, seed=9, experts=[2])
    np.testing.assert_array_equal(layer.w1.asnumpy()[[0, 4]], np.stack([w1[0], w1[0]]))
    np.testing.assert_array_equal(layer.w2.asnumpy()[4], w2[0])
    assert np.abs(layer.w1.asnumpy()[0] - layer.w1.asnumpy()[1]).max() > 0



@functools.lru_cache(maxsize=None)
def one_slot_each(dispatch):
    """outputs_and_grads of the layer with one slot per expert and room for every row (T
    each), static or grouped, on ``weights()`` and ``batch()`` in GRAPH_MODE, computed once
    for the tests that compare with it (as ``reference``)."""
    w, (x, dy) = weights(), batch()
    mode = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        make = ep_layer if dispatch == "static" else grouped_layer
        return outputs_and_grads(make(w, [0, 1, 2, 3], [T] * E), x, dy)
    finally:
        ms.set_context(mode=mode)


@pytest.mark.parametrize("mode", [ms.GRAPH_MODE, ms.PYNATIVE_MODE], ids=["graph", "pynative"])
def test_one_replica_per_expert_with_room_for_all_tokens_equals_moe_feedforward(mode):
    ms.set_context(mode=mode)
    try:
        w = weights()
        x, dy = batch()
        if mode == ms.GRAPH_MODE:
            (out, (dx, g)), (out_ref, (dx_ref, g_ref)) = one_slot_each("static"), reference()
        else:
            out, (dx, g) = outputs_and_grads(ep_layer(w, [0, 1, 2, 3], [T] * E), x, dy)
            out_ref, (dx_ref, g_ref) = outputs_and_grads(dense_layer(w), x, dy)
        # forward: the same BatchMatMul on the same capacity groups, the rest gathers: bit-exact
        for a, b in zip(out, out_ref):
            np.testing.assert_array_equal(a, b)
        # backward: the EP layer's dispatch / combine / replica-sync graph against the dense
        # layer's gathers adds dx's and the weights' partial sums in other orders: each within
        # the chained sums' float32 bound (moe_float32_bounds: gamma over H, F and T terms)
        bounds = reference_bounds()
        assert_within_float32_bound(dx, dx_ref, bounds["dx"], "static vs dense: dx")
        for name in g:
            assert_within_float32_bound(g[name], g_ref[name], bounds[name],
                                        f"static vs dense: {name}")
    finally:
        ms.set_context(mode=ms.GRAPH_MODE)


def test_with_one_rank_the_same_capacities_drop_the_same_tokens_as_moe_feedforward():
    w = weights()
    x, _ = batch()
    caps = [3, 4, 5, 6]
    y, aux, counts, dropped = ep_layer(w, [0, 1, 2, 3], caps)(x)
    y_ref, aux_ref, counts_ref, dropped_ref = dense_layer(w, capacity=caps)(x)
    assert int(dropped.asnumpy()) == int(dropped_ref.asnumpy()) > 0
    np.testing.assert_array_equal(y.asnumpy(), y_ref.asnumpy())
    np.testing.assert_array_equal(counts.asnumpy(), counts_ref.asnumpy())


def test_replicating_an_expert_changes_neither_outputs_nor_input_gradient():
    w = weights()
    x, dy = batch()
    single, (dx_ref, g_ref) = one_slot_each("static")
    # expert 0 twice: slot 0 keeps its first 3 arrivals, slot 4 the rest
    replicated = ep_layer(w, [0, 1, 2, 3, 0], [3, T, T, T, T])
    assert replicated.tables.static.ends_EJ[0].tolist() == [3, T + 3]
    # y: expert 0's rows run in a [1, 3, H] BatchMatMul and in the [4, T, H] group of the
    # other slots, against one [4, T, H] product: other kernels' blocking, so other summation
    # orders of x W1 (H terms) and h W2 (F terms): within their chained float32 bound
    # (moe_float32_bounds). Routing, aux loss, counts and drops are the same code: bit-exact.
    bounds = reference_bounds()
    (y, *rest), (y_ref, *rest_ref) = [a.asnumpy() for a in replicated(x)], single
    assert_within_float32_bound(y, y_ref, bounds["y"], "static replica: y")
    for a, b in zip(rest, rest_ref):
        np.testing.assert_array_equal(a, b)
    dx, g = grads(replicated, x, dy)
    # dx and the weight gradients: other products and the replicas' partial sums added
    assert_within_float32_bound(dx, dx_ref, bounds["dx"], "static replica: dx")
    # each replica's gradient is the logical expert's, summed over both replicas
    for name in ("w1", "b1", "w2", "b2"):
        np.testing.assert_array_equal(g[name][0], g[name][4])
        assert_within_float32_bound(g[name][:4], g_ref[name], bounds[name],
                                    f"static replica: {name}")


def test_the_second_replica_really_computes_tokens():
    w = weights()
    x, _ = batch()
    layer = ep_layer(w, [0, 1, 2, 3, 0], [3, T, T, T, T])
    y = layer(x)[0].asnumpy()
    layer.w2.set_data(Tensor(layer.w2.asnumpy() * np.array([1, 1, 1, 1, 2], np.float32)
                             .reshape(-1, 1, 1)))
    assert np.abs(layer(x)[0].asnumpy() - y).max() > 1e-3


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_replicas_stay_identical_and_train_like_one_expert(optimizer):
    w = weights()

    def train(layer):
        params = layer.trainable_params()
        opt = (nn.SGD(params, learning_rate=0.05) if optimizer == "sgd"
               else nn.Adam(params, learning_rate=0.01))
        step = nn.TrainOneStepCell(WeightedOutput(layer), opt)
        for i in range(4):
            step(*batch(1 + i))
        return layer

    single = train(ep_layer(w, [0, 1, 2, 3], [T] * E))
    replicated = train(ep_layer(w, [0, 1, 0, 2, 3, 0], [3, T, 5, T, T, T]))
    for name in ("w1", "b1", "w2", "b2"):
        p = getattr(replicated, name).asnumpy()
        np.testing.assert_array_equal(p[0], p[2])
        np.testing.assert_array_equal(p[0], p[5])
        np.testing.assert_allclose(p[[0, 1, 3, 4]], getattr(single, name).asnumpy(),
                                   rtol=1e-4, atol=1e-6)
    assert np.abs(single.w1.asnumpy() - w[1]).max() > 1e-3     # training moved the weights


# --- grouped dispatch -------------------------------------------------------------------------


def grouped_layer(w, slot_expert, slot_capacity, **kwargs):
    plan = ExpertPlan(slot_expert, [0] * len(slot_expert), slot_capacity, dispatch="grouped")
    layer = ExpertParallelMoE(H, F, E, K, plan, **kwargs)
    layer.set_weights(*w)
    return layer


def skewed_inputs(seed=0):
    """(weights, x, dy) where expert 3 never makes a token's top 2: x carries +4 on feature 0,
    which the router scores +1 for experts 0-2 and -3 for expert 3."""
    w = list(weights())
    w[0] = w[0].copy()
    w[0][:3, 0] += 1.0
    w[0][3, 0] = -3.0
    x, dy = batch(seed)
    shift = np.zeros(H, np.float32)
    shift[0] = 4.0
    return tuple(w), Tensor(x.asnumpy() + shift), dy


def numpy_grouped_moe(x_TH, w, plan, counts_RE, assigned_RS, rank, top_k):
    """y_TH of rank ``rank`` in numpy: top-k routing (k-major arrivals), then the kept
    assignments of :func:`grouped_assignments` (rank r's arrivals of e cut over e's replicas at
    the cumulative split weights; arrival q of (r, s) kept iff q < assigned_RS[r, s])."""
    router, w1, b1, w2, b2 = w
    logits = x_TH @ router.T
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    ids_TK = np.argsort(-probs, axis=1, kind="stable")[:, :top_k]
    gate_TK = np.take_along_axis(probs, ids_TK, axis=1)
    gate_TK /= gate_TK.sum(axis=1, keepdims=True)
    weights_RS = grouped_split_weights(plan, w1.shape[0], np.arange(counts_RE.shape[0]))
    y = np.zeros_like(x_TH)
    seen = np.zeros(w1.shape[0], np.int64)
    for k in range(top_k):                        # k-major arrivals
        for t in range(x_TH.shape[0]):
            e, p = ids_TK[t, k], seen[ids_TK[t, k]]
            seen[e] += 1
            slots = plan.replicas_of(e)
            ends = counts_RE[rank, e] * np.cumsum(weights_RS[rank, slots]) // SPLIT_UNITS
            j = int((ends <= p).sum())
            if p - (ends[j - 1] if j else 0) >= assigned_RS[rank, slots[j]]:
                continue                          # dropped
            u = x_TH[t] @ w1[e] + b1[e, 0]
            hid = 0.5 * u * (1 + np.tanh(np.sqrt(2 / np.pi) * (u + 0.044715 * u ** 3)))
            y[t] += gate_TK[t, k] * (hid @ w2[e] + b2[e, 0])
    return y


@pytest.mark.parametrize("caps", [[T] * E, [1, 1, 1, K * T - 3]],
                         ids=["roomy-slots", "buffer-of-exactly-all-rows"])
def test_grouped_layer_with_room_for_every_row_equals_moe_feedforward(caps):
    """Outputs and every gradient equal the dropless static layer, expert 3 getting no token;
    a slot's capacity is only its share of the device buffer (slots of 1 row take 8+)."""
    w, x, dy = skewed_inputs()
    ep = grouped_layer(w, [0, 1, 2, 3], caps)
    out, (out_ref, (dx_ref, g_ref)) = ep(x), reference(skewed=True)
    counts = out[2].asnumpy()
    assert counts[0, 3] == 0 and (counts[0, :3] > 1).all()
    assert int(out[3].asnumpy()) == 0
    # y: the grouped layer's cblas_sgemm grouped matmuls against the dense layer's
    # BatchMatMul: other kernels, other summation orders of x W1 (H terms) and h W2 (F terms),
    # within their chained float32 bound (moe_float32_bounds). Routing, aux loss, counts and
    # drops are the same code: bit-exact.
    bounds = reference_bounds(skewed=True)
    assert_within_float32_bound(out[0].asnumpy(), out_ref[0], bounds["y"], "grouped vs dense: y")
    for a, b in zip(out[1:], out_ref[1:]):
        np.testing.assert_array_equal(a.asnumpy(), b)
    dx, g = grads(ep, x, dy)
    # the backward's grouped products (dx, weight gradients) against BatchMatMul's: as y
    assert_within_float32_bound(dx, dx_ref, bounds["dx"], "grouped vs dense: dx")
    for name in g:
        assert_within_float32_bound(g[name], g_ref[name], bounds[name],
                                    f"grouped vs dense: {name}")
    assert np.abs(g["w1"][:3]).max() > 1e-3 and np.abs(g["w1"][3]).max() == 0


def test_a_small_grouped_buffer_drops_exactly_the_assignments_of_the_rule():
    """Expert 0 on slots 0 and 4 (split 1:1), one buffer of A - 5 rows: the rule keeps slots
    0-3 whole and drops the tail of slot 4; every expert keeps a prefix of its arrivals, so
    the static layer with those per-expert capacities is the reference (outputs, gradients)."""
    w = weights()
    x, dy = batch()
    counts_RE = reference()[0][2].astype(np.int64)              # MoEFeedForward's counts
    slot_expert = [0, 1, 2, 3, 0]
    caps = [4, 1, 1, K * T - 5 - 10, 4]                   # buffer K*T - 5 on device 0
    plan = ExpertPlan(slot_expert, [0] * 5, caps, dispatch="grouped")
    assigned_RS, dropped = grouped_assignments(plan, counts_RE, [0])
    assert dropped == 5 and assigned_RS[0, 4] < counts_RE[0, 0] - assigned_RS[0, 0]
    kept_E = np.bincount(slot_expert, weights=assigned_RS[0], minlength=E).astype(int)
    assert (kept_E >= 1).all() and (kept_E < counts_RE[0]).sum() >= 1

    ep, ref = grouped_layer(w, slot_expert, caps), dense_layer(w, capacity=kept_E.tolist())
    y, aux, counts, got_dropped = ep(x)
    y_ref, aux_ref, _, dropped_ref = ref(x)
    assert int(got_dropped.asnumpy()) == dropped == int(dropped_ref.asnumpy())
    np.testing.assert_array_equal(counts.asnumpy(), counts_RE)
    np.testing.assert_array_equal(aux.asnumpy(), aux_ref.asnumpy())     # same routing code
    # y: grouped cblas_sgemm products against the static layer's BatchMatMul, both without
    # the dropped assignments (which the counts above pin down exactly): other summation
    # orders of x W1 (H terms) and h W2 (F terms), within their chained float32 bound
    bounds = moe_float32_bounds(w, x, dy)
    assert_within_float32_bound(y.asnumpy(), y_ref.asnumpy(), bounds["y"],
                                "small grouped buffer vs static: y")
    # against numpy (its own softmax too): the bound with the gates' rounding added
    assert_within_float32_bound(
        y.asnumpy().reshape(T, H),
        numpy_grouped_moe(x.asnumpy().reshape(T, H), w, plan, counts_RE, assigned_RS, 0, K),
        moe_float32_bounds(w, x, router_differs=True, numpy_gelu=True)["y"].reshape(T, H),
        "small grouped buffer vs numpy: y")
    (dx, g), (dx_ref, g_ref) = grads(ep, x, dy), grads(ref, x, dy)
    assert_within_float32_bound(dx, dx_ref, bounds["dx"], "small grouped buffer vs static: dx")
    for name in ("w1", "b1", "w2", "b2"):
        np.testing.assert_array_equal(g[name][0], g[name][4])
        assert_within_float32_bound(g[name][:4], g_ref[name], bounds[name],
                                    f"small grouped buffer vs static: {name}")


@pytest.mark.parametrize("caps", [[T] * 5, [3, T, T, T, 13]], ids=["half-half", "3:13"])
def test_replicating_an_expert_in_a_grouped_plan_changes_neither_outputs_nor_input_gradient(
        caps):
    w = weights()
    x, dy = batch()
    single, (dx_ref, g_ref) = one_slot_each("grouped")
    replicated = grouped_layer(w, [0, 1, 2, 3, 0], caps)
    cumw = replicated.tables.grouped.cut_hi_V[[0, 4]].tolist()          # expert 0's two slots
    assert cumw == ([SPLIT_UNITS // 2, SPLIT_UNITS] if caps[0] == T else [768, SPLIT_UNITS])
    # y: expert 0's rows split over two groups of the grouped matmul (other row counts per
    # cblas_sgemm call, so other blocking and summation orders of x W1 and h W2): within the
    # chained float32 bound (moe_float32_bounds). Routing, aux, counts, drops: bit-exact.
    bounds = reference_bounds()
    (y, *rest), (y_ref, *rest_ref) = [a.asnumpy() for a in replicated(x)], single
    assert_within_float32_bound(y, y_ref, bounds["y"], "grouped replica: y")
    for a, b in zip(rest, rest_ref):
        np.testing.assert_array_equal(a, b)
    dx, g = grads(replicated, x, dy)
    # dx and the weight gradients: other products and the replicas' partial sums added
    assert_within_float32_bound(dx, dx_ref, bounds["dx"], "grouped replica: dx")
    for name in ("w1", "b1", "w2", "b2"):
        np.testing.assert_array_equal(g[name][0], g[name][4])
        assert_within_float32_bound(g[name][:4], g_ref[name], bounds[name],
                                    f"grouped replica: {name}")
    # the second replica really computes tokens
    y = replicated(x)[0].asnumpy()
    replicated.w2.set_data(Tensor(replicated.w2.asnumpy()
                                  * np.array([1, 1, 1, 1, 2], np.float32).reshape(-1, 1, 1)))
    assert np.abs(replicated(x)[0].asnumpy() - y).max() > 1e-3


def test_grouped_tables_follow_the_split_weights_and_device_buffers():
    plan = ExpertPlan([0, 1, 2, 0, 3], [0, 0, 0, 1, 1], [24, 32, 32, 8, 32], dispatch="grouped")
    t1 = layer_tables(plan, E, 1, 2).grouped              # budget 3: device 1's third slot empty
    assert t1.budget == 3 and t1.slot_of_V.tolist() == [0, 1, 2, 3, 4, -1]
    assert t1.expert_V.tolist() == [0, 1, 2, 0, 3, E]
    assert t1.cut_lo_V[[0, 3]].tolist() == [0, 2048]          # rank 1 spills half of expert 0
    assert t1.cut_hi_V[[0, 3]].tolist() == [2048, 4096]
    assert t1.cut_hi_V[[1, 2, 4, 5]].tolist() == [4096, 4096, 4096, 0]
    t0 = layer_tables(plan, E, 0, 2).grouped
    assert t0.cut_lo_V[[0, 3]].tolist() == [0, 4096] and t0.cut_hi_V[[0, 3]].tolist() == [4096] * 2
    assert t1.buffer_D.tolist() == [88, 40]
    assert t1.block_start_V.tolist() == [0, 0, 0, 88, 88, 88]
    assert t1.earlier_on_device_VV[:, 2].tolist() == [1, 1, 0, 0, 0, 0]
    assert t1.earlier_on_device_VV[:, 5].tolist() == [0, 0, 0, 1, 1, 0]
    with pytest.raises(ValueError, match=r"'slots_per_device' must be >= .* \(3, per device "
                                         r"\[3, 2\]\), but got 2"):
        layer_tables(plan, E, 1, 2, budget=2)


def test_bad_grouped_plans_are_rejected():
    empty = ExpertPlan([0, 1, 2, 3], [0] * 4, [0] * 4, dispatch="grouped")
    with pytest.raises(ValueError, match=r"row buffer >= 1 on every device, but device_rows"):
        ExpertParallelMoE(H, F, E, K, empty)
    plan = ExpertPlan([0, 1, 2, 3], [0] * 4, [4] * 4, dispatch="grouped")
    with pytest.raises(ValueError, match="'rank_load_RE' splits the capacities of static"):
        ExpertParallelMoE(H, F, E, K, plan, rank_load_RE=np.ones((1, E)))


def test_a_grouped_layer_refuses_more_tokens_than_its_int32_split_is_exact_for(monkeypatch):
    import ms_efficient.moe.ep_layer as ep_layer_module

    monkeypatch.setattr(ep_layer_module, "MAX_GROUPED_TOKENS", T - 1)
    layer = grouped_layer(weights(), [0, 1, 2, 3], [T] * E)
    with pytest.raises(ValueError, match=f"at most {T - 1} local tokens per call, but got {T}"):
        layer(batch()[0])



# --- set_plan: a re-plan with the same buffers is data ---------------------------------------


class ForwardAndGrads(nn.Cell):
    """One compiled graph: (WeightedOutput, (dx, ddy), grads of router, w1, b1, w2, b2)."""

    def __init__(self, layer):
        super().__init__()
        self.loss = WeightedOutput(layer)
        self.params = ParameterTuple([layer.router.weight, layer.w1, layer.b1, layer.w2,
                                      layer.b2])
        self.grad = ops.GradOperation(get_all=True, get_by_list=True)

    def construct(self, x, dy):
        return self.loss(x, dy), self.grad(self.loss, self.params)(x, dy)


def count_compiles(monkeypatch):
    """The worker script's compile recorder (tests/dist/check_ep_moe.py), undone after the
    test."""
    return workers.load_script("check_ep_moe").count_compiles(monkeypatch.setattr)


# Both plans keep one buffer of K*T - 5 rows, so rows are dropped and WHICH ones depends on the
# slots' order and the split; B replicates expert 0 (split 3:6) and reorders the others.
REPLAN_A = ([0, 1, 2, 3], [8, 8, 8, K * T - 5 - 24])
REPLAN_B = ([3, 0, 2, 1, 0], [4, 3, 7, 7, 6])


def test_set_plan_switches_a_compiled_grouped_layer_to_a_new_plan_without_recompiling(
        monkeypatch):
    """Plan A compiles; set_plan(B) (same buffer, expert 0 replicated, other experts moved):
    outputs, input and weight gradients and the weights themselves equal a fresh layer of
    plan B, and no graph was compiled again. A table kept as a compile-time constant would
    still give A's outputs, which differ from B's."""
    w = weights()
    x, dy = batch()
    compiled = count_compiles(monkeypatch)
    layer = grouped_layer(w, *REPLAN_A, slots_per_device=5)
    step = ForwardAndGrads(layer)
    out_a = [a.asnumpy() for a in layer(x)]
    step(x, dy)
    assert compiled == ["ExpertParallelMoE", "ForwardAndGrads"]     # the counter sees compiles

    plan_b = ExpertPlan(REPLAN_B[0], [0] * 5, REPLAN_B[1], dispatch="grouped")
    layer.set_plan(plan_b)
    out = [a.asnumpy() for a in layer(x)]
    loss, ((dx, _), g) = step(x, dy)
    assert compiled == ["ExpertParallelMoE", "ForwardAndGrads"]     # nothing recompiled
    assert layer.local_experts.tolist() == REPLAN_B[0]

    fresh = grouped_layer(w, *REPLAN_B)
    out_ref = [a.asnumpy() for a in fresh(x)]
    loss_ref, ((dx_ref, _), g_ref) = ForwardAndGrads(fresh)(x, dy)
    assert int(out_ref[3]) > 0 and np.abs(out_ref[0] - out_a[0]).max() > 1e-3
    for got, ref in zip(out, out_ref):
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(loss.asnumpy(), loss_ref.asnumpy(), rtol=1e-6)
    np.testing.assert_allclose(dx.asnumpy(), dx_ref.asnumpy(), rtol=1e-6, atol=1e-7)
    for name, a, b in zip(("router", "w1", "b1", "w2", "b2"), g, g_ref):
        np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=1e-5, atol=1e-7, err_msg=name)
    for name in ("w1", "b1", "w2", "b2"):
        np.testing.assert_array_equal(getattr(layer, name).asnumpy(),
                                      getattr(fresh, name).asnumpy())
    for a, b in zip(layer.expert_weights(), w[1:]):
        np.testing.assert_array_equal(a, b)


def test_an_empty_budget_slot_computes_nothing_and_gets_no_gradient():
    """slots_per_device above the plan's slots: the same outputs and gradients as the
    default budget, and the spare rows' gradients are zero."""
    w, x, dy = skewed_inputs()
    tight, spare = (grouped_layer(w, [0, 1, 2, 3], [T] * E, slots_per_device=n) for n in (4, 6))
    assert spare.w1.shape[0] == 6 and np.abs(spare.w1.asnumpy()[4:]).max() == 0
    for a, b in zip(spare(x), tight(x)):
        np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=1e-6, atol=1e-7)
    (dx, g), (dx_ref, g_ref) = grads(spare, x, dy), grads(tight, x, dy)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-6, atol=1e-7)
    for name in ("w1", "b1", "w2", "b2"):
        np.testing.assert_allclose(g[name][:4], g_ref[name], rtol=1e-6, atol=1e-7)
        assert np.abs(g[name][4:]).max() == 0


def test_set_plan_refuses_plans_that_need_new_shapes():
    layer = grouped_layer(weights(), *REPLAN_A, slots_per_device=5)
    buffer = K * T - 5
    with pytest.raises(ValueError, match=rf"'device_rows' must equal the layer's \[{buffer}\], "
                                         rf"but got \[{buffer + 1}\]; new buffers need a new"):
        layer.set_plan(ExpertPlan([0, 1, 2, 3], [0] * 4, [8, 8, 8, buffer + 1 - 24],
                                  dispatch="grouped"))
    with pytest.raises(ValueError, match=r"at most 'slots_per_device' = 5 slots, but the plan "
                                         r"holds \[6\]"):
        layer.set_plan(ExpertPlan([0, 1, 2, 3, 0, 1], [0] * 6, [5, 5, 5, 4, 4, 4],
                                  dispatch="grouped"))
    with pytest.raises(ValueError, match=r"set_plan: ExpertPlan gives experts \[3\] no slot"):
        layer.set_plan(ExpertPlan([0, 1, 2, 0], [0] * 4, REPLAN_A[1], dispatch="grouped"))
    with pytest.raises(ValueError, match=r"the layer's dispatch is 'grouped' and the plan's "
                                         r"'static'"):
        layer.set_plan(ExpertPlan(*REPLAN_A[:1], [0] * 4, REPLAN_A[1], dispatch="static"))
    with pytest.raises(ValueError, match=r"'slots_per_device' sets the slot budget of 'grouped'"):
        ep_layer(weights(), [0, 1, 2, 3], [T] * E, slots_per_device=5)
    assert layer.local_experts.tolist() == REPLAN_A[0]            # unchanged by the refusals


# --- 2 workers (msrun) ------------------------------------------------------------------------


@pytest.mark.slow
@workers.needs_msrun
def test_two_workers_match_one_process_on_the_whole_batch(dist_checks):
    """Each rank feeds half the batch: outputs, counts, input gradients and every slot's
    gradient (= its logical expert's, summed over replicas) equal MoEFeedForward on the whole
    batch, with experts spread over the ranks, the same in 2 MPipeMoE chunks (PipelinedMoE),
    and with a hot expert on both ranks (one rank spilling into the other's replica), static
    and grouped (dropless buffers), also reached by set_plan from another placement after a
    compiled step (weights moved across ranks, nothing recompiled); with small grouped buffers each rank drops what
    split.grouped_assignments drops and its outputs equal a numpy MoE without those; after
    Adam steps the hot expert's replicas are
    identical on both ranks and every weight matches the one-process run."""
    wk = workers.load_script("check_ep_moe")
    # the single-process reference
    w = wk.logical_weights()
    x_np, dy_np = wk.global_batch()
    ref = MoEFeedForward(wk.H, wk.F, wk.E, wk.K, capacity=wk.FULL, trace_ranks=wk.WORLD)
    ref.router.weight.set_data(Tensor(w[0]))
    for p, a in zip((ref.w1, ref.b1, ref.w2, ref.b2), w[1:]):
        p.set_data(Tensor(a))
    params = [ref.router.weight, ref.w1, ref.b1, ref.w2, ref.b2]

    def weighted(x, dy):
        y, _, counts, _ = ref(x)
        return (y * dy).sum(), y, counts

    (_, y_ref, counts_ref), (dx_ref, g_ref) = ms.value_and_grad(
        weighted, grad_position=0, weights=params, has_aux=True)(Tensor(x_np), Tensor(dy_np))
    y_ref, counts_ref, dx_ref = y_ref.asnumpy(), counts_ref.asnumpy(), dx_ref.asnumpy()
    g_ref = dict(zip(wk.PARAM_NAMES, (g.asnumpy() for g in g_ref)))

    class Loss(nn.Cell):
        def __init__(self, layer):
            super().__init__()
            self.layer = layer

        def construct(self, x, dy):
            return (self.layer(x)[0] * dy).sum()

    step = nn.TrainOneStepCell(Loss(ref), nn.Adam(params, learning_rate=wk.LR))
    for i in range(wk.TRAIN_STEPS):
        step(*(Tensor(a) for a in wk.global_batch(i)))
    trained_ref = {name: p.asnumpy() for name, p in zip(wk.PARAM_NAMES, params)}

    # each rank's products run on its own rows (other shapes, other kernels' blocking; grouped
    # plans: cblas_sgemm grouped matmuls) and the gradients are summed over ranks and replicas:
    # other summation orders than the one-process BatchMatMul reference, so the float values
    # are held to their chained float32 bound (moe_float32_bounds on the whole batch; counts,
    # drops and traffic stay exact)
    bounds = moe_float32_bounds(w, x_np, dy_np, top_k=wk.K, router_differs=True)
    out_dir = dist_checks / "check_ep_moe"
    for plan in (p for p in wk.PLANS if p not in wk.DROPPING):
        res = [np.load(out_dir / f"{plan}_rank{r}.npz") for r in range(wk.WORLD)]
        router_sum = sum(r["grad_router"] for r in res)
        assert_within_float32_bound(router_sum, g_ref["router"], bounds["router"],
                                    f"{plan}: router")
        for r, got in enumerate(res):
            rows = slice(r * wk.B, (r + 1) * wk.B)
            assert_within_float32_bound(got["y"], y_ref[rows], bounds["y"][rows], f"{plan}: y")
            assert_within_float32_bound(got["dx"], dx_ref[rows], bounds["dx"][rows],
                                        f"{plan}: dx")
            assert got["counts"].tolist() == [counts_ref[r].tolist()]
            assert int(got["dropped"]) == 0
            experts = np.asarray(wk.PLANS[plan]["slot_expert"])[got["local_slots"]]
            n = experts.size                       # rows past n: empty budget slots
            for name in ("w1", "b1", "w2", "b2"):
                assert_within_float32_bound(got[f"grad_{name}"][:n], g_ref[name][experts],
                                            bounds[name][experts], f"{plan}: {name}")
                assert not got[f"grad_{name}"][n:].any(), (plan, name)
    # one source of truth for traffic: the rows every AlltoAllV Cell sends are the rows
    # exchange_rows gives and the cost model charges (bytes at fp32 on this CPU)
    model = CostModel(get_cluster("ascend910b-1x8"), wk.H, wk.F, dtype="fp32")
    for plan in wk.PLANS:
        res = [np.load(out_dir / f"{plan}_rank{r}.npz") for r in range(wk.WORLD)]
        counts_RE = np.concatenate([got["counts"] for got in res]).astype(np.int64)
        expert_plan = ExpertPlan(**wk.PLANS[plan])
        if wk.CHUNKS.get(plan, 1) > 1:
            continue                                  # chunked: one exchange per chunk
        sent_WD = np.stack([got["send_counts"] for got in res])
        np.testing.assert_array_equal(sent_WD, np.stack([got["recv_counts"] for got in res]).T)
        if expert_plan.dispatch != "grouped":
            expert_plan = dataclasses.replace(expert_plan, dispatch="static")
        np.testing.assert_array_equal(
            sent_WD, exchange_rows(expert_plan, wk.E, np.arange(wk.WORLD), wk.WORLD), plan)
        charged = layer_cost(expert_plan, counts_RE, model, np.arange(wk.WORLD))
        off_diagonal = sent_WD.sum() - np.trace(sent_WD)
        a2a = uneven_alltoall_time_s(
            np.pad(sent_WD * wk.H * 4.0, ((0, 6), (0, 6))), model.cluster) * model.a2a_passes
        assert charged.a2a_time_s == pytest.approx(a2a) and off_diagonal > 0, plan

    for plan in wk.REPLAN_FROM:                   # set_plan reused the compiled graphs
        assert all(int(np.load(out_dir / f"{plan}_rank{r}.npz")["compiled_after_replan"]) == 0
                   for r in range(wk.WORLD))

    # training: the reference took the same Adam steps on the whole batch
    trained = [np.load(out_dir / f"{wk.TRAIN_PLAN}_rank{r}.npz") for r in range(wk.WORLD)]
    np.testing.assert_array_equal(trained[0]["trained_router"], trained[1]["trained_router"])
    slot_expert = np.asarray(wk.PLANS[wk.TRAIN_PLAN]["slot_expert"])
    hot = [int(np.flatnonzero(slot_expert[t["local_slots"]] == 0)[0]) for t in trained]
    for name in wk.PARAM_NAMES[1:]:
        np.testing.assert_array_equal(trained[0][f"trained_{name}"][hot[0]],
                                      trained[1][f"trained_{name}"][hot[1]])
    for t in trained:
        experts = slot_expert[t["local_slots"]]
        for name in wk.PARAM_NAMES:
            expected = trained_ref[name] if name == "router" else trained_ref[name][experts]
            np.testing.assert_allclose(t[f"trained_{name}"], expected, rtol=1e-4, atol=1e-5,
                                       err_msg=name)

    # grouped plans with small buffers: every rank drops exactly what the package's rule drops
    for plan in wk.DROPPING:
        res = [np.load(out_dir / f"{plan}_rank{r}.npz") for r in range(wk.WORLD)]
        counts_RE = np.concatenate([got["counts"] for got in res])
        expert_plan = ExpertPlan(**wk.PLANS[plan])
        assigned_RS, dropped = grouped_assignments(expert_plan, counts_RE, np.arange(wk.WORLD))
        on_device = [np.asarray(wk.PLANS[plan]["slot_device"]) == d for d in range(wk.WORLD)]
        if plan == "grouped-tight":
            # buffers fill rank-major: rank 0 keeps everything, rank 1 drops on both devices
            assert assigned_RS[0].sum() == counts_RE[0].sum() and dropped > 0
            assert all(0 < assigned_RS[1, on].sum() < assigned_RS[:, on].sum()
                       for on in on_device)
        else:
            # send blocks: every pair keeps min(its rows, its block); both full blocks drop
            block = np.asarray(wk.PLANS[plan]["send_block"])
            kept_RD = np.stack([assigned_RS[:, on].sum(axis=1) for on in on_device], axis=1)
            assert (kept_RD <= block).all() and kept_RD[0, 0] == 10 and kept_RD[1, 0] == 5
            assert dropped > 0
        for r, got in enumerate(res):
            assert int(got["dropped"]) == counts_RE[r].sum() - assigned_RS[r].sum(), plan
            x_r = x_np[r * wk.B:(r + 1) * wk.B].reshape(-1, wk.H)
            y_r = numpy_grouped_moe(x_r, w, expert_plan, counts_RE, assigned_RS, r, wk.K)
            # numpy's products, softmax and tanh-form GELU against the rank's: the bound with
            # the gates' and the GELU's own rounding
            assert_within_float32_bound(
                got["y"].reshape(-1, wk.H), y_r,
                moe_float32_bounds(w, x_r, top_k=wk.K, router_differs=True, numpy_gelu=True)["y"],
                f"{plan}: y vs numpy")
