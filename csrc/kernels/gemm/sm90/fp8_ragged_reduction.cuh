// moegemm's own FP8 grouped GEMM with a ragged reduction (the weight gradient) for sm90a:
//   out[e] ([N, K]) (+)= Σ_i Σ_{t in block i of e} saT[blk_e + i, n] · sbT[blk_e + i, k] · qaT[n, col_e + t] · qbT[k, col_e + t]
// on quantize_act's per-expert column copies: qaT [N, cols] (dy) and qbT [K, cols] (x) e4m3, expert e's
// m_e tokens at columns [col_e, col_e + m_e), with 128x1 scales along the tokens, saT [blocks, N] and
// sbT [blocks, K], expert e's 128-token blocks from row blk_e (the plan's rows, csrc/moegemm.h).
//
// The design (one CTA per SM, warp-specialized, as the ragged-row kernel fp8_ragged_rows.cuh):
// - One TMA descriptor per operand over the whole column copy, none per expert: a tile's K loop reads
//   128-token boxes from column col_e. An expert's last box reaches past its tokens (into its padding and
//   the next expert's tokens, whose bytes the layout leaves unspecified): its 32-token wgmma steps past
//   the expert's tokens are skipped, and in its last step the math warpgroups set the bytes past them to
//   zero in both operands in shared memory (none when the tokens end on a step), so nothing is padded in
//   global memory and no size goes to the host.
// - Every expert owns the same output tiles (scheduler.cuh, RaggedReductionTiles), row-major or in bands of
//   row blocks (heuristics.h); a tile's reduction is its expert's tokens. The persistent grid walks them
//   dynamically: the producer's TMA thread draws each CTA's next id from a tile counter (the launch's
//   workspace, zeroed before it) and hands it to the other roles through a ring of shared-memory slots
//   (pipeline.cuh, TileIdRing), so that a CTA held up by a long reduction takes fewer tiles. An empty
//   expert's tiles read nothing: they store zeros (written outputs) or are skipped (accumulated outputs keep
//   their values).
// - A producer warpgroup: one thread issues the TMA copies of A (128 gradient rows) and B (BLOCK_N
//   columns) per 128-token block into a ring of stages; one warp loads the stage's scales (saT of the
//   tile's rows, sbT of its columns, 16-byte loads) into shared memory beside them.
// - Two math warpgroups of 64 rows each: per block, a wgmma chain per part (all of BLOCK_N, or 128 of
//   256) into a temporary accumulator, then the promotion out += acc · sa[row] · sb[col] (both scales vary
//   across the tile: 1x128 blocks along the tokens on both operands). With one part the column scales go
//   to registers (at 160 columns before its wgmmas are issued, at 128 while they run) and the stage is
//   released at their end (and the next stage's barrier tested without blocking, its latency hidden behind
//   the promotion); with two (their accumulators fill the registers) they are read from shared memory per
//   8-column chunk and the stage is released after the last part's promotion. With fp32 accumulation the
//   warpgroups take turns at issuing their chains, so that they do not issue, finish and promote together
//   (in one-part tiles warpgroup 0 hands the turn over once its chain is done, so that warpgroup 1's chain runs
//   while it promotes).
// - Epilogue per warpgroup: 64-row slabs of one 128-byte swizzle span (32 fp32 or 64 bf16 columns; 32 bf16
//   columns in a 64-byte span at 160 columns) through kSlabBuffers shared-memory buffers, each stored by TMA
//   while the next is written; fp32 is written or added into the output (Megatron's main_grad) by TMA's
//   reduce-add, which adds in L2 (the values prefetched into L2 a few boxes before the main loop ends). bf16
//   is written. A 3-D tensor map over [E, N, K] clips rows past N and columns past K. The last stores
//   overlap the next tile's main loop.
// - A plan that does not fit the column copy (plan_fits) is taken as the plan of no tokens.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>
#include <utility>

#include "cute/arch/copy_sm90_desc.hpp"
#include "cute/arch/copy_sm90_tma.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/arch/reg_reconfig.h"

#include "moegemm.h"
#include "kernels/plan/plan.cuh"
#include "kernels/gemm/sm90/cta.h"
#include "kernels/gemm/sm90/pipeline.cuh"
#include "kernels/gemm/sm90/scheduler.cuh"
#include "kernels/gemm/sm90/wgmma.cuh"

namespace moegemm::sm90 {

// One kernel configuration: BLOCK_M = 128 rows of the gradient (two warpgroups of 64), BLOCK_K = 128
// tokens (one scale block per stage), BLOCK_N = 128 or 160 columns in one part or 256 in two parts of 128,
// each part one wgmma chain (64 x part x 32) into the temporary accumulator; the output kind (WgradOut) fixed
// per instantiation.
template <int kBlockN_, WgradOut kOut_>
struct Fp8RaggedReductionConfig : WarpSpecializedCta {
  static constexpr int kBlockN = kBlockN_;
  static constexpr WgradOut kOut = kOut_;
  // (BLOCK_N = 192 in one part: its column scales would not fit in the registers beside two 96-value
  // accumulators; 160 (80 + 80 + 40 registers) is the widest one-part tile that keeps them there.)
  static_assert(kBlockN == 128 || kBlockN == 160 || kBlockN == 256, "BLOCK_N of 128, 160 or 256 columns");
  static constexpr int kBlockK = kBlock;
  static_assert(kBlockK == 4 * 32, "four 32-token wgmma steps per box (the kernel's chains of 1 to 4 steps)");
  static constexpr int kPartN = kBlockN == 256 ? 128 : kBlockN;  // one part, or two of 128
  static constexpr int kParts = kBlockN / kPartN;
  static constexpr int kScaleGroupN = 128;  // the scale warp loads 128 column scales per group (4 per lane)
  static constexpr int kScaleGroups = (kBlockN + kScaleGroupN - 1) / kScaleGroupN;
  static constexpr int kAccum = kPartN / 2;  // fp32 accumulator registers per thread of a 64 x part wgmma
  // One part: its column scales go to registers while its wgmmas run and the stage is released at their end;
  // two (their accumulators fill the registers): the scales are read from shared memory in the promotion
  // and the stage is released after it.
  static constexpr bool kColsInRegisters = kParts == 1;
  // At 160 columns their 20 pairs are read before the chain is issued, as DeepGEMM's k-grouped kernel does: faster
  // for fp32 accumulation on the wide problems (H200; docs/performance.md, Ragged-reduction GEMM). At 128 columns,
  // read before the issue, the issue waited for them.
  static constexpr bool kColsBeforeChain = kParts == 1 && kBlockN > 128;

  // epilogue: slabs of a warpgroup's 64 rows x one swizzle span, 128 bytes (128B swizzle), or 64 bytes (64B
  // swizzle) for bf16 when 64 columns do not divide the part (160)
  static constexpr int kOutBytes = kOut == WgradOut::kBF16 ? 2 : 4;
  static constexpr int kSlabRowBytes = kPartN % (128 / kOutBytes) == 0 ? 128 : 64;
  static constexpr int kSlabCols = kSlabRowBytes / kOutBytes;
  static constexpr int kSlabBytes = kWarpgroupRows * kSlabRowBytes;
  static_assert(kPartN % kSlabCols == 0, "whole slabs per part");
  // buffers per warpgroup: 4 measured faster than 2 wherever the output is the bound (the wgrad table)
  static constexpr int kSlabBuffers = 4;
  // fp32 accumulation adds into the gradient by TMA reduce-add (in L2), the tile's gradient values prefetched
  // into L2 (by every fp32 accumulation) this many 128-token boxes before the end of its main loop so that the reduce-adds find them there
  // instead of reading DRAM behind the epilogue: 3 was the best of the tile's start, half-way and 3 or 6 boxes
  // before its end. At 128 columns it also beat loading the values into the epilogue's buffers by TMA and adding
  // them in registers, a form that moves twice the shared-memory bytes per tile (H200; docs/performance.md,
  // Ragged-reduction GEMM).
  static constexpr int kPrefetchBoxesAhead = 3;
  // How the two math warpgroups order their wgmma chains. Issued together, the two chains of a box share the
  // tensor cores and end together, and then both warpgroups promote while the tensor cores idle. With turns (two
  // named barriers) a warpgroup issues its chain once the other has handed the turn over: after issuing its own
  // chain (kAfterIssue), or, warpgroup 0, once its chain is done (kAfterChain: warpgroup 1's chain then runs
  // alone while warpgroup 0 promotes, and warpgroup 0's next chain is queued behind it). With fp32 accumulation
  // one-part tiles take kAfterChain, two parts kAfterIssue, the fastest of the three for each (H200;
  // docs/performance.md, Ragged-reduction GEMM). Written outputs take no turns (turns made bf16 slower).
  enum class Turns { kNone, kAfterIssue, kAfterChain };
  static constexpr Turns kTurns = kOut != WgradOut::kF32Accumulate ? Turns::kNone
                                  : kParts == 1                    ? Turns::kAfterChain
                                                                   : Turns::kAfterIssue;
  static constexpr bool kTakeTurns = kTurns != Turns::kNone;

  // shared memory, from a 1024-byte aligned base (the 128B swizzle's period; checked at kernel start)
  static constexpr int kBytesA = kBlockM * kBlockK;  // e4m3, per stage
  static constexpr int kBytesB = kBlockN * kBlockK;
  static constexpr int kBytesD = kMathWarpgroups * kSlabBuffers * kSlabBytes;
  static constexpr int kBytesStage = kBytesA + kBytesB + (kBlockM + kBlockN) * 4 + 2 * 8;
  static constexpr int kStages = (kSharedBytes - kBytesD) / kBytesStage;
  static constexpr int kOffsetA = kBytesD;
  static constexpr int kOffsetB = kOffsetA + kStages * kBytesA;
  static constexpr int kOffsetScalesA = kOffsetB + kStages * kBytesB;      // fp32 [kStages][kBlockM]
  static constexpr int kOffsetScalesB = kOffsetScalesA + kStages * kBlockM * 4;  // fp32 [kStages][kBlockN]
  static constexpr int kOffsetBarriers = kOffsetScalesB + kStages * kBlockN * 4;
  // the tile-id ring (TileIdRing): its full and empty barriers, then its slots
  static constexpr int kIdSlots = 4;
  static constexpr int kIdReaders = 32 * (1 + kMathWarpgroups * 4);  // the lanes of the scale warp and of every math warp
  static constexpr int kOffsetIdRing = kOffsetBarriers + 2 * kStages * 8;
  static constexpr int kSmemBytes = kOffsetIdRing + TileIdRing<kIdSlots>::kBytes;
  static_assert(kStages >= 3, "a pipeline of at least three stages");
  static_assert(kSmemBytes <= kSharedBytes, "shared memory per block on sm90");
};

struct Fp8RaggedReductionParams {
  CUtensorMap a;  // qaT [N, cols], box 128 x 128, 128B swizzle
  CUtensorMap b;  // qbT [K, cols], box kBlockN x 128
  CUtensorMap d;  // out [E, N, K] (fp32 or bf16), box 64 x kSlabCols of one expert
  const float* sa;  // saT [blocks, N]
  const float* sb;  // sbT [blocks, K]
  const int32_t* plan;
  int* tile_counter;  // the tile walk's counter, zero at launch
  int E, N, K;
  int band;  // the tile walk's row blocks per band (0: row-major), heuristics.h
  int64_t cols, blocks;
};

namespace detail {

// Sets bytes [keep, end) of every 128-byte row of a stage's A (kRowsA rows) and B (kRowsB rows) tiles,
// 128B-swizzled, to zero: the tokens of an expert's last box past its own that the box's wgmmas read (keep
// < end, end a multiple of 16). Thread t of kThreads takes rows t, t + kThreads, ... of the two tiles in
// turn and in each the units from the one holding byte keep (its first keep % 16 bytes kept) to the one
// before `end`: straight-line code, since two warps per scheduler hide no latency (a loop over every
// unit with a branch per unit cost ~2 us per box).
template <int kRowsA, int kRowsB, int kThreads>
__device__ __forceinline__ void zero_past(uint8_t* a, uint8_t* b, int keep, int end, int t) {
  static_assert(kRowsA % 8 == 0, "B's rows on A's swizzle phases");
  const int first = keep / 16, last = end / 16;
  uint32_t mask[4];  // of unit `first`'s words: the bytes that stay
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int bytes = keep % 16 - 4 * j;
    mask[j] = bytes >= 4 ? ~0u : bytes <= 0 ? 0u : (1u << (8 * bytes)) - 1u;
  }
  constexpr int kRows = kRowsA + kRowsB;
#pragma unroll
  for (int q0 = 0; q0 < kRows; q0 += kThreads) {
    const int q = q0 + t;
    if (kRows % kThreads != 0 && q >= kRows) break;
    uint8_t* row = q < kRowsA ? a + q * 128 : b + (q - kRowsA) * 128;
    const int phase = q % 8;  // unit u of the row stored at unit u ^ phase
    uint4* unit = reinterpret_cast<uint4*>(row + (first ^ phase) * 16);
    uint4 v = *unit;
    v.x &= mask[0], v.y &= mask[1], v.z &= mask[2], v.w &= mask[3];
    *unit = v;
#pragma unroll
    for (int u = 1; u < 8; ++u)
      if (u > first && u < last) *reinterpret_cast<uint4*>(row + (u ^ phase) * 16) = make_uint4(0, 0, 0, 0);
  }
}

// out += acc · a_row · b_col over a part's accumulator: rows r (values with i & 2 clear: a0) and r + 8
// (a1); the 8-column chunk j = i / 4's two columns of this thread at b[kStride j] (fp32 pairs: registers,
// or shared memory with b offset by the lane).
template <int kAccum, int kStride>
__device__ __forceinline__ void promote_rows_cols(float* out, const float* acc, float a0, float a1, const float2* b) {
#pragma unroll
  for (int j = 0; j < kAccum / 4; ++j) {
    const float2 c = b[kStride * j];
    out[4 * j + 0] = fmaf(acc[4 * j + 0], a0 * c.x, out[4 * j + 0]);
    out[4 * j + 1] = fmaf(acc[4 * j + 1], a0 * c.y, out[4 * j + 1]);
    out[4 * j + 2] = fmaf(acc[4 * j + 2], a1 * c.x, out[4 * j + 2]);
    out[4 * j + 3] = fmaf(acc[4 * j + 3], a1 * c.y, out[4 * j + 3]);
  }
}

}  // namespace detail

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1) fp8_ragged_reduction_kernel(const __grid_constant__ Fp8RaggedReductionParams p) {
#if defined(__CUDA_ARCH__) && defined(CUTE_ARCH_MMA_SM90A_ENABLED)
  using Barrier = cutlass::arch::ClusterBarrier;
  using TxBarrier = cutlass::arch::ClusterTransactionBarrier;
  constexpr int kStages = Cfg::kStages;
  constexpr bool kAccumulate = Cfg::kOut == WgradOut::kF32Accumulate;

  extern __shared__ __align__(1024) uint8_t smem[];
  if (cute::cast_smem_ptr_to_uint(smem) % 1024 != 0) __trap();  // the swizzled layouts need it
  uint8_t* smem_d = smem;
  uint8_t* smem_a = smem + Cfg::kOffsetA;
  uint8_t* smem_b = smem + Cfg::kOffsetB;
  float* smem_sa = reinterpret_cast<float*>(smem + Cfg::kOffsetScalesA);
  float* smem_sb = reinterpret_cast<float*>(smem + Cfg::kOffsetScalesB);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + Cfg::kOffsetBarriers);
  uint64_t* empty = full + kStages;
  uint64_t* id_full = reinterpret_cast<uint64_t*>(smem + Cfg::kOffsetIdRing);
  uint64_t* id_empty = id_full + Cfg::kIdSlots;
  TileIdRing<Cfg::kIdSlots> id_ring{reinterpret_cast<int*>(id_empty + Cfg::kIdSlots), id_full, id_empty};

  const int warpgroup = __shfl_sync(0xffffffff, threadIdx.x / 128, 0);  // uniform: descriptors in uniform registers

  // A plan that does not fit the column copy counts as the plan of no tokens.
  const bool fits = plan_fits(p.plan, p.E, PlanLimits{kNoLimit, p.cols, p.blocks});
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      Barrier::init(&full[s], 1 + 32);                        // the TMA thread (+ bytes), each scale lane
      Barrier::init(&empty[s], Cfg::kMathWarpgroups * 128);   // each math thread
    }
    TileIdRing<Cfg::kIdSlots>::init(id_full, id_empty, Cfg::kIdReaders);
    cutlass::arch::fence_barrier_init();
  }
  if (threadIdx.x == Cfg::kMathWarpgroups * 128) {
    cute::prefetch_tma_descriptor(reinterpret_cast<const cute::TmaDescriptor*>(&p.a));
    cute::prefetch_tma_descriptor(reinterpret_cast<const cute::TmaDescriptor*>(&p.b));
    cute::prefetch_tma_descriptor(reinterpret_cast<const cute::TmaDescriptor*>(&p.d));
  }
  __syncthreads();

  // The problem and the tile walk, set up by each role after its register reconfiguration.
  int N, K, num_tiles;
  const int32_t *tok, *col, *blk;
  RaggedReductionTiles tiles;
  auto set_up = [&] {
    N = p.N, K = p.K;
    tok = p.plan, col = p.plan + (p.E + 1), blk = p.plan + 2 * (p.E + 1);
    tiles = {p.E, (N + Cfg::kBlockM - 1) / Cfg::kBlockM, (K + Cfg::kBlockN - 1) / Cfg::kBlockN, p.band};
    num_tiles = tiles.count();
  };
  // A role's walk over its tiles (ids from the tile-id ring): the tile after the current one, with its expert's
  // tokens and its column (or scale-block) start, loaded while the current tile runs (dependent global loads,
  // hidden behind it).
  struct Walk {
    int id;
    ReductionTile t;
    int m, start;
  };
  auto walk = [&](int id, const int32_t* starts) {
    Walk w{};
    w.id = id;
    if (id < num_tiles) {
      w.t = tiles.at(id);
      w.m = fits ? tok[w.t.expert + 1] - tok[w.t.expert] : 0;
      w.start = starts[w.t.expert];
    }
    return w;
  };

  if (warpgroup == Cfg::kMathWarpgroups) {
    // ---- producer: one thread issues every TMA copy, one warp loads the scales
    cutlass::arch::warpgroup_reg_dealloc<Cfg::kProducerRegisters>();
    set_up();
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    if (warp == 0 && lane == 0) {
      constexpr uint64_t kHint = static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL);
      int stage = 0;
      uint32_t phase = 0;
      // The walk's ids, drawn here from the tile counter (each CTA takes the next tile when it needs one, so that
      // a long reduction holds up only its own CTA) and handed to the other roles. Each id is drawn a tile ahead
      // of its hand-over (the counter's latency hidden behind a tile), and handed over as the tile before it
      // starts, so that every role loads its expert's plan entries in time.
      auto draw = [&] { return atomicAdd(p.tile_counter, 1); };
      int pending = draw();
      id_ring.put(pending);
      Walk next = walk(pending, col);
      if (pending < num_tiles) pending = draw();
      for (int id = next.id, nxt; id < num_tiles; id = nxt) {
        nxt = pending;
        id_ring.put(nxt);
        if (nxt < num_tiles) pending = draw();
        const Walk cur = next;
        next = walk(nxt, col);
        const ReductionTile t = cur.t;
        const int m = cur.m, c0 = cur.start;
        if (m == 0) continue;
        const int m0 = t.m_block * Cfg::kBlockM, n0 = t.n_block * Cfg::kBlockN;
        for (int k0 = 0; k0 < m; k0 += kBlock) {
          Barrier::wait(&empty[stage], phase ^ 1);
          TxBarrier::arrive_and_expect_tx(&full[stage], Cfg::kBytesA + Cfg::kBytesB);
          cute::SM90_TMA_LOAD_2D::copy(&p.a, &full[stage], kHint, smem_a + stage * Cfg::kBytesA, c0 + k0, m0);
          cute::SM90_TMA_LOAD_2D::copy(&p.b, &full[stage], kHint, smem_b + stage * Cfg::kBytesB, c0 + k0, n0);
          if (++stage == kStages) stage = 0, phase ^= 1;
        }
      }
    } else if (warp == 1) {
      int stage = 0;
      uint32_t phase = 0;
      Walk next = walk(id_ring.take(), blk);
      for (int id = next.id, nxt; id < num_tiles; id = nxt) {
        nxt = id_ring.take();
        const Walk cur = next;
        next = walk(nxt, blk);
        const ReductionTile t = cur.t;
        const int m = __shfl_sync(0xffffffff, cur.m, 0);  // warp-uniform to the compiler
        if (m == 0) continue;
        // this lane's 4 rows and 4 x kParts columns of the tile, those inside N and K (both multiples of 16)
        const int m0 = t.m_block * Cfg::kBlockM + 4 * lane, n0 = t.n_block * Cfg::kBlockN + 4 * lane;
        const float* sa = p.sa + int64_t(cur.start) * N + m0;
        const float* sb = p.sb + int64_t(cur.start) * K + n0;
        for (int k0 = 0; k0 < m; k0 += kBlock) {
          // loaded before the wait, so that their latency overlaps it
          const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
          const float4 a = m0 < N ? __ldg(reinterpret_cast<const float4*>(sa)) : zero;
          float4 b[Cfg::kScaleGroups];
#pragma unroll
          for (int h = 0; h < Cfg::kScaleGroups; ++h)
            b[h] = n0 + h * Cfg::kScaleGroupN < K && 4 * lane + h * Cfg::kScaleGroupN < Cfg::kBlockN
                       ? __ldg(reinterpret_cast<const float4*>(sb + h * Cfg::kScaleGroupN))
                       : zero;
          Barrier::wait(&empty[stage], phase ^ 1);
          reinterpret_cast<float4*>(smem_sa + stage * Cfg::kBlockM)[lane] = a;
#pragma unroll
          for (int h = 0; h < Cfg::kScaleGroups; ++h)
            if (4 * lane + h * Cfg::kScaleGroupN < Cfg::kBlockN)
              reinterpret_cast<float4*>(smem_sb + stage * Cfg::kBlockN + h * Cfg::kScaleGroupN)[lane] = b[h];
          Barrier::arrive(&full[stage]);  // each lane releases its own stores
          if (++stage == kStages) stage = 0, phase ^= 1;
          sa += N, sb += K;
        }
      }
    }
  } else {
    // ---- math warpgroups
    cutlass::arch::warpgroup_reg_alloc<Cfg::kMathRegisters>();
    set_up();
    const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;

    // This thread's reads of a stage are done: release it. Every math thread arrives (not one lane per warp), so
    // each reader's own arrival orders its reads before the stage's next fill, as racecheck models it.
    auto release = [&](int s) { Barrier::arrive(&empty[s]); };
    // Whether the next K block's stage (of this tile or the next: the stages are consumed in order) is full
    // (next_stage_full, tested after an early release).
    bool full_next = false;

    float acc[Cfg::kAccum];
    float out[Cfg::kParts][Cfg::kAccum];
    int stage = 0;
    uint32_t phase = 0;
    int slab = 0;  // slabs stored so far by this warpgroup: the next one's buffer
    uint8_t* smem_d_wg = smem_d + warpgroup * Cfg::kSlabBuffers * Cfg::kSlabBytes;
    const uint64_t a_desc0 = sw128_descriptor(smem_a + warpgroup * Cfg::kWarpgroupRows * kBlock);
    const uint64_t b_desc0 = sw128_descriptor(smem_b);
    const uint32_t a_lo0 = __shfl_sync(0xffffffff, static_cast<uint32_t>(a_desc0), 0);
    const uint32_t b_lo0 = __shfl_sync(0xffffffff, static_cast<uint32_t>(b_desc0), 0);
    const uint64_t a_hi = a_desc0 & 0xffffffff00000000ull, b_hi = b_desc0 & 0xffffffff00000000ull;
    // this thread's accumulator rows r, r + 8 of the warpgroup's 64 and its columns 2 (lane % 4) + {0, 1} of each chunk
    const int r = warp * 16 + lane / 4;
    int sa_row = warpgroup * Cfg::kWarpgroupRows + r;
    asm volatile("" : "+r"(sa_row));  // kept in a register, not recomputed from %tid per block
    const float* smem_sa_row = smem_sa + sa_row;
    int sb_col = lane % 4;
    asm volatile("" : "+r"(sb_col));  // likewise (it was an S2R of %tid on the way to every block's first wgmma)
    const float2* smem_sb_cols = reinterpret_cast<const float2*>(smem_sb) + sb_col;

    // named barriers: kEpilogueBarrier + w for warpgroup w's epilogue, kZeroBarrier for both around the zeroing
    // of a last box, kTurnBarrier + w for warpgroup w's turn to issue (kTurns; warpgroup 0 issues first)
    constexpr int kEpilogueBarrier = 0, kZeroBarrier = 2, kTurnBarrier = 3;
    if (Cfg::kTakeTurns && warpgroup == 1) cutlass::arch::NamedBarrier::arrive(256, kTurnBarrier);
    Walk next = walk(id_ring.take(), tok);
    for (int id = next.id, nxt; id < num_tiles; id = nxt) {
      nxt = id_ring.take();
      const Walk cur = next;
      next = walk(nxt, tok);
      const ReductionTile t = cur.t;
      // broadcast from lane 0: warp-uniform to the compiler, which keeps the K loop's values in uniform registers
      const int m = __shfl_sync(0xffffffff, cur.m, 0);
      if (kAccumulate && m == 0) continue;  // nothing to add
      const int row0 = t.m_block * Cfg::kBlockM + warpgroup * Cfg::kWarpgroupRows;  // this warpgroup's rows
      const int n0 = t.n_block * Cfg::kBlockN;
      // the K block at which this warpgroup's gradient values are prefetched into L2 (fp32 accumulation)
      const int k_prefetch = max(0, (m - 1) / kBlock - Cfg::kPrefetchBoxesAhead) * kBlock;

#pragma unroll
      for (int h = 0; h < Cfg::kParts; ++h)
#pragma unroll
        for (int i = 0; i < Cfg::kAccum; ++i) out[h][i] = 0.f;

      for (int k0 = 0; k0 < m; k0 += kBlock) {
        const uint32_t a_lo = a_lo0 + stage * (Cfg::kBytesA / 16), b_lo = b_lo0 + stage * (Cfg::kBytesB / 16);
        if (!full_next) Barrier::wait(&full[stage], phase);
        full_next = false;
        if constexpr (kAccumulate) {
          if (k0 == k_prefetch && row0 < N && tid == 0) {
#pragma unroll
            for (int c = 0; c < Cfg::kBlockN / Cfg::kSlabCols; ++c)
              if (n0 + c * Cfg::kSlabCols < K) cute::SM90_TMA_LOAD_3D::PREFETCH::copy(&p.d, n0 + c * Cfg::kSlabCols, row0, t.expert);
          }
        }
        // The expert's last box: its 32-token wgmma steps past the expert's tokens are skipped, and the bytes
        // past them in its last step (another expert's tokens, or padding) are set to zero in both operands.
        int ksteps = kBlock / 32;
        if (m - k0 < kBlock) {
          const int keep = m - k0;
          ksteps = (keep + 31) / 32;
          if (keep % 32 != 0) {
            detail::zero_past<Cfg::kBlockM, Cfg::kBlockN, 256>(smem_a + stage * Cfg::kBytesA, smem_b + stage * Cfg::kBytesB, keep,
                                                               32 * ksteps, warpgroup * 128 + tid);
            cutlass::arch::fence_view_async_shared();
            cutlass::arch::NamedBarrier::sync(256, kZeroBarrier);
          }
        }
        const float a0 = smem_sa_row[stage * Cfg::kBlockM], a1 = smem_sa_row[stage * Cfg::kBlockM + 8];
        // One part: the column scales into registers, loaded right after the chain is issued so that the loads
        // overlap it, or before it (kColsBeforeChain), the stage released at its end.
        float2 cols[Cfg::kColsInRegisters ? Cfg::kAccum / 4 : 1];
        auto load_cols = [&] {
          if constexpr (Cfg::kColsInRegisters) {
#pragma unroll
            for (int j = 0; j < Cfg::kAccum / 4; ++j) cols[j] = smem_sb_cols[stage * Cfg::kBlockN / 2 + 4 * j];
          }
        };
#pragma unroll
        for (int h = 0; h < Cfg::kParts; ++h) {
#pragma unroll
          for (int i = 0; i < Cfg::kAccum; ++i) cute::warpgroup_fence_operand(acc[i]);
          // the part's wgmma chain over the box's first `steps` 32-token steps (one straight-line chain per count:
          // a wgmma under a branch makes ptxas fence every wgmma)
          auto chain = [&](auto steps) {
            cute::warpgroup_arrive();
#pragma unroll
            for (int k = 0; k < decltype(steps)::value; ++k)
              wgmma<Cfg::kPartN>(a_hi | (a_lo + 2 * k), b_hi | (b_lo + (h * Cfg::kPartN * kBlock) / 16 + 2 * k), acc, k > 0,
                                 std::make_integer_sequence<int, Cfg::kAccum>{});
            cute::warpgroup_commit_batch();
          };
          if (Cfg::kColsBeforeChain && h == 0) load_cols();
          if constexpr (Cfg::kTakeTurns) cutlass::arch::NamedBarrier::sync(256, kTurnBarrier + warpgroup);  // this warpgroup's turn
          if (ksteps == 4) {  // a whole box (all but an expert's last): one test before the chain, not three
            chain(std::integral_constant<int, 4>{});
          } else {
            switch (ksteps) {
              case 1: chain(std::integral_constant<int, 1>{}); break;
              case 2: chain(std::integral_constant<int, 2>{}); break;
              default: chain(std::integral_constant<int, 3>{}); break;
            }
          }
          // the other's turn: now, or (warpgroup 0, kAfterChain) once this chain is done
          if (Cfg::kTurns == Cfg::Turns::kAfterIssue || (Cfg::kTurns == Cfg::Turns::kAfterChain && warpgroup == 1))
            cutlass::arch::NamedBarrier::arrive(256, kTurnBarrier + 1 - warpgroup);
          if (!Cfg::kColsBeforeChain && h == 0) load_cols();
          cute::warpgroup_wait<0>();
          if (Cfg::kTurns == Cfg::Turns::kAfterChain && warpgroup == 0) cutlass::arch::NamedBarrier::arrive(256, kTurnBarrier + 1);
#pragma unroll
          for (int i = 0; i < Cfg::kAccum; ++i) cute::warpgroup_fence_operand(acc[i]);
          if constexpr (Cfg::kColsInRegisters) {
            release(stage);
            full_next = next_stage_full<kStages>(full, stage, phase);
            detail::promote_rows_cols<Cfg::kAccum, 1>(out[h], acc, a0, a1, cols);
          } else {  // the column scales from shared memory, the stage released after the last part's promotion
            detail::promote_rows_cols<Cfg::kAccum, 4>(out[h], acc, a0, a1,
                                                      smem_sb_cols + (stage * Cfg::kBlockN + h * Cfg::kPartN) / 2);
          }
        }
        if constexpr (!Cfg::kColsInRegisters) release(stage);
        if (++stage == kStages) stage = 0, phase ^= 1;
      }

      // ---- epilogue: this warpgroup's 64 rows of the tile, slab by slab
      if (row0 >= N) continue;  // all of them past the gradient's rows
#pragma unroll
      for (int h = 0; h < Cfg::kParts; ++h) {
#pragma unroll
        for (int s = 0; s < Cfg::kPartN / Cfg::kSlabCols; ++s) {
          const int col0 = n0 + h * Cfg::kPartN + s * Cfg::kSlabCols;
          if (col0 >= K) break;
          uint8_t* buf = smem_d_wg + (slab++ % Cfg::kSlabBuffers) * Cfg::kSlabBytes;
          if (tid == 0) cute::tma_store_wait<Cfg::kSlabBuffers - 1>();  // the store that last read `buf` is done
          cutlass::arch::NamedBarrier::sync(128, kEpilogueBarrier + warpgroup);
          constexpr int kChunks = Cfg::kSlabCols / 8;  // 8-column chunks per slab
#pragma unroll
          for (int jj = 0; jj < kChunks; ++jj) {
            const int j = s * kChunks + jj, c = 8 * jj + 2 * (lane % 4);
#pragma unroll
            for (int v = 0; v < 2; ++v) {
              const float lo = out[h][4 * j + 2 * v], hi = out[h][4 * j + 2 * v + 1];
              if constexpr (Cfg::kOut == WgradOut::kBF16) {
                const int at = Cfg::kSlabRowBytes == 128 ? sw128_offset(r + 8 * v, 2 * c) : sw64_offset(r + 8 * v, 2 * c);
                *reinterpret_cast<uint32_t*>(buf + at) = pack_bf16x2(lo, hi);
              } else {
                *reinterpret_cast<float2*>(buf + sw128_offset(r + 8 * v, 4 * c)) = make_float2(lo, hi);
              }
            }
          }
          cutlass::arch::fence_view_async_shared();
          cutlass::arch::NamedBarrier::sync(128, kEpilogueBarrier + warpgroup);
          if (tid == 0) {
            if constexpr (kAccumulate)
              cute::SM90_TMA_REDUCE_ADD_3D::copy(&p.d, buf, col0, row0, t.expert);
            else
              cute::SM90_TMA_STORE_3D::copy(&p.d, buf, col0, row0, t.expert);
            cute::tma_store_arrive();
          }
        }
      }
    }
    if (Cfg::kTakeTurns && warpgroup == 0) cutlass::arch::NamedBarrier::sync(256, kTurnBarrier);  // warpgroup 1's last arrival
    if (tid == 0) cute::tma_store_wait<0>();
  }
#endif
}

}  // namespace moegemm::sm90
