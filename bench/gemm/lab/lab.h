// The GEMM lab (python -m bench.gemm.lab): CUTLASS FP8 grouped GEMM tilings built side by side in one
// extension, so that one GPU run times every candidate on the same operands. Torch-free; each generated
// variant registers its tilings here. (moegemm's own sm90 kernel takes its tilings by index from
// csrc/kernels/gemm/heuristics.h through torch.ops.moegemm.gemm_fp8_ragged_m; bench.gemm.ragged_rows times them.)
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "moegemm.h"

namespace moegemm_lab {

struct RaggedM {  // fprop / dgrad
  std::string name;
  size_t (*workspace_size)(int E);
  void (*run)(const moegemm::RaggedRows& p, moegemm::Fp8Operand a, moegemm::Fp8Operand b, void* workspace, cudaStream_t stream,
              const char* name);
};

struct RaggedK {  // wgrad; f32 = fp32 output (accumulate allowed), else bf16
  std::string name;
  bool f32;
  size_t (*workspace_size)(int E);
  void (*run)(const moegemm::RaggedReduction& p, moegemm::Fp8Operand a, moegemm::Fp8Operand b, void* workspace,
              cudaStream_t stream, const char* name);
};

std::vector<RaggedM>& ragged_m_variants();
std::vector<RaggedK>& ragged_k_variants();

}  // namespace moegemm_lab
