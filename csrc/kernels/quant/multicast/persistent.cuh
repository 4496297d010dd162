// The persistent form of the multi-cast quantizer (launch.cuh), for the loaders that do not take the per-tile form
// (per_tile.cuh: several staged inputs, a per-row extra, or kPerTile false).
//
// kernel: one CTA of 16 warps per SM loops over the tiles. Warp 0 finds each tile (no division
// per tile); the warps copy its input rows into a ring of shared-memory stages with 16-byte cp.async (only
// the tile's tokens; the copies complete on the stage's mbarrier), n_stages tiles ahead; then compute the
// tile's values from the stage into registers (4 rows x 8 columns per thread), write the row copy, reduce
// the column maxima through shared memory (every warp taking 8 columns), and write the column copy through
// a swizzled shared-memory tile with full-line stores: three CTA barriers per tile.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "moegemm.h"
#include "kernels/common/async_copy.cuh"
#include "kernels/common/cuda_check.h"
#include "kernels/common/device.h"
#include "kernels/plan/plan.cuh"
#include "kernels/quant/fp8_block.cuh"
#include "kernels/quant/multicast/common.cuh"
#include "kernels/quant/tiles.cuh"

namespace moegemm::multicast {

constexpr int kWarps = 16;                       // one CTA per SM
constexpr int kThreads = kWarps * 32;            // 512
constexpr int kMaxStages = 8;
constexpr int kSharedBytes = 227 * 1024;         // an sm_90 CTA's shared memory (all of it dynamic here)

// A tile as warp 0 found it. Tile j of a CTA lives in slot j % (2 n_stages) of the info ring: written an
// iteration before its loads read it, and read again when the tile is computed.
struct TileInfo {
  int64_t row0;    // first token
  int64_t block;   // 128-token block (row of sT)
  int64_t qt_col;  // first column of the tile's tokens in qT
  int32_t nr, kb;  // tokens (1..128), tile column block (the first output block's)
};

// The shared memory of a CTA, all dynamic: the stages' barriers, the tile infos, the per-warp column
// maxima, the column multipliers, the plan, the FP8 column tile (when the column copy is made), then the
// ring of stages.
struct Layout {
  static constexpr int kFull = 0, kInfo = kFull + 8 * kMaxStages;
  static constexpr int kPartial = kInfo + int(sizeof(TileInfo)) * 2 * kMaxStages;     // [16 warps][128] floats
  static constexpr int kMul = kPartial + kWarps * kBlock * 4;                         // [2][128] floats
  static constexpr int kPlan = kMul + 2 * kBlock * 4;
  int col_tile, stages, total;
  __host__ __device__ Layout(int E, bool cols, int64_t stage_bytes, int n_stages) {
    col_tile = kPlan + (3 * (E + 1) * 4 + 127) / 128 * 128;
    stages = col_tile + (cols ? kColTileBytes : 0);
    total = stages + int(stage_bytes) * n_stages;
  }
};

// Where warp w's maximum of column c sits in the per-warp column maxima: row w, rotated by 8 columns per
// group of 4 warps, so that the lanes reading 4 warps' rows of 8 columns meet 32 different banks.
__device__ __forceinline__ int partial_index(int w, int c) { return w * kBlock + (c + kVec * (w / 4)) % kBlock; }

// One CTA per SM walks its tiles j = 0, 1, ... (tile blockIdx.x + j * gridDim.x). Per tile, three barriers:
//   values from the stage; row copy; column maxima -> shared     | barrier A: the stage is free, so every
//   thread issues its loads of tile j + n_stages into it (found by warp 0 while tile j was waited for);
//   column scales, 8 columns per warp                            | barrier B
//   the column copy into the FP8 column tile                     | barrier C
//   the column tile out to qT.
// The next tile's column maxima, scales and column tile come after the next barrier that every thread
// passes past this tile's last reads of them, so one buffer of each suffices. Tiles of 128 tokens and 128
// columns (all but an expert's last and the last column block) take a path without bounds checks.
template <class Loader>
__global__ void __launch_bounds__(kThreads, 1) kernel(Loader src, int64_t T, int64_t K, int E,
    const int32_t* __restrict__ plan, uint8_t* __restrict__ q, float* __restrict__ s, uint8_t* __restrict__ qT,
    float* __restrict__ sT, int64_t col_cap, float* __restrict__ row_extra, int n_stages, const ZeroFill zero) {
  using Raw = typename Loader::Raw;
  constexpr int kStageElems = kBlock * kBlock;  // per input
  constexpr int64_t kStageBytes = stage_bytes<Loader>();
  extern __shared__ __align__(128) unsigned char smem[];
  const Layout layout(E, qT != nullptr, kStageBytes, n_stages);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + Layout::kFull);
  TileInfo* infos = reinterpret_cast<TileInfo*>(smem + Layout::kInfo);
  float* partial = reinterpret_cast<float*>(smem + Layout::kPartial);
  float* mul_hi = reinterpret_cast<float*>(smem + Layout::kMul);
  float* mul_lo = mul_hi + kBlock;
  int32_t* plan_s = reinterpret_cast<int32_t*>(smem + Layout::kPlan);
  uint32_t* col_tile = reinterpret_cast<uint32_t*>(smem + layout.col_tile);
  Raw* stages = reinterpret_cast<Raw*>(smem + layout.stages);

  // The plan is read once per CTA (one coalesced read); tiles are then found in shared memory.
  for (int idx = threadIdx.x; idx < 3 * (E + 1); idx += kThreads) plan_s[idx] = plan[idx];
  if (threadIdx.x == 0) {
    for (int i = 0; i < n_stages; ++i) async_copy::barrier_init(&full[i], kThreads);
    async_copy::fence_barrier_init();
  }
  __syncthreads();
  const int32_t* tok = plan_s;
  const int32_t* col = plan_s + (E + 1);
  const int32_t* blk = plan_s + 2 * (E + 1);
  const int64_t Kb = (K + kBlock - 1) / kBlock;  // output column blocks
  const int64_t s_pitch = row_scale_pitch(T);    // of the row scales (K-major)
  const bool fits = plan_fits(plan_s, E, token_limit(T));  // a foreign plan: as if no tokens (zeros)
  const int64_t covered = fits ? tok[E] : 0;
  const int64_t n_tiles = fits ? int64_t(blk[E]) * Kb : 0;
  const int n_mine = n_tiles > blockIdx.x ? static_cast<int>((n_tiles - blockIdx.x + gridDim.x - 1) / gridDim.x) : 0;
  const int ring = 2 * n_stages;  // info slots
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int half = lane / kLanesPerRow, hl = lane % kLanesPerRow;
  const int g = 2 * warp + half;  // thread (warp w, half h, lane hl): rows 4g .. 4g + 3, columns 8hl .. 8hl + 7

  // Warp 0 finds the CTA's tiles in order and records each in its info slot: the next tile's 128-token
  // block and column block by adding the grid's (no division per tile), the block's owner from the
  // previous tile's.
  int owner = 0;
  const int n_kb = static_cast<int>(Kb > 0 ? Kb : 1), grid_blocks = gridDim.x / n_kb, grid_kb = gridDim.x % n_kb;  // (Kb < 2^31)
  int next_b = blockIdx.x / n_kb, next_kb = blockIdx.x % n_kb;  // (blocks < 2^31: plan values are int32)
  auto find_tile = [&](int slot) {
    const int b = next_b, kb = next_kb;
    next_b += grid_blocks;
    next_kb += grid_kb;
    if (next_kb >= n_kb) next_kb -= n_kb, ++next_b;
    const int e = owner = walk_expert(blk, E, b, owner);
    const int64_t i = b - blk[e];
    const int64_t row0 = tok[e] + i * kBlock;
    if (lane == 0) infos[slot] = TileInfo{row0, b, col[e] + i * kBlock, static_cast<int>(imin64(kBlock, tok[e + 1] - row0)), kb};
  };
  // Every thread's share of the loads of the tile in info slot `slot` into `stage`.
  auto load_tile = [&](int slot, int stage) {
    const TileInfo tile = infos[slot];
    const int64_t k0 = int64_t(tile.kb) * kBlock;
    load_tile_rows<kThreads>(src, stages + int64_t(stage) * (kStageBytes / sizeof(Raw)), tile.row0, tile.nr, k0,
                             static_cast<int>(imin64(kBlock, K - k0)), threadIdx.x);
    async_copy::arrive_when_loaded(&full[stage]);
  };

  if (covered < T) zero_uncovered_rows(covered, T, K, Kb, q, s, row_extra, int64_t(blockIdx.x) * kThreads + threadIdx.x,
                                       int64_t(gridDim.x) * kThreads);
  zero_fill(zero, int64_t(blockIdx.x) * kThreads + threadIdx.x, int64_t(gridDim.x) * kThreads);
  const int n_ahead = n_mine < n_stages ? n_mine : n_stages;
  if (warp == 0)
    for (int j = 0; j < n_ahead; ++j) find_tile(j);
  async_copy::sync_threads(1, kThreads);
  for (int j = 0; j < n_ahead; ++j) load_tile(j, j);

  // Tile j sits in stage j % n_stages (its use number parity = j / n_stages) and info slot j % ring;
  // tile j + n_stages in the same stage and slot (j + n_stages) % ring. Counted, not divided.
  int stage = 0, slot = 0;
  uint32_t parity = 0;
  for (int j = 0; j < n_mine; ++j) {
    const int slot_ahead = slot + n_stages < ring ? slot + n_stages : slot + n_stages - ring;
    if (warp == 0 && j + n_stages < n_mine) find_tile(slot_ahead);  // its loads read it after barrier A
    async_copy::wait(&full[stage], parity);
    const TileInfo tile = infos[slot];
    const int64_t k0 = int64_t(tile.kb) * kBlock;  // of the tile, in the loader's columns
    const int nk = static_cast<int>(imin64(kBlock, K - k0));
    const Raw* staged = stages + int64_t(stage) * (kStageBytes / sizeof(Raw));

    auto compute = [&](auto whole) {
      constexpr bool kWhole = decltype(whole)::value;  // 128 tokens x 128 columns: no bounds to check
      const bool lane_active = kWhole || kVec * hl < nk;  // nk is a multiple of 16
      auto row_in = [&](int r) { return kWhole || r < tile.nr; };

      // Values of the thread's 4 rows from the stage.
      float v[kRows][kVec];
      float extra[kRows];
#pragma unroll
      for (int jr = 0; jr < kRows; ++jr) {
        const int r = kRows * g + jr;
        extra[jr] = 0.f;
        if (row_in(r) && lane_active) {
          const Raw* raw[Loader::kInputs];
#pragma unroll
          for (int in = 0; in < Loader::kInputs; ++in) raw[in] = staged + in * kStageElems + r * kBlock + kVec * hl;
          const float factor = row_factor_of(src, staged, r, k0);
          extra[jr] = src.values(raw, factor, tile.row0 + r, k0 + kVec * hl, v[jr]);
        } else {
#pragma unroll
          for (int c = 0; c < kVec; ++c) v[jr][c] = 0.f;
        }
      }

      if constexpr (Loader::kExtra) {
        // Each row's sum over the tile's columns, lane 4 jr of the half-warp writing row jr's.
        const float sum = scatter_sum4(extra, hl);
        const int r = kRows * g + hl / 4;
        if (row_extra != nullptr && hl % 4 == 0 && row_in(r)) row_extra[(tile.row0 + r) * Kb + tile.kb] = sum;
      }
      // The maxima of each row over the thread's 8 columns and of each column over its 4 rows, in one pass.
      float a[kRows], cmax[kVec];
#pragma unroll
      for (int jr = 0; jr < kRows; ++jr) {
        a[jr] = 0.f;
#pragma unroll
        for (int c = 0; c < kVec; ++c) a[jr] = nan_max(a[jr], fabsf(v[jr][c]));
      }
      if (qT != nullptr) {
#pragma unroll
        for (int c = 0; c < kVec; ++c) {
          cmax[c] = fabsf(v[0][c]);
#pragma unroll
          for (int jr = 1; jr < kRows; ++jr) cmax[c] = nan_max(cmax[c], fabsf(v[jr][c]));
        }
      }
      // Row copy: a half-warp per row block. The 4 rows' maxima are reduced and scattered over the
      // half-warp (lane hl ends with row hl / 4's), each lane makes that row's block scale, and the
      // multipliers go back by shuffles; a warp whose blocks all have normal scales multiplies once per value.
      if (q != nullptr) {
        const float amax = scatter_amax4(a, hl);
        const BlockQuant quant(amax);
        const int mine = hl / 4;  // the row this lane made the scale of
        if (row_in(kRows * g + mine) && hl % 4 == 0) s[tile.kb * s_pitch + tile.row0 + kRows * g + mine] = quant.scale;
        const bool simple = __all_sync(0xffffffffu, quant.mul_lo == 1.f);
        uint8_t* qrow = q + (tile.row0 + kRows * g) * K + k0 + kVec * hl;
        float hi[kRows];
#pragma unroll
        for (int jr = 0; jr < kRows; ++jr) hi[jr] = __shfl_sync(0xffffffffu, quant.mul_hi, (lane & kLanesPerRow) + 4 * jr);
        if (simple) {
#pragma unroll
          for (int jr = 0; jr < kRows; ++jr)
            if (row_in(kRows * g + jr) && lane_active)
              *reinterpret_cast<uint2*>(qrow + jr * K) =
                  make_uint2(pack4_by(hi[jr], {v[jr][0], v[jr][1], v[jr][2], v[jr][3]}),
                             pack4_by(hi[jr], {v[jr][4], v[jr][5], v[jr][6], v[jr][7]}));
        } else {
#pragma unroll
          for (int jr = 0; jr < kRows; ++jr) {
            const BlockQuant row(hi[jr], __shfl_sync(0xffffffffu, quant.mul_lo, (lane & kLanesPerRow) + 4 * jr));
            if (row_in(kRows * g + jr) && lane_active)
              *reinterpret_cast<uint2*>(qrow + jr * K) = make_uint2(row.pack4({v[jr][0], v[jr][1], v[jr][2], v[jr][3]}),
                                                                    row.pack4({v[jr][4], v[jr][5], v[jr][6], v[jr][7]}));
          }
        }
      }

      // Column maxima over the warp's 8 rows: half 0 keeps columns 0-3 of its eight, half 1 columns 4-7,
      // each taking the other half's rows by one shuffle; one 16-byte store per lane.
      if (qT != nullptr) {
        float kept[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const float mine = half ? cmax[4 + c] : cmax[c], theirs = half ? cmax[c] : cmax[4 + c];
          kept[c] = nan_max(mine, __shfl_xor_sync(0xffffffffu, theirs, kLanesPerRow));
        }
        *reinterpret_cast<float4*>(partial + partial_index(warp, kVec * hl) + 4 * half) =
            make_float4(kept[0], kept[1], kept[2], kept[3]);
      }
      // Barrier A. Every thread has read its values: the stage takes the loads of tile j + n_stages.
      async_copy::sync_threads(1, kThreads);
      if (j + n_stages < n_mine) load_tile(slot_ahead, stage);
      if (qT == nullptr) return;  // uniform

      // Column scales: warp w reduces columns 8w .. 8w + 7, lane (quarter qd, column c8) the maxima of
      // warps 4qd .. 4qd + 3, then the four quarters by shuffles.
      {
        const int c8 = lane % kVec, qd = lane / kVec, c = kVec * warp + c8;
        float a = partial[partial_index(4 * qd, c)];
#pragma unroll
        for (int w = 1; w < 4; ++w) a = nan_max(a, partial[partial_index(4 * qd + w, c)]);
        a = nan_max(a, __shfl_xor_sync(0xffffffffu, a, 8));
        a = nan_max(a, __shfl_xor_sync(0xffffffffu, a, 16));
        const BlockQuant quant(a);
        if (qd == 0) {
          mul_hi[c] = quant.mul_hi;
          mul_lo[c] = quant.mul_lo;
          if (kWhole || c < nk) sT[tile.block * K + k0 + c] = quant.scale;
        }
      }
      async_copy::sync_threads(1, kThreads);  // barrier B

      // Column copy: each thread's 4 rows of its 8 columns, one word per column, into the swizzled tile
      // (the thread's 8 columns share one swizzle).
      float hi[kVec], lo[kVec];
      load8(mul_hi + kVec * hl, hi);
      load8(mul_lo + kVec * hl, lo);
      bool normal = true;
#pragma unroll
      for (int c = 0; c < kVec; ++c) normal = normal && lo[c] == 1.f;
      uint32_t* words = col_tile + kVec * hl * (kBlock / 4) + (g ^ col_swizzle(kVec * hl));
      if (__all_sync(0xffffffffu, normal)) {
#pragma unroll
        for (int c = 0; c < kVec; ++c) words[c * (kBlock / 4)] = pack4_by(hi[c], {v[0][c], v[1][c], v[2][c], v[3][c]});
      } else {
#pragma unroll
        for (int c = 0; c < kVec; ++c)
          words[c * (kBlock / 4)] = BlockQuant(hi[c], lo[c]).pack4({v[0][c], v[1][c], v[2][c], v[3][c]});
      }
      async_copy::sync_threads(1, kThreads);  // barrier C

      // ... and out with 16-byte stores, 8 lanes per column line: the tokens rounded up to kColAlign (zeros past nr).
      const int chunks = kWhole ? kBlock / 16 : column_chunks(tile.nr);
#pragma unroll
      for (int it = 0; it < kBlock * (kBlock / 16) / kThreads; ++it) {
        const int idx = it * kThreads + threadIdx.x;
        const int cc = idx / (kBlock / 16), chunk = idx % (kBlock / 16);
        if (!kWhole && (cc >= nk || chunk >= chunks)) continue;
        const int sw = col_swizzle(cc);  // even: whole chunks move (sw / 4), word pairs swap within (sw & 2)
        uint4 w = *reinterpret_cast<const uint4*>(col_tile + cc * (kBlock / 4) + 4 * (chunk ^ (sw >> 2)));
        if (sw & 2) w = make_uint4(w.z, w.w, w.x, w.y);
        *reinterpret_cast<uint4*>(qT + (k0 + cc) * col_cap + tile.qt_col + chunk * 16) = w;
      }
    };
    if (tile.nr == kBlock && nk == kBlock) compute(std::true_type{});
    else compute(std::false_type{});
    if (++stage == n_stages) stage = 0, parity ^= 1;
    if (++slot == ring) slot = 0;
  }
}

// Stages of the ring for a launch: as many as fit next to the rest (at most kMaxStages).
template <class Loader>
int ring_stages(int E, bool cols) {
  const int64_t room = kSharedBytes - Layout(E, cols, stage_bytes<Loader>(), 0).total;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(kMaxStages, room / stage_bytes<Loader>())));
}

// Launches the persistent form over every expert block of the output [T, K] (launch.cuh's launch chooses it).
template <class Loader>
void launch_persistent(const Loader& src, int64_t T, int64_t K, int E, const int32_t* plan, uint8_t* q, float* s,
                       uint8_t* qT, float* sT, float* row_extra, const ZeroFill& zero, cudaStream_t stream,
                       const char* name) {
  const int n_stages = ring_stages<Loader>(E, qT != nullptr);
  const int smem = Layout(E, qT != nullptr, stage_bytes<Loader>(), n_stages).total;
  allow_shared_memory<kernel<Loader>>(kSharedBytes, name);  // once; a launch takes only what it needs
  // Persistent: one CTA per SM of the budget, never more than the tiles there can be.
  const int64_t most_tiles = block_capacity(T, E) * ceil_div(K, kBlock);
  const int64_t grid = std::max<int64_t>(1, std::min<int64_t>(most_tiles, grid_sms()));
  kernel<Loader><<<static_cast<unsigned>(grid), kThreads, smem, stream>>>(src, T, K, E, plan, q, s, qT, sT,
                                                                         col_capacity(T, E), row_extra, n_stages, zero);
  check_launch(name);
}

}  // namespace moegemm::multicast
