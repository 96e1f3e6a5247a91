"""Measured check on this machine (issue item 6): train the reference model a few steps in
GRAPH mode with a plan's recompute part applied, in a fresh process, and report its peak
resident memory (``ru_maxrss``) and step time.

``measure_plan(model_dict, moe_dict, batch, recompute_names)`` spawns
``python -m ms_efficient.memopt.measure`` (one process per configuration, so every peak is
that configuration's own) and returns {"peak_bytes", "step_time_s"}. MindSpore is imported
only in the child.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Dict, List

__all__ = ["measure_plan"]


def measure_plan(model: Dict[str, Any], moe: Dict[str, Any], batch_size: int,
                 recompute: List[str], steps: int = 3, timeout_s: float = 300.0) -> Dict[str, float]:
    """Peak RSS bytes and median step time (s) of ``steps`` GRAPH-mode training steps (after
    one compile step) with ``Cell.recompute()`` on the Cells named in ``recompute``."""
    spec = json.dumps({"model": model, "moe": moe, "batch_size": batch_size,
                       "recompute": recompute, "steps": steps})
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""),
               GLOG_v="3")
    proc = subprocess.run([sys.executable, "-m", "ms_efficient.memopt.measure", spec],
                          capture_output=True, text=True, timeout=timeout_s, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"measurement process failed (rc={proc.returncode}): "
                           f"{proc.stderr.strip()[-800:]}")
    return json.loads(lines[-1])


def _child(spec: Dict[str, Any]) -> Dict[str, float]:
    import resource
    import time

    import numpy as np
    import mindspore as ms
    from mindspore import Tensor, nn

    from ms_efficient.config import ModelConfig, MoEConfig
    from ms_efficient.models.gpt_moe import build_model

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    ms.set_seed(0)
    model, moe = ModelConfig(**spec["model"]), MoEConfig(**spec["moe"])
    net = build_model(model, moe, spec["batch_size"])
    cells = dict(net.cells_and_names())
    for name in spec["recompute"]:
        cells[name].recompute()
    optimizer = nn.SGD(net.trainable_params(), 1e-3)
    grad_fn = ms.value_and_grad(net, None, optimizer.parameters, has_aux=True)

    @ms.jit
    def train_step(tokens, targets):
        (loss, _, _, _), grads = grad_fn(tokens, targets)
        optimizer(grads)
        return loss

    rng = np.random.default_rng(0)
    shape = (spec["batch_size"], model.seq_length)
    tokens = Tensor(rng.integers(0, model.vocab_size, shape).astype(np.int32))
    train_step(tokens, tokens).asnumpy()          # compile
    times = []
    for _ in range(spec["steps"]):
        start = time.perf_counter()
        train_step(tokens, tokens).asnumpy()
        times.append(time.perf_counter() - start)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_bytes": float(peak_kib) * 1024.0, "step_time_s": float(np.median(times))}


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.argv[1]))))
