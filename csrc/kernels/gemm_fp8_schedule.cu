// The FP8 grouped GEMMs of moegemm.h: pick a schedule per call from the host-known sizes (T, E, N, K;
// the per-expert counts live on the device only), then run that schedule's kernel
// (gemm_fp8_variants.h). MOEGEMM_FP8_GEMM_SCHEDULE=cooperative|pingpong forces one (tests, benchmarks).
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "../moegemm.h"
#include "gemm_fp8_variants.h"

namespace moegemm {
namespace {

using fp8::Schedule;

enum class Gemm { kRaggedM, kRaggedK };

// The heuristic (bench/NOTES.md has the measurements behind it).
Schedule heuristic(Gemm gemm, int64_t T, int E, int64_t N, int64_t K) {
  (void)gemm; (void)T; (void)E; (void)N; (void)K;
  return Schedule::kCooperative;
}

Schedule choose(Gemm gemm, int64_t T, int E, int64_t N, int64_t K) {
  if (const char* forced = std::getenv("MOEGEMM_FP8_GEMM_SCHEDULE")) {
    if (std::strcmp(forced, "cooperative") == 0) return Schedule::kCooperative;
    if (std::strcmp(forced, "pingpong") == 0) return Schedule::kPingpong;
  }
  return heuristic(gemm, T, E, N, K);
}

}  // namespace

size_t gemm_fp8_ragged_m_workspace_size(int E) {
  return std::max(fp8::ragged_m_workspace_size<Schedule::kCooperative>(E), fp8::ragged_m_workspace_size<Schedule::kPingpong>(E));
}

void gemm_fp8_ragged_m(const uint8_t* qa, const float* sa, const uint8_t* qb, const float* sb, const int32_t* plan, int E,
                       int64_t T, int64_t N, int64_t K, void* out, void* workspace, cudaStream_t stream) {
  const fp8::RaggedM args{qa, sa, qb, sb, plan, E, N, K, out, workspace, stream};
  if (choose(Gemm::kRaggedM, T, E, N, K) == Schedule::kPingpong) fp8::ragged_m<Schedule::kPingpong>(args);
  else fp8::ragged_m<Schedule::kCooperative>(args);
}

size_t gemm_fp8_ragged_k_f32_workspace_size(int E) {
  return std::max(fp8::ragged_k_f32_workspace_size<Schedule::kCooperative>(E),
                  fp8::ragged_k_f32_workspace_size<Schedule::kPingpong>(E));
}

void gemm_fp8_ragged_k_f32(const uint8_t* qaT, const float* saT, const uint8_t* qbT, const float* sbT,
                           const int32_t* plan, int E, int64_t col_cap, int64_t N, int64_t K, float* out,
                           bool accumulate, void* workspace, cudaStream_t stream) {
  const fp8::RaggedK args{qaT, saT, qbT, sbT, plan, E, col_cap, N, K, out, accumulate, workspace, stream};
  if (choose(Gemm::kRaggedK, col_cap, E, N, K) == Schedule::kPingpong) fp8::ragged_k_f32<Schedule::kPingpong>(args);
  else fp8::ragged_k_f32<Schedule::kCooperative>(args);
}

size_t gemm_fp8_ragged_k_bf16_workspace_size(int E) {
  return std::max(fp8::ragged_k_bf16_workspace_size<Schedule::kCooperative>(E),
                  fp8::ragged_k_bf16_workspace_size<Schedule::kPingpong>(E));
}

void gemm_fp8_ragged_k_bf16(const uint8_t* qaT, const float* saT, const uint8_t* qbT, const float* sbT,
                            const int32_t* plan, int E, int64_t col_cap, int64_t N, int64_t K, void* out,
                            void* workspace, cudaStream_t stream) {
  const fp8::RaggedK args{qaT, saT, qbT, sbT, plan, E, col_cap, N, K, out, false, workspace, stream};
  if (choose(Gemm::kRaggedK, col_cap, E, N, K) == Schedule::kPingpong) fp8::ragged_k_bf16<Schedule::kPingpong>(args);
  else fp8::ragged_k_bf16<Schedule::kCooperative>(args);
}

}  // namespace moegemm
