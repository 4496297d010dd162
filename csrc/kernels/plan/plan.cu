// The plan kernel: expert offsets from device m_splits (docs/design.md#plan: never read on the host), and the
// zero-fill of empty experts' weight gradients.
#include <cub/block/block_scan.cuh>
#include <algorithm>

#include "moegemm.h"
#include "kernels/common/cuda_check.h"
#include "kernels/plan/plan.cuh"

namespace moegemm {
namespace {

template <typename Count>
__global__ void __launch_bounds__(kMaxExperts) make_plan_kernel(const Count* m_splits, int E, int64_t T, int32_t* plan) {
  using Scan = cub::BlockScan<long long, kMaxExperts>;
  __shared__ typename Scan::TempStorage scan_storage;
  const int e = threadIdx.x;
  // Each count clamped to [0, T] before any sum: E <= 1024 counts of at most T < 2^31 cannot overflow,
  // whatever the device values (negative, huge, stale bytes).
  long long m = e < E ? static_cast<long long>(m_splits[e]) : 0;
  m = m < 0 ? 0 : (m > T ? T : m);
  long long end;  // inclusive prefix sum of the clamped counts
  Scan(scan_storage).InclusiveSum(m, end);
  __syncthreads();
  const long long start = end - m;
  const long long tok0 = start < T ? start : T;
  const long long tok1 = end < T ? end : T;
  const long long count = tok1 - tok0;
  long long cols = (count + kColAlign - 1) / kColAlign * kColAlign;
  long long blks = (count + kBlock - 1) / kBlock;
  long long col_end, blk_end;
  Scan(scan_storage).InclusiveSum(cols, col_end);
  __syncthreads();
  Scan(scan_storage).InclusiveSum(blks, blk_end);
  if (e < E) {
    int32_t* tok = plan;
    int32_t* col = plan + (E + 1);
    int32_t* blk = plan + 2 * (E + 1);
    tok[e + 1] = static_cast<int32_t>(tok1);
    col[e + 1] = static_cast<int32_t>(col_end);
    blk[e + 1] = static_cast<int32_t>(blk_end);
    if (e == 0) tok[0] = col[0] = blk[0] = 0;
  }
}

__global__ void zero_empty_experts_kernel(const int32_t* plan, int E, PlanLimits limits, int64_t bytes, void* out) {
  const int e = blockIdx.y;
  if (plan_fits(plan, E, limits) && plan[e + 1] != plan[e]) return;
  uint4* dst = reinterpret_cast<uint4*>(static_cast<char*>(out) + e * bytes);
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < bytes / 16; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = make_uint4(0, 0, 0, 0);
}

}  // namespace

void make_plan(const void* m_splits, bool m_is_int64, int E, int64_t T, int32_t* plan, cudaStream_t stream) {
  if (E < 1 || E > kMaxExperts) throw std::runtime_error("moegemm: make_plan: E out of range");
  if (T < 0 || col_capacity(T, E) > kMaxPlanValue) throw std::runtime_error("moegemm: make_plan: T out of range");
  if (m_is_int64)
    make_plan_kernel<int64_t><<<1, kMaxExperts, 0, stream>>>(static_cast<const int64_t*>(m_splits), E, T, plan);
  else
    make_plan_kernel<int32_t><<<1, kMaxExperts, 0, stream>>>(static_cast<const int32_t*>(m_splits), E, T, plan);
  check_launch("make_plan");
}

void zero_empty_experts(const int32_t* plan, int E, PlanLimits limits, int64_t bytes_per_expert, void* out,
                        cudaStream_t stream) {
  // bytes_per_expert = N*K*element size is a multiple of 512 (N, K multiples of 16): 16-byte stores cover it.
  const int blocks = static_cast<int>(std::min<int64_t>(ceil_div(bytes_per_expert / 16, 256), 64));
  zero_empty_experts_kernel<<<dim3(blocks, E), 256, 0, stream>>>(plan, E, limits, bytes_per_expert, out);
  check_launch("zero_empty_experts");
}

}  // namespace moegemm
