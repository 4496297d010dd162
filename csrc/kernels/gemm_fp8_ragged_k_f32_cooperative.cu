// FP8 wgrad GEMM with fp32 output, written or accumulated (Megatron's main_grad), cooperative schedule. See gemm_fp8_ragged_k.cuh.
#include "gemm_fp8_ragged_k.cuh"

namespace moegemm::fp8 {

template <> size_t ragged_k_f32_workspace_size<Schedule::kCooperative>(int E) {
  return ragged_k::workspace_size<float, grouped::Fp8Cooperative>(E);
}
template <> void ragged_k_f32<Schedule::kCooperative>(const RaggedK& args) {
  ragged_k::run<float, grouped::Fp8Cooperative>(args, "gemm_fp8_ragged_k_f32 (cooperative)");
}

}  // namespace moegemm::fp8
