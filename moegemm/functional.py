"""``grouped_linear``: the differentiable grouped GEMM of SPEC §2.

The autograd Function is a thin shell: it validates nothing (the public function does, once) and calls
the backend chosen in ``backend.py`` — the CUDA ops or the reference, which share one interface.
For ``fp8_blockwise`` the forward quantizes ``x`` once into its row copy (fprop) and its per-expert
transposed copy (saved for wgrad), so backward never re-reads ``x`` in bf16.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import backend
from ._validate import (SplitsLike, check_bias, check_main_grad, check_recipe, check_weight, check_x,
                        splits_to_device)


def _forward(x, weight, bias, plan, recipe, need_dx: bool, need_dw: bool):
    """y and the tensors backward needs (quantized copies for fp8, bf16 operands otherwise)."""
    ops = backend.select(x.device)
    if recipe == "fp8_blockwise":
        qx, sx, qxT, sxT = ops.quantize_act(x, plan, rows=True, cols=need_dw)
        qw, sw, qwT, swT = ops.quantize_weight(weight.contiguous())
        y = ops.gemm_fp8_ragged_m(qx, sx, qw, sw, plan, x.dtype)
        saved = (qxT, sxT, qwT if need_dx else None, swT if need_dx else None)
    else:
        w = weight.to(x.dtype).contiguous()
        y = ops.gemm_bf16_fprop(x, w, plan)
        saved = (x if need_dw else None, w if need_dx else None)
    return add_bias(y, bias, plan), saved


def add_bias(y, bias, plan):
    """``y[t] += bias[e(t)]`` on the covered tokens, in place on y (a fresh GEMM output)."""
    return y if bias is None else backend.select(y.device).add_bias_(y, bias, plan)


def bias_grad(dy, plan, dtype):
    """``dbias[e] = Σ_{t ∈ e} dy[t]`` (fp32 sums, bitwise reproducible), without a host sync."""
    return backend.select(dy.device).bias_grad(dy, plan).to(dtype)


def refuse_double_backward(what: str) -> None:
    """Backward under create_graph=True would build a graph whose second derivatives are wrong (the
    kernels are not differentiable): refuse it. (torch.compile refuses double backward by itself.)"""
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        raise RuntimeError(f"moegemm: {what} is not twice differentiable: its backward cannot run with "
                           "create_graph=True (double backward)")


def weight_grad_target(weight, need_dw: bool):
    """Megatron's gradient-accumulation fusion: wgrad goes into ``weight.main_grad`` when it exists.
    Checked again here: the attribute may have been replaced between forward and backward."""
    if not need_dw:
        return None
    check_main_grad(weight)
    return getattr(weight, "main_grad", None)


def wgrad_dtype(weight) -> torch.dtype:
    """The wgrad GEMMs write bf16 directly for bf16 weights, fp32 otherwise (no fp32 round trip)."""
    return torch.bfloat16 if weight.dtype == torch.bfloat16 else torch.float32


def finish_weight_grad(dw, weight, main_grad):
    """The gradient autograd returns for ``weight``: None when it went into main_grad."""
    return None if dw is None or main_grad is not None else dw.to(weight.dtype)


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, plan, recipe):
        y, saved = _forward(x, weight, bias, plan, recipe, *ctx.needs_input_grad[:2])
        ctx.save_for_backward(*saved, plan)
        ctx.recipe, ctx.weight = recipe, weight
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y

    @staticmethod
    def backward(ctx, dy):
        refuse_double_backward("grouped_linear")
        ops = backend.select(dy.device)
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dy = dy.contiguous()
        main_grad = weight_grad_target(ctx.weight, need_dw)
        dx = dw = db = None
        if ctx.recipe == "fp8_blockwise":
            qxT, sxT, qwT, swT, plan = ctx.saved_tensors
            if need_dx or need_dw:
                qdy, sdy, qdyT, sdyT = ops.quantize_act(dy, plan, rows=need_dx, cols=need_dw)
            if need_dx:
                dx = ops.gemm_fp8_ragged_m(qdy, sdy, qwT, swT, plan, dy.dtype)
            if need_dw:
                dw = ops.gemm_fp8_ragged_k(qdyT, sdyT, qxT, sxT, plan, out=main_grad, out_dtype=wgrad_dtype(ctx.weight))
        else:
            x, w, plan = ctx.saved_tensors
            if need_dx:
                dx = ops.gemm_bf16_dgrad(dy, w, plan)
            if need_dw:
                dw = ops.gemm_bf16_wgrad(dy, x, plan, out=main_grad, out_dtype=wgrad_dtype(ctx.weight))
        dw = finish_weight_grad(dw, ctx.weight, main_grad)
        db = bias_grad(dy, plan, ctx.bias_dtype) if need_db else None
        return dx, dw, db, None, None


def grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    m_splits: SplitsLike,
    bias: Optional[torch.Tensor] = None,
    recipe: str = "fp8_blockwise",
    check_splits: Optional[bool] = None,
) -> torch.Tensor:
    """``y[t] = x[t] @ weight[e(t)]ᵀ (+ bias[e(t)])`` for tokens packed by expert.

    x: ``[T, K]``; weight: ``[E, N, K]``; m_splits: ``E`` token counts (list, CPU tensor, or an
    int32/int64 tensor on x's device, which is never read on the host); bias: ``[E, N]``;
    recipe: ``"fp8_blockwise"`` or ``"bf16"``. ``check_splits`` (or ``MOEGEMM_CHECK_SPLITS=1``)
    validates device ``m_splits`` on the device, at the cost of one sync.
    If ``weight`` has a ``main_grad`` attribute (fp32), its gradient is accumulated there instead.
    """
    check_recipe(recipe)
    check_weight(weight)
    E, N, K = weight.shape
    check_x(x, K, weight.device, cuda_path=backend.uses_cuda(weight.device))
    check_bias(bias, E, N, weight.device)
    check_main_grad(weight)
    m = splits_to_device(m_splits, E, x.shape[0], x.device, check_splits)  # the first device work
    ops = backend.select(x.device)
    plan = ops.make_plan(m, x.shape[0])
    if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return _forward(x, weight, bias, plan, recipe, need_dx=False, need_dw=False)[0]  # inference
    return _GroupedLinear.apply(x, weight, bias, plan, recipe)
