// The multi-cast FP8 quantization kernels (docs/design.md#fp8-recipe), generic over where their values come from.
//
// A tile is (expert 128-token block, 128 output columns). Each value is read once and written as the 1x128
// row-block copy q [T, K] + s [T, Kb] (K-major: csrc/moegemm.h, row_scale_pitch) and the per-expert
// transposed 128x1 column-block copy qT [K, col_cap] + sT [NB, K] (either pair may be skipped). Two forms:
//
// Persistent (kernel): one CTA of 16 warps per SM loops over the tiles. Warp 0 finds each tile (no division
// per tile); the warps copy its input rows into a ring of shared-memory stages with 16-byte cp.async (only
// the tile's tokens; the copies complete on the stage's mbarrier), n_stages tiles ahead; then compute the
// tile's values from the stage into registers (4 rows x 8 columns per thread), write the row copy, reduce
// the column maxima through shared memory (every warp taking 8 columns), and write the column copy through
// a swizzled shared-memory tile with full-line stores: three CTA barriers per tile.
// Per tile (tile_kernel): one CTA of 8 warps per tile, up to six per SM (see there); the loaders whose
// kPerTile says so (16-bit x for quantize_act, an FP8 row copy for requantize_cols).
//
// Loaders say what is staged and how values are made of it:
//   PlainLoader<T>        x itself (quantize_act)
//   Fp8RowsLoader         an FP8 row copy, dequantized (requantize_cols: the column copy of an FP8 input)
//   activation loaders    act(h) (* up) * probs and its gradient (activation.cu), so the activation
//                         between the two GEMMs of an expert MLP never goes through memory in bf16.
// A loader has kInputs staged inputs of element type Raw; for a tile's columns [k0, k0 + nk) it names up
// to two column segments of each input (segments) and the start of a row of it (row_start); with kRowFactor
// it has one fp32 factor per row of a tile (its row_factor(k0), row r's at [r]: the router probs, an FP8 row
// copy's scales of the tile's column block, or null for none), staged beside the inputs so that no global load
// sits among the values; from the staged rows and the row's factor (1 without
// one) it computes eight values (values; Fp8RowsLoader one value of a row's staged bytes: value). It may also return a per-element "extra" whose per-row sums over
// each tile are written to row_extra [T, Kb]: the probs gradient of the activation backward (a GLU's forward, and
// its backward with F % 128 == 0, have kernels of their own: glu_forward.cuh, glu_backward.cuh).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "moegemm.h"
#include "kernels/common/async_copy.cuh"
#include "kernels/common/cuda_check.h"
#include "kernels/common/device.h"
#include "kernels/common/pdl.cuh"
#include "kernels/quant/fp8_block.cuh"
#include "kernels/quant/tiles.cuh"
#include "kernels/plan/build.cuh"
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
template <>
__device__ __forceinline__ void load8(const __nv_bfloat16* p, float (&v)[kVec]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  unpack_bf16x8(raw, v);
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
  static constexpr bool kExtra = false;
  static constexpr bool kPerTile = sizeof(T) == 2;  // (fp32: slower per tile on the small-experts shape)
  static constexpr bool kRowFactor = false;
  const T* x;
  int64_t K;
  __device__ __forceinline__ int segments(int, int64_t k0, int nk, Segment (&seg)[2]) const {
    seg[0] = {k0, 0, nk};
    return 1;
  }
  __device__ __forceinline__ const T* row_start(int, int64_t row) const { return x + row * K; }
  __device__ __forceinline__ float values(const T* const (&raw)[kInputs], float, int64_t, int64_t, float (&v)[kVec]) const {
    load8(raw[0], v);
    return 0.f;
  }
};

// Values of an FP8 row copy q [T, K] (e4m3) with its 1x128 row scales s (quantize_act's rows, K-major with
// row pitch `pitch`: csrc/moegemm.h, row_scale_pitch),
// dequantized: q * s is exact in fp32 (4 significant bits times a power of two), so the column copy is
// the one quantize_act would make of the fp32 tensor of dequantized values. A tile's columns are one scale
// block, so its rows' scales are its row factors (contiguous in s: K-major), staged with the rows.
struct Fp8RowsLoader {
  using Raw = uint8_t;
  static constexpr int kInputs = 1;
  static constexpr bool kExtra = false;
  static constexpr bool kPerTile = true;    // (measured faster per tile; the only form: tile_kernel keeps the bytes)
  static constexpr bool kRowFactor = true;  // the row scales
  const uint8_t* q;
  const float* s;
  int64_t K, pitch;
  __device__ __forceinline__ int segments(int, int64_t k0, int nk, Segment (&seg)[2]) const {
    seg[0] = {k0, 0, nk};
    return 1;
  }
  __device__ __forceinline__ const uint8_t* row_start(int, int64_t row) const { return q + row * K; }
  __device__ __forceinline__ const float* row_factor(int64_t k0) const { return s + k0 / kBlock * pitch; }
  // Value i of a row's eight staged bytes, times the row's scale (in place of values(): the per-tile kernel keeps
  // the bytes and decodes each value where it is used).
  static __device__ __forceinline__ float value(const uint2& bytes, float scale, int i) {
    const uint32_t word = i < 4 ? bytes.x : bytes.y;
    const uint32_t h = i / 2 % 2 ? f16x2_of_e4m3x2<1>(word) : f16x2_of_e4m3x2<0>(word);  // exact
    return (i % 2 ? f16_hi(h) : f16_lo(h)) * scale;
  }
};

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

// A reduction (op) of each of 4 rows over a half-warp, reduced and scattered: lane hl returns row hl / 4's (5
// shuffles instead of 16). Each result is a half-warp butterfly's (xor 8, 4, 2, 1) to the bit: the same pairs are
// combined at each step of the same tree (op commutative). Every lane of the warp must call it.
template <class Op>
__device__ __forceinline__ float scatter_reduce4(const float (&a)[kRows], int hl, Op op) {
  const bool hi8 = hl & 8, hi4 = hl & 4;
  // lanes with bit 3 keep rows 2, 3 and send rows 0, 1 to their partner; the others the opposite
  const float k0 = op(hi8 ? a[2] : a[0], __shfl_xor_sync(0xffffffffu, hi8 ? a[0] : a[2], 8));
  const float k1 = op(hi8 ? a[3] : a[1], __shfl_xor_sync(0xffffffffu, hi8 ? a[1] : a[3], 8));
  float m = op(hi4 ? k1 : k0, __shfl_xor_sync(0xffffffffu, hi4 ? k0 : k1, 4));  // row 2 * bit3 + bit2
  m = op(m, __shfl_xor_sync(0xffffffffu, m, 2));
  return op(m, __shfl_xor_sync(0xffffffffu, m, 1));
}
// The rows' maxima (NaN-propagating) and sums.
__device__ __forceinline__ float scatter_amax4(const float (&a)[kRows], int hl) {
  return scatter_reduce4(a, hl, [](float x, float y) { return nan_max(x, y); });
}
__device__ __forceinline__ float scatter_sum4(const float (&a)[kRows], int hl) {
  return scatter_reduce4(a, hl, [](float x, float y) { return x + y; });
}

// Bytes of one stage of the ring: the loader's staged inputs, 128 x 128 elements each, then (kRowFactor) the
// tile's 128 row factors.
template <class Loader>
constexpr int64_t staged_input_bytes() {
  return int64_t(Loader::kInputs) * kBlock * kBlock * sizeof(typename Loader::Raw);
}
template <class Loader>
constexpr int64_t stage_bytes() {
  return staged_input_bytes<Loader>() + (Loader::kRowFactor ? kBlock * 4 : 0);
}
// The row factors of a stage (kRowFactor), row r of the tile at [r] (const as the stage is).
template <class Loader, class Raw>
__device__ __forceinline__ auto staged_factors(Raw* stage) {
  using Float = std::conditional_t<std::is_const_v<Raw>, const float, float>;
  return reinterpret_cast<Float*>(stage + staged_input_bytes<Loader>() / sizeof(Raw));
}
// The factor row r of a staged tile (columns from k0) takes: its staged factor, or 1 (no factor).
template <class Loader>
__device__ __forceinline__ float row_factor_of(const Loader& src, const typename Loader::Raw* stage, int r, int64_t k0) {
  if constexpr (Loader::kRowFactor) {
    if (src.row_factor(k0) != nullptr) return staged_factors<Loader>(stage)[r];
  }
  return 1.f;
}

// Every thread's share of the loads of a tile's nr tokens from row0, the loader's columns [k0, k0 + nk), into
// `stage` (kInputs inputs of 128 x 128): 16-byte chunk c of rows r0, r0 + kThreads / (chunks per row), ...
// (a chunk's columns lie in at most one segment of each input); with kRowFactor, thread r < nr the factor of
// row r (4 bytes: a tile's first row is any token).
template <int kThreads, class Loader>
__device__ __forceinline__ void load_tile_rows(const Loader& src, typename Loader::Raw* stage, int64_t row0, int nr,
                                               int64_t k0, int nk, int tid) {
  constexpr int kPerCopy = 16 / sizeof(typename Loader::Raw);  // elements per 16-byte copy
  constexpr int kChunksPerRow = kBlock / kPerCopy, kRowStep = kThreads / kChunksPerRow;
  const int cc = kPerCopy * (tid % kChunksPerRow), r0 = tid / kChunksPerRow;
#pragma unroll
  for (int in = 0; in < Loader::kInputs; ++in) {
    Segment seg[2];
    const int nseg = src.segments(in, k0, nk, seg);
    int64_t from = -1;
#pragma unroll
    for (int x = 0; x < 2; ++x)  // (constant indices: the segments stay in registers)
      if (x < nseg && cc >= seg[x].dst && cc < seg[x].dst + seg[x].n) from = seg[x].src + (cc - seg[x].dst);
    if (from < 0) continue;
    // One row's address, then a step per kRowStep rows (no 64-bit product per copy).
    const typename Loader::Raw* g = src.row_start(in, row0 + r0) + from;
    const int64_t step = src.row_start(in, row0 + r0 + kRowStep) - src.row_start(in, row0 + r0);
    typename Loader::Raw* d = stage + in * kBlock * kBlock + r0 * kBlock + cc;
    for (int r = r0; r < nr; r += kRowStep, g += step, d += kRowStep * kBlock) async_copy::load16(d, g);
  }
  if constexpr (Loader::kRowFactor) {
    static_assert(kThreads >= kBlock, "a thread per row of the tile");
    const float* factor = src.row_factor(k0);
    if (factor != nullptr && tid < nr)
      async_copy::load4(staged_factors<Loader>(stage) + tid, factor + row0 + tid);
  }
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

// ---- The per-tile form: one CTA of 8 warps per tile, several CTAs per SM ----
//
// The persistent kernel above runs one CTA of 16 warps per SM in lock-step phases between CTA barriers: at 4
// warps per scheduler its barriers and reductions leave the SM idle half the time (bench/NOTES.md). Here a CTA
// takes one tile and leaves, so that several CTAs share an SM and one's barriers and loads overlap another's
// work (the weight quantizer's form). A CTA stages its tile by 16-byte cp.async (its row factors by 4-byte ones), then
//   row pass: 4 rows x 8 columns per thread at a time, two row groups (16 rows per warp): the row copy, and
//             the thread's column maxima over both groups -> per-warp maxima in shared memory  | barrier
//   column scales, 2 threads per column                                                        | barrier
//   column pass: the values read again from the stage (no registers held across the barriers),
//             quantized into the swizzled FP8 column tile                                      | barrier
//   the column tile out to qT.
// bf16 staged as is (PlainLoader<bf16>) keeps its values as packed pairs until they are quantized: the row
// and column maxima are taken on the pairs (exact: a maximum of bf16 values is one of them). An FP8 row copy
// (Fp8RowsLoader) keeps each row's eight bytes and its scale, decoded where a value is used, and makes no row copy;
// where the tile's row scales allow (Fp8Window: quantize_act's powers of two within 2^14 of each other) its
// values are f16 pairs, else floats with the same arithmetic: 40 registers, 6 CTAs per SM (bench/NOTES.md,
// thirty-seventh, thirty-eighth and forty-third sessions).

// Which loaders take the per-tile form (their kPerTile, set where it was measured faster): one staged input, one
// output block, no per-row extra.
template <class Loader>
constexpr bool per_tile() {
  return Loader::kPerTile && !Loader::kExtra && Loader::kInputs == 1;
}

constexpr int kTileWarps = 8;
constexpr int kTileThreads = kTileWarps * 32;                // 256
constexpr int kTileGroups = kBlock / kRows;                  // 32 groups of 4 rows
constexpr int kTilePasses = kTileGroups / (2 * kTileWarps);  // 2 groups per thread

// How a per-tile CTA keeps a row's eight values (columns 8 hl .. 8 hl + 7) between the stage and the quantizer:
// as floats from the loader, as the staged bf16 pairs (PlainLoader<bf16>), or as the staged e4m3 bytes and the
// row's scale (Fp8RowsLoader), decoded where used. The two staged forms take fewer registers: more CTAs per SM.
enum class Kept { kFloats, kBf16Pairs, kFp8Bytes };
template <class Loader>
constexpr Kept kept_form() {
  if constexpr (std::is_same_v<Loader, PlainLoader<__nv_bfloat16>>) return Kept::kBf16Pairs;
  else if constexpr (std::is_same_v<Loader, Fp8RowsLoader>) return Kept::kFp8Bytes;
  else return Kept::kFloats;
}

// A row's eight values, and the column maxima over a thread's rows.
template <Kept kForm>
struct Row8;
template <>
struct Row8<Kept::kFloats> {
  float v[kVec];
  __device__ __forceinline__ float at(int i) const { return v[i]; }
  __device__ __forceinline__ float amax() const {
    float a = fabsf(v[0]);
#pragma unroll
    for (int i = 1; i < kVec; ++i) a = nan_max(a, fabsf(v[i]));
    return a;
  }
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int i = 0; i < kVec; ++i) v[i] = 0.f;
  }
};
template <>
struct Row8<Kept::kBf16Pairs> {
  uint32_t w[kVec / 2];
  __device__ __forceinline__ float at(int i) const { return i % 2 ? bf16_hi(w[i / 2]) : bf16_lo(w[i / 2]); }
  __device__ __forceinline__ float amax() const {
    const uint32_t m = abs_max_bf16x2(abs_max_bf16x2(w[0], w[1]), abs_max_bf16x2(w[2], w[3]));
    return nan_max(fabsf(bf16_lo(m)), fabsf(bf16_hi(m)));
  }
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int i = 0; i < kVec / 2; ++i) w[i] = 0u;
  }
};
template <>
struct Row8<Kept::kFp8Bytes> {
  uint2 bytes;
  float scale;
  __device__ __forceinline__ float at(int i) const { return Fp8RowsLoader::value(bytes, scale, i); }
  __device__ __forceinline__ void zero() { bytes = make_uint2(0u, 0u), scale = 0.f; }
};
template <Kept kForm>
struct ColMax8 {  // (the floats and the FP8 bytes: on the values)
  float m[kVec];
  __device__ __forceinline__ ColMax8() {
#pragma unroll
    for (int i = 0; i < kVec; ++i) m[i] = 0.f;
  }
  __device__ __forceinline__ void fold(const Row8<kForm>& r) {
#pragma unroll
    for (int i = 0; i < kVec; ++i) m[i] = nan_max(m[i], fabsf(r.at(i)));
  }
  __device__ __forceinline__ float get(int i) const { return m[i]; }
};
template <>
struct ColMax8<Kept::kBf16Pairs> {  // on the pairs
  uint32_t m[kVec / 2];
  __device__ __forceinline__ ColMax8() {
#pragma unroll
    for (int i = 0; i < kVec / 2; ++i) m[i] = 0u;
  }
  __device__ __forceinline__ void fold(const Row8<Kept::kBf16Pairs>& r) {
#pragma unroll
    for (int i = 0; i < kVec / 2; ++i) m[i] = abs_max_bf16x2(m[i], r.w[i]);
  }
  __device__ __forceinline__ float get(int i) const { return fabsf(i % 2 ? bf16_hi(m[i / 2]) : bf16_lo(m[i / 2])); }
};

// An FP8 row copy's tile on f16 pairs (the per-tile kernel of requantize_cols). When every row scale of the tile is
// a power of two 2^e_r (quantize_act's always are) with the e_r at most 14 below their largest, eS, and every
// dequantized value q * 2^e_r a normal float (-117 <= e_r <= 118), a row's values are kept as the f16 pairs
// y = q * 2^(e_r - eS), exact: e4m3 is a subset of f16 and 2^(e_r - eS) >= 2^-14 keeps the lowest bit of the smallest
// e4m3 subnormal (2^-9) at or above f16's smallest subnormal (2^-24). So a column's maximum is 2^eS times its f16
// maximum, the same float as the maximum of the dequantized values, and the column copy's byte is e4m3(y * F_c) with
// F_c = 2^eS * mul_hi_c (a normal column block, mul_lo 1), which is exact too: F_c > 1/2 when the column has a
// nonzero value (its scale is at most twice its maximum over 448), so every nonzero product keeps its lowest bit
// above 2^-24. Columns of zeros (F_c = 2^eS, at most 2^15 here) or NaNs (mul_hi = 0: F_c = 0) come out as before;
// a column whose F_c exceeds f16 (2^15; only one whose values all lie below 2^-6 of the tile's largest row scale)
// sends its whole tile down the fp32 path, as does any other row scale.
struct Fp8Window {
  bool on = false;
  uint32_t top = 0;  // eS's fp32 exponent field
  // The f16 ratio 2^(e_r - eS) of row scale s (in the window) in the low half of the result.
  __device__ __forceinline__ uint32_t ratio(float s) const { return ((__float_as_uint(s) >> 23) + 15u - top) << 10; }
  __device__ __forceinline__ float largest() const { return __uint_as_float(top << 23); }  // 2^eS
  // F = 2^eS * mul as an f16 (mul 0 or a normal power of two; 0 below f16's subnormals); false beyond f16.
  __device__ __forceinline__ bool factor(float mul, uint32_t& f16) const {
    const int e = static_cast<int>(top + (__float_as_uint(mul) >> 23)) - 254;
    f16 = mul == 0.f || e < -24 ? 0u : e < -14 ? 1u << (e + 24) : static_cast<uint32_t>(e + 15) << 10;
    return mul == 0.f || e <= 15;
  }
};
// The window of a staged tile's nr row scales, the same in every thread (every thread must call it).
__device__ __forceinline__ Fp8Window fp8_window(const float* scales, int nr) {
  const int lane = threadIdx.x % 32;
  uint32_t top = 0, low = 255, fraction = 0;
#pragma unroll
  for (int i = 0; i < kBlock / 32; ++i) {
    const int r = lane + 32 * i;
    if (r < nr) {
      const uint32_t bits = __float_as_uint(scales[r]);  // (a sign bit puts the field past 255: outside)
      fraction |= bits & 0x7fffffu;
      top = max(top, bits >> 23);
      low = min(low, bits >> 23);
    }
  }
  top = __reduce_max_sync(0xffffffffu, top);
  low = __reduce_min_sync(0xffffffffu, low);
  Fp8Window w;
  w.on = __reduce_or_sync(0xffffffffu, fraction) == 0 && low >= 127 - 117 && top <= 127 + 118 && top - low <= 14;
  w.top = top;
  return w;
}

// The shared memory of a per-tile CTA: the column multipliers (and an FP8 row copy's f16 factor pairs and its rows'
// f16 ratios in pairs, for the column pass: Fp8Window), the FP8 column tile (when the column copy is made), then the
// stage. The per-warp column maxima lie in the column tile's first 4 KB (only a tile with a column copy takes them):
// they are read before the barrier after which the column pass writes the tile.
struct TileLayout {
  static constexpr int kMul = 0;                                   // [2][128] floats
  static constexpr int kFactor16 = kMul + 2 * kBlock * 4;          // [128] f16 pairs
  static constexpr int kRatio2 = kFactor16 + kBlock * 4;           // [64] f16 pairs
  static constexpr int kColTile = kRatio2 + kBlock * 2;
  static constexpr int kPartial = kColTile;                        // [8 warps][128] floats
  static_assert(kTileWarps * kBlock * 4 <= kColTileBytes, "the column maxima fit in the column tile");
  int stage, total;
  constexpr __host__ __device__ TileLayout(bool cols, int64_t stage_bytes)
      : stage(kColTile + (cols ? kColTileBytes : 0)), total(stage + int(stage_bytes)) {}
};
template <class Loader>
constexpr __host__ __device__ TileLayout tile_layout(bool cols) {
  return TileLayout(cols, stage_bytes<Loader>());
}

// CTAs of the per-tile form per SM: as many as their shared memory allows, at most 6 for an FP8 row copy (40 registers a
// thread, 48 bytes of spills outside the passes; 1.017x its 5 CTAs of 48 registers on the memory-bound table, which
// were 1.06x 4 CTAs of 64: bench/NOTES.md), 4 for bf16 kept as pairs (64) and 3 for the values as floats (80).
template <class Loader>
constexpr int tile_ctas_per_sm() {
  constexpr Kept kForm = kept_form<Loader>();
  constexpr int64_t per_cta = tile_layout<Loader>(true).total + 1024;  // (1 KB reserved per CTA)
  constexpr int64_t fit = 228 * 1024 / per_cta, most = kForm == Kept::kFloats ? 3 : kForm == Kept::kFp8Bytes ? 6 : 4;
  static_assert(kForm != Kept::kFp8Bytes || fit >= most, "an FP8 row copy's six CTAs fit");
  return fit < 1 ? 1 : static_cast<int>(fit > most ? most : fit);
}

// Where warp w's maximum of column c sits: row w, rotated by 16 columns for warps 4..7, so that a warp reading
// 16 columns of warps 0..3 and of warps 4..7 meets 32 different banks.
__device__ __forceinline__ int tile_partial_index(int w, int c) { return w * kBlock + (c + 16 * (w / 4)) % kBlock; }

// A CTA's tile is (128-token block tile_block(), column block blockIdx.x): tile_grid; CTAs past the plan's blocks
// only zero their share of the uncovered rows. With build.plan set, each CTA
// derives the plan from m_splits itself (a scan of the counts instead of the given plan's check) and CTA 0
// writes it to build.plan for the kernels after this one: the plan needs no launch of its own.
template <class Loader>
__global__ void __launch_bounds__(kTileThreads, tile_ctas_per_sm<Loader>()) tile_kernel(Loader src, int64_t T,
    int64_t K, int E, const int32_t* __restrict__ plan, uint8_t* __restrict__ q, float* __restrict__ s,
    uint8_t* __restrict__ qT, float* __restrict__ sT, int64_t col_cap, const PlanBuild build, const ZeroFill zero) {
  using Raw = typename Loader::Raw;
  static_assert(per_tile<Loader>(), "the per-tile form takes one staged input and makes one output block");
  constexpr Kept kForm = kept_form<Loader>();
  constexpr bool kPacked = kForm == Kept::kBf16Pairs;  // (quantized as pairs too)
  constexpr int kStageElems = kBlock * kBlock;  // per input
  extern __shared__ __align__(128) unsigned char smem[];
  const TileLayout layout = tile_layout<Loader>(qT != nullptr);
  float* partial = reinterpret_cast<float*>(smem + TileLayout::kPartial);
  float* mul_hi = reinterpret_cast<float*>(smem + TileLayout::kMul);
  float* mul_lo = mul_hi + kBlock;
  uint32_t* factor16 = reinterpret_cast<uint32_t*>(smem + TileLayout::kFactor16);
  uint32_t* ratio2 = reinterpret_cast<uint32_t*>(smem + TileLayout::kRatio2);
  uint32_t* col_tile = reinterpret_cast<uint32_t*>(smem + TileLayout::kColTile);
  Raw* staged = reinterpret_cast<Raw*>(smem + layout.stage);

  grid_wait();  // (launched dependent: nothing read or written before)
  grid_release();
  const int64_t Kb = (K + kBlock - 1) / kBlock;  // column blocks = tile columns
  const unsigned tid = threadIdx.x;
  const int b = tile_block(), kb = static_cast<int>(blockIdx.x);  // (blocks < 2^31: plan values are int32)
  const int64_t cta = tile_cta();
  const int64_t k0 = int64_t(kb) * kBlock;
  const int nk = static_cast<int>(imin64(kBlock, K - k0));
  TileSpot spot;
  bool fits = true;
  int64_t covered = 0;
  if (build.plan != nullptr) {
    // The plan derived here: made by the scan, it fits by construction.
    __shared__ PlanEntry owner;
    const PlanTotals totals = scan_plan<kTileThreads>(build.m_splits, build.m_is_int64, E, T, [&](const PlanEntry& x) {
      if (cta == 0) write_plan_entry(x, E, build.plan);
      if (x.blk0 <= b && b < x.blk1) owner = x;  // one expert owns block b < blk[E]
    });
    __syncthreads();
    if (Kb > 0 && b < totals.blk) spot = tile_spot(b, owner.tok0, owner.tok1, owner.col0, owner.blk0, T);
    covered = totals.tok;
    if (spot.has_tile) load_tile_rows<kTileThreads>(src, staged, spot.row0, spot.nr, k0, nk, tid);
  } else {
    const Found found = find_tile(b, Kb > 0, E, T, plan, [&](const TileSpot& at) {
      load_tile_rows<kTileThreads>(src, staged, at.row0, at.nr, k0, nk, tid);
    });
    spot = found.spot;
    fits = found.fits;
    covered = found.covered;
  }
  const bool has_tile = spot.has_tile;
  const int64_t row0 = spot.row0, qt_col = spot.qt_col;
  const int nr = spot.nr;
  if (covered < T) zero_uncovered_rows(covered, T, K, Kb, q, s, nullptr, cta * kTileThreads + tid,
                                       tile_ctas() * kTileThreads);
  zero_fill(zero, cta * kTileThreads + tid, tile_ctas() * kTileThreads);
  async_copy::wait_all();  // (also before leaving: no copy may land after the CTA)
  if (!fits || !has_tile) return;
  __syncthreads();
  Fp8Window window;  // (an FP8 row copy's: its values as f16 pairs where the tile allows)
  if constexpr (kForm == Kept::kFp8Bytes) window = fp8_window(staged_factors<Loader>(staged), nr);

  const int warp = tid / 32, lane = tid % 32;
  const int half = lane / kLanesPerRow, hl = lane % kLanesPerRow;
  auto compute = [&](auto whole) {
    constexpr bool kWhole = decltype(whole)::value;  // 128 tokens x 128 columns: no bounds to check
    const bool lane_active = kWhole || kVec * hl < nk;  // nk is a multiple of 16
    auto row_in = [&](int r) { return kWhole || r < nr; };
    // Rows 4g .. 4g + 3 (thread's columns) from the stage; zeros outside the tile.
    auto values = [&](int g, Row8<kForm> (&v)[kRows]) {
#pragma unroll
      for (int jr = 0; jr < kRows; ++jr) {
        const int r = kRows * g + jr;
        if (row_in(r) && lane_active) {
          Raw* at = staged + r * kBlock + kVec * hl;  // input `in` at at + in * kStageElems
          if constexpr (kPacked) {
            const uint4 w = *reinterpret_cast<const uint4*>(at);
            v[jr].w[0] = w.x; v[jr].w[1] = w.y; v[jr].w[2] = w.z; v[jr].w[3] = w.w;
          } else if constexpr (kForm == Kept::kFp8Bytes) {
            v[jr].bytes = *reinterpret_cast<const uint2*>(at);
            v[jr].scale = row_factor_of(src, staged, r, k0);
          } else {
            const Raw* raw[Loader::kInputs];
#pragma unroll
            for (int in = 0; in < Loader::kInputs; ++in) raw[in] = at + in * kStageElems;
            src.values(raw, row_factor_of(src, staged, r, k0), row0 + r, k0 + kVec * hl, v[jr].v);
          }
        } else {
          v[jr].zero();
        }
      }
    };
    auto group = [&](int p) { return (kTileGroups / kTilePasses) * p + 2 * warp + half; };
    // An FP8 row copy's rows 4g .. 4g + 3 (thread's columns) as staged and, unless `ratio` is null, their f16 ratios
    // (Fp8Window); zeros outside.
    auto fp8_rows = [&](int g, uint2 (&bytes)[kRows], uint32_t* ratio) {
#pragma unroll
      for (int jr = 0; jr < kRows; ++jr) {
        const int r = kRows * g + jr;
        const bool in = row_in(r) && lane_active;
        bytes[jr] = in ? *reinterpret_cast<const uint2*>(staged + r * kBlock + kVec * hl) : make_uint2(0u, 0u);
        if (ratio != nullptr) ratio[jr] = in ? window.ratio(staged_factors<Loader>(staged)[r]) : 0u;
      }
    };

    // Row pass (an FP8 row copy makes none: launch_tiles).
    constexpr bool kRowCopy = kForm != Kept::kFp8Bytes;
    ColMax8<kForm> cmax;
    bool folded = false;
    if constexpr (kForm == Kept::kFp8Bytes) {
      if (window.on) {  // the column maxima on f16 pairs
        uint32_t top2[kVec / 2] = {0u, 0u, 0u, 0u};
#pragma unroll 1
        for (int p = 0; p < kTilePasses; ++p) {
          uint2 bytes[kRows];
          uint32_t ratio[kRows];
          fp8_rows(group(p), bytes, ratio);
#pragma unroll
          for (int jr = 0; jr < kRows; ++jr) {
            const uint32_t r2 = ratio[jr] * 0x10001u;
#pragma unroll
            for (int i = 0; i < kVec / 2; ++i) {
              const uint32_t word = i < 2 ? bytes[jr].x : bytes[jr].y;
              const uint32_t pair = i % 2 ? f16x2_of_e4m3x2<1>(word) : f16x2_of_e4m3x2<0>(word);
              top2[i] = abs_max_f16x2(top2[i], mul_f16x2(pair, r2));
            }
          }
        }
        const float largest = window.largest();
#pragma unroll
        for (int i = 0; i < kVec / 2; ++i) {
          cmax.m[2 * i] = fabsf(f16_lo(top2[i])) * largest;
          cmax.m[2 * i + 1] = fabsf(f16_hi(top2[i])) * largest;
        }
        folded = true;
      }
    }
    float* s_block = s + kb * row_scale_pitch(T) + row0;
#pragma unroll 1
    for (int p = 0; p < kTilePasses && !folded; ++p) {
      const int g = group(p);
      Row8<kForm> v[kRows];
      values(g, v);
      float a[kRows];
#pragma unroll
      for (int jr = 0; jr < kRows; ++jr) {
        if constexpr (kRowCopy) a[jr] = v[jr].amax();
        if (qT != nullptr) cmax.fold(v[jr]);
      }
      if (kRowCopy && q != nullptr) {  // as the persistent kernel's row copy
        const float amax = scatter_amax4(a, hl);
        const BlockQuant quant(amax);
        const int mine = hl / 4;
        if (row_in(kRows * g + mine) && hl % 4 == 0) s_block[kRows * g + mine] = quant.scale;
        const bool simple = __all_sync(0xffffffffu, quant.mul_lo == 1.f);
        uint8_t* qrow = q + (row0 + kRows * g) * K + k0 + kVec * hl;
        float hi[kRows];
#pragma unroll
        for (int jr = 0; jr < kRows; ++jr) hi[jr] = __shfl_sync(0xffffffffu, quant.mul_hi, (lane & kLanesPerRow) + 4 * jr);
        if (simple) {
#pragma unroll
          for (int jr = 0; jr < kRows; ++jr) {
            uint2 bytes;
            if constexpr (kPacked) {
              const uint32_t m = bf16x2_of(hi[jr], hi[jr]);
              uint32_t x[kVec / 2];
#pragma unroll
              for (int i = 0; i < kVec / 2; ++i) x[i] = mul_bf16x2(v[jr].w[i], m);
              bytes = make_uint2(e4m3x2_of(bf16_lo(x[0]), bf16_hi(x[0])) | e4m3x2_of(bf16_lo(x[1]), bf16_hi(x[1])) << 16,
                                 e4m3x2_of(bf16_lo(x[2]), bf16_hi(x[2])) | e4m3x2_of(bf16_lo(x[3]), bf16_hi(x[3])) << 16);
            } else {
              bytes = make_uint2(pack4_by(hi[jr], {v[jr].at(0), v[jr].at(1), v[jr].at(2), v[jr].at(3)}),
                                 pack4_by(hi[jr], {v[jr].at(4), v[jr].at(5), v[jr].at(6), v[jr].at(7)}));
            }
            if (row_in(kRows * g + jr) && lane_active) *reinterpret_cast<uint2*>(qrow + jr * K) = bytes;
          }
        } else {
#pragma unroll
          for (int jr = 0; jr < kRows; ++jr) {
            const BlockQuant row(hi[jr], __shfl_sync(0xffffffffu, quant.mul_lo, (lane & kLanesPerRow) + 4 * jr));
            if (row_in(kRows * g + jr) && lane_active)
              *reinterpret_cast<uint2*>(qrow + jr * K) =
                  make_uint2(row.pack4({v[jr].at(0), v[jr].at(1), v[jr].at(2), v[jr].at(3)}),
                             row.pack4({v[jr].at(4), v[jr].at(5), v[jr].at(6), v[jr].at(7)}));
          }
        }
      }
    }
    if (qT == nullptr) return;  // uniform

    // The warp's column maxima (half 0 keeps columns 0-3 of its eight, half 1 columns 4-7).
    {
      float kept[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const float mine = half ? cmax.get(4 + c) : cmax.get(c), theirs = half ? cmax.get(c) : cmax.get(4 + c);
        kept[c] = nan_max(mine, __shfl_xor_sync(0xffffffffu, theirs, kLanesPerRow));
      }
      *reinterpret_cast<float4*>(partial + tile_partial_index(warp, kVec * hl) + 4 * half) =
          make_float4(kept[0], kept[1], kept[2], kept[3]);
    }
    __syncthreads();
    // Column scales: thread c < 128 (warps 0-3) takes column c's maxima of the 8 warps; warps 4-7 wait (4 and 5 stage
    // an FP8 row copy's row ratios for its column pass on f16 pairs).
    bool f16_cols = false;  // (uniform)
    {
      [[maybe_unused]] bool column_fits = true;  // (an FP8 row copy's)
      if (tid < kBlock) {
        const int c = tid;
        float a = partial[tile_partial_index(0, c)];
#pragma unroll
        for (int w = 1; w < kTileWarps; ++w) a = nan_max(a, partial[tile_partial_index(w, c)]);
        const BlockQuant quant(a);
        mul_hi[c] = quant.mul_hi;
        mul_lo[c] = quant.mul_lo;
        if (kWhole || c < nk) sT[int64_t(b) * K + k0 + c] = quant.scale;
        if constexpr (kForm == Kept::kFp8Bytes) {  // and the f16 factors, where every column has one
          if (window.on) {
            uint32_t f16 = 0u;
            column_fits = quant.mul_lo == 1.f && window.factor(quant.mul_hi, f16);
            factor16[c] = f16 * 0x10001u;
          }
        }
      } else if constexpr (kForm == Kept::kFp8Bytes) {  // warps 4 and 5: the rows' f16 ratios, in pairs
        const int pr = tid - kBlock;  // rows 2 pr, 2 pr + 1 (0 past the tile's rows)
        if (window.on && pr < kBlock / 2) {
          const float* sf = staged_factors<Loader>(staged);
          const uint32_t first = 2 * pr < nr ? window.ratio(sf[2 * pr]) : 0u;
          const uint32_t second = 2 * pr + 1 < nr ? window.ratio(sf[2 * pr + 1]) : 0u;
          ratio2[pr] = first | second << 16;
        }
      }
      if constexpr (kForm == Kept::kFp8Bytes) f16_cols = __syncthreads_and(window.on && column_fits);
      else __syncthreads();
    }
    // One word (4 rows) of column c into the swizzled column tile.
    auto store_words = [&](int g, const uint32_t (&word)[kVec]) {
      uint32_t* words = col_tile + kVec * hl * (kBlock / 4) + (g ^ col_swizzle(kVec * hl));
#pragma unroll
      for (int c = 0; c < kVec; ++c) words[c * (kBlock / 4)] = word[c];
    };
    // Column pass of an FP8 row copy on f16 pairs: the bytes of two rows interleaved so that each 16-bit pair holds
    // one column's two rows, decoded, times the rows' ratios and the column's factor, and each word's two FP8 pairs
    // made in place (rows 4g, 4g + 1 in its low half).
    if constexpr (kForm == Kept::kFp8Bytes) {
      if (f16_cols) {
        uint32_t factor[kVec];
        {
          const uint4 f0 = *reinterpret_cast<const uint4*>(factor16 + kVec * hl);
          const uint4 f1 = *reinterpret_cast<const uint4*>(factor16 + kVec * hl + 4);
          factor[0] = f0.x; factor[1] = f0.y; factor[2] = f0.z; factor[3] = f0.w;
          factor[4] = f1.x; factor[5] = f1.y; factor[6] = f1.z; factor[7] = f1.w;
        }
#pragma unroll 1
        for (int p = 0; p < kTilePasses; ++p) {
          const int g = group(p);
          uint2 bytes[kRows];
          fp8_rows(g, bytes, nullptr);  // (the ratios: staged above, in pairs)
          uint32_t word[kVec];
          const uint2 rr = *reinterpret_cast<const uint2*>(ratio2 + 2 * g);  // rows 4g, 4g + 1 | 4g + 2, 4g + 3
#pragma unroll
          for (int rp = 0; rp < 2; ++rp) {  // rows 4g + 2rp, 4g + 2rp + 1
            const uint32_t r2 = rp ? rr.y : rr.x;
#pragma unroll
            for (int x = 0; x < 2; ++x) {  // columns 4x .. 4x + 3
              const uint32_t lo = x ? bytes[2 * rp].y : bytes[2 * rp].x, hi = x ? bytes[2 * rp + 1].y : bytes[2 * rp + 1].x;
              const uint32_t cols[2] = {__byte_perm(lo, hi, 0x5140), __byte_perm(lo, hi, 0x7362)};  // 4x, 4x+1 | 4x+2, 4x+3
#pragma unroll
              for (int j = 0; j < 4; ++j) {
                const int c = 4 * x + j;
                const uint32_t pair = j % 2 ? f16x2_of_e4m3x2<1>(cols[j / 2]) : f16x2_of_e4m3x2<0>(cols[j / 2]);
                const uint32_t y = mul_f16x2(mul_f16x2(pair, r2), factor[c]);
                const uint32_t e = e4m3x2_of_f16x2(y);
                word[c] = rp ? word[c] | e << 16 : e;
              }
            }
          }
          store_words(g, word);
        }
      }
    }
    // Column pass: the values again.
    if (!f16_cols) {
      float hi[kVec];
      load8(mul_hi + kVec * hl, hi);
      bool normal = true;
#pragma unroll
      for (int c = 0; c < kVec; ++c) normal = normal && mul_lo[kVec * hl + c] == 1.f;
      const bool simple = __all_sync(0xffffffffu, normal);
#pragma unroll 1
      for (int p = 0; p < kTilePasses; ++p) {
        const int g = group(p);
        Row8<kForm> v[kRows];
        values(g, v);
        uint32_t word[kVec];
        if (simple) {
          if constexpr (kPacked) {
#pragma unroll
            for (int i = 0; i < kVec / 2; ++i) {  // columns 2i, 2i + 1: the halves of word i of each row
              const uint32_t m = bf16x2_of(hi[2 * i], hi[2 * i + 1]);
              uint32_t x[kRows];
#pragma unroll
              for (int jr = 0; jr < kRows; ++jr) x[jr] = mul_bf16x2(v[jr].w[i], m);
              word[2 * i] = e4m3x2_of(bf16_lo(x[0]), bf16_lo(x[1])) | e4m3x2_of(bf16_lo(x[2]), bf16_lo(x[3])) << 16;
              word[2 * i + 1] = e4m3x2_of(bf16_hi(x[0]), bf16_hi(x[1])) | e4m3x2_of(bf16_hi(x[2]), bf16_hi(x[3])) << 16;
            }
          } else {
#pragma unroll
            for (int c = 0; c < kVec; ++c) word[c] = pack4_by(hi[c], {v[0].at(c), v[1].at(c), v[2].at(c), v[3].at(c)});
          }
        } else {
#pragma unroll
          for (int c = 0; c < kVec; ++c)
            word[c] = BlockQuant(hi[c], mul_lo[kVec * hl + c]).pack4({v[0].at(c), v[1].at(c), v[2].at(c), v[3].at(c)});
        }
        store_words(g, word);
      }
    }
    __syncthreads();
    // ... and out with 16-byte stores, 8 lanes per column line: thread t writes chunk t % 8 of columns
    // t / 8 + 32 i (the column tile's swizzle folded: chunk ^ (cc / 16), word pairs swapped when cc / 8 is
    // odd), the tokens rounded up to kColAlign (zeros past nr).
    {
      const int chunk = tid % 8, c0 = tid / 8;
      const bool swap = (c0 / 8) % 2;
      const int chunks = kWhole ? kBlock / 16 : column_chunks(nr);
      uint8_t* dst = qT + (k0 + c0) * col_cap + qt_col + chunk * 16;
#pragma unroll
      for (int it = 0; it < kBlock / 32; ++it) {
        const int cc = c0 + 32 * it;
        if (kWhole || (cc < nk && chunk < chunks)) {
          uint4 w = *reinterpret_cast<const uint4*>(col_tile + cc * (kBlock / 4) + 4 * (chunk ^ (cc / 16)));
          if (swap) w = make_uint4(w.z, w.w, w.x, w.y);
          *reinterpret_cast<uint4*>(dst) = w;
        }
        dst += 32 * col_cap;
      }
    }
  };
  if (nr == kBlock && nk == kBlock) compute(std::true_type{});
  else compute(std::false_type{});
}

// Launches the per-tile form over every (expert block, column block) the buffers can hold.
template <class Loader>
void launch_tiles(const Loader& src, int64_t T, int64_t K, int E, const int32_t* plan, uint8_t* q, float* s, uint8_t* qT,
                  float* sT, const PlanBuild& build, const ZeroFill& zero, cudaStream_t stream, const char* name) {
  if (kept_form<Loader>() == Kept::kFp8Bytes && q != nullptr)
    throw std::runtime_error(std::string("moegemm: ") + name + ": an FP8 row copy is requantized into columns only");
  const int smem = tile_layout<Loader>(qT != nullptr).total;
  allow_shared_memory<tile_kernel<Loader>>(tile_layout<Loader>(true).total, name);
  launch_dependent(tile_kernel<Loader>, tile_grid(block_capacity(T, E), ceil_div(K, kBlock)), kTileThreads, smem, stream,
                   name, src, T, K, E, plan, q, s, qT, sT, col_capacity(T, E), build, zero);
}

// Stages of the ring for a launch: as many as fit next to the rest (at most kMaxStages).
template <class Loader>
int ring_stages(int E, bool cols) {
  const int64_t room = kSharedBytes - Layout(E, cols, stage_bytes<Loader>(), 0).total;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(kMaxStages, room / stage_bytes<Loader>())));
}

// Launches the multi-cast kernel over every expert block of the output [T, K] (K = output columns): the
// per-tile form for the loaders that take it, else the persistent one.
// With build.plan set (to `plan`, for these E and T), the plan is built first: by the per-tile form's CTAs
// themselves (see tile_kernel), else (or when there is nothing to quantize) by make_plan's kernel. `zero` (ZeroFill):
// zeroed by the kernel's threads, or by a memset when there is nothing to quantize.
template <class Loader>
void launch(const Loader& src, int64_t T, int64_t K, int E, const int32_t* plan, uint8_t* q, float* s, uint8_t* qT,
            float* sT, float* row_extra, const PlanBuild& build, const ZeroFill& zero, cudaStream_t stream, const char* name) {
  const bool builds = build.plan != nullptr;
  const bool nothing = T == 0 || (q == nullptr && qT == nullptr && row_extra == nullptr);
  if (builds) check_plan_size(build.E, build.T, name);
  if (builds && (nothing || !per_tile<Loader>())) make_plan(build.m_splits, build.m_is_int64, build.E, build.T, build.plan, stream);
  if (nothing) {
    if (zero.count > 0) check_cuda(cudaMemsetAsync(zero.words, 0, sizeof(int32_t) * zero.count, stream), name);
    return;
  }
  if constexpr (per_tile<Loader>()) {
    launch_tiles(src, T, K, E, plan, q, s, qT, sT, build, zero, stream, name);
  } else {
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
}

}  // namespace moegemm::multicast
