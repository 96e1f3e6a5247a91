"""Counter-based dropout: masks that are a pure function of where and when they apply.

``nn.Dropout`` (MindSpore's ``ops.Dropout``) keeps its random state inside the kernel, where
no checkpoint reaches it: a resumed run draws other masks than the uninterrupted one, and an
expert-parallel rank, which holds rows [r B/W, (r + 1) B/W) of the global batch, draws other
masks than one process does for the same rows. :class:`StepDropout` has no random state at all.
Its keep mask is a hash of

    (run seed, training step, block index, site index within the block,
     GLOBAL sample index = sample_offset + row, position, channel)

computed in the graph with integer ops only (int64 Mul, BitwiseAnd, BitwiseXor, RightShift,
which give the same bits on every CPU), so a resumed run, a run resized to any number of
ranks and the one-process run see the same masks. The hash (:func:`keep_mask_reference` is
the same in numpy) absorbs the seven values one after another, each by
``absorb(k, v) = mix(k ^ (v & 0x7FFFFFFF))``, where ``mix`` is a 31-bit variant of the
"lowbias32" integer finaliser (xor-shifts and two multiplications by odd constants below 2**31,
each product masked to its low 31 bits: every intermediate is below 2**62, so int64 never
overflows, and ``mix`` is a bijection of [0, 2**31)). Of the final value h, the low 24 bits
give u = (h & 0xFFFFFF) / 2**24, uniform on [0, 1) in steps of 2**-24, and an element is kept
when u >= p, that is when (h & 0xFFFFFF) >= ceil(p * 2**24) (exact, no float compare);
kept elements are scaled by 1 / (1 - p), as ``nn.Dropout`` does.

The step is a non-trainable Parameter (int64 scalar ``dropout_step``) the trainers write from
the host before every train step (:func:`set_dropout_step`, through
:func:`~ms_efficient.core.params.write_parameter`, which a ``@ms.jit`` step sees; the 0-based
step being trained, the one ``Corpus.train_batch`` takes); the sample offset (rank x local
batch; 0 in one process) and the seed are constructor constants. In eval mode
(``set_train(False)``, what :func:`set_dropout_step` with ``step=None`` sets before an
evaluation) the Cell is the identity.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from ms_efficient.core.params import write_parameter

__all__ = ["StepDropout", "keep_mask_reference", "dropout_key", "keep_threshold",
           "dropout_cells", "set_dropout_step", "MASK31"]

MASK31 = 0x7FFFFFFF               # every hash value stays in [0, 2**31)
_MUL1 = 0x7FEB352D                # odd multipliers below 2**31 (products below 2**62)
_MUL2 = 0x5BD1E995
_SALT = 0x2545F491                # the hash's starting value
_LOW24 = 0xFFFFFF                 # the bits u is made of


def _check_int(field: str, value, low: int = 0) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) \
            or value < low:
        raise ValueError(f"StepDropout '{field}' must be an integer >= {low}, but got "
                         f"{value!r}.")
    return int(value)


def _check_p(p) -> float:
    if isinstance(p, (bool, np.bool_)) or not isinstance(p, (int, float, np.floating)) \
            or not 0.0 <= float(p) < 1.0:
        raise ValueError(f"StepDropout 'p' must be in [0, 1), but got {p!r}.")
    return float(p)


# --- the hash in numpy (host constants and the reference) --------------------------------------

def _mix_np(x: np.ndarray) -> np.ndarray:
    """The 31-bit finaliser on int64 values in [0, 2**31) (any shape)."""
    x = np.asarray(x, np.int64)
    x = x ^ (x >> 16)
    x = (x * _MUL1) & MASK31
    x = x ^ (x >> 15)
    x = (x * _MUL2) & MASK31
    return x ^ (x >> 16)


def _absorb_np(k, v) -> np.ndarray:
    return _mix_np(np.asarray(k, np.int64) ^ (np.asarray(v, np.int64) & MASK31))


def dropout_key(seed: int, block: int, site: int) -> int:
    """The hash state after (salt, seed, block, site): the constant a :class:`StepDropout`
    starts its in-graph hash from (an int in [0, 2**31)). ``seed`` may be any integer (its
    low 31 bits count)."""
    k = _absorb_np(_SALT, int(seed) & MASK31)
    return int(_absorb_np(_absorb_np(k, block), site))


def keep_threshold(p: float) -> int:
    """ceil(p * 2**24): an element is kept when its 24-bit draw is >= this (u >= p)."""
    return int(math.ceil(_check_p(p) * (1 << 24)))


def keep_mask_reference(p: float, seed: int, block: int, site: int, step: int,
                        sample_offset: int, shape: Sequence[int]) -> np.ndarray:
    """bool [B, S, H]: the keep mask :class:`StepDropout` (p, seed, block, site,
    sample_offset) applies at training step ``step`` to an input of ``shape`` [B, S, H]
    (rows are global samples sample_offset .. sample_offset + B - 1), computed in numpy."""
    b, s, h = (int(n) for n in shape)
    k = _absorb_np(dropout_key(seed, block, site), step)
    k = _absorb_np(k, sample_offset + np.arange(b, dtype=np.int64))[:, None, None]
    k = _absorb_np(k, np.arange(s, dtype=np.int64)[None, :, None])
    k = _absorb_np(k, np.arange(h, dtype=np.int64)[None, None, :])
    return (k & _LOW24) >= keep_threshold(p)


# --- the Cell ----------------------------------------------------------------------------------

class StepDropout(nn.Cell):
    """Dropout whose mask is a function of (seed, step, block, site, global sample, position,
    channel): ``construct(x_BSH) -> y_BSH`` (any float dtype), y = x * keep / (1 - p).

    p: drop probability in [0, 1) (0: the identity). seed: the run's seed
    (``context.seed``). block: the block index; site: the dropout site within the block
    (0: after attention, 1: after the FFN). sample_offset: the global index of this
    process's first row (rank x local batch in an expert-parallel run, 0 in one process).
    ``dropout_step`` (int64 scalar Parameter, not trainable): the training step, written by
    :func:`set_dropout_step` before each train step. Eval mode (``set_train(False)``, a
    Cell's default) is the identity.
    """

    def __init__(self, p: float, seed: int = 0, block: int = 0, site: int = 0,
                 sample_offset: int = 0):
        super().__init__()
        self.p = _check_p(p)
        if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
            raise ValueError(f"StepDropout 'seed' must be an integer, but got {seed!r}.")
        self.seed = int(seed)
        self.block = _check_int("block", block)
        self.site = _check_int("site", site)
        self.sample_offset = _check_int("sample_offset", sample_offset)
        if self.sample_offset > MASK31:
            raise ValueError(f"StepDropout 'sample_offset' must be < 2**31, but got "
                             f"{sample_offset}.")
        self.key = Tensor(dropout_key(self.seed, self.block, self.site), ms.int64)
        self.threshold = Tensor(keep_threshold(self.p), ms.int64)
        self.scale = 1.0 / (1.0 - self.p)
        self.mask31 = Tensor(MASK31, ms.int64)
        self.low24 = Tensor(_LOW24, ms.int64)
        self.shift15 = Tensor(15, ms.int64)
        self.shift16 = Tensor(16, ms.int64)
        self.right_shift = ops.RightShift()
        self.dropout_step = Parameter(Tensor(0, ms.int64), name="dropout_step",
                                      requires_grad=False)

    def _mix(self, x):
        x = ops.bitwise_xor(x, self.right_shift(x, self.shift16))
        x = ops.bitwise_and(x * _MUL1, self.mask31)
        x = ops.bitwise_xor(x, self.right_shift(x, self.shift15))
        x = ops.bitwise_and(x * _MUL2, self.mask31)
        return ops.bitwise_xor(x, self.right_shift(x, self.shift16))

    def _absorb(self, k, v):
        return self._mix(ops.bitwise_xor(k, ops.bitwise_and(v, self.mask31)))

    def keep(self, shape):
        """float32 [B, S, H] 1 where kept, 0 where dropped, for the current step."""
        b, s, h = shape
        k = self._absorb(self.key, self.dropout_step)                                  # []
        rows = ops.arange(0, b, dtype=ms.int64) + self.sample_offset
        k = self._absorb(k, rows).reshape(b, 1, 1)                                     # [B,1,1]
        k = self._absorb(k, ops.arange(0, s, dtype=ms.int64).reshape(1, s, 1))         # [B,S,1]
        k = self._absorb(k, ops.arange(0, h, dtype=ms.int64).reshape(1, 1, h))         # [B,S,H]
        return ops.cast(ops.bitwise_and(k, self.low24) >= self.threshold, ms.float32)

    def construct(self, x):
        if not self.training or self.p == 0.0:
            return x
        scaled = ops.stop_gradient(self.keep(x.shape) * self.scale)    # 0 or 1 / (1 - p)
        return x * ops.cast(scaled, x.dtype)


# --- the trainers' side ------------------------------------------------------------------------

def dropout_cells(net: nn.Cell) -> List[StepDropout]:
    """The :class:`StepDropout` cells of ``net`` (none when ``model.dropout`` is 0)."""
    return [cell for _, cell in net.cells_and_names() if isinstance(cell, StepDropout)]


def set_dropout_step(cells: Sequence[StepDropout], step: Optional[int]) -> None:
    """Before a train step: write ``step`` (the 0-based step about to be trained) into every
    cell's ``dropout_step`` and put the cells in training mode; ``step=None`` before an
    evaluation: eval mode (the identity). A ``@ms.jit`` function reads the cells' mode when it
    is first compiled (MindSpore 2.10 does not recompile it when the mode changes), so call
    this before every call of a train or eval step function; a Cell called directly keeps
    one graph per ``phase`` of that Cell: ``set_train`` it too (the cells here are set)."""
    for cell in cells:
        if step is None:
            if cell.training:
                cell.set_train(False)
            continue
        if step < 0 or step > MASK31:
            raise ValueError(f"dropout step must be in [0, 2**31), but got {step}.")
        write_parameter(cell.dropout_step, np.int64(step))
        if not cell.training:
            cell.set_train(True)
