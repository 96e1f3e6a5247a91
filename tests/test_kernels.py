"""Padding-free MoE dispatch kernels (ms_efficient.moe.kernels) against naive loops written here."""
import shutil
import threading

import numpy as np
import pytest

import mindspore as ms
from mindspore import Tensor, ops

from conftest import assert_within_float32_bound, float32_bound
from ms_efficient.moe import kernels as K

pytestmark = pytest.mark.mindspore
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None,
                               reason="g++ is not on PATH, so the aot kernels cannot be built")
MODES = {"graph": ms.GRAPH_MODE, "pynative": ms.PYNATIVE_MODE}


# ---- naive references: one row at a time -----------------------------------------------------

def naive_permute(x, idx):
    y = np.zeros((len(idx), x.shape[1]), x.dtype)
    for i, src in enumerate(idx):
        if src >= 0:
            y[i] = x[src]
    return y


def naive_combine(y, tok, w, num_tokens):
    out = np.zeros((num_tokens, y.shape[1]), y.dtype)
    for r, t in enumerate(tok):
        if t >= 0:
            out[t] += w[r] * y[r]
    return out


def combine_bound(y, tok, w, num_tokens):
    """How far a combine kernel may be from naive_combine in float32 (conftest.float32_bound):
    out[t] sums the products w[r] y[r] of its n_t rows, in the kernel's order and with its
    arithmetic (FMA or not) against the loop's: 2 gamma_(n_t) sum |w[r]| |y[r]|; a token
    with no row is exactly 0 on both sides."""
    keep = tok >= 0
    scale = np.zeros((num_tokens, y.shape[1]))
    np.add.at(scale, tok[keep], np.abs(w[keep, None].astype(np.float64) * y[keep]))
    rows = np.bincount(tok[keep], minlength=num_tokens)
    return float32_bound(rows[:, None], scale)


# ---- fixtures --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def library(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("g++ is not on PATH, so the aot kernels cannot be built")
    return K.build_kernel_library(cache_dir=tmp_path_factory.mktemp("kernel_cache"))


@pytest.fixture(params=sorted(MODES))
def mode(request):
    before = ms.get_context("mode")
    ms.set_context(mode=MODES[request.param], device_target="CPU")
    yield request.param
    ms.set_context(mode=before)


@pytest.fixture
def pynative():
    before = ms.get_context("mode")
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    yield
    ms.set_context(mode=before)


def case(t, h, n, seed=0):
    """x [T, H], an index [N] in [-1, T) with repeats, a second input y [N, H] and weights [N]."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, h)).astype(np.float32)
    idx = rng.integers(-1, t, n).astype(np.int32)
    y = rng.standard_normal((n, h)).astype(np.float32)
    w = rng.random(n).astype(np.float32)
    return x, idx, y, w


# T=1; N=0; -1 rows and repeated tokens; a size above the OpenMP threshold (N*H >= 32768).
SHAPES = [(1, 1, 1), (1, 8, 3), (7, 5, 0), (16, 33, 40), (64, 128, 300)]


# ---- forward ---------------------------------------------------------------------------------

@pytest.mark.parametrize("t,h,n", SHAPES)
def test_permute_copies_the_indexed_rows_and_zeros_for_minus_one(library, mode, t, h, n):
    x, idx, _, _ = case(t, h, n)
    got = K.MoePermute(K.KERNEL_AOT, library)(Tensor(x), Tensor(idx)).asnumpy()
    np.testing.assert_array_equal(got, naive_permute(x, idx))


@pytest.mark.parametrize("t,h,n", SHAPES)
def test_combine_sums_weighted_rows_per_token_including_repeats(library, mode, t, h, n):
    x, tok, y, w = case(t, h, n, seed=1)
    got = K.MoeUnpermuteCombine(K.KERNEL_AOT, library)(Tensor(y), Tensor(tok), Tensor(w),
                                                        Tensor(x)).asnumpy()
    assert got.shape == (t, h)
    # the C++ kernel's sums against the numpy loop's: float32 rounding apart at most
    assert_within_float32_bound(got, naive_combine(y, tok, w, t), combine_bound(y, tok, w, t),
                                "combine vs naive loop")


def test_float16_kernels_match_the_float32_loop_within_half_precision(library, pynative):
    x, idx, y, w = case(9, 16, 20, seed=2)
    x16, y16, w16 = x.astype(np.float16), y.astype(np.float16), w.astype(np.float16)
    got = K.MoePermute(K.KERNEL_AOT, library)(Tensor(x16), Tensor(idx)).asnumpy()
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, naive_permute(x16, idx))
    got = K.MoeUnpermuteCombine(K.KERNEL_AOT, library)(Tensor(y16), Tensor(idx), Tensor(w16),
                                                        Tensor(x16)).asnumpy()
    want = naive_combine(y16.astype(np.float32), idx, w16.astype(np.float32), 9)
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=2e-3, atol=2e-3)


def test_ops_implementation_matches_the_aot_kernels(library, pynative):
    x, idx, y, w = case(16, 33, 40, seed=3)
    for impl in (K.KERNEL_AOT, K.KERNEL_OPS):
        got = K.MoePermute(impl, library)(Tensor(x), Tensor(idx)).asnumpy()
        np.testing.assert_array_equal(got, naive_permute(x, idx))
        got = K.MoeUnpermuteCombine(impl, library)(Tensor(y), Tensor(idx), Tensor(w),
                                                    Tensor(x)).asnumpy()
        # the kernel's (or MindSpore ops') sums against the numpy loop's: float32 rounding
        assert_within_float32_bound(got, naive_combine(y, idx, w, 16),
                                    combine_bound(y, idx, w, 16), f"combine {impl} vs naive loop")


def test_combine_is_bit_identical_across_runs(library, pynative):
    # 4096 rows onto 64 tokens: ~64 rows summed per token, where a racy order would show.
    x, tok, y, w = case(64, 64, 4096, seed=4)
    combine = K.MoeUnpermuteCombine(K.KERNEL_AOT, library)
    runs = [combine(Tensor(y), Tensor(tok), Tensor(w), Tensor(x)).asnumpy() for _ in range(3)]
    assert runs[0].tobytes() == runs[1].tobytes() == runs[2].tobytes()


def test_out_of_range_index_raises_instead_of_reading_past_x(library, pynative):
    x, _, _, _ = case(4, 3, 1)
    with pytest.raises(RuntimeError, match="MoePermute"):  # PYNATIVE raises at the sync
        K.MoePermute(K.KERNEL_AOT, library)(Tensor(x), Tensor(np.array([4], np.int32))).asnumpy()


def test_wrong_rank_or_dtype_is_refused(library, pynative):
    x, idx, _, _ = case(4, 3, 2)
    permute = K.MoePermute(K.KERNEL_AOT, library)
    with pytest.raises(ValueError, match=r"expects x \[T, H\]"):
        permute(Tensor(x.reshape(-1)), Tensor(idx))
    with pytest.raises(RuntimeError, match="is 2"):  # the kernel's bad-dtype code
        permute(Tensor(x), Tensor(idx.astype(np.int64))).asnumpy()


# ---- gradients -------------------------------------------------------------------------------

def test_permute_and_combine_gradients_match_gather_and_segment_sum(library, mode):
    x, idx, y, w = case(16, 24, 40, seed=5)
    g = np.random.default_rng(6).standard_normal((16, 24)).astype(np.float32)

    def grads(impl):
        permute = K.MoePermute(impl, library)
        combine = K.MoeUnpermuteCombine(impl, library)

        def loss(x_, w_):  # permute, a row-wise nonlinearity standing in for experts, combine
            h = ops.tanh(permute(x_, Tensor(idx)))
            return (combine(h, Tensor(idx), w_, x_) * Tensor(g)).sum()

        dx, dw = ms.grad(loss, grad_position=(0, 1))(Tensor(x), Tensor(w))
        return dx.asnumpy(), dw.asnumpy()

    (dx_aot, dw_aot), (dx_ops, dw_ops) = grads(K.KERNEL_AOT), grads(K.KERNEL_OPS)
    np.testing.assert_allclose(dx_aot, dx_ops, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dw_aot, dw_ops, rtol=1e-5, atol=1e-6)
    assert np.abs(dw_aot).sum() > 0  # the row-weight gradient is not trivially zero


def test_every_aot_kernel_gradient_matches_numeric_differences(library, pynative):
    """The backward kernels (weighted permute, gather-dot) have their own bprops too."""
    kern = K._AotKernels(library)
    x, idx, y, w = case(5, 3, 8, seed=7)
    fns = {  # each: (function of float inputs, inputs); integer index fixed
        "permute_weighted": (lambda a, b: kern.permute_weighted(a, Tensor(idx), b), (x, w)),
        "unpermute_sum": (lambda a: kern.unpermute_sum(a, Tensor(idx), Tensor(x)), (y,)),
        "gather_dot": (lambda a, b: kern.gather_dot(a, Tensor(idx), b), (x, y)),
    }
    for name, (fn, inputs) in fns.items():
        f32 = list(inputs)
        out = fn(*map(Tensor, f32)).asnumpy()
        g = np.random.default_rng(8).standard_normal(out.shape).astype(np.float32)
        got = ms.grad(lambda *a: (fn(*a) * Tensor(g)).sum(), grad_position=tuple(range(len(f32))))
        got = got(*map(Tensor, f32))
        got = got if isinstance(got, tuple) else (got,)
        for pos, analytic in enumerate(got):  # central differences in float32 on each entry
            numeric = np.zeros_like(f32[pos])
            for j in np.ndindex(f32[pos].shape):
                hi, lo = [a.copy() for a in f32], [a.copy() for a in f32]
                hi[pos][j] += 1e-2
                lo[pos][j] -= 1e-2
                f = lambda arrs: float((fn(*map(Tensor, arrs)).asnumpy() * g).sum())  # noqa: E731
                numeric[j] = (f(hi) - f(lo)) / 2e-2
            np.testing.assert_allclose(analytic.asnumpy(), numeric, rtol=1e-2, atol=1e-2,
                                       err_msg=f"{name} input {pos}")


# ---- routing level ---------------------------------------------------------------------------

def test_permutation_from_routing_groups_assignments_by_expert_stably():
    expert_ids_TK = np.array([[2, 0], [0, 1], [2, 1]])
    plan = K.permutation_from_routing(expert_ids_TK, num_experts=4)
    np.testing.assert_array_equal(plan.row_assignment_N, [1, 2, 3, 5, 0, 4])
    np.testing.assert_array_equal(plan.sorted_token_idx_N, [0, 1, 1, 2, 0, 2])
    np.testing.assert_array_equal(plan.tokens_per_expert_E, [2, 2, 2, 0])
    np.testing.assert_array_equal(plan.offsets_E1, [0, 2, 4, 6, 6])
    np.testing.assert_array_equal(plan.row_assignment_N[plan.row_of_assignment_N], np.arange(6))
    with pytest.raises(ValueError, match=r"must be in \[0, 2\)"):
        K.permutation_from_routing(expert_ids_TK, num_experts=2)


def test_token_permute_then_unpermute_with_identity_experts_returns_weighted_tokens(library, mode):
    rng = np.random.default_rng(9)
    x = rng.standard_normal((12, 8)).astype(np.float32)
    expert_ids_TK = rng.integers(0, 4, (12, 2)).astype(np.int32)
    probs_TK = rng.random((12, 2)).astype(np.float32)
    plan = K.permutation_from_routing(expert_ids_TK, num_experts=4)
    x_NH, rows = K.MoeTokenPermute(K.KERNEL_AOT, library)(Tensor(x), Tensor(expert_ids_TK))
    np.testing.assert_array_equal(x_NH.asnumpy(), naive_permute(x, plan.sorted_token_idx_N))
    np.testing.assert_array_equal(rows.asnumpy(), plan.row_of_assignment_N)
    out = K.MoeTokenUnpermute(K.KERNEL_AOT, library)(x_NH, rows, Tensor(probs_TK)).asnumpy()
    # x p_1 + x p_2 (the kernel) against x (p_1 + p_2): 2 products and a sum against a sum and
    # a product, each within gamma_2 of |x| (p_1 + p_2)
    scale = np.abs(x.astype(np.float64)) * probs_TK.astype(np.float64).sum(axis=1, keepdims=True)
    assert_within_float32_bound(out, x * probs_TK.sum(axis=1, keepdims=True),
                                float32_bound(2, scale), "unpermute vs x (p_1 + p_2)")


# ---- building --------------------------------------------------------------------------------

@needs_gxx
def test_build_failure_names_the_command_and_the_compiler_error(tmp_path):
    bad = tmp_path / "bad.cc"
    bad.write_text('extern "C" int Broken() { return undefined_symbol_xyz; }\n')
    with pytest.raises(K.KernelBuildError) as err:
        K.build_kernel_library(bad, cache_dir=tmp_path / "cache")
    message = str(err.value)
    assert "command:" in message and str(bad) in message and "undefined_symbol_xyz" in message
    assert not list((tmp_path / "cache").glob("*.so*"))  # no half-written library left behind


def test_missing_compiler_is_a_clear_error(tmp_path):
    with pytest.raises(K.KernelBuildError, match="'no-such-cxx-123' not found on PATH"):
        K.build_kernel_library(cache_dir=tmp_path, compiler="no-such-cxx-123")


@needs_gxx
def test_concurrent_builds_agree_and_an_edited_source_gets_a_new_library(tmp_path):
    source = tmp_path / "k.cc"
    source.write_text(K.KERNEL_SOURCE.read_text())
    results = []
    threads = [threading.Thread(target=lambda: results.append(
        K.build_kernel_library(source, cache_dir=tmp_path / "cache"))) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(results) == 2 and results[0] == results[1]
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [results[0].split("/")[-1]]
    source.write_text(source.read_text() + "\n// edited\n")
    assert K.build_kernel_library(source, cache_dir=tmp_path / "cache") != results[0]


@needs_gxx
def test_eager_functions_build_into_the_cache_named_by_the_environment(monkeypatch, tmp_path,
                                                                       pynative):
    monkeypatch.setenv(K.CACHE_ENV, str(tmp_path))
    K._default_cell.cache_clear()
    try:
        x, idx, y, w = case(6, 4, 9, seed=10)
        np.testing.assert_array_equal(K.moe_permute(Tensor(x), Tensor(idx)).asnumpy(),
                                      naive_permute(x, idx))
        got = K.moe_unpermute_combine(Tensor(y), Tensor(idx), Tensor(w), Tensor(x)).asnumpy()
        assert_within_float32_bound(got, naive_combine(y, idx, w, 6), combine_bound(y, idx, w, 6),
                                    "eager combine vs naive loop")
        assert len(list(tmp_path.glob("moe_dispatch-*.so"))) == 1
    finally:
        K._default_cell.cache_clear()


def test_unknown_impl_is_rejected():
    with pytest.raises(ValueError, match="'impl' must be one of"):
        K.MoePermute(impl="cuda")
