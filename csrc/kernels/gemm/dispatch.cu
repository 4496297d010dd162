// csrc/moegemm.h's GEMM entry points: each picks its implementation (heuristics.h) and calls it.
#include <stdexcept>

#include "kernels/gemm/heuristics.h"
#include "kernels/common/device.h"
#include "kernels/gemm/variants.h"
#include "kernels/plan/build.cuh"

namespace moegemm {

int num_ragged_rows_tilings() { return gemm::kNumRaggedRowsTilings; }

void set_sm_budget(int sms) {
  if (sms < 0) throw std::invalid_argument("moegemm: set_sm_budget: the budget must be 0 (every SM) or positive");
  sm_budget_setting().store(sms);
}

size_t gemm_fp8_ragged_rows_workspace_size() { return gemm::kSm90TileCounterWorkspace; }

void gemm_fp8_ragged_rows(const RaggedRows& p, Fp8Operand a, Fp8Operand b, ExpertBias bias, int tiling, void* workspace,
                       cudaStream_t stream) {
  if (tiling >= gemm::kNumRaggedRowsTilings) throw std::runtime_error("moegemm: gemm_fp8_ragged_rows: no such tiling");
  const gemm::RaggedRowsTiling chosen = tiling >= 0 ? gemm::kRaggedRowsTilings[tiling] : gemm::ragged_rows_tiling(p.T, p.E, p.N, grid_sms(), dram_gbps());
  gemm::sm90_fp8_ragged_rows(p, a, b, bias, chosen, workspace, stream);
}

size_t gemm_fp8_ragged_rows_quantize_a_workspace_size() { return gemm::kSm90OneLaunchWorkspace; }

void gemm_fp8_ragged_rows_quantize_a(const PlanBuild& plan, const void* x, int64_t N, int64_t K, void* out, uint8_t* qa,
                                  float* sa, Fp8Operand b, ExpertBias bias, ZeroFill zero, void* workspace,
                                  cudaStream_t stream) {
  check_plan_size(plan.E, plan.T, "gemm_fp8_ragged_rows_quantize_a");
  if (plan.T < 1 || plan.plan == nullptr)
    throw std::runtime_error("moegemm: gemm_fp8_ragged_rows_quantize_a: needs T >= 1 and the plan");
  const RaggedRows p{plan.plan, plan.E, plan.T, N, K, out};
  gemm::sm90_fp8_ragged_rows_quantize_a(p, {x, plan, qa, sa, zero}, b, bias, gemm::ragged_rows_tiling(p.T, p.E, N, grid_sms(), dram_gbps()),
                                        workspace, stream);
}

bool gemm_fp8_ragged_rows_quantize_a_preferred(int64_t T, int64_t K) {
  static const bool enabled = gemm::enabled_by_env("MOEGEMM_ONE_LAUNCH_FORWARD");  // read once
  return enabled && gemm::quantize_a_in_gemm(T, K);
}

int num_ragged_reduction_tilings() { return gemm::kNumRaggedReductionTilings; }

size_t gemm_fp8_ragged_reduction_workspace_size(const RaggedReduction& p, GemmChoice choice) {
  if (gemm::fp8_ragged_reduction_kernel(choice.kernel) != GemmKernel::kCutlass) return gemm::kSm90TileCounterWorkspace;
  return p.out_kind == WgradOut::kBF16 ? gemm::cutlass_fp8_ragged_reduction_bf16_workspace_size(p.E)
                                       : gemm::cutlass_fp8_ragged_reduction_f32_workspace_size(p.E);
}

void gemm_fp8_ragged_reduction(const RaggedReduction& p, Fp8Operand a, Fp8Operand b, GemmChoice choice, void* workspace,
                       cudaStream_t stream) {
  if (gemm::fp8_ragged_reduction_kernel(choice.kernel) == GemmKernel::kCutlass) {
    if (p.out_kind == WgradOut::kBF16) return gemm::cutlass_fp8_ragged_reduction_bf16(p, a, b, workspace, stream);
    return gemm::cutlass_fp8_ragged_reduction_f32(p, a, b, workspace, stream);
  }
  if (choice.tiling >= gemm::kNumRaggedReductionTilings) throw std::runtime_error("moegemm: gemm_fp8_ragged_reduction: no such tiling");
  const gemm::RaggedReductionTiling tiling = choice.tiling >= 0 ? gemm::kRaggedReductionTilings[choice.tiling]
                                                                : gemm::ragged_reduction_tiling(p, grid_sms());
  gemm::sm90_fp8_ragged_reduction(p, a, b, tiling, workspace, stream);
}

size_t gemm_bf16_ragged_rows_workspace_size(int E, bool dgrad) {
  return dgrad ? gemm::cutlass_bf16_ragged_rows_dgrad_workspace_size(E) : gemm::cutlass_bf16_ragged_rows_fprop_workspace_size(E);
}

void gemm_bf16_ragged_rows(const RaggedRows& p, const void* a, const void* b, bool dgrad, void* workspace, cudaStream_t stream) {
  if (dgrad) return gemm::cutlass_bf16_ragged_rows_dgrad(p, a, b, workspace, stream);
  gemm::cutlass_bf16_ragged_rows_fprop(p, a, b, workspace, stream);
}

size_t gemm_bf16_ragged_reduction_workspace_size(int E, WgradOut out) {
  return out == WgradOut::kBF16 ? gemm::cutlass_bf16_ragged_reduction_bf16_workspace_size(E) : gemm::cutlass_bf16_ragged_reduction_f32_workspace_size(E);
}

void gemm_bf16_ragged_reduction(const RaggedReduction& p, const void* a, const void* b, void* workspace, cudaStream_t stream) {
  if (p.out_kind == WgradOut::kBF16) return gemm::cutlass_bf16_ragged_reduction_bf16(p, a, b, workspace, stream);
  gemm::cutlass_bf16_ragged_reduction_f32(p, a, b, workspace, stream);
}

}  // namespace moegemm
