"""The backends and the one place that chooses between them.

* ``protocol.py``: the interface both offer (``Backend``): the layer entries, one op per layer and
  direction, and the primitives, one kernel each.
* ``contract.py``: the layer ops' contract, declared once by name (schemas, saved and made slots, wgrad
  operands, FP8 weights); the C++ header ``csrc/api/layer_contract.h`` is generated from it.
* ``primitives.py``: the primitive ops' contract, declared once (each op's schema, as ``csrc/binding.cpp``
  registers it, and its fake).
* ``cuda.py``: the CUDA extension's ops (built or loaded on first use); ``reference.py``: the same ops in
  plain PyTorch, from the oracle ``moegemm/reference.py``; ``fakes.py``: their meta functions.

Tensors on a Hopper GPU (compute capability 9.0) go to the CUDA ops; everything else, or
``MOEGEMM_BACKEND=reference`` (read once, at import; tests set ``FORCE_REFERENCE``), goes to the reference.
"""

from __future__ import annotations

import warnings

import torch

from .._env import env_choice
from . import reference
from .protocol import Backend

FORCE_REFERENCE = env_choice("MOEGEMM_BACKEND", ("reference",)) == "reference"

_HOPPER: dict = {}  # device index -> is it compute capability 9.0 (a plain dict: torch.compile traces it)
_CUDA: list = []  # the cuda backend module once imported (it builds or loads the extension)


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


def select(device: torch.device) -> Backend:
    """The backend for tensors on ``device``: the ``cuda`` or the ``reference`` module."""
    if not uses_cuda(device):
        return reference
    if not _CUDA:
        from . import cuda

        _CUDA.append(cuda)
    return _CUDA[0]
