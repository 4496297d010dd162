"""``GroupedMLP``: E expert MLPs ``fc2(act(fc1(x)) * probs)`` over tokens packed by expert."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .._validate import (SplitsLike, check_activation, check_bool_arg, check_layer_sizes, check_mlp_dims, check_recipe,
                         check_weight_dtype)
from ..functional import grouped_mlp
from ..quantize import Fp8Rows
from .base import ExpertLayer, GroupedWeights


class GroupedMLP(ExpertLayer, nn.Module):
    """E expert MLPs ``fc2(act(fc1(x)) * probs)`` over tokens packed by expert.

    ``fc1.weight`` is ``[E, 2·ffn, hidden]`` for GLU activations (gate rows first, as Megatron lays out
    fc1's output) or ``[E, ffn, hidden]``; ``fc2.weight`` is ``[E, hidden, ffn]``. Parameters are ordinary
    bf16/fp32 ``nn.Parameter``s, held by ``fc1`` and ``fc2`` (``GroupedWeights``); one op runs both GEMMs.
    The sizes are checked here, with grouped_mlp's rules, before any memory is allocated.

    FP8 weights (``fp8_blockwise``): the module keeps the FP8 copies of both weights (``W`` and ``Wᵀ``,
    ``quantize_weight``) and re-quantizes them only when the weights changed: after an optimizer step,
    ``load_state_dict`` or an in-place write (``weight_cache.py`` has the rules). After a write through
    ``.data`` or a buffer sharing the weights' storage, call ``moegemm.weights_changed()`` or
    ``refresh_fp8_weights()``. ``forward(..., is_first_microbatch=True)`` forces the re-quantization,
    ``False`` reuses the copies unchecked (TransformerEngine's convention), ``None`` (default) decides
    automatically. ``fp8_weight_cache=False``: ``None`` quantizes inside every call and keeps nothing.
    The copies take as much memory as the bf16 weights (two bytes per element: ``W`` and ``Wᵀ`` in FP8),
    plus the scales. Inside a CUDA graph capture, ``None`` quantizes inside the call; under
    ``torch.compile`` the weights are always quantized inside the call.

    ``delay_wgrad_compute=True`` (also settable on an instance): split backward; the weight gradients wait
    for ``backward_dw()``."""

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, activation: str = "swiglu",
                 bias: bool = False, recipe: str = "fp8_blockwise", device=None, dtype=None,
                 fp8_weight_cache: bool = True, delay_wgrad_compute: bool = False):
        check_activation(activation)
        check_layer_sizes(("num_experts", num_experts), ("hidden_size", hidden_size), ("ffn_hidden_size", ffn_hidden_size))
        fc1_out = check_mlp_dims(num_experts, hidden_size, ffn_hidden_size, activation)
        check_recipe(recipe)
        dtype = check_weight_dtype("dtype", dtype)
        for name, flag in (("bias", bias), ("fp8_weight_cache", fp8_weight_cache),
                           ("delay_wgrad_compute", delay_wgrad_compute)):
            check_bool_arg(name, flag)
        super().__init__()
        self._init_expert_layer(recipe, fp8_weight_cache, delay_wgrad_compute)
        self.activation = activation
        self.num_experts, self.hidden_size, self.ffn_hidden_size = num_experts, hidden_size, ffn_hidden_size
        self.fc1 = GroupedWeights(num_experts, hidden_size, fc1_out, bias, device, dtype)
        self.fc1.reset_parameters()
        self.fc2 = GroupedWeights(num_experts, ffn_hidden_size, hidden_size, bias, device, dtype)
        self.fc2.reset_parameters()

    def expert_weights(self) -> tuple:
        return (self.fc1.weight, self.fc2.weight)

    @torch.no_grad()
    def to_fp8_inference(self) -> "GroupedMLP":
        """Inference mode: keep only the FP8 weights (W copies and scales) and free the bf16 ones."""
        if self.recipe != "fp8_blockwise":
            raise ValueError(f"to_fp8_inference needs recipe='fp8_blockwise', got {self.recipe!r}")
        if self._fp8_inference is None:
            (q1, s1, _, _), (q2, s2, _, _) = self._fp8_cache.refresh(self.expert_weights())
            self._fp8_inference = ((q1, s1, None, None), (q2, s2, None, None))
            self._fp8_cache.clear()  # the transposed copies go too
        for holder in (self.fc1, self.fc2):  # one element, expanded: shape, dtype and device stay for validation
            w = holder.weight
            holder.weight = nn.Parameter(torch.zeros(1, device=w.device, dtype=w.dtype).expand(w.shape),
                                         requires_grad=False)
            if holder.bias is not None:
                holder.bias.requires_grad_(False)
        return self.eval()

    def _refuse_in_fp8_inference(self, what: str) -> None:
        if self._fp8_inference is not None:
            raise RuntimeError(f"moegemm: {what} of a GroupedMLP that holds only FP8 weights (to_fp8_inference): its "
                               "weight parameters are placeholders, and its FP8 weights are not part of a state_dict; "
                               "save or load the model's state before to_fp8_inference()")

    def state_dict(self, *args, **kwargs):
        """(Refused after ``to_fp8_inference``: its weights would be the placeholders.)"""
        self._refuse_in_fp8_inference("state_dict")
        return super().state_dict(*args, **kwargs)

    def _load_from_state_dict(self, *args, **kwargs):
        # (refused after to_fp8_inference: forward would keep the FP8 weights and ignore what was loaded)
        self._refuse_in_fp8_inference("load_state_dict")
        super()._load_from_state_dict(*args, **kwargs)

    def forward(self, x: torch.Tensor, m_splits: SplitsLike, probs: Optional[torch.Tensor] = None,
                is_first_microbatch: Optional[bool] = None, check_splits: Optional[bool] = None) -> torch.Tensor:
        """x: ``[T, hidden]`` bf16, or an FP8 ``Fp8Rows`` (fp8_blockwise)."""
        x_grad = x.grad_target if isinstance(x, Fp8Rows) else x
        if self._fp8_inference is not None and torch.is_grad_enabled() and ((x_grad is not None and x_grad.requires_grad)
                                                                             or (probs is not None and probs.requires_grad)):
            raise RuntimeError("GroupedMLP holds only FP8 weights (to_fp8_inference): it cannot compute gradients; "
                               "run it under torch.no_grad() or with inputs that do not require grad")
        return grouped_mlp(x, self.fc1.weight, self.fc2.weight, m_splits, probs, self.fc1.bias, self.fc2.bias,
                           self.activation, self.recipe, self.fp8_weights(is_first_microbatch), check_splits,
                           self._wgrad_store if self.delay_wgrad_compute else None)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}, recipe={self.recipe!r}"
