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
    runtime_conf()    as given   CPU: adds                 MindSpore's graph pipeline runs a
                                 "graph_pipeline:False"    step's graph on a queue thread while
                                 to MS_DEV_RUNTIME_CONF    the Python thread that waits for its
                                                           outputs spins (a loop with no sleep),
                                                           a core per rank; CPU ranks share the
                                                           host's cores, so the spinning takes
                                                           them from the ranks that compute. Off:
                                                           the same steps, a fifth (2 ranks) to
                                                           30 % (4) less CPU, sooner done
                                                           (scripts/time_test_compiles.py). The
                                                           one-process ``train()`` sets it in
                                                           its own process
                                                           (``set_runtime_conf``): the same
                                                           losses, about a third less CPU on
                                                           2 cores.

Add a new choice as a function ``<thing>_impl(device_target=None) -> str`` that returns one of a
few documented string constants, and list it in the table above.
"""
import os
from typing import Optional

# MindSpore is imported by the functions that ask it, so that the msrun launcher (which only
# needs runtime_conf) starts without it.

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
    "RUNTIME_CONF_ENV",
    "runtime_conf",
    "set_runtime_conf",
    "run_json_child",
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
    import mindspore as ms

    return ms.get_context("device_target")


def use_device(target: str) -> None:
    """Run this process on ``target`` ("Ascend", "CPU", "GPU"). A no-op when it already is:
    MindSpore refuses ``set_device`` once a kernel has run, even to the same target, so a
    process that builds several networks (a benchmark, a test run) calls this every time."""
    if device_target() != target:
        import mindspore as ms

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


RUNTIME_CONF_ENV = "MS_DEV_RUNTIME_CONF"     # MindSpore reads it once, at its first use


def runtime_conf(target: str, conf: Optional[str] = None) -> str:
    """The ``MS_DEV_RUNTIME_CONF`` value for processes on ``target``, from ``conf`` (default:
    this process's environment): on CPU ``conf`` with ``graph_pipeline:False`` added, unless
    it names ``graph_pipeline`` itself (the user's choice stands); elsewhere ``conf`` as it
    is. "key:value" items, comma-separated, as MindSpore parses them. Set it in the
    environment of the worker processes before they start (``train --workers`` does):
    MindSpore reads the variable once per process."""
    conf = os.environ.get(RUNTIME_CONF_ENV, "") if conf is None else conf
    if target != CPU:
        return conf
    keys = {item.split(":", 1)[0].strip() for item in conf.split(",") if ":" in item}
    if "graph_pipeline" in keys:
        return conf
    return ",".join(item for item in (conf.strip(", "), "graph_pipeline:False") if item)


def set_runtime_conf(target: str) -> str:
    """Set ``MS_DEV_RUNTIME_CONF`` in this process's environment to ``runtime_conf(target)``
    and return it ("" leaves the variable as it is). MindSpore reads the variable once, when
    its runtime starts (the process's first op or graph), so a process's entry point calls
    this before any MindSpore op (the one-process ``train.trainer.train`` does); called later,
    it changes only what the process's children inherit."""
    conf = runtime_conf(target)
    if conf:
        os.environ[RUNTIME_CONF_ENV] = conf
    return conf


def world_group() -> str:
    """Name of the world communication group of the initialised backend (e.g. "mccl_world_group")."""
    from mindspore.communication import GlobalComm

    return GlobalComm.WORLD_COMM_GROUP


def group_size(group: Optional[str] = None) -> int:
    """Number of ranks in `group` (default: the world group); 1 before ``init()`` is called."""
    from mindspore.communication import get_group_size

    return get_group_size(group or world_group())


def group_rank(group: Optional[str] = None) -> int:
    """This process's rank inside `group` (default: the world group); 0 before ``init()``."""
    from mindspore.communication import get_rank

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


def run_json_child(module: str, arg: str, target: str, timeout_s: float, what: str,
                   extra_env: Optional[dict] = None) -> dict:
    """Run ``python -m module arg`` in a fresh process and return the JSON object of the last
    line it prints that starts with "{" (the measurement children of ``bench moe`` and
    memopt: each run's graphs, buffers and allocator pool end with its process). The child
    gets this environment with the package's folder first on PYTHONPATH, ``extra_env``, and
    MindSpore's graph pipeline as :func:`runtime_conf` sets it for ``target`` (off on CPU, as
    ``train`` runs). RuntimeError naming ``what`` with the child's stderr tail if it exits
    non-zero or prints no such line; subprocess.TimeoutExpired after ``timeout_s``."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p), **(extra_env or {}))
    env[RUNTIME_CONF_ENV] = runtime_conf(target, env.get(RUNTIME_CONF_ENV, ""))
    proc = subprocess.run([sys.executable, "-m", module, arg], capture_output=True, text=True,
                          timeout=timeout_s, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{what} failed (rc={proc.returncode}): "
                           f"{proc.stderr.strip()[-3000:]}")
    return json.loads(lines[-1])
