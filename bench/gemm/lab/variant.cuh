// Registers one tiling of the lab: #define LAB_TILING to a tiling name of gemm_configs.cuh and
// LAB_RAGGED_M / LAB_RAGGED_K_BF16 / LAB_RAGGED_K_F32 to 1 for the GEMMs to build with it, then include this.
#include "kernels/gemm_fp8_ragged_k.cuh"
#include "kernels/gemm_fp8_ragged_m.cuh"
#include "lab.h"

#define LAB_STR2(x) #x
#define LAB_STR(x) LAB_STR2(x)

namespace moegemm_lab {
namespace {

using Tiling = moegemm::grouped::LAB_TILING;

template <class ElementD>
void run_k(const uint8_t* qaT, const float* saT, const uint8_t* qbT, const float* sbT, const int32_t* plan, int E,
           int64_t col_cap, int64_t blk_cap, int64_t N, int64_t K, void* out, bool accumulate, void* workspace,
           cudaStream_t stream, const char* name) {
  moegemm::ragged_k::run<ElementD, Tiling>(qaT, saT, qbT, sbT, plan, E, col_cap, blk_cap, N, K, static_cast<ElementD*>(out),
                                           accumulate, workspace, stream, name);
}

struct Register {
  Register() {
#if LAB_RAGGED_M
    ragged_m_variants().push_back({LAB_STR(LAB_TILING), &moegemm::ragged_m::workspace_size<Tiling>, &moegemm::ragged_m::run<Tiling>});
#endif
#if LAB_RAGGED_K_BF16
    ragged_k_variants().push_back({LAB_STR(LAB_TILING), false, &moegemm::ragged_k::workspace_size<cutlass::bfloat16_t, Tiling>,
                                   &run_k<cutlass::bfloat16_t>});
#endif
#if LAB_RAGGED_K_F32
    ragged_k_variants().push_back({LAB_STR(LAB_TILING), true, &moegemm::ragged_k::workspace_size<float, Tiling>, &run_k<float>});
#endif
  }
} registered;

}  // namespace
}  // namespace moegemm_lab
