// FP8 blockwise grouped GEMM with ragged rows on CUTLASS's sm90 ptr-array kernel: fprop (b = W) and
// dgrad (b = the Wᵀ copy), for any Fp8Tiling (configs.cuh); fp8_ragged_m.cu instantiates production's.
//   out[rows of e] (bf16, [T, N]) = (qa [T, K], 1x128 scales sa [T, Kb]) · (qb[e] [N, K], 128x128 scales sb[e] [Nb, Kb])ᵀ
#pragma once

#include "moegemm.h"
#include "kernels/gemm/cutlass/configs.cuh"

namespace moegemm::ragged_m {

using namespace cute;
// Both scale tensors K-major: sa [T, Kb] (per-row pointer offset), sb [E][Nb, Kb].
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128, GMMA::Major::K, GMMA::Major::K>;
template <class Tiling>
using Config = grouped::Fp8BlockwiseGemm<ScaleConfig, void, cutlass::bfloat16_t, Tiling>;

template <class Arrays>
__global__ void build_args(Arrays a, const int32_t* __restrict__ plan, int E, int64_t T, int64_t N, int64_t K,
                           const typename Arrays::ElementA* qa, const float* sa, const typename Arrays::ElementB* qb,
                           const float* sb, typename Arrays::ElementD* out) {
  const bool fits = plan_fits(plan, E, token_limit(T));  // a foreign plan: as if no tokens (zeros)
  if (grouped::zero_uncovered_rows(fits ? plan[E] : 0, T, N * int64_t(sizeof(typename Arrays::ElementD)), out)) return;
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
  a.stride_A[e] = grouped::leading<typename Arrays::StrideA>(K);
  a.stride_B[e] = grouped::leading<typename Arrays::StrideB>(K);
  a.stride_C[e] = grouped::leading<typename Arrays::StrideC>(N);
  a.stride_D[e] = grouped::leading<typename Arrays::StrideD>(N);
}

template <class Tiling>
size_t workspace_size(int E) { return Config<Tiling>::Runner::workspace_size(E); }

template <class Tiling>
void run(const RaggedRows& p, Fp8Operand a, Fp8Operand b, void* workspace, cudaStream_t stream, const char* name) {
  using Runner = typename Config<Tiling>::Runner;
  using Arrays = typename Runner::Arrays;
  Arrays args = Runner::arrays(workspace, p.E);
  build_args<Arrays><<<grouped::prep_grid_zeroing_rows(p.E), grouped::kPrepThreads, 0, stream>>>(
      args, p.plan, p.E, p.T, p.N, p.K, reinterpret_cast<const typename Arrays::ElementA*>(a.q), a.s,
      reinterpret_cast<const typename Arrays::ElementB*>(b.q), b.s, static_cast<typename Arrays::ElementD*>(p.out));
  check_launch(name);
  Runner::run(args, p.E, 1.f, 0.f, workspace, stream, name);
}

}  // namespace moegemm::ragged_m
