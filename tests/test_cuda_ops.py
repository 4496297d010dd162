"""The CUDA path against the reference (docs/design.md#reference), on a Hopper GPU; skipped elsewhere.

Quantizers: bitwise. GEMMs: ‖out − ref‖/‖ref‖ ≤ 2e-3 from the same quantized operands. Plus no host
sync, CUDA-graph replay with new m_splits, launch count independent of E, determinism."""

from __future__ import annotations

import pytest
import torch

import moegemm
from moegemm import reference as ref
from moegemm.layout import COL_ALIGN

from conftest import HAS_HOPPER, capture_step, cuda_kernels, rel, requires_cuda, zipf_splits

pytestmark = requires_cuda

if HAS_HOPPER:
    from moegemm.backends import cuda as cuda_ops

DEV = "cuda"


def device_plan(splits, T):
    m = torch.tensor(splits, dtype=torch.int64, device=DEV)
    return cuda_ops.make_plan(m, T), ref.make_plan(m, T)


def split_cases():
    yield "zipf", lambda E, T: zipf_splits(E, T)
    yield "one_expert", lambda E, T: [0] * (E - 1) + [T]
    yield "odd", lambda E, T: [T // E + (1 if e < T % E else 0) for e in range(E)]


# ------------------------------------------------------------------------------------------------ plan
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_plan_matches_reference(dtype):
    for E, T in [(1, 0), (1, 77), (8, 1000), (256, 5000), (1024, 3000)]:
        m = torch.tensor(zipf_splits(E, T), dtype=dtype, device=DEV)
        assert torch.equal(cuda_ops.make_plan(m, T).cpu(), ref.make_plan(m, T).cpu())


def test_plan_clamps_bad_counts():
    m = torch.tensor([5, -3, 100, 7], device=DEV)
    assert torch.equal(cuda_ops.make_plan(m, 50).cpu(), ref.make_plan(m, 50).cpu())
    plan = cuda_ops.make_plan(m, 50).cpu()
    assert plan[0, -1] == 50 and (plan[0, 1:] >= plan[0, :-1]).all()


def plan_cases(dtype):
    yield 1, 77, [77]
    yield 4, 50, [5, -3, 100, 7]  # a negative count, one past T, the total past T
    yield 3, 40, [2 ** 31 - 1, 5, 5] if dtype == torch.int32 else [2 ** 40, -2 ** 40, 5]
    for E, T in [(8, 1000), (256, 5000), (1024, 3000)]:
        yield E, T, zipf_splits(E, T)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("first", ["weights", "x", "fp8_x"])
def test_plan_built_inside_the_first_quantizer_matches_make_plan(dtype, first):
    """A forward builds the plan inside its first quantizer's launch: the weights' (one more CTA) when it
    quantizes them, else x's (each CTA deriving it, CTA 0 writing it; an FP8 x: make_plan's kernel, in the
    launch of requantize_cols with nothing to requantize). Always make_plan's plan, bad counts and T = 0 included, and y as from that plan."""
    from moegemm.layout import ACTIVATIONS, FP8_BLOCKWISE
    K, N = 128, 256
    for E, T, counts in [*plan_cases(dtype), (5, 0, [0, 3, -1, 0, 2])]:
        m = torch.tensor(counts, dtype=dtype, device=DEV)
        want = ref.make_plan(m.cpu(), T)
        x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16)
        w = (torch.randn(E, N, K, device=DEV) * 0.05).to(torch.bfloat16)
        w2 = (torch.randn(E, K, N // 2, device=DEV) * 0.05).to(torch.bfloat16)
        fp8_w, fp8_w2 = cuda_ops.quantize_weight(w), cuda_ops.quantize_weight(w2)
        given = [] if first == "weights" else [*fp8_w]
        plan_ref = cuda_ops.make_plan(m, T)
        q, s, _, _ = cuda_ops.quantize_act(x, plan_ref, True, False)
        if first == "fp8_x":
            y, plan, _ = cuda_ops.linear_fwd(q, w, m, None, FP8_BLOCKWISE, True, True, s, given)
        else:
            y, plan, _ = cuda_ops.linear_fwd(x, w, m, None, FP8_BLOCKWISE, True, True, None, given)
        assert torch.equal(plan.cpu(), want), (E, T)
        assert torch.equal(y, cuda_ops.gemm_fp8_ragged_rows(q, s, fp8_w[0], fp8_w[1], plan_ref)), (E, T)
        if first != "fp8_x":
            _, plan, _ = cuda_ops.mlp_fwd(x, w, w2, m, None, None, None, ACTIVATIONS["swiglu"], FP8_BLOCKWISE,
                                          given and [*fp8_w, *fp8_w2], True, True, True)
            assert torch.equal(plan.cpu(), want), (E, T)


@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                    (torch.bfloat16, torch.float32)])
def test_mlp_weights_quantized_in_the_call_as_quantize_weight(dtypes):
    """Both weights quantized in the forward's first launch (two when their dtypes differ): bitwise what
    quantize_weight makes of each, so the output equals the one from pre-quantized weights."""
    from moegemm.backends import contract
    from moegemm.layout import ACTIVATIONS, FP8_BLOCKWISE
    E, T, H, F = 8, 1000, 256, 384
    m = torch.tensor(zipf_splits(E, T), device=DEV)
    x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)
    w1 = (torch.randn(E, 2 * F, H, device=DEV) * 0.05).to(dtypes[0])
    w2 = (torch.randn(E, H, F, device=DEV) * 0.05).to(dtypes[1])
    act = ACTIVATIONS["swiglu"]
    y, _, saved = cuda_ops.mlp_fwd(x, w1, w2, m, None, None, None, act, FP8_BLOCKWISE, [], True, True, True)
    given = [*cuda_ops.quantize_weight(w1), *cuda_ops.quantize_weight(w2)]
    y_given, _, _ = cuda_ops.mlp_fwd(x, w1, w2, m, None, None, None, act, FP8_BLOCKWISE, given, True, True, True)
    assert torch.equal(y, y_given)
    names = [sl.name for sl in contract.MLP_FWD.saved[FP8_BLOCKWISE]]
    for name, want in [("qw1T", given[2]), ("sw1T", given[3]), ("qw2T", given[6]), ("sw2T", given[7])]:
        got = saved[names.index(name)]
        assert torch.equal(got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
                           want.view(torch.uint8) if want.dtype == torch.float8_e4m3fn else want), name


def test_quantize_weights_one_launch_per_layer():
    """quantize_weights (the FP8 weight cache's refresh): bitwise quantize_weight of each weight, two weights per
    launch when their dtypes agree (three weights: two launches), and a bad weight named by its index."""
    def as_bytes(t):
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t

    ws = [(torch.randn(8, 384, 256, device=DEV) * 0.05).to(torch.bfloat16),
          (torch.randn(8, 256, 192, device=DEV) * 0.05).to(torch.bfloat16),
          (torch.randn(3, 144, 1040, device=DEV) * 0.05).to(torch.float16)]
    for n, want_launches in [(1, 1), (2, 1), (3, 2)]:
        got, names = cuda_kernels(lambda: cuda_ops.quantize_weights(ws[:n]))
        assert len(names) == want_launches, names
        assert len(got) == n
        for w, copies in zip(ws, got):
            for a, b in zip(copies, cuda_ops.quantize_weight(w)):
                assert torch.equal(as_bytes(a), as_bytes(b))
    mixed = cuda_ops.quantize_weights([ws[0], ws[2]])  # dtypes differ: one launch each, same values
    for w, copies in zip([ws[0], ws[2]], mixed):
        assert all(torch.equal(as_bytes(a), as_bytes(b)) for a, b in zip(copies, cuda_ops.quantize_weight(w)))
    with pytest.raises(RuntimeError, match=r"weights\[1\]"):
        cuda_ops.quantize_weights([ws[0], ws[1][:, :, :100]])
    with pytest.raises(RuntimeError, match="weights"):
        cuda_ops.quantize_weights([])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_weights_into_parts(dtype):
    """quantize_weights_into: a weight given as parts (an expert MLP's gate and up projections, 256 + 144 rows, the
    second not whole 128-row blocks) is bitwise quantize_weight of their concatenation, written into the given
    copies; with a third weight (w2) one launch; the reference op gives the same bits; bad arguments named."""
    def as_bytes(t):
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t

    def copies_of(E, N, K):
        nb, kb = -(-N // 128), -(-K // 128)
        return [torch.full((E, N, K), 7, dtype=torch.uint8, device=DEV).view(torch.float8_e4m3fn),
                torch.full((E, nb, kb), -1.0, device=DEV), torch.full((E, K, N), 7, dtype=torch.uint8,
                                                                       device=DEV).view(torch.float8_e4m3fn),
                torch.full((E, kb, nb), -1.0, device=DEV)]

    E, K = 6, 320
    w1, w3 = (torch.randn(E, F, K, device=DEV, dtype=dtype) * 0.05 for F in (256, 144))
    w2 = torch.randn(E, K, 400, device=DEV, dtype=dtype) * 0.05
    out = copies_of(E, 400, K) + copies_of(E, K, 400)
    _, names = cuda_kernels(lambda: torch.ops.moegemm.quantize_weights_into([w1, w3, w2], [2, 1], out))
    assert len(names) == 1, names
    want = list(ref.quantize_weight(torch.cat([w1, w3], 1))) + list(ref.quantize_weight(w2))
    for got, w in zip(out, want):
        assert torch.equal(as_bytes(got), as_bytes(w.to(DEV)))
    ref_out = [torch.empty_like(t) for t in out]
    ref.quantize_weights_into([w1, w3, w2], [2, 1], ref_out)
    assert all(torch.equal(as_bytes(a), as_bytes(b)) for a, b in zip(out, ref_out))
    into = torch.ops.moegemm.quantize_weights_into
    with pytest.raises(RuntimeError, match=r"parts\[0\] has 144 rows"):
        into([w3, w1], [2], copies_of(E, 400, K))
    with pytest.raises(RuntimeError, match=r"out\[2\] must have shape"):
        into([w1, w3], [2], copies_of(E, 400, K)[:2] + copies_of(E, 401, K)[2:])
    with pytest.raises(RuntimeError, match="four tensors"):
        into([w1, w3], [2], out)
    with pytest.raises(RuntimeError, match=r"parts\[1\]"):
        into([w1, w3[:, :, :160].contiguous()], [2], copies_of(E, 400, K))
    # four parts: two launches (three at most per launch); a part of another dtype: a launch of its own
    w4 = torch.randn(E, 128, K, device=DEV, dtype=dtype) * 0.05
    out = copies_of(E, 400, K) + copies_of(E, K, 400) + copies_of(E, 128, K)
    _, names = cuda_kernels(lambda: into([w1, w3, w2, w4], [2, 1, 1], out))
    assert len(names) == 2, names
    want = want + list(ref.quantize_weight(w4))
    for got, w in zip(out, want):
        assert torch.equal(as_bytes(got), as_bytes(w.to(DEV)))
    w2h = w2.half()
    out = copies_of(E, 400, K) + copies_of(E, K, 400)
    _, names = cuda_kernels(lambda: into([w1, w3, w2h], [2, 1], out))
    assert len(names) == 2, names
    for got, w in zip(out, list(ref.quantize_weight(torch.cat([w1, w3], 1))) + list(ref.quantize_weight(w2h))):
        assert torch.equal(as_bytes(got), as_bytes(w.to(DEV)))


# ------------------------------------------------------------------------------------------ quantizers
def assert_cols_equal(a, b, plan, T):
    """Compare transposed copies on the experts' padded columns and their scale-block rows."""
    qT_a, sT_a = a
    qT_b, sT_b = b
    for start, m, col, blk in ref._segments(plan):
        w = -(-m // COL_ALIGN) * COL_ALIGN
        nblk = -(-m // 128)
        assert torch.equal(qT_a[:, col: col + w].view(torch.uint8), qT_b[:, col: col + w].view(torch.uint8))
        assert torch.equal(sT_a[blk: blk + nblk], sT_b[blk: blk + nblk])


@pytest.mark.parametrize("K", [128, 144, 1408, 2048])
@pytest.mark.parametrize("E", [1, 8, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_act_bitwise(K, E, dtype):
    for name, make in split_cases():
        T = int(torch.randint(1, 3000, ()).item())
        splits = make(E, T)
        x = (torch.randn(T, K, device=DEV) * torch.rand(T, 1, device=DEV) * 10).to(dtype)
        plan, plan_ref = device_plan(splits, T)
        q, s, qT, sT = cuda_ops.quantize_act(x, plan, True, True)
        rq, rs, rqT, rsT = ref.quantize_act(x, plan_ref, True, True)
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)), name
        assert torch.equal(s, rs), name
        assert_cols_equal((qT, sT), (rqT, rsT), plan_ref, T)
        # rows-only and cols-only give the same bytes
        q2, s2, none1, none2 = cuda_ops.quantize_act(x, plan, True, False)
        assert none1 is None and torch.equal(q2.view(torch.uint8), q.view(torch.uint8))
        n1, n2, qT2, sT2 = cuda_ops.quantize_act(x, plan, False, True)
        assert n1 is None
        assert_cols_equal((qT2, sT2), (rqT, rsT), plan_ref, T)


@pytest.mark.parametrize("K", [128, 144, 2048])
@pytest.mark.parametrize("E", [1, 8, 64])
def test_requantize_cols_bitwise(K, E):
    """The column copy of an FP8 row copy (rows over a wide range of magnitudes, subnormal scales included),
    from its scales in quantize_act's layout or in any strides: the reference's, bitwise."""
    for name, make in split_cases():
        T = int(torch.randint(1, 3000, ()).item())
        splits = make(E, T)
        mags = torch.pow(2.0, torch.randint(-140, 12, (T, 1), device=DEV).float())
        x = torch.randn(T, K, device=DEV) * mags
        plan, plan_ref = device_plan(splits, T)
        q, s, _, _ = cuda_ops.quantize_act(x, plan, True, False)
        expect = ref.requantize_cols(q, s, plan_ref)
        assert_cols_equal(cuda_ops.requantize_cols(q, s, plan), expect, plan_ref, T)
        assert_cols_equal(cuda_ops.requantize_cols(q, s.contiguous(), plan), expect, plan_ref, T)
    with pytest.raises(RuntimeError, match="x_scales"):
        cuda_ops.requantize_cols(q, torch.cat([s, s], 1), plan)  # twice the scale blocks
    with pytest.raises(RuntimeError, match="x given with x_scales must be float8_e4m3fn"):
        cuda_ops.requantize_cols(x, s, plan)


@pytest.mark.parametrize("low,spread", [(-7, 0), (-7, 14), (-7, 15), (-117, 14), (-118, 14), (104, 14), (105, 14),
                                        (13, 2), (16, 0)])
@pytest.mark.parametrize("specials", [False, True])
@pytest.mark.parametrize("K", [384, 272])
def test_requantize_cols_power_of_two_scales(low, spread, specials, K):
    """Row scales that are powers of two 2^low .. 2^(low + spread) per row: the kernel's f16 path where a tile's
    scales lie within 2^14 of each other and fp32's range (multicast/per_tile.cuh, Fp8Window), its fp32 path where they do
    not, near fp32's limits, with columns of zeros (their factor 2^eS, beyond f16 from 2^16) and of values far
    below the rest (beyond f16 too), subnormal FP8 bytes and, with specials, NaN and -0 bytes: the reference's
    bytes; K = 272 ends in a partial column block (16 columns)."""
    gen = torch.Generator(device=DEV).manual_seed(1000 * low + spread + specials + K)
    T, E = 1500, 5
    splits = zipf_splits(E, T)
    plan, plan_ref = device_plan(splits, T)
    byte = torch.randint(0, 0x7F, (T, K), device=DEV, generator=gen, dtype=torch.int32)  # finite magnitudes
    byte |= torch.randint(0, 2, (T, K), device=DEV, generator=gen, dtype=torch.int32) << 7
    byte[:, 5] = 0  # a column of zeros
    byte[: T // 2, 131] = torch.randint(1, 8, (T // 2,), device=DEV, generator=gen, dtype=torch.int32)  # subnormals
    byte[:, 260] &= 0x87  # a column of subnormals and zeros only (2^-6 of a tile's largest row scale and below)
    if specials:
        at = torch.randint(0, T * K, (T * K // 300,), device=DEV, generator=gen)
        byte.view(-1)[at] = torch.tensor([0x7F, 0xFF, 0x80], device=DEV, dtype=torch.int32)[at % 3]
    q = byte.to(torch.uint8).view(torch.float8_e4m3fn)
    e = low + torch.randint(0, spread + 1, (T, -(-K // 128)), device=DEV, generator=gen)
    s = torch.pow(2.0, e.double()).float()
    expect = ref.requantize_cols(q, s, plan_ref)
    assert_cols_equal(cuda_ops.requantize_cols(q, s, plan), expect, plan_ref, T)


@pytest.mark.parametrize("N,K", [(128, 128), (144, 272), (1408, 2048), (2048, 7168)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_weight_bitwise(N, K, dtype):
    E = 3
    w = (torch.randn(E, N, K, device=DEV) * torch.rand(E, N, 1, device=DEV)).to(dtype)
    for a, b in zip(cuda_ops.quantize_weight(w), ref.quantize_weight(w)):
        assert a.shape == b.shape
        assert torch.equal(a.view(torch.uint8) if a.dtype == ref.FP8 else a, b.view(torch.uint8) if b.dtype == ref.FP8 else b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_tiny_blocks_bitwise(dtype):
    """Blocks whose scale is a subnormal power of two (down to 2^-149) quantize exactly like the
    reference's division: every 128-row/128-column block gets its own magnitude from 2^-150 to 2^10
    (including blocks where fl32(amax / 448) rounds down and the quotient saturates at 448)."""
    T, K, E = 1024, 1024, 2
    mags = torch.pow(2.0, torch.linspace(-150, 10, 8 * 8, device=DEV)).reshape(8, 8)
    x = torch.randn(T, K, device=DEV) * mags.repeat_interleave(128, 0).repeat_interleave(128, 1)
    x = x.to(dtype)
    plan, plan_ref = device_plan([300, T - 300], T)
    q, s, qT, sT = cuda_ops.quantize_act(x, plan, True, True)
    rq, rs, rqT, rsT = ref.quantize_act(x, plan_ref, True, True)
    assert (rs < 2.0 ** -126).any()  # subnormal scales are exercised
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    assert_cols_equal((qT, sT), (rqT, rsT), plan_ref, T)
    w = x.reshape(2, T // 2, K)
    for a, b in zip(cuda_ops.quantize_weight(w), ref.quantize_weight(w)):
        assert torch.equal(a.view(torch.uint8) if a.dtype == ref.FP8 else a, b.view(torch.uint8) if b.dtype == ref.FP8 else b)


def test_quantize_nonfinite_propagates():
    T, K, E = 300, 256, 2
    x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16)
    x[5, 7] = float("nan")
    x[200, 130] = float("inf")
    plan, plan_ref = device_plan([150, 150], T)
    q, s, qT, sT = cuda_ops.quantize_act(x, plan, True, True)
    rows = ref.dequantize_rows(q, s)
    assert not torch.isfinite(rows[5, :128]).any() and torch.isfinite(rows[5, 128:]).all()
    assert not torch.isfinite(rows[200, 128:]).any() and torch.isfinite(rows[200, :128]).all()
    cols = ref.dequantize_cols(qT, sT, plan_ref)
    assert not torch.isfinite(cols[:128, 7]).any() and torch.isfinite(cols[128:, 7]).all()
    assert not torch.isfinite(cols[150:278, 130]).any()


# ------------------------------------------------------------------------------------------------ GEMMs
SIZES = [(128, 1408), (2048, 128), (7168, 2048), (144, 400)]


@pytest.mark.parametrize("E", [1, 8, 64, 256])
@pytest.mark.parametrize("K,N", SIZES)
def test_fp8_gemms_match_reference(E, K, N):
    if E * N * K > 2 ** 28:
        pytest.skip("float64 reference weights would not fit")
    for name, make in split_cases():
        T = max(E * 24, 512) if K * N < 2 ** 24 else 1024
        splits = make(E, T)
        plan, plan_ref = device_plan(splits, T)
        x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16)
        dy = torch.randn(T, N, device=DEV, dtype=torch.bfloat16)
        w = torch.randn(E, N, K, device=DEV, dtype=torch.bfloat16) * 0.05
        qx, sx, qxT, sxT = cuda_ops.quantize_act(x, plan, True, True)
        qdy, sdy, qdyT, sdyT = cuda_ops.quantize_act(dy, plan, True, True)
        qw, sw, qwT, swT = cuda_ops.quantize_weight(w)
        y = cuda_ops.gemm_fp8_ragged_rows(qx, sx, qw, sw, plan)
        assert rel(y, ref.gemm_fp8_ragged_rows(qx, sx, qw, sw, plan_ref, torch.float64)) <= 2e-3, name
        dx = cuda_ops.gemm_fp8_ragged_rows(qdy, sdy, qwT, swT, plan)
        assert rel(dx, ref.gemm_fp8_ragged_rows(qdy, sdy, qwT, swT, plan_ref, torch.float64)) <= 2e-3, name
        dw_ref = ref.gemm_fp8_ragged_reduction(qdyT, sdyT, qxT, sxT, plan_ref)
        dw = cuda_ops.gemm_fp8_ragged_reduction(qdyT, sdyT, qxT, sxT, plan)
        assert rel(dw, dw_ref) <= 2e-3, name
        empty = [e for e, m in enumerate(splits) if m == 0]
        assert (dw[empty] == 0).all(), name
        dw16 = cuda_ops.gemm_fp8_ragged_reduction(qdyT, sdyT, qxT, sxT, plan, out_dtype=torch.bfloat16)
        assert dw16.dtype == torch.bfloat16 and rel(dw16, dw_ref) <= 5e-3 and (dw16[empty] == 0).all(), name
        acc = torch.randn_like(dw)
        acc0 = acc.clone()
        cuda_ops.gemm_fp8_ragged_reduction(qdyT, sdyT, qxT, sxT, plan, out=acc)
        assert rel(acc - acc0, dw_ref) <= 2e-3 and torch.equal(acc[empty], acc0[empty]), name


@pytest.mark.parametrize("E", [1, 8, 64, 256])
@pytest.mark.parametrize("K,N", SIZES)
def test_bf16_gemms_match_reference(E, K, N):
    if E * N * K > 2 ** 28:
        pytest.skip("float64 reference weights would not fit")
    for name, make in split_cases():
        T = max(E * 24, 512) if K * N < 2 ** 24 else 1024
        splits = make(E, T)
        plan, plan_ref = device_plan(splits, T)
        x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16)
        dy = torch.randn(T, N, device=DEV, dtype=torch.bfloat16)
        w = torch.randn(E, N, K, device=DEV, dtype=torch.bfloat16) * 0.05
        assert rel(cuda_ops.gemm_bf16_fprop(x, w, plan), ref.gemm_bf16_fprop(x, w, plan_ref)) <= 2e-3 * 4, name
        assert rel(cuda_ops.gemm_bf16_dgrad(dy, w, plan), ref.gemm_bf16_dgrad(dy, w, plan_ref)) <= 2e-3 * 4, name
        dw_ref = ref.gemm_bf16_wgrad(dy, x, plan_ref)
        dw = cuda_ops.gemm_bf16_wgrad(dy, x, plan)
        assert rel(dw, dw_ref) <= 2e-3, name
        empty = [e for e, m in enumerate(splits) if m == 0]
        assert (dw[empty] == 0).all(), name
        dw16 = cuda_ops.gemm_bf16_wgrad(dy, x, plan, out_dtype=torch.bfloat16)
        assert dw16.dtype == torch.bfloat16 and rel(dw16, dw_ref) <= 5e-3 and (dw16[empty] == 0).all(), name
        acc = torch.randn_like(dw)
        acc0 = acc.clone()
        cuda_ops.gemm_bf16_wgrad(dy, x, plan, out=acc)
        assert rel(acc - acc0, dw_ref) <= 2e-3, name


@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N", [144, 400, 1408])
def test_fp8_forward_bias_added_in_the_gemm(bias_dtype, N, monkeypatch):
    """fp8_blockwise adds the bias in the GEMM's epilogue, to the fp32 result before its one rounding
    (docs/design.md), on each expert's rows and inside N only: against the reference backend, with a bias
    far larger than x·Wᵀ so that a bias on the wrong rows or columns shows; rows past the covered tokens
    stay zero. Partial tiles (1, 17, 129 rows), empty experts, N past a tile's width."""
    E, K, T = 6, 256, 480
    splits = [0, 1, 17, 129, 300, 0]  # 447 covered tokens
    gen = torch.Generator(device=DEV).manual_seed(7)
    x = torch.randn(T, K, device=DEV, generator=gen).to(torch.bfloat16)
    w = (torch.randn(E, N, K, device=DEV, generator=gen) * 0.05).to(torch.bfloat16)
    bias = (torch.randn(E, N, device=DEV, generator=gen) * 20).to(bias_dtype)
    m = torch.tensor(splits, device=DEV)
    got = moegemm.grouped_linear(x, w, m, bias)
    no_bias = moegemm.grouped_linear(x, w, m)
    monkeypatch.setattr(moegemm.backends, "FORCE_REFERENCE", True)
    expected = moegemm.grouped_linear(x, w, m, bias)
    covered = sum(splits)
    assert (got[covered:] == 0).all()
    assert rel(got[:covered], expected[:covered]) <= 2e-3
    got_bias, expected_bias = (y[:covered].float() - no_bias[:covered].float() for y in (got, expected))
    assert rel(got_bias, expected_bias) <= 2e-2


# ----------------------------------------------------------------------------------------- whole op
@pytest.mark.parametrize("recipe", ["fp8_blockwise", "bf16"])
def test_grouped_linear_cuda_matches_reference_backend(recipe, monkeypatch):
    E, T, K, N = 8, 1000, 256, 384
    splits = zipf_splits(E, T)
    x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(E, N, K, device=DEV) * 0.05).to(torch.bfloat16).requires_grad_()
    b = torch.randn(E, N, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(T, N, device=DEV, dtype=torch.bfloat16)
    m = torch.tensor(splits, device=DEV)

    def run():
        x.grad = w.grad = b.grad = None
        y = moegemm.grouped_linear(x, w, m, b, recipe=recipe)
        y.backward(dy)
        return y.detach(), x.grad, w.grad, b.grad

    got = run()
    monkeypatch.setattr(moegemm.backends, "FORCE_REFERENCE", True)  # MOEGEMM_BACKEND=reference, read at import
    expected = run()
    tol = 2e-3 if recipe == "fp8_blockwise" else 8e-3
    for g, e in zip(got, expected):
        assert rel(g, e) <= tol


def test_forwards_without_dgrad_match_training_forward():
    """Without dx (no grad at all, or only the weight's), the weights' transposed FP8 copies are not made:
    the outputs equal those of a forward that makes them, bitwise, and the weight gradient too."""
    E, T, H, F = 8, 1000, 256, 384
    m = torch.tensor(zipf_splits(E, T), device=DEV)
    x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)
    w1 = (torch.randn(E, 2 * F, H, device=DEV) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(E, H, F, device=DEV) * 0.05).to(torch.bfloat16)
    probs = torch.rand(T, device=DEV)
    dy = torch.randn(T, 2 * F, device=DEV, dtype=torch.bfloat16)

    xg, wg = x.clone().requires_grad_(), w1.clone().requires_grad_()
    y_train = moegemm.grouped_linear(xg, wg, m)
    y_train.backward(dy)
    mlp_train = moegemm.grouped_mlp(xg, wg, w2.clone().requires_grad_(), m, probs)
    with torch.no_grad():
        assert torch.equal(moegemm.grouped_linear(x, w1, m), y_train.detach())
        assert torch.equal(moegemm.grouped_mlp(x, w1, w2, m, probs), mlp_train.detach())
    w_only = w1.clone().requires_grad_()
    y = moegemm.grouped_linear(x, w_only, m)  # dw only: no dgrad, so no Wᵀ
    assert torch.equal(y.detach(), y_train.detach())
    y.backward(dy)
    assert torch.equal(w_only.grad, wg.grad)


def test_zero_tokens():
    w = torch.randn(4, 128, 256, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    x = torch.zeros(0, 256, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    for recipe in ["fp8_blockwise", "bf16"]:
        y = moegemm.grouped_linear(x, w, torch.zeros(4, dtype=torch.int64, device=DEV), recipe=recipe)
        assert y.shape == (0, 128)
        y.sum().backward()
        assert (w.grad == 0).all()
        w.grad = None


@pytest.mark.parametrize("recipe", ["fp8_blockwise", "bf16"])
def test_no_host_sync(recipe):
    E, T, K, N = 16, 2048, 512, 256
    x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(E, N, K, device=DEV) * 0.05).to(torch.bfloat16).requires_grad_()
    b = torch.zeros(E, N, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    m = torch.tensor(zipf_splits(E, T), device=DEV)
    moegemm.grouped_linear(x, w, m, b, recipe=recipe).sum().backward()  # build/warm up outside
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = moegemm.grouped_linear(x, w, m, b, recipe=recipe)
        y.backward(torch.ones_like(y))
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("recipe", ["fp8_blockwise", "bf16"])
def test_cuda_graph_replay_with_new_splits(recipe):
    E, T, K, N = 8, 1024, 256, 256
    x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(E, N, K, device=DEV) * 0.05).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(T, N, device=DEV, dtype=torch.bfloat16)
    m = torch.tensor(zipf_splits(E, T), device=DEV)

    def step():
        x.grad = w.grad = None
        y = moegemm.grouped_linear(x, w, m, recipe=recipe)
        y.backward(dy)
        return y, x.grad, w.grad

    g, (y_static, gx, gw) = capture_step(step)
    for _ in range(3):
        m.copy_(torch.tensor(zipf_splits(E, T), device=DEV))
        g.replay()
        torch.cuda.synchronize()
        y_eager = moegemm.grouped_linear(x.detach(), w.detach(), m, recipe=recipe)
        x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        moegemm.grouped_linear(x2, w2, m, recipe=recipe).backward(dy)
        assert torch.equal(y_static, y_eager)
        assert torch.equal(gx, x2.grad) and torch.equal(gw, w2.grad)


def count_kernels(E, recipe):
    T, K, N = 4096, 256, 256
    x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(E, N, K, device=DEV) * 0.05).to(torch.bfloat16).requires_grad_()
    m = torch.tensor(zipf_splits(E, T), device=DEV)
    return len(cuda_kernels(lambda: moegemm.grouped_linear(x, w, m, recipe=recipe).sum().backward())[1])


@pytest.mark.parametrize("recipe", ["fp8_blockwise", "bf16"])
def test_launch_count_independent_of_E(recipe):
    n8, n256 = count_kernels(8, recipe), count_kernels(256, recipe)
    print(f"kernel launches per forward+backward ({recipe}): E=8 -> {n8}, E=256 -> {n256}")
    assert n8 == n256 and n8 > 0


def mlp_kernels(fp8_weights=None):
    """The kernels of one expert MLP forward + backward (fp8_blockwise, SwiGLU x probs, no bias)."""
    from moegemm.layout import ACTIVATIONS, FP8_BLOCKWISE
    E, T, H, F = 8, 4096, 256, 256
    x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w1 = (torch.randn(E, 2 * F, H, device=DEV) * 0.05).to(torch.bfloat16).requires_grad_()
    w2 = (torch.randn(E, H, F, device=DEV) * 0.05).to(torch.bfloat16).requires_grad_()
    probs = torch.rand(T, device=DEV, requires_grad=True)
    m = torch.tensor(zipf_splits(E, T), device=DEV)
    dy = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)
    args = (x, w1, w2, m, None, None, probs, ACTIVATIONS["swiglu"], FP8_BLOCKWISE, fp8_weights or [])

    def step():
        for t in (x, w1, w2, probs):
            t.grad = None  # (no accumulation kernels)
        y = cuda_ops.grouped_mlp(*args)
        y.backward(dy)

    return cuda_kernels(step)[1]


@pytest.mark.parametrize("need_dw", [False, True])
def test_fc1_forward_launches(need_dw):
    """The launch bound: the fc1 forward with given FP8 weights is one kernel, with or without the weight gradient
    (the GEMM builds the plan and x's FP8 rows itself, the rows that backward makes wgrad's column copy from;
    tests/test_one_launch_forward.py)."""
    from moegemm.layout import FP8_BLOCKWISE
    E, T, K, N = 8, 4096, 256, 512
    x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16)
    w = (torch.randn(E, N, K, device=DEV) * 0.05).to(torch.bfloat16)
    m = torch.tensor(zipf_splits(E, T), device=DEV)
    given = [*cuda_ops.quantize_weight(w)]
    _, names = cuda_kernels(lambda: cuda_ops.linear_fwd(x, w, m, None, FP8_BLOCKWISE, True, need_dw, None, given))
    assert len(names) == 1 and "fp8_ragged_rows_kernel" in names[0], names


@pytest.mark.parametrize("cached", [False, True])
def test_mlp_step_launches(cached):
    """The launch bound: at most 12 GPU operations per expert MLP forward + backward, weights quantized in the call
    (the plan built in the weights' launch) or given (the plan built by x's quantizer); no memset among them (each
    wgrad GEMM's tile counter is zeroed by the quantizer launched before it, csrc/moegemm.h ZeroFill)."""
    given = None
    if cached:
        w1 = torch.randn(8, 512, 256, device=DEV, dtype=torch.bfloat16)
        w2 = torch.randn(8, 256, 256, device=DEV, dtype=torch.bfloat16)
        given = [*cuda_ops.quantize_weight(w1), *cuda_ops.quantize_weight(w2)]
    names = mlp_kernels(given)
    print(f"GPU operations per MLP forward + backward (weights {'given' if cached else 'quantized in the call'}): "
          f"{len(names)}: {names}")
    assert 0 < len(names) <= 12
    assert not [n for n in names if n.startswith("Memset")], names


def dirty_small_pool(blocks=4096):
    """Leaves freed blocks of the caching allocator's small pool (where a wgrad GEMM's 4-byte workspace comes from)
    holding nonzero words (0x7f7f7f7f)."""
    held = [torch.full((128,), 0x7F7F7F7F, dtype=torch.int32, device=DEV) for _ in range(blocks)]
    torch.cuda.synchronize()
    del held


@pytest.mark.parametrize("layer", ["linear", "mlp"])
@pytest.mark.parametrize("T", [0, 3000])
def test_wgrad_counter_zeroed_over_a_dirty_pool(layer, T):
    """Each fp8 wgrad GEMM's tile counter is zeroed in the launch of the quantizer before it (csrc/moegemm.h ZeroFill),
    or by a memset where that quantizer has nothing to do (T = 0): backward over a caching pool whose free small blocks
    hold nonzero words gives the same gradients, bitwise, as over a clean one (a counter left nonzero skips tiles)."""
    from moegemm.layout import ACTIVATIONS, FP8_BLOCKWISE
    E, H, F = 16, 256, 384
    x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w1 = (torch.randn(E, 2 * F, H, device=DEV) * 0.05).to(torch.bfloat16).requires_grad_()
    w2 = (torch.randn(E, H, F, device=DEV) * 0.05).to(torch.bfloat16).requires_grad_()
    m = torch.tensor(zipf_splits(E, T), device=DEV)
    dy = torch.randn(T, H if layer == "mlp" else 2 * F, device=DEV, dtype=torch.bfloat16)
    weights = [w1, w2] if layer == "mlp" else [w1]

    def step(dirty):
        for t in (x, *weights):
            t.grad = None
        torch.cuda.empty_cache()
        if dirty:
            dirty_small_pool()
        if layer == "mlp":
            y = cuda_ops.grouped_mlp(x, w1, w2, m, None, None, None, ACTIVATIONS["swiglu"], FP8_BLOCKWISE, [])
        else:
            y = moegemm.grouped_linear(x, w1, m, recipe="fp8_blockwise")
        if dirty:
            dirty_small_pool()
        y.backward(dy)
        return [x.grad.clone()] + [w.grad.clone() for w in weights]

    clean, dirty = step(False), step(True)
    for a, b in zip(clean, dirty):
        assert torch.equal(a, b)
    if T == 0:
        assert all(not w.any() for w in dirty[1:])  # every expert empty: zero weight gradients


@pytest.mark.parametrize("recipe", ["fp8_blockwise", "bf16"])
def test_deterministic(recipe):
    E, T, K, N = 32, 3000, 512, 384
    x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(E, N, K, device=DEV) * 0.05).to(torch.bfloat16).requires_grad_()
    m = torch.tensor(zipf_splits(E, T), device=DEV)
    dy = torch.randn(T, N, device=DEV, dtype=torch.bfloat16)
    outs = []
    for _ in range(2):
        x.grad = w.grad = None
        y = moegemm.grouped_linear(x, w, m, recipe=recipe)
        y.backward(dy)
        outs.append((y.detach().clone(), x.grad.clone(), w.grad.clone()))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
