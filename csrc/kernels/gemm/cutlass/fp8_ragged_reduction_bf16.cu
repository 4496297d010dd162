// FP8 wgrad on CUTLASS with bf16 output (the parameter's dtype, no fp32 round trip).
// See fp8_ragged_reduction.cuh.
#include "kernels/gemm/variants.h"
#include "kernels/gemm/cutlass/fp8_ragged_reduction.cuh"

namespace moegemm::gemm {

using CutlassTiling = grouped::Tile128x128C1x2;

size_t cutlass_fp8_ragged_reduction_bf16_workspace_size(int E) { return cutlass_ragged_reduction::workspace_size<cutlass::bfloat16_t, CutlassTiling>(E); }

void cutlass_fp8_ragged_reduction_bf16(const RaggedReduction& p, Fp8Operand a, Fp8Operand b, void* workspace, cudaStream_t stream) {
  cutlass_ragged_reduction::run<cutlass::bfloat16_t, CutlassTiling>(p, a, b, workspace, stream, "gemm_fp8_ragged_reduction_bf16 (CUTLASS)");
}

}  // namespace moegemm::gemm
