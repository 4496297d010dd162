"""``GroupedLinear``: E independent Linear layers applied to tokens packed by expert."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from ._validate import SplitsLike, check_recipe
from .functional import WgradStore, grouped_linear


class GroupedLinear(nn.Module):
    """Per-expert ``Linear(in_features, out_features)``; ``weight`` is ``[E, out, in]``.

    ``forward(x, m_splits)`` with ``x [T, in_features]`` sorted by expert (bf16, or an FP8 ``Fp8Rows``) and
    ``m_splits`` the tokens per expert (a device tensor is never read on the host).
    ``delay_wgrad_compute=True``: split backward; the weight gradient waits for ``backward_dw()``.
    With ``fp8_blockwise`` the weight is quantized inside every call: the layer op (``linear_fwd``) takes
    no pre-quantized weights, so ``GroupedLinear`` has no FP8 weight cache (``GroupedMLP`` has one,
    ``weight_cache.py``)."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool = True,
                 recipe: str = "fp8_blockwise", device=None, dtype=None, delay_wgrad_compute: bool = False):
        super().__init__()
        self.delay_wgrad_compute = delay_wgrad_compute
        self._wgrad_store = WgradStore()
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        self.recipe = check_recipe(recipe)
        factory = {"device": device, "dtype": dtype if dtype is not None else torch.bfloat16}
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(num_experts, out_features, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.in_features)  # nn.Linear's default, per expert
        with torch.no_grad():
            self.weight.uniform_(-bound, bound)
            if self.bias is not None:
                self.bias.uniform_(-bound, bound)

    def forward(self, x: torch.Tensor, m_splits: SplitsLike, check_splits: Optional[bool] = None) -> torch.Tensor:
        return grouped_linear(x, self.weight, m_splits, self.bias, self.recipe, check_splits,
                              self._wgrad_store if self.delay_wgrad_compute else None)

    def backward_dw(self) -> None:
        """The weight gradients of every backward since the last call (delay_wgrad_compute)."""
        self._wgrad_store.backward_dw()

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, recipe={self.recipe!r}")
