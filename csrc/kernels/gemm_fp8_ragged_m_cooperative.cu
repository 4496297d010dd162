// FP8 fprop/dgrad GEMM, cooperative schedule (see gemm_fp8_ragged_m.cuh, gemm_configs.cuh: Fp8Cooperative).
#include "gemm_fp8_ragged_m.cuh"

namespace moegemm::fp8 {

template <> size_t ragged_m_workspace_size<Schedule::kCooperative>(int E) { return ragged_m::workspace_size<grouped::Fp8Cooperative>(E); }
template <> void ragged_m<Schedule::kCooperative>(const RaggedM& args) { ragged_m::run<grouped::Fp8Cooperative>(args, "gemm_fp8_ragged_m (cooperative)"); }

}  // namespace moegemm::fp8
