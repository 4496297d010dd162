// The bf16 recipe's grouped GEMMs on CUTLASS's sm90 ptr-array kernel share one argument builder; each
// lives in its own translation unit (bf16_ragged_rows_{fprop,dgrad}.cu, bf16_ragged_reduction_{f32,bf16}.cu) so that
// they compile in parallel.
#pragma once

#include <type_traits>

#include "moegemm.h"
#include "kernels/gemm/variants.h"
#include "kernels/gemm/cutlass/configs.cuh"

namespace moegemm::bf16 {

// Which operand is ragged: rows of A and D (fprop, dgrad), or the reduction (wgrad).
enum class Ragged { kRows, kReduction };

// Per expert e with token start s and count m:
//   kRows:      A = a + s*lda ([m, Kg]),  B = b + e*N*K, D = d + s*ldd ([m, Ng]); shape (m, Ng, Kg)
//   kReduction: A = a + s*lda, B = b + s*ldb, C = D = d + e*Ng*Kg; shape (Mg, Ng, m), or no tiles if m = 0
// kRows also zeroes D's rows [plan[E], T) (grouped::zero_uncovered_rows). A plan that does not fit T
// tokens (plan_fits) is taken as the plan of no tokens.
template <class Arrays, Ragged kRagged>
__global__ void build_args(Arrays a, const int32_t* __restrict__ plan, int E, int64_t T, int Mg, int Ng, int Kg,
                           const typename Arrays::ElementA* A, int64_t lda, const typename Arrays::ElementB* B,
                           int64_t ldb, typename Arrays::ElementD* D, int64_t ldd) {
  // The dynamic tile walk's counter starts at tile 0 (the GEMM follows on this stream).
  if constexpr (Arrays::kDynamicWalk) {
    if (blockIdx.x == 0 && threadIdx.x == 0) a.claims[0] = 0;
  }
  const bool fits = plan_fits(plan, E, token_limit(T));
  if constexpr (kRagged == Ragged::kRows) {
    if (grouped::zero_uncovered_rows(fits ? plan[E] : 0, T, ldd * int64_t(sizeof(typename Arrays::ElementD)), D)) return;
  }
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= E) return;
  const int64_t start = fits ? plan[e] : 0;
  const int m = fits ? plan[e + 1] - plan[e] : 0;
  a.A[e] = A + start * lda;
  if constexpr (kRagged == Ragged::kRows) {
    a.shape[e] = grouped::GroupShape{m, Ng, Kg};
    a.B[e] = B + int64_t(e) * Ng * Kg;
    a.C[e] = nullptr;
    a.D[e] = D + start * ldd;
  } else {
    a.shape[e] = m > 0 ? grouped::GroupShape{Mg, Ng, m} : grouped::GroupShape{0, 0, 0};
    a.B[e] = B + start * ldb;
    if constexpr (std::is_void_v<typename Arrays::ElementC>) a.C[e] = nullptr;
    else a.C[e] = D + int64_t(e) * Mg * Ng;
    a.D[e] = D + int64_t(e) * Mg * Ng;
  }
  a.stride_A[e] = grouped::leading<typename Arrays::StrideA>(lda);
  a.stride_B[e] = grouped::leading<typename Arrays::StrideB>(ldb);
  a.stride_C[e] = grouped::leading<typename Arrays::StrideC>(ldd);
  a.stride_D[e] = grouped::leading<typename Arrays::StrideD>(ldd);
}

template <class Config, Ragged kRagged>
void run(const int32_t* plan, int E, int64_t T, int Mg, int Ng, int Kg, const void* A, int64_t lda, const void* B,
         int64_t ldb, void* D, int64_t ldd, float beta, void* workspace, cudaStream_t stream, const char* name) {
  using Runner = typename Config::Runner;
  using Arrays = typename Runner::Arrays;
  Arrays a = Runner::arrays(workspace, E);
  const dim3 grid = kRagged == Ragged::kRows ? grouped::prep_grid_zeroing_rows(E) : grouped::prep_grid(E);
  build_args<Arrays, kRagged><<<grid, grouped::kPrepThreads, 0, stream>>>(
      a, plan, E, T, Mg, Ng, Kg, static_cast<const typename Arrays::ElementA*>(A), lda,
      static_cast<const typename Arrays::ElementB*>(B), ldb, static_cast<typename Arrays::ElementD*>(D), ldd);
  check_launch(name);
  Runner::run(a, E, 1.f, beta, workspace, stream, name);
}

// wgrad: dy_e read as a column-major A, x_e as a row-major B; fp32 output reads C so it can accumulate.
template <class ElementD>
using WgradConfig = grouped::Bf16Gemm<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor,
                                      std::conditional_t<std::is_same_v<ElementD, float>, float, void>, ElementD>;

template <class ElementD>
void wgrad(const RaggedReduction& p, const void* dy, const void* x, void* workspace, cudaStream_t stream, const char* name) {
  const bool accumulate = p.out_kind == WgradOut::kF32Accumulate;
  if (!accumulate) zero_empty_experts(p.plan, p.E, token_limit(p.T), p.N * p.K * int64_t(sizeof(ElementD)), p.out, stream);
  run<WgradConfig<ElementD>, Ragged::kReduction>(p.plan, p.E, p.T, int(p.N), int(p.K), 0, dy, p.N, x, p.K, p.out, p.K,
                                                 accumulate ? 1.f : 0.f, workspace, stream, name);
}

}  // namespace moegemm::bf16
