// The loaders of the multi-cast quantizer (launch.cuh): where a tile's values come from. Loaders say what is
// staged and how values are made of it:
//   PlainLoader<T>        x itself (quantize_act)
//   Fp8RowsLoader         an FP8 row copy, dequantized (requantize_cols: the column copy of an FP8 input)
//   activation loaders    act(h) (* up) * probs and its gradient (act_quantize.cu), so the activation
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

#include <cstdint>

#include "moegemm.h"
#include "kernels/quant/fp8_block.cuh"
#include "kernels/quant/multicast/common.cuh"

namespace moegemm::multicast {

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

}  // namespace moegemm::multicast
