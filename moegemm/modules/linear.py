"""``GroupedLinear``: E independent Linear layers applied to tokens packed by expert."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .._validate import SplitsLike, check_bool_arg, check_layer_sizes, check_recipe, check_weight_dtype
from ..functional import grouped_linear
from .base import ExpertLayer, init_uniform_


class GroupedLinear(ExpertLayer, nn.Module):
    """Per-expert ``Linear(in_features, out_features)``; ``weight`` is ``[E, out, in]``.

    ``forward(x, m_splits)`` with ``x [T, in_features]`` sorted by expert (bf16, or an FP8 ``Fp8Rows``) and
    ``m_splits`` the tokens per expert (a device tensor is never read on the host).
    ``delay_wgrad_compute=True``: split backward; the weight gradient waits for ``backward_dw()``.
    FP8 weights (``fp8_blockwise``): the layer keeps the weight's FP8 copies (``W`` and ``Wᵀ``) and
    re-quantizes them only when the weight changed (``ExpertLayer``; ``weight_cache.py`` has the rules):
    ``forward(..., is_first_microbatch=True)`` forces it, ``False`` reuses the copies unchecked, ``None``
    decides automatically; after a write through ``.data`` call ``moegemm.weights_changed()`` or
    ``refresh_fp8_weights()``. ``fp8_weight_cache=False``: quantize inside every call. The sizes are
    checked here, with grouped_linear's rules, before any memory is allocated."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool = True,
                 recipe: str = "fp8_blockwise", device=None, dtype=None, delay_wgrad_compute: bool = False,
                 fp8_weight_cache: bool = True):
        check_layer_sizes(("num_experts", num_experts), ("in_features", in_features), ("out_features", out_features))
        check_recipe(recipe)
        dtype = check_weight_dtype("dtype", dtype)
        for name, flag in (("bias", bias), ("delay_wgrad_compute", delay_wgrad_compute),
                           ("fp8_weight_cache", fp8_weight_cache)):
            check_bool_arg(name, flag)
        super().__init__()
        self._init_expert_layer(recipe, fp8_weight_cache, delay_wgrad_compute)
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(num_experts, out_features, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init_uniform_(self.weight, self.bias)

    def expert_weights(self) -> tuple:
        return (self.weight,)

    def fp8_weight(self, is_first_microbatch: Optional[bool] = None):
        """The weight's FP8 copies for this call (None: quantize inside the call)."""
        copies = self.fp8_weights(is_first_microbatch)
        return copies[0] if copies is not None else None

    def forward(self, x: torch.Tensor, m_splits: SplitsLike, check_splits: Optional[bool] = None,
                is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        copies = self.fp8_weights(is_first_microbatch)
        return grouped_linear(x, self.weight, m_splits, self.bias, self.recipe, check_splits,
                              self._wgrad_store if self.delay_wgrad_compute else None,
                              copies[0] if copies is not None else None)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, recipe={self.recipe!r}")
