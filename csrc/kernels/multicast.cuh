// The multi-cast FP8 quantization kernel (SPEC §3), generic over where its values come from.
//
// One CTA per (expert 128-token block, 128 columns): it reads each value once through a Loader and
// writes the 1x128 row-block copy q [T, K] + s [T, Kb] and the per-expert transposed 128x1
// column-block copy qT [K, col_cap] + sT [NB, K] (either pair may be skipped). Loaders:
//   PlainLoader<T>        x itself (quantize_act)
//   activation loaders    act(h) (* up) * probs and its gradient (activation.cu), so the activation
//                         between the two GEMMs of an expert MLP never goes through memory in bf16.
// A loader may also return a per-element "extra" whose per-row sums over each 128-column block are
// written to row_extra [T, Kb] (the probs gradient of the activation backward).
#pragma once

#include "../moegemm.h"
#include "cuda_check.h"
#include "fp8_block.cuh"

namespace moegemm::multicast {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kRowsPerWarp = kBlock / kWarps;  // 16
constexpr int kChunk = 32;                     // column phase: rows per thread item

template <typename T>
__device__ __forceinline__ void load4(const T* p, float (&v)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = to_float(p[i]);
}
template <>
__device__ __forceinline__ void load4(const __nv_bfloat16* p, float (&v)[4]) {
  uint2 raw = *reinterpret_cast<const uint2*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
  float2 a = __bfloat1622float2(h[0]), b = __bfloat1622float2(h[1]);
  v[0] = a.x; v[1] = a.y; v[2] = b.x; v[3] = b.y;
}
template <>
__device__ __forceinline__ void load4(const float* p, float (&v)[4]) {
  float4 raw = *reinterpret_cast<const float4*>(p);
  v[0] = raw.x; v[1] = raw.y; v[2] = raw.z; v[3] = raw.w;
}

// Values of x [T, K] as they are; staged in shared memory in their own type (exact).
template <typename T>
struct PlainLoader {
  using Stage = T;
  static constexpr bool kExtra = false;
  const T* x;
  int64_t K;
  __device__ __forceinline__ float load4(int64_t row, int64_t k, float (&v)[4]) const {
    multicast::load4(x + row * K + k, v);
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

__device__ __forceinline__ uint32_t pack4(const float (&v)[4], float scale) {
  return uint32_t(to_e4m3(v[0], scale)) | uint32_t(to_e4m3(v[1], scale)) << 8 |
         uint32_t(to_e4m3(v[2], scale)) << 16 | uint32_t(to_e4m3(v[3], scale)) << 24;
}

// Expert owning scale block b: the last e with blk[e] <= b (blk is non-decreasing).
__device__ __forceinline__ int find_expert(const int32_t* blk, int E, int64_t b) {
  int lo = 0, hi = E - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) >> 1;
    if (blk[mid] <= b) lo = mid; else hi = mid - 1;
  }
  return lo;
}

template <class Loader>
__global__ void __launch_bounds__(kThreads) kernel(Loader src, int64_t K, int E, const int32_t* __restrict__ plan,
    uint8_t* __restrict__ q, float* __restrict__ s, uint8_t* __restrict__ qT, float* __restrict__ sT, int64_t col_cap,
    float* __restrict__ row_extra) {
  using Stage = typename Loader::Stage;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Stage* tile = reinterpret_cast<Stage*>(smem_raw);  // [128][128]
  __shared__ float partial[kBlock / kChunk][kBlock];

  const int32_t* tok = plan;
  const int32_t* col = plan + (E + 1);
  const int32_t* blk = plan + 2 * (E + 1);
  const int64_t b = blockIdx.x;
  if (b >= blk[E]) return;
  const int e = find_expert(blk, E, b);
  const int64_t i = b - blk[e];
  const int64_t row0 = tok[e] + i * kBlock;
  const int nr = static_cast<int>(imin64(kBlock, tok[e + 1] - row0));
  const int64_t k0 = int64_t(blockIdx.y) * kBlock;
  const int nk = static_cast<int>(imin64(kBlock, K - k0));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const bool lane_active = 4 * lane < nk;
  const int64_t Kb = (K + kBlock - 1) / kBlock;

  // Row phase: warp w owns rows w, w+8, ...; lane owns columns 4l..4l+3. Loads first, then reduce.
  float v[kRowsPerWarp][4];
  float extra[kRowsPerWarp];
#pragma unroll
  for (int j = 0; j < kRowsPerWarp; ++j) {
    const int r = warp + j * kWarps;
    extra[j] = 0.f;
    if (r < nr && lane_active) extra[j] = src.load4(row0 + r, k0 + 4 * lane, v[j]);
    else v[j][0] = v[j][1] = v[j][2] = v[j][3] = 0.f;
  }
#pragma unroll
  for (int j = 0; j < kRowsPerWarp; ++j) {
    const int r = warp + j * kWarps;
    if (qT != nullptr) {
#pragma unroll
      for (int c = 0; c < 4; ++c) tile[r * kBlock + 4 * lane + c] = static_cast<Stage>(v[j][c]);
    }
    if (r >= nr) continue;
    if constexpr (Loader::kExtra) {
      const float sum = warp_sum(extra[j]);
      if (row_extra != nullptr && lane == 0) row_extra[(row0 + r) * Kb + blockIdx.y] = sum;
    }
    if (q == nullptr) continue;
    float a = nan_max(nan_max(fabsf(v[j][0]), fabsf(v[j][1])), nan_max(fabsf(v[j][2]), fabsf(v[j][3])));
    const float scale = block_scale(warp_amax(a));
    if (lane_active) *reinterpret_cast<uint32_t*>(q + (row0 + r) * K + k0 + 4 * lane) = pack4(v[j], scale);
    if (lane == 0) s[(row0 + r) * Kb + blockIdx.y] = scale;
  }
  if (qT == nullptr) return;
  __syncthreads();

  // Column phase: thread item = (column c, chunk of 32 rows); two items per thread.
  const int c = threadIdx.x % kBlock;
  const int ch0 = threadIdx.x / kBlock;  // 0 or 1; items ch0 and ch0 + 2
#pragma unroll
  for (int it = 0; it < 2; ++it) {
    const int ch = ch0 + 2 * it;
    float a = 0.f;
#pragma unroll 8
    for (int rr = 0; rr < kChunk; ++rr) a = nan_max(a, fabsf(to_float(tile[(ch * kChunk + rr) * kBlock + c])));
    partial[ch][c] = a;
  }
  __syncthreads();
  if (c >= nk) return;
  const float scale = block_scale(nan_max(nan_max(partial[0][c], partial[1][c]), nan_max(partial[2][c], partial[3][c])));
  if (ch0 == 0) sT[b * K + k0 + c] = scale;
  const int padded_rows = (nr + kColAlign - 1) / kColAlign * kColAlign;
  uint8_t* dst = qT + (k0 + c) * col_cap + col[e] + i * kBlock;
#pragma unroll
  for (int it = 0; it < 2; ++it) {
    const int ch = ch0 + 2 * it;
#pragma unroll
    for (int h = 0; h < kChunk / 16; ++h) {
      const int r0 = ch * kChunk + h * 16;
      if (r0 >= padded_rows) break;
      uint32_t w[4];
#pragma unroll
      for (int g = 0; g < 4; ++g) {
        float f[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) f[u] = to_float(tile[(r0 + 4 * g + u) * kBlock + c]);
        w[g] = pack4(f, scale);
      }
      *reinterpret_cast<uint4*>(dst + r0) = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
}

// Launches the multi-cast kernel over every expert block of x [T, K] (K = output columns).
template <class Loader>
void launch(const Loader& src, int64_t T, int64_t K, int E, const int32_t* plan, uint8_t* q, float* s, uint8_t* qT,
            float* sT, float* row_extra, cudaStream_t stream, const char* name) {
  if (T == 0) return;
  const size_t smem = sizeof(typename Loader::Stage) * kBlock * kBlock;
  // Per device and cheap (no sync), so simply on every launch.
  check_cuda(cudaFuncSetAttribute(kernel<Loader>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)), name);
  const dim3 grid(static_cast<unsigned>(block_capacity(T, E)), static_cast<unsigned>(ceil_div(K, kBlock)));
  kernel<Loader><<<grid, kThreads, qT != nullptr ? smem : 0, stream>>>(src, K, E, plan, q, s, qT, sT, col_capacity(T, E),
                                                                      row_extra);
  check_launch(name);
}

}  // namespace moegemm::multicast
