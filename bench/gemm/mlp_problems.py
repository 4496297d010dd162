"""The grouped GEMMs of a SwiGLU expert MLP on fixed FP8 operands (fc1/fc2 fprop, dgrad, wgrad with bf16
output and with fp32 accumulation), built with moegemm's own quantization, for every benchmark point
(the model shapes of bench/workloads.py with Zipf and balanced splits, the small-experts workload, issue
6's two GEMM shapes); each GEMM's roofline, and the timing the GEMM tools share. Importing this module
builds or loads moegemm's extension: the tools import it after their machine check."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from moegemm.backends import cuda as ops
from bench.workloads import GEMM_SHAPES, SHAPES, SMALL_EXPERTS, balanced_splits, small_experts_splits, zipf_splits

from bench.suite.measure import measure_ceilings, time_op


@dataclass
class Problem:
    """One grouped GEMM on fixed operands: ragged-row (fprop/dgrad: args = qa, sa, qb, sb) or ragged-reduction
    (wgrad: args = qaT, saT, qbT, sbT, written into `out`, accumulated when `accumulate`)."""
    name: str
    ragged_reduction: bool
    args: tuple
    flops: float
    bytes: float
    out: torch.Tensor | None = None
    accumulate: bool = False
    plan: torch.Tensor | None = None

    def run_production(self):
        if not self.ragged_reduction:
            return ops.gemm_fp8_ragged_rows(*self.args, self.plan)
        if self.accumulate:
            return ops.gemm_fp8_ragged_reduction(*self.args, self.plan, out=self.out)
        return ops.gemm_fp8_ragged_reduction(*self.args, self.plan, out_dtype=self.out.dtype)


def points(shapes: str | None = None):
    """(name, E, hidden, ffn, splits, fc1_only) for every measured point."""
    out = []
    for n, (E, H, F, T) in SHAPES.items():
        out.append((f"{n} zipf", E, H, F, zipf_splits(E, T), False))
        out.append((f"{n} balanced", E, H, F, balanced_splits(E, T), False))
    for n, (E, H, F, T) in SMALL_EXPERTS.items():
        out.append((n, E, H, F, small_experts_splits(E, T), False))
    for n, (E, K, N, T) in GEMM_SHAPES.items():
        out.append((n, E, K, N // 2, balanced_splits(E, T), True))
    if shapes:
        keys = [s.strip() for s in shapes.split(",")]
        out = [p for p in out if any(k in p[0] for k in keys)]
    return out


def rand(*shape):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)


def problems(E, H, F, splits, fc1_only=False) -> list[Problem]:
    """The GEMMs of a SwiGLU expert MLP (fc1: K=H, N=2F; fc2: K=F, N=H) with these splits."""
    T = sum(splits)
    plan = ops.make_plan(torch.tensor(splits, device="cuda"), T)
    f32, bf16 = torch.float32, torch.bfloat16

    def ragged_rows(name, a, w):  # a [T, K], w [E, N, K]
        N, K = w[0].shape[1], w[0].shape[2]
        return Problem(name, False, a + w, 2.0 * T * N * K, T * K * 1.0 + T * (K // 128) * 4 + E * N * K + T * N * 2.0)

    def ragged_reduction(name, dyT, xT, N, K, dtype, accumulate=False):
        out = torch.zeros(E, N, K, device="cuda", dtype=dtype)
        nbytes = T * (N + K) * 1.0 + E * N * K * dtype.itemsize * (2 if accumulate else 1)
        return Problem(name, True, dyT + xT, 2.0 * T * N * K, nbytes, out, accumulate)

    qx, sx, qxT, sxT = ops.quantize_act(rand(T, H), plan)
    qw1, sw1, qw1T, sw1T = ops.quantize_weight(rand(E, 2 * F, H))
    out = [ragged_rows("fc1 fprop", (qx, sx), (qw1, sw1))]
    if not fc1_only:
        qa, sa, qaT, saT = ops.quantize_act(rand(T, F), plan)
        qdy, sdy, qdyT, sdyT = ops.quantize_act(rand(T, H), plan)
        qdh, sdh, qdhT, sdhT = ops.quantize_act(rand(T, 2 * F), plan)
        qw2, sw2, qw2T, sw2T = ops.quantize_weight(rand(E, H, F))
        out += [
            ragged_rows("fc2 fprop", (qa, sa), (qw2, sw2)),
            ragged_rows("fc2 dgrad", (qdy, sdy), (qw2T, sw2T)),
            ragged_rows("fc1 dgrad", (qdh, sdh), (qw1T, sw1T)),
            ragged_reduction("fc2 wgrad bf16", (qdyT, sdyT), (qaT, saT), H, F, bf16),
            ragged_reduction("fc1 wgrad bf16", (qdhT, sdhT), (qxT, sxT), 2 * F, H, bf16),
            ragged_reduction("fc2 wgrad f32+=", (qdyT, sdyT), (qaT, saT), H, F, f32, True),
            ragged_reduction("fc1 wgrad f32+=", (qdhT, sdhT), (qxT, sxT), 2 * F, H, f32, True),
        ]
    for p in out:
        p.plan = plan
    return out


def roofline_ms(p: Problem, ceilings: dict) -> float:
    return max(p.flops / (ceilings["fp8_tflops"] * 1e9), p.bytes / (ceilings["copy_gbps"] * 1e6))


def time_ms(fn, iters: int) -> float:
    return time_op(fn, 0.0, iters, iters, 3)["ms"]  # 3 warm-up calls, median of `iters`


def ceilings() -> dict:
    ce = measure_ceilings({"ceiling_n": 8192, "ceiling_s": 0.3, "copy_elems": 1 << 29})
    print(f"ceilings: FP8 dense {ce['fp8_tflops']:.0f} TFLOP/s ({ce['fp8_how']}), copy {ce['copy_gbps']:.0f} GB/s", flush=True)
    return ce
