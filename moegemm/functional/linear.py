"""``grouped_linear``: the differentiable grouped GEMM of SPEC §2.

The public function checks its arguments once on the host (``_validate.py``); the autograd Function is
a thin shell that calls one op per direction, ``linear_fwd`` and ``linear_bwd``, of the backend chosen in
``backend.py`` (the C++ entries of ``csrc/api/grouped_linear.cpp`` or ``reference_api.py``, which share
one interface). For ``fp8_blockwise`` the forward quantizes ``x`` once into its row copy (fprop) and its
per-expert transposed copy (saved for wgrad), so backward never re-reads ``x`` in bf16.

Two options (issue 16):
* an FP8 ``x`` (``Fp8Rows``: quantize_act's row copy and scales, as an FP8 dispatcher delivers it): fprop
  reads the rows as they are, wgrad's column copy is made from them on the device; dx (bf16) goes to
  ``Fp8Rows.grad_target``;
* a split backward (``wgrad_store``): backward computes dx and db, and leaves the weight gradient, with
  the FP8 column copies it needs, in the store until ``store.backward_dw()``.
"""

from __future__ import annotations

import collections
import warnings
from typing import Optional

import torch

from .. import backends as backend
from ..backends import contract
from .._validate import (SplitsLike, check_bias, check_main_grad, check_recipe, check_weight, check_x,
                        splits_to_device)
from ..layout import BF16, RECIPE_IDS
from ..quantize import Fp8Rows, check_fp8_rows


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
    if not need_dw or main_grad is not None:
        return None
    return dw if dw.dtype == weight.dtype else dw.to(weight.dtype)


def finish_sum(total, needed: bool, dtype):
    """A bias or probs gradient (an fp32 sum from the op) in its parameter's dtype, or None."""
    if not needed:
        return None
    return total if total.dtype == dtype else total.to(dtype)


class WgradStore:
    """The weight gradients a split backward left for later (Megatron's ``delay_wgrad_compute``).

    A layer's backward with a store computes the input gradient (and bias/probs gradients) at once and
    pushes its weight-gradient work here, holding the operands it needs (the FP8 column copies of dy and
    of the activations, or their bf16 tensors). ``backward_dw()`` runs all pending work in the order it
    was pushed (several micro-batches may be pending: the results accumulate) and releases the operands.
    Each gradient goes into ``weight.main_grad`` when the weight has one (fp32, accumulated by the GEMM),
    else into ``weight.grad`` (accumulated by the GEMM when it is an fp32 tensor of the weight's shape,
    else created or added to).

    Work never run keeps its operands alive: the store warns once when more than ``max_pending``
    backward passes are pending (backward_dw forgotten) and ``clear()`` drops them without computing."""

    def __init__(self, max_pending: int = 8):
        self.max_pending = max_pending
        self._pending = collections.deque()
        self._warned = False

    def __len__(self) -> int:
        return len(self._pending)

    def push(self, job) -> None:
        self._pending.append(job)
        if len(self._pending) > self.max_pending and not self._warned:
            self._warned = True
            warnings.warn(f"moegemm: {len(self._pending)} split backward passes wait for backward_dw() (their FP8 "
                          "operands stay allocated until then); call backward_dw() after each backward, or clear()",
                          stacklevel=2)

    @torch.no_grad()
    def backward_dw(self) -> None:
        while self._pending:
            self._pending.popleft()()

    def clear(self) -> None:
        self._pending.clear()


def check_deferrable(*weights) -> None:
    """A split backward hands each weight's gradient to the weight itself later (main_grad or ``.grad``),
    outside autograd: a weight that is not a leaf (e.g. ``master.bfloat16()``) would lose it."""
    for name, w in weights:
        if w.requires_grad and w.grad_fn is not None:
            raise ValueError(f"wgrad_store (split backward) needs {name} to be a leaf tensor (a Parameter): its "
                             "deferred gradient cannot flow back through autograd to where it was computed from")


def grad_target(param: torch.Tensor):
    """Where a deferred GEMM accumulates param's gradient: main_grad (fp32, checked), else an fp32
    ``param.grad`` of param's shape, else None (the GEMM writes a fresh dw for add_grad)."""
    check_main_grad(param)
    target = getattr(param, "main_grad", None)
    grad = param.grad
    if target is None and grad is not None and grad.dtype == torch.float32 and grad.shape == param.shape \
            and grad.is_contiguous() and grad.device == param.device:
        target = grad
    return target


def add_grad(param: torch.Tensor, dw) -> None:
    """param.grad (created, or added to) += dw, unless dw is None (accumulated by the GEMM already)."""
    if dw is None or dw.numel() == 0:
        return
    dw = dw.to(param.dtype)
    if param.grad is None:
        param.grad = dw
    else:
        param.grad.add_(dw)


_WGRAD_GATHER = {recipe: contract.LINEAR.wgrad_gather(recipe) for recipe in RECIPE_IDS.values()}


def _linear_wgrad_job(plan, operands, weight, recipe: int):
    def job():
        target = grad_target(weight)
        dw = backend.select(plan.device).linear_wgrad(plan, operands, weight, target, recipe)
        add_grad(weight, None if target is not None else dw)
    return job


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, m_splits, recipe: int, x_fp8, x_scales, store, fp8_weight: list):
        """x: the bf16 input, or with an FP8 input (x_fp8, x_scales) the tensor that receives dx (or None).
        fp8_weight: [] or the weight's kept FP8 copies (quantize_weight), also handed to backward."""
        need_dx, need_dw = ctx.needs_input_grad[:2]
        x_op = x_fp8 if x_scales is not None else x
        y, plan, saved = backend.select(x_op.device).linear_fwd(x_op, weight, m_splits, bias, recipe, need_dx, need_dw,
                                                                x_scales, fp8_weight or None)
        ctx.save_for_backward(plan, x if recipe == BF16 and need_dw else None, weight, *fp8_weight, *saved)
        ctx.recipe, ctx.weight, ctx.store, ctx.num_fp8 = recipe, weight, store, len(fp8_weight)
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y

    @staticmethod
    def backward(ctx, dy):
        refuse_double_backward("grouped_linear")
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        plan, x, weight, *rest = ctx.saved_tensors
        fp8_weight, saved = rest[:ctx.num_fp8], rest[ctx.num_fp8:]
        defer = ctx.store is not None and need_dw
        main_grad = None if defer else weight_grad_target(ctx.weight, need_dw)
        dx, dw, db, *made = backend.select(dy.device).linear_bwd(dy, plan, saved, x, weight, main_grad, ctx.recipe,
                                                                need_dx, need_dw, need_db, defer, fp8_weight or None)
        if defer:  # the wgrad op's operands, by name from what this backward has (contract.LINEAR)
            pool = (*made, *saved, dy.contiguous(), x)
            operands = [pool[i] for i in _WGRAD_GATHER[ctx.recipe]]
            ctx.store.push(_linear_wgrad_job(plan, operands, ctx.weight, ctx.recipe))
        return (dx if need_dx else None, None if defer else finish_weight_grad(dw, need_dw, ctx.weight, main_grad),
                finish_sum(db, need_db, ctx.bias_dtype), None, None, None, None, None, None)


def split_x(x, K: int, device, cuda_path: bool):
    """(x for the Function, x_fp8, x_scales): a bf16 x checked as before, or an ``Fp8Rows`` checked and split
    into its grad target (which receives dx) and its FP8 tensors."""
    if isinstance(x, Fp8Rows):
        check_fp8_rows(x, K, device)
        return x.grad_target, x.q, x.s
    check_x(x, K, device, cuda_path=cuda_path)
    return x, None, None


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
    If ``weight`` has a ``main_grad`` attribute (fp32), its gradient is accumulated there instead.

    ``x`` may be FP8: ``Fp8Rows(q, s, grad_target)`` (see ``moegemm.to_fp8_rows``), fp8_blockwise only; y is
    bf16 and dx (bf16) goes to ``grad_target`` (none computed without one).
    ``wgrad_store``: split backward; the weight gradient waits in the store until ``wgrad_store.backward_dw()``
    (the weight must be a leaf: the deferred gradient goes to its main_grad or ``.grad``, not through autograd).
    ``fp8_weight``: ``quantize_weight(weight)`` to reuse (fp8_blockwise; ``GroupedLinear`` keeps it).
    """
    check_recipe(recipe)
    check_weight(weight)
    E, N, K = weight.shape
    x, x_fp8, x_scales = split_x(x, K, weight.device, backend.uses_cuda(weight.device))
    if x_scales is not None and recipe != "fp8_blockwise":
        raise ValueError(f"an FP8 x (Fp8Rows) needs recipe='fp8_blockwise', got {recipe!r}")
    x_dev = x_fp8 if x_scales is not None else x
    check_bias(bias, E, N, weight.device)
    check_main_grad(weight)
    m = splits_to_device(m_splits, E, x_dev.shape[0], x_dev.device, check_splits)  # the first device work
    fp8 = list(fp8_weight) if fp8_weight is not None and recipe == "fp8_blockwise" else []
    if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return backend.select(x_dev.device).linear_fwd(x_dev, weight, m, bias, RECIPE_IDS[recipe], False, False,
                                                       x_scales, fp8 or None)[0]  # inference
    if wgrad_store is not None:
        check_deferrable(("weight", weight))
    apply = _GroupedLinear.apply if wgrad_store is None else _apply_deferred
    return apply(x, weight, bias, m, RECIPE_IDS[recipe], x_fp8, x_scales, wgrad_store, fp8)


@torch.compiler.disable
def _apply_deferred(*args):
    """The split-backward layer outside torch.compile's graphs: its backward pushes work into a Python
    store, a side effect a traced backward cannot hold (a graph break under torch.compile)."""
    return _GroupedLinear.apply(*args)
