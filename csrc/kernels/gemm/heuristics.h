// Which kernel and tiling a grouped GEMM gets: pure functions of the host-known problem (T, E, N, K and
// the device's SM count and DRAM bandwidth; m_splits stay on the device, so the row blocks are estimated).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "env_flag.h"
#include "moegemm.h"

namespace moegemm::gemm {

// moegemm's own ragged-row kernel (sm90/fp8_ragged_rows.cuh): BLOCK_M = 128, BLOCK_N = 128, 192 or 256,
// alone or in clusters of two CTAs that multicast a shared operand.
// The table of tilings the kernel is built with; a raw op may ask for one by its index.
struct RaggedRowsTiling {
  int block_n;
  int cluster;
};
constexpr RaggedRowsTiling kRaggedRowsTilings[] = {{128, 1}, {256, 1}, {128, 2}, {256, 2}, {192, 1}, {192, 2}};
constexpr int kNumRaggedRowsTilings = sizeof(kRaggedRowsTilings) / sizeof(kRaggedRowsTilings[0]);

// Row blocks of 128 expected for T tokens over E experts: each non-empty expert's last block is partial.
inline int64_t expected_row_blocks(int64_t T, int E) { return ceil_div(T, kBlock) + E / 2; }

// The candidates of the choice below: the three single-CTA widths, each with its time per column of a tile
// relative to 128 columns (wider tiles stream A once for more columns). The costs depend on the device's DRAM
// bandwidth (docs/performance.md, Ragged-row GEMM):
// - at kRaggedRowsHighDramGBps and above (H200, 4.8 TB/s): 192 columns 0.80 and 256 columns 0.84 of 128's time
//   per column, the costs that picked the fastest width most often on the GEMM table (bench/gemm/ragged_rows.py);
//   clusters of two are no candidates, their lead over the best single CTA being small (about 1 %);
// - below it (H100 SXM, 3.35 TB/s): 256 columns, which were the fastest single-CTA tiling almost everywhere,
//   unless 128-column tiles take fewer waves (small problems, N of at most 128).
// A device that reports no DRAM bandwidth (0) gets the H200's costs.
struct RaggedRowsCandidate {
  int tiling;  // index into kRaggedRowsTilings
  double cost_per_column;
};
constexpr double kRaggedRowsHighDramGBps = 4000;
constexpr RaggedRowsCandidate kRaggedRowsCandidates[] = {{4, 0.80}, {1, 0.84}, {0, 1.0}};
constexpr RaggedRowsCandidate kRaggedRowsCandidatesLowDram[] = {{1, 0.70}, {0, 1.0}};

// The candidate with the least estimated time: waves of tiles over the SMs, each as long as its tile is
// wide times its relative cost per column.
template <size_t kCount>
RaggedRowsTiling least_time_tiling(const RaggedRowsCandidate (&candidates)[kCount], int64_t blocks, int64_t N, int sms) {
  int best = 0;
  double best_time = 0.0;
  for (const RaggedRowsCandidate& c : candidates) {
    const int width = kRaggedRowsTilings[c.tiling].block_n;
    const double time = double(ceil_div(blocks * ceil_div(N, width), sms)) * width * c.cost_per_column;
    if (best_time == 0.0 || time < best_time) best = c.tiling, best_time = time;  // ties: the earlier candidate
  }
  return kRaggedRowsTilings[best];
}
// The ragged-row GEMM's tiling: the least-time candidate of the device's DRAM class, over the expected row blocks.
inline RaggedRowsTiling ragged_rows_tiling(int64_t T, int E, int64_t N, int sms, double dram_gbps) {
  const int64_t blocks = expected_row_blocks(T, E);
  if (dram_gbps > 0 && dram_gbps < kRaggedRowsHighDramGBps) return least_time_tiling(kRaggedRowsCandidatesLowDram, blocks, N, sms);
  return least_time_tiling(kRaggedRowsCandidates, blocks, N, sms);
}

// Whether an FP8 forward from a bf16 x [T, K] quantizes x inside the GEMM's launch (the fused prologue,
// gemm_fp8_ragged_rows_quantize_a: one launch) rather than in one of its own before it: for an x of up to 2^23 values
// (16 MiB), where the host's time per launch is the bound. Beyond that the prologue's lower quantizing rate and its
// wait (every CTA's GEMM starts after all of x) cost more than the saved launch (H200; docs/performance.md,
// Ragged-row GEMM). Both forms give bitwise the same results.
constexpr int64_t kQuantizeAInGemmMaxValues = int64_t(1) << 23;
inline bool quantize_a_in_gemm(int64_t T, int64_t K) { return T * K <= kQuantizeAInGemmMaxValues; }

// moegemm's own ragged-reduction kernel (sm90/fp8_ragged_reduction.cuh, the FP8 wgrad): BLOCK_M = 128
// gradient rows, BLOCK_N = 128, 256 or 160 columns. The table of tilings it is built with; a raw op may ask for
// one by its index.
struct RaggedReductionTiling {
  int block_n;
};
constexpr RaggedReductionTiling kRaggedReductionTilings[] = {{128}, {256}, {160}};
constexpr int kNumRaggedReductionTilings = sizeof(kRaggedReductionTilings) / sizeof(kRaggedReductionTilings[0]);

// The tokens a ragged reduction covers, from the width of its column copies (col_capacity: T + 31 E
// rounded up to 32; the counts themselves stay on the device).
inline int64_t reduction_tokens(const RaggedReduction& p) { return std::max<int64_t>(0, p.cols - (kColAlign - 1) * int64_t(p.E)); }

// Tokens per expert below which an fp32 accumulation is short: moving main_grad in and out is its bound,
// and 128-column tiles beat wider ones; from ~1000 tokens per expert the wider tiles win (H200, wgrad table
// bench/gemm/ragged_reduction.py; docs/performance.md, Ragged-reduction GEMM).
constexpr int64_t kShortReductionTokensPerExpert = 512;

// Tokens per expert from which a written output (bf16, fp32) is a long reduction: 160-column tiles' cheaper
// boxes outweigh their 1.6x as many tile ends (H200; docs/performance.md, Ragged-reduction GEMM).
constexpr int64_t kLongReductionTokensPerExpert = 4096;

// The tiling of moegemm's kernel: wide tiles (160 columns for an fp32 accumulation or a long reduction, else
// 256), except 128 for a short fp32 accumulation and when 256-wide tiles would leave SMs idle. For the
// accumulation into main_grad, 160 columns in one part (their column scales in registers, read before the
// chain; the stage released before the promotion) beat 256 in two parts on most wide problems (H200;
// docs/performance.md, Ragged-reduction GEMM).
inline RaggedReductionTiling ragged_reduction_tiling(const RaggedReduction& p, int sms) {
  const int64_t wide_tiles = p.E * ceil_div(p.N, kBlock) * ceil_div(p.K, 256);
  const int64_t tokens = reduction_tokens(p);
  const bool accumulate = p.out_kind == WgradOut::kF32Accumulate;
  if (p.K <= 128 || wide_tiles < sms || (accumulate && tokens < kShortReductionTokensPerExpert * p.E))
    return kRaggedReductionTilings[0];
  return kRaggedReductionTilings[accumulate || tokens >= kLongReductionTokensPerExpert * p.E ? 2 : 1];
}

// The kernel an FP8 grouped GEMM runs when the caller names none: CUTLASS's when the environment variable
// `env` says "cutlass", moegemm's own sm90 kernel when it says "sm90" or is unset (anything else throws
// std::invalid_argument naming the variable: env_flag.h's rule).
inline GemmKernel kernel_from_env(const char* env) {
  return env_choice(env, {"sm90", "cutlass"}) == 1 ? GemmKernel::kCutlass : GemmKernel::kSm90;
}

// A form that the boolean environment variable `env` turns off (on when unset; env_flag.h's strict rule: a value
// that is not a boolean throws std::invalid_argument naming the variable).
inline bool enabled_by_env(const char* env) { return env_flag(env, true); }

// The ragged reduction's tile walk within an expert (scheduler.cuh): row-major, where the CTAs working at one
// time share sms / n_blocks row tiles and read every column tile, or, with many column tiles, in bands of
// kReductionBandRows row blocks walked column by column (about 16 row tiles and 8 column tiles at a time, each
// read by 8-16 CTAs together: fewer DRAM bytes). The wgrad GEMMs run power-capped, and fewer DRAM bytes leave the
// SMs a higher clock: bands pay from kReductionBandMinColumnTiles column tiles on (many: K = 7168, 14336) and
// cost a little with few (H200; docs/performance.md, Ragged-reduction GEMM).
constexpr int kReductionBandRows = 16;
constexpr int64_t kReductionBandMinColumnTiles = 24;
inline int ragged_reduction_band(int64_t K, int block_n) {
  return ceil_div(K, block_n) >= kReductionBandMinColumnTiles ? kReductionBandRows : 0;
}

// The FP8 ragged-reduction kernel: the caller's choice, else MOEGEMM_FP8_WGRAD (read once), else moegemm's
// own kernel, faster than CUTLASS's on nearly every problem of the wgrad table (docs/performance.md,
// Ragged-reduction GEMM).
inline GemmKernel fp8_ragged_reduction_kernel(GemmKernel requested) {
  static const GemmKernel from_env = kernel_from_env("MOEGEMM_FP8_WGRAD");
  return requested != GemmKernel::kDefault ? requested : from_env;
}

}  // namespace moegemm::gemm
