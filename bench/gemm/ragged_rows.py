"""The FP8 ragged-row GEMM table (fprop and dgrad): moegemm's own sm90 kernel (each tiling and the
heuristic's choice), CUTLASS's ptr-array kernel, and DeepGEMM's m-grouped contiguous GEMM when it is
importable, side by side in one run, with the dense FP8 ceiling measured in the same run.

Shapes: DeepGEMM's six m-grouped problems (groups x nominal rows, N, K; each group's rows uniform within
±30 % of the nominal) and the benchmark's model shapes (fc1/fc2 fprop and dgrad, Zipf and balanced splits).
Operands are pre-quantized; TFLOP/s counts real tokens only (DeepGEMM also computes its 128-row padding).

    python -m bench.gemm.ragged_rows [--quick] [--json PATH] [--md PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys

DEEPGEMM_SHAPES = [  # groups, nominal rows per group, N, K
    (4, 8192, 4096, 7168), (4, 8192, 7168, 2048), (8, 4096, 6144, 7168),
    (32, 1024, 4096, 7168), (64, 384, 2816, 2048), (64, 192, 2816, 2048),
]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer iterations, model shapes with Zipf splits only")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per measurement (default 50, quick 20)")
    ap.add_argument("--json", default=None, help="write the rows as JSON here")
    ap.add_argument("--md", default=None, help="write the markdown table here")
    ap.add_argument("--no-deepgemm", action="store_true", help="skip the DeepGEMM column even if importable")
    ap.add_argument("--tilings", type=int, default=0,
                    help="also time the sm90 kernel's first N tilings (csrc/kernels/gemm/heuristics.h's table) one by one")
    return ap.parse_args()


def main() -> int:
    args = parse_args()
    import torch

    if not torch.cuda.is_available() or torch.version.cuda is None:
        print("bench.gemm.ragged_rows: needs a CUDA build of torch and an NVIDIA Hopper GPU; none here.")
        return 1
    import moegemm  # noqa: F401  (registers torch.ops.moegemm)
    from moegemm import cuda_ops
    from moegemm.workloads import SHAPES, SMALL_EXPERTS, balanced_splits, small_experts_splits, zipf_splits

    iters = args.iters or (20 if args.quick else 50)
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)

    def time_ms(fn) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)

    # dense FP8 ceiling: torch._scaled_mm rowwise, 8192^3, fast accumulation
    n = 8192
    a8 = torch.randn(n, n, device=dev, generator=gen).to(torch.float8_e4m3fn)
    b8 = torch.randn(n, n, device=dev, generator=gen).to(torch.float8_e4m3fn).t()
    sa8, sb8 = torch.ones(n, 1, device=dev), torch.ones(1, n, device=dev)
    ceiling = 2 * n**3 / time_ms(lambda: torch._scaled_mm(a8, b8, sa8, sb8, out_dtype=torch.bfloat16, use_fast_accum=True)) / 1e9
    del a8, b8
    print(f"dense FP8 ceiling (torch._scaled_mm rowwise 8192^3): {ceiling:.0f} TFLOP/s", flush=True)

    dg = None
    if not args.no_deepgemm:
        try:
            from bench.peers import deepgemm as dg_peer  # optional: built for the run on the GPU machine
            dg = dg_peer.load()
        except Exception as exc:  # noqa: BLE001  (a peer that does not import is reported, not fatal)
            print(f"DeepGEMM: not available ({type(exc).__name__}: {str(exc)[:200]})")

    problems = []  # (label, splits, N, K)
    rng = random.Random(0)
    for G, rows, N, K in DEEPGEMM_SHAPES:
        splits = [rng.randint(int(rows * 0.7), int(rows * 1.3)) for _ in range(G)]
        problems.append((f"DG {G}x{rows} N={N} K={K}", splits, N, K))
    shapes = dict(SHAPES)
    shapes.update(SMALL_EXPERTS)
    for name, (E, H, F, T) in shapes.items():
        modes = {"zipf": small_experts_splits(E, T) if name in SMALL_EXPERTS else zipf_splits(E, T)}
        if not args.quick and name not in SMALL_EXPERTS:
            modes["balanced"] = balanced_splits(E, T)
        for mode, splits in modes.items():
            for gemm, N, K in (("fc1 fprop", 2 * F, H), ("fc2 fprop", H, F), ("fc1 dgrad", H, 2 * F), ("fc2 dgrad", F, H)):
                problems.append((f"{name} {mode} {gemm}", splits, N, K))

    variants = {"cutlass": dict(kernel=1)}
    variants.update({f"sm90 t{i}": dict(kernel=2, tiling=i) for i in range(args.tilings)})
    variants["sm90 auto"] = dict(kernel=2, tiling=-1)
    rows_out = []
    header = f"{'problem':48s} {'T':>6s}" + "".join(f" {v:>9s}" for v in variants) + (f" {'DeepGEMM':>9s}" if dg else "")
    print("TFLOP/s on real tokens\n" + header, flush=True)
    for label, splits, N, K in problems:
        E, T = len(splits), sum(splits)
        x = torch.randn(T, K, device=dev, generator=gen).to(torch.bfloat16)
        w = (torch.randn(E, N, K, device=dev, generator=gen) * 0.05).to(torch.bfloat16)
        plan = cuda_ops.make_plan(torch.tensor(splits, device=dev), T)
        qx, sx, _, _ = cuda_ops.quantize_act(x, plan, cols=False)
        qw, sw, _, _ = cuda_ops.quantize_weight(w)
        del x, w
        flops = 2.0 * T * N * K
        rec = {"problem": label, "T": T, "N": N, "K": K, "E": E, "tflops": {}}
        ref_out = torch.ops.moegemm.gemm_fp8_ragged_m(qx, sx, qw, sw, plan, 1)
        for v, kw in variants.items():
            out = torch.ops.moegemm.gemm_fp8_ragged_m(qx, sx, qw, sw, plan, **kw)
            err = ((out.float() - ref_out.float()).norm() / ref_out.float().norm().clamp_min(1e-30)).item()
            ms = time_ms(lambda: torch.ops.moegemm.gemm_fp8_ragged_m(qx, sx, qw, sw, plan, **kw))
            rec["tflops"][v] = flops / ms / 1e9
            rec.setdefault("rel_diff_vs_cutlass", {})[v] = err
        if dg:
            try:
                rec["tflops"]["DeepGEMM"] = flops / dg_peer.time_m_grouped(dg, qx, sx, qw, sw, splits, time_ms) / 1e9
            except Exception as exc:  # noqa: BLE001
                rec["deepgemm_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        rows_out.append(rec)
        print(f"{label:48s} {T:6d}" + "".join(f" {rec['tflops'].get(v, float('nan')):9.0f}" for v in variants)
              + (f" {rec['tflops'].get('DeepGEMM', float('nan')):9.0f}" if dg else "")
              + ("" if max(rec["rel_diff_vs_cutlass"].values()) < 2e-3 else f"  DIFF {rec['rel_diff_vs_cutlass']}"), flush=True)
        del qx, sx, qw, sw, out, ref_out
        torch.cuda.empty_cache()

    cols = list(variants) + (["DeepGEMM"] if dg else [])
    md = [f"Dense FP8 ceiling (torch._scaled_mm rowwise 8192³, same run): {ceiling:.0f} TFLOP/s. TFLOP/s on real tokens "
          "(% of the ceiling).", "", "| problem | T | " + " | ".join(cols) + " |", "|---|---:|" + "---:|" * len(cols)]
    for r in rows_out:
        cells = [f"{r['tflops'][c]:.0f} ({100 * r['tflops'][c] / ceiling:.0f} %)" if c in r["tflops"] else "–" for c in cols]
        md.append(f"| {r['problem']} | {r['T']} | " + " | ".join(cells) + " |")
    if args.md:
        open(args.md, "w").write("\n".join(md) + "\n")
    if args.json:
        json.dump({"gpu": torch.cuda.get_device_name(), "ceiling_tflops": ceiling, "rows": rows_out}, open(args.json, "w"), indent=1)
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
