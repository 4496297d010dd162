// Per-expert bias of a grouped linear layer, over the plan's 128-token blocks (blocks never cross an
// expert; tokens past the covered ones belong to no block and are left alone).
//   add_bias:  y[t, :] += bias[e(t), :]                    one CTA per (block, 256 columns)
//   bias_grad: db[e, :] = sum of dy[t, :] over e's tokens  two passes, fixed order, no atomics:
//              partial[b, :] = sum of block b's rows (one CTA per (block, 256 columns)), then
//              db[e, :] = sum of e's partials in order, so the result is bitwise reproducible.
#include <cuda_bf16.h>

#include "moegemm.h"
#include "kernels/common/cuda_check.h"
#include "kernels/common/pdl.cuh"
#include "kernels/plan/plan.cuh"
#include "kernels/plan/tile_lookup.cuh"

namespace moegemm {
namespace {

// A CTA of 4 warps takes one 128-token block x 256 columns: each lane 8 columns (16 bytes of bf16), the warps
// the block's rows w, w + 4, ... in turn, kRowsInFlight rows' loads issued before their first use, so that
// each thread has 128 bytes in flight (one 4-byte value per thread at a time left the kernels at 50-70 % of
// copy bandwidth; docs/performance.md, Activation kernels). N is a multiple of 16, so 8 columns lie within N or past it.
constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kColsPerLane = 8;
constexpr int kCols = 32 * kColsPerLane;
constexpr int kRowsInFlight = 8;

struct BlockRows {
  int e;
  int64_t row0, row1;
};

// 8 bf16 values <-> fp32
__device__ __forceinline__ void unpack8(const uint4& u, float* f) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = __bfloat1622float2(h[i]);
    f[2 * i] = v.x, f[2 * i + 1] = v.y;
  }
}
__device__ __forceinline__ uint4 pack8(const float* f) {
  uint4 u;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  return u;
}

__device__ __forceinline__ void load_bias(const float* bias, int64_t i, float* f) {
  const float4 lo = *reinterpret_cast<const float4*>(bias + i), hi = *reinterpret_cast<const float4*>(bias + i + 4);
  f[0] = lo.x, f[1] = lo.y, f[2] = lo.z, f[3] = lo.w, f[4] = hi.x, f[5] = hi.y, f[6] = hi.z, f[7] = hi.w;
}
__device__ __forceinline__ void load_bias(const __nv_bfloat16* bias, int64_t i, float* f) {
  unpack8(*reinterpret_cast<const uint4*>(bias + i), f);
}

// The CTA's block (tile_block(): the grid is tile_grid's) and this lane's columns (blockIdx.x the 256-column block),
// found with the plan checked in one pass (find_tile); false, after that pass, which every thread takes part in,
// when there is nothing to do (past the plan's blocks, past N, or a foreign plan: no tokens). kExpert: r.e the
// block's expert (else 0: block_sums_kernel needs none).
template <bool kExpert>
__device__ __forceinline__ bool block_cols(const int32_t* plan, int E, int64_t T, int64_t N, BlockRows& r, int64_t& n) {
  n = (int64_t(blockIdx.x) * 32 + threadIdx.x % 32) * kColsPerLane;
  const Found f = find_tile<kExpert>(tile_block(), true, E, T, plan, [](const TileSpot&) {});
  if (!f.spot.has_tile || f.spot.nr == 0 || n >= N) return false;
  r = {f.expert, f.spot.row0, f.spot.row0 + f.spot.nr};
  return true;
}

// Calls f(t, v) for this warp's rows t of block r (w, w + kWarps, ... for warp w), in order, with v the 16 bytes
// of row t at column n; the loads of kRowsInFlight rows are issued before the first of them is used (through the
// read-only path when the kernel does not write src).
template <bool kReadOnly, class F>
__device__ __forceinline__ void for_rows(const __nv_bfloat16* src, const BlockRows& r, int64_t N, int64_t n, F f) {
  for (int64_t t0 = r.row0 + threadIdx.x / 32; t0 < r.row1; t0 += kWarps * kRowsInFlight) {
    uint4 v[kRowsInFlight];
#pragma unroll
    for (int i = 0; i < kRowsInFlight; ++i)
      if (t0 + kWarps * i < r.row1) {
        const uint4* p = reinterpret_cast<const uint4*>(src + (t0 + kWarps * i) * N + n);
        v[i] = kReadOnly ? __ldg(p) : *p;
      }
#pragma unroll
    for (int i = 0; i < kRowsInFlight; ++i) {
      if (t0 + kWarps * i >= r.row1) break;
      f(t0 + kWarps * i, v[i]);
    }
  }
}

template <class Bias>
__global__ void __launch_bounds__(kThreads) add_bias_kernel(__nv_bfloat16* y, const Bias* bias, const int32_t* plan, int E,
                                                            int64_t T, int64_t N) {
  grid_wait();  // (launched dependent: nothing read or written before)
  grid_release();
  BlockRows r;
  int64_t n;
  if (!block_cols<true>(plan, E, T, N, r, n)) return;
  float bv[kColsPerLane];
  load_bias(bias, r.e * N + n, bv);
  for_rows<false>(y, r, N, n, [&](int64_t t, const uint4& v) {
    float f[kColsPerLane];
    unpack8(v, f);
#pragma unroll
    for (int j = 0; j < kColsPerLane; ++j) f[j] += bv[j];
    *reinterpret_cast<uint4*>(y + t * N + n) = pack8(f);
  });
}

// partial[b, n] = the sum of block b's rows of dy: each warp sums its rows in order, then the warps' sums are
// added in warp order (a fixed order: bitwise reproducible). (16 rows in flight, or 16 columns per lane, were
// no faster.)
__global__ void __launch_bounds__(kThreads) block_sums_kernel(const __nv_bfloat16* dy, const int32_t* plan, int E,
                                                              int64_t T, int64_t N, float* partial) {
  grid_wait();  // (launched dependent: nothing read or written before)
  grid_release();  // after the wait, which expert_sums_kernel's plan check before its own wait relies on
  __shared__ float4 sums[kWarps - 1][32][kColsPerLane / 4];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  BlockRows r;
  int64_t n;
  const bool work = block_cols<false>(plan, E, T, N, r, n);  // the same across the CTA but for n
  float acc[kColsPerLane] = {};
  if (work) {
    for_rows<true>(dy, r, N, n, [&](int64_t, const uint4& v) {
      float f[kColsPerLane];
      unpack8(v, f);
#pragma unroll
      for (int j = 0; j < kColsPerLane; ++j) acc[j] += f[j];
    });
  }
  if (warp > 0) {
    sums[warp - 1][lane][0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    sums[warp - 1][lane][1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
  }
  __syncthreads();
  if (warp > 0 || !work) return;
#pragma unroll
  for (int w = 0; w < kWarps - 1; ++w) {
    const float4 lo = sums[w][lane][0], hi = sums[w][lane][1];
    acc[0] += lo.x, acc[1] += lo.y, acc[2] += lo.z, acc[3] += lo.w, acc[4] += hi.x, acc[5] += hi.y, acc[6] += hi.z, acc[7] += hi.w;
  }
  float4* out = reinterpret_cast<float4*>(partial + int64_t(tile_block()) * N + n);
  out[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
  out[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
}

constexpr int kSumThreads = 128;  // expert_sums_kernel: two columns per thread
constexpr int kSumsAhead = 8;     // and 8 blocks' partials in flight (one at a time left a Zipf expert's many
                                  // blocks a chain of dependent loads: bias_grad 1.01-1.04x on the Zipf points)

__global__ void __launch_bounds__(kSumThreads) expert_sums_kernel(const float* partial, const int32_t* plan, int E, int64_t T,
                                                                  int64_t N, float* db) {
  const int e = blockIdx.y;
  const int64_t n = (int64_t(blockIdx.x) * kSumThreads + threadIdx.x) * 2;
  // Launched dependent on block_sums_kernel (T > 0): the plan, which block_sums_kernel does not write and whose
  // writer finished before every block_sums_kernel CTA passed its wait and released this kernel, is checked while
  // block_sums_kernel's last CTAs still run; the partials only after the wait.
  const bool fits = plan_fits(plan, E, token_limit(T));  // a foreign plan: no tokens, zeros
  grid_wait();
  grid_release();
  if (n >= N) return;
  const int32_t* blk = plan + 2 * (E + 1);
  float2 acc = make_float2(0.f, 0.f);
  for (int64_t b = fits ? blk[e] : 0, end = fits ? blk[e + 1] : 0; b < end; b += kSumsAhead) {
    float2 v[kSumsAhead];  // the loads of kSumsAhead partials issued, then added in block order
#pragma unroll
    for (int i = 0; i < kSumsAhead; ++i)
      if (b + i < end) v[i] = *reinterpret_cast<const float2*>(partial + (b + i) * N + n);
#pragma unroll
    for (int i = 0; i < kSumsAhead; ++i)
      if (b + i < end) acc.x += v[i].x, acc.y += v[i].y;
  }
  *reinterpret_cast<float2*>(db + int64_t(e) * N + n) = acc;
}

dim3 block_grid(int64_t T, int E, int64_t N) { return tile_grid(block_capacity(T, E), ceil_div(N, kCols)); }

}  // namespace

void add_bias(void* y_bf16, const void* bias, bool bias_is_f32, const int32_t* plan, int E, int64_t T, int64_t N,
              cudaStream_t stream) {
  if (T == 0 || N == 0) return;
  auto* y = static_cast<__nv_bfloat16*>(y_bf16);
  if (bias_is_f32)
    launch_dependent(add_bias_kernel<float>, block_grid(T, E, N), kThreads, 0, stream, "add_bias", y,
                     static_cast<const float*>(bias), plan, E, T, N);
  else
    launch_dependent(add_bias_kernel<__nv_bfloat16>, block_grid(T, E, N), kThreads, 0, stream, "add_bias", y,
                     static_cast<const __nv_bfloat16*>(bias), plan, E, T, N);
}

void bias_grad(const void* dy_bf16, const int32_t* plan, int E, int64_t T, int64_t N, float* db, float* partial,
               cudaStream_t stream) {
  if (N == 0) return;
  if (T == 0) {  // no tokens: zeros under any plan (one that fits T = 0 has no blocks)
    check_cuda(cudaMemsetAsync(db, 0, sizeof(float) * E * N, stream), "bias_grad zeros");
    return;
  }
  launch_dependent(block_sums_kernel, block_grid(T, E, N), kThreads, 0, stream, "bias_grad block sums",
                   static_cast<const __nv_bfloat16*>(dy_bf16), plan, E, T, N, partial);
  launch_dependent(expert_sums_kernel, dim3(static_cast<unsigned>(ceil_div(N, 2 * kSumThreads)), E), kSumThreads, 0, stream,
                   "bias_grad expert sums", static_cast<const float*>(partial), plan, E, T, N, db);
}

}  // namespace moegemm
