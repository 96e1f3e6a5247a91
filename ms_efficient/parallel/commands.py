"""``ms-efficient plan bundle CONFIG --out DIR``: plan the reference model of a run config with
the config's passes (``optimize.passes``, which must include shard and/or place), check the
plans build MindSpore's ``AutoParallel`` (``parallelize``, constructed, not compiled) and write
the launch bundle (``ms_efficient.parallel.bundle``).

A pass that refuses (``optimize`` records ``{"refused": reason}``) is printed as a note and left
out of the bundle; when neither shard nor place applied there is nothing to launch and the
command fails (exit 2) naming every refusal: no silent no-op."""
from __future__ import annotations

import argparse
import os

from ms_efficient.core.argtypes import positive_int

__all__ = ["add_bundle_arguments", "run_bundle"]


def add_bundle_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="run config YAML (model, moe, train, cluster, optimize); "
                                       "optimize.passes must include shard and/or place")
    parser.add_argument("--out", required=True, help="bundle folder to write")
    parser.set_defaults(out_is_folder=True)
    parser.add_argument("--devices", type=positive_int,
                        help="ranks of the job (default: the config's cluster)")
    parser.add_argument("--command", help="training command msrun runs on every rank "
                                          "(default: MindFormers' run_mindformer.py with run.yaml)")


def run_bundle(args: argparse.Namespace) -> int:
    import numpy as np
    import mindspore as ms
    from mindspore import Tensor

    import ms_efficient
    from ms_efficient.core import backend
    from ms_efficient.core.registry import applied_plans, refusals
    from ms_efficient.core.config import load_config
    from ms_efficient.models.gpt_moe import build_model
    from ms_efficient.parallel.bundle import write_bundle
    from ms_efficient.parallel.settings import summary_rows

    if os.path.isfile(args.out):
        raise ValueError(f"'--out' must be a folder, but '{args.out}' is a file.")
    cfg = load_config(args.config)
    wanted = {"shard", "place"} & set(cfg.optimize.passes)
    if not wanted:
        raise ValueError(f"'optimize.passes' of {args.config} is {list(cfg.optimize.passes)}; "
                         f"a launch bundle needs the shard and/or place pass.")
    cluster = cfg.cluster_spec()
    ms.set_context(mode=ms.GRAPH_MODE)
    backend.use_device(cfg.context.device_target)
    ms.set_seed(cfg.context.seed)
    batch, seq = cfg.train.batch_size, cfg.model.seq_length
    net = build_model(cfg.model, cfg.moe, batch)
    tokens = Tensor(np.zeros((batch, seq), np.int32))
    network, plans = ms_efficient.optimize(net, cfg, sample_inputs=(tokens, tokens))
    if not wanted & set(applied_plans(plans)):
        why = "; ".join(f"{name} refused: {reason}" for name, reason in refusals(plans).items()
                        if name in wanted)
        raise ValueError(f"'optimize.passes' of {args.config} is {list(cfg.optimize.passes)}, "
                         f"but no pass a launch bundle needs applied ({why}); there is nothing "
                         f"to launch.")
    wrapper = ms_efficient.parallelize(network, plans, (tokens, tokens),
                                       devices=args.devices or cluster.num_devices)
    moe = {"num_experts": cfg.moe.num_experts, "top_k": cfg.moe.top_k,
           "capacity_factor": cfg.moe.capacity_factor, "aux_loss_coef": cfg.moe.aux_loss_coef,
           "moe_layers": len(getattr(net, "moe_index", ()))}
    bundle = write_bundle(args.out, plans, wrapper.settings, cluster.devices_per_node, moe=moe,
                          tokens_per_step=batch * seq, command=args.command)
    for name, value in summary_rows(wrapper.settings):
        print(f"{name:>24}: {value}")
    for note in bundle.notes:
        print(f"note: {note}")
    for name, path in bundle.files.items():
        print(f"wrote {path}")
    return 0
