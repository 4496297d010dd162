// What the kernels' launchers and kernels share about the device: its SM count, the SM budget and DRAM bandwidth,
// raising a kernel's dynamic shared-memory limit (once per device), and zeroing a range of output rows.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>

#include "kernels/common/cuda_check.h"

namespace moegemm {

// An attribute of the current device, queried once per device (and attribute).
template <cudaDeviceAttr kAttribute>
int device_attribute() {
  static std::array<int, 64> value{};
  static std::array<std::once_flag, 64> once;
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  std::call_once(once[device], [&] {
    check_cuda(cudaDeviceGetAttribute(&value[device], kAttribute, device), "cudaDeviceGetAttribute");
  });
  return value[device];
}

// Multiprocessors of the current device.
inline int sm_count() { return device_attribute<cudaDevAttrMultiProcessorCount>(); }

// The process-wide SM budget of moegemm's persistent kernels (csrc/moegemm.h set_sm_budget; 0: none, every SM of
// the device). Read at each launch: a captured CUDA graph keeps the grids of its capture.
inline std::atomic<int>& sm_budget_setting() {
  static std::atomic<int> budget{0};
  return budget;
}

// The SMs a persistent grid of the current device spreads over: the budget, else all of them. A budget above the
// device's SM count is refused here, at the launch.
inline int grid_sms() {
  const int all = sm_count(), budget = sm_budget_setting().load();
  if (budget > all)
    throw std::invalid_argument("moegemm: the SM budget (" + std::to_string(budget) + ") exceeds the device's " +
                                std::to_string(all) + " SMs");
  return budget > 0 ? budget : all;
}

// Peak DRAM bandwidth of the current device in GB/s: both edges of the memory clock over the whole bus.
inline double dram_gbps() {
  return 2.0 * device_attribute<cudaDevAttrMemoryClockRate>() * 1e3 * (device_attribute<cudaDevAttrGlobalMemoryBusWidth>() / 8) / 1e9;
}

// Raises `kKernel`'s dynamic shared-memory limit to `bytes`, once per device and kernel.
template <auto kKernel>
void allow_shared_memory(int bytes, const char* what) {
  static std::array<std::once_flag, 64> once;
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  std::call_once(once[device], [&] {
    check_cuda(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), what);
  });
}

#ifdef __CUDACC__
// Zeroes rows [begin, end) of `out` (row_bytes each, a multiple of 16) with 16-byte stores, thread
// `first` of `stride` threads taking every stride-th store (the rows past a plan's covered tokens).
__device__ __forceinline__ void zero_rows(void* out, int64_t begin, int64_t end, int64_t row_bytes, int64_t first,
                                          int64_t stride) {
  uint4* dst = static_cast<uint4*>(out);
  for (int64_t i = begin * row_bytes / 16 + first; i < end * row_bytes / 16; i += stride) dst[i] = make_uint4(0, 0, 0, 0);
}
#endif

}  // namespace moegemm
