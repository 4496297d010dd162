"""What every module of the suite shares: the repository root, the device and dtypes of the run, log()
and short() for messages, and the CUDA-context helpers cuda_alive() and free()."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]

BF16 = torch.bfloat16
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
DEV = "cuda"  # every tensor of the run lives here


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def short(exc: BaseException, n: int = 300) -> str:
    s = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    return s if len(s) <= n else s[: n - 3] + "..."


def cuda_alive() -> bool:
    try:
        torch.cuda.synchronize()
        torch.empty(1, device=DEV).add_(1).item()
        return True
    except Exception:
        return False


def free():
    gc.collect()
    torch.cuda.empty_cache()
