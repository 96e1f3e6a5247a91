"""Time the MoE layer's forward + backward on CPU (GRAPH_MODE): grouped vs static dispatch.

    .venv/bin/python scripts/bench_grouped_matmul.py [--sizes 16,128,256,512,8,2 ...]
                                                     [--repeat 10] [--threads 1 2] [--json OUT]

Paths, all ``ms_efficient.moe.layer.MoEFeedForward`` with the same weights (B*S = T tokens,
H hidden, F expert FFN width, E experts, K top-k):
- grouped-gmm:        dispatch="grouped": permute kernel, the aot grouped matmul
                      (ms_efficient.moe.grouped_matmul, OpenBLAS), combine kernel; T*K rows;
- grouped-dynamic:    the grouped path as it was before the grouped matmul (commit ef3384a):
                      each expert's rows found with a dynamic-shape ``nonzero`` + gather, kept
                      here as the baseline;
- static-dropless:    dispatch="static", capacity = T per expert (E*T rows, nothing drops);
- static-cf1.25:      dispatch="static", capacity = ceil(1.25*T*K/E) (drops overflow).
``--threads`` times grouped-gmm once per OpenBLAS thread count (the process-wide setting).
Times are medians over --repeat runs in milliseconds after 3 warm-up runs, of the gradients
of sum(y * g) + aux_loss wrt x and every parameter. Routing comes from the router at its
random initialisation (near-uniform).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import mindspore as ms  # noqa: E402
from mindspore import Tensor, nn, ops  # noqa: E402

from ms_efficient.moe import grouped_matmul as G  # noqa: E402
from ms_efficient.moe.kernels import MoeUnpermuteCombine  # noqa: E402
from ms_efficient.moe.layer import MoEFeedForward, routing_statistics  # noqa: E402
from ms_efficient.moe.split import switch_capacity  # noqa: E402


class DynamicGrouped(MoEFeedForward):
    """The grouped path before the grouped matmul (baseline only): one FFN per expert on rows
    found with ``nonzero`` (dynamic shapes), plus one zero row per group (MatMul's backward
    rejects an empty dynamic input)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.combine = MoeUnpermuteCombine()

    def _grouped(self, x):
        b, s, h = x.shape
        t = b * s
        k, e_total = self.top_k, self.num_experts
        n = t * k
        x_TH = x.reshape(t, h)
        probs_TE, weights_TK, expert_ids_A, onehot_AE, _ = self.arrival(self.router(x_TH))
        expert_ids_TK = expert_ids_A.reshape(k, t).transpose(1, 0)
        x_NH, rows_N = self.permute(x_TH, expert_ids_TK)
        expert_N = expert_ids_TK.reshape(-1)
        expert_of_row = ops.tensor_scatter_update(ops.zeros((n,), ms.int32),
                                                  rows_N.reshape(-1, 1), expert_N)
        x_pad = ops.concat((x_NH, ops.zeros((1, h), x_NH.dtype)), 0)
        extra = Tensor([n], ms.int64)
        outs = ()
        for e in range(e_total):
            idx = ops.concat((ops.nonzero(expert_of_row == e).reshape(-1), extra), 0)
            rows = ops.gather(x_pad, idx, 0)
            hid = self.gelu(ops.matmul(rows, self.w1[e]) + self.b1[e])
            outs = outs + (ops.matmul(hid, self.w2[e]) + self.b2[e],)
        y_PH = ops.concat(outs, 0).reshape(n + e_total, h)
        pos = (rows_N + expert_N).reshape(-1, 1)
        row_token = ops.tensor_scatter_update(ops.fill(ms.int32, (n + e_total,), -1), pos,
                                              ops.arange(n, dtype=ms.int32) // k)
        row_weight = ops.tensor_scatter_update(ops.zeros((n + e_total,), y_PH.dtype), pos,
                                               weights_TK.reshape(-1).astype(y_PH.dtype))
        y_TH = self.combine(y_PH, row_token, row_weight, x_TH)
        aux_loss, counts_RE = routing_statistics(probs_TE, onehot_AE, k, self.trace_ranks)
        return y_TH.reshape(b, s, h), aux_loss, counts_RE, ops.zeros((), ms.int32)


class Loss(nn.Cell):
    """sum(y * g) + aux_loss: a scalar whose gradient sends g back through the layer."""

    def __init__(self, layer, g):
        super().__init__()
        self.layer, self.g = layer, Tensor(g)

    def construct(self, x):
        y, aux, _, _ = self.layer(x)
        return (y * self.g).sum() + aux


class FwdBwd(nn.Cell):
    """Loss and its gradients wrt x and every trainable parameter."""

    def __init__(self, layer, g):
        super().__init__()
        loss = Loss(layer, g)
        self.fn = ms.value_and_grad(loss, 0, loss.trainable_params())

    def construct(self, x):
        return self.fn(x)


def wait(out):
    """Block until every tensor of a nested output is computed."""
    if isinstance(out, (tuple, list)):
        for item in out:
            wait(item)
    else:
        out.asnumpy()


def time_ms(fn, x, repeat):
    for _ in range(3):
        wait(fn(x))
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        wait(fn(x))
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def bench_size(b, s, h, f, e, k, repeat, threads, library, seed=0):
    t = b * s
    rng = np.random.default_rng(seed)
    x = Tensor(rng.standard_normal((b, s, h)).astype(np.float32))
    g = rng.standard_normal((b, s, h)).astype(np.float32)
    cap125 = switch_capacity(t, e, k, 1.25)
    layers = {
        "grouped-gmm": (MoEFeedForward(h, f, e, k, capacity=t, dispatch="grouped"), t * k),
        "grouped-dynamic": (DynamicGrouped(h, f, e, k, capacity=t, dispatch="grouped"), t * k),
        "static-dropless": (MoEFeedForward(h, f, e, k, capacity=t), e * t),
        "static-cf1.25": (MoEFeedForward(h, f, e, k, capacity=cap125), e * cap125),
    }
    first = layers["grouped-gmm"][0]
    for layer, _ in layers.values():
        for src, dst in zip(first.get_parameters(), layer.get_parameters()):
            dst.set_data(src.data.copy())
    y_ref = first(x)[0].asnumpy()
    for name in ("grouped-dynamic", "static-dropless"):
        y = layers[name][0](x)[0].asnumpy()
        assert np.allclose(y, y_ref, rtol=1e-4, atol=1e-5), f"{name} disagrees with grouped-gmm"

    runs = [(name, None) for name in layers]
    runs[0:1] = [("grouped-gmm", th) for th in threads]
    rows = []
    for name, th in runs:
        layer, computed_rows = layers[name]
        if th is not None:
            G.set_grouped_matmul_threads(library, th)
        rows.append({
            "evidence": "measured (MindSpore 2.10 CPU)", "path": name, "blas_threads": th,
            "T": t, "H": h, "F": f, "E": e, "K": k, "expert_rows": computed_rows,
            "fwd_ms": round(time_ms(layer, x, repeat), 2),
            "fwd_bwd_ms": round(time_ms(FwdBwd(layer, g), x, repeat), 2),
        })
    G.set_grouped_matmul_threads(library, G.DEFAULT_BLAS_THREADS)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["16,128,256,512,8,2",
                                                        "16,256,512,1024,8,2"],
                        help="B,S,H,F,E,K per size (the first is configs/gpt_moe_tiny.yaml's)")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--threads", type=int, nargs="+", default=[G.DEFAULT_BLAS_THREADS],
                        help="OpenBLAS thread counts to time grouped-gmm with")
    parser.add_argument("--json", help="write the rows and the environment to this file")
    args = parser.parse_args(argv)
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    library = G.build_grouped_matmul_library()
    rows = []
    for size in args.sizes:
        rows += bench_size(*(int(v) for v in size.split(",")), repeat=args.repeat,
                           threads=args.threads, library=library)

    print("measured (MindSpore 2.10 CPU), medians in ms")
    print("| T | H | F | E | K | path | BLAS threads | expert rows | fwd ms | fwd+bwd ms "
          "| fwd+bwd vs static-dropless |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    dropless = {(r["T"], r["H"], r["F"]): r["fwd_bwd_ms"]
                for r in rows if r["path"] == "static-dropless"}
    for r in rows:
        ratio = dropless[(r["T"], r["H"], r["F"])] / r["fwd_bwd_ms"]
        th = "" if r["blas_threads"] is None else r["blas_threads"]
        print(f"| {r['T']} | {r['H']} | {r['F']} | {r['E']} | {r['K']} | {r['path']} | {th} "
              f"| {r['expert_rows']} | {r['fwd_ms']:.2f} | {r['fwd_bwd_ms']:.2f} "
              f"| {ratio:.2f}x |")
    env = {"mindspore": ms.__version__, "cpus": os.cpu_count(), "machine": platform.machine(),
           "mode": "GRAPH_MODE", "repeat": args.repeat, "gmm_library": library,
           "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    result = {"environment": env, "rows": rows}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
