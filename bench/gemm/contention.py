"""The grouped GEMMs under contention: a kernel on another stream holds k SMs (one CTA per SM, ~200 KB of shared
memory each, spinning for longer than the GEMMs run) while the GEMM runs on the current stream, as an expert-parallel
all-to-all does. Each GEMM's time is reported over its ideal, its time alone x SMs / (SMs - k) (1.0: it uses the free
SMs perfectly), without an SM budget and with the budget set to the free SMs (moegemm.set_num_sms). Then the fc1
forward with cached FP8 weights (one launch up to 2^23 values of x; MOEGEMM_ONE_LAUNCH_FORWARD=0 for two) with a
4 ms kernel holding k SMs launched just before it, in ms, timed as issued and queued behind a spin (the GPU's span
without the host's launch gaps); and the expert MLP's training step (GA = 1, FP8 with the
weight cache) with `--step-held` SMs held for the whole step, over its time alone x SMs / (SMs - k).

    python -m bench.gemm.contention [--shapes DeepSeek-V3-EP8,Mixtral-8x7B] [--held 0,8,16,24,33] [--json PATH] [--md PATH]
    python -m bench.gemm.contention --only fc1 --fc1-kernels   # the fc1 forward's kernels one by one

Needs a Hopper GPU. Writes nothing unless --json or --md names a file (--md: the tables, GPU and commit named).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time

import torch

import moegemm
from bench.preflight import require_cuda_gpu, require_cuda_toolkit
from bench.workloads import SHAPES, SMALL_EXPERTS, small_experts_splits, zipf_splits

PROG = "python -m bench.gemm.contention"

HOLD_SOURCE = r"""
extern "C" __global__ void hold(long long cycles, int* started) {
  extern __shared__ char smem[];
  if (threadIdx.x == 0) { smem[0] = 1; atomicAdd(started, 1); }
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) { }
}
"""
HOLD_SMEM = 200 * 1024
HOLD_LAUNCHER = f"""
#include <cstdint>
#include <cuda_runtime.h>
void hold_on(int64_t k, int64_t cycles, int64_t started, int64_t stream) {{
  cudaFuncSetAttribute(hold, cudaFuncAttributeMaxDynamicSharedMemorySize, {HOLD_SMEM});
  hold<<<k, 32, {HOLD_SMEM}, reinterpret_cast<cudaStream_t>(stream)>>>(cycles, reinterpret_cast<int*>(started));
}}
"""


class Holder:
    """Holds k SMs from a side stream for about `seconds` (SM clocks counted at 2 GHz, at most the boost clock). The
    holding kernel is compiled with CuPy's NVRTC where CuPy is installed, else as a small torch extension."""

    def __init__(self):
        self.stream = torch.cuda.Stream()
        self.started = torch.zeros(1, dtype=torch.int32, device="cuda")
        try:
            import cupy
        except ImportError:
            cupy = None
        if cupy is not None:
            kernel = cupy.RawKernel(HOLD_SOURCE, "hold")
            kernel.max_dynamic_shared_size_bytes = HOLD_SMEM

            def launch(k, cycles):
                with cupy.cuda.ExternalStream(self.stream.cuda_stream):
                    kernel((k,), (32,), (cycles, self.started.data_ptr()), shared_mem=HOLD_SMEM)
        else:
            from torch.utils.cpp_extension import load_inline
            ext = load_inline("moegemm_bench_hold", cpp_sources="void hold_on(int64_t k, int64_t cycles, "
                              "int64_t started, int64_t stream);", cuda_sources=HOLD_SOURCE + HOLD_LAUNCHER,
                              functions=["hold_on"], verbose=False)

            def launch(k, cycles):
                ext.hold_on(k, cycles, self.started.data_ptr(), self.stream.cuda_stream)
        self.launch = launch

    def hold(self, k: int, seconds: float) -> None:
        if k == 0:
            return
        self.started.zero_()
        torch.cuda.synchronize()
        self.launch(k, int(seconds * 2.0e9))
        while int(self.started.item()) < k:  # every holding CTA resident before the GEMM is launched
            time.sleep(1e-4)

    def release(self) -> None:
        self.stream.synchronize()


def median_ms(fn, reps: int, before=None, after=None) -> float:
    """fn's median time in ms over ``reps`` calls, each timed alone (``before`` / ``after`` run around each, untimed
    unless they launch work on the timed stream)."""
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
        if after is not None:
            after()
    return statistics.median(times)


def gemms(name: str, E: int, H: int, F: int, T: int):
    """name -> fn of the fc1 GEMMs of one shape: FP8 fprop, dgrad and wgrad (fp32 accumulated), bf16 fprop, dgrad
    and wgrad (fp32 accumulated), and torch._grouped_mm's bf16 fprop, dgrad and wgrad (written in bf16)."""
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
        "fp8 fprop": lambda: ops.gemm_fp8_ragged_rows(qx, sx, qw, sw, plan),
        "fp8 dgrad": lambda: ops.gemm_fp8_ragged_rows(qdy, sdy, qwT, swT, plan),
        "fp8 wgrad": lambda: ops.gemm_fp8_ragged_reduction(qdyT, sdyT, qxT, sxT, plan, out=main_grad),
        "bf16 fprop": lambda: ops.gemm_bf16_fprop(x, w, plan),
        "bf16 dgrad": lambda: ops.gemm_bf16_dgrad(dy, w, plan),
        "bf16 wgrad": lambda: ops.gemm_bf16_wgrad(dy, x, plan, out=main_grad),
        "torch._grouped_mm bf16 fprop": lambda: torch._grouped_mm(x, wt, offs=offs),
        "torch._grouped_mm bf16 dgrad": lambda: torch._grouped_mm(dy, w, offs=offs),
        "torch._grouped_mm bf16 wgrad": lambda: torch._grouped_mm(dy.t(), x, offs=offs),  # bf16 out, as torch's autograd
    }


# E x hidden x columns x tokens; x of at most 2^23 values each, which the one-launch forward takes (heuristics.h
# quantize_a_in_gemm) unless MOEGEMM_ONE_LAUNCH_FORWARD=0
FC1_SHAPES = [(8, 1024, 1024, 8192), (64, 1024, 1024, 8192), (64, 2048, 2816, 4096), (128, 2048, 1536, 2048)]


def kernel_medians_us(fn, reps: int, before=None, after=None) -> dict:
    """Each CUDA kernel's median GPU time in us over ``reps`` calls of fn (torch.profiler; kernels named "hold"
    left out), in launch order."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            if before is not None:
                before()
            fn()
            torch.cuda.synchronize()
            if after is not None:
                after()
    times = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and "hold" not in ev.name:
            times.setdefault(ev.name, []).append(ev.device_time_total)
    return {name: statistics.median(v) for name, v in times.items()}


# Spin queued ahead of each queued call of the fc1 forward: long enough (~1 ms) for the host to launch the whole forward
# behind it, so that the timed span holds no wait for the host.
QUEUE_SPIN_CYCLES = 2_000_000


def fc1_forward(holder: Holder, held: list, reps: int, kernels: bool = False) -> list:
    """The fc1 forward with cached FP8 weights (E x hidden x columns x tokens) alone and with a 4 ms kernel holding
    k SMs launched just before each call, in ms (median), timed as issued ("ms") and queued behind a spin on its
    stream ("queued_ms": the GPU's span of the forward, without the host's launch gaps); with `kernels`, each
    kernel's time too."""
    from moegemm.backends import cuda as ops
    from moegemm.layout import FP8_BLOCKWISE
    from moegemm._env import env_flag
    one_launch = env_flag("MOEGEMM_ONE_LAUNCH_FORWARD", True)  # every x of FC1_SHAPES is small enough for it
    rows = []
    for E, H, F, T in FC1_SHAPES:
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(E, F, H, device="cuda", dtype=torch.bfloat16) * 0.05
        m = torch.tensor(zipf_splits(E, T), device="cuda")
        given = [*ops.quantize_weight(w)]
        fn = lambda: ops.linear_fwd(x, w, m, None, FP8_BLOCKWISE, True, False, None, given)  # noqa: E731
        for _ in range(3):
            fn()
        line, per_kernel = f"fc1 forward {E} x {H} x {F} x {T}:", []
        for k in held:
            def hold(k=k):
                holder.hold(k, seconds=0.004)

            def hold_then_spin(k=k):
                hold(k)
                torch.cuda._sleep(QUEUE_SPIN_CYCLES)
            t = median_ms(fn, reps, before=hold, after=holder.release)
            tq = median_ms(fn, reps, before=hold_then_spin, after=holder.release)
            row = {"fc1_forward": [E, H, F, T], "held": k, "ms": t, "queued_ms": tq, "one_launch": one_launch,
                   "gpu": torch.cuda.get_device_name()}
            line += f" k={k} {t:.3f} ms (queued {tq:.3f})"
            if kernels:
                row["kernels_us"] = kernel_medians_us(fn, reps, before=hold, after=holder.release)
                per_kernel.append(f"  k={k}: " + "; ".join(f"{n[:60]} {us:.1f} us" for n, us in row["kernels_us"].items()))
            rows.append(row)
        print("\n".join([line, *per_kernel]), flush=True)
    return rows


def mlp_step(holder: Holder, name: str, held: int, reps: int) -> dict:
    """The expert MLP's training step (forward and backward, GA = 1, FP8 with the weight cache) alone and with
    `held` SMs held for the whole step."""
    E, H, F, T = {**SHAPES, **SMALL_EXPERTS}[name]
    torch.manual_seed(0)
    mlp = moegemm.GroupedMLP(E, H, F, activation="swiglu", recipe="fp8_blockwise", device="cuda")
    splits = small_experts_splits(E, T) if name in SMALL_EXPERTS else zipf_splits(E, T)
    m = torch.tensor(splits, device="cuda")
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)

    def step():
        mlp(x, m).backward(dy)

    for _ in range(3):
        step()
    alone = median_ms(step, reps)
    holder.hold(held, seconds=max(0.05, 40 * alone * 1e-3))
    t = median_ms(step, reps)
    holder.release()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ratio = t / (alone * sms / (sms - held))
    print(f"MLP step {name}: alone {alone:.3f} ms, {held} SMs held {t:.3f} ms: {ratio:.2f} x ideal", flush=True)
    return {"mlp_step": name, "held": held, "ms": t, "alone_ms": alone, "over_ideal": ratio,
            "gpu": torch.cuda.get_device_name()}


def markdown(rows: list, sms: int, heading: str) -> str:
    """The rows as markdown tables: each GEMM's time over its ideal per k held ("b": the budget set to the free SMs),
    the fc1 forward's times, the MLP step's; `heading` names the GPU and the commit."""
    out = [heading, ""]
    gemm_rows = [r for r in rows if "gemm" in r]
    if gemm_rows:
        cols = sorted({(r["held"], r["budget"] is not None) for r in gemm_rows if r["held"]})  # (k, budget set)
        out += [f"Time over ideal, alone x {sms} / ({sms} - k); b: the SM budget set to the free SMs.", "",
                "| shape | GEMM | alone ms | " + " | ".join(f"k={k}{' b' if b else ''}" for k, b in cols) + " |",
                "|---|---|---:|" + "---:|" * len(cols)]
        by_gemm = {}
        for r in gemm_rows:
            by_gemm.setdefault((r["shape"], r["gemm"]), {})[(r["held"], r["budget"] is not None)] = r
        for (shape, gemm), got in by_gemm.items():
            alone = next(iter(got.values()))["alone_ms"]
            cells = [f"{got[c]['over_ideal']:.2f}" if c in got else "" for c in cols]
            out.append(f"| {shape} | {gemm} | {alone:.3f} | " + " | ".join(cells) + " |")
        out.append("")
    fc1_rows = [r for r in rows if "fc1_forward" in r]
    if fc1_rows:
        held = sorted({r["held"] for r in fc1_rows})
        names = ["alone" if k == 0 else f"k={k}" for k in held]
        out += ["fc1 forward with cached FP8 weights (E x hidden x columns x tokens), ms, a 4 ms kernel holding k SMs "
                "launched before each call; timed as issued, and queued behind a spin on its stream (q: the GPU's "
                "span, without the host's launch gaps):", "",
                "| shape | path | " + " | ".join(names + [f"{n} q" for n in names]) + " |",
                "|---|---|" + "---:|" * (2 * len(held))]
        by_shape = {}
        for r in fc1_rows:
            by_shape.setdefault((tuple(r["fc1_forward"]), r["one_launch"]), {})[r["held"]] = r
        for (shape, one_launch), got in by_shape.items():
            cells = [f"{got[k][key]:.3f}" if k in got else "" for key in ("ms", "queued_ms") for k in held]
            out.append(f"| {' x '.join(map(str, shape))} | {'one launch' if one_launch else 'two launches'} | "
                       + " | ".join(cells) + " |")
        out.append("")
    step_rows = [r for r in rows if "mlp_step" in r]
    if step_rows:
        out += ["The expert MLP's training step (GA = 1, FP8 with the weight cache) with SMs held for the whole step:", "",
                "| shape | alone ms | SMs held | held ms | over ideal |", "|---|---:|---:|---:|---:|"]
        out += [f"| {r['mlp_step']} | {r['alone_ms']:.3f} | {r['held']} | {r['ms']:.3f} | {r['over_ideal']:.2f} |"
                for r in step_rows]
        out.append("")
    return "\n".join(out)


def md_heading(device: str, sms: int, args: argparse.Namespace, argv: list) -> str:
    """The markdown tables' first line: the GPU, its SMs, the commit measured and the command."""
    from bench.suite.meta import collect_meta
    return (f"{device} ({sms} SMs), commit {collect_meta(args)['git_commit']}, torch {torch.__version__}: "
            f"`{PROG} {' '.join(argv)}`")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="DeepSeek-V3-EP8,Mixtral-8x7B,Small experts E=64")
    ap.add_argument("--held", default="0,8,16,24,33", help="SMs held by the other stream, comma-separated")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--gemms", default=None, help="only the GEMMs whose name contains one of these (comma-separated)")
    ap.add_argument("--fc1-held", default="0,8,33", help="SMs held during the fc1 forward ('': skip it)")
    ap.add_argument("--step-held", type=int, default=24, help="SMs held during the MLP step (0: skip it)")
    ap.add_argument("--step-shapes", default="DeepSeek-V3-EP8,Mixtral-8x7B,Small experts E=64")
    ap.add_argument("--fc1-kernels", action="store_true", help="the fc1 forward's time per kernel too (torch.profiler)")
    ap.add_argument("--fc1-path", choices=["both", "current"], default="both",
                    help="both: the fc1 forward on the path MOEGEMM_ONE_LAUNCH_FORWARD gives and, in a child process, "
                         "the other; current: the given path only")
    ap.add_argument("--only", choices=["gemms", "fc1", "step"], help="one part only")
    ap.add_argument("--json", help="write the rows to this file (default: none)")
    ap.add_argument("--md", help="write the tables to this markdown file (default: none)")
    args = ap.parse_args(argv)
    require_cuda_gpu(PROG, hopper=True)
    if importlib.util.find_spec("cupy") is None:  # the SM-holding kernel is then built as a torch extension
        require_cuda_toolkit(PROG)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    holder = Holder()
    shapes = {**SHAPES, **SMALL_EXPERTS}
    rows = []
    print(f"{torch.cuda.get_device_name()}: {sms} SMs; time over ideal (alone x {sms} / ({sms} - k))")
    names = [s.strip() for s in args.shapes.split(",") if s.strip()] if args.only in (None, "gemms") else []
    picked = [g.strip() for g in (args.gemms or "").split(",") if g.strip()]
    for name in names:
        E, H, F, T = shapes[name]
        for gemm, fn in gemms(name, E, H, F, T).items():
            if picked and not any(g in gemm for g in picked):
                continue
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
    write(rows, sms, args, argv)
    if args.fc1_held and args.only in (None, "fc1"):
        rows += fc1_forward(holder, [int(v) for v in args.fc1_held.split(",")], args.reps, args.fc1_kernels)
        if args.fc1_path == "both":
            rows += fc1_forward_other_path(args)
        write(rows, sms, args, argv)
    if args.step_held and args.only in (None, "step"):
        for name in [s.strip() for s in args.step_shapes.split(",") if s.strip()]:
            rows.append(mlp_step(holder, name, args.step_held, args.reps))
    write(rows, sms, args, argv)


def fc1_forward_other_path(args: argparse.Namespace) -> list:
    """The fc1 forward's rows on the path MOEGEMM_ONE_LAUNCH_FORWARD does not give (it is read once per process): run
    in a child process; none, with the reason printed, if it fails."""
    import os
    import subprocess
    import tempfile
    from moegemm._env import env_flag
    env = {**os.environ, "MOEGEMM_ONE_LAUNCH_FORWARD": "0" if env_flag("MOEGEMM_ONE_LAUNCH_FORWARD", True) else "1"}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "fc1.json")
        cmd = [sys.executable, "-m", "bench.gemm.contention", "--only", "fc1", "--fc1-path", "current", "--fc1-held",
               args.fc1_held, "--reps", str(args.reps), "--json", path] + (["--fc1-kernels"] if args.fc1_kernels else [])
        done = subprocess.run(cmd, env=env)
        if done.returncode != 0 or not os.path.exists(path):
            print(f"the fc1 forward on the other path failed (exit {done.returncode})", flush=True)
            return []
        with open(path) as f:
            return json.load(f)


def write(rows: list, sms: int, args: argparse.Namespace, argv) -> None:
    """The rows so far to --json and --md (after each part: a run cut short keeps what it measured)."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.md:
        heading = md_heading(torch.cuda.get_device_name(), sms, args, argv if argv is not None else sys.argv[1:])
        with open(args.md, "w") as f:
            f.write(markdown(rows, sms, heading))


if __name__ == "__main__":
    main()
