"""The zoo (issue 33 item 5): six networks the package did not write, each optimised with
``verify=True`` under four pass sets, the outcome of every case recorded as JSON-ready data.
``tests/test_zoo.py`` pins each outcome; ``scripts/zoo.py`` prints the matrix.

Networks (small, so that a case compiles in seconds on 2 CPU cores):

- ``llama``: the LLaMA-shaped decoder of ``tests.user_models`` with q/k/v biases (nn.Dense
  with bias, RMSNorm, nn.Embedding), 2 layers, hidden 32, ids [8, 16];
- ``encoder``: ``nn.TransformerEncoder`` of 2 ``nn.TransformerEncoderLayer`` (d 64, 4 heads)
  between a patch Dense and a classifier, patches [8, 16, 48];
- ``moe_gpt``: a GPT (LayerNorm, biased Dense, learned positions) whose MLPs are MoE blocks
  its user wrote, replaced by the package's layer with ``adopt_moe`` (dropless, 4 experts,
  top-2), 2 blocks, ids [8, 16];
- ``resnet18``: ``mindcv.create_model("resnet18", num_classes=10)``, images [8, 3, 32, 32];
- ``vit``: mindcv's ``VisionTransformer`` (patch 8, d 64, depth 2, 4 heads, MLP 2x), images
  [8, 3, 32, 32]: mindcv's smallest named ViT is ViT-B/32 (88 M parameters);
- ``mobilenet_v2``: ``mindcv.create_model("mobilenet_v2_035_96", num_classes=10)`` (width
  0.35: depthwise Conv2D, BatchNorm, ReLU6), images [8, 3, 32, 32].

Pass sets: ``memopt``, ``shard``, ``place`` alone and ``all`` (``[shard, place, memopt]``,
the order docs/usage.md gives), on ``ascend910b-1x8`` with ``optimize.memory_budget`` 90%
of the unoptimised simulated peak (99% for resnet18, whose peak at this size is 98% weights,
gradients and optimizer states: no recompute plan reaches 90%).

Each network's train-step graph is extracted once and every case plans it
(``optimize(..., graph=...)``) on a freshly built copy of the network; each case compiles
its own optimised network once for ``verify=True``. mindcv's Cells must not outlive
MindSpore at interpreter exit, so the test runs the mindcv networks in a child process
(``scripts/zoo.py --json``).
"""
from __future__ import annotations

import json
import time
from typing import Any, Callable, Dict, List, Tuple

import numpy as np

IN_PROCESS = ("llama", "encoder", "moe_gpt")
MINDCV = ("resnet18", "vit", "mobilenet_v2")
NETWORKS = IN_PROCESS + MINDCV
PASS_SETS: Dict[str, List[str]] = {"memopt": ["memopt"], "shard": ["shard"],
                                   "place": ["place"], "all": ["shard", "place", "memopt"]}
CLUSTER = "ascend910b-1x8"
BUDGET = {name: "90%" for name in NETWORKS}
BUDGET["resnet18"] = "99%"
BATCH = 8
# plan entries left out of the record: the ILP's per-operator table and the strategy file
# (the applied strategies are in "applied" and "cells")
_BULKY = ("operators", "strategy_json", "device_share")


def _llama():
    from tests.user_models import llama_with_loss

    return llama_with_loss(num_layers=2, batch=BATCH, bias=True)


def _encoder():
    import mindspore as ms

    from tests.user_models import PatchEncoder, classifier_with_loss

    ms.set_seed(0)
    x = np.random.default_rng(0).standard_normal((BATCH, 16, 48)).astype(np.float32)
    return classifier_with_loss(PatchEncoder(layers=2), ms.Tensor(x))


def _moe_gpt():
    from ms_efficient import adopt_moe
    from tests.user_models import moe_gpt_with_loss

    net, inputs = moe_gpt_with_loss(batch=BATCH, seq=16)
    adopt_moe(net, tokens=BATCH * 16)
    return net, inputs


def _image_classifier(backbone):
    """``backbone`` with its loss and 8 seeded images [8, 3, 32, 32]."""
    import mindspore as ms

    from tests.user_models import classifier_with_loss

    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, 3, 32, 32)).astype(np.float32)
    return classifier_with_loss(backbone, ms.Tensor(x))


def _resnet18():
    import mindcv
    import mindspore as ms

    ms.set_seed(0)
    return _image_classifier(mindcv.create_model("resnet18", pretrained=False, num_classes=10))


def _vit():
    import mindspore as ms
    from mindcv.models.vit import VisionTransformer

    ms.set_seed(0)
    return _image_classifier(VisionTransformer(image_size=32, patch_size=8, embed_dim=64,
                                               depth=2, num_heads=4, mlp_ratio=2.0,
                                               num_classes=10))


def _mobilenet_v2():
    import mindcv
    import mindspore as ms

    ms.set_seed(0)
    return _image_classifier(mindcv.create_model("mobilenet_v2_035_96", pretrained=False,
                                                 num_classes=10))


BUILDERS: Dict[str, Callable[[], Tuple[Any, Tuple[Any, ...]]]] = {
    "llama": _llama, "encoder": _encoder, "moe_gpt": _moe_gpt, "resnet18": _resnet18,
    "vit": _vit, "mobilenet_v2": _mobilenet_v2}


def build(name: str) -> Tuple[Any, Tuple[Any, ...]]:
    """(network with its loss, one batch of inputs) of zoo network ``name``, freshly built
    with seed 0."""
    if name not in BUILDERS:
        raise ValueError(f"no zoo network {name!r}; the zoo holds {list(BUILDERS)}.")
    return BUILDERS[name]()


def config(name: str, pass_set: str):
    """The RunConfig of case (``name``, ``pass_set``)."""
    from ms_efficient.core.config import config_from_dict

    if pass_set not in PASS_SETS:
        raise ValueError(f"no pass set {pass_set!r}; the zoo runs {list(PASS_SETS)}.")
    return config_from_dict({"optimize": {"passes": PASS_SETS[pass_set],
                                          "memory_budget": BUDGET[name]},
                             "cluster": {"preset": CLUSTER}})


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=lambda v: v.item() if hasattr(v, "item")
                                 else str(v)))


def record(plans: Dict[str, Any]) -> Dict[str, Any]:
    """The JSON-ready outcome of one ``optimize()`` call: every pass's plan (its
    ``verified`` included, without the bulky entries ``_BULKY``) or ``{"refused": reason}``,
    and ``summary``."""
    out = {}
    for name, plan in plans.items():
        out[name] = _jsonable({k: v for k, v in plan.items() if k not in _BULKY})
    return out


def run_network(name: str, train_steps: int = 0) -> Dict[str, Any]:
    """Every pass set of network ``name`` with ``verify=True``: {"graph_ops": number of
    operators of the train-step graph, "graph_unchanged": the graph reads the same after
    the four cases, "seconds": {"graph": s, pass set: s} (wall), "cases": {pass set: record
    or {"error": "<type>: <message>"}}, "losses": the losses of ``train_steps`` steps
    (Momentum 0.01) of the network optimised by the ``all`` case, when asked}."""
    import mindspore as ms
    from mindspore import nn

    import ms_efficient
    from ms_efficient.graph import from_network

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    t0 = time.perf_counter()
    net, inputs = build(name)
    graph = from_network(net, *inputs, mode="train")
    before = json.dumps(graph.to_dict(), sort_keys=True)
    seconds = {"graph": time.perf_counter() - t0}
    cases: Dict[str, Any] = {}
    for pass_set in PASS_SETS:
        t0 = time.perf_counter()
        net, inputs = build(name)
        try:
            net, plans = ms_efficient.optimize(net, config(name, pass_set),
                                               sample_inputs=inputs, verify=True, graph=graph)
            cases[pass_set] = record(plans)
        except Exception as err:  # recorded: the test names the case and the error
            cases[pass_set] = {"error": f"{type(err).__name__}: {err}"}
        seconds[pass_set] = time.perf_counter() - t0
    out = {"graph_ops": len(graph), "seconds": seconds, "cases": cases,
           "graph_unchanged": json.dumps(graph.to_dict(), sort_keys=True) == before}
    if train_steps:
        step = nn.TrainOneStepCell(net, nn.Momentum(net.trainable_params(), 0.01, 0.9))
        out["losses"] = [float(step(*inputs).asnumpy()) for _ in range(train_steps)]
    return out


def outcome(case: Dict[str, Any], pass_name: str) -> str:
    """One line for the matrix: the applied plan's summary or ``refused: <reason>``."""
    if "error" in case:
        return f"error: {case['error']}"
    plan = case[pass_name]
    if "refused" in plan:
        return f"refused: {plan['refused']}"
    if pass_name == "memopt":
        acts = sorted({a.get("action", "recompute") for a in plan["cells"].values()})
        nodes = sum(v["recompute"]["recomputed_nodes"] for v in plan["verified"].values()
                    if "recompute" in v)
        return (f"{'/'.join(acts)} on {len(plan['cells'])} Cells, {nodes} recomputed nodes "
                f"verified")
    if pass_name == "shard":
        prims = sorted({r["prim"] for r in plan["applied"].values()})
        return (f"mesh {plan['mesh']['dp']}x{plan['mesh']['mp']}, {len(plan['applied'])} "
                f"strategies verified ({', '.join(prims)})")
    if pass_name == "place":
        return f"{plan['pp']}x{plan['dp']} pipeline, {plan['micro_batches']} micro-batches"
    return f"applied on {len(plan['cells'])} Cells"
