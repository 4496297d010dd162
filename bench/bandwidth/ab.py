"""A/B of a change to one of the FP8 path's memory-bound kernels, in one build: the kernel's launcher reads an
environment variable at every launch and picks the form under test (a temporary switch, removed once the A/B has
decided), and this tool runs the forms side by side in one process (the ragged GEMMs' counterpart is bench.gemm.ab).

1. Bitwise: every form's outputs equal to the first's, on random and edge problems (empty experts, 1, 63, 64, 65,
   127, 128, 129 tokens, one expert with every token, E = 1024, K of one and several column blocks), rows only,
   columns only and both: quantize_act of bf16, requantize_cols (FP8 rows with special bytes and scales: NaN,
   infinite, zero, subnormal), the GLU activation forward (act_quantize) and backward (act_backward_quantize, its
   dprobs too), and the bias kernels (add_bias with bf16 and fp32 biases, bias_grad). Compared: the row copy whole,
   the column copy on each expert's padded columns and scale blocks (the rest of its buffer is unspecified), the bias
   kernels' outputs whole.
2. Timing: the memory-bound table's points (bench/bandwidth/table.py, its minimal bytes), each kernel's calls in a
   CUDA graph per form, the graphs of a point replayed interleaved over rounds, the median per call, % of the copy
   bandwidth of the same run, and each form's geometric mean of speed over the first per kernel.

    python -m bench.bandwidth.ab --env MOEGEMM_AB_X --values 0,1 [--kernels NAMES] [--quick] [--shapes NAMES]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from bench.ab_switch import add_switch_arguments, switch_setter, switch_values
from bench.preflight import require_cuda_gpu

PROG = "python -m bench.bandwidth.ab"
SPECIAL_BYTES = (0x7F, 0xFF, 0x80, 0x7E, 0xFE, 0x01)  # e4m3 NaN, -NaN, -0, 448, -448, the smallest subnormal
SPECIAL_SCALES = (float("inf"), 0.0, 1e-40, 3e38, 0.3, float("nan"))


def parse_args():
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_switch_arguments(ap)
    ap.add_argument("--kernels", default=None,
                    help="comma-separated substrings of the table's kernel names to time (default: all of them)")
    ap.add_argument("--quick", action="store_true", help="the table's Zipf points only")
    ap.add_argument("--shapes", default=None, help="only points whose label contains one of these (comma-separated)")
    ap.add_argument("--rounds", type=int, default=9, help="interleaved replays per form and kernel (default 9)")
    ap.add_argument("--iters", type=int, default=20, help="calls per CUDA graph (default 20)")
    return ap.parse_args()


def edge_problems(rng: random.Random) -> list:
    """(splits, K) of the bitwise comparison (K: the columns of x, or the GLU's F)."""
    out = []
    for K in (128, 256, 272, 384, 400, 1408, 2048, 7168):
        for _ in range(4):
            E, T = rng.choice([1, 3, 8, 17, 64, 1024]), rng.choice([1, 63, 64, 65, 127, 129, 1000, 3000, 9000])
            cuts = sorted(rng.randint(0, T) for _ in range(E - 1))
            out.append(([b - a for a, b in zip([0] + cuts, cuts + [T])], K))
    out += [([0, 1, 17, 63, 64, 65, 127, 128, 129, 0, 300], 256), ([5000], 384), ([0] * 1000 + [3, 1, 400] + [0] * 21, 256),
            ([0, 0, 0], 256), ([1] * 1024, 128), ([2000, 0, 0, 3], 1408)]
    return out


def defined_bytes(outs, segments, torch):
    """The specified bytes of a quantizer's (q, s, qT, sT[, dprobs]) (a bias kernel's output as q), as one uint8
    tensor."""
    def flat(t):
        return t.reshape(-1).contiguous().view(torch.uint8)

    q, s, qT, sT = outs[:4]
    parts = []
    if q is not None:
        parts.append(flat(q.view(torch.uint8)))
    if s is not None:
        parts.append(flat(s))
    if qT is not None:
        for _start, m, col, blk in segments:
            w, nb = -(-m // 32) * 32, -(-m // 128)
            parts += [flat(qT.view(torch.uint8)[:, col: col + w]), flat(sT[blk: blk + nb])]
    if len(outs) > 4 and outs[4] is not None:
        parts.append(flat(outs[4]))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8, device="cuda")


def _added(y, bias, plan):
    """add_bias_ on a copy of y."""
    import torch

    out = y.clone()
    torch.ops.moegemm.add_bias_(out, bias, plan)
    return out


def bitwise(values, use, torch, ops, ref) -> int:
    """Compares every form's outputs with the first's; prints the unequal ones; returns their count."""
    dev = "cuda"
    rng = random.Random(1)
    gen = torch.Generator(device=dev).manual_seed(1)
    t0, compared, bad = time.time(), 0, 0
    for splits, K in edge_problems(rng):
        E, T = len(splits), sum(splits)
        plan = ops.make_plan(torch.tensor(splits, device=dev), T)
        segments = ref._segments(plan.cpu())
        x = (torch.randn(max(T, 1), K, device=dev, generator=gen) * 3).to(torch.bfloat16)[:T]
        h = (torch.randn(max(T, 1), 2 * K, device=dev, generator=gen) * 2).to(torch.bfloat16)[:T]
        da = torch.randn(max(T, 1), K, device=dev, generator=gen).to(torch.bfloat16)[:T]
        probs = torch.rand(max(T, 1), device=dev, generator=gen)[:T]
        y = torch.randn(max(T, 1), 2 * K, device=dev, generator=gen).to(torch.bfloat16)[:T]
        bias = torch.randn(E, 2 * K, device=dev, generator=gen)
        use(values[0])
        qx, sx = ops.quantize_act(x, plan, True, False)[:2]
        if T > 0:  # special bytes and scales in the FP8 rows requantize_cols reads
            flat = qx.view(torch.uint8).view(-1)
            at = torch.randint(0, flat.numel(), (max(1, flat.numel() // 500),), device=dev, generator=gen)
            pick = torch.randint(0, len(SPECIAL_BYTES), at.shape, device=dev, generator=gen)
            flat[at] = torch.tensor(SPECIAL_BYTES, device=dev, dtype=torch.uint8)[pick]
            for v in SPECIAL_SCALES:
                sx[rng.randrange(T), rng.randrange(sx.shape[1])] = v
        calls = {
            "quantize_act": lambda: ops.quantize_act(x, plan, True, True),
            "quantize_act rows": lambda: ops.quantize_act(x, plan, True, False),
            "quantize_act cols": lambda: ops.quantize_act(x, plan, False, True),
            "requantize_cols": lambda: (None, None) + tuple(ops.requantize_cols(qx, sx, plan)),
            "act_quantize swiglu": lambda: ops.act_quantize(h, probs, "swiglu", plan),
            "act_quantize geglu cols, no probs": lambda: ops.act_quantize(h, None, "geglu", plan, False, True),
            "act_backward_quantize swiglu": lambda: ops.act_backward_quantize(da, h, probs, "swiglu", plan),
            "act_backward_quantize swiglu rows": lambda: ops.act_backward_quantize(da, h, probs, "swiglu", plan, True, False),
            "add_bias bf16": lambda: (_added(y, bias.to(torch.bfloat16), plan), None, None, None),
            "add_bias fp32": lambda: (_added(y, bias, plan), None, None, None),
            "bias_grad": lambda: (torch.ops.moegemm.bias_grad(y, plan), None, None, None),
        }
        for name, fn in calls.items():
            outs = []
            for v in values:
                use(v)
                outs.append(defined_bytes(fn(), segments, torch).clone())
            compared += len(values) - 1
            for v, o in zip(values[1:], outs[1:]):
                if not torch.equal(outs[0], o):
                    bad += 1
                    print(f"NOT BITWISE EQUAL: {name}, E={E} T={T} K={K}, value {v}", flush=True)
    torch.cuda.synchronize()
    print(f"bitwise: {compared} comparisons with the first value, {bad} unequal ({time.time() - t0:.0f} s)", flush=True)
    return bad


def main() -> int:
    args = parse_args()
    require_cuda_gpu(PROG, hopper=True)
    import torch

    from bench.bandwidth.table import graph_of, kernels, replay_interleaved
    from bench.suite.measure import measure_ceilings
    from bench.workloads import table_points
    from moegemm import reference as ref
    from moegemm.backends import cuda as ops

    values, use = switch_values(args), switch_setter(args)
    bad = 0 if args.no_bitwise else bitwise(values, use, torch, ops, ref)

    ce = measure_ceilings({"ceiling_n": 8192, "ceiling_s": 0.3, "copy_elems": 1 << 29})
    copy = ce["copy_gbps"]
    print(f"{torch.cuda.get_device_name()}; copy bandwidth {copy:.0f} GB/s ({ce['copy_how']}); {args.env} in {values}; "
          f"us per call (% of copy, minimal bytes), {args.iters} calls per CUDA graph, median over {args.rounds} "
          f"interleaved replays", flush=True)
    print("| point | kernel | " + " | ".join(f"{args.env}={v}" for v in values) + " | "
          + " | ".join(f"{v} / {values[0]}" for v in values[1:]) + " |", flush=True)
    print("|---|---|" + "---:|" * (2 * len(values) - 1), flush=True)
    ratios: dict = {}
    for label, E, H, F, splits in table_points(args.quick, args.shapes):
        plan, ks = kernels(E, H, F, splits, ops, torch)
        if args.kernels:
            ks = {k: c for k, c in ks.items() if any(sub.strip() in k for sub in args.kernels.split(","))}
        graphs = {}
        for k, (fn, _) in ks.items():
            for v in values:
                use(v)  # captured with the form it launches
                graphs[(k, v)] = graph_of(fn, args.iters, torch)
        times = replay_interleaved(graphs, args.rounds, args.iters, torch)
        for k, (_, nbytes) in ks.items():
            ms = {v: statistics.median(times[(k, v)]) for v in values}
            for v in values[1:]:
                ratios.setdefault((k, v), []).append(ms[values[0]] / ms[v])
            cells = " | ".join(f"{ms[v] * 1e3:.1f} ({100 * nbytes / ms[v] / 1e6 / copy:.1f} %)" for v in values)
            print(f"| {label} | {k} | {cells} | " + " | ".join(f"{ms[values[0]] / ms[v]:.3f}" for v in values[1:]) + " |",
                  flush=True)
        del graphs, ks, plan
        torch.cuda.empty_cache()
    for (k, v), r in ratios.items():
        print(f"{k}: {args.env}={v} over {values[0]}: geometric mean of speed {statistics.geometric_mean(r):.4f}, "
              f"faster on {sum(x > 1 for x in r)} of {len(r)}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
