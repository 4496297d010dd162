// Device-side reading of the plan (csrc/moegemm.h): which expert owns a 128-token block.
#pragma once

#include <cstdint>

namespace moegemm {

// Expert owning 128-token block b: the last e with blk[e] <= b (blk, the plan's third row, is
// non-decreasing; experts without tokens own no block). Needs b < blk[E].
__device__ __forceinline__ int find_expert(const int32_t* blk, int E, int64_t b) {
  int lo = 0, hi = E - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) >> 1;
    if (blk[mid] <= b) lo = mid; else hi = mid - 1;
  }
  return lo;
}

}  // namespace moegemm
