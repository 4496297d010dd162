// FP8 blockwise grouped GEMM with a ragged reduction (the weight gradient) on CUTLASS's sm90 ptr-array
// kernel, for any Fp8Tiling; production's is instantiated for fp32 output (optionally accumulated:
// main_grad) in fp8_ragged_reduction_f32.cu and for bf16 output in fp8_ragged_reduction_bf16.cu.
//   out[e] ([N, K]) (+)= Σ_{128-token blocks i of e} saT[i] sbT[i] · qaT_e [N, m_e] · qbT_eᵀ [m_e, K]
// Operands are the per-expert transposed (token-contiguous) copies written by quantize_act; expert e's
// tokens start at column col[e] (a multiple of 16, as TMA requires) and its scale blocks at row blk[e].
// Experts without tokens get no tiles (csrc/moegemm.h, RaggedReduction).
#pragma once

#include <type_traits>

#include "moegemm.h"
#include "kernels/gemm/cutlass/configs.cuh"

namespace moegemm::cutlass_ragged_reduction {

using namespace cute;
// 128x1 blocks along tokens for both operands; scale tensors [NB, N] and [NB, K] are MN-major.
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 1, 128, GMMA::Major::MN, GMMA::Major::MN>;
// fp32 output reads C (= D) so that it can accumulate; bf16 output has no C.
template <class ElementD, class Tiling>
using Config = grouped::Fp8BlockwiseGemm<ScaleConfig, std::conditional_t<std::is_same_v<ElementD, float>, float, void>, ElementD,
                                         Tiling>;

template <class Arrays>
__global__ void build_args(Arrays a, const int32_t* __restrict__ plan, int E, int64_t col_cap, int64_t blk_cap, int64_t N,
                           int64_t K,
                           const typename Arrays::ElementA* qaT, const float* saT, const typename Arrays::ElementB* qbT,
                           const float* sbT, typename Arrays::ElementD* out) {
  // columns and scale blocks within the operands' capacities (a foreign plan: no tiles)
  const bool fits = plan_fits(plan, E, PlanLimits{kNoLimit, col_cap, blk_cap});
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= E) return;
  const int32_t* tok = plan;
  const int32_t* col = plan + (E + 1);
  const int32_t* blk = plan + 2 * (E + 1);
  const int m = fits ? tok[e + 1] - tok[e] : 0;
  a.shape[e] = m > 0 ? grouped::GroupShape{static_cast<int>(N), static_cast<int>(K), m} : grouped::GroupShape{0, 0, 0};
  a.A[e] = qaT + col[e];
  a.SFA[e] = saT + int64_t(blk[e]) * N;
  a.B[e] = qbT + col[e];
  a.SFB[e] = sbT + int64_t(blk[e]) * K;
  if constexpr (std::is_void_v<typename Arrays::ElementC>) a.C[e] = nullptr;
  else a.C[e] = out + e * N * K;
  a.D[e] = out + e * N * K;
  a.stride_A[e] = grouped::leading<typename Arrays::StrideA>(col_cap);
  a.stride_B[e] = grouped::leading<typename Arrays::StrideB>(col_cap);
  a.stride_C[e] = grouped::leading<typename Arrays::StrideC>(K);
  a.stride_D[e] = grouped::leading<typename Arrays::StrideD>(K);
}

template <class ElementD, class Tiling>
size_t workspace_size(int E) { return Config<ElementD, Tiling>::Runner::workspace_size(E); }

template <class ElementD, class Tiling>
void run(const RaggedReduction& p, Fp8Operand a, Fp8Operand b, void* workspace, cudaStream_t stream, const char* name) {
  using Runner = typename Config<ElementD, Tiling>::Runner;
  using Arrays = typename Runner::Arrays;
  const bool accumulate = p.out_kind == WgradOut::kF32Accumulate;
  const PlanLimits limits{kNoLimit, p.cols, p.blocks};
  ElementD* out = static_cast<ElementD*>(p.out);
  if (!accumulate) zero_empty_experts(p.plan, p.E, limits, p.N * p.K * int64_t(sizeof(ElementD)), out, stream);
  Arrays args = Runner::arrays(workspace, p.E);
  build_args<Arrays><<<grouped::prep_grid(p.E), grouped::kPrepThreads, 0, stream>>>(
      args, p.plan, p.E, p.cols, p.blocks, p.N, p.K, reinterpret_cast<const typename Arrays::ElementA*>(a.q), a.s,
      reinterpret_cast<const typename Arrays::ElementB*>(b.q), b.s, out);
  check_launch(name);
  Runner::run(args, p.E, 1.f, accumulate ? 1.f : 0.f, workspace, stream, name);
}

}  // namespace moegemm::cutlass_ragged_reduction
