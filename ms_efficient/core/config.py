"""Typed run configuration loaded from YAML, validated once where it is built.

A config file has MindFormers-like sections; every section is optional and falls back to the
defaults below::

    context:  {mode: GRAPH_MODE, device_target: CPU, seed: 1234}
    model:    {vocab_size: 256, seq_length: 128, hidden_size: 256, num_layers: 4, ...}
    moe:      {num_experts: 8, top_k: 2, capacity_factor: 1.25, dispatch: static, ...}
    efficientmoe: {enabled: false, replan_every: 25, ...}   # the slow level of an expert-parallel run
    data:     {path: stdlib, val_fraction: 0.05, ...}
    train:    {steps: 300, batch_size: 16, learning_rate: 1.0e-3, ...}
    cluster:  {preset: cpu-local}           # or a preset plus overrides, see cluster.py
    optimize: {passes: []}                  # passes run by ms_efficient.optimize

Unknown keys, wrong types and out-of-range values raise ``ValueError`` naming the key path,
the bad value and what is allowed, e.g.
``"moe.top_k must be <= moe.num_experts (8), but got 9."``.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import yaml

from ms_efficient.core.fileio import atomic_write_text
from ms_efficient.core.registry import known_pass_names
from ms_efficient.core.units import parse_budget

logger = logging.getLogger(__name__)

__all__ = [
    "history_trace_path",
    "DISPATCH_NAMES",
    "EXPERT_PARALLEL_DISPATCH",
    "check_dispatch",
    "ContextConfig",
    "ModelConfig",
    "MoEConfig",
    "EfficientMoEConfig",
    "DataConfig",
    "TrainConfig",
    "OptimizeConfig",
    "RunConfig",
    "load_config",
    "config_from_dict",
    "save_config",
    "read_yaml",
]


def history_trace_path(path: str) -> str:
    """``efficientmoe.history`` as a file: a run folder means its ``trace.npz``."""
    return os.path.join(path, "trace.npz") if os.path.isdir(path) else path


# `moe.dispatch`: how tokens reach the experts (MoEConfig's comments). The expert-parallel
# trainer runs "balanced"; the one-process trainer "static" and "grouped" ("balanced" runs as
# "grouped" there: MoEConfig.layer_dispatch).
DISPATCH_NAMES = ("static", "grouped", "balanced")
FAST_LEVEL_IMPLS = ("auto", "host", "aot", "ops")   # ms_efficient.moe.fast_level's twins
EXPERT_PARALLEL_DISPATCH = ("balanced",)


def check_dispatch(cfg: "RunConfig", expert_parallel: bool) -> None:
    """ValueError naming the field unless ``cfg.moe.dispatch`` suits the run: an
    expert-parallel run (``train --workers W``, its workers) needs "balanced" (EfficientMoE's
    two levels, the one expert-parallel layer); a one-process run cannot have
    ``efficientmoe.enabled`` (EfficientMoE places experts over devices, and one process has
    one)."""
    dispatch = cfg.moe.dispatch
    if expert_parallel and dispatch not in EXPERT_PARALLEL_DISPATCH:
        _fail("moe.dispatch", dispatch,
              "'balanced' for an expert-parallel run (train --workers W: EfficientMoE's two "
              "levels over the ranks); 'static' and 'grouped' are one-process dispatches")
    if not expert_parallel and cfg.efficientmoe.enabled:
        _fail("efficientmoe.enabled", True,
              "false for a one-process run (EfficientMoE places experts over the ranks of "
              "an expert-parallel run, train --workers W; one device has nothing to place. "
              "Run it with --efficientmoe off: moe.dispatch 'grouped' computes every routed "
              "row without padding or drops, and the efficientmoe pass sizes 'static' "
              "capacities from a recorded trace)")


def _fail(path: str, value: Any, allowed: str) -> None:
    raise ValueError(f"'{path}' must be {allowed}, but got {value!r}.")


@dataclass
class ContextConfig:
    # GRAPH_MODE compiles one static graph per step shape: the fast path and the one Ascend uses.
    mode: str = "GRAPH_MODE"
    device_target: str = "CPU"
    seed: int = 1234

    def validate(self, path: str) -> None:
        if self.mode not in ("GRAPH_MODE", "PYNATIVE_MODE"):
            _fail(f"{path}.mode", self.mode, "one of ['GRAPH_MODE', 'PYNATIVE_MODE']")
        if self.device_target not in ("CPU", "Ascend", "GPU"):
            _fail(f"{path}.device_target", self.device_target, "one of ['CPU', 'Ascend', 'GPU']")
        if self.seed < 0:
            _fail(f"{path}.seed", self.seed, ">= 0")


@dataclass
class ModelConfig:
    # Byte-level vocabulary: any text file works, no tokenizer download needed.
    vocab_size: int = 256
    # 128 bytes of context is enough for the model to learn Python syntax locally.
    seq_length: int = 128
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    # Per-expert FFN width; with top-2 of 8 experts each token sees 2 x 512 hidden units.
    ffn_hidden_size: int = 512
    dropout: float = 0.0
    dtype: str = "float32"

    def validate(self, path: str) -> None:
        for name in ("vocab_size", "seq_length", "hidden_size", "num_layers", "num_heads",
                     "ffn_hidden_size"):
            if getattr(self, name) < 1:
                _fail(f"{path}.{name}", getattr(self, name), "a positive integer")
        if self.hidden_size % self.num_heads:
            _fail(f"{path}.hidden_size", self.hidden_size,
                  f"a multiple of {path}.num_heads ({self.num_heads})")
        if not 0.0 <= self.dropout < 1.0:            # (nan fails every comparison)
            _fail(f"{path}.dropout", self.dropout, "in [0, 1)")
        if self.dtype not in ("float32", "float16", "bfloat16"):
            _fail(f"{path}.dtype", self.dtype, "one of ['float32', 'float16', 'bfloat16']")


@dataclass
class MoEConfig:
    num_experts: int = 8
    top_k: int = 2
    # Slots per expert = ceil(capacity_factor * tokens * top_k / num_experts); 0 means dropless
    # (capacity = tokens, every expert can take every token).
    capacity_factor: float = 1.25
    # Switch-Transformer load-balancing loss weight (Fedus et al. 2021 use 1e-2).
    aux_loss_coef: float = 0.01
    # Every `moe_every`-th block has an MoE FFN, the others a dense FFN (1 = all MoE).
    moe_every: int = 1
    # Capacities are rounded up to a multiple of this (hardware-friendly tile size).
    capacity_multiple: int = 1
    # The batch's tokens are recorded as this many groups ("source ranks") in the routing
    # trace, as data-parallel ranks would each see batch_size / trace_ranks samples.
    trace_ranks: int = 1
    # How tokens reach the experts (DISPATCH_NAMES; `plan moe --dispatch` takes the same
    # names):
    #   "static"   per-expert capacities (capacity_factor; padded, may drop; EfficientMoE
    #              plans them when enabled). One-process runs only.
    #   "grouped"  rows permuted by expert, each expert on its own rows (grouped matmul, no
    #              padding). One process: no capacity, no drops (moe.layer module doc).
    #   "balanced" `train --workers W`: EfficientMoE's two levels (BalancedExpertParallelMoE):
    #              a fixed layout (home experts, slots_per_device minus ceil(E / W) spare
    #              slots, receive buffers) balanced every step from that step's exact counts,
    #              hot experts copied into spare slots. The one expert-parallel dispatch.
    # One process has no exchange, so "balanced" runs there as "grouped" (the same rows;
    # `layer_dispatch`). Fixed for a run: each is a different graph.
    dispatch: str = "static"
    # Expert-parallel runs (`ms-efficient train --workers W`): weight slots every rank compiles
    # for its experts, ceil(num_experts / W) home slots and the rest spare slots for the fast
    # level's per-step copies; 0 = ceil(num_experts / W) + 1, one spare slot.
    slots_per_device: int = 0
    # moe.dispatch "balanced": how the fast level runs inside the compiled step
    # (FAST_LEVEL_IMPLS): "host" the numpy function as a host op (CPU only), "aot" the same
    # compiled in C++ (CPU only), "ops" its MindSpore-ops twin (any target); all give equal
    # tables. "auto": aot on CPU (host when g++ cannot build it), ops elsewhere.
    fast_level: str = "auto"
    # The experts' FFN: "mlp" w2(gelu(x w1)), or "glu" gated w2(silu(x w_gate) * (x w_up))
    # (SwiGLU, as Mixtral, Qwen-MoE and DeepSeek; moe.activations.EXPERT_KINDS).
    expert_kind: str = "mlp"
    # Shared experts every token passes through (DeepSeekMoE), each of the routed experts'
    # width, as one dense FFN of expert_kind added to the routed output; 0 = none.
    shared_experts: int = 0

    def validate(self, path: str) -> None:
        if self.expert_kind not in ("mlp", "glu"):
            _fail(f"{path}.expert_kind", self.expert_kind, "one of ['mlp', 'glu']")
        if self.shared_experts < 0:
            _fail(f"{path}.shared_experts", self.shared_experts, ">= 0 (0 = none)")
        if self.slots_per_device < 0:
            _fail(f"{path}.slots_per_device", self.slots_per_device, ">= 0 (0 = automatic)")
        if self.fast_level not in FAST_LEVEL_IMPLS:
            _fail(f"{path}.fast_level", self.fast_level, f"one of {list(FAST_LEVEL_IMPLS)}")
        if self.dispatch not in DISPATCH_NAMES:
            _fail(f"{path}.dispatch", self.dispatch, f"one of {list(DISPATCH_NAMES)}")
        if self.num_experts < 1:
            _fail(f"{path}.num_experts", self.num_experts, "a positive integer")
        if not 1 <= self.top_k <= self.num_experts:
            _fail(f"{path}.top_k", self.top_k,
                  f"in [1, {path}.num_experts ({self.num_experts})]")
        if not (self.capacity_factor == 0 or 1.0 <= self.capacity_factor < math.inf):
            _fail(f"{path}.capacity_factor", self.capacity_factor, ">= 1.0, or 0 for dropless")
        if not 0 <= self.aux_loss_coef < math.inf:
            _fail(f"{path}.aux_loss_coef", self.aux_loss_coef, "a finite number >= 0")
        if self.moe_every < 1:
            _fail(f"{path}.moe_every", self.moe_every, "a positive integer")
        if self.capacity_multiple < 1:
            _fail(f"{path}.capacity_multiple", self.capacity_multiple, "a positive integer")
        if self.trace_ranks < 1:
            _fail(f"{path}.trace_ranks", self.trace_ranks, "a positive integer")

    @property
    def layer_dispatch(self) -> str:
        """The dispatch of a one-process MoE layer (MoEFeedForward) for ``dispatch``: "static"
        stays "static"; "grouped" and "balanced" are "grouped" (one device has no exchange,
        so they compute the same rows, dropless)."""
        return "static" if self.dispatch == "static" else "grouped"


@dataclass
class EfficientMoEConfig:
    """EfficientMoE during an expert-parallel run (``enabled``, ``train --workers W`` with
    ``moe.dispatch`` "balanced"): the slow level re-places each layer's home experts when it
    pays (the fast level balances every step either way); no re-plan changes a compiled
    shape. A one-process run has one device and nothing to place: :func:`check_dispatch`
    refuses ``enabled`` there. ``history``, ``drop_target`` and ``capacity_multiple`` also
    serve the ``efficientmoe`` pass, which sizes a one-process network's "static" capacities
    from a recorded trace before compiling."""

    enabled: bool = False
    # Steps before the slow level's first check (the counts it plans from).
    warmup_steps: int = 20
    # A re-plan is considered every this many steps (and adopted only when it pays).
    replan_every: int = 25
    # Trace rows the slow level's forecast (their mean) and replays look at.
    window: int = 16
    # The efficientmoe pass: the share of a recorded trace's assignments its static
    # capacities may drop (the fewest rows that drop no more on that trace).
    drop_target: float = 0.005
    # Capacities are multiples of this many tokens (16x16 cube tiles on Ascend).
    capacity_multiple: int = 16
    # Routing history to plan from before the first step: a trace .npz (`bench moe --trace`
    # format) or a run folder holding trace.npz, e.g. the run these weights continue.
    # Expert-parallel runs price their receive buffers from it (efficientmoe.planner); the
    # efficientmoe pass sizes static capacities from it. "" = none.
    history: str = ""
    # Expert-parallel runs: adopt the slow level's home table after this many steps even when
    # the re-plan rule finds no gain worth it (0 = never force), so a short run shows a
    # re-plan.
    force_replan_step: int = 0
    # With `enabled`, a moe.dispatch "balanced" run also re-places its home experts during the
    # run (the slow level): every `replan_every` steps after `warmup_steps`, when the new home table's
    # modelled gain over the next `replan_every` steps pays for moving the changed experts'
    # weights and Adam moments (efficientmoe.planner.decide_home, the rule `bench moe`'s
    # `efficientmoe` row replays); no shape changes, no recompile. Without it the home table
    # is the first compile's for the whole run (`bench moe`'s `efficientmoe-fixed-home`).
    # moe.dispatch "balanced" runs: each device's receive buffer is its mean share x
    # (1 + buffer_slack), fixed at the first compile (no history trace); with `history`, priced from that trace
    # (efficientmoe.planner). Rows above every holder's buffer are dropped and counted.
    buffer_slack: float = 0.5

    def validate(self, path: str) -> None:
        if self.force_replan_step < 0:
            _fail(f"{path}.force_replan_step", self.force_replan_step, ">= 0 (0 = never)")
        if not 0.0 <= self.buffer_slack <= 64.0:
            _fail(f"{path}.buffer_slack", self.buffer_slack, "in [0, 64]")
        if not isinstance(self.history, str):
            _fail(f"{path}.history", self.history, "a path string or ''")
        if self.history and not os.path.isfile(history_trace_path(self.history)):
            _fail(f"{path}.history", self.history,
                  "a routing trace .npz or a run folder holding trace.npz")

        for name in ("warmup_steps", "replan_every", "window", "capacity_multiple"):
            if getattr(self, name) < 1:
                _fail(f"{path}.{name}", getattr(self, name), "a positive integer")
        if self.window < 3:
            _fail(f"{path}.window", self.window, ">= 3")
        if not 0.0 <= self.drop_target < 1.0:
            _fail(f"{path}.drop_target", self.drop_target, "in [0, 1)")


# efficientmoe keys of the retired one-process capacity planner: a run folder's saved config
# drops them when read (logged); a user's config naming one is refused with this reason
RETIRED_EFFICIENTMOE_KEYS = ("predictor", "max_block_drop_rate", "capacity_levels",
                             "recompile_cost_s", "max_forecast_error", "monitor_steps")


@dataclass
class DataConfig:
    # 'stdlib' = the .py sources of this Python's standard library: real text on every machine.
    path: str = "stdlib"
    # File name suffixes read when `path` is a folder.
    suffixes: List[str] = field(default_factory=lambda: [".py", ".txt", ".md"])
    # Cap on bytes read, so the demo starts in seconds; files are taken in sorted order.
    max_bytes: int = 8_000_000
    # Every file is assigned to validation by a hash of its relative path: deterministic.
    val_fraction: float = 0.05

    def validate(self, path: str) -> None:
        if not self.path:
            _fail(f"{path}.path", self.path, "'stdlib' or an existing file or folder")
        if self.path != "stdlib" and not os.path.exists(os.path.expanduser(self.path)):
            _fail(f"{path}.path", self.path, "'stdlib' or an existing file or folder")
        if self.max_bytes < 1024:
            _fail(f"{path}.max_bytes", self.max_bytes, ">= 1024")
        if not 0.0 < self.val_fraction < 0.5:
            _fail(f"{path}.val_fraction", self.val_fraction, "in (0, 0.5)")


@dataclass
class TrainConfig:
    steps: int = 300
    batch_size: int = 16
    learning_rate: float = 1.0e-3
    # Linear warm-up then cosine decay to 10% of the peak rate.
    warmup_steps: int = 20
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    log_every: int = 10
    eval_every: int = 50
    eval_batches: int = 8
    # A run killed with SIGKILL loses at most this many steps.
    save_every: int = 50
    out_dir: str = "runs/gpt_moe_tiny"

    def validate(self, path: str) -> None:
        for name in ("steps", "batch_size", "log_every", "eval_every", "eval_batches",
                     "save_every"):
            if getattr(self, name) < 1:
                _fail(f"{path}.{name}", getattr(self, name), "a positive integer")
        if not 0 < self.learning_rate < math.inf:
            _fail(f"{path}.learning_rate", self.learning_rate, "a finite number > 0")
        if self.warmup_steps < 0:
            _fail(f"{path}.warmup_steps", self.warmup_steps, ">= 0")
        if not 0 <= self.weight_decay < math.inf:
            _fail(f"{path}.weight_decay", self.weight_decay, "a finite number >= 0")
        if not 0 <= self.grad_clip < math.inf:
            _fail(f"{path}.grad_clip", self.grad_clip,
                  "a finite number >= 0 (0 disables clipping)")


@dataclass
class OptimizeConfig:
    # Names of passes to run, in order: the built-in ones or any registered with register_pass.
    passes: List[str] = field(default_factory=list)
    # Peak-memory budget per device for the memopt pass: bytes, a size such as "12GiB", or a
    # share such as "90%" of the network's unoptimised simulated peak. "" = the device memory
    # of the cluster (a network that fits it has nothing to plan, and the pass says so). Below
    # the feasible floor (often 65-95% of the peak) the pass raises naming the floor. Listed
    # after shard / place, memopt applies it per device share / per pipeline stage (a share
    # then of the largest stage's unoptimised peak: every device has the same memory).
    memory_budget: Any = ""
    # Glob patterns of the Cells memopt plans, e.g. ["model.layers.*.self_attn",
    # "model.layers.*.mlp"]; a glob matches within one level ("blocks.*" = blocks.0, blocks.1,
    # not blocks.0.attn); [] = the repeated blocks of every CellList / SequentialCell, or else
    # the Cells holding parameters of the network's largest CellList / SequentialCell.
    memopt_cells: List[str] = field(default_factory=list)
    # GPipe micro-batches per step the place pass plans pipeline stages for (MindSpore's
    # micro_batch_num); 0 = the pass chooses among the divisors of the batch (simulated).
    micro_batches: int = 0
    # Device mesh of the shard pass, "DPxMP" (dp strided over nodes, mp inside a node);
    # "" = the pass tries every factorisation of the cluster's devices and chooses.
    shard_mesh: str = ""
    # Communication budget of the shard pass: this many times the communication of data
    # parallelism with ZeRO-1 on the same graph and mesh (half the unoptimised simulated step
    # where the batch does not divide the devices); 0 = unconstrained (the least memory).
    shard_comm_ratio: float = 1.0
    # Where the shard pass writes MindSpore's strategy JSON (keyed by your Cells' primitives
    # and parameter names); "" = only in the returned plan.
    shard_strategy_file: str = ""

    def validate(self, path: str) -> None:
        known = known_pass_names()
        for i, name in enumerate(self.passes):
            if name not in known:
                _fail(f"{path}.passes[{i}]", name, f"one of {sorted(known)}")
        if len(set(self.passes)) != len(self.passes):
            _fail(f"{path}.passes", self.passes, "each pass at most once")
        if self.memory_budget != "":
            if isinstance(self.memory_budget, bool) or not isinstance(
                    self.memory_budget, (int, float, str)):
                _fail(f"{path}.memory_budget", self.memory_budget,
                      "bytes, a size such as 12GiB, or a share such as 50%")
            try:
                parse_budget(self.memory_budget, f"{path}.memory_budget")
            except ValueError as err:
                raise ValueError(str(err)) from None
        if self.micro_batches < 0:
            _fail(f"{path}.micro_batches", self.micro_batches,
                  "a positive integer, or 0 to let the place pass choose")
        for i, pattern in enumerate(self.memopt_cells):
            if not pattern.strip():
                _fail(f"{path}.memopt_cells[{i}]", pattern, "a non-empty glob pattern")
        if self.shard_mesh:
            parts = str(self.shard_mesh).lower().split("x")
            if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
                _fail(f"{path}.shard_mesh", self.shard_mesh,
                      "DPxMP with positive integers, e.g. 2x4")
        if isinstance(self.shard_comm_ratio, bool) or not self.shard_comm_ratio >= 0:
            _fail(f"{path}.shard_comm_ratio", self.shard_comm_ratio,
                  "a number >= 0 (0 = unconstrained)")


@dataclass
class RunConfig:
    context: ContextConfig = field(default_factory=ContextConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    efficientmoe: EfficientMoEConfig = field(default_factory=EfficientMoEConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    # Cluster section as given (a preset name plus overrides); resolved by cluster_spec().
    cluster: Dict[str, Any] = field(default_factory=lambda: {"preset": "cpu-local"})
    optimize: OptimizeConfig = field(default_factory=OptimizeConfig)

    def validate(self, path: str = "") -> None:
        if self.train.batch_size % self.moe.trace_ranks:
            _fail("train.batch_size", self.train.batch_size,
                  f"a multiple of moe.trace_ranks ({self.moe.trace_ranks})")
        self.cluster_spec()

    def cluster_spec(self):
        """The resolved :class:`~ms_efficient.core.cluster.ClusterSpec` of ``cluster``."""
        from ms_efficient.core.cluster import ClusterSpec

        try:
            return ClusterSpec.from_dict(self.cluster)
        except ValueError as err:
            raise ValueError(f"in section 'cluster': {err}") from None

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


def _check_type(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against the annotation ``tp``; ints are accepted where floats are."""
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _check_type(value, args[0], path)
    if origin in (list, List):
        if not isinstance(value, list):
            _fail(path, value, "a list")
        (item_tp,) = typing.get_args(tp)
        return [_check_type(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin in (dict, Dict):
        if not isinstance(value, dict):
            _fail(path, value, "a mapping")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            _fail(path, value, "a boolean (true/false)")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(path, value, "an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail(path, value, "a number")
        if not math.isfinite(value):                  # YAML .nan / .inf
            _fail(path, value, "a finite number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            _fail(path, value, "a string")
        return value
    return value


def _build(cls: type, data: Any, path: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        _fail(path or "config", data, "a mapping of keys to values")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    retired = [k for k in unknown if k in RETIRED_EFFICIENTMOE_KEYS]
    if path == "efficientmoe" and retired:
        raise ValueError(f"'efficientmoe.{retired[0]}' belonged to the retired one-process "
                         f"capacity planner (online per-expert capacities): remove it; "
                         f"allowed keys in 'efficientmoe': {names}.")
    if path == "efficientmoe" and "dispatch" in unknown:        # the key of older configs
        raise ValueError(f"'efficientmoe.dispatch' ({data['dispatch']!r}) is now "
                         f"'moe.dispatch', one of {list(DISPATCH_NAMES)} for every run: move "
                         f"it there (a config run both ways keeps moe.dispatch for its "
                         f"expert-parallel runs; one process runs 'balanced' as 'grouped').")
    if unknown:
        where = f"'{path}.{unknown[0]}'" if path else f"'{unknown[0]}'"
        raise ValueError(f"Unknown config key {where}; allowed keys"
                         f"{' in ' + repr(path) if path else ''}: {names}.")
    kwargs = {}
    for name in names:
        if name not in data:
            continue
        sub = f"{path}.{name}" if path else name
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, data[name], sub)
        else:
            kwargs[name] = _check_type(data[name], tp, sub)
    obj = cls(**kwargs)
    if hasattr(obj, "validate"):
        obj.validate(path or "")
    return obj


def config_from_dict(data: Dict[str, Any]) -> RunConfig:
    """Build and validate a :class:`RunConfig` from a plain mapping (e.g. parsed YAML)."""
    return _build(RunConfig, data, "")


def read_yaml(path: str, allow_empty: bool = True) -> Dict[str, Any]:
    """The mapping in YAML file ``path`` ({} for an empty file, or ValueError when
    ``allow_empty`` is False); clear errors otherwise."""
    if os.path.isdir(path):
        raise ValueError(f"Config file '{path}' is a folder, not a YAML file.")
    if not os.path.isfile(path):
        raise ValueError(f"Config file '{path}' does not exist.")
    with open(path, "r", encoding="utf-8") as fh:
        try:
            data = yaml.safe_load(fh)
        except yaml.YAMLError as err:
            reason = " ".join(str(err).split())            # one line
            raise ValueError(f"Config file '{path}' is not valid YAML: {reason}") from None
        except UnicodeDecodeError:
            raise ValueError(f"Config file '{path}' is binary, not YAML text (a MINDIR, "
                             f"checkpoint or trace given where a config belongs?).") from None
    if data is None or data == {}:
        if not allow_empty:
            raise ValueError(f"Config file '{path}' is empty: it must hold at least one "
                             f"section (context, model, moe, efficientmoe, data, train, "
                             f"cluster, optimize); an empty file would train on all defaults.")
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"Config file '{path}' must hold a mapping of sections, but got "
                         f"{type(data).__name__}.")
    return data


def _migrate_saved_config(data: Dict[str, Any], expert_parallel: bool, path: str) -> None:
    """A run folder's config.yaml saved before ``moe.dispatch`` named every run's dispatch
    holds ``efficientmoe.dispatch`` (the expert-parallel exchange) beside ``moe.dispatch``
    (the one-process layers): the run used the first if it was expert-parallel, the second
    otherwise. A folder of the retired one-level "counts" layer reads as "grouped" (the rows
    it computed; ``checkpoint export`` and a one-process resume read it so, and a
    ``--workers`` resume is refused: expert-parallel runs are "balanced"). The retired
    one-process capacity planner's keys (``RETIRED_EFFICIENTMOE_KEYS``) are dropped, and a
    one-process run that had it on resumes with it off (its capacities are in its
    checkpoints). Rewrites ``data`` in place."""
    section = data.get("efficientmoe")
    if isinstance(section, dict):
        retired = [k for k in RETIRED_EFFICIENTMOE_KEYS if section.pop(k, None) is not None]
        if retired:
            logger.info("%s: dropped the retired one-process planner's keys %s", path,
                        ["efficientmoe." + k for k in retired])
        if not expert_parallel and section.get("enabled"):
            # its one-process capacities stay in its checkpoints; nothing re-plans them
            section["enabled"] = False
            logger.info("%s: a one-process run with the retired online capacity planner "
                        "resumes with efficientmoe.enabled false (its capacities are kept)",
                        path)
    if isinstance(section, dict) and "dispatch" in section:
        old = section.pop("dispatch")
        if expert_parallel:
            if not isinstance(data.get("moe"), dict):
                data["moe"] = {}
            data["moe"]["dispatch"] = old
        logger.info("%s: read the older key efficientmoe.dispatch (%r) as %s", path, old,
                    f"moe.dispatch {old!r}" if expert_parallel else
                    "unused (a one-process run: moe.dispatch was its dispatch)")
    moe = data.get("moe")
    if isinstance(moe, dict) and moe.get("dispatch") == "counts":
        # the retired one-level "counts" layer computed the rows "grouped" computes
        moe["dispatch"] = "grouped"
        logger.info("%s: read the retired moe.dispatch 'counts' as 'grouped' (the same rows; "
                    "an expert-parallel run now runs 'balanced')", path)


def load_config(path: str, overrides: Optional[Dict[str, Any]] = None,
                saved_expert_parallel: Optional[bool] = None) -> RunConfig:
    """Load ``path`` (YAML), apply dotted ``overrides`` (``{"train.steps": 10}``), validate.

    An empty file is refused (it would silently mean "all defaults").
    saved_expert_parallel: set when ``path`` is a run folder's own config.yaml (True for a
    ``train --workers`` run): a folder saved with the older ``efficientmoe.dispatch`` key
    then loads as the run it was (:func:`_migrate_saved_config`); a config a user writes
    with that key is refused, naming where it went."""
    data = read_yaml(path, allow_empty=False)
    if saved_expert_parallel is not None and isinstance(data, dict):
        _migrate_saved_config(data, saved_expert_parallel, path)
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for depth, key in enumerate(parents):
            if node.get(key) is None:                 # a missing or empty (null) section
                node[key] = {}
            node = node[key]
            if not isinstance(node, dict):
                where = ".".join(parents[:depth + 1])
                raise ValueError(f"{path}: '{where}' must be a mapping of keys to values, "
                                 f"but got {node!r}.")
        node[leaf] = value
    try:
        return config_from_dict(data)
    except ValueError as err:                 # say which file the bad field is in
        raise ValueError(f"{path}: {err}") from None


def save_config(cfg: RunConfig, path: str) -> None:
    """Write the resolved config as YAML, atomically (temp file then rename)."""
    atomic_write_text(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))
