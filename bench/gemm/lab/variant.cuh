// Registers one tiling of the lab: #define LAB_TILING to a tiling name of csrc/kernels/gemm/cutlass/configs.cuh and
// LAB_RAGGED_M / LAB_RAGGED_K_BF16 / LAB_RAGGED_K_F32 to 1 for the GEMMs to build with it, then include this.
#include "kernels/gemm/cutlass/fp8_ragged_k.cuh"
#include "kernels/gemm/cutlass/fp8_ragged_m.cuh"
#include "lab.h"

#define LAB_STR2(x) #x
#define LAB_STR(x) LAB_STR2(x)

namespace moegemm_lab {
namespace {

using Tiling = moegemm::grouped::LAB_TILING;

struct Register {
  Register() {
#if LAB_RAGGED_M
    ragged_m_variants().push_back({LAB_STR(LAB_TILING), &moegemm::ragged_m::workspace_size<Tiling>, &moegemm::ragged_m::run<Tiling>});
#endif
#if LAB_RAGGED_K_BF16
    ragged_k_variants().push_back({LAB_STR(LAB_TILING), false, &moegemm::ragged_k::workspace_size<cutlass::bfloat16_t, Tiling>,
                                   &moegemm::ragged_k::run<cutlass::bfloat16_t, Tiling>});
#endif
#if LAB_RAGGED_K_F32
    ragged_k_variants().push_back({LAB_STR(LAB_TILING), true, &moegemm::ragged_k::workspace_size<float, Tiling>, &moegemm::ragged_k::run<float, Tiling>});
#endif
  }
} registered;

}  // namespace
}  // namespace moegemm_lab
