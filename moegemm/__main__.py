"""``python -m moegemm``: the demo.

On a Hopper GPU: builds the extension (first run), runs a GroupedLinear forward and backward with the
``fp8_blockwise`` recipe on a default MoE shape (DeepSeek-V2-Lite fc1: 64 experts, hidden 2048, 2·1408
outputs, 24576 routed tokens with Zipf-skewed counts, empty experts included), checks it against the
reference and prints its speed next to ``torch._grouped_mm`` (bf16). Without one: runs the reference
path on a small shape and says so.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import moegemm
from moegemm import backend
from moegemm.workloads import SHAPES, zipf_splits


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def median_ms(fn, iters: int = 30) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def run(E, K, N, T, device) -> None:
    splits = zipf_splits(E, T)
    m = torch.tensor(splits, device=device)
    x = torch.randn(T, K, device=device, dtype=torch.bfloat16, requires_grad=True)
    layer = moegemm.GroupedLinear(E, K, N, bias=False, recipe="fp8_blockwise", device=device)
    dy = torch.randn(T, N, device=device, dtype=torch.bfloat16)
    path = "CUDA kernels" if backend.uses_cuda(torch.device(device)) else "reference (plain PyTorch)"
    print(f"moegemm {moegemm.__version__}: GroupedLinear E={E} K={K} N={N} T={T} "
          f"(m_splits Zipf, {splits.count(0)} empty experts) on {device}, path: {path}")

    y = layer(x, m)
    y.backward(dy)
    # Check against float64 math on the unquantized operands: FP8 E4M3 costs a few percent.
    w64, x64, dy64 = layer.weight.double(), x.detach().double(), dy.double()
    y64, dx64, dw64 = torch.empty(T, N, dtype=torch.float64, device=device), torch.empty_like(x64), torch.zeros_like(w64)
    start = 0
    for e, cnt in enumerate(splits):
        rows = slice(start, start + cnt)
        y64[rows] = x64[rows] @ w64[e].t()
        dx64[rows] = dy64[rows] @ w64[e]
        dw64[e] = dy64[rows].t() @ x64[rows]
        start += cnt
    errs = {"y": rel(y, y64), "dx": rel(x.grad, dx64), "dw": rel(layer.weight.grad, dw64)}
    print("relative error vs float64 (fp8_blockwise): " + ", ".join(f"{k} {v:.3%}" for k, v in errs.items()))
    if max(errs.values()) > 0.08:
        raise SystemExit("moegemm: error larger than FP8's inherent ~3-5%: something is wrong")

    if path != "CUDA kernels":
        print("No Hopper GPU here: ran the reference path on a small shape; run on an H100/H200 for the CUDA kernels.")
        return
    offs = torch.cumsum(m, 0).to(torch.int32)
    w_bf16 = layer.weight.detach()
    flops = 2.0 * T * N * K
    with torch.no_grad():
        results = {
            "torch._grouped_mm (bf16)": median_ms(lambda: torch._grouped_mm(x.detach(), w_bf16.transpose(1, 2), offs=offs)),
            "moegemm bf16": median_ms(lambda: moegemm.grouped_linear(x.detach(), w_bf16, m, recipe="bf16")),
            "moegemm fp8_blockwise (quantization included)": median_ms(lambda: layer(x.detach(), m)),
        }
    base = results["torch._grouped_mm (bf16)"]
    print(f"\nforward, {torch.cuda.get_device_name()}:")
    for name, ms in results.items():
        print(f"  {name:48s} {ms:7.3f} ms  {flops / ms / 1e9:6.0f} TFLOP/s  {base / ms:5.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", nargs=4, type=int, metavar=("E", "K", "N", "T"), help="experts, in, out, tokens")
    args = ap.parse_args()
    if torch.cuda.is_available():
        E, hidden, ffn, T = SHAPES["DeepSeek-V2-Lite"]
        run(*(args.shape or (E, hidden, 2 * ffn, T)), device="cuda")
    else:
        run(*(args.shape or (8, 256, 512, 1000)), device="cpu")


if __name__ == "__main__":
    main()
