// FP8 wgrad on CUTLASS with fp32 output, written or accumulated (Megatron's main_grad).
// See fp8_ragged_k.cuh.
#include "kernels/gemm/variants.h"
#include "kernels/gemm/cutlass/fp8_ragged_k.cuh"

namespace moegemm::gemm {

using RaggedKTiling = grouped::Tile128x128C1x2;

size_t cutlass_fp8_ragged_k_f32_workspace_size(int E) { return ragged_k::workspace_size<float, RaggedKTiling>(E); }

void cutlass_fp8_ragged_k_f32(const RaggedReduction& p, Fp8Operand a, Fp8Operand b, void* workspace, cudaStream_t stream) {
  ragged_k::run<float, RaggedKTiling>(p, a, b, workspace, stream, "gemm_fp8_ragged_k_f32 (CUTLASS)");
}

}  // namespace moegemm::gemm
