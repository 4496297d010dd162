"""The standard MoE workloads of the benchmarks (docs/design.md#performance-contract): model shapes and
token counts per expert (Zipf-skewed with empty experts, or balanced), the two grouped-GEMM target
problems, and the torch bf16 baseline they measure against (``torch._grouped_mm``). Deterministic for a
given seed."""

from __future__ import annotations

# The Zipf splits and the torch bf16 baseline are the quick start's (python -m moegemm), defined once there.
from moegemm.__main__ import TorchGroupedLinearBF16, zipf_splits  # noqa: F401  (re-exported for the bench)

SHAPES = {  # name: (E, hidden, ffn per expert, routed tokens)
    "DeepSeek-V2-Lite": (64, 2048, 1408, 24576),
    "Qwen3-30B-A3B": (128, 2048, 768, 32768),
    "DeepSeek-V3-EP8": (32, 7168, 2048, 32768),
    "Mixtral-8x7B": (8, 4096, 14336, 16384),
}


# Small experts: fine-grained experts with a skewed router, Zipf alpha 1.2 and a quarter of
# the experts empty, so that most experts hold fewer than 128 tokens. name -> (E, hidden, ffn, tokens).
SMALL_EXPERTS = {"Small experts E=64": (64, 2048, 1408, 12288)}
SMALL_EXPERTS_EMPTY_FRAC = 0.25


def small_experts_splits(E: int, T: int) -> list:
    return zipf_splits(E, T, alpha=1.2, empty_frac=SMALL_EXPERTS_EMPTY_FRAC)


# The grouped-GEMM problems (DeepGEMM-style), fc1 forward only, balanced groups:
# name -> (groups, K, N, tokens).
GEMM_SHAPES = {
    "GEMM 4x8192 N=4096 K=7168": (4, 7168, 4096, 4 * 8192),
    "GEMM 64x2304 N=2816 K=2048": (64, 2048, 2816, 64 * 2304),
}


def balanced_splits(E: int, T: int) -> list:
    return [T // E + (1 if e < T % E else 0) for e in range(E)]


def jittered_splits(groups: int, nominal: int, rng) -> list:
    """DeepGEMM's grouped problems as the GEMM tables time them: each group's count uniform within
    +-30 % of the nominal (``rng``: a random.Random)."""
    return [rng.randint(int(nominal * 0.7), int(nominal * 1.3)) for _ in range(groups)]


def table_points(quick: bool, keep: str | None = None) -> list:
    """(label, E, hidden, ffn, splits) of the points of the per-kernel tables (bench/gemm, bench/bandwidth):
    every model shape with Zipf splits and, unless ``quick``, balanced ones; the small-experts workload
    with its own skew only. With ``keep`` (comma-separated), only the labels containing one of its keys."""
    out = []
    for name, (E, H, F, T) in {**SHAPES, **SMALL_EXPERTS}.items():
        small = name in SMALL_EXPERTS
        out.append((f"{name} zipf", E, H, F, small_experts_splits(E, T) if small else zipf_splits(E, T)))
        if not quick and not small:
            out.append((f"{name} balanced", E, H, F, balanced_splits(E, T)))
    if keep:
        keys = [k.strip() for k in keep.split(",")]
        out = [p for p in out if any(k in p[0] for k in keys)]
    return out


