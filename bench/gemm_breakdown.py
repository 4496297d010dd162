"""Each FP8 grouped GEMM of the expert MLP (fc1/fc2 fprop, dgrad, wgrad) timed alone, on the SPEC §7
shapes (Zipf splits) and issue 6's two GEMM shapes: where the GEMM time of the MLP goes.
(At commit 085894a this script also compared a pingpong schedule: bench/logs/gemm_schedules_h100.log.)

    python bench/gemm_breakdown.py [--iters 30]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from moegemm import cuda_ops as ops  # noqa: E402
from moegemm.workloads import GEMM_SHAPES, SHAPES, balanced_splits, zipf_splits  # noqa: E402

from measure import time_op  # noqa: E402  (bench/ is on sys.path: the script's folder)


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
    points += [(n, E, K, N // 2, balanced_splits(E, T), True) for n, (E, K, N, T) in GEMM_SHAPES.items()]
    print(f"{'shape':28s} {'gemm':15s} {'ms':>8s} {'TFLOP/s':>8s}")
    for name, E, H, F, splits, fc1_only in points:
        for g, (fn, flops) in gemms(E, H, F, splits, fc1_only).items():
            ms = time_op(fn, 0.0, args.iters, args.iters, 3)["ms"]  # 3 warm-up calls, median of args.iters
            print(f"{name:28s} {g:15s} {ms:8.3f} {flops / ms / 1e9:8.0f}", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
