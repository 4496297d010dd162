"""Where the time goes: GPU kernel time per kernel family, from torch.profiler, for the benchmark's model shapes
(bench/workloads.py, Zipf splits; the small-experts workload with its own skew).

    python -m bench.suite.profile_mlp [--recipe fp8_blockwise] [--shapes DeepSeek-V2-Lite ...]
    python -m bench.suite.profile_mlp --step [--shapes ...]

Default: one expert-MLP (SwiGLU, probs) forward + backward of ``--recipe``, the weights quantized in the call.
``--step``: one training step as the suite's training section runs it (bench/suite/training.py: GA = 1, main_grad
zeroed, accumulated into and applied to the weights), moegemm bf16 next to moegemm fp8 with its FP8 weight cache,
with the times of GA = 1 and GA = 4 (measured as the suite's training table does) split into a per-micro-batch part
((GA4 - GA1) / 3) and a per-step one (GA1 minus it). The harness's own kernels (main_grad's zeroing, the optimizer's update) are named as such: both
recipes pay them alike.
"""

from __future__ import annotations

import argparse
import collections

import torch

from bench.preflight import require_cuda_gpu
from bench.suite.measure import time_op
from bench.workloads import SHAPES, SMALL_EXPERTS, small_experts_splits, zipf_splits

PROG = "python -m bench.suite.profile_mlp"
ALL_SHAPES = {**SHAPES, **SMALL_EXPERTS}
ITERS = 3

# (substring of the kernel's name, lower case; family), the first match wins
FAMILIES = [
    ("fp8_ragged_reduction", "fp8 wgrad GEMM"), ("fp8_ragged_rows", "fp8 fprop/dgrad GEMM"),
    ("glu_backward", "act backward + quantize"), ("glu_forward", "act forward + quantize"),
    ("act_backward", "act backward + quantize"), ("actforward", "act forward + quantize"),
    ("act_bf16", "act (bf16)"), ("fp8rowsloader", "requantize_cols"), ("plainloader", "quantize_act"),
    ("quantize_weight", "quantize_weight"), ("make_plan", "plan"), ("build_args", "gemm args (bf16)"),
    ("sum_rows", "dprobs sum"), ("bias", "bias"), ("cutlass", "bf16 GEMM (CUTLASS)"),
    ("functor_add", "harness: optimizer update w -= lr * main_grad"), ("fillfunctor", "harness: main_grad zeroing"),
]


def family(name: str) -> str:
    n = name.lower()
    for key, fam in FAMILIES:
        if key in n:
            return fam
    return "other: " + name[:60]


def splits_of(shape: str) -> list:
    E, _, _, T = ALL_SHAPES[shape]
    return small_experts_splits(E, T) if shape in SMALL_EXPERTS else zipf_splits(E, T)


def kernel_times(fn, iters=ITERS):
    """{family: (ms, launches)} per call of fn."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    times, counts = collections.Counter(), collections.Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            fam = family(ev.name)
            times[fam] += ev.device_time_total / iters / 1e3
            counts[fam] += 1 / iters
    return {fam: (t, counts[fam]) for fam, t in times.most_common()}


def print_families(fams, indent="  "):
    total = sum(t for t, _ in fams.values())
    for fam, (t, n) in fams.items():
        print(f"{indent}{fam:48s} {t:8.3f} ms  {100 * t / total:5.1f}%  launches {n:.0f}")


def profile(shape, recipe):
    import moegemm

    E, H, F, T = ALL_SHAPES[shape]
    mlp = moegemm.GroupedMLP(E, H, F, recipe=recipe, device="cuda", fp8_weight_cache=False)  # quantize every step
    m = torch.tensor(splits_of(shape), device="cuda")
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(T, device="cuda", requires_grad=True)
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)

    def step():  # a training step's expert work: fresh gradients (as after optimizer.zero_grad())
        x.grad = probs.grad = None
        mlp.zero_grad(set_to_none=True)
        mlp(x, m, probs).backward(dy)

    for _ in range(2):
        step()
    fams = kernel_times(step)
    print(f"\n{shape} {recipe}: E={E} H={H} F={F} T={T}: GPU kernel time {sum(t for t, _ in fams.values()):.3f} ms "
          f"per fwd+bwd")
    print_families(fams)
    torch.cuda.empty_cache()


def profile_step(shape):
    from bench.suite import moegemm_variants
    from bench.suite.cases import Case
    from bench.suite.training import TrainStep

    E, H, F, T = ALL_SHAPES[shape]
    moegemm_variants.load("moegemm_bf16")
    c = Case(shape, E, H, F, splits_of(shape), "cuda", seed=1)
    print(f"\n{shape}: E={E} H={H} F={F} T={T}, one training step (GA = 1) by kernel family")
    ga = {}
    for key in ("moegemm_bf16", "moegemm_fp8_wcache"):
        st = TrainStep(key, c)
        # timed as the suite's training table times it (back-to-back steps, median of CUDA events)
        ga1, ga4 = (time_op(lambda g=g: st.run(g), 0.5, 5, 20, 1)["ms"] for g in (1, 4))
        per_mb = (ga4 - ga1) / 3
        ga[key] = (ga1, ga4)
        fams = kernel_times(lambda: st.run(1))
        print(f"\n  {key}: GA1 {ga1:.3f} ms, GA4 {ga4:.3f} ms; per micro-batch {per_mb:.3f} ms, per step "
              f"{ga1 - per_mb:.3f} ms; kernels at GA1 {sum(t for t, _ in fams.values()):.3f} ms")
        print_families(fams, indent="    ")
        del st
        torch.cuda.empty_cache()
    (b1, b4), (f1, f4) = ga["moegemm_bf16"], ga["moegemm_fp8_wcache"]
    print(f"\n  moegemm fp8 (weight cache) over moegemm bf16: GA1 {b1 / f1:.3f}x, GA4 {b4 / f4:.3f}x")


def main():
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="fp8_blockwise", help="moegemm recipe: fp8_blockwise or bf16 (not with --step)")
    ap.add_argument("--shapes", nargs="*", default=list(ALL_SHAPES), help="model shapes (default: all)")
    ap.add_argument("--step", action="store_true", help="one training step, moegemm bf16 next to fp8 (weight cache)")
    args = ap.parse_args()
    unknown = [s for s in args.shapes if s not in ALL_SHAPES]
    if unknown:
        ap.error(f"unknown shapes {unknown}; choose from {list(ALL_SHAPES)}")
    require_cuda_gpu(PROG, hopper=True)
    for s in args.shapes:
        profile_step(s) if args.step else profile(s, args.recipe)


if __name__ == "__main__":
    main()
