"""The moegemm benchmark suite: moegemm next to its peers, side by side in one process.

    python -m bench.suite            # full run (~8-10 min of GPU time), results in ~/.cache/moegemm-bench/suite/
    python -m bench.suite --out bench/results   # the same, rewriting the committed results
    python -m bench.suite --quick    # ~2.5 min: fewer iterations, Zipf splits only, short jitter run
    LD_PRELOAD=$(g++ -print-file-name=libstdc++.so.6) python -m bench.suite ...   # with the DeepGEMM rows
    (DeepGEMM: its source carried to .peers/DeepGEMM; its first build, ~80 s, and the JIT prewarm of its
    kernels come on top of the time budget, as the probes do)
    python -m bench.suite.plot bench/results/results.json --out bench/results   # the PNGs again (matplotlib)

Model shapes (E, hidden, ffn per expert, routed tokens T) with Zipf-skewed m_splits (empty experts
included) and a balanced variant. Variants (each guarded: a failure is recorded, never fatal):
  moegemm fp8_blockwise / bf16        moegemm.grouped_linear, moegemm.GroupedMLP (device m_splits)
  torch._grouped_mm bf16              device offsets; dgrad 2d x 3d, wgrad 2d x 2d with offs (baseline)
  torch._scaled_grouped_mm fp8        rowwise quantization in plain torch ops, included in the timing
  torchao fp8 rowwise                 torchao.prototype.moe_training (Triton quantization), if importable
  per-expert loop bf16                torch.split + F.linear per expert, m_splits.tolist() (a host sync)
  TE GroupedLinear bf16 / fp8         if transformer_engine is importable
  DeepGEMM fp8 blockwise              its m-grouped / k-grouped FP8 GEMMs, each expert padded to 128 rows,
                                      m_splits read on the host; built from a carried source tree (.peers/)
  (+ "GEMM only" rows for fc1: operands quantized beforehand, not a peer, for the kernel comparison)
Metrics: fc1 forward (K=hidden, N=2*ffn) and expert MLP (SwiGLU with router probs) forward+backward:
median ms over CUDA-event-timed back-to-back iterations after warm-up, TFLOP/s, fraction of the dense
ceilings measured in the same run, speed-up over torch._grouped_mm bf16; host overhead per call with the
GPU kept busy (torch.cuda._sleep), also swept over E (there the variants' batches in turn, the garbage
collector off); jitter of synchronised iterations; peak extra memory; accuracy of every variant against a
float64 per-expert computation. Training step: GA = 1 and 4 micro-batches of MLP fwd+bwd with fp32 main_grad
accumulation and an in-place weight update (FP8 weight caches refreshed once per step), torch bf16 / moegemm
bf16 / moegemm fp8 / DeepGEMM.

Peers that can crash the CUDA context (device-side asserts cannot be caught) are first run on a small
case in a child process per variant ("probe"); a variant/split kind whose probe died is reported n/a.
"""

# The parts, one job each (bench/README.md): shared.py, variants.py, cases.py, moegemm_variants.py,
# implementations.py, measure.py, probes.py, training.py, meta.py, runner.py (the run and results.json),
# report.py (results.md), plot.py (the PNGs), compare.py (two builds point by point).

from __future__ import annotations

import argparse
import sys

from bench.outputs import describe, out_dir
from bench.preflight import require_cuda_gpu
from bench.suite.variants import VARIANTS  # torch-free: the options are known before torch is imported

PROG = "python -m bench.suite"


def make_cfg(args) -> dict:
    from bench.workloads import GEMM_SHAPES, SHAPES

    from bench.suite.runner import JITTER_SHAPE, SWEEP_E, SWEEP_SHAPE

    q = args.quick
    cfg = {
        "fc1_target_s": 0.08 if q else 0.4,
        "mlp_target_s": 0.12 if q else 0.8,
        "min_iters": 5 if q else 10,
        "max_iters": 30 if q else 200,
        "warmup": 2 if q else 3,
        "host_reps": 3 if q else 7,
        "sweep_reps": 3 if q else 7,
        "ceiling_s": 0.15 if q else 0.5,
        "ceiling_n": 8192,
        "copy_elems": 1 << 29,  # bf16: 1 GiB
        "jitter_iters": args.jitter_iters or (1000 if q else 10000),
        "jitter_seconds": args.jitter_seconds or (4.0 if q else 60.0),
        "jitter_variants": ["moegemm_fp8", "torch_bf16", "loop_bf16"] if q else ["moegemm_fp8", "moegemm_bf16", "torch_bf16"],
        "budget_s": args.budget_s or (120.0 if q else 500.0),
        "sweep_reserve_s": 8.0 if q else 25.0,
        "jitter_reserve_s": 12.0 if q else 140.0,
        "train_reserve_s": 20.0 if q else 60.0,
        "probe_timeout_s": 90.0 if q else 200.0,
        "probe_jit_extra_s": 150.0,  # more when a probed variant compiles its kernels first (DeepGEMM)
        "prewarm_timeout_s": 300.0 if q else 480.0,
        "prewarm_max_par": 8,
        "train_ga": [1, 4],
        "train_variants": ["torch_bf16", "moegemm_bf16", "moegemm_fp8_wcache", "deepgemm_fp8_wcache"],
        "train_target_s": 0.15 if q else 0.6,
        "train_min_iters": 3 if q else 5,
        "train_max_iters": 20 if q else 100,
        "train_warmup": 1 if q else 2,
        "splits": [s.strip() for s in args.splits.split(",")] if args.splits else (["zipf"] if q else ["zipf", "balanced"]),
        "shapes": SHAPES,
        "gemm_shapes": {} if q else GEMM_SHAPES,
        "sweep": {"E": list(SWEEP_E), "hidden_ffn_T": list(SWEEP_SHAPE)},
        "jitter_shape": JITTER_SHAPE,
    }
    return cfg


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer iterations, Zipf splits only, short jitter (~2.5 min)")
    ap.add_argument("--out", default=None, help=f"output folder ({describe('suite')}; bench/results for the "
                    "committed results)")
    ap.add_argument("--shapes", default=None, help="comma-separated substrings of shape names to run")
    ap.add_argument("--splits", default=None, help="comma-separated: zipf,balanced")
    ap.add_argument("--variants", default=None, help="comma-separated substrings of variant keys "
                    "(" + ", ".join(v.key for v in VARIANTS) + "); the torch bf16 baseline always runs")
    ap.add_argument("--jitter-iters", type=int, default=None, help="synchronised iterations per variant (10000; quick 1000)")
    ap.add_argument("--jitter-seconds", type=float, default=None, help="time cap per variant for the jitter run")
    ap.add_argument("--budget-s", type=float, default=None, help="wall-time budget of the measurements (the setup: "
                    "loading the variants, probes, JIT prewarm, comes on top); later sections shrink or skip")
    ap.add_argument("--no-probe", action="store_true", help="skip the crash probes in child processes")
    ap.add_argument("--no-sweep", action="store_true", help="skip the host-overhead sweep over E")
    ap.add_argument("--no-jitter", action="store_true", help="skip the jitter run")
    ap.add_argument("--no-train", action="store_true", help="skip the training-step section (GA = 1 and 4)")
    ap.add_argument("--no-prewarm", action="store_true", help="no JIT prewarm in child processes (DeepGEMM then "
                    "compiles its kernels inside the timed run)")
    ap.add_argument("--no-plots", action="store_true", help="do not write PNGs")
    ap.add_argument("--verbose", action="store_true", help="print tracebacks of failing variants")
    ap.add_argument("--probe", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--probe-kinds", default="aligned,unaligned", help=argparse.SUPPRESS)
    ap.add_argument("--prewarm", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prewarm-job", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    require_cuda_gpu(PROG)
    import torch  # (and moegemm, below) only once the machine is known to fit

    from bench.suite.probes import PROBE_SPLITS, prewarm_main, probe_main
    from bench.suite.runner import Runner

    if args.probe:
        return probe_main(args.probe, [k for k in args.probe_kinds.split(",") if k in PROBE_SPLITS])
    if args.prewarm:
        return prewarm_main(args.prewarm, args.prewarm_job)
    torch.backends.cuda.matmul.allow_tf32 = False
    args.out = str(out_dir(args.out, "suite"))
    return Runner(args, make_cfg(args)).run()


if __name__ == "__main__":
    sys.exit(main())
