// moegemm's own FP8 grouped GEMM with ragged rows for sm90a (fprop, and dgrad with the Wᵀ copy):
//   out[rows of e] (bf16 [T, N]) = Σ_j sa[t, j] · sb[e, n/128, j] · Σ_{k in block j} qa[t, k] · qb[e, n, k]
// qa [T, K] e4m3 with 1x128 scales sa [T, Kb]; qb [E, N, K] e4m3 with 128x128 scales sb [E, Nb, Kb].
//
// The design (one CTA per SM, warp-specialized):
// - One TMA descriptor per operand over the whole tensor: A = qa [T, K], B = qb viewed as [E·N, K],
//   D = out [T, N]. No per-expert descriptors, no tensormap writes, no padding: an M tile starts at a
//   row of its expert (scheduler.cuh) and TMA fills rows past T (and K past the end) with zeros.
// - A producer warpgroup: one thread issues the TMA copies of A and B for each 128-wide K block into a
//   ring of kStages shared-memory stages (full/empty mbarriers), running ahead across tiles.
// - Two math warpgroups of 64 rows each. Per K block: wgmma chains over 128-column parts of the tile
//   into a temporary accumulator, wait, release the stage at once, then promote into the output
//   accumulator with the block's scale product (sa of the row x sb of the part) — the promotion of one
//   warpgroup runs while the other's wgmma occupies the tensor cores. A warpgroup whose 64 rows all lie
//   past its expert's end (the last tile of an expert) skips its MMAs.
// - Scales are read by the math threads themselves: each thread needs sa for its two rows and sb for the
//   tile's weight block, loaded before it waits on the stage (L1-resident after the first K block).
// - Epilogue per warpgroup: bf16 into 128B-swizzled shared memory, then one TMA store per 64 columns
//   when the warpgroup's 64 rows all belong to the expert, else 16-byte stores of the expert's rows
//   only (the rows past them belong to the next expert). The wait for a TMA store's reads is deferred
//   to the next tile's epilogue, so the store overlaps the next tile's main loop.
// - A plan that does not fit T (plan_fits) is taken as the plan of no tokens; rows past the covered
//   tokens are zeroed.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>
#include <utility>

#include "cute/arch/copy_sm90_desc.hpp"
#include "cute/arch/copy_sm90_tma.hpp"
#include "cute/arch/mma_sm90_desc.hpp"
#include "cute/arch/mma_sm90_gmma.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/arch/reg_reconfig.h"

#include "moegemm.h"
#include "kernels/gemm/sm90/scheduler.cuh"

namespace moegemm::sm90 {

// One kernel configuration: BLOCK_M = 128 rows (the plan's row blocks), BLOCK_K = 128 (one scale block
// per stage), BLOCK_N = 128 * kParts columns (one weight-scale block per part), kStages stages.
template <int kParts_, int kStages_>
struct Fp8RaggedRowsConfig {
  static constexpr int kParts = kParts_;
  static constexpr int kStages = kStages_;
  static constexpr int kBlockM = kBlock, kBlockK = kBlock, kPartN = kBlock;
  static constexpr int kBlockN = kPartN * kParts;
  static constexpr int kMathWarpgroups = 2;  // 64 rows each
  static constexpr int kWarpgroupRows = kBlockM / kMathWarpgroups;
  static constexpr int kThreads = 128 * (kMathWarpgroups + 1);
  static constexpr int kProducerRegisters = 40, kMathRegisters = 232;
  static constexpr int kBandRows = 8;  // scheduler.cuh
  static constexpr int kStoreCols = 64;  // a TMA store box: 64 bf16 = 128 bytes, the swizzle span

  // shared memory, from a 1024-byte aligned base (the 128B swizzle's period)
  static constexpr int kBytesA = kBlockM * kBlockK;  // e4m3, per stage
  static constexpr int kBytesB = kBlockN * kBlockK;
  static constexpr int kBytesD = kBlockM * kBlockN * 2;  // bf16 epilogue tile
  static constexpr int kOffsetA = kBytesD;
  static constexpr int kOffsetB = kOffsetA + kStages * kBytesA;
  static constexpr int kOffsetBarriers = kOffsetB + kStages * kBytesB;
  static constexpr int kOffsetPlan = kOffsetBarriers + 2 * kStages * 8;
  static constexpr int kSmemBytes = kOffsetPlan + 2 * (kMaxExperts + 1) * 4 + 1024;  // + alignment slack
  static_assert(kSmemBytes <= 232448, "shared memory per block on sm90");
};

struct Fp8RaggedRowsParams {
  CUtensorMap a;  // qa [T, K], box 128 x 128, 128B swizzle
  CUtensorMap b;  // qb as [E*N, K], box BLOCK_N x 128
  CUtensorMap d;  // out [T, N] bf16, box 64 x 64
  const float* sa;
  const float* sb;
  const int32_t* plan;
  __nv_bfloat16* out;
  int E, T, N, K;
};

namespace detail {

// A wgmma operand descriptor of a K-major tile of 128-byte rows in 128B-swizzled shared memory (8-row
// atoms 1024 bytes apart), starting at `smem` (K advances by adding bytes within the swizzle row).
__device__ __forceinline__ uint64_t sw128_descriptor(const void* smem) {
  cute::GmmaDescriptor d;
  d.bitfield.start_address_ = static_cast<uint16_t>(cute::cast_smem_ptr_to_uint(smem) >> 4);
  d.bitfield.leading_byte_offset_ = 1;  // unused by swizzled K-major layouts
  d.bitfield.stride_byte_offset_ = 1024 >> 4;
  d.bitfield.base_offset_ = 0;
  d.bitfield.layout_type_ = 1;  // SWIZZLE_128B
  return d.desc_;
}

using Wgmma64x128 = cute::SM90::GMMA::MMA_64x128x32_F32E4M3E4M3_SS_TN<>;

template <int... I>
__device__ __forceinline__ void wgmma(uint64_t a, uint64_t b, float* d, bool accumulate, std::integer_sequence<int, I...>) {
  Wgmma64x128::fma(a, b, d[I]..., accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);
}

// Two fp32 values as a bf16 pair (round to nearest even), the lower column first.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Byte offset of (row, col) in a warpgroup's epilogue tile: 64-column slabs of 64 rows x 128 bytes, each
// with the 128B swizzle (16-byte unit u of row r stored at unit u ^ (r % 8)), as the TMA store reads it.
__device__ __forceinline__ int epilogue_offset(int row, int col) {
  const int slab = col / 64, c = col % 64, unit = c / 8;
  return slab * (64 * 128) + row * 128 + ((unit ^ (row % 8)) * 16) + (c % 8) * 2;
}

}  // namespace detail

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1) fp8_ragged_rows_kernel(const __grid_constant__ Fp8RaggedRowsParams p) {
#if defined(__CUDA_ARCH__) && defined(CUTE_ARCH_MMA_SM90A_ENABLED)
  using Barrier = cutlass::arch::ClusterBarrier;
  using TxBarrier = cutlass::arch::ClusterTransactionBarrier;
  constexpr int kStages = Cfg::kStages;

  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* smem_d = smem;
  uint8_t* smem_a = smem + Cfg::kOffsetA;
  uint8_t* smem_b = smem + Cfg::kOffsetB;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + Cfg::kOffsetBarriers);
  uint64_t* empty = full + kStages;
  int32_t* tok = reinterpret_cast<int32_t*>(smem + Cfg::kOffsetPlan);
  int32_t* blk = tok + (kMaxExperts + 1);

  const int E = p.E, T = p.T, N = p.N, K = p.K;
  const int Kb = (K + kBlock - 1) / kBlock, Nb = (N + kBlock - 1) / kBlock;
  const int warpgroup = threadIdx.x / 128;

  // The plan into shared memory; one that does not fit T tokens counts as the plan of no tokens.
  const bool fits = plan_fits(p.plan, E, token_limit(T));
  for (int i = threadIdx.x; i <= E; i += blockDim.x) {
    tok[i] = fits ? p.plan[i] : 0;
    blk[i] = fits ? p.plan[2 * (E + 1) + i] : 0;
  }
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      Barrier::init(&full[s], 1);                                   // the producer's arrive + the bytes
      Barrier::init(&empty[s], Cfg::kMathWarpgroups * 4);           // one arrive per math warp
    }
    cutlass::arch::fence_barrier_init();
  }
  if (threadIdx.x == Cfg::kMathWarpgroups * 128) {
    cute::prefetch_tma_descriptor(reinterpret_cast<const cute::TmaDescriptor*>(&p.a));
    cute::prefetch_tma_descriptor(reinterpret_cast<const cute::TmaDescriptor*>(&p.b));
    cute::prefetch_tma_descriptor(reinterpret_cast<const cute::TmaDescriptor*>(&p.d));
  }
  __syncthreads();

  const RaggedRowTiles<Cfg::kBandRows> tiles{tok, blk, E, (N + Cfg::kBlockN - 1) / Cfg::kBlockN};
  const int64_t num_tiles = tiles.count();

  if (warpgroup == Cfg::kMathWarpgroups) {
    // ---- producer
    cutlass::arch::warpgroup_reg_dealloc<Cfg::kProducerRegisters>();
    if (threadIdx.x % 128 != 0) return;
    int stage = 0;
    uint32_t phase = 0;
    for (int64_t id = blockIdx.x; id < num_tiles; id += gridDim.x) {
      const RowTile t = tiles.at(id);
      const int b_row = t.expert * N + t.n_block * Cfg::kBlockN;
      for (int kb = 0; kb < Kb; ++kb) {
        Barrier::wait(&empty[stage], phase ^ 1);
        TxBarrier::arrive_and_expect_tx(&full[stage], Cfg::kBytesA + Cfg::kBytesB);
        constexpr uint64_t kHint = static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL);
        cute::SM90_TMA_LOAD_2D::copy(&p.a, &full[stage], kHint, smem_a + stage * Cfg::kBytesA, kb * kBlock, t.row0);
        cute::SM90_TMA_LOAD_2D::copy(&p.b, &full[stage], kHint, smem_b + stage * Cfg::kBytesB, kb * kBlock, b_row);
        if (++stage == kStages) stage = 0, phase ^= 1;
      }
    }
    return;
  }

  // ---- math warpgroups
  cutlass::arch::warpgroup_reg_alloc<Cfg::kMathRegisters>();
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;

  // Rows past the covered tokens (device counts summing below T, or a foreign plan) get zeros.
  {
    const int64_t covered = tok[E];
    uint4* dst = reinterpret_cast<uint4*>(p.out);
    const int64_t per_row = N / 8, end = int64_t(T) * per_row;
    for (int64_t i = covered * per_row + int64_t(blockIdx.x) * Cfg::kMathWarpgroups * 128 + threadIdx.x; i < end;
         i += int64_t(gridDim.x) * Cfg::kMathWarpgroups * 128)
      dst[i] = make_uint4(0, 0, 0, 0);
  }

  float acc[64];
  float out[Cfg::kParts][64];
  int stage = 0;
  uint32_t phase = 0;
  uint8_t* smem_d_wg = smem_d + warpgroup * (Cfg::kWarpgroupRows * Cfg::kBlockN * 2);

  for (int64_t id = blockIdx.x; id < num_tiles; id += gridDim.x) {
    const RowTile t = tiles.at(id);
    const int n0 = t.n_block * Cfg::kBlockN;
    const int rows = min(Cfg::kWarpgroupRows, max(0, t.rows - warpgroup * Cfg::kWarpgroupRows));  // of this warpgroup
    const int parts = min(Cfg::kParts, (N - n0 + Cfg::kPartN - 1) / Cfg::kPartN);                // inside N
    const int row = warpgroup * Cfg::kWarpgroupRows + warp * 16 + lane / 4;                      // + 8 for the second
    const float* sa0 = p.sa + int64_t(min(t.row0 + row, T - 1)) * Kb;
    const float* sa1 = p.sa + int64_t(min(t.row0 + row + 8, T - 1)) * Kb;
    const float* sb = p.sb + (int64_t(t.expert) * Nb + n0 / kBlock) * Kb;

#pragma unroll
    for (int h = 0; h < Cfg::kParts; ++h)
#pragma unroll
      for (int i = 0; i < 64; ++i) out[h][i] = 0.f;

    for (int kb = 0; kb < Kb; ++kb) {
      const float a0 = __ldg(sa0 + kb), a1 = __ldg(sa1 + kb);
      float b[Cfg::kParts];
#pragma unroll
      for (int h = 0; h < Cfg::kParts; ++h) b[h] = h < parts ? __ldg(sb + h * Kb + kb) : 0.f;
      Barrier::wait(&full[stage], phase);
      if (rows > 0) {
        const uint8_t* a_tile = smem_a + stage * Cfg::kBytesA + warpgroup * Cfg::kWarpgroupRows * kBlock;
        const uint8_t* b_tile = smem_b + stage * Cfg::kBytesB;
#pragma unroll
        for (int h = 0; h < Cfg::kParts; ++h) {
          if (h >= parts) break;
#pragma unroll
          for (int i = 0; i < 64; ++i) cute::warpgroup_fence_operand(acc[i]);
          cute::warpgroup_arrive();
#pragma unroll
          for (int k = 0; k < kBlock / 32; ++k)
            detail::wgmma(detail::sw128_descriptor(a_tile + k * 32),
                          detail::sw128_descriptor(b_tile + h * Cfg::kPartN * kBlock + k * 32), acc, k > 0,
                          std::make_integer_sequence<int, 64>{});
          cute::warpgroup_commit_batch();
          cute::warpgroup_wait<0>();
#pragma unroll
          for (int i = 0; i < 64; ++i) cute::warpgroup_fence_operand(acc[i]);
          if (h == parts - 1 && lane == 0) Barrier::arrive(&empty[stage]);  // the stage's last read is done
          const float s0 = a0 * b[h], s1 = a1 * b[h];
#pragma unroll
          for (int i = 0; i < 64; ++i) out[h][i] = fmaf((i & 2) ? s1 : s0, acc[i], out[h][i]);
        }
      } else if (lane == 0) {
        Barrier::arrive(&empty[stage]);
      }
      if (++stage == kStages) stage = 0, phase ^= 1;
    }

    // ---- epilogue: this warpgroup's 64 x BLOCK_N tile
    if (tid == 0) cute::tma_store_wait<0>();  // the previous tile's stores have read shared memory
    cutlass::arch::NamedBarrier::sync(128, warpgroup);
    if (rows > 0) {
      const int r = warp * 16 + lane / 4;
#pragma unroll
      for (int h = 0; h < Cfg::kParts; ++h)
#pragma unroll
        for (int j = 0; j < Cfg::kPartN / 8; ++j)
#pragma unroll
          for (int v = 0; v < 2; ++v) {
            const int col = h * Cfg::kPartN + j * 8 + (lane % 4) * 2;
            *reinterpret_cast<uint32_t*>(smem_d_wg + detail::epilogue_offset(r + 8 * v, col)) =
                detail::pack_bf16x2(out[h][j * 4 + v * 2], out[h][j * 4 + v * 2 + 1]);
          }
      cutlass::arch::fence_view_async_shared();
    }
    cutlass::arch::NamedBarrier::sync(128, warpgroup);
    const int row0 = t.row0 + warpgroup * Cfg::kWarpgroupRows;
    if (rows == Cfg::kWarpgroupRows) {
      if (tid == 0) {
#pragma unroll
        for (int c = 0; c < Cfg::kBlockN / Cfg::kStoreCols; ++c)
          if (n0 + c * Cfg::kStoreCols < N)
            cute::SM90_TMA_STORE_2D::copy(&p.d, smem_d_wg + c * (64 * 128), n0 + c * Cfg::kStoreCols, row0);
        cute::tma_store_arrive();
      }
    } else if (rows > 0) {
      constexpr int kUnits = Cfg::kBlockN / 8;  // 16-byte units per row
      for (int u = tid; u < rows * kUnits; u += 128) {
        const int r = u / kUnits, col = (u % kUnits) * 8;
        if (n0 + col < N)
          *reinterpret_cast<uint4*>(p.out + int64_t(row0 + r) * N + n0 + col) =
              *reinterpret_cast<const uint4*>(smem_d_wg + detail::epilogue_offset(r, col));
      }
    }
  }
  if (tid == 0) cute::tma_store_wait<0>();
#endif
}

}  // namespace moegemm::sm90
