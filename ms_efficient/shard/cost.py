"""Per-device memory and communication of an operator strategy, and of resharding on an edge.

Units: bytes per device, seconds per training step (forward + backward + optimizer step of
one batch, collectives not overlapped with compute nor with each other).

Memory convention (mixed-precision Adam, Rajbhandari et al. 2020 "ZeRO", K = 12): every
parameter element costs 2 B (fp16/bf16 weight) + 2 B (fp16/bf16 gradient) + 12 B (fp32
master weight, Adam m and v). ZeRO level z of a strategy shards, over the parameter's replica
group R (the mesh axes that do not split the parameter): z>=1 the 12 B, z>=2 the gradient,
z=3 the weight. Kept activations follow Korthikanti et al. 2022: 2 B per element of every
tensor backward reads, 1 B per element of a dropout mask; transient buffers are not counted.

Communication (alpha-beta, :meth:`ClusterSpec.collective_time_s`):
  * op output partial over an axis (a contracted dim split): all-reduce, or reduce-scatter
    onto ``layout.scatter`` plus an all-gather of the output gradient in backward;
  * parameter gradients partial over axes Q: z=0 all-reduce over Q; z=1,2 reduce-scatter over
    Q + all-gather of the updated weights over R; z=3 reduce-scatter + 2 all-gathers (forward
    and backward) of the weights;
  * edge u -> v whose placements differ along an axis: split->replicated all-gather (backward
    free), replicated->split free (backward all-gather), split->split on another dim
    all-to-all both ways; an input gradient partial over an axis is all-reduced (producer
    replicated there) or reduce-scattered (producer split there) on the edge.
A consumer that keeps its input for backward may keep it in the producer's finer split and
gather it again in backward (Korthikanti's sequence-parallel trick): a second edge option.

Redundant share of an item held identically on ``rep`` devices: ``bytes * (1 - 1/rep)``
(what a perfect 1/N split would save).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from ms_efficient.shard.strategies import (AXES, Layout, Mesh, OpSpec, Strategy, output_placement,
                                           placement, shard_factor)

__all__ = ["Precision", "ADAM_MIXED", "Cost", "CostModel", "evaluate", "SAVED_POLICIES"]

SAVED_POLICIES = ("min_memory", "producer", "consumer")


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter element: weight, gradient, optimizer states (+ fp32 master)."""

    param_bytes: int = 2
    grad_bytes: int = 2
    optim_bytes: int = 12


ADAM_MIXED = Precision()


@dataclass(frozen=True)
class Cost:
    """Per-device bytes by kind, the redundant share of them, and communication seconds."""

    params: float = 0.0
    grads: float = 0.0
    optim: float = 0.0
    acts: float = 0.0
    redundant: float = 0.0
    comm_s: float = 0.0

    @property
    def memory(self) -> float:
        """Per-device bytes: params + grads + optimizer states + kept activations."""
        return self.params + self.grads + self.optim + self.acts

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def scaled(self, k: float) -> "Cost":
        return Cost(*(getattr(self, f.name) * k for f in fields(self)))

    def as_dict(self) -> Dict[str, float]:
        d = {f.name: float(getattr(self, f.name)) for f in fields(self)}
        d["memory"] = float(self.memory)
        return d


class CostModel:
    """Costs of strategies on one mesh of one cluster (collective times are cached)."""

    def __init__(self, mesh: Mesh, cluster, precision: Precision = ADAM_MIXED) -> None:
        if cluster.num_devices < mesh.devices:
            raise ValueError(f"mesh {mesh} needs {mesh.devices} devices but cluster "
                             f"'{cluster.name}' has {cluster.num_devices}.")
        self.mesh = mesh
        self.cluster = cluster
        self.precision = precision
        self._cache: Dict[Tuple[str, float, Tuple[str, ...]], float] = {}

    # ---- collectives ----------------------------------------------------------------------
    def coll(self, kind: str, nbytes: float, axes: Iterable[str]) -> float:
        """Seconds of collective ``kind`` over device 0's group along ``axes`` (nbytes per the
        :mod:`ms_efficient.core.collectives` convention)."""
        axes = tuple(a for a in AXES if a in set(axes) and self.mesh.size(a) > 1)
        if not axes or nbytes <= 0:
            return 0.0
        key = (kind, float(nbytes), axes)
        if key not in self._cache:
            self._cache[key] = self.cluster.collective_time_s(kind, nbytes, self.mesh.group(axes))
        return self._cache[key]

    def _rep(self, pl: Sequence[Optional[str]]) -> int:
        return self.mesh.devices // shard_factor(pl, self.mesh)

    @staticmethod
    def _red(nbytes: float, rep: int) -> float:
        return nbytes * (1.0 - 1.0 / rep)

    # ---- operator ---------------------------------------------------------------------------
    def node_cost(self, spec: OpSpec, strategy: Strategy) -> Cost:
        """Parameters, their gradients/optimizer states, kept outputs/masks/graph inputs, the
        op's own output reduction and its gradient synchronisation, per device."""
        mesh, prec, lay = self.mesh, self.precision, strategy.layout
        params = grads = optim = acts = red = comm = 0.0
        # Step 1: output reduction of a split contracted dim.
        pre = placement(spec, lay, spec.out)
        post = output_placement(spec, lay)
        out_full = spec.elems(spec.out) * spec.out_bytes
        for axis in AXES:
            if lay.axis_dim(axis) in spec.contract and mesh.size(axis) > 1:
                buf = out_full / shard_factor(pre, mesh)
                if axis == "mp" and lay.scatter is not None:
                    comm += self.coll("reduce_scatter", buf, [axis]) + self.coll("allgather", buf, [axis])
                else:
                    comm += self.coll("allreduce", buf, [axis])
        # Step 2: what backward keeps from this op itself.
        if "out" in spec.saves or "mask" in spec.saves:
            out_elems = spec.elems(spec.out) / shard_factor(post, mesh)
            kept = out_elems * (spec.out_bytes if "out" in spec.saves else 0)
            kept += out_elems * (1 if "mask" in spec.saves else 0)
            acts += kept
            red += self._red(kept, self._rep(post))
        for i, t in enumerate(spec.inputs):
            pl = placement(spec, lay, t.dims)
            dev_elems = spec.elems(t.dims) / shard_factor(pl, mesh)
            if t.kind == "input" and f"in{i}" in spec.saves:
                acts += dev_elems * t.dtype_bytes
                red += self._red(dev_elems * t.dtype_bytes, self._rep(pl))
            if t.kind != "param":
                continue
            # Step 3: parameter, gradient, optimizer state and gradient synchronisation.
            replica = [a for a in AXES if pl[AXES.index(a)] is None and mesh.size(a) > 1]
            partial = [a for a in AXES if lay.axis_dim(a) is not None and pl[AXES.index(a)] is None]
            r = 1
            for a in replica:
                r *= mesh.size(a)
            z = strategy.zero
            p_b = dev_elems * prec.param_bytes / (r if z >= 3 else 1)
            g_b = dev_elems * prec.grad_bytes / (r if z >= 2 else 1)
            o_b = dev_elems * prec.optim_bytes / (r if z >= 1 else 1)
            params, grads, optim = params + p_b, grads + g_b, optim + o_b
            for nbytes, sharded in ((p_b, z >= 3), (g_b, z >= 2), (o_b, z >= 1)):
                red += self._red(nbytes, 1 if sharded else r)
            grad_buf = dev_elems * prec.grad_bytes
            if z == 0:
                comm += self.coll("allreduce", grad_buf, partial)
            else:
                gathers = 2 if z == 3 else 1
                comm += self.coll("reduce_scatter", grad_buf, partial)
                comm += gathers * self.coll("allgather", dev_elems * prec.param_bytes, replica)
        return Cost(params, grads, optim, acts, red, comm)

    # ---- edge -------------------------------------------------------------------------------
    def edge_options(self, producer: OpSpec, lu: Layout, consumer: OpSpec, lv: Layout,
                     index: int) -> List[Cost]:
        """Costs of feeding ``producer``'s output (layout ``lu``) into input ``index`` of
        ``consumer`` (layout ``lv``): resharding both ways, input-gradient reduction, and the
        kept input when the consumer saves it. One entry per way of keeping the input."""
        mesh = self.mesh
        t = consumer.inputs[index]
        rename = dict(t.rename)
        p_pl = output_placement(producer, lu)
        q_pl = placement(consumer, lv, t.dims, rename)
        full = consumer.elems(t.dims) * t.dtype_bytes
        fwd = bwd = 0.0
        for k, axis in enumerate(AXES):
            if mesh.size(axis) == 1:
                continue
            p, q = p_pl[k], q_pl[k]
            other = 1
            for j, b in enumerate(AXES):
                if j != k and (p_pl[j] is not None or q_pl[j] is not None):
                    other *= mesh.size(b)
            nbytes = full / other
            partial = lv.axis_dim(axis) is not None and q is None
            if partial:
                bwd += self.coll("allreduce" if p is None else "reduce_scatter", nbytes, [axis])
            if p == q:
                continue
            if q is None:
                fwd += self.coll("allgather", nbytes, [axis])
            elif p is None:
                bwd += self.coll("allgather", nbytes, [axis])
            else:
                fwd += self.coll("alltoall", nbytes / mesh.size(axis), [axis])
                bwd += self.coll("alltoall", nbytes / mesh.size(axis), [axis])
        if f"in{index}" not in consumer.saves:
            return [Cost(comm_s=fwd + bwd)]
        kept = full / shard_factor(q_pl, mesh)
        options = [Cost(acts=kept, redundant=self._red(kept, self._rep(q_pl)), comm_s=fwd + bwd)]
        finer = all(q is None or q == p for p, q in zip(p_pl, q_pl))
        if finer and shard_factor(p_pl, mesh) > shard_factor(q_pl, mesh):
            kept_p = full / shard_factor(p_pl, mesh)
            # keep the producer's finer split; backward repeats the forward gather
            options.append(Cost(acts=kept_p, redundant=self._red(kept_p, self._rep(p_pl)),
                                comm_s=2 * fwd + bwd))
        return options


def _pick(options: List[Cost], policy: str) -> Cost:
    if policy == "consumer":
        return options[0]
    if policy == "producer":
        return options[-1]
    return min(options, key=lambda c: (c.memory, c.comm_s))


def evaluate(specs: Sequence[OpSpec], strategies: Mapping[str, Strategy], model: CostModel,
             saved: str = "min_memory") -> Cost:
    """Total per-device cost of a full assignment ``{op name: Strategy}``.

    saved: how a consumer keeps an input that its producer splits more finely: "consumer"
        (in the consumer's layout), "producer" (finer split, re-gathered in backward, as
        Megatron sequence parallelism does) or "min_memory" (the smaller of the two).
    """
    if saved not in SAVED_POLICIES:
        raise ValueError(f"'saved' must be one of {list(SAVED_POLICIES)}, but got {saved!r}.")
    by_name = {s.name: s for s in specs}
    missing = sorted(set(by_name) - set(strategies))
    if missing:
        raise ValueError(f"no strategy for ops {missing[:5]}{'...' if len(missing) > 5 else ''}.")
    total = Cost()
    for spec in specs:
        st = strategies[spec.name]
        total = total + model.node_cost(spec, st)
        for i, t in enumerate(spec.inputs):
            if t.kind == "act":
                prod = by_name[t.source]
                opts = model.edge_options(prod, strategies[prod.name].layout, spec, st.layout, i)
                total = total + _pick(opts, saved)
    return total
