// Device helpers of the FP8 blockwise recipe (docs/design.md#fp8-recipe), shared by the quantization kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cstdint>

#include "kernels/common/vec8.cuh"  // unpack_bf16x8

namespace moegemm {

constexpr float kFp8Max = 448.0f;

// max(a, b) that propagates NaN (fmaxf drops it): one max.NaN instruction (sm_80+).
__device__ __forceinline__ float nan_max(float a, float b) {
  float d;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}

// Smallest power of two >= fl32(amax / 448), from the exponent bits; 1 for amax == 0 and +inf for a
// non-finite amax (so every dequantized value of the block is NaN).
__device__ __forceinline__ float block_scale(float amax) {
  if (amax == 0.0f) return 1.0f;
  if (!isfinite(amax)) return __int_as_float(0x7f800000);
  int e;
  float m = frexpf(amax / kFp8Max, &e);
  return ldexpf(1.0f, m == 0.5f ? e - 1 : e);
}

// Quantizer of one block: q = e4m3(v / scale), round-to-nearest-even, as two multiplications by exact
// powers of two (no division, no per-element branch). scale = 2^e (or +inf): for e >= -127, 1/scale is
// exact and v * (1/scale) is the correctly rounded v / scale (also for subnormal results; 1/inf = 0 gives
// ±0 or NaN like the division). For a subnormal scale with e < -127, 1/scale overflows, so v is scaled by
// 2^64 first (exact: |v| <= 448 * 2^-127) and then by 2^(-e-64), rounding once.
struct BlockQuant {
  float scale, mul_hi, mul_lo;
  __device__ __forceinline__ explicit BlockQuant(float amax) {
    if (amax >= 7.88860905e-31f && amax <= 3.40282347e38f) {  // 2^-100 <= amax <= FLT_MAX (not NaN)
      // The common case from the exponent bits: fl32(amax / 448) <= 2^k exactly when amax <= 448 * 2^k
      // (no float lies in the rounding gap above 448 * 2^k at these magnitudes), i.e. k = E - 8, plus one
      // when amax's significand exceeds 1.75. Equal to block_scale's value; 2^-k is exact, so no division.
      const uint32_t bits = __float_as_uint(amax);
      const int k = static_cast<int>(bits >> 23) - 127 - 8 + ((bits & 0x7fffffu) > 0x600000u ? 1 : 0);
      scale = __uint_as_float(static_cast<uint32_t>(127 + k) << 23);
      mul_hi = __uint_as_float(static_cast<uint32_t>(127 - k) << 23);
      mul_lo = 1.0f;
      return;
    }
    scale = block_scale(amax);
    const bool tiny = scale < 5.87747175e-39f;  // 2^-127
    mul_hi = tiny ? 18446744073709551616.0f : 1.0f / scale;  // 2^64
    mul_lo = tiny ? 1.0f / (scale * 18446744073709551616.0f) : 1.0f;
  }
  // A block whose multipliers were computed elsewhere (the scale itself is not needed to quantize).
  __device__ __forceinline__ BlockQuant(float hi, float lo) : scale(0.f), mul_hi(hi), mul_lo(lo) {}
  __device__ __forceinline__ float scaled(float v) const { return v * mul_hi * mul_lo; }
  // Four values -> four e4m3 bytes, little-endian in one word.
  __device__ __forceinline__ uint32_t pack4(const float (&v)[4]) const {
    const __nv_fp8x2_storage_t lo = __nv_cvt_float2_to_fp8x2(make_float2(scaled(v[0]), scaled(v[1])), __NV_SATFINITE, __NV_E4M3);
    const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(make_float2(scaled(v[2]), scaled(v[3])), __NV_SATFINITE, __NV_E4M3);
    return uint32_t(lo) | uint32_t(hi) << 16;
  }
};

// Four values -> four e4m3 bytes with one multiplier: BlockQuant::pack4 of a block whose mul_lo is 1 (a
// normal scale), one multiplication per value fewer.
__device__ __forceinline__ uint32_t pack4_by(float mul, const float (&v)[4]) {
  const __nv_fp8x2_storage_t lo = __nv_cvt_float2_to_fp8x2(make_float2(v[0] * mul, v[1] * mul), __NV_SATFINITE, __NV_E4M3);
  const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(make_float2(v[2] * mul, v[3] * mul), __NV_SATFINITE, __NV_E4M3);
  return uint32_t(lo) | uint32_t(hi) << 16;
}

// bf16 pairs (two values in one 32-bit word, the first in the low half), as the quantizers of bf16 tiles keep them.
// max(|a|, |b|) of each bf16 half (NaN if either is; the sign bit is not the maximum's: read with |.|).
__device__ __forceinline__ uint32_t abs_max_bf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("max.NaN.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
// Quantizing bf16 pairs: a normal block's multiplier 2^-k is a bf16 too, and v * 2^-k is exact in bf16 wherever it
// is exact in fp32 (the same exponent range; below 2^-126 both round to an FP8 zero of v's sign), so the pairs are
// scaled in place (one instruction per pair) and only then widened for the FP8 conversion: pack4_by's bytes.
__device__ __forceinline__ uint32_t mul_bf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ uint32_t bf16x2_of(float lo, float hi) {  // (powers of two: exact)
  return __byte_perm(__float_as_uint(lo), __float_as_uint(hi), 0x7632);
}
__device__ __forceinline__ uint32_t e4m3x2_of(float a, float b) {  // a -> the low byte
  return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
}
// f16 pairs (the first value in the low half), as requantize_cols' per-tile kernel keeps an FP8 row copy's values
// when its tile allows (multicast/per_tile.cuh, Fp8Window): e4m3 is a subset of f16, so the decode is exact, and products by
// powers of two are exact wherever they stay above f16's smallest subnormal by e4m3's 3 fraction bits.
// Bytes 2 kHalf, 2 kHalf + 1 of word -> the low, high half. The half is the conversion's operand (sm_90's F2FP reads a
// register's upper half, .H1), so no shift goes before it (docs/performance.md, Quantizers).
template <int kHalf>
__device__ __forceinline__ uint32_t f16x2_of_e4m3x2(uint32_t word) {
  static_assert(kHalf == 0 || kHalf == 1, "a word has two halves");
  uint32_t d;
  if constexpr (kHalf == 0)
    asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, lo;\n}" : "=r"(d) : "r"(word));
  else
    asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, hi;\n}" : "=r"(d) : "r"(word));
  return d;
}
__device__ __forceinline__ uint32_t mul_f16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
// max(|a|, |b|) of each f16 half (NaN if either is; the sign bit is not the maximum's: read with |.|).
__device__ __forceinline__ uint32_t abs_max_f16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("max.NaN.xorsign.abs.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ uint32_t e4m3x2_of_f16x2(uint32_t h) {  // low half -> the low byte; RNE, saturating
  unsigned short d;
  asm("cvt.rn.satfinite.e4m3x2.f16x2 %0, %1;" : "=h"(d) : "r"(h));
  return d;
}
__device__ __forceinline__ float f16_lo(uint32_t w) { return __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xffffu))); }
__device__ __forceinline__ float f16_hi(uint32_t w) { return __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16))); }

// The activation gradient dh as the FP8 copies quantize it, rounded to bf16 to nearest even
// (docs/design.md#fp8-recipe): one value (as a float), or a pair (a -> the low half).
__device__ __forceinline__ float round_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }
__device__ __forceinline__ uint32_t bf16x2_rn(float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}

template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_float(float v) { return v; }

}  // namespace moegemm
