// Per-expert bias of a grouped linear layer, over the plan's 128-token blocks (blocks never cross an
// expert; tokens past the covered ones belong to no block and are left alone).
//   add_bias:  y[t, :] += bias[e(t), :]                    one CTA per (block, 256 columns)
//   bias_grad: db[e, :] = sum of dy[t, :] over e's tokens  two passes, fixed order, no atomics:
//              partial[b, :] = sum of block b's rows, then db[e, :] = sum of e's partials in order,
//              so the result is bitwise reproducible.
#include <cuda_bf16.h>

#include "moegemm.h"
#include "kernels/common/cuda_check.h"
#include "kernels/plan/plan.cuh"

namespace moegemm {
namespace {

constexpr int kThreads = 128;
constexpr int kCols = 2 * kThreads;  // two columns (one bf16x2) per thread; N is a multiple of 16

struct BlockRows {
  int e;
  int64_t row0, row1;
};

// The expert and token rows of 128-token block b (b < blk[E]).
__device__ __forceinline__ BlockRows block_rows(const int32_t* plan, int E, int64_t b) {
  const int32_t* tok = plan;
  const int32_t* blk = plan + 2 * (E + 1);
  const int e = find_expert(blk, E, b);
  const int64_t row0 = tok[e] + (b - blk[e]) * kBlock;
  const int64_t row1 = row0 + kBlock < tok[e + 1] ? row0 + kBlock : tok[e + 1];
  return {e, row0, row1};
}

__device__ __forceinline__ float2 load_bias(const float* bias, int64_t i) { return *reinterpret_cast<const float2*>(bias + i); }
__device__ __forceinline__ float2 load_bias(const __nv_bfloat16* bias, int64_t i) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(bias + i));
}

template <class Bias>
__global__ void __launch_bounds__(kThreads) add_bias_kernel(__nv_bfloat16* y, const Bias* bias, const int32_t* plan, int E,
                                                            int64_t T, int64_t N) {
  const int64_t b = blockIdx.x, n = (int64_t(blockIdx.y) * kThreads + threadIdx.x) * 2;
  if (!plan_fits(plan, E, token_limit(T)) || b >= plan[2 * (E + 1) + E] || n >= N) return;  // foreign plan: no tokens
  const BlockRows r = block_rows(plan, E, b);
  const float2 bv = load_bias(bias, r.e * N + n);
  for (int64_t t = r.row0; t < r.row1; ++t) {
    __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(y + t * N + n);
    const float2 v = __bfloat1622float2(*p);
    *p = __floats2bfloat162_rn(v.x + bv.x, v.y + bv.y);
  }
}

__global__ void __launch_bounds__(kThreads) block_sums_kernel(const __nv_bfloat16* dy, const int32_t* plan, int E,
                                                              int64_t T, int64_t N, float* partial) {
  const int64_t b = blockIdx.x, n = (int64_t(blockIdx.y) * kThreads + threadIdx.x) * 2;
  if (!plan_fits(plan, E, token_limit(T)) || b >= plan[2 * (E + 1) + E] || n >= N) return;
  const BlockRows r = block_rows(plan, E, b);
  float2 acc = make_float2(0.f, 0.f);
  for (int64_t t = r.row0; t < r.row1; ++t) {
    const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(dy + t * N + n));
    acc.x += v.x;
    acc.y += v.y;
  }
  *reinterpret_cast<float2*>(partial + b * N + n) = acc;
}

__global__ void __launch_bounds__(kThreads) expert_sums_kernel(const float* partial, const int32_t* plan, int E, int64_t T,
                                                               int64_t N, float* db) {
  const int e = blockIdx.y;
  const int64_t n = (int64_t(blockIdx.x) * kThreads + threadIdx.x) * 2;
  const bool fits = plan_fits(plan, E, token_limit(T));  // a foreign plan: no tokens, zeros
  if (n >= N) return;
  const int32_t* blk = plan + 2 * (E + 1);
  float2 acc = make_float2(0.f, 0.f);
  for (int64_t b = fits ? blk[e] : 0, end = fits ? blk[e + 1] : 0; b < end; ++b) {
    const float2 v = *reinterpret_cast<const float2*>(partial + b * N + n);
    acc.x += v.x;
    acc.y += v.y;
  }
  *reinterpret_cast<float2*>(db + int64_t(e) * N + n) = acc;
}

dim3 block_grid(int64_t T, int E, int64_t N) {
  return dim3(static_cast<unsigned>(block_capacity(T, E)), static_cast<unsigned>(ceil_div(N, kCols)));
}

__global__ void sum_rows_kernel(const float* in, int64_t rows, int64_t cols, float* out) {
  const int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  const float* row = in + r * cols;
  float sum = 0.f;
  for (int64_t c = 0; c < cols; ++c) sum += row[c];
  out[r] = sum;
}

}  // namespace

void sum_rows(const float* in, int64_t rows, int64_t cols, float* out, cudaStream_t stream) {
  if (rows == 0) return;
  sum_rows_kernel<<<static_cast<unsigned>(ceil_div(rows, kThreads)), kThreads, 0, stream>>>(in, rows, cols, out);
  check_launch("sum_rows");
}

void add_bias(void* y_bf16, const void* bias, bool bias_is_f32, const int32_t* plan, int E, int64_t T, int64_t N,
              cudaStream_t stream) {
  if (T == 0 || N == 0) return;
  auto* y = static_cast<__nv_bfloat16*>(y_bf16);
  if (bias_is_f32)
    add_bias_kernel<<<block_grid(T, E, N), kThreads, 0, stream>>>(y, static_cast<const float*>(bias), plan, E, T, N);
  else
    add_bias_kernel<<<block_grid(T, E, N), kThreads, 0, stream>>>(y, static_cast<const __nv_bfloat16*>(bias), plan, E, T, N);
  check_launch("add_bias");
}

void bias_grad(const void* dy_bf16, const int32_t* plan, int E, int64_t T, int64_t N, float* db, float* partial,
               cudaStream_t stream) {
  if (N == 0) return;
  if (T > 0) {
    block_sums_kernel<<<block_grid(T, E, N), kThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(dy_bf16), plan, E,
                                                                    T, N, partial);
    check_launch("bias_grad block sums");
  }
  expert_sums_kernel<<<dim3(static_cast<unsigned>(ceil_div(N, kCols)), E), kThreads, 0, stream>>>(partial, plan, E, T, N, db);
  check_launch("bias_grad expert sums");
}

}  // namespace moegemm
