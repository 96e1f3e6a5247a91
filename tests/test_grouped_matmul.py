"""The grouped matmul (ms_efficient.moe.grouped_matmul): forward and both gradients against a
numpy loop written here, for the OpenBLAS build and the plain-loop build, over group sizes with
empty groups, one group holding every row and an unused tail; bad sizes fail loudly."""
import ctypes

import numpy as np
import pytest

import mindspore as ms
from mindspore import Tensor, nn

from ms_efficient.core import backend
from ms_efficient.moe import grouped_matmul as G

ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")

N, H, F, E = 24, 6, 10, 4
SIZES = {
    "mixed": [5, 0, 12, 7],
    "one_group_holds_all": [0, 24, 0, 0],
    "unused_tail": [3, 0, 4, 2],         # 9 of 24 rows used, rows 9.. -> zeros
    "all_empty": [0, 0, 0, 0],
}


@pytest.fixture(scope="module", params=["openblas", "loop"])
def build(request):
    """(library, backend name) of each build; the BLAS one needs scipy-openblas32."""
    if request.param == "openblas" and G.blas_build_flags() is None:
        pytest.skip("scipy-openblas32 is not installed")
    library = G.build_grouped_matmul_library(use_blas=request.param == "openblas")
    return library, request.param


def naive_loop(x, w, sizes):
    """y[r] = x[r] @ w[group of r] row by row; tail rows stay 0."""
    y = np.zeros((x.shape[0], w.shape[2]), np.float64)
    group = np.repeat(np.arange(len(sizes)), sizes)
    for r, e in enumerate(group):
        y[r] = x[r].astype(np.float64) @ w[e]
    return y


def case(seed=0, n=N):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, H)).astype(np.float32)
    w = rng.standard_normal((E, H, F)).astype(np.float32)
    g = rng.standard_normal((n, F)).astype(np.float32)
    return x, w, g


class Loss(nn.Cell):
    """<gmm(x, w, sizes), g>: its gradients are dx = g @ w^T and dw = x^T @ g per group."""

    def __init__(self, gmm, g):
        super().__init__()
        self.gmm, self.g = gmm, Tensor(g)

    def construct(self, x, w, sizes):
        return (self.gmm(x, w, sizes) * self.g).sum()


def forward_and_grads(gmm, x, w, g, sizes):
    args = (Tensor(x), Tensor(w), Tensor(np.asarray(sizes, np.int32)))
    y = gmm(*args).asnumpy()
    dx, dw = ms.grad(Loss(gmm, g), (0, 1))(*args)
    return y, dx.asnumpy(), dw.asnumpy()


@pytest.mark.parametrize("name", list(SIZES))
def test_forward_and_gradients_match_a_numpy_loop(build, name):
    library, _ = build
    sizes = SIZES[name]
    x, w, g = case()
    y, dx, dw = forward_and_grads(G.GroupedMatmul(G.GMM_AOT, library), x, w, g, sizes)
    used = sum(sizes)
    np.testing.assert_allclose(y, naive_loop(x, w, sizes), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y, G.grouped_matmul_reference(x, w, sizes), rtol=1e-5, atol=1e-5)
    # dx: rows of group e get g @ w[e]^T; the tail gets nothing
    dx_ref = np.zeros_like(x)
    dw_ref = np.zeros_like(w)
    off = np.concatenate([[0], np.cumsum(sizes)])
    for e in range(E):
        rows = slice(off[e], off[e + 1])
        dx_ref[rows] = g[rows] @ w[e].T
        dw_ref[e] = x[rows].T @ g[rows]
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, G.grouped_matmul_trans_w_reference(g, w, sizes),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, G.grouped_matmul_weight_grad_reference(x, g, sizes),
                               rtol=1e-5, atol=1e-5)
    # the unused tail and the empty groups are exact zeros, though x and g are not zero there
    assert not y[used:].any() and not dx[used:].any()
    for e in np.flatnonzero(np.asarray(sizes) == 0):
        assert not dw[e].any()


def test_rows_of_one_group_see_only_that_groups_weights(build):
    """Row i of group 1 times w[1] only: w[0] and w[2] poisoned with huge values change nothing."""
    library, _ = build
    x, w, _ = case(1)
    sizes = np.array([0, 10, 0, 14], np.int32)
    w_poisoned = w.copy()
    w_poisoned[[0, 2]] = 1e30
    gmm = G.GroupedMatmul(G.GMM_AOT, library)
    y = gmm(Tensor(x), Tensor(w_poisoned), Tensor(sizes)).asnumpy()
    np.testing.assert_allclose(y[:10], x[:10] @ w[1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y[10:], x[10:] @ w[3], rtol=1e-5, atol=1e-5)


def test_large_groups_cross_the_tile_and_thread_boundaries(build):
    """Shapes past the loop build's tiles (4 rows, 256 columns) and its parallel threshold, and
    the same bits from 1 and 2 threads."""
    library, _ = build
    rng = np.random.default_rng(2)
    n, h, f = 301, 70, 300
    x = rng.standard_normal((n, h)).astype(np.float32)
    w = rng.standard_normal((3, h, f)).astype(np.float32)
    sizes = np.array([101, 3, 190], np.int32)
    gmm = G.GroupedMatmul(G.GMM_AOT, library)
    outs = []
    for threads in (1, 2):
        assert G.set_grouped_matmul_threads(library, threads) == threads
        outs.append(gmm(Tensor(x), Tensor(w), Tensor(sizes)).asnumpy())
    G.set_grouped_matmul_threads(library, G.DEFAULT_BLAS_THREADS)
    np.testing.assert_allclose(outs[0], naive_loop(x, w, sizes), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-6, atol=1e-5)
    assert not outs[0][294:].any()


@pytest.mark.parametrize("sizes", [[20, 0, 5, 0], [3, -1, 4, 2]], ids=["sum_above_N", "negative"])
def test_bad_group_sizes_fail_with_the_kernels_code_and_in_the_reference(build, sizes):
    library, _ = build
    x, w, _ = case()
    gmm = G.GroupedMatmul(G.GMM_AOT, library)
    with pytest.raises(RuntimeError, match=r"function\(MoeGroupedMatmul\) is 4"):
        gmm(Tensor(x), Tensor(w), Tensor(np.array(sizes, np.int32))).asnumpy()
    with pytest.raises(ValueError, match=r"'group_sizes_E' must be .* summing to at most 24 "
                                         r"rows, but got \[" + str(sizes[0])):
        G.grouped_matmul_reference(x, w, np.array(sizes))


def test_wrong_ranks_are_named_at_shape_inference(build):
    library, _ = build
    x, w, _ = case()
    gmm = G.GroupedMatmul(G.GMM_AOT, library)
    with pytest.raises(ValueError, match=r"MoeGroupedMatmul expects .* but got shapes \(24, 6\), "
                                         r"\(6, 10\)"):
        gmm(Tensor(x), Tensor(w[0]), Tensor(np.array([24, 0, 0, 0], np.int32)))


def test_float16_is_computed_in_float32_and_rounded_once(build):
    library, _ = build
    x, w, _ = case(3)
    sizes = np.array([7, 9, 0, 5], np.int32)
    y = G.GroupedMatmul(G.GMM_AOT, library)(Tensor(x.astype(np.float16)),
                                            Tensor(w.astype(np.float16)), Tensor(sizes))
    assert y.dtype == ms.float16
    ref = naive_loop(x.astype(np.float16).astype(np.float32),
                     w.astype(np.float16).astype(np.float32), sizes)
    np.testing.assert_allclose(y.asnumpy().astype(np.float32), ref, rtol=2e-3, atol=2e-3)


def test_the_blas_build_links_openblas_and_the_loop_build_does_not(build):
    library, name = build
    lib = ctypes.CDLL(library)
    lib.MoeGroupedMatmulBackend.restype = ctypes.c_char_p
    assert lib.MoeGroupedMatmulBackend().decode() == name


def test_the_dense_composite_agrees_with_the_kernel_outputs_and_gradients(build):
    library, _ = build
    x, w, g = case(4)
    sizes = SIZES["unused_tail"]
    got = forward_and_grads(G.GroupedMatmul(G.GMM_OPS), x, w, g, sizes)
    want = forward_and_grads(G.GroupedMatmul(G.GMM_AOT, library), x, w, g, sizes)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_backend_table_and_the_ascend_op_is_refused_on_cpu():
    assert backend.grouped_matmul_impl("Ascend") == backend.GMM_NATIVE
    assert backend.grouped_matmul_impl("CPU") == backend.GMM_AOT
    assert backend.grouped_matmul_impl("GPU") == backend.GMM_OPS
    with pytest.raises(ValueError, match="returns an empty tuple; use 'aot'"):
        G.GroupedMatmul(G.GMM_NATIVE)
    with pytest.raises(ValueError, match=r"'impl' must be one of .* but got 'blas'"):
        G.GroupedMatmul("blas")


def test_blas_flags_carry_an_rpath_and_change_the_cached_library(tmp_path):
    flags = G.blas_build_flags()
    if flags is None:
        pytest.skip("scipy-openblas32 is not installed")
    compile_flags, link_flags = flags
    assert "-DMOE_GMM_OPENBLAS" in compile_flags
    assert any(f.startswith("-Wl,-rpath,") for f in link_flags)
    with_blas = G.build_grouped_matmul_library(use_blas=True, cache_dir=str(tmp_path))
    plain = G.build_grouped_matmul_library(use_blas=False, cache_dir=str(tmp_path))
    assert with_blas != plain


def test_without_the_blas_package_the_loop_is_built_with_a_log_line(tmp_path, monkeypatch,
                                                                     caplog):
    monkeypatch.setattr(G, "blas_build_flags", lambda: None)
    with caplog.at_level("INFO", logger=G.__name__):
        library = G.build_grouped_matmul_library(cache_dir=str(tmp_path))
    assert "scipy_openblas32 is not installed" in caplog.text
    lib = ctypes.CDLL(library)
    lib.MoeGroupedMatmulBackend.restype = ctypes.c_char_p
    assert lib.MoeGroupedMatmulBackend() == b"loop"
    with pytest.raises(G.KernelBuildError, match="pip install scipy-openblas32"):
        G.build_grouped_matmul_library(use_blas=True, cache_dir=str(tmp_path))
