"""Measured peak of memopt's segment plan on a VGG-style ConvNet (no repeated blocks) on CPU.

For each configuration, in a fresh process: build tests/test_user_network_plans.py's
``ConvNet`` (features = 4 Conv2d/ReLU pairs, then a Dense classifier), or with ``--pairs N``
a plain VGG-style net of N Conv2d(16, 16, 3)/ReLU pairs at 32x32 (every stored activation the
same size), at batch ``--batch``,
optionally run the memopt pass at ``--budget`` (segments of ``features``), train 2 GRAPH_MODE
steps, then profile one step (``mindspore.profiler`` with ``profile_memory=True``) and take
the allocator peak ("Total Allocated(Byte)" of ``cpu_ms_memory_record``, as
``ms_efficient.memopt.measure`` does). Prints one JSON line per configuration with the
simulated and the measured peak.

    PYTHONPATH=. python scripts/segments_peak.py --batch 64 --budget 80%
    PYTHONPATH=. python scripts/segments_peak.py --batch 32 --pairs 8 --budget 60%
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile


def child(batch: int, budget: str, pairs: int) -> dict:
    import numpy as np
    import mindspore as ms
    from mindspore import nn
    from mindspore.profiler import ProfilerActivity, tensorboard_trace_handler

    import ms_efficient
    from ms_efficient.core.config import config_from_dict
    from ms_efficient.memopt.measure import _allocator_peak_bytes
    from tests.test_user_network_plans import ConvNet, _classifier

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    ms.set_seed(0)
    rng = np.random.default_rng(0)
    backbone = ConvNet()
    if pairs:
        layers = [nn.Conv2d(3, 16, 3), nn.ReLU()]
        for _ in range(pairs - 1):
            layers += [nn.Conv2d(16, 16, 3), nn.ReLU()]
        backbone = nn.SequentialCell([nn.SequentialCell(layers), nn.Flatten(),
                                      nn.Dense(16 * 32 * 32, 10)])
    net, inputs = _classifier(backbone, ms.Tensor(
        rng.standard_normal((batch, 3, 32, 32)).astype(np.float32)))
    out = {"batch": batch, "pairs": pairs or 4, "budget": budget or "none"}
    if budget:
        config = config_from_dict({"optimize": {"passes": ["memopt"], "memory_budget": budget},
                                   "cluster": {"preset": "ascend910b-1x8"}})
        net, plans = ms_efficient.optimize(net, config, sample_inputs=inputs, strict=True)
        plan = plans["memopt"]
        out.update(segments=[[layer["name"], layer["action"], len(layer["cells"])]
                             for layer in plan["layers"]],
                   simulated_peak_bytes=plan["simulated"]["peak_bytes"],
                   simulated_unoptimised_bytes=plan["unoptimised_peak_bytes"])
    step = nn.TrainOneStepCell(net, nn.Momentum(net.trainable_params(), 0.01, 0.9))
    for _ in range(2):
        step(*inputs).asnumpy()
    tmp = tempfile.mkdtemp(prefix="segments_prof_")
    try:
        with ms.profiler.profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                                 on_trace_ready=tensorboard_trace_handler(tmp)) as prof:
            step(*inputs).asnumpy()
            prof.step()
        out["measured_peak_bytes"] = _allocator_peak_bytes(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--budget", default="80%")
    parser.add_argument("--pairs", type=int, default=0)
    parser.add_argument("--child", default=None)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.batch, args.child, args.pairs)))
        return
    for budget in ("", args.budget):
        got = subprocess.run([sys.executable, __file__, "--batch", str(args.batch),
                              "--pairs", str(args.pairs), "--child", budget], capture_output=True, text=True,
                             env={**os.environ}, check=True)
        print(got.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
