"""The place and shard passes on networks the package did not write: what each plans, or why
it does not pay, with the unoptimised price both report (simulated; no hardware).

    PATH=.venv/bin:$PATH PYTHONPATH=. python scripts/user_network_plans.py [--json OUT]

Networks: LLaMA-shaped decoders of ``tests/user_models.py`` (3 small layers, dense and with the
package's MoE layer; 6 wider layers; 12 layers of d 768 at batch 8 and 32), an ``nn.TransformerEncoder`` classifier, a small conv net
and a decoder with a tied embedding / LM head (``tests/test_user_network_plans.py``), and
mindcv's resnet18 when mindcv is installed. Clusters: ascend910b-1x8, and 4 CPU workers
(``cpu-local`` with 4 devices) where compute outweighs the launch overhead.
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

import numpy as np  # noqa: E402

import mindspore as ms  # noqa: E402
from mindspore import nn  # noqa: E402

import ms_efficient  # noqa: E402
from ms_efficient.core.config import config_from_dict  # noqa: E402

ASCEND = {"preset": "ascend910b-1x8"}
CPU4 = {"preset": "cpu-local", "devices_per_node": 4}


def _networks():
    from tests.test_user_network_plans import (ConvNet, PatchEncoder, TiedLM, _classifier,
                                               _deep_llama)
    from tests.user_models import llama_with_loss

    rng = np.random.default_rng(0)
    yield "llama-3x32 (batch 2)", lambda: llama_with_loss(num_layers=3)
    yield "llama-moe-3x32 (batch 2)", lambda: llama_with_loss(
        moe={"num_experts": 4, "top_k": 2, "capacity": 16}, num_layers=3)
    yield "llama-6x128 (batch 8)", _deep_llama
    for batch in (8, 32):          # 12 layers of d 768 (86M parameters), 128 tokens a sample
        yield f"llama-12x768 (batch {batch})", lambda batch=batch: _decoder_12x768(batch)
    yield "nn.TransformerEncoder x4 (batch 8)", lambda: _classifier(PatchEncoder(), ms.Tensor(
        rng.standard_normal((8, 16, 48)).astype(np.float32)))
    yield "convnet (batch 8)", lambda: _classifier(ConvNet(), ms.Tensor(
        rng.standard_normal((8, 3, 32, 32)).astype(np.float32)))

    def tied():
        ids = ms.Tensor(rng.integers(0, 64, (8, 16)).astype(np.int32))
        labels = ms.Tensor(rng.integers(0, 64, (128,)).astype(np.int32))
        return nn.WithLossCell(TiedLM(), nn.CrossEntropyLoss()), (ids, labels)

    yield "tied embedding/head (batch 8)", tied
    try:
        import mindcv
    except ImportError:
        return
    yield "mindcv resnet18 64x64 (batch 8)", lambda: _classifier(
        mindcv.create_model("resnet18", pretrained=False, num_classes=10),
        ms.Tensor(rng.standard_normal((8, 3, 64, 64)).astype(np.float32)))


def _decoder_12x768(batch, seq=128, vocab=1024):
    from tests.user_models import LlamaForCausalLM

    ms.set_seed(0)
    net = LlamaForCausalLM(vocab_size=vocab, hidden_size=768, num_heads=12,
                           intermediate_size=2048, num_layers=12)
    rng = np.random.default_rng(0)
    ids = ms.Tensor(rng.integers(0, vocab, (batch, seq)).astype(np.int32))
    labels = ms.Tensor(rng.integers(0, vocab, (batch * seq,)).astype(np.int32))
    return nn.WithLossCell(net, nn.CrossEntropyLoss()), (ids, labels)


def _run(build, cluster, passes):
    ms.set_seed(0)
    net, inputs = build()
    cfg = config_from_dict({"optimize": {"passes": passes}, "cluster": cluster})
    try:
        return ms_efficient.optimize(net, cfg, sample_inputs=inputs, strict=True)[1]
    except ValueError as err:
        return {"error": str(err)}


def _place_row(plan):
    if "error" in plan:
        return {"error": plan["error"]}
    p = plan["place"]
    return {"stages": [s["blocks"] for s in p["stages"]], "micro_batches": p["micro_batches"],
            "stage_time_ms": [round(t * 1e3, 4) for t in p["stage_time_s"]],
            "step_ms": round(p["step_time_s"] * 1e3, 4),
            "one_stage_ms": round(p["meta"]["one_stage_s"] * 1e3, 4),
            "pp_x_dp": p["shape"], "baseline": p["baseline"]["label"],
            "baseline_ms": round(p["baseline"]["step_time_s"] * 1e3, 4),
            "ratio_to_baseline": round(p["ratio_to_baseline"], 4), "reason": p["reason"],
            "unoptimised": p["unoptimised"]}


def _shard_row(plan):
    if "error" in plan:
        return {"error": plan["error"]}
    p = plan["shard"]
    fits = {m: b["memory_per_device_bytes"] for m, b in p["baselines"].items()
            if "error" not in b and b["comm_time_s"] <= p["comm_budget_s"] * (1 + 1e-9)}
    return {"mesh": f"{p['mesh']['dp']}x{p['mesh']['mp']}",
            "memory_per_device_bytes": p["summary"]["memory_per_device_bytes"],
            "baselines_within_budget": fits, "budget": p["budget"], "fallback": p["fallback"],
            "baseline_bound_bytes": p["baseline_bound_bytes"],
            "tied": p["tied"], "unoptimised": p["unoptimised"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    rows = []
    for name, build in _networks():
        for cname, cluster in (("ascend910b-1x8", ASCEND), ("cpu-local-1x4", CPU4)):
            row = {"network": name, "cluster": cname,
                   "place": _place_row(_run(build, cluster, ["place"])),
                   "shard": _shard_row(_run(build, cluster, ["shard"]))}
            rows.append(row)
            print(json.dumps(row, default=str))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
