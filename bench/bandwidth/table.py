"""The memory-bound kernels of the FP8 path, each on each benchmark shape: bytes moved, GB/s and % of the
device's copy bandwidth measured in the same run.

Bytes are the minimal ones: every input read once, every output written once (the FP8 copies with the
padding of each expert's column copy to COL_ALIGN tokens, the scales, the probs-gradient partial sums). Kernels:
  quantize_act        x [T, H] -> rows (1x128) + per-expert columns (128x1): fc1's input, fc2's dy
  requantize_cols     x's FP8 rows [T, H] -> its per-expert columns: fc1's wgrad operand, in the backward
  act_quantize        SwiGLU(h) x probs -> FP8 rows + columns, h [T, 2F]
  act_backward_quant  its gradient: da [T, F], h, probs -> dh rows + columns and the probs partials
  quantize_weight     fc1 [E, 2F, H] and fc2 [E, H, F] weights -> W and Wᵀ copies
  quantize_weights    both in one launch: the FP8 weight cache's refresh once per optimizer step
  add_bias, bias_grad the per-expert bias of fc1 [T, 2F]
Timing: each kernel's calls captured `--iters` at a time in a CUDA graph (no host time), the graphs of one
shape replayed interleaved over `--rounds` rounds, the median per call.

    python -m bench.bandwidth.table [--quick] [--shapes NAMES] [--kernels NAMES] [--json PATH] [--md PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics

from bench.preflight import require_cuda_gpu

PROG = "python -m bench.bandwidth.table"


def parse_args():
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="Zipf splits only, fewer rounds")
    ap.add_argument("--shapes", default=None, help="comma-separated substrings of the shape names to keep")
    ap.add_argument("--kernels", default=None, help="comma-separated substrings of the kernel names to keep")
    ap.add_argument("--iters", type=int, default=20, help="calls per CUDA graph (default 20)")
    ap.add_argument("--rounds", type=int, default=None, help="replays per kernel, interleaved (default 9, quick 5)")
    ap.add_argument("--json", default=None, help="write the rows as JSON here")
    ap.add_argument("--md", default=None, help="write the markdown table here")
    return ap.parse_args()


def multicast_bytes(T: int, K: int, splits: list, rows: bool = True, cols: bool = True) -> float:
    """Bytes written by a multi-cast quantization of [T, K]: FP8 rows + 1x128 scales, FP8 columns (each
    expert's tokens rounded up to COL_ALIGN) + 128x1 scales (one per 128-token block of an expert)."""
    from moegemm.layout import COL_ALIGN

    kb = -(-K // 128)
    col = sum(-(-m // COL_ALIGN) * COL_ALIGN for m in splits)
    blocks = sum(-(-m // 128) for m in splits)
    return (T * K + T * kb * 4 if rows else 0) + (K * col + blocks * K * 4 if cols else 0)


def kernels(E, H, F, splits, ops, torch):
    """name -> (call, minimal bytes) for one point."""
    T = sum(splits)
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    bf = torch.bfloat16
    plan = ops.make_plan(torch.tensor(splits, device=dev), T)
    x = torch.randn(T, H, device=dev, generator=g).to(bf)
    h = torch.randn(T, 2 * F, device=dev, generator=g).to(bf)
    da = torch.randn(T, F, device=dev, generator=g).to(bf)
    probs = torch.rand(T, device=dev, generator=g)
    w1 = (torch.randn(E, 2 * F, H, device=dev, generator=g) * 0.05).to(bf)
    w2 = (torch.randn(E, H, F, device=dev, generator=g) * 0.05).to(bf)
    b1 = torch.randn(E, 2 * F, device=dev, generator=g).to(bf)
    y1 = torch.randn(T, 2 * F, device=dev, generator=g).to(bf)
    kb = lambda K: -(-K // 128)  # noqa: E731
    m = torch.ops.moegemm
    qx, sx = ops.quantize_act(x, plan, True, False)[:2]

    def wbytes(N, K):
        return E * N * K * 2 + 2 * (E * N * K + E * kb(N) * kb(K) * 4)

    return plan, {
        "quantize_act [T, H]": (lambda: ops.quantize_act(x, plan), T * H * 2 + multicast_bytes(T, H, splits)),
        "requantize_cols [T, H]": (lambda: ops.requantize_cols(qx, sx, plan),
                                   T * H + T * kb(H) * 4 + multicast_bytes(T, H, splits, rows=False)),
        "act_quantize SwiGLU": (lambda: ops.act_quantize(h, probs, "swiglu", plan),
                                T * 2 * F * 2 + T * 4 + multicast_bytes(T, F, splits)),
        "act_backward_quantize SwiGLU": (lambda: ops.act_backward_quantize(da, h, probs, "swiglu", plan),
                                         T * F * 2 + T * 2 * F * 2 + T * 4 + multicast_bytes(T, 2 * F, splits)
                                         + T * kb(2 * F) * 4),
        "quantize_weight fc1": (lambda: ops.quantize_weight(w1), wbytes(2 * F, H)),
        "quantize_weight fc2": (lambda: ops.quantize_weight(w2), wbytes(H, F)),
        "quantize_weights fc1+fc2": (lambda: ops.quantize_weights([w1, w2]), wbytes(2 * F, H) + wbytes(H, F)),
        "add_bias [T, 2F]": (lambda: m.add_bias_(y1, b1, plan), T * 2 * F * 2 * 2 + E * 2 * F * 2),
        "bias_grad [T, 2F]": (lambda: m.bias_grad(y1, plan), T * 2 * F * 2 + E * 2 * F * 4),
    }


def graph_of(fn, iters: int, torch):
    """A CUDA graph of `iters` calls of fn (warmed up on a side stream first, as capture requires)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    return graph


def replay_interleaved(graphs: dict, rounds: int, iters: int, torch) -> dict:
    """key -> ms per call of each replay: the graphs (of `iters` calls each) replayed in turn, `rounds` times."""
    times = {key: [] for key in graphs}
    for _ in range(rounds):
        for key, graph in graphs.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times[key].append(a.elapsed_time(b) / iters)
    return times


def main() -> int:
    args = parse_args()
    require_cuda_gpu(PROG, hopper=True)
    import torch

    from bench.suite.measure import measure_ceilings
    from moegemm.backends import cuda as ops

    rounds = args.rounds or (5 if args.quick else 9)
    ce = measure_ceilings({"ceiling_n": 8192, "ceiling_s": 0.3, "copy_elems": 1 << 29})
    copy = ce["copy_gbps"]
    print(f"copy bandwidth {copy:.0f} GB/s ({ce['copy_how']})", flush=True)
    rows = []
    print(f"{'point':32s} {'kernel':30s} {'MB':>8s} {'us':>8s} {'GB/s':>7s} {'% copy':>7s}", flush=True)
    from bench.workloads import table_points

    for label, E, H, F, splits in table_points(args.quick, args.shapes):
        plan, ks = kernels(E, H, F, splits, ops, torch)
        if args.kernels:
            ks = {k: v for k, v in ks.items() if any(sub.strip() in k for sub in args.kernels.split(","))}
        graphs = {k: graph_of(fn, args.iters, torch) for k, (fn, _) in ks.items()}
        times = replay_interleaved(graphs, rounds, args.iters, torch)
        for k, (_, nbytes) in ks.items():
            ms = statistics.median(times[k])
            gbps = nbytes / ms / 1e6
            rec = {"point": label, "E": E, "T": sum(splits), "H": H, "F": F, "kernel": k, "bytes": nbytes, "ms": ms,
                   "gbps": gbps, "pct_copy": 100 * gbps / copy}
            rows.append(rec)
            print(f"{label:32s} {k:30s} {nbytes / 1e6:8.1f} {ms * 1e3:8.1f} {gbps:7.0f} {rec['pct_copy']:6.0f} %", flush=True)
        del graphs, ks, plan
        torch.cuda.empty_cache()

    from bench.suite.meta import collect_meta

    meta = collect_meta(args)
    md = [f"{torch.cuda.get_device_name()}, commit {meta['git_commit']}, torch {torch.__version__}; copy bandwidth "
          f"{copy:.0f} GB/s ({ce['copy_how']}, same run). Minimal bytes (inputs read once, outputs written once); "
          f"per call, {args.iters} calls per CUDA graph, median over {rounds} interleaved replays.", "",
          "| point | kernel | MB | µs | GB/s | % of copy |", "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        md.append(f"| {r['point']} | {r['kernel']} | {r['bytes'] / 1e6:.1f} | {r['ms'] * 1e3:.1f} | {r['gbps']:.0f} | "
                  f"{r['pct_copy']:.0f} % |")
    print("\n".join(md))
    if args.md:
        open(args.md, "w").write("\n".join(md) + "\n")
    if args.json:
        json.dump({"meta": meta, "gpu": torch.cuda.get_device_name(), "ceilings": ce, "iters": args.iters,
                   "rounds": rounds, "rows": rows}, open(args.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
