"""The package layout holds: layers import only downwards, no import cycles, planners stay
free of MindSpore. Imports are read from the source (every ``import``, including those inside
functions, since a late import is still a dependency), so nothing is imported to check."""
import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "ms_efficient"
CAPABILITIES = ("efficientmoe", "mpipe", "memopt", "shard", "place")
# Modules at the top of each capability: they may use the trainer and each other's rows.
APPLICATION_ROLES = ("bench", "commands")
# Modules of a capability that build or change MindSpore Cells (the rest is numpy only).
MINDSPORE_ROLES = {"efficientmoe": {"apply", "ep_replanner"},
                   "mpipe": {"layer", "apply"},
                   "memopt": {"apply", "measure", "bench", "commands"},
                   "shard": {"apply", "commands"},
                   "place": {"apply", "commands", "bench", "workloads"}}


def _modules():
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name, path):
    """Modules of the package that ``name`` imports (resolved to module names)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # "from pkg import mod" imports pkg.mod when that is a module
            targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES
                       else node.module for a in node.names]
        else:
            continue
        found.update(t for t in targets if t.startswith("ms_efficient") and t != name)
    return found


def _layer(module):
    """Layer of a module, lowest 0: a module may import only modules of its layer or below."""
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else ""
    role = parts[2] if len(parts) > 2 else ""
    if top == "core":
        return 0
    if top in ("graph", "sim"):
        return 1
    if top == "moe":
        return 2
    if top == "models":
        return 3
    if top in CAPABILITIES:
        return 6 if role in APPLICATION_ROLES else 4
    if top == "adopt":           # builds moe layers; the MoE passes point to it
        return 4
    if top == "train":
        return 5
    return 7                     # ms_efficient, passes, cli


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_imports_only_its_layer_or_below(module):
    upward = sorted(t for t in GRAPH[module] if t in MODULES and _layer(t) > _layer(module))
    assert not upward, f"{module} (layer {_layer(module)}) imports higher layers: {upward}"


def test_every_import_names_an_existing_module():
    missing = sorted((m, t) for m, ts in GRAPH.items() for t in ts if t not in MODULES)
    assert not missing


def test_there_is_no_import_cycle():
    # Tarjan's strongly connected components over the module import graph.
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in MODULES:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(MODULES):
        if v not in index:
            visit(v)
    assert not cycles


def test_a_cycle_is_detected_by_the_checker():
    # The checker itself can fail: a two-module cycle written here is found.
    saved = dict(GRAPH)
    try:
        GRAPH["ms_efficient.core.fileio"] = GRAPH["ms_efficient.core.fileio"] | {
            "ms_efficient.core.config"}
        with pytest.raises(AssertionError):
            test_there_is_no_import_cycle()
    finally:
        GRAPH.clear()
        GRAPH.update(saved)


def _imports_mindspore(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "mindspore"
                                                for a in node.names):
            return True
        if (isinstance(node, ast.ImportFrom) and node.module
                and node.module.split(".")[0] == "mindspore"):
            return True
    return False


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_planner_modules_never_import_mindspore(capability):
    allowed = MINDSPORE_ROLES[capability]
    offenders = sorted(m for m, p in MODULES.items()
                       if m.startswith(f"ms_efficient.{capability}.")
                       and m.split(".")[-1] not in allowed and _imports_mindspore(p))
    assert not offenders


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_each_capability_has_the_common_roles(capability):
    names = {p.stem for p in (PKG / capability).glob("*.py")}
    assert {"planner", "bench", "commands"} <= names


# Modules a package folder may hold (``__init__`` not counted): 11 unless listed. Each
# capability holds its five roles (planner, baselines, apply/layer, bench, commands) plus one
# module per planning concept; EfficientMoE's planner is the slow level's layout, beside the
# concepts balanced_cost, two_level, sampler, capacity (a one-process network's static
# capacities from a trace), cost and replay, and a second MindSpore-facing role, the
# re-planning of running expert-parallel layers (ep_replanner, beside apply). The MoE runtime
# eighteen modules: the layer, what an expert computes (experts: activations, gated and
# shared experts), the routers (routing), the drop-in MLP, the replica tables (ep_routing),
# migration and re-plan, All-to-All, the count-driven exchange (CountedAllToAllV), what an
# expert copy sends (exchange), kernels, grouped matmul, plan, split and trace, and the
# balanced layer with its fast level (balanced_ep, balance) and the fast level's in-graph
# twins (fast_level: the host op and the MindSpore-ops one). MemOpt twelve: its roles plus the profile, environment,
# agents, MILP, measured check, calibration and the segments of networks without repeated
# blocks (the README's Architecture section lists them).
MAX_MODULES = 11
MAX_MODULES_OF = {"efficientmoe": 12, "moe": 18, "memopt": 12, "place": 12}


def test_no_package_folder_holds_more_modules_than_its_limit():
    for folder in sorted(p for p in PKG.iterdir() if p.is_dir() and p.name != "__pycache__"):
        count = len([p for p in folder.glob("*.py") if p.name != "__init__.py"])
        assert count <= MAX_MODULES_OF.get(folder.name, MAX_MODULES), (folder.name, count)


def test_builtin_pass_names_match_the_passes_that_register():
    from ms_efficient.core.registry import BUILTIN_PASSES
    from ms_efficient.passes import registered_passes

    assert set(BUILTIN_PASSES) <= set(registered_passes())


