"""Backend layer: the one place where code paths are chosen per MindSpore device target.

Ascend 910 is the production target; CPU is where everything is built and tested (GPU is
accepted but not a goal). Runtime Cells ask this module which implementation to use instead of
testing ``device_target`` themselves, so every per-target choice is listed here, with the
reason, in one table:

    choice            Ascend     CPU / GPU                 why
    ----------------  ---------  ------------------------  --------------------------------------
    alltoall_impl()   "native"   world group:              ``ops.AlltoAll`` is Ascend-only; the
                                 "allgather-emulation"     CPU (mccl) backend has no AlltoAll or
                                 other groups:             ReduceScatter, and its AllGather kernel
                                 "allreduce-emulation"     accepts only the world group (AllReduce
                                                           accepts any group).
    grouped_matmul_   "native"   CPU: "aot"                padding-free expert matmul with group
    impl()            (untested  GPU: "ops"                sizes as data: Ascend's fused
                      here)                                GroupedMatmul; on CPU a C++ kernel over
                                                           OpenBLAS (ms_efficient.moe.
                                                           grouped_matmul); GPU a dense composite.
                                                           Never the Ascend op on CPU: in
                                                           PYNATIVE it returns an empty tuple.
    counted_alltoall_ "native"   "block-emulation"         the "counts" dispatch's exchange
    impl()                                                 (per-peer counts are data): Ascend's
                                                           ``ops.AlltoAllVC`` with a Tensor
                                                           [W * W] count matrix (GRAPH mode,
                                                           bprop registered, output size is
                                                           data); elsewhere no count-driven
                                                           collective exists (CPU mccl has no
                                                           AlltoAllV at all), so the static
                                                           blocks C[r, d] are exchanged with the
                                                           AllToAllV emulation: the same values
                                                           (unfilled block rows are zeros), the
                                                           padded traffic.

Add a new choice as a function ``<thing>_impl(device_target=None) -> str`` that returns one of a
few documented string constants, and list it in the table above.
"""
from typing import Optional

import mindspore as ms
from mindspore.communication import GlobalComm, get_group_size, get_rank

__all__ = [
    "ASCEND",
    "CPU",
    "GPU",
    "ALLTOALL_NATIVE",
    "ALLTOALL_ALLGATHER_EMULATION",
    "ALLTOALL_ALLREDUCE_EMULATION",
    "ALLTOALL_IMPLS",
    "device_target",
    "use_device",
    "is_ascend",
    "alltoall_impl",
    "GMM_NATIVE",
    "GMM_AOT",
    "GMM_OPS",
    "grouped_matmul_impl",
    "COUNTED_NATIVE",
    "COUNTED_BLOCK_EMULATION",
    "counted_alltoall_impl",
    "world_group",
    "group_size",
    "group_rank",
    "recompile_on_next_call",
]

ASCEND = "Ascend"
CPU = "CPU"
GPU = "GPU"

# All-to-All implementations (see ms_efficient.moe.alltoall.AllToAll).
ALLTOALL_NATIVE = "native"  # ops.AlltoAll: one collective, Ascend only
ALLTOALL_ALLGATHER_EMULATION = "allgather-emulation"  # AllGather + keep my column: exact
ALLTOALL_ALLREDUCE_EMULATION = "allreduce-emulation"  # AllReduce of zero-padded buffers: exact
ALLTOALL_IMPLS = (ALLTOALL_NATIVE, ALLTOALL_ALLGATHER_EMULATION, ALLTOALL_ALLREDUCE_EMULATION)

# Grouped matmul implementations (see ms_efficient.moe.grouped_matmul.GroupedMatmul).
GMM_NATIVE = "native"  # Ascend GroupedMatmul with a group list (untested here: no Ascend)
GMM_AOT = "aot"  # ops.Custom C++ kernel over OpenBLAS: CPU only (host code on host memory)
GMM_OPS = "ops"  # every expert on every row, masked: exact, E times the FLOPs; any target


# Count-driven AlltoAllV implementations (see ms_efficient.moe.counted_alltoall).
COUNTED_NATIVE = "native"  # ops.AlltoAllVC, counts as a Tensor: Ascend only
COUNTED_BLOCK_EMULATION = "block-emulation"  # the static blocks through AllToAllV: exact values


def device_target() -> str:
    """The MindSpore device target of this process: "Ascend", "CPU" or "GPU"."""
    return ms.get_context("device_target")


def use_device(target: str) -> None:
    """Run this process on ``target`` ("Ascend", "CPU", "GPU"). A no-op when it already is:
    MindSpore refuses ``set_device`` once a kernel has run, even to the same target, so a
    process that builds several networks (a benchmark, a test run) calls this every time."""
    if device_target() != target:
        ms.set_device(target)


def is_ascend(target: Optional[str] = None) -> bool:
    """True when `target` (default: this process's device target) is Ascend."""
    return (target or device_target()) == ASCEND


def alltoall_impl(target: Optional[str] = None, group: Optional[str] = None) -> str:
    """The All-to-All implementation for `group` on `target` (defaults: world group, this process).

    - ALLTOALL_NATIVE ("native") on Ascend, where ``ops.AlltoAll`` exists (MindSpore documents
      it for Ascend only);
    - elsewhere ALLTOALL_ALLGATHER_EMULATION ("allgather-emulation") on the world group, and
      ALLTOALL_ALLREDUCE_EMULATION ("allreduce-emulation") on any other group, because the CPU
      AllGather kernel raises "AllGather only support mccl_world_group on CPU" for named groups.
    Both emulations are exact; see ms_efficient.moe.alltoall.
    """
    if is_ascend(target):
        return ALLTOALL_NATIVE
    if group is None or group == world_group():
        return ALLTOALL_ALLGATHER_EMULATION
    return ALLTOALL_ALLREDUCE_EMULATION


def grouped_matmul_impl(target: Optional[str] = None) -> str:
    """The grouped matmul implementation on `target` (default: this process's device target):
    GMM_NATIVE on Ascend, GMM_AOT on CPU, GMM_OPS elsewhere (see the table above)."""
    target = target or device_target()
    if target == ASCEND:
        return GMM_NATIVE
    return GMM_AOT if target == CPU else GMM_OPS


def counted_alltoall_impl(target: Optional[str] = None) -> str:
    """The exchange of ``"counts"`` plans on `target` (default: this process's device target):
    COUNTED_NATIVE on Ascend (``ops.AlltoAllVC``: MindSpore 2.10 documents it for Ascend only,
    with ``send_count_matrix`` a Tensor, so the per-peer counts are data in GRAPH mode),
    COUNTED_BLOCK_EMULATION elsewhere (see the table above)."""
    return COUNTED_NATIVE if is_ascend(target) else COUNTED_BLOCK_EMULATION


def world_group() -> str:
    """Name of the world communication group of the initialised backend (e.g. "mccl_world_group")."""
    return GlobalComm.WORLD_COMM_GROUP


def group_size(group: Optional[str] = None) -> int:
    """Number of ranks in `group` (default: the world group); 1 before ``init()`` is called."""
    return get_group_size(group or world_group())


def group_rank(group: Optional[str] = None) -> int:
    """This process's rank inside `group` (default: the world group); 0 before ``init()``."""
    return get_rank(group or world_group())


def recompile_on_next_call(cell) -> None:
    """Make ``cell``'s next call in GRAPH_MODE compile a new graph from its current attributes.

    MindSpore keys a Cell's compiled graph by its phase, its creation time, its id and its
    argument shapes (``mindspore/graph/api.py``, ``_real_phase``), so a Python attribute changed
    after the first call (an MoE layer's capacities) is otherwise never seen by the running
    ``Model.train`` loop. There is no public call to drop the cache; the creation time is
    renewed here, the one place that touches this private field.
    """
    import time

    object.__setattr__(cell, "_create_time", time.time_ns())
