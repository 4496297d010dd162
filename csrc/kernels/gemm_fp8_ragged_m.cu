// FP8 blockwise grouped GEMM with ragged rows: fprop (b = W) and dgrad (b = the Wᵀ copy).
//   out[rows of e] (bf16, [T, N]) = (qa [T, K], 1x128 scales sa [T, Kb]) · (qb[e] [N, K], 128x128 scales sb[e] [Nb, Kb])ᵀ
#include "../moegemm.h"
#include "gemm_configs.cuh"

namespace moegemm {
namespace {

using namespace cute;
// Both scale tensors K-major: sa [T, Kb] (per-row pointer offset), sb [E][Nb, Kb].
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128, GMMA::Major::K, GMMA::Major::K>;
using Config = grouped::Fp8BlockwiseGemm<ScaleConfig, void, cutlass::bfloat16_t>;
using Runner = Config::Runner;
using Arrays = Runner::Arrays;

__global__ void build_args(Arrays a, const int32_t* __restrict__ plan, int E, int64_t T, int64_t N, int64_t K,
                           const Arrays::ElementA* qa, const float* sa, const Arrays::ElementB* qb, const float* sb,
                           Arrays::ElementD* out) {
  const bool fits = plan_fits(plan, E, token_limit(T));  // a foreign plan: as if no tokens (zeros)
  if (grouped::zero_uncovered_rows(fits ? plan[E] : 0, T, N * int64_t(sizeof(Arrays::ElementD)), out)) return;
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= E) return;
  const int64_t start = fits ? plan[e] : 0, m = fits ? plan[e + 1] - plan[e] : 0;
  const int64_t Kb = (K + kBlock - 1) / kBlock, Nb = (N + kBlock - 1) / kBlock;
  a.shape[e] = grouped::GroupShape{static_cast<int>(m), static_cast<int>(N), static_cast<int>(K)};  // m = 0: no tiles
  a.A[e] = qa + start * K;
  a.SFA[e] = sa + start * Kb;
  a.B[e] = qb + e * N * K;
  a.SFB[e] = sb + e * Nb * Kb;
  a.C[e] = nullptr;
  a.D[e] = out + start * N;
  a.stride_A[e] = grouped::leading<Arrays::StrideA>(K);
  a.stride_B[e] = grouped::leading<Arrays::StrideB>(K);
  a.stride_C[e] = grouped::leading<Arrays::StrideC>(N);
  a.stride_D[e] = grouped::leading<Arrays::StrideD>(N);
}

}  // namespace

size_t gemm_fp8_ragged_m_workspace_size(int E) { return Runner::workspace_size(E); }

void gemm_fp8_ragged_m(const uint8_t* qa, const float* sa, const uint8_t* qb, const float* sb, const int32_t* plan, int E,
                       int64_t T, int64_t N, int64_t K, void* out, void* workspace, cudaStream_t stream) {
  Arrays a = Runner::arrays(workspace, E);
  build_args<<<grouped::prep_grid_zeroing_rows(E), grouped::kPrepThreads, 0, stream>>>(
      a, plan, E, T, N, K, reinterpret_cast<const Arrays::ElementA*>(qa), sa, reinterpret_cast<const Arrays::ElementB*>(qb),
      sb, static_cast<Arrays::ElementD*>(out));
  check_launch("gemm_fp8_ragged_m build_args");
  Runner::run(a, E, 1.f, 0.f, workspace, stream, "gemm_fp8_ragged_m");
}

}  // namespace moegemm
