// The multi-cast FP8 quantization kernel (docs/design.md#fp8-recipe), generic over where its values come from.
//
// A tile is (expert 128-token block, 128 columns); persistent CTAs loop over the tiles. Each value is
// read once, through a Loader, and written as the 1x128 row-block copy q [T, K] + s [T, Kb] and the
// per-expert transposed 128x1 column-block copy qT [K, col_cap] + sT [NB, K] (either pair may be
// skipped). Loaders:
//   PlainLoader<T>        x itself (quantize_act)
//   Fp8RowsLoader         an FP8 row copy, dequantized (requantize_cols: the column copy of an FP8 input)
//   activation loaders    act(h) (* up) * probs and its gradient (activation.cu), so the activation
//                         between the two GEMMs of an expert MLP never goes through memory in bf16.
// A loader names the type its values are staged in for the column pass (Stage) and the CTAs per SM
// the kernel is compiled for (kMinBlocks, bounded by that stage's shared memory). It may also return
// a per-element "extra" whose per-row sums over each 128-column block are written to row_extra
// [T, Kb] (the probs gradient of the activation backward).
#pragma once

#include <algorithm>
#include <array>
#include <mutex>

#include "moegemm.h"
#include "kernels/common/cuda_check.h"
#include "kernels/common/device.h"
#include "kernels/quant/fp8_block.cuh"
#include "kernels/plan/plan.cuh"

namespace moegemm::multicast {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kVec = 8;                          // row phase: values per lane (16-byte loads of 16-bit data)
constexpr int kLanesPerRow = kBlock / kVec;      // 16: a half-warp covers a 128-column row block
constexpr int kRowIters = kBlock / (2 * kWarps); // 8: each warp covers two rows per iteration
constexpr int kRowBatch = 4;                     // row phase: iterations loaded before the first use
constexpr int kChunk = 32;                       // column phase: rows per thread

// Eight consecutive values as floats (one 16-byte load for 16-bit types, two for fp32).
template <typename T>
__device__ __forceinline__ void load8(const T* p, float (&v)[kVec]);
template <>
__device__ __forceinline__ void load8(const __nv_bfloat16* p, float (&v)[kVec]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    v[2 * i] = f.x; v[2 * i + 1] = f.y;
  }
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

// Two adjacent staged values in one shared-memory read.
__device__ __forceinline__ void load2(const float* p, float& a, float& b) {
  const float2 v = *reinterpret_cast<const float2*>(p);
  a = v.x; b = v.y;
}
__device__ __forceinline__ void load2(const __nv_bfloat16* p, float& a, float& b) {
  const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
  a = v.x; b = v.y;
}
__device__ __forceinline__ void load2(const __half* p, float& a, float& b) {
  const float2 v = __half22float2(*reinterpret_cast<const __half2*>(p));
  a = v.x; b = v.y;
}

// Values of x [T, K] as they are; staged in shared memory in their own type (exact).
template <typename T>
struct PlainLoader {
  using Stage = T;
  static constexpr bool kExtra = false;
  static constexpr int kMinBlocks = sizeof(T) == 4 ? 3 : 4;  // CTAs per SM: 64 KB fp32 / 32 KB 16-bit stage
  const T* x;
  int64_t K;
  __device__ __forceinline__ float load8(int64_t row, int64_t k, float (&v)[kVec]) const {
    multicast::load8(x + row * K + k, v);
    return 0.f;
  }
};

// Values of an FP8 row copy q [T, K] (e4m3) with its 1x128 row scales s [T, Kb] (quantize_act's rows),
// dequantized: q * s is exact in fp32 (4 significant bits times a power of two), so the column copy is
// the one quantize_act would make of the fp32 tensor of dequantized values. Staged as fp32 (exact).
struct Fp8RowsLoader {
  using Stage = float;
  static constexpr bool kExtra = false;
  static constexpr int kMinBlocks = 3;  // 64 KB fp32 stage
  const uint8_t* q;
  const float* s;
  int64_t K, Kb;
  __device__ __forceinline__ float load8(int64_t row, int64_t k, float (&v)[kVec]) const {
    const uint2 raw = *reinterpret_cast<const uint2*>(q + row * K + k);  // k is a multiple of 8, K of 16
    const float scale = s[row * Kb + k / kBlock];
    const __nv_fp8x2_storage_t* pairs = reinterpret_cast<const __nv_fp8x2_storage_t*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pairs[i], __NV_E4M3)));  // exact
      v[2 * i] = f.x * scale;
      v[2 * i + 1] = f.y * scale;
    }
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

// Reductions within each half-warp (one row block each); every lane of the warp must call them.
__device__ __forceinline__ float half_amax(float a) {
#pragma unroll
  for (int o = kLanesPerRow / 2; o > 0; o >>= 1) a = nan_max(a, __shfl_xor_sync(0xffffffffu, a, o));
  return a;
}

__device__ __forceinline__ float half_sum(float a) {
#pragma unroll
  for (int o = kLanesPerRow / 2; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
  return a;
}

// Dynamic shared memory: the plan, then (for the column copy) the staged tile.
__host__ __device__ __forceinline__ size_t plan_bytes(int E) { return (3 * (E + 1) * sizeof(int32_t) + 15) / 16 * 16; }

// Rows [covered, T) of the row copy (q, s) and of row_extra belong to no expert (device counts summing
// below T): zeros, spread over all CTAs. q's rows are K bytes, K a multiple of 16.
__device__ __forceinline__ void zero_uncovered_rows(int64_t covered, int64_t T, int64_t K, int64_t Kb, uint8_t* q, float* s,
                                                   float* row_extra) {
  const int64_t tid = int64_t(blockIdx.x) * kThreads + threadIdx.x, stride = int64_t(gridDim.x) * kThreads;
  if (q != nullptr) {
    uint4* q16 = reinterpret_cast<uint4*>(q);
    for (int64_t i = covered * K / 16 + tid; i < T * K / 16; i += stride) q16[i] = make_uint4(0, 0, 0, 0);
    for (int64_t i = covered * Kb + tid; i < T * Kb; i += stride) s[i] = 0.f;
  }
  if (row_extra != nullptr)
    for (int64_t i = covered * Kb + tid; i < T * Kb; i += stride) row_extra[i] = 0.f;
}

template <class Loader>
__global__ void __launch_bounds__(kThreads, Loader::kMinBlocks) kernel(Loader src, int64_t T, int64_t K, int E,
    const int32_t* __restrict__ plan, uint8_t* __restrict__ q, float* __restrict__ s, uint8_t* __restrict__ qT,
    float* __restrict__ sT, int64_t col_cap, float* __restrict__ row_extra) {
  using Stage = typename Loader::Stage;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  int32_t* plan_s = reinterpret_cast<int32_t*>(smem_raw);  // the plan, [3][E+1], then the tile
  Stage* tile = reinterpret_cast<Stage*>(smem_raw + plan_bytes(E));  // [128][128]
  __shared__ __align__(16) float partial[kWarps][kBlock];  // per-warp column maxima

  // The plan is read once per CTA (one coalesced read); tiles are then found in shared memory.
  for (int idx = threadIdx.x; idx < 3 * (E + 1); idx += kThreads) plan_s[idx] = plan[idx];
  __syncthreads();
  const int32_t* tok = plan_s;
  const int32_t* col = plan_s + (E + 1);
  const int32_t* blk = plan_s + 2 * (E + 1);
  const int64_t Kb = (K + kBlock - 1) / kBlock;
  const bool fits = plan_fits(plan_s, E, token_limit(T));  // a foreign plan: as if no tokens (zeros)
  const int64_t covered = fits ? tok[E] : 0;
  const int64_t n_tiles = fits ? int64_t(blk[E]) * Kb : 0;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int half = lane / kLanesPerRow, hl = lane % kLanesPerRow;

  // Persistent CTAs: tile t = (scale block b, column block kb); a CTA's tiles share nothing, so the
  // next tile's loads are in flight while other CTAs of the SM run their column passes.
  if (covered < T) zero_uncovered_rows(covered, T, K, Kb, q, s, row_extra);
  for (int64_t t = blockIdx.x; t < n_tiles; t += gridDim.x) {
    const int64_t b = t / Kb, kb = t % Kb;
    const int e = find_expert(blk, E, b);
    const int64_t i = b - blk[e];
    const int64_t row0 = tok[e] + i * kBlock;
    const int nr = static_cast<int>(imin64(kBlock, tok[e + 1] - row0));
    const int64_t k0 = kb * kBlock;
    const int nk = static_cast<int>(imin64(kBlock, K - k0));
    const bool lane_active = kVec * hl < nk;  // nk is a multiple of 16

    // Row phase: iteration `it` of warp w covers row 2 (w + 8 it) + half; lane hl of each half-warp owns
    // columns 8 hl .. 8 hl + 7 (one 16-byte load). Batches of 4 iterations have all their loads issued
    // before the first use. Column maxima are gathered on the way.
    float colmax[kVec];
#pragma unroll
    for (int c = 0; c < kVec; ++c) colmax[c] = 0.f;
#pragma unroll
    for (int batch = 0; batch < kRowIters; batch += kRowBatch) {
      float v[kRowBatch][kVec];
      float extra[kRowBatch];
#pragma unroll
      for (int j = 0; j < kRowBatch; ++j) {
        const int r = 2 * (warp + (batch + j) * kWarps) + half;
        extra[j] = 0.f;
        if (r < nr && lane_active) {
          extra[j] = src.load8(row0 + r, k0 + kVec * hl, v[j]);
        } else {
#pragma unroll
          for (int c = 0; c < kVec; ++c) v[j][c] = 0.f;
        }
      }
#pragma unroll
      for (int j = 0; j < kRowBatch; ++j) {
        const int r = 2 * (warp + (batch + j) * kWarps) + half;
        const bool row_ok = r < nr;  // differs between the half-warps: shuffles below run on all lanes
        if (qT != nullptr) {
          store8(tile + r * kBlock + kVec * hl, v[j]);
#pragma unroll
          for (int c = 0; c < kVec; ++c) colmax[c] = nan_max(colmax[c], fabsf(v[j][c]));
        }
        if constexpr (Loader::kExtra) {
          const float sum = half_sum(extra[j]);
          if (row_extra != nullptr && row_ok && hl == 0) row_extra[(row0 + r) * Kb + kb] = sum;
        }
        if (q == nullptr) continue;
        float a = 0.f;
#pragma unroll
        for (int c = 0; c < kVec; ++c) a = nan_max(a, fabsf(v[j][c]));
        const BlockQuant quant(half_amax(a));
        if (row_ok && lane_active) {
          uint2 packed;
          packed.x = quant.pack4({v[j][0], v[j][1], v[j][2], v[j][3]});
          packed.y = quant.pack4({v[j][4], v[j][5], v[j][6], v[j][7]});
          *reinterpret_cast<uint2*>(q + (row0 + r) * K + k0 + kVec * hl) = packed;
        }
        if (row_ok && hl == 0) s[(row0 + r) * Kb + kb] = quant.scale;
      }
    }
    if (qT == nullptr) continue;  // uniform: no shared memory was written
#pragma unroll
    for (int c = 0; c < kVec; ++c) colmax[c] = nan_max(colmax[c], __shfl_xor_sync(0xffffffffu, colmax[c], kLanesPerRow));
    if (half == 0) store8(&partial[warp][kVec * hl], colmax);
    __syncthreads();

    // Column phase: thread = (column pair 2p, 2p+1; chunk of 32 rows). Each shared-memory read brings
    // both columns of a row; each column's 32 bytes go out as two 16-byte stores.
    const int p = threadIdx.x % (kBlock / 2), ch = threadIdx.x / (kBlock / 2);
    const int c = 2 * p;
    if (c < nk) {
      float amax[2] = {partial[0][c], partial[0][c + 1]};
#pragma unroll
      for (int w = 1; w < kWarps; ++w) {
        amax[0] = nan_max(amax[0], partial[w][c]);
        amax[1] = nan_max(amax[1], partial[w][c + 1]);
      }
      const BlockQuant quant[2] = {BlockQuant(amax[0]), BlockQuant(amax[1])};
      if (ch == 0) *reinterpret_cast<float2*>(sT + b * K + k0 + c) = make_float2(quant[0].scale, quant[1].scale);
      const int padded_rows = (nr + kColAlign - 1) / kColAlign * kColAlign;
      uint8_t* dst = qT + (k0 + c) * col_cap + col[e] + i * kBlock;
#pragma unroll
      for (int h = 0; h < kChunk / 16; ++h) {
        const int r0 = ch * kChunk + h * 16;
        if (r0 >= padded_rows) break;
        uint32_t w0[4], w1[4];
#pragma unroll
        for (int g = 0; g < 4; ++g) {
          float f0[4], f1[4];
#pragma unroll
          for (int u = 0; u < 4; ++u) load2(tile + (r0 + 4 * g + u) * kBlock + c, f0[u], f1[u]);
          w0[g] = quant[0].pack4(f0);
          w1[g] = quant[1].pack4(f1);
        }
        *reinterpret_cast<uint4*>(dst + r0) = make_uint4(w0[0], w0[1], w0[2], w0[3]);
        *reinterpret_cast<uint4*>(dst + col_cap + r0) = make_uint4(w1[0], w1[1], w1[2], w1[3]);
      }
    }
    __syncthreads();  // the next tile overwrites the stage and the column maxima
  }
}

// CTAs of kernel<Loader> with `smem` bytes of dynamic shared memory that the device runs at once
// (the last answer is kept per thread: consecutive launches mostly ask the same question).
template <class Loader>
int64_t resident_ctas(size_t smem, const char* name) {
  thread_local int last_device = -1;
  thread_local size_t last_smem = 0;
  thread_local int64_t last_ctas = 0;
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  if (device != last_device || smem != last_smem) {
    int sms = 0, per_sm = 0;
    check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), name);
    check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel<Loader>, kThreads, smem), name);
    last_device = device;
    last_smem = smem;
    last_ctas = int64_t(sms) * std::max(per_sm, 1);
  }
  return last_ctas;
}

// Launches the multi-cast kernel over every expert block of x [T, K] (K = output columns).
template <class Loader>
void launch(const Loader& src, int64_t T, int64_t K, int E, const int32_t* plan, uint8_t* q, float* s, uint8_t* qT,
            float* sT, float* row_extra, cudaStream_t stream, const char* name) {
  if (T == 0) return;
  const size_t tile = sizeof(typename Loader::Stage) * kBlock * kBlock;
  const size_t smem = plan_bytes(E) + (qT != nullptr ? tile : 0);
  // the limit raised once to the most any launch uses (the plan of kMaxExperts experts and a staged tile);
  // a launch still takes only what it needs
  allow_shared_memory<kernel<Loader>>(int(plan_bytes(kMaxExperts) + tile), name);
  // Persistent: as many CTAs as fit on the device at once, never more than the tiles there can be.
  const int64_t most_tiles = block_capacity(T, E) * ceil_div(K, kBlock);
  const int64_t grid = std::min<int64_t>(most_tiles, resident_ctas<Loader>(smem, name));
  kernel<Loader><<<static_cast<unsigned>(grid), kThreads, smem, stream>>>(src, T, K, E, plan, q, s, qT, sT,
                                                                         col_capacity(T, E), row_extra);
  check_launch(name);
}

}  // namespace moegemm::multicast
