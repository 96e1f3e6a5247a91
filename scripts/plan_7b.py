"""Plan a LLaMA-7B-shaped decoder with ``ms_efficient.optimize`` on this machine: the time and
peak resident memory of the graph extraction and of each pass (a table, then JSON).

    PATH=.venv/bin:$PATH PYTHONPATH=. python scripts/plan_7b.py [--json OUT] \
        [--layers 32 --hidden 4096 --heads 32 --ffn 11008 --vocab 32000 --seq 2048 --batch 8] \
        [--passes shard,place,memopt] [--cluster ascend910b-4x8] [--shard-mesh 4x4] [--weights]
        [--no-phase-peaks]

The network is ``tests/user_models.py``'s ``LlamaForCausalLM`` (nn.Embedding, nn.Dense, RMSNorm,
attention by MatMul/Softmax, SwiGLU MLP) with a cross-entropy loss, built under
``mindspore.nn.utils.no_init_parameters()``: its 6.7 G parameters (27 GB in fp32, 81 GB with
SGD's two states) are shapes only, never allocated (``--weights``: built with its weights). ``optimize`` extracts the train-step graph
(MINDIR export without weights) when the first pass needs it, then runs the passes in order.

Figures per phase: wall time (s) and peak RSS (GiB, the process's ``VmHWM``, reset at the start
of each phase through ``/proc/self/clear_refs``; when the kernel does not allow the reset, the
process's peak so far). The reset also resets the maximum RSS the kernel reports at exit (what
``/usr/bin/time -v`` prints): ``--no-phase-peaks`` keeps it, each row then shows the peak so far. Phases are cut where ``optimize`` logs "running pass <name>" and
"extracted the train-step graph"; "summary" is the combined report after the last pass.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

import mindspore as ms  # noqa: E402
from mindspore import nn  # noqa: E402
from mindspore.nn.utils import no_init_parameters  # noqa: E402

import ms_efficient  # noqa: E402
from ms_efficient.core.config import config_from_dict  # noqa: E402

GIB = 1024 ** 3


def _status_bytes(field: str) -> int:
    """``field`` (VmRSS, VmHWM) of /proc/self/status in bytes."""
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False when not allowed."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


class PhaseClock(logging.Handler):
    """Cuts the run into phases at ``optimize``'s log lines and records each phase's wall time
    (s) and peak RSS (bytes)."""

    def __init__(self, reset_peaks: bool = True) -> None:
        super().__init__(level=logging.INFO)
        self.rows = []
        self.peak_resets = reset_peaks
        self._name, self._start = None, 0.0

    def begin(self, name: str) -> None:
        self.end()
        self.peak_resets = self.peak_resets and _reset_peak()
        self._name, self._start = name, time.perf_counter()

    def end(self) -> None:
        if self._name is not None:
            self.rows.append({"phase": self._name,
                              "time_s": round(time.perf_counter() - self._start, 2),
                              "peak_rss_gib": round(_status_bytes("VmHWM") / GIB, 3)})
        self._name = None

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.startswith("running pass "):
            self.begin(msg[len("running pass "):])
        elif msg.startswith("combining the plans"):
            self.begin("summary (combined report)")
        elif msg.startswith("extracted the train-step graph") and self._name is not None:
            # the pass that asked for the graph spent its time so far extracting it
            name, self._name = self._name, "extract graph"
            self.end()
            self.begin(name)


def build(args):
    """(WithLossCell of the decoder, (ids [batch, seq] int32, labels [batch * seq] int32))."""
    from tests.user_models import LlamaForCausalLM

    with contextlib.nullcontext() if args.weights else no_init_parameters():
        net = LlamaForCausalLM(vocab_size=args.vocab, hidden_size=args.hidden,
                               num_heads=args.heads, intermediate_size=args.ffn,
                               num_layers=args.layers)
    ids = ms.Tensor(np.zeros((args.batch, args.seq), np.int32))
    labels = ms.Tensor(np.zeros((args.batch * args.seq,), np.int32))
    return nn.WithLossCell(net, nn.CrossEntropyLoss()), (ids, labels)


def _figures(plans) -> dict:
    """What the applied plans chose and their simulated price (bytes, seconds)."""
    out = {}
    shard = plans.get("shard", {})
    if "summary" in shard:
        out["shard"] = {"mesh": f"{shard['mesh']['dp']}x{shard['mesh']['mp']}",
                        **{k: shard["summary"][k] for k in (
                            "memory_per_device_bytes", "comm_time_s", "ilp_groups",
                            "operators")}}
    place = plans.get("place", {})
    if "stages" in place:
        out["place"] = {"stages": len(place["stages"]), "micro_batches": place["micro_batches"],
                        "step_time_s": place["step_time_s"]}
    summary = plans.get("summary")
    if summary:
        out["combined"] = {k: summary[k] for k in ("step_time_s", "peak_memory_bytes",
                                                   "devices_needed")}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--ffn", type=int, default=11008)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--passes", default="shard,place,memopt")
    parser.add_argument("--cluster", default="ascend910b-4x8")
    parser.add_argument("--shard-mesh", default="",
                        help="optimize.shard_mesh, e.g. 4x4 (default: shard searches the "
                             "cluster's meshes)")
    parser.add_argument("--weights", action="store_true",
                        help="build the network with its weights (initialised), as a user "
                             "who did not use no_init_parameters")
    parser.add_argument("--no-phase-peaks", action="store_true",
                        help="do not reset the peak RSS per phase (keeps the process's peak "
                             "for /usr/bin/time)")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    for key in ("layers", "hidden", "heads", "ffn", "vocab", "seq", "batch"):
        if getattr(args, key) < 1:
            parser.error(f"--{key} must be >= 1, but got {getattr(args, key)}.")
    if args.hidden % args.heads:
        parser.error(f"--hidden ({args.hidden}) must be a multiple of --heads ({args.heads}).")
    logging.basicConfig(level=logging.WARNING)
    clock = PhaseClock(reset_peaks=not args.no_phase_peaks)
    passes_logger = logging.getLogger("ms_efficient.passes")
    passes_logger.setLevel(logging.INFO)
    passes_logger.addHandler(clock)
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")

    total = time.perf_counter()
    clock.begin("build (weights)" if args.weights else "build (no_init_parameters)")
    net, inputs = build(args)
    n_params = sum(int(p.size) for p in net.get_parameters())
    cfg = config_from_dict({"optimize": {"passes": args.passes.split(","),
                                         "shard_mesh": args.shard_mesh},
                            "cluster": {"preset": args.cluster}})
    clock.begin("optimize: setup")
    _, plans = ms_efficient.optimize(net, cfg, sample_inputs=inputs)
    clock.end()
    total_s = time.perf_counter() - total
    result = {
        "network": f"LlamaForCausalLM L{args.layers} d{args.hidden} h{args.heads} "
                   f"ffn{args.ffn} V{args.vocab}, batch {args.batch} x seq {args.seq}",
        "parameters": n_params, "cluster": args.cluster, "passes": args.passes.split(","),
        "phases": clock.rows, "total_s": round(total_s, 2),
        "peak_rss_gib": round(max(r["peak_rss_gib"] for r in clock.rows), 3),
        "per_phase_peak": clock.peak_resets,
        "plans": {name: ("refused: " + plan["refused"]) if "refused" in plan else "applied"
                  for name, plan in plans.items() if name != "summary"},
        "figures": _figures(plans),
    }
    print(f"{'phase':<30} {'time (s)':>9} {'peak RSS (GiB)':>15}")
    for row in clock.rows:
        print(f"{row['phase']:<30} {row['time_s']:>9.2f} {row['peak_rss_gib']:>15.3f}")
    print(f"{'total':<30} {result['total_s']:>9.2f} {result['peak_rss_gib']:>15.3f}")
    for name, outcome in result["plans"].items():
        print(f"{name}: {outcome}")
    print(json.dumps(result, indent=1))
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
        os.replace(tmp, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
