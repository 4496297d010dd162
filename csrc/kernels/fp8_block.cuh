// Device helpers of the FP8 blockwise recipe (SPEC §3), shared by the quantization kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cstdint>

namespace moegemm {

constexpr float kFp8Max = 448.0f;

// max(|a|, |b|) that propagates NaN (fmaxf drops it).
__device__ __forceinline__ float nan_max(float a, float b) { return (a > b || a != a) ? a : b; }

// Smallest power of two >= fl32(amax / 448), from the exponent bits; 1 for amax == 0 and +inf for a
// non-finite amax (so every dequantized value of the block is NaN).
__device__ __forceinline__ float block_scale(float amax) {
  if (amax == 0.0f) return 1.0f;
  if (!isfinite(amax)) return __int_as_float(0x7f800000);
  int e;
  float m = frexpf(amax / kFp8Max, &e);
  return ldexpf(1.0f, m == 0.5f ? e - 1 : e);
}

__device__ __forceinline__ uint8_t to_e4m3(float v, float scale) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v / scale, __NV_SATFINITE, __NV_E4M3));
}

template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_float(float v) { return v; }

}  // namespace moegemm
