#!/usr/bin/env python3
"""The moegemm benchmark suite (SPEC §7): moegemm next to its peers, side by side in one process.

    python bench/bench.py            # full run (~5-8 min of GPU time), results under bench/results/
    python bench/bench.py --quick    # < 2 min: fewer iterations, Zipf splits only, short jitter run
    python bench/plot.py bench/results/results.json   # the PNGs again, on any machine with matplotlib

Model shapes (E, hidden, ffn per expert, routed tokens T) with Zipf-skewed m_splits (empty experts
included) and a balanced variant. Variants (each guarded: a failure is recorded, never fatal):
  moegemm fp8_blockwise / bf16        moegemm.grouped_linear, moegemm.GroupedMLP (device m_splits)
  torch._grouped_mm bf16              device offsets; dgrad 2d x 3d, wgrad 2d x 2d with offs (baseline)
  torch._scaled_grouped_mm fp8        rowwise quantization in plain torch ops, included in the timing
  torchao fp8 rowwise                 torchao.prototype.moe_training (Triton quantization), if importable
  per-expert loop bf16                torch.split + F.linear per expert, m_splits.tolist() (a host sync)
  TE GroupedLinear bf16 / fp8         if transformer_engine is importable
  (+ "GEMM only" rows for fc1: operands quantized beforehand, not a peer, for the kernel comparison)
Metrics: fc1 forward (K=hidden, N=2*ffn) and expert MLP (SwiGLU with router probs) forward+backward:
median ms over CUDA-event-timed back-to-back iterations after warm-up, TFLOP/s, fraction of the dense
ceilings measured in the same run, speed-up over torch._grouped_mm bf16; host overhead per call with the
GPU kept busy (torch.cuda._sleep), also swept over E; jitter of synchronised iterations; peak extra
memory; accuracy of every variant against a float64 per-expert computation.

Peers that can crash the CUDA context (device-side asserts cannot be caught) are first run on a small
case in a child process per variant ("probe"); a variant/split kind whose probe died is reported n/a.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib
import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
import zipfile
from pathlib import Path

import torch
import torch.nn.functional as F_

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from moegemm.workloads import GEMM_SHAPES, SHAPES, balanced_splits, zipf_splits  # noqa: E402

# Issue 6: TFLOP/s targets of the grouped-GEMM problems (moegemm.workloads.GEMM_SHAPES), fc1 forward.
GEMM_TARGETS = {"GEMM 4x8192 N=4096 K=7168": 1300.0, "GEMM 64x2304 N=2816 K=2048": 1100.0}
SWEEP_E = (8, 32, 128, 256)
SWEEP_SHAPE = (1024, 512, 8192)  # hidden, ffn, T for the host-overhead sweep (Zipf splits)
JITTER_SHAPE = "DeepSeek-V2-Lite"
PROBE_E, PROBE_H, PROBE_F = 8, 256, 128
PROBE_SPLITS = {"aligned": [32] * 8, "unaligned": [0, 1, 3, 17, 0, 30, 64, 13]}

BF16 = torch.bfloat16
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
PROBE_TAG = "@@PROBE "
DEV = "cuda"  # every tensor of the run lives here


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def short(exc: BaseException, n: int = 300) -> str:
    s = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    return s if len(s) <= n else s[: n - 3] + "..."


# ----------------------------------------------------------------------------------------- variants
class Variant:
    def __init__(self, key, label, precision, ops=("fc1", "mlp"), aux=False, family=None):
        self.key, self.label, self.precision, self.ops, self.aux = key, label, precision, ops, aux
        self.family = family or key.split("_")[0]


VARIANTS = [
    Variant("moegemm_fp8", "moegemm fp8_blockwise", "fp8"),
    Variant("moegemm_bf16", "moegemm bf16", "bf16"),
    Variant("torch_bf16", "torch._grouped_mm bf16", "bf16"),
    Variant("torch_fp8", "torch._scaled_grouped_mm fp8 rowwise", "fp8"),
    Variant("torchao_fp8", "torchao fp8 rowwise", "fp8"),
    Variant("loop_bf16", "per-expert loop bf16 (split+tolist)", "bf16"),
    Variant("te_bf16", "TE GroupedLinear bf16", "bf16"),
    Variant("te_fp8", "TE GroupedLinear fp8", "fp8"),
    Variant("moegemm_fp8_gemm", "moegemm fp8 GEMM only (pre-quantized)", "fp8", ops=("fc1",), aux=True),
    Variant("torch_fp8_gemm", "torch fp8 rowwise GEMM only (pre-quantized)", "fp8", ops=("fc1",), aux=True),
    Variant("moegemm_fp8_wcache", "moegemm fp8_blockwise, FP8 weights cached (is_first_microbatch=False)", "fp8",
            ops=("mlp",), aux=True),
]
VBY = {v.key: v for v in VARIANTS}
BASELINE = "torch_bf16"

# Filled by load_peers(): module handles, and why a variant cannot run at all (key -> reason).
MOD: dict = {}
UNAVAILABLE: dict = {}


def _ensure_carried_wheels() -> list:
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
            from moegemm import backend

            if not backend.uses_cuda(torch.device(dev)):
                raise RuntimeError("moegemm would run its plain-PyTorch reference path here "
                                   "(no Hopper GPU or MOEGEMM_BACKEND=reference)")
            from moegemm import cuda_ops  # builds / loads the extension

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


# ------------------------------------------------------------------------------------------- splits
def split_kind(splits) -> str:
    """'aligned' when every group is non-empty and a multiple of 16 rows (what the FP8 2d x 2d grouped
    GEMM of torch needs), else 'unaligned'."""
    return "aligned" if all(c > 0 and c % 16 == 0 for c in splits) else "unaligned"


# --------------------------------------------------------------------------------------------- case
class Case:
    """Inputs of one benchmark point: x [T, H], W1 [E, 2F, H] (gate rows, then up rows), W2 [E, H, F],
    router probs [T] (fp32), upstream gradient dy [T, H], device m_splits."""

    def __init__(self, name, E, H, F, splits, dev="cuda", seed=0):
        self.name, self.E, self.H, self.F, self.splits = name, E, H, F, list(splits)
        self.T = T = sum(splits)
        self.kind = split_kind(splits)
        g = torch.Generator(device=dev)
        g.manual_seed(seed)
        self.x = torch.randn(T, H, device=dev, dtype=BF16, generator=g)
        self.W1 = torch.empty(E, 2 * F, H, device=dev, dtype=BF16).uniform_(-H ** -0.5, H ** -0.5, generator=g)
        self.W2 = torch.empty(E, H, F, device=dev, dtype=BF16).uniform_(-F ** -0.5, F ** -0.5, generator=g)
        self.probs = torch.rand(T, device=dev, generator=g) * 0.9 + 0.1
        self.dy = torch.randn(T, H, device=dev, dtype=BF16, generator=g)
        self.m = torch.tensor(self.splits, device=dev, dtype=torch.int64)
        # Leaves for the fwd+bwd step (share storage with the tensors above).
        self.xg = self.x.detach().requires_grad_()
        self.pg = self.probs.detach().requires_grad_()
        self.W1g = self.W1.detach().requires_grad_()
        self.W2g = self.W2.detach().requires_grad_()

    def flops(self, op):
        T, H, F = self.T, self.H, self.F
        if op == "fc1":
            return 2.0 * T * H * 2 * F
        return 3.0 * (2.0 * T * H * 2 * F + 2.0 * T * F * H)

    def min_bytes(self, op):
        """Bytes that any implementation must move (bf16 operands, fp32 probs): a roofline lower bound."""
        T, H, F, E = self.T, self.H, self.F, self.E
        if op == "fc1":
            return 2.0 * (T * H + E * 2 * F * H + T * 2 * F)
        return 2.0 * (4 * T * H + 2 * (E * 2 * F * H + E * H * F)) + 8.0 * T


@torch.no_grad()
def reference(c: Case, fc1_only: bool = False) -> dict:
    """float64 per-expert computation (inputs are the exact bf16 values), stored as fp32; with
    ``fc1_only`` just fc1's output h."""
    dev, T, H, F, E = c.x.device, c.T, c.H, c.F, c.E
    f32 = dict(dtype=torch.float32, device=dev)
    out = {"h": torch.empty(T, 2 * F, **f32), "y": torch.empty(T, H, **f32), "dx": torch.empty(T, H, **f32),
           "dprobs": torch.empty(T, **f32), "dW1": torch.zeros(E, 2 * F, H, **f32),
           "dW2": torch.zeros(E, H, F, **f32)}
    s0 = 0
    for e, cnt in enumerate(c.splits):
        if cnt == 0:
            continue
        rows = slice(s0, s0 + cnt)
        s0 += cnt
        w1, w2 = c.W1[e].double(), c.W2[e].double()
        xe, pe, dye = c.x[rows].double(), c.probs[rows].double()[:, None], c.dy[rows].double()
        h = xe @ w1.t()
        out["h"][rows] = h
        if fc1_only:
            continue
        g, u = h[:, :F], h[:, F:]
        sig = torch.sigmoid(g)
        s = g * sig
        act = s * u
        a = act * pe
        out["y"][rows] = a @ w2.t()
        da = dye @ w2
        out["dW2"][e] = dye.t() @ a
        out["dprobs"][rows] = (da * act).sum(1)
        dap = da * pe
        dh = torch.cat([dap * u * (sig * (1 + g * (1 - sig))), dap * s], 1)
        del h, g, u, sig, act, a, da, dap
        out["dx"][rows] = dh @ w1
        out["dW1"][e] = dh.t() @ xe
        del dh, xe, w1, w2
    return out


def rel_err(out, ref) -> float | None:
    """||out - ref||_F / ||ref||_F, accumulated in float64 over chunks (no full-size fp64 copy)."""
    if out is None:
        return None
    if out.numel() != ref.numel():
        raise ValueError(f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    o, r = out.detach().reshape(-1), ref.reshape(-1)
    num = den = 0.0
    step = 1 << 26
    for i in range(0, r.numel(), step):
        rr, oo = r[i:i + step].double(), o[i:i + step].double()
        num += (oo - rr).pow(2).sum().item()
        den += rr.pow(2).sum().item()
    if not math.isfinite(num):
        return float("nan")
    return math.sqrt(num / den) if den > 0 else (0.0 if num == 0 else float("inf"))


# ------------------------------------------------------------------------------ peer implementations
def _offs(m):
    return torch.cumsum(m, 0, dtype=torch.int32)


def swiglu_probs(h, probs, F):
    """The expert activation of every peer: silu(gate) * up * probs (torch ops, bf16)."""
    return F_.silu(h[:, :F]) * h[:, F:] * probs.to(h.dtype).unsqueeze(-1)


class _TorchGroupedLinearBF16(torch.autograd.Function):
    """y = x @ W[e]^T with torch._grouped_mm: fprop/dgrad 2d x 3d, wgrad 2d x 2d over the token offsets.
    wgrad passes dy^T column-major and x row-major: the layout torch allows empty groups in."""

    @staticmethod
    def forward(ctx, x, w, offs):
        ctx.save_for_backward(x, w, offs)
        return torch._grouped_mm(x, w.transpose(1, 2), offs=offs)

    @staticmethod
    def backward(ctx, dy):
        x, w, offs = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = torch._grouped_mm(dy, w, offs=offs)
        if ctx.needs_input_grad[1]:
            dw = torch._grouped_mm(dy.t(), x, offs=offs)
        return dx, dw, None


def _fp8_rowwise(t):
    """FP8 E4M3 quantization along the last dim in plain torch ops: (q contiguous, fp32 dequant scales
    of shape t.shape[:-1]); scale = amax / 448 per row."""
    amax = torch.linalg.vector_norm(t, float("inf"), dim=-1, keepdim=True).float()
    scale = amax.clamp_min(1e-12) / FP8_MAX
    q = (t / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8).contiguous()
    return q, scale.squeeze(-1).contiguous()


def _torch_fp8_fprop(x, w, offs):
    qx, sx = _fp8_rowwise(x)  # [T, K], [T]
    qw, sw = _fp8_rowwise(w)  # [E, N, K], [E, N]: per output column of B = W^T
    return torch._scaled_grouped_mm(qx, qw.transpose(1, 2), sx, sw, offs=offs, out_dtype=BF16, use_fast_accum=True)


class _TorchGroupedLinearFP8(torch.autograd.Function):
    """torch._scaled_grouped_mm with rowwise FP8 (quantization in torch ops, counted in the time).
    wgrad is FP8 (2d x 2d, scales per row of dy^T and x^T) only when every group is non-empty and a
    multiple of 16 rows: otherwise torch device-asserts (GroupMMCommon.cuh), so it runs in bf16."""

    @staticmethod
    def forward(ctx, x, w, offs, fp8_wgrad):
        ctx.save_for_backward(x, w, offs)
        ctx.fp8_wgrad = fp8_wgrad
        return _torch_fp8_fprop(x, w, offs)

    @staticmethod
    def backward(ctx, dy):
        x, w, offs = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            qdy, sdy = _fp8_rowwise(dy)                  # [T, N], [T]
            qwt, swt = _fp8_rowwise(w.transpose(1, 2))   # [E, K, N] contiguous, [E, K]
            dx = torch._scaled_grouped_mm(qdy, qwt.transpose(1, 2), sdy, swt, offs=offs, out_dtype=BF16,
                                          use_fast_accum=True)
        if ctx.needs_input_grad[1]:
            if ctx.fp8_wgrad:
                E = w.shape[0]
                qdyt, sdyt = _fp8_rowwise(dy.t())        # [N, T], [N]
                qxt, sxt = _fp8_rowwise(x.t())           # [K, T], [K]
                dw = torch._scaled_grouped_mm(qdyt, qxt.t(), sdyt.repeat(E), sxt.repeat(E), offs=offs,
                                              out_dtype=BF16, use_fast_accum=True)
            else:
                dw = torch._grouped_mm(dy.t(), x, offs=offs)
        return dx, dw, None, None


def _te_module(E, fin, fout, W, dev):
    te = MOD["te"]
    mod = te.GroupedLinear(E, fin, fout, bias=False, params_dtype=BF16, device=dev)
    with torch.no_grad():
        for e in range(E):
            getattr(mod, f"weight{e}").copy_(W[e])
    return mod


def _te_ctx(fp8: bool):
    if not fp8:
        return contextlib.nullcontext()
    te = MOD["te"]
    from transformer_engine.common import recipe as te_recipe

    rec = te_recipe.Float8BlockScaling() if hasattr(te_recipe, "Float8BlockScaling") else te_recipe.DelayedScaling()
    autocast = getattr(te, "fp8_autocast", None)
    if autocast is not None:
        return autocast(enabled=True, fp8_recipe=rec)
    return te.autocast(enabled=True, recipe=rec)


def static_unsupported(key, op, kind):
    """Combinations that are known to be impossible (reason), or None."""
    if op not in VBY[key].ops:
        return f"measured for {'/'.join(VBY[key].ops)} only"
    if key == "torchao_fp8" and op == "mlp" and kind == "unaligned":
        return ("wgrad needs non-empty 16-row groups: torch._scaled_grouped_mm 2d x 2d device-asserts otherwise "
                "(GroupMMCommon.cuh) and torchao 0.18 does not pad (pad_token_groups=True unsupported)")
    return None


def build_fc1(key, c: Case):
    """A callable running fc1's forward (call it under no_grad); per-call preparation (offsets,
    tolist, quantization) is inside the callable, so it is timed."""
    x, W1, m, E, T = c.x, c.W1, c.m, c.E, c.T
    if key in ("moegemm_fp8", "moegemm_bf16"):
        moe, recipe = MOD["moegemm"], "fp8_blockwise" if key == "moegemm_fp8" else "bf16"
        return lambda: moe.grouped_linear(x, W1, m, recipe=recipe)
    if key == "moegemm_fp8_gemm":
        ops = MOD["moegemm_ops"]
        plan = ops.make_plan(m, T)
        qx, sx = ops.quantize_act(x, plan, True, False)[:2]
        qw, sw = ops.quantize_weight(W1)[:2]
        return lambda: ops.gemm_fp8_ragged_m(qx, sx, qw, sw, plan)
    if key == "torch_bf16":
        return lambda: torch._grouped_mm(x, W1.transpose(1, 2), offs=_offs(m))
    if key == "torch_fp8":
        return lambda: _torch_fp8_fprop(x, W1, _offs(m))
    if key == "torch_fp8_gemm":
        qx, sx = _fp8_rowwise(x)
        qw, sw = _fp8_rowwise(W1)
        offs = _offs(m)
        return lambda: torch._scaled_grouped_mm(qx, qw.transpose(1, 2), sx, sw, offs=offs, out_dtype=BF16,
                                                use_fast_accum=True)
    if key == "torchao_fp8":
        ao = MOD["torchao_mm"]
        return lambda: ao(x, W1.transpose(-2, -1), _offs(m), out_dtype=BF16, pad_token_groups_for_grouped_mm=False)
    if key == "loop_bf16":
        w1s = [W1[e].clone() for e in range(E)]

        def loop():
            return torch.cat([F_.linear(xe, w) for xe, w in zip(x.split(m.tolist()), w1s)])
        return loop
    if key in ("te_bf16", "te_fp8"):
        mod, fp8 = _te_module(E, c.H, 2 * c.F, W1, x.device), key == "te_fp8"

        def te_fwd():
            with _te_ctx(fp8):
                return mod(x, m.tolist())
        return te_fwd
    raise KeyError(key)


class MLPImpl:
    """fwd(x, m, probs) -> y; params: the weight leaves; to_w(grads of params) -> (dW1, dW2) stacked."""

    def __init__(self, fwd, params, to_w=None):
        self.fwd, self.params = fwd, params
        self.to_w = to_w or (lambda g: (g[0], g[1]))


def build_mlp(key, c: Case) -> MLPImpl:
    E, H, F, dev = c.E, c.H, c.F, c.x.device
    if key in ("moegemm_fp8", "moegemm_bf16"):
        moe = MOD["moegemm"]
        mlp = moe.GroupedMLP(E, H, F, activation="swiglu", bias=False,
                             recipe="fp8_blockwise" if key == "moegemm_fp8" else "bf16", device=dev, dtype=BF16)
        with torch.no_grad():
            mlp.fc1.weight.copy_(c.W1)
            mlp.fc2.weight.copy_(c.W2)
        return MLPImpl(lambda x, m, p: mlp(x, m, p), [mlp.fc1.weight, mlp.fc2.weight])
    if key == "moegemm_fp8_wcache":  # weights quantized once per optimizer step, reused by later microbatches
        moe = MOD["moegemm"]
        mlp = moe.GroupedMLP(E, H, F, activation="swiglu", bias=False, recipe="fp8_blockwise", device=dev, dtype=BF16)
        with torch.no_grad():
            mlp.fc1.weight.copy_(c.W1)
            mlp.fc2.weight.copy_(c.W2)
            mlp(c.x, c.m, c.probs, is_first_microbatch=True)
        return MLPImpl(lambda x, m, p: mlp(x, m, p, is_first_microbatch=False), [mlp.fc1.weight, mlp.fc2.weight])
    if key == "torch_bf16":
        W1, W2 = c.W1g, c.W2g

        def fwd(x, m, p):
            offs = _offs(m)
            h = _TorchGroupedLinearBF16.apply(x, W1, offs)
            return _TorchGroupedLinearBF16.apply(swiglu_probs(h, p, F), W2, offs)
        return MLPImpl(fwd, [W1, W2])
    if key == "torch_fp8":
        W1, W2, fp8_wgrad = c.W1g, c.W2g, c.kind == "aligned"

        def fwd(x, m, p):
            offs = _offs(m)
            h = _TorchGroupedLinearFP8.apply(x, W1, offs, fp8_wgrad)
            return _TorchGroupedLinearFP8.apply(swiglu_probs(h, p, F), W2, offs, fp8_wgrad)
        return MLPImpl(fwd, [W1, W2])
    if key == "torchao_fp8":
        ao, W1, W2 = MOD["torchao_mm"], c.W1g, c.W2g

        def fwd(x, m, p):
            offs = _offs(m)
            h = ao(x, W1.transpose(-2, -1), offs, out_dtype=BF16, pad_token_groups_for_grouped_mm=False)
            return ao(swiglu_probs(h, p, F), W2.transpose(-2, -1), offs, out_dtype=BF16,
                      pad_token_groups_for_grouped_mm=False)
        return MLPImpl(fwd, [W1, W2])
    if key == "loop_bf16":
        w1s = [c.W1[e].clone().requires_grad_() for e in range(E)]
        w2s = [c.W2[e].clone().requires_grad_() for e in range(E)]

        def fwd(x, m, p):
            splits = m.tolist()
            return torch.cat([F_.linear(swiglu_probs(F_.linear(xe, w1), pe, F), w2)
                              for xe, pe, w1, w2 in zip(x.split(splits), p.split(splits), w1s, w2s)])
        return MLPImpl(fwd, w1s + w2s, lambda g: (torch.stack(g[:E]), torch.stack(g[E:])))
    if key in ("te_bf16", "te_fp8"):
        fc1, fc2, fp8 = _te_module(E, H, 2 * F, c.W1, dev), _te_module(E, F, H, c.W2, dev), key == "te_fp8"

        def fwd(x, m, p):
            splits = m.tolist()
            with _te_ctx(fp8):
                h = fc1(x, splits)
                return fc2(swiglu_probs(h, p, F), splits)
        params = [getattr(fc1, f"weight{e}") for e in range(E)] + [getattr(fc2, f"weight{e}") for e in range(E)]
        return MLPImpl(fwd, params, lambda g: (torch.stack(g[:E]), torch.stack(g[E:])))
    raise KeyError(key)


def make_step(impl: MLPImpl, c: Case):
    inputs = [c.xg, c.pg] + list(impl.params)

    def step():
        y = impl.fwd(c.xg, c.m, c.pg)
        return torch.autograd.grad(y, inputs, c.dy, allow_unused=True)
    return step


def mlp_errors(impl: MLPImpl, c: Case, ref: dict) -> dict:
    y = impl.fwd(c.xg, c.m, c.pg)
    grads = torch.autograd.grad(y, [c.xg, c.pg] + list(impl.params), c.dy, allow_unused=True)
    dW1, dW2 = impl.to_w(grads[2:])
    errs = {}
    for k, v in (("y", y), ("dx", grads[0]), ("dprobs", grads[1]), ("dW1", dW1), ("dW2", dW2)):
        try:
            errs[k] = rel_err(v, ref[k])
        except ValueError as exc:  # a layout we do not understand: report, do not fail the variant
            errs[k], errs[k + "_error"] = None, short(exc)
    del y, grads, dW1, dW2
    return errs


# ------------------------------------------------------------------------------------- measurement
def _pct(sorted_vals, p):
    return sorted_vals[min(len(sorted_vals) - 1, max(0, int(round(p * (len(sorted_vals) - 1)))))]


def time_op(fn, target_s, min_iters, max_iters, warmup) -> dict:
    """Median of per-iteration CUDA-event times over back-to-back iterations (the host may run ahead,
    as in training; a host-bound or syncing variant shows its host time here too)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    est = time.perf_counter() - t0
    n = int(min(max_iters, max(min_iters, target_s / max(est, 1e-6))))
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for a, b in evs:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    ts = sorted(a.elapsed_time(b) for a, b in evs)
    return {"ms": statistics.median(ts), "ms_p10": _pct(ts, 0.1), "ms_p90": _pct(ts, 0.9), "iters": n}


_CYCLES_PER_MS = None


def cycles_per_ms() -> float:
    global _CYCLES_PER_MS
    if _CYCLES_PER_MS is None:
        torch.cuda._sleep(1000)
        torch.cuda.synchronize()
        cyc, best = 20_000_000, float("inf")
        for _ in range(3):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.cuda._sleep(cyc)
            b.record()
            torch.cuda.synchronize()
            best = min(best, a.elapsed_time(b))
        _CYCLES_PER_MS = cyc / best
    return _CYCLES_PER_MS


def host_overhead(fn, reps, target_s=2e-3, max_calls=20) -> dict:
    """Host wall time per call while the GPU is busy with a torch.cuda._sleep enqueued before a batch of
    back-to-back calls (about ``target_s`` of host work, at most ``max_calls``), so the calls only
    enqueue; the median over ``reps`` batches. 'gpu_went_idle' counts the batches during which the sleep
    ran out: a call synchronised with the device (or filled the launch queue), so the time includes GPU
    waiting."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    est = time.perf_counter() - t0
    del out
    torch.cuda.synchronize()
    n = max(1, min(max_calls, int(target_s / max(est, 1e-6))))
    sleep_ms = min(max(2.0, 3e3 * n * est + 1.0), 2000.0)
    cyc = int(sleep_ms * cycles_per_ms())
    times, idle = [], 0
    for _ in range(reps):
        torch.cuda._sleep(cyc)
        ev = torch.cuda.Event()
        ev.record()
        t0 = time.perf_counter()
        for _ in range(n):
            out = fn()
            del out
        t1 = time.perf_counter()
        idle += int(ev.query())
        times.append((t1 - t0) / n)
        torch.cuda.synchronize()
    return {"host_us": statistics.median(times) * 1e6, "host_gpu_went_idle": idle, "host_reps": reps,
            "host_calls_per_rep": n}


def count_syncs(fn) -> int:
    """Synchronising CUDA operations torch reports during one call (torch.cuda.set_sync_debug_mode)."""
    torch.cuda.synchronize()
    prev = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = fn()
        finally:
            torch.cuda.set_sync_debug_mode(prev)
    del out
    torch.cuda.synchronize()
    return sum(1 for w in caught if "synchroniz" in str(w.message).lower())


def peak_extra_mib(fn) -> float:
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del out
    return (peak - base) / 2 ** 20


def jitter(fn, n, max_s) -> dict:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    ts, end = [], time.perf_counter() + max_s
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
        if time.perf_counter() > end:
            break
    ts.sort()
    return {"n": len(ts), "p50_ms": _pct(ts, 0.5) * 1e3, "p99_ms": _pct(ts, 0.99) * 1e3, "max_ms": ts[-1] * 1e3,
            "mean_ms": statistics.fmean(ts) * 1e3}


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


def measure_ceilings(cfg) -> dict:
    out = {}
    n = cfg["ceiling_n"]
    g = torch.Generator(device=DEV)
    g.manual_seed(1)
    a = torch.randn(n, n, device=DEV, dtype=BF16, generator=g)
    b = torch.randn(n, n, device=DEV, dtype=BF16, generator=g)
    try:
        t = time_op(lambda: torch.mm(a, b), cfg["ceiling_s"], 10, 200, 5)
        out["bf16_tflops"] = 2.0 * n ** 3 / t["ms"] / 1e9
        out["bf16_how"] = f"torch.mm bf16 {n}^3"
    except Exception as exc:
        out["bf16_error"] = short(exc)
    try:
        a8, bt8 = a.to(FP8), b.t().contiguous().to(FP8)
        b8 = bt8.t()  # column-major [K, N]
        try:
            sa = torch.ones(n, 1, device=DEV, dtype=torch.float32)
            sb = torch.ones(1, n, device=DEV, dtype=torch.float32)
            f = lambda: torch._scaled_mm(a8, b8, sa, sb, out_dtype=BF16, use_fast_accum=True)  # noqa: E731
            f()
            how = f"torch._scaled_mm fp8 e4m3 rowwise {n}^3, fast accum"
        except Exception as exc:
            out["fp8_rowwise_error"] = short(exc)
            one = torch.ones((), device=DEV, dtype=torch.float32)
            f = lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=BF16, use_fast_accum=True)  # noqa: E731
            how = f"torch._scaled_mm fp8 e4m3 tensorwise {n}^3, fast accum"
        t = time_op(f, cfg["ceiling_s"], 10, 300, 5)
        out["fp8_tflops"], out["fp8_how"] = 2.0 * n ** 3 / t["ms"] / 1e9, how
    except Exception as exc:
        out["fp8_error"] = short(exc)
    del a, b
    free()
    try:
        src = torch.randn(cfg["copy_elems"], device=DEV, dtype=BF16)
        dst = torch.empty_like(src)
        t = time_op(lambda: dst.copy_(src), cfg["ceiling_s"], 10, 200, 3)
        out["copy_gbps"] = 2.0 * src.numel() * src.element_size() / t["ms"] / 1e6
        out["copy_how"] = f"{src.numel() * 2 / 2**30:.0f} GiB device-to-device copy_, read + write bytes"
        del src, dst
    except Exception as exc:
        out["copy_error"] = short(exc)
    free()
    return out


# ------------------------------------------------------------------------------------------- probes
def probe_main(key: str, kinds) -> int:
    """Child process: run `key` on tiny aligned and unaligned cases, one line per stage (flushed), so that
    the parent knows which stage killed the process if one does."""
    def emit(**kw):
        print(PROBE_TAG + json.dumps(kw), flush=True)

    torch.manual_seed(0)
    load_peers(DEV, only=key)
    if key in UNAVAILABLE:
        emit(stage="*", status="error", reason=UNAVAILABLE[key])
        emit(stage="done", status="ok")
        return 0
    v = VBY[key]
    tol = 0.15 if v.precision == "fp8" else 0.03
    for kind in kinds:
        splits = PROBE_SPLITS[kind]
        c = Case("probe", PROBE_E, PROBE_H, PROBE_F, splits, DEV, seed=1)
        ref = reference(c)
        for op in v.ops:
            stage = f"{kind}.{op}"
            why = static_unsupported(key, op, kind)
            if why:
                emit(stage=stage, status="unsupported", reason=why)
                continue
            try:
                if op == "fc1":
                    with torch.no_grad():
                        y = build_fc1(key, c)()
                        torch.cuda.synchronize()
                        errs = {"y": rel_err(y, ref["h"])}
                else:
                    errs = mlp_errors(build_mlp(key, c), c, ref)
                    torch.cuda.synchronize()
                vals = [e for e in errs.values() if isinstance(e, float)]
                worst = max(vals, default=0.0)
                ok = all(math.isfinite(e) and e <= tol for e in vals)
                emit(stage=stage, status="ok" if ok else "error", errs=errs,
                     reason=None if ok else f"wrong result on the probe case: rel err {worst:.3g} > {tol}")
            except Exception as exc:
                emit(stage=stage, status="error", reason=short(exc))
                if not cuda_alive():
                    emit(stage=stage, status="crash", reason="CUDA context lost: " + short(exc))
                    return 3
    emit(stage="done", status="ok")
    return 0


def run_probes(keys, kinds, timeout_s) -> dict:
    """{key: {stage: {"status":..., "reason":...}}} from one child process per variant, run in parallel."""
    procs, logs = {}, {}
    tmp = Path(tempfile.mkdtemp(prefix="moegemm_probe_"))
    for k in keys:
        fo, fe = open(tmp / f"{k}.out", "w"), open(tmp / f"{k}.err", "w")  # files: no pipe can fill up
        logs[k] = (fo, fe)
        procs[k] = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--probe", k,
                                     "--probe-kinds", ",".join(kinds)], cwd=str(REPO),
                                    stdout=fo, stderr=fe, env=os.environ.copy())
    deadline = time.time() + timeout_s
    res = {}
    for k, p in procs.items():
        timed_out = False
        try:
            p.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            timed_out = True
        for f in logs[k]:
            f.close()
        out = (tmp / f"{k}.out").read_text(errors="replace")
        err = (tmp / f"{k}.err").read_text(errors="replace")
        stages, done = {}, False
        for line in out.splitlines():
            if line.startswith(PROBE_TAG):
                try:
                    d = json.loads(line[len(PROBE_TAG):])
                except ValueError:
                    continue
                if d.get("stage") == "done":
                    done = True
                elif d.get("stage") == "*":
                    for kind in kinds:
                        for op in VBY[k].ops:
                            stages[f"{kind}.{op}"] = {"status": d["status"], "reason": d.get("reason")}
                else:
                    stages[d["stage"]] = {kk: vv for kk, vv in d.items() if kk != "stage"}
        if not done:
            tail = (err or "").strip().splitlines()[-3:]
            why = ("timed out after %.0f s" % timeout_s) if timed_out else f"exit code {p.returncode}"
            why += (": " + " | ".join(tail))[:400] if tail else ""
            crashed = any(d.get("status") == "crash" for d in stages.values())
            for kind in kinds:
                for op in VBY[k].ops:
                    st = f"{kind}.{op}"
                    if st in stages:
                        continue
                    if not crashed:
                        stages[st] = {"status": "crash", "reason": f"probe process died here ({why})"}
                        crashed = True
                    else:
                        stages[st] = {"status": "not run", "reason": f"probe process died earlier ({why})"}
        res[k] = stages
    log(f"[bench] probe logs under {tmp}")
    return res


PROBES: dict = {}


def gate(key, op, kind):
    """None when (variant, op, split kind) may run in this process, else the reason it may not."""
    why = static_unsupported(key, op, kind)
    if why:
        return why
    st = PROBES.get(key, {}).get(f"{kind}.{op}")
    if st is None or st["status"] in ("ok", "error"):
        return None
    return f"not run: probe {st['status']} ({st.get('reason')})"


# ---------------------------------------------------------------------------------------- the run
class Runner:
    def __init__(self, args, cfg):
        self.args, self.cfg = args, cfg
        self.t_start = time.time()
        self.res = {"meta": {}, "config": cfg, "unavailable": {}, "probes": {}, "ceilings": {}, "records": [],
                    "host_sweep": [], "jitter": [], "skipped": []}
        self.out = Path(args.out)
        self.dead = None  # reason once the CUDA context is lost

    def elapsed(self):
        return time.time() - self.t_start

    def over_budget(self, reserve=0.0):
        return self.elapsed() + reserve > self.cfg["budget_s"]

    def save(self):
        self.res["meta"]["elapsed_s"] = round(self.elapsed(), 1)
        self.out.mkdir(parents=True, exist_ok=True)
        with open(self.out / "results.json", "w") as f:
            json.dump(_clean(self.res), f, indent=1)

    def selected(self, aux=True):
        keys = [v.key for v in VARIANTS if aux or not v.aux]
        if self.args.variants:
            pats = [p.strip() for p in self.args.variants.split(",") if p.strip()]
            keys = [k for k in keys if k == BASELINE or any(p in k for p in pats)]
        return [k for k in keys if k not in UNAVAILABLE]

    def guarded(self, rec, what, f):
        """Run f(); on an exception record it; detect a lost CUDA context (stops the run)."""
        if self.dead:
            rec.update(status="skipped", reason=self.dead)
            return
        try:
            f()
            rec.setdefault("status", "ok")
        except Exception as exc:
            rec["status"], rec["reason"] = "error", short(exc)
            log(f"[bench]   {what}: {short(exc)}")
            if self.args.verbose:
                traceback.print_exc()
            if not cuda_alive():
                self.dead = f"CUDA context lost after {what}: {short(exc)}"
                log("[bench] " + self.dead)

    # -------------------------------------------------------------------------------- model shapes
    def run_point(self, shape, E, H, F, T, kind_name, splits, ops=("fc1", "mlp")):
        c = Case(shape, E, H, F, splits, DEV, seed=0)
        t0 = time.time()
        ref = reference(c, fc1_only="mlp" not in ops)
        log(f"[bench] {shape} {kind_name}: E={E} H={H} F={F} T={T} empty={splits.count(0)} "
            f"({c.kind}); float64 reference {time.time() - t0:.1f} s")
        recs = []
        for key in self.selected():
            v = VBY[key]
            for op in (o for o in v.ops if o in ops):
                rec = {"section": op, "shape": shape, "E": E, "hidden": H, "ffn": F, "T": T, "splits": kind_name,
                       "split_kind": c.kind, "n_empty": splits.count(0), "variant": key, "label": v.label,
                       "precision": v.precision, "aux": v.aux, "flops": c.flops(op), "min_bytes": c.min_bytes(op),
                       "gemm_target": shape in GEMM_SHAPES}
                if key == "torch_fp8" and op == "mlp" and c.kind != "aligned":
                    rec["note"] = "wgrad in bf16 (torch._grouped_mm): FP8 2d x 2d needs non-empty 16-row groups"
                recs.append(rec)
                self.res["records"].append(rec)
                why = gate(key, op, c.kind)
                if why:
                    rec.update(status="n/a", reason=why)
                    continue
                if self.over_budget():
                    rec.update(status="skipped", reason="time budget")
                    continue
                t1 = time.time()
                self.guarded(rec, f"{shape}/{kind_name}/{key}/{op}", lambda: self._measure(rec, key, op, c, ref))
                free()
                log(f"[bench]   {op:3s} {v.label:45s} {rec.get('status'):7s} "
                    f"{('%.3f ms' % rec['ms']) if 'ms' in rec else ''} ({time.time() - t1:.1f} s)")
        base = {r["section"]: r.get("ms") for r in recs if r["variant"] == BASELINE and r.get("status") == "ok"}
        for r in recs:
            if r.get("status") == "ok" and base.get(r["section"]):
                r["speedup_vs_torch_bf16"] = base[r["section"]] / r["ms"]
        del c, ref
        free()

    def _measure(self, rec, key, op, c, ref):
        cfg = self.cfg
        ce = self.res["ceilings"]
        if op == "fc1":
            with torch.no_grad():
                fn = build_fc1(key, c)
                y = fn()
                torch.cuda.synchronize()
                rec["err"] = {"y": rel_err(y, ref["h"])}
                del y
                rec["syncs"] = count_syncs(fn)
                rec["peak_extra_mib"] = peak_extra_mib(fn)
                rec.update(time_op(fn, cfg["fc1_target_s"], cfg["min_iters"], cfg["max_iters"], cfg["warmup"]))
                rec.update(host_overhead(fn, cfg["host_reps"]))
        else:
            impl = build_mlp(key, c)
            rec["err"] = mlp_errors(impl, c, ref)
            fn = make_step(impl, c)
            rec["syncs"] = count_syncs(fn)
            rec["peak_extra_mib"] = peak_extra_mib(fn)
            rec.update(time_op(fn, cfg["mlp_target_s"], cfg["min_iters"], cfg["max_iters"], cfg["warmup"]))
            rec.update(host_overhead(fn, cfg["host_reps"]))
        rec["tflops"] = rec["flops"] / rec["ms"] / 1e9
        peak = ce.get("fp8_tflops" if rec["precision"] == "fp8" else "bf16_tflops")
        if peak:
            rec["frac_peak"] = rec["tflops"] / peak
        if peak and ce.get("copy_gbps"):
            t_lb = max(rec["flops"] / (peak * 1e9), rec["min_bytes"] / (ce["copy_gbps"] * 1e6))  # ms
            rec["frac_roofline"] = t_lb / rec["ms"]

    # ------------------------------------------------------------------------------ host sweep (E)
    def run_sweep(self):
        H, F, T = SWEEP_SHAPE
        for E in SWEEP_E:
            if self.dead or self.over_budget(reserve=self.cfg["jitter_reserve_s"]):
                self.res["skipped"].append(f"host sweep E={E}: " + (self.dead or "time budget"))
                continue
            splits = zipf_splits(E, T)
            c = Case("sweep", E, H, F, splits, DEV, seed=2)
            for key in self.selected(aux=False):
                for op in VBY[key].ops:
                    rec = {"op": op, "E": E, "hidden": H, "ffn": F, "T": T, "splits": "zipf", "variant": key,
                           "label": VBY[key].label}
                    self.res["host_sweep"].append(rec)
                    why = gate(key, op, c.kind)
                    if why:
                        rec.update(status="n/a", reason=why)
                        continue

                    def go(rec=rec, key=key, op=op):
                        if op == "fc1":
                            with torch.no_grad():
                                fn = build_fc1(key, c)
                                fn()
                                rec["syncs"] = count_syncs(fn)
                                rec.update(host_overhead(fn, self.cfg["sweep_reps"]))
                        else:
                            fn = make_step(build_mlp(key, c), c)
                            fn()
                            rec["syncs"] = count_syncs(fn)
                            rec.update(host_overhead(fn, self.cfg["sweep_reps"]))
                    self.guarded(rec, f"sweep/E={E}/{key}/{op}", go)
                    free()
            log(f"[bench] host sweep E={E} done ({self.elapsed():.0f} s)")
            del c
            free()
            self.save()

    # ---------------------------------------------------------------------------------- jitter
    def run_jitter(self):
        E, H, F, T = SHAPES[JITTER_SHAPE]
        splits = zipf_splits(E, T)
        jv = self.cfg["jitter_variants"]
        keys = [k for k in self.selected(aux=False) if jv == "all" or k in jv]
        c = Case(JITTER_SHAPE, E, H, F, splits, DEV, seed=3)
        for i, key in enumerate(keys):
            rec = {"shape": JITTER_SHAPE, "splits": "zipf", "variant": key, "label": VBY[key].label}
            self.res["jitter"].append(rec)
            why = gate(key, "mlp", c.kind)
            if why:
                rec.update(status="n/a", reason=why)
                continue
            left = self.cfg["budget_s"] - self.elapsed() - 5.0
            per = min(self.cfg["jitter_seconds"], left / (len(keys) - i))
            if per < 1.0:
                rec.update(status="skipped", reason="time budget")
                continue

            def go(rec=rec, key=key, per=per):
                fn = make_step(build_mlp(key, c), c)
                rec.update(jitter(fn, self.cfg["jitter_iters"], per))
                rec["time_cap_s"] = round(per, 1)
            self.guarded(rec, f"jitter/{key}", go)
            free()
            log(f"[bench] jitter {VBY[key].label}: {rec.get('status')} n={rec.get('n')}")
        del c
        free()

    # ------------------------------------------------------------------------------------ main
    def run(self):
        args, cfg = self.args, self.cfg
        self.res["meta"] = collect_meta(args)
        load_peers(DEV)
        self.res["unavailable"] = dict(UNAVAILABLE)
        self.res["meta"]["versions"].update({"torchao": MOD.get("torchao_version"),
                                             "transformer_engine": MOD.get("te_version")})
        for k, why in UNAVAILABLE.items():
            log(f"[bench] unavailable: {VBY[k].label}: {why}")
        self.save()
        if not args.no_probe:
            t0 = time.time()
            keys = self.selected()
            log(f"[bench] probing {len(keys)} variants in child processes ...")
            kinds = ["unaligned"] + (["aligned"] if "balanced" in cfg["splits"] else [])  # sweep, jitter: Zipf
            kinds = [k for k in PROBE_SPLITS if k in kinds]
            PROBES.update(run_probes(keys, kinds, cfg["probe_timeout_s"]))
            self.res["probes"] = PROBES
            bad = [(k, s, d) for k, st in PROBES.items() for s, d in st.items() if d["status"] not in ("ok", "unsupported")]
            for k, s, d in bad:
                log(f"[bench] probe {k} {s}: {d['status']}: {d.get('reason')}")
            log(f"[bench] probes done ({time.time() - t0:.0f} s)")
            self.save()
        self.res["ceilings"] = measure_ceilings(cfg)
        log(f"[bench] ceilings: {self.res['ceilings']}")
        self.save()
        for shape, (E, H, F, T) in SHAPES.items():
            if args.shapes and not any(s.lower() in shape.lower() for s in args.shapes.split(",")):
                continue
            for kind_name in cfg["splits"]:
                if self.dead or self.over_budget(reserve=cfg["sweep_reserve_s"] + cfg["jitter_reserve_s"]):
                    self.res["skipped"].append(f"{shape}/{kind_name}: " + (self.dead or "time budget"))
                    continue
                splits = zipf_splits(E, T) if kind_name == "zipf" else balanced_splits(E, T)
                pt = {}
                self.guarded(pt, f"{shape}/{kind_name}", lambda: self.run_point(shape, E, H, F, T, kind_name, splits))
                if pt.get("status") != "ok":
                    self.res["skipped"].append(f"{shape}/{kind_name}: {pt.get('status')}: {pt.get('reason')}")
                free()
                self.save()
        for shape, (E, K, N, T) in cfg["gemm_shapes"].items():
            if args.shapes and not any(s.lower() in shape.lower() for s in args.shapes.split(",")):
                continue
            if self.dead or self.over_budget(reserve=cfg["sweep_reserve_s"] + cfg["jitter_reserve_s"]):
                self.res["skipped"].append(f"{shape}: " + (self.dead or "time budget"))
                continue
            pt = {}
            self.guarded(pt, shape, lambda: self.run_point(shape, E, K, N // 2, T, "balanced", balanced_splits(E, T),
                                                           ops=("fc1",)))
            free()
            self.save()
        if not args.no_sweep:
            self.run_sweep()
            self.save()
        if not args.no_jitter and not self.dead:
            self.run_jitter()
        self.save()
        md = render_markdown(self.res)
        (self.out / "results.md").write_text(md)
        print(md, flush=True)
        if not args.no_plots:
            try:
                plot = _load_plot_module()
                for p in plot.make_plots(self.res, self.out):
                    log(f"[bench] wrote {p}")
            except ImportError as exc:
                log(f"[bench] no plots ({short(exc)}): run `python bench/plot.py {self.out / 'results.json'}` "
                    "on a machine with matplotlib")
            except Exception as exc:
                log(f"[bench] plotting failed: {short(exc)}")
        log(f"[bench] done in {self.elapsed():.0f} s; results in {self.out}")
        return 0 if not self.dead else 2


def _load_plot_module():
    spec = importlib.util.spec_from_file_location("moegemm_bench_plot", BENCH / "plot.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _clean(o):
    if isinstance(o, float):
        return o if math.isfinite(o) else str(o)
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    if isinstance(o, (str, int, bool)) or o is None:
        return o
    return str(o)


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
        "quick": bool(args.quick),
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
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        meta.update(device=torch.cuda.get_device_name(0), capability=list(torch.cuda.get_device_capability(0)),
                    sm_count=p.multi_processor_count, gpu_mem_gib=round(p.total_memory / 2 ** 30, 1))
    meta["nvidia_smi"] = _run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem,power.limit",
                               "--format=csv,noheader"])
    return meta


# ---------------------------------------------------------------------------------------- markdown
def _f(v, spec=".3f", na="n/a"):
    if v is None or isinstance(v, str):
        return na if v is None else v
    try:
        return format(v, spec)
    except (TypeError, ValueError):
        return str(v)


def _table(headers, rows):
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return "\n".join(out)


def _status_cell(r):
    st = r.get("status")
    if st == "ok":
        return None
    reason = (r.get("reason") or "").replace("|", "/")
    return f"{st}: {reason[:120]}"


def render_markdown(res: dict) -> str:
    m, ce = res.get("meta", {}), res.get("ceilings", {})
    parts = [f"# moegemm benchmark\n\n{m.get('device', '?')} (sm {m.get('capability')}, {m.get('sm_count')} SMs), "
             f"torch {m.get('versions', {}).get('torch')}, CUDA {m.get('versions', {}).get('cuda')}, "
             f"commit {str(m.get('git_commit'))[:12]}{' (dirty)' if m.get('git_dirty') else ''}, {m.get('date_utc')}"
             f"{', --quick' if m.get('quick') else ''}, {m.get('elapsed_s', '?')} s.\n"]
    parts.append("## Ceilings (measured in this run)\n\n" + _table(["ceiling", "value", "how"], [
        ["dense bf16 GEMM", _f(ce.get("bf16_tflops"), ".0f") + " TFLOP/s", ce.get("bf16_how", ce.get("bf16_error", ""))],
        ["dense fp8 GEMM", _f(ce.get("fp8_tflops"), ".0f") + " TFLOP/s", ce.get("fp8_how", ce.get("fp8_error", ""))],
        ["device copy bandwidth", _f(ce.get("copy_gbps"), ".0f") + " GB/s", ce.get("copy_how", ce.get("copy_error", ""))],
    ]))
    if res.get("unavailable"):
        parts.append("Not run (unavailable here): " + "; ".join(
            f"{VBY[k].label if k in VBY else k}: {why}" for k, why in res["unavailable"].items()))
    bad = [(k, s, d) for k, st in res.get("probes", {}).items() for s, d in st.items()
           if d.get("status") not in ("ok", "unsupported")]
    if bad:
        parts.append("Probe findings (small case in a child process):\n\n" + _table(
            ["variant", "stage", "status", "reason"],
            [[VBY[k].label if k in VBY else k, s, d.get("status"), str(d.get("reason"))[:160].replace("|", "/")]
             for k, s, d in bad]))
    recs = res.get("records", [])
    titles = {"fc1": "GroupedLinear forward (fc1: K = hidden, N = 2*ffn), no grad",
              "mlp": "Expert MLP forward + backward (fc1 -> silu(gate)*up*probs -> fc2; dx, dprobs, dW1, dW2)"}
    for sec in ("fc1", "mlp"):
        rows = []
        for r in recs:
            if r["section"] != sec:
                continue
            st = _status_cell(r)
            head = [r["shape"], r["splits"], r["label"]]
            if st:
                rows.append(head + [st] + [""] * 8)
                continue
            host = _f(r.get("host_us"), ".0f") + (" (idle*)" if r.get("host_gpu_went_idle") else "")
            rows.append(head + [_f(r.get("ms")), _f(r.get("tflops"), ".0f"), _f(100 * r["frac_peak"], ".0f") if "frac_peak" in r else "n/a",
                                _f(100 * r["frac_roofline"], ".0f") if "frac_roofline" in r else "n/a",
                                _f(r.get("speedup_vs_torch_bf16"), ".2f") + "x" if r.get("speedup_vs_torch_bf16") else "n/a",
                                host, str(r.get("syncs", "?")), _f(r.get("peak_extra_mib"), ".0f"),
                                _f((r.get("err") or {}).get("y"), ".2e")])
        if rows:
            parts.append(f"## {titles[sec]}\n\nmedian ms of CUDA-event timed iterations; % peak = TFLOP/s over "
                         "the dense ceiling of the same precision; % roofline = max(FLOP/peak, min bytes/copy BW) "
                         "over the time; host = host us per call with the GPU busy (idle* = the call waited for "
                         "the GPU: a sync or a full launch queue); syncs = synchronising calls torch reports per "
                         "call; peak = peak extra MiB; err = relative Frobenius error of the output vs float64.\n\n"
                         + _table(["shape", "splits", "variant", "ms", "TFLOP/s", "% peak", "% roofline",
                                   "vs torch bf16", "host us", "syncs", "peak MiB", "err y"], rows))
    acc = [[r["shape"], r["splits"], r["label"]] + [_f(r["err"].get(k), ".2e") for k in ("y", "dx", "dprobs", "dW1", "dW2")]
           for r in recs if r["section"] == "mlp" and r.get("status") == "ok" and r.get("err")]
    if acc:
        parts.append("## Accuracy of the MLP vs float64 (relative Frobenius error)\n\n"
                     + _table(["shape", "splits", "variant", "y", "dx", "dprobs", "dW1", "dW2"], acc))
    notes = sorted({(r["label"], r["note"]) for r in recs if r.get("note")})
    if notes:
        parts.append("Notes: " + "; ".join(f"{a}: {b}" for a, b in notes) + ".")
    sweep = res.get("host_sweep", [])
    if sweep:
        Es = sorted({r["E"] for r in sweep})
        rows = []
        for op in ("fc1", "mlp"):
            for key in dict.fromkeys(r["variant"] for r in sweep if r["op"] == op):
                cells = []
                for E in Es:
                    r = next((x for x in sweep if x["op"] == op and x["variant"] == key and x["E"] == E), None)
                    if r is None:
                        cells.append("")
                    elif r.get("status") != "ok":
                        cells.append(r.get("status", "?"))
                    else:
                        cells.append(_f(r.get("host_us"), ".0f") + ("*" if r.get("host_gpu_went_idle") else "")
                                     + (f" ({r['syncs']} sync)" if r.get("syncs") else ""))
                rows.append([{"fc1": "fc1 fwd", "mlp": "MLP fwd+bwd"}[op], VBY[key].label if key in VBY else key] + cells)
        h, f, t = (sweep[0].get(k) for k in ("hidden", "ffn", "T"))
        parts.append(f"## Host overhead per call vs number of experts (us; hidden={h}, ffn={f}, T={t}, Zipf splits; "
                     "GPU kept busy by torch.cuda._sleep; * = the call waited for the GPU)\n\n"
                     + _table(["op", "variant"] + [f"E={E}" for E in Es], rows))
    jit = res.get("jitter", [])
    if jit:
        rows = []
        for r in jit:
            if r.get("status") != "ok":
                rows.append([r["label"], r["shape"], _status_cell(r), "", "", "", ""])
            else:
                rows.append([r["label"], r["shape"], r["n"], _f(r["p50_ms"]), _f(r["p99_ms"]), _f(r["max_ms"]),
                             _f(r["p99_ms"] / r["p50_ms"], ".2f")])
        parts.append("## Jitter: synchronised MLP fwd+bwd iterations (host wall time per iteration, Zipf splits)\n\n"
                     + _table(["variant", "shape", "n", "p50 ms", "p99 ms", "max ms", "p99/p50"], rows))
    if res.get("skipped"):
        parts.append("Skipped: " + "; ".join(res["skipped"]))
    parts.append(render_summary(res))
    return "\n\n".join(parts) + "\n"


def render_gemm_targets(recs) -> str:
    rows = []
    for shape, target in GEMM_TARGETS.items():
        got = {r["variant"]: r for r in recs if r["shape"] == shape and r["section"] == "fc1" and r.get("status") == "ok"}
        if not got:
            continue
        cell = lambda k: _f(got[k]["tflops"], ".0f") if k in got else "n/a"  # noqa: E731
        rows.append([shape, f"{target:.0f}", cell("moegemm_fp8"), cell("moegemm_fp8_gemm"), cell("torch_fp8_gemm"),
                     cell("torch_fp8"), cell(BASELINE)])
    if not rows:
        return ""
    return ("## Grouped FP8 GEMM targets (fc1 forward, balanced groups; TFLOP/s)\n\n"
            + _table(["problem", "target", "moegemm fp8 (quantization included)", "moegemm GEMM only",
                      "torch fp8 rowwise GEMM only", "torch fp8 rowwise (quantization included)",
                      "torch._grouped_mm bf16"], rows) + "\n\n")


def render_summary(res: dict) -> str:
    recs = res.get("records", [])
    rows = []
    points = list(dict.fromkeys((r["shape"], r["splits"]) for r in recs if r["shape"] in SHAPES))
    for shape, splits in points:
        def get(key, sec):
            return next((r for r in recs if r["shape"] == shape and r["splits"] == splits and r["variant"] == key
                         and r["section"] == sec and r.get("status") == "ok"), None)
        mo, base, mo1 = get("moegemm_fp8", "mlp"), get(BASELINE, "mlp"), get("moegemm_fp8", "fc1")
        peers = [r for r in recs if r["shape"] == shape and r["splits"] == splits and r["section"] == "mlp"
                 and r.get("status") == "ok" and not r["aux"] and not r["variant"].startswith("moegemm")]
        best = min(peers, key=lambda r: r["ms"]) if peers else None
        def x(a, b):  # speed-up a/b as text
            return f"{a / b:.2f}x" if a and b else "n/a"
        rows.append([shape, splits, _f(mo["ms"]) if mo else "n/a", _f(base["ms"]) if base else "n/a",
                     x(base and base["ms"], mo and mo["ms"]),
                     f"{best['label']} {best['ms']:.3f}" if best else "n/a",
                     x(best and best["ms"], mo and mo["ms"]),
                     _f(mo1.get("speedup_vs_torch_bf16"), ".2f") + "x" if mo1 and mo1.get("speedup_vs_torch_bf16") else "n/a",
                     (_f(mo.get("host_us"), ".0f") if mo else "n/a") + " / " + (_f(base.get("host_us"), ".0f") if base else "n/a"),
                     _f((mo.get("err") or {}).get("y"), ".2e") if mo else "n/a"])
    return (render_gemm_targets(recs) + "## Summary: moegemm fp8_blockwise\n\nMLP fwd+bwd ms, speed-ups over torch._grouped_mm bf16 and over "
            "the fastest peer measured here, fc1 forward speed-up, host us per MLP call (moegemm / torch bf16), "
            "output error vs float64.\n\n"
            + _table(["shape", "splits", "moegemm ms", "torch bf16 ms", "vs torch bf16", "best peer ms",
                      "vs best peer", "fc1 vs torch bf16", "host us", "err y"], rows))


# --------------------------------------------------------------------------------------------- CLI
def make_cfg(args) -> dict:
    q = args.quick
    cfg = {
        "fc1_target_s": 0.08 if q else 0.4,
        "mlp_target_s": 0.12 if q else 0.8,
        "min_iters": 5 if q else 10,
        "max_iters": 30 if q else 200,
        "warmup": 2 if q else 3,
        "host_reps": 3 if q else 7,
        "sweep_reps": 3 if q else 7,
        "ceiling_s": 0.15 if q else 0.5,
        "ceiling_n": 8192,
        "copy_elems": 1 << 29,  # bf16: 1 GiB
        "jitter_iters": args.jitter_iters or (1000 if q else 10000),
        "jitter_seconds": args.jitter_seconds or (4.0 if q else 60.0),
        "jitter_variants": ["moegemm_fp8", "torch_bf16", "loop_bf16"] if q else ["moegemm_fp8", "moegemm_bf16", "torch_bf16"],
        "budget_s": args.budget_s or (110.0 if q else 500.0),
        "sweep_reserve_s": 8.0 if q else 25.0,
        "jitter_reserve_s": 12.0 if q else 140.0,
        "probe_timeout_s": 90.0 if q else 200.0,
        "splits": [s.strip() for s in args.splits.split(",")] if args.splits else (["zipf"] if q else ["zipf", "balanced"]),
        "shapes": SHAPES,
        "gemm_shapes": {} if q else GEMM_SHAPES,
        "sweep": {"E": list(SWEEP_E), "hidden_ffn_T": list(SWEEP_SHAPE)},
        "jitter_shape": JITTER_SHAPE,
    }
    return cfg


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer iterations, Zipf splits only, short jitter (< 2 min)")
    ap.add_argument("--out", default=str(BENCH / "results"), help="output folder (default: bench/results)")
    ap.add_argument("--shapes", default=None, help="comma-separated substrings of shape names to run")
    ap.add_argument("--splits", default=None, help="comma-separated: zipf,balanced")
    ap.add_argument("--variants", default=None, help="comma-separated substrings of variant keys "
                    "(" + ", ".join(v.key for v in VARIANTS) + "); the torch bf16 baseline always runs")
    ap.add_argument("--jitter-iters", type=int, default=None, help="synchronised iterations per variant (10000; quick 1000)")
    ap.add_argument("--jitter-seconds", type=float, default=None, help="time cap per variant for the jitter run")
    ap.add_argument("--budget-s", type=float, default=None, help="wall-time budget; later sections shrink or skip")
    ap.add_argument("--no-probe", action="store_true", help="skip the crash probes in child processes")
    ap.add_argument("--no-sweep", action="store_true", help="skip the host-overhead sweep over E")
    ap.add_argument("--no-jitter", action="store_true", help="skip the jitter run")
    ap.add_argument("--no-plots", action="store_true", help="do not write PNGs")
    ap.add_argument("--verbose", action="store_true", help="print tracebacks of failing variants")
    ap.add_argument("--probe", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--probe-kinds", default="aligned,unaligned", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    _ensure_carried_wheels()
    if args.probe:
        return probe_main(args.probe, [k for k in args.probe_kinds.split(",") if k in PROBE_SPLITS])
    if not torch.cuda.is_available():
        log("bench.py needs a CUDA GPU (an H100/H200 for moegemm's kernels); nothing measured.")
        return 1
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = make_cfg(args)
    return Runner(args, cfg).run()


if __name__ == "__main__":
    sys.exit(main())
