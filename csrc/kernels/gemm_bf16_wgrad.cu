// bf16 wgrad: dw[e] (fp32, [N, K]) (+)= dy_eᵀ · x_e, the reduction over the expert's tokens.
// dy_e [m, N] is read as a column-major A ([N, m], N contiguous), x_e [m, K] as a row-major B.
#include "gemm_bf16.cuh"

namespace moegemm {
namespace {
using Config = grouped::Bf16Gemm<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, float, float>;
}

size_t gemm_bf16_wgrad_workspace_size(int E) { return Config::Runner::workspace_size(E); }

void gemm_bf16_wgrad(const void* dy, const void* x, const int32_t* plan, int E, int64_t T, int64_t N, int64_t K,
                     float* dw, bool accumulate, void* workspace, cudaStream_t stream) {
  (void)T;
  if (!accumulate) zero_empty_experts(plan, E, N * K, dw, stream);
  bf16::run<Config, bf16::Ragged::kReduction>(plan, E, int(N), int(K), 0, dy, N, x, K, dw, K, accumulate ? 1.f : 0.f,
                                              workspace, stream, "gemm_bf16_wgrad");
}

}  // namespace moegemm
