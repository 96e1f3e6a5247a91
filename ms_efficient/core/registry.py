"""The pass registry: pass name -> function ``(network, config) -> (network, plan)``.

It lives in ``core`` so that the config can check ``optimize.passes`` when it is loaded without
importing the capabilities: the built-in pass names are listed here, and
``ms_efficient.passes`` imports the modules that register them (a test checks both agree).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

__all__ = ["BUILTIN_PASSES", "PassFn", "register_pass", "registered", "known_pass_names"]

PassFn = Callable[[Any, Any], Tuple[Any, Any]]

# Passes that ship with the package (registered when ms_efficient.passes loads them).
BUILTIN_PASSES = ("memopt", "shard", "place", "efficientmoe", "mpipe")

_REGISTRY: Dict[str, PassFn] = {}


def register_pass(name: str) -> Callable[[PassFn], PassFn]:
    """Decorator: register ``fn`` as the pass called ``name`` (names are unique)."""

    def wrap(fn: PassFn) -> PassFn:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"pass '{name}' is already registered by "
                             f"{_REGISTRY[name].__module__}.{_REGISTRY[name].__qualname__}.")
        _REGISTRY[name] = fn
        return fn

    return wrap


def registered() -> Dict[str, PassFn]:
    """A copy of the passes registered so far (built-in ones only once loaded)."""
    return dict(_REGISTRY)


def known_pass_names() -> Tuple[str, ...]:
    """Every name ``optimize.passes`` may use: the built-in passes and any registered one."""
    return tuple(sorted(set(BUILTIN_PASSES) | set(_REGISTRY)))
