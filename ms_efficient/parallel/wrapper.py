"""``parallelize``: the plans of ``ms_efficient.optimize`` as MindSpore 2.10's parallel API.

    network, plans = ms_efficient.optimize(net_with_loss, cfg, sample_inputs=batch)
    parallel_net = ms_efficient.parallelize(network, plans, sample_inputs=batch)
    # on Ascend, after mindspore.communication.init(): train parallel_net (Model, or a
    # functional step with PipelineGradReducer when pipelined)

What it builds, every item a MindSpore API that reads it (``ms_efficient.parallel.settings``
derives the values and checks them):

- the pipeline: ``mindspore.parallel.nn.Pipeline(network, micro_batches, stage_config=
  {Cell path: stage})`` (MindSpore's micro-batch Cell; it sets ``pipeline_stage`` on each
  named Cell and raises KeyError for a name the network lacks), wrapped by
  ``AutoParallel(...).pipeline(stages=S, scheduler="1f1b")``;
- operator strategies: the ``Primitive.shard`` strategies the shard pass set, which
  ``AutoParallel(parallel_mode="semi_auto")`` reads (checked here against the plan);
  ``save_param_strategy_file`` makes the Ascend run write MindSpore's own strategy file
  for comparison with the planned one;
- optimizer sharding: ``AutoParallel.hsdp(shard_size=-1, threshold=0,
  optimizer_level=...)`` and ``Parameter.parallel_optimizer = False`` on the parameters the
  plan keeps whole;
- the dataset strategy: ``AutoParallel.dataset_strategy(((dp, 1, ...), ...))``, dim 0 of each
  input split over the dp replicas and repeated over mp.

``AutoParallel`` builds on CPU without ``init()`` (it reads rank 0 of 1); compiling it needs
Ascend (MindSpore refuses semi-auto parallel on the CPU backend).
"""
from __future__ import annotations

import logging
import os
from typing import Any, Dict, Mapping, Optional, Sequence

from ms_efficient.parallel.settings import ParallelSettings, settings_from_plans

__all__ = ["parallelize", "check_strategies"]

logger = logging.getLogger(__name__)


def _shape(x: Any) -> Sequence[int]:
    shape = getattr(x, "shape", None)
    if shape is None:
        raise ValueError(f"'sample_inputs' items must be Tensors or arrays with a shape, but "
                         f"got {type(x).__name__}.")
    return tuple(int(d) for d in shape)


def check_strategies(network: Any, plans: Mapping[str, Any]) -> Dict[str, Any]:
    """``{Cell path.attribute: in_strategy}`` of every primitive the shard plan names, read from
    the network; ValueError naming the first one whose strategy differs from the plan (or
    that the network lacks): semi-auto parallel would run something else."""
    from ms_efficient.core.registry import applied_plans

    shard = applied_plans(plans).get("shard")
    if shard is None:
        return {}
    cells = dict(network.cells_and_names())
    found: Dict[str, Any] = {}
    for path, entry in shard.get("cells", {}).items():
        for attr, planned in entry.get("shard", {}).items():
            prim = getattr(cells.get(path), attr, None)
            got = None if prim is None else prim.attrs.get("in_strategy")
            want = [list(t) for t in planned]
            if got is None or [list(t) for t in got] != want:
                raise ValueError(f"'{path}.{attr}' has strategy {got!r}, but the shard plan set "
                                 f"{want}; pass the network optimize() returned.")
            found[f"{path}.{attr}"] = want
    return found


def _zero_switches(network: Any, settings: ParallelSettings) -> None:
    names = {p.name: p for p in network.get_parameters()}
    missing = [n for n in settings.zero_of if n not in names]
    if missing:
        raise ValueError(f"the shard plan names parameter '{missing[0]}' the network lacks; "
                         f"pass the network optimize() returned.")
    for name in settings.zero_off:
        names[name].parallel_optimizer = False


def parallelize(network: Any, plans: Mapping[str, Any], sample_inputs: Sequence[Any], *,
                devices: Optional[int] = None, scheduler: str = "1f1b",
                strategy_file: Optional[str] = None):
    """Wrap ``network`` in ``mindspore.parallel.auto_parallel.AutoParallel`` (semi_auto) set up
    as ``plans`` say (module docstring).

    Args:
        network: the Cell ``optimize()`` returned (its output is the loss).
        plans: the plans ``optimize()`` returned; needs ``shard`` and/or ``place``.
        sample_inputs: one global batch of the network's inputs (shapes only are read).
        devices: ranks of the job; default the place plan's cluster, else dp x mp.
        scheduler: pipeline schedule, "1f1b" (default) or "gpipe".
        strategy_file: absolute path ending in ``.json``; the Ascend run writes MindSpore's
            strategy file there (``save_param_strategy_file``).

    Returns:
        the ``AutoParallel`` Cell; its ``settings`` attribute is the ParallelSettings used.
    Raises ValueError when the plans break a rule MindSpore states (device count, stage count,
    micro-batches, batch divisibility) or do not match the network.
    """
    from mindspore.communication import get_group_size
    from mindspore.parallel.auto_parallel import AutoParallel
    from mindspore.parallel.nn import Pipeline

    settings = settings_from_plans(plans, [_shape(x) for x in sample_inputs], devices,
                                   scheduler)
    world = get_group_size()            # 1 before init() (on CPU, or before msrun's init)
    if world > 1 and world != settings.devices:
        raise ValueError(f"the job has {world} ranks but the plans need {settings.devices} "
                         f"(stages x dp x mp = {settings.stages} x {settings.dp} x "
                         f"{settings.mp}); launch {settings.devices} ranks or re-plan.")
    check_strategies(network, plans)
    _zero_switches(network, settings)
    inner = network
    if settings.stages > 1:
        inner = Pipeline(network, settings.micro_batches, stage_config=settings.stage_config)
    wrapper = AutoParallel(inner, parallel_mode="semi_auto")
    if settings.stages > 1:
        wrapper.pipeline(stages=settings.stages, scheduler=settings.scheduler)
    if settings.optimizer_level:
        wrapper.hsdp(shard_size=-1, threshold=0, optimizer_level=settings.optimizer_level)
    wrapper.dataset_strategy(settings.dataset_strategy)
    if strategy_file is not None:
        if not os.path.isabs(strategy_file) or not strategy_file.endswith(".json"):
            raise ValueError(f"'strategy_file' must be an absolute path ending in .json, but "
                             f"got {strategy_file!r}.")
        wrapper.save_param_strategy_file(strategy_file)
    wrapper.settings = settings
    logger.info("parallelize: %d devices = %d stages x dp %d x mp %d, %d micro-batches, "
                "optimizer %s", settings.devices, settings.stages, settings.dp, settings.mp,
                settings.micro_batches, settings.optimizer_level or "not sharded")
    return wrapper
