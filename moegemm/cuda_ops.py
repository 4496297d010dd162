"""The CUDA backend: thin wrappers over the extension's ``torch.ops.moegemm`` ops, with the same
signatures as ``reference.py`` (parts not asked for come back as None), plus their fake (meta)
implementations so that torch.compile can trace them."""

from __future__ import annotations

import torch

from ._build import load_extension
from .reference import ACTIVATIONS, BLOCK, block_capacity, ceil_div, col_capacity

load_extension()
_ops = torch.ops.moegemm


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


def add_bias_(y, bias, plan):
    if bias.dtype not in (torch.float32, torch.bfloat16):
        bias = bias.float()
    _ops.add_bias_(y, bias, plan)
    return y


def bias_grad(dy, plan):
    return _ops.bias_grad(dy, plan)


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
    F = h.shape[1] // 2 if activation in (0, 1) else h.shape[1]
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
    F = h.shape[1] // 2 if activation in (0, 1) else h.shape[1]
    return h.new_empty((h.shape[0], F))


@_fake("act_backward_bf16")
def _(da, h, probs, activation):
    T, F = da.shape
    return h.new_empty(h.shape), da.new_empty((T if probs is not None else 0, ceil_div(F, 256)), dtype=torch.float32)

