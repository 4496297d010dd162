"""torchao as a peer: ``_to_fp8_rowwise_then_scaled_grouped_mm`` (torchao.prototype.moe_training; FP8
rowwise with Triton quantization kernels), fc1 and the expert MLP."""

from __future__ import annotations

import os

import torch

from bench.peers.interface import MLPImpl, offsets, swiglu_probs

_MM: list = []  # the grouped-GEMM function, once imported


def load(key):
    # The FP8 rowwise MoE path is Triton + torch ops only; do not load torchao's prebuilt C++/CUDA
    # extension (built for some CUDA, possibly not this torch's), unless the caller says otherwise.
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

    _MM[:] = [_to_fp8_rowwise_then_scaled_grouped_mm]


def _mm(a, w, offs):
    return _MM[0](a, w.transpose(-2, -1), offs, out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=False)


def fc1(key, c):
    x, W1, m = c.x, c.W1, c.m
    return lambda: _mm(x, W1, offsets(m))


def mlp(key, c):
    W1, W2, F = c.W1g, c.W2g, c.F

    def fwd(x, m, p):
        offs = offsets(m)
        return _mm(swiglu_probs(_mm(x, W1, offs), p, F), W2, offs)
    return MLPImpl(fwd, [W1, W2])
