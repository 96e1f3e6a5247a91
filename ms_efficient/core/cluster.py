"""Cluster model used by every planner: devices, memory, peak FLOP/s and alpha-beta links.

A :class:`ClusterSpec` is ``nodes`` x ``devices_per_node`` identical devices, numbered
node-major (device ``d`` sits on node ``d // devices_per_node``), with three kinds of link:
``intra_link`` between devices of one node, ``inter_link`` between nodes (per device NIC) and
``host_link`` for host<->device copies (swap / offload). Units: bytes, seconds, FLOP/s.

A YAML ``cluster:`` section is read by :meth:`ClusterSpec.from_dict` in one of three forms::

    cluster: {preset: ascend910b-4x8}
    cluster: {preset: ascend910b-1x8, nodes: 2, inter_link: {bandwidth_Bps: 12.5e9}}
    cluster: {name: my-box, nodes: 1, devices_per_node: 4, device_memory_bytes: ..., ...}

The presets' figures are public vendor numbers or stated approximations, good for comparing
plans by ratio in the simulator; they are not measurements of any particular machine.
The flat collective formulas are in :mod:`ms_efficient.core.collectives` and re-exported here.
"""
from __future__ import annotations

import dataclasses
import math
import operator
from collections import Counter
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Dict, Mapping, Sequence, Tuple

import numpy as np

from ms_efficient.core.collectives import (COLLECTIVE_KINDS, LOCAL_LINK, Link, allgather_time_s,
                                           allreduce_time_s, alltoall_time_s, broadcast_time_s,
                                           hierarchical_collective_time_s, p2p_time_s,
                                           reduce_scatter_time_s)

__all__ = [
    "Link",
    "LOCAL_LINK",
    "ClusterSpec",
    "COLLECTIVE_KINDS",
    "PRESETS",
    "get_cluster",
    "for_ranks",
    "cluster_names",
    "p2p_time_s",
    "allreduce_time_s",
    "allgather_time_s",
    "reduce_scatter_time_s",
    "alltoall_time_s",
    "broadcast_time_s",
    "hierarchical_collective_time_s",
]

# MindSpore / NumPy spellings of the dtypes the presets list.
_DTYPE_ALIASES = {"float16": "fp16", "half": "fp16", "bfloat16": "bf16",
                  "float32": "fp32", "float": "fp32", "single": "fp32"}
_LINK_FIELDS = ("intra_link", "inter_link", "host_link")


def _fail(name: str, value: Any, allowed: str) -> None:
    raise ValueError(f"ClusterSpec '{name}' must be {allowed}, but got {value!r}.")


def _canonical_dtype(dtype: Any) -> str:
    key = str(dtype).lower()
    return _DTYPE_ALIASES.get(key, key)


def _as_device(device: Any, num_devices: int) -> int:
    try:
        index = operator.index(device)
    except TypeError:
        index = -1
    if isinstance(device, bool) or not 0 <= index < num_devices:
        raise ValueError(f"device id must be an integer in [0, {num_devices}), "
                         f"but got {device!r}.")
    return index


def _as_number(name: str, value: Any) -> Any:
    """YAML 1.1 reads ``64e9`` (no dot) as a string: accept numeric strings in from_dict."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            _fail(name, value, "a number")
    return value


@dataclass(frozen=True)
class ClusterSpec:
    """Devices, memory, compute and links of a homogeneous cluster.

    name: label used in reports and plan files.
    nodes: number of nodes (servers), >= 1.
    devices_per_node: accelerators per node, >= 1; devices are numbered node-major.
    device_memory_bytes: memory of one device, bytes (the full capacity; planners keep their
        own reserve for the framework and fragmentation).
    peak_flops: dense peak of one device per dtype, FLOP/s. Pass a mapping such as
        ``{"fp16": 313e12}``; it is stored as sorted ``(dtype, FLOP/s)`` pairs so the spec
        stays hashable. Read it with :meth:`peak_flops_for`.
    intra_link: link between two devices of one node.
    inter_link: link between devices on different nodes, per device NIC.
    host_link: host<->device copy link of one device (swap-out / prefetch).
    compute_efficiency: fraction of peak FLOP/s a well-tuned kernel reaches (MFU-like),
        in (0, 1]; :meth:`compute_time_s` divides by ``peak * compute_efficiency``. 1.0 keeps
        the raw peak, which is enough when plans are compared by ratio.
    matmul_tile_rows: rows of the matrix unit's tile, >= 1: a matmul over m rows computes
        ceil(m / tile) * tile of them, which is how a grouped matmul's efficiency depends
        on its group sizes (a group of 3 rows costs a whole tile). Ascend's Da Vinci cube
        unit multiplies 16 x 16 fp16 fractals (Liao et al., "Ascend: a Scalable and Unified
        Architecture for Ubiquitous Deep Neural Network Computing", HPCA 2021, sec. 3), so
        16 by default; 1 models no tile loss.
    hbm_bandwidth_Bps: device memory bandwidth, bytes/s, or None (no limit): a kernel that
        moves B bytes takes at least B / hbm_bandwidth_Bps (:meth:`memory_time_s`), the
        roofline's memory side; the MoE cost model charges each expert GEMM the larger of
        its compute and memory times.
    op_launch_s: seconds one launched kernel of a kernel-by-kernel graph costs beyond its
        work (launch and its share of stream synchronisation), or None (not modelled: the
        target runs such work as one compiled host kernel, e.g. the CPU's aot ops). What a
        chain of many tiny kernels costs: the MoE cost model charges the fast level's
        MindSpore-ops twin its launched-kernel count times this
        (:meth:`~ms_efficient.efficientmoe.cost.CostModel.fast_level_time_L`).
    """

    name: str
    nodes: int
    devices_per_node: int
    device_memory_bytes: int
    peak_flops: Tuple[Tuple[str, float], ...]
    intra_link: Link
    inter_link: Link
    host_link: Link
    compute_efficiency: float = 1.0
    matmul_tile_rows: int = 16
    hbm_bandwidth_Bps: Any = None
    op_launch_s: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            _fail("name", self.name, "a non-empty string")
        for name in ("nodes", "devices_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                _fail(name, value, "a positive integer")
        memory = self.device_memory_bytes
        if (isinstance(memory, bool) or not isinstance(memory, (int, float)) or not memory >= 1
                or math.isinf(memory) or memory != int(memory)):
            _fail("device_memory_bytes", memory, "a positive integer number of bytes")
        object.__setattr__(self, "device_memory_bytes", int(memory))
        object.__setattr__(self, "peak_flops", self._normalized_peak_flops(self.peak_flops))
        for name in _LINK_FIELDS:
            if not isinstance(getattr(self, name), Link):
                _fail(name, getattr(self, name), "a Link")
        eff = self.compute_efficiency
        if isinstance(eff, bool) or not isinstance(eff, (int, float)) or not 0 < eff <= 1:
            _fail("compute_efficiency", eff, "a number in (0, 1]")
        tile = self.matmul_tile_rows
        if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
            _fail("matmul_tile_rows", tile, "a positive integer")
        hbm = self.hbm_bandwidth_Bps
        if hbm is not None and (isinstance(hbm, bool) or not isinstance(hbm, (int, float))
                                or not 0 < hbm < math.inf):
            _fail("hbm_bandwidth_Bps", hbm, "a positive finite number of bytes/s or null")
        launch = self.op_launch_s
        if launch is not None and (isinstance(launch, bool)
                                   or not isinstance(launch, (int, float))
                                   or not 0 <= launch < math.inf):
            _fail("op_launch_s", launch, "a finite number of seconds >= 0 or null")

    def memory_time_s(self, nbytes) -> Any:
        """Seconds to move ``nbytes`` (a number or an array) through device memory:
        nbytes / hbm_bandwidth_Bps, 0 without a bandwidth."""
        if self.hbm_bandwidth_Bps is None:
            return np.zeros_like(np.asarray(nbytes, dtype=np.float64))
        return np.asarray(nbytes, dtype=np.float64) / self.hbm_bandwidth_Bps

    def tiled_rows(self, rows):
        """Rows a matmul over ``rows`` (an int or an int array) computes:
        ceil(rows / matmul_tile_rows) * matmul_tile_rows, 0 for 0."""
        tile = self.matmul_tile_rows
        return -(-np.asarray(rows, dtype=np.int64) // tile) * tile

    @staticmethod
    def _normalized_peak_flops(peak: Any) -> Tuple[Tuple[str, float], ...]:
        try:
            pairs = list(peak.items() if isinstance(peak, Mapping) else peak)
        except TypeError:
            pairs = None
        if not pairs or any(not isinstance(p, (tuple, list)) or len(p) != 2 for p in pairs):
            _fail("peak_flops", peak, "a non-empty mapping of dtype name to FLOP/s")
        normalized: Dict[str, float] = {}
        for dtype, flops in pairs:
            key = _canonical_dtype(dtype)
            if key in normalized:
                _fail("peak_flops", peak, f"free of duplicate dtypes ('{key}' twice)")
            if (isinstance(flops, bool) or not isinstance(flops, (int, float))
                    or not 0 < flops < math.inf):
                _fail(f"peak_flops.{key}", flops, "a positive finite number of FLOP/s")
            normalized[key] = float(flops)
        return tuple(sorted(normalized.items()))

    # ---- devices and links ------------------------------------------------------------------

    @property
    def num_devices(self) -> int:
        """Total number of devices, ``nodes * devices_per_node``."""
        return self.nodes * self.devices_per_node

    def node_of(self, device: int) -> int:
        """Node index of a device id in ``[0, num_devices)``."""
        return _as_device(device, self.num_devices) // self.devices_per_node

    def node_devices(self, node: int) -> range:
        """Device ids on node ``node``."""
        if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < self.nodes:
            raise ValueError(f"node must be an integer in [0, {self.nodes}), but got {node!r}.")
        return range(node * self.devices_per_node, (node + 1) * self.devices_per_node)

    def link_between(self, a: int, b: int) -> Link:
        """Link from device ``a`` to device ``b``: ``LOCAL_LINK`` (free) when ``a == b``,
        ``intra_link`` on one node, ``inter_link`` across nodes."""
        if _as_device(a, self.num_devices) == _as_device(b, self.num_devices):
            return LOCAL_LINK
        return self.intra_link if self.node_of(a) == self.node_of(b) else self.inter_link

    def transfer_time_s(self, nbytes: float, src: int, dst: int) -> float:
        """Seconds to send ``nbytes`` bytes from device ``src`` to device ``dst``."""
        return p2p_time_s(nbytes, self.link_between(src, dst))

    # ---- compute ----------------------------------------------------------------------------

    def peak_flops_for(self, dtype: Any = "fp16") -> float:
        """Peak FLOP/s of one device for ``dtype`` ("fp16", "bf16", "fp32", or the
        MindSpore/NumPy names "float16", "bfloat16", "float32")."""
        key = _canonical_dtype(dtype)
        table = dict(self.peak_flops)
        if key not in table:
            raise ValueError(f"ClusterSpec '{self.name}' has no peak FLOP/s for dtype "
                             f"{dtype!r}; known dtypes are {sorted(table)}.")
        return table[key]

    def compute_time_s(self, flops: float, dtype: Any = "fp16") -> float:
        """Seconds for one device to do ``flops`` FLOP in ``dtype``:
        ``flops / (peak_flops_for(dtype) * compute_efficiency)``."""
        if isinstance(flops, bool) or not isinstance(flops, (int, float)) or not flops >= 0:
            raise ValueError(f"'flops' must be a number >= 0, but got {flops!r}.")
        return flops / (self.peak_flops_for(dtype) * self.compute_efficiency)

    # ---- collectives ------------------------------------------------------------------------

    def collective_time_s(self, kind: str, nbytes: float, devices: Sequence[int]) -> float:
        """Seconds for a collective of ``kind`` over the distinct device ids ``devices``.

        ``nbytes`` follows the per-rank convention of :mod:`ms_efficient.core.collectives`
        (all-reduce: the tensor; all-gather: output size; reduce-scatter: input size;
        all-to-all: all one rank sends, own share included). Devices on one node use the
        flat formula over ``intra_link``; groups spanning nodes use the hierarchical model of
        :func:`ms_efficient.core.collectives.hierarchical_collective_time_s` (intra_link inside
        nodes, inter_link between them).
        """
        ids = [_as_device(d, self.num_devices) for d in devices]
        if not ids or len(set(ids)) != len(ids):
            raise ValueError(f"'devices' must be a non-empty list of distinct device ids, "
                             f"but got {list(devices)!r}.")
        ranks_per_node = list(Counter(i // self.devices_per_node for i in ids).values())
        return hierarchical_collective_time_s(kind, nbytes, ranks_per_node,
                                              self.intra_link, self.inter_link)

    # ---- (de)serialisation ------------------------------------------------------------------

    def to_dict(self) -> Dict[str, Any]:
        """Plain dict (YAML/JSON-ready) holding every field; ``from_dict`` reads it back."""
        out: Dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["peak_flops"] = dict(self.peak_flops)
        for name in _LINK_FIELDS:
            out[name] = dataclasses.asdict(getattr(self, name))
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ClusterSpec":
        """Build a spec from a YAML ``cluster:`` mapping.

        ``{preset: NAME}`` is the preset; extra keys override its fields, and the nested
        mappings (``peak_flops``, ``*_link``) update the preset's entries key by key, so
        ``{preset: ascend910b-1x8, inter_link: {bandwidth_Bps: 12.5e9}}`` keeps the latency.
        The preset's ``name`` is kept unless ``name`` is given.
        Without ``preset`` every field except ``compute_efficiency``, ``matmul_tile_rows``,
        ``hbm_bandwidth_Bps`` and ``op_launch_s`` is required.
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"cluster config must be a mapping, but got {d!r}.")
        field_names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(field_names) - {"preset"})
        if unknown:
            raise ValueError(f"cluster config has unknown keys {unknown}; allowed keys are "
                             f"{['preset'] + field_names}.")
        given = {k: v for k, v in d.items() if k != "preset"}
        if "preset" in d:
            merged = get_cluster(d["preset"]).to_dict()
        else:
            merged = {}
            missing = [f.name for f in dataclasses.fields(cls)
                       if f.name not in given and f.default is dataclasses.MISSING]
            if missing:
                raise ValueError(f"cluster config without 'preset' must give {missing}.")
        for key, value in given.items():
            if key == "peak_flops" and isinstance(value, Mapping):
                value = {_canonical_dtype(k): _as_number(f"peak_flops.{k}", v)
                         for k, v in value.items()}
            if key in _LINK_FIELDS and isinstance(value, Mapping):
                bad = sorted(set(value) - {"latency_s", "bandwidth_Bps"})
                if bad:
                    raise ValueError(f"cluster config '{key}' has unknown keys {bad}; allowed "
                                     f"keys are ['latency_s', 'bandwidth_Bps'].")
                value = {k: _as_number(f"{key}.{k}", v) for k, v in value.items()}
            if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
                value = {**merged[key], **value}
            elif key in ("device_memory_bytes", "compute_efficiency") or (
                    key in ("hbm_bandwidth_Bps", "op_launch_s") and value is not None):
                value = _as_number(key, value)
            merged[key] = value
        for key in _LINK_FIELDS:
            link = merged[key]
            if isinstance(link, Mapping):
                if set(link) != {"latency_s", "bandwidth_Bps"}:
                    _fail(key, dict(link), "a mapping with 'latency_s' and 'bandwidth_Bps'")
                try:
                    merged[key] = Link(**link)
                except ValueError as err:
                    raise ValueError(f"ClusterSpec '{key}': {err}") from None
        return cls(**merged)

    def with_overrides(self, **overrides: Any) -> "ClusterSpec":
        """A copy with some fields replaced (``dataclasses.replace``), validated again.

        Values are field values: ints, floats, ``Link`` objects, a dtype->FLOP/s mapping.
        """
        field_names = [f.name for f in dataclasses.fields(self)]
        unknown = sorted(set(overrides) - set(field_names))
        if unknown:
            raise ValueError(f"ClusterSpec has no fields {unknown}; fields are {field_names}.")
        return dataclasses.replace(self, **overrides)


# ---- presets --------------------------------------------------------------------------------

_GiB = 2**30

# cpu-local: this build machine, a 2-core x86 VM running 2 msrun workers ("devices") on
# loopback. Every figure is rough, for smoke tests of the planners, not for conclusions.
_CPU_LOCAL = ClusterSpec(
    name="cpu-local",
    nodes=1,
    devices_per_node=2,  # one msrun worker per core
    device_memory_bytes=8 * _GiB,  # each worker's share of ~23 GiB host RAM, rounded down
    # 1 core x 2.6e9 Hz (lscpu BogoMIPS / 2) x 32 fp32 FLOP/cycle (AVX2: 2 FMA ports x 8 lanes
    # x 2 FLOP) = 83.2 GFLOP/s per worker; an upper bound (the CPU also has AVX-512, MindSpore's
    # CPU kernels reach far less). CPU fp16/bf16 kernels compute in fp32: same figure.
    peak_flops={"fp32": 83.2e9, "fp16": 83.2e9, "bf16": 83.2e9},
    # TCP loopback between worker processes: ~50 us per message, ~2 GB/s (rough order of
    # magnitude, not measured). Single node, so inter_link is never used; kept equal.
    intra_link=Link(latency_s=50e-6, bandwidth_Bps=2e9),
    inter_link=Link(latency_s=50e-6, bandwidth_Bps=2e9),
    # "Host" and "device" memory are the same DRAM: a memcpy, ~1 us + ~10 GB/s (rough).
    host_link=Link(latency_s=1e-6, bandwidth_Bps=10e9),
    # no matrix unit: the CPU kernels' register blocks are a few rows, not modelled
    matmul_tile_rows=1,
)


def _ascend910b(nodes: int) -> ClusterSpec:
    """Atlas 800T A2 training servers: 8 x Ascend 910B per node."""
    return ClusterSpec(
        name=f"ascend910b-{nodes}x8",
        nodes=nodes,
        devices_per_node=8,  # Atlas 800T A2 spec sheet: 8 Ascend 910B NPUs per server
        device_memory_bytes=64 * _GiB,  # 64 GB HBM2e per 910B (Atlas 800T A2 spec sheet)
        peak_flops={
            # Dense fp16 cube peak, approx., public spec sheet: ~313 TFLOP/s (figures of
            # ~280-376 TFLOP/s are quoted for the 910B SKUs B1..B4; 313 is the mid value).
            "fp16": 313e12,
            "bf16": 313e12,  # same cube rate as fp16 (approx., public spec sheet)
            # Assumption, not a spec-sheet figure: fp32 (HF32 / vector path) at 1/4 of fp16.
            "fp32": 313e12 / 4,
        },
        # HCCS full mesh: each 910B has 7 links of ~56 GB/s, one per peer, 392 GB/s per chip
        # in total (approx., Huawei Atlas 800T A2 / Ascend 910B public material). HCCL's Mesh
        # algorithm drives all 7 at once, so one device's effective bandwidth in the ring
        # formulas is the aggregate; we read 392 GB/s as a two-direction sum (as NVIDIA's
        # 900 GB/s NVLink figure is) and use 196 GB/s per direction. Approximation.
        # alpha ~5 us per HCCL step (approx., order of magnitude).
        intra_link=Link(latency_s=5e-6, bandwidth_Bps=196e9),
        # One 200GE RoCE v2 port per NPU (Atlas 800T A2 spec sheet: 8 x 200GE):
        # 200 Gb/s = 25 GB/s per direction, line rate (an upper bound). alpha ~10 us with a
        # switch hop (approx.).
        inter_link=Link(latency_s=10e-6, bandwidth_Bps=25e9),
        # PCIe 4.0 x16 to the Kunpeng 920 host: 16 GT/s x 16 lanes x 128/130 / 8 = 31.5 GB/s
        # per direction (PCI-SIG PCIe 4.0 base spec), line rate; alpha ~10 us per DMA (approx.).
        host_link=Link(latency_s=10e-6, bandwidth_Bps=31.5e9),
        # What a real MoE training run reaches on 910B-class NPUs: Pangu Ultra MoE (718B
        # parameters, 6K Ascend NPUs) reports an MFU of 30.0% (Pangu Team, "Pangu Ultra
        # MoE: How to Train Your Big MoE on Ascend NPUs", arXiv 2505.04519, 2025, abstract).
        # MFU counts the whole step, communication stalls included, so charging every
        # kernel at 30% of peak over-charges compute; that shrinks the All-to-All's share
        # of a step, which works against a planner whose gains are in the All-to-All.
        compute_efficiency=0.30,
        # HBM2e per 910B: ~1.6 TB/s (approx., public material; the 910's HBM2 gives
        # 1.2 TB/s). Only the memory side of the expert GEMMs' roofline reads it.
        hbm_bandwidth_Bps=1.6e12,
        # One small vector kernel (gelu / relu / sigmoid of 256-16384 elements) launched and
        # its stream synchronised on an Ascend 910B3, CANN 8.5: 0.019-0.031 ms wall-clock,
        # median of 10 (ascend-rs, "Appendix F: Performance Benchmarks", ascend-rs.org); the
        # smallest is taken. It includes one synchronisation per kernel: chained kernels
        # without one may cost less each, while a loop whose condition is a tensor pays a
        # device-to-host read every iteration. Not measured here (no Ascend hardware).
        op_launch_s=19e-6,
    )


# Read-only registry name -> spec (specs are frozen, the mapping is a read-only view).
PRESETS: Mapping[str, ClusterSpec] = MappingProxyType(
    {spec.name: spec for spec in (_CPU_LOCAL, _ascend910b(1), _ascend910b(4), _ascend910b(16))}
)


def cluster_names() -> Tuple[str, ...]:
    """Names of the presets, in registration order."""
    return tuple(PRESETS)


def for_ranks(spec: ClusterSpec, world: int) -> ClusterSpec:
    """``spec`` for a job of ``world`` ranks, one per device: ``cpu-local`` (this machine, one
    node) grows to ``world`` devices on its node; any other cluster is returned as it is (the
    caller refuses one with fewer devices, naming its own fields)."""
    if spec.name == "cpu-local" and spec.nodes == 1 and spec.num_devices < world:
        return spec.with_overrides(devices_per_node=world)
    return spec


def get_cluster(name: str) -> ClusterSpec:
    """The preset called ``name``; an unknown name raises ``ValueError`` listing the known ones."""
    if not isinstance(name, str) or name not in PRESETS:
        raise ValueError(f"cluster 'preset' must be one of {list(PRESETS)}, but got {name!r}.")
    return PRESETS[name]
