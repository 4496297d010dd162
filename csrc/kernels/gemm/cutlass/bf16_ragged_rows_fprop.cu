// bf16 fprop on CUTLASS: y[rows of e] = x_e [m, K] · w[e]ᵀ; w[e] [N, K] is a column-major B.
#include "kernels/gemm/cutlass/bf16.cuh"

namespace moegemm::gemm {
namespace {
using Config = grouped::Bf16Gemm<cutlass::layout::RowMajor, cutlass::layout::ColumnMajor, void, cutlass::bfloat16_t>;
}

size_t cutlass_bf16_ragged_rows_fprop_workspace_size(int E) { return Config::Runner::workspace_size(E); }

void cutlass_bf16_ragged_rows_fprop(const RaggedRows& p, const void* x, const void* w, void* workspace, cudaStream_t stream) {
  bf16::run<Config, bf16::Ragged::kRows>(p.plan, p.E, p.T, 0, int(p.N), int(p.K), x, p.K, w, p.K, p.out, p.N, 0.f, workspace,
                                         stream, "gemm_bf16_ragged_rows fprop (CUTLASS)");
}

}  // namespace moegemm::gemm
