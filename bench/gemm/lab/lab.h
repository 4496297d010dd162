// The GEMM lab (python -m bench.gemm.lab): FP8 grouped GEMM tilings built side by side in one extension, so that
// one GPU run times every candidate on the same operands. Torch-free; each variant_*.cu registers its
// tilings here. Production picks among them in csrc/kernels/gemm_heuristics.h.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace moegemm_lab {

struct RaggedM {  // fprop / dgrad
  std::string name;
  size_t (*workspace_size)(int E);
  void (*run)(const uint8_t* qa, const float* sa, const uint8_t* qb, const float* sb, const int32_t* plan, int E, int64_t T,
              int64_t N, int64_t K, void* out, void* workspace, cudaStream_t stream, const char* name);
};

struct RaggedK {  // wgrad; f32 = fp32 output (accumulate allowed), else bf16
  std::string name;
  bool f32;
  size_t (*workspace_size)(int E);
  void (*run)(const uint8_t* qaT, const float* saT, const uint8_t* qbT, const float* sbT, const int32_t* plan, int E,
              int64_t col_cap, int64_t blk_cap, int64_t N, int64_t K, void* out, bool accumulate, void* workspace,
              cudaStream_t stream, const char* name);
};

std::vector<RaggedM>& ragged_m_variants();
std::vector<RaggedK>& ragged_k_variants();

}  // namespace moegemm_lab
