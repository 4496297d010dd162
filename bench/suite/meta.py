"""What a run records about itself (results.json "meta"): date, git commit and state, argv, Python,
torch/CUDA/triton/moegemm/torchao/TransformerEngine versions, the GPU and nvidia-smi's clocks and power
limit."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
import sys

import torch

from bench.suite.shared import REPO


def _run(cmd, cwd=None):
    try:
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=20).stdout.strip() or None
    except Exception:
        return None


def collect_meta(args) -> dict:
    rev = _run(["git", "rev-parse", "HEAD"], cwd=str(REPO))
    rev = rev if rev and len(rev) == 40 else None  # the GPU machine's copy of the tree has no git history
    commit = os.environ.get("MOEGEMM_COMMIT") or rev or "unknown"
    # Only where this tree is the checkout of the commit named: a copy (the device machine's, with no
    # or stale git metadata) says nothing about its state.
    same = rev is not None and os.environ.get("MOEGEMM_COMMIT", rev) == rev
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=str(REPO)) if same else None
    meta = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": commit,
        "git_dirty": bool(dirty) if dirty is not None else None,
        "git_dirty_files": dirty.splitlines() if dirty else [],
        "argv": sys.argv[1:],
        "quick": bool(getattr(args, "quick", False)),  # (tools without --quick)
        "python": platform.python_version(),
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda},
    }
    try:
        import triton

        meta["versions"]["triton"] = triton.__version__
    except Exception:
        meta["versions"]["triton"] = None
    try:
        import moegemm

        meta["versions"]["moegemm"] = getattr(moegemm, "__version__", "?")
    except Exception:
        meta["versions"]["moegemm"] = None
    for dist in ("torchao", "transformer_engine"):  # the peers' packages, where installed
        try:
            meta["versions"][dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            meta["versions"][dist] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        meta.update(device=torch.cuda.get_device_name(0), capability=list(torch.cuda.get_device_capability(0)),
                    sm_count=p.multi_processor_count, gpu_mem_gib=round(p.total_memory / 2 ** 30, 1))
    meta["nvidia_smi"] = _run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem,power.limit",
                               "--format=csv,noheader"])
    return meta
