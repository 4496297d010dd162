"""The SM budget: how many SMs of the GPU moegemm's persistent kernels spread over.

In expert-parallel training the token all-to-all runs on another stream while the experts' GEMMs run, and its
kernels hold SMs. moegemm's GEMMs share out their tiles dynamically, so they keep their speed on the SMs left to
them without a budget too; a budget set to the SMs that the communication leaves free (the GPU's count less what
DeepEP or NCCL reserve) gives them those SMs from the start, as DeepGEMM's ``set_num_sms`` does:

    moegemm.set_num_sms(132 - 24)          # process-wide, until changed; None: every SM again
    with moegemm.num_sms(108):             # for a block, then the budget before it again
        y = mlp(x, m_splits, probs)

or ``MOEGEMM_NUM_SMS=108`` in the environment (read at import). The budget is read at each launch: a CUDA graph
keeps the budget of its capture. It changes which SMs compute, never the results (bitwise the same for every
budget). It bounds the grouped GEMMs (FP8 and bf16) and the multi-cast quantizer. On the CPU (the reference path)
it is checked and kept, and changes nothing.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator, Optional

import torch

ENV = "MOEGEMM_NUM_SMS"

_budget: Optional[int] = None


def _checked(sms, what: str) -> Optional[int]:
    if sms is None:
        return None
    if isinstance(sms, bool) or not isinstance(sms, int):
        raise TypeError(f"moegemm: {what} must be a positive int or None, got {sms!r}")
    if sms < 1:
        raise ValueError(f"moegemm: {what} must be at least 1 (None: every SM), got {sms}")
    if torch.cuda.is_available():
        device_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        if sms > device_sms:
            raise ValueError(f"moegemm: {what} = {sms} exceeds the {device_sms} SMs of "
                             f"{torch.cuda.get_device_name(torch.cuda.current_device())}")
    return sms


def _push() -> None:
    """Hands the budget to the extension once it is loaded (its kernels read it at each launch)."""
    if "moegemm.backends.cuda" in sys.modules:
        torch.ops.moegemm.set_sm_budget(_budget or 0)


def set_num_sms(sms: Optional[int]) -> None:
    """Let moegemm's persistent kernels use at most ``sms`` SMs of each GPU (None: all of them)."""
    global _budget
    _budget = _checked(sms, "num_sms")
    _push()


def get_num_sms() -> Optional[int]:
    """The SM budget set (None: every SM)."""
    return _budget


@contextlib.contextmanager
def num_sms(sms: Optional[int]) -> Iterator[None]:
    """The SM budget ``sms`` inside the block, the one before it after (also when the block raises)."""
    before = _budget
    set_num_sms(sms)
    try:
        yield
    finally:
        set_num_sms(before)


def _from_env() -> Optional[int]:
    value = os.environ.get(ENV, "").strip()
    if not value:
        return None
    try:
        sms = int(value)
    except ValueError:
        raise ValueError(f"moegemm: {ENV} must be a positive integer (unset: every SM), got {value!r}") from None
    return _checked(sms, ENV)


_budget = _from_env()
