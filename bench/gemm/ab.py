"""A/B of a change to one of moegemm's grouped GEMM kernels (its own sm90 FP8 ones, or the bf16 ones on CUTLASS), in
one build: the kernel's launcher reads an environment variable at every launch and picks the form under test (a
temporary switch, removed once the A/B has decided), and this tool runs both forms side by side in one process.

1. Bitwise: every form's output equal to the first's, on edge problems (empty experts, 1, 127, 128, 129 rows, one
   expert with every token, E = 1024; K filling whole rounds of the stage ring and not; N with partial tiles) in every
   tiling and the heuristic's. Ragged rows: the raw GEMM, and the fp8 forward with a bias (its fused one-launch form
   up to 2^23 values of x, the two-launch form past them). Ragged reduction: bf16 and fp32 written, fp32 accumulated.
   bf16: fprop, dgrad, and wgrad written in bf16 and fp32 and accumulated into fp32.
2. Timing: the GEMM table's problems (bench/gemm/ragged_rows.py or ragged_reduction.py), each form and tiling
   interleaved per problem (median over rounds of back-to-back calls), TFLOP/s on real tokens (the ragged reduction
   accumulating into fp32, as in training; bf16: the ragged-row table's problems in its three directions), and each
   form's geometric mean over the first.

    python -m bench.gemm.ab --env MOEGEMM_AB_X --values 0,1 [--gemm rows|reduction|bf16] [--tilings -1,4,1] [--quick]
"""

from __future__ import annotations

import argparse
import math
import random
import time

from bench.ab_switch import add_switch_arguments, switch_setter, switch_values
from bench.preflight import require_cuda_gpu

PROG = "python -m bench.gemm.ab"


def parse_args():
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_switch_arguments(ap)
    ap.add_argument("--gemm", choices=("rows", "reduction", "bf16"), default="rows",
                    help="the FP8 ragged-row GEMM (fprop, dgrad; default), the FP8 ragged reduction (wgrad), or the bf16 "
                         "GEMMs (fprop, dgrad, wgrad; no tilings)")
    ap.add_argument("--tilings", default="-1",
                    help="the tilings timed, comma-separated indices of heuristics.h's table (-1: the heuristic's)")
    ap.add_argument("--quick", action="store_true", help="the table's quick problems (model shapes with Zipf splits)")
    ap.add_argument("--shapes", default=None, help="only problems whose label contains one of these (comma-separated)")
    ap.add_argument("--rounds", type=int, default=7, help="rounds per problem (default 7)")
    ap.add_argument("--iters", type=int, default=10, help="back-to-back calls per form and round (default 10)")
    return ap.parse_args()


def edge_problems(rng: random.Random) -> list:
    """(splits, N, K) of the bitwise comparison."""
    out = []
    for K in (128, 256, 384, 512, 640, 768, 1024, 1280, 1408, 2048, 2560, 7168):
        for N in (128, 192, 256, 320, 400, 576, 1408, 2816):
            E, T = rng.choice([1, 3, 8, 17, 64]), rng.choice([1, 200, 1000, 3000])
            cuts = sorted(rng.randint(0, T) for _ in range(E - 1))
            out.append(([b - a for a, b in zip([0] + cuts, cuts + [T])], N, K))
    out += [([0, 1, 17, 127, 128, 129, 0, 300], 4096, 7168), ([5000], 192, 2048), ([9000], 400, 1024),
            ([0] * 1000 + [3, 1, 400] + [0] * 21, 256, 512), ([0, 0, 0], 256, 512), ([1] * 1024, 192, 512)]
    return out


def main() -> int:
    args = parse_args()
    require_cuda_gpu(PROG, hopper=True)
    import torch

    from bench.gemm.mlp_problems import ceilings, ops  # builds / loads the extension
    from bench.suite.measure import time_interleaved
    from moegemm.layout import FP8_BLOCKWISE, GEMM_SM90, SM90_RAGGED_REDUCTION_TILINGS, SM90_RAGGED_ROWS_TILINGS

    values, use = switch_values(args), switch_setter(args)
    bf16_gemms = args.gemm == "bf16"
    tilings = [-1] if bf16_gemms else [int(t) for t in args.tilings.split(",")]
    rows_gemm = args.gemm == "rows"
    every_tiling = [-1] if bf16_gemms else range(-1, SM90_RAGGED_ROWS_TILINGS if rows_gemm else SM90_RAGGED_REDUCTION_TILINGS)
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)

    def gemm(operands, plan, tiling, mode, out=None):
        """One call of the GEMM under test (mode: rows; bf16 / f32 written or f32_accumulate into `out`; for the bf16
        GEMMs fprop, dgrad or wgrad <bf16 | f32 | f32_accumulate>)."""
        if bf16_gemms:
            x, w, dy = operands
            if mode == "fprop":
                return ops.gemm_bf16_fprop(x, w, plan)
            if mode == "dgrad":
                return ops.gemm_bf16_dgrad(dy, w, plan)
            if mode == "wgrad f32_accumulate":
                return ops.gemm_bf16_wgrad(dy, x, plan, out=out)
            return ops.gemm_bf16_wgrad(dy, x, plan, out_dtype=torch.bfloat16 if mode == "wgrad bf16" else torch.float32)
        if rows_gemm:
            return torch.ops.moegemm.gemm_fp8_ragged_rows(*operands, plan, tiling)
        if mode == "f32_accumulate":
            return torch.ops.moegemm.gemm_fp8_ragged_reduction_accumulate(*operands, plan, out, GEMM_SM90, tiling)
        dtype = torch.bfloat16 if mode == "bf16" else torch.float32
        return torch.ops.moegemm.gemm_fp8_ragged_reduction(*operands, plan, dtype, GEMM_SM90, tiling)

    def operands_of(splits, N, K):
        E, T = len(splits), sum(splits)
        plan = ops.make_plan(torch.tensor(splits, device=dev), T)
        if bf16_gemms:
            x = torch.randn(T, K, device=dev, generator=gen).to(torch.bfloat16)
            w = (torch.randn(E, N, K, device=dev, generator=gen) * 0.05).to(torch.bfloat16)
            dy = torch.randn(T, N, device=dev, generator=gen).to(torch.bfloat16)
            return (x, w, dy), plan, None
        if rows_gemm:
            x = torch.randn(T, K, device=dev, generator=gen).to(torch.bfloat16)
            w = (torch.randn(E, N, K, device=dev, generator=gen) * 0.05).to(torch.bfloat16)
            qx, sx, _, _ = ops.quantize_act(x, plan, cols=False)
            qw, sw, _, _ = ops.quantize_weight(w)
            return (qx, sx, qw, sw), plan, (x, w)
        dy = torch.randn(T, N, device=dev, generator=gen).to(torch.bfloat16)
        x = torch.randn(T, K, device=dev, generator=gen).to(torch.bfloat16)
        _, _, qaT, saT = ops.quantize_act(dy, plan, rows=False)
        _, _, qbT, sbT = ops.quantize_act(x, plan, rows=False)
        return (qaT, saT, qbT, sbT), plan, None

    bf16_modes = ["fprop", "dgrad", "wgrad bf16", "wgrad f32", "wgrad f32_accumulate"]
    modes = bf16_modes if bf16_gemms else ["rows"] if rows_gemm else ["bf16", "f32", "f32_accumulate"]
    if not args.no_bitwise:
        t0, compared, bad = time.time(), 0, []
        for splits, N, K in edge_problems(random.Random(1)):
            operands, plan, bf16 = operands_of(splits, N, K)
            E = len(splits)
            for tiling in every_tiling:
                for mode in modes:
                    outs = []
                    for v in values:
                        use(v)
                        acc = None  # main_grad, the same random values for every form
                        if mode.endswith("f32_accumulate"):
                            acc = torch.randn(E, N, K, device=dev, generator=torch.Generator(device=dev).manual_seed(E + N + K))
                        res = gemm(operands, plan, tiling, mode, acc)
                        outs.append((acc if res is None else res).clone())
                    compared += len(values) - 1
                    bad += [(E, sum(splits), N, K, tiling, mode, v) for v, o in zip(values[1:], outs[1:])
                            if not torch.equal(outs[0].view(torch.int16), o.view(torch.int16))]
            if rows_gemm and sum(splits) > 0:  # the fp8 forward with a bias: fused up to 2^23 values of x
                x, w = bf16
                bias = torch.randn(E, N, device=dev, generator=gen)
                given = list(ops.quantize_weight(w))
                outs = []
                for v in values:
                    use(v)
                    y, _, _ = ops.linear_fwd(x, w, torch.tensor(splits, device=dev), bias, FP8_BLOCKWISE, False, True, None, given)
                    outs.append(y.view(torch.int16).clone())
                compared += len(values) - 1
                bad += [(E, sum(splits), N, K, "forward with bias", "rows", v) for v, o in zip(values[1:], outs[1:])
                        if not torch.equal(outs[0], o)]
        torch.cuda.synchronize()
        for b in bad:
            print("NOT BITWISE EQUAL (E, T, N, K, tiling, mode, value):", b, flush=True)
        print(f"bitwise: {compared} comparisons with {args.env}={values[0]}, {len(bad)} unequal ({time.time() - t0:.0f} s)",
              flush=True)

    if args.gemm != "reduction":  # the bf16 GEMMs too, on the ragged-row table
        from bench.gemm.ragged_rows import problems
    else:
        from bench.gemm.ragged_reduction import problems
    table = problems(args.quick, args.shapes)
    info = ceilings()
    print(f"{torch.cuda.get_device_name()}; dense FP8 ceiling {info['fp8_tflops']:.0f} TFLOP/s ({info['fp8_how']}); "
          f"{args.env} in {values}; TFLOP/s on real tokens, median over {args.rounds} rounds of {args.iters}", flush=True)
    timed = ["fprop", "dgrad", "wgrad f32_accumulate"] if bf16_gemms else ["rows"] if rows_gemm else ["f32_accumulate"]
    cols = [(t, v) for t in tilings for v in values]
    print(f"{'problem':44s}" + "".join(f" {f't{t}/{v}':>9s}" for t, v in cols), flush=True)
    ratios = {(mode, t, v): [] for mode in timed for t, v in cols if v != values[0]}
    for label, splits, N, K in table:
        operands, plan, _ = operands_of(splits, N, K)
        E, T = len(splits), sum(splits)
        for mode in timed:
            acc = torch.zeros(E, N, K, device=dev) if mode.endswith("f32_accumulate") else None
            calls = {}
            for t, v in cols:
                def call(t=t, v=v, mode=mode, acc=acc):
                    use(v)
                    gemm(operands, plan, t, mode, acc)
                calls[(t, v)] = call
            tflops = {c: 2.0 * T * N * K / ms / 1e9 for c, ms in time_interleaved(calls, args.rounds, args.iters).items()}
            for m, t, v in ratios:
                if m == mode:
                    ratios[(m, t, v)].append(tflops[(t, v)] / tflops[(t, values[0])])
            name = f"{label} {mode}" if bf16_gemms else label
            print(f"{name:44s}" + "".join(f" {tflops[c]:9.0f}" for c in cols), flush=True)
            del acc, calls
        del operands, plan
        torch.cuda.empty_cache()
    for (mode, t, v), r in ratios.items():
        what = mode if bf16_gemms else f"tiling {t}"
        print(f"{what}: {args.env}={v} over {values[0]}: geometric mean {math.exp(sum(map(math.log, r)) / len(r)):.4f}, "
              f"faster on {sum(x > 1 for x in r)} of {len(r)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
