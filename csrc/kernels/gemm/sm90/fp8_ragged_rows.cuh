// moegemm's own FP8 grouped GEMM with ragged rows for sm90a (fprop, and dgrad with the Wᵀ copy):
//   out[rows of e] (bf16 [T, N]) = Σ_j sa[t, j] · sb[e, n/128, j] · Σ_{k in block j} qa[t, k] · qb[e, n, k]
// qa [T, K] e4m3 with 1x128 scales sa [T, Kb] (K-major: csrc/moegemm.h, row_scale_pitch); qb [E, N, K] e4m3
// with 128x128 scales sb [E, Nb, Kb].
//
// The design (one CTA per SM, warp-specialized):
// - One TMA descriptor per operand over the whole tensor: A = qa [T, K], B = qb viewed as [E·N, K],
//   D = out [T, N], SA = sa as [Kb, T] (rows pitch apart). No per-expert descriptors, no tensormap writes, no
//   padding: an M tile starts at a row of its expert (scheduler.cuh) and TMA fills rows past T (and K past the
//   end) with zeros.
// - A producer warpgroup: one thread issues the TMA copies of A, B and A's row scales for each 128-wide K block
//   into a ring of kStages shared-memory stages (full/empty mbarriers), running ahead across tiles. The row scales'
//   box starts at the 16-byte aligned row at or below the tile's first row (kSaBox = 132 rows; a box starting at
//   any row stopped the kernel with an illegal instruction), and the math threads read them from that offset.
// - Clusters of two CTAs (kCluster = 2) take consecutive tiles; when both tiles need the same weight tile
//   (one expert, same columns) or the same activation rows, each CTA loads half of it and multicasts that
//   half into both CTAs' shared memory, halving that operand's L2 traffic. A stage is then refilled only
//   when the consumers of both CTAs have released it (every math thread arrives on its own CTA's empty
//   barrier, lane 0 of each math warp also on the peer's).
// - Two math warpgroups of 64 rows each. Per K block: a wgmma chain per part of the tile (128 or 192
//   columns) into a temporary accumulator, wait, release the stage at once and test (without blocking)
//   whether the next stage is full (pipeline.cuh), then promote into the output accumulator with the
//   block's scale products (sa of the row x sb of each 8-column chunk's weight block; a 192-wide part
//   straddles two, at a column fixed per tile) — the promotion of one
//   warpgroup runs while the other's wgmma occupies the tensor cores. A warpgroup whose 64 rows all lie
//   past its expert's end (the last tile of an expert) skips its MMAs. The K loop takes what is fixed per tile
//   (the 192-wide part's scale split, a 256-wide tile's parts inside N) as compile-time constants, chosen once per
//   tile, and when K fills whole rounds of the stage ring it is unrolled over a round, so that each stage's
//   barrier, scale and descriptor addresses are immediates (docs/performance.md, Ragged-row GEMM).
// - A scale warp of the producer warpgroup loads each stage's weight scales (sb of the tile's weight blocks)
//   into shared memory beside the operands and arrives on the stage's full barrier with the TMA bytes; the math
//   threads read both kinds of scales from shared memory, so no global load sits between a stage's wgmma and
//   its promotion. Its loads run stages ahead of its stores, so that its pace is not one load's latency a stage.
// - Epilogue per warpgroup and part: the expert's bias added when given (fp32 or bf16, read from global
//   memory, before the rounding), bf16 into 128B-swizzled shared memory, then one TMA store
//   per 64 columns when the warpgroup's 64 rows all belong to the expert, else 16-byte stores of the
//   expert's rows only (the rows past them belong to the next expert). The wait for a TMA store's reads
//   comes only when the buffer is written next (the next part's or tile's epilogue), so the store runs on
//   while the main loop does; one part's buffer (not the whole tile's) leaves shared memory for another
//   pipeline stage. In tiles of one part (128, 192 columns) a tile's whole epilogue is deferred until the next
//   tile's first wgmma chain is issued (or, for a warpgroup with no rows in that tile, before it drains its
//   stages; after the last tile, at the end), so that the tensor cores work while it runs (docs/performance.md,
//   Ragged-row GEMM); the A/B form kDeferLastPart defers only part 1 of single-CTA 256-column tiles the same way.
//   Nothing may touch the accumulator of that chain meanwhile: ptxas would
//   make the chain wait (C7517), which the compile check (moegemm/_build.py) refuses.
// - Single CTAs walk the tiles dynamically: the TMA warp draws each next id from a tile counter (the launch's
//   workspace, zero at launch and left zero by the launch's last draw) a tile ahead and hands it to the scale warp
//   through a ring of shared-memory slots (pipeline.cuh, TileIdRing); the math warpgroups read each tile from its
//   stages as before, and the walk's end from a last stage with no copies. A CTA that starts late (its SM held by
//   a kernel on another stream) takes fewer tiles instead of holding up the whole GEMM. Clusters of two walk the
//   ids statically (below).
// - The producer's TMA warp and scale warp each walk the tile list in the plan (global memory): each looks the
//   next tile's expert up with warp votes from the current one's (RaggedRowTiles::at_after: usually one vote's
//   load, not a binary search's log2(E) dependent loads), right after the current tile's first stage, so that
//   the lookup's latency falls while the ring is full instead of between two tiles' stages (where it made the
//   math warpgroups wait 6-10 % of the time on short tiles). The TMA warp hands each stage's tile to the math
//   warpgroups in the stage, so they start a tile without a global load. Per-tile values are broadcast from
//   lane 0, which keeps the K loop's stage, branches and wgmma descriptors in uniform registers.
// - A plan that does not fit T (plan_fits) is taken as the plan of no tokens; rows past the covered
//   tokens are zeroed.
// - Launched dependent (kernels/common/pdl.cuh): the barriers' set-up and the descriptors' prefetch (kernel
//   parameters) overlap the kernel before it; every thread waits for that kernel before the plan check.
// - The one-launch form (kQuantizeA; csrc/moegemm.h gemm_fp8_ragged_rows_quantize_a): before all of the above, the
//   CTAs claim the prologue's work items off a counter (kernels/common/grid_claims.cuh): the plan built from
//   m_splits (unless an earlier launch built it: no counts given), then chunks of a bf16 x's rows quantized into
//   A's memory (csrc/kernels/quant/rows.cuh); each CTA then waits until every item is done (each item's writes
//   behind a proxy fence: the TMA copies of A and its row scales read what the generic proxy wrote). A plain launch
//   whose CTAs need not be resident at once: a CTA that starts late finds the items taken and joins the tile walk.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>
#include <utility>

#include "cute/arch/cluster_sm90.hpp"
#include "cute/arch/copy_sm90_desc.hpp"
#include "cute/arch/copy_sm90_tma.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/arch/reg_reconfig.h"

#include "moegemm.h"
#include "kernels/common/device.h"
#include "kernels/common/pdl.cuh"
#include "kernels/gemm/sm90/cta.h"
#include "kernels/gemm/sm90/pipeline.cuh"
#include "kernels/gemm/sm90/scheduler.cuh"
#include "kernels/gemm/sm90/wgmma.cuh"
#include "kernels/plan/build.cuh"
#include "kernels/common/grid_claims.cuh"
#include "kernels/quant/rows.cuh"

namespace moegemm::sm90 {

// One kernel configuration: BLOCK_M = 128 rows (the plan's row blocks), BLOCK_K = 128 (one scale block
// per stage), BLOCK_N = 128, 192 or 256 columns, as kParts parts of kPartN columns, each one wgmma chain
// (64 x kPartN x 32) into its own accumulator: 128 and 192 in one part, 256 in two parts of 128 (a 64 x 256
// accumulator and its promoted copy would not fit in the registers). A 192-wide tile starts at a column
// n0 with n0 % 128 in {0, 64}, so its part straddles two weight-scale blocks at column 128 or 64.
// kStages: as many as fit beside the epilogue buffer.
template <int kBlockN_, int kCluster_, bool kQuantizeA_ = false, bool kDeferLastPart_ = false>
struct Fp8RaggedRowsConfig : WarpSpecializedCta {
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kCluster = kCluster_;  // 1, or 2 with TMA multicast of the shared operand
  // The fused prologue: the plan and A (x's FP8 row copy) made by the kernel's own CTAs first, as work items
  // claimed off a counter, every CTA waiting for all of them before the GEMM
  static constexpr bool kQuantizeA = kQuantizeA_;
  // Tile ids drawn from the launch's tile counter (single CTAs whose grid need not be resident at once), else
  // walked statically
  static constexpr bool kDynamicWalk = kCluster == 1;
  static constexpr int kIdSlots = 4;
  static constexpr int kIdReaders = 32;  // the scale warp's lanes (the math warpgroups see the walk's end in a stage)
  static constexpr int kIdRingBytes = kDynamicWalk ? TileIdRing<kIdSlots>::kBytes : 0;
  static_assert(kBlockN == 128 || kBlockN == 192 || kBlockN == 256, "BLOCK_N of 128, 192 or 256 columns");
  static_assert(kCluster == 1 || kCluster == 2, "clusters of one or two CTAs");
  static_assert(!kQuantizeA || kCluster == 1, "the fused prologue in a grid of single CTAs");
  static constexpr int kBlockK = kBlock;
  static constexpr int kPartN = kBlockN == 256 ? 128 : kBlockN;
  static constexpr int kParts = kBlockN / kPartN;
  // A tile's epilogue deferred until the next tile's first wgmma chain is issued, so that it runs while that chain
  // does: tiles of one part (with two, the 256-column tiling spills 144-160 bytes)
  static constexpr bool kDeferEpilogue = kParts == 1;
  // A/B (temporary, MOEGEMM_AB_DEFER_LAST_PART): tiles of two parts store part 0 at their end and defer part 1 to the
  // next tile's first chain, holding no more accumulators than the undeferred form
  static constexpr bool kDeferLastPart = kDeferLastPart_;
  static_assert(!kDeferLastPart || (kParts == 2 && kCluster == 1), "single-CTA 256-column tiles (2-CTA: spills)");
  // the tile's first chain issued before its K loop (while an epilogue runs)
  static constexpr bool kFirstChainEarly = kDeferEpilogue || kDeferLastPart;
  static constexpr int kAccum = kPartN / 2;  // fp32 accumulator registers per thread of a 64 x kPartN wgmma
  static constexpr int kStoreCols = 64;  // a TMA store box: 64 bf16 = 128 bytes, the swizzle span
  static constexpr int kScalesB = 2;     // weight-scale blocks per stage: a tile's columns touch at most two
  // A stage's row scales: a TMA box of kSaBox fp32 from the 16-byte aligned row at or below the tile's first row
  // (rows kRowScaleAlign apart: csrc/moegemm.h), in a slot of kSaStride values (TMA destinations 128-byte aligned)
  static constexpr int kSaBox = kBlockM + kRowScaleAlign;
  static constexpr int kSaStride = (kSaBox * 4 + 127) / 128 * 128 / 4;

  // shared memory, from a 1024-byte aligned base (the 128B swizzle's period; checked at kernel start)
  static constexpr int kBytesA = kBlockM * kBlockK;  // e4m3, per stage
  static constexpr int kBytesB = kBlockN * kBlockK;
  static constexpr int kBoxRowsA = kBlockM / kCluster, kBoxRowsB = kBlockN / kCluster;  // a TMA box: one CTA's share
  static constexpr int kBytesD = kBlockM * kPartN * 2;  // bf16 epilogue tile: one part at a time
  static constexpr int kBytesStage = kBytesA + kBytesB + kSaStride * 4 + kScalesB * 4 + 16 + 2 * 8;
  static constexpr int kStages = (kSharedBytes - kBytesD - kIdRingBytes) / kBytesStage;
  static constexpr int kOffsetA = kBytesD;
  static constexpr int kOffsetB = kOffsetA + kStages * kBytesA;
  static constexpr int kOffsetScalesA = kOffsetB + kStages * kBytesB;                   // fp32 [kStages][kSaStride]
  static constexpr int kOffsetTiles = kOffsetScalesA + kStages * kSaStride * 4;         // RowTile [kStages]
  static constexpr int kOffsetScalesB = kOffsetTiles + kStages * 16;                     // fp32 [kStages][kScalesB]
  static constexpr int kOffsetBarriers = kOffsetScalesB + kStages * kScalesB * 4;
  static constexpr int kOffsetIdRing = kOffsetBarriers + 2 * kStages * 8;  // TileIdRing: barriers, then ids
  static constexpr int kSmemBytes = kOffsetIdRing + kIdRingBytes;
  static_assert(kStages >= 3, "a pipeline of at least three stages");
  // (the 256-column tiling has 88 bytes per stage to spare before it drops to three stages)
  static_assert(kBlockN != 256 || kStages >= 4, "the 256-column tiling's four stages");
  // TMA: shared-memory destinations 128-byte aligned, a box's row a multiple of 16 bytes and at most 256 values
  static_assert(kOffsetScalesA % 128 == 0 && kSaStride * 4 % 128 == 0, "row-scale slots for TMA");
  static_assert(kSaBox * 4 % 16 == 0 && kSaBox <= 256 && kSaBox <= kSaStride, "the row-scale box");
  static_assert((kRowScaleAlign & (kRowScaleAlign - 1)) == 0, "a box start masked from a tile's first row");
  // a stage's release: every math thread of this CTA, and one lane per math warp of the peer CTA
  static constexpr int kEmptyArrivals = kMathWarpgroups * 128 + (kCluster - 1) * kMathWarpgroups * 4;
  static_assert(sizeof(RowTile) == 16 && kOffsetTiles % 16 == 0, "a stage's tile as one 16-byte shared-memory word");
  static_assert(kSmemBytes <= kSharedBytes, "shared memory per block on sm90");
};

struct Fp8RaggedRowsParams {
  CUtensorMap a;  // qa [T, K], box kBoxRowsA x 128, 128B swizzle
  CUtensorMap b;  // qb as [E*N, K], box kBoxRowsB x 128
  CUtensorMap d;  // out [T, N] bf16, box 64 x 64
  CUtensorMap sa;  // sa as [Kb, T] fp32, rows row_scale_pitch(T) apart, box 1 x kSaBox
  const float* sb;
  const int32_t* plan;
  int* tile_counter;  // Cfg::kDynamicWalk without kQuantizeA: the walk's counter, zero at launch and left zero
  __nv_bfloat16* out;
  const void* bias;  // [E, N] fp32 (bias_f32) or bf16, added before the rounding to bf16; null: none
  bool bias_f32;
  int E, T, N, K;
  // Cfg::kQuantizeA: the plan built from plan_build's counts into `plan` (none given: built by an earlier launch),
  // and x [T, K] bf16 quantized into the memory of `a` and `sa` (qa, sa_out), before the GEMM
  PlanBuild plan_build;
  const __nv_bfloat16* x;
  uint8_t* qa;
  float* sa_out;
  ZeroFill zero;  // zeroed by the prologue's first work item
  GridClaims claims;  // the prologue's work items and the walk's counter
};

namespace detail {

// out += scale · acc over a part's accumulator: a thread's values i of 8-column chunk i / 4, row + 8 when
// i & 2; chunks below kLoChunks take the first weight-scale block's product (lo0 / lo1 for the two rows),
// the others the second's. kFirst: out = scale · acc + 0, the tile's first K block on an out not zeroed before (the
// same bits as on a zeroed out).
template <int kAccum, int kLoChunks, bool kFirst = false>
__device__ __forceinline__ void promote(float* out, const float* acc, float lo0, float lo1, float hi0, float hi1) {
#pragma unroll
  for (int i = 0; i < kAccum; ++i) {
    const float s = i / 4 < kLoChunks ? ((i & 2) ? lo1 : lo0) : ((i & 2) ? hi1 : hi0);
    out[i] = fmaf(s, acc[i], kFirst ? 0.f : out[i]);
  }
}

// out[i] += bias[e][col] over a part's accumulator (this thread's columns c + 8 j, c + 8 j + 1 of chunk j for
// both its rows), from the expert's row of the bias (`row` its offset); columns at or past N are left alone. The
// loads of kBatch chunks first, then their additions: few registers, which the epilogue has to spare while the
// next tile's first wgmma chain holds the accumulator.
template <int kPartN>
__device__ __forceinline__ void add_bias(float* out, const void* bias, bool f32, int64_t row, int c, int N) {
  constexpr int kBatch = 4;
  static_assert(kPartN / 8 % kBatch == 0, "whole batches of chunks");
#pragma unroll
  for (int j0 = 0; j0 < kPartN / 8; j0 += kBatch) {
    float2 b[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int col = c + 8 * (j0 + j);
      if (col >= N)
        b[j] = make_float2(0.f, 0.f);
      else if (f32)
        b[j] = *reinterpret_cast<const float2*>(static_cast<const float*>(bias) + row + col);
      else
        b[j] = __bfloat1622float2(
            *reinterpret_cast<const __nv_bfloat162*>(static_cast<const __nv_bfloat16*>(bias) + row + col));
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      float* o = out + 4 * (j0 + j);
      o[0] += b[j].x, o[1] += b[j].y;
      o[2] += b[j].x, o[3] += b[j].y;
    }
  }
}

}  // namespace detail

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1) fp8_ragged_rows_kernel(const __grid_constant__ Fp8RaggedRowsParams p) {
#if defined(__CUDA_ARCH__) && defined(CUTE_ARCH_MMA_SM90A_ENABLED)
  using Barrier = cutlass::arch::ClusterBarrier;
  using TxBarrier = cutlass::arch::ClusterTransactionBarrier;
  constexpr int kStages = Cfg::kStages, kCluster = Cfg::kCluster;

  extern __shared__ __align__(1024) uint8_t smem[];
  if (cute::cast_smem_ptr_to_uint(smem) % 1024 != 0) __trap();  // the swizzled layouts need it
  uint8_t* smem_d = smem;
  uint8_t* smem_a = smem + Cfg::kOffsetA;
  uint8_t* smem_b = smem + Cfg::kOffsetB;
  float* smem_sa = reinterpret_cast<float*>(smem + Cfg::kOffsetScalesA);
  float* smem_sb = reinterpret_cast<float*>(smem + Cfg::kOffsetScalesB);
  RowTile* smem_tile = reinterpret_cast<RowTile*>(smem + Cfg::kOffsetTiles);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + Cfg::kOffsetBarriers);
  uint64_t* empty = full + kStages;
  using IdRing = TileIdRing<Cfg::kIdSlots>;
  uint64_t* id_full = reinterpret_cast<uint64_t*>(smem + Cfg::kOffsetIdRing);
  uint64_t* id_empty = id_full + Cfg::kIdSlots;
  IdRing id_ring{reinterpret_cast<int*>(id_empty + Cfg::kIdSlots), id_full, id_empty};

  const int warpgroup = __shfl_sync(0xffffffff, threadIdx.x / 128, 0);  // uniform: descriptors in uniform registers

  if constexpr (Cfg::kQuantizeA) {
    // The fused prologue: item 0 zeroes `zero` and builds the plan (unless an earlier launch did: no counts given),
    // items 1.. quantize chunks of x's row groups into A (about four per CTA of the grid); each item's stores made
    // visible to the TMA's reads (async proxy) before it counts as done. Every CTA that runs claims items until none
    // is left (the next drawn while the current one is worked on), then waits until all are done: only for CTAs
    // that run. (the scans' storage in the epilogue buffer and the claimed item in the id ring's, both unused until
    // the GEMM: no static shared memory)
    constexpr int kWarps = Cfg::kThreads / 32;
    int* claimed = reinterpret_cast<int*>(smem + Cfg::kOffsetIdRing);
    const int64_t groups = rows::groups(p.T, p.K), spread = 4LL * kWarps * gridDim.x;
    const int64_t per_item = kWarps * ((groups + spread - 1) / spread);
    const int items = 1 + static_cast<int>((groups + per_item - 1) / per_item);
    if (threadIdx.x == 0) p.claims.open();
    auto draw = [&] { return threadIdx.x == 0 ? atomicAdd(p.claims.tickets(), 1) : 0; };
    auto broadcast = [&](int drawn) {  // thread 0's draw to the whole CTA
      if (threadIdx.x == 0) *claimed = drawn;
      __syncthreads();
      const int item = *claimed;
      __syncthreads();
      return item;
    };
    auto finish = [&] {
      asm volatile("fence.proxy.async.global;" ::: "memory");
      __syncthreads();
      if (threadIdx.x == 0) p.claims.finish_item();
    };
    int item = broadcast(draw());
    if (item == 0) {  // (outside the loop below: the plan's scan there would spill)
      for (int64_t i = threadIdx.x; i < p.zero.count; i += Cfg::kThreads) p.zero.words[i] = 0;
      if (p.plan_build.m_splits != nullptr)
        build_plan<Cfg::kThreads>(p.plan_build, *reinterpret_cast<typename PlanScan<Cfg::kThreads>::Storage*>(smem_d));
      finish();
      item = broadcast(draw());
    }
    while (item < items) {
      const int next = draw();
      const int64_t first = (item - 1) * per_item;
      rows::quantize_bf16(p.x, p.T, p.K, p.qa, p.sa_out, first + threadIdx.x / 32, kWarps, first + per_item);
      finish();
      item = broadcast(next);
    }
    if (threadIdx.x == 0) p.claims.wait_done(items);
    __syncthreads();
    asm volatile("fence.proxy.async.global;" ::: "memory");
  }
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      Barrier::init(&full[s], 1 + Cfg::kScalesB);                         // the TMA thread (+ bytes), each weight-scale lane
      Barrier::init(&empty[s], Cfg::kEmptyArrivals);
    }
    if constexpr (Cfg::kDynamicWalk) IdRing::init(id_full, id_empty, Cfg::kIdReaders);
    cutlass::arch::fence_barrier_init();
  }
  if (threadIdx.x == Cfg::kMathWarpgroups * 128) {  // (the descriptors are kernel parameters: no earlier kernel writes them)
    cute::prefetch_tma_descriptor(reinterpret_cast<const cute::TmaDescriptor*>(&p.a));
    cute::prefetch_tma_descriptor(reinterpret_cast<const cute::TmaDescriptor*>(&p.b));
    cute::prefetch_tma_descriptor(reinterpret_cast<const cute::TmaDescriptor*>(&p.d));
    cute::prefetch_tma_descriptor(reinterpret_cast<const cute::TmaDescriptor*>(&p.sa));
  }
  if constexpr (!Cfg::kQuantizeA) {  // launched dependent (kernels/common/pdl.cuh): no memory touched before
    grid_wait();
    grid_release();
  }
  // A plan that does not fit T tokens counts as the plan of no tokens.
  const bool fits = plan_fits(p.plan, p.E, token_limit(p.T));
  if constexpr (kCluster > 1) cute::cluster_sync();  // the peer's barriers exist before any remote arrive
  else __syncthreads();

  // The problem and the tile walk, set up by each role after its register reconfiguration: values
  // computed before it would have to live through the producer's few registers (and spill).
  int E, T, N, K, Kb, Nb, rank, cluster, clusters, num_tiles, num_groups;
  RaggedRowTiles tiles;
  auto set_up = [&] {
    E = p.E, T = p.T, N = p.N, K = p.K;
    Kb = (K + kBlock - 1) / kBlock, Nb = (N + kBlock - 1) / kBlock;
    rank = kCluster > 1 ? static_cast<int>(cute::block_rank_in_cluster()) : 0;
    cluster = blockIdx.x / kCluster, clusters = gridDim.x / kCluster;
    tiles = {p.plan, p.plan + 2 * (E + 1), E, (N + Cfg::kBlockN - 1) / Cfg::kBlockN};
    num_tiles = __shfl_sync(0xffffffff, fits ? tiles.count() : 0, 0);  // warp-uniform to the compiler: see the math loop
    num_groups = (num_tiles + kCluster - 1) / kCluster;
  };
  // this CTA's tile of id group g (the last group's missing ids repeat its first tile)
  auto tile_id = [&](int g, int r) { return min(g * kCluster + r, num_tiles - 1); };

  if (warpgroup == Cfg::kMathWarpgroups) {
    // ---- producer: one thread issues every TMA copy, one warp loads the weight scales
    cutlass::arch::warpgroup_reg_dealloc<Cfg::kProducerRegisters>();
    set_up();
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    if (warp == 0) {  // the TMA warp: its lane 0 issues, the whole warp finds the tiles
      constexpr uint64_t kHint = static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL);
      constexpr uint16_t kBoth = (1 << kCluster) - 1;
      int stage = 0;
      uint32_t phase = 0;
      // the tile walk of group g (dependent global loads), a group ahead: looked up once the current tile's
      // first stage is issued, so that its latency falls where the ring is full, not between two tiles' stages
      int from = -1, from_peer = -1;
      auto walk = [&](int g, RowTile& t, Shared& shared) {
        if (g >= num_groups) return;
        t = tiles.at_after(tile_id(g, rank), from);
        shared = Shared::kNone;
        if constexpr (kCluster > 1) shared = shared_operand(t, tiles.at_after(tile_id(g, rank ^ 1), from_peer));
      };
      if constexpr (Cfg::kDynamicWalk) {
        // Each id is drawn a tile ahead of its use (the counter's latency hidden behind a tile) and handed to the
        // scale warp as the tile before it starts; the walk ends with the first id past the last tile.
        // Every CTA draws once past the last tile, so the launch's last draw is id num_tiles + gridDim.x - 1: it
        // leaves the counter zero again, for the next launch given the same workspace.
        auto draw = [&] {
          int id = 0;
          if (lane == 0) {
            int* counter = Cfg::kQuantizeA ? p.claims.tiles() : p.tile_counter;
            id = atomicAdd(counter, 1);
            if (!Cfg::kQuantizeA && id == num_tiles + static_cast<int>(gridDim.x) - 1) *counter = 0;
          }
          return __shfl_sync(0xffffffff, id, 0);
        };
        auto hand_over = [&](int id) {
          if (lane == 0) id_ring.put(id);
          __syncwarp();
        };
        int id = draw(), pending = num_tiles;
        hand_over(id);
        RowTile next{};
        if (id < num_tiles) next = tiles.at_after(id, from), pending = draw();
        while (id < num_tiles) {
          const int nxt = pending;
          hand_over(nxt);
          const RowTile t = next;
          const int b_row = t.expert * N + t.n_block * Cfg::kBlockN;
          for (int kb = 0; kb < Kb; ++kb) {
            Barrier::wait(&empty[stage], phase ^ 1);
            if (lane == 0) {
              smem_tile[stage] = t;  // the math warpgroups read the tile here, not in global memory
              TxBarrier::arrive_and_expect_tx(&full[stage], Cfg::kBytesA + Cfg::kBytesB + Cfg::kSaBox * 4);
              const int k0 = kb * kBlock;
              cute::SM90_TMA_LOAD_2D::copy(&p.a, &full[stage], kHint, smem_a + stage * Cfg::kBytesA, k0, t.row0);
              cute::SM90_TMA_LOAD_2D::copy(&p.b, &full[stage], kHint, smem_b + stage * Cfg::kBytesB, k0, b_row);
              cute::SM90_TMA_LOAD_2D::copy(&p.sa, &full[stage], kHint, smem_sa + stage * Cfg::kSaStride,
                                           t.row0 & ~(kRowScaleAlign - 1), kb);
            }
            __syncwarp();
            if (kb == 0 && nxt < num_tiles) next = tiles.at_after(nxt, from), pending = draw();
            if (++stage == kStages) stage = 0, phase ^= 1;
          }
          id = nxt;
        }
        // the walk's end for the math warpgroups: a stage with no copies whose tile has no expert
        Barrier::wait(&empty[stage], phase ^ 1);
        if (lane == 0) {
          smem_tile[stage] = RowTile{-1, 0, 0, 0};
          Barrier::arrive(&full[stage]);
          if constexpr (Cfg::kQuantizeA) p.claims.close();  // this CTA's last use of the claims' counters
        }
      } else {
        RowTile next{};
        Shared next_shared = Shared::kNone;
        walk(cluster, next, next_shared);
        for (int g = cluster; g < num_groups; g += clusters) {
          const RowTile t = next;
          const Shared shared = next_shared;
          const int b_row = t.expert * N + t.n_block * Cfg::kBlockN;
          for (int kb = 0; kb < Kb; ++kb) {
            Barrier::wait(&empty[stage], phase ^ 1);
            if (lane == 0) {
              smem_tile[stage] = t;  // the math warpgroups read the tile here, not in global memory
              TxBarrier::arrive_and_expect_tx(&full[stage], Cfg::kBytesA + Cfg::kBytesB + Cfg::kSaBox * 4);
              uint8_t* a = smem_a + stage * Cfg::kBytesA;
              uint8_t* b = smem_b + stage * Cfg::kBytesB;
              const int k0 = kb * kBlock;
              if (shared == Shared::kA) {
                cute::SM90_TMA_LOAD_MULTICAST_2D::copy(&p.a, &full[stage], kBoth, kHint, a + rank * Cfg::kBoxRowsA * kBlock, k0,
                                                       t.row0 + rank * Cfg::kBoxRowsA);
              } else {
#pragma unroll
                for (int h = 0; h < kCluster; ++h)
                  cute::SM90_TMA_LOAD_2D::copy(&p.a, &full[stage], kHint, a + h * Cfg::kBoxRowsA * kBlock, k0,
                                               t.row0 + h * Cfg::kBoxRowsA);
              }
              if (shared == Shared::kB) {
                cute::SM90_TMA_LOAD_MULTICAST_2D::copy(&p.b, &full[stage], kBoth, kHint, b + rank * Cfg::kBoxRowsB * kBlock, k0,
                                                       b_row + rank * Cfg::kBoxRowsB);
              } else {
#pragma unroll
                for (int h = 0; h < kCluster; ++h)
                  cute::SM90_TMA_LOAD_2D::copy(&p.b, &full[stage], kHint, b + h * Cfg::kBoxRowsB * kBlock, k0,
                                               b_row + h * Cfg::kBoxRowsB);
              }
              cute::SM90_TMA_LOAD_2D::copy(&p.sa, &full[stage], kHint, smem_sa + stage * Cfg::kSaStride,
                                           t.row0 & ~(kRowScaleAlign - 1), kb);
            }
            __syncwarp();
            if (kb == 0) walk(g + clusters, next, next_shared);
            if (++stage == kStages) stage = 0, phase ^= 1;
          }
        }
      }
    } else if (warp == 1) {
      // The scale warp: each stage's weight scales (the row scales come with the TMA copies). Its loads run
      // kRing - 1 stages ahead of its stores (a ring of registers, the loop unrolled over it so that no value is
      // copied between slots: a copy would wait for its loads); loaded just before each stage's wait, its pace
      // would be one global load's latency per stage, slower than a K block of the narrower tilings.
      constexpr int kRing = 4;
      if constexpr (Cfg::kDynamicWalk) {
        // The loads' cursor: tile `lt` (no expert: past the walk's end), K block lkb; the tile after it (`lnext`),
        // taken from the id ring and looked up once the cursor's first stage is loaded, a tile ahead of its use.
        // `loaded` counts the stages loaded so far: all of the walk's, once it has ended.
        int from = -1, lkb = 0, loaded = 0;
        RowTile lt, lnext;
        auto take_tile = [&](RowTile& t) {
          const int id = id_ring.take();
          if (id < num_tiles) t = tiles.at_after(id, from);
          else t.expert = -1;
        };
        take_tile(lt);
        auto load_next = [&](float& b) {
          if (lt.expert < 0) return;  // past this CTA's last stage: never stored
          const int n0 = lt.n_block * Cfg::kBlockN;
          const int scale_blocks = (min(N, n0 + Cfg::kBlockN) - 1) / kBlock - n0 / kBlock + 1;
          b = lane < scale_blocks ? __ldg(p.sb + ((lt.expert * Nb + n0 / kBlock + lane) * Kb + lkb)) : 0.f;
          if (lkb == 0) take_tile(lnext);
          ++loaded;
          if (++lkb == Kb) lkb = 0, lt = lnext;
        };
        float ring[kRing];
#pragma unroll
        for (int i = 0; i < kRing - 1; ++i) load_next(ring[i]);
        int stage = 0;
        uint32_t phase = 0;
        for (int j = 0; j < loaded; j += kRing) {
#pragma unroll
          for (int r = 0; r < kRing; ++r) {
            load_next(ring[(r + kRing - 1) % kRing]);
            if (j + r >= loaded) break;  // the walk ended before this stage
            Barrier::wait(&empty[stage], phase ^ 1);
            if (lane < Cfg::kScalesB) {
              smem_sb[stage * Cfg::kScalesB + lane] = ring[r];
              Barrier::arrive(&full[stage]);  // each storing lane releases its own store
            }
            if (++stage == kStages) stage = 0, phase ^= 1;
          }
        }
        // the scale lanes' arrivals on the walk's end stage (see the TMA warp)
        Barrier::wait(&empty[stage], phase ^ 1);
        if (lane < Cfg::kScalesB) Barrier::arrive(&full[stage]);
      } else {
        // The loads' cursor: tile `lt` of group lg, K block lkb. The tile after it (`lnext`) is looked up once the
        // cursor's first stage is loaded, a tile ahead of its use.
        int from = -1, lg = cluster, lkb = 0;
        RowTile lt{}, lnext{};
        if (lg < num_groups) lt = tiles.at_after(tile_id(lg, rank), from);
        // lane < scale_blocks: the weight-scale block n0 / 128 + lane of the cursor's tile, at its K block (0 for the others)
        auto load_next = [&](float& b) {
          if (lg >= num_groups) return;  // past this CTA's last stage: never stored
          // the weight-scale blocks the tile's columns inside N touch, from n0's
          const int n0 = lt.n_block * Cfg::kBlockN;
          const int scale_blocks = (min(N, n0 + Cfg::kBlockN) - 1) / kBlock - n0 / kBlock + 1;
          // (32-bit: the launcher refuses weight scales of 2^31 values or more)
          b = lane < scale_blocks ? __ldg(p.sb + ((lt.expert * Nb + n0 / kBlock + lane) * Kb + lkb)) : 0.f;
          if (lkb == 0 && lg + clusters < num_groups) lnext = tiles.at_after(tile_id(lg + clusters, rank), from);
          if (++lkb == Kb) lkb = 0, lg += clusters, lt = lnext;
        };
        float ring[kRing];
#pragma unroll
        for (int i = 0; i < kRing - 1; ++i) load_next(ring[i]);
        const int64_t stages = cluster < num_groups ? int64_t((num_groups - 1 - cluster) / clusters + 1) * Kb : 0;
        int stage = 0;
        uint32_t phase = 0;
        for (int64_t j = 0; j < stages; j += kRing) {
#pragma unroll
          for (int r = 0; r < kRing; ++r) {
            if (j + r >= stages) break;
            load_next(ring[(r + kRing - 1) % kRing]);
            Barrier::wait(&empty[stage], phase ^ 1);
            if (lane < Cfg::kScalesB) {
              smem_sb[stage * Cfg::kScalesB + lane] = ring[r];
              Barrier::arrive(&full[stage]);  // each storing lane releases its own store
            }
            if (++stage == kStages) stage = 0, phase ^= 1;
          }
        }
      }
    }
  } else {
    // ---- math warpgroups
    cutlass::arch::warpgroup_reg_alloc<Cfg::kMathRegisters>();
    set_up();
    const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;

    // Rows past the covered tokens (device counts summing below T, or a foreign plan) get zeros.
    zero_rows(p.out, fits ? p.plan[E] : 0, T, int64_t(N) * 2, int64_t(blockIdx.x) * Cfg::kMathWarpgroups * 128 + threadIdx.x,
              int64_t(gridDim.x) * Cfg::kMathWarpgroups * 128);

    // A lane's last read of a stage is done: it releases the stage. Each lane arrives on its own CTA's
    // barrier for its own reads (of the scales, which the producer overwrites next: one arrival per reader,
    // the ordering stated to compute-sanitizer's racecheck too); with multicast the peer's producer writes
    // into this CTA's stage as well, so one lane of the warp also arrives on the peer's barrier, once the
    // whole warp has arrived here (so that no lane's arrival can fall into the peer's next phase).
    auto release = [&](int s) {
      Barrier::arrive(&empty[s]);
      if constexpr (kCluster > 1) {
        __syncwarp();
        if (lane == 0) Barrier::arrive(&empty[s], rank ^ 1, 1);
      }
    };

    float acc[Cfg::kAccum];
    float out[Cfg::kParts][Cfg::kAccum];
    int stage = 0;
    uint32_t phase = 0;
    uint8_t* smem_d_wg = smem_d + warpgroup * (Cfg::kWarpgroupRows * Cfg::kPartN * 2);
    // The wgmma descriptors change only in their low 32 bits (the start address) across stages and K
    // steps: 32-bit arithmetic on warp-uniform values, which the compiler keeps in uniform registers.
    const uint64_t a_desc0 = sw128_descriptor(smem_a + warpgroup * Cfg::kWarpgroupRows * kBlock);
    const uint64_t b_desc0 = sw128_descriptor(smem_b);
    const uint32_t a_lo0 = __shfl_sync(0xffffffff, static_cast<uint32_t>(a_desc0), 0);
    const uint32_t b_lo0 = __shfl_sync(0xffffffff, static_cast<uint32_t>(b_desc0), 0);
    const uint64_t a_hi = a_desc0 & 0xffffffff00000000ull, b_hi = b_desc0 & 0xffffffff00000000ull;
    // this thread's two accumulator rows (r, r + 8) in the stage's A scales
    // (its offset made opaque, so that the compiler keeps it in a register instead of recomputing it
    // from %tid at every K block)
    int sa_row = warpgroup * Cfg::kWarpgroupRows + warp * 16 + lane / 4;
    asm volatile("" : "+r"(sa_row));
    const float* smem_sa_row = smem_sa + sa_row;
    const bool whole_rounds = Kb % kStages == 0;  // K blocks filling whole rounds of the ring: every tile starts on stage 0

    // Part h's wgmma chain on stage s (64 x kPartN x 128) into acc, issued and committed, not waited for.
    auto issue_chain = [&](const int s, const int h) {
      const uint32_t a_lo = a_lo0 + s * (Cfg::kBytesA / 16), b_lo = b_lo0 + s * (Cfg::kBytesB / 16);
#pragma unroll
      for (int i = 0; i < Cfg::kAccum; ++i) cute::warpgroup_fence_operand(acc[i]);
      cute::warpgroup_arrive();
#pragma unroll
      for (int k = 0; k < kBlock / 32; ++k)
        wgmma<Cfg::kPartN>(a_hi | (a_lo + 2 * k), b_hi | (b_lo + (h * Cfg::kPartN * kBlock) / 16 + 2 * k), acc, k > 0,
                           std::make_integer_sequence<int, Cfg::kAccum>{});
      cute::warpgroup_commit_batch();
    };

    // A finished tile's epilogue: this warpgroup's 64 x BLOCK_N of out, one part at a time (`stored` rows of the
    // warpgroup stored: 0 for none; `parts` 0 for no tile at all).
    struct Finished {
      int stored, row0, n0, parts, expert;
    };
    Finished finished{0, 0, 0, 0, 0};
    using First = std::integral_constant<int, 0>;
    using All = std::integral_constant<int, Cfg::kParts>;
    // parts [kFirst, kEnd) of the tile, those inside N
    auto epilogue_parts = [&](const Finished& f, auto first_c, auto end_c) {
      constexpr int kFirst = decltype(first_c)::value, kEnd = decltype(end_c)::value;
      const int wg_row0 = f.row0 + warpgroup * Cfg::kWarpgroupRows;
#pragma unroll
      for (int h = kFirst; h < kEnd; ++h) {
        if (h >= f.parts) break;
        const int col0 = f.n0 + h * Cfg::kPartN;
        if (tid == 0) cute::tma_store_wait<0>();  // the previous part's stores have read shared memory
        cutlass::arch::NamedBarrier::sync(128, warpgroup);
        if (f.stored > 0) {
          const int r = warp * 16 + lane / 4;
          if (p.bias != nullptr)
            detail::add_bias<Cfg::kPartN>(out[h], p.bias, p.bias_f32, int64_t(f.expert) * N, col0 + (lane % 4) * 2, N);
#pragma unroll
          for (int j = 0; j < Cfg::kPartN / 8; ++j)
#pragma unroll
            for (int v = 0; v < 2; ++v)
              *reinterpret_cast<uint32_t*>(smem_d_wg + epilogue_offset(r + 8 * v, j * 8 + (lane % 4) * 2)) =
                  pack_bf16x2(out[h][j * 4 + v * 2], out[h][j * 4 + v * 2 + 1]);
          cutlass::arch::fence_view_async_shared();
        }
        cutlass::arch::NamedBarrier::sync(128, warpgroup);
        if (f.stored == Cfg::kWarpgroupRows) {
          if (tid == 0) {
#pragma unroll
            for (int c = 0; c < Cfg::kPartN / Cfg::kStoreCols; ++c)
              if (col0 + c * Cfg::kStoreCols < N)
                cute::SM90_TMA_STORE_2D::copy(&p.d, smem_d_wg + c * (64 * 128), col0 + c * Cfg::kStoreCols, wg_row0);
            cute::tma_store_arrive();
          }
        } else if (f.stored > 0) {
          constexpr int kUnits = Cfg::kPartN / 8;  // 16-byte units per row
          for (int u = tid; u < f.stored * kUnits; u += 128) {
            const int r = u / kUnits, col = (u % kUnits) * 8;
            if (col0 + col < N)
              *reinterpret_cast<uint4*>(p.out + int64_t(wg_row0 + r) * N + col0 + col) =
                  *reinterpret_cast<const uint4*>(smem_d_wg + epilogue_offset(r, col));
          }
        }
      }
    };
    auto epilogue = [&](const Finished& f) { epilogue_parts(f, First{}, All{}); };
    using Last = std::integral_constant<int, 1>;  // a kDeferLastPart tile's deferred part: [Last, All)

    // a dynamic walk: whether the next stage holds a tile (the walk's end: a stage whose tile has no expert)
    auto walk_goes_on = [&] {
      Barrier::wait(&full[stage], phase);
      return __shfl_sync(0xffffffff, smem_tile[stage].expert, 0) >= 0;
    };
    bool more = Cfg::kDynamicWalk ? walk_goes_on() : true;
    for (int g = cluster; Cfg::kDynamicWalk ? more : g < num_groups; g += clusters) {
      // The tile, from its first stage (K has at least one block), where the TMA warp wrote it: no
      // global loads at a tile's start. Broadcast from lane 0, so that the compiler knows it warp-uniform
      // and keeps the K loop's branches, stage and descriptors in uniform registers.
      int rows, parts, lo_chunks, row0, n0, expert;
      {
        Barrier::wait(&full[stage], phase);
        const RowTile t = smem_tile[stage];
        row0 = __shfl_sync(0xffffffff, t.row0, 0);
        expert = t.expert;
        n0 = __shfl_sync(0xffffffff, t.n_block, 0) * Cfg::kBlockN;
        const int tile_rows = __shfl_sync(0xffffffff, t.rows, 0);
        rows = min(Cfg::kWarpgroupRows, max(0, tile_rows - warpgroup * Cfg::kWarpgroupRows));  // of this warpgroup
        parts = min(Cfg::kParts, (N - n0 + Cfg::kPartN - 1) / Cfg::kPartN);                     // inside N
        // a 192-wide part's first weight-scale block covers its first 128 - n0 % 128 columns (8-column chunks)
        lo_chunks = min(Cfg::kPartN, kBlock - n0 % kBlock) / 8;
      }
      const float* sa_tile = smem_sa_row + (row0 & (kRowScaleAlign - 1));  // the tile's rows in its row-scale box

      auto zero_out = [&] {
#pragma unroll
        for (int h = 0; h < Cfg::kParts; ++h)
#pragma unroll
          for (int i = 0; i < Cfg::kAccum; ++i) out[h][i] = 0.f;
      };
      if constexpr (!Cfg::kFirstChainEarly) zero_out();

      if (rows > 0) {
        // What is fixed per tile is a compile-time constant of the K loop (one instantiation per case, chosen once
        // per tile): the 192-column part's weight-scale split (kLo chunks on the first block: 16 or 8) and the
        // parts inside N of a 256-column tile (kNow: 2, or 1 in the last column tile).
        // One K block at stage s (phase ph): each part's chain, the stage released after the last part's wait
        // (and whether the next stage is full tested, without blocking), then each part's promotion.
        auto k_block = [&](const int s, const uint32_t ph, bool& full_next, auto lo_c, auto now_c, bool first_issued) {
          constexpr int kLo = decltype(lo_c)::value, kNow = decltype(now_c)::value;
          if (!full_next) Barrier::wait(&full[s], ph);
          // the scales, read before the stage can be released (the producer then overwrites them)
          const float a0 = sa_tile[s * Cfg::kSaStride], a1 = sa_tile[s * Cfg::kSaStride + 8];
          float b[Cfg::kScalesB];
#pragma unroll
          for (int j = 0; j < Cfg::kScalesB; ++j) b[j] = smem_sb[s * Cfg::kScalesB + j];
#pragma unroll
          for (int h = 0; h < kNow; ++h) {
            if (!(first_issued && h == 0)) issue_chain(s, h);  // (the tile's first chain may be in flight already)
            cute::warpgroup_wait<0>();
#pragma unroll
            for (int i = 0; i < Cfg::kAccum; ++i) cute::warpgroup_fence_operand(acc[i]);
            if (h == kNow - 1) {
              release(s);
              full_next = next_stage_full<kStages>(full, s, ph);
            }
            // part h's columns start in weight-scale block h; only a 192-wide part reaches into the next
            constexpr int kHi = Cfg::kPartN == 128 ? 0 : 1;
            if (Cfg::kDeferLastPart && first_issued)  // (out holds the previous tile's last part until its epilogue)
              detail::promote<Cfg::kAccum, kLo, true>(out[h], acc, a0 * b[h], a1 * b[h], a0 * b[h + kHi], a1 * b[h + kHi]);
            else
              detail::promote<Cfg::kAccum, kLo>(out[h], acc, a0 * b[h], a1 * b[h], a0 * b[h + kHi], a1 * b[h + kHi]);
          }
        };
        // The tile's K blocks. When they fill whole rounds of the ring (whole_rounds), every tile starts on stage 0
        // and the loop is unrolled over a round: each stage a constant, so every barrier, scale and descriptor
        // address is an immediate. The tile's first stage was waited for above.
        // With a deferred epilogue the tile's first chain was issued before it: the first block (the first round's when
        // unrolled) is peeled off, so that no other block tests for it.
        auto k_loop = [&](auto lo_c, auto now_c) {
          bool full_next = true;
          if (whole_rounds) {
            int kb = 0;
            if constexpr (Cfg::kFirstChainEarly) {
#pragma unroll
              for (int s = 0; s < kStages; ++s) k_block(s, phase, full_next, lo_c, now_c, s == 0);
              phase ^= 1;
              kb = kStages;
            }
            for (; kb < Kb; kb += kStages) {
#pragma unroll
              for (int s = 0; s < kStages; ++s) k_block(s, phase, full_next, lo_c, now_c, false);
              phase ^= 1;
            }
          } else {
            int kb = 0;
            if constexpr (Cfg::kFirstChainEarly) {
              k_block(stage, phase, full_next, lo_c, now_c, true);
              if (++stage == kStages) stage = 0, phase ^= 1;
              kb = 1;
            }
            for (; kb < Kb; ++kb) {
              k_block(stage, phase, full_next, lo_c, now_c, false);
              if (++stage == kStages) stage = 0, phase ^= 1;
            }
          }
        };
        if constexpr (Cfg::kDeferEpilogue) {  // the tile's first chain, then the previous tile's epilogue while it runs
          issue_chain(stage, 0);
          epilogue(finished);
          zero_out();
        } else if constexpr (Cfg::kDeferLastPart) {  // the same with the previous tile's last part (out not zeroed:
          issue_chain(stage, 0);                      // the first K block's promotions overwrite it)
          epilogue_parts(finished, Last{}, All{});
        }
        using C16 = std::integral_constant<int, 16>;
        using C8 = std::integral_constant<int, 8>;
        using One = std::integral_constant<int, 1>;
        if constexpr (Cfg::kPartN == 192) {  // 16 chunks on the first block when n0 % 128 == 0, else 8
          if (lo_chunks == 16) k_loop(C16{}, One{});
          else k_loop(C8{}, One{});
        } else if constexpr (Cfg::kParts == 2) {
          if (parts == 2) k_loop(C16{}, std::integral_constant<int, 2>{});
          else k_loop(C16{}, One{});
        } else {
          k_loop(C16{}, One{});
        }
      } else {  // all of this warpgroup's rows lie past its expert's end
        if constexpr (Cfg::kDeferEpilogue) epilogue(finished);
        if constexpr (Cfg::kDeferLastPart) epilogue_parts(finished, Last{}, All{});
        for (int kb = 0; kb < Kb; ++kb) {
          Barrier::wait(&full[stage], phase);
          release(stage);
          if (++stage == kStages) stage = 0, phase ^= 1;
        }
      }

      // ---- this tile's epilogue: now, or deferred (at the next tile, once its first chain is issued or before a
      // warpgroup with no rows drains its stages; after the last tile, below)
      const Finished done{Cfg::kDynamicWalk || g * kCluster + rank < num_tiles ? rows : 0, row0, n0, parts, expert};
      if constexpr (Cfg::kDeferEpilogue) {
        finished = done;
      } else if constexpr (Cfg::kDeferLastPart) {
        epilogue_parts(done, First{}, Last{});
        finished = done;
      } else {
        epilogue(done);
      }
      if constexpr (Cfg::kDynamicWalk) more = walk_goes_on();
    }
    if constexpr (Cfg::kDeferEpilogue) epilogue(finished);
    if constexpr (Cfg::kDeferLastPart) epilogue_parts(finished, Last{}, All{});
    if (tid == 0) cute::tma_store_wait<0>();
  }
  // No CTA of a cluster leaves while its peer may still arrive on its barriers.
  if constexpr (kCluster > 1) cute::cluster_sync();
#endif
}

}  // namespace moegemm::sm90
