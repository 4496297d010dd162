"""The contract of the primitive ops, declared once: ``torch.ops.moegemm.<name>``, one kernel each
(``csrc/api/primitives.h``; for tests and benchmarks), and the SM budget's ``set_sm_budget``.

Each op is a ``PrimitiveOp``: the schema ``csrc/binding.cpp`` registers (spelled out there, character for
character: they are the public ``torch.ops`` API) and its fake (meta) function, the outputs' shapes and dtypes
from the arguments, with the schema's argument names and defaults, which ``fakes.register_cuda`` registers so
that torch.compile can trace the op. An op with no tensor among its arguments and returns (``set_sm_budget``)
has no fake: its kernel, given with its schema in binding.cpp, runs for every backend.

``tests/test_primitive_contract.py`` parses binding.cpp and fails unless it registers exactly these schemas
(beside the layer ops of ``contract.py``), each with a kernel, and every op with a tensor has a fake that
matches its schema. Adding a primitive: its C++ (``csrc/api/primitives.h``, ``.cpp``), its ``m.def`` and
``m.impl`` in binding.cpp, and one ``PrimitiveOp`` here with the same schema and a fake.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

from ..layout import ACT_BF16_COLS, BLOCK, act_width, block_capacity, ceil_div, col_capacity, empty_row_scales

_F8, _F32 = torch.float8_e4m3fn, torch.float32


class PrimitiveOp(NamedTuple):
    schema: str  # as csrc/binding.cpp registers it
    fake: Optional[Callable]  # None: no tensors (its kernel runs for every backend)

    @property
    def name(self) -> str:
        return self.schema.split("(", 1)[0]


# ------------------------------------------------------------------------------------------- the fakes
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


def _quantize_weights_into(parts, counts, out):
    return None


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


def _gemm_fp8_ragged_rows(qa, sa, qb, sb, plan, tiling=-1):
    return qa.new_empty((qa.shape[0], qb.shape[1]), dtype=torch.bfloat16)


def _gemm_fp8_ragged_reduction(qaT, saT, qbT, sbT, plan, out_dtype, kernel=0, tiling=-1):
    return qaT.new_empty((plan.shape[1] - 1, qaT.shape[0], qbT.shape[0]), dtype=out_dtype)


def _gemm_fp8_ragged_reduction_accumulate(qaT, saT, qbT, sbT, plan, out, kernel=0, tiling=-1):
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


# --------------------------------------------------------------------------------------------- the ops
OPS = (
    PrimitiveOp("make_plan(Tensor m_splits, int T) -> Tensor", _make_plan),
    PrimitiveOp("quantize_act(Tensor x, Tensor plan, bool rows, bool cols) -> (Tensor, Tensor, Tensor, Tensor)",
                _quantize_act),
    PrimitiveOp("requantize_cols(Tensor x, Tensor x_scales, Tensor plan) -> (Tensor, Tensor)", _requantize_cols),
    PrimitiveOp("quantize_weight(Tensor w) -> (Tensor, Tensor, Tensor, Tensor)", _quantize_weight),
    PrimitiveOp("quantize_weights(Tensor[] weights) -> Tensor[]", _quantize_weights),
    PrimitiveOp("quantize_weights_into(Tensor[] parts, int[] counts, Tensor(a!)[] out) -> ()", _quantize_weights_into),
    PrimitiveOp("act_quantize(Tensor h, Tensor? probs, int activation, Tensor plan, bool rows, bool cols) -> "
                "(Tensor, Tensor, Tensor, Tensor)", _act_quantize),
    PrimitiveOp("act_backward_quantize(Tensor da, Tensor h, Tensor? probs, int activation, Tensor plan, bool rows, "
                "bool cols) -> (Tensor, Tensor, Tensor, Tensor, Tensor)", _act_backward_quantize),
    PrimitiveOp("act_bf16(Tensor h, Tensor? probs, int activation) -> Tensor", _act_bf16),
    PrimitiveOp("act_backward_bf16(Tensor da, Tensor h, Tensor? probs, int activation) -> (Tensor, Tensor)",
                _act_backward_bf16),
    PrimitiveOp("gemm_fp8_ragged_rows(Tensor qa, Tensor sa, Tensor qb, Tensor sb, Tensor plan, int tiling=-1) -> Tensor",
                _gemm_fp8_ragged_rows),
    PrimitiveOp("gemm_fp8_ragged_reduction(Tensor qaT, Tensor saT, Tensor qbT, Tensor sbT, Tensor plan, ScalarType out_dtype, "
                "int kernel=0, int tiling=-1) -> Tensor", _gemm_fp8_ragged_reduction),
    PrimitiveOp("gemm_fp8_ragged_reduction_accumulate(Tensor qaT, Tensor saT, Tensor qbT, Tensor sbT, Tensor plan, "
                "Tensor(a!) out, int kernel=0, int tiling=-1) -> ()", _gemm_fp8_ragged_reduction_accumulate),
    PrimitiveOp("gemm_bf16_fprop(Tensor x, Tensor w, Tensor plan) -> Tensor", _gemm_bf16_fprop),
    PrimitiveOp("gemm_bf16_dgrad(Tensor dy, Tensor w, Tensor plan) -> Tensor", _gemm_bf16_dgrad),
    PrimitiveOp("gemm_bf16_wgrad(Tensor dy, Tensor x, Tensor plan, ScalarType out_dtype) -> Tensor", _gemm_bf16_wgrad),
    PrimitiveOp("gemm_bf16_wgrad_accumulate(Tensor dy, Tensor x, Tensor plan, Tensor(a!) out) -> ()",
                _gemm_bf16_wgrad_accumulate),
    PrimitiveOp("add_bias_(Tensor(a!) y, Tensor bias, Tensor plan) -> ()", _add_bias_),
    PrimitiveOp("bias_grad(Tensor dy, Tensor plan) -> Tensor", _bias_grad),
    # the SM budget of the persistent kernels (moegemm/sm_budget.py): no tensors, one kernel for every backend
    PrimitiveOp("set_sm_budget(int sms) -> ()", None),
)
BY_NAME = {op.name: op for op in OPS}
