"""What MindSpore's parallel API must be told to run the plans of ``ms_efficient.optimize``
(no MindSpore import): one :class:`ParallelSettings` read from the plans and checked against
the rules MindSpore and MindFormers state for a semi-auto parallel run.

From the plans:

- ``plans["place"]`` (the place pass): the pipeline. ``stages``: one entry per stage, so the
  stage count S is their number; ``micro_batches``: M; ``cells``: ``{Cell path:
  {"pipeline_stage": s}}`` of every planned Cell (never the root), MindSpore's
  ``Pipeline(network, M, stage_config={path: s})``; ``devices``: the devices the plan runs
  on (its stages x its data-parallel copies ``dp``).
- ``plans["shard"]`` (the shard pass): ``mesh`` dp x mp (one stage's devices) and
  ``operators``, each with its ZeRO level ``zero`` (0-3) and the parameters it reads
  (``params``: ``[input index, parameter name]``).
- Without a shard plan every stage is data parallel over its devices (dp = devices / S).

Rules (a violated one raises ValueError naming the fields and what would fix it):

- device count = S x dp x mp (MindFormers' configuration guide: "device_num =
  data_parallel x model_parallel x context_parallel x pipeline_stage");
- M >= S when S > 1 (MindSpore ``Pipeline``: "micro_size must be greater than or equal to
  pipeline stages");
- dim 0 of every input (the global batch B for the first) divides by dp x M: each of the dp
  replicas of a stage splits its share into M micro-batches of equal shape;
- the stage ids of the planned Cells are exactly 0..S-1.

ZeRO: MindSpore 2.10 has one optimizer-shard level per network, ``AutoParallel.hsdp(
optimizer_level="level1|2|3")`` (level1 shards optimizer states, level2 adds gradients,
level3 adds weights re-gathered before backward: ZeRO-1/2/3), and a per-parameter switch
``Parameter.parallel_optimizer``. The level is the highest the plan chose; the parameters
whose operators all kept ZeRO 0 are excluded with the switch; ``threshold`` 0 so that no
planned parameter is left out for being small (``hsdp``'s default skips those under 64 KB).
Operators planned at a lower non-zero level than the maximum get the maximum (logged).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = ["ParallelSettings", "settings_from_plans", "stage_of_path", "stage_of_keys",
           "summary_rows"]

logger = logging.getLogger(__name__)

SCHEDULERS = ("1f1b", "gpipe")


@dataclass(frozen=True)
class ParallelSettings:
    """The parallel run the plans describe.

    devices: total device count (ranks). stages: pipeline stages S. micro_batches: M (1
    without a pipeline). dp, mp: one stage's data- and model-parallel sizes. batch: global
    batch B, samples. stage_config: ``{Cell path: stage}`` for ``Pipeline``. optimizer_level:
    ``"level1".."level3"`` or None (no optimizer sharding). zero_off: parameter names kept
    whole by the plan (``Parameter.parallel_optimizer = False``). zero_of: ``{parameter
    name: planned ZeRO level}``. scheduler: the pipeline schedule. dataset_strategy: one
    split-factor tuple per network input (dim 0 split dp ways).
    """

    devices: int
    stages: int
    micro_batches: int
    dp: int
    mp: int
    batch: int
    stage_config: Dict[str, int] = field(default_factory=dict)
    optimizer_level: Optional[str] = None
    zero_off: Tuple[str, ...] = ()
    zero_of: Dict[str, int] = field(default_factory=dict)
    scheduler: str = "1f1b"
    dataset_strategy: Tuple[Tuple[int, ...], ...] = ()

    @property
    def per_stage_devices(self) -> int:
        return self.dp * self.mp


def _int_field(doc: Mapping[str, Any], key: str, where: str) -> int:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"'{where}.{key}' must be a positive integer, but got {value!r}.")
    return value


def _stage_config(place: Mapping[str, Any], stages: int) -> Dict[str, int]:
    cells = place.get("cells")
    if not isinstance(cells, dict) or not cells:
        raise ValueError("'plans[\"place\"].cells' must map Cell paths to {pipeline_stage: s}; "
                         "pass the plans optimize() returned.")
    config = {}
    for path, entry in cells.items():
        if not path:
            raise ValueError("'plans[\"place\"].cells' names the root Cell; the root spans "
                             "every stage and takes no pipeline_stage.")
        config[path] = int(entry["pipeline_stage"])
    used = sorted(set(config.values()))
    if used != list(range(stages)):
        raise ValueError(f"the place plan has {stages} stages but its Cells use stages {used}; "
                         f"MindSpore needs every stage 0..{stages - 1} to hold a Cell.")
    return config


def _zero(shard: Mapping[str, Any]) -> Tuple[Optional[str], Tuple[str, ...], Dict[str, int]]:
    level_of: Dict[str, int] = {}
    for entry in shard.get("operators", {}).values():
        for _, name in entry.get("params", []):
            level_of[name] = max(level_of.get(name, 0), int(entry.get("zero", 0)))
    top = max(level_of.values(), default=0)
    if not top:
        return None, (), level_of
    raised = sorted(n for n, z in level_of.items() if 0 < z < top)
    if raised:
        logger.info("parallelize: MindSpore has one optimizer-shard level; %d parameters "
                    "planned below ZeRO-%d get level%d (%s ...)", len(raised), top, top,
                    raised[0])
    off = tuple(sorted(n for n, z in level_of.items() if z == 0))
    return f"level{top}", off, level_of


def settings_from_plans(plans: Mapping[str, Any], batch_shapes: Sequence[Sequence[int]],
                        devices: Optional[int] = None, scheduler: str = "1f1b"
                        ) -> ParallelSettings:
    """Read the plans of ``optimize()`` into :class:`ParallelSettings` (module docstring).

    batch_shapes: the shape of each network input for one global batch (dim 0 = B).
    devices: ranks of the job; default the place plan's device count, else dp x mp.
    A refused pass (``{"refused": reason}``) counts as absent. Raises ValueError when the
    plans hold neither an applied shard nor place plan (naming the refusals), or break a rule.
    """
    if not isinstance(plans, Mapping):
        raise ValueError(f"'plans' must be the dict optimize() returns, but got "
                         f"{type(plans).__name__}.")
    from ms_efficient.core.registry import applied_plans, refusals

    refused = {k: v for k, v in refusals(plans).items() if k in ("shard", "place")}
    plans = applied_plans(plans)                  # a refused pass set nothing to run
    shard, place = plans.get("shard"), plans.get("place")
    if shard is None and place is None:
        if refused:
            raise ValueError("'plans' holds no applied 'shard' or 'place' plan: " + "; ".join(
                f"pass {name} refused: {reason}" for name, reason in refused.items()))
        raise ValueError(f"'plans' holds no 'shard' or 'place' plan (it has {sorted(plans)}); "
                         "enable those passes in optimize.passes.")
    if scheduler not in SCHEDULERS:
        raise ValueError(f"'scheduler' must be one of {SCHEDULERS}, but got {scheduler!r}.")
    if not batch_shapes or not all(len(s) >= 1 for s in batch_shapes):
        raise ValueError("'sample_inputs' must be one batch of the network's inputs, each with "
                         "a batch dimension.")
    batch = int(batch_shapes[0][0])
    stages, micro = 1, 1
    stage_config: Dict[str, int] = {}
    if place is not None:
        stages = len(place.get("stages") or [])
        if stages < 2:
            raise ValueError(f"'plans[\"place\"].stages' lists {stages} stage; a pipeline "
                             "needs >= 2.")
        micro = _int_field(place, "micro_batches", 'plans["place"]')
        stage_config = _stage_config(place, stages)
    if devices is None:
        devices = int(place["devices"]) if place is not None else \
            int(shard["mesh"]["dp"]) * int(shard["mesh"]["mp"])
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"'devices' must be a positive integer, but got {devices!r}.")
    if devices % stages:
        raise ValueError(f"'devices' {devices} does not divide into the place plan's {stages} "
                         f"pipeline stages; MindSpore gives every stage devices / stages ranks.")
    if shard is not None:
        dp, mp = int(shard["mesh"]["dp"]), int(shard["mesh"]["mp"])
        if dp * mp * stages != devices:
            raise ValueError(
                f"the shard plan's mesh {dp}x{mp} x {stages} pipeline stages = "
                f"{dp * mp * stages} devices, but the job has {devices} (MindSpore: device_num "
                f"= data_parallel x model_parallel x pipeline_stage); plan the shard pass for "
                f"one stage's {devices // stages} devices (optimize.shard_mesh, e.g. "
                f"'{devices // stages}x1') or pass devices={dp * mp * stages}.")
    else:
        dp, mp = devices // stages, 1
    if stages > 1 and micro < stages:
        raise ValueError(f"'plans[\"place\"].micro_batches' {micro} is below its {stages} "
                         f"stages; MindSpore's Pipeline needs micro_batches >= stages "
                         f"(set optimize.micro_batches >= {stages}).")
    for i, shape in enumerate(batch_shapes):      # Pipeline and the dataset split dim 0
        if int(shape[0]) % (dp * micro):
            raise ValueError(
                f"dim 0 of input {i} ({int(shape[0])}; the batch is {batch}) must divide by "
                f"data_parallel x micro_batches = {dp} x {micro} = {dp * micro}: each of the "
                f"{dp} data-parallel replicas splits its share into {micro} equal micro-batches.")
    level, off, zero_of = _zero(shard) if shard is not None else (None, (), {})
    ds = tuple((dp,) + (1,) * (len(s) - 1) for s in batch_shapes)
    return ParallelSettings(devices=devices, stages=stages, micro_batches=micro, dp=dp, mp=mp,
                            batch=batch, stage_config=stage_config, optimizer_level=level,
                            zero_off=off, zero_of=zero_of, scheduler=scheduler,
                            dataset_strategy=ds)


def stage_of_path(path: str, stage_config: Mapping[str, int]) -> int:
    """Pipeline stage of the Cell at ``path``: that of its deepest planned enclosing Cell
    (itself included), 0 when none is planned."""
    while path and path not in stage_config:
        path = path.rsplit(".", 1)[0] if "." in path else ""
    return int(stage_config.get(path, 0))


def stage_of_keys(keys: Sequence[str], stage_config: Mapping[str, int]) -> Dict[str, int]:
    """Pipeline stage of each ``<cell path>.<attribute>`` key (a primitive of a Cell)."""
    return {key: stage_of_path(key.rsplit(".", 1)[0] if "." in key else "", stage_config)
            for key in keys}


def summary_rows(settings: ParallelSettings) -> List[Tuple[str, Any]]:
    """(setting, value) rows for printing."""
    return [("devices", settings.devices), ("pipeline stages", settings.stages),
            ("micro-batches", settings.micro_batches), ("data parallel", settings.dp),
            ("model parallel", settings.mp), ("optimizer level", settings.optimizer_level),
            ("parameters without ZeRO", len(settings.zero_off))]
