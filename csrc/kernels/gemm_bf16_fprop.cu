// bf16 fprop: y[rows of e] = x_e [m, K] · w[e]ᵀ; w[e] [N, K] is a column-major B.
#include "gemm_bf16.cuh"

namespace moegemm {
namespace {
using Config = grouped::Bf16Gemm<cutlass::layout::RowMajor, cutlass::layout::ColumnMajor, void, cutlass::bfloat16_t>;
}

size_t gemm_bf16_fprop_workspace_size(int E) { return Config::Runner::workspace_size(E); }

void gemm_bf16_fprop(const void* x, const void* w, const int32_t* plan, int E, int64_t T, int64_t N, int64_t K, void* y,
                     void* workspace, cudaStream_t stream) {
  bf16::run<Config, bf16::Ragged::kRows>(plan, E, T, 0, int(N), int(K), x, K, w, K, y, N, 0.f, workspace, stream,
                                         "gemm_bf16_fprop");
}

}  // namespace moegemm
