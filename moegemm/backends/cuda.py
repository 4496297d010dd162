"""The CUDA backend: the extension's ``torch.ops.moegemm`` ops with the backend interface (``protocol.py``).

* The differentiable layer ops ``grouped_linear, grouped_mlp`` (``LAYER_AUTOGRAD``): one C++ autograd node
  per call (``csrc/api/autograd.h``), the layers' path without a split backward.
* The layer entries ``linear_fwd, linear_bwd, linear_wgrad, mlp_fwd, mlp_bwd, mlp_wgrad`` are the C++ ops
  themselves (one op per layer and direction, ``csrc/api/layers.h``; their contract: ``contract.py``).
* The primitives (one kernel each, for tests and benchmarks) are thin wrappers with the signatures of
  ``moegemm/reference.py`` (parts not asked for come back as None).

Importing this module builds or loads the extension and registers the ops' fakes (``fakes.py``).
"""

from __future__ import annotations

import torch

from .._build import load_extension
from ..layout import ACTIVATIONS
from ..sm_budget import get_num_sms
from . import fakes

load_extension()
fakes.register_cuda()
_ops = torch.ops.moegemm
_ops.set_sm_budget(get_num_sms() or 0)  # the budget set before the extension was loaded

# ------------------------------------------------------------------------- differentiable layer ops
LAYER_AUTOGRAD = True
grouped_linear = _ops.grouped_linear.default
grouped_mlp = _ops.grouped_mlp.default

# ------------------------------------------------------------------------------------- layer entries
linear_fwd = _ops.linear_fwd.default
linear_bwd = _ops.linear_bwd.default
linear_wgrad = _ops.linear_wgrad.default
mlp_fwd = _ops.mlp_fwd.default
mlp_bwd = _ops.mlp_bwd.default
mlp_wgrad = _ops.mlp_wgrad.default


# ----------------------------------------------------------------------------------------- primitives
def make_plan(m_splits: torch.Tensor, T: int) -> torch.Tensor:
    return _ops.make_plan(m_splits, T)


def quantize_act(x, plan, rows: bool = True, cols: bool = True):
    q, s, qT, sT = _ops.quantize_act(x, plan, rows, cols)
    return (q if rows else None, s if rows else None, qT if cols else None, sT if cols else None)


def requantize_cols(q, s, plan):
    return _ops.requantize_cols(q, s, plan)


def quantize_weight(w):
    return _ops.quantize_weight(w)


def quantize_weights(weights):
    flat = _ops.quantize_weights(list(weights))
    return [tuple(flat[i: i + 4]) for i in range(0, len(flat), 4)]


def quantize_weights_into(parts, counts, out):
    _ops.quantize_weights_into(list(parts), list(counts), list(out))
    for t in out:  # (the kernel's writes move no version counter, the reference's copy_ does: a saved copy is stale)
        torch.autograd.graph.increment_version(t)


def gemm_fp8_ragged_rows(qa, sa, qb, sb, plan, out_dtype=torch.bfloat16):
    if out_dtype != torch.bfloat16:
        raise ValueError(f"the CUDA FP8 GEMM writes bfloat16 output, got out_dtype={out_dtype}")
    return _ops.gemm_fp8_ragged_rows(qa, sa, qb, sb, plan)


def gemm_fp8_ragged_reduction(qaT, saT, qbT, sbT, plan, out=None, out_dtype=torch.float32):
    if out is None:
        return _ops.gemm_fp8_ragged_reduction(qaT, saT, qbT, sbT, plan, out_dtype)
    _ops.gemm_fp8_ragged_reduction_accumulate(qaT, saT, qbT, sbT, plan, out)
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


def act_quantize(h, probs, activation: str, plan, rows: bool = True, cols: bool = True):
    q, s, qT, sT = _ops.act_quantize(h, probs, ACTIVATIONS[activation], plan, rows, cols)
    return (q if rows else None, s if rows else None, qT if cols else None, sT if cols else None)


def act_backward_quantize(da, h, probs, activation: str, plan, rows: bool = True, cols: bool = True):
    q, s, qT, sT, partial = _ops.act_backward_quantize(da, h, probs, ACTIVATIONS[activation], plan, rows, cols)
    dprobs = partial.sum(1) if probs is not None else None
    return (q if rows else None, s if rows else None, qT if cols else None, sT if cols else None, dprobs)


def act_bf16(h, probs, activation: str):
    return _ops.act_bf16(h, probs, ACTIVATIONS[activation])


def act_backward_bf16(da, h, probs, activation: str):
    dh, partial = _ops.act_backward_bf16(da, h, probs, ACTIVATIONS[activation])
    return dh, (partial.sum(1) if probs is not None else None)

