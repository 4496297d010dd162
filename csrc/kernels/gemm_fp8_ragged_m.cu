// FP8 grouped GEMM with ragged rows (fprop and dgrad), production tilings. See gemm_fp8_ragged_m.cuh.
#include "gemm_fp8_ragged_m.cuh"

namespace moegemm {

using RaggedMTiling = grouped::Tile128x128C1x2;

size_t gemm_fp8_ragged_m_workspace_size(int E) { return ragged_m::workspace_size<RaggedMTiling>(E); }

void gemm_fp8_ragged_m(const uint8_t* qa, const float* sa, const uint8_t* qb, const float* sb, const int32_t* plan, int E,
                       int64_t T, int64_t N, int64_t K, void* out, void* workspace, cudaStream_t stream) {
  ragged_m::run<RaggedMTiling>(qa, sa, qb, sb, plan, E, T, N, K, out, workspace, stream, "gemm_fp8_ragged_m");
}

}  // namespace moegemm
