"""Expert parallelism for your own MoE network, in your own msrun script.

A small language model with a Mixtral-style or a DeepSeek-V3-style MoE block, written in
MindSpore the way their public model code writes them, trained with EfficientMoE's balanced
expert-parallel layer on W ranks:

    msrun --worker_num 2 --local_worker_num 2 --master_port 8118 --log_dir runs/ep_log \
        --join True examples/moe_expert_parallel.py --model mixtral --out runs/ep_mixtral

    python examples/moe_expert_parallel.py --model mixtral --out runs/one   # one process

The three lines that make it expert-parallel (see ``train``), and the callback that re-places
the home experts during ``Model.train`` (``--replan-every``)::

    init()                                                  # mindspore.communication
    net, report = ms_efficient.adopt_moe(net, tokens=T, expert_parallel=True)
    step = ms_efficient.TrainOneStepCell(net, optimizer)    # instead of nn.TrainOneStepCell
    Model(step).train(1, dataset, callbacks=[ms_efficient.EfficientMoECallback(net, em)])

Every rank trains on its rows of the same global batch; the mean of the ranks' losses is the
one-process loss of that batch, step for step. The router is started with one favoured
expert (``--hot``), so EfficientMoE's fast level copies it into spare slots on other ranks
every step. With ``--replan-every N`` the slow level checks every N steps whether new home
tables pay for moving the experts (``--force-replan-step S`` moves them at step S whatever
the gain: the run goes on equal to one process). Each rank writes ``losses_rank<r>.json``
(its loss, the copies made and the rows dropped per step, the home re-plans and every check's
verdict) into ``--out``, and ``model.ckpt`` there, the trained network in its own
layout and names with the optimizer's state in the names it has on the original network
(``ms_efficient.save_moe_checkpoint(net, path, optimizer)``): ``--load`` it to continue on any
number of ranks (``ms_efficient.load_moe_optimizer_state`` after the optimizer is built).
"""
import argparse
import json
import os

import numpy as np
import mindspore as ms
import mindspore.dataset as ds
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Normal, initializer
from mindspore.train import Callback, Model

import ms_efficient
from ms_efficient.core.config import EfficientMoEConfig

VOCAB, SEQ, H, F, E, K = 64, 16, 32, 32, 8, 2


class GatedMLP(nn.Cell):
    """down(silu(gate x) * up x), the experts of Mixtral (w1 gate, w3 up, w2 down) and
    DeepSeek (gate_proj, up_proj, down_proj)."""

    def __init__(self, hidden, ffn, names=("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        self.names = names
        for name, shape in zip(names, ((hidden, ffn), (hidden, ffn), (ffn, hidden))):
            setattr(self, name, nn.Dense(*shape, has_bias=False, weight_init=Normal(0.2)))
        self.act_fn = nn.SiLU()

    def construct(self, x):
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(self.act_fn(gate(x)) * up(x))


def combine(x_TH, experts, ids_TK, weights_TK):
    """sum_k weights[t, k] * expert_ids[t, k](x_t) (every expert on every token, masked: the
    plain reference form of a model's own code)."""
    out = ops.zeros_like(x_TH)
    for e, expert in enumerate(experts):
        w_T = (weights_TK * (ids_TK == e).astype(weights_TK.dtype)).sum(axis=1, keepdims=True)
        out = out + w_T * expert(x_TH)
    return out


class MixtralSparseMoeBlock(nn.Cell):
    """Mixtral: a gate Dense H -> E without bias, top-2 of the softmax renormalised, SwiGLU
    experts w1 / w3 / w2."""

    def __init__(self):
        super().__init__()
        self.num_experts_per_tok = K
        self.gate = nn.Dense(H, E, has_bias=False, weight_init=Normal(0.2))
        self.experts = nn.CellList([GatedMLP(H, F, ("w1", "w3", "w2")) for _ in range(E)])

    def construct(self, x):
        b, s, h = x.shape
        x_TH = x.reshape(b * s, h)
        weights, ids = ops.topk(ops.softmax(self.gate(x_TH), -1), K)
        weights = weights / weights.sum(axis=-1, keepdims=True)
        return combine(x_TH, self.experts, ids, weights).reshape(b, s, h)


class MoEGate(nn.Cell):
    """DeepSeek-V3's gate: sigmoid scores, selection on scores + e_score_correction_bias within
    the best topk_group of n_group groups (a group's score: its two best), weights the chosen
    scores renormalised times routed_scaling_factor."""

    def __init__(self):
        super().__init__()
        self.top_k, self.n_group, self.topk_group = K, 4, 2
        self.routed_scaling_factor = 2.5
        self.scoring_func, self.topk_method, self.norm_topk_prob = "sigmoid", "noaux_tc", True
        self.weight = Parameter(initializer(Normal(0.2), (E, H), ms.float32), name="weight")
        self.e_score_correction_bias = Parameter(Tensor(np.zeros(E, np.float32)),
                                                 name="e_score_correction_bias",
                                                 requires_grad=False)

    def construct(self, x_TH):
        scores = ops.sigmoid(ops.matmul(x_TH, self.weight.T))
        select = scores + self.e_score_correction_bias.reshape(1, -1)
        t = select.shape[0]
        group_scores = ops.topk(select.reshape(t, self.n_group, -1), 2)[0].sum(axis=-1)
        _, kept = ops.topk(group_scores, self.topk_group)
        mask = ops.tensor_scatter_elements(ops.zeros((t, self.n_group), ms.float32), kept,
                                           ops.ones_like(kept, dtype=ms.float32), 1)
        mask = ops.broadcast_to(mask.reshape(t, self.n_group, 1),
                                (t, self.n_group, E // self.n_group)).reshape(t, E)
        _, ids = ops.topk(ops.select(mask > 0, select, ops.full_like(select, -1e9)), self.top_k)
        weights = ops.gather_elements(scores, 1, ids)
        weights = weights / weights.sum(axis=-1, keepdims=True)
        return ids, weights * self.routed_scaling_factor


class DeepseekV3MoE(nn.Cell):
    """DeepSeek-V3: the gate above, SwiGLU routed experts and a shared expert added."""

    def __init__(self):
        super().__init__()
        self.gate = MoEGate()
        self.experts = nn.CellList([GatedMLP(H, F) for _ in range(E)])
        self.shared_experts = GatedMLP(H, F)

    def construct(self, x):
        b, s, h = x.shape
        x_TH = x.reshape(b * s, h)
        ids, weights = self.gate(x_TH)
        y = combine(x_TH, self.experts, ids, weights) + self.shared_experts(x_TH)
        return y.reshape(b, s, h)


class TinyLM(nn.Cell):
    """Embedding -> x + moe(norm(x)) -> norm -> logits [B * S, V]."""

    def __init__(self, block):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, H, embedding_table=Normal(1.0))
        self.norm = nn.LayerNorm((H,))
        self.moe = block
        self.norm_out = nn.LayerNorm((H,))
        self.head = nn.Dense(H, VOCAB, has_bias=False, weight_init=Normal(0.2))

    def construct(self, ids):
        x = self.embed(ids)
        x = x + self.moe(self.norm(x))
        return self.head(self.norm_out(x)).reshape(-1, VOCAB)


BLOCKS = {"mixtral": MixtralSparseMoeBlock, "deepseek": DeepseekV3MoE}


def build(model: str, hot: float, seed: int = 0) -> nn.Cell:
    """The loss network, the same on every rank (seeded); the router's row of expert 0 gets
    ``hot`` x the mean normalised token direction, so expert 0 starts hot."""
    ms.set_seed(seed)
    lm = TinyLM(BLOCKS[model]())
    router = lm.moe.gate.weight
    table = lm.embed.embedding_table.asnumpy()
    mean = table.mean(axis=0)
    row = router.asnumpy()
    row[0] += hot * mean / np.linalg.norm(mean)
    router.set_data(Tensor(row))
    return nn.WithLossCell(lm, nn.CrossEntropyLoss())


def global_batch(step: int, batch: int):
    """(ids [batch, SEQ], labels [batch * SEQ]) of ``step``: the same on every rank; the next
    token of a fixed random walk over the vocabulary (learnable)."""
    rng = np.random.default_rng(1000 + step)
    start = rng.integers(0, VOCAB, (batch, 1))
    walk = (start + np.cumsum(rng.integers(1, 3, (batch, SEQ + 1)), axis=1)) % VOCAB
    return walk[:, :SEQ].astype(np.int32), walk[:, 1:].reshape(-1).astype(np.int32)


def train(args) -> None:
    ms.set_context(mode=ms.GRAPH_MODE, device_target=args.device_target)
    distributed = "MS_WORKER_NUM" in os.environ or "RANK_SIZE" in os.environ
    if distributed:                                        # launched by msrun
        from mindspore.communication import get_group_size, get_rank, init

        init()
        world, rank = get_group_size(), get_rank()
    else:
        world, rank = 1, 0
    if args.batch % world:
        raise SystemExit(f"--batch ({args.batch}) must be divisible by the {world} ranks.")
    local = args.batch // world
    net = build(args.model, args.hot)
    if args.load:                        # the original network's checkpoint, any world size
        missing, _ = ms.load_param_into_net(net, ms.load_checkpoint(args.load))
        if missing:
            raise SystemExit(f"--load {args.load}: no values for {missing}")
    if distributed:
        net, report = ms_efficient.adopt_moe(net, tokens=local * SEQ, expert_parallel=True,
                                             buffer_slack=args.buffer_slack)
    else:          # one process: the same function, dropless, all experts here
        net, report = ms_efficient.adopt_moe(net, tokens=local * SEQ, dispatch="grouped")
    optimizer = nn.AdamWeightDecay(net.trainable_params(), learning_rate=args.lr,
                                   weight_decay=0.0)
    if args.load:                        # its optimizer state: the moments and the step count
        ms_efficient.load_moe_optimizer_state(net, optimizer, args.load)
    step = (ms_efficient.TrainOneStepCell(net, optimizer) if distributed
            else nn.TrainOneStepCell(net, optimizer))
    layer = next(c for _, c in net.cells_and_names() if hasattr(c, "routing_counts"))
    rows = []

    class StepLog(Callback):
        """Each step's loss and the fast level's figures: copies, rows dropped, rows kept,
        then the rows every device computed (the same on every rank)."""

        def on_train_step_end(self, run_context):
            loss = float(run_context.original_args().net_outputs.asnumpy())
            stats = (layer.balance_stats.asnumpy().tolist()
                     if hasattr(layer, "balance_stats") else [0, 0, 0])
            rows.append({"step": len(rows) + 1, "loss": loss, "copies": int(stats[0]),
                         "dropped": int(stats[1]), "rows_per_device": stats[3:]})
            if rank == 0:
                print(f"step {len(rows)}: loss {loss:.5f} (rank 0) copies {stats[0]} "
                      f"dropped {stats[1]} rows per device {stats[3:]}", flush=True)

    callbacks = [StepLog()]
    efficient = None
    if distributed and args.replan_every:
        em = EfficientMoEConfig(enabled=True, warmup_steps=3, replan_every=args.replan_every,
                                window=max(3, args.replan_every),
                                force_replan_step=args.force_replan_step)
        efficient = ms_efficient.EfficientMoECallback(net, em)
        callbacks.insert(0, efficient)
    batches = []                                            # this rank's rows of each batch
    for i in range(args.steps):
        ids, labels = global_batch(i, args.batch)
        batches.append((ids[rank * local:(rank + 1) * local],
                        labels[rank * local * SEQ:(rank + 1) * local * SEQ]))
    dataset = ds.GeneratorDataset(batches, ["ids", "labels"], shuffle=False)
    Model(step).train(1, dataset, callbacks=callbacks, dataset_sink_mode=False)
    os.makedirs(args.out, exist_ok=True)
    checkpoint = os.path.join(args.out, "model.ckpt")
    if distributed:
        ms_efficient.save_moe_checkpoint(net, checkpoint, optimizer)  # collective; rank 0 writes
    else:                                    # the network's Parameters and the optimizer's
        ms.save_checkpoint(step, checkpoint)
    path = os.path.join(args.out, f"losses_rank{rank}.json")
    with open(path + ".tmp", "w") as fh:
        json.dump({"world": world, "model": args.model, "steps": rows,
                   "blocks": {p: str(b) for p, b in report.items()},
                   "replans": efficient.plans if efficient else [],
                   "replan_checks": efficient.checks if efficient else []}, fh)
    os.replace(path + ".tmp", path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(BLOCKS), default="mixtral")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=128, help="global batch (sequences)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--hot", type=float, default=4.0,
                        help="how strongly the router starts favouring expert 0")
    parser.add_argument("--buffer-slack", type=float, default=1.0,
                        help="receive buffers: the mean share x (1 + this)")
    parser.add_argument("--device-target", default="CPU")
    parser.add_argument("--replan-every", type=int, default=0, metavar="N",
                        help="W > 1: EfficientMoECallback checks the home experts every N "
                             "steps (0: no slow level)")
    parser.add_argument("--force-replan-step", type=int, default=0, metavar="S",
                        help="with --replan-every: move the home experts at step S whatever "
                             "the gain")
    parser.add_argument("--load", help="a model.ckpt of an earlier run to start from")
    parser.add_argument("--out", required=True)
    train(parser.parse_args(argv))


if __name__ == "__main__":
    main()
