"""The raw ops ``torch.ops.moegemm.*`` under misuse (docs/design.md#errors): every bad argument raises
(RuntimeError, or NotImplementedError from the dispatcher for CPU-only calls) and the CUDA context
survives; misaligned data pointers either raise naming the argument ("aligned") or give the aligned
result; ``torch.library.opcheck`` on every op, and aliasing/mutation checks where its schema test cannot
run (float8 inputs). CUDA only (``requires_cuda``).
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from conftest import HAS_HOPPER, cuda_alive, requires_cuda

pytestmark = requires_cuda

if HAS_HOPPER:
    from moegemm.backends import cuda as cuda_ops  # noqa: F401  (builds/loads the extension)

DEV = "cuda"
# m_e ≡ 1 (mod 128): the transposed copies' padded columns and scale-block rows are all covered, so
# every output entry of every op is defined (opcheck compares eager and compiled outputs).
SPLITS = [129, 1, 257]
E, T, K, N, F = 3, 387, 144, 160, 144
SENTINEL = -1234.5
F8 = torch.float8_e4m3fn


def ops():
    return torch.ops.moegemm



@pytest.fixture(scope="module")
def a():
    torch.manual_seed(50)
    o = ops()
    m = torch.tensor(SPLITS, dtype=torch.int64, device=DEV)
    plan = o.make_plan(m, T)
    x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16)
    dy = torch.randn(T, N, device=DEV, dtype=torch.bfloat16)
    w = (torch.randn(E, N, K, device=DEV) * 0.05).to(torch.bfloat16)
    qx, sx, qxT, sxT = o.quantize_act(x, plan, True, True)
    qdy, sdy, qdyT, sdyT = o.quantize_act(dy, plan, True, True)
    qw, sw, qwT, swT = o.quantize_weight(w)
    h = torch.randn(T, 2 * F, device=DEV, dtype=torch.bfloat16)
    h1 = torch.randn(T, F, device=DEV, dtype=torch.bfloat16)
    da = torch.randn(T, F, device=DEV, dtype=torch.bfloat16)
    p = torch.rand(T, device=DEV)
    out = torch.randn(E, N, K, device=DEV)
    torch.cuda.synchronize()
    return SimpleNamespace(**{k: v for k, v in locals().items() if k not in ("o",)})


def good_calls(a):
    """(op name, args) of a valid call of every op."""
    return [
        ("make_plan", (a.m, T)),
        ("quantize_act", (a.x, a.plan, True, True)),
        ("requantize_cols", (a.qx, a.sx, a.plan)),
        ("quantize_weight", (a.w,)),
        ("act_quantize", (a.h, a.p, 0, a.plan, True, True)),
        ("act_backward_quantize", (a.da, a.h, a.p, 0, a.plan, True, True)),
        ("act_bf16", (a.h, a.p, 0)),
        ("act_backward_bf16", (a.da, a.h, a.p, 0)),
        ("gemm_fp8_ragged_rows", (a.qx, a.sx, a.qw, a.sw, a.plan)),
        ("gemm_fp8_ragged_reduction", (a.qdyT, a.sdyT, a.qxT, a.sxT, a.plan, torch.float32)),
        ("gemm_fp8_ragged_reduction_accumulate", (a.qdyT, a.sdyT, a.qxT, a.sxT, a.plan, a.out.clone())),
        ("gemm_bf16_fprop", (a.x, a.w, a.plan)),
        ("gemm_bf16_dgrad", (a.dy, a.w, a.plan)),
        ("gemm_bf16_wgrad", (a.dy, a.x, a.plan, torch.float32)),
        ("gemm_bf16_wgrad_accumulate", (a.dy, a.x, a.plan, a.out.clone())),
    ]


ALL_OPS = ["make_plan", "quantize_act", "requantize_cols", "quantize_weight", "act_quantize", "act_backward_quantize", "act_bf16",
           "act_backward_bf16", "gemm_fp8_ragged_rows", "gemm_fp8_ragged_reduction", "gemm_fp8_ragged_reduction_accumulate",
           "gemm_bf16_fprop", "gemm_bf16_dgrad", "gemm_bf16_wgrad", "gemm_bf16_wgrad_accumulate"]


def _bytes(t):
    return t.view(torch.uint8) if t.dtype == F8 else t


def same(u, v) -> bool:
    if isinstance(u, (tuple, list)):
        return len(u) == len(v) and all(same(p, q) for p, q in zip(u, v))
    if u is None or v is None:
        return u is None and v is None
    return u.shape == v.shape and u.dtype == v.dtype and torch.equal(_bytes(u), _bytes(v))


def guarded_like(t, offset=3, after=5):
    buf = torch.full((offset + t.numel() + after,), SENTINEL, dtype=t.dtype, device=t.device)
    view = buf[offset:offset + t.numel()].view(t.shape)
    view.copy_(t)
    return view, buf, (offset, offset + t.numel())


def guards_intact(buf, span) -> bool:
    return bool((buf[:span[0]] == SENTINEL).all() and (buf[span[1]:] == SENTINEL).all())


# ================================================================================== misuse must raise
def _zeros(*shape, dtype=torch.float32, device=DEV):
    return torch.zeros(*shape, dtype=dtype, device=device)


BAD = {
    # make_plan
    "make_plan/1025_counts": lambda a: ("make_plan", (_zeros(1025, dtype=torch.int64), 10)),
    "make_plan/0_counts": lambda a: ("make_plan", (_zeros(0, dtype=torch.int64), 0)),
    "make_plan/T_negative": lambda a: ("make_plan", (a.m, -1)),
    "make_plan/T_2_31": lambda a: ("make_plan", (a.m, 2 ** 31)),
    "make_plan/T_2_62": lambda a: ("make_plan", (a.m, 2 ** 62)),
    "make_plan/float_counts": lambda a: ("make_plan", (a.m.float(), T)),
    "make_plan/int16_counts": lambda a: ("make_plan", (a.m.short(), T)),
    "make_plan/2d_counts": lambda a: ("make_plan", (a.m.view(1, E), T)),
    "make_plan/cpu_counts": lambda a: ("make_plan", (a.m.cpu(), T)),
    # quantize_act
    "quantize_act/x_int32": lambda a: ("quantize_act", (a.x.int(), a.plan, True, True)),
    "quantize_act/x_fp8": lambda a: ("quantize_act", (a.qx, a.plan, True, True)),
    "quantize_act/x_3d": lambda a: ("quantize_act", (a.x.view(1, T, K), a.plan, True, True)),
    "quantize_act/x_K24": lambda a: ("quantize_act", (_zeros(T, 24, dtype=torch.bfloat16), a.plan, True, True)),
    "quantize_act/x_noncontig": lambda a: ("quantize_act", (_zeros(T, 2 * K, dtype=torch.bfloat16)[:, :K], a.plan, True, True)),
    "quantize_act/plan_int64": lambda a: ("quantize_act", (a.x, a.plan.long(), True, True)),
    "quantize_act/plan_2rows": lambda a: ("quantize_act", (a.x, a.plan[:2].contiguous(), True, True)),
    "quantize_act/plan_1d": lambda a: ("quantize_act", (a.x, a.plan[0].contiguous(), True, True)),
    "quantize_act/plan_E0": lambda a: ("quantize_act", (a.x, a.plan[:, :1].contiguous(), True, True)),
    "quantize_act/plan_cpu": lambda a: ("quantize_act", (a.x, a.plan.cpu(), True, True)),
    "quantize_act/x_cpu": lambda a: ("quantize_act", (a.x.cpu(), a.plan, True, True)),
    "quantize_act/all_cpu": lambda a: ("quantize_act", (a.x.cpu(), a.plan.cpu(), True, True)),
    # requantize_cols (an FP8 x's column copy from its rows)
    "requantize_cols/x_bf16": lambda a: ("requantize_cols", (a.x, a.sx, a.plan)),
    "requantize_cols/x_3d": lambda a: ("requantize_cols", (a.qx.view(1, T, K), a.sx, a.plan)),
    "requantize_cols/x_K24": lambda a: ("requantize_cols", (a.qx[:, :24].contiguous(), a.sx[:, :1].contiguous(), a.plan)),
    "requantize_cols/scales_wide": lambda a: ("requantize_cols", (a.qx, torch.cat([a.sx, a.sx], 1), a.plan)),
    "requantize_cols/scales_rows": lambda a: ("requantize_cols", (a.qx, a.sx[:-1], a.plan)),
    "requantize_cols/scales_bf16": lambda a: ("requantize_cols", (a.qx, a.sx.bfloat16(), a.plan)),
    "requantize_cols/scales_cpu": lambda a: ("requantize_cols", (a.qx, a.sx.cpu(), a.plan)),
    "requantize_cols/plan_int64": lambda a: ("requantize_cols", (a.qx, a.sx, a.plan.long())),
    "requantize_cols/plan_cpu": lambda a: ("requantize_cols", (a.qx, a.sx, a.plan.cpu())),
    # quantize_weight
    "quantize_weight/2d": lambda a: ("quantize_weight", (a.w[0],)),
    "quantize_weight/int": lambda a: ("quantize_weight", (a.w.int(),)),
    "quantize_weight/fp8": lambda a: ("quantize_weight", (a.qw,)),
    "quantize_weight/N24": lambda a: ("quantize_weight", (_zeros(E, 24, K, dtype=torch.bfloat16),)),
    "quantize_weight/noncontig": lambda a: ("quantize_weight", (a.w.transpose(1, 2),)),
    "quantize_weight/cpu": lambda a: ("quantize_weight", (a.w.cpu(),)),
    # quantize_weights (the weight cache's: one launch per layer)
    "quantize_weights/empty": lambda a: ("quantize_weights", ([],)),
    "quantize_weights/2d": lambda a: ("quantize_weights", ([a.w, a.w[0]],)),
    "quantize_weights/int": lambda a: ("quantize_weights", ([a.w.int(), a.w],)),
    "quantize_weights/N24": lambda a: ("quantize_weights", ([a.w, _zeros(E, 24, K, dtype=torch.bfloat16)],)),
    "quantize_weights/cpu": lambda a: ("quantize_weights", ([a.w, a.w.cpu()],)),
    # act_quantize
    "act_quantize/act_5": lambda a: ("act_quantize", (a.h, a.p, 5, a.plan, True, True)),
    "act_quantize/act_-1": lambda a: ("act_quantize", (a.h, a.p, -1, a.plan, True, True)),
    "act_quantize/act_2_40": lambda a: ("act_quantize", (a.h, a.p, 2 ** 40, a.plan, True, True)),
    "act_quantize/h_fp32": lambda a: ("act_quantize", (a.h.float(), a.p, 0, a.plan, True, True)),
    "act_quantize/h_1d": lambda a: ("act_quantize", (a.h[0], a.p, 0, a.plan, True, True)),
    "act_quantize/glu_F_152": lambda a: ("act_quantize", (_zeros(T, 304, dtype=torch.bfloat16), a.p, 0, a.plan, True, True)),
    "act_quantize/relu_F_24": lambda a: ("act_quantize", (_zeros(T, 24, dtype=torch.bfloat16), None, 3, a.plan, True, True)),
    "act_quantize/probs_bf16": lambda a: ("act_quantize", (a.h, a.p.bfloat16(), 0, a.plan, True, True)),
    "act_quantize/probs_T+1": lambda a: ("act_quantize", (a.h, _zeros(T + 1), 0, a.plan, True, True)),
    "act_quantize/probs_2d": lambda a: ("act_quantize", (a.h, a.p.view(T, 1), 0, a.plan, True, True)),
    "act_quantize/probs_cpu": lambda a: ("act_quantize", (a.h, a.p.cpu(), 0, a.plan, True, True)),
    "act_quantize/plan_int64": lambda a: ("act_quantize", (a.h, a.p, 0, a.plan.long(), True, True)),
    # act_backward_quantize
    "act_backward_quantize/da_F+16": lambda a: ("act_backward_quantize", (_zeros(T, F + 16, dtype=torch.bfloat16), a.h, a.p, 0, a.plan, True, True)),
    "act_backward_quantize/da_fp32": lambda a: ("act_backward_quantize", (a.da.float(), a.h, a.p, 0, a.plan, True, True)),
    "act_backward_quantize/h_T-1": lambda a: ("act_backward_quantize", (a.da, a.h[:-1], a.p, 0, a.plan, True, True)),
    "act_backward_quantize/act_7": lambda a: ("act_backward_quantize", (a.da, a.h, a.p, 7, a.plan, True, True)),
    "act_backward_quantize/probs_T-1": lambda a: ("act_backward_quantize", (a.da, a.h, a.p[:-1], 0, a.plan, True, True)),
    "act_backward_quantize/relu_with_glu_h": lambda a: ("act_backward_quantize", (a.da, a.h, a.p, 3, a.plan, True, True)),
    # act_bf16 / act_backward_bf16
    "act_bf16/act_5": lambda a: ("act_bf16", (a.h, a.p, 5)),
    "act_bf16/h_fp32": lambda a: ("act_bf16", (a.h.float(), a.p, 0)),
    "act_bf16/probs_bf16": lambda a: ("act_bf16", (a.h, a.p.bfloat16(), 0)),
    "act_bf16/probs_T+1": lambda a: ("act_bf16", (a.h, _zeros(T + 1), 0)),
    "act_bf16/h_odd_glu": lambda a: ("act_bf16", (_zeros(T, 2 * F + 16, dtype=torch.bfloat16), None, 1)),
    "act_backward_bf16/disagree": lambda a: ("act_backward_bf16", (a.da, a.h1, a.p, 0)),
    "act_backward_bf16/act_-1": lambda a: ("act_backward_bf16", (a.da, a.h, a.p, -1)),
    "act_backward_bf16/h_cpu": lambda a: ("act_backward_bf16", (a.da, a.h.cpu(), a.p, 0)),
    # gemm_fp8_ragged_rows
    "gemm_fp8_ragged_rows/qa_bf16": lambda a: ("gemm_fp8_ragged_rows", (a.x, a.sx, a.qw, a.sw, a.plan)),
    "gemm_fp8_ragged_rows/sa_shape": lambda a: ("gemm_fp8_ragged_rows", (a.qx, a.sx[:, :1].contiguous(), a.qw, a.sw, a.plan)),
    "gemm_fp8_ragged_rows/sa_rows": lambda a: ("gemm_fp8_ragged_rows", (a.qx, a.sx[:-1], a.qw, a.sw, a.plan)),
    "gemm_fp8_ragged_rows/sa_bf16": lambda a: ("gemm_fp8_ragged_rows", (a.qx, a.sx.bfloat16(), a.qw, a.sw, a.plan)),
    "gemm_fp8_ragged_rows/qb_E": lambda a: ("gemm_fp8_ragged_rows", (a.qx, a.sx, a.qw[:2], a.sw[:2], a.plan)),
    "gemm_fp8_ragged_rows/qb_K": lambda a: ("gemm_fp8_ragged_rows", (a.qx, a.sx, _zeros(E, N, K + 16, dtype=F8), _zeros(E, 2, 2), a.plan)),
    "gemm_fp8_ragged_rows/sb_blocks": lambda a: ("gemm_fp8_ragged_rows", (a.qx, a.sx, a.qw, _zeros(E, 3, 2), a.plan)),
    "gemm_fp8_ragged_rows/sb_2d": lambda a: ("gemm_fp8_ragged_rows", (a.qx, a.sx, a.qw, a.sw[0], a.plan)),
    "gemm_fp8_ragged_rows/qa_3d": lambda a: ("gemm_fp8_ragged_rows", (a.qx.view(1, T, K), a.sx, a.qw, a.sw, a.plan)),
    "gemm_fp8_ragged_rows/plan_int64": lambda a: ("gemm_fp8_ragged_rows", (a.qx, a.sx, a.qw, a.sw, a.plan.long())),
    "gemm_fp8_ragged_rows/plan_E2": lambda a: ("gemm_fp8_ragged_rows", (a.qx, a.sx, a.qw, a.sw, a.plan[:, :3].contiguous())),
    "gemm_fp8_ragged_rows/cpu": lambda a: ("gemm_fp8_ragged_rows", (a.qx.cpu(), a.sx.cpu(), a.qw.cpu(), a.sw.cpu(), a.plan.cpu())),
    # gemm_fp8_ragged_reduction(_accumulate)
    "gemm_fp8_ragged_reduction/out_fp16": lambda a: ("gemm_fp8_ragged_reduction", (a.qdyT, a.sdyT, a.qxT, a.sxT, a.plan, torch.float16)),
    "gemm_fp8_ragged_reduction/out_int32": lambda a: ("gemm_fp8_ragged_reduction", (a.qdyT, a.sdyT, a.qxT, a.sxT, a.plan, torch.int32)),
    "gemm_fp8_ragged_reduction/out_fp8": lambda a: ("gemm_fp8_ragged_reduction", (a.qdyT, a.sdyT, a.qxT, a.sxT, a.plan, F8)),
    "gemm_fp8_ragged_reduction/width": lambda a: ("gemm_fp8_ragged_reduction", (a.qdyT, a.sdyT, a.qxT[:, :-16].contiguous(), a.sxT, a.plan, torch.float32)),
    "gemm_fp8_ragged_reduction/scale_rows": lambda a: ("gemm_fp8_ragged_reduction", (a.qdyT, a.sdyT[:-1], a.qxT, a.sxT, a.plan, torch.float32)),
    "gemm_fp8_ragged_reduction/bf16_operand": lambda a: ("gemm_fp8_ragged_reduction", (a.qdyT.view(torch.uint8), a.sdyT, a.qxT, a.sxT, a.plan, torch.float32)),
    "gemm_fp8_ragged_reduction_accumulate/out_K+16": lambda a: ("gemm_fp8_ragged_reduction_accumulate", (a.qdyT, a.sdyT, a.qxT, a.sxT, a.plan, "out", (E, N, K + 16), torch.float32)),
    "gemm_fp8_ragged_reduction_accumulate/out_E+1": lambda a: ("gemm_fp8_ragged_reduction_accumulate", (a.qdyT, a.sdyT, a.qxT, a.sxT, a.plan, "out", (E + 1, N, K), torch.float32)),
    "gemm_fp8_ragged_reduction_accumulate/out_bf16": lambda a: ("gemm_fp8_ragged_reduction_accumulate", (a.qdyT, a.sdyT, a.qxT, a.sxT, a.plan, "out", (E, N, K), torch.bfloat16)),
    "gemm_fp8_ragged_reduction_accumulate/out_fp64": lambda a: ("gemm_fp8_ragged_reduction_accumulate", (a.qdyT, a.sdyT, a.qxT, a.sxT, a.plan, "out", (E, N, K), torch.float64)),
    "gemm_fp8_ragged_reduction_accumulate/out_2d": lambda a: ("gemm_fp8_ragged_reduction_accumulate", (a.qdyT, a.sdyT, a.qxT, a.sxT, a.plan, "out", (E * N, K), torch.float32)),
    "gemm_fp8_ragged_reduction_accumulate/out_transposed": lambda a: ("gemm_fp8_ragged_reduction_accumulate", (a.qdyT, a.sdyT, a.qxT, a.sxT, a.plan, "out_t", (E, K, N), torch.float32)),
    "gemm_fp8_ragged_reduction_accumulate/out_cpu": lambda a: ("gemm_fp8_ragged_reduction_accumulate", (a.qdyT, a.sdyT, a.qxT, a.sxT, a.plan, a.out.cpu())),
    # bf16 GEMMs
    "gemm_bf16_fprop/x_fp32": lambda a: ("gemm_bf16_fprop", (a.x.float(), a.w, a.plan)),
    "gemm_bf16_fprop/w_fp32": lambda a: ("gemm_bf16_fprop", (a.x, a.w.float(), a.plan)),
    "gemm_bf16_fprop/w_E": lambda a: ("gemm_bf16_fprop", (a.x, a.w[:2], a.plan)),
    "gemm_bf16_fprop/x_K": lambda a: ("gemm_bf16_fprop", (a.dy, a.w, a.plan)),
    "gemm_bf16_fprop/plan_1d": lambda a: ("gemm_bf16_fprop", (a.x, a.w, a.plan[0].contiguous())),
    "gemm_bf16_fprop/w_noncontig": lambda a: ("gemm_bf16_fprop", (a.x, _zeros(E, K, N, dtype=torch.bfloat16).transpose(1, 2), a.plan)),
    "gemm_bf16_dgrad/dy_N": lambda a: ("gemm_bf16_dgrad", (a.x, a.w, a.plan)),
    "gemm_bf16_dgrad/w_2d": lambda a: ("gemm_bf16_dgrad", (a.dy, a.w[0], a.plan)),
    "gemm_bf16_wgrad/x_T": lambda a: ("gemm_bf16_wgrad", (a.dy, a.x[:-1], a.plan, torch.float32)),
    "gemm_bf16_wgrad/out_fp16": lambda a: ("gemm_bf16_wgrad", (a.dy, a.x, a.plan, torch.float16)),
    "gemm_bf16_wgrad/out_fp64": lambda a: ("gemm_bf16_wgrad", (a.dy, a.x, a.plan, torch.float64)),
    "gemm_bf16_wgrad/x_fp16": lambda a: ("gemm_bf16_wgrad", (a.dy, a.x.half(), a.plan, torch.float32)),
    "gemm_bf16_wgrad_accumulate/out_K+16": lambda a: ("gemm_bf16_wgrad_accumulate", (a.dy, a.x, a.plan, "out", (E, N, K + 16), torch.float32)),
    "gemm_bf16_wgrad_accumulate/out_bf16": lambda a: ("gemm_bf16_wgrad_accumulate", (a.dy, a.x, a.plan, "out", (E, N, K), torch.bfloat16)),
    "gemm_bf16_wgrad_accumulate/out_flat": lambda a: ("gemm_bf16_wgrad_accumulate", (a.dy, a.x, a.plan, "out", (E * N * K,), torch.float32)),
    "gemm_bf16_wgrad_accumulate/out_transposed": lambda a: ("gemm_bf16_wgrad_accumulate", (a.dy, a.x, a.plan, "out_t", (E, K, N), torch.float32)),
}


@pytest.mark.parametrize("case", list(BAD))
def test_raw_op_misuse_raises(a, case):
    name, args = BAD[case](a)
    guard = None
    if len(args) >= 3 and isinstance(args[-3], str):  # a caller buffer `out` inside sentinel guards
        kind, shape, dtype = args[-3:]
        n = 1
        for s in shape:
            n *= s
        buf = torch.full((3 + n + 5,), SENTINEL, dtype=dtype, device=DEV)
        out = buf[3:3 + n].view(shape)
        out.zero_()
        if kind == "out_t":
            out = out.transpose(1, 2)
        guard = (buf, n)
        args = args[:-3] + (out,)
    before = [t.clone() for t in args if isinstance(t, torch.Tensor)]
    with pytest.raises((RuntimeError, NotImplementedError)):
        getattr(ops(), name)(*args)
    cuda_alive()
    after = [t for t in args if isinstance(t, torch.Tensor)]
    for u, v in zip(before, after):
        assert same(u, v), "an argument was modified by a call that raised"
    if guard is not None:
        buf, n = guard
        assert (buf[:3] == SENTINEL).all() and (buf[3 + n:] == SENTINEL).all() and (buf[3:3 + n] == 0).all()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_raw_ops_tensors_on_two_devices(a):
    for name, args in good_calls(a):
        for i, t in enumerate(args):
            if not isinstance(t, torch.Tensor) or len([u for u in args if isinstance(u, torch.Tensor)]) < 2:
                continue
            moved = tuple(u.to("cuda:1") if j == i else u for j, u in enumerate(args))
            with pytest.raises(RuntimeError):
                getattr(ops(), name)(*moved)
            cuda_alive()


# ============================================================================= misaligned data pointers
def offset_view(t, offset=1):
    flat = torch.zeros(t.numel() + offset + 5, dtype=t.dtype, device=t.device)
    v = flat[offset:offset + t.numel()].view(t.shape)
    v.copy_(t)
    return v


@pytest.mark.parametrize("name", ALL_OPS)
def test_raw_op_misaligned_arguments(a, name):
    """Each tensor argument in turn at an element offset (data pointer not 16-byte aligned): the op
    either raises RuntimeError mentioning "aligned" and the argument's name, or gives the aligned result
    bitwise (an `out` view at an offset gets exactly that, its neighbours untouched)."""
    args = dict(good_calls(a))[name]
    schema = getattr(ops(), name).default._schema
    arg_names = [arg.name for arg in schema.arguments]
    accumulate = name.endswith("_accumulate")
    expected_out = None
    res = getattr(ops(), name)(*args)
    if accumulate:
        expected_out = args[-1].clone()
    for i, t in enumerate(args):
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            continue
        call = list(args)
        if accumulate:
            call[-1] = a.out.clone()
        guard = None
        if accumulate and i == len(args) - 1:
            view, buf, span = guarded_like(a.out, offset=1)
            call[i], guard = view, (buf, span)
        else:
            call[i] = offset_view(t, 1)
        assert call[i].data_ptr() % 16 != 0
        try:
            got = getattr(ops(), name)(*call)
        except RuntimeError as err:
            msg = str(err)
            assert "aligned" in msg and re.search(rf"\b{re.escape(arg_names[i])}\b", msg), (arg_names[i], msg)
            if guard is not None:
                assert guards_intact(*guard)
            cuda_alive()
            continue
        cuda_alive()
        if accumulate:
            assert same(call[-1].contiguous(), expected_out), arg_names[i]
            if guard is not None:
                assert guards_intact(*guard), "the accumulate op wrote outside out"
        else:
            assert same(got, res), arg_names[i]


# ================================================================================ opcheck + aliasing
def opcheck_cases():
    """(id, op name, builder): every op, including its optional-argument and activation variants."""
    yield "make_plan", "make_plan", lambda a: (a.m, T)
    yield "make_plan_int32", "make_plan", lambda a: (a.m.int(), T)
    yield "quantize_act", "quantize_act", lambda a: (a.x, a.plan, True, True)
    yield "quantize_act_rows", "quantize_act", lambda a: (a.x, a.plan, True, False)
    yield "quantize_act_cols_fp32", "quantize_act", lambda a: (a.x.float(), a.plan, False, True)
    yield "requantize_cols", "requantize_cols", lambda a: (a.qx, a.sx, a.plan)
    yield "quantize_weight", "quantize_weight", lambda a: (a.w,)
    yield "quantize_weight_fp32", "quantize_weight", lambda a: (a.w.float(),)
    yield "quantize_weights", "quantize_weights", lambda a: ([a.w, a.w.float(), a.w],)
    for act in range(5):
        glu = act in (0, 1)
        yield f"act_quantize_{act}", "act_quantize", lambda a, act=act, glu=glu: (a.h if glu else a.h1, a.p, act, a.plan, True, True)
        yield f"act_quantize_{act}_noprobs", "act_quantize", lambda a, act=act, glu=glu: (a.h if glu else a.h1, None, act, a.plan, True, False)
        yield f"act_backward_quantize_{act}", "act_backward_quantize", lambda a, act=act, glu=glu: (a.da, a.h if glu else a.h1, a.p, act, a.plan, True, True)
        yield f"act_backward_quantize_{act}_noprobs", "act_backward_quantize", lambda a, act=act, glu=glu: (a.da, a.h if glu else a.h1, None, act, a.plan, False, True)
        yield f"act_bf16_{act}", "act_bf16", lambda a, act=act, glu=glu: (a.h if glu else a.h1, a.p, act)
        yield f"act_backward_bf16_{act}", "act_backward_bf16", lambda a, act=act, glu=glu: (a.da, a.h if glu else a.h1, a.p, act)
        yield f"act_backward_bf16_{act}_noprobs", "act_backward_bf16", lambda a, act=act, glu=glu: (a.da, a.h if glu else a.h1, None, act)
    yield "gemm_bf16_fprop", "gemm_bf16_fprop", lambda a: (a.x, a.w, a.plan)
    yield "gemm_bf16_dgrad", "gemm_bf16_dgrad", lambda a: (a.dy, a.w, a.plan)
    yield "gemm_bf16_wgrad", "gemm_bf16_wgrad", lambda a: (a.dy, a.x, a.plan, torch.float32)
    yield "gemm_bf16_wgrad_bf16", "gemm_bf16_wgrad", lambda a: (a.dy, a.x, a.plan, torch.bfloat16)
    yield "gemm_bf16_wgrad_accumulate", "gemm_bf16_wgrad_accumulate", lambda a: (a.dy, a.x, a.plan, a.out.clone())
    yield "gemm_fp8_ragged_rows", "gemm_fp8_ragged_rows", lambda a: (a.qx, a.sx, a.qw, a.sw, a.plan)
    yield "gemm_fp8_ragged_rows_dgrad", "gemm_fp8_ragged_rows", lambda a: (a.qdy, a.sdy, a.qwT, a.swT, a.plan)
    yield "gemm_fp8_ragged_reduction", "gemm_fp8_ragged_reduction", lambda a: (a.qdyT, a.sdyT, a.qxT, a.sxT, a.plan, torch.float32)
    yield "gemm_fp8_ragged_reduction_bf16", "gemm_fp8_ragged_reduction", lambda a: (a.qdyT, a.sdyT, a.qxT, a.sxT, a.plan, torch.bfloat16)
    yield "gemm_fp8_ragged_reduction_accumulate", "gemm_fp8_ragged_reduction_accumulate", lambda a: (a.qdyT, a.sdyT, a.qxT, a.sxT, a.plan, a.out.clone())


FP8_INPUT_OPS = ("requantize_cols", "gemm_fp8_ragged_rows", "gemm_fp8_ragged_reduction", "gemm_fp8_ragged_reduction_accumulate")
ALL_CASES = list(opcheck_cases())
# opcheck compiles each case (test_aot_dispatch_dynamic, seconds each): the activation ops with one GLU
# (swiglu, 0) and one plain (relu, 3) activation; the aliasing test below runs every variant.
OPCHECK = [c for c in ALL_CASES if not any(c[0].startswith(f"{op}_{act}") for act in (1, 2, 4)
                                             for op in ("act_quantize", "act_backward_quantize", "act_bf16",
                                                        "act_backward_bf16"))]


@pytest.mark.parametrize("cid,name,build", OPCHECK, ids=[c[0] for c in OPCHECK])
def test_opcheck(a, cid, name, build):
    op = getattr(ops(), name).default
    args = build(a)
    if name in FP8_INPUT_OPS:
        # test_schema (SchemaCheckMode) cannot take float8 inputs; aliasing and mutation are checked by
        # test_aliasing_and_mutation below instead.
        utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    else:
        utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(op, args, test_utils=utils)
    cuda_alive()


def _storages(x):
    if isinstance(x, torch.Tensor):
        return [x.untyped_storage().data_ptr()] if x.numel() else []
    if isinstance(x, (tuple, list)):
        return [p for u in x for p in _storages(u)]
    return []


@pytest.mark.parametrize("cid,name,build", ALL_CASES, ids=[c[0] for c in ALL_CASES])
def test_aliasing_and_mutation(a, cid, name, build):
    """Inputs are unchanged bitwise, outputs share no storage with inputs, and the `_accumulate` ops
    mutate exactly `out` (by the non-accumulating op's result)."""
    args = build(a)
    before = [t.clone() if isinstance(t, torch.Tensor) else t for t in args]
    res = getattr(ops(), name)(*args)
    torch.cuda.synchronize()
    accumulate = name.endswith("_accumulate")
    checked = args[:-1] if accumulate else args
    for u, v in zip(before, checked):
        if isinstance(u, torch.Tensor):
            assert same(u, v), "an input was modified"
    if accumulate:
        assert res is None
        plain = name[: -len("_accumulate")]
        delta = getattr(ops(), plain)(*args[:-1], torch.float32)
        exp = before[-1] + delta
        assert torch.allclose(args[-1], exp, rtol=1e-5, atol=1e-5)
        assert not same(args[-1], before[-1])
    else:
        ins = set(_storages([t for t in args if isinstance(t, torch.Tensor)]))
        outs = _storages(res)
        assert not ins & set(outs), "an output aliases an input"
        assert len(outs) == len(set(outs)), "two outputs share storage"


# ------------------------------------------------------------------------ a plan made for other tensors
@pytest.mark.parametrize("experts", [1, 5])
def test_bias_grad_of_no_tokens_is_zeros(experts):
    """bias_grad of no tokens gives zeros [E, N] under its own plan and under a plan for more tokens made in the
    launch just before it (its workspace then holds no rows: nothing may be read from it)."""
    o = ops()
    dy = torch.randn(1, 48, device=DEV, dtype=torch.bfloat16)[:0]
    own = o.make_plan(torch.zeros(experts, dtype=torch.int64, device=DEV), 0)
    for plan in (own, o.make_plan(torch.full((experts,), 300, dtype=torch.int64, device=DEV), 300 * experts)):
        db = o.bias_grad(dy, plan)
        assert db.shape == (experts, 48) and db.dtype == torch.float32
        assert int(db.count_nonzero()) == 0
    cuda_alive()


@pytest.mark.parametrize("which", ["more_tokens", "forged"])
def test_foreign_plan_gives_zeros(a, which):
    """A plan is device data the host cannot check against T. One made for more tokens than the inputs
    hold, or not by make_plan at all, is taken by every plan-consuming kernel as the plan of no tokens:
    zeros (no reads or writes past the buffers: tests/sanitize/adversarial.py runs this under memcheck)."""
    o = ops()
    if which == "more_tokens":
        foreign = o.make_plan(a.m * 2, 2 * T)
    else:
        gen = torch.Generator(device=DEV).manual_seed(7)
        foreign = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, E + 1), dtype=torch.int32, device=DEV, generator=gen)
    outs = {
        "quantize_act rows": o.quantize_act(a.x, foreign, True, True)[0].view(torch.uint8),
        "quantize_act scales": o.quantize_act(a.x, foreign, True, True)[1],
        "gemm_fp8_ragged_rows": o.gemm_fp8_ragged_rows(a.qx, a.sx, a.qw, a.sw, foreign),
        "gemm_fp8_ragged_reduction": o.gemm_fp8_ragged_reduction(a.qdyT, a.sdyT, a.qxT, a.sxT, foreign, torch.float32),
        "gemm_bf16_fprop": o.gemm_bf16_fprop(a.x, a.w, foreign),
        "gemm_bf16_dgrad": o.gemm_bf16_dgrad(a.dy, a.w, foreign),
        "gemm_bf16_wgrad": o.gemm_bf16_wgrad(a.dy, a.x, foreign, torch.float32),
        "bias_grad": o.bias_grad(a.dy, foreign),
        "act_quantize": o.act_quantize(a.h, a.p, 0, foreign, True, True)[0].view(torch.uint8),
        "act_backward_quantize": o.act_backward_quantize(a.da, a.h, a.p, 0, foreign, True, True)[0].view(torch.uint8),
    }
    y = torch.zeros(T, N, device=DEV, dtype=torch.bfloat16)
    o.add_bias_(y, torch.ones(E, N, device=DEV), foreign)
    outs["add_bias_"] = y
    acc = a.out.clone()
    o.gemm_fp8_ragged_reduction_accumulate(a.qdyT, a.sdyT, a.qxT, a.sxT, foreign, acc)
    outs["gemm_fp8_ragged_reduction_accumulate (unchanged)"] = acc - a.out
    for name, t in outs.items():
        assert int(t.count_nonzero()) == 0, name
    cuda_alive()
