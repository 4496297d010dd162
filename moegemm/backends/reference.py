"""The layer entries of the reference path: ``linear_fwd, linear_bwd, mlp_fwd, mlp_bwd`` with the
signatures and return conventions of the C++ ops (``torch.ops.moegemm.*``, see ``csrc/api/layers.h``),
built from the reference primitives of ``reference.py``. The autograd shells (``functional.py``,
``mlp.py``) call these or the C++ ops through ``backend.select``, the same way.

The primitives are re-exported, so that this module offers the whole backend interface as ``cuda_ops``
does. Parts not asked for come back as None (the C++ ops return [0] placeholders; the shells look at their
``need_*`` flags, never at these values). Sums (bias and probs gradients) are fp32; the shells cast.
"""

from __future__ import annotations

import torch

from .. import reference as R
from ..layout import ACTIVATION_NAMES, FP8_BLOCKWISE, wgrad_dtype
from ..reference import (act_backward_bf16, act_backward_quantize, act_bf16, act_quantize,  # noqa: F401
                        gemm_bf16_dgrad, gemm_bf16_fprop, gemm_bf16_wgrad, gemm_fp8_ragged_k, gemm_fp8_ragged_m,
                        make_plan, quantize_act, quantize_weight, requantize_cols)


def _add_bias(y, bias, plan):
    return y if bias is None else R.add_bias_(y, bias, plan)


def _weight_grad(gemm, operands: tuple, plan, weight, main_grad):
    """``gemm(*operands, plan)`` accumulated into main_grad (then None), or a fresh dw."""
    dw = gemm(*operands, plan, out=main_grad, out_dtype=wgrad_dtype(weight))
    return None if main_grad is not None else dw


# ------------------------------------------------------------------------------------- grouped linear
def _x_fp8(x, x_scales, plan, cols: bool):
    """(q, s, qT, sT) of x: quantized here (bf16 x), or an FP8 x's rows as given with their column copy
    made from them (x_scales given)."""
    if x_scales is None:
        return R.quantize_act(x, plan, rows=True, cols=cols)
    if x.dtype != R.FP8:
        raise TypeError(f"x given with x_scales must be float8_e4m3fn, got {x.dtype}")
    qT, sT = R.requantize_cols(x, x_scales, plan) if cols else (None, None)
    return x, x_scales, qT, sT


def _out_dtype(x):
    return torch.bfloat16 if x.dtype == R.FP8 else x.dtype


def linear_fwd(x, weight, m_splits, bias, recipe: int, need_dx: bool, need_dw: bool, x_scales=None, fp8_weight=None):
    """-> (y, plan, saved): fp8 saved [qxT, sxT, qwT, swT]; bf16 saved [w in x's dtype]. With x_scales, x is
    FP8 (the row copy of quantize_act; fp8_blockwise only) and y is bf16. fp8_weight: empty, or
    quantize_weight(weight) kept by the caller (then saved has None for qwT, swT: linear_bwd gets them)."""
    plan = R.make_plan(m_splits, x.shape[0])
    if x_scales is not None and recipe != FP8_BLOCKWISE:
        raise ValueError("an FP8 x (x_scales given) needs the fp8_blockwise recipe")
    if recipe == FP8_BLOCKWISE:
        qx, sx, qxT, sxT = _x_fp8(x, x_scales, plan, need_dw)
        given = len(fp8_weight or ()) == 4
        qw, sw, qwT, swT = fp8_weight if given else R.quantize_weight(weight.contiguous())
        y = R.gemm_fp8_ragged_m(qx, sx, qw, sw, plan, _out_dtype(x))
        keep = need_dx and not given
        saved = [qxT, sxT, qwT if keep else None, swT if keep else None]
    else:
        w = weight.to(x.dtype).contiguous()
        y = R.gemm_bf16_fprop(x, w, plan)
        saved = [w if need_dx else None]
    return _add_bias(y, bias, plan), plan, saved


def linear_bwd(dy, plan, saved, x, weight, main_grad, recipe: int, need_dx: bool, need_dw: bool, need_db: bool,
               defer_wgrad: bool = False, fp8_weight=None):
    """-> (dx, dw (None when accumulated into main_grad or deferred), db fp32, made0, made1): with
    defer_wgrad (and need_dw) the weight gradient is left to linear_wgrad over fp8 [qdyT, sdyT, qxT, sxT] /
    bf16 [dy, x]; made0, made1 are the ones made here (fp8 qdyT, sdyT; bf16 none), the caller keeps the
    rest. Else (and for bf16) they are None."""
    dy = dy.contiguous()
    dx = dw = db = None
    defer = defer_wgrad and need_dw
    operands = [None, None]
    if recipe == FP8_BLOCKWISE:
        qxT, sxT, qwT, swT = saved
        if len(fp8_weight or ()) == 4:  # the caller's kept copies (linear_fwd saved no Wᵀ)
            qwT, swT = fp8_weight[2], fp8_weight[3]
        if need_dx or need_dw:
            qdy, sdy, qdyT, sdyT = R.quantize_act(dy, plan, rows=need_dx, cols=need_dw)
        if need_dx:
            dx = R.gemm_fp8_ragged_m(qdy, sdy, qwT, swT, plan, dy.dtype)
        if defer:
            operands = [qdyT, sdyT]
        elif need_dw:
            dw = _weight_grad(R.gemm_fp8_ragged_k, (qdyT, sdyT, qxT, sxT), plan, weight, main_grad)
    else:
        (w,) = saved
        if need_dx:
            dx = R.gemm_bf16_dgrad(dy, w, plan)
        if defer:
            pass  # dy and x: the caller has them
        elif need_dw:
            dw = _weight_grad(R.gemm_bf16_wgrad, (dy, x), plan, weight, main_grad)
    if need_db:
        db = R.bias_grad(dy, plan)
    return dx, dw, db, *operands


def _deferred_weight_grad(operands, plan, weight, main_grad, recipe: int):
    if recipe == FP8_BLOCKWISE:
        return _weight_grad(R.gemm_fp8_ragged_k, tuple(operands[:4]), plan, weight, main_grad)
    return _weight_grad(R.gemm_bf16_wgrad, tuple(operands[:2]), plan, weight, main_grad)


def linear_wgrad(plan, wgrad_operands, weight, main_grad, recipe: int):
    """The deferred weight gradient of a ``defer_wgrad`` linear_bwd: dw, or None when accumulated into main_grad."""
    return _deferred_weight_grad(wgrad_operands, plan, weight, main_grad, recipe)


# ----------------------------------------------------------------------------------------- expert MLP
def _fp8_weight(fp8_weights, i: int, w):
    return tuple(fp8_weights[4 * i: 4 * i + 4]) if fp8_weights else R.quantize_weight(w.contiguous())


def mlp_fwd(x, fc1_weight, fc2_weight, m_splits, fc1_bias, fc2_bias, probs, activation: int, recipe: int, fp8_weights,
            save: bool, need_dw1: bool, need_dw2: bool, x_scales=None):
    """-> (y, plan, saved); saved (empty unless ``save``): fp8 [qxT, sxT, h, qaT, saT, qw1T, sw1T, qw2T, sw2T]
    (the weights' parts None when ``fp8_weights`` holds them), bf16 [h, a, w1, w2] in x's dtype."""
    act = ACTIVATION_NAMES[activation]
    plan = R.make_plan(m_splits, x.shape[0])
    p32 = probs.float() if probs is not None else None
    if x_scales is not None and recipe != FP8_BLOCKWISE:
        raise ValueError("an FP8 x (x_scales given) needs the fp8_blockwise recipe")
    if recipe == FP8_BLOCKWISE:
        qw1, sw1, qw1T, sw1T = _fp8_weight(fp8_weights, 0, fc1_weight)
        qx, sx, qxT, sxT = _x_fp8(x, x_scales, plan, need_dw1)
        h = _add_bias(R.gemm_fp8_ragged_m(qx, sx, qw1, sw1, plan, _out_dtype(x)), fc1_bias, plan)
        qw2, sw2, qw2T, sw2T = _fp8_weight(fp8_weights, 1, fc2_weight)
        qa, sa, qaT, saT = R.act_quantize(h, p32, act, plan, rows=True, cols=need_dw2)
        y = R.gemm_fp8_ragged_m(qa, sa, qw2, sw2, plan, _out_dtype(x))
        weights_T = [None] * 4 if fp8_weights else [qw1T, sw1T, qw2T, sw2T]
        saved = [qxT, sxT, h, qaT, saT, *weights_T]
    else:
        w1, w2 = fc1_weight.to(x.dtype).contiguous(), fc2_weight.to(x.dtype).contiguous()
        h = _add_bias(R.gemm_bf16_fprop(x, w1, plan), fc1_bias, plan)
        a = R.act_bf16(h, p32, act)
        y = R.gemm_bf16_fprop(a, w2, plan)
        saved = [h, a, w1, w2]
    return _add_bias(y, fc2_bias, plan), plan, saved if save else []


def mlp_bwd(dy, plan, saved, x, fc1_weight, fc2_weight, probs, fp8_weights, fc1_main_grad, fc2_main_grad,
            activation: int, recipe: int, need_dx: bool, need_dw1: bool, need_dw2: bool, need_db1: bool, need_db2: bool,
            need_dprobs: bool, release_saved: bool, defer_wgrad: bool = False):
    """-> (dx, dw1, dw2, db1 fp32, db2 fp32, dprobs fp32, made0, made1, made2, made3); ``release_saved`` is
    for the C++ op only. With defer_wgrad (and a weight gradient needed) dw1/dw2 are None and mlp_wgrad takes
    fp8 [qdyT, sdyT, qaT, saT, qdhT, sdhT, qxT, sxT] / bf16 [dy, a, dh, x]; made0..3 are the ones made here
    (fp8 qdyT, sdyT, qdhT, sdhT; bf16 dh), the caller keeps the saved rest; None where not made."""
    act = ACTIVATION_NAMES[activation]
    dy = dy.contiguous()
    p32 = probs.float() if probs is not None else None
    need_dh = need_dx or need_dw1 or need_db1
    dx = dw1 = dw2 = db1 = dprobs = None
    defer = defer_wgrad and (need_dw1 or need_dw2)
    fp8 = recipe == FP8_BLOCKWISE
    operands = [None] * 4
    if fp8:
        qxT, sxT, h, qaT, saT, qw1T, sw1T, qw2T, sw2T = saved
        if fp8_weights:
            qw1T, sw1T, qw2T, sw2T = fp8_weights[2], fp8_weights[3], fp8_weights[6], fp8_weights[7]
        qdy, sdy, qdyT, sdyT = R.quantize_act(dy, plan, rows=need_dh or need_dprobs, cols=need_dw2)
        if need_dw2 and defer:
            operands[:2] = [qdyT, sdyT]
        elif need_dw2:
            dw2 = _weight_grad(R.gemm_fp8_ragged_k, (qdyT, sdyT, qaT, saT), plan, fc2_weight, fc2_main_grad)
        if need_dh or need_dprobs:
            da = R.gemm_fp8_ragged_m(qdy, sdy, qw2T, sw2T, plan, dy.dtype)
            qdh, sdh, qdhT, sdhT, dprobs = R.act_backward_quantize(da, h, p32, act, plan, rows=need_dx, cols=need_dw1)
            if need_db1:  # fc1's bias gradient needs dh itself (in bf16), which the fused kernel only quantizes
                db1 = R.bias_grad(R.act_backward_bf16(da, h, p32, act)[0], plan)
            if need_dx:
                dx = R.gemm_fp8_ragged_m(qdh, sdh, qw1T, sw1T, plan, dy.dtype)
            if need_dw1 and defer:
                operands[2:] = [qdhT, sdhT]
            elif need_dw1:
                dw1 = _weight_grad(R.gemm_fp8_ragged_k, (qdhT, sdhT, qxT, sxT), plan, fc1_weight, fc1_main_grad)
    else:
        h, a, w1, w2 = saved
        if need_dw2 and defer:
            pass  # dy and a: the caller has them
        elif need_dw2:
            dw2 = _weight_grad(R.gemm_bf16_wgrad, (dy, a), plan, fc2_weight, fc2_main_grad)
        if need_dh or need_dprobs:
            da = R.gemm_bf16_dgrad(dy, w2, plan)
            dh, dprobs = R.act_backward_bf16(da, h, p32, act)
            if need_dx:
                dx = R.gemm_bf16_dgrad(dh, w1, plan)
            if need_dw1 and defer:
                operands[0] = dh
            elif need_dw1:
                dw1 = _weight_grad(R.gemm_bf16_wgrad, (dh, x), plan, fc1_weight, fc1_main_grad)
            if need_db1:
                db1 = R.bias_grad(dh, plan)
    db2 = R.bias_grad(dy, plan) if need_db2 else None
    return dx, dw1, dw2, db1, db2, dprobs if need_dprobs else None, *operands


def mlp_wgrad(plan, wgrad_operands, fc1_weight, fc2_weight, fc1_main_grad, fc2_main_grad, recipe: int, need_dw1: bool,
              need_dw2: bool):
    """The deferred weight gradients (dw1, dw2) of a ``defer_wgrad`` mlp_bwd (None where not needed or
    accumulated into a main_grad)."""
    n = 4 if recipe == FP8_BLOCKWISE else 2
    dw2 = _deferred_weight_grad(wgrad_operands[:n], plan, fc2_weight, fc2_main_grad, recipe) if need_dw2 else None
    dw1 = _deferred_weight_grad(wgrad_operands[n:], plan, fc1_weight, fc1_main_grad, recipe) if need_dw1 else None
    return dw1, dw2
