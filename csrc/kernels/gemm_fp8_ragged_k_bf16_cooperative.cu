// FP8 wgrad GEMM with bf16 output (the parameter's dtype, no fp32 round trip), cooperative schedule. See gemm_fp8_ragged_k.cuh.
#include "gemm_fp8_ragged_k.cuh"

namespace moegemm::fp8 {

template <> size_t ragged_k_bf16_workspace_size<Schedule::kCooperative>(int E) {
  return ragged_k::workspace_size<cutlass::bfloat16_t, grouped::Fp8Cooperative>(E);
}
template <> void ragged_k_bf16<Schedule::kCooperative>(const RaggedK& args) {
  ragged_k::run<cutlass::bfloat16_t, grouped::Fp8Cooperative>(args, "gemm_fp8_ragged_k_bf16 (cooperative)");
}

}  // namespace moegemm::fp8
