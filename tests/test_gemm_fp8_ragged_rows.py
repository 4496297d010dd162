"""The FP8 ragged-row GEMM (fprop and dgrad) against the reference, on a Hopper GPU: moegemm's own persistent
sm90 kernel (csrc/kernels/gemm/sm90/) with the heuristic's tiling and in each of its tilings
(csrc/kernels/gemm/heuristics.h: BLOCK_N 128, 192 or 256, alone or in 2-CTA clusters).
Each case draws fresh operands, poisons the output's memory first, and checks ‖out − ref‖/‖ref‖ ≤ 4e-3
(the bf16 output's rounding alone is up to 2^-8 of each value: on one row of 128 values it passed 2e-3)
against the float64 reference on the same quantized operands, zeros on rows no expert covers, and bitwise
equality of two runs."""

from __future__ import annotations

import zlib

import pytest
import torch

from moegemm import reference as ref
from moegemm.layout import SM90_RAGGED_ROWS_TILINGS

from conftest import GEMM_EDGE_SPLITS, HAS_HOPPER, poisoned, rel, requires_cuda, zipf_splits

pytestmark = requires_cuda

if HAS_HOPPER:
    from moegemm.backends import cuda as cuda_ops

DEV = "cuda"
TOL = 4e-3  # relative to the float64 reference: the bf16 output's rounding and fp32 accumulation
# test id -> the tiling of torch.ops.moegemm.gemm_fp8_ragged_rows (-1: the heuristic's)
KERNELS = {"sm90_default": -1, **{f"sm90_tiling{i}": i for i in range(SM90_RAGGED_ROWS_TILINGS)}}


def operands(T, E, N, K, gen):
    x = torch.randn(T, K, device=DEV, generator=gen).to(torch.bfloat16)
    w = (torch.randn(E, N, K, device=DEV, generator=gen) * 0.05).to(torch.bfloat16)
    return x, w


def test_tiling_table_size():
    """SM90_RAGGED_ROWS_TILINGS is the size of heuristics.h's table: its last index runs, the next is refused."""
    x, w = operands(64, 2, 128, 128, torch.Generator(device=DEV).manual_seed(1))
    plan = cuda_ops.make_plan(torch.tensor([30, 34], device=DEV), 64)
    qx, sx, _, _ = cuda_ops.quantize_act(x, plan, cols=False)
    qw, sw, _, _ = cuda_ops.quantize_weight(w)
    run(qx, sx, qw, sw, plan, SM90_RAGGED_ROWS_TILINGS - 1)
    for bad in (SM90_RAGGED_ROWS_TILINGS, -2):
        with pytest.raises(RuntimeError, match="tiling must be"):
            run(qx, sx, qw, sw, plan, bad)


def run(qa, sa, qb, sb, plan, tiling):
    return torch.ops.moegemm.gemm_fp8_ragged_rows(qa, sa, qb, sb, plan, tiling)


def check_against_reference(splits, N, K, kernel, seed):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    E, T = len(splits), sum(splits)
    x, w = operands(T, E, N, K, gen)
    m = torch.tensor(splits, dtype=torch.int64, device=DEV)
    plan = cuda_ops.make_plan(m, T)
    plan_ref = ref.make_plan(m, T)
    qx, sx, _, _ = cuda_ops.quantize_act(x, plan, cols=False)
    qw, sw, qwT, swT = cuda_ops.quantize_weight(w)
    dy = torch.randn(T, N, device=DEV, generator=gen).to(torch.bfloat16)
    qdy, sdy, _, _ = cuda_ops.quantize_act(dy, plan, cols=False)
    for name, (qa, sa, qb, sb) in {"fprop": (qx, sx, qw, sw), "dgrad": (qdy, sdy, qwT, swT)}.items():
        out = poisoned(lambda: run(qa, sa, qb, sb, plan, kernel), (T, qb.shape[1]), torch.bfloat16)
        expect = ref.gemm_fp8_ragged_rows(qa, sa, qb, sb, plan_ref, torch.float64)
        assert torch.isfinite(out).all(), (name, splits[:8])
        assert rel(out, expect) <= TOL, (name, splits[:8])
        assert torch.equal(out, run(qa, sa, qb, sb, plan, kernel)), (name, "not bitwise repeatable")


@pytest.mark.parametrize("kernel", KERNELS.values(), ids=KERNELS.keys())
@pytest.mark.parametrize("case", GEMM_EDGE_SPLITS.keys())
# K = 640 and 2048 fill whole rounds of the 128-column tiling's 5 stages and of the others' 4 (the K loop unrolled over
# a round: csrc/kernels/gemm/sm90/fp8_ragged_rows.cuh); N = 400: 192-wide tiles at both weight-scale splits, a last
# 256-wide tile of one part
@pytest.mark.parametrize("N,K", [(128, 128), (256, 384), (400, 272), (400, 640), (1408, 2048)])
def test_edge_counts(case, N, K, kernel):
    check_against_reference(GEMM_EDGE_SPLITS[case], N, K, kernel, seed=zlib.crc32(f"{case} {N} {K}".encode()))


@pytest.mark.parametrize("kernel", KERNELS.values(), ids=KERNELS.keys())
@pytest.mark.parametrize("E,T,N,K", [(8, 4096, 4096, 1024), (64, 6000, 2816, 2048), (1024, 5000, 256, 256), (3, 700, 768, 7168)])
def test_zipf(E, T, N, K, kernel):
    check_against_reference(zipf_splits(E, T), N, K, kernel, seed=E * 7 + K)


@pytest.mark.parametrize("kernel", KERNELS.values(), ids=KERNELS.keys())
def test_uncovered_rows_and_clamped_counts(kernel):
    """Device counts that cover fewer than T tokens: the rows past them are zeros; garbage counts clamp."""
    gen = torch.Generator(device=DEV).manual_seed(11)
    T, E, N, K = 700, 4, 256, 256
    x, w = operands(T, E, N, K, gen)
    for counts in ([100, 0, 200, 50], [-5, 10**12, 3, 7], [0, 0, 0, 0]):
        m = torch.tensor(counts, dtype=torch.int64, device=DEV)
        plan = cuda_ops.make_plan(m, T)
        qx, sx, _, _ = cuda_ops.quantize_act(x, plan, cols=False)
        qw, sw, _, _ = cuda_ops.quantize_weight(w)
        out = poisoned(lambda: run(qx, sx, qw, sw, plan, kernel), (T, N), torch.bfloat16)
        expect = ref.gemm_fp8_ragged_rows(qx, sx, qw, sw, ref.make_plan(m, T), torch.float64)
        covered = int(ref.make_plan(m, T)[0, -1])
        assert torch.equal(out[covered:], torch.zeros_like(out[covered:])), counts
        if covered:
            assert rel(out[:covered], expect[:covered]) <= TOL, counts


@pytest.mark.parametrize("kernel", KERNELS.values(), ids=KERNELS.keys())
def test_kernels_agree_and_graph_replay_with_new_splits(kernel):
    """Captured once in a CUDA graph, replayed with other m_splits of the same E (no host sync)."""
    gen = torch.Generator(device=DEV).manual_seed(5)
    T, E, N, K = 3000, 16, 512, 512
    x, w = operands(T, E, N, K, gen)
    m = torch.tensor(zipf_splits(E, T), dtype=torch.int64, device=DEV)
    qw, sw, _, _ = cuda_ops.quantize_weight(w)

    def step():
        plan = cuda_ops.make_plan(m, T)
        qx, sx, _, _ = cuda_ops.quantize_act(x, plan, cols=False)
        return run(qx, sx, qw, sw, plan, kernel)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        splits = zipf_splits(E, T)
        m.copy_(torch.tensor(splits, dtype=torch.int64))
        graph.replay()
        torch.cuda.synchronize()
        plan_ref = ref.make_plan(m, T)
        qx, sx, _, _ = ref.quantize_act(x, plan_ref, cols=False)
        assert rel(out, ref.gemm_fp8_ragged_rows(qx, sx, qw, sw, plan_ref, torch.float64)) <= TOL, splits[:4]


@pytest.mark.parametrize("kernel", KERNELS.values(), ids=KERNELS.keys())
def test_tile_counter_across_launches_streams_and_graphs(kernel):
    """The raw op keeps one tile counter per stream, which each launch leaves zero for the next: problems of other
    sizes back to back (more and fewer tiles than CTAs), two streams in turn, and a captured graph replayed between
    eager launches on its stream all give the first launch's bits."""
    gen = torch.Generator(device=DEV).manual_seed(9)
    problems = []
    for splits, N, K in (([300, 0, 1000, 7], 512, 256), ([1], 128, 128), (zipf_splits(64, 20000), 2816, 512)):
        x, w = operands(sum(splits), len(splits), N, K, gen)
        plan = cuda_ops.make_plan(torch.tensor(splits, device=DEV), sum(splits))
        qx, sx, _, _ = cuda_ops.quantize_act(x, plan, cols=False)
        qw, sw, _, _ = cuda_ops.quantize_weight(w)
        first = run(qx, sx, qw, sw, plan, kernel)
        plan_ref = ref.make_plan(torch.tensor(splits, device=DEV), sum(splits))
        expect = ref.gemm_fp8_ragged_rows(qx, sx, qw, sw, plan_ref, torch.float64)
        assert rel(first, expect) <= TOL, splits[:4]
        problems.append(((qx, sx, qw, sw, plan), first))
    side = torch.cuda.Stream()
    for _ in range(2):
        for args, first in problems + problems[::-1]:
            assert torch.equal(run(*args, kernel), first)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                out = run(*args, kernel)
            torch.cuda.current_stream().wait_stream(side)
            assert torch.equal(out, first)
    args, first = problems[2]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run(*args, kernel)
    for _ in range(3):
        captured.zero_()
        graph.replay()
        assert torch.equal(run(*args, kernel), first)
        torch.cuda.synchronize()
        assert torch.equal(captured, first)


@pytest.mark.parametrize("kernel", KERNELS.values(), ids=KERNELS.keys())
def test_past_int32_elements(kernel):
    """T * K > 2^31: the last expert's rows lie past 2^31 elements of qa."""
    K, N, E = 8192, 128, 3
    T = (1 << 31) // K + 300
    gen = torch.Generator(device=DEV).manual_seed(3)
    # e4m3 bytes without NaN codes (0x7f, 0xff): magnitude codes 0..0x7e, either sign
    qa = (torch.randint(0, 0x7F, (T, K), device=DEV, dtype=torch.uint8, generator=gen)
          | (torch.randint(0, 2, (T, K), device=DEV, dtype=torch.uint8, generator=gen) << 7)).view(torch.float8_e4m3fn)
    sa = torch.rand(T, K // 128, device=DEV, generator=gen) * 1e-3
    w = (torch.randn(E, N, K, device=DEV, generator=gen) * 0.05).to(torch.bfloat16)
    qb, sb, _, _ = cuda_ops.quantize_weight(w)
    splits = [100, T - 400, 300]
    plan = cuda_ops.make_plan(torch.tensor(splits, device=DEV), T)
    out = run(qa, sa, qb, sb, plan, kernel)
    rows = slice(T - 300, T)
    a = qa[rows].double() * sa[rows].double().repeat_interleave(128, dim=1)
    b = qb[2].double() * sb[2].double().repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)[:N, :K]
    assert rel(out[rows], a @ b.T) <= TOL


def test_row_scales_layout():
    """quantize_act writes the row scales K-major, as the reference lays them out; the GEMM reads sa in that
    layout and copies any other (row-major, a strided view) into it first: bitwise the same result."""
    T, E, N, K = 333, 3, 256, 640
    x, w = operands(T, E, N, K, torch.Generator(device=DEV).manual_seed(4))
    m = torch.tensor([100, 33, 200], device=DEV)
    plan = cuda_ops.make_plan(m, T)
    qx, sx, _, _ = cuda_ops.quantize_act(x, plan, cols=False)
    _, sx_ref, _, _ = ref.quantize_act(x, ref.make_plan(m, T), cols=False)
    assert sx.stride() == sx_ref.stride() == (1, 336) and torch.equal(sx, sx_ref)
    qw, sw, _, _ = cuda_ops.quantize_weight(w)
    y = run(qx, sx, qw, sw, plan, -1)
    wide = torch.zeros(T, 9, device=DEV)
    wide[:, 3:8] = sx
    for sa in (sx.contiguous(), wide[:, 3:8], sx.t().contiguous().t()[:, :]):
        assert torch.equal(run(qx, sa, qw, sw, plan, -1), y), sa.stride()


def test_non_contiguous_operand_error_shows_strides():
    x, w = operands(64, 2, 128, 256, torch.Generator(device=DEV).manual_seed(2))
    plan = cuda_ops.make_plan(torch.tensor([30, 34], device=DEV), 64)
    qx, sx, _, _ = cuda_ops.quantize_act(x, plan, cols=False)
    qw, sw, _, _ = cuda_ops.quantize_weight(w)
    wide = torch.empty(64, 512, device=DEV, dtype=qx.dtype)
    with pytest.raises(RuntimeError, match=r"qa must be contiguous, got shape \[64, 256\] with strides \[512, 1\]"):
        torch.ops.moegemm.gemm_fp8_ragged_rows(wide[:, :256], sx, qw, sw, plan)
