"""``grouped_linear``: the differentiable grouped GEMM of SPEC §2.

The public function checks its arguments once on the host (``_validate.py``); the autograd Function is
a thin shell that calls one op per direction, ``linear_fwd`` and ``linear_bwd``, of the backend chosen in
``backend.py`` (the C++ entries of ``csrc/api/grouped_linear.cpp`` or ``reference_api.py``, which share
one interface). For ``fp8_blockwise`` the forward quantizes ``x`` once into its row copy (fprop) and its
per-expert transposed copy (saved for wgrad), so backward never re-reads ``x`` in bf16.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import backend
from ._validate import (SplitsLike, check_bias, check_main_grad, check_recipe, check_weight, check_x,
                        splits_to_device)
from .layout import BF16, RECIPE_IDS


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


def finish_weight_grad(dw, need_dw: bool, weight, main_grad):
    """The gradient autograd returns for ``weight``: None when not needed or when it went into main_grad."""
    return None if not need_dw or main_grad is not None else dw.to(weight.dtype)


def finish_sum(total, needed: bool, dtype):
    """A bias or probs gradient (an fp32 sum from the op) in its parameter's dtype, or None."""
    return total.to(dtype) if needed else None


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, m_splits, recipe: int):
        need_dx, need_dw = ctx.needs_input_grad[:2]
        y, plan, saved = backend.select(x.device).linear_fwd(x, weight, m_splits, bias, recipe, need_dx, need_dw)
        ctx.save_for_backward(plan, x if recipe == BF16 and need_dw else None, weight, *saved)
        ctx.recipe, ctx.weight = recipe, weight
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y

    @staticmethod
    def backward(ctx, dy):
        refuse_double_backward("grouped_linear")
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        plan, x, weight, *saved = ctx.saved_tensors
        main_grad = weight_grad_target(ctx.weight, need_dw)
        dx, dw, db = backend.select(dy.device).linear_bwd(dy, plan, saved, x, weight, main_grad, ctx.recipe, need_dx,
                                                          need_dw, need_db)
        return (dx if need_dx else None, finish_weight_grad(dw, need_dw, ctx.weight, main_grad),
                finish_sum(db, need_db, ctx.bias_dtype), None, None)


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
    if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return backend.select(x.device).linear_fwd(x, weight, m, bias, RECIPE_IDS[recipe], False, False)[0]  # inference
    return _GroupedLinear.apply(x, weight, bias, m, RECIPE_IDS[recipe])
