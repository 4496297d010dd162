"""The one place that chooses between the CUDA extension and the plain-PyTorch reference.

Both backends offer the same functions: the layer entries ``linear_fwd, linear_bwd, mlp_fwd, mlp_bwd``
(one per layer and direction: ``cuda_ops`` wraps the C++ ops, ``reference_api`` builds them from the
reference primitives) and the primitives ``make_plan, quantize_act, quantize_weight, ...`` with the same
canonical layouts (see ``reference.py``). Tensors on a Hopper GPU (compute capability 9.0) go to the CUDA
ops (built on first use); everything else, or ``MOEGEMM_BACKEND=reference`` (read once, at import; tests
set ``FORCE_REFERENCE``), goes to the reference.
"""

from __future__ import annotations

import os
import warnings

import torch

from . import reference as reference_api

FORCE_REFERENCE = os.environ.get("MOEGEMM_BACKEND", "") == "reference"

_HOPPER: dict = {}  # device index -> is it compute capability 9.0 (a plain dict: torch.compile traces it)
_CUDA_OPS: list = []  # the cuda_ops module once imported (it builds or loads the extension)


def _device_is_hopper(index: int) -> bool:
    if index not in _HOPPER:
        _HOPPER[index] = torch.cuda.get_device_capability(index) == (9, 0)
    return _HOPPER[index]


def uses_cuda(device: torch.device) -> bool:
    if device.type != "cuda" or FORCE_REFERENCE:
        return False
    index = device.index
    if _HOPPER.get(index) or _device_is_hopper(index if index is not None else torch.cuda.current_device()):
        return True
    _warn_not_hopper()
    return False


def _warn_not_hopper() -> None:
    warnings.warn("moegemm: the CUDA kernels need a Hopper GPU (sm_90a); using the slow reference path")


def select(device: torch.device):
    """The backend module for tensors on ``device``: ``cuda_ops`` or ``reference_api``."""
    if not uses_cuda(device):
        return reference_api
    if not _CUDA_OPS:
        from . import cuda as cuda_ops

        _CUDA_OPS.append(cuda_ops)
    return _CUDA_OPS[0]
