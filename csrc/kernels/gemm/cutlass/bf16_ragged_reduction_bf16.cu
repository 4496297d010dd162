// bf16 wgrad on CUTLASS with bf16 output (the parameter's dtype, no fp32 round trip). See bf16_ragged_reduction_f32.cu.
#include "kernels/gemm/cutlass/bf16.cuh"

namespace moegemm::gemm {

size_t cutlass_bf16_ragged_reduction_bf16_workspace_size(int E) {
  return bf16::WgradConfig<cutlass::bfloat16_t>::Runner::workspace_size(E);
}

void cutlass_bf16_ragged_reduction_bf16(const RaggedReduction& p, const void* dy, const void* x, void* workspace, cudaStream_t stream) {
  bf16::wgrad<cutlass::bfloat16_t>(p, dy, x, workspace, stream, "gemm_bf16_ragged_reduction_bf16 (CUTLASS)");
}

}  // namespace moegemm::gemm
