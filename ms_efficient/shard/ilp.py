"""Minimal-redundancy sharding: an integer linear program over per-operator strategies.

Variables (one group g = one operator, or a class of the operators tied to it by
``OpSpec.tie`` across repeated layers, see ``ShardOptions.tie``; its costs count n_g times):
    s[g, c]     binary, 1 if op group g uses candidate strategy c (layout + ZeRO level)
    e[k, a, b, o]  1 if edge group k (producer group u -> input i of consumer group v) joins
                producer layout a with consumer layout b, keeping the input by option o
                (continuous in [0, 1] with one option: integral given binary s; binary
                with two, so the keep choice cannot be mixed)
    x[g, a] = sum_{c: layout(c) = a} s[g, c]   (an expression: op group g has layout a)

Objective (bytes per device, scaled to GiB):
    budget:   min  M + rho * R            s.t.  C <= comm_budget_s
    weighted: min  M + rho * R + w * C
  where M = sum node and edge memory (params, grads, optimizer states, kept activations),
  R = their redundant share, C = communication seconds per step, rho = redundancy_weight,
  w = comm_weight_gib_per_s. In budget mode a second solve keeps M + rho * R at its optimum
  (within 1e-6 relative) and minimises C: the cheapest of the equal-memory plans.

An infeasible budget raises ``ValueError`` naming the minimum feasible budget (from a second
solve that minimises C alone).
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from ms_efficient.shard.cost import Cost, CostModel
from ms_efficient.shard.strategies import Layout, OpSpec, Strategy, candidate_strategies
from ms_efficient.shard.strategies import add_same_split as _add_same_split

try:
    import pulp
except ImportError as err:  # pragma: no cover - pulp is a declared dependency
    raise ImportError("the sharding ILP needs PuLP (bundles the CBC solver): "
                      "pip install pulp") from err

__all__ = ["ShardOptions", "ShardSolution", "solve_sharding", "OBJECTIVES"]

logger = logging.getLogger(__name__)

OBJECTIVES = ("budget", "weighted")
TIE_MODES = ("binary", "layer", "none")
_GIB = float(2**30)
_TIE_BREAK = 1e-6
_DOMINANCE_RTOL = 1e-9


@dataclass(frozen=True)
class ShardOptions:
    """How to trade memory for communication.

    objective: "budget" (minimise memory subject to comm <= comm_budget_s) or "weighted"
        (minimise memory_GiB + comm_weight_gib_per_s * comm_s).
    comm_budget_s: seconds of communication allowed per step; None = unconstrained.
    comm_weight_gib_per_s: GiB of per-device memory one second of communication is worth.
    redundancy_weight: extra weight rho on the redundant share (0: plain per-device memory).
    tie: how operators with the same ``OpSpec.tie`` key (one per repeated layer) share
        strategies: "binary" splits the n repeats, in order, into classes of 1, 2, 4, ...
        layers (the last takes the rest), one strategy per class, so the ILP can give any
        number 0..n of layers a different strategy with only ~log2(n) copies of a layer;
        "layer" ties all n repeats to one strategy; "none" solves every operator separately.
    time_limit_s: CBC time limit, seconds.
    mip_gap: relative optimality gap at which CBC stops (1e-4: the plan's objective is within
        0.01% of the optimum over the strategy space; 0 proves exact optimality, which on
        the largest meshes can take minutes to close the last megabytes of a ~1e-5 gap).
    """

    objective: str = "budget"
    comm_budget_s: Optional[float] = None
    comm_weight_gib_per_s: float = 1.0
    redundancy_weight: float = 0.0
    tie: str = "binary"
    time_limit_s: float = 120.0
    mip_gap: float = 1e-4

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"'objective' must be one of {list(OBJECTIVES)}, "
                             f"but got {self.objective!r}.")
        if self.tie not in TIE_MODES:
            raise ValueError(f"'tie' must be one of {list(TIE_MODES)}, but got {self.tie!r}.")
        if self.comm_budget_s is not None and not self.comm_budget_s >= 0:
            raise ValueError(f"'comm_budget_s' must be >= 0 or None, but got "
                             f"{self.comm_budget_s!r}.")
        for key in ("comm_weight_gib_per_s", "redundancy_weight", "mip_gap"):
            if not getattr(self, key) >= 0:
                raise ValueError(f"'{key}' must be >= 0, but got {getattr(self, key)!r}.")


@dataclass
class ShardSolution:
    """The chosen strategies and what they cost.

    strategies: op name -> Strategy. keep_producer: edge "producer->consumer:i" entries whose
    kept input uses the producer's finer split. cost: per-device total (bytes, seconds).
    solve_time_s: wall seconds to build and solve. groups / variables: ILP size.
    """

    strategies: Dict[str, Strategy]
    cost: Cost
    solve_time_s: float
    status: str
    groups: int
    variables: int
    keep_producer: List[str] = field(default_factory=list)


@dataclass
class _Group:
    rep: OpSpec
    members: List[OpSpec]
    cands: List[Strategy]
    layouts: List[Layout]
    node: List[Cost]


def _binary_class(j: int, n: int) -> int:
    """Class of the j-th of n repeats when classes hold 1, 2, 4, ... repeats (last: the rest)."""
    start, size, cls = 0, 1, 0
    while start + size < n and j >= start + size:
        start, size, cls = start + size, size * 2, cls + 1
    return cls


def _tie_keys(specs: Sequence[OpSpec], tie: str) -> Dict[str, str]:
    """op name -> group key under the tie mode (see ShardOptions.tie)."""
    if tie == "none":
        return {s.name: s.name for s in specs}
    members: "OrderedDict[str, List[str]]" = OrderedDict()
    for s in specs:
        members.setdefault(s.tie_key, []).append(s.name)
    if tie == "layer":
        return {name: key for key, names in members.items() for name in names}
    return {name: f"{key}#{_binary_class(j, len(names))}"
            for key, names in members.items() for j, name in enumerate(names)}


def _groups(specs: Sequence[OpSpec], model: CostModel, tie: str) -> "OrderedDict[str, _Group]":
    groups: "OrderedDict[str, _Group]" = OrderedDict()
    keys = _tie_keys(specs, tie)
    for spec in specs:
        key = keys[spec.name]
        if key in groups:
            if groups[key].rep.signature() != spec.signature():
                raise ValueError(f"ops {groups[key].rep.name!r} and {spec.name!r} share tie "
                                 f"key {key!r} but differ in shape or kind.")
            groups[key].members.append(spec)
            continue
        cands = candidate_strategies(spec, model.mesh)
        costs = [model.node_cost(spec, c) for c in cands]
        keep = _undominated(cands, costs)
        cands, costs = [cands[i] for i in keep], [costs[i] for i in keep]
        layouts = list(OrderedDict.fromkeys(c.layout for c in cands))
        groups[key] = _Group(spec, [spec], cands, layouts, costs)
    return groups


def _no_worse(a: float, b: float) -> bool:
    return a <= b + _DOMINANCE_RTOL * max(abs(a), abs(b))


def _undominated(cands: Sequence[Strategy], costs: Sequence[Cost]) -> List[int]:
    """Indices of the candidates no other candidate of the same layout dominates.

    Edge costs depend on the layout only, so a candidate whose node memory, redundant share
    and communication are all no better than another's of the same layout can never be
    needed (the other is at least as good in every objective and constraint). Of equal
    candidates the first (lowest ZeRO level) is kept, so e.g. ZeRO levels of a parameter that
    no two devices hold identically collapse to level 0, and ZeRO-1 (reduce-scatter +
    all-gather, as cheap as the all-reduce it replaces) removes level 0 where it shards.
    """
    def dominates(j: int, i: int) -> bool:
        a, b = costs[j], costs[i]
        return (_no_worse(a.memory, b.memory) and _no_worse(a.redundant, b.redundant)
                and _no_worse(a.comm_s, b.comm_s))

    keep = []
    for i in range(len(cands)):
        rivals = [j for j in range(len(cands)) if j != i and cands[j].layout == cands[i].layout]
        if any(dominates(j, i) and (j < i or not dominates(i, j)) for j in rivals):
            continue
        keep.append(i)
    return keep


def _edge_groups(specs: Sequence[OpSpec], key_of: Dict[str, str]) -> "OrderedDict[Tuple[str, str, int], int]":
    """(producer group, consumer group, input index) -> number of edges."""
    edges: "OrderedDict[Tuple[str, str, int], int]" = OrderedDict()
    for spec in specs:
        for i, t in enumerate(spec.inputs):
            if t.kind == "act":
                k = (key_of[t.source], key_of[spec.name], i)
                edges[k] = edges.get(k, 0) + 1
    return edges


def solve_sharding(specs: Sequence[OpSpec], model: CostModel,
                   options: ShardOptions = ShardOptions(),
                   start: Optional[Dict[str, Strategy]] = None,
                   same_split: Sequence[Sequence[Tuple[str, int]]] = ()) -> ShardSolution:
    """Pick one strategy per operator minimising per-device memory (see module docstring).

    start: an optional known assignment ``{op name: Strategy}`` (e.g. the budget's reference
        baseline) given to CBC as its first incumbent: on graphs where CBC finds no feasible
        point within the time limit by itself, the solve then ends with a plan at least as
        good as the start (an op group takes its first member's strategy; a strategy pruned
        as dominated is replaced by the kept candidate of its layout with the least memory).

    same_split: groups of (op name, input index) uses of one tensor (``GraphOps.tied``, a
        tied embedding / LM head) that must be split identically at every use.
    specs: operators in topological order; every "act" input's source must be in ``specs``.
    Returns a :class:`ShardSolution`; an infeasible budget raises ValueError with the minimum.
    """
    t0 = time.perf_counter()
    names = {s.name for s in specs}
    for s in specs:
        for t in s.inputs:
            if t.kind == "act" and t.source not in names:
                raise ValueError(f"op {s.name!r} reads unknown op {t.source!r}.")
    # Step 1: op groups (tied repeated layers), candidates and their costs.
    groups = _groups(specs, model, options.tie)
    key_of = {m.name: k for k, g in groups.items() for m in g.members}
    edges = _edge_groups(specs, key_of)
    # Step 2: edge cost tables over (producer layout, consumer layout, keep option).
    edge_costs: Dict[Tuple[str, str, int], Dict[Tuple[int, int, int], Cost]] = {}
    self_costs: Dict[str, Dict[int, Cost]] = {}
    for (gu, gv, i), n in edges.items():
        U, V = groups[gu], groups[gv]
        table = {}
        for a, la in enumerate(U.layouts):
            for b, lb in enumerate(V.layouts):
                if gu == gv and a != b:
                    continue
                for o, c in enumerate(model.edge_options(U.rep, la, V.rep, lb, i)):
                    table[(a, b, o)] = c.scaled(n)
        if gu == gv:   # both ends share one strategy: fold into the node cost
            best: Dict[int, Cost] = {}
            for (a, _, _), c in table.items():
                if a not in best or c.memory < best[a].memory:
                    best[a] = c
            for a, c in best.items():
                self_costs.setdefault(gu, {})[a] = self_costs.get(gu, {}).get(a, Cost()) + c
        else:
            edge_costs[(gu, gv, i)] = table
    build = _Build(groups, edge_costs, self_costs, options)
    _add_same_split(build, groups, key_of, specs, model.mesh, same_split)
    if start is not None:
        build.warm_start(start)
    status = build.solve(options, minimise_comm=False)
    if status == "Infeasible":
        floor = _Build(groups, edge_costs, self_costs, options)
        _add_same_split(floor, groups, key_of, specs, model.mesh, same_split)
        floor.solve(options, minimise_comm=True)
        minimum = floor.comm_value()
        raise ValueError(f"communication budget {options.comm_budget_s:.6g} s per step is below "
                         f"the minimum feasible {minimum:.6g} s on mesh {model.mesh}; raise "
                         f"'comm_budget_s' to at least that.")
    if status != "Optimal":
        raise ValueError(f"the sharding ILP ended with status {status!r} within "
                         f"{options.time_limit_s} s; raise 'time_limit_s'.")
    sol = build.extract(groups)
    sol.solve_time_s = time.perf_counter() - t0
    logger.info("sharding ILP: %d groups, %d variables, %.2f GiB/device, %.4g s comm, %.2f s",
                sol.groups, sol.variables, sol.cost.memory / _GIB, sol.cost.comm_s,
                sol.solve_time_s)
    return sol


class _Build:
    """The PuLP model of one solve."""

    def __init__(self, groups, edge_costs, self_costs, options: ShardOptions) -> None:
        self.groups, self.edge_costs, self.self_costs = groups, edge_costs, self_costs
        self.prob = pulp.LpProblem("min_redundancy_sharding", pulp.LpMinimize)
        # s[g, c]: 1 if op group g uses candidate strategy c
        self.s = {(g, c): pulp.LpVariable(f"s_{gi}_{c}", cat="Binary")
                  for gi, (g, grp) in enumerate(groups.items()) for c in range(len(grp.cands))}
        # e[k, a, b, o]: 1 if edge group k joins producer layout a, consumer layout b, keep o
        self.e = {}
        for ki, (k, table) in enumerate(edge_costs.items()):
            two = any(o > 0 for (_, _, o) in table)
            for (a, b, o) in table:
                self.e[(k, a, b, o)] = pulp.LpVariable(
                    f"e_{ki}_{a}_{b}_{o}", lowBound=0, upBound=1,
                    cat="Binary" if two else "Continuous")
        self.cost_terms: List[Tuple[object, Cost]] = []
        for g, grp in groups.items():
            for c, cand in enumerate(grp.cands):
                cost = grp.node[c].scaled(len(grp.members))
                extra = self.self_costs.get(g, {}).get(grp.layouts.index(cand.layout))
                self.cost_terms.append((self.s[(g, c)], cost + extra if extra else cost))
        for (k, a, b, o), var in self.e.items():
            self.cost_terms.append((var, self.edge_costs[k][(a, b, o)]))
        self.mem = pulp.lpSum(v * ((c.memory + options.redundancy_weight * c.redundant) / _GIB)
                              for v, c in self.cost_terms)
        # the problem's own memory scale (every op at its largest candidate): the phase-2 row
        # is written in it, so CBC's absolute tolerances stay relative on a model of any size
        self.scale = _GIB / max(1.0, sum(max(c.memory for c in grp.node) * len(grp.members)
                                         for grp in groups.values()))
        self.comm = pulp.lpSum(v * c.comm_s for v, c in self.cost_terms if c.comm_s)
        # [Constraint] every op group picks exactly one strategy
        for g, grp in groups.items():
            self.prob += pulp.lpSum(self.s[(g, c)] for c in range(len(grp.cands))) == 1, f"one_{g}"
        # [Constraint] edge variables agree with the producer's and the consumer's layouts
        for ki, (k, table) in enumerate(edge_costs.items()):
            gu, gv, _ = k
            for side, grp, pos in (("u", groups[gu], 0), ("v", groups[gv], 1)):
                for a in range(len(grp.layouts)):
                    x = pulp.lpSum(self.s[(k[pos], c)] for c, cand in enumerate(grp.cands)
                                   if cand.layout == grp.layouts[a])
                    ev = pulp.lpSum(self.e[(k, *abo)] for abo in table if abo[pos] == a)
                    self.prob += ev == x, f"edge{ki}_{side}{a}"

    def solve(self, options: ShardOptions, minimise_comm: bool) -> str:
        if minimise_comm:
            self.prob.setObjective(self.comm + _TIE_BREAK * self.mem)
        elif options.objective == "weighted":
            self.prob.setObjective(self.mem + options.comm_weight_gib_per_s * self.comm)
        else:
            self.prob.setObjective(self.mem)
            if options.comm_budget_s is not None:
                # [Constraint] communication per step stays within the budget
                self.prob += self.comm <= options.comm_budget_s, "comm_budget"
        status = self._run(options)
        if status != "Optimal" or minimise_comm or options.objective == "weighted":
            return status
        # Phase 2 (lexicographic tie-break): the least communication among min-memory plans.
        best = float(pulp.value(self.mem))
        # [Constraint] memory stays at its optimum (phase 2 only)
        self.prob += (self.mem * self.scale <= best * self.scale * (1 + _TIE_BREAK) + 1e-9,
                      "memory_optimum")
        self.prob.setObjective(self.comm)
        return self._run(options)

    def warm_start(self, start: Dict[str, Strategy]) -> None:
        """Initial values of every variable from ``start`` (see ``solve_sharding``)."""
        layout_of: Dict[str, int] = {}
        for g, grp in self.groups.items():
            want = start.get(grp.members[0].name)
            if want is None:
                return
            if want in grp.cands:
                c = grp.cands.index(want)
            else:
                same = [i for i, cand in enumerate(grp.cands) if cand.layout == want.layout]
                if not same:
                    return
                c = min(same, key=lambda i: grp.node[i].memory)
            for i in range(len(grp.cands)):
                self.s[(g, i)].setInitialValue(1 if i == c else 0)
            layout_of[g] = grp.layouts.index(grp.cands[c].layout)
        for (k, a, b, o), var in self.e.items():
            var.setInitialValue(1 if (a, b, o) == (layout_of[k[0]], layout_of[k[1]], 0) else 0)
        self.warm = True

    def _run(self, options: ShardOptions) -> str:
        solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=options.time_limit_s, threads=1,
                                   warmStart=getattr(self, "warm", False),
                                   gapRel=options.mip_gap)
        self.prob.solve(solver)
        return pulp.LpStatus[self.prob.status]

    def comm_value(self) -> float:
        return float(pulp.value(self.comm) or 0.0)

    def extract(self, groups) -> ShardSolution:
        strategies: Dict[str, Strategy] = {}
        total = Cost()
        for v, c in self.cost_terms:
            if (v.value() or 0) > 0.5:
                total = total + c
        for g, grp in groups.items():
            chosen = [c for c in range(len(grp.cands)) if (self.s[(g, c)].value() or 0) > 0.5]
            assert len(chosen) == 1, (g, chosen)
            for m in grp.members:
                strategies[m.name] = grp.cands[chosen[0]]
        keep = sorted(f"{k[0]}->{k[1]}:{k[2]}" for (k, a, b, o), v in self.e.items()
                      if o == 1 and (v.value() or 0) > 0.5)
        return ShardSolution(strategies, total, 0.0, "Optimal", len(groups),
                             len(self.s) + len(self.e), keep)
