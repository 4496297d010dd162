// FP8 wgrad on CUTLASS with fp32 output, written or accumulated (Megatron's main_grad).
// See fp8_ragged_reduction.cuh.
#include "kernels/gemm/variants.h"
#include "kernels/gemm/cutlass/fp8_ragged_reduction.cuh"

namespace moegemm::gemm {

using CutlassTiling = grouped::Tile128x128C1x2;

size_t cutlass_fp8_ragged_reduction_f32_workspace_size(int E) { return cutlass_ragged_reduction::workspace_size<float, CutlassTiling>(E); }

void cutlass_fp8_ragged_reduction_f32(const RaggedReduction& p, Fp8Operand a, Fp8Operand b, void* workspace, cudaStream_t stream) {
  cutlass_ragged_reduction::run<float, CutlassTiling>(p, a, b, workspace, stream, "gemm_fp8_ragged_reduction_f32 (CUTLASS)");
}

}  // namespace moegemm::gemm
