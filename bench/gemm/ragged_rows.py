"""The FP8 ragged-row GEMM table (fprop and dgrad): moegemm's own sm90 kernel (each tiling of
csrc/kernels/gemm/heuristics.h and the heuristic's choice) and, when its source is carried
(``bench/peers/deepgemm.py``), DeepGEMM's m-grouped contiguous GEMM, side by side in one run
with the benchmark's dense FP8 ceiling measured in the same run (bench/gemm/mlp_problems.py: the same
ceiling as the other GEMM tools and the suite).

Timing: back-to-back calls, the kernels of one problem interleaved — in each of ``--rounds`` rounds every
kernel runs ``--iters`` untimed calls, then ``--iters`` calls in a row between two CUDA events — and each
kernel's median over the rounds, so that a drift of the GPU's clock (power, temperature) during the run falls on
every kernel alike and no kernel is timed in the power state its neighbour left (bench/suite/measure.py).

Problems: DeepGEMM's six m-grouped shapes (groups x nominal rows, N, K; each group's rows uniform within
±30 % of the nominal) and the benchmark's model shapes (bench/workloads.py: fc1/fc2 fprop and dgrad, Zipf
and balanced splits, the small-experts workload). Operands are quantized beforehand; TFLOP/s counts real
tokens only (DeepGEMM also computes the rows that pad each group to 128, as its users must). Every
moegemm kernel's output is compared with the float64 reference (``moegemm/reference.py``) on the same
quantized operands.

    python -m bench.gemm.ragged_rows [--quick] [--tilings N] [--deepgemm] [--shapes DG,...] [--json PATH] [--md PATH]
    (with --deepgemm: LD_PRELOAD=$(g++ -print-file-name=libstdc++.so.6) python -m bench.gemm.ragged_rows ...)
"""

from __future__ import annotations

import argparse
import json
import random

from bench.preflight import require_cuda_gpu

PROG = "python -m bench.gemm.ragged_rows"
DEEPGEMM_SHAPES = [  # groups, nominal rows per group, N, K
    (4, 8192, 4096, 7168), (4, 8192, 7168, 2048), (8, 4096, 6144, 7168),
    (32, 1024, 4096, 7168), (64, 384, 2816, 2048), (64, 192, 2816, 2048),
]


def parse_args():
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer iterations; model shapes with Zipf splits only")
    ap.add_argument("--iters", type=int, default=10, help="back-to-back calls per kernel and round (default 10)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per problem (default 9, quick 5)")
    ap.add_argument("--tilings", type=int, default=0,
                    help="also time the sm90 kernel's first N tilings (heuristics.h's table) one by one")
    ap.add_argument("--deepgemm", action="store_true", help="add DeepGEMM (built from .peers/DeepGEMM; needs the preload)")
    ap.add_argument("--shapes", default=None, help="only problems whose label contains one of these (comma-separated)")
    ap.add_argument("--json", default=None, help="write the rows as JSON here")
    ap.add_argument("--md", default=None, help="write the markdown table here")
    return ap.parse_args()


def problems(quick: bool, shapes: str | None = None) -> list:
    """(label, splits, N, K) of every row of the table (with `shapes`, those whose label contains one of them)."""
    from bench.workloads import jittered_splits, table_points

    rng = random.Random(0)
    out = [(f"DG {G}x{rows} N={N} K={K}", jittered_splits(G, rows, rng), N, K) for G, rows, N, K in DEEPGEMM_SHAPES]
    for label, E, H, F, splits in table_points(quick):
        for gemm, N, K in (("fc1 fprop", 2 * F, H), ("fc2 fprop", H, F), ("fc1 dgrad", H, 2 * F), ("fc2 dgrad", F, H)):
            out.append((f"{label} {gemm}", splits, N, K))
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

    iters, rounds = args.iters, args.rounds or (5 if args.quick else 9)
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    ceiling_info = ceilings()
    ceiling = ceiling_info["fp8_tflops"]

    dg = dg_peer = None
    if args.deepgemm:
        from bench.peers import deepgemm as dg_peer

        dg = dg_peer.load(dg_peer.build())

    from moegemm import reference as ref

    variants = {f"sm90 t{i}": i for i in range(args.tilings)}
    variants["sm90"] = -1
    cols = list(variants) + (["DeepGEMM"] if dg else [])
    rows = []
    print("TFLOP/s on real tokens\n" + f"{'problem':44s} {'T':>6s}" + "".join(f" {c:>9s}" for c in cols), flush=True)
    for label, splits, N, K in problems(args.quick, args.shapes):
        E, T = len(splits), sum(splits)
        x = torch.randn(T, K, device=dev, generator=gen).to(torch.bfloat16)
        w = (torch.randn(E, N, K, device=dev, generator=gen) * 0.05).to(torch.bfloat16)
        m = torch.tensor(splits, device=dev)
        plan = ops.make_plan(m, T)
        qx, sx, _, _ = ops.quantize_act(x, plan, cols=False)
        qw, sw, _, _ = ops.quantize_weight(w)
        flops = 2.0 * T * N * K
        rec = {"problem": label, "E": E, "T": T, "N": N, "K": K, "tflops": {}, "rel_diff_vs_reference": {}}
        expect = ref.gemm_fp8_ragged_rows(qx, sx, qw, sw, ref.make_plan(m, T), torch.float64)
        calls = {}
        for v, tiling in variants.items():
            out = torch.ops.moegemm.gemm_fp8_ragged_rows(qx, sx, qw, sw, plan, tiling).double()
            rec["rel_diff_vs_reference"][v] = ((out - expect).norm() / expect.norm().clamp_min(1e-30)).item()
            calls[v] = lambda tiling=tiling: torch.ops.moegemm.gemm_fp8_ragged_rows(qx, sx, qw, sw, plan, tiling)
        del expect, out
        if dg:  # each group padded to 128 rows, as DeepGEMM requires
            calls["DeepGEMM"], _ = dg_peer.fprop_from_bf16(dg, x, w, splits)
        rec["tflops"] = {v: flops / ms / 1e9 for v, ms in time_interleaved(calls, rounds, iters).items()}
        del calls
        rows.append(rec)
        bad = {v: d for v, d in rec["rel_diff_vs_reference"].items() if d > 4e-3}
        print(f"{label:44s} {T:6d}" + "".join(f" {rec['tflops'][c]:9.0f}" for c in cols) + (f"  DIFF {bad}" if bad else ""),
              flush=True)
        del x, w, qx, sx, qw, sw
        torch.cuda.empty_cache()

    from bench.suite.meta import collect_meta

    meta = collect_meta(args)
    md = [f"{torch.cuda.get_device_name()}, commit {meta['git_commit']}, torch {torch.__version__}; dense FP8 ceiling ({ceiling_info['fp8_how']}, same run): {ceiling:.0f} "
          f"TFLOP/s. TFLOP/s on real tokens (% of that ceiling); back-to-back calls, the kernels interleaved, each timed batch after as many untimed calls of its own, median over {rounds} rounds of {iters}.", "",
          "| problem | T | " + " | ".join(cols) + " |", "|---|---:|" + "---:|" * len(cols)]
    for r in rows:
        md.append(f"| {r['problem']} | {r['T']} | "
                  + " | ".join(f"{r['tflops'][c]:.0f} ({100 * r['tflops'][c] / ceiling:.0f} %)" for c in cols) + " |")
    print("\n".join(md))
    if args.md:
        open(args.md, "w").write("\n".join(md) + "\n")
    if args.json:
        json.dump({"meta": meta, "gpu": torch.cuda.get_device_name(), "ceilings": ceiling_info, "iters": iters, "rounds": rounds,
               "rows": rows},
                  open(args.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
