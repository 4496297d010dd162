// The pieces of the per-tile GLU kernels (glu_forward.cuh, glu_backward.cuh), which quantize a tile of 128 tokens
// x 128 columns in two passes over shared memory, one CTA of 8 warps per tile, several per SM. The CTA stages its
// inputs by 16-byte cp.async (the 16-byte chunks of a row swizzled: chunk_at), then
//   row pass     8 lanes a row, 16 columns a lane: the row's values, written in place over the chunks they were
//                made of, its scale by an 8-lane reduction and its 16 FP8 bytes as one 16-byte store (8 lanes =
//                a 128-byte line); rows past the tile's tokens get zeros there, for the column pass   | barrier
//   column pass  8 lanes a column pair, 16 rows a lane: the pair's column scales by an 8-lane reduction, each
//                column's 16 FP8 bytes as one 16-byte store (8 lanes = a 128-byte line of the column copy).
// No value is held across the barrier, no shared tile transposes the column copy and the column maxima need no
// shared memory. (TransformerEngine's blockwise cast-transpose reads its tile in the same two passes.)
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "moegemm.h"
#include "kernels/quant/fp8_block.cuh"
#include "kernels/quant/tiles.cuh"

namespace moegemm::two_pass {

constexpr int kThreads = 256;
constexpr int kRowLanes = 8;                        // lanes per row in the row pass
constexpr int kLaneCols = kBlock / kRowLanes;       // 16 columns a lane
constexpr int kRowsPerPass = kThreads / kRowLanes;  // 32 rows at a time
constexpr int kSegRows = kBlock / 8;                // 16 rows a lane in the column pass
constexpr int kChunks = kBlock * 2 / 16;            // 16-byte chunks of a staged row (128 bf16)
constexpr int kInputBytes = kBlock * kBlock * 2;    // one staged bf16 input, 32 KB

// Where chunk c of staged row r lies (in chunks from the input's start): c ^ (c >> 3) puts a row pass lane's
// chunks 2l and 2l + 1 (l = 0..7) in 8 different bank groups each, and the XOR with the row's 16-row band puts
// the column pass's 8 lanes of a pair (rows 16 apart) in 8 different ones: every access meets 32 banks.
__device__ __forceinline__ int chunk_at(int r, int c) { return r * kChunks + (c ^ (c >> 3) ^ ((r / kSegRows) % 8)); }

// The larger magnitude of a bf16 pair, as a float (NaN if either is).
__device__ __forceinline__ float abs_max_of(uint32_t w) {
  return nan_max(fabsf(bf16_lo(w)), fabsf(bf16_hi(w)));
}

// The maximum over the 8 lanes l ^ 1, l ^ 2, l ^ 4 (a row's lanes, or a column pair's segments).
__device__ __forceinline__ float amax8(float a) {
#pragma unroll
  for (int o = 1; o < 8; o <<= 1) a = nan_max(a, __shfl_xor_sync(0xffffffffu, a, o));
  return a;
}

// 16 bf16 values (8 words) -> 16 e4m3 bytes with the block's multipliers; with `simple` (mul_lo == 1, a normal
// scale) the pairs are scaled in bf16 first (exact: fp8_block.cuh, mul_bf16x2) and then converted.
__device__ __forceinline__ uint4 quantize16(const uint32_t (&w)[8], float hi, float lo, bool simple) {
  uint32_t out[4];
  if (simple) {
    const uint32_t m = bf16x2_of(hi, hi);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t x0 = mul_bf16x2(w[2 * i], m), x1 = mul_bf16x2(w[2 * i + 1], m);
      out[i] = e4m3x2_of(bf16_lo(x0), bf16_hi(x0)) |
               e4m3x2_of(bf16_lo(x1), bf16_hi(x1)) << 16;
    }
  } else {
    const BlockQuant quant(hi, lo);
#pragma unroll
    for (int i = 0; i < 4; ++i)
      out[i] = quant.pack4({bf16_lo(w[2 * i]), bf16_hi(w[2 * i]), bf16_lo(w[2 * i + 1]),
                            bf16_hi(w[2 * i + 1])});
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// 16 fp32 values -> 16 e4m3 bytes (pack4_by with one multiplier when simple, as the multi-cast kernels do).
__device__ __forceinline__ uint4 quantize16(const float (&v)[16], float hi, float lo, bool simple) {
  uint32_t out[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    out[i] = simple ? pack4_by(hi, {v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]})
                    : BlockQuant(hi, lo).pack4({v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]});
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// One row block's scale and FP8 bytes from the amax of a lane's 16 values (every lane of the warp calls it; the
// 8 lanes of a row reduce it): the scale to *scale_at where `scale` (the row's lane 0 of a row of the tile), the
// lane's bytes to *q_at where `store` (a row of the tile, the lane's columns inside it).
template <class Values>
__device__ __forceinline__ void row_block(const Values& v, float amax, bool scale, bool store, float* scale_at,
                                          uint8_t* q_at) {
  const BlockQuant quant(amax8(amax));
  if (scale) *scale_at = quant.scale;
  const bool simple = __all_sync(0xffffffffu, quant.mul_lo == 1.f);
  const uint4 bytes = quantize16(v, quant.mul_hi, quant.mul_lo, simple);
  if (store) *reinterpret_cast<uint4*>(q_at) = bytes;
}

// A launch's host-side check: the tile columns F a multiple of 16 (the kernels' 8-column loads and 16-column lanes).
// (Any tile count: tile_grid.)
inline void check_launch_size(int64_t F, const char* name) {
  if (F % kDimAlign != 0) throw std::runtime_error(std::string("moegemm: ") + name + ": ffn must be a multiple of 16");
}

}  // namespace moegemm::two_pass
