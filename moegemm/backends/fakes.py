"""The fake (meta) implementations of the ops, so that torch.compile can trace them: the layer ops' of
both backends (``torch.ops.moegemm.*`` and ``torch.ops.moegemm_reference.*``) computed from their
contract (``contract.outputs``), and the CUDA primitives'. Registered once the ops exist: by ``cuda.py``
after loading the extension, by ``reference.py`` after defining its ops."""

from __future__ import annotations

import torch

from ..layout import ACT_BF16_COLS, BLOCK, act_width, block_capacity, ceil_div, col_capacity, empty_row_scales
from . import contract


def _layer_fake(op: contract.LayerOp):
    def fake(*args, **kwargs):
        return contract.outputs(op, contract.bind(op, args, kwargs))
    fake.__name__ = f"{op.name}_fake"
    return fake


def register_layer_ops(namespace: str) -> None:
    """The fakes of the six layer ops of ``namespace`` (``moegemm`` or ``moegemm_reference``)."""
    for op in contract.OPS:
        torch.library.register_fake(f"{namespace}::{op.name}")(_layer_fake(op))


def _grouped_linear(x, weight, m_splits, bias, recipe, x_scales=None, dx_target=None, fp8_weight=None):
    return x.new_empty((x.shape[0], weight.shape[1]), dtype=torch.bfloat16 if x_scales is not None else x.dtype)


def _grouped_mlp(x, fc1_weight, fc2_weight, m_splits, fc1_bias, fc2_bias, probs, activation, recipe, fp8_weights,
                 x_scales=None, dx_target=None):
    return x.new_empty((x.shape[0], fc2_weight.shape[1]), dtype=torch.bfloat16 if x_scales is not None else x.dtype)


def register_cuda() -> None:
    """Every fake of the extension's ops: the differentiable layer ops (for their forward alone, below
    autograd; above it their C++ node runs and calls the layer ops), the layer ops and the primitives."""
    torch.library.register_fake("moegemm::grouped_linear")(_grouped_linear)
    torch.library.register_fake("moegemm::grouped_mlp")(_grouped_mlp)
    register_layer_ops("moegemm")
    for name, fake in _PRIMITIVES.items():
        torch.library.register_fake(f"moegemm::{name}")(fake)


# ------------------------------------------------------------------------------------ the primitives
_F8, _F32 = torch.float8_e4m3fn, torch.float32


def _multicast_like(x, K, plan, rows, cols):
    """quantize_act's four outputs for x [T, *] quantized to width K (the parts not asked for: [0])."""
    T, E = x.shape[0], plan.shape[1] - 1
    return (
        x.new_empty((T, K) if rows else (0,), dtype=_F8),
        empty_row_scales(T, ceil_div(K, BLOCK), x.device) if rows else x.new_empty((0,), dtype=_F32),
        x.new_empty((K, col_capacity(T, E)) if cols else (0,), dtype=_F8),
        x.new_empty((block_capacity(T, E), K) if cols else (0,), dtype=_F32),
    )


def _make_plan(m_splits, T):
    return m_splits.new_empty((3, m_splits.shape[0] + 1), dtype=torch.int32)


def _quantize_act(x, plan, rows, cols):
    return _multicast_like(x, x.shape[1], plan, rows, cols)


def _requantize_cols(x, x_scales, plan):
    return _multicast_like(x, x.shape[1], plan, False, True)[2:]


def _quantize_weight(w):
    E, N, K = w.shape
    nb, kb = ceil_div(N, BLOCK), ceil_div(K, BLOCK)
    return (w.new_empty((E, N, K), dtype=_F8), w.new_empty((E, nb, kb), dtype=_F32),
            w.new_empty((E, K, N), dtype=_F8), w.new_empty((E, kb, nb), dtype=_F32))


def _quantize_weights(weights):
    return [t for w in weights for t in _quantize_weight(w)]


def _gemm_fp8_ragged_m(qa, sa, qb, sb, plan, tiling=-1):
    return qa.new_empty((qa.shape[0], qb.shape[1]), dtype=torch.bfloat16)


def _gemm_fp8_ragged_k(qaT, saT, qbT, sbT, plan, out_dtype, kernel=0, tiling=-1):
    return qaT.new_empty((plan.shape[1] - 1, qaT.shape[0], qbT.shape[0]), dtype=out_dtype)


def _gemm_fp8_ragged_k_accumulate(qaT, saT, qbT, sbT, plan, out, kernel=0, tiling=-1):
    return None


def _gemm_bf16_fprop(x, w, plan):
    return x.new_empty((x.shape[0], w.shape[1]))


def _gemm_bf16_dgrad(dy, w, plan):
    return dy.new_empty((dy.shape[0], w.shape[2]))


def _gemm_bf16_wgrad(dy, x, plan, out_dtype):
    return dy.new_empty((plan.shape[1] - 1, dy.shape[1], x.shape[1]), dtype=out_dtype)


def _gemm_bf16_wgrad_accumulate(dy, x, plan, out):
    return None


def _add_bias_(y, bias, plan):
    return None


def _bias_grad(dy, plan):
    return dy.new_empty((plan.shape[1] - 1, dy.shape[1]), dtype=torch.float32)


def _act_quantize(h, probs, activation, plan, rows, cols):
    return _multicast_like(h, act_width(h.shape[1], activation), plan, rows, cols)


def _act_backward_quantize(da, h, probs, activation, plan, rows, cols):
    T, F1 = h.shape
    partial = da.new_empty((T if probs is not None else 0, ceil_div(F1, BLOCK)), dtype=torch.float32)
    return (*_multicast_like(da, F1, plan, rows, cols), partial)


def _act_bf16(h, probs, activation):
    return h.new_empty((h.shape[0], act_width(h.shape[1], activation)))


def _act_backward_bf16(da, h, probs, activation):
    T, F = da.shape
    return h.new_empty(h.shape), da.new_empty((T if probs is not None else 0, ceil_div(F, ACT_BF16_COLS)), dtype=torch.float32)


_PRIMITIVES = {
    "make_plan": _make_plan,
    "quantize_act": _quantize_act,
    "requantize_cols": _requantize_cols,
    "quantize_weight": _quantize_weight,
    "quantize_weights": _quantize_weights,
    "gemm_fp8_ragged_m": _gemm_fp8_ragged_m,
    "gemm_fp8_ragged_k": _gemm_fp8_ragged_k,
    "gemm_fp8_ragged_k_accumulate": _gemm_fp8_ragged_k_accumulate,
    "gemm_bf16_fprop": _gemm_bf16_fprop,
    "gemm_bf16_dgrad": _gemm_bf16_dgrad,
    "gemm_bf16_wgrad": _gemm_bf16_wgrad,
    "gemm_bf16_wgrad_accumulate": _gemm_bf16_wgrad_accumulate,
    "add_bias_": _add_bias_,
    "bias_grad": _bias_grad,
    "act_quantize": _act_quantize,
    "act_backward_quantize": _act_backward_quantize,
    "act_bf16": _act_bf16,
    "act_backward_bf16": _act_backward_bf16,
}
