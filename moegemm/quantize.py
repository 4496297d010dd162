"""Public entry points of the FP8 blockwise quantizers (SPEC §3), on whichever backend the tensor's
device selects. Outputs use the canonical layouts described in ``reference.py``."""

from __future__ import annotations

import torch

from . import backend
from ._validate import SplitsLike, check_num_experts, check_weight, splits_to_device


def make_plan(m_splits: SplitsLike, T: int, device=None, check_splits=None) -> torch.Tensor:
    """Expert offsets ``[3, E+1]`` int32 (token starts, padded column starts, scale-block starts)."""
    if device is None:
        device = m_splits.device if isinstance(m_splits, torch.Tensor) else torch.device("cpu")
    device = torch.device(device)
    check_num_experts(len(m_splits), "len(m_splits) (the number of experts)")  # the layers check weight.shape[0]
    m = splits_to_device(m_splits, len(m_splits), T, device, check_splits)
    return backend.select(device).make_plan(m, T)


def quantize_act(x: torch.Tensor, m_splits: SplitsLike, rows: bool = True, cols: bool = True):
    """Multi-cast quantization of ``x [T, K]``: ``(q, s, qT, sT)``, None for the parts not asked for."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2 or x.shape[1] <= 0 or x.shape[1] % 16:
        raise ValueError(f"x must be [T, K] with K a positive multiple of 16, got shape {tuple(x.shape)}")
    plan = make_plan(m_splits, x.shape[0], device=x.device)
    return backend.select(x.device).quantize_act(x.contiguous(), plan, rows=rows, cols=cols)


def quantize_weight(weight: torch.Tensor):
    """128×128-block quantization: ``(q [E,N,K], s [E,Nb,Kb], qT [E,K,N], sT [E,Kb,Nb])``."""
    check_weight(weight)
    return backend.select(weight.device).quantize_weight(weight.contiguous())
