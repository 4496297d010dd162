// Where a multi-cast quantizer's tile lies and what its kernels share about the outputs' layout: the tile of an
// expert's 128-token block (TileSpot, tile_spot), the 16-byte chunks of a column line a tile stores (column_chunks)
// and the rows of no expert (zero_uncovered_rows), and a per-tile CTA's tile under a given plan (find_tile). Used by
// multicast.cuh's kernels and the per-tile GLU kernels.
#pragma once

#include <cstdint>

#include "moegemm.h"
#include "kernels/plan/plan.cuh"

namespace moegemm {

__device__ __forceinline__ int64_t imin64(int64_t a, int64_t b) { return a < b ? a : b; }

// The 16-byte chunks of a column line that a tile of nr tokens stores: its tokens rounded up to kColAlign (the
// chunks past nr hold zeros).
__device__ __forceinline__ int column_chunks(int nr) { return (nr + kColAlign - 1) / kColAlign * (kColAlign / 16); }

// Where a CTA's tile lies: its expert's rows [row0, row0 + nr) from 128-token block b, at column qt_col of the
// column copy (has_tile false past the plan's blocks).
struct TileSpot {
  bool has_tile = false;
  int64_t row0 = 0, qt_col = 0;
  int nr = 0;
};

__device__ __forceinline__ TileSpot tile_spot(int b, int tok0, int tok1, int col0, int blk0, int64_t T) {
  TileSpot spot;
  const int64_t i_blk = int64_t(b) - blk0;
  spot.has_tile = true;
  spot.row0 = tok0 + i_blk * kBlock;
  spot.qt_col = col0 + i_blk * kBlock;
  spot.nr = spot.row0 < 0 || spot.row0 >= T ? 0 : static_cast<int>(imin64(kBlock, imin64(tok1, T) - spot.row0));
  return spot;
}

// Rows [covered, T) of the row copy (q, s) and of row_extra belong to no expert (device counts summing
// below T): zeros, spread over every thread. q's rows are K bytes, K a multiple of 16; s is K-major.
__device__ __forceinline__ void zero_uncovered_rows(int64_t covered, int64_t T, int64_t K, int64_t Kb, uint8_t* q, float* s,
                                                   float* row_extra, int64_t tid, int64_t stride) {
  if (q != nullptr) {
    uint4* q16 = reinterpret_cast<uint4*>(q);
    for (int64_t i = covered * K / 16 + tid; i < T * K / 16; i += stride) q16[i] = make_uint4(0, 0, 0, 0);
    const int64_t rows = T - covered, pitch = row_scale_pitch(T);
    for (int64_t i = tid; i < rows * Kb; i += stride) s[i / rows * pitch + covered + i % rows] = 0.f;
  }
  if (row_extra != nullptr)
    for (int64_t i = covered * Kb + tid; i < T * Kb; i += stride) row_extra[i] = 0.f;
}

// The grid of a per-tile kernel: x the tile's column block (fastest: the tiles of one token block read the same rows),
// y the 128-token block, continued in z past 65535 blocks, the blocks spread evenly over the z rows (CTAs past
// `blocks` in the last z row, fewer than z, have no tile). No division per CTA: tile_block() and the linear CTA id
// come from the grid itself.
inline dim3 tile_grid(int64_t blocks, int64_t col_blocks) {
  constexpr int64_t kMaxY = 65535;
  const int64_t n = blocks < 1 ? 1 : blocks, z = (n + kMaxY - 1) / kMaxY, y = (n + z - 1) / z;
  return dim3(static_cast<unsigned>(col_blocks < 1 ? 1 : col_blocks), static_cast<unsigned>(y), static_cast<unsigned>(z));
}
__device__ __forceinline__ int tile_block() { return static_cast<int>(blockIdx.y + blockIdx.z * gridDim.y); }
__device__ __forceinline__ int64_t tile_cta() { return int64_t(tile_block()) * gridDim.x + blockIdx.x; }
__device__ __forceinline__ int64_t tile_ctas() { return int64_t(gridDim.x) * gridDim.y * gridDim.z; }

// A per-tile CTA's tile under a given plan: block b's tokens [row0, row0 + nr) (nr 0 past the plan's blocks or with
// no columns), the plan checked (fits) and the tokens it covers. One pass of the CTA's threads over the experts
// reads every plan entry at once, checks the plan as plan_fits does and finds block b's owner (the one expert
// with blk[e] <= b < blk[e + 1] in a plan that fits), whose thread leaves its offsets in shared memory; the check's
// barrier publishes both. The tile's loads (load(spot)) are issued only under a plan that fits, so a foreign plan
// never steers a load (it writes nothing but zeros). (Under a foreign plan several threads may write owner_s,
// unordered; it is then never read. racecheck would name that write-after-write; the tests run it on make_plan's plans.)
struct Found {
  TileSpot spot;
  bool fits = true;
  int64_t covered = 0;
};
template <class Load>
__device__ __forceinline__ Found find_tile(int b, bool any_cols, int E, int64_t T, const int32_t* plan, Load&& load) {
  __shared__ int4 owner_s;  // block b's expert: its first token, end token, first column, first block
  const int32_t* tok = plan;
  const int32_t* col = plan + (E + 1);
  const int32_t* blk = plan + 2 * (E + 1);
  const PlanLimits limits = token_limit(T);
  const int tok_end = tok[E], col_end = col[E], blk_end = blk[E];
  int bad = 0;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    const int t0 = tok[e], t1 = tok[e + 1], c0 = col[e], c1 = col[e + 1], b0 = blk[e], b1 = blk[e + 1];
    const int64_t m = int64_t(t1) - t0;
    bad |= m < 0 || int64_t(c1) - c0 != (m + kColAlign - 1) / kColAlign * kColAlign ||
           int64_t(b1) - b0 != (m + kBlock - 1) / kBlock;
    if (b0 <= b && b < b1) owner_s = make_int4(t0, t1, c0, b0);
  }
  if (threadIdx.x == 0)
    bad |= tok[0] != 0 || col[0] != 0 || blk[0] != 0 || tok_end > limits.tok || col_end > limits.col || blk_end > limits.blk;
  Found f;
  f.fits = !__syncthreads_or(bad);
  f.covered = f.fits ? tok_end : 0;
  if (f.fits && any_cols && b < blk_end) {
    const int4 o = owner_s;
    f.spot = tile_spot(b, o.x, o.y, o.z, o.w, T);
    load(f.spot);
  }
  return f;
}

}  // namespace moegemm
