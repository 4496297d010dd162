// Launching moegemm's own FP8 ragged-row GEMM (fp8_ragged_rows.cuh) with the tiling heuristics.h chose.
#include <algorithm>
#include <stdexcept>

#include "kernels/gemm/heuristics.h"
#include "kernels/gemm/variants.h"
#include "kernels/gemm/sm90/fp8_ragged_rows.cuh"
#include "kernels/gemm/sm90/tma.h"

namespace moegemm::gemm {
namespace {

// BLOCK_N 128 with five stages, 256 with three: as many as fit beside the epilogue tile and the plan.
using Narrow = sm90::Fp8RaggedRowsConfig<1, 5>;
using Wide = sm90::Fp8RaggedRowsConfig<2, 3>;

template <class Cfg>
void launch(const RaggedRows& p, Fp8Operand a, Fp8Operand b, cudaStream_t stream) {
  constexpr auto kKernel = sm90::fp8_ragged_rows_kernel<Cfg>;
  const char* name = "gemm_fp8_ragged_m (sm90)";
  if (p.E * p.N > INT32_MAX) throw std::runtime_error("moegemm: gemm_fp8_ragged_m: E * N exceeds the TMA coordinate range");
  sm90::Fp8RaggedRowsParams k{};
  const uint64_t T = p.T, N = p.N, K = p.K;
  k.a = sm90::make_tensor_map({a.q, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, T, K, K, Cfg::kBlockM, Cfg::kBlockK,
                               CU_TENSOR_MAP_SWIZZLE_128B}, name);
  k.b = sm90::make_tensor_map({b.q, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, uint64_t(p.E) * N, K, K, Cfg::kBlockN, Cfg::kBlockK,
                               CU_TENSOR_MAP_SWIZZLE_128B}, name);
  k.d = sm90::make_tensor_map({p.out, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, T, N, N * 2, Cfg::kWarpgroupRows, Cfg::kStoreCols,
                               CU_TENSOR_MAP_SWIZZLE_128B}, name);
  k.sa = a.s;
  k.sb = b.s;
  k.plan = p.plan;
  k.out = static_cast<__nv_bfloat16*>(p.out);
  k.E = p.E, k.T = int(p.T), k.N = int(p.N), k.K = int(p.K);
  // one CTA per SM, or one per tile when there are fewer (an upper bound: the row blocks live on the device)
  const int64_t max_tiles = block_capacity(p.T, p.E) * ceil_div(p.N, Cfg::kBlockN);
  const int grid = int(std::max<int64_t>(1, std::min<int64_t>(sm90::sm_count(), max_tiles)));
  sm90::allow_shared_memory<kKernel>(Cfg::kSmemBytes, name);
  kKernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(k);
  check_launch(name);
}

}  // namespace

void sm90_fp8_ragged_rows(const RaggedRows& p, Fp8Operand a, Fp8Operand b, const RaggedRowsTiling& tiling, cudaStream_t stream) {
  if (tiling.parts == 2) return launch<Wide>(p, a, b, stream);
  launch<Narrow>(p, a, b, stream);
}

}  // namespace moegemm::gemm
