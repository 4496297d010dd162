"""torch's grouped GEMMs as a peer: ``torch._grouped_mm`` bf16 (the baseline of every speed-up) and
``torch._scaled_grouped_mm`` FP8 rowwise with its quantization in plain torch ops inside the timed call,
plus the FP8 "GEMM only" fc1 row (operands quantized beforehand)."""

from __future__ import annotations

import torch
from bench.workloads import TorchGroupedLinearBF16

from bench.peers.interface import MLPImpl, offsets, swiglu_probs

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def load(key):
    op = "_grouped_mm" if key == "torch_bf16" else "_scaled_grouped_mm"
    if not hasattr(torch, op):
        raise RuntimeError(f"torch.{op} missing in this torch")


def _fp8_rowwise(t):
    """FP8 E4M3 quantization along the last dim in plain torch ops: (q contiguous, fp32 dequant scales
    of shape t.shape[:-1]); scale = amax / 448 per row."""
    amax = torch.linalg.vector_norm(t, float("inf"), dim=-1, keepdim=True).float()
    scale = amax.clamp_min(1e-12) / FP8_MAX
    q = (t / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8).contiguous()
    return q, scale.squeeze(-1).contiguous()


def _fp8_fprop(x, w, offs):
    qx, sx = _fp8_rowwise(x)  # [T, K], [T]
    qw, sw = _fp8_rowwise(w)  # [E, N, K], [E, N]: per output column of B = W^T
    return torch._scaled_grouped_mm(qx, qw.transpose(1, 2), sx, sw, offs=offs, out_dtype=BF16, use_fast_accum=True)


class _GroupedLinearFP8(torch.autograd.Function):
    """torch._scaled_grouped_mm with rowwise FP8 (quantization in torch ops, counted in the time).
    wgrad is FP8 (2d x 2d, scales per row of dy^T and x^T) only when every group is non-empty and a
    multiple of 16 rows: otherwise torch device-asserts (GroupMMCommon.cuh), so it runs in bf16."""

    @staticmethod
    def forward(ctx, x, w, offs, fp8_wgrad):
        ctx.save_for_backward(x, w, offs)
        ctx.fp8_wgrad = fp8_wgrad
        return _fp8_fprop(x, w, offs)

    @staticmethod
    def backward(ctx, dy):
        x, w, offs = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            qdy, sdy = _fp8_rowwise(dy)                  # [T, N], [T]
            qwt, swt = _fp8_rowwise(w.transpose(1, 2))   # [E, K, N] contiguous, [E, K]
            dx = torch._scaled_grouped_mm(qdy, qwt.transpose(1, 2), sdy, swt, offs=offs, out_dtype=BF16,
                                          use_fast_accum=True)
        if ctx.needs_input_grad[1]:
            if ctx.fp8_wgrad:
                E = w.shape[0]
                qdyt, sdyt = _fp8_rowwise(dy.t())        # [N, T], [N]
                qxt, sxt = _fp8_rowwise(x.t())           # [K, T], [K]
                dw = torch._scaled_grouped_mm(qdyt, qxt.t(), sdyt.repeat(E), sxt.repeat(E), offs=offs,
                                              out_dtype=BF16, use_fast_accum=True)
            else:
                dw = torch._grouped_mm(dy.t(), x, offs=offs)
        return dx, dw, None, None


def fc1(key, c):
    x, W1, m = c.x, c.W1, c.m
    if key == "torch_bf16":
        return lambda: torch._grouped_mm(x, W1.transpose(1, 2), offs=offsets(m))
    if key == "torch_fp8":
        return lambda: _fp8_fprop(x, W1, offsets(m))
    if key == "torch_fp8_gemm":
        qx, sx = _fp8_rowwise(x)
        qw, sw = _fp8_rowwise(W1)
        offs = offsets(m)
        return lambda: torch._scaled_grouped_mm(qx, qw.transpose(1, 2), sx, sw, offs=offs, out_dtype=BF16,
                                                use_fast_accum=True)
    raise KeyError(key)


def mlp(key, c):
    W1, W2, F = c.W1g, c.W2g, c.F
    if key == "torch_bf16":
        def fwd(x, m, p):
            offs = offsets(m)
            h = TorchGroupedLinearBF16.apply(x, W1, offs)
            return TorchGroupedLinearBF16.apply(swiglu_probs(h, p, F), W2, offs)
        return MLPImpl(fwd, [W1, W2])
    if key == "torch_fp8":
        fp8_wgrad = c.kind == "aligned"

        def fwd(x, m, p):
            offs = offsets(m)
            h = _GroupedLinearFP8.apply(x, W1, offs, fp8_wgrad)
            return _GroupedLinearFP8.apply(swiglu_probs(h, p, F), W2, offs, fp8_wgrad)
        return MLPImpl(fwd, [W1, W2])
    raise KeyError(key)
