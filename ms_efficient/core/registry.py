"""The pass registry: pass name -> function ``(network, config) -> (network, plan)``.

It lives in ``core`` so that the config can check ``optimize.passes`` when it is loaded without
importing the capabilities: the built-in pass names are listed here, and
``ms_efficient.passes`` imports the modules that register them (a test checks both agree).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Tuple

__all__ = ["BUILTIN_PASSES", "PassFn", "PassRefused", "register_pass", "registered",
           "known_pass_names", "is_refused", "applied_plans", "refusals"]

PassFn = Callable[[Any, Any], Tuple[Any, Any]]

# Passes that ship with the package (registered when ms_efficient.passes loads them).
BUILTIN_PASSES = ("memopt", "shard", "place", "efficientmoe", "mpipe")

_REGISTRY: Dict[str, PassFn] = {}


class PassRefused(ValueError):
    """A pass looked at the network and has nothing worth changing: no Cell it can plan, a
    plan that does not pay (place's pipeline slower than one stage, recompute that lowers no
    peak), a memory budget below the feasible floor, a plan that splits nothing. The message
    says what the pass looked for and by how much it missed.

    ``ms_efficient.optimize`` records it as ``plans[name] = {"refused": message}`` and runs
    the other passes (``strict=True`` re-raises it). Every other exception a pass raises (a
    config field out of range, a missing ``sample_inputs``) is an error and propagates. A
    ValueError, so code that caught a pass's ValueError still catches it."""


def is_refused(plan: Any) -> bool:
    """True when ``plan`` is a refusal recorded by ``optimize`` (``{"refused": reason}``)."""
    return isinstance(plan, Mapping) and "refused" in plan


def applied_plans(plans: Mapping[str, Any]) -> Dict[str, Any]:
    """The plans of ``optimize()``'s result that changed the network: every entry but the
    refusals and ``summary``, in pass order."""
    return {name: plan for name, plan in plans.items()
            if name != "summary" and not is_refused(plan)}


def refusals(plans: Mapping[str, Any]) -> Dict[str, str]:
    """{pass name: reason} of the passes that refused, in pass order."""
    return {name: str(plan["refused"]) for name, plan in plans.items()
            if name != "summary" and is_refused(plan)}


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
