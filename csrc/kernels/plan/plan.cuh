// Device-side reading of the plan (csrc/moegemm.h): which expert owns a 128-token block.
#pragma once

#include <cstdint>

#include "moegemm.h"

namespace moegemm {

// The limits of buffers sized for T tokens (a plan with the make_plan structure and tok[E] <= T keeps
// col[E] <= col_capacity(T, E) and blk[E] <= block_capacity(T, E) by construction).
__host__ __device__ inline PlanLimits token_limit(int64_t T) { return {T, kNoLimit, kNoLimit}; }

// Block-wide: every thread of the block calls it, before any early return. True when `plan` has the
// structure make_plan writes (offsets from 0; per expert a non-negative token count, its columns rounded
// up to kColAlign, its 128-token blocks) and keeps within `limits`, so that every offset it yields lies inside
// the caller's buffers. Callers treat a plan that does not fit (made for more tokens, or not by
// make_plan: only a raw op can be handed one) as the plan of no tokens, so such input gives zeros and
// never an out-of-bounds access.
__device__ __forceinline__ bool plan_fits(const int32_t* plan, int E, PlanLimits limits) {
  const int32_t* tok = plan;
  const int32_t* col = plan + (E + 1);
  const int32_t* blk = plan + 2 * (E + 1);
  int bad = 0;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    const int64_t m = int64_t(tok[e + 1]) - tok[e];
    bad |= m < 0 || int64_t(col[e + 1]) - col[e] != (m + kColAlign - 1) / kColAlign * kColAlign ||
           int64_t(blk[e + 1]) - blk[e] != (m + kBlock - 1) / kBlock;
  }
  if (threadIdx.x == 0)
    bad |= tok[0] != 0 || col[0] != 0 || blk[0] != 0 || tok[E] > limits.tok || col[E] > limits.col || blk[E] > limits.blk;
  return !__syncthreads_or(bad);
}

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

// find_expert's answer found by a whole warp in a few dependent loads instead of log2(E) (every lane of the warp
// calls these with the same arguments):
// the owner of block b given the owner `from` of an earlier or the same block (-1: none), the warp testing the next
// 32 experts at once (one load per 32 experts passed).
__device__ __forceinline__ int walk_expert(const int32_t* blk, int E, int64_t b, int from) {
  const int lane = threadIdx.x % 32;
  for (;;) {
    const int c = from + 1 + lane;
    const unsigned later = __ballot_sync(0xffffffffu, c < E && blk[c] <= b);  // a prefix: blk is sorted
    from += __popc(later);
    if (later != 0xffffffffu) return from;
  }
}

// the owner of block b < blk[E] by two warp votes: over the experts at every ceil(E / 32)-th index first, then
// over those after the last of them at or below b; E <= 1024 (kMaxExperts).
__device__ __forceinline__ int owner_of(const int32_t* blk, int E, int b) {
  const int lane = threadIdx.x % 32, stride = (E + 31) / 32;
  const int c = lane * stride;
  // (Clamped to [0, E): a foreign plan's answer is wrong but in bounds; make_plan's always has blk[0] = 0 <= b.)
  int owner = max(0, __popc(__ballot_sync(0xffffffffu, c < E && blk[c] <= b)) - 1) * stride;
  if (stride > 1) {
    const int d = owner + lane;
    owner += __popc(__ballot_sync(0xffffffffu, lane < stride && d < E && blk[d] <= b)) - 1;
  }
  return min(max(owner, 0), E - 1);
}

// The owner of block b < blk[E] for a warp that knows no earlier owner: owner_of's two votes within kMaxExperts
// (every plan the API makes), else find_expert's binary search.
__device__ __forceinline__ int expert_of(const int32_t* blk, int E, int b) {
  return E <= kMaxExperts ? owner_of(blk, E, b) : find_expert(blk, E, b);
}

}  // namespace moegemm
