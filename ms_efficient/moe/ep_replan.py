"""Moving expert rows and their optimizer state for a layer's ``set_plan`` (MindSpore
side of :mod:`~ms_efficient.moe.ep_migration`, which says what moves).

Notation: W ranks, S_b weight rows (budget slots) per rank, X floats in one row of the moved
tensors together (w1 | b1 | w2 | b2, then the same four of every optimizer state, each
flattened), M rows this rank sends, R rows it receives.

On every rank, between steps (collective when a row crosses ranks; every rank calls it with
the same plans):

    the layer's tensors -> old rows [S_b, X] (host numpy)
      -> send buffer [M, X] = old rows ``Migration.send_rows(rank)``
      -> ONE exchange of the moved rows (:class:`~ms_efficient.moe.alltoall.AllToAllV`,
         counts ``rows_WW``; run op by op in PYNATIVE, so no graph is compiled) -> [R, X]
      -> new rows: kept rows unchanged, local copies from old rows, remote rows from the
         receive buffer, rows empty in the new plan zeros -> written in place into every tensor
         (:func:`~ms_efficient.core.params.write_parameter`).

Optimizer state: every optimizer Parameter of the layer's w1/b1/w2/b2 travels with its row
(:func:`weight_states`: nn.Adam's ``moment1.<name>``/``moment2.<name>``, nn.Momentum's
``moments.<name>``, found generically by name suffix and shape). Scalars of the optimizer
(step count, Adam's beta powers) are shared by all rows and stay.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import numpy as np
import mindspore as ms
from mindspore import Parameter, ParameterTuple, Tensor

from ms_efficient.core.params import write_parameter
from ms_efficient.moe.alltoall import AllToAllV
from ms_efficient.moe.ep_migration import Migration, migration_bytes_WW

__all__ = ["MigrationRecord", "weight_states", "move_rows", "record"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MigrationRecord:
    """What one ``set_plan`` moved (the same on every rank).

    moved_slots: rows (slots, all ranks) that received an expert's values, local copies
        included.
    sent_rows: rows carried by the exchange (sum of ``rows_WW``).
    moved_bytes: bytes the exchange carried: sent_rows x row_bytes x (1 + optimizer_states)
        (:func:`~ms_efficient.moe.ep_migration.migration_bytes_WW`).
    row_bytes: bytes of one slot's weights (w1, b1, w2, b2 rows).
    optimizer_states: state tensors moved per weight (0 without an optimizer).
    rows_WW: int64 [W, W], [src, dst], rows exchanged.
    """

    moved_slots: int
    sent_rows: int
    moved_bytes: float
    row_bytes: int
    optimizer_states: int
    rows_WW: np.ndarray

    def log_entry(self, step: int) -> Dict[str, object]:
        """The trainer's log line of a re-plan at ``step`` (no graph was recompiled)."""
        return {"kind": "replan", "step": int(step), "moved_slots": self.moved_slots,
                "moved_bytes": self.moved_bytes, "recompiled": False}


def weight_states(optimizer, weights: Sequence[Parameter]) -> Tuple[Tuple[Parameter, ...], ...]:
    """The optimizer's state Parameters of ``weights`` (all with leading dim S_b), as one
    tuple per state kind, each in the order of ``weights``: nn.Adam gives ((moment1 of w1,
    b1, w2, b2), (moment2 of ...)), nn.Momentum ((moments of ...),), nn.SGD its accum and
    stat.

    A state of weight w is an optimizer Parameter other than w with w's shape whose name ends
    with "." + the name w had when the optimizer was built, found two ways: (1) the entry of w
    in every ParameterTuple attribute of the optimizer aligned with ``optimizer.parameters``
    (how MindSpore optimizers clone their state: ``moment1.<name>``; exact even when the
    network renamed w after the optimizer was built, e.g. "w1" -> "layer.w1"); (2) any other
    optimizer Parameter named "<kind>." + w's current name.
    Raises ``ValueError`` when ``optimizer`` is not an optimizer of these weights or a state
    kind does not cover every weight.
    """
    if not hasattr(optimizer, "get_parameters") or not hasattr(optimizer, "parameters"):
        raise ValueError(f"'optimizer' must be a mindspore.nn.Optimizer (e.g. nn.Adam) of the "
                         f"layer's weights, or None, but got {type(optimizer).__name__}.")
    trained = list(optimizer.parameters)
    index = {id(p): i for i, p in enumerate(trained)}
    missing = [w.name for w in weights if id(w) not in index]
    if missing:
        raise ValueError(f"'optimizer' must optimize the layer's expert weights, but it does "
                         f"not hold {missing} (it holds {[p.name for p in trained][:8]}...).")
    names = [w.name for w in weights]
    kinds: Dict[str, Dict[str, Parameter]] = {}
    seen = {id(p) for p in trained}
    # (1) ParameterTuples aligned with optimizer.parameters
    for kind, value in vars(optimizer).items():
        if not isinstance(value, ParameterTuple) or len(value) != len(trained):
            continue
        for weight in weights:
            param = value[index[id(weight)]]
            if id(param) in seen or tuple(param.shape) != tuple(weight.shape):
                continue
            if param.name.rsplit(".", 1)[-1] != weight.name.rsplit(".", 1)[-1]:
                continue
            kinds.setdefault(kind, {})[weight.name] = param
    covered = {id(p) for found in kinds.values() for p in found.values()}
    # (2) "<kind>.<current weight name>" elsewhere in the optimizer
    for param in optimizer.get_parameters():
        if id(param) in seen or id(param) in covered:
            continue
        for weight in weights:
            suffix = "." + weight.name
            if param.name.endswith(suffix) and tuple(param.shape) == tuple(weight.shape):
                kinds.setdefault(param.name[:-len(suffix)], {})[weight.name] = param
    states = []
    for kind, found in kinds.items():
        if set(found) != set(names):
            raise ValueError(f"optimizer state '{kind}' must have one Parameter per expert "
                             f"weight {names}, but got {sorted(found)}.")
        states.append(tuple(found[n] for n in names))
    return tuple(states)


def move_rows(migration: Migration, rank: int, tensors: Sequence[Parameter],
              group: Optional[str] = None) -> None:
    """Apply ``migration`` on ``rank`` to ``tensors`` (Parameters [S_b, ...], the rows of one
    slot across them move together): kept rows stay, local copies are made here, remote
    rows come through one AllToAllV of the moved rows (skipped when no row crosses ranks,
    the same decision on every rank), rows empty in the new plan become zeros.
    Collective when ``migration.rows_WW`` has a non-zero entry."""
    budget = migration.src_rank_WB.shape[1]
    for t in tensors:
        if t.shape[0] != budget:
            raise ValueError(f"every moved tensor must have {budget} rows (S_b), but "
                             f"{t.name} has shape {tuple(t.shape)}.")
    old_BX = np.concatenate([t.asnumpy().astype(np.float32).reshape(budget, -1)
                             for t in tensors], axis=1)
    new_BX = old_BX.copy()
    src_rank_B, src_row_B = migration.src_rank_WB[rank], migration.src_row_WB[rank]
    local_B = src_rank_B == rank
    new_BX[local_B] = old_BX[src_row_B[local_B]]
    if migration.sent_rows:
        received_RX = _exchange(migration, rank, old_BX, group)
        index_B = migration.receive_index(rank)
        new_BX[index_B >= 0] = received_RX[index_B[index_B >= 0]]
    new_BX[migration.new_expert_WB[rank] < 0] = 0.0
    start = 0
    for t in tensors:
        numel = int(np.prod(t.shape[1:]))
        part = new_BX[:, start:start + numel].reshape(t.shape)
        write_parameter(t, part)
        start += numel


def _exchange(migration: Migration, rank: int, old_BX: np.ndarray,
              group: Optional[str]) -> np.ndarray:
    """The moved rows of every rank -> this rank's received rows [R, X]: one AllToAllV with
    the counts of ``migration.rows_WW`` (the emulation's block = its largest entry, the same
    on every rank), run in PYNATIVE mode (one-off: no graph compiled), mode restored."""
    rows_WW = migration.rows_WW
    send_MX = old_BX[migration.send_rows(rank)]
    mode = ms.get_context("mode")
    if mode != ms.PYNATIVE_MODE:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        exchange = AllToAllV(rows_WW[rank], rows_WW[:, rank], old_BX.shape[1],
                             int(rows_WW.max()), group)
        received = exchange(Tensor(send_MX)).asnumpy()
    finally:
        if mode != ms.PYNATIVE_MODE:
            ms.set_context(mode=mode)
    logger.debug("rank %d: sent %s rows, received %s rows of %d floats", rank,
                 rows_WW[rank].tolist(), rows_WW[:, rank].tolist(), old_BX.shape[1])
    return received


def record(migration: Migration, weights: Sequence[Parameter],
           optimizer_states: int) -> MigrationRecord:
    """The :class:`MigrationRecord` of ``migration`` for ``weights`` (w1, b1, w2, b2)."""
    row_bytes = int(sum(int(np.prod(w.shape[1:])) * w.itemsize for w in weights))
    moved = migration_bytes_WW(migration.rows_WW, row_bytes, optimizer_states)
    return MigrationRecord(migration.moved_slots, migration.sent_rows, float(moved.sum()),
                           row_bytes, optimizer_states, migration.rows_WW.copy())
