"""Reference GEMMs (moegemm.reference) against an independent float64 per-expert loop over torch.split."""

from __future__ import annotations

import math
import random

import pytest
import torch

from moegemm import reference as R

from conftest import zipf_splits

SPLITS = {
    "odd": [1, 17, 129, 0, 256, 33],
    "zipf": None,
    "one_expert": [0, 0, 300, 0],
    "E1": [77],
    "T0": [0, 0, 0],
}
SHAPES = [(144, 160), (256, 128)]  # (K, N)


def get_splits(name):
    s = SPLITS[name]
    return zipf_splits(8, 600) if s is None else list(s)


# --------------------------------------------------------------------------------------- float64 oracles
def loop_ragged_rows(a: torch.Tensor, b: torch.Tensor, splits) -> torch.Tensor:
    """out[t] = a[t] @ b[e(t)]^T, float64, by torch.split."""
    a, b = a.double(), b.double()
    parts = [a_e @ b[e].t() for e, a_e in enumerate(torch.split(a, splits))]
    return torch.cat(parts) if parts else a.new_zeros(0, b.shape[1])


def loop_ragged_reduction(a: torch.Tensor, b: torch.Tensor, splits) -> torch.Tensor:
    """out[e] = a_e^T @ b_e, float64."""
    a, b = a.double(), b.double()
    return torch.stack([a_e.t() @ b_e for a_e, b_e in zip(torch.split(a, splits), torch.split(b, splits))])


def assert_rounded_close(out: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    """Elementwise |out - ref| <= rel |ref| + rel * max|ref| * 1e-3 (one final rounding to out's dtype)."""
    assert out.shape == ref.shape
    out, ref = out.double(), ref.double()
    scale = ref.abs().max().item() if ref.numel() else 0.0
    err = (out - ref).abs()
    bound = rel * ref.abs() + rel * 1e-3 * scale + 1e-300
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"


RTOL = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -23, torch.float64: 1e-12}


def make_plan(splits):
    return R.make_plan(torch.tensor(splits, dtype=torch.int64), sum(splits))


# ------------------------------------------------------------------------------------------------- FP8
@pytest.mark.parametrize("name", list(SPLITS))
@pytest.mark.parametrize("K,N", SHAPES)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_fp8_fprop(name, K, N, out_dtype):
    splits = get_splits(name)
    E, T = len(splits), sum(splits)
    x = torch.randn(T, K, dtype=torch.bfloat16)
    w = torch.randn(E, N, K, dtype=torch.bfloat16) * 0.05
    plan = make_plan(splits)
    qx, sx = R.quantize_rows(x)
    qw, sw, _, _ = R.quantize_weight(w)
    out = R.gemm_fp8_ragged_rows(qx, sx, qw, sw, plan, out_dtype)
    assert out.dtype == out_dtype and out.shape == (T, N)
    ref = loop_ragged_rows(R.dequantize_rows(qx, sx), R.dequantize_weight(qw, sw), splits)
    assert_rounded_close(out, ref, RTOL[out_dtype])


def test_fp8_fprop_matches_block_formula():
    """docs/design.md#fp8-recipe: y[t,n] = Σ_j sx[t,j] sw[e,n/128,j] Σ_{k in block j} qx[t,k] qw[e,n,k]."""
    splits = [70, 0, 190]
    E, T, K, N = 3, 260, 272, 144
    x = torch.randn(T, K) * torch.pow(10.0, torch.empty(T, 1).uniform_(-2, 2))
    w = torch.randn(E, N, K)
    plan = make_plan(splits)
    qx, sx = R.quantize_rows(x)
    qw, sw, _, _ = R.quantize_weight(w)
    out = R.gemm_fp8_ragged_rows(qx, sx, qw, sw, plan, torch.float64)
    kb = math.ceil(K / 128)
    ref = torch.zeros(T, N, dtype=torch.float64)
    e_of = torch.repeat_interleave(torch.arange(E), torch.tensor(splits))
    for j in range(kb):
        ks = slice(128 * j, 128 * (j + 1))
        partial = torch.einsum("tk,tnk->tn", qx[:, ks].double(), qw[e_of][:, :, ks].double())
        sw_tn = sw[e_of][:, :, j].double().repeat_interleave(128, 1)[:, :N]  # [T, N]
        ref += sx[:, j:j + 1].double() * sw_tn * partial
    assert_rounded_close(out, ref, 1e-12)


@pytest.mark.parametrize("name", list(SPLITS))
@pytest.mark.parametrize("K,N", SHAPES)
def test_fp8_dgrad(name, K, N):
    splits = get_splits(name)
    E, T = len(splits), sum(splits)
    dy = torch.randn(T, N, dtype=torch.bfloat16)
    w = torch.randn(E, N, K, dtype=torch.bfloat16)
    plan = make_plan(splits)
    qdy, sdy = R.quantize_rows(dy)
    qw, sw, qwT, swT = R.quantize_weight(w)
    dx = R.gemm_fp8_ragged_rows(qdy, sdy, qwT, swT, plan, torch.bfloat16)
    assert dx.dtype == torch.bfloat16 and dx.shape == (T, K)
    ref = loop_ragged_rows(R.dequantize_rows(qdy, sdy), R.dequantize_weight(qw, sw).transpose(1, 2), splits)
    assert_rounded_close(dx, ref, RTOL[torch.bfloat16])


@pytest.mark.parametrize("name", list(SPLITS))
@pytest.mark.parametrize("K,N", SHAPES)
def test_fp8_wgrad(name, K, N):
    splits = get_splits(name)
    E, T = len(splits), sum(splits)
    dy = torch.randn(T, N, dtype=torch.bfloat16)
    x = torch.randn(T, K, dtype=torch.bfloat16)
    plan = make_plan(splits)
    qdyT, sdyT = R.quantize_cols(dy, plan)
    qxT, sxT = R.quantize_cols(x, plan)
    dw = R.gemm_fp8_ragged_reduction(qdyT, sdyT, qxT, sxT, plan)
    assert dw.dtype == torch.float32 and dw.shape == (E, N, K)
    ref = loop_ragged_reduction(R.dequantize_cols(qdyT, sdyT, plan), R.dequantize_cols(qxT, sxT, plan), splits)
    assert_rounded_close(dw, ref, RTOL[torch.float32])
    for e, m in enumerate(splits):
        if m == 0:
            assert (dw[e] == 0).all()
    # out= accumulates (fp32 main_grad)
    out0 = torch.randn(E, N, K)
    out = out0.clone()
    res = R.gemm_fp8_ragged_reduction(qdyT, sdyT, qxT, sxT, plan, out=out)
    assert res is out
    assert torch.equal(out, out0 + dw)
    R.gemm_fp8_ragged_reduction(qdyT, sdyT, qxT, sxT, plan, out=out)
    assert torch.allclose(out, out0 + 2 * dw, rtol=1e-6, atol=1e-5)


def test_fp8_gemm_nonfinite_propagates():
    splits = [40, 0, 150, 60]
    E, T, K, N = 4, 250, 272, 144
    x = torch.randn(T, K, dtype=torch.bfloat16)
    w = torch.randn(E, N, K, dtype=torch.bfloat16)
    plan = make_plan(splits)
    tok = plan[0].tolist()
    # NaN in x row t (expert 2), block 1: the whole output row becomes non-finite
    t = tok[2] + 7
    x[t, 200] = float("nan")
    # Inf in expert 3's weight block (1, 0): its rows' columns 128..143 become non-finite
    w[3, 130, 3] = float("inf")
    qx, sx = R.quantize_rows(x)
    qw, sw, _, _ = R.quantize_weight(w)
    y = R.gemm_fp8_ragged_rows(qx, sx, qw, sw, plan, torch.bfloat16)
    assert not torch.isfinite(y[t]).any()
    assert not torch.isfinite(y[tok[3]:, 128:]).any()
    mask = torch.ones(T, N, dtype=torch.bool)
    mask[t] = False
    mask[tok[3]:, 128:] = False
    assert torch.isfinite(y[mask]).all()
    # wgrad: a NaN in x's column block of expert 2 poisons dW[2, :, k] only
    x2 = torch.randn(T, K, dtype=torch.bfloat16)
    x2[tok[2] + 130, 17] = float("nan")
    dy = torch.randn(T, N, dtype=torch.bfloat16)
    dw = R.gemm_fp8_ragged_reduction(*R.quantize_cols(dy, plan), *R.quantize_cols(x2, plan), plan)
    assert not torch.isfinite(dw[2, :, 17]).any()
    mask = torch.ones(E, N, K, dtype=torch.bool)
    mask[2, :, 17] = False
    assert torch.isfinite(dw[mask]).all()


# ------------------------------------------------------------------------------------------------- bf16
@pytest.mark.parametrize("name", list(SPLITS))
@pytest.mark.parametrize("K,N", SHAPES)
def test_bf16_gemms(name, K, N):
    splits = get_splits(name)
    E, T = len(splits), sum(splits)
    x = torch.randn(T, K, dtype=torch.bfloat16)
    dy = torch.randn(T, N, dtype=torch.bfloat16)
    w = torch.randn(E, N, K, dtype=torch.bfloat16)
    plan = make_plan(splits)

    y = R.gemm_bf16_fprop(x, w, plan)
    assert y.dtype == torch.bfloat16 and y.shape == (T, N)
    assert_rounded_close(y, loop_ragged_rows(x, w, splits), RTOL[torch.bfloat16])

    dx = R.gemm_bf16_dgrad(dy, w, plan)
    assert dx.dtype == torch.bfloat16 and dx.shape == (T, K)
    assert_rounded_close(dx, loop_ragged_rows(dy, w.transpose(1, 2), splits), RTOL[torch.bfloat16])

    dw = R.gemm_bf16_wgrad(dy, x, plan)
    assert dw.dtype == torch.float32 and dw.shape == (E, N, K)
    assert_rounded_close(dw, loop_ragged_reduction(dy, x, splits), RTOL[torch.float32])
    for e, m in enumerate(splits):
        if m == 0:
            assert (dw[e] == 0).all()

    out0 = torch.randn(E, N, K)
    out = out0.clone()
    assert R.gemm_bf16_wgrad(dy, x, plan, out=out) is out
    assert torch.equal(out, out0 + dw)


def test_bf16_gemm_fp32_inputs():
    splits = zipf_splits(5, 200)
    E, T, K, N = 5, 200, 48, 32
    x = torch.randn(T, K)
    w = torch.randn(E, N, K)
    plan = make_plan(splits)
    y = R.gemm_bf16_fprop(x, w, plan)
    assert y.dtype == torch.float32
    assert_rounded_close(y, loop_ragged_rows(x, w, splits), RTOL[torch.float32])


def test_bias_add_and_grad():
    """add_bias_ adds each expert's bias to its rows only; bias_grad sums them back; uncovered rows are left alone."""
    splits = [0, 3, 0, 2, 1]
    bias = torch.arange(5.0)[:, None].expand(5, 16).contiguous()
    y = R.add_bias_(torch.zeros(6, 16), bias, make_plan(splits))
    assert y[:, 0].tolist() == [1, 1, 1, 3, 3, 4]
    db = R.bias_grad(torch.ones(6, 16), make_plan(splits))
    assert db[:, 0].tolist() == [0, 3, 0, 2, 1]
    short = R.make_plan(torch.tensor([0, 3, 0, 1, 0]), 6)  # counts cover 4 of 6 tokens
    assert R.add_bias_(torch.zeros(6, 16), bias, short)[:, 0].tolist() == [1, 1, 1, 3, 0, 0]
    assert R.bias_grad(torch.ones(6, 16), short)[:, 0].tolist() == [0, 3, 0, 1, 0]
    splits = zipf_splits(random.randint(1, 20), random.randint(0, 500))
    dy = torch.randn(sum(splits), 32)
    ids = torch.repeat_interleave(torch.arange(len(splits)), torch.tensor(splits))
    expected = torch.zeros(len(splits), 32).index_add_(0, ids, dy)
    assert torch.allclose(R.bias_grad(dy, make_plan(splits)), expected, atol=1e-5)