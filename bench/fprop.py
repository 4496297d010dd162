"""First throughput figures: GroupedLinear forward (fc1 of the expert MLP, N = 2·ffn for SwiGLU) on the
SPEC §7 model shapes with Zipf-skewed m_splits (empty experts included), moegemm next to
torch._grouped_mm (bf16) in the same process. Median of CUDA-event timings after warm-up.

    python bench/fprop.py            # prints a markdown table
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

import torch

import moegemm
from moegemm import cuda_ops

SHAPES = {  # name: (E, hidden, ffn per expert, routed tokens)
    "DeepSeek-V2-Lite": (64, 2048, 1408, 24576),
    "Qwen3-30B-A3B": (128, 2048, 768, 32768),
    "DeepSeek-V3-EP8": (32, 7168, 2048, 32768),
    "Mixtral-8x7B": (8, 4096, 14336, 16384),
}


def zipf_splits(E, T, alpha=1.2, empty_frac=0.125, seed=0):
    rng = random.Random(seed)
    w = [1.0 / (r + 1) ** alpha for r in range(E)]
    rng.shuffle(w)
    for e in rng.sample(range(E), max(1, int(E * empty_frac)) if E > 1 else 0):
        w[e] = 0.0
    counts = [int(T * x / sum(w)) for x in w]
    counts[max(range(E), key=lambda e: w[e])] += T - sum(counts)
    return counts


def time_ms(fn, iters=50, warmup=10):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for name, (E, H, F, T) in SHAPES.items():
        K, N = H, 2 * F
        splits = zipf_splits(E, T)
        m = torch.tensor(splits, device="cuda")
        x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) * 0.02
        offs = torch.cumsum(m, 0).to(torch.int32)
        wt = w.transpose(1, 2)
        flops = 2.0 * T * N * K
        plan = cuda_ops.make_plan(m, T)
        qw, sw, _, _ = cuda_ops.quantize_weight(w)
        res = {
            "torch._grouped_mm bf16": time_ms(lambda: torch._grouped_mm(x, wt, offs=offs)),
            "moegemm bf16": time_ms(lambda: moegemm.grouped_linear(x, w, m, recipe="bf16")),
            "moegemm fp8 (act+weight quant+GEMM)": time_ms(lambda: moegemm.grouped_linear(x, w, m)),
            "moegemm fp8 (act quant+GEMM)": time_ms(
                lambda: cuda_ops.gemm_fp8_ragged_m(*cuda_ops.quantize_act(x, plan, True, False)[:2], qw, sw, plan)),
        }
        qx, sx, _, _ = cuda_ops.quantize_act(x, plan, True, False)
        res["moegemm fp8 GEMM only"] = time_ms(lambda: cuda_ops.gemm_fp8_ragged_m(qx, sx, qw, sw, plan))
        for variant, ms in res.items():
            rows.append({"shape": name, "E": E, "T": T, "K": K, "N": N, "variant": variant, "ms": ms,
                         "tflops": flops / ms / 1e9})
        del x, w, wt, qw, sw, qx, sx
        torch.cuda.empty_cache()
    print(f"\nGroupedLinear forward (fc1, N=2*ffn), {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| shape | variant | ms | TFLOP/s | vs torch bf16 |\n|---|---|---|---|---|")
    base = {r["shape"]: r["ms"] for r in rows if r["variant"] == "torch._grouped_mm bf16"}
    for r in rows:
        print(f"| {r['shape']} | {r['variant']} | {r['ms']:.3f} | {r['tflops']:.0f} | {base[r['shape']] / r['ms']:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
