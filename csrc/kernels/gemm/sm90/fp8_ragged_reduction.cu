// Launching moegemm's own FP8 ragged-reduction GEMM (fp8_ragged_reduction.cuh) with the tiling heuristics.h chose.
#include <algorithm>
#include <stdexcept>

#include "kernels/common/device.h"
#include "kernels/gemm/heuristics.h"
#include "kernels/gemm/variants.h"
#include "kernels/gemm/sm90/fp8_ragged_reduction.cuh"
#include "kernels/gemm/sm90/tma.h"

namespace moegemm::gemm {
namespace {

template <int kBlockN, WgradOut kOut>
using Config = sm90::Fp8RaggedReductionConfig<kBlockN, kOut>;

template <class Cfg>
void launch(const RaggedReduction& p, Fp8Operand a, Fp8Operand b, int* tile_counter, cudaStream_t stream) {
  constexpr auto kKernel = sm90::fp8_ragged_reduction_kernel<Cfg>;
  const char* name = "gemm_fp8_ragged_reduction (sm90)";
  const int64_t tiles = p.E * ceil_div(p.N, Cfg::kBlockM) * ceil_div(p.K, Cfg::kBlockN);
  // the tile counter draws up to two ids per CTA past the last tile
  if (tiles > INT32_MAX - 2 * 65536)
    throw std::runtime_error("moegemm: gemm_fp8_ragged_reduction: too many tiles for the scheduler's 32-bit ids (2^31 less two per CTA)");
  if (p.cols > INT32_MAX) throw std::runtime_error("moegemm: gemm_fp8_ragged_reduction: the column copy exceeds the TMA coordinate range");
  sm90::Fp8RaggedReductionParams k{};
  const uint64_t N = p.N, K = p.K, cols = p.cols;
  k.a = sm90::make_tensor_map({a.q, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, N, cols, cols, Cfg::kBlockM, Cfg::kBlockK,
                               CU_TENSOR_MAP_SWIZZLE_128B}, name);
  k.b = sm90::make_tensor_map({b.q, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, K, cols, cols, Cfg::kBlockN, Cfg::kBlockK,
                               CU_TENSOR_MAP_SWIZZLE_128B}, name);
  const CUtensorMapDataType out_type = Cfg::kOut == WgradOut::kBF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
  const uint64_t row_bytes = K * Cfg::kOutBytes;
  const CUtensorMapSwizzle out_swizzle = Cfg::kSlabRowBytes == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B;
  k.d = sm90::make_tensor_map_3d(sm90::Tensor3d{{p.out, out_type, Cfg::kOutBytes, N, K, row_bytes, Cfg::kWarpgroupRows, Cfg::kSlabCols,
                                              out_swizzle},
                                             uint64_t(p.E), N * row_bytes},
                              name);
  k.sa = a.s;
  k.sb = b.s;
  k.plan = p.plan;
  k.tile_counter = tile_counter;
  k.E = p.E, k.N = int(p.N), k.K = int(p.K);
  k.band = ragged_reduction_band(p.K, Cfg::kBlockN);
  k.cols = p.cols, k.blocks = p.blocks;
  allow_shared_memory<kKernel>(Cfg::kSmemBytes, name);
  const int grid = int(std::max<int64_t>(1, std::min<int64_t>(grid_sms(), tiles)));
  if (tile_counter == nullptr) throw std::runtime_error("moegemm: gemm_fp8_ragged_reduction (sm90): no workspace for the tile counter");
  kKernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(k);
  check_launch(name);
}

template <int kBlockN>
void launch_out(const RaggedReduction& p, Fp8Operand a, Fp8Operand b, int* tile_counter, cudaStream_t stream) {
  switch (p.out_kind) {
    case WgradOut::kF32: return launch<Config<kBlockN, WgradOut::kF32>>(p, a, b, tile_counter, stream);
    case WgradOut::kF32Accumulate: return launch<Config<kBlockN, WgradOut::kF32Accumulate>>(p, a, b, tile_counter, stream);
    case WgradOut::kBF16: return launch<Config<kBlockN, WgradOut::kBF16>>(p, a, b, tile_counter, stream);
  }
  throw std::runtime_error("moegemm: gemm_fp8_ragged_reduction (sm90): unknown output kind");
}

}  // namespace

void sm90_fp8_ragged_reduction(const RaggedReduction& p, Fp8Operand a, Fp8Operand b, const RaggedReductionTiling& tiling,
                               void* workspace, cudaStream_t stream) {
  int* tile_counter = static_cast<int*>(workspace);
  // one instantiation per entry of heuristics.h's kRaggedReductionTilings and output kind
  if (tiling.block_n == 128) return launch_out<128>(p, a, b, tile_counter, stream);
  if (tiling.block_n == 160) return launch_out<160>(p, a, b, tile_counter, stream);
  if (tiling.block_n == 256) return launch_out<256>(p, a, b, tile_counter, stream);
  throw std::runtime_error("moegemm: gemm_fp8_ragged_reduction (sm90): no kernel built for this tiling");
}

}  // namespace moegemm::gemm
