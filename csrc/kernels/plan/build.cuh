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

// The plan from the counts each thread holds (thread t: experts t * kItems .. t * kItems + kItems - 1, zero
// past E), each already clamped to [0, T]: E <= 1024 counts of at most T < 2^31 cannot overflow the 64-bit
// token sum, whatever the device values. The token ends are clamped to T; columns and blocks come from the
// clamped counts (their sums stay within col_capacity(T, E), checked on the host to fit int32). Every thread
// of the block calls it.
template <int kThreads, int kItems>
__device__ __forceinline__ void plan_from_counts(long long (&m)[kItems], int E, int64_t T, int32_t* plan) {
  // warp scans: a few hundred bytes of shared memory, for the kernels that build the plan on the side
  using TokenScan = cub::BlockScan<long long, kThreads, cub::BLOCK_SCAN_WARP_SCANS>;
  using CountScan = cub::BlockScan<int, kThreads, cub::BLOCK_SCAN_WARP_SCANS>;
  __shared__ union {
    typename TokenScan::TempStorage tokens;
    typename CountScan::TempStorage counts;
  } storage;
  long long end[kItems];
  TokenScan(storage.tokens).InclusiveSum(m, end);
  __syncthreads();
  int tok1[kItems], cols[kItems], blks[kItems], col_end[kItems], blk_end[kItems];
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const long long start = end[i] - m[i];
    const long long tok0 = start < T ? start : T;
    tok1[i] = static_cast<int>(end[i] < T ? end[i] : T);
    const int count = static_cast<int>(tok1[i] - tok0);
    cols[i] = (count + kColAlign - 1) / kColAlign * kColAlign;
    blks[i] = (count + kBlock - 1) / kBlock;
  }
  CountScan(storage.counts).InclusiveSum(cols, col_end);
  __syncthreads();
  CountScan(storage.counts).InclusiveSum(blks, blk_end);
  int32_t* tok = plan;
  int32_t* col = plan + (E + 1);
  int32_t* blk = plan + 2 * (E + 1);
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int e = threadIdx.x * kItems + i;
    if (e < E) tok[e + 1] = tok1[i], col[e + 1] = col_end[i], blk[e + 1] = blk_end[i];
  }
  if (threadIdx.x == 0) tok[0] = col[0] = blk[0] = 0;
}

// The plan of m_splits (int32 or int64 counts) built by a block of kThreads threads.
template <int kThreads>
__device__ __forceinline__ void build_plan(const void* m_splits, bool m_is_int64, int E, int64_t T, int32_t* plan) {
  constexpr int kItems = kMaxExperts / kThreads;
  static_assert(kItems * kThreads == kMaxExperts, "the block's threads hold kMaxExperts counts");
  long long m[kItems];
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int e = threadIdx.x * kItems + i;
    long long v = 0;
    if (e < E) v = m_is_int64 ? static_cast<const int64_t*>(m_splits)[e] : static_cast<const int32_t*>(m_splits)[e];
    m[i] = v < 0 ? 0 : (v > T ? T : v);
  }
  plan_from_counts<kThreads>(m, E, T, plan);
}

template <int kThreads>
__device__ __forceinline__ void build_plan(const PlanBuild& p) {
  build_plan<kThreads>(p.m_splits, p.m_is_int64, p.E, p.T, p.plan);
}

}  // namespace moegemm
