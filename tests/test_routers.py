"""The routers of ms_efficient/moe/routing.py: the configuration's checks, the numpy reference
on hand-computed cases, the MindSpore Router (GRAPH_MODE) against the reference and, with the
default configuration, against TopKArrival bit for bit; the aux losses, the z-loss and the
auxiliary-loss-free bias update.

Float32 against float64. The Router computes in float32, the reference in float64, so weights
and losses are compared within bounds from float32 rounding (conftest.py: u = 2**-24, gamma_n)
plus MindSpore's exp / sigmoid accuracy: the CPU kernels of MindSpore 2.10 are not correctly
rounded (measured on this machine over 10**6 arguments in [-18, 18]: exp up to 114 u
relative, 55 u for |x| < 1; sigmoid up to 80 u; the relative error grows about |x| u with the
argument, from its range reduction), so the bounds allow EXP_ULPS = 128 u + |x| u per exp /
sigmoid: an accuracy allowance, not a rounding bound. Expert ids are compared exactly on
inputs whose selection scores are farther apart than those bounds (``_assert_well_posed``).
"""
import numpy as np
import pytest

from conftest import U32, assert_within_float32_bound, gamma32
from ms_efficient.moe.routing import (RouterConfig, aux_loss_reference, bias_update_reference,
                                      group_mask_reference, route_reference,
                                      router_scores_reference, z_loss_reference)

EXP_ULPS = 128       # MindSpore 2.10 CPU exp / sigmoid accuracy allowance (module docstring)
LN3 = float(np.log(3.0))

# --- bounds --------------------------------------------------------------------------------


def _score_rel(logits_TE, config):
    """[T, E]: a bound on the relative error of each of the Router's float32 scores (softmax
    probabilities or sigmoid scores). Softmax, per token: exp of x - max (or of x, whichever
    the kernel does: R covers both) with error (R + EXP_ULPS) u, the sum of E positive terms
    gamma_E, the division u, and the denominator's exps again: 2 (R + EXP_ULPS) u + gamma_E +
    u. Sigmoid s = 1 / (1 + exp(-x)): an error d in exp(-x) moves s by the fraction (1 - s) d
    (the relative error of 1 + exp(-x)), so (1 - s) (|x| + EXP_ULPS) u, plus u for the add
    and u for the division."""
    x = np.asarray(logits_TE, np.float64)
    e = x.shape[1]
    if config.score == "softmax":
        r = np.maximum(np.abs(x - x.max(axis=1, keepdims=True)), np.abs(x)).max(axis=1,
                                                                                 keepdims=True)
        return np.broadcast_to(2 * (r + EXP_ULPS) * U32 + gamma32(e) + U32, x.shape)
    s = 1 / (1 + np.exp(-x))
    return (1 - s) * (np.abs(x) + EXP_ULPS) * U32 + 2 * U32


def _weights_bound(logits_TE, config, weights_TK, ids_TK):
    """|w - w_ref| bound [T, K] for the weights of experts ids_TK: the chosen score's error
    (for "topk-softmax" a softmax over the K chosen logits, within the row's softmax bound),
    renormalisation (the other chosen scores' errors, at most their largest; their sum
    gamma_K; the division u), the scaling u: (rel_k + max_k' rel_k' + gamma_K + 2 u) |w|,
    times 1.001 for the second-order terms."""
    k = weights_TK.shape[1]
    rel_TK = np.take_along_axis(_score_rel(logits_TE, config), np.asarray(ids_TK), 1)
    rel = rel_TK + rel_TK.max(axis=1, keepdims=True) + gamma32(k) + 2 * U32
    return rel * np.abs(weights_TK) * 1.001


def _probs_rel(logits_TE, config):
    """[T, E] relative bound on probs_TE: softmax, the scores' bound; sigmoid scores normalised
    per token add the other scores' error (at most the row's largest), the sum of E
    (gamma_E) and the division (u)."""
    rel = _score_rel(logits_TE, config)
    if config.score == "sigmoid":
        rel = rel + rel.max(axis=1, keepdims=True) + gamma32(rel.shape[1]) + U32
    return rel


def _probs_bound(logits_TE, config, probs_TE):
    return _probs_rel(logits_TE, config) * np.abs(probs_TE) * 1.001


def _assert_well_posed(logits_TE, config, k, bias_E=None):
    """The reference's selection is farther from a tie than float32 can move it. Each
    selection score's error: rel |score| (:func:`_score_rel`; 0 for "topk-softmax", whose
    scores are the logits themselves) plus, with a bias, the add's u |score + bias|; a group
    score's: the sum of its two (or one) members' errors plus u |group score|. Every gap
    between consecutive values among the K + 1 largest masked selection scores (the order of
    the K chosen matters: they are returned largest first), and the gap between the last kept
    and the first dropped group, must exceed 2x the two sides' errors. Otherwise a random case
    would be decided by rounding: pick another seed."""
    x = np.asarray(logits_TE, np.float64)
    t, e = x.shape
    _, base = router_scores_reference(x, config)
    err = _score_rel(x, config) * np.abs(base)
    if config.score == "softmax" and config.order == "topk-softmax":
        err = np.zeros_like(base)
    select = base
    if config.uses_bias:
        select = base + np.asarray(bias_E, np.float64)
        err = err + U32 * np.abs(select)
    masked = np.where(group_mask_reference(select, config), select, -np.inf)
    order = np.argsort(-masked, axis=1, kind="stable")[:, :min(k + 1, e)]
    top, top_err = np.take_along_axis(masked, order, 1), np.take_along_axis(err, order, 1)
    finite = np.isfinite(top[:, 1:])
    gaps = np.where(finite, top[:, :-1] - top[:, 1:], np.inf)
    assert (gaps > 2 * (top_err[:, :-1] + top_err[:, 1:])).all(), \
        "near tie in the expert selection: pick another seed"
    if config.limits_groups():
        g, j = config.num_groups, config.topk_groups
        grouped = select.reshape(t, g, -1)
        summed = 2 if config.group_score == "top2-sum" else 1
        members = np.argsort(-grouped, axis=-1, kind="stable")[..., :summed]
        gs = np.take_along_axis(grouped, members, -1).sum(-1)
        gs_err = (np.take_along_axis(err.reshape(t, g, -1), members, -1).sum(-1)
                  + U32 * np.abs(gs))
        rank = np.argsort(-gs, axis=1, kind="stable")
        last, first_out = rank[:, j - 1:j], rank[:, j:j + 1]
        gap = np.take_along_axis(gs, last, 1) - np.take_along_axis(gs, first_out, 1)
        assert (gap > 2 * (np.take_along_axis(gs_err, last, 1)
                           + np.take_along_axis(gs_err, first_out, 1))).all(), \
            "near tie in the group selection: pick another seed"


def _assignments(expert_ids_TK, e):
    """(expert_ids_A, onehot_AE, position_A) from ids [T, K], k-major, in numpy."""
    ids_A = np.asarray(expert_ids_TK).T.reshape(-1)
    onehot = np.eye(e, dtype=np.float32)[ids_A]
    seen = np.zeros(e, np.int64)
    position = np.zeros(ids_A.size, np.int32)
    for a, ex in enumerate(ids_A):
        position[a] = seen[ex]
        seen[ex] += 1
    return ids_A, onehot, position


# --- the configuration (numpy) -------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    ({"score": "relu"},
     "'moe.router.score' must be one of ['softmax', 'sigmoid'], but got 'relu'."),
    ({"order": "topk"},
     "'moe.router.order' must be one of ['softmax-topk', 'topk-softmax'], but got 'topk'."),
    ({"group_score": "mean"},
     "'moe.router.group_score' must be one of ['top2-sum', 'max'], but got 'mean'."),
    ({"aux_loss": "gshard"},
     "'moe.router.aux_loss' must be one of ['none', 'switch', 'sequence'], but got 'gshard'."),
    ({"renormalize": 1},
     "'moe.router.renormalize' must be a bool (true or false), but got 1."),
    ({"scaling_factor": 0.0},
     "'moe.router.scaling_factor' must be a finite number > 0, but got 0.0."),
    ({"scaling_factor": float("nan")},
     "'moe.router.scaling_factor' must be a finite number > 0, but got nan."),
    ({"num_groups": 0}, "'moe.router.num_groups' must be an integer >= 1, but got 0."),
    ({"num_groups": 2.0}, "'moe.router.num_groups' must be an integer >= 1, but got 2.0."),
    ({"topk_groups": True}, "'moe.router.topk_groups' must be an integer >= 1, but got True."),
    ({"num_groups": 4, "topk_groups": 5},
     "'moe.router.topk_groups' must be at most 'moe.router.num_groups' = 4, but got 5."),
    ({"bias_update_speed": -0.001},
     "'moe.router.bias_update_speed' must be a finite number >= 0, but got -0.001."),
    ({"z_loss_coef": "0.001"},
     "'moe.router.z_loss_coef' must be a finite number >= 0, but got '0.001'."),
    ({"score": "sigmoid", "order": "topk-softmax"},
     "'moe.router.order' 'topk-softmax' applies to a softmax router only (a sigmoid router "
     "scores every expert on its own); with 'moe.router.score' 'sigmoid' it must be "
     "'softmax-topk', but got 'topk-softmax'."),
    ({"aux_loss_coef": 0.01},
     "'moe.router.aux_loss_coef' must be 0 when 'moe.router.aux_loss' is 'none' (set "
     "aux_loss to 'switch' or 'sequence'), but got 0.01."),
    ({"aux_loss": "switch"},
     "'moe.router.aux_loss_coef' must be > 0 when 'moe.router.aux_loss' is 'switch' (or set "
     "aux_loss to 'none'), but got 0.0."),
])
def test_bad_config_is_refused_naming_the_field_value_and_what_is_allowed(kwargs, message):
    with pytest.raises(ValueError) as err:
        RouterConfig(**kwargs)
    assert str(err.value) == message


@pytest.mark.parametrize("kwargs, e, k, message", [
    ({}, 8, 0, "'moe.top_k' must be an integer in [1, 8] (the number of experts), but got 0."),
    ({}, 8, 9, "'moe.top_k' must be an integer in [1, 8] (the number of experts), but got 9."),
    ({}, 0, 1, "'moe.num_experts' must be an integer >= 1, but got 0."),
    ({"num_groups": 3}, 8, 2,
     "'moe.router.num_groups' must divide the 8 experts into equal groups, but got 3."),
    ({"num_groups": 8, "topk_groups": 4}, 8, 2,
     "'moe.router.group_score' 'top2-sum' needs at least 2 experts per group, but "
     "'moe.router.num_groups' = 8 leaves 1 of the 8 experts per group; use 'max' or fewer "
     "groups."),
    ({"num_groups": 4, "topk_groups": 2}, 8, 8,
     "'moe.top_k' must be at most the 4 experts of the 'moe.router.topk_groups' = 2 kept "
     "groups of 2, but got 8."),
])
def test_config_checked_against_experts_and_top_k(kwargs, e, k, message):
    with pytest.raises(ValueError) as err:
        RouterConfig(**kwargs).check(e, k)
    assert str(err.value) == message
    if e >= 1 and 1 <= k <= e:                      # route_reference checks the same way
        with pytest.raises(ValueError, match="moe.router|moe.top_k"):
            route_reference(np.zeros((2, e)), RouterConfig(**kwargs), k)


def test_valid_corner_configs_pass():
    RouterConfig(num_groups=8, topk_groups=4, group_score="max").check(8, 4)   # 1 per group
    RouterConfig(num_groups=8, topk_groups=8).check(8, 8)         # no limit: top2 not needed
    RouterConfig(num_groups=8, topk_groups=4).check(256, 8)       # DeepSeek-V3's shape
    RouterConfig(aux_loss="sequence", aux_loss_coef=1e-4, z_loss_coef=1e-3)


# --- the numpy reference on hand-computed cases ------------------------------------------------

# E = 8 in 4 groups of 2: {0, 1} {2, 3} {4, 5} {6, 7}
GROUP_LOGITS = np.array([[2.0, -5.0, 1.6, 1.4, 1.5, 1.3, -5.0, -5.0],
                         [0.0, 0.5, 3.0, 2.8, -1.0, -1.0, 0.2, 0.1]])
GROUPED = RouterConfig(num_groups=4, topk_groups=2)
# Token 0. Softmax probabilities are e^x / Z: e^2 = 7.38906, e^-5 = 0.00674, e^1.6 = 4.95303,
# e^1.4 = 4.05520, e^1.5 = 4.48169, e^1.3 = 3.66930. Group scores (top-2 sums, times Z):
# g0 = 7.39580, g1 = 9.00823, g2 = 8.15099, g3 = 0.01348 -> keep groups 1 and 2, experts
# {2, 3, 4, 5}; their top-2 is 2 (1.6) and 4 (1.5), while the plain top-2 is 0 (2.0) and
# 2 (1.6). Renormalised weights: e^1.6 / (e^1.6 + e^1.5) = sigmoid(0.1) = 0.5249791875,
# and 0.4750208125. With the group max (DeepSeek-V2) g0 = e^2 wins, then g1 = e^1.6: experts
# {0, 1, 2, 3}, the plain top-2 again.
# Token 1: the plain top-2, 2 (3.0) and 3 (2.8), is in group 1, the best group, so every rule
# gives it: weights sigmoid(0.2) = 0.5498339973, 0.4501660027.
GROUP_IDS = [[2, 4], [2, 3]]
PLAIN_IDS = [[0, 2], [2, 3]]
GROUP_WEIGHTS = [[0.5249791875, 0.4750208125], [0.5498339973, 0.4501660027]]
# plain token 0: e^2 : e^1.6, sigmoid(0.4) = 0.5986876601 and 0.4013123399
PLAIN_WEIGHTS = [[0.5986876601, 0.4013123399], [0.5498339973, 0.4501660027]]

# sigmoid(ln 3) = 3/4, sigmoid(0) = 1/2, sigmoid(-ln 3) = 1/4, sigmoid(-4) = 0.0179862
SIGMOID_LOGITS = np.array([[LN3, 0.0, -LN3, -4.0, -4.0, -4.0, -4.0, -4.0]])
V3 = RouterConfig(score="sigmoid", scaling_factor=2.5)
# top-2 {0, 1}: renormalised 0.75 / 1.25 = 0.6, 0.5 / 1.25 = 0.4; times 2.5: 1.5, 1.0.
# Not renormalised: 2.5 * 0.75 = 1.875, 2.5 * 0.5 = 1.25. K = 1: 0.75 / 0.75 * 2.5 = 2.5.
BIASED = RouterConfig(score="sigmoid", bias_update_speed=0.001)
BIAS = np.array([-0.5, 0.0, 0.4, 0.0, 0.0, 0.0, 0.0, 0.0], np.float32)
# Selection scores s + b: [0.25, 0.5, 0.65, 0.018, ...] -> experts 2 (0.65), then 1 (0.5),
# where the unbiased top-2 is 0 (0.75), 1 (0.5). The weights are the unbiased scores of the
# chosen experts, renormalised: 0.25 / 0.75 = 1/3, 0.5 / 0.75 = 2/3 (the biased scores would
# have given 0.65 / 1.15 = 0.565, 0.435).


def test_reference_group_limited_top_k_by_hand():
    w, ids = route_reference(GROUP_LOGITS, GROUPED, 2)
    assert ids.tolist() == GROUP_IDS
    np.testing.assert_allclose(w, GROUP_WEIGHTS, rtol=1e-9)
    w, ids = route_reference(GROUP_LOGITS, RouterConfig(), 2)
    assert ids.tolist() == PLAIN_IDS
    np.testing.assert_allclose(w, PLAIN_WEIGHTS, rtol=1e-9)
    w, ids = route_reference(GROUP_LOGITS, RouterConfig(num_groups=4, topk_groups=2,
                                                        group_score="max"), 2)
    assert ids.tolist() == PLAIN_IDS
    assert group_mask_reference(router_scores_reference(GROUP_LOGITS, GROUPED)[1],
                                GROUPED)[0].tolist() == [False, False] + [True] * 4 + [False] * 2


def test_reference_sigmoid_renormalised_and_scaled_by_hand():
    w, ids = route_reference(SIGMOID_LOGITS, V3, 2)
    assert ids.tolist() == [[0, 1]]
    np.testing.assert_allclose(w, [[1.5, 1.0]], rtol=1e-12)
    w, _ = route_reference(SIGMOID_LOGITS, RouterConfig(score="sigmoid", renormalize=False,
                                                        scaling_factor=2.5), 2)
    np.testing.assert_allclose(w, [[1.875, 1.25]], rtol=1e-12)
    w, ids = route_reference(SIGMOID_LOGITS, V3, 1)
    assert ids.tolist() == [[0]] and w.tolist() == [[2.5]]


def test_reference_bias_changes_the_selection_not_the_weights_by_hand():
    w, ids = route_reference(SIGMOID_LOGITS, BIASED, 2, BIAS)
    assert ids.tolist() == [[2, 1]]
    np.testing.assert_allclose(w, [[1 / 3, 2 / 3]], rtol=1e-12)
    w, ids = route_reference(SIGMOID_LOGITS, BIASED, 2, np.zeros(8))
    assert ids.tolist() == [[0, 1]]
    np.testing.assert_allclose(w, [[0.6, 0.4]], rtol=1e-12)
    # without bias_update_speed the bias is not used, as in the Router
    w, ids = route_reference(SIGMOID_LOGITS, RouterConfig(score="sigmoid"), 2, BIAS)
    assert ids.tolist() == [[0, 1]]


def test_reference_orders_and_ties():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((16, 8)) * 2
    for k in (1, 2, 8):
        # Mixtral: softmax over the top-k logits = softmax-then-top-k renormalised
        w1, i1 = route_reference(x, RouterConfig(order="topk-softmax"), k)
        w2, i2 = route_reference(x, RouterConfig(), k)
        np.testing.assert_array_equal(i1, i2)
        np.testing.assert_allclose(w1, w2, rtol=1e-12)
    # ...but not without renormalisation (Qwen1.5-MoE keeps the softmax probabilities)
    w3, _ = route_reference(x, RouterConfig(renormalize=False), 2)
    assert (w3.sum(axis=1) < 1 - 1e-3).all()
    # ties go to the lower expert id, experts and groups
    w, ids = route_reference(np.zeros((1, 8)), RouterConfig(), 2)
    assert ids.tolist() == [[0, 1]] and w.tolist() == [[0.5, 0.5]]
    _, ids = route_reference(np.zeros((1, 8)), RouterConfig(num_groups=4, topk_groups=2), 4)
    assert ids.tolist() == [[0, 1, 2, 3]]


# Aux losses by hand, E = 4, K = 2. Probabilities (the softmax of their logs) per token:
#   a = [0.4, 0.3, 0.2, 0.1] (top-2: 0, 1),  b = [0.1, 0.2, 0.3, 0.4] (top-2: 3, 2).
# Switch on [a, b]: counts [1, 1, 1, 1], f = 1/4 each, P = [0.25] * 4, loss = 4 * 4 / 16 = 1.0.
# Switch on [a, a]: counts [2, 2, 0, 0], f = [0.5, 0.5, 0, 0], P = a: 4 * (0.2 + 0.15) = 1.4.
# Switch on [a, b, a, a]: counts [3, 3, 1, 1] / 8; P = [0.325, 0.275, 0.225, 0.175];
#   4 * (3 * 0.325 + 3 * 0.275 + 0.225 + 0.175) / 8 = 4 * 2.2 / 8 = 1.1.
# Sequence loss on [a, b | a, a] (S = 2): per sequence f_e = E / (K S) * count = count:
#   [a, b]: sum_e 1 * 0.25 = 1.0;  [a, a]: 2 * 0.4 + 2 * 0.3 = 1.4;  mean 1.2.
# z-loss on logits [0, 0, 0, 0] and [ln 3, 0, 0, 0]: logsumexp ln 4 and ln 6;
#   (1.3862944^2 + 1.7917595^2) / 2 = (1.9218121 + 3.2104020) / 2 = 2.5661070.
PA, PB = [0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]
AUX_CASES = [  # (probability rows, kind, seq_length, expected)
    ([PA, PB], "switch", None, 1.0),
    ([PA, PA], "switch", None, 1.4),
    ([PA, PB, PA, PA], "switch", None, 1.1),
    ([PA, PB, PA, PA], "sequence", 2, 1.2),
    ([PA, PB, PA, PA], "sequence", 4, 1.1),     # one sequence: the Switch loss
]
Z_LOGITS = np.array([[0.0, 0.0, 0.0, 0.0], [LN3, 0.0, 0.0, 0.0]])
Z_EXPECTED = 2.5661070


@pytest.mark.parametrize("rows, kind, seq_length, expected", AUX_CASES)
def test_reference_aux_losses_by_hand(rows, kind, seq_length, expected):
    probs = np.array(rows)
    _, ids = route_reference(np.log(probs), RouterConfig(), 2)
    assert aux_loss_reference(probs, ids, kind, seq_length) == pytest.approx(expected, rel=1e-12)


def test_reference_z_loss_and_bias_update_by_hand():
    assert z_loss_reference(Z_LOGITS) == pytest.approx(Z_EXPECTED, abs=1e-7)
    # loads [4, 0, 2, 2], mean 2: expert 0 over (-gamma), expert 1 under (+gamma), 2 and 3 at it
    b = bias_update_reference(np.array([0.1, 0.0, -0.2, 0.0], np.float32), [4, 0, 2, 2], 0.001)
    assert b.dtype == np.float32
    np.testing.assert_array_equal(
        b, np.array([0.1, 0.0, -0.2, 0.0], np.float32) + np.float32(0.001) * np.float32(
            [-1, 1, 0, 0]))
    with pytest.raises(ValueError, match="seq_length"):
        aux_loss_reference(np.full((4, 4), 0.25), np.zeros((4, 2), int), "sequence", 3)


# --- the Router (MindSpore, GRAPH_MODE) --------------------------------------------------------


def _run(router, logits, bias=None):
    """The Router's five outputs as numpy arrays."""
    from mindspore import Tensor

    args = (Tensor(np.asarray(logits, np.float32)),)
    if bias is not None:
        args += (Tensor(np.asarray(bias, np.float32)),)
    return [o.asnumpy() for o in router(*args)]


def _check_against_reference(outputs, logits, config, k, bias=None, label=""):
    """ids exact, onehot / position those of the ids, weights and probs within float32 bounds
    of the float64 reference."""
    probs, weights, ids_A, onehot, position = outputs
    t, e = logits.shape
    ref_w, ref_ids = route_reference(logits, config, k, bias)
    ref_probs, _ = router_scores_reference(logits, config)
    np.testing.assert_array_equal(ids_A.reshape(k, t).T, ref_ids, err_msg=label)
    exp_ids_A, exp_onehot, exp_position = _assignments(ref_ids, e)
    np.testing.assert_array_equal(ids_A, exp_ids_A)
    np.testing.assert_array_equal(onehot, exp_onehot)
    np.testing.assert_array_equal(position, exp_position)
    assert weights.dtype == np.float32 and probs.dtype == np.float32
    assert_within_float32_bound(weights, ref_w, _weights_bound(logits, config, ref_w, ref_ids),
                                f"weights {label}")
    assert_within_float32_bound(probs, ref_probs, _probs_bound(logits, config, ref_probs),
                                f"probs {label}")


@pytest.mark.mindspore
@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("renormalize", [True, False])
def test_default_router_is_topkarrival_bit_for_bit(graph_mode, k, renormalize):
    from ms_efficient.moe.layer import TopKArrival
    from ms_efficient.moe.routing import Router

    rng = np.random.default_rng(k)
    x = (rng.standard_normal((16, 8)) * 2).astype(np.float32)
    x[3] = 0.0                                          # an all-tie row
    x[7, :4] = 1.5                                      # ties at the top
    x[11] = np.float32([1, 1, 2, 2, 0, 0, 2, 1])        # ties at the K-th place
    config = RouterConfig(renormalize=renormalize)
    router, arrival = Router(8, k, config), TopKArrival(8, k, renormalize)
    for bias in (None, np.zeros(8)):
        for got, want in zip(_run(router, x, bias), _run(arrival, x)):
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got, want)


@pytest.mark.mindspore
def test_router_ties_choose_experts_of_the_tied_score(graph_mode):
    """ops.topk (CPU, K < E) does not break ties to the lower id (module docstring): on tied
    rows the Router's chosen experts have the reference's scores and weights, in any order
    of the tied ids."""
    from ms_efficient.moe.routing import Router

    x = np.zeros((3, 8), np.float32)
    x[1, [1, 4, 6]] = 1.0                               # a tie of 3 for 2 places
    x[2, [0, 5]] = [2.0, -1.0]
    probs, weights, ids_A, _, _ = _run(Router(8, 2), x)
    ids = ids_A.reshape(2, 3).T
    ref_w, ref_ids = route_reference(x, RouterConfig(), 2)
    assert ref_ids.tolist() == [[0, 1], [1, 4], [0, 1]]
    np.testing.assert_array_equal(np.take_along_axis(probs, ids, 1),
                                  np.take_along_axis(probs, ref_ids, 1))
    assert all(len(set(row)) == 2 for row in ids.tolist())
    assert set(ids[1]) <= {1, 4, 6} and ids[2, 0] == 0
    assert_within_float32_bound(weights, ref_w, _weights_bound(x, RouterConfig(), ref_w, ref_ids),
                                "weights on ties")


KINDS = {
    "switch-mixtral-hf": RouterConfig(),
    "qwen-no-renorm": RouterConfig(renormalize=False),
    "mixtral-topk-softmax": RouterConfig(order="topk-softmax"),
    "deepseek-v3-sigmoid": RouterConfig(score="sigmoid", scaling_factor=2.5),
    "sigmoid-no-renorm": RouterConfig(score="sigmoid", renormalize=False),
    "groups-top2-sum": RouterConfig(num_groups=4, topk_groups=2),
    "groups-max-v2": RouterConfig(num_groups=4, topk_groups=2, group_score="max",
                                  scaling_factor=16.0),
    "groups-topk-softmax": RouterConfig(order="topk-softmax", num_groups=2, topk_groups=1),
    "bias-softmax": RouterConfig(bias_update_speed=0.001),
    "bias-sigmoid-groups": RouterConfig(score="sigmoid", scaling_factor=2.5, num_groups=4,
                                        topk_groups=2, bias_update_speed=0.001),
}
KIND_CASES = [("switch-mixtral-hf", 1), ("switch-mixtral-hf", 2), ("switch-mixtral-hf", 8),
              ("qwen-no-renorm", 2), ("mixtral-topk-softmax", 1), ("mixtral-topk-softmax", 2),
              ("deepseek-v3-sigmoid", 2), ("deepseek-v3-sigmoid", 8), ("sigmoid-no-renorm", 2),
              ("groups-top2-sum", 2), ("groups-top2-sum", 4), ("groups-max-v2", 2),
              ("groups-topk-softmax", 2), ("bias-softmax", 2), ("bias-sigmoid-groups", 2)]


@pytest.mark.mindspore
@pytest.mark.parametrize("kind, k", KIND_CASES, ids=[f"{n}-k{k}" for n, k in KIND_CASES])
def test_router_matches_the_reference(graph_mode, kind, k):
    from ms_efficient.moe.routing import Router

    config = KINDS[kind]
    seed = sum(map(ord, kind)) + k
    rng = np.random.default_rng(seed)
    t = 5 + seed % 12                                   # T in 5..16
    x = (rng.standard_normal((t, 8)) * 2).astype(np.float32)
    bias = None
    if config.uses_bias:                                # of the scores' size: moves choices
        scale = 0.5 if config.score == "sigmoid" else 0.2
        bias = (rng.standard_normal(8) * scale).astype(np.float32)
    _assert_well_posed(x, config, k, bias)
    outputs = _run(Router(8, k, config), x, bias if bias is not None else np.zeros(8))
    _check_against_reference(outputs, x, config, k, bias, label=f"{kind} K={k}")
    if config.uses_bias:                                # the bias did change some choices
        _, unbiased = route_reference(x, config, k, np.zeros(8))
        assert not np.array_equal(unbiased, outputs[2].reshape(k, t).T)


@pytest.mark.mindspore
def test_router_hand_cases(graph_mode):
    """The hand-computed cases of the reference tests, on the Router."""
    from ms_efficient.moe.routing import Router

    x = GROUP_LOGITS.astype(np.float32)
    cases = [(GROUPED, 2, x, None, GROUP_IDS, GROUP_WEIGHTS),
             (V3, 2, SIGMOID_LOGITS, None, [[0, 1]], [[1.5, 1.0]]),
             (BIASED, 2, SIGMOID_LOGITS, BIAS, [[2, 1]], [[1 / 3, 2 / 3]])]
    for config, k, logits, bias, ids, weights in cases:
        logits = logits.astype(np.float32)
        probs, w, ids_A, _, _ = _run(Router(8, k, config), logits,
                                     bias if bias is not None else np.zeros(8))
        assert ids_A.reshape(k, -1).T.tolist() == ids, config
        # + the logits' rounding to float32 (ln 3, 1.6, ...): each weight is a function of
        # differences of two logits (renormalised) or of one logit (sigmoid) whose relative
        # derivative is below 1, so at most 2 max|x| u relative
        bound = (_weights_bound(logits, config, np.array(weights), np.array(ids))
                 + 2 * U32 * np.abs(logits).max() * np.abs(np.array(weights)))
        assert_within_float32_bound(w, weights, bound, f"hand case {config}")


def _aux_cell(router, seq_length):
    """A Cell as a layer would use the Router: route, then the configured aux losses."""
    from mindspore import nn

    class RouteAndLoss(nn.Cell):
        def __init__(self):
            super().__init__()
            self.router = router

        def construct(self, logits_TE):
            probs_TE, weights_TK, ids_A, onehot_AE, position_A = self.router(logits_TE)
            return self.router.aux_losses(logits_TE, probs_TE, onehot_AE, seq_length), probs_TE

    return RouteAndLoss()


def _loss_rel(logits_TE, config, t):
    """Relative bound on a balancing loss sum_e f_e P_e (nonnegative terms): P_e's scores
    (:func:`_probs_bound`'s relative part), its mean over T (gamma_T), f_e (a mean of exact
    counts: u), the sum over E (gamma_E), the coefficient's and E's products (2 u)."""
    rel = _probs_rel(logits_TE, config)
    return float(rel.max()) + gamma32(t) + gamma32(logits_TE.shape[1]) + 4 * U32


@pytest.mark.mindspore
@pytest.mark.parametrize("rows, kind, seq_length, expected", AUX_CASES[1:4])
def test_router_aux_losses_by_hand(graph_mode, rows, kind, seq_length, expected):
    from mindspore import Tensor

    from ms_efficient.moe.layer import routing_statistics
    from ms_efficient.moe.routing import Router

    logits = np.log(np.array(rows)).astype(np.float32)
    config = RouterConfig(aux_loss=kind, aux_loss_coef=0.5)
    router = Router(4, 2, config)
    loss, _ = _aux_cell(router, seq_length)(Tensor(logits))
    t = logits.shape[0]
    assert_within_float32_bound(float(loss.asnumpy()), 0.5 * expected,
                                _loss_rel(logits, config, t) * 0.5 * expected, f"{kind} loss")
    if kind == "switch":          # the layer's own Switch loss, bit for bit
        probs, _, _, onehot, _ = router(Tensor(logits))
        aux, _ = routing_statistics(probs, onehot, 2, 1)
        assert float(loss.asnumpy()) == np.float32(0.5) * float(aux.asnumpy())


@pytest.mark.mindspore
def test_router_z_loss_and_sigmoid_sequence_loss_match_the_references(graph_mode):
    from mindspore import Tensor

    from ms_efficient.moe.routing import Router

    # z-loss alone, by hand
    z_config = RouterConfig(z_loss_coef=0.001)
    z, _ = _aux_cell(Router(4, 2, z_config), None)(Tensor(Z_LOGITS.astype(np.float32)))
    # |lse| error: log of a sum with (R + EXP_ULPS) u + gamma_E relative error, plus the log's
    # and the add's u |lse|; squared and averaged: 2 abs/|lse| + u + gamma_T relative
    lse_rel = ((np.log(6) + EXP_ULPS) * U32 + gamma32(4) + 2 * U32 * np.log(6)) / np.log(4)
    assert_within_float32_bound(float(z.asnumpy()), 0.001 * Z_EXPECTED,
                                (2 * lse_rel + gamma32(2) + 2 * U32) * 0.001 * Z_EXPECTED
                                + 1e-10,     # Z_EXPECTED is rounded to 1e-7
                                "z-loss")
    # DeepSeek-V3's sigmoid router with its sequence loss and a z-loss, on random logits:
    # B = 4 sequences of S = 4
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((16, 8)) * 2).astype(np.float32)
    config = RouterConfig(score="sigmoid", scaling_factor=2.5, aux_loss="sequence",
                          aux_loss_coef=1e-4, z_loss_coef=1e-3)
    _assert_well_posed(x, config, 2)
    loss, probs = _aux_cell(Router(8, 2, config), 4)(Tensor(x))
    _, ids = route_reference(x, config, 2)
    ref_probs, _ = router_scores_reference(x, config)
    seq = aux_loss_reference(ref_probs, ids, "sequence", 4)
    zr = z_loss_reference(x)
    lse_max = np.abs(x).max() + np.log(8)
    lse_rel_x = ((np.abs(x).max() * 2 + EXP_ULPS) * U32 + gamma32(8) + 2 * U32 * lse_max)
    bound = (1e-4 * seq * _loss_rel(x, config, 4)
             + 1e-3 * zr * (2 * lse_rel_x / 0.1 + gamma32(16) + 2 * U32)   # |lse| >= ln 8 > 0.1
             + U32 * (1e-4 * seq + 1e-3 * zr))                              # the final add
    assert_within_float32_bound(float(loss.asnumpy()), 1e-4 * seq + 1e-3 * zr, bound,
                                "sequence + z loss")
    assert_within_float32_bound(probs.asnumpy(), ref_probs, _probs_bound(x, config, ref_probs),
                                "sigmoid normalised probs")
    np.testing.assert_allclose(probs.asnumpy().sum(axis=1), 1.0, rtol=1e-5)
    # no loss configured: exactly 0
    none, _ = _aux_cell(Router(8, 2), None)(Tensor(x))
    assert float(none.asnumpy()) == 0.0


@pytest.mark.mindspore
def test_updated_bias_is_the_reference_bit_for_bit_and_balances_a_skewed_router(graph_mode):
    from mindspore import Tensor

    from ms_efficient.moe.routing import Router, expert_bias_parameter, updated_bias

    b = updated_bias(Tensor(np.array([0.1, 0.0, -0.2, 0.0], np.float32)),
                     Tensor(np.array([4, 0, 2, 2], np.int32)), 0.001).asnumpy()
    np.testing.assert_array_equal(
        b, bias_update_reference([0.1, 0.0, -0.2, 0.0], [4, 0, 2, 2], 0.001))
    # auxiliary-loss-free balancing: tokens that all prefer experts 0 and 1; 150 steps of the
    # sign rule (gamma = 0.01, 10x the paper's, for a short test) in MindSpore and in numpy,
    # bit for bit, until the load evens out
    rng = np.random.default_rng(5)
    e, k, t, speed = 8, 2, 64, 0.01
    x = (rng.standard_normal((t, e)) * 0.5 + np.array([2.0, 1.5] + [0.0] * 6)).astype(
        np.float32)
    config = RouterConfig(score="sigmoid", scaling_factor=2.5, num_groups=4, topk_groups=2,
                          bias_update_speed=speed)
    router = Router(e, k, config)
    bias = expert_bias_parameter(e)
    ref_bias = np.zeros(e, np.float32)
    first = last = None
    for step in range(150):
        _, _, _, onehot, _ = router(Tensor(x), bias)
        counts = onehot.asnumpy().sum(axis=0)
        if step == 0:
            first = counts.max() / counts.mean()
        last = counts.max() / counts.mean()
        bias.set_data(updated_bias(bias, Tensor(counts.astype(np.int32)), speed))
        ref_bias = bias_update_reference(ref_bias, counts, speed)
        np.testing.assert_array_equal(bias.asnumpy(), ref_bias)
    assert first >= 3.0          # all 64 tokens choose experts 0 and 1 at first: 4x the mean
    assert last <= 1.5, (first, last, bias.asnumpy())


@pytest.mark.mindspore
def test_router_gradient_reaches_the_chosen_logits_only(graph_mode):
    """Sigmoid + bias + groups: d(sum_k c_k w_k)/dx flows through gather_elements to the
    chosen experts' logits only (exact zeros elsewhere) and equals the analytic derivative
    w_k = f s_k / S, S = sum_j s_j: dL/dx_i = f / S (c_i - sum_k c_k s_k / S) s_i (1 - s_i).
    Bound: each factor within the weights' relative bound; 4x that bound on the magnitude
    f / S (|c_i| + sum_k |c_k| s_k / S) s_i."""
    import mindspore as ms
    from mindspore import Tensor

    from ms_efficient.moe.routing import Router

    config = KINDS["bias-sigmoid-groups"]
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((6, 8)) * 2).astype(np.float32)
    bias = (rng.standard_normal(8) * 0.5).astype(np.float32)
    c = rng.standard_normal((6, 2)).astype(np.float32)
    _assert_well_posed(x, config, 2, bias)
    router = Router(8, 2, config)

    def loss(logits):
        return (router(logits, Tensor(bias))[1] * Tensor(c)).sum()

    g = ms.grad(loss)(Tensor(x)).asnumpy()
    _, ids = route_reference(x, config, 2, bias)
    s = 1 / (1 + np.exp(-x.astype(np.float64)))
    s_k = np.take_along_axis(s, ids, 1)
    big_s = s_k.sum(axis=1, keepdims=True)
    f = config.scaling_factor
    d_k = f / big_s * (c - (c * s_k).sum(axis=1, keepdims=True) / big_s) * s_k * (1 - s_k)
    expected = np.zeros_like(s)
    np.put_along_axis(expected, ids, d_k, 1)
    scale = np.zeros_like(s)
    np.put_along_axis(scale, ids, f / big_s * (np.abs(c) + (np.abs(c) * s_k).sum(
        axis=1, keepdims=True) / big_s) * s_k, 1)
    rel = 2 * _score_rel(x, config).max() + gamma32(2) + 2 * U32
    assert (g[expected == 0] == 0).all()
    assert_within_float32_bound(g, expected, 4 * rel * scale, "router gradient")


@pytest.mark.mindspore
@pytest.mark.parametrize("config", [
    RouterConfig(score="sigmoid", scaling_factor=2.5, num_groups=8, topk_groups=4,
                 bias_update_speed=0.001),
    RouterConfig(num_groups=8, topk_groups=4, group_score="max", scaling_factor=16.0,
                 renormalize=False),
], ids=["deepseek-v3", "deepseek-v2-style"])
def test_deepseek_shape_256_experts_8_groups(graph_mode, config):
    """E = 256 in 8 groups of 32, 4 groups kept, K = 8 (DeepSeek-V3's routed experts), T = 32
    random tokens: the Router equals the reference, and the group limit changed routes."""
    from ms_efficient.moe.routing import Router

    e, k, t = 256, 8, 32
    rng = np.random.default_rng(257)        # a seed _assert_well_posed accepts for both
    x = (rng.standard_normal((t, e)) * 2).astype(np.float32)
    bias = (rng.standard_normal(e) * 0.05).astype(np.float32) if config.uses_bias else None
    _assert_well_posed(x, config, k, bias)
    outputs = _run(Router(e, k, config), x, bias if bias is not None else np.zeros(e))
    _check_against_reference(outputs, x, config, k, bias, label="E=256")
    ungrouped = RouterConfig(score=config.score, num_groups=1, topk_groups=1,
                             bias_update_speed=config.bias_update_speed)
    _, plain = route_reference(x, ungrouped, k, bias)
    ids = outputs[2].reshape(k, t).T
    assert (np.sort(plain, 1) != np.sort(ids, 1)).any(axis=1).sum() >= t // 4
    # every token's experts lie in at most 4 of the 8 groups
    assert max(len({e_ // 32 for e_ in row}) for row in ids.tolist()) <= 4


# --- the group-limited routing trace (moe.trace.group_limited_trace) --------------------------


def test_group_limited_trace_of_equal_scores_routes_to_the_lowest_group_and_experts():
    """All logits 0 (no skew, drift or kind spread): every score is sigmoid(0) = 0.5, the two
    groups tie and the lower one is kept, its experts 0 and 1 tie and both are chosen: each
    rank's 3 tokens give counts [3, 3, 0, 0], rows 10 training steps apart."""
    from ms_efficient.moe.trace import group_limited_trace

    trace = group_limited_trace(steps=2, layers=1, ranks=2, experts=4, top_k=2, num_groups=2,
                                topk_groups=1, tokens_per_rank=3, hidden=8, skew=0.0,
                                drift=0.0, token_types=1, type_spread=0.0,
                                bias_update_speed=0.0, burn_in=0)
    np.testing.assert_array_equal(trace.counts, np.tile([3, 3, 0, 0], (2, 1, 2, 1)))
    assert trace.top_k == 2 and trace.tokens_per_rank == 3 and trace.hidden == 8
    np.testing.assert_array_equal(trace.steps, [0, 10])


def test_group_limited_trace_keeps_each_kind_in_its_groups_and_the_bias_spreads_the_load():
    """One kind of token: without the balancing bias every row routes all tokens to the same
    top-k experts, inside topk_groups groups; with it (V3's sign rule) the chosen experts
    change over the rows and the busiest expert's share over the trace falls. Every rank's
    row holds tokens_per_rank x top_k assignments."""
    from ms_efficient.moe.trace import group_limited_trace

    kwargs = dict(steps=30, layers=1, ranks=4, experts=16, top_k=2, num_groups=4,
                  topk_groups=1, tokens_per_rank=50, token_types=1, drift=0.0, step_stride=1,
                  burn_in=0, seed=3)
    still = group_limited_trace(bias_update_speed=0.0, **kwargs).counts[:, 0]   # [T, R, E]
    moving = group_limited_trace(bias_update_speed=0.05, **kwargs).counts[:, 0]
    for counts in (still, moving):
        assert (counts.sum(axis=2) == 100).all()
        used = counts > 0                                    # [T, R, E]
        assert (used.sum(axis=2) == 2).all()                  # one kind: two experts a row
        groups = used.reshape(30, 4, 4, 4).any(axis=3).sum(axis=2)
        assert (groups == 1).all()                            # ... in one group
    assert len(np.unique(np.nonzero(still.sum(axis=1))[1])) == 2
    assert len(np.unique(np.nonzero(moving.sum(axis=1))[1])) > 2
    share = lambda c: c.sum(axis=(0, 1)).max() / c.sum()      # noqa: E731
    assert share(moving) < share(still) == 0.5


def test_group_limited_trace_is_deterministic_and_refuses_what_the_router_refuses():
    from ms_efficient.moe.trace import group_limited_trace

    small = dict(steps=3, layers=2, ranks=4, experts=16, top_k=4, num_groups=4, topk_groups=2,
                 tokens_per_rank=32, token_types=8, burn_in=2)
    a, b = group_limited_trace(seed=1, **small), group_limited_trace(seed=1, **small)
    np.testing.assert_array_equal(a.counts, b.counts)
    assert not np.array_equal(a.counts, group_limited_trace(seed=2, **small).counts)
    with pytest.raises(ValueError, match="num_groups"):
        group_limited_trace(**{**small, "num_groups": 3})
    with pytest.raises(ValueError, match="positive integers"):
        group_limited_trace(**{**small, "token_types": 0})
