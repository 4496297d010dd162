"""The adversarial cases (docs/design.md#errors) once each, small shapes, for compute-sanitizer memcheck (from the
repository root, which must be on PYTHONPATH; bench/gpu_run.sh runs it with SANITIZE=1):

    compute-sanitizer --tool memcheck --error-exitcode 9 python tests/sanitize/adversarial.py

Every invalid device m_splits (negative, > T, int64 wrap, stale bytes, sums below/above T), both recipes,
grouped_linear and grouped_mlp forward+backward with biases and probs; misaligned inputs and a
misaligned main_grad; E = 1024; T = 0 with garbage counts; raw op misuse that must raise (caught).
Any out-of-bounds access shows in memcheck's report; the script itself also checks the zero rows past
the covered tokens and prints a summary. Not a pytest module: a driver for the sanitizer."""

import argparse
import sys

from bench.preflight import require_cuda_gpu

PROG = f"python {sys.argv[0]}"
argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
require_cuda_gpu(PROG, hopper=True)

import torch  # noqa: E402  (after the machine check)

import moegemm  # noqa: E402
from moegemm.backends import cuda as cuda_ops  # noqa: E402, F401  (builds/loads the extension)

DEV = "cuda"
I64_MAX, I64_MIN = 2 ** 63 - 1, -2 ** 63
E, T, K, N, H, F = 4, 300, 144, 160, 128, 144
torch.manual_seed(0)
stats = {"cases": 0, "expected_errors": 0}


def covered(ms, T):
    tok = 0
    for v in ms:
        tok = min(tok + min(max(int(v), 0), T), T)
    return tok


def bad_splits(T):
    return {
        "negative": [-5, 100, -7, T], "over_T": [T + 1, 5, 0, 7], "each_over_T": [T + 17, T + 1, 2 * T, T],
        "sum_below": [10, 0, 50, 3], "all_zero": [0, 0, 0, 0], "sum_above": [200, 200, 200, 200],
        "wrap2": [I64_MAX, T + 1001, 0, 0], "wrap2_late": [0, 7, I64_MAX, T + 1001],
        "wrap3": [I64_MAX, T + 1001, I64_MAX - 1000, 0], "int64_extremes": [I64_MIN, I64_MAX, -1, T],
        "int32_extremes": [2 ** 31 - 1, 2 ** 31 - 1, -2 ** 31, 5],
        "stale": torch.randint(I64_MIN, I64_MAX, (4,), dtype=torch.int64).tolist(),
    }


def expect_error(fn, types=(RuntimeError, NotImplementedError, ValueError, TypeError)):
    try:
        fn()
    except types:
        stats["expected_errors"] += 1
        return
    raise AssertionError("expected an error")


def linear(x, w, b, m, dy, recipe, main_grad=None):
    xl, wl, bl = (t.clone().requires_grad_() for t in (x, w, b))
    if main_grad is not None:
        wl.main_grad = main_grad
    y = moegemm.grouped_linear(xl, wl, m, bl, recipe=recipe)
    y.backward(dy)
    stats["cases"] += 1
    return y.detach(), xl.grad


def mlp(x, w1, w2, b1, b2, p, m, dy, recipe, activation):
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2, b1, b2, p)]
    y = moegemm.grouped_mlp(leaves[0], leaves[1], leaves[2], m, leaves[5], leaves[3], leaves[4],
                            activation=activation, recipe=recipe)
    y.backward(dy)
    stats["cases"] += 1
    return y.detach(), leaves[0].grad


x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16)
w = (torch.randn(E, N, K, device=DEV) * 0.05).to(torch.bfloat16)
b = torch.randn(E, N, device=DEV, dtype=torch.bfloat16)
dy = torch.randn(T, N, device=DEV, dtype=torch.bfloat16)
xm = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)
w1g = (torch.randn(E, 2 * F, H, device=DEV) * 0.08).to(torch.bfloat16)
w1 = (torch.randn(E, F, H, device=DEV) * 0.08).to(torch.bfloat16)
w2 = (torch.randn(E, H, F, device=DEV) * 0.08).to(torch.bfloat16)
b1g, b1 = torch.randn(E, 2 * F, device=DEV, dtype=torch.bfloat16), torch.randn(E, F, device=DEV, dtype=torch.bfloat16)
b2 = torch.randn(E, H, device=DEV, dtype=torch.bfloat16)
p = torch.rand(T, device=DEV)
dym = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)

# ------------------------------------------------------------------ invalid device m_splits, both recipes
for name, ms in bad_splits(T).items():
    cov = covered(ms, T)
    dtypes = [torch.int64] + ([torch.int32] if all(-2 ** 31 <= v < 2 ** 31 for v in ms) else [])
    for dt in dtypes:
        m = torch.tensor(ms, dtype=dt, device=DEV)
        for recipe in ("fp8_blockwise", "bf16"):
            y, dx = linear(x, w, b, m, dy, recipe)
            assert (y[cov:] == 0).all() and (dx[cov:] == 0).all(), (name, recipe)
            moegemm.quantize_act(x, m)
            stats["cases"] += 1
            expect_error(lambda: moegemm.grouped_linear(x, w, m, b, recipe=recipe, check_splits=True), ValueError)
    m = torch.tensor(ms, dtype=torch.int64, device=DEV)
    for recipe in ("fp8_blockwise", "bf16"):
        for activation in ("swiglu", "relu"):
            glu = activation == "swiglu"
            y, dx = mlp(xm, w1g if glu else w1, w2, b1g if glu else b1, b2, p, m, dym, recipe, activation)
            assert (y[cov:] == 0).all() and (dx[cov:] == 0).all(), (name, recipe, activation)
    torch.cuda.synchronize()
print(f"invalid m_splits: {stats['cases']} runs")

# ------------------------------------------------------------------------- T = 0 with garbage counts
for recipe in ("fp8_blockwise", "bf16"):
    m = torch.tensor([5, -3, I64_MAX, 7], device=DEV)
    linear(x[:0], w, b, m, dy[:0], recipe)
    mlp(xm[:0], w1g, w2, b1g, b2, p[:0], m, dym[:0], recipe, "swiglu")


# --------------------------------------------------------------------------------- misaligned inputs
def off(t, k=1):
    flat = torch.zeros(t.numel() + k + 5, dtype=t.dtype, device=t.device)
    v = flat[k:k + t.numel()].view(t.shape)
    v.copy_(t)
    return v


m_good = torch.tensor([100, 0, 150, 50], device=DEV)
for recipe in ("fp8_blockwise", "bf16"):
    buf = torch.full((3 + E * N * K + 5,), -1234.5, device=DEV)
    mg = buf[3:3 + E * N * K].view(E, N, K).zero_()
    linear(off(x), off(w, 3), off(b), off(m_good), off(dy), recipe, main_grad=mg)
    assert (buf[:3] == -1234.5).all() and (buf[3 + E * N * K:] == -1234.5).all()
    mlp(off(xm), off(w1g, 3), off(w2, 5), off(b1g), off(b2), off(p), m_good, off(dym), recipe, "swiglu")
    moegemm.quantize_act(off(x), m_good)
    moegemm.quantize_weight(off(w, 3))
torch.cuda.synchronize()

# -------------------------------------------------------------------------------------------- E = 1024
Em = 1024
counts = torch.zeros(Em, dtype=torch.int64)
counts[torch.randint(0, Em, (2000,))] += 1
xe = torch.randn(2000, 128, device=DEV, dtype=torch.bfloat16)
we = (torch.randn(Em, 128, 128, device=DEV) * 0.05).to(torch.bfloat16)
be = torch.randn(Em, 128, device=DEV, dtype=torch.bfloat16)
dye = torch.randn(2000, 128, device=DEV, dtype=torch.bfloat16)
for recipe in ("fp8_blockwise", "bf16"):
    linear(xe, we, be, counts.to(DEV), dye, recipe)
    linear(xe, we, be, torch.randint(I64_MIN, I64_MAX, (Em,), dtype=torch.int64).to(DEV), dye, recipe)
expect_error(lambda: moegemm.grouped_linear(xe, torch.zeros(1025, 128, 128, device=DEV, dtype=torch.bfloat16),
                                            torch.zeros(1025, dtype=torch.int64, device=DEV)), ValueError)
torch.cuda.synchronize()

# ------------------------------------------------------------------------------ raw op misuse (raises)
o = torch.ops.moegemm
plan = o.make_plan(m_good, T)
qx, sx, qxT, sxT = o.quantize_act(x, plan, True, True)
qw, sw, qwT, swT = o.quantize_weight(w)
h = torch.randn(T, 2 * F, device=DEV, dtype=torch.bfloat16)
misuse = [
    lambda: o.make_plan(torch.zeros(1025, dtype=torch.int64, device=DEV), 10),
    lambda: o.make_plan(torch.zeros(0, dtype=torch.int64, device=DEV), 0),
    lambda: o.make_plan(m_good, -1),
    lambda: o.make_plan(m_good, 2 ** 31),
    lambda: o.quantize_act(x, plan.long(), True, True),
    lambda: o.quantize_act(x, plan[:, :1].contiguous(), True, True),
    lambda: o.act_quantize(h, p, 5, plan, True, True),
    lambda: o.act_bf16(h, p, -1),
    lambda: o.act_quantize(h, p[:-1], 0, plan, True, True),
    lambda: o.gemm_fp8_ragged_rows(qx, sx, qw[:2], sw[:2], plan),
    lambda: o.gemm_fp8_ragged_rows(qx, sx[:-1], qw, sw, plan),
    lambda: o.gemm_fp8_ragged_reduction(qxT, sxT, qxT, sxT, plan, torch.float16),
    lambda: o.gemm_fp8_ragged_reduction_accumulate(qxT, sxT, qxT, sxT, plan, torch.zeros(E, K, K + 16, device=DEV)),
    lambda: o.gemm_fp8_ragged_reduction_accumulate(qxT, sxT, qxT, sxT, plan, torch.zeros(E, K, K, device=DEV, dtype=torch.bfloat16)),
    lambda: o.gemm_bf16_fprop(x, w[:2], plan),
    lambda: o.gemm_bf16_wgrad(dy, x[:-1], plan, torch.float32),
    lambda: o.gemm_bf16_wgrad_accumulate(dy, x, plan, torch.zeros(E, N, K - 16, device=DEV)),
]
for fn in misuse:
    expect_error(fn, (RuntimeError, NotImplementedError))
# misaligned raw-op arguments: raise, or run correctly (memcheck watches the latter)
for fn in [lambda: o.quantize_act(off(x), plan, True, True), lambda: o.quantize_weight(off(w, 3)),
           lambda: o.gemm_fp8_ragged_rows(off(qx), sx, qw, sw, plan), lambda: o.gemm_fp8_ragged_rows(qx, sx, off(qw), sw, plan),
           lambda: o.gemm_bf16_fprop(off(x), w, plan), lambda: o.gemm_bf16_fprop(x, off(w), plan),
           lambda: o.gemm_bf16_wgrad_accumulate(dy, x, plan, off(torch.zeros(E, N, K, device=DEV))),
           lambda: o.act_bf16(off(h), off(p), 0), lambda: o.act_quantize(off(h), p, 0, plan, True, True)]:
    try:
        fn()
        stats["cases"] += 1
    except RuntimeError as err:
        assert "aligned" in str(err), err
        stats["expected_errors"] += 1

# a plan made for more tokens than the inputs hold, and a forged plan: every plan-consuming kernel takes
# them as the plan of no tokens (zeros), never reading or writing past its buffers
big_plan = o.make_plan(m_good * 2, 2 * T)
forged = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, E + 1), dtype=torch.int32, device=DEV)
dyf = torch.randn(T, N, device=DEV, dtype=torch.bfloat16)
qdf, sdf, qdfT, sdfT = o.quantize_act(dyf, plan, True, True)
for foreign in (big_plan, forged):
    outs = [o.quantize_act(x, foreign, True, True)[0].view(torch.uint8), o.gemm_fp8_ragged_rows(qx, sx, qw, sw, foreign),
            o.gemm_fp8_ragged_reduction(qdfT, sdfT, qxT, sxT, foreign, torch.float32), o.gemm_bf16_fprop(x, w, foreign),
            o.gemm_bf16_wgrad(dyf, x, foreign, torch.float32), o.bias_grad(dyf, foreign),
            o.act_quantize(h, p, 0, foreign, True, True)[0].view(torch.uint8)]
    y0 = torch.zeros(T, N, device=DEV, dtype=torch.bfloat16)
    o.add_bias_(y0, torch.ones(E, N, device=DEV), foreign)
    outs.append(y0)
    assert all(int(t.count_nonzero()) == 0 for t in outs), "a foreign plan must give zeros"
    stats["cases"] += len(outs)

torch.cuda.synchronize()
print(f"sanitize adversarial: {stats['cases']} runs, {stats['expected_errors']} expected errors raised, "
      f"CUDA context alive: {(torch.ones(4, device=DEV) * 2).sum().item() == 8.0}")
