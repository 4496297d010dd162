// The multi-cast FP8 quantization kernel (docs/design.md#fp8-recipe), generic over where its values come from.
//
// A tile is (expert 128-token block, 128 output columns); persistent CTAs, one per SM, loop over the
// tiles. Each value is read once and written as the 1x128 row-block copy q [T, K] + s [T, Kb] (K-major:
// csrc/moegemm.h, row_scale_pitch) and the per-expert transposed 128x1 column-block copy qT [K, col_cap] +
// sT [NB, K] (either pair may be skipped).
//
// Pipeline: warp 0 finds each tile (no division per tile); the CTA's 16 warps copy its input rows into a
// ring of shared-memory stages with 16-byte cp.async (only the tile's tokens; the copies complete on the
// stage's mbarrier), n_stages tiles ahead; then compute the tile's values from the stage into registers
// (4 rows x 8 columns per thread), write the row copy, reduce the column maxima through shared memory
// (every warp taking 8 columns), and write the column copy through a swizzled shared-memory tile with
// full-line stores: three CTA barriers per tile (see kernel).
//
// Loaders say what is staged and how values are made of it:
//   PlainLoader<T>        x itself (quantize_act)
//   Fp8RowsLoader         an FP8 row copy, dequantized (requantize_cols: the column copy of an FP8 input)
//   activation loaders    act(h) (* up) * probs and its gradient (activation.cu), so the activation
//                         between the two GEMMs of an expert MLP never goes through memory in bf16.
// A loader has kInputs staged inputs of element type Raw; for a tile's columns [k0, k0 + nk) it names up
// to two column segments of each input (segments) and the start of a row of it (row_start); from the
// staged rows it computes eight values of each of its kOut output blocks (values): with kOut = 2 a tile
// makes output blocks kt and Kt + kt of the K = 2 Kt * 128 output columns (the two halves of a GLU
// gradient from one read of its inputs). It may also return a per-element "extra" whose per-row sums
// over each tile are written to row_extra [T, Kb] at the first output block (zeros at the second): the
// probs gradient of the activation backward.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "moegemm.h"
#include "kernels/common/async_copy.cuh"
#include "kernels/common/cuda_check.h"
#include "kernels/common/device.h"
#include "kernels/quant/fp8_block.cuh"
#include "kernels/plan/plan.cuh"

namespace moegemm::multicast {

constexpr int kWarps = 16;                       // one CTA per SM
constexpr int kThreads = kWarps * 32;            // 512
constexpr int kVec = 8;                          // values per lane: columns 8 hl .. 8 hl + 7 of a row
constexpr int kLanesPerRow = kBlock / kVec;      // 16: a half-warp covers a 128-column row block
constexpr int kRows = 4;                         // rows per thread: group g = 2 warp + half owns 4g .. 4g + 3
constexpr int kMaxStages = 8;
constexpr int kSharedBytes = 227 * 1024;         // an sm_90 CTA's shared memory (all of it dynamic here)
constexpr int kColTileBytes = kBlock * kBlock;   // the FP8 column tile, 128 columns of 128 rows

// Columns [src, src + n) of an input land at columns [dst, dst + n) of its staged tile (n a multiple of 16).
struct Segment {
  int64_t src;
  int dst, n;
};

// Eight consecutive values as floats (one 16-byte load for 16-bit types, two for fp32).
template <typename T>
__device__ __forceinline__ void load8(const T* p, float (&v)[kVec]);
// bf16 -> fp32 is a 16-bit shift: the low half moves up, the high half keeps its place (one instruction each).
template <>
__device__ __forceinline__ void load8(const __nv_bfloat16* p, float (&v)[kVec]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = __uint_as_float(w[i] << 16);
    v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
template <>
__device__ __forceinline__ void load8(const __half* p, float (&v)[kVec]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(h[i]);
    v[2 * i] = f.x; v[2 * i + 1] = f.y;
  }
}
template <>
__device__ __forceinline__ void load8(const float* p, float (&v)[kVec]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

// Eight staged values in their stage type (exact for the loaders' types).
__device__ __forceinline__ void store8(float* p, const float (&v)[kVec]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}
template <typename T>
__device__ __forceinline__ void store8(T* p, const float (&v)[kVec]) {
  union { T h[kVec]; uint4 u; } pack;
#pragma unroll
  for (int i = 0; i < kVec; ++i) pack.h[i] = static_cast<T>(v[i]);
  *reinterpret_cast<uint4*>(p) = pack.u;
}

// Values of x [T, K] as they are (staged in their own type).
template <typename T>
struct PlainLoader {
  using Raw = T;
  static constexpr int kInputs = 1;
  static constexpr int kOut = 1;
  static constexpr bool kExtra = false;
  const T* x;
  int64_t K;
  __device__ __forceinline__ int segments(int, int64_t k0, int nk, Segment (&seg)[2]) const {
    seg[0] = {k0, 0, nk};
    return 1;
  }
  __device__ __forceinline__ const T* row_start(int, int64_t row) const { return x + row * K; }
  __device__ __forceinline__ float values(const T* const (&raw)[kInputs], int64_t, int64_t, float (&v)[kVec]) const {
    load8(raw[0], v);
    return 0.f;
  }
};

// Values of an FP8 row copy q [T, K] (e4m3) with its 1x128 row scales s (quantize_act's rows, K-major with
// row pitch `pitch`: csrc/moegemm.h, row_scale_pitch),
// dequantized: q * s is exact in fp32 (4 significant bits times a power of two), so the column copy is
// the one quantize_act would make of the fp32 tensor of dequantized values.
struct Fp8RowsLoader {
  using Raw = uint8_t;
  static constexpr int kInputs = 1;
  static constexpr int kOut = 1;
  static constexpr bool kExtra = false;
  const uint8_t* q;
  const float* s;
  int64_t K, pitch;
  __device__ __forceinline__ int segments(int, int64_t k0, int nk, Segment (&seg)[2]) const {
    seg[0] = {k0, 0, nk};
    return 1;
  }
  __device__ __forceinline__ const uint8_t* row_start(int, int64_t row) const { return q + row * K; }
  __device__ __forceinline__ float values(const uint8_t* const (&raw)[kInputs], int64_t row, int64_t k,
                                          float (&v)[kVec]) const {
    const uint2 bytes = *reinterpret_cast<const uint2*>(raw[0]);
    const float scale = s[k / kBlock * pitch + row];
    const __nv_fp8x2_storage_t* pairs = reinterpret_cast<const __nv_fp8x2_storage_t*>(&bytes);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pairs[i], __NV_E4M3)));  // exact
      v[2 * i] = f.x * scale;
      v[2 * i + 1] = f.y * scale;
    }
    return 0.f;
  }
};

__device__ __forceinline__ int64_t imin64(int64_t a, int64_t b) { return a < b ? a : b; }

__device__ __forceinline__ float warp_amax(float a) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) a = nan_max(a, __shfl_xor_sync(0xffffffffu, a, o));
  return a;
}

__device__ __forceinline__ float warp_sum(float a) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
  return a;
}

// Sum within each half-warp (one row block each); every lane of the warp must call it.
__device__ __forceinline__ float half_sum(float a) {
#pragma unroll
  for (int o = kLanesPerRow / 2; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
  return a;
}

// Maxima of 4 rows over a half-warp, reduced and scattered: lane hl returns row hl / 4's (5 shuffles
// instead of 16). Every lane of the warp must call it.
__device__ __forceinline__ float scatter_amax4(const float (&a)[kRows], int hl) {
  const bool hi8 = hl & 8, hi4 = hl & 4;
  // lanes with bit 3 keep rows 2, 3 and send rows 0, 1 to their partner; the others the opposite
  const float k0 = nan_max(hi8 ? a[2] : a[0], __shfl_xor_sync(0xffffffffu, hi8 ? a[0] : a[2], 8));
  const float k1 = nan_max(hi8 ? a[3] : a[1], __shfl_xor_sync(0xffffffffu, hi8 ? a[1] : a[3], 8));
  float m = nan_max(hi4 ? k1 : k0, __shfl_xor_sync(0xffffffffu, hi4 ? k0 : k1, 4));  // row 2 * bit3 + bit2
  m = nan_max(m, __shfl_xor_sync(0xffffffffu, m, 2));
  return nan_max(m, __shfl_xor_sync(0xffffffffu, m, 1));
}

// Owner of 128-token block b (find_expert's answer) given the owner `from` of an earlier block: the
// warp tests the next 32 experts at once. Every lane of the warp calls it with the same arguments.
__device__ __forceinline__ int walk_expert(const int32_t* blk, int E, int64_t b, int from) {
  const int lane = threadIdx.x % 32;
  for (;;) {
    const int c = from + 1 + lane;
    const unsigned later = __ballot_sync(0xffffffffu, c < E && blk[c] <= b);  // a prefix: blk is sorted
    from += __popc(later);
    if (later != 0xffffffffu) return from;
  }
}

// Bytes of one stage of the ring: the loader's staged inputs, 128 x 128 elements each.
template <class Loader>
constexpr int64_t stage_bytes() {
  return int64_t(Loader::kInputs) * kBlock * kBlock * sizeof(typename Loader::Raw);
}

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

// The FP8 column tile: column c (128 bytes = 32 words, one per 4 rows) holds word w at w ^ swz(c), so that
// the 32 lanes of a warp writing words of 16 columns x 2 row groups hit 32 different banks, and 8 lanes
// reading one column's 16-byte chunks hit 8 different ones.
__device__ __forceinline__ int col_swizzle(int c) { return 2 * (c / kVec); }

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
    float* __restrict__ sT, int64_t col_cap, float* __restrict__ row_extra, int n_stages) {
  using Raw = typename Loader::Raw;
  constexpr int kOut = Loader::kOut;
  constexpr int kStageElems = kBlock * kBlock;  // per input
  constexpr int64_t kStageBytes = stage_bytes<Loader>();
  constexpr int kPerCopy = 16 / sizeof(Raw);    // elements per 16-byte copy
  constexpr int kChunksPerRow = kBlock / kPerCopy;
  constexpr int kRowStep = kThreads / kChunksPerRow;
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
  const int64_t Kt = Kb / kOut;                  // tile columns
  const bool fits = plan_fits(plan_s, E, token_limit(T));  // a foreign plan: as if no tokens (zeros)
  const int64_t covered = fits ? tok[E] : 0;
  const int64_t n_tiles = fits ? int64_t(blk[E]) * Kt : 0;
  const int n_mine = n_tiles > blockIdx.x ? static_cast<int>((n_tiles - blockIdx.x + gridDim.x - 1) / gridDim.x) : 0;
  const int ring = 2 * n_stages;  // info slots
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int half = lane / kLanesPerRow, hl = lane % kLanesPerRow;
  const int g = 2 * warp + half;  // thread (warp w, half h, lane hl): rows 4g .. 4g + 3, columns 8hl .. 8hl + 7

  // Warp 0 finds the CTA's tiles in order and records each in its info slot: the next tile's 128-token
  // block and column block by adding the grid's (no division per tile), the block's owner from the
  // previous tile's.
  int owner = 0;
  const int kt = static_cast<int>(Kt > 0 ? Kt : 1), grid_blocks = gridDim.x / kt, grid_kb = gridDim.x % kt;  // (Kt < 2^31)
  int next_b = blockIdx.x / kt, next_kb = blockIdx.x % kt;  // (blocks < 2^31: plan values are int32)
  auto find_tile = [&](int slot) {
    const int b = next_b, kb = next_kb;
    next_b += grid_blocks;
    next_kb += grid_kb;
    if (next_kb >= kt) next_kb -= kt, ++next_b;
    const int e = owner = walk_expert(blk, E, b, owner);
    const int64_t i = b - blk[e];
    const int64_t row0 = tok[e] + i * kBlock;
    if (lane == 0) infos[slot] = TileInfo{row0, b, col[e] + i * kBlock, static_cast<int>(imin64(kBlock, tok[e + 1] - row0)), kb};
  };
  // Every thread's share of the loads of the tile in info slot `slot` into `stage`: 16-byte chunk c of rows
  // r0, r0 + kRowStep, ... of the tile (a chunk's columns lie in at most one segment of each input).
  auto load_tile = [&](int slot, int stage) {
    const TileInfo tile = infos[slot];
    const int64_t k0 = int64_t(tile.kb) * kBlock;
    const int nk = static_cast<int>(imin64(kBlock, K / kOut - k0));
    const int cc = kPerCopy * (threadIdx.x % kChunksPerRow), r0 = threadIdx.x / kChunksPerRow;
    Raw* dst = stages + int64_t(stage) * (kStageBytes / sizeof(Raw)) + cc;
#pragma unroll
    for (int in = 0; in < Loader::kInputs; ++in) {
      Segment seg[2];
      const int nseg = src.segments(in, k0, nk, seg);
      int64_t from = -1;
#pragma unroll
      for (int x = 0; x < 2; ++x)  // (constant indices: the segments stay in registers)
        if (x < nseg && cc >= seg[x].dst && cc < seg[x].dst + seg[x].n) from = seg[x].src + (cc - seg[x].dst);
      if (from < 0) continue;
      for (int r = r0; r < tile.nr; r += kRowStep)
        async_copy::load16(dst + in * kStageElems + r * kBlock, src.row_start(in, tile.row0 + r) + from);
    }
    async_copy::arrive_when_loaded(&full[stage]);
  };

  if (covered < T) zero_uncovered_rows(covered, T, K, Kb, q, s, row_extra, int64_t(blockIdx.x) * kThreads + threadIdx.x,
                                       int64_t(gridDim.x) * kThreads);
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
    const int nk = static_cast<int>(imin64(kBlock, K / kOut - k0));
    const Raw* staged = stages + int64_t(stage) * (kStageBytes / sizeof(Raw));

    auto compute = [&](auto whole) {
      constexpr bool kWhole = decltype(whole)::value;  // 128 tokens x 128 columns: no bounds to check
      const bool lane_active = kWhole || kVec * hl < nk;  // nk is a multiple of 16
      auto row_in = [&](int r) { return kWhole || r < tile.nr; };

      // Values of the thread's 4 rows from the stage.
      float v[kOut][kRows][kVec];
      float extra[kRows];
#pragma unroll
      for (int jr = 0; jr < kRows; ++jr) {
        const int r = kRows * g + jr;
        extra[jr] = 0.f;
        if (row_in(r) && lane_active) {
          const Raw* raw[Loader::kInputs];
#pragma unroll
          for (int in = 0; in < Loader::kInputs; ++in) raw[in] = staged + in * kStageElems + r * kBlock + kVec * hl;
          if constexpr (kOut == 1) extra[jr] = src.values(raw, tile.row0 + r, k0 + kVec * hl, v[0][jr]);
          else extra[jr] = src.values(raw, tile.row0 + r, k0 + kVec * hl, v[0][jr], v[1][jr]);
        } else {
#pragma unroll
          for (int c = 0; c < kVec; ++c)
#pragma unroll
            for (int ob = 0; ob < kOut; ++ob) v[ob][jr][c] = 0.f;
        }
      }

      if constexpr (Loader::kExtra) {
#pragma unroll
        for (int jr = 0; jr < kRows; ++jr) {
          const int r = kRows * g + jr;
          const float sum = half_sum(extra[jr]);
          if (row_extra != nullptr && row_in(r) && hl == 0) {
            row_extra[(tile.row0 + r) * Kb + tile.kb] = sum;
            if (kOut == 2) row_extra[(tile.row0 + r) * Kb + Kt + tile.kb] = 0.f;
          }
        }
      }
#pragma unroll
      for (int ob = 0; ob < kOut; ++ob) {
        const float (&vo)[kRows][kVec] = v[ob];
        const int64_t kb_out = tile.kb + ob * Kt, k0_out = kb_out * kBlock;
        // The maxima of each row over the thread's 8 columns and of each column over its 4 rows: in one pass
        // for one output block (registers to spare); for two, the column maxima after the row copy.
        float a[kRows], cmax[kVec];
        auto column_maxima = [&] {
#pragma unroll
          for (int c = 0; c < kVec; ++c) {
            cmax[c] = fabsf(vo[0][c]);
#pragma unroll
            for (int jr = 1; jr < kRows; ++jr) cmax[c] = nan_max(cmax[c], fabsf(vo[jr][c]));
          }
        };
#pragma unroll
        for (int jr = 0; jr < kRows; ++jr) {
          a[jr] = 0.f;
#pragma unroll
          for (int c = 0; c < kVec; ++c) a[jr] = nan_max(a[jr], fabsf(vo[jr][c]));
        }
        if (kOut == 1 && qT != nullptr) column_maxima();
        // Row copy: a half-warp per row block. The 4 rows' maxima are reduced and scattered over the
        // half-warp (lane hl ends with row hl / 4's), each lane makes that row's block scale, and the
        // multipliers go back by shuffles; a warp whose blocks all have normal scales multiplies once per value.
        if (q != nullptr) {
          const float amax = scatter_amax4(a, hl);
          const BlockQuant quant(amax);
          const int mine = hl / 4;  // the row this lane made the scale of
          if (row_in(kRows * g + mine) && hl % 4 == 0) s[kb_out * s_pitch + tile.row0 + kRows * g + mine] = quant.scale;
          const bool simple = __all_sync(0xffffffffu, quant.mul_lo == 1.f);
          uint8_t* qrow = q + (tile.row0 + kRows * g) * K + k0_out + kVec * hl;
          float hi[kRows];
#pragma unroll
          for (int jr = 0; jr < kRows; ++jr) hi[jr] = __shfl_sync(0xffffffffu, quant.mul_hi, (lane & kLanesPerRow) + 4 * jr);
          if (simple) {
#pragma unroll
            for (int jr = 0; jr < kRows; ++jr)
              if (row_in(kRows * g + jr) && lane_active)
                *reinterpret_cast<uint2*>(qrow + jr * K) =
                    make_uint2(pack4_by(hi[jr], {vo[jr][0], vo[jr][1], vo[jr][2], vo[jr][3]}),
                               pack4_by(hi[jr], {vo[jr][4], vo[jr][5], vo[jr][6], vo[jr][7]}));
          } else {
#pragma unroll
            for (int jr = 0; jr < kRows; ++jr) {
              const BlockQuant row(hi[jr], __shfl_sync(0xffffffffu, quant.mul_lo, (lane & kLanesPerRow) + 4 * jr));
              if (row_in(kRows * g + jr) && lane_active)
                *reinterpret_cast<uint2*>(qrow + jr * K) = make_uint2(row.pack4({vo[jr][0], vo[jr][1], vo[jr][2], vo[jr][3]}),
                                                                      row.pack4({vo[jr][4], vo[jr][5], vo[jr][6], vo[jr][7]}));
            }
          }
        }

        // Column maxima over the warp's 8 rows: half 0 keeps columns 0-3 of its eight, half 1 columns 4-7,
        // each taking the other half's rows by one shuffle; one 16-byte store per lane.
        if (qT != nullptr) {
          if (kOut == 2) column_maxima();
          float kept[4];
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const float mine = half ? cmax[4 + c] : cmax[c], theirs = half ? cmax[c] : cmax[4 + c];
            kept[c] = nan_max(mine, __shfl_xor_sync(0xffffffffu, theirs, kLanesPerRow));
          }
          *reinterpret_cast<float4*>(partial + partial_index(warp, kVec * hl) + 4 * half) =
              make_float4(kept[0], kept[1], kept[2], kept[3]);
        }
        // Barrier A. Every thread has read its values: at the last output block's (when the others' values
        // no longer hold registers), the stage takes the loads of tile j + n_stages.
        if (ob == kOut - 1 || qT != nullptr) async_copy::sync_threads(1, kThreads);
        if (ob == kOut - 1 && j + n_stages < n_mine) load_tile(slot_ahead, stage);
        if (qT == nullptr) continue;  // uniform (the same for every output block)

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
            if (kWhole || c < nk) sT[tile.block * K + k0_out + c] = quant.scale;
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
          for (int c = 0; c < kVec; ++c) words[c * (kBlock / 4)] = pack4_by(hi[c], {vo[0][c], vo[1][c], vo[2][c], vo[3][c]});
        } else {
#pragma unroll
          for (int c = 0; c < kVec; ++c)
            words[c * (kBlock / 4)] = BlockQuant(hi[c], lo[c]).pack4({vo[0][c], vo[1][c], vo[2][c], vo[3][c]});
        }
        async_copy::sync_threads(1, kThreads);  // barrier C

        // ... and out with 16-byte stores, 8 lanes per column line: the tokens rounded up to 16 (zeros past nr).
        const int chunks = kWhole ? kBlock / kColAlign : (tile.nr + kColAlign - 1) / kColAlign;
#pragma unroll
        for (int it = 0; it < kBlock * (kBlock / 16) / kThreads; ++it) {
          const int idx = it * kThreads + threadIdx.x;
          const int cc = idx / (kBlock / 16), chunk = idx % (kBlock / 16);
          if (!kWhole && (cc >= nk || chunk >= chunks)) continue;
          const int sw = col_swizzle(cc);  // even: whole chunks move (sw / 4), word pairs swap within (sw & 2)
          uint4 w = *reinterpret_cast<const uint4*>(col_tile + cc * (kBlock / 4) + 4 * (chunk ^ (sw >> 2)));
          if (sw & 2) w = make_uint4(w.z, w.w, w.x, w.y);
          *reinterpret_cast<uint4*>(qT + (k0_out + cc) * col_cap + tile.qt_col + chunk * 16) = w;
        }
      }
    };
    // (Two output blocks take the checked path only: the second path's code would push the paired GLU
    // gradient, 64 values per thread, into spills.)
    if (kOut == 1 && tile.nr == kBlock && nk == kBlock) compute(std::true_type{});
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

// Launches the multi-cast kernel over every expert block of the output [T, K] (K = output columns).
template <class Loader>
void launch(const Loader& src, int64_t T, int64_t K, int E, const int32_t* plan, uint8_t* q, float* s, uint8_t* qT,
            float* sT, float* row_extra, cudaStream_t stream, const char* name) {
  if (T == 0) return;
  const int n_stages = ring_stages<Loader>(E, qT != nullptr);
  const int smem = Layout(E, qT != nullptr, stage_bytes<Loader>(), n_stages).total;
  allow_shared_memory<kernel<Loader>>(kSharedBytes, name);  // once; a launch takes only what it needs
  // Persistent: one CTA per SM, never more than the tiles there can be.
  const int64_t most_tiles = block_capacity(T, E) * ceil_div(K, kBlock);
  const int64_t grid = std::max<int64_t>(1, std::min<int64_t>(most_tiles, sm_count()));
  kernel<Loader><<<static_cast<unsigned>(grid), kThreads, smem, stream>>>(src, T, K, E, plan, q, s, qT, sT,
                                                                         col_capacity(T, E), row_extra, n_stages);
  check_launch(name);
}

}  // namespace moegemm::multicast
