"""The zoo matrix: six networks the package did not write (a LLaMA-shaped decoder, an
nn.TransformerEncoder encoder, a GPT with its own MoE blocks adopted by ``adopt_moe``,
mindcv's resnet18, a small mindcv ViT and mobilenet_v2) x the pass sets {memopt}, {shard},
{place}, {shard, place, memopt}, each ``optimize(..., verify=True)`` on ascend910b-1x8:
a plan verified in the compiled graph, or the pass's refusal (``tests/zoo.py`` has the
networks and the configs; ``tests/test_zoo.py`` pins every outcome).

    PATH=.venv/bin:$PATH PYTHONPATH=. python scripts/zoo.py [--networks llama,vit] [--json out.json]
        [--train resnet18]

Prints one table row per network and pass set (wall seconds of the case on this machine,
the network's graph extraction counted once per network) and, with ``--json``, writes
``{network: tests.zoo.run_network(network)}`` (``-`` writes it to stdout, after the table
on stderr). ``--train`` trains the networks it names for 2 steps after their last case
(``losses`` in the JSON).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests import zoo  # noqa: E402


def _networks(text: str):
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in zoo.NETWORKS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"--networks takes a comma-separated list of "
                                         f"{list(zoo.NETWORKS)}, but got {text!r}.")
    return names


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--networks", type=_networks, default=list(zoo.NETWORKS),
                        help="comma-separated zoo networks (default: all six)")
    parser.add_argument("--json", default=None, help="write the records here ('-': stdout)")
    parser.add_argument("--train", type=_networks, default=[],
                        help="networks to train for 2 steps after their last case")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    table = sys.stderr if args.json == "-" else sys.stdout
    print("| network | pass set | pass | outcome | case s |", file=table)
    print("|---|---|---|---|---|", file=table)
    records = {}
    for name in args.networks:
        records[name] = rec = zoo.run_network(name, train_steps=2 if name in args.train else 0)
        for pass_set, passes in zoo.PASS_SETS.items():
            case = rec["cases"][pass_set]
            for pass_name in passes:
                print(f"| {name} | {pass_set} | {pass_name} | {zoo.outcome(case, pass_name)} "
                      f"| {rec['seconds'][pass_set]:.1f} |", file=table, flush=True)
    if args.json == "-":
        sys.stdout.write(json.dumps(records) + "\n")
    elif args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(records, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
