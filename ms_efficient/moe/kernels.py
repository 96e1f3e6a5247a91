"""Padding-free MoE token permutation and weighted combine: CPU aot kernels, numpy references.

Names carry their dimensions: T tokens, H hidden, E experts, K top-k, N permuted rows
(N = T*K when nothing is dropped). Rows are grouped by expert with no capacity padding, so
expert e owns rows ``offsets_E1[e]:offsets_E1[e+1]`` of ``x_NH``:

    x_TH --MoePermute(sorted_token_idx_N)--> x_NH --experts--> y_NH
         --MoeUnpermuteCombine(row_token_N, row_weight_N, like=x_TH)--> out_TH

- ``MoePermute``: ``x_NH[i] = x_TH[sorted_token_idx_N[i]]``, a zero row where the index is -1.
- ``MoeUnpermuteCombine``: ``out_TH[t] = sum of row_weight_N[r] * y_NH[r] over r with
  row_token_N[r] == t`` (-1 rows are ignored). T is read from the shape of ``like`` (any tensor
  whose first dimension is T, usually ``x_TH``; only its shape is used and its gradient is
  zero), because MindSpore infers output shapes from input shapes, never from data.

Implementations (``dispatch_kernel_impl``):
- ``KERNEL_AOT`` ("aot") on CPU: ``ops.Custom(func_type="aot")`` over kernels/cpu/moe_dispatch.cc,
  built with g++ on first use. The combine is deterministic (per-token CSR, no atomics).
  Every backward is made of the same five kernels (see ``_AotKernels``).
- ``KERNEL_OPS`` ("ops") elsewhere: ``ops.gather`` on a zero-padded ``x`` and
  ``ops.unsorted_segment_sum``; native kernels on Ascend, also the CPU baseline in benchmarks.
The routing-level Cells ``MoeTokenPermute``/``MoeTokenUnpermute`` take top-k expert ids instead
of row indices; on Ascend they call the fused ``ops.moe_token_permute``/``moe_token_unpermute``
(whose contract is expert ids, not arbitrary row indices), elsewhere the kernels above.
Index tensors are int32; N = 0 is allowed (an empty permute; a combine of zeros).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np

import mindspore as ms
from mindspore import nn, ops

from ms_efficient.core.backend import ASCEND, CPU, device_target

__all__ = [
    "KERNEL_AOT", "KERNEL_OPS", "KERNEL_SOURCE", "CACHE_ENV", "KernelBuildError",
    "dispatch_kernel_impl", "kernel_cache_dir", "build_kernel_library",
    "MoePermute", "MoeUnpermuteCombine", "MoeTokenPermute", "MoeTokenUnpermute",
    "moe_permute", "moe_unpermute_combine",
    "PermutationPlan", "permutation_from_routing",
    "moe_permute_reference", "moe_unpermute_combine_reference",
]

logger = logging.getLogger(__name__)

KERNEL_AOT = "aot"  # C++ kernels via ops.Custom(func_type="aot"): CPU only
KERNEL_OPS = "ops"  # ops.gather / ops.unsorted_segment_sum: any target
KERNEL_SOURCE = Path(__file__).resolve().parents[2] / "kernels" / "cpu" / "moe_dispatch.cc"
CACHE_ENV = "MS_EFFICIENT_KERNEL_CACHE"
# -O2 as the aot docs build; -fopenmp parallelises over rows when g++ ships libgomp (it is
# dropped, with a log line, if that build fails).
BASE_FLAGS = ("-O2", "-shared", "-fPIC", "-std=c++17")
OPENMP_FLAG = "-fopenmp"


class KernelBuildError(RuntimeError):
    """The C++ kernel library could not be built (no compiler, or the compiler failed)."""


def dispatch_kernel_impl(target: Optional[str] = None) -> str:
    """KERNEL_AOT on CPU (the aot .so runs host code on host memory), KERNEL_OPS elsewhere.

    Belongs in the table of ms_efficient.core.backend; kept here until it moves there.
    """
    return KERNEL_AOT if (target or device_target()) == CPU else KERNEL_OPS


# ---------------------------------------------------------------------------------------------
# Building the library
# ---------------------------------------------------------------------------------------------

def kernel_cache_dir() -> Path:
    """``$MS_EFFICIENT_KERNEL_CACHE`` if set, else ``~/.cache/ms_efficient/kernels``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "ms_efficient" / "kernels")


def build_kernel_library(source: Union[str, Path] = KERNEL_SOURCE,
                         cache_dir: Union[str, Path, None] = None,
                         compiler: str = "g++", compile_flags: Sequence[str] = (),
                         link_flags: Sequence[str] = ()) -> str:
    """Compile `source` into ``<cache_dir>/<stem>-<hash>.so`` unless it is there; return its path.

    compile_flags: extra flags before the source (``-D...``, ``-I<dir>``); link_flags: after
    it (``-L<dir>``, ``-l<lib>``, ``-Wl,-rpath,<dir>``), as the linker reads libraries after
    the objects that need them.
    The hash covers the source text and all flags, so an edited source, or the same source
    against another library, gets a new file. The
    library is written to a temporary name and renamed into place, so concurrent builds (several
    workers starting at once) are safe: the last rename wins with an identical file.
    Raises KernelBuildError naming the command and the compiler's stderr when the build fails.
    """
    source = Path(source)
    if not source.is_file():
        raise KernelBuildError(f"kernel source {source} does not exist.")
    text = source.read_bytes()
    extra = (*compile_flags, *link_flags)
    flags = " ".join(BASE_FLAGS) + ("" if not extra else " | " + " ".join(extra))
    digest = hashlib.sha256(text + flags.encode()).hexdigest()[:16]
    out_dir = Path(cache_dir) if cache_dir is not None else kernel_cache_dir()
    library = out_dir / f"{source.stem}-{digest}.so"
    if library.is_file():
        return str(library)
    cxx = shutil.which(compiler)
    if cxx is None:
        raise KernelBuildError(f"C++ compiler '{compiler}' not found on PATH; building "
                               f"{source.name} needs it (Debian/Ubuntu: apt-get install g++).")
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so.tmp", dir=out_dir)
    os.close(fd)
    try:
        cmd = [cxx, *BASE_FLAGS, OPENMP_FLAG, *compile_flags, str(source), *link_flags,
               "-o", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            logger.info("building without OpenMP: %s", proc.stderr.strip()[:500])
            cmd.remove(OPENMP_FLAG)
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise KernelBuildError(f"building {source.name} failed (exit {proc.returncode}).\n"
                                   f"command: {' '.join(cmd)}\nstderr:\n{proc.stderr.strip()}")
        os.replace(tmp, library)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("built %s", library)
    return str(library)


# ---------------------------------------------------------------------------------------------
# Primitives
# ---------------------------------------------------------------------------------------------

def _shape_n_h(x, idx, *weight):
    """Output shape [N, H] of a permute from x [T, H] and idx [N] (shape inference)."""
    if len(x) != 2 or len(idx) != 1:
        raise ValueError(f"MoePermute expects x [T, H] and an index [N], but got shapes "
                         f"{tuple(x)} and {tuple(idx)}.")
    return idx[0], x[1]


def _shape_t_h(y, tok, *rest):
    """Output shape [T, H] of a combine from y [N, H], row_token [N], ..., like [T, ...]."""
    like = rest[-1]
    if len(y) != 2 or len(tok) != 1 or len(like) < 1:
        raise ValueError(f"MoeUnpermuteCombine expects y [N, H], row_token [N] and like [T, ...], "
                         f"but got shapes {tuple(y)}, {tuple(tok)} and {tuple(like)}.")
    return like[0], y[1]


class _AotKernels:
    """The five aot primitives of one library; each backward is made of the others.

        permute(x, idx)              -> y_N = x[idx]          dx = unpermute_sum(dy, idx, x)
        permute_weighted(x, idx, w)  -> y_N = w * x[idx]      dx = combine(dy, idx, w, x)
                                                              dw = gather_dot(x, idx, dy)
        combine(y, tok, w, like)     -> out_T                 dy = permute_weighted(dout, tok, w)
                                                              dw = gather_dot(dout, tok, y)
        unpermute_sum(y, tok, like)  -> out_T                 dy = permute(dout, tok)
        gather_dot(a, idx, b)        -> d_N = <a[idx], b>     da = combine(b, idx, dd, a)
                                                              db = permute_weighted(a, idx, dd)
    Index inputs and ``like`` get zero gradients.
    """

    def __init__(self, library: str):
        def aot(name, out_shape, bprop):
            return ops.Custom(f"{library}:{name}", out_shape=out_shape,
                              out_dtype=lambda first, *rest: first, func_type="aot", bprop=bprop)

        zeros = ops.zeros_like

        def permute_bprop(x, idx, out, dout):
            return unpermute_sum(dout, idx, x), zeros(idx)

        def permute_weighted_bprop(x, idx, w, out, dout):
            return combine(dout, idx, w, x), zeros(idx), gather_dot(x, idx, dout)

        def combine_bprop(y, tok, w, like, out, dout):
            return permute_weighted(dout, tok, w), zeros(tok), gather_dot(dout, tok, y), zeros(like)

        def unpermute_sum_bprop(y, tok, like, out, dout):
            return permute(dout, tok), zeros(tok), zeros(like)

        def gather_dot_bprop(a, idx, b, out, dout):
            return combine(b, idx, dout, a), zeros(idx), permute_weighted(a, idx, dout)

        permute = aot("MoePermute", _shape_n_h, permute_bprop)
        permute_weighted = aot("MoePermuteWeighted", _shape_n_h, permute_weighted_bprop)
        combine = aot("MoeUnpermuteCombine", _shape_t_h, combine_bprop)
        unpermute_sum = aot("MoeUnpermuteSum", _shape_t_h, unpermute_sum_bprop)
        gather_dot = aot("MoeGatherDot", lambda a, idx, b: _shape_n_h(a, idx)[:1],
                         gather_dot_bprop)
        self.permute, self.permute_weighted, self.combine = permute, permute_weighted, combine
        self.unpermute_sum, self.gather_dot = unpermute_sum, gather_dot


def _check_impl(impl: Optional[str]) -> str:
    impl = impl or dispatch_kernel_impl()
    if impl not in (KERNEL_AOT, KERNEL_OPS):
        raise ValueError(f"'impl' must be one of {(KERNEL_AOT, KERNEL_OPS)}, but got {impl!r}.")
    if impl == KERNEL_AOT and device_target() != CPU:
        raise ValueError(f"'impl' {KERNEL_AOT!r} runs host code and needs device_target 'CPU', "
                         f"but got {device_target()!r}; use {KERNEL_OPS!r}.")
    return impl


class MoePermute(nn.Cell):
    """``construct(x_TH, sorted_token_idx_N int32) -> x_NH``: ``x_NH[i] = x_TH[idx[i]]``, 0 if -1.

    Args:
        impl: KERNEL_AOT or KERNEL_OPS; default ``dispatch_kernel_impl()``.
        library: a built kernel library (default: ``build_kernel_library()``), aot only.
    """

    def __init__(self, impl: Optional[str] = None, library: Optional[str] = None):
        super().__init__()
        self.use_aot = _check_impl(impl) == KERNEL_AOT
        if self.use_aot:
            self.op = _AotKernels(library or build_kernel_library()).permute

    def construct(self, x, idx):
        if self.use_aot:
            return self.op(x, idx)
        # -1 reads an appended zero row T.
        t = x.shape[0]
        x_pad = ops.concat((x, ops.zeros((1, x.shape[1]), x.dtype)), 0)
        return ops.gather(x_pad, ops.select(idx < 0, ops.full_like(idx, t), idx), 0)


class MoeUnpermuteCombine(nn.Cell):
    """``construct(y_NH, row_token_N int32, row_weight_N, like_T) -> out_TH`` (see module doc).

    Args:
        impl: KERNEL_AOT or KERNEL_OPS; default ``dispatch_kernel_impl()``.
        library: a built kernel library (default: ``build_kernel_library()``), aot only.
    """

    def __init__(self, impl: Optional[str] = None, library: Optional[str] = None):
        super().__init__()
        self.use_aot = _check_impl(impl) == KERNEL_AOT
        if self.use_aot:
            self.op = _AotKernels(library or build_kernel_library()).combine

    def construct(self, y, row_token, row_weight, like):
        if self.use_aot:
            return self.op(y, row_token, row_weight, like)
        # -1 rows go to an extra segment T that is dropped.
        t = like.shape[0]
        seg = ops.select(row_token < 0, ops.full_like(row_token, t), row_token)
        out = ops.unsorted_segment_sum(y * row_weight.reshape(-1, 1), seg, t + 1)
        return out[:t]


class MoeTokenPermute(nn.Cell):
    """``construct(x_TH, expert_ids_TK int32) -> (x_NH, row_of_assignment_N int32)``, N = T*K.

    Rows are the (token, choice) assignments stably sorted by expert (flat index t*K + k breaks
    ties), and ``row_of_assignment_N[t*K + k]`` is the row of assignment (t, k): the
    ``sorted_indices`` contract of ``ops.moe_token_permute``, which this calls on Ascend
    (untested here: no Ascend hardware; contract read from the MindSpore docs example), where
    `impl` and `library` are unused.
    """

    def __init__(self, impl: Optional[str] = None, library: Optional[str] = None):
        super().__init__()
        self.use_fused = device_target() == ASCEND
        if not self.use_fused:
            self.permute = MoePermute(impl, library)

    def construct(self, x, expert_ids):
        if self.use_fused:
            return ops.moe_token_permute(x, expert_ids)
        t, k = expert_ids.shape
        n = t * k
        # Step 1: stable sort of assignments by expert (unique int64 keys expert*N + a).
        key = expert_ids.reshape(-1).astype(ms.int64) * n + ops.arange(n, dtype=ms.int64)
        order_N = ops.argsort(key).astype(ms.int32)  # assignment held by each row
        # Step 2: gather token rows; invert the order for the combine.
        x_NH = self.permute(x, order_N // k)
        rows = ops.tensor_scatter_update(ops.zeros((n,), ms.int32), order_N.reshape(-1, 1),
                                         ops.arange(n, dtype=ms.int32))
        return x_NH, rows


class MoeTokenUnpermute(nn.Cell):
    """``construct(y_NH, row_of_assignment_N, probs_TK) -> out_TH``, the inverse of MoeTokenPermute.

    ``out[t] = sum_k probs[t, k] * y_NH[row_of_assignment_N[t*K + k]]``; gradients flow to
    ``y_NH`` and ``probs_TK``. Calls ``ops.moe_token_unpermute`` on Ascend (untested here), where
    `impl` and `library` are unused.
    """

    def __init__(self, impl: Optional[str] = None, library: Optional[str] = None):
        super().__init__()
        self.use_fused = device_target() == ASCEND
        if not self.use_fused:
            self.combine = MoeUnpermuteCombine(impl, library)

    def construct(self, y, rows, probs):
        if self.use_fused:
            return ops.moe_token_unpermute(y, rows, probs)
        t, k = probs.shape
        n = t * k
        order_N = ops.tensor_scatter_update(ops.zeros((n,), ms.int32), rows.reshape(-1, 1),
                                            ops.arange(n, dtype=ms.int32))
        weight_N = ops.gather(probs.reshape(-1), order_N, 0).astype(y.dtype)
        return self.combine(y, order_N // k, weight_N, probs)


@functools.lru_cache(maxsize=None)
def _default_cell(cls: type, target: str) -> nn.Cell:
    """One default-built Cell per class and device target, for the eager functions below."""
    return cls()


def moe_permute(x, sorted_token_idx):
    """PYNATIVE convenience for ``MoePermute()(x_TH, sorted_token_idx_N)``.

    Graph code (a GRAPH_MODE ``construct``) cannot call it: create the Cell in ``__init__``.
    """
    return _default_cell(MoePermute, device_target())(x, sorted_token_idx)


def moe_unpermute_combine(y, row_token, row_weight, like):
    """PYNATIVE convenience for ``MoeUnpermuteCombine()(y_NH, row_token_N, row_weight_N, like)``.

    Graph code cannot call it: create the Cell in ``__init__``.
    """
    return _default_cell(MoeUnpermuteCombine, device_target())(y, row_token, row_weight, like)


# ---------------------------------------------------------------------------------------------
# Planning and numpy references
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PermutationPlan:
    """Padding-free layout of T*K assignments grouped by expert (N = T*K rows).

    sorted_token_idx_N: int32 [N], token held by each row (the MoePermute index).
    row_token_N: int32 [N], token each row combines back into (equal to sorted_token_idx_N
        here; separate so that dropped rows can be set to -1 in one of them).
    row_assignment_N: int32 [N], flat assignment t*K + k of each row; gate weights per row are
        ``weights_TK.reshape(-1)[row_assignment_N]``.
    row_of_assignment_N: int32 [N], inverse of row_assignment_N (row of assignment t*K + k).
    tokens_per_expert_E: int64 [E], rows owned by each expert.
    offsets_E1: int64 [E+1], expert e owns rows offsets_E1[e]:offsets_E1[e+1].
    """

    sorted_token_idx_N: np.ndarray
    row_token_N: np.ndarray
    row_assignment_N: np.ndarray
    row_of_assignment_N: np.ndarray
    tokens_per_expert_E: np.ndarray
    offsets_E1: np.ndarray


def permutation_from_routing(expert_ids_TK: np.ndarray, num_experts: int) -> PermutationPlan:
    """Group the assignments of `expert_ids_TK` (int [T, K], values in [0, E)) by expert.

    A stable argsort by expert, so inside an expert rows follow (t, k) order.
    """
    expert_ids_TK = np.asarray(expert_ids_TK)
    if expert_ids_TK.ndim != 2:
        raise ValueError(f"'expert_ids_TK' must be 2-D [T, K], but got shape "
                         f"{expert_ids_TK.shape}.")
    if expert_ids_TK.size and (expert_ids_TK.min() < 0 or expert_ids_TK.max() >= num_experts):
        raise ValueError(f"'expert_ids_TK' values must be in [0, {num_experts}), but got "
                         f"[{expert_ids_TK.min()}, {expert_ids_TK.max()}].")
    k = expert_ids_TK.shape[1]
    flat_N = expert_ids_TK.reshape(-1)
    # Step 1: rows = assignments stably sorted by expert.
    row_assignment_N = np.argsort(flat_N, kind="stable").astype(np.int32)
    row_of_assignment_N = np.empty_like(row_assignment_N)
    row_of_assignment_N[row_assignment_N] = np.arange(flat_N.size, dtype=np.int32)
    # Step 2: per-expert group sizes and offsets.
    tokens_per_expert_E = np.bincount(flat_N, minlength=num_experts).astype(np.int64)
    offsets_E1 = np.concatenate([[0], np.cumsum(tokens_per_expert_E)]).astype(np.int64)
    sorted_token_idx_N = (row_assignment_N // k).astype(np.int32)
    return PermutationPlan(sorted_token_idx_N, sorted_token_idx_N.copy(), row_assignment_N,
                           row_of_assignment_N, tokens_per_expert_E, offsets_E1)


def moe_permute_reference(x_TH: np.ndarray, sorted_token_idx_N: np.ndarray) -> np.ndarray:
    """Numpy MoePermute: ``x_NH[i] = x_TH[idx[i]]``, a zero row where ``idx[i] == -1``."""
    idx = np.asarray(sorted_token_idx_N)
    x_NH = x_TH[np.maximum(idx, 0)]
    x_NH[idx < 0] = 0
    return x_NH


def moe_unpermute_combine_reference(y_NH: np.ndarray, row_token_N: np.ndarray,
                                    row_weight_N: np.ndarray, num_tokens: int) -> np.ndarray:
    """Numpy MoeUnpermuteCombine: ``out[t] = sum of w[r] * y[r] over rows r with tok[r] == t``."""
    out_TH = np.zeros((num_tokens, y_NH.shape[1]), dtype=y_NH.dtype)
    keep = np.asarray(row_token_N) >= 0
    np.add.at(out_TH, row_token_N[keep], y_NH[keep] * row_weight_N[keep, None])
    return out_TH
