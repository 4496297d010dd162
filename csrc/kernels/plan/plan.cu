// The plan kernel: expert offsets from device m_splits (docs/design.md#plan: never read on the host), and the
// zero-fill of empty experts' weight gradients.
#include <algorithm>

#include "moegemm.h"
#include "kernels/common/cuda_check.h"
#include "kernels/plan/build.cuh"
#include "kernels/plan/plan.cuh"

namespace moegemm {
namespace {

__global__ void __launch_bounds__(kMaxExperts) make_plan_kernel(const PlanBuild p) { build_plan<kMaxExperts>(p); }

__global__ void zero_empty_experts_kernel(const int32_t* plan, int E, PlanLimits limits, int64_t bytes, void* out) {
  const int e = blockIdx.y;
  if (plan_fits(plan, E, limits) && plan[e + 1] != plan[e]) return;
  uint4* dst = reinterpret_cast<uint4*>(static_cast<char*>(out) + e * bytes);
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < bytes / 16; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = make_uint4(0, 0, 0, 0);
}

}  // namespace

void make_plan(const void* m_splits, bool m_is_int64, int E, int64_t T, int32_t* plan, cudaStream_t stream) {
  check_plan_size(E, T, "make_plan");
  make_plan_kernel<<<1, kMaxExperts, 0, stream>>>(PlanBuild{m_splits, m_is_int64, E, T, plan});
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
