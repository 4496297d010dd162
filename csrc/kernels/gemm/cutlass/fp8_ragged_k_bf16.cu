// FP8 wgrad on CUTLASS with bf16 output (the parameter's dtype, no fp32 round trip).
// See fp8_ragged_k.cuh.
#include "kernels/gemm/variants.h"
#include "kernels/gemm/cutlass/fp8_ragged_k.cuh"

namespace moegemm::gemm {

using RaggedKTiling = grouped::Tile128x128C1x2;

size_t cutlass_fp8_ragged_k_bf16_workspace_size(int E) { return ragged_k::workspace_size<cutlass::bfloat16_t, RaggedKTiling>(E); }

void cutlass_fp8_ragged_k_bf16(const RaggedReduction& p, Fp8Operand a, Fp8Operand b, void* workspace, cudaStream_t stream) {
  ragged_k::run<cutlass::bfloat16_t, RaggedKTiling>(p, a, b, workspace, stream, "gemm_fp8_ragged_k_bf16 (CUTLASS)");
}

}  // namespace moegemm::gemm
