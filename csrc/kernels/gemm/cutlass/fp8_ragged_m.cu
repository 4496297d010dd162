// FP8 grouped GEMM with ragged rows (fprop and dgrad) on CUTLASS, production tiling. See fp8_ragged_m.cuh.
#include "kernels/gemm/variants.h"
#include "kernels/gemm/cutlass/fp8_ragged_m.cuh"

namespace moegemm::gemm {

using RaggedMTiling = grouped::Tile128x128C1x2;

size_t cutlass_fp8_ragged_m_workspace_size(int E) { return ragged_m::workspace_size<RaggedMTiling>(E); }

void cutlass_fp8_ragged_m(const RaggedRows& p, Fp8Operand a, Fp8Operand b, void* workspace, cudaStream_t stream) {
  ragged_m::run<RaggedMTiling>(p, a, b, workspace, stream, "gemm_fp8_ragged_m (CUTLASS)");
}

}  // namespace moegemm::gemm
