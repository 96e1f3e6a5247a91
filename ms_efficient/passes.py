"""Pass framework: plans made on the user's own network applied to its Cell tree before
compilation.

``optimize(network, config, sample_inputs=batch)`` extracts the train-step graph of THAT
network once (MINDIR export of ``nn.TrainOneStepCell(network, SGD)``, so ``network`` is what the
user trains, typically ``nn.WithLossCell(backbone, loss)``; ``sample_inputs`` is one batch of
its inputs), maps its operators to the network's Cells by scope (``ms_efficient.graph.cells``)
and runs the passes named in ``config.optimize.passes`` in order.

A pass is a function ``(network, context) -> (network, plan)`` registered under a name with
:func:`register_pass`; ``context`` is the :class:`PassContext` (config, sample inputs, the graph
and the Cell tree, built on first use). Every plan is a dict whose ``cells`` maps each Cell path
the pass changed (exactly as in ``network.cells_and_names()``) to what it set there. A pass that
finds nothing worth changing (no Cell it can plan, a plan that does not pay or splits nothing)
raises :class:`PassRefused` (a ValueError) saying what it looked for, before it changes the
network; a plan with no ``cells`` is a refusal too, so no pass reports success having done
nothing. ``optimize`` records a refusal as ``plans[name] = {"refused": reason}``, logs it as a
warning and runs the other passes; ``optimize(..., strict=True)`` raises it instead. Any other
exception of a pass (a config field out of range) is an error and always propagates. With no
pass enabled the network is returned untouched.
"""
from __future__ import annotations

import functools
import importlib
import logging
from typing import Any, Dict, Optional, Sequence, Tuple

from ms_efficient.core.config import RunConfig, load_config
from ms_efficient.core.registry import (PassFn, PassRefused, applied_plans, is_refused,
                                        refusals, register_pass, registered)

__all__ = ["register_pass", "registered_passes", "optimize", "PassContext", "PassFn",
           "PassRefused", "applied_plans", "is_refused", "refusals"]

logger = logging.getLogger(__name__)

# Modules that register the built-in passes (core.registry.BUILTIN_PASSES); imported on first
# use of the registry, i.e. by optimize(), which needs MindSpore anyway.
_PASS_MODULES = (
    "ms_efficient.memopt.apply",
    "ms_efficient.shard.apply",
    "ms_efficient.place.apply",
    "ms_efficient.efficientmoe.apply",
    "ms_efficient.mpipe.apply",
)


@functools.lru_cache(maxsize=None)
def _load_builtin_passes() -> None:
    for name in _PASS_MODULES:
        importlib.import_module(name)


def registered_passes() -> Dict[str, PassFn]:
    """A copy of the name -> pass registry (built-in passes included)."""
    _load_builtin_passes()
    return registered()


class PassContext:
    """What every pass of one :func:`optimize` call shares.

    config: the RunConfig. sample_inputs: the batch given to ``optimize`` (or None).
    :meth:`graph` and :meth:`cell_tree` are built on first use and shared by the passes.
    plans: {pass name: plan} of the passes applied so far (later passes plan against them);
    refused: {pass name: reason} of the passes that refused (not in ``plans``).
    """

    def __init__(self, network: Any, config: RunConfig,
                 sample_inputs: Optional[Sequence[Any]] = None, graph=None) -> None:
        self.network = network
        self.config = config
        self.sample_inputs = None if sample_inputs is None else tuple(sample_inputs)
        self._graph = graph              # or one already extracted from this network
        self._tree = None
        self._price = None
        # {pass name: plan} of the passes run so far: later passes plan against them
        # (memopt on one device's share after shard and place)
        self.plans: Dict[str, Any] = {}
        # {pass name: reason} of the passes that refused (optimize records them, not in plans)
        self.refused: Dict[str, str] = {}

    def graph(self, needed_by: str = "this pass"):
        """The train-step OpGraph of the network (forward, backward and optimizer ops)."""
        if self._graph is None:
            if not self.sample_inputs:
                raise ValueError(f"{needed_by} plans the network's own graph: call "
                                 "optimize(network, config, sample_inputs=(batch...)) with one "
                                 "batch of the inputs the network is trained on.")
            from ms_efficient.graph import from_network

            self._graph = from_network(self.network, *self.sample_inputs, mode="train")
            logger.info("extracted the train-step graph of %s: %d ops",
                        type(self.network).__name__, len(self._graph))
        return self._graph

    def unoptimised(self, needed_by: str = "this pass"):
        """The network's unoptimised step on one device of the config's cluster, priced once
        for every pass (``ms_efficient.place.stages.price_network``; a ``NetworkPrice``)."""
        if self._price is None:
            from ms_efficient.place.stages import price_network

            self._price = price_network(self.graph(needed_by), self.config.cluster_spec())
        return self._price

    @property
    def has_graph(self) -> bool:
        """True once a pass has extracted the graph (the combined report needs it)."""
        return self._graph is not None

    def invalidate(self) -> None:
        """Forget the Cell tree (a pass changed the network's Cells). The graph stays: a
        second export of a compiled network keeps the first compile's scopes, so it would
        not name the new Cells anyway, and the passes that change Cells (``mpipe``) only
        wrap Cells inside the blocks the graph's scopes already name."""
        self._tree = None

    def cell_tree(self):
        """The network's Cells (path, class, parameter bytes) as ``cells_and_names`` lists them."""
        if self._tree is None:
            from ms_efficient.graph.cells import CellTree

            rows = []
            for path, cell in self.network.cells_and_names():
                nbytes = sum(int(p.size) * p.itemsize for p in cell.get_parameters())
                rows.append((path, type(cell).__name__, nbytes))
            self._tree = CellTree.from_cells(rows)
        return self._tree


def _check_graph(graph: Any, network: Any) -> None:
    """TypeError / ValueError unless ``graph`` is a train-step OpGraph extracted from a network
    of ``network``'s class (what ``optimize(..., graph=...)`` accepts)."""
    from ms_efficient.graph.opgraph import OpGraph

    if not isinstance(graph, OpGraph):
        raise TypeError(f"optimize(..., graph=...) takes the OpGraph of the network's train "
                        f"step, but got {type(graph).__name__}.")
    mode, source = graph.meta.get("mode"), graph.meta.get("network")
    if mode != "train" or source != type(network).__name__:
        raise ValueError(
            f"optimize(..., graph=...) takes the train-step graph of this network "
            f"(ms_efficient.graph.from_network(network, *sample_inputs, mode='train')), but "
            f"got graph {graph.name!r} with mode {mode!r} extracted from {source!r}, for a "
            f"{type(network).__name__}.")


def optimize(network, config, sample_inputs: Optional[Sequence[Any]] = None,
             verify: bool = False, strict: bool = False,
             graph: Any = None) -> Tuple[Any, Dict[str, Any]]:
    """Run the enabled passes on ``network`` (an ``nn.Cell``) before it is compiled.

    Args:
        network: the Cell the user trains (its output is the loss, e.g.
            ``nn.WithLossCell(backbone, loss_fn)``); passes modify it in place or return a
            new Cell. Its weights are never read: a network built under
            ``mindspore.nn.utils.no_init_parameters()`` is planned without allocating them
            and stays uninitialised (``ms_efficient.graph.mindir``).
        config: a :class:`ms_efficient.core.config.RunConfig` or a path to a YAML config.
        sample_inputs: one batch of the network's inputs (Tensors or numpy arrays, in
            ``construct`` order); needed by every pass that plans the network's graph.
        verify: compile the optimised network once with the plan-verification graph pass
            (``ms_efficient.verify``), add ``verified`` (Cell path -> what the compiled graph
            shows) to each applied plan, and raise ``PlanNotRealised`` naming each Cell whose
            planned action left no trace. Needs a C++ compiler (``VerifyUnavailable``
            otherwise). When every pass refused there is nothing to compile-check: it is
            skipped (logged).
        strict: raise the first refusal (:class:`PassRefused`, a ValueError) instead of
            recording it; the passes before it have already changed the network.
        graph: the train-step OpGraph of ``network`` when it is already extracted
            (``ms_efficient.graph.from_network(network, *sample_inputs, mode="train")``, or
            of an identically built network: its scopes name the same Cells); the passes
            plan it instead of exporting the network again, so one network planned under
            several configs is compiled for its graph once. Not changed by the passes.

    Returns:
        (network, plans): the network to compile and ``{pass name: plan}`` in pass order. An
        applied plan's ``cells`` names the Cells the pass changed. A pass that refused (found
        nothing worth changing: no Cell it can plan, place's pipelines slower than the same
        devices without one (data parallel),
        a memory budget below the feasible floor, a shard plan that splits no dimension)
        leaves the network as it was and is recorded as ``{"refused": reason}`` (logged as a
        warning); the other passes plan and apply as if it were not listed.
        ``ms_efficient.passes.applied_plans(plans)`` / ``refusals(plans)`` split the two.
        When a pass planned the network's graph (memopt, shard, place),
        ``plans["summary"]`` is the combined report of the applied passes together
        (``ms_efficient.plan_report.combined_report``): one simulated step time and the
        peak bytes of every device, next to the unoptimised figures every pass priced; its
        ``refused`` lists the passes that refused. Passes see the plans applied before them:
        list ``memopt`` after ``shard`` and ``place`` so it plans one device's share of the
        network.

    Raises:
        PassRefused: only with ``strict=True``, the first pass that refused.
        ValueError: an unknown pass name, or an error of a pass (a config field it cannot
            use); never a refusal unless ``strict``; a ``graph`` that is not a train-step
            graph of a network of this class (TypeError when it is no OpGraph).
    """
    if isinstance(config, str):
        config = load_config(config)
    if not isinstance(config, RunConfig):
        raise TypeError(f"optimize() takes a RunConfig or a config path, but got "
                        f"{type(config).__name__}.")
    if not isinstance(strict, bool):
        raise TypeError(f"'strict' must be True or False, but got {strict!r}.")
    if graph is not None:
        _check_graph(graph, network)
    known = registered_passes()
    context = PassContext(network, config, sample_inputs, graph=graph)
    plans: Dict[str, Any] = {}
    for name in config.optimize.passes:
        if name not in known or name == "summary":
            raise ValueError(f"'optimize.passes' names unknown pass '{name}'; registered: "
                             f"{sorted(known)}.")
        logger.info("running pass %s", name)
        before = [path for path, _ in network.cells_and_names()]
        try:
            network, plan = known[name](network, context)
            if not isinstance(plan, dict) or not plan.get("cells") or is_refused(plan):
                raise PassRefused(
                    f"pass '{name}' returned a plan that names no changed Cell (its 'cells' "
                    f"is empty): it changed nothing; a pass with nothing to change must raise "
                    f"PassRefused saying what it looked for.")
        except PassRefused as err:
            if strict:
                raise
            plans[name] = {"refused": str(err)}
            context.refused[name] = str(err)
            logger.warning("pass %s refused (the other passes still apply; strict=True "
                           "raises): %s", name, err)
            continue
        finally:
            context.network = network
            if [path for path, _ in network.cells_and_names()] != before:
                context.invalidate()      # the Cell tree changed: later passes see the new one
        plans[name] = plan
        context.plans[name] = plan
    applied, refused = applied_plans(plans), refusals(plans)
    if verify and plans and not applied:
        logger.warning("optimize(..., verify=True): every pass refused (%s); the network is "
                       "unchanged and there is no plan to check in the compiled graph.",
                       ", ".join(refused))
    else:
        from ms_efficient.verify.check import verify_after_optimize

        verify_after_optimize(network, applied, context.sample_inputs, verify)
    if context.has_graph:
        from ms_efficient.plan_report import combined_report

        logger.info("combining the plans of %d applied passes into plans['summary']",
                    len(applied))
        plans["summary"] = combined_report(context)
    return network, plans
