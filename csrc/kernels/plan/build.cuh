// Building the plan of m_splits (csrc/moegemm.h make_plan) block-wide: the plan kernel's whole body, and
// what any kernel that builds the plan on the side (one extra CTA, e.g. the weight quantizer's) runs.
#pragma once

#include <cub/block/block_scan.cuh>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "moegemm.h"

namespace moegemm {

// The host-side requirements of a plan (csrc/moegemm.h make_plan), thrown before anything is launched.
inline void check_plan_size(int E, int64_t T, const char* what) {
  if (E < 1 || E > kMaxExperts) throw std::runtime_error(std::string("moegemm: ") + what + ": E out of range");
  if (T < 0 || col_capacity(T, E) > kMaxPlanValue) throw std::runtime_error(std::string("moegemm: ") + what + ": T out of range");
}

// One expert's entries of the plan: tokens [tok0, tok1), padded columns from col0 to col1, 128-token blocks
// [blk0, blk1).
struct PlanEntry {
  int e, tok0, tok1, col0, col1, blk0, blk1;
};
// The plan's last column: covered tokens, columns and blocks of all experts.
struct PlanTotals {
  int tok, col, blk;
};

// The plan of m_splits (int32 or int64 counts) scanned by a block of kThreads threads, thread t holding
// experts t * kItems .. t * kItems + kItems - 1: visit(entry) for each of its experts < E, and the totals to
// every thread. Each count is clamped to [0, T] before any sum (E <= 1024 counts of at most T < 2^31 cannot
// overflow the 64-bit token sum, whatever the device values) and the token ends to T; columns and blocks
// come from the clamped counts (their sums stay within col_capacity(T, E), checked on the host to fit
// int32). Every thread of the block calls it.
template <int kThreads, class Visit>
__device__ __forceinline__ PlanTotals scan_plan(const void* m_splits, bool m_is_int64, int E, int64_t T, Visit&& visit) {
  constexpr int kItems = kMaxExperts / kThreads;
  static_assert(kItems * kThreads == kMaxExperts, "the block's threads hold kMaxExperts counts");
  // warp scans: a few hundred bytes of shared memory, for the kernels that build the plan on the side
  using TokenScan = cub::BlockScan<long long, kThreads, cub::BLOCK_SCAN_WARP_SCANS>;
  using CountScan = cub::BlockScan<int, kThreads, cub::BLOCK_SCAN_WARP_SCANS>;
  __shared__ union {
    typename TokenScan::TempStorage tokens;
    typename CountScan::TempStorage counts;
  } storage;
  const int first = threadIdx.x * kItems;
  long long m[kItems], end[kItems], tokens;
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    long long v = 0;
    if (first + i < E) v = m_is_int64 ? static_cast<const int64_t*>(m_splits)[first + i] : static_cast<const int32_t*>(m_splits)[first + i];
    m[i] = v < 0 ? 0 : (v > T ? T : v);
  }
  TokenScan(storage.tokens).InclusiveSum(m, end, tokens);
  __syncthreads();
  int tok0[kItems], tok1[kItems], cols[kItems], blks[kItems], col_end[kItems], blk_end[kItems], col_total, blk_total;
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const long long start = end[i] - m[i];
    tok0[i] = static_cast<int>(start < T ? start : T);
    tok1[i] = static_cast<int>(end[i] < T ? end[i] : T);
    const int count = tok1[i] - tok0[i];
    cols[i] = (count + kColAlign - 1) / kColAlign * kColAlign;
    blks[i] = (count + kBlock - 1) / kBlock;
  }
  CountScan(storage.counts).InclusiveSum(cols, col_end, col_total);
  __syncthreads();
  CountScan(storage.counts).InclusiveSum(blks, blk_end, blk_total);
#pragma unroll
  for (int i = 0; i < kItems; ++i)
    if (first + i < E) visit(PlanEntry{first + i, tok0[i], tok1[i], col_end[i] - cols[i], col_end[i], blk_end[i] - blks[i], blk_end[i]});
  return {static_cast<int>(tokens < T ? tokens : T), col_total, blk_total};
}

// Writes one expert's entries into plan [3, E+1] (its end column; the plan's first column is zeros).
__device__ __forceinline__ void write_plan_entry(const PlanEntry& x, int E, int32_t* plan) {
  plan[x.e + 1] = x.tok1, plan[(E + 1) + x.e + 1] = x.col1, plan[2 * (E + 1) + x.e + 1] = x.blk1;
  if (x.e == 0) plan[0] = plan[E + 1] = plan[2 * (E + 1)] = 0;
}

// The plan of m_splits built by a block of kThreads threads (make_plan's kernel, or one CTA of another).
template <int kThreads>
__device__ __forceinline__ void build_plan(const PlanBuild& p) {
  scan_plan<kThreads>(p.m_splits, p.m_is_int64, p.E, p.T, [&](const PlanEntry& x) { write_plan_entry(x, p.E, p.plan); });
}

}  // namespace moegemm
