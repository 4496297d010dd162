"""A small case that runs every CUDA kernel of moegemm once, for compute-sanitizer (from the repository
root, which must be on PYTHONPATH; bench/gpu_run.sh runs it with SANITIZE=1):

    compute-sanitizer --tool memcheck  python tests/sanitize/every_kernel.py
    compute-sanitizer --tool racecheck python tests/sanitize/every_kernel.py

Shapes include an empty expert, counts that are not multiples of 16 or 128 and K, N that are not
multiples of 128, so partial tiles and padding are exercised. Checks the results loosely too. Not a
pytest module: a driver for the sanitizer."""

import argparse
import sys

from bench.preflight import require_cuda_gpu

PROG = f"python {sys.argv[0]}"
argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
require_cuda_gpu(PROG, hopper=True)

import torch  # noqa: E402  (after the machine check)

import moegemm  # noqa: E402
from moegemm import reference as ref  # noqa: E402
from moegemm.backends import cuda as cuda_ops  # noqa: E402
from moegemm.layout import GEMM_CUTLASS, GEMM_SM90, SM90_RAGGED_REDUCTION_TILINGS, SM90_RAGGED_ROWS_TILINGS  # noqa: E402

torch.manual_seed(0)
splits = [0, 17, 130, 1, 64]
T, E, K, N = sum(splits), len(splits), 144, 272
m = torch.tensor(splits, device="cuda", dtype=torch.int32)
plan = cuda_ops.make_plan(m, T)
for recipe in ["fp8_blockwise", "bf16"]:
    for wdtype in [torch.bfloat16, torch.float32]:
        x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(E, N, K, device="cuda") * 0.05).to(wdtype).requires_grad_()
        b = torch.randn(E, N, device="cuda", requires_grad=True)
        y = moegemm.grouped_linear(x, w, m, b, recipe=recipe)
        y.backward(torch.randn_like(y))
        w.main_grad = torch.zeros(E, N, K, device="cuda")
        moegemm.grouped_linear(x, w, m, recipe=recipe).backward(torch.randn_like(y))  # accumulate path
        del w.main_grad
for activation, recipe, F in [(a, r, 144) for a in moegemm.reference.ACTIVATIONS for r in ("fp8_blockwise", "bf16")] + [
        ("swiglu", "fp8_blockwise", 256), ("geglu", "fp8_blockwise", 256)]:
    # the fused activation kernels (FP8 multi-cast and bf16), forward and backward; F = 256: the GLU
    # gradient's two halves from one tile
    mlp = moegemm.GroupedMLP(E, K, F, activation=activation, bias=True, recipe=recipe, device="cuda",
                             dtype=torch.bfloat16)
    xm = torch.randn(T, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(T, device="cuda", requires_grad=True)
    ym = mlp(xm, m, probs)
    ym.backward(torch.randn_like(ym))
    assert torch.isfinite(xm.grad).all() and torch.isfinite(probs.grad).all()
# Both weights quantized in the forward's first launch with the plan (one more CTA), or in two launches when
# their dtypes differ
for w1_dtype, w2_dtype in [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)]:
    xm = torch.randn(T, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w1 = (torch.randn(E, 2 * 144, K, device="cuda") * 0.05).to(w1_dtype).requires_grad_()
    w2 = (torch.randn(E, K, 144, device="cuda") * 0.05).to(w2_dtype).requires_grad_()
    ym = moegemm.grouped_mlp(xm, w1, w2, m, torch.rand(T, device="cuda"))
    ym.backward(torch.randn_like(ym))
    assert torch.isfinite(xm.grad).all() and torch.isfinite(w1.grad).all()
# A weight given as parts written into the whole weight's copies (torchtitan's w1 and w3 into the fused fc1 rows, a
# part of 144 rows: not whole 128-row blocks) with w2 in the same launch; checked bitwise against the concatenation's
parts = [(torch.randn(E, F, K, device="cuda") * 0.05).to(torch.bfloat16) for F in (256, 144)]
w2p = (torch.randn(E, K, 400, device="cuda") * 0.05).to(torch.bfloat16)
copies = [torch.empty_like(t) for t in list(cuda_ops.quantize_weight(torch.cat(parts, 1))) + list(
    cuda_ops.quantize_weight(w2p))]
torch.ops.moegemm.quantize_weights_into(parts + [w2p], [2, 1], copies)
for got, want in zip(copies, list(ref.quantize_weight(torch.cat(parts, 1))) + list(ref.quantize_weight(w2p))):
    assert torch.equal(got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
                       want.to("cuda").view(torch.uint8) if want.dtype == torch.float8_e4m3fn else want.to("cuda"))
# Given FP8 weights: x's quantizer derives the plan in each CTA (CTA 0 writing it)
wq = (torch.randn(E, N, K, device="cuda") * 0.05).to(torch.bfloat16)
yq, plan_q, _ = cuda_ops.linear_fwd(torch.randn(T, K, device="cuda", dtype=torch.bfloat16), wq, m, None, 1, True, True,
                                    None, list(cuda_ops.quantize_weight(wq)))
assert torch.equal(plan_q, plan) and torch.isfinite(yq).all()
# ... and without a weight gradient, in one launch: the GEMM builds the plan and x's FP8 rows itself (the
# heuristic's tilings of these problems: 128, 192 and 256 columns on an H200; 128 and 256 on a device with less
# DRAM bandwidth, such as the H100 SXM, where the fused 192-column form is not reached); with the weights quantized
# in the call, their launch builds the plan and the GEMM reads it
for splits_q, Kq, Nq in [(splits, 144, 272), ([1000, 0, 2000, 1096], 1024, 2816), ([1000, 0, 2000, 1096], 256, 768)]:
    mq = torch.tensor(splits_q, device="cuda")
    xq = torch.randn(sum(splits_q), Kq, device="cuda", dtype=torch.bfloat16)
    wq = (torch.randn(len(splits_q), Nq, Kq, device="cuda") * 0.05).to(torch.bfloat16)
    given_q = list(cuda_ops.quantize_weight(wq))
    y1, plan_1, _ = cuda_ops.linear_fwd(xq, wq, mq, None, 1, False, False, None, given_q)
    y2, plan_2, _ = cuda_ops.linear_fwd(xq, wq, mq, None, 1, False, True, None, given_q)
    y3, plan_3, _ = cuda_ops.linear_fwd(xq, wq, mq, None, 1, False, False, None, None)
    assert torch.equal(plan_1, plan_2) and torch.equal(y1, y2) and torch.equal(plan_1, plan_3) and torch.equal(y1, y3)
# FP8 input (the column copy re-quantized from the rows) and the split backward (wgrad later)
xs = torch.randn(T, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
lin = moegemm.GroupedLinear(E, K, N, bias=True, device="cuda", delay_wgrad_compute=True)
yl = lin(moegemm.to_fp8_rows(xs), m)
yl.backward(torch.randn_like(yl))
lin.backward_dw()
assert torch.isfinite(xs.grad).all() and torch.isfinite(lin.weight.grad).all()
xf = torch.randn(T, K, device="cuda")  # fp32 activations through the multi-cast kernel
q, s, qT, sT = cuda_ops.quantize_act(xf, plan, True, True)
rq, rs, _, _ = ref.quantize_act(xf, ref.make_plan(m, T), True, False)
assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
torch.cuda.synchronize()
print("sanitize case ran every kernel")

# The FP8 ragged-row GEMM in every tiling (the layers above use the heuristic's): at the case's K and N, and at K of
# whole rounds of the stage ring (the K loop unrolled over a round, fp8_ragged_rows.cuh): 4 stages (192 and 256
# columns) at K = 512, 5 (128 columns) at K = 640; N = 400: a 192-wide tile at either weight-scale split, a last
# 256-wide tile of one part.
for Kg, Ng in ((K, N), (512, 400), (640, 400)):
    qx, sx, _, _ = cuda_ops.quantize_act(torch.randn(T, Kg, device="cuda", dtype=torch.bfloat16), plan, cols=False)
    qw, sw, _, _ = cuda_ops.quantize_weight((torch.randn(E, Ng, Kg, device="cuda") * 0.05).to(torch.bfloat16))
    expect = ref.gemm_fp8_ragged_rows(qx, sx, qw, sw, ref.make_plan(m, T), torch.float64)
    for tiling in range(SM90_RAGGED_ROWS_TILINGS):
        y = torch.ops.moegemm.gemm_fp8_ragged_rows(qx, sx, qw, sw, plan, tiling)
        assert ((y.double() - expect).norm() / expect.norm()).item() < 2e-3, (Kg, Ng, tiling)
torch.cuda.synchronize()
print("every_kernel: the FP8 ragged-row GEMM in every tiling agrees with the reference")

# The FP8 ragged reduction (wgrad) on each of its kernels, every sm90 tiling and every output kind.
_, _, qdyT, sdyT = cuda_ops.quantize_act(torch.randn(T, N, device="cuda", dtype=torch.bfloat16), plan, rows=False)
_, _, qxT, sxT = cuda_ops.quantize_act(torch.randn(T, K, device="cuda", dtype=torch.bfloat16), plan, rows=False)
expect = ref.gemm_fp8_ragged_reduction(qdyT, sdyT, qxT, sxT, ref.make_plan(m, T), out_dtype=torch.float64)
for kernel, tiling in [(GEMM_CUTLASS, -1)] + [(GEMM_SM90, i) for i in range(SM90_RAGGED_REDUCTION_TILINGS)]:
    for dtype in (torch.float32, torch.bfloat16):
        dw = torch.ops.moegemm.gemm_fp8_ragged_reduction(qdyT, sdyT, qxT, sxT, plan, dtype, kernel, tiling)
        assert ((dw.double() - expect).norm() / expect.norm()).item() < 4e-3, (kernel, tiling, dtype)
    acc = torch.ones(E, N, K, device="cuda")
    torch.ops.moegemm.gemm_fp8_ragged_reduction_accumulate(qdyT, sdyT, qxT, sxT, plan, acc, kernel, tiling)
    assert ((acc.double() - 1 - expect).norm() / expect.norm()).item() < 2e-3, (kernel, tiling, "accumulate")
# The sm90 kernel's banded tile walk (24 or more column tiles, heuristics.h): 128 columns on K = 3072.
_, _, qxT, sxT = cuda_ops.quantize_act(torch.randn(T, 3072, device="cuda", dtype=torch.bfloat16), plan, rows=False)
expect = ref.gemm_fp8_ragged_reduction(qdyT, sdyT, qxT, sxT, ref.make_plan(m, T), out_dtype=torch.float64)
dw = torch.ops.moegemm.gemm_fp8_ragged_reduction(qdyT, sdyT, qxT, sxT, plan, torch.bfloat16, GEMM_SM90, 0)
assert ((dw.double() - expect).norm() / expect.norm()).item() < 4e-3, "banded walk"
acc = torch.ones(E, N, 3072, device="cuda")
torch.ops.moegemm.gemm_fp8_ragged_reduction_accumulate(qdyT, sdyT, qxT, sxT, plan, acc, GEMM_SM90, 0)
assert ((acc.double() - 1 - expect).norm() / expect.norm()).item() < 2e-3, "banded walk, accumulate"
torch.cuda.synchronize()
print("every_kernel: the FP8 ragged reduction on every kernel, tiling and output agrees with the reference")
