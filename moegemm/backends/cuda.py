"""The CUDA backend: the extension's ``torch.ops.moegemm`` ops with the interface of ``reference_api.py``,
plus their fake (meta) implementations so that torch.compile can trace them.

* The layer entries ``linear_fwd, linear_bwd, mlp_fwd, mlp_bwd`` are the C++ ops themselves (one op per
  layer and direction, ``csrc/api/layers.h``); parts not asked for come back as ``[0]`` placeholders.
* The primitives (one kernel each, for tests and benchmarks) are thin wrappers with the signatures of
  ``reference.py`` (parts not asked for come back as None).
"""

from __future__ import annotations

import torch

from .._build import load_extension
from ..layout import (ACT_BF16_COLS, ACTIVATIONS, BLOCK, FP8_BLOCKWISE, PLAN_ROWS, act_width, block_capacity, ceil_div,
                     col_capacity, wgrad_dtype)

load_extension()
_ops = torch.ops.moegemm

# ------------------------------------------------------------------------------------- layer entries
linear_fwd = _ops.linear_fwd.default
linear_bwd = _ops.linear_bwd.default
mlp_fwd = _ops.mlp_fwd.default
mlp_bwd = _ops.mlp_bwd.default
linear_wgrad = _ops.linear_wgrad.default
mlp_wgrad = _ops.mlp_wgrad.default

_F8, _F32, _BF16 = torch.float8_e4m3fn, torch.float32, torch.bfloat16


def _new(like, shape, dtype, wanted: bool = True):
    """A fake output: ``shape`` when wanted, else the ``[0]`` placeholder of the C++ ops."""
    return like.new_empty(shape if wanted else (0,), dtype=dtype)


def _fake_plan(like, E):
    return like.new_empty((PLAN_ROWS, E + 1), dtype=torch.int32)


def _fake_weight_T(w, wanted: bool):
    """The transposed FP8 copy of w [E, N, K] and its scales: qT [E, K, N], sT [E, Kb, Nb]."""
    E, N, K = w.shape
    return [_new(w, (E, K, N), _F8, wanted), _new(w, (E, ceil_div(K, BLOCK), ceil_div(N, BLOCK)), _F32, wanted)]


def _fake_cols(like, T, E, K, wanted: bool):
    """The per-expert column copy of a [T, K] tensor and its scales."""
    return [_new(like, (K, col_capacity(T, E)), _F8, wanted), _new(like, (block_capacity(T, E), K), _F32, wanted)]


@torch.library.register_fake("moegemm::linear_fwd")
def _(x, weight, m_splits, bias, recipe, need_dx, need_dw, x_scales=None, fp8_weight=None):
    (T, K), (E, N, _) = x.shape, weight.shape
    if recipe == FP8_BLOCKWISE:
        saved = _fake_cols(x, T, E, K, need_dw) + _fake_weight_T(weight, need_dx and not fp8_weight)
    else:
        saved = [_new(x, (E, N, K), _BF16, need_dx and weight.dtype != _BF16)]
    return _new(x, (T, N), _BF16), _fake_plan(x, E), saved


@torch.library.register_fake("moegemm::linear_bwd")
def _(dy, plan, saved, x, weight, main_grad, recipe, need_dx, need_dw, need_db, defer_wgrad=False, fp8_weight=None):
    (E, N, K), T = weight.shape, dy.shape[0]
    defer = defer_wgrad and need_dw
    if recipe == FP8_BLOCKWISE:
        made = _fake_cols(dy, T, E, N, defer)
    else:
        made = [_new(dy, (0,), _BF16), _new(dy, (0,), _BF16)]
    return (_new(dy, (T, K), _BF16, need_dx),
            _new(dy, (E, N, K), wgrad_dtype(weight), need_dw and main_grad is None and not defer),
            _new(dy, (E, N), _F32, need_db), *made)


@torch.library.register_fake("moegemm::linear_wgrad")
def _(plan, wgrad_operands, weight, main_grad, recipe):
    return _new(plan, tuple(weight.shape), wgrad_dtype(weight), main_grad is None)


@torch.library.register_fake("moegemm::mlp_fwd")
def _(x, fc1_weight, fc2_weight, m_splits, fc1_bias, fc2_bias, probs, activation, recipe, fp8_weights, save, need_dw1,
      need_dw2, x_scales=None):
    (T, H), (E, F1, _) = x.shape, fc1_weight.shape
    F = act_width(F1, activation)
    saved = []
    if save and recipe == FP8_BLOCKWISE:
        quantize_here = len(fp8_weights) == 0
        saved = (_fake_cols(x, T, E, H, need_dw1) + [_new(x, (T, F1), _BF16)] + _fake_cols(x, T, E, F, need_dw2)
                 + _fake_weight_T(fc1_weight, quantize_here) + _fake_weight_T(fc2_weight, quantize_here))
    elif save:
        saved = [_new(x, (T, F1), _BF16), _new(x, (T, F), _BF16), _new(x, (E, F1, H), _BF16, fc1_weight.dtype != _BF16),
                 _new(x, (E, H, F), _BF16, fc2_weight.dtype != _BF16)]
    return _new(x, (T, H), _BF16), _fake_plan(x, E), saved


@torch.library.register_fake("moegemm::mlp_bwd")
def _(dy, plan, saved, x, fc1_weight, fc2_weight, probs, fp8_weights, fc1_main_grad, fc2_main_grad, activation, recipe,
      need_dx, need_dw1, need_dw2, need_db1, need_db2, need_dprobs, release_saved, defer_wgrad=False):
    (T, H), (E, F1, _), F = dy.shape, fc1_weight.shape, fc2_weight.shape[2]
    defer = defer_wgrad and (need_dw1 or need_dw2)
    if recipe == FP8_BLOCKWISE:
        made = _fake_cols(dy, T, E, H, defer and need_dw2) + _fake_cols(dy, T, E, F1, defer and need_dw1)
    else:
        made = [_new(dy, (T, F1), _BF16, defer and need_dw1)] + [_new(dy, (0,), _BF16) for _ in range(3)]
    return (_new(dy, (T, H), _BF16, need_dx),
            _new(dy, (E, F1, H), wgrad_dtype(fc1_weight), need_dw1 and fc1_main_grad is None and not defer),
            _new(dy, (E, H, F), wgrad_dtype(fc2_weight), need_dw2 and fc2_main_grad is None and not defer),
            _new(dy, (E, F1), _F32, need_db1), _new(dy, (E, H), _F32, need_db2),
            _new(dy, (T,), _F32, need_dprobs and probs is not None), *made)


@torch.library.register_fake("moegemm::mlp_wgrad")
def _(plan, wgrad_operands, fc1_weight, fc2_weight, fc1_main_grad, fc2_main_grad, recipe, need_dw1, need_dw2):
    return (_new(plan, tuple(fc1_weight.shape), wgrad_dtype(fc1_weight), need_dw1 and fc1_main_grad is None),
            _new(plan, tuple(fc2_weight.shape), wgrad_dtype(fc2_weight), need_dw2 and fc2_main_grad is None))


# ----------------------------------------------------------------------------------------- primitives


def make_plan(m_splits: torch.Tensor, T: int) -> torch.Tensor:
    return _ops.make_plan(m_splits, T)


def quantize_act(x, plan, rows: bool = True, cols: bool = True):
    q, s, qT, sT = _ops.quantize_act(x, plan, rows, cols)
    return (q if rows else None, s if rows else None, qT if cols else None, sT if cols else None)


def quantize_weight(w):
    return _ops.quantize_weight(w)


def gemm_fp8_ragged_m(qa, sa, qb, sb, plan, out_dtype=torch.bfloat16):
    if out_dtype != torch.bfloat16:
        raise ValueError(f"the CUDA FP8 GEMM writes bfloat16 output, got out_dtype={out_dtype}")
    return _ops.gemm_fp8_ragged_m(qa, sa, qb, sb, plan)


def gemm_fp8_ragged_k(qaT, saT, qbT, sbT, plan, out=None, out_dtype=torch.float32):
    if out is None:
        return _ops.gemm_fp8_ragged_k(qaT, saT, qbT, sbT, plan, out_dtype)
    _ops.gemm_fp8_ragged_k_accumulate(qaT, saT, qbT, sbT, plan, out)
    return out


def gemm_bf16_fprop(x, w, plan):
    return _ops.gemm_bf16_fprop(x, w, plan)


def gemm_bf16_dgrad(dy, w, plan):
    return _ops.gemm_bf16_dgrad(dy, w, plan)


def gemm_bf16_wgrad(dy, x, plan, out=None, out_dtype=torch.float32):
    if out is None:
        return _ops.gemm_bf16_wgrad(dy, x, plan, out_dtype)
    _ops.gemm_bf16_wgrad_accumulate(dy, x, plan, out)
    return out


# ------------------------------------------------------------------------------ fake implementations
def _fake(name):
    return torch.library.register_fake(f"moegemm::{name}")


@_fake("make_plan")
def _(m_splits, T):
    return m_splits.new_empty((3, m_splits.shape[0] + 1), dtype=torch.int32)


def _multicast_like(x, K, plan, rows, cols):
    T, E = x.shape[0], plan.shape[1] - 1
    f8, f32 = torch.float8_e4m3fn, torch.float32
    return (
        x.new_empty((T, K) if rows else (0,), dtype=f8),
        x.new_empty((T, ceil_div(K, BLOCK)) if rows else (0,), dtype=f32),
        x.new_empty((K, col_capacity(T, E)) if cols else (0,), dtype=f8),
        x.new_empty((block_capacity(T, E), K) if cols else (0,), dtype=f32),
    )


@_fake("quantize_act")
def _(x, plan, rows, cols):
    return _multicast_like(x, x.shape[1], plan, rows, cols)


@_fake("quantize_weight")
def _(w):
    E, N, K = w.shape
    f8, f32 = torch.float8_e4m3fn, torch.float32
    nb, kb = ceil_div(N, BLOCK), ceil_div(K, BLOCK)
    return (w.new_empty((E, N, K), dtype=f8), w.new_empty((E, nb, kb), dtype=f32),
            w.new_empty((E, K, N), dtype=f8), w.new_empty((E, kb, nb), dtype=f32))


@_fake("gemm_fp8_ragged_m")
def _(qa, sa, qb, sb, plan):
    return qa.new_empty((qa.shape[0], qb.shape[1]), dtype=torch.bfloat16)


@_fake("gemm_fp8_ragged_k")
def _(qaT, saT, qbT, sbT, plan, out_dtype):
    return qaT.new_empty((plan.shape[1] - 1, qaT.shape[0], qbT.shape[0]), dtype=out_dtype)


@_fake("gemm_fp8_ragged_k_accumulate")
def _(qaT, saT, qbT, sbT, plan, out):
    return None


@_fake("gemm_bf16_fprop")
def _(x, w, plan):
    return x.new_empty((x.shape[0], w.shape[1]))


@_fake("gemm_bf16_dgrad")
def _(dy, w, plan):
    return dy.new_empty((dy.shape[0], w.shape[2]))


@_fake("gemm_bf16_wgrad")
def _(dy, x, plan, out_dtype):
    return dy.new_empty((plan.shape[1] - 1, dy.shape[1], x.shape[1]), dtype=out_dtype)


@_fake("gemm_bf16_wgrad_accumulate")
def _(dy, x, plan, out):
    return None


@_fake("add_bias_")
def _(y, bias, plan):
    return None


@_fake("bias_grad")
def _(dy, plan):
    return dy.new_empty((plan.shape[1] - 1, dy.shape[1]), dtype=torch.float32)


def act_quantize(h, probs, activation: str, plan, rows: bool = True, cols: bool = True):
    q, s, qT, sT = _ops.act_quantize(h, probs, ACTIVATIONS[activation], plan, rows, cols)
    return (q if rows else None, s if rows else None, qT if cols else None, sT if cols else None)


def act_backward_quantize(da, h, probs, activation: str, plan, rows: bool = True, cols: bool = True):
    q, s, qT, sT, partial = _ops.act_backward_quantize(da, h, probs, ACTIVATIONS[activation], plan, rows, cols)
    dprobs = partial.sum(1) if probs is not None else None
    return (q if rows else None, s if rows else None, qT if cols else None, sT if cols else None, dprobs)


@_fake("act_quantize")
def _(h, probs, activation, plan, rows, cols):
    F = act_width(h.shape[1], activation)
    return _multicast_like(h, F, plan, rows, cols)


@_fake("act_backward_quantize")
def _(da, h, probs, activation, plan, rows, cols):
    T, F1 = h.shape
    partial = da.new_empty((T if probs is not None else 0, ceil_div(F1, BLOCK)), dtype=torch.float32)
    return (*_multicast_like(da, F1, plan, rows, cols), partial)


def act_bf16(h, probs, activation: str):
    return _ops.act_bf16(h, probs, ACTIVATIONS[activation])


def act_backward_bf16(da, h, probs, activation: str):
    dh, partial = _ops.act_backward_bf16(da, h, probs, ACTIVATIONS[activation])
    return dh, (partial.sum(1) if probs is not None else None)


@_fake("act_bf16")
def _(h, probs, activation):
    F = act_width(h.shape[1], activation)
    return h.new_empty((h.shape[0], F))


@_fake("act_backward_bf16")
def _(da, h, probs, activation):
    T, F = da.shape
    return h.new_empty(h.shape), da.new_empty((T if probs is not None else 0, ceil_div(F, ACT_BF16_COLS)), dtype=torch.float32)

