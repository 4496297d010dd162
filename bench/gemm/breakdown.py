"""Each FP8 grouped GEMM of the expert MLP (fc1/fc2 fprop, dgrad, wgrad) timed alone against its
roofline, on the benchmark's model shapes (bench/workloads.py; Zipf and balanced splits), the
small-experts workload and the two grouped-GEMM problems: where the GEMM time of the MLP goes, and how far
each GEMM is from its floor.

Roofline of a GEMM = max(FLOPs at the dense FP8 ceiling, minimal bytes at copy bandwidth), both ceilings
measured in the same run. Minimal bytes: operands read once, output written once (wgrad with fp32
accumulation also reads main_grad).

    python -m bench.gemm.breakdown [--iters 30] [--shapes SUBSTR,...] [--gemms SUBSTR,...] [--json PATH] [--md PATH]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.preflight import require_cuda_gpu

PROG = "python -m bench.gemm.breakdown"


def main():
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=30, help="timed calls per GEMM (median)")
    ap.add_argument("--shapes", default=None, help="comma-separated substrings of the point names")
    ap.add_argument("--gemms", default=None, help="comma-separated substrings of the GEMM names")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--md", default=None, help="write a markdown table here")
    ap.add_argument("--no-ceilings", action="store_true", help="skip the ceilings (no roofline column; for ncu)")
    args = ap.parse_args()
    require_cuda_gpu(PROG, hopper=True)
    import torch

    from bench.gemm.mlp_problems import ceilings, points, problems, roofline_ms, time_ms

    ce = None if args.no_ceilings else ceilings()
    rows = []
    print(f"{'point':34s} {'gemm':16s} {'ms':>8s} {'TFLOP/s':>8s} {'roofline':>8s}")
    for name, E, H, F, splits, fc1_only in points(args.shapes):
        for p in problems(E, H, F, splits, fc1_only):
            if args.gemms and not any(g.strip() in p.name for g in args.gemms.split(",")):
                continue
            ms = time_ms(p.run_production, args.iters)
            frac = roofline_ms(p, ce) / ms if ce else float("nan")
            rows.append({"point": name, "gemm": p.name, "ms": ms, "tflops": p.flops / ms / 1e9, "frac_roofline": frac})
            print(f"{name:34s} {p.name:16s} {ms:8.3f} {p.flops / ms / 1e9:8.0f} {100 * frac:7.0f}%", flush=True)
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps({"ceilings": ce, "rows": rows}, indent=1))
    if args.md:
        Path(args.md).write_text(markdown(ce, rows))


def markdown(ce: dict | None, rows: list) -> str:
    head = [f"# FP8 grouped GEMMs against their roofline (`{PROG}`)", ""]
    if ce:
        head += [f"Ceilings measured in the same run: FP8 dense {ce['fp8_tflops']:.0f} TFLOP/s ({ce['fp8_how']}), "
                 f"copy {ce['copy_gbps']:.0f} GB/s ({ce['copy_how']}). Roofline = max(FLOPs at the FP8 ceiling, "
                 "minimal bytes at copy bandwidth); wgrad f32+= accumulates into fp32 (main_grad read and written).", ""]
    head += ["| point | GEMM | ms | TFLOP/s | % roofline |", "|---|---|---:|---:|---:|"]
    return "\n".join(head + [f"| {r['point']} | {r['gemm']} | {r['ms']:.3f} | {r['tflops']:.0f} | {100 * r['frac_roofline']:.0f} |"
                             for r in rows]) + "\n"


if __name__ == "__main__":
    main()
