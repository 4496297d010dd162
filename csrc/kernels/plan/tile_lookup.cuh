// Which tile a per-tile CTA takes under a plan (csrc/moegemm.h) of 128-token blocks: the grid over (column block,
// token block) (tile_grid, tile_block), where a block's tile lies (TileSpot, tile_spot) and the block's owner found
// with the plan checked in one pass (find_tile). Used by the multi-cast quantizers, the per-tile GLU kernels and
// the bias kernels.
#pragma once

#include <cstdint>

#include "moegemm.h"
#include "kernels/plan/plan.cuh"

namespace moegemm {

__device__ __forceinline__ int64_t imin64(int64_t a, int64_t b) { return a < b ? a : b; }

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
// kExpert: the owner's index too (Found::expert), for kernels that read per-expert data (the bias kernels).
struct Found {
  TileSpot spot;
  bool fits = true;
  int64_t covered = 0;
  int expert = 0;  // block b's owner, with kExpert and a tile
};
template <bool kExpert = false, class Load>
__device__ __forceinline__ Found find_tile(int b, bool any_cols, int E, int64_t T, const int32_t* plan, Load&& load) {
  __shared__ int4 owner_s;  // block b's expert: its first token, end token, first column, first block
  __shared__ int expert_s;  // and its index (kExpert)
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
    if (b0 <= b && b < b1) {
      owner_s = make_int4(t0, t1, c0, b0);
      if constexpr (kExpert) expert_s = e;
    }
  }
  if (threadIdx.x == 0)
    bad |= tok[0] != 0 || col[0] != 0 || blk[0] != 0 || tok_end > limits.tok || col_end > limits.col || blk_end > limits.blk;
  Found f;
  f.fits = !__syncthreads_or(bad);
  f.covered = f.fits ? tok_end : 0;
  if (f.fits && any_cols && b < blk_end) {
    const int4 o = owner_s;
    f.spot = tile_spot(b, o.x, o.y, o.z, o.w, T);
    if constexpr (kExpert) f.expert = expert_s;
    load(f.spot);
  }
  return f;
}

}  // namespace moegemm
