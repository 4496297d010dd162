"""Public entry points of the FP8 blockwise quantizers (docs/design.md#fp8-recipe), on whichever backend the tensor's
device selects. Outputs use the canonical layouts described in ``reference.py``."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from . import backends
from ._validate import (SplitsLike, check_bool_arg, check_num_experts, check_token_count, check_tokens_input, check_weight,
                        num_splits, splits_to_device)
from .layout import BLOCK, MAX_TOKENS, ceil_div


def make_plan(m_splits: SplitsLike, T: int, device=None, check_splits=None) -> torch.Tensor:
    """Expert offsets ``[3, E+1]`` int32 (token starts, padded column starts, scale-block starts)."""
    if device is None:
        device = m_splits.device if isinstance(m_splits, torch.Tensor) else torch.device("cpu")
    device = torch.device(device)
    T = check_token_count("T", T)
    E = num_splits(m_splits)
    check_num_experts(E, "len(m_splits) (the number of experts)")  # the layers check weight.shape[0]
    m = splits_to_device(m_splits, E, T, device, check_splits)
    return backends.select(device).make_plan(m, T)


def quantize_act(x: torch.Tensor, m_splits: SplitsLike, rows: bool = True, cols: bool = True):
    """Multi-cast quantization of ``x [T, K]``: ``(q, s, qT, sT)``, None for the parts not asked for."""
    check_tokens_input(x)
    check_bool_arg("rows", rows)
    check_bool_arg("cols", cols)
    plan = make_plan(m_splits, x.shape[0], device=x.device)
    return backends.select(x.device).quantize_act(x.contiguous(), plan, rows=rows, cols=cols)


def quantize_weight(weight: torch.Tensor):
    """128×128-block quantization: ``(q [E,N,K], s [E,Nb,Kb], qT [E,K,N], sT [E,Kb,Nb])``."""
    check_weight(weight)
    return backends.select(weight.device).quantize_weight(weight.contiguous())


class Fp8Rows(NamedTuple):
    """An FP8 activation as an FP8 dispatcher delivers it: ``q [T, K]`` float8_e4m3fn and its 1×128 row
    scales ``s [T, ceil(K/128)]`` fp32 (quantize_act's row copy, docs/design.md#fp8-recipe; any strides: moegemm's
    layout is K-major, ``layout.empty_row_scales``, and scales in another are copied into it by each
    op that reads them), and ``grad_target``: the
    differentiable tensor ``[T, K]`` that receives the input gradient dx (bf16, cast to its dtype) in
    backward, or None (then no dx is computed). Pass it as ``x`` to grouped_linear / grouped_mlp /
    GroupedLinear / GroupedMLP / MoegemmExperts (fp8_blockwise only). With the weight gradient wanted, backward
    reads ``q`` and ``s`` again (wgrad's column copy is made from them then): keep them unchanged until it ran."""
    q: torch.Tensor
    s: torch.Tensor
    grad_target: Optional[torch.Tensor] = None


def check_fp8_rows(x: Fp8Rows, K: int, device) -> None:
    q, s, g = x
    if not isinstance(q, torch.Tensor) or q.dtype != torch.float8_e4m3fn:
        raise TypeError(f"Fp8Rows.q must be a float8_e4m3fn tensor, got {getattr(q, 'dtype', type(q).__name__)}")
    if q.dim() != 2 or q.shape[1] != K:
        raise ValueError(f"Fp8Rows.q must be [T, {K}] (K = weight.shape[2]), got shape {tuple(q.shape)}")
    if q.shape[0] > MAX_TOKENS:
        raise ValueError(f"Fp8Rows.q.shape[0] (tokens) must be at most {MAX_TOKENS}, got {q.shape[0]}")
    if q.device != torch.device(device):
        raise ValueError(f"Fp8Rows.q is on {q.device} but weight is on {device}")
    if not q.is_contiguous():
        raise ValueError(f"Fp8Rows.q must be contiguous, got strides {q.stride()} for shape {tuple(q.shape)}")
    want = (q.shape[0], ceil_div(K, BLOCK))
    if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or tuple(s.shape) != want:
        raise ValueError(f"Fp8Rows.s must be a float32 tensor of shape {want}, got "
                         f"{getattr(s, 'dtype', type(s).__name__)} {tuple(getattr(s, 'shape', ()))}")
    if s.device != q.device:
        raise ValueError(f"Fp8Rows.s must be on {q.device}, got one on {s.device}")
    check_grad_target(g, q, "Fp8Rows.grad_target", "Fp8Rows.q")


def check_grad_target(g, like: torch.Tensor, name: str, like_name: str) -> None:
    """A grad_target: None, or a floating-point tensor of ``like``'s shape on its device (it receives dx)."""
    if g is None:
        return
    if (not isinstance(g, torch.Tensor) or not g.is_floating_point() or g.shape != like.shape
            or g.device != like.device):
        raise ValueError(f"{name} must be None or a floating-point tensor of {like_name}'s shape {tuple(like.shape)} on "
                         f"{like.device}, got {getattr(g, 'dtype', type(g).__name__)} "
                         f"{tuple(getattr(g, 'shape', ()))} on {getattr(g, 'device', None)}")


def to_fp8_rows(x: torch.Tensor, grad_target: Optional[torch.Tensor] = None) -> Fp8Rows:
    """``x [T, K]`` quantized into its FP8 row copy (1×128 blocks; quantize_act's rows), as an FP8
    dispatcher would send it. ``grad_target`` defaults to x itself when x requires grad: dx flows back to
    the unquantized tensor (straight through the quantization), as a dispatcher's backward wants it."""
    check_tokens_input(x)
    check_grad_target(grad_target, x, "grad_target", "x")
    with torch.no_grad():
        q, s, _, _ = quantize_act(x.detach(), [x.shape[0]], rows=True, cols=False)
    if grad_target is None and x.requires_grad:
        grad_target = x
    return Fp8Rows(q, s, grad_target)
