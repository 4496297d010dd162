"""The expert MLP for training: fc1 -> activation x router probs -> fc2, forward and backward.

The public function checks its arguments once on the host; the autograd Function is a thin shell that
calls one op per direction, ``mlp_fwd`` and ``mlp_bwd``, of the backend chosen in ``backend.py`` (the C++
entries of ``csrc/api/grouped_mlp.cpp`` or ``reference_api.py``). For ``fp8_blockwise`` the activation is
fused with the FP8 quantization of its result, and its backward with quantizing the gradient, so no bf16
copy of the activation is written or saved. Saved for backward: the FP8 copies (x's and the
activation's column copies, the weights' transposed copies) and fc1's bf16 output h; the backward op
frees each after its last use.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .. import backends as backend
from ..backends import contract
from .._validate import (SplitsLike, check_bias, check_main_grad, check_recipe, check_weight,
                        splits_to_device)
from .linear import (WgradStore, add_grad, check_deferrable, finish_sum, finish_weight_grad, grad_target,
                         refuse_double_backward, split_x, weight_grad_target)
from ..layout import ACTIVATIONS, BF16, GLU_ACTIVATIONS, RECIPE_IDS, act_width
from ..modules.linear import GroupedLinear
from ..quantize import Fp8Rows
from .. import weight_cache

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
        dw1, dw2 = backend.select(plan.device).mlp_wgrad(plan, operands, w1, w2, t1, t2, recipe, need_dw1, need_dw2)
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
        y, plan, saved = backend.select(x_op.device).mlp_fwd(x_op, w1, w2, m_splits, b1, b2, probs, activation, recipe,
                                                             fp8_weights, True, need_dw1, need_dw2, x_scales)
        _stash(ctx, (plan, x if recipe == BF16 else None, w1, w2, probs, *fp8_weights, *saved))
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
        mg1, mg2 = (None, None) if defer else (weight_grad_target(ctx.w1, need_dw1), weight_grad_target(ctx.w2, need_dw2))
        tensors, release = _unstash(ctx)
        (plan, x, w1, w2, probs), rest = tensors[:5], tensors[5:]
        fp8_weights, saved = rest[:ctx.num_fp8_weights], rest[ctx.num_fp8_weights:]
        del tensors, rest  # the op holds the last references to what it frees
        dx, dw1, dw2, db1, db2, dp, *made = backend.select(dy.device).mlp_bwd(
            dy, plan, saved, x, w1, w2, probs, fp8_weights, mg1, mg2, ctx.activation, ctx.recipe, need_dx, need_dw1,
            need_dw2, need_db1, need_db2, need_dp, release, defer)
        if defer:  # the wgrad op's operands, by name (contract.MLP); the op never frees the saved ones it needs
            pool = (*made, *saved, dy.contiguous(), x)
            operands = [pool[i] for i in _WGRAD_GATHER[ctx.recipe]]
            ctx.store.push(_mlp_wgrad_job(plan, operands, ctx.w1, ctx.w2, ctx.recipe, need_dw1, need_dw2))
            dw1 = dw2 = None
        return (dx if need_dx else None, None if defer else finish_weight_grad(dw1, need_dw1, ctx.w1, mg1),
                None if defer else finish_weight_grad(dw2, need_dw2, ctx.w2, mg2), finish_sum(db1, need_db1, ctx.b1_dtype),
                finish_sum(db2, need_db2, ctx.b2_dtype), finish_sum(dp, need_dp, ctx.probs_dtype),
                None, None, None, None, None, None, None)


def check_activation(activation: str) -> str:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")
    return activation


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
    check_weight(fc1_weight, "fc1_weight")
    check_weight(fc2_weight, "fc2_weight")
    E, F1, H = fc1_weight.shape
    F = act_width(F1, activation)
    if activation in GLU_ACTIVATIONS and F % 16:
        raise ValueError(f"fc1_weight.shape[1] must be 2*ffn with ffn a multiple of 16 for {activation}, got {F1}")
    if tuple(fc2_weight.shape) != (E, H, F):
        raise ValueError(f"fc2_weight must have shape {(E, H, F)} to match fc1_weight {tuple(fc1_weight.shape)}, "
                         f"got {tuple(fc2_weight.shape)}")
    if fc2_weight.device != fc1_weight.device:
        raise ValueError(f"fc2_weight is on {fc2_weight.device} but fc1_weight is on {fc1_weight.device}")
    x, x_fp8, x_scales = split_x(x, H, fc1_weight.device, backend.uses_cuda(fc1_weight.device))
    if x_scales is not None and recipe != "fp8_blockwise":
        raise ValueError(f"an FP8 x (Fp8Rows) needs recipe='fp8_blockwise', got {recipe!r}")
    x_dev = x_fp8 if x_scales is not None else x
    check_bias(fc1_bias, E, F1, fc1_weight.device)
    check_bias(fc2_bias, E, H, fc1_weight.device)
    check_main_grad(fc1_weight)
    check_main_grad(fc2_weight)
    T = x_dev.shape[0]
    if probs is not None:
        if not isinstance(probs, torch.Tensor) or not probs.is_floating_point():
            raise TypeError(f"probs must be a floating-point tensor, got {getattr(probs, 'dtype', type(probs))}")
        if tuple(probs.shape) != (T,):
            raise ValueError(f"probs must have shape [T] = {(T,)}, got {tuple(probs.shape)}")
        if probs.device != x_dev.device:
            raise ValueError(f"probs is on {probs.device} but x is on {x_dev.device}")
    m = splits_to_device(m_splits, E, T, x_dev.device, check_splits)  # the first device work
    fp8 = [t for w in fp8_weights for t in w] if fp8_weights and recipe == "fp8_blockwise" else []
    act_id, recipe_id = ACTIVATIONS[activation], RECIPE_IDS[recipe]
    inputs = (x, fc1_weight, fc2_weight, fc1_bias, fc2_bias, probs)
    if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in inputs):  # inference
        return backend.select(x_dev.device).mlp_fwd(x_dev, fc1_weight, fc2_weight, m, fc1_bias, fc2_bias, probs, act_id,
                                                    recipe_id, fp8, False, False, False, x_scales)[0]
    if wgrad_store is not None:
        check_deferrable(("fc1_weight", fc1_weight), ("fc2_weight", fc2_weight))
    apply = _GroupedMLP.apply if wgrad_store is None else _apply_deferred
    return apply(*inputs, m, act_id, recipe_id, fp8, x_fp8, x_scales, wgrad_store)


@torch.compiler.disable
def _apply_deferred(*args):
    """The split-backward MLP outside torch.compile's graphs (its backward pushes work into a Python store)."""
    return _GroupedMLP.apply(*args)


class GroupedMLP(nn.Module):
    """E expert MLPs ``fc2(act(fc1(x)) * probs)`` over tokens packed by expert.

    ``fc1.weight`` is ``[E, 2·ffn, hidden]`` for GLU activations (gate rows first, as Megatron lays out
    fc1's output) or ``[E, ffn, hidden]``; ``fc2.weight`` is ``[E, hidden, ffn]``. Parameters are ordinary
    bf16/fp32 ``nn.Parameter``s. ``fc1``/``fc2`` are GroupedLinear layers holding the parameters; the MLP
    does not call them (one op runs both layers), and their own FP8 caches stay empty unless they are
    called directly.

    FP8 weights (``fp8_blockwise``): the module keeps the FP8 copies of both weights (``W`` and ``Wᵀ``,
    ``quantize_weight``) and re-quantizes them only when the weights changed: after an optimizer step,
    ``load_state_dict`` or an in-place write (``weight_cache.py`` has the rules). After a write through
    ``.data`` or a buffer sharing the weights' storage, call ``moegemm.weights_changed()`` or
    ``refresh_fp8_weights()``. ``forward(..., is_first_microbatch=True)`` forces the re-quantization,
    ``False`` reuses the copies unchecked (TransformerEngine's convention), ``None`` (default) decides
    automatically. ``fp8_weight_cache=False``: ``None`` quantizes inside every call and keeps nothing.
    The copies take as much memory as the bf16 weights (two bytes per element: ``W`` and ``Wᵀ`` in FP8),
    plus the scales. Inside a CUDA graph capture, ``None`` quantizes inside the call; under
    ``torch.compile`` the weights are always quantized inside the call."""

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, activation: str = "swiglu",
                 bias: bool = False, recipe: str = "fp8_blockwise", device=None, dtype=None,
                 fp8_weight_cache: bool = True):
        super().__init__()
        self.activation = check_activation(activation)
        self.recipe = check_recipe(recipe)
        self.num_experts, self.hidden_size, self.ffn_hidden_size = num_experts, hidden_size, ffn_hidden_size
        fc1_out = 2 * ffn_hidden_size if activation in GLU_ACTIVATIONS else ffn_hidden_size
        self.fc1 = GroupedLinear(num_experts, hidden_size, fc1_out, bias, recipe, device, dtype)
        self.fc2 = GroupedLinear(num_experts, ffn_hidden_size, hidden_size, bias, recipe, device, dtype)
        weight_cache.attach(self, fp8_weight_cache)
        self._fp8_inference = None  # to_fp8_inference: the W copies, the only weights left

    fp8_weight_cache = weight_cache.switch

    def fp8_weights(self, is_first_microbatch: Optional[bool] = None):
        """The FP8 copies of both weights for this call (None: quantize inside the call)."""
        if self.recipe != "fp8_blockwise":
            return None
        if self._fp8_inference is not None:
            return self._fp8_inference
        return self._fp8_cache.get((self.fc1.weight, self.fc2.weight), is_first_microbatch)

    def refresh_fp8_weights(self) -> None:
        """Quantize the current weights into the FP8 cache now: the explicit call after writes no check
        can see (through ``.data``, or a buffer sharing the weights' storage), and between replays of a
        CUDA graph that reads the cached copies (``is_first_microbatch=False`` during capture): copies
        a graph reads are overwritten in place. No-op for ``bf16`` and after ``to_fp8_inference``."""
        if self.recipe == "fp8_blockwise" and self._fp8_inference is None:
            self._fp8_cache.refresh((self.fc1.weight, self.fc2.weight))

    @torch.no_grad()
    def to_fp8_inference(self) -> "GroupedMLP":
        """Inference mode: keep only the FP8 weights (W copies and scales) and free the bf16 ones."""
        if self.recipe != "fp8_blockwise":
            raise ValueError(f"to_fp8_inference needs recipe='fp8_blockwise', got {self.recipe!r}")
        if self._fp8_inference is None:
            (q1, s1, _, _), (q2, s2, _, _) = self._fp8_cache.refresh((self.fc1.weight, self.fc2.weight))
            self._fp8_inference = ((q1, s1, None, None), (q2, s2, None, None))
            self._fp8_cache.clear()  # the transposed copies go too
        for lin in (self.fc1, self.fc2):  # one element, expanded: shape, dtype and device stay for validation
            w = lin.weight
            lin.weight = nn.Parameter(torch.zeros(1, device=w.device, dtype=w.dtype).expand(w.shape), requires_grad=False)
            if lin.bias is not None:
                lin.bias.requires_grad_(False)
        return self.eval()

    # Split backward (Megatron's delay_wgrad_compute): set True on an instance; backward then leaves the
    # weight gradients to backward_dw().
    delay_wgrad_compute = False
    _wgrad_store = None

    def backward_dw(self) -> None:
        """The weight gradients of every backward since the last call (delay_wgrad_compute)."""
        if self._wgrad_store is not None:
            self._wgrad_store.backward_dw()

    def forward(self, x: torch.Tensor, m_splits: SplitsLike, probs: Optional[torch.Tensor] = None,
                is_first_microbatch: Optional[bool] = None, check_splits: Optional[bool] = None) -> torch.Tensor:
        """x: ``[T, hidden]`` bf16, or an FP8 ``Fp8Rows`` (fp8_blockwise)."""
        store = None
        if self.delay_wgrad_compute:
            if self._wgrad_store is None:
                self._wgrad_store = WgradStore()
            store = self._wgrad_store
        x_grad = x.grad_target if isinstance(x, Fp8Rows) else x
        if self._fp8_inference is not None and torch.is_grad_enabled() and ((x_grad is not None and x_grad.requires_grad)
                                                           or (probs is not None and probs.requires_grad)):
            raise RuntimeError("GroupedMLP holds only FP8 weights (to_fp8_inference): it cannot compute gradients; "
                               "run it under torch.no_grad() or with inputs that do not require grad")
        return grouped_mlp(x, self.fc1.weight, self.fc2.weight, m_splits, probs, self.fc1.bias, self.fc2.bias,
                           self.activation, self.recipe, self.fp8_weights(is_first_microbatch), check_splits, store)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}, recipe={self.recipe!r}"
