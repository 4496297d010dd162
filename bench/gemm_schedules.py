"""Each FP8 grouped GEMM of the expert MLP (fc1/fc2 fprop, dgrad, wgrad) timed alone under every
schedule (MOEGEMM_FP8_GEMM_SCHEDULE), on the SPEC §7 shapes (Zipf splits) and issue 6's two GEMM
shapes: the measurements behind the heuristic in csrc/kernels/gemm_fp8_schedule.cu.

    python bench/gemm_schedules.py [--iters 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from moegemm import cuda_ops as ops  # noqa: E402
from moegemm.workloads import SHAPES, balanced_splits, zipf_splits  # noqa: E402

SCHEDULES = ("cooperative", "pingpong")
GEMM_SHAPES = {"GEMM 4x8192 N=4096 K=7168": (4, 7168, 2048, 4 * 8192), "GEMM 64x2304 N=2816 K=2048": (64, 2048, 1408, 64 * 2304)}


def timed(fn, iters):
    for _ in range(3):
        fn()
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in evs:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in evs)


def rand(*shape):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)


def gemms(E, H, F, splits, fc1_only=False):
    """name -> (callable, flops) for the six GEMMs of a SwiGLU expert MLP with these splits."""
    T = sum(splits)
    plan = ops.make_plan(torch.tensor(splits, device="cuda"), T)
    qx, sx, qxT, sxT = ops.quantize_act(rand(T, H), plan)
    qw1, sw1, qw1T, sw1T = ops.quantize_weight(rand(E, 2 * F, H))
    out = {"fc1 fprop": (lambda: ops.gemm_fp8_ragged_m(qx, sx, qw1, sw1, plan), 2.0 * T * H * 2 * F)}
    if fc1_only:
        return out
    qa, sa, qaT, saT = ops.quantize_act(rand(T, F), plan)
    qdy, sdy, qdyT, sdyT = ops.quantize_act(rand(T, H), plan)
    qdh, sdh, qdhT, sdhT = ops.quantize_act(rand(T, 2 * F), plan)
    qw2, sw2, qw2T, sw2T = ops.quantize_weight(rand(E, H, F))
    bf16 = torch.bfloat16
    out.update({
        "fc2 fprop": (lambda: ops.gemm_fp8_ragged_m(qa, sa, qw2, sw2, plan), 2.0 * T * F * H),
        "fc2 dgrad": (lambda: ops.gemm_fp8_ragged_m(qdy, sdy, qw2T, sw2T, plan), 2.0 * T * H * F),
        "fc1 dgrad": (lambda: ops.gemm_fp8_ragged_m(qdh, sdh, qw1T, sw1T, plan), 2.0 * T * 2 * F * H),
        "fc2 wgrad bf16": (lambda: ops.gemm_fp8_ragged_k(qdyT, sdyT, qaT, saT, plan, out_dtype=bf16), 2.0 * T * H * F),
        "fc1 wgrad bf16": (lambda: ops.gemm_fp8_ragged_k(qdhT, sdhT, qxT, sxT, plan, out_dtype=bf16), 2.0 * T * 2 * F * H),
        "fc1 wgrad fp32": (lambda: ops.gemm_fp8_ragged_k(qdhT, sdhT, qxT, sxT, plan), 2.0 * T * 2 * F * H),
    })
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    points = [(n, E, H, F, zipf_splits(E, T), False) for n, (E, H, F, T) in SHAPES.items()]
    points += [(n, E, H, F, balanced_splits(E, T), True) for n, (E, H, F, T) in GEMM_SHAPES.items()]
    print(f"{'shape':28s} {'gemm':15s}" + "".join(f"{s + ' ms':>16s}{'TFLOP/s':>9s}" for s in SCHEDULES)
          + f"{'best':>13s} {'max rel diff':>12s}")
    for name, E, H, F, splits, fc1_only in points:
        for g, (fn, flops) in gemms(E, H, F, splits, fc1_only).items():
            res, outs = {}, {}
            for s in SCHEDULES:
                os.environ["MOEGEMM_FP8_GEMM_SCHEDULE"] = s
                res[s] = timed(fn, args.iters)
                outs[s] = fn().float()
            ref = outs[SCHEDULES[0]]
            diff = max(((o - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item() for o in outs.values())
            best = min(res, key=res.get)
            print(f"{name:28s} {g:15s}" + "".join(f"{res[s]:16.3f}{flops / res[s] / 1e9:9.0f}" for s in SCHEDULES)
                  + f"{best:>13s} {diff:12.2e}", flush=True)
            del outs
        torch.cuda.empty_cache()
    os.environ.pop("MOEGEMM_FP8_GEMM_SCHEDULE", None)


if __name__ == "__main__":
    main()
