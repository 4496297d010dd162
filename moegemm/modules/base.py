"""What the layer modules share (``GroupedLinear``, ``GroupedMLP``, the Megatron experts):

* ``ExpertLayer``: a mixin for ``nn.Module``s that owns the FP8 weight cache of the layer's expert weights
  (``moegemm/weight_cache.py`` has its rules), the split backward's wgrad store, ``refresh_fp8_weights``
  and ``backward_dw``;
* ``GroupedWeights``: the parameters of one expert GEMM, ``weight [E, out, in]`` and ``bias [E, out]``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from .. import weight_cache
from .._validate import check_bool_arg, check_optional_bool, check_recipe
from ..functional import WgradStore


class ExpertLayer:
    """The FP8 weights and the split backward of a layer module. A subclass (an ``nn.Module``) calls
    ``_init_expert_layer`` in its constructor and names the weights its op takes in ``expert_weights()``.

    * ``fp8_weight_cache`` (fp8_blockwise): keep the FP8 copies of the weights (``W`` and ``Wᵀ``) and
      re-quantize them only when the weights changed; ``False``: quantize inside every call (the explicit
      ``is_first_microbatch`` flags keep their meaning); setting it to False frees the copies.
    * ``refresh_fp8_weights()``: quantize the current weights into the cache now (after writes no check
      can see, and between replays of a CUDA graph that reads the copies).
    * ``delay_wgrad_compute`` (Megatron's split backward): backward leaves the weight gradients to
      ``backward_dw()``, which runs every backward's since the last call."""

    recipe: str
    _fp8_inference = None  # GroupedMLP.to_fp8_inference: the W copies, the only weights left

    def _init_expert_layer(self, recipe: str, fp8_weight_cache: bool = True, delay_wgrad_compute: bool = False) -> None:
        self.recipe = check_recipe(recipe)
        weight_cache.attach(self, fp8_weight_cache)
        self.delay_wgrad_compute = delay_wgrad_compute
        self._wgrad_store = WgradStore()

    def expert_weights(self) -> tuple:
        """The weights whose FP8 copies the layer's op takes, in its order."""
        raise NotImplementedError

    fp8_weight_cache = weight_cache.switch

    @property
    def delay_wgrad_compute(self) -> bool:
        """Whether backward leaves the weight gradients to ``backward_dw()`` (settable: True or False)."""
        return self._delay_wgrad_compute

    @delay_wgrad_compute.setter
    def delay_wgrad_compute(self, on: bool) -> None:
        self._delay_wgrad_compute = check_bool_arg("delay_wgrad_compute", on)

    def fp8_weights(self, is_first_microbatch: Optional[bool] = None):
        """The FP8 copies of ``expert_weights()`` for this call, one ``quantize_weight`` 4-tuple each; None:
        quantize inside the call (bf16, or the cache's decision)."""
        check_optional_bool("is_first_microbatch", is_first_microbatch)
        if self.recipe != "fp8_blockwise":
            return None
        if self._fp8_inference is not None:
            return self._fp8_inference
        return self._fp8_cache.get(self.expert_weights(), is_first_microbatch)

    def refresh_fp8_weights(self) -> None:
        """Quantize the current weights into the FP8 cache now: the explicit call after writes no check can
        see (through ``.data``, or a buffer sharing the weights' storage), and between replays of a CUDA
        graph that reads the cached copies (``is_first_microbatch=False`` during capture): copies a graph
        reads are overwritten in place. No-op for ``bf16`` and after ``to_fp8_inference``."""
        if self.recipe == "fp8_blockwise" and self._fp8_inference is None:
            self._fp8_cache.refresh(self.expert_weights())

    def backward_dw(self) -> None:
        """The weight gradients of every backward since the last call (delay_wgrad_compute)."""
        self._wgrad_store.backward_dw()


class GroupedWeights(nn.Module):
    """``weight [E, out, in]`` and optional ``bias [E, out]`` of one expert GEMM (uninitialized: see
    ``reset_parameters``). ``forward()`` returns them: calling the holder runs the forward pre-hooks
    registered on it (Megatron DDP's ``overlap_param_gather`` waits there for the parameters' all-gather)."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool, device, dtype):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(num_experts, out_features, **factory)) if bias else None

    def reset_parameters(self) -> None:
        init_uniform_(self.weight, self.bias)

    def forward(self):
        return self.weight, self.bias

    def extra_repr(self) -> str:
        E, N, K = self.weight.shape
        return f"num_experts={E}, in_features={K}, out_features={N}, bias={self.bias is not None}"


def init_uniform_(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    """nn.Linear's default initialization, per expert: U(-1/sqrt(in), 1/sqrt(in)) for weight and bias."""
    bound = 1.0 / math.sqrt(weight.shape[2])
    with torch.no_grad():
        weight.uniform_(-bound, bound)
        if bias is not None:
            bias.uniform_(-bound, bound)
