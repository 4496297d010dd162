// The per-tile form of the multi-cast quantizer (launch.cuh), tile_kernel: one CTA of 8 warps per tile, up to six
// per SM (see there), for the loaders whose kPerTile says so (16-bit x for quantize_act, an FP8 row copy for
// requantize_cols).
//
// The persistent kernel (persistent.cuh) runs one CTA of 16 warps per SM in lock-step phases between CTA barriers: at 4
// warps per scheduler its barriers and reductions leave the SM idle half the time (docs/performance.md, Quantizers). Here a CTA
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
// values are f16 pairs, else floats with the same arithmetic: 40 registers, 6 CTAs per SM (docs/performance.md,
// Quantizers).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "moegemm.h"
#include "kernels/common/async_copy.cuh"
#include "kernels/common/cuda_check.h"
#include "kernels/common/device.h"
#include "kernels/common/pdl.cuh"
#include "kernels/plan/build.cuh"
#include "kernels/plan/plan.cuh"
#include "kernels/quant/fp8_block.cuh"
#include "kernels/quant/multicast/common.cuh"
#include "kernels/quant/multicast/loaders.cuh"
#include "kernels/quant/tiles.cuh"

namespace moegemm::multicast {

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
// were 1.06x 4 CTAs of 64: docs/performance.md, Quantizers), 4 for bf16 kept as pairs (64) and 3 for the values as floats (80).
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

}  // namespace moegemm::multicast
