"""The catalogue of what is measured: one Variant per implementation (key, label, precision, the
operations it is measured on, whether it is an insight-only "aux" row), and the baseline of every
speed-up."""

from __future__ import annotations


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
    Variant("deepgemm_fp8", "DeepGEMM fp8 blockwise (padded to 128)", "fp8"),
    Variant("moegemm_fp8_gemm", "moegemm fp8 GEMM only (pre-quantized)", "fp8", ops=("fc1",), aux=True),
    Variant("torch_fp8_gemm", "torch fp8 rowwise GEMM only (pre-quantized)", "fp8", ops=("fc1",), aux=True),
    Variant("moegemm_fp8_wcache", "moegemm fp8_blockwise, automatic FP8 weight cache (once per step)", "fp8",
            aux=True),
    Variant("deepgemm_fp8_wcache", "DeepGEMM fp8 blockwise (padded to 128), FP8 weights cached (once per step)", "fp8",
            ops=("mlp",), aux=True),
]
VBY = {v.key: v for v in VARIANTS}
BASELINE = "torch_bf16"
