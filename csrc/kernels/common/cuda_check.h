// Turning a failed launch into an exception that names the kernel.
#pragma once

#include <cuda_runtime.h>
#include <stdexcept>
#include <string>

namespace moegemm {

inline void check_launch(const char* what) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string("moegemm: ") + what + ": " + cudaGetErrorString(err));
}

inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string("moegemm: ") + what + ": " + cudaGetErrorString(err));
}

}  // namespace moegemm
