"""Reference quantizers of docs/design.md#fp8-recipe (moegemm.reference), checked against independent computations:

* scales from ``math.frexp`` on the fp32 quotient ``fl32(amax / 448)``;
* FP8 E4M3 bytes from an independent round-to-nearest-even on the E4M3 grid in float64.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

import moegemm
from moegemm import reference as R
from moegemm.layout import COL_ALIGN

from conftest import zipf_splits

FP8 = torch.float8_e4m3fn


# ------------------------------------------------------------------------------------ independent oracles
def fl32_div448(amax: float) -> float:
    """fl32(amax / 448): IEEE single-precision division, correctly rounded."""
    return (torch.tensor([amax], dtype=torch.float32) / torch.tensor([448.0], dtype=torch.float32)).item()


def expected_scale(amax: float) -> float:
    """Smallest power of two >= fl32(amax / 448); 1 for amax == 0; inf for non-finite amax."""
    if not math.isfinite(amax):
        return math.inf
    if amax == 0:
        return 1.0
    r = fl32_div448(amax)
    m, e = math.frexp(r)  # r = m * 2**e, 0.5 <= m < 1
    if m == 0.5:
        e -= 1  # r is a power of two already
    return math.ldexp(1.0, e)


def e4m3_rne(y: torch.Tensor) -> torch.Tensor:
    """Round float64 values with |y| <= 448 to the E4M3 grid, nearest-even (independent of torch's cast)."""
    y = y.double()
    a = y.abs()
    _, e = torch.frexp(a)  # a = m * 2**e, m in [0.5, 1)
    exp = (e.long() - 1).clamp(min=-6)  # floor(log2 a), subnormals share the exponent -6
    spacing = torch.pow(2.0, (exp - 3).double())  # 3 mantissa bits
    return torch.sign(y) * torch.round(a / spacing) * spacing  # torch.round: half to even


def expected_scales(amax: torch.Tensor) -> torch.Tensor:
    flat = [expected_scale(v) for v in amax.float().flatten().tolist()]
    return torch.tensor(flat, dtype=torch.float32).view(amax.shape)


def check_bound(deq: torch.Tensor, v: torch.Tensor, s_full: torch.Tensor) -> None:
    """|q*s - v| <= 2^-4 |v| + s 2^-9 (half an E4M3 ulp relative, or the subnormal spacing)."""
    deq, v, s_full = deq.double(), v.double(), s_full.double()
    err = (deq - v).abs()
    bound = 2.0 ** -4 * v.abs() + s_full * 2.0 ** -9
    bad = err > bound
    assert not bad.any(), f"{int(bad.sum())} values off: max excess {(err - bound).max().item()}"


def is_pow2(s: torch.Tensor) -> bool:
    m, _ = torch.frexp(s)
    return bool((m == 0.5).all())


def wide_range_rows(T: int, K: int, dtype=torch.float32) -> torch.Tensor:
    """Gaussian rows with per-row magnitudes over many decades (and some very different blocks)."""
    mag = torch.pow(10.0, torch.empty(T, 1).uniform_(-6, 6))
    x = torch.randn(T, K) * mag
    return x.to(dtype)


def bytes_of(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


# ------------------------------------------------------------------------------------------ block_scale
def test_block_scale_hand_cases():
    amax = torch.tensor([448.0, 449.0, 0.0, 224.0, 1e-3, float("inf"), float("nan"), 896.0, 447.0])
    s = R.block_scale(amax)
    assert s.dtype == torch.float32
    r = fl32_div448(torch.tensor(1e-3, dtype=torch.float32).item())
    m, e = math.frexp(r)
    small = math.ldexp(1.0, e - 1 if m == 0.5 else e)
    assert small >= r and small / 2 < r
    expected = [1.0, 2.0, 1.0, 0.5, small, math.inf, math.inf, 2.0, 1.0]
    assert s.tolist() == expected


@pytest.mark.parametrize("k", list(range(-40, 41, 7)) + [-1, 0, 1])
def test_block_scale_exact_powers(k):
    amax = torch.tensor([448.0 * 2.0 ** k], dtype=torch.float32)
    assert R.block_scale(amax).item() == 2.0 ** k
    up = torch.nextafter(amax, torch.tensor([math.inf]))
    down = torch.nextafter(amax, torch.tensor([0.0]))
    assert R.block_scale(up).item() == 2.0 ** (k + 1)
    assert R.block_scale(down).item() == 2.0 ** k


def test_block_scale_negative_inf_is_inf():
    s = R.block_scale(torch.tensor([-math.inf, math.nan, math.inf]))
    assert torch.isinf(s).all() and (s > 0).all()


def test_block_scale_random_matches_independent():
    amax = torch.pow(2.0, torch.empty(2000).uniform_(-100, 100)).float()
    amax[:10] = torch.tensor([1.0, 448.0, 3.0e38, 1e-30, 0.5, 7.0, 1000.0, 0.0, 2.0 ** -120, 3.4e38])
    s = R.block_scale(amax)
    assert is_pow2(s[amax > 0])
    assert s.tolist() == expected_scales(amax).tolist()
    r = amax / 448.0
    pos = amax > 0
    assert (s[pos] >= r[pos]).all() and (s[pos] / 2 < r[pos]).all()
    assert ((amax / s) <= 448.0).all()


# -------------------------------------------------------------------------------------- quantize_rows
@pytest.mark.parametrize("K", [16, 128, 144, 272])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_rows_exact(K, dtype):
    T = 37
    x = wide_range_rows(T, K, dtype)
    q, s = R.quantize_rows(x)
    kb = math.ceil(K / 128)
    assert q.dtype == FP8 and q.shape == (T, K) and q.is_contiguous()
    assert s.dtype == torch.float32 and s.shape == (T, kb)
    assert is_pow2(s)
    xf = x.float()
    # scales: one per 1x128 block, the last one partial
    amax = torch.stack([xf[:, 128 * j: 128 * (j + 1)].abs().amax(1) for j in range(kb)], 1)
    assert torch.equal(s, expected_scales(amax))
    s_full = s.repeat_interleave(128, 1)[:, :K]
    scaled = xf.double() / s_full.double()
    assert (scaled.abs() <= 448.0).all()
    assert torch.equal(q.double(), e4m3_rne(scaled))
    check_bound(R.dequantize_rows(q, s), xf, s_full)


def test_quantize_rows_subnormal_scale_saturates():
    """amax < 448 * 2^-126: fl32(amax / 448) is subnormal and may round below amax / 448; the quotient
    then passes 448 and must saturate to ±448, never become NaN."""
    amax = 2.8222151071501816e-42  # fl32(amax / 448) = 2^-147 < amax / 448: amax / scale ~ 503
    x = torch.zeros(2, 128)
    x[0, :3] = torch.tensor([amax, -amax, amax / 4])
    q, s = R.quantize_rows(x)
    assert s[0, 0].item() == 2.0 ** -147 and torch.isfinite(q.float()).all()
    assert q[0, :3].float().tolist() == [448.0, -448.0, 128.0]


def test_quantize_rows_partial_block_isolated():
    x = torch.randn(4, 144)
    x[0, 130] = 1.0e6  # in the partial second block of row 0
    q, s = R.quantize_rows(x)
    assert s[0, 1].item() == expected_scale(1.0e6)
    assert s[0, 0].item() == expected_scale(x[0, :128].abs().max().item())
    assert s[0, 0].item() < 1.0


def test_quantize_rows_zero_blocks():
    x = torch.randn(5, 272)
    x[1] = 0
    x[3, 128:256] = 0
    x[4, 256:] = 0
    q, s = R.quantize_rows(x)
    assert s[1].tolist() == [1.0, 1.0, 1.0]
    assert s[3, 1].item() == 1.0 and s[4, 2].item() == 1.0
    assert (bytes_of(q[1]) == 0).all()
    assert (bytes_of(q[3, 128:256]) == 0).all() and (bytes_of(q[4, 256:]) == 0).all()
    assert (R.dequantize_rows(q, s)[1] == 0).all()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_quantize_rows_nonfinite_isolated(bad):
    T, K = 6, 272
    x = torch.randn(T, K, dtype=torch.bfloat16)
    r, c = random.randrange(T), random.randrange(K)
    j = c // 128
    xb = x.clone()
    xb[r, c] = bad
    q0, s0 = R.quantize_rows(x)
    q, s = R.quantize_rows(xb)
    deq = R.dequantize_rows(q, s)
    blk = slice(128 * j, min(128 * (j + 1), K))
    assert not torch.isfinite(deq[r, blk]).any()
    mask = torch.ones(T, K, dtype=torch.bool)
    mask[r, blk] = False
    assert torch.isfinite(deq[mask]).all()
    assert torch.equal(bytes_of(q)[mask], bytes_of(q0)[mask])
    smask = torch.ones_like(s0, dtype=torch.bool)
    smask[r, j] = False
    assert torch.equal(s[smask], s0[smask])


# --------------------------------------------------------------------------------------------- plan
def _cumsum0(v):
    out = [0]
    for a in v:
        out.append(out[-1] + a)
    return out


@pytest.mark.parametrize("splits", [[0], [5], [1, 17, 129, 0, 256, 16, 15], [0, 0, 300, 0], None])
def test_plan_layout_from_list(splits):
    if splits is None:
        splits = zipf_splits(9, 700)
    T = sum(splits)
    plan = moegemm.make_plan(splits, T)
    assert plan.dtype == torch.int32 and plan.shape == (3, len(splits) + 1)
    tok, col, blk = plan.tolist()
    assert tok == _cumsum0(splits)
    assert col == _cumsum0([COL_ALIGN * math.ceil(m / COL_ALIGN) for m in splits])
    assert blk == _cumsum0([math.ceil(m / 128) for m in splits])
    assert col[-1] <= R.col_capacity(T, len(splits))
    assert blk[-1] <= R.block_capacity(T, len(splits))
    # the reference plan from a tensor agrees with the public one
    for dt in (torch.int32, torch.int64):
        assert torch.equal(R.make_plan(torch.tensor(splits, dtype=dt), T), plan)


@pytest.mark.parametrize("dt", [torch.int32, torch.int64])
def test_plan_clamps_bad_device_counts(dt):
    # negatives are taken as 0, the running total is clamped to T
    plan = R.make_plan(torch.tensor([5, -3, 10, 7], dtype=dt), 12)
    A = COL_ALIGN
    assert plan.tolist() == [[0, 5, 5, 12, 12], [0, A, A, 2 * A, 2 * A], [0, 1, 1, 2, 2]]
    plan = R.make_plan(torch.tensor([-100, 1000], dtype=dt), 40)
    assert plan.tolist() == [[0, 0, 40], [0, 0, -(-40 // A) * A], [0, 0, 1]]
    # a sum below T is left as it is
    plan = R.make_plan(torch.tensor([3, 4], dtype=dt), 40)
    assert plan[0].tolist() == [0, 3, 7]


def test_plan_capacities_bound_worst_case():
    for _ in range(50):
        E = random.randint(1, 40)
        T = random.randint(0, 2000)
        splits = zipf_splits(E, T, empty=random.random() < 0.5)
        plan = R.make_plan(torch.tensor(splits), T)
        assert plan[1, -1].item() <= R.col_capacity(T, E)
        assert plan[2, -1].item() <= R.block_capacity(T, E)
        assert R.col_capacity(T, E) % COL_ALIGN == 0


# -------------------------------------------------------------------------------------- quantize_cols
@pytest.mark.parametrize("splits", [[1, 17, 129, 0, 256, 33], [0, 300, 0], [128], None])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_cols_exact(splits, dtype):
    if splits is None:
        splits = zipf_splits(7, 500)
    T, K, E = sum(splits), 144, len(splits)
    x = wide_range_rows(T, K, dtype)
    plan = R.make_plan(torch.tensor(splits), T)
    qT, sT = R.quantize_cols(x, plan)
    assert qT.dtype == FP8 and qT.shape == (K, R.col_capacity(T, E))
    assert sT.dtype == torch.float32 and sT.shape == (R.block_capacity(T, E), K)
    tok, col, blk = plan.tolist()
    xf = x.float()
    used_cols = torch.zeros(qT.shape[1], dtype=torch.bool)
    used_blks = torch.zeros(sT.shape[0], dtype=torch.bool)
    for e, m in enumerate(splits):
        for i in range(math.ceil(m / 128)):
            rows = xf[tok[e] + 128 * i: tok[e] + min(128 * (i + 1), m)]
            s = sT[blk[e] + i]
            assert torch.equal(s, expected_scales(rows.abs().amax(0)))
            assert is_pow2(s)
            c0 = col[e] + 128 * i
            q = qT[:, c0: c0 + rows.shape[0]].t()
            scaled = rows.double() / s.double()
            assert (scaled.abs() <= 448).all()
            assert torch.equal(q.double(), e4m3_rne(scaled))
            used_cols[c0: c0 + rows.shape[0]] = True
            used_blks[blk[e] + i] = True
    # padding columns and unused scale rows are zeros in the reference
    assert (bytes_of(qT)[:, ~used_cols] == 0).all()
    assert (sT[~used_blks] == 0).all()
    # round trip
    deq = R.dequantize_cols(qT, sT, plan)
    assert deq.shape == (T, K) and deq.dtype == torch.float64
    s_full = torch.zeros(T, K)
    for e, m in enumerate(splits):
        nb = math.ceil(m / 128)
        s_full[tok[e]: tok[e] + m] = sT[blk[e]: blk[e] + nb].repeat_interleave(128, 0)[:m]
    check_bound(deq, xf, s_full)


def test_quantize_cols_blocks_never_cross_experts():
    # expert 0 huge, expert 1 small: both live inside the first 128 rows of x
    splits = [100, 50, 0, 20]
    T, K = sum(splits), 32
    x = torch.randn(T, K)
    x[:100] *= 1.0e4
    x[100:150] *= 1.0e-2
    x[150:] *= 1.0e2
    plan = R.make_plan(torch.tensor(splits), T)
    qT, sT = R.quantize_cols(x, plan)
    tok, col, blk = plan.tolist()
    s1 = sT[blk[1]]
    assert torch.equal(s1, expected_scales(x[100:150].abs().amax(0)))
    assert (s1 < 1e-3).all()
    assert (sT[blk[0]] > 1.0).all()
    assert torch.equal(sT[blk[3]], expected_scales(x[150:].abs().amax(0)))
    deq = R.dequantize_cols(qT, sT, plan)
    rel = ((deq[100:150] - x[100:150].double()).norm() / x[100:150].double().norm()).item()
    assert rel < 0.06


def test_quantize_cols_zero_blocks():
    splits = [40, 130, 0]
    T, K = sum(splits), 48
    x = torch.randn(T, K)
    x[:40] = 0
    x[40:168, 16:32] = 0  # first column block of expert 1, columns 16..31
    plan = R.make_plan(torch.tensor(splits), T)
    qT, sT = R.quantize_cols(x, plan)
    tok, col, blk = plan.tolist()
    assert (sT[blk[0]] == 1).all()
    assert (bytes_of(qT[:, col[0]: col[0] + 40]) == 0).all()
    assert (sT[blk[1], 16:32] == 1).all()
    assert (bytes_of(qT[16:32, col[1]: col[1] + 128]) == 0).all()


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_quantize_cols_nonfinite_isolated(bad):
    splits = [30, 200, 0, 60]
    T, K = sum(splits), 32
    x = torch.randn(T, K, dtype=torch.bfloat16)
    plan = R.make_plan(torch.tensor(splits), T)
    tok = plan[0].tolist()
    # a bad value in expert 1's second 128-row block (rows 158..229), column 5
    r, c = tok[1] + 128 + random.randrange(72), 5
    xb = x.clone()
    xb[r, c] = bad
    deq0 = R.dequantize_cols(*R.quantize_cols(x, plan), plan)
    deq = R.dequantize_cols(*R.quantize_cols(xb, plan), plan)
    rows = slice(tok[1] + 128, tok[2])
    assert not torch.isfinite(deq[rows, c]).any()
    mask = torch.ones(T, K, dtype=torch.bool)
    mask[rows, c] = False
    assert torch.isfinite(deq[mask]).all()
    assert torch.equal(deq[mask], deq0[mask])


def test_quantize_act_public_matches_reference():
    splits = zipf_splits(5, 300)
    x = torch.randn(300, 160, dtype=torch.bfloat16)
    plan = R.make_plan(torch.tensor(splits), 300)
    q, s, qT, sT = moegemm.quantize_act(x, splits)
    q0, s0 = R.quantize_rows(x)
    qT0, sT0 = R.quantize_cols(x, plan)
    assert torch.equal(bytes_of(q), bytes_of(q0)) and torch.equal(s, s0)
    assert torch.equal(bytes_of(qT), bytes_of(qT0)) and torch.equal(sT, sT0)
    q, s, qT, sT = moegemm.quantize_act(x, torch.tensor(splits), rows=False)
    assert q is None and s is None and torch.equal(sT, sT0)
    q, s, qT, sT = moegemm.quantize_act(x, splits, cols=False)
    assert qT is None and sT is None and torch.equal(s, s0)


# ------------------------------------------------------------------------------------- quantize_weight
@pytest.mark.parametrize("N,K", [(144, 272), (128, 128), (16, 48), (256, 160)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_weight_exact(N, K, dtype):
    E = 3
    w = torch.randn(E, N, K) * torch.pow(10.0, torch.empty(E, 1, 1).uniform_(-4, 4))
    w = w.to(dtype)
    q, s, qT, sT = R.quantize_weight(w)
    nb, kb = math.ceil(N / 128), math.ceil(K / 128)
    assert q.shape == (E, N, K) and qT.shape == (E, K, N) and q.dtype == qT.dtype == FP8
    assert s.shape == (E, nb, kb) and sT.shape == (E, kb, nb) and s.dtype == sT.dtype == torch.float32
    assert q.is_contiguous() and qT.is_contiguous() and sT.is_contiguous()
    assert torch.equal(bytes_of(qT), bytes_of(q).transpose(1, 2))
    assert torch.equal(sT, s.transpose(1, 2))
    assert is_pow2(s)
    wf = w.float()
    amax = torch.empty(E, nb, kb)
    for a in range(nb):
        for b in range(kb):
            amax[:, a, b] = wf[:, 128 * a: 128 * (a + 1), 128 * b: 128 * (b + 1)].abs().amax((1, 2))
    assert torch.equal(s, expected_scales(amax))
    s_full = s.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :N, :K]
    scaled = wf.double() / s_full.double()
    assert (scaled.abs() <= 448).all()
    assert torch.equal(q.double(), e4m3_rne(scaled))
    deq = R.dequantize_weight(q, s)
    check_bound(deq, wf, s_full)
    assert torch.equal(R.dequantize_weight(qT, sT), deq.transpose(1, 2))


def test_quantize_weight_public_matches_reference():
    w = torch.randn(2, 144, 160, dtype=torch.bfloat16)
    for a, b in zip(moegemm.quantize_weight(w), R.quantize_weight(w)):
        assert a.dtype == b.dtype
        assert torch.equal(a.view(torch.uint8) if a.dtype == FP8 else a, b.view(torch.uint8) if b.dtype == FP8 else b)


def test_quantize_weight_zero_and_nonfinite_blocks():
    E, N, K = 2, 256, 272
    w = torch.randn(E, N, K)
    w[0, :128, 128:256] = 0
    w[1, 130, 260] = math.nan
    w[1, 5, 5] = math.inf
    q, s, qT, sT = R.quantize_weight(w)
    assert s[0, 0, 1].item() == 1.0 and (bytes_of(q[0, :128, 128:256]) == 0).all()
    assert math.isinf(s[1, 1, 2].item()) and math.isinf(s[1, 0, 0].item())
    deq = R.dequantize_weight(q, s)
    assert not torch.isfinite(deq[1, 128:256, 256:]).any()
    assert not torch.isfinite(deq[1, :128, :128]).any()
    mask = torch.ones(E, N, K, dtype=torch.bool)
    mask[1, 128:256, 256:] = False
    mask[1, :128, :128] = False
    assert torch.isfinite(deq[mask]).all()
    w_clean = w.clone()
    w_clean[1, 130, 260] = 0
    w_clean[1, 5, 5] = 0
    deq0 = R.dequantize_weight(*R.quantize_weight(w_clean)[:2])
    assert torch.equal(deq[mask], deq0[mask])


def test_quantize_weights_into_is_the_quantization_of_the_concatenation():
    """The reference quantize_weights_into: each weight's parts quantized as their concatenation along dim 1 into the
    given copies; a part before a weight's last must be whole 128-row blocks, and the counts must fit."""
    torch.manual_seed(0)
    w1, w3 = torch.randn(3, 128, 192), torch.randn(3, 80, 192)
    w2 = torch.randn(3, 192, 208)
    out = [torch.empty_like(t) for t in R.quantize_weight(torch.cat([w1, w3], 1)) + R.quantize_weight(w2)]
    R.quantize_weights_into([w1, w3, w2], [2, 1], out)
    want = R.quantize_weight(torch.cat([w1, w3], 1)) + R.quantize_weight(w2)
    for got, w in zip(out, want):
        assert torch.equal(got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
                           w.view(torch.uint8) if w.dtype == torch.float8_e4m3fn else w)
    with pytest.raises(ValueError, match=r"parts\[0\] has 80 rows"):
        R.quantize_weights_into([w3, w1], [2], out[:4])
    with pytest.raises(ValueError, match="disagree"):
        R.quantize_weights_into([w1, w3, w2], [2], out)
    with pytest.raises(ValueError, match=r"out\[0\] must be torch.float8_e4m3fn"):
        R.quantize_weights_into([w1, w3], [2], [out[0].float()] + out[1:4])
