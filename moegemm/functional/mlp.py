"""The expert MLP for training: fc1 -> activation x router probs -> fc2, forward and backward.

The public function checks its arguments once on the host and chooses the op: on the CUDA backend one
differentiable op, ``grouped_mlp`` (forward and backward as one C++ autograd node, ``csrc/api/autograd.h``);
on the reference backend, and for a split backward, the autograd Function below, a thin shell that calls one
op per direction, ``mlp_fwd`` and ``mlp_bwd``, of the backend chosen by ``moegemm.backends.select``. Both run
the same entries (``csrc/api/grouped_mlp.cpp`` or the reference ones: ``backends/contract.py``). For
``fp8_blockwise`` the activation is fused with the FP8 quantization of its result, and its backward with
quantizing the gradient, so no bf16 copy of the activation is written or saved. Saved for backward: the FP8 copies
(x's row copy, from which backward makes fc1 wgrad's column copy; the activation's column copy; the weights'
transposed copies) and fc1's bf16 output h; the backward op frees each after its last use.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import backends
from .._validate import (SplitsLike, check_activation, check_bias, check_fp8_weight_pair, check_fp8_weights_recipe,
                         check_main_grad, check_mlp_weights, check_probs, check_recipe, splits_to_device)
from ..backends import contract
from ..layout import ACTIVATIONS, BF16, RECIPE_IDS
from .grads import (WgradStore, add_grad, check_deferrable, check_wgrad_store, drops_on_failure, finish_sum,
                    finish_weight_grad, grad_target, overwrites_main_grad, refuse_double_backward,
                    refuse_split_backward_in_fullgraph, weight_grad_target)
from .inputs import split_x

_RELEASED = "released"


def _stash(ctx, tensors) -> None:
    """Keep the tensors backward needs. Eager mode keeps them in a list on ctx that backward hands over
    to the op, which frees each one as soon as its last use is done (the FP8 weight copies and h do not
    wait for the whole backward: peak memory); a torch.compile trace uses save_for_backward."""
    if torch.compiler.is_compiling():
        ctx.save_for_backward(*tensors)
        ctx.stash = None
    else:
        ctx.stash = list(tensors)


def _unstash(ctx):
    """(the tensors of _stash, whether the op may free them): handed over in eager mode (ctx keeps no
    reference), kept by autograd in a torch.compile trace."""
    if ctx.stash is None:
        return list(ctx.saved_tensors), False
    if ctx.stash is _RELEASED:
        raise RuntimeError("moegemm: GroupedMLP's backward ran a second time over the same graph; it frees its "
                           "saved tensors during the first one (retain_graph=True is not supported)")
    tensors, ctx.stash = ctx.stash, _RELEASED
    return tensors, True


_WGRAD_GATHER = {recipe: contract.MLP.wgrad_gather(recipe) for recipe in RECIPE_IDS.values()}


def _mlp_wgrad_job(plan, operands, w1, w2, recipe: int, need_dw1: bool, need_dw2: bool):
    def job():
        t1 = grad_target(w1) if need_dw1 else None
        t2 = grad_target(w2) if need_dw2 else None
        dw1, dw2 = backends.select(plan.device).mlp_wgrad(plan, operands, w1, w2, t1, t2, recipe, need_dw1, need_dw2,
                                                          overwrites_main_grad(w1, t1), overwrites_main_grad(w2, t2))
        if need_dw2:
            add_grad(w2, None if t2 is not None else dw2)
        if need_dw1:
            add_grad(w1, None if t1 is not None else dw1)
    return job


class _GroupedMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, w2, b1, b2, probs, m_splits, activation: int, recipe: int, fp8_weights: list, x_fp8,
                x_scales, store):
        """x: the bf16 input, or with an FP8 input (x_fp8, x_scales) the tensor that receives dx (or None)."""
        need_dw1, need_dw2 = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        x_op = x_fp8 if x_scales is not None else x
        y, plan, saved = backends.select(x_op.device).mlp_fwd(x_op, w1, w2, m_splits, b1, b2, probs, activation, recipe,
                                                             fp8_weights, True, need_dw1, need_dw2, x_scales)
        # wgrad's x: the bf16 recipe's, or an FP8 x's row copy and scales (the fp8 recipe saves a bf16 x's own)
        fp8_x = x_scales is not None and need_dw1
        _stash(ctx, (plan, x if recipe == BF16 else x_fp8 if fp8_x else None, x_scales if fp8_x else None, w1, w2,
                     probs, *fp8_weights, *saved))
        ctx.activation, ctx.recipe, ctx.num_fp8_weights = activation, recipe, len(fp8_weights)
        ctx.w1, ctx.w2, ctx.store = w1, w2, store
        ctx.b1_dtype = b1.dtype if b1 is not None else None
        ctx.b2_dtype = b2.dtype if b2 is not None else None
        ctx.probs_dtype = probs.dtype if probs is not None else None
        return y

    @staticmethod
    def backward(ctx, dy):
        refuse_double_backward("grouped_mlp")
        need_dx, need_dw1, need_dw2, need_db1, need_db2, need_dp = ctx.needs_input_grad[:6]
        defer = ctx.store is not None and (need_dw1 or need_dw2)
        mg1, mg2 = (None, None) if defer else (weight_grad_target(ctx.w1, need_dw1, "fc1_weight"),
                                               weight_grad_target(ctx.w2, need_dw2, "fc2_weight"))
        tensors, release = _unstash(ctx)
        (plan, x, x_scales, w1, w2, probs), rest = tensors[:6], tensors[6:]
        fp8_weights, saved = rest[:ctx.num_fp8_weights], rest[ctx.num_fp8_weights:]
        del tensors, rest  # the op holds the last references to what it frees
        with drops_on_failure(ctx.store):
            dx, dw1, dw2, db1, db2, dp, *made = backends.select(dy.device).mlp_bwd(
                dy, plan, saved, x, w1, w2, probs, fp8_weights, mg1, mg2, ctx.activation, ctx.recipe, need_dx, need_dw1,
                need_dw2, need_db1, need_db2, need_dp, release, defer, x_scales, overwrites_main_grad(ctx.w1, mg1),
                overwrites_main_grad(ctx.w2, mg2))
            if defer:  # the wgrad op's operands, by name (contract.MLP); the op never frees the saved ones it needs
                pool = (*made, *saved, dy.contiguous(), x)
                operands = [pool[i] for i in _WGRAD_GATHER[ctx.recipe]]
                ctx.store.push(_mlp_wgrad_job(plan, operands, ctx.w1, ctx.w2, ctx.recipe, need_dw1, need_dw2))
                dw1 = dw2 = None
        return (dx if need_dx else None, None if defer else finish_weight_grad(dw1, need_dw1, ctx.w1, mg1),
                None if defer else finish_weight_grad(dw2, need_dw2, ctx.w2, mg2), finish_sum(db1, need_db1, ctx.b1_dtype),
                finish_sum(db2, need_db2, ctx.b2_dtype), finish_sum(dp, need_dp, ctx.probs_dtype),
                None, None, None, None, None, None, None)


def grouped_mlp(x: torch.Tensor, fc1_weight: torch.Tensor, fc2_weight: torch.Tensor, m_splits: SplitsLike,
                probs: Optional[torch.Tensor] = None, fc1_bias: Optional[torch.Tensor] = None,
                fc2_bias: Optional[torch.Tensor] = None, activation: str = "swiglu", recipe: str = "fp8_blockwise",
                fp8_weights=None, check_splits: Optional[bool] = None,
                wgrad_store: Optional[WgradStore] = None) -> torch.Tensor:
    """``fc2(act(fc1(x)) * probs)`` per expert; fc1_weight ``[E, F1, H]`` (F1 = 2F for GLU activations,
    gate rows first), fc2_weight ``[E, H, F]``; probs ``[T]`` (any float dtype) or None.
    ``fp8_weights``: ``(quantize_weight(fc1_weight), quantize_weight(fc2_weight))`` to reuse.
    ``x`` may be FP8: ``Fp8Rows(q, s, grad_target)`` (fp8_blockwise only; dx goes to grad_target).
    ``wgrad_store``: split backward, the weight gradients wait there until ``wgrad_store.backward_dw()`` (the
    weights must be leaves: the deferred gradients go to their main_grad or ``.grad``)."""
    check_recipe(recipe)
    check_activation(activation)
    E, F1, H, _ = check_mlp_weights(fc1_weight, fc2_weight, activation)
    x, x_fp8, x_scales = split_x(x, H, fc1_weight.device, recipe, backends.uses_cuda(fc1_weight.device))
    x_dev = x_fp8 if x_scales is not None else x
    check_bias(fc1_bias, E, F1, fc1_weight.device, "fc1_bias")
    check_bias(fc2_bias, E, H, fc1_weight.device, "fc2_bias")
    check_main_grad(fc1_weight, "fc1_weight")
    check_main_grad(fc2_weight, "fc2_weight")
    T = x_dev.shape[0]
    check_probs(probs, T, x_dev.device)
    check_wgrad_store(wgrad_store)
    inputs = (x, fc1_weight, fc2_weight, fc1_bias, fc2_bias, probs)
    records_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)
    check_fp8_weights_recipe(fp8_weights, recipe, "fp8_weights")
    if recipe == "fp8_blockwise":
        check_fp8_weight_pair(fp8_weights, fc1_weight, fc2_weight, records_grad)
    m = splits_to_device(m_splits, E, T, x_dev.device, check_splits)  # the first device work
    fp8 = [t for w in fp8_weights for t in w] if fp8_weights and recipe == "fp8_blockwise" else []
    act_id, recipe_id = ACTIVATIONS[activation], RECIPE_IDS[recipe]
    ops = backends.select(x_dev.device)
    if ops.LAYER_AUTOGRAD and wgrad_store is None:  # one C++ node, with grad or without
        return ops.grouped_mlp(x_dev, fc1_weight, fc2_weight, m, fc1_bias, fc2_bias, probs, act_id, recipe_id, fp8,
                               x_scales, x if x_scales is not None else None)
    if not records_grad:  # inference
        return ops.mlp_fwd(x_dev, fc1_weight, fc2_weight, m, fc1_bias, fc2_bias, probs, act_id, recipe_id, fp8, False,
                           False, False, x_scales)[0]
    if wgrad_store is not None:
        check_deferrable(("fc1_weight", fc1_weight), ("fc2_weight", fc2_weight))
        refuse_split_backward_in_fullgraph()
    apply = _GroupedMLP.apply if wgrad_store is None else _apply_deferred
    return apply(*inputs, m, act_id, recipe_id, fp8, x_fp8, x_scales, wgrad_store)


@torch.compiler.disable
def _apply_deferred(*args):
    """The split-backward MLP outside torch.compile's graphs (its backward pushes work into a Python store)."""
    return _GroupedMLP.apply(*args)
