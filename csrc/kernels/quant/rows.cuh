// x's FP8 row copy made by the threads of a kernel whose main work comes after it: the fused prologue of the
// ragged-row GEMM (csrc/kernels/gemm/sm90/fp8_ragged_rows.cuh). Every row is quantized: on the rows a plan covers
// these are quantize_act's bytes (csrc/moegemm.h), while quantize_act zeroes the rows past them.
// Every (row, 128-column block) segment is quantized on its own amax (docs/design.md#fp8-recipe): a half-warp
// per segment, 8 values per lane; a warp takes 2 * kUnroll rows of one K block (their scales neighbours in their
// K-major row, csrc/moegemm.h row_scale_pitch), consecutive warps the next K blocks of the same rows (so that
// the grid reads whole rows at a time, not a column stripe of many rows: DRAM pages).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "moegemm.h"
#include "kernels/quant/fp8_block.cuh"

namespace moegemm::rows {

constexpr int kVec = 8;                      // values per lane
constexpr int kLanesPerSegment = kBlock / kVec;  // 16: a half-warp per 128-column segment
constexpr int kUnroll = 8;                   // segments per half-warp whose loads are in flight together

constexpr int kRowsPerGroup = 2 * kUnroll;

// The work items of x [T, K]: groups of kRowsPerGroup consecutive rows and one K block.
__host__ __device__ inline int64_t groups(int64_t T, int64_t K) {
  return (K + kBlock - 1) / kBlock * ((T + kRowsPerGroup - 1) / kRowsPerGroup);
}

// The FP8 row copy of x [T, K] bf16 (K a multiple of 16): q [T, K] e4m3, s K-major [Kb, row_scale_pitch(T)]. The
// warps `warp`, `warp` + `warps`, ... of the caller's grid (all 32 lanes of each call it) take the groups below
// `end` (of groups(T, K)), K block fastest.
__device__ __forceinline__ void quantize_bf16(const __nv_bfloat16* x, int64_t T, int64_t K, uint8_t* q, float* s, int64_t warp,
                                              int64_t warps, int64_t end) {
  const int lane = threadIdx.x % 32, half = lane / kLanesPerSegment, hl = lane % kLanesPerSegment;
  const int64_t Kb = (K + kBlock - 1) / kBlock;
  const int64_t pitch = row_scale_pitch(T);
  end = min(end, groups(T, K));
  for (int64_t g = warp; g < end; g += warps) {
    const int64_t rg = g / Kb, kb = g - rg * Kb, row0 = rg * kRowsPerGroup;
    const int64_t col = kb * kBlock + kVec * hl;
    const bool col_in = col < K;  // K is a multiple of 16: a lane's 8 columns lie inside K or past it
    uint4 raw[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {  // every load first
      const int64_t row = row0 + 2 * u + half;
      raw[u] = col_in && row < T ? *reinterpret_cast<const uint4*>(x + row * K + col) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t row = row0 + 2 * u + half;
      float v[kVec];
      unpack_bf16x8(raw[u], v);
      float amax = fabsf(v[0]);
#pragma unroll
      for (int i = 1; i < kVec; ++i) amax = nan_max(amax, fabsf(v[i]));
#pragma unroll
      for (int o = kLanesPerSegment / 2; o > 0; o >>= 1) amax = nan_max(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      const BlockQuant quant(amax);
      if (row < T) {
        if (col_in)
          *reinterpret_cast<uint2*>(q + row * K + col) =
              make_uint2(quant.pack4({v[0], v[1], v[2], v[3]}), quant.pack4({v[4], v[5], v[6], v[7]}));
        if (hl == 0) s[kb * pitch + row] = quant.scale;
      }
    }
  }
}

}  // namespace moegemm::rows
