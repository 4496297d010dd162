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
  if (T < 0 || T > max_plan_tokens(E)) throw std::runtime_error(std::string("moegemm: ") + what + ": T out of range");
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

// a + b clamped to T: for counts in [0, T] an associative operation whose prefix sums are the running totals
// clamped to T (a + b <= 2T < 2^32 cannot wrap).
struct AddClamped {
  uint32_t T;
  __device__ __forceinline__ uint32_t operator()(uint32_t a, uint32_t b) const { return min(a + b, T); }
};

// The shared memory of scan_plan's two block scans (warp scans: a few hundred bytes, for the kernels that
// build the plan on the side).
template <int kThreads>
struct PlanScan {
  using Tokens = cub::BlockScan<uint32_t, kThreads, cub::BLOCK_SCAN_WARP_SCANS>;
  using Packed = cub::BlockScan<unsigned long long, kThreads, cub::BLOCK_SCAN_WARP_SCANS>;
  union Storage {
    typename Tokens::TempStorage tokens;
    typename Packed::TempStorage packed;
  };
};

// The plan of m_splits (int32 or int64 counts) scanned by a block of kThreads threads, thread t holding
// experts t * kItems .. t * kItems + kItems - 1: visit(entry) for each of its experts < E, and the totals to
// every thread. Each count is clamped to [0, T] before any sum (whatever the device values) and the running
// token total to T; columns and blocks come from the clamped counts (their sums stay within
// col_capacity(T, E), checked on the host to fit int32). Two block scans: the tokens, then the columns and
// blocks together (packed in 64 bits), in `storage`. Every thread of the block calls it.
template <int kThreads, class Visit>
__device__ __forceinline__ PlanTotals scan_plan(const void* m_splits, bool m_is_int64, int E, int64_t T,
                                                typename PlanScan<kThreads>::Storage& storage, Visit&& visit) {
  constexpr int kItems = (kMaxExperts + kThreads - 1) / kThreads;
  using TokenScan = typename PlanScan<kThreads>::Tokens;
  using PackedScan = typename PlanScan<kThreads>::Packed;
  const int first = threadIdx.x * kItems;
  const AddClamped add{static_cast<uint32_t>(T)};
  uint32_t m[kItems], tok0[kItems], tokens;
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    long long v = 0;
    if (first + i < E) v = m_is_int64 ? static_cast<const int64_t*>(m_splits)[first + i] : static_cast<const int32_t*>(m_splits)[first + i];
    m[i] = static_cast<uint32_t>(v < 0 ? 0 : (v > T ? T : v));
  }
  TokenScan(storage.tokens).ExclusiveScan(m, tok0, 0u, add, tokens);
  __syncthreads();
  // per expert: its padded columns (low 32 bits) and 128-token blocks (high 32 bits) of its clamped count
  unsigned long long packed[kItems], packed_end[kItems], packed_total;
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const uint32_t count = add(tok0[i], m[i]) - tok0[i];
    packed[i] = (static_cast<unsigned long long>((count + kBlock - 1) / kBlock) << 32) | ((count + kColAlign - 1) / kColAlign * kColAlign);
  }
  PackedScan(storage.packed).InclusiveSum(packed, packed_end, packed_total);
  auto low = [](unsigned long long v) { return static_cast<int>(v & 0xffffffffu); };
  auto high = [](unsigned long long v) { return static_cast<int>(v >> 32); };
#pragma unroll
  for (int i = 0; i < kItems; ++i)
    if (first + i < E)
      visit(PlanEntry{first + i, static_cast<int>(tok0[i]), static_cast<int>(add(tok0[i], m[i])), low(packed_end[i] - packed[i]),
                      low(packed_end[i]), high(packed_end[i] - packed[i]), high(packed_end[i])});
  return {static_cast<int>(tokens), low(packed_total), high(packed_total)};
}

// The same with its storage in static shared memory.
template <int kThreads, class Visit>
__device__ __forceinline__ PlanTotals scan_plan(const void* m_splits, bool m_is_int64, int E, int64_t T, Visit&& visit) {
  __shared__ typename PlanScan<kThreads>::Storage storage;
  return scan_plan<kThreads>(m_splits, m_is_int64, E, T, storage, visit);
}

// Writes one expert's entries into plan [3, E+1] (its end column; the plan's first column is zeros).
__device__ __forceinline__ void write_plan_entry(const PlanEntry& x, int E, int32_t* plan) {
  plan[x.e + 1] = x.tok1, plan[(E + 1) + x.e + 1] = x.col1, plan[2 * (E + 1) + x.e + 1] = x.blk1;
  if (x.e == 0) plan[0] = plan[E + 1] = plan[2 * (E + 1)] = 0;
}

// The plan of m_splits built by a block of kThreads threads (make_plan's kernel, or one CTA of another), the
// scans' storage static or the caller's.
template <int kThreads>
__device__ __forceinline__ void build_plan(const PlanBuild& p, typename PlanScan<kThreads>::Storage& storage) {
  scan_plan<kThreads>(p.m_splits, p.m_is_int64, p.E, p.T, storage, [&](const PlanEntry& x) { write_plan_entry(x, p.E, p.plan); });
}
template <int kThreads>
__device__ __forceinline__ void build_plan(const PlanBuild& p) {
  __shared__ typename PlanScan<kThreads>::Storage storage;
  build_plan<kThreads>(p, storage);
}

}  // namespace moegemm
