// bf16 dgrad: dx[rows of e] = dy_e [m, N] · w[e]; w[e] [N, K] read as a row-major B (K contiguous).
#include "gemm_bf16.cuh"

namespace moegemm {
namespace {
using Config = grouped::Bf16Gemm<cutlass::layout::RowMajor, cutlass::layout::RowMajor, void, cutlass::bfloat16_t>;
}

size_t gemm_bf16_dgrad_workspace_size(int E) { return Config::Runner::workspace_size(E); }

void gemm_bf16_dgrad(const void* dy, const void* w, const int32_t* plan, int E, int64_t T, int64_t N, int64_t K,
                     void* dx, void* workspace, cudaStream_t stream) {
  bf16::run<Config, bf16::Ragged::kRows>(plan, E, T, 0, int(K), int(N), dy, N, w, K, dx, K, 0.f, workspace, stream,
                                         "gemm_bf16_dgrad");
}

}  // namespace moegemm
