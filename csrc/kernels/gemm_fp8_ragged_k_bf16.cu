// FP8 wgrad with bf16 output (the parameter's dtype, no fp32 round trip). See gemm_fp8_ragged_k.cuh.
#include "gemm_fp8_ragged_k.cuh"

namespace moegemm {

using RaggedKTiling = grouped::Tile128x128C1x2;

size_t gemm_fp8_ragged_k_bf16_workspace_size(int E) { return ragged_k::workspace_size<cutlass::bfloat16_t, RaggedKTiling>(E); }

void gemm_fp8_ragged_k_bf16(const uint8_t* qaT, const float* saT, const uint8_t* qbT, const float* sbT,
                            const int32_t* plan, int E, int64_t col_cap, int64_t blk_cap, int64_t N, int64_t K, void* out,
                            void* workspace, cudaStream_t stream) {
  ragged_k::run<cutlass::bfloat16_t, RaggedKTiling>(qaT, saT, qbT, sbT, plan, E, col_cap, blk_cap, N, K,
                                     static_cast<cutlass::bfloat16_t*>(out), false, workspace, stream,
                                     "gemm_fp8_ragged_k_bf16");
}

}  // namespace moegemm
