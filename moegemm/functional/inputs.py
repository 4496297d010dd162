"""The layers' activation argument, checked once for both shells: a bf16 ``x`` or an FP8 ``Fp8Rows``
(``moegemm.quantize``), which only the ``fp8_blockwise`` recipe takes."""

from __future__ import annotations

import torch

from .._validate import check_x
from ..quantize import Fp8Rows, check_fp8_rows


def split_x(x, K: int, device: torch.device, recipe: str, cuda_path: bool):
    """(x for the Function, x_fp8, x_scales): a bf16 x checked, or an ``Fp8Rows`` checked and split into its
    grad target (which receives dx) and its FP8 tensors."""
    if isinstance(x, Fp8Rows):
        if recipe != "fp8_blockwise":
            raise ValueError(f"an FP8 x (Fp8Rows) needs recipe='fp8_blockwise', got {recipe!r}")
        check_fp8_rows(x, K, device)
        return x.grad_target, x.q, x.s
    check_x(x, K, device, cuda_path=cuda_path)
    return x, None, None
