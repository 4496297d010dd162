// The GEMM implementations behind csrc/moegemm.h's entry points; csrc/kernels/gemm/dispatch.cu picks one
// per call (with csrc/kernels/gemm/heuristics.h). Torch-free, host-side declarations.
#pragma once

#include "moegemm.h"

namespace moegemm::gemm {

// CUTLASS sm90 ptr-array kernels (csrc/kernels/gemm/cutlass/): per-group arguments built on the device.
size_t cutlass_fp8_ragged_reduction_f32_workspace_size(int E);
void cutlass_fp8_ragged_reduction_f32(const RaggedReduction& p, Fp8Operand a, Fp8Operand b, void* workspace, cudaStream_t stream);
size_t cutlass_fp8_ragged_reduction_bf16_workspace_size(int E);
void cutlass_fp8_ragged_reduction_bf16(const RaggedReduction& p, Fp8Operand a, Fp8Operand b, void* workspace, cudaStream_t stream);
size_t cutlass_bf16_ragged_rows_fprop_workspace_size(int E);
void cutlass_bf16_ragged_rows_fprop(const RaggedRows& p, const void* a, const void* b, void* workspace, cudaStream_t stream);
size_t cutlass_bf16_ragged_rows_dgrad_workspace_size(int E);
void cutlass_bf16_ragged_rows_dgrad(const RaggedRows& p, const void* a, const void* b, void* workspace, cudaStream_t stream);
size_t cutlass_bf16_ragged_reduction_f32_workspace_size(int E);
void cutlass_bf16_ragged_reduction_f32(const RaggedReduction& p, const void* a, const void* b, void* workspace, cudaStream_t stream);
size_t cutlass_bf16_ragged_reduction_bf16_workspace_size(int E);
void cutlass_bf16_ragged_reduction_bf16(const RaggedReduction& p, const void* a, const void* b, void* workspace, cudaStream_t stream);

// moegemm's own persistent sm90 kernels (csrc/kernels/gemm/sm90/): their workspace is the tile walk's counter
// (kSm90TileCounterWorkspace bytes, zero at launch; see gemm_fp8_ragged_rows and gemm_fp8_ragged_reduction).
constexpr size_t kSm90TileCounterWorkspace = sizeof(int);
struct RaggedRowsTiling;  // heuristics.h
void sm90_fp8_ragged_rows(const RaggedRows& p, Fp8Operand a, Fp8Operand b, ExpertBias bias, const RaggedRowsTiling& tiling,
                          void* workspace, cudaStream_t stream);
// The fused form (csrc/moegemm.h gemm_fp8_ragged_rows_quantize_a): its launch builds A (and the plan, when given counts) itself.
struct RowsPrologue {
  const void* x;  // [T, K] bf16
  PlanBuild plan;
  uint8_t* qa;  // x's FP8 row copy [T, K] and its K-major row scales: written, then read as A
  float* sa;
  ZeroFill zero;  // words zeroed by the launch too (the tile counters of the GEMMs after it), or none
};
// workspace: kSm90OneLaunchWorkspace bytes of any contents (csrc/kernels/common/grid_claims.cuh)
constexpr size_t kSm90OneLaunchWorkspace = 8 * sizeof(uint32_t);
void sm90_fp8_ragged_rows_quantize_a(const RaggedRows& p, const RowsPrologue& prologue, Fp8Operand b, ExpertBias bias,
                                     const RaggedRowsTiling& tiling, void* workspace, cudaStream_t stream);
struct RaggedReductionTiling;  // heuristics.h
void sm90_fp8_ragged_reduction(const RaggedReduction& p, Fp8Operand a, Fp8Operand b, const RaggedReductionTiling& tiling,
                               void* workspace, cudaStream_t stream);

}  // namespace moegemm::gemm
