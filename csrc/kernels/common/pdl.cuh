// Programmatic dependent launch (sm_90): a kernel launched dependent (launch_dependent) may be scheduled while the
// kernel before it on the stream still runs, so its launch and whatever it does before grid_wait() overlap that
// kernel's last CTAs. Such a kernel calls grid_wait() before it reads anything an earlier kernel writes or writes
// anything an earlier kernel reads (grid_wait returns once the kernels before it have finished and their writes are
// visible), then grid_release() (never before its own wait, so that a kernel that starts early after it still finds
// every kernel before this one finished), which lets the next dependent kernel be scheduled. Launched the ordinary
// way, both are no-ops. The dependency is captured into CUDA graphs as a programmatic edge.
// Launched dependent: the quantizers' per-tile kernels, the GLU kernels, the weight quantizer and the bias kernels
// (a kernel of a graph costs ~1.15 us on the H200 even when it does nothing; docs/performance.md, Quantizers), and
// the ragged-row GEMM but for its fused form (docs/performance.md, Ragged-row GEMM). The ragged reduction, bound by
// main_grad's traffic, gains nothing from it and is launched the ordinary way.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "kernels/common/cuda_check.h"

namespace moegemm {

#ifdef __CUDACC__
__device__ __forceinline__ void grid_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void grid_release() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
#endif

// The launch attribute that makes a launch dependent (for launches that also carry other attributes).
inline cudaLaunchAttribute dependent_launch_attribute() {
  cudaLaunchAttribute a{};
  a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a.val.programmaticStreamSerializationAllowed = 1;
  return a;
}

// kernel<<<grid, block, smem, stream>>>(args...), dependent on the kernel before it.
template <class... Params, class... Args>
void launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, int smem, cudaStream_t stream, const char* name,
                      Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid, config.blockDim = block, config.dynamicSmemBytes = static_cast<size_t>(smem), config.stream = stream;
  cudaLaunchAttribute attribute[1] = {dependent_launch_attribute()};
  config.attrs = attribute, config.numAttrs = 1;
  check_cuda(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...), name);  // (converted as <<<>>> would)
}

}  // namespace moegemm
