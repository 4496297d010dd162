// The FP8 grouped GEMMs per schedule, as plain functions: each (GEMM, schedule) pair is compiled in its
// own translation unit (gemm_fp8_ragged_{m,k}_*.cu, ~30 s each); gemm_fp8_schedule.cu picks one per
// call and implements the public functions of moegemm.h. No CUTLASS or torch types here.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace moegemm::fp8 {

enum class Schedule : int { kCooperative = 0, kPingpong = 1 };

// out [T, N] (bf16) = qa [T, K] · qb[e] [N, K]ᵀ over each expert's rows (fprop, dgrad).
struct RaggedM {
  const uint8_t* qa; const float* sa; const uint8_t* qb; const float* sb; const int32_t* plan;
  int E; int64_t N, K; void* out; void* workspace; cudaStream_t stream;
};
// out [E, N, K] (+)= qaT_e [N, m_e] · qbT_e [K, m_e]ᵀ over each expert's tokens (wgrad).
struct RaggedK {
  const uint8_t* qaT; const float* saT; const uint8_t* qbT; const float* sbT; const int32_t* plan;
  int E; int64_t col_cap, N, K; void* out; bool accumulate; void* workspace; cudaStream_t stream;
};

// Specialized (defined) in the per-schedule translation units.
template <Schedule S> size_t ragged_m_workspace_size(int E);
template <Schedule S> void ragged_m(const RaggedM& args);
template <Schedule S> size_t ragged_k_f32_workspace_size(int E);
template <Schedule S> void ragged_k_f32(const RaggedK& args);   // out fp32: = or +=
template <Schedule S> size_t ragged_k_bf16_workspace_size(int E);
template <Schedule S> void ragged_k_bf16(const RaggedK& args);  // out bf16: =

}  // namespace moegemm::fp8
