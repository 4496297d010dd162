"""The FP8 ragged-reduction GEMM table (wgrad): moegemm's own sm90 kernel (each tiling of
csrc/kernels/gemm/heuristics.h and the heuristic's choice), CUTLASS's ptr-array kernel and, when its source
is carried (``bench/peers/deepgemm.py``), DeepGEMM's k-grouped contiguous GEMM, side by side in one run,
with the roofline of the benchmark (dense FP8 ceiling and copy bandwidth measured in the same run,
bench/gemm/mlp_problems.py).

Both output modes: fp32 added into an existing gradient (Megatron's main_grad; DeepGEMM's only mode) and
bf16 written. Timing as bench/gemm/ragged_rows.py: the kernels of one problem interleaved, ``--iters``
back-to-back calls per kernel and round, each kernel's median over ``--rounds`` rounds.

Problems: DeepGEMM's six k-grouped shapes (groups, the gradient's M x N, nominal tokens per group; each
group's tokens uniform within ±30 % of the nominal: moegemm's unpadded, DeepGEMM's rounded up to 128 as it
requires, with its host sizes) and the benchmark's model shapes (bench/workloads.py: fc1/fc2 wgrad, Zipf
and balanced splits, the small-experts workload). Operands are quantized beforehand; TFLOP/s counts real
tokens only. Every kernel's output is compared with CUTLASS's.

    python -m bench.gemm.ragged_reduction [--quick] [--tilings] [--deepgemm] [--json PATH] [--md PATH]
    (with --deepgemm: LD_PRELOAD=$(g++ -print-file-name=libstdc++.so.6) python -m bench.gemm.ragged_reduction ...)
"""

from __future__ import annotations

import argparse
import json
import random

from bench.preflight import require_cuda_gpu

PROG = "python -m bench.gemm.ragged_reduction"
DEEPGEMM_SHAPES = [  # groups, gradient rows M, gradient columns N, nominal tokens per group
    (4, 4096, 7168, 8192), (8, 4096, 7168, 4096), (16, 4096, 7168, 2048),
    (32, 4096, 7168, 1024), (64, 2816, 2048, 384), (8, 28672, 4096, 2048),
]
MODES = {"f32+=": "f32_accumulate", "bf16": "bf16"}


def parse_args():
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer rounds; model shapes with Zipf splits only")
    ap.add_argument("--iters", type=int, default=10, help="back-to-back calls per kernel and round (default 10)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per problem (default 9, quick 5)")
    ap.add_argument("--tilings", action="store_true", help="also time each of the sm90 kernel's tilings")
    ap.add_argument("--deepgemm", action="store_true", help="add DeepGEMM (built from .peers/DeepGEMM; needs the preload)")
    ap.add_argument("--shapes", default=None, help="only problems whose label contains one of these (comma-separated)")
    ap.add_argument("--json", default=None, help="write the rows as JSON here")
    ap.add_argument("--md", default=None, help="write the markdown table here")
    return ap.parse_args()


def problems(quick: bool, shapes: str | None) -> list:
    """(label, splits, N, K) of every row of the table: the gradient [N, K] per expert."""
    from bench.workloads import jittered_splits, table_points

    rng = random.Random(0)
    out = [(f"DG {G}x{tokens} M={M} N={N}", jittered_splits(G, tokens, rng), M, N) for G, M, N, tokens in DEEPGEMM_SHAPES]
    for label, E, H, F, splits in table_points(quick):
        out += [(f"{label} fc1 wgrad", splits, 2 * F, H), (f"{label} fc2 wgrad", splits, H, F)]
    if shapes:
        keys = [s.strip() for s in shapes.split(",")]
        out = [p for p in out if any(k in p[0] for k in keys)]
    return out


def main() -> int:
    args = parse_args()
    require_cuda_gpu(PROG, hopper=True)
    import torch

    from bench.gemm.mlp_problems import ceilings, ops  # builds / loads the extension
    from bench.suite.measure import time_interleaved
    from moegemm.layout import GEMM_CUTLASS, GEMM_SM90, SM90_RAGGED_REDUCTION_TILINGS

    iters, rounds = args.iters, args.rounds or (5 if args.quick else 9)
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    ceiling_info = ceilings()
    fp8, copy = ceiling_info["fp8_tflops"], ceiling_info["copy_gbps"]

    dg = dg_peer = None
    if args.deepgemm:
        from bench.peers import deepgemm as dg_peer

        dg = dg_peer.load(dg_peer.build())

    kernels = {"CUTLASS": (GEMM_CUTLASS, -1)}
    if args.tilings:
        kernels.update({f"sm90 t{i}": (GEMM_SM90, i) for i in range(SM90_RAGGED_REDUCTION_TILINGS)})
    kernels["sm90"] = (GEMM_SM90, -1)

    def call(ops_, plan, kernel, mode, out):
        if mode == "f32_accumulate":
            return lambda: torch.ops.moegemm.gemm_fp8_ragged_reduction_accumulate(*ops_, plan, out, *kernel)
        return lambda: torch.ops.moegemm.gemm_fp8_ragged_reduction(*ops_, plan, torch.bfloat16, *kernel)

    cols = [f"{k} {m}" for m in MODES for k in kernels] + (["DeepGEMM f32+="] if dg else [])
    rows = []
    print("TFLOP/s on real tokens\n" + f"{'problem':40s} {'T':>6s}" + "".join(f" {c:>14s}" for c in cols), flush=True)
    for label, splits, N, K in problems(args.quick, args.shapes):
        E, T = len(splits), sum(splits)
        dy = torch.randn(T, N, device=dev, generator=gen).to(torch.bfloat16)
        x = torch.randn(T, K, device=dev, generator=gen).to(torch.bfloat16)
        plan = ops.make_plan(torch.tensor(splits, device=dev), T)
        _, _, qaT, saT = ops.quantize_act(dy, plan, rows=False)
        _, _, qbT, sbT = ops.quantize_act(x, plan, rows=False)
        operands = (qaT, saT, qbT, sbT)
        flops = 2.0 * T * N * K
        rec = {"problem": label, "E": E, "T": T, "N": N, "K": K, "tflops": {}, "rel_diff_vs_cutlass": {}, "roofline_pct": {}}
        calls = {}
        for m, mode in MODES.items():
            base = None
            for k, kernel in kernels.items():
                out = torch.zeros(E, N, K, device=dev)
                res = call(operands, plan, kernel, mode, out)()
                res = (out if res is None else res).float()
                base = res if base is None else base
                rec["rel_diff_vs_cutlass"][f"{k} {m}"] = ((res - base).norm() / base.norm().clamp_min(1e-30)).item()
                calls[f"{k} {m}"] = call(operands, plan, kernel, mode, out)
            del base, res
        if dg:  # each group's tokens padded to 128 with zeros, as DeepGEMM requires; its host sizes
            calls["DeepGEMM f32+="], _ = dg_peer.wgrad_from_bf16(dg, dy, x, splits)
        times = time_interleaved(calls, rounds, iters)
        for c, ms in times.items():
            rec["tflops"][c] = flops / ms / 1e9
            out_bytes = E * N * K * (8 if "f32" in c else 2)  # fp32 read and written, or bf16 written
            roof_ms = max(flops / (fp8 * 1e9), (T * (N + K) + out_bytes) / (copy * 1e6))
            rec["roofline_pct"][c] = 100.0 * roof_ms / ms
        del calls
        rows.append(rec)
        bad = {v: d for v, d in rec["rel_diff_vs_cutlass"].items() if d > 4e-3}
        print(f"{label:40s} {T:6d}" + "".join(f" {rec['tflops'][c]:14.0f}" for c in cols) + (f"  DIFF {bad}" if bad else ""),
              flush=True)
        del dy, x, qaT, saT, qbT, sbT, operands
        torch.cuda.empty_cache()

    from bench.suite.meta import collect_meta

    meta = collect_meta(args)
    md = [f"{torch.cuda.get_device_name()}, commit {meta['git_commit']}, torch {torch.__version__}; dense FP8 ceiling "
          f"({ceiling_info['fp8_how']}, same run) {fp8:.0f} TFLOP/s, copy {copy:.0f} GB/s. TFLOP/s on real tokens (% of the "
          f"roofline: that ceiling and the copy bandwidth over the operands and the gradient); back-to-back calls, the "
          f"kernels interleaved, each timed batch after as many untimed calls of its own, median over {rounds} rounds of {iters}.", "",
          "| problem | T | " + " | ".join(cols) + " |", "|---|---:|" + "---:|" * len(cols)]
    for r in rows:
        md.append(f"| {r['problem']} | {r['T']} | "
                  + " | ".join(f"{r['tflops'][c]:.0f} ({r['roofline_pct'][c]:.0f} %)" for c in cols) + " |")
    print("\n".join(md))
    if args.md:
        open(args.md, "w").write("\n".join(md) + "\n")
    if args.json:
        json.dump({"meta": meta, "gpu": torch.cuda.get_device_name(), "ceilings": ceiling_info, "iters": iters,
                   "rounds": rounds, "rows": rows}, open(args.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
