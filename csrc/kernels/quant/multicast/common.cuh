// The pieces both forms of the multi-cast FP8 quantizer share (launch.cuh): the thread layout of a tile's values
// (kVec columns x kRows rows per thread; common/vec8.cuh moves eight values at a time), the warp reductions, and
// the staging of a tile's input rows (and row factors) into shared memory by cp.async (load_tile_rows).
#pragma once

#include <cstdint>
#include <type_traits>

#include "moegemm.h"
#include "kernels/common/async_copy.cuh"
#include "kernels/common/vec8.cuh"
#include "kernels/quant/fp8_block.cuh"

namespace moegemm::multicast {

constexpr int kVec = 8;                          // values per lane: columns 8 hl .. 8 hl + 7 of a row
constexpr int kLanesPerRow = kBlock / kVec;      // 16: a half-warp covers a 128-column row block

constexpr int kRows = 4;                         // rows per thread: group g = 2 warp + half owns 4g .. 4g + 3
constexpr int kColTileBytes = kBlock * kBlock;   // the FP8 column tile, 128 columns of 128 rows

// Columns [src, src + n) of an input land at columns [dst, dst + n) of its staged tile (n a multiple of 16).
struct Segment {
  int64_t src;
  int dst, n;
};

__device__ __forceinline__ float warp_amax(float a) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) a = nan_max(a, __shfl_xor_sync(0xffffffffu, a, o));
  return a;
}


// A reduction (op) of each of 4 rows over a half-warp, reduced and scattered: lane hl returns row hl / 4's (5
// shuffles instead of 16). Each result is a half-warp butterfly's (xor 8, 4, 2, 1) to the bit: the same pairs are
// combined at each step of the same tree (op commutative). Every lane of the warp must call it.
template <class Op>
__device__ __forceinline__ float scatter_reduce4(const float (&a)[kRows], int hl, Op op) {
  const bool hi8 = hl & 8, hi4 = hl & 4;
  // lanes with bit 3 keep rows 2, 3 and send rows 0, 1 to their partner; the others the opposite
  const float k0 = op(hi8 ? a[2] : a[0], __shfl_xor_sync(0xffffffffu, hi8 ? a[0] : a[2], 8));
  const float k1 = op(hi8 ? a[3] : a[1], __shfl_xor_sync(0xffffffffu, hi8 ? a[1] : a[3], 8));
  float m = op(hi4 ? k1 : k0, __shfl_xor_sync(0xffffffffu, hi4 ? k0 : k1, 4));  // row 2 * bit3 + bit2
  m = op(m, __shfl_xor_sync(0xffffffffu, m, 2));
  return op(m, __shfl_xor_sync(0xffffffffu, m, 1));
}
// The rows' maxima (NaN-propagating) and sums.
__device__ __forceinline__ float scatter_amax4(const float (&a)[kRows], int hl) {
  return scatter_reduce4(a, hl, [](float x, float y) { return nan_max(x, y); });
}
__device__ __forceinline__ float scatter_sum4(const float (&a)[kRows], int hl) {
  return scatter_reduce4(a, hl, [](float x, float y) { return x + y; });
}

// Bytes of one stage of the ring: the loader's staged inputs, 128 x 128 elements each, then (kRowFactor) the
// tile's 128 row factors.
template <class Loader>
constexpr int64_t staged_input_bytes() {
  return int64_t(Loader::kInputs) * kBlock * kBlock * sizeof(typename Loader::Raw);
}
template <class Loader>
constexpr int64_t stage_bytes() {
  return staged_input_bytes<Loader>() + (Loader::kRowFactor ? kBlock * 4 : 0);
}
// The row factors of a stage (kRowFactor), row r of the tile at [r] (const as the stage is).
template <class Loader, class Raw>
__device__ __forceinline__ auto staged_factors(Raw* stage) {
  using Float = std::conditional_t<std::is_const_v<Raw>, const float, float>;
  return reinterpret_cast<Float*>(stage + staged_input_bytes<Loader>() / sizeof(Raw));
}
// The factor row r of a staged tile (columns from k0) takes: its staged factor, or 1 (no factor).
template <class Loader>
__device__ __forceinline__ float row_factor_of(const Loader& src, const typename Loader::Raw* stage, int r, int64_t k0) {
  if constexpr (Loader::kRowFactor) {
    if (src.row_factor(k0) != nullptr) return staged_factors<Loader>(stage)[r];
  }
  return 1.f;
}

// Every thread's share of the loads of a tile's nr tokens from row0, the loader's columns [k0, k0 + nk), into
// `stage` (kInputs inputs of 128 x 128): 16-byte chunk c of rows r0, r0 + kThreads / (chunks per row), ...
// (a chunk's columns lie in at most one segment of each input); with kRowFactor, thread r < nr the factor of
// row r (4 bytes: a tile's first row is any token).
template <int kThreads, class Loader>
__device__ __forceinline__ void load_tile_rows(const Loader& src, typename Loader::Raw* stage, int64_t row0, int nr,
                                               int64_t k0, int nk, int tid) {
  constexpr int kPerCopy = 16 / sizeof(typename Loader::Raw);  // elements per 16-byte copy
  constexpr int kChunksPerRow = kBlock / kPerCopy, kRowStep = kThreads / kChunksPerRow;
  const int cc = kPerCopy * (tid % kChunksPerRow), r0 = tid / kChunksPerRow;
#pragma unroll
  for (int in = 0; in < Loader::kInputs; ++in) {
    Segment seg[2];
    const int nseg = src.segments(in, k0, nk, seg);
    int64_t from = -1;
#pragma unroll
    for (int x = 0; x < 2; ++x)  // (constant indices: the segments stay in registers)
      if (x < nseg && cc >= seg[x].dst && cc < seg[x].dst + seg[x].n) from = seg[x].src + (cc - seg[x].dst);
    if (from < 0) continue;
    // One row's address, then a step per kRowStep rows (no 64-bit product per copy).
    const typename Loader::Raw* g = src.row_start(in, row0 + r0) + from;
    const int64_t step = src.row_start(in, row0 + r0 + kRowStep) - src.row_start(in, row0 + r0);
    typename Loader::Raw* d = stage + in * kBlock * kBlock + r0 * kBlock + cc;
    for (int r = r0; r < nr; r += kRowStep, g += step, d += kRowStep * kBlock) async_copy::load16(d, g);
  }
  if constexpr (Loader::kRowFactor) {
    static_assert(kThreads >= kBlock, "a thread per row of the tile");
    const float* factor = src.row_factor(k0);
    if (factor != nullptr && tid < nr)
      async_copy::load4(staged_factors<Loader>(stage) + tid, factor + row0 + tid);
  }
}

// The FP8 column tile: column c (128 bytes = 32 words, one per 4 rows) holds word w at w ^ swz(c), so that
// the 32 lanes of a warp writing words of 16 columns x 2 row groups hit 32 different banks, and 8 lanes
// reading one column's 16-byte chunks hit 8 different ones.
__device__ __forceinline__ int col_swizzle(int c) { return 2 * (c / kVec); }

}  // namespace moegemm::multicast
