"""Padding-free grouped matmul: each expert's weights multiply only its own rows.

Names carry their dimensions: N rows, H input width, F output width, E groups (experts).
Rows are grouped by expert, group e owning rows ``off[e]:off[e] + group_sizes_E[e]`` with
``off`` the exclusive cumsum of the sizes. The sizes are DATA (an int32 tensor), so shapes stay
static while the split changes every step, and no compute is spent on padding:

    y_NF[rows of e] = x_NH[rows of e] @ w_EHF[e]        rows past sum(sizes) -> 0

Sizes must be >= 0 and sum to at most N (the rows past the sum are a buffer's unused tail);
anything else is an error. The gradients are grouped products of the same shapes:
    dx_NH = dy_NF[rows of e] @ w_EHF[e]^T               (``MoeGroupedMatmulTransW``)
    dw_EHF[e] = x_NH[rows of e]^T @ dy_NF[rows of e]    (``MoeGroupedMatmulWeightGrad``)
and group sizes get a zero gradient.

Implementations (``core.backend.grouped_matmul_impl``):
- GMM_AOT on CPU: ``ops.Custom(func_type="aot")`` over kernels/cpu/grouped_matmul.cc, which
  calls ``cblas_sgemm`` of the pip package scipy-openblas32 once per group (its library is
  linked with an rpath, so nothing is needed at run time beyond the package). Without that
  package the kernel is built as a tiled C++ loop instead, with a log line.
- GMM_NATIVE on Ascend: the fused GroupedMatmul op with a group list of sizes
  (``group_list_type=1``); untested here (no Ascend hardware), contract read from the
  MindSpore 2.10 docstring, which documents gradients for ``split_item=3, group_type=0``.
- GMM_OPS elsewhere: every expert on every row and a per-row mask: exact, E times the FLOPs.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path
from typing import Optional, Tuple

import numpy as np

import mindspore as ms
from mindspore import nn, ops

from ms_efficient.core.backend import (CPU, GMM_AOT, GMM_NATIVE, GMM_OPS, device_target,
                                       grouped_matmul_impl)
from ms_efficient.moe.kernels import KernelBuildError, build_kernel_library

__all__ = [
    "GMM_SOURCE", "BLAS_PACKAGE", "GMM_THREADS_ENV", "DEFAULT_BLAS_THREADS",
    "blas_build_flags", "build_grouped_matmul_library", "set_grouped_matmul_threads",
    "GroupedMatmul", "row_groups",
    "grouped_matmul_reference", "grouped_matmul_trans_w_reference",
    "grouped_matmul_weight_grad_reference",
]

logger = logging.getLogger(__name__)

GMM_SOURCE = Path(__file__).resolve().parents[2] / "kernels" / "cpu" / "grouped_matmul.cc"
BLAS_PACKAGE = "scipy_openblas32"  # pip install scipy-openblas32: headers + prefixed symbols
GMM_THREADS_ENV = "MS_EFFICIENT_GMM_THREADS"
# OpenBLAS threads per product, chosen by measurement (scripts/bench_grouped_matmul.py
# --threads 1 2, 2-core CPU shared with other jobs): 2 threads made the reference layer's
# forward+backward 5x slower than 1 (594 vs 111 ms; the kernel alone 50-101 vs 17-21 ms on
# [4096, 256] x [8, 256, 512]), as OpenBLAS's spinning threads fight MindSpore's own pool and
# the other jobs for the 2 cores. Override with $MS_EFFICIENT_GMM_THREADS on a larger machine.
DEFAULT_BLAS_THREADS = 1


# ---------------------------------------------------------------------------------------------
# Building the library
# ---------------------------------------------------------------------------------------------

def blas_build_flags() -> Optional[Tuple[Tuple[str, ...], Tuple[str, ...]]]:
    """(compile_flags, link_flags) for scipy-openblas32's cblas, or None when it is missing.

    The link flags carry an rpath to the package's lib dir, so the kernel finds the library
    without LD_LIBRARY_PATH.
    """
    try:
        import scipy_openblas32 as blas
    except ImportError:
        return None
    lib_dir = blas.get_lib_dir()
    return (("-DMOE_GMM_OPENBLAS", f"-I{blas.get_include_dir()}"),
            (f"-L{lib_dir}", f"-l{blas.get_library()}", f"-Wl,-rpath,{lib_dir}"))


def build_grouped_matmul_library(use_blas: Optional[bool] = None,
                                 cache_dir: Optional[str] = None) -> str:
    """Build kernels/cpu/grouped_matmul.cc (cached, see ``kernels.build_kernel_library``).

    use_blas: True requires scipy-openblas32 (KernelBuildError if missing), False builds the
        tiled C++ loop, None (default) uses BLAS when installed and logs the fallback otherwise.
    Returns the library path; its BLAS threads are set to ``$MS_EFFICIENT_GMM_THREADS`` or
    DEFAULT_BLAS_THREADS on first load.
    """
    flags = blas_build_flags() if use_blas is not False else None
    if flags is None and use_blas:
        raise KernelBuildError(f"use_blas=True needs the '{BLAS_PACKAGE}' package, which is not "
                               "installed (pip install scipy-openblas32).")
    if flags is None and use_blas is None:
        logger.info("%s is not installed: the grouped matmul is built as a plain C++ loop "
                    "(pip install scipy-openblas32 for BLAS speed).", BLAS_PACKAGE)
    compile_flags, link_flags = flags or ((), ())
    library = build_kernel_library(GMM_SOURCE, cache_dir, compile_flags=compile_flags,
                                   link_flags=link_flags)
    _configure_threads(library)
    return library


@functools.lru_cache(maxsize=None)
def _configure_threads(library: str) -> None:
    """Set the default thread count once per library (a process-wide BLAS setting)."""
    value = os.environ.get(GMM_THREADS_ENV) or str(DEFAULT_BLAS_THREADS)
    if not value.strip().isdigit() or int(value) < 1:
        raise ValueError(f"${GMM_THREADS_ENV} must be a positive integer, but got {value!r}.")
    set_grouped_matmul_threads(library, int(value))


def set_grouped_matmul_threads(library: str, threads: int) -> int:
    """Set the threads every grouped product of `library` uses (OpenBLAS's thread count, or the
    loop build's OpenMP threads; process-wide); returns the count now in effect."""
    if threads < 1:
        raise ValueError(f"'threads' must be >= 1, but got {threads}.")
    lib = ctypes.CDLL(library)   # the handle MindSpore's dlopen shares: same path, same copy
    lib.MoeGroupedMatmulSetThreads(ctypes.c_int(threads))
    return int(lib.MoeGroupedMatmulGetThreads())


# ---------------------------------------------------------------------------------------------
# Primitives and the Cell
# ---------------------------------------------------------------------------------------------

def _check_shapes(name: str, a, b, sizes, b_rank: int) -> None:
    if len(a) != 2 or len(b) != b_rank or len(sizes) != 1:
        raise ValueError(f"{name} expects a 2-D [N, .] input, a {b_rank}-D second input and "
                         f"group sizes [E], but got shapes {tuple(a)}, {tuple(b)} and "
                         f"{tuple(sizes)}.")


def _shape_forward(x, w, sizes):
    """[N, F] from x [N, H], w [E, H, F], sizes [E]."""
    _check_shapes("MoeGroupedMatmul", x, w, sizes, 3)
    return x[0], w[2]


def _shape_trans_w(dy, w, sizes):
    """[N, H] from dy [N, F], w [E, H, F], sizes [E]."""
    _check_shapes("MoeGroupedMatmulTransW", dy, w, sizes, 3)
    return dy[0], w[1]


def _shape_weight_grad(x, dy, sizes):
    """[E, H, F] from x [N, H], dy [N, F], sizes [E]."""
    _check_shapes("MoeGroupedMatmulWeightGrad", x, dy, sizes, 2)
    return sizes[0], x[1], dy[1]


class _AotGroupedMatmul:
    """The three aot primitives of one library; each backward is made of the others:

        forward(x, w, s)      -> y = x_e @ w_e        dx = trans_w(dy, w, s)
                                                      dw = weight_grad(x, dy, s)
        trans_w(dy, w, s)     -> d = dy_e @ w_e^T     ddy = forward(dd, w, s)
                                                      dw = weight_grad(dd, dy, s)
        weight_grad(x, dy, s) -> g_e = x_e^T @ dy_e   dx = trans_w(dy, dg, s)
                                                      ddy = forward(x, dg, s)
    Group sizes get zero gradients.
    """

    def __init__(self, library: str):
        def aot(name, out_shape, bprop):
            return ops.Custom(f"{library}:{name}", out_shape=out_shape,
                              out_dtype=lambda first, *rest: first, func_type="aot", bprop=bprop)

        zeros = ops.zeros_like

        def forward_bprop(x, w, sizes, out, dout):
            return trans_w(dout, w, sizes), weight_grad(x, dout, sizes), zeros(sizes)

        def trans_w_bprop(dy, w, sizes, out, dout):
            return forward(dout, w, sizes), weight_grad(dout, dy, sizes), zeros(sizes)

        def weight_grad_bprop(x, dy, sizes, out, dout):
            return trans_w(dy, dout, sizes), forward(x, dout, sizes), zeros(sizes)

        forward = aot("MoeGroupedMatmul", _shape_forward, forward_bprop)
        trans_w = aot("MoeGroupedMatmulTransW", _shape_trans_w, trans_w_bprop)
        weight_grad = aot("MoeGroupedMatmulWeightGrad", _shape_weight_grad, weight_grad_bprop)
        self.forward, self.trans_w, self.weight_grad = forward, trans_w, weight_grad


def row_groups(group_sizes_E, num_rows: int):
    """int32 [N]: the group of every row for sizes [E] (int32), E for the unused tail rows.

    Static-shaped: row r is in group #{e : cumsum(sizes)[e] <= r}.
    """
    ends_E = ops.cumsum(group_sizes_E.astype(ms.int32), 0)
    rows_N = ops.arange(num_rows, dtype=ms.int32)
    return (rows_N.reshape(-1, 1) >= ends_E.reshape(1, -1)).astype(ms.int32).sum(axis=1)


class GroupedMatmul(nn.Cell):
    """``construct(x_NH, w_EHF, group_sizes_E int32) -> y_NF`` (see the module doc).

    Differentiable in x and w. Sizes are checked by the kernel at run time: a negative size or
    a sum above N makes the aot kernel fail with code 4 (MindSpore raises a RuntimeError
    naming MoeGroupedMatmul).

    Args:
        impl: GMM_AOT, GMM_NATIVE or GMM_OPS; default ``core.backend.grouped_matmul_impl()``.
        library: a built kernel library (default: ``build_grouped_matmul_library()``), aot only.
    """

    def __init__(self, impl: Optional[str] = None, library: Optional[str] = None):
        super().__init__()
        impl = impl or grouped_matmul_impl()
        if impl not in (GMM_AOT, GMM_NATIVE, GMM_OPS):
            raise ValueError(f"'impl' must be one of {(GMM_AOT, GMM_NATIVE, GMM_OPS)}, but got "
                             f"{impl!r}.")
        if impl == GMM_AOT and device_target() != CPU:
            raise ValueError(f"'impl' {GMM_AOT!r} runs host code and needs device_target 'CPU', "
                             f"but got {device_target()!r}.")
        if impl == GMM_NATIVE and device_target() == CPU:
            raise ValueError(f"'impl' {GMM_NATIVE!r} is Ascend's GroupedMatmul, which on CPU "
                             "returns an empty tuple; use 'aot'.")
        self.impl = impl
        if impl == GMM_AOT:
            self.op = _AotGroupedMatmul(library or build_grouped_matmul_library()).forward
        elif impl == GMM_NATIVE:
            # Not exported by mindspore.ops in 2.10; this is the only import of it.
            from mindspore.ops.auto_generate import grouped_matmul_v4

            self.op = grouped_matmul_v4

    def construct(self, x, w, group_sizes):
        if self.impl == GMM_AOT:
            return self.op(x, w, group_sizes)
        if self.impl == GMM_NATIVE:
            return self.op([x], [w], group_list=group_sizes.astype(ms.int64), split_item=3,
                           group_type=0, group_list_type=1)[0]
        # GMM_OPS: y_ENF = every expert on every row; each row keeps its own group's product.
        e = w.shape[0]
        y_ENF = ops.matmul(x.reshape(1, x.shape[0], x.shape[1]), w)
        mask_EN = ops.one_hot(row_groups(group_sizes, x.shape[0]), e + 1, 1.0, 0.0)[:, :e].T
        return (y_ENF * mask_EN.astype(x.dtype).reshape(e, -1, 1)).sum(axis=0)


# ---------------------------------------------------------------------------------------------
# Numpy references
# ---------------------------------------------------------------------------------------------

def _offsets(group_sizes_E: np.ndarray, num_rows: int) -> np.ndarray:
    """Exclusive cumsum [E+1] of valid sizes; ValueError naming the sizes otherwise."""
    sizes = np.asarray(group_sizes_E, np.int64)
    if sizes.ndim != 1 or (sizes < 0).any() or sizes.sum() > num_rows:
        raise ValueError(f"'group_sizes_E' must be a 1-D array of sizes >= 0 summing to at most "
                         f"{num_rows} rows, but got {sizes.tolist()}.")
    return np.concatenate([[0], np.cumsum(sizes)])


def grouped_matmul_reference(x_NH: np.ndarray, w_EHF: np.ndarray,
                             group_sizes_E: np.ndarray) -> np.ndarray:
    """Numpy y_NF: ``y[off_e:off_e+size_e] = x[off_e:off_e+size_e] @ w[e]``, tail rows 0."""
    off = _offsets(group_sizes_E, x_NH.shape[0])
    y_NF = np.zeros((x_NH.shape[0], w_EHF.shape[2]), x_NH.dtype)
    for e in range(w_EHF.shape[0]):
        y_NF[off[e]:off[e + 1]] = x_NH[off[e]:off[e + 1]] @ w_EHF[e]
    return y_NF


def grouped_matmul_trans_w_reference(dy_NF: np.ndarray, w_EHF: np.ndarray,
                                     group_sizes_E: np.ndarray) -> np.ndarray:
    """Numpy dx_NH: ``dx[rows of e] = dy[rows of e] @ w[e]^T``, tail rows 0."""
    return grouped_matmul_reference(dy_NF, w_EHF.transpose(0, 2, 1), group_sizes_E)


def grouped_matmul_weight_grad_reference(x_NH: np.ndarray, dy_NF: np.ndarray,
                                         group_sizes_E: np.ndarray) -> np.ndarray:
    """Numpy dw_EHF: ``dw[e] = x[rows of e]^T @ dy[rows of e]`` (0 for an empty group)."""
    off = _offsets(group_sizes_E, x_NH.shape[0])
    e = len(off) - 1
    dw_EHF = np.zeros((e, x_NH.shape[1], dy_NF.shape[1]), x_NH.dtype)
    for g in range(e):
        dw_EHF[g] = x_NH[off[g]:off[g + 1]].T @ dy_NF[off[g]:off[g + 1]]
    return dw_EHF
