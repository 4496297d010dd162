// FP8 blockwise quantization kernels (docs/design.md#fp8-recipe).
//   quantize_act: the multi-cast kernel (multicast.cuh) reading x as it is.
//   requantize_cols: the same kernel reading an FP8 row copy (dequantized), writing only the column copy.
//   quantize_weight_kernel: one CTA per 128x128 block of one expert; writes W and Wᵀ copies.
#include <algorithm>

#include "moegemm.h"
#include "kernels/common/cuda_check.h"
#include "kernels/quant/fp8_block.cuh"
#include "kernels/quant/multicast.cuh"

namespace moegemm {
namespace {

using multicast::warp_amax;
using multicast::imin64;
constexpr int kThreads = 256;                  // weight kernel: one CTA per 128x128 block
constexpr int kWarps = kThreads / 32;
constexpr int kRowsPerWarp = kBlock / kWarps;  // warp w owns rows w, w + 8, ...

// Four consecutive values in their storage type (one 8- or 16-byte load).
template <typename T>
struct alignas(4 * sizeof(T)) Raw4 {
  T x[4];
  __device__ __forceinline__ void get(float (&v)[4]) const {
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = to_float(x[i]);
  }
};

template <typename T>
__global__ void __launch_bounds__(kThreads, 3) quantize_weight_kernel(const T* __restrict__ w, int64_t N, int64_t K,
    uint8_t* __restrict__ q, float* __restrict__ s, uint8_t* __restrict__ qT, float* __restrict__ sT) {
  __shared__ __align__(16) uint8_t tileq[kBlock][kBlock + 16];
  __shared__ float warp_max[kWarps];
  const int64_t e = blockIdx.z;
  const int64_t n0 = int64_t(blockIdx.y) * kBlock, k0 = int64_t(blockIdx.x) * kBlock;
  const int nn = static_cast<int>(imin64(kBlock, N - n0));
  const int nk = static_cast<int>(imin64(kBlock, K - k0));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const bool lane_active = 4 * lane < nk;
  const T* src = w + e * N * K;

  // The whole tile's amax comes before any quantization, so the values wait in registers in their own
  // type (half the registers of floats for bf16: 3 CTAs per SM instead of 2).
  Raw4<T> raw[kRowsPerWarp];
  float a = 0.f;
#pragma unroll
  for (int j = 0; j < kRowsPerWarp; ++j) {
    const int r = warp + j * kWarps;
    if (r < nn && lane_active) raw[j] = *reinterpret_cast<const Raw4<T>*>(src + (n0 + r) * K + k0 + 4 * lane);
    else raw[j] = Raw4<T>{};
    float v[4];
    raw[j].get(v);
#pragma unroll
    for (int c = 0; c < 4; ++c) a = nan_max(a, fabsf(v[c]));
  }
  a = warp_amax(a);
  if (lane == 0) warp_max[warp] = a;
  __syncthreads();
  a = warp_max[0];
#pragma unroll
  for (int i = 1; i < kWarps; ++i) a = nan_max(a, warp_max[i]);
  const BlockQuant quant(a);
  const float scale = quant.scale;
  const int64_t Nb = (N + kBlock - 1) / kBlock, Kb = (K + kBlock - 1) / kBlock;
  if (threadIdx.x == 0) {
    s[(e * Nb + blockIdx.y) * Kb + blockIdx.x] = scale;
    sT[(e * Kb + blockIdx.x) * Nb + blockIdx.y] = scale;
  }
#pragma unroll
  for (int j = 0; j < kRowsPerWarp; ++j) {
    const int r = warp + j * kWarps;
    float v[4];
    raw[j].get(v);
    const uint32_t packed = quant.pack4(v);
    *reinterpret_cast<uint32_t*>(&tileq[r][4 * lane]) = packed;
    if (r < nn && lane_active) *reinterpret_cast<uint32_t*>(q + e * N * K + (n0 + r) * K + k0 + 4 * lane) = packed;
  }
  __syncthreads();
  // Transposed copy: item = (column k, 16 rows of n); 1024 items, 4 per thread.
  for (int item = threadIdx.x; item < kBlock * (kBlock / 16); item += kThreads) {
    const int k = item % kBlock, r0 = (item / kBlock) * 16;
    if (k >= nk || r0 >= nn) continue;
    uint32_t out[4];
#pragma unroll
    for (int g = 0; g < 4; ++g)
      out[g] = uint32_t(tileq[r0 + 4 * g][k]) | uint32_t(tileq[r0 + 4 * g + 1][k]) << 8 |
               uint32_t(tileq[r0 + 4 * g + 2][k]) << 16 | uint32_t(tileq[r0 + 4 * g + 3][k]) << 24;
    *reinterpret_cast<uint4*>(qT + e * N * K + (k0 + k) * N + n0 + r0) = make_uint4(out[0], out[1], out[2], out[3]);
  }
}

template <typename T>
void launch_act(const void* x, int64_t T_, int64_t K, int E, const int32_t* plan, uint8_t* q, float* s, uint8_t* qT,
                float* sT, cudaStream_t stream) {
  multicast::launch(multicast::PlainLoader<T>{static_cast<const T*>(x), K}, T_, K, E, plan, q, s, qT, sT, nullptr,
                    stream, "quantize_act");
}

template <typename T>
void launch_weight(const void* w, int64_t E, int64_t N, int64_t K, uint8_t* q, float* s, uint8_t* qT, float* sT,
                   cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(ceil_div(K, kBlock)), static_cast<unsigned>(ceil_div(N, kBlock)),
                  static_cast<unsigned>(E));
  quantize_weight_kernel<T><<<grid, kThreads, 0, stream>>>(static_cast<const T*>(w), N, K, q, s, qT, sT);
  check_launch("quantize_weight");
}

}  // namespace

void quantize_act(const void* x, DType dtype, int64_t T, int64_t K, int E, const int32_t* plan, uint8_t* q, float* s,
                  uint8_t* qT, float* sT, cudaStream_t stream) {
  if (q == nullptr && qT == nullptr) return;
  switch (dtype) {
    case DType::kBF16: return launch_act<__nv_bfloat16>(x, T, K, E, plan, q, s, qT, sT, stream);
    case DType::kF16: return launch_act<__half>(x, T, K, E, plan, q, s, qT, sT, stream);
    case DType::kF32: return launch_act<float>(x, T, K, E, plan, q, s, qT, sT, stream);
  }
}

void requantize_cols(const uint8_t* q, const float* s, int64_t T, int64_t K, int E, const int32_t* plan, uint8_t* qT,
                     float* sT, cudaStream_t stream) {
  if (qT == nullptr) return;
  multicast::launch(multicast::Fp8RowsLoader{q, s, K, ceil_div(K, kBlock)}, T, K, E, plan, nullptr, nullptr, qT, sT,
                    nullptr, stream, "requantize_cols");
}

void quantize_weight(const void* w, DType dtype, int64_t E, int64_t N, int64_t K, uint8_t* q, float* s, uint8_t* qT,
                     float* sT, cudaStream_t stream) {
  if (E == 0 || N == 0 || K == 0) return;
  switch (dtype) {
    case DType::kBF16: return launch_weight<__nv_bfloat16>(w, E, N, K, q, s, qT, sT, stream);
    case DType::kF16: return launch_weight<__half>(w, E, N, K, q, s, qT, sT, stream);
    case DType::kF32: return launch_weight<float>(w, E, N, K, q, s, qT, sT, stream);
  }
}

}  // namespace moegemm
