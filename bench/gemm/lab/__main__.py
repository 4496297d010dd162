"""The GEMM lab: CUTLASS FP8 grouped GEMM tilings (csrc/kernels/gemm/cutlass/configs.cuh) built side by side in one
extension (the sources beside this file) and timed on the operands of ``python -m bench.gemm.breakdown``
(bench/gemm/mlp_problems.py), next to the tiling production uses; each variant's output is checked against
production's. (moegemm's own sm90 kernel's tilings, csrc/kernels/gemm/heuristics.h, are timed by
``python -m bench.gemm.ragged_rows``.)

    python -m bench.gemm.lab [--shapes SUBSTR,...] [--iters 20] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from bench.preflight import require_cuda_gpu, require_cuda_toolkit

PROG = "python -m bench.gemm.lab"
HERE = Path(__file__).resolve().parent  # the lab's C++/CUDA sources

# tiling name (csrc/kernels/gemm/cutlass/configs.cuh) -> the GEMMs built with it: m = ragged M (fprop/dgrad), kb = wgrad bf16,
# kf = wgrad fp32.
VARIANTS = {
    # Also tried on an H200 and slower than production on (nearly) every GEMM (bench/NOTES.md, fifth
    # session; bench/results/logs/gemm_lab_h200_tilings.log, whose bf16-wgrad max|diff| column compared
    # against a zero tensor, a bug since fixed, and bench/results/logs/gemm_lab_h200_nosmem.log): clusters 2x2 and 2x1,
    # 128x192 wgrad tiles, the register-store epilogue (PtrArrayNoSmemWarpSpecialized) - taken out of
    # configs.cuh again; 128x256 tiles do not compile with 128x128 B-scale blocks.
    "Tile128x128C1x1": "m",
    "Tile64x128C1x2Pingpong": "m",
}


def build():
    from moegemm import _build
    from torch.utils.cpp_extension import load
    gen = Path(tempfile.gettempdir()) / "moegemm_gemm_lab"  # fixed, so that a second build finds the first
    gen.mkdir(exist_ok=True)
    srcs = [str(HERE / "lab_binding.cpp"), str(HERE / "lab_registry.cu"),
            str(_build.csrc_dir() / "kernels" / "plan" / "plan.cu")]  # zero_empty_experts
    for tiling, kinds in VARIANTS.items():
        for kind in kinds.split():
            f = gen / f"{tiling}_{kind}.cu"
            text = (f"#define LAB_TILING {tiling}\n#define LAB_RAGGED_M {int(kind == 'm')}\n"
                    f"#define LAB_RAGGED_K_BF16 {int(kind == 'kb')}\n#define LAB_RAGGED_K_F32 {int(kind == 'kf')}\n"
                    '#include "variant.cuh"\n')
            if not f.is_file() or f.read_text() != text:  # unchanged files keep their time stamps (no rebuild)
                f.write_text(text)
            srcs.append(str(f))
    os.environ.setdefault("MAX_JOBS", str(_build.default_jobs()))
    return load(name="moegemm_gemm_lab", sources=srcs, extra_include_paths=_build.include_dirs() + [str(HERE)],
                extra_cflags=_build.cxx_flags(), extra_cuda_cflags=_build.NVCC_FLAGS, verbose=True)


def variant_fn(lab, name, p):
    if not p.ragged_k:
        return lambda: lab.ragged_m(name, *p.args, p.plan)
    return lambda: lab.ragged_k(name, *p.args, p.plan, p.out, p.accumulate)


def output_of(fn, p):
    """The output of one call on fresh (zeroed) wgrad output."""
    if p.ragged_k:
        p.out.zero_()
        r = fn()  # production's bf16 wgrad returns a new tensor; the others write p.out
        return (p.out if r is None else r).clone()
    return fn()


def main():
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=20, help="timed calls per GEMM and tiling (median)")
    ap.add_argument("--shapes", default=None, help="comma-separated substrings of the point names")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    require_cuda_gpu(PROG, hopper=True)
    require_cuda_toolkit(PROG)
    import torch

    from bench.gemm.mlp_problems import ceilings, points, problems, roofline_ms, time_ms

    lab = build()
    ce = ceilings()
    rows = []
    print(f"{'point':34s} {'gemm':16s} {'variant':24s} {'ms':>8s} {'TFLOP/s':>8s} {'roofline':>8s} {'max|diff|':>9s}")
    for point, E, H, F, splits, fc1_only in points(args.shapes):
        for p in problems(E, H, F, splits, fc1_only):
            ref = output_of(p.run_production, p).float()
            f32 = p.ragged_k and p.out.dtype == torch.float32
            names = ["production"] + list(lab.names(p.ragged_k, f32))
            for name in names:
                fn = p.run_production if name == "production" else variant_fn(lab, name, p)
                try:
                    diff = (output_of(fn, p).float() - ref).abs().max().item()
                    ms = time_ms(fn, args.iters)
                except Exception as exc:  # a tiling CUTLASS cannot implement for this problem
                    print(f"{point:34s} {p.name:16s} {name:24s} failed: {str(exc)[:80]}", flush=True)
                    continue
                frac = roofline_ms(p, ce) / ms
                rows.append({"point": point, "gemm": p.name, "variant": name, "ms": ms, "tflops": p.flops / ms / 1e9,
                             "frac_roofline": frac, "max_abs_diff": diff})
                print(f"{point:34s} {p.name:16s} {name:24s} {ms:8.3f} {p.flops / ms / 1e9:8.0f} {100 * frac:7.0f}% {diff:9.2e}",
                      flush=True)
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps({"ceilings": ce, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
