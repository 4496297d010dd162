// FP8 wgrad with fp32 output, written or accumulated (Megatron's main_grad). See gemm_fp8_ragged_k.cuh.
#include "gemm_fp8_ragged_k.cuh"

namespace moegemm {

using RaggedKTiling = grouped::Tile128x128C1x2;

size_t gemm_fp8_ragged_k_f32_workspace_size(int E) { return ragged_k::workspace_size<float, RaggedKTiling>(E); }

void gemm_fp8_ragged_k_f32(const uint8_t* qaT, const float* saT, const uint8_t* qbT, const float* sbT,
                           const int32_t* plan, int E, int64_t col_cap, int64_t blk_cap, int64_t N, int64_t K, float* out,
                           bool accumulate, void* workspace, cudaStream_t stream) {
  ragged_k::run<float, RaggedKTiling>(qaT, saT, qbT, sbT, plan, E, col_cap, blk_cap, N, K, out, accumulate, workspace, stream,
                       "gemm_fp8_ragged_k_f32");
}

}  // namespace moegemm
