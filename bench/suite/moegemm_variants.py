"""moegemm's own variants, built as bench/peers/interface.py describes: grouped_linear and GroupedMLP in
both recipes (FP8 weights quantized inside every call, like the peers), the "GEMM only" fc1 row (operands
quantized beforehand) and the automatic FP8 weight cache (weights quantized once, reused while unchanged)."""

from __future__ import annotations

import torch

from bench.peers.interface import MLPImpl
from bench.suite.shared import BF16, DEV

_MOEGEMM: list = []  # moegemm and its cuda_ops, once imported


def load(key):
    import moegemm
    from moegemm import backends as backend

    if not backend.uses_cuda(torch.device(DEV)):
        raise RuntimeError("moegemm would run its plain-PyTorch reference path here "
                           "(no Hopper GPU or MOEGEMM_BACKEND=reference)")
    from moegemm.backends import cuda as cuda_ops  # builds / loads the extension

    _MOEGEMM[:] = [moegemm, cuda_ops]


def fc1(key, c):
    moegemm, ops = _MOEGEMM
    x, W1, m = c.x, c.W1, c.m
    if key in ("moegemm_fp8", "moegemm_bf16"):
        recipe = "fp8_blockwise" if key == "moegemm_fp8" else "bf16"
        return lambda: moegemm.grouped_linear(x, W1, m, recipe=recipe)
    if key == "moegemm_fp8_wcache":  # GroupedLinear's automatic FP8 weight cache: W quantized once, x per call
        lin = moegemm.GroupedLinear(c.E, c.H, 2 * c.F, bias=False, recipe="fp8_blockwise", device=x.device, dtype=BF16)
        with torch.no_grad():
            lin.weight.copy_(W1)
        return lambda: lin(x, m)
    if key == "moegemm_fp8_gemm":
        plan = ops.make_plan(m, c.T)
        qx, sx = ops.quantize_act(x, plan, True, False)[:2]
        qw, sw = ops.quantize_weight(W1)[:2]
        return lambda: ops.gemm_fp8_ragged_rows(qx, sx, qw, sw, plan)
    raise KeyError(key)


def mlp(key, c):
    moegemm = _MOEGEMM[0]
    if key in ("moegemm_fp8", "moegemm_bf16"):
        # fp8_weight_cache=False: the weights are quantized in every call, as in a step's first micro-batch
        mlp_ = moegemm.GroupedMLP(c.E, c.H, c.F, activation="swiglu", bias=False,
                                  recipe="fp8_blockwise" if key == "moegemm_fp8" else "bf16", device=DEV,
                                  dtype=BF16, fp8_weight_cache=False)
    elif key == "moegemm_fp8_wcache":  # the automatic FP8 weight cache: quantized once, reused while unchanged
        mlp_ = moegemm.GroupedMLP(c.E, c.H, c.F, activation="swiglu", bias=False, recipe="fp8_blockwise",
                                  device=DEV, dtype=BF16)
    else:
        raise KeyError(key)
    with torch.no_grad():
        mlp_.fc1.weight.copy_(c.W1)
        mlp_.fc2.weight.copy_(c.W2)
    return MLPImpl(lambda x, m, p: mlp_(x, m, p), [mlp_.fc1.weight, mlp_.fc2.weight])
