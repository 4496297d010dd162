// What the multi-cast quantizers' tiles share about the outputs' layout: the 16-byte chunks of a column line a
// tile stores (column_chunks), the rows of no expert (zero_uncovered_rows) and a launch's side zeroing (zero_fill); where a tile lies under a plan is
// kernels/plan/tile_lookup.cuh. Used by the multi-cast kernels (multicast/) and the per-tile GLU kernels.
#pragma once

#include <cstdint>

#include "moegemm.h"
#include "kernels/plan/tile_lookup.cuh"

namespace moegemm {

// The 16-byte chunks of a column line that a tile of nr tokens stores: its tokens rounded up to kColAlign (the
// chunks past nr hold zeros).
__device__ __forceinline__ int column_chunks(int nr) { return (nr + kColAlign - 1) / kColAlign * (kColAlign / 16); }

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

// A launch's ZeroFill (moegemm.h), spread over every thread.
__device__ __forceinline__ void zero_fill(const ZeroFill& zero, int64_t tid, int64_t stride) {
  for (int64_t i = tid; i < zero.count; i += stride) zero.words[i] = 0;
}

}  // namespace moegemm
