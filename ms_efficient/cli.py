"""The ``ms-efficient`` command.

    ms-efficient train CONFIG [--steps N] [--out DIR] [--overwrite]
                                                         train the reference MoE model
    ms-efficient train --resume DIR [--steps N]          continue a run from its checkpoint
    ms-efficient train CONFIG --workers W [--out DIR]    expert-parallel over W msrun ranks
    ms-efficient train --resume DIR --workers N          continue an expert-parallel run on N
                                                         ranks (1: one process)
    ms-efficient checkpoint export DIR --out FILE.ckpt   one checkpoint of the one-process model
    ms-efficient graph CONFIG_OR_FILE [--mode M] [--out graph.json]
    ms-efficient report RUN_DIR                          rebuild a run's report.md and plots
    ms-efficient plan KIND ...                           run a planner, write plan YAML
    ms-efficient plan bundle CONFIG --out DIR            strategy file, MindFormers YAML and
                                                         msrun script of a cluster run
    ms-efficient bench KIND [--quick] --json OUT         benchmark a planner against baselines

Each planner kind lives in its own ``commands`` module (see ``PLANNER_COMMANDS``) that offers
``add_plan_arguments(parser)``, ``run_plan(args) -> int``, ``add_bench_arguments(parser)`` and
``run_bench(args) -> int``; the module is imported when the parser is built, so it must not
import MindSpore at module level.

Bad input (config, trace, graph) prints one line ``ms-efficient: error: ...`` and exits 2,
without writing anything.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import math
import os
import sys
from typing import List, Optional

from ms_efficient.core.argtypes import positive_int as _positive_int

__all__ = ["main"]

logger = logging.getLogger("ms_efficient")


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors (bad option values included) are one line, exit 2;
    sub-command parsers inherit it."""

    def error(self, message: str):
        self.exit(2, f"ms-efficient: error: {self.prog}: {message}\n")


def _cmd_train(args: argparse.Namespace) -> int:
    from ms_efficient.train.trainer import train

    if args.resume and args.config:
        raise ValueError("give either CONFIG or --resume DIR, not both.")
    if not args.resume and not args.config:
        raise ValueError("train needs CONFIG (a YAML file) or --resume DIR.")
    if args.resume and args.overwrite:
        raise ValueError("give either --resume DIR (continue the run) or --overwrite "
                         "(replace it), not both.")
    overrides, transient = {}, {}
    if args.efficientmoe is not None:
        overrides["efficientmoe.enabled"] = args.efficientmoe == "on"
    workers = args.workers
    if args.resume:
        from ms_efficient.train.ep_launch import is_expert_parallel_run, saved_world_size

        saved = saved_world_size(args.resume)
        if workers == 1 and is_expert_parallel_run(args.resume):
            # the one-process trainer continues it: its moe.dispatch (balanced) runs as
            # dropless grouped experts there, and one device has no experts to place
            logger.info("resuming the %d-rank run %s in one process (grouped experts, "
                        "efficientmoe off)", saved, args.resume)
            transient["efficientmoe.enabled"] = False     # not recorded in config.yaml
        workers = saved if workers is None else workers
        # --steps is the total the run trains to (train.steps), on one process and on
        # --workers alike; a total already reached would train nothing: refuse it before any
        # work or file (a resume without --steps of a finished run says so and writes nothing)
        from ms_efficient.train import checkpoint as run_ckpt
        from ms_efficient.train.ep_launch import load_run_config

        if (os.path.isfile(run_ckpt.state_path(args.resume))
                and os.path.isfile(os.path.join(args.resume, "config.yaml"))):
            total = args.steps or load_run_config(args.resume).train.steps
            reached = int(run_ckpt.read_state(args.resume)["step"])
            if total <= reached:
                from ms_efficient.train.logical_state import read_run

                reached = read_run(args.resume).step   # the step the resume would load
            if total <= reached and args.steps is not None:
                raise ValueError(
                    f"--steps {args.steps} is the total step count the run trains to, not "
                    f"steps to add, but '{args.resume}' has already reached step {reached}: "
                    f"nothing would be trained. Pass --steps N with N > {reached} (--steps "
                    f"{reached + args.steps} trains {args.steps} more).")
            if total <= reached:
                raise ValueError(
                    f"nothing to train: '{args.resume}' has already reached step {reached}, "
                    f"its train.steps ({total}); nothing was written. To train further pass "
                    f"--steps N with N > {reached}, the total to train to.")
    if (workers or 1) > 1:
        return _train_expert_parallel(args, workers)
    result = train(args.config, out_dir=args.out, steps=args.steps, resume=args.resume,
                   overrides=overrides, overwrite=args.overwrite, transient=transient)
    drop = result.first_val_loss - result.final_val_loss
    print(f"run folder: {result.out_dir}")
    print(f"validation loss: {result.first_val_loss:.4f} -> {result.final_val_loss:.4f} "
          f"nats/byte ({drop:+.4f} fallen) after {result.steps} steps")
    if math.isfinite(result.step_time_s):      # NaN when this process trained no step
        print(f"measured step time {result.step_time_s * 1e3:.1f} ms "
              f"({result.tokens_per_s:.0f} tokens/s, MindSpore GRAPH_MODE on CPU)")
    print(f"report: {os.path.join(result.out_dir, 'report.md')}")
    return 0


def _train_expert_parallel(args: argparse.Namespace, workers: int) -> int:
    """``train --workers W``: W msrun ranks on this machine (ms_efficient.train.ep_launch)."""
    import json

    from ms_efficient.train.ep_launch import launch
    from ms_efficient.train.report import write_report

    out = launch(workers, args.config, out=args.out, steps=args.steps, resume=args.resume,
                 efficientmoe=args.efficientmoe, overwrite=args.overwrite)
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    vals = [r for r in rows if r["kind"] == "val"]
    replans = [r for r in rows if r["kind"] == "replan"]
    print(f"run folder: {out} ({workers} expert-parallel ranks)")
    if vals:
        print(f"validation loss: {vals[0]['val_loss']:.4f} -> {vals[-1]['val_loss']:.4f} "
              f"nats/byte after {vals[-1]['step']} steps")
    declined = [r for r in rows if r["kind"] == "replan_check" and not r["adopted"]]
    print(f"re-plans: {len(replans)}" + "".join(
        f"; step {r['step']}: {r['moved_slots']} slots, {r['moved_bytes']} bytes moved, "
        f"recompiled {str(r.get('recompiled')).lower()}" for r in replans)
        + (f" ({len(declined)} checks declined; the last, step {declined[-1]['step']}: "
           f"{declined[-1]['reason']})" if declined else ""))
    print(f"report: {write_report(out)}")
    return 0


def _cmd_checkpoint_export(args: argparse.Namespace) -> int:
    """``checkpoint export RUN --out FILE``: the run's latest state as one checkpoint of the
    one-process reference model (ms_efficient.train.logical_state)."""
    from ms_efficient.train.logical_state import export_checkpoint

    if not args.out.endswith(".ckpt"):
        raise ValueError(f"'--out' must name a .ckpt file, but got '{args.out}'.")
    done = export_checkpoint(args.run_dir, args.out, optimizer=args.optimizer)
    print(f"exported step {done['step']} of {args.run_dir} (world_size {done['world_size']}): "
          f"{done['parameters']} parameters of the one-process model in {done['path']}")
    return 0


def _graph_from_config(path: str, mode: str):
    import numpy as np
    import mindspore as ms
    from mindspore import Tensor, nn

    from ms_efficient.core import backend
    from ms_efficient.core.config import load_config
    from ms_efficient.graph import from_network
    from ms_efficient.models.gpt_moe import build_model

    cfg = load_config(path)
    ms.set_context(mode=ms.GRAPH_MODE)
    backend.use_device(cfg.context.device_target)
    ms.set_seed(cfg.context.seed)
    net = build_model(cfg.model, cfg.moe, cfg.train.batch_size)
    shape = (cfg.train.batch_size, cfg.model.seq_length)
    tokens = Tensor(np.zeros(shape, np.int32))
    optimizer = nn.AdamWeightDecay(net.trainable_params(), 1e-3) if mode == "train" else None
    return from_network(net, tokens, tokens, mode=mode, optimizer=optimizer)


def _cmd_graph(args: argparse.Namespace) -> int:
    from ms_efficient.graph import graph_summary_table, load_graph

    # a MINDIR name may stand for the split export <name>_graph.mindir (load_graph says which
    # files it looked for)
    if not os.path.exists(args.source) and not args.source.lower().endswith(".mindir"):
        raise ValueError(f"'{args.source}' does not exist.")
    if args.source.endswith((".yaml", ".yml")):
        graph = _graph_from_config(args.source, args.mode)
    else:
        graph = load_graph(args.source)
    print(graph_summary_table(graph))
    if args.out:
        graph.save_json(args.out)
        print(f"graph written to {args.out}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from ms_efficient.train.report import write_report

    print(f"report: {write_report(args.run_dir)}")
    return 0


# plan/bench kind -> module with add_plan_arguments/run_plan/add_bench_arguments/run_bench.
PLANNER_COMMANDS = {
    "moe": "ms_efficient.efficientmoe.commands",
    "memory": "ms_efficient.memopt.commands",
    "shard": "ms_efficient.shard.commands",
    "place": "ms_efficient.place.commands",
    "mpipe": "ms_efficient.mpipe.commands",
}
# other names accepted for a kind (issue texts call the memory benchmark "memopt")
PLANNER_ALIASES = {"memory": ["memopt"]}


def _add_planner_commands(sub) -> None:
    plan = sub.add_parser("plan", help="run a planner and write its plan (YAML)")
    plan_sub = plan.add_subparsers(dest="kind", required=True)
    bench = sub.add_parser("bench", help="benchmark a planner against its baselines")
    bench_sub = bench.add_subparsers(dest="kind", required=True)
    for kind, module_name in PLANNER_COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name != module_name:      # a real missing dependency: say so
                raise
            logger.debug("planner kind %s not installed (%s)", kind, module_name)
            continue
        doc = (module.__doc__ or kind).strip().splitlines()[0]
        aliases = PLANNER_ALIASES.get(kind, [])
        p = plan_sub.add_parser(kind, help=doc, aliases=aliases)
        module.add_plan_arguments(p)
        p.set_defaults(func=module.run_plan)
        p = bench_sub.add_parser(kind, help=doc, aliases=aliases)
        module.add_bench_arguments(p)
        p.set_defaults(func=module.run_bench)
    from ms_efficient.parallel import commands as bundle

    p = plan_sub.add_parser("bundle", help=bundle.__doc__.strip().splitlines()[0])
    bundle.add_bundle_arguments(p)
    p.set_defaults(func=bundle.run_bundle)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="ms-efficient",
        description="Faster, leaner MindSpore training of dense and MoE models.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train the reference GPT-MoE model on text (GRAPH_MODE)")
    p.add_argument("config", nargs="?", help="YAML config, e.g. configs/gpt_moe_tiny.yaml")
    p.add_argument("--steps", type=_positive_int, metavar="N",
                   help="the total step count the run trains to (overrides train.steps), "
                        "counted from step 0, not steps to add: on --resume of a run at "
                        "step 300, --steps 350 trains 50 more; N <= the step reached is "
                        "refused (exit 2). Default: the config's train.steps (on --resume, "
                        "the run's config.yaml's). The same for --workers runs")
    p.add_argument("--out", help="run folder (default: train.out_dir of the config)")
    p.add_argument("--resume", metavar="DIR",
                   help="continue the run in DIR from its newest verified checkpoint up to "
                        "--steps N in total (a run that already reached its train.steps, "
                        "without --steps: nothing to train, nothing written, exit 2)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run already in the output folder (without it, a "
                        "non-empty folder is refused)")
    p.add_argument("--efficientmoe", choices=("on", "off"),
                   help="override efficientmoe.enabled: the slow level's home re-placement "
                        "during an expert-parallel run (--workers W; refused on one process)")
    p.add_argument("--workers", type=_positive_int, metavar="W",
                   help="expert-parallel ranks started with msrun on this machine (>= 2; "
                        "on --resume of an expert-parallel run, 1 continues it in one "
                        "process); default one process, or the world size of a resumed run")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("graph", help="extract or read an OpGraph and print its summary")
    p.add_argument("source", help="config YAML (builds the reference model), graph JSON, "
                                  "MINDIR file or PipeDream profile")
    p.add_argument("--mode", choices=("forward", "train"), default="forward",
                   help="for a config: forward graph, or the whole train step")
    p.add_argument("--out", help="write the graph as JSON here")
    p.set_defaults(func=_cmd_graph)

    p = sub.add_parser("checkpoint", help="convert a run's checkpoints")
    checkpoint_sub = p.add_subparsers(dest="action", required=True)
    p = checkpoint_sub.add_parser(
        "export", help="write a run's latest state (any world size) as one checkpoint of the "
                       "one-process reference model")
    p.add_argument("run_dir", help="run folder (state.json, config.yaml, ckpt/)")
    p.add_argument("--out", required=True, help="checkpoint file to write (.ckpt)")
    p.add_argument("--optimizer", action="store_true",
                   help="also write the optimizer state (global_step, Adam moments, "
                        "learning_rate), as the one-process trainer's checkpoints hold")
    p.set_defaults(func=_cmd_checkpoint_export)

    p = sub.add_parser("report", help="rebuild report.md and plots of a run folder")
    p.add_argument("run_dir")
    p.set_defaults(func=_cmd_report)
    _add_planner_commands(sub)
    return parser


def _check_outputs(args: argparse.Namespace) -> None:
    """Output files (``--out`` of every command but train and plan bundle, whose --out is a
    folder, and ``--json``) are refused before any work when they name a folder."""
    for name in ("out", "json"):
        value = getattr(args, name, None)
        folder = args.command == "train" or getattr(args, "out_is_folder", False)
        if value and os.path.isdir(value) and not (name == "out" and folder):
            raise ValueError(f"'--{name}' must be a file to write, but '{value}' is a folder.")


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    try:
        _check_outputs(args)
        return args.func(args)
    except ValueError as err:
        print(f"ms-efficient: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:           # unreadable input or unwritable output: name the file
        where = f"'{err.filename}': " if err.filename else ""
        print(f"ms-efficient: error: {where}{err.strerror or err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ms-efficient: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
