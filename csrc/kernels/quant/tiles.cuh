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

// A per-tile CTA's tile under a given plan: block b's tokens [row0, row0 + nr) (nr 0 past the plan's blocks or with
// no columns), the plan checked (fits) and the tokens it covers. The tile's loads (load(spot)) are issued before the
// plan is checked, so that their latency hides the check's: the rows they read are clamped into the tensors (tile_spot's row0 and nr),
// so a foreign plan's loads stay inside them; such a plan (fits false) writes nothing but zeros, and a caller
// takes anything else from the spot (qt_col) only once fits holds.
struct Found {
  TileSpot spot;
  bool fits = true;
  int64_t covered = 0;
};
template <class Load>
__device__ __forceinline__ Found find_tile(int b, bool any_cols, int E, int64_t T, const int32_t* plan, Load&& load) {
  const int32_t* tok = plan;
  const int32_t* col = plan + (E + 1);
  const int32_t* blk = plan + 2 * (E + 1);
  Found f;
  if (any_cols && b < blk[E]) {
    const int e = expert_of(blk, E, b);
    f.spot = tile_spot(b, tok[e], tok[e + 1], col[e], blk[e], T);
  }
  if (f.spot.has_tile) load(f.spot);
  f.fits = plan_fits(plan, E, token_limit(T));
  f.covered = f.fits ? tok[E] : 0;
  return f;
}

}  // namespace moegemm
