"""Pass framework: planners' plans applied to a network's Cell tree before compilation.

A pass is a function ``(network, config) -> (network, plan)`` registered under a name with
:func:`register_pass`. :func:`optimize` runs the passes named in ``config.optimize.passes``
in order and returns the network and a ``{name: plan}`` dict of what it applied. With no pass
enabled the network is returned untouched.
"""
from __future__ import annotations

import functools
import importlib
import logging
from typing import Any, Dict, Tuple

from ms_efficient.core.registry import PassFn, register_pass, registered

__all__ = ["register_pass", "registered_passes", "optimize", "PassFn"]

logger = logging.getLogger(__name__)

# Modules that register the built-in passes (core.registry.BUILTIN_PASSES); imported on first
# use of the registry (they import MindSpore only inside the pass functions).
_PASS_MODULES = (
    "ms_efficient.memopt.apply",
    "ms_efficient.shard.apply",
)


@functools.lru_cache(maxsize=None)
def _load_builtin_passes() -> None:
    for name in _PASS_MODULES:
        importlib.import_module(name)


def registered_passes() -> Dict[str, PassFn]:
    """A copy of the name -> pass registry (built-in passes included)."""
    _load_builtin_passes()
    return registered()


def optimize(network, config) -> Tuple[Any, Dict[str, Any]]:
    """Run the enabled passes on ``network`` (an ``nn.Cell``) before it is compiled.

    Args:
        network: the user's network; passes may modify it in place or return a new Cell.
        config: a :class:`ms_efficient.core.config.RunConfig` (its ``optimize.passes`` list) or a
            path to a YAML config file.

    Returns:
        (network, plans): the network to compile and ``{pass name: plan}`` it applied.
    """
    from ms_efficient.core.config import RunConfig, load_config

    if isinstance(config, str):
        config = load_config(config)
    if not isinstance(config, RunConfig):
        raise TypeError(f"optimize() takes a RunConfig or a config path, but got "
                        f"{type(config).__name__}.")
    known = registered_passes()
    plans: Dict[str, Any] = {}
    for name in config.optimize.passes:
        if name not in known:
            raise ValueError(f"'optimize.passes' names unknown pass '{name}'; registered: "
                             f"{sorted(known)}.")
        logger.info("running pass %s", name)
        network, plans[name] = known[name](network, config)
    return network, plans
