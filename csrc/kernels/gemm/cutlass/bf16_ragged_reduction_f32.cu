// bf16 wgrad on CUTLASS with fp32 output: dw[e] (fp32, [N, K]) (+)= dy_eᵀ · x_e, the reduction over the
// expert's tokens (written, or accumulated into Megatron's main_grad). dy_e [m, N] is read as a
// column-major A ([N, m], N contiguous), x_e [m, K] as a row-major B.
#include "kernels/gemm/cutlass/bf16.cuh"

namespace moegemm::gemm {

size_t cutlass_bf16_ragged_reduction_f32_workspace_size(int E) { return bf16::WgradConfig<float>::Runner::workspace_size(E); }

void cutlass_bf16_ragged_reduction_f32(const RaggedReduction& p, const void* dy, const void* x, void* workspace, cudaStream_t stream) {
  bf16::wgrad<float>(p, dy, x, workspace, stream, "gemm_bf16_ragged_reduction_f32 (CUTLASS)");
}

}  // namespace moegemm::gemm
