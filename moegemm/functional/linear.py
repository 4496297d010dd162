"""``grouped_linear``: the differentiable grouped GEMM of docs/design.md#operations.

The public function checks its arguments once on the host (``_validate.py``) and chooses the op. On the
CUDA backend that is one differentiable op, ``grouped_linear`` (forward and backward as one C++ autograd
node, ``csrc/api/autograd.h``); on the reference backend, and for a split backward, the autograd Function
below, a thin shell that calls one op per direction, ``linear_fwd`` and ``linear_bwd``, of the backend
chosen by ``moegemm.backends.select``. Both run the same entries (``csrc/api/grouped_linear.cpp`` or the
reference ones, which share one contract: ``backends/contract.py``). For ``fp8_blockwise`` the forward
quantizes ``x`` once into its FP8 row copy (fprop's operand, saved), and backward makes wgrad's per-expert
column copy from that row copy, so it never re-reads ``x`` in bf16.

Two options:
* an FP8 ``x`` (``Fp8Rows``: quantize_act's row copy and scales, as an FP8 dispatcher delivers it): fprop
  reads the rows as they are, backward makes wgrad's column copy from them on the device, as from a bf16
  ``x``'s own row copy; dx (bf16) goes to ``Fp8Rows.grad_target``;
* a split backward (``wgrad_store``): backward computes dx and db, and leaves the weight gradient, with
  the FP8 column copies it needs, in the store until ``store.backward_dw()``.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import backends
from .._validate import (SplitsLike, check_bias, check_fp8_weight, check_fp8_weights_recipe, check_main_grad, check_recipe,
                         check_weight, splits_to_device)
from ..backends import contract
from ..layout import BF16, RECIPE_IDS
from .grads import (WgradStore, add_grad, check_deferrable, check_wgrad_store, drops_on_failure, finish_sum,
                    finish_weight_grad, grad_target, overwrites_main_grad, refuse_double_backward,
                    refuse_split_backward_in_fullgraph, weight_grad_target)
from .inputs import split_x

_WGRAD_GATHER = {recipe: contract.LINEAR.wgrad_gather(recipe) for recipe in RECIPE_IDS.values()}


def _linear_wgrad_job(plan, operands, weight, recipe: int):
    def job():
        target = grad_target(weight)
        dw = backends.select(plan.device).linear_wgrad(plan, operands, weight, target, recipe,
                                                       overwrites_main_grad(weight, target))
        add_grad(weight, None if target is not None else dw)
    return job


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, m_splits, recipe: int, x_fp8, x_scales, store, fp8_weight: list):
        """x: the bf16 input, or with an FP8 input (x_fp8, x_scales) the tensor that receives dx (or None).
        fp8_weight: [] or the weight's kept FP8 copies (quantize_weight), also handed to backward."""
        need_dx, need_dw = ctx.needs_input_grad[:2]
        x_op = x_fp8 if x_scales is not None else x
        y, plan, saved = backends.select(x_op.device).linear_fwd(x_op, weight, m_splits, bias, recipe, need_dx, need_dw,
                                                                x_scales, fp8_weight or None)
        # wgrad's x: the bf16 recipe's, or an FP8 x's row copy and scales (the fp8 recipe saves a bf16 x's own)
        fp8_x = x_scales is not None and need_dw
        ctx.save_for_backward(plan, x if recipe == BF16 and need_dw else x_fp8 if fp8_x else None,
                              x_scales if fp8_x else None, weight, *fp8_weight, *saved)
        ctx.recipe, ctx.weight, ctx.store, ctx.num_fp8 = recipe, weight, store, len(fp8_weight)
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y

    @staticmethod
    def backward(ctx, dy):
        refuse_double_backward("grouped_linear")
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        plan, x, x_scales, weight, *rest = ctx.saved_tensors
        fp8_weight, saved = rest[:ctx.num_fp8], rest[ctx.num_fp8:]
        defer = ctx.store is not None and need_dw
        main_grad = None if defer else weight_grad_target(ctx.weight, need_dw)
        with drops_on_failure(ctx.store):
            dx, dw, db, *made = backends.select(dy.device).linear_bwd(
                dy, plan, saved, x, weight, main_grad, ctx.recipe, need_dx, need_dw, need_db, defer, fp8_weight or None,
                x_scales, overwrites_main_grad(ctx.weight, main_grad))
            if defer:  # the wgrad op's operands, by name from what this backward has (contract.LINEAR)
                pool = (*made, *saved, dy.contiguous(), x)
                operands = [pool[i] for i in _WGRAD_GATHER[ctx.recipe]]
                ctx.store.push(_linear_wgrad_job(plan, operands, ctx.weight, ctx.recipe))
        return (dx if need_dx else None, None if defer else finish_weight_grad(dw, need_dw, ctx.weight, main_grad),
                finish_sum(db, need_db, ctx.bias_dtype), None, None, None, None, None, None)


def grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    m_splits: SplitsLike,
    bias: Optional[torch.Tensor] = None,
    recipe: str = "fp8_blockwise",
    check_splits: Optional[bool] = None,
    wgrad_store: Optional[WgradStore] = None,
    fp8_weight=None,
) -> torch.Tensor:
    """``y[t] = x[t] @ weight[e(t)]ᵀ (+ bias[e(t)])`` for tokens packed by expert.

    x: ``[T, K]``; weight: ``[E, N, K]``; m_splits: ``E`` token counts (list, CPU tensor, or an
    int32/int64 tensor on x's device, which is never read on the host); bias: ``[E, N]``;
    recipe: ``"fp8_blockwise"`` or ``"bf16"``. ``check_splits`` (or ``MOEGEMM_CHECK_SPLITS=1``)
    validates device ``m_splits`` on the device, at the cost of one sync.
    If ``weight`` has a ``main_grad`` attribute (fp32), its gradient is accumulated there instead (written there
    when ``weight.overwrite_main_grad`` is true, as Megatron-FSDP sets it).

    ``x`` may be FP8: ``Fp8Rows(q, s, grad_target)`` (see ``moegemm.to_fp8_rows``), fp8_blockwise only; y is
    bf16 and dx (bf16) goes to ``grad_target`` (none computed without one).
    ``wgrad_store``: split backward; the weight gradient waits in the store until ``wgrad_store.backward_dw()``
    (the weight must be a leaf: the deferred gradient goes to its main_grad or ``.grad``, not through autograd).
    ``fp8_weight``: ``quantize_weight(weight)`` to reuse (fp8_blockwise; ``GroupedLinear`` keeps it).
    """
    check_recipe(recipe)
    check_weight(weight)
    E, N, K = weight.shape
    x, x_fp8, x_scales = split_x(x, K, weight.device, recipe, backends.uses_cuda(weight.device))
    x_dev = x_fp8 if x_scales is not None else x
    check_bias(bias, E, N, weight.device)
    check_main_grad(weight)
    check_wgrad_store(wgrad_store)
    check_fp8_weights_recipe(fp8_weight, recipe, "fp8_weight")
    if fp8_weight is not None and recipe == "fp8_blockwise":
        check_fp8_weight(fp8_weight, weight, "fp8_weight")
    m = splits_to_device(m_splits, E, x_dev.shape[0], x_dev.device, check_splits)  # the first device work
    fp8 = list(fp8_weight) if fp8_weight is not None and recipe == "fp8_blockwise" else []
    ops = backends.select(x_dev.device)
    if ops.LAYER_AUTOGRAD and wgrad_store is None:  # one C++ node, with grad or without
        return ops.grouped_linear(x_dev, weight, m, bias, RECIPE_IDS[recipe], x_scales,
                                  x if x_scales is not None else None, fp8 or None)
    if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return ops.linear_fwd(x_dev, weight, m, bias, RECIPE_IDS[recipe], False, False, x_scales,
                              fp8 or None)[0]  # inference
    if wgrad_store is not None:
        check_deferrable(("weight", weight))
        refuse_split_backward_in_fullgraph()
    apply = _GroupedLinear.apply if wgrad_store is None else _apply_deferred
    return apply(x, weight, bias, m, RECIPE_IDS[recipe], x_fp8, x_scales, wgrad_store, fp8)


@torch.compiler.disable
def _apply_deferred(*args):
    """The split-backward layer outside torch.compile's graphs: its backward pushes work into a Python
    store, a side effect a traced backward cannot hold (a graph break under torch.compile)."""
    return _GroupedLinear.apply(*args)
