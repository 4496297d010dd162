"""What an FP8 GEMM's rate is made of under the board's power cap (a diagnostic, not a benchmark).

Each chosen GEMM runs back to back for --seconds while nvidia-smi samples the SM clock, the board power,
the temperature and the clock-event reasons every 25 ms. Per GEMM it prints the TFLOP/s, the median clock
and power over the run's settled part (its first 0.5 s left out), the FLOP per SM cycle (the kernel's pace in
cycles, what bench.gemm.tile_probe sees) and the picojoules per FLOP (what a power-capped run is rationed
by: at the cap, rate = power / energy per FLOP). The dense FP8 ceiling of the GEMM tables
(torch._scaled_mm rowwise 8192^3) runs first as the reference for both, and a 1 GiB copy last.

    python -m bench.gemm.power [--rows LABELS] [--wgrad LABELS] [--tilings=-1,3] [--seconds 2] [--deepgemm]
    python -m bench.gemm.power --env MOEGEMM_AB_X --values 0,1 [--rounds 2] ...   # a sustained A/B
    (with --deepgemm: LD_PRELOAD=$(g++ -print-file-name=libstdc++.so.6) python -m bench.gemm.power ...)

LABELS: comma-separated problems of bench.gemm.ragged_rows (fprop, dgrad) and bench.gemm.ragged_reduction
(wgrad, fp32 accumulated and bf16 written); the tilings are heuristics.h's indices of the ragged-row
kernel, -1 the heuristic's.

With --env (an A/B switch, bench/ab_switch.py: a variable the kernel's launcher reads at every launch), each moegemm
GEMM runs once per value in each of --rounds rounds, the values' order reversed every other round, and a last table
gives each value's median rate and its ratio to the first value's. A form that lowers the power drawn runs at a
higher clock under the cap, which a sustained run shows and an interleaved one of short bursts does not
(docs/performance.md, Ragged-reduction GEMM (wgrad): the tile-walk band).
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import subprocess
import tempfile
import time

from bench.ab_switch import add_switch_arguments, switch_setter, switch_values
from bench.preflight import require_cuda_gpu

PROG = "python -m bench.gemm.power"
ROWS = "DG 4x8192 N=4096 K=7168,DeepSeek-V3-EP8 zipf fc1 fprop,Small experts E=64 zipf fc1 fprop"
WGRAD = "DG 4x8192 M=4096 N=7168,DeepSeek-V3-EP8 zipf fc1 wgrad"
SAMPLE_MS = 25
SETTLE_S = 0.5  # left out of each run's window: the clock settles at the cap within it


def parse_args():
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=ROWS, help="ragged-row problems (bench.gemm.ragged_rows labels); '' for none")
    ap.add_argument("--wgrad", default=WGRAD, help="ragged-reduction problems (bench.gemm.ragged_reduction labels); '' for none")
    ap.add_argument("--tilings", default="-1", help="the ragged-row kernel's tilings (write --tilings=-1,3)")
    ap.add_argument("--seconds", type=float, default=2.0, help="how long each GEMM runs (default 2)")
    ap.add_argument("--deepgemm", action="store_true", help="DeepGEMM's GEMM on each problem too (built from .peers/DeepGEMM)")
    add_switch_arguments(ap, required=False, bitwise=False)
    ap.add_argument("--rounds", type=int, default=2, help="with --env: rounds of one sustained run per value (default 2)")
    args = ap.parse_args()
    args.forms = switch_values(args) if args.env else [None]
    if args.values and not args.env:
        ap.error("--values needs --env")
    if args.env and len(args.forms) < 2:
        ap.error("--env needs at least two --values")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    return args


class Sampler:
    """nvidia-smi in the background, sampling every SAMPLE_MS into a temporary file."""

    FIELDS = ("timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active",
              "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active")  # older drivers

    def __enter__(self):
        if shutil.which("nvidia-smi") is None:
            raise SystemExit(f"{PROG}: needs nvidia-smi on the PATH (it samples the clock and the power)")
        self.fields = next((f for f in self.FIELDS if subprocess.run(["nvidia-smi", f"--query-gpu={f}", "--format=csv,noheader"],
                                                                       capture_output=True).returncode == 0), None)
        if self.fields is None:
            raise SystemExit(f"{PROG}: nvidia-smi cannot report the SM clock, power and clock-event reasons here")
        gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
        self.log = tempfile.NamedTemporaryFile("w", prefix="moegemm_power_", suffix=".csv", delete=False)
        self.path = self.log.name
        self.proc = subprocess.Popen(["nvidia-smi", "-i", gpu, f"--query-gpu={self.fields}", "--format=csv,noheader,nounits",
                                      "-lms", str(SAMPLE_MS)], stdout=self.log, stderr=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait()
        self.log.close()
        os.unlink(self.path)

    def window(self, t0: float, t1: float):
        """(median MHz, median W, median degrees C, the reasons seen) of the samples within [t0, t1] (epoch seconds)."""
        got = []
        with open(self.path) as f:
            for line in f:
                v = [s.strip() for s in line.split(",")]
                try:
                    ts = datetime.datetime.strptime(v[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()  # local time, as time.time()
                    if t0 <= ts <= t1:
                        got.append((float(v[1]), float(v[2]), float(v[3]), v[4]))
                except (ValueError, IndexError):
                    continue
        if not got:
            return None
        return (statistics.median(g[0] for g in got), statistics.median(g[1] for g in got), statistics.median(g[2] for g in got),
                sorted({g[3] for g in got}))


def sustain(fn, seconds: float) -> tuple:
    """Calls fn back to back for `seconds`: (calls, start, end), epoch seconds."""
    import torch

    fn()
    torch.cuda.synchronize()
    calls, t0 = 0, time.time()
    while time.time() - t0 < seconds:
        for _ in range(10):
            fn()
        calls += 10
        torch.cuda.synchronize()
    return calls, t0, time.time()


def print_forms(env: str, values: list, forms: dict) -> None:
    """Each switched GEMM's median rate per value (forms: GEMM -> value -> rates) and its ratio to the first value's,
    then each value's geometric mean ratio over the GEMMs."""
    ref = values[0]
    print(f"\n{env}: median TFLOP/s over the rounds, and the ratio to {env}={ref}")
    print(f"{'GEMM':62s}" + "".join(f"{v:>10s}" for v in values) + "".join(f"{v + '/' + ref:>12s}" for v in values[1:]))
    ratios = {v: [] for v in values[1:]}
    for name, by in forms.items():
        med = {v: statistics.median(by[v]) for v in values}
        for v in values[1:]:
            ratios[v].append(med[v] / med[ref])
        print(f"{name:62s}" + "".join(f"{med[v]:10.1f}" for v in values)
              + "".join(f"{med[v] / med[ref]:12.3f}" for v in values[1:]))
    for v in values[1:]:
        print(f"{env}={v} over {env}={ref}: geometric mean {statistics.geometric_mean(ratios[v]):.4f} over "
              f"{len(ratios[v])} GEMMs")


def chosen(table: list, labels: str, tool: str) -> list:
    wanted = [w.strip() for w in labels.split(",") if w.strip()]
    found = {p[0]: p for p in table}
    missing = [w for w in wanted if w not in found]
    if missing:
        raise SystemExit(f"{PROG}: no such problem: {missing} (see python -m {tool})")
    return [found[w] for w in wanted]


def main() -> int:
    args = parse_args()
    require_cuda_gpu(PROG, hopper=True)
    import torch

    from bench.gemm.mlp_problems import ops  # builds / loads the extension
    from bench.gemm.ragged_reduction import problems as reduction_problems
    from bench.gemm.ragged_rows import problems as rows_problems
    from moegemm.layout import GEMM_SM90

    dg = dg_peer = None
    if args.deepgemm:
        from bench.peers import deepgemm as dg_peer

        dg = dg_peer.load(dg_peer.build())
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    runs = []  # (name, rate in TFLOP/s or TB/s, start, end)
    forms = {}  # with --env: GEMM -> value -> rates
    use = switch_setter(args)

    def run(name: str, fn, flops: float, switched: bool = True) -> None:
        """fn sustained: once, or (a moegemm GEMM under --env) once per value and round."""
        values = args.forms if switched else [None]
        for r in range(args.rounds if values[0] is not None else 1):
            for v in values if r % 2 == 0 else values[::-1]:
                if v is not None:
                    use(v)
                calls, t0, t1 = sustain(fn, args.seconds)
                rate = flops * calls / (t1 - t0) / 1e12
                runs.append((name if v is None else f"{name} [{v}]", rate, t0 + SETTLE_S, t1))
                if v is not None:
                    forms.setdefault(name, {}).setdefault(v, []).append(rate)
                time.sleep(0.3)

    with Sampler() as sampler:
        time.sleep(0.5)
        n = 8192
        a8 = torch.randn(n, n, device=dev, generator=gen).to(torch.float8_e4m3fn)
        b8 = torch.randn(n, n, device=dev, generator=gen).to(torch.float8_e4m3fn).t()  # column-major
        sa, sb = torch.ones(n, 1, device=dev), torch.ones(1, n, device=dev)
        run("ceiling: torch._scaled_mm rowwise 8192^3",
            lambda: torch._scaled_mm(a8, b8, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=True), 2.0 * n ** 3, False)
        del a8, b8
        for label, splits, N, K in chosen(rows_problems(False), args.rows, "bench.gemm.ragged_rows"):
            E, T = len(splits), sum(splits)
            plan = ops.make_plan(torch.tensor(splits, device=dev), T)
            x = torch.randn(T, K, device=dev, generator=gen).to(torch.bfloat16)
            w = (torch.randn(E, N, K, device=dev, generator=gen) * 0.05).to(torch.bfloat16)
            qx, sx, _, _ = ops.quantize_act(x, plan, cols=False)
            qw, sw, _, _ = ops.quantize_weight(w)
            for tiling in (int(t) for t in args.tilings.split(",")):
                run(f"{label}, moegemm tiling {tiling}",
                    lambda tiling=tiling: torch.ops.moegemm.gemm_fp8_ragged_rows(qx, sx, qw, sw, plan, tiling), 2.0 * T * N * K)
            if dg:
                fn, _ = dg_peer.fprop_from_bf16(dg, x, w, splits)
                run(f"{label}, DeepGEMM", fn, 2.0 * T * N * K, False)
                del fn
            del x, w, qx, sx, qw, sw
            torch.cuda.empty_cache()
        for label, splits, N, K in chosen(reduction_problems(False, None), args.wgrad, "bench.gemm.ragged_reduction"):
            E, T = len(splits), sum(splits)
            plan = ops.make_plan(torch.tensor(splits, device=dev), T)
            dy = torch.randn(T, N, device=dev, generator=gen).to(torch.bfloat16)
            x = torch.randn(T, K, device=dev, generator=gen).to(torch.bfloat16)
            _, _, qa, sa_ = ops.quantize_act(dy, plan, rows=False)
            _, _, qb, sb_ = ops.quantize_act(x, plan, rows=False)
            out = torch.zeros(E, N, K, device=dev)
            flops = 2.0 * T * N * K
            run(f"{label}, moegemm fp32 +=",
                lambda: torch.ops.moegemm.gemm_fp8_ragged_reduction_accumulate(qa, sa_, qb, sb_, plan, out, GEMM_SM90, -1), flops)
            run(f"{label}, moegemm bf16",
                lambda: torch.ops.moegemm.gemm_fp8_ragged_reduction(qa, sa_, qb, sb_, plan, torch.bfloat16, GEMM_SM90, -1), flops)
            if dg:
                fn, _ = dg_peer.wgrad_from_bf16(dg, dy, x, splits)
                run(f"{label}, DeepGEMM fp32 +=", fn, flops, False)
                del fn
            del dy, x, qa, qb, out
            torch.cuda.empty_cache()
        src = torch.randn(1 << 29, device=dev, dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        run("copy 1 GiB (TB/s and pJ per byte)", lambda: dst.copy_(src), 2.0 * src.numel() * src.element_size(), False)
        del src, dst
        time.sleep(2 * SAMPLE_MS / 1e3)
        print(f"{torch.cuda.get_device_name(0)}, {sms} SMs; nvidia-smi every {SAMPLE_MS} ms ({sampler.fields}); "
              f"medians over each run's last {args.seconds - SETTLE_S:.1f} s")
        print(f"{'GEMM':62s} {'TFLOP/s':>8s} {'MHz':>6s} {'W':>5s} {'C':>4s} {'FLOP/SM/cycle':>14s} {'pJ/FLOP':>8s}  reasons")
        for name, rate, t0, t1 in runs:
            w = sampler.window(t0, t1)
            if w is None:
                print(f"{name:62s} {rate:8.1f}  (no samples)")
                continue
            mhz, watts, deg, reasons = w
            per_cycle = rate * 1e12 / (mhz * 1e6 * sms)
            print(f"{name:62s} {rate:8.1f} {mhz:6.0f} {watts:5.0f} {deg:4.0f} {per_cycle:14.0f} {watts / rate:8.3f}  {' '.join(reasons)}")
    if forms:
        print_forms(args.env, args.forms, forms)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
