"""memopt, shard and place together on a user's network: each pass alone and all three, with
the unoptimised price every pass reports and ``plans["summary"]``, the combined simulated step
and per-device peak (simulated; no hardware).

    PATH=.venv/bin:$PATH PYTHONPATH=. python scripts/passes_together.py

Network: the 6-layer LLaMA-shaped decoder of ``tests/test_user_network_plans.py`` (hidden 128,
batch 8, sequence 32) on 2 CPU workers (``cpu-local`` with 2 devices), memory_budget 90%.
"""
from __future__ import annotations

import logging
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import mindspore as ms  # noqa: E402

import ms_efficient  # noqa: E402
from ms_efficient.core.config import config_from_dict  # noqa: E402

CPU2 = {"preset": "cpu-local", "devices_per_node": 2}
RUNS = (["memopt"], ["shard"], ["place"], ["shard", "memopt"], ["place", "memopt"],
        ["shard", "place", "memopt"])


def main() -> int:
    from tests.test_user_network_plans import _deep_llama

    logging.basicConfig(level=logging.WARNING)
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    print("| passes | unoptimised step ms | unoptimised peak MiB | step ms | peak MiB "
          "| devices | memopt recomputes |")
    print("|---|---|---|---|---|---|---|")
    for passes in RUNS:
        net, inputs = _deep_llama()
        cfg = config_from_dict({"optimize": {"passes": passes, "memory_budget": "90%"},
                                "cluster": CPU2})
        try:
            _, plans = ms_efficient.optimize(net, cfg, sample_inputs=inputs, strict=True)
        except ValueError as err:
            print(f"| {'+'.join(passes)} | error: {err} |")
            continue
        s, u = plans["summary"], plans["summary"]["unoptimised"]
        recomputed = sorted(n.rsplit(".", 1)[1] for n in plans.get("memopt", {}).get("cells", {}))
        print(f"| {'+'.join(passes)} | {u['step_time_s'] * 1e3:.3f} "
              f"| {u['peak_memory_bytes'] / 2**20:.2f} | {s['step_time_s'] * 1e3:.3f} "
              f"| {s['peak_memory_bytes'] / 2**20:.2f} | "
              + "; ".join(f"{d['share']}: {d['peak_memory_bytes'] / 2**20:.2f} MiB"
                          for d in s["devices"])
              + f" | layers {recomputed or '-'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
