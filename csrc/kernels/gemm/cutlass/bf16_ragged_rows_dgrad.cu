// bf16 dgrad on CUTLASS: dx[rows of e] = dy_e [m, K] · w[e] with w [E, K, N] (RaggedRows' names: the
// layer's weight [E, N_layer, K_layer] with N = K_layer, K = N_layer), read as a row-major B.
#include "kernels/gemm/cutlass/bf16.cuh"

namespace moegemm::gemm {
namespace {
using Config = grouped::Bf16Gemm<cutlass::layout::RowMajor, cutlass::layout::RowMajor, void, cutlass::bfloat16_t>;
}

size_t cutlass_bf16_ragged_rows_dgrad_workspace_size(int E) { return Config::Runner::workspace_size(E); }

void cutlass_bf16_ragged_rows_dgrad(const RaggedRows& p, const void* dy, const void* w, void* workspace, cudaStream_t stream) {
  bf16::run<Config, bf16::Ragged::kRows>(p.plan, p.E, p.T, 0, int(p.N), int(p.K), dy, p.K, w, p.N, p.out, p.N, 0.f, workspace,
                                         stream, "gemm_bf16_ragged_rows dgrad (CUTLASS)");
}

}  // namespace moegemm::gemm
