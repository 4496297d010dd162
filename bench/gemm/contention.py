"""The grouped GEMMs under contention: a kernel on another stream holds k SMs (one CTA per SM, ~200 KB of shared
memory each, spinning for longer than the GEMMs run) while the GEMM runs on the current stream, as an expert-parallel
all-to-all does. Each GEMM's time is reported over its ideal, its time alone x SMs / (SMs - k) (1.0: it uses the free
SMs perfectly), without an SM budget and with the budget set to the free SMs (moegemm.set_num_sms).

    python -m bench.gemm.contention [--shapes DeepSeek-V3-EP8,Mixtral-8x7B] [--held 0,8,16,24,33] [--json PATH]

Needs a Hopper GPU and CuPy (the holding kernel is compiled with NVRTC). Writes nothing unless --json names a file.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import moegemm
from bench.workloads import SHAPES, SMALL_EXPERTS, small_experts_splits, zipf_splits

HOLD_SOURCE = r"""
extern "C" __global__ void hold(long long cycles, int* started) {
  extern __shared__ char smem[];
  if (threadIdx.x == 0) { smem[0] = 1; atomicAdd(started, 1); }
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) { }
}
"""
HOLD_SMEM = 200 * 1024


class Holder:
    """Holds k SMs from a side stream for about `seconds` (SM clocks counted at 2 GHz, at most the boost clock)."""

    def __init__(self):
        import cupy  # only here: the rest of the bench package imports without it
        self.cupy = cupy
        self.kernel = cupy.RawKernel(HOLD_SOURCE, "hold")
        self.kernel.max_dynamic_shared_size_bytes = HOLD_SMEM
        self.stream = torch.cuda.Stream()
        self.started = torch.zeros(1, dtype=torch.int32, device="cuda")

    def hold(self, k: int, seconds: float) -> None:
        if k == 0:
            return
        self.started.zero_()
        torch.cuda.synchronize()
        with self.cupy.cuda.ExternalStream(self.stream.cuda_stream):
            self.kernel((k,), (32,), (int(seconds * 2.0e9), self.started.data_ptr()), shared_mem=HOLD_SMEM)
        while int(self.started.item()) < k:  # every holding CTA resident before the GEMM is launched
            time.sleep(1e-4)

    def release(self) -> None:
        self.stream.synchronize()


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def gemms(name: str, E: int, H: int, F: int, T: int):
    """name -> fn of the fc1 GEMMs of one shape: FP8 fprop, dgrad and wgrad (fp32 accumulated), bf16 fprop and
    wgrad, and torch._grouped_mm's bf16 fprop."""
    from moegemm.backends import cuda as ops
    splits = small_experts_splits(E, T) if name in SMALL_EXPERTS else zipf_splits(E, T)
    m = torch.tensor(splits, device="cuda")
    plan = ops.make_plan(m, T)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, F, H, device="cuda", dtype=torch.bfloat16) * 0.05
    dy = torch.randn(T, F, device="cuda", dtype=torch.bfloat16)
    qx, sx, qxT, sxT = ops.quantize_act(x, plan)
    qdy, sdy, qdyT, sdyT = ops.quantize_act(dy, plan)
    qw, sw, qwT, swT = ops.quantize_weight(w)
    main_grad = torch.zeros(E, F, H, device="cuda", dtype=torch.float32)
    offs = torch.cumsum(m, 0).to(torch.int32)
    wt = w.transpose(1, 2)
    return {
        "fp8 fprop": lambda: ops.gemm_fp8_ragged_m(qx, sx, qw, sw, plan),
        "fp8 dgrad": lambda: ops.gemm_fp8_ragged_m(qdy, sdy, qwT, swT, plan),
        "fp8 wgrad": lambda: ops.gemm_fp8_ragged_k(qdyT, sdyT, qxT, sxT, plan, out=main_grad),
        "bf16 fprop": lambda: ops.gemm_bf16_fprop(x, w, plan),
        "bf16 wgrad": lambda: ops.gemm_bf16_wgrad(dy, x, plan, out=main_grad),
        "torch._grouped_mm bf16 fprop": lambda: torch._grouped_mm(x, wt, offs=offs),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.gemm.contention", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="DeepSeek-V3-EP8,Mixtral-8x7B,Small experts E=64")
    ap.add_argument("--held", default="0,8,16,24,33", help="SMs held by the other stream, comma-separated")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", help="write the rows to this file (default: none)")
    args = ap.parse_args(argv)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    holder = Holder()
    shapes = {**SHAPES, **SMALL_EXPERTS}
    rows = []
    print(f"{torch.cuda.get_device_name()}: {sms} SMs; time over ideal (alone x {sms} / ({sms} - k))")
    for name in [s.strip() for s in args.shapes.split(",") if s.strip()]:
        E, H, F, T = shapes[name]
        for gemm, fn in gemms(name, E, H, F, T).items():
            for _ in range(3):
                fn()
            alone = median_ms(fn, args.reps)
            line = f"{name:20s} {gemm:30s} alone {alone:7.3f} ms |"
            for k in [int(v) for v in args.held.split(",")]:
                for budget in ([None] if k == 0 else [None, sms - k]):
                    moegemm.set_num_sms(budget)
                    fn()
                    holder.hold(k, seconds=max(0.05, 40 * alone * 1e-3))
                    t = median_ms(fn, args.reps)
                    holder.release()
                    moegemm.set_num_sms(None)
                    ratio = t / (alone * sms / (sms - k))
                    rows.append({"shape": name, "gemm": gemm, "held": k, "budget": budget, "ms": t, "alone_ms": alone,
                                 "over_ideal": ratio, "gpu": torch.cuda.get_device_name()})
                    line += f" k={k}{'b' if budget else ''} {ratio:.2f}"
            print(line, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
