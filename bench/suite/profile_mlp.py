"""Where the time goes: GPU kernel time of one expert-MLP (SwiGLU, probs) forward+backward per kernel
family, from torch.profiler, for the benchmark's model shapes (bench/workloads.py).

    python -m bench.suite.profile_mlp [--recipe fp8_blockwise] [--shapes DeepSeek-V2-Lite ...]
"""

from __future__ import annotations

import argparse
import collections

import moegemm
import torch
from bench.workloads import SHAPES, zipf_splits

from bench.preflight import require_cuda_gpu

PROG = "python -m bench.suite.profile_mlp"


def family(name: str) -> str:
    n = name.lower()
    for key, fam in [("act_backward", "act_bwd+quant"), ("activeforward", "act_fwd+quant"), ("actforward", "act_fwd+quant"),
                     ("actbackward", "act_bwd+quant"), ("plainloader", "quantize_act"), ("quantize_weight", "quantize_weight"),
                     ("make_plan", "plan"), ("build_args", "gemm args"), ("zero_empty", "zero_empty"),
                     ("cutlass", "gemm"), ("gemm", "gemm"), ("device_kernel", "gemm")]:
        if key in n:
            return fam
    return "other: " + name[:60]


def profile(shape, recipe, iters=5):
    E, H, F, T = SHAPES[shape]
    mlp = moegemm.GroupedMLP(E, H, F, recipe=recipe, device="cuda", fp8_weight_cache=False)  # quantize every step
    m = torch.tensor(zipf_splits(E, T), device="cuda")
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(T, device="cuda", requires_grad=True)
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)

    def step():  # a training step's expert work: fresh gradients (as after optimizer.zero_grad())
        x.grad = probs.grad = None
        mlp.zero_grad(set_to_none=True)
        mlp(x, m, probs).backward(dy)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    times = collections.Counter()
    counts = collections.Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            fam = family(ev.name)
            times[fam] += ev.device_time_total / iters
            counts[fam] += 1 / iters
    total = sum(times.values())
    print(f"\n{shape} {recipe}: E={E} H={H} F={F} T={T}: GPU kernel time {total / 1e3:.3f} ms per fwd+bwd")
    for fam, t in times.most_common():
        print(f"  {fam:40s} {t / 1e3:8.3f} ms  {100 * t / total:5.1f}%  launches {counts[fam]:.0f}")
    mlp = None  # (not del: step() reads it)
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="fp8_blockwise", help="moegemm recipe: fp8_blockwise or bf16")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), help="model shapes (default: all)")
    args = ap.parse_args()
    require_cuda_gpu(PROG, hopper=True)
    for s in args.shapes:
        profile(s, args.recipe)


if __name__ == "__main__":
    main()
