// bf16 wgrad with bf16 output (the parameter's dtype, no fp32 round trip). See gemm_bf16_wgrad.cu.
#include "gemm_bf16.cuh"

namespace moegemm {

size_t gemm_bf16_wgrad_bf16_workspace_size(int E) {
  return bf16::WgradConfig<cutlass::bfloat16_t>::Runner::workspace_size(E);
}

void gemm_bf16_wgrad_bf16(const void* dy, const void* x, const int32_t* plan, int E, int64_t T, int64_t N, int64_t K,
                          void* dw, void* workspace, cudaStream_t stream) {
  bf16::wgrad<cutlass::bfloat16_t>(dy, x, plan, E, T, N, K, static_cast<cutlass::bfloat16_t*>(dw), false, workspace,
                                   stream, "gemm_bf16_wgrad_bf16");
}

}  // namespace moegemm
