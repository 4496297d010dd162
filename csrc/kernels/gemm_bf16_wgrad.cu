// bf16 wgrad with fp32 output: dw[e] (fp32, [N, K]) (+)= dy_eᵀ · x_e, the reduction over the expert's
// tokens (written, or accumulated into Megatron's main_grad). The bf16-output variant is in
// gemm_bf16_wgrad_bf16.cu. dy_e [m, N] is read as a column-major A ([N, m], N contiguous), x_e [m, K]
// as a row-major B.
#include "gemm_bf16.cuh"

namespace moegemm {

size_t gemm_bf16_wgrad_f32_workspace_size(int E) { return bf16::WgradConfig<float>::Runner::workspace_size(E); }

void gemm_bf16_wgrad_f32(const void* dy, const void* x, const int32_t* plan, int E, int64_t T, int64_t N, int64_t K,
                         float* dw, bool accumulate, void* workspace, cudaStream_t stream) {
  bf16::wgrad<float>(dy, x, plan, E, T, N, K, dw, accumulate, workspace, stream, "gemm_bf16_wgrad_f32");
}

}  // namespace moegemm
