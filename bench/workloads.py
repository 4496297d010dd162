"""The standard MoE workloads of the benchmarks (docs/design.md#performance-contract): model shapes and token counts per expert
(Zipf-skewed with empty experts, or balanced), issue 6's two grouped-GEMM problems, and the torch bf16
baseline they measure against (``torch._grouped_mm``). Deterministic for a given seed. (``python -m
moegemm`` carries its own copy of the one shape, split and baseline it shows.)"""

from __future__ import annotations

import random

import torch

SHAPES = {  # name: (E, hidden, ffn per expert, routed tokens)
    "DeepSeek-V2-Lite": (64, 2048, 1408, 24576),
    "Qwen3-30B-A3B": (128, 2048, 768, 32768),
    "DeepSeek-V3-EP8": (32, 7168, 2048, 32768),
    "Mixtral-8x7B": (8, 4096, 14336, 16384),
}


# Small experts (issue 15): fine-grained experts with a skewed router, Zipf alpha 1.2 and a quarter of
# the experts empty, so that most experts hold fewer than 128 tokens. name -> (E, hidden, ffn, tokens).
SMALL_EXPERTS = {"Small experts E=64": (64, 2048, 1408, 12288)}
SMALL_EXPERTS_EMPTY_FRAC = 0.25


def small_experts_splits(E: int, T: int) -> list:
    return zipf_splits(E, T, alpha=1.2, empty_frac=SMALL_EXPERTS_EMPTY_FRAC)


# Issue 6's grouped-GEMM problems (DeepGEMM-style), fc1 forward only, balanced groups:
# name -> (groups, K, N, tokens).
GEMM_SHAPES = {
    "GEMM 4x8192 N=4096 K=7168": (4, 7168, 4096, 4 * 8192),
    "GEMM 64x2304 N=2816 K=2048": (64, 2048, 2816, 64 * 2304),
}


def zipf_splits(E: int, T: int, alpha: float = 1.2, empty_frac: float = 0.125, seed: int = 0) -> list:
    """Zipf-skewed counts summing to T in a shuffled expert order, with at least one empty expert (E > 1)."""
    rng = random.Random(seed)
    w = [1.0 / (r + 1) ** alpha for r in range(E)]
    rng.shuffle(w)
    for e in rng.sample(range(E), max(1, int(E * empty_frac)) if E > 1 else 0):
        w[e] = 0.0
    counts = [int(T * x / sum(w)) for x in w]
    counts[max(range(E), key=lambda e: w[e])] += T - sum(counts)
    return counts


def balanced_splits(E: int, T: int) -> list:
    return [T // E + (1 if e < T % E else 0) for e in range(E)]


class TorchGroupedLinearBF16(torch.autograd.Function):
    """The torch baseline: y = x @ W[e]^T with torch._grouped_mm over the token offsets ``offs``
    (fprop and dgrad 2d x 3d; wgrad 2d x 2d with dy^T column-major and x row-major, the layout torch
    allows empty groups in)."""

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
