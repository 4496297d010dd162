// FP8 blockwise quantization kernels (SPEC §3).
//   quantize_act_kernel: one CTA per (expert 128-token block, 128 columns). One read of x writes the
//     1x128 row-block copy and the per-expert transposed 128x1 column-block copy ("multi-cast").
//   quantize_weight_kernel: one CTA per 128x128 block of one expert; writes W and Wᵀ copies.
#include <algorithm>

#include "../moegemm.h"
#include "cuda_check.h"
#include "fp8_block.cuh"

namespace moegemm {
namespace {

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

__device__ __forceinline__ int64_t imin64(int64_t a, int64_t b) { return a < b ? a : b; }

__device__ __forceinline__ float warp_amax(float a) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) a = nan_max(a, __shfl_xor_sync(0xffffffffu, a, o));
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

template <typename T>
__global__ void __launch_bounds__(kThreads) quantize_act_kernel(const T* __restrict__ x, int64_t K, int E,
    const int32_t* __restrict__ plan, uint8_t* __restrict__ q, float* __restrict__ s,
    uint8_t* __restrict__ qT, float* __restrict__ sT, int64_t col_cap) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* tile = reinterpret_cast<T*>(smem_raw);       // [128][128]
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
#pragma unroll
  for (int j = 0; j < kRowsPerWarp; ++j) {
    const int r = warp + j * kWarps;
    if (r < nr && lane_active) load4(x + (row0 + r) * K + k0 + 4 * lane, v[j]);
    else v[j][0] = v[j][1] = v[j][2] = v[j][3] = 0.f;
  }
#pragma unroll
  for (int j = 0; j < kRowsPerWarp; ++j) {
    const int r = warp + j * kWarps;
    if (qT != nullptr) {
#pragma unroll
      for (int c = 0; c < 4; ++c) tile[r * kBlock + 4 * lane + c] = static_cast<T>(v[j][c]);
    }
    if (q == nullptr || r >= nr) continue;
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

template <typename T>
__global__ void __launch_bounds__(kThreads) quantize_weight_kernel(const T* __restrict__ w, int64_t N, int64_t K,
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

  float v[kRowsPerWarp][4];
  float a = 0.f;
#pragma unroll
  for (int j = 0; j < kRowsPerWarp; ++j) {
    const int r = warp + j * kWarps;
    if (r < nn && lane_active) load4(src + (n0 + r) * K + k0 + 4 * lane, v[j]);
    else v[j][0] = v[j][1] = v[j][2] = v[j][3] = 0.f;
#pragma unroll
    for (int c = 0; c < 4; ++c) a = nan_max(a, fabsf(v[j][c]));
  }
  a = warp_amax(a);
  if (lane == 0) warp_max[warp] = a;
  __syncthreads();
  a = warp_max[0];
#pragma unroll
  for (int i = 1; i < kWarps; ++i) a = nan_max(a, warp_max[i]);
  const float scale = block_scale(a);
  const int64_t Nb = (N + kBlock - 1) / kBlock, Kb = (K + kBlock - 1) / kBlock;
  if (threadIdx.x == 0) {
    s[(e * Nb + blockIdx.y) * Kb + blockIdx.x] = scale;
    sT[(e * Kb + blockIdx.x) * Nb + blockIdx.y] = scale;
  }
#pragma unroll
  for (int j = 0; j < kRowsPerWarp; ++j) {
    const int r = warp + j * kWarps;
    const uint32_t packed = pack4(v[j], scale);
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
void launch_act(const void* x, int64_t T_, int64_t K, int E, const int32_t* plan, uint8_t* q, float* s,
                uint8_t* qT, float* sT, cudaStream_t stream) {
  const size_t smem = sizeof(T) * kBlock * kBlock;
  auto kernel = quantize_act_kernel<T>;
  static const bool attr_set = [&] {
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)), "quantize_act smem");
    return true;
  }();
  (void)attr_set;
  const dim3 grid(static_cast<unsigned>(block_capacity(T_, E)), static_cast<unsigned>(ceil_div(K, kBlock)));
  kernel<<<grid, kThreads, qT != nullptr ? smem : 0, stream>>>(static_cast<const T*>(x), K, E, plan, q, s, qT, sT,
                                                              col_capacity(T_, E));
  check_launch("quantize_act");
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
  if (T == 0 || (q == nullptr && qT == nullptr)) return;
  switch (dtype) {
    case DType::kBF16: return launch_act<__nv_bfloat16>(x, T, K, E, plan, q, s, qT, sT, stream);
    case DType::kF16: return launch_act<__half>(x, T, K, E, plan, q, s, qT, sT, stream);
    case DType::kF32: return launch_act<float>(x, T, K, E, plan, q, s, qT, sT, stream);
  }
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
