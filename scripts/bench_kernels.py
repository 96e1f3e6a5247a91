"""Time MoE dispatch + combine on CPU (GRAPH_MODE): aot kernels vs ops vs capacity padding.

    .venv/bin/python scripts/bench_kernels.py [--sizes 4096,256,8,2 ...] [--repeat 20]
                                              [--json OUT]

Three paths move the same tokens, with identity experts in between so only data movement is
timed (T tokens, H hidden, E experts, K top-k):
- aot:    MoePermute -> MoeUnpermuteCombine, padding-free, N = T*K rows (ms_efficient kernels);
- ops:    the same layout with ops.gather / ops.unsorted_segment_sum;
- padded: gather into [E, C, H] slots (C = ceil(cf*T*K/E), empty slots read a zero row,
          overflow dropped) and gather back per assignment, as in ms_efficient.moe.layer.
Routing is random (uniform experts) and computed once in numpy, outside the timed region.
"fwd" times out_TH = combine(permute(x)); "fwd+bwd" also the gradients wrt x and the gate
weights. Times are medians over --repeat runs in milliseconds, after 3 warm-up runs.
"""
from __future__ import annotations

import argparse
import json
import math
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

from ms_efficient.moe import kernels as K  # noqa: E402


class PaddingFree(nn.Cell):
    """out_TH = combine(permute(x_TH, idx_N), idx_N, w_N); impl "aot" or "ops"."""

    def __init__(self, impl, idx_N, library):
        super().__init__()
        self.permute = K.MoePermute(impl, library)
        self.combine = K.MoeUnpermuteCombine(impl, library)
        self.idx_N = Tensor(idx_N)

    def construct(self, x, w):
        return self.combine(self.permute(x, self.idx_N), self.idx_N, w, x)


class Padded(nn.Cell):
    """Capacity dispatch: slots [E*C] hold a token or T (a zero row); assignments read their
    slot, or E*C (a zero row) when dropped."""

    def __init__(self, slot_token_S, slot_A, num_experts, capacity, top_k):
        super().__init__()
        self.slot_token_S, self.slot_A = Tensor(slot_token_S), Tensor(slot_A)
        self.e, self.c, self.k = num_experts, capacity, top_k

    def construct(self, x, gate_A):
        t, h = x.shape
        x_pad = ops.concat((x, ops.zeros((1, h), x.dtype)), 0)
        expert_in_ECH = ops.gather(x_pad, self.slot_token_S, 0).reshape(self.e, self.c, h)
        out_pad = ops.concat((expert_in_ECH.reshape(-1, h), ops.zeros((1, h), x.dtype)), 0)
        y_ATH = ops.gather(out_pad, self.slot_A, 0) * gate_A.reshape(-1, 1)
        return y_ATH.reshape(self.k, t, h).sum(axis=0)


class Loss(nn.Cell):
    """<net(x, w), g>: a scalar whose gradient sends g back through the dispatch."""

    def __init__(self, net, g_TH):
        super().__init__()
        self.net, self.g = net, Tensor(g_TH)

    def construct(self, x, w):
        return (self.net(x, w) * self.g).sum()


class FwdBwd(nn.Cell):
    """Gradients of Loss wrt x and w."""

    def __init__(self, net, g_TH):
        super().__init__()
        self.loss = Loss(net, g_TH)
        self.grad = ops.GradOperation(get_all=True)

    def construct(self, x, w):
        return self.grad(self.loss)(x, w)


def padded_slots(expert_ids_TK, num_experts, capacity):
    """Slot tables in k-major arrival order.

    slot_token_S: int32 [E*C], token in each slot (T = empty slot, reads a zero row).
    slot_A: int32 [K*T], slot of each assignment (E*C = dropped, reads a zero row).
    """
    t, k = expert_ids_TK.shape
    expert_A = expert_ids_TK.T.reshape(-1)
    fill_E = np.zeros(num_experts, np.int64)
    slot_token_S = np.full(num_experts * capacity, t, np.int32)
    slot_A = np.full(k * t, num_experts * capacity, np.int32)
    for a, e in enumerate(expert_A):
        if fill_E[e] < capacity:
            slot_A[a] = e * capacity + fill_E[e]
            slot_token_S[slot_A[a]] = a % t
            fill_E[e] += 1
    return slot_token_S, slot_A


def run_and_wait(fn, args):
    """Call fn and wait for its outputs (asnumpy waits, and shares memory on CPU: no copy)."""
    out = fn(*args)
    for tensor in out if isinstance(out, tuple) else (out,):
        tensor.asnumpy()


def time_ms(fn, args, repeat):
    for _ in range(3):
        run_and_wait(fn, args)
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        run_and_wait(fn, args)
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def bench_size(t, h, e, k, capacity_factor, repeat, library, seed=0):
    rng = np.random.default_rng(seed)
    x_TH = rng.standard_normal((t, h)).astype(np.float32)
    g_TH = rng.standard_normal((t, h)).astype(np.float32)
    expert_ids_TK = np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)
    weights_TK = rng.random((t, k)).astype(np.float32)
    plan = K.permutation_from_routing(expert_ids_TK, e)
    w_N = weights_TK.reshape(-1)[plan.row_assignment_N]
    capacity = math.ceil(capacity_factor * t * k / e)
    slot_token_S, slot_A = padded_slots(expert_ids_TK, e, capacity)
    gate_A = weights_TK.T.reshape(-1) * (slot_A < e * capacity)

    paths = {
        "aot": (PaddingFree(K.KERNEL_AOT, plan.sorted_token_idx_N, library), w_N, t * k),
        "ops": (PaddingFree(K.KERNEL_OPS, plan.sorted_token_idx_N, library), w_N, t * k),
        "padded": (Padded(slot_token_S, slot_A, e, capacity, k), gate_A, e * capacity),
    }
    rows, outs = [], {}
    for name, (net, w, dispatched_rows) in paths.items():
        args = (Tensor(x_TH), Tensor(w.astype(np.float32)))
        outs[name] = net(*args).asnumpy()
        rows.append({
            "evidence": "measured", "path": name, "T": t, "H": h, "E": e, "K": k,
            "capacity": capacity if name == "padded" else None,
            "dispatched_rows": dispatched_rows,
            "fwd_ms": round(time_ms(net, args, repeat), 3),
            "fwd_bwd_ms": round(time_ms(FwdBwd(net, g_TH), args, repeat), 3),
        })
    # The padding-free paths must agree with each other (padded drops overflow, so it differs).
    assert np.allclose(outs["aot"], outs["ops"], rtol=1e-5, atol=1e-5), "aot and ops disagree"
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["1024,256,8,2", "4096,256,8,2",
                                                        "4096,1024,16,2"],
                        help="T,H,E,K per size")
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--json", help="write the rows and the environment to this file")
    args = parser.parse_args(argv)
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    library = K.build_kernel_library()
    rows = []
    for size in args.sizes:
        t, h, e, k = (int(v) for v in size.split(","))
        rows += bench_size(t, h, e, k, args.capacity_factor, args.repeat, library)

    print("| T | H | E | K | path | rows | fwd ms | fwd+bwd ms | fwd+bwd vs ops |")
    print("|---|---|---|---|---|---|---|---|---|")
    ops_time = {(r["T"], r["H"], r["E"], r["K"]): r["fwd_bwd_ms"]
                for r in rows if r["path"] == "ops"}
    for r in rows:
        ratio = ops_time[(r["T"], r["H"], r["E"], r["K"])] / r["fwd_bwd_ms"]
        print(f"| {r['T']} | {r['H']} | {r['E']} | {r['K']} | {r['path']} | {r['dispatched_rows']} "
              f"| {r['fwd_ms']:.2f} | {r['fwd_bwd_ms']:.2f} | {ratio:.2f}x |")
    if args.json:
        env = {"mindspore": ms.__version__, "cpus": os.cpu_count(), "machine": platform.machine(),
               "mode": "GRAPH_MODE", "capacity_factor": args.capacity_factor,
               "repeat": args.repeat, "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
        with open(args.json, "w") as f:
            json.dump({"environment": env, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
