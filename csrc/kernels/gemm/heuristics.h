// Which kernel and tiling a grouped GEMM gets: pure functions of the host-known problem (T, E, N, K and
// the device's SM count; m_splits stay on the device, so the row blocks are estimated).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "moegemm.h"

namespace moegemm::gemm {

// moegemm's own ragged-row kernel (sm90/fp8_ragged_rows.cuh): BLOCK_M = 128, BLOCK_N = 128 * parts, alone or
// in clusters of two CTAs that multicast a shared operand.
// The table of tilings the kernel is built with; a raw op may ask for one by its index.
struct RaggedRowsTiling {
  int parts;
  int cluster;
};
constexpr RaggedRowsTiling kRaggedRowsTilings[] = {{1, 1}, {2, 1}, {1, 2}, {2, 2}};
constexpr int kNumRaggedRowsTilings = sizeof(kRaggedRowsTilings) / sizeof(kRaggedRowsTilings[0]);

// Row blocks of 128 expected for T tokens over E experts: each non-empty expert's last block is partial.
inline int64_t expected_row_blocks(int64_t T, int E) { return ceil_div(T, kBlock) + E / 2; }

// Between 128 columns alone and 256 columns in 2-CTA clusters (the faster of each width in the GEMM table
// of bench/gemm/ragged_rows.py on an H200, bench/results/ragged_rows_h200.md), the one with the fewer
// 128-column tile passes per SM: waves of tiles over the SMs, each as long as its tile is wide; a
// 256-wide tile streams A once for two weight blocks, which the relative cost kWideTileCost (< 1 per 128
// columns) credits.
inline RaggedRowsTiling ragged_rows_tiling(int64_t T, int E, int64_t N, int sms) {
  constexpr double kWideTileCost = 0.9;
  const int64_t blocks = expected_row_blocks(T, E);
  const double narrow = double(ceil_div(blocks * ceil_div(N, kBlock), sms));
  const double wide = double(ceil_div(blocks * ceil_div(N, 2 * kBlock), sms)) * 2 * kWideTileCost;
  return kRaggedRowsTilings[wide < narrow ? 3 : 0];
}

// The FP8 ragged-row kernel: the caller's choice, else MOEGEMM_FP8_GEMM (cutlass | sm90, read once), else
// CUTLASS's ptr-array kernel.
inline GemmKernel fp8_ragged_rows_kernel(GemmKernel requested) {
  if (requested != GemmKernel::kDefault) return requested;
  static const GemmKernel from_env = [] {
    const char* v = std::getenv("MOEGEMM_FP8_GEMM");
    if (v != nullptr && std::strcmp(v, "sm90") == 0) return GemmKernel::kSm90;
    return GemmKernel::kCutlass;
  }();
  return from_env;
}

}  // namespace moegemm::gemm
