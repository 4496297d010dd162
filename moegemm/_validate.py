"""Input validation of SPEC §6, shared by the CUDA and the reference path.

Every check runs on the host before any kernel is launched and names the argument, the expected and the
actual value. ``m_splits`` given as a list or CPU tensor is checked here (negative counts, sum ≠ T);
a device tensor is never read on the host unless the checked mode is on (``check_splits=True`` or
``MOEGEMM_CHECK_SPLITS=1``, read once at import), which validates it on the device and raises.
"""

from __future__ import annotations

import numbers
import os
from typing import Sequence, Union

import torch

from .layout import MAX_EXPERTS, MAX_TOKENS, RECIPE_IDS

# The default of check_splits, read once at import (tests set it directly).
CHECK_SPLITS = os.environ.get("MOEGEMM_CHECK_SPLITS", "0") not in ("", "0")
RECIPES = tuple(RECIPE_IDS)
X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
W_DTYPES = (torch.bfloat16, torch.float32)

SplitsLike = Union[torch.Tensor, Sequence[int]]


def check_recipe(recipe: str) -> str:
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    return recipe


def check_num_experts(E: int, what: str) -> None:
    if not 1 <= E <= MAX_EXPERTS:
        raise ValueError(f"{what} must be in [1, {MAX_EXPERTS}], got {E}")


def check_weight(weight: torch.Tensor, name: str = "weight") -> None:
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(weight).__name__}")
    shape = weight.shape
    if len(shape) != 3:
        raise ValueError(f"{name} must be 3-D [E, N, K], got shape {tuple(shape)}")
    if weight.dtype not in W_DTYPES:
        raise TypeError(f"{name}.dtype must be one of {W_DTYPES}, got {weight.dtype}")
    E, N, K = shape
    check_num_experts(E, f"{name}.shape[0] (number of experts)")
    if N <= 0 or N % 16:
        raise ValueError(f"{name}.shape[1] (N, out_features) must be a positive multiple of 16, got {N}")
    if K <= 0 or K % 16:
        raise ValueError(f"{name}.shape[2] (K, in_features) must be a positive multiple of 16, got {K}")


def check_x(x: torch.Tensor, K: int, device: torch.device, cuda_path: bool = False) -> None:
    """x [T, K] on ``device``; bf16 on the CUDA path (``cuda_path``), which its kernels take."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    shape, dtype = x.shape, x.dtype
    if len(shape) != 2:
        raise ValueError(f"x must be 2-D [T, K], got shape {tuple(shape)}")
    if dtype is not torch.bfloat16:
        if dtype not in X_DTYPES:
            raise TypeError(f"x.dtype must be one of {X_DTYPES}, got {dtype}")
        if cuda_path:
            raise TypeError(f"x.dtype must be torch.bfloat16 on the CUDA path, got {dtype}")
    if shape[0] > MAX_TOKENS:
        raise ValueError(f"x.shape[0] (tokens) must be at most {MAX_TOKENS}, got {shape[0]}")
    if shape[1] != K:
        raise ValueError(f"x.shape[1] must equal weight.shape[2] = {K}, got {shape[1]}")
    if x.device != device:
        raise ValueError(f"x is on {x.device} but weight is on {device}")
    if not x.is_contiguous():
        raise ValueError("x must be contiguous")


def check_bias(bias, E: int, N: int, device: torch.device) -> None:
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
    if tuple(bias.shape) != (E, N):
        raise ValueError(f"bias must have shape [E, N] = {(E, N)}, got {tuple(bias.shape)}")
    if bias.device != device:
        raise ValueError(f"bias is on {bias.device} but weight is on {device}")
    if not bias.is_floating_point():
        raise TypeError(f"bias.dtype must be floating point, got {bias.dtype}")


def check_main_grad(weight: torch.Tensor) -> None:
    """Megatron's gradient-accumulation fusion: ``weight.main_grad`` must be an fp32 buffer like weight."""
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None:
        return
    if not isinstance(main_grad, torch.Tensor) or main_grad.dtype != torch.float32:
        raise TypeError(f"weight.main_grad must be a float32 tensor, got {getattr(main_grad, 'dtype', type(main_grad))}")
    if main_grad.shape != weight.shape or main_grad.device != weight.device or not main_grad.is_contiguous():
        raise ValueError(f"weight.main_grad must be contiguous with weight's shape {tuple(weight.shape)} on "
                         f"{weight.device}, got {tuple(main_grad.shape)} on {main_grad.device}")


def checked_mode(check_splits) -> bool:
    return CHECK_SPLITS if check_splits is None else bool(check_splits)


def splits_to_device(m_splits: SplitsLike, E: int, T: int, device: torch.device, check_splits=None) -> torch.Tensor:
    """Validate ``m_splits`` and return it as an int32/int64 tensor on ``device``.

    Host input (list, tuple, CPU tensor) is checked on the host and copied asynchronously. A tensor on
    ``device`` is returned as it is (never read on the host) unless the checked mode is on."""
    if isinstance(m_splits, torch.Tensor):
        if m_splits.dim() != 1:
            raise ValueError(f"m_splits must be 1-D, got shape {tuple(m_splits.shape)}")
        if m_splits.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"m_splits.dtype must be torch.int32 or torch.int64, got {m_splits.dtype}")
        if m_splits.numel() != E:
            raise ValueError(f"len(m_splits) must equal the number of experts E = {E}, got {m_splits.numel()}")
        if m_splits.device.type == "cpu" and device.type != "cpu":
            _check_host_counts(m_splits.tolist(), T)
            src = m_splits.contiguous().pin_memory() if torch.cuda.is_available() else m_splits
            return src.to(device, non_blocking=True)
        if m_splits.device != device:
            raise ValueError(f"m_splits is on {m_splits.device} but x is on {device}")
        if m_splits.device.type == "cpu":
            _check_host_counts(m_splits.tolist(), T)
        elif checked_mode(check_splits):
            _check_device_counts(m_splits, T)
        return m_splits.contiguous()
    if not isinstance(m_splits, (list, tuple)):
        raise TypeError(f"m_splits must be a list of ints or an int32/int64 tensor, got {type(m_splits).__name__}")
    if len(m_splits) != E:
        raise ValueError(f"len(m_splits) must equal the number of experts E = {E}, got {len(m_splits)}")
    counts = []
    for i, m in enumerate(m_splits):
        if isinstance(m, bool) or not isinstance(m, numbers.Integral):
            raise TypeError(f"m_splits[{i}] must be an int, got {type(m).__name__}")
        counts.append(int(m))
    _check_host_counts(counts, T)
    t = torch.tensor(counts, dtype=torch.int64)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _check_host_counts(counts, T: int) -> None:
    for i, m in enumerate(counts):
        if m < 0:
            raise ValueError(f"m_splits[{i}] must be non-negative, got {m}")
    if sum(counts) != T:
        raise ValueError(f"sum(m_splits) must equal x.shape[0] = {T}, got {sum(counts)}")


def _check_device_counts(m: torch.Tensor, T: int) -> None:
    """Checked mode: one device reduction and one host read (a deliberate sync). The sum is taken over
    counts clamped to [0, T] (E * T cannot overflow int64), so huge counts cannot wrap it to T."""
    m = m.long()
    lo, hi, total = torch.stack([m.min(), m.max(), m.clamp(0, T).sum()]).tolist()
    if lo < 0:
        raise ValueError(f"m_splits must be non-negative, got a count of {lo}")
    if hi > T:
        raise ValueError(f"every count of m_splits must be at most x.shape[0] = {T}, got {hi}")
    if total != T:
        raise ValueError(f"sum(m_splits) must equal x.shape[0] = {T}, got {total}")
