// FP8 blockwise grouped GEMM with ragged rows: fprop (b = W) and dgrad (b = the Wᵀ copy), for one
// schedule (instantiated in gemm_fp8_ragged_m_cooperative.cu / _pingpong.cu).
//   out[rows of e] (bf16, [T, N]) = (qa [T, K], 1x128 scales sa [T, Kb]) · (qb[e] [N, K], 128x128 scales sb[e] [Nb, Kb])ᵀ
#pragma once

#include "../moegemm.h"
#include "gemm_configs.cuh"
#include "gemm_fp8_variants.h"

namespace moegemm::ragged_m {

using namespace cute;
// Both scale tensors K-major: sa [T, Kb] (per-row pointer offset), sb [E][Nb, Kb].
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128, GMMA::Major::K, GMMA::Major::K>;
template <class Schedule>
using Config = grouped::Fp8BlockwiseGemm<ScaleConfig, void, cutlass::bfloat16_t, Schedule>;

template <class Arrays>
__global__ void build_args(Arrays a, const int32_t* __restrict__ plan, int E, int64_t N, int64_t K,
                           const typename Arrays::ElementA* qa, const float* sa, const typename Arrays::ElementB* qb,
                           const float* sb, typename Arrays::ElementD* out) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= E) return;
  const int64_t start = plan[e], m = plan[e + 1] - plan[e];
  const int64_t Kb = (K + kBlock - 1) / kBlock, Nb = (N + kBlock - 1) / kBlock;
  a.shape[e] = grouped::GroupShape{static_cast<int>(m), static_cast<int>(N), static_cast<int>(K)};  // m = 0: no tiles
  a.A[e] = qa + start * K;
  a.SFA[e] = sa + start * Kb;
  a.B[e] = qb + e * N * K;
  a.SFB[e] = sb + e * Nb * Kb;
  a.C[e] = nullptr;
  a.D[e] = out + start * N;
  a.stride_A[e] = grouped::leading<typename Arrays::StrideA>(K);
  a.stride_B[e] = grouped::leading<typename Arrays::StrideB>(K);
  a.stride_C[e] = grouped::leading<typename Arrays::StrideC>(N);
  a.stride_D[e] = grouped::leading<typename Arrays::StrideD>(N);
}

template <class Schedule>
size_t workspace_size(int E) { return Config<Schedule>::Runner::workspace_size(E); }

template <class Schedule>
void run(const fp8::RaggedM& p, const char* name) {
  using Runner = typename Config<Schedule>::Runner;
  using Arrays = typename Runner::Arrays;
  Arrays a = Runner::arrays(p.workspace, p.E);
  build_args<Arrays><<<grouped::prep_grid(p.E), grouped::kPrepThreads, 0, p.stream>>>(
      a, p.plan, p.E, p.N, p.K, reinterpret_cast<const typename Arrays::ElementA*>(p.qa), p.sa,
      reinterpret_cast<const typename Arrays::ElementB*>(p.qb), p.sb, static_cast<typename Arrays::ElementD*>(p.out));
  check_launch(name);
  Runner::run(a, p.E, 1.f, 0.f, p.workspace, p.stream, name);
}

}  // namespace moegemm::ragged_m
