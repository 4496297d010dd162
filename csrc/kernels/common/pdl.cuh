// Programmatic dependent launch (sm_90): a kernel launched dependent (launch_dependent) may be scheduled while the
// kernel before it on the stream still runs, so its launch and whatever it does before grid_wait() overlap that
// kernel's last CTAs. Such a kernel calls grid_wait() before it reads anything an earlier kernel writes or writes
// anything an earlier kernel reads (grid_wait returns once the kernels before it have finished and their writes are
// visible), then grid_release() (never before its own wait, so that a kernel that starts early after it still finds
// every kernel before this one finished), which lets the next dependent kernel be scheduled. Launched the ordinary
// way, both are no-ops. The dependency is captured into CUDA graphs as a programmatic edge.
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <utility>

#include "kernels/common/cuda_check.h"

namespace moegemm {

#ifdef __CUDACC__
__device__ __forceinline__ void grid_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void grid_release() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
#endif

// kernel<<<grid, block, smem, stream>>>(args...), dependent on the kernel before it when `dependent` is set.
template <class... Params, class... Args>
void launch_kernel(bool dependent, void (*kernel)(Params...), dim3 grid, dim3 block, int smem, cudaStream_t stream,
                   const char* name, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid, config.blockDim = block, config.dynamicSmemBytes = static_cast<size_t>(smem), config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute, config.numAttrs = dependent ? 1 : 0;
  check_cuda(cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...), name);
}
template <class... Params, class... Args>
void launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, int smem, cudaStream_t stream, const char* name,
                      Args&&... args) {
  launch_kernel(true, kernel, grid, block, smem, stream, name, std::forward<Args>(args)...);
}

// TEMPORARY A/B switch (bench.bandwidth.ab --env MOEGEMM_AB_PDL --values 0,2): 0 = the launches that read it the
// ordinary way; unset or anything else = dependent.
inline bool ab_dependent() {
  const char* v = std::getenv("MOEGEMM_AB_PDL");
  return v == nullptr || std::atoi(v) != 0;
}

}  // namespace moegemm
