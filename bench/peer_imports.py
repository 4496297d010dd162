"""Importing the peers: unpack carried wheels (torchao, nvidia-cutlass) when they are not importable,
import what each variant needs into MOD, and record in UNAVAILABLE why a variant cannot run at all."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

from shared import REPO, log, short
from variants import VARIANTS, VBY

# Filled by load_peers(): module handles, and why a variant cannot run at all (key -> reason).
MOD: dict = {}
UNAVAILABLE: dict = {}


def ensure_carried_wheels() -> list:
    """If torchao / nvidia-cutlass are not importable but their wheels are in .whl/ (carried to the GPU
    machine), unpack them into a temp dir on sys.path (what `pip install --no-deps --target` does)."""
    wanted = {"torchao": "torchao", "nvidia_cutlass": "cutlass_library"}
    site = Path(tempfile.gettempdir()) / "moegemm_bench_site"
    done = []
    for whl in sorted((REPO / ".whl").glob("*.whl")):
        dist = whl.name.split("-")[0]
        top = wanted.get(dist)
        if top is None:
            continue
        try:
            if importlib.util.find_spec(top) is not None:
                continue
        except Exception:
            pass
        try:
            site.mkdir(parents=True, exist_ok=True)
            with zipfile.ZipFile(whl) as z:
                z.extractall(site)
            done.append(whl.name)
        except Exception as exc:  # pragma: no cover
            log(f"[bench] could not unpack {whl.name}: {short(exc)}")
    if done:
        if str(site) not in sys.path:
            sys.path.insert(0, str(site))
        os.environ["PYTHONPATH"] = str(site) + os.pathsep + os.environ.get("PYTHONPATH", "")
        importlib.invalidate_caches()
        log(f"[bench] unpacked carried wheels into {site}: {', '.join(done)}")
    return done


def load_peers(dev: str, only=None) -> None:
    """Import what each variant needs; record why a variant is unavailable."""
    keys = [v.key for v in VARIANTS] if only is None else [only]
    fams = {VBY[k].family for k in keys}
    if "moegemm" in fams:
        try:
            import moegemm
            from moegemm import backends as backend

            if not backend.uses_cuda(torch.device(dev)):
                raise RuntimeError("moegemm would run its plain-PyTorch reference path here "
                                   "(no Hopper GPU or MOEGEMM_BACKEND=reference)")
            from moegemm.backends import cuda as cuda_ops  # builds / loads the extension

            MOD["moegemm"], MOD["moegemm_ops"] = moegemm, cuda_ops
        except Exception as exc:
            for k in (v.key for v in VARIANTS if v.family == "moegemm"):
                UNAVAILABLE[k] = f"moegemm not usable: {short(exc)}"
    if "torch" in fams and not hasattr(torch, "_scaled_grouped_mm"):
        for k in ("torch_fp8", "torch_fp8_gemm"):
            UNAVAILABLE[k] = "torch._scaled_grouped_mm missing in this torch"
    if "torch" in fams and not hasattr(torch, "_grouped_mm"):
        UNAVAILABLE["torch_bf16"] = "torch._grouped_mm missing in this torch"
    if "torchao" in fams:
        # The FP8 rowwise MoE path is Triton + torch ops only; do not load torchao's prebuilt C++/CUDA
        # extension (built for some CUDA, possibly not this torch's), unless the caller says otherwise.
        os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
        try:
            from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm as ao_mm

            import torchao

            MOD["torchao_mm"], MOD["torchao_version"] = ao_mm, getattr(torchao, "__version__", "?")
        except Exception as exc:
            UNAVAILABLE["torchao_fp8"] = f"torchao not importable: {short(exc)}"
    if "te" in fams:
        try:
            import transformer_engine
            import transformer_engine.pytorch as te

            MOD["te"], MOD["te_version"] = te, getattr(transformer_engine, "__version__", "?")
        except Exception as exc:
            for k in ("te_bf16", "te_fp8"):
                UNAVAILABLE[k] = f"TransformerEngine not importable: {short(exc)}"
