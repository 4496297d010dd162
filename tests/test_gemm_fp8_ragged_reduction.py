"""The FP8 ragged-reduction GEMM (wgrad) on each of its kernels against the reference, on a Hopper GPU.

kernel=1 is CUTLASS's ptr-array kernel, kernel=2 moegemm's own persistent sm90 kernel
(csrc/kernels/gemm/sm90/fp8_ragged_reduction.cuh) in each of its tilings (heuristics.h: BLOCK_N 128, 256 and 160),
each with every output kind.
Each case draws fresh operands, fills the column copies' unspecified bytes (each expert's padding and
everything past the last expert) with garbage that includes NaN codes, poisons the output's memory for the
written outputs, and checks ‖out − ref‖/‖ref‖ against the float64 reference on the same quantized operands
for the three outputs (fp32 written, fp32 added to an existing gradient, bf16 written), exact zeros (or the
untouched gradient) for empty experts, and bitwise equality of two runs."""

from __future__ import annotations

import zlib

import pytest
import torch

from moegemm import reference as ref
from moegemm.layout import COL_ALIGN, GEMM_CUTLASS, GEMM_SM90, SM90_RAGGED_REDUCTION_TILINGS

from conftest import GEMM_EDGE_SPLITS, HAS_HOPPER, poisoned, rel, requires_cuda, zipf_splits

pytestmark = requires_cuda

if HAS_HOPPER:
    from moegemm.backends import cuda as cuda_ops

DEV = "cuda"
# test id -> (kernel, tiling) of torch.ops.moegemm.gemm_fp8_ragged_reduction
KERNELS = {"cutlass": (GEMM_CUTLASS, -1), "sm90_default": (GEMM_SM90, -1),
           **{f"sm90_tiling{i}": (GEMM_SM90, i) for i in range(SM90_RAGGED_REDUCTION_TILINGS)}}
OUTS = ("f32", "f32_accumulate", "bf16")


def wgrad(qaT, saT, qbT, sbT, plan, kernel, out_kind, acc=None):
    if out_kind == "f32_accumulate":
        torch.ops.moegemm.gemm_fp8_ragged_reduction_accumulate(qaT, saT, qbT, sbT, plan, acc, *kernel)
        return acc
    dtype = torch.float32 if out_kind == "f32" else torch.bfloat16
    return torch.ops.moegemm.gemm_fp8_ragged_reduction(qaT, saT, qbT, sbT, plan, dtype, *kernel)


def garbage_outside_experts(qT, plan_ref, gen):
    """Random bytes (NaN codes 0x7f / 0xff among them) in every column of qT no expert owns."""
    owned = torch.zeros(qT.shape[1], dtype=torch.bool, device=DEV)
    tok, col = plan_ref[0].tolist(), plan_ref[1].tolist()
    for e in range(len(tok) - 1):
        owned[col[e]: col[e] + tok[e + 1] - tok[e]] = True
    noise = torch.randint(0, 256, qT.shape, dtype=torch.uint8, device=DEV, generator=gen)
    noise[:, ::7] = 0x7F
    raw = qT.view(torch.uint8)
    raw[:, ~owned] = noise[:, ~owned]


def column_operands(splits, N, K, gen):
    T = sum(splits)
    dy = torch.randn(T, N, device=DEV, generator=gen).to(torch.bfloat16)
    x = torch.randn(T, K, device=DEV, generator=gen).to(torch.bfloat16)
    m = torch.tensor(splits, dtype=torch.int64, device=DEV)
    plan, plan_ref = cuda_ops.make_plan(m, T), ref.make_plan(m, T)
    _, _, qaT, saT = cuda_ops.quantize_act(dy, plan, rows=False)
    _, _, qbT, sbT = cuda_ops.quantize_act(x, plan, rows=False)
    garbage_outside_experts(qaT, plan_ref, gen)
    garbage_outside_experts(qbT, plan_ref, gen)
    return (qaT, saT, qbT, sbT), plan, plan_ref


def check_against_reference(splits, N, K, kernel, seed):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    E = len(splits)
    ops, plan, plan_ref = column_operands(splits, N, K, gen)
    expect = ref.gemm_fp8_ragged_reduction(*ops, plan_ref, out_dtype=torch.float64)
    empty = [e for e, m in enumerate(splits) if m == 0]
    for out_kind in OUTS:
        acc0 = None
        if out_kind == "f32_accumulate":
            acc0 = torch.randn(E, N, K, device=DEV, generator=gen)
            out = wgrad(*ops, plan, kernel, out_kind, acc0.clone())
            got, want = out.double() - acc0.double(), expect
            assert torch.equal(out[empty], acc0[empty]), (out_kind, "empty experts' gradient changed")
        else:
            out = poisoned(lambda: wgrad(*ops, plan, kernel, out_kind), (E, N, K), torch.float32)
            got, want = out, expect
            assert torch.equal(out[empty], torch.zeros_like(out[empty])), (out_kind, "empty experts not zero")
        assert torch.isfinite(out).all(), (out_kind, splits[:8])
        tol = 4e-3 if out_kind == "bf16" else 2e-3
        assert rel(got, want) <= tol, (out_kind, splits[:8], rel(got, want))
        again = wgrad(*ops, plan, kernel, out_kind, None if acc0 is None else acc0.clone())
        assert torch.equal(out, again), (out_kind, "not bitwise repeatable")


def test_tiling_table_size():
    """SM90_RAGGED_REDUCTION_TILINGS is the size of heuristics.h's table: its last index runs, the next is refused."""
    gen = torch.Generator(device=DEV).manual_seed(1)
    ops, plan, _ = column_operands([30, 34], 128, 128, gen)
    wgrad(*ops, plan, (GEMM_SM90, SM90_RAGGED_REDUCTION_TILINGS - 1), "f32")
    with pytest.raises(RuntimeError, match="tiling must be"):
        wgrad(*ops, plan, (GEMM_SM90, SM90_RAGGED_REDUCTION_TILINGS), "f32")
    with pytest.raises(RuntimeError, match="pass it with kernel=2"):
        wgrad(*ops, plan, (GEMM_CUTLASS, 0), "bf16")


@pytest.mark.parametrize("kernel", KERNELS.values(), ids=KERNELS.keys())
@pytest.mark.parametrize("case", GEMM_EDGE_SPLITS.keys())
@pytest.mark.parametrize("N,K", [(128, 128), (256, 384), (400, 272), (1408, 2048)])
def test_edge_counts(case, N, K, kernel):
    check_against_reference(GEMM_EDGE_SPLITS[case], N, K, kernel, seed=zlib.crc32(f"{case} {N} {K}".encode()))


@pytest.mark.parametrize("kernel", KERNELS.values(), ids=KERNELS.keys())
@pytest.mark.parametrize("E,T,N,K", [(8, 4096, 1024, 512), (64, 6000, 512, 768), (1024, 5000, 128, 256), (3, 700, 7168, 256)])
def test_zipf(E, T, N, K, kernel):
    check_against_reference(zipf_splits(E, T), N, K, kernel, seed=E * 7 + K)


@pytest.mark.parametrize("kernel", KERNELS.values(), ids=KERNELS.keys())
def test_banded_tile_walk(kernel):
    """24 or more column tiles: the sm90 kernel walks an expert's tiles in bands of 16 row blocks (heuristics.h);
    here 17 row blocks, a whole band and a band of one."""
    check_against_reference(zipf_splits(5, 1500), 2176, 6144, kernel, seed=11)


@pytest.mark.parametrize("kernel", KERNELS.values(), ids=KERNELS.keys())
def test_foreign_plan_gives_no_tokens(kernel):
    """A plan made for more tokens than the column copy holds counts as no tokens: zeros written, an
    accumulated gradient left as it is."""
    gen = torch.Generator(device=DEV).manual_seed(4)
    ops, _, _ = column_operands([100, 60, 40], 256, 256, gen)
    big = cuda_ops.make_plan(torch.tensor([5000, 3000, 2000], device=DEV), 10000)
    out = wgrad(*ops, big, kernel, "f32")
    assert torch.equal(out, torch.zeros_like(out))
    acc = torch.randn(3, 256, 256, device=DEV, generator=gen)
    assert torch.equal(wgrad(*ops, big, kernel, "f32_accumulate", acc.clone()), acc)


@pytest.mark.parametrize("kernel", KERNELS.values(), ids=KERNELS.keys())
def test_graph_replay_with_new_splits(kernel):
    """Captured once in a CUDA graph (quantization and wgrad), replayed with other m_splits (no host sync)."""
    gen = torch.Generator(device=DEV).manual_seed(5)
    T, E, N, K = 3000, 16, 384, 512
    dy = torch.randn(T, N, device=DEV, generator=gen).to(torch.bfloat16)
    x = torch.randn(T, K, device=DEV, generator=gen).to(torch.bfloat16)
    m = torch.tensor(zipf_splits(E, T), dtype=torch.int64, device=DEV)
    acc = torch.zeros(E, N, K, device=DEV)

    def step():
        plan = cuda_ops.make_plan(m, T)
        _, _, qaT, saT = cuda_ops.quantize_act(dy, plan, rows=False)
        _, _, qbT, sbT = cuda_ops.quantize_act(x, plan, rows=False)
        acc.zero_()
        wgrad(qaT, saT, qbT, sbT, plan, kernel, "f32_accumulate", acc)
        return wgrad(qaT, saT, qbT, sbT, plan, kernel, "bf16")

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out16 = step()
    for _ in range(3):
        splits = zipf_splits(E, T)
        m.copy_(torch.tensor(splits, dtype=torch.int64))
        graph.replay()
        torch.cuda.synchronize()
        plan_ref = ref.make_plan(m, T)
        _, _, qaT, saT = ref.quantize_act(dy, plan_ref, rows=False)
        _, _, qbT, sbT = ref.quantize_act(x, plan_ref, rows=False)
        expect = ref.gemm_fp8_ragged_reduction(qaT, saT, qbT, sbT, plan_ref, out_dtype=torch.float64)
        assert rel(acc, expect) <= 2e-3, splits[:4]
        assert rel(out16, expect) <= 4e-3, splits[:4]


@pytest.mark.parametrize("kernel", KERNELS.values(), ids=KERNELS.keys())
def test_past_int32_elements(kernel):
    """K * cols > 2^31: the last expert's tokens of qbT lie past 2^31 bytes."""
    K, N = 8192, 128
    T = (1 << 31) // K + 300
    gen = torch.Generator(device=DEV).manual_seed(3)
    splits = [100, T - 400, 300]
    m = torch.tensor(splits, device=DEV)
    plan, plan_ref = cuda_ops.make_plan(m, T), ref.make_plan(m, T)
    cols, blocks = int(plan_ref[1, -1]), int(plan_ref[2, -1])
    cols = -(-cols // COL_ALIGN) * COL_ALIGN

    def random_fp8(rows):  # e4m3 bytes without NaN codes: magnitude codes 0..0x7e, either sign
        return (torch.randint(0, 0x7F, (rows, cols), device=DEV, dtype=torch.uint8, generator=gen)
                | (torch.randint(0, 2, (rows, cols), device=DEV, dtype=torch.uint8, generator=gen) << 7)).view(torch.float8_e4m3fn)

    qaT, qbT = random_fp8(N), random_fp8(K)
    saT = torch.rand(blocks, N, device=DEV, generator=gen) * 1e-2
    sbT = torch.rand(blocks, K, device=DEV, generator=gen) * 1e-2
    out = wgrad(qaT, saT, qbT, sbT, plan, kernel, "f32")
    c0, b0 = int(plan_ref[1, 2]), int(plan_ref[2, 2])
    a = qaT[:, c0: c0 + 300].double() * saT[b0: b0 + 3].double().repeat_interleave(128, dim=0)[:300].t()
    b = qbT[:, c0: c0 + 300].double() * sbT[b0: b0 + 3].double().repeat_interleave(128, dim=0)[:300].t()
    assert rel(out[2], a @ b.t()) <= 2e-3
