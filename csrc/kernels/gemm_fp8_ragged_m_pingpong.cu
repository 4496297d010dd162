// FP8 fprop/dgrad GEMM, pingpong schedule (see gemm_fp8_ragged_m.cuh, gemm_configs.cuh: Fp8Pingpong).
#include "gemm_fp8_ragged_m.cuh"

namespace moegemm::fp8 {

template <> size_t ragged_m_workspace_size<Schedule::kPingpong>(int E) { return ragged_m::workspace_size<grouped::Fp8Pingpong>(E); }
template <> void ragged_m<Schedule::kPingpong>(const RaggedM& args) { ragged_m::run<grouped::Fp8Pingpong>(args, "gemm_fp8_ragged_m (pingpong)"); }

}  // namespace moegemm::fp8
