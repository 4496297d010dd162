// Launching moegemm's own FP8 ragged-row GEMM (fp8_ragged_rows.cuh) with the tiling heuristics.h chose.
#include <algorithm>
#include <array>
#include <mutex>
#include <stdexcept>
#include <string>

#include "kernels/gemm/heuristics.h"
#include "kernels/gemm/variants.h"
#include "kernels/gemm/sm90/fp8_ragged_rows.cuh"
#include "kernels/common/device.h"
#include "kernels/common/pdl.cuh"
#include "kernels/gemm/sm90/tma.h"

namespace moegemm::gemm {
namespace {

template <int kBlockN, int kCluster, bool kQuantizeA = false, bool kDeferLastPart = false>
using Config = sm90::Fp8RaggedRowsConfig<kBlockN, kCluster, kQuantizeA, kDeferLastPart>;

// A/B (temporary): MOEGEMM_AB_DEFER_LAST_PART=1 runs the single-CTA 256-column tilings with part 1's epilogue deferred
// to the next tile (Fp8RaggedRowsConfig::kDeferLastPart; in 2-CTA clusters it spills); read at every launch
bool defer_last_part() { return env_flag("MOEGEMM_AB_DEFER_LAST_PART", false); }

// Clusters of `Cfg` that fit on the device at once (a cluster's CTAs share a GPC), queried once per device; for
// single CTAs, the SMs of the budget (grid_sms).
template <class Cfg>
int max_active_clusters(const char* name) {
  if (Cfg::kCluster == 1) return grid_sms();
  static std::array<int, 64> count{};
  static std::array<std::once_flag, 64> once;
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  std::call_once(once[device], [&] {
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(Cfg::kCluster * sm_count());
    config.blockDim = dim3(Cfg::kThreads);
    config.dynamicSmemBytes = Cfg::kSmemBytes;
    cudaLaunchAttribute cluster{};
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = Cfg::kCluster, cluster.val.clusterDim.y = 1, cluster.val.clusterDim.z = 1;
    config.attrs = &cluster;
    config.numAttrs = 1;
    check_cuda(cudaOccupancyMaxActiveClusters(&count[device], sm90::fp8_ragged_rows_kernel<Cfg>, &config), name);
    if (count[device] < 1) throw std::runtime_error(std::string("moegemm: ") + name + ": no cluster fits on this device");
  });
  return std::max(1, std::min(count[device], grid_sms() / Cfg::kCluster));
}

// `prologue`: the fused form's (Cfg::kQuantizeA), whose `a` is the memory its prologue writes; `words` its
// claims' workspace (kSm90OneLaunchWorkspace bytes). `tile_counter`: the dynamic walk's otherwise, zero at launch (and
// left zero).
template <class Cfg>
void launch(const RaggedRows& p, Fp8Operand a, Fp8Operand b, ExpertBias bias, int* tile_counter, cudaStream_t stream,
            const RowsPrologue* prologue = nullptr, uint32_t* words = nullptr) {
  constexpr auto kKernel = sm90::fp8_ragged_rows_kernel<Cfg>;
  const char* name = Cfg::kQuantizeA ? "gemm_fp8_ragged_rows_quantize_a (sm90)" : "gemm_fp8_ragged_rows (sm90)";
  if (p.E * p.N > INT32_MAX) throw std::runtime_error("moegemm: gemm_fp8_ragged_rows: E * N exceeds the TMA coordinate range");
  if (p.E * ceil_div(p.N, kBlock) * ceil_div(p.K, kBlock) > INT32_MAX)  // the kernel indexes them in 32 bits
    throw std::runtime_error("moegemm: gemm_fp8_ragged_rows: 2^31 weight scales or more");
  const int64_t max_tiles = block_capacity(p.T, p.E) * ceil_div(p.N, Cfg::kBlockN);
  // (the counter of a dynamic walk draws one id per CTA past the last tile)
  if (max_tiles + grid_sms() > INT32_MAX) throw std::runtime_error("moegemm: gemm_fp8_ragged_rows: 2^31 tiles or more (the scheduler's ids are 32-bit)");
  if (Cfg::kQuantizeA && words == nullptr) throw std::runtime_error("moegemm: gemm_fp8_ragged_rows_quantize_a (sm90): no workspace");
  if (Cfg::kDynamicWalk && !Cfg::kQuantizeA && tile_counter == nullptr) throw std::runtime_error("moegemm: gemm_fp8_ragged_rows (sm90): no workspace for the tile counter");
  sm90::Fp8RaggedRowsParams k{};
  const uint64_t T = p.T, N = p.N, K = p.K;
  k.a = sm90::make_tensor_map({a.q, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, T, K, K, Cfg::kBoxRowsA, Cfg::kBlockK,
                               CU_TENSOR_MAP_SWIZZLE_128B}, name);
  k.b = sm90::make_tensor_map({b.q, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, uint64_t(p.E) * N, K, K, Cfg::kBoxRowsB, Cfg::kBlockK,
                               CU_TENSOR_MAP_SWIZZLE_128B}, name);
  k.d = sm90::make_tensor_map({p.out, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, T, N, N * 2, Cfg::kWarpgroupRows, Cfg::kStoreCols,
                               CU_TENSOR_MAP_SWIZZLE_128B}, name);
  k.sa = sm90::make_tensor_map({a.s, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, uint64_t(ceil_div(p.K, kBlock)), T,
                                uint64_t(row_scale_pitch(p.T)) * 4, 1, Cfg::kSaBox, CU_TENSOR_MAP_SWIZZLE_NONE}, name);
  k.sb = b.s;
  k.plan = p.plan;
  k.tile_counter = tile_counter;
  k.out = static_cast<__nv_bfloat16*>(p.out);
  k.bias = bias.data;
  k.bias_f32 = bias.f32;
  k.E = p.E, k.T = int(p.T), k.N = int(p.N), k.K = int(p.K);
  if (prologue != nullptr) {
    k.plan_build = prologue->plan;
    k.x = static_cast<const __nv_bfloat16*>(prologue->x);
    k.qa = prologue->qa;
    k.sa_out = prologue->sa;
    k.zero = prologue->zero;
    k.claims = {words, next_grid_claims_tag()};
  }
  allow_shared_memory<kKernel>(Cfg::kSmemBytes, name);
  // as many clusters as fit at once within the SM budget, or one per group of tiles when there are fewer (an upper
  // bound: the row blocks live on the device); the fused form on every SM of the budget (its prologue's items
  // spread over them all)
  const int64_t max_groups = ceil_div(max_tiles, Cfg::kCluster);
  const int clusters = Cfg::kQuantizeA ? grid_sms() : int(std::max<int64_t>(1, std::min<int64_t>(max_active_clusters<Cfg>(name), max_groups)));
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(clusters * Cfg::kCluster);
  config.blockDim = dim3(Cfg::kThreads);
  config.dynamicSmemBytes = Cfg::kSmemBytes;
  config.stream = stream;
  cudaLaunchAttribute attrs[2]{};
  config.attrs = attrs;
  config.numAttrs = 1;
  attrs[0].id = cudaLaunchAttributeClusterDimension;
  attrs[0].val.clusterDim.x = Cfg::kCluster, attrs[0].val.clusterDim.y = 1, attrs[0].val.clusterDim.z = 1;
  if constexpr (!Cfg::kQuantizeA) {  // (the fused form writes memory before any wait: not dependent)
    attrs[1] = dependent_launch_attribute();  // launched dependent: kernels/common/pdl.cuh
    config.numAttrs = 2;
  }
  check_cuda(cudaLaunchKernelEx(&config, kKernel, k), name);
}

}  // namespace

void sm90_fp8_ragged_rows(const RaggedRows& p, Fp8Operand a, Fp8Operand b, ExpertBias bias, const RaggedRowsTiling& tiling,
                          void* workspace, cudaStream_t stream) {
  int* tile_counter = static_cast<int*>(workspace);
  // one instantiation per entry of heuristics.h's kRaggedRowsTilings
  const auto is = [&](int block_n, int cluster) { return tiling.block_n == block_n && tiling.cluster == cluster; };
  if (is(128, 1)) return launch<Config<128, 1>>(p, a, b, bias, tile_counter, stream);
  if (is(256, 1) && defer_last_part()) return launch<Config<256, 1, false, true>>(p, a, b, bias, tile_counter, stream);
  if (is(256, 1)) return launch<Config<256, 1>>(p, a, b, bias, tile_counter, stream);
  if (is(128, 2)) return launch<Config<128, 2>>(p, a, b, bias, tile_counter, stream);
  if (is(256, 2)) return launch<Config<256, 2>>(p, a, b, bias, tile_counter, stream);
  if (is(192, 1)) return launch<Config<192, 1>>(p, a, b, bias, tile_counter, stream);
  if (is(192, 2)) return launch<Config<192, 2>>(p, a, b, bias, tile_counter, stream);
  throw std::runtime_error("moegemm: gemm_fp8_ragged_rows (sm90): no kernel built for this tiling");
}

void sm90_fp8_ragged_rows_quantize_a(const RaggedRows& p, const RowsPrologue& prologue, Fp8Operand b, ExpertBias bias,
                                     const RaggedRowsTiling& tiling, void* workspace, cudaStream_t stream) {
  static_assert(kSm90OneLaunchWorkspace == GridClaims::kWords * sizeof(uint32_t), "the claims' workspace");
  // the single-CTA tilings of kRaggedRowsTilings, each also built with the prologue
  const Fp8Operand a{prologue.qa, prologue.sa};
  uint32_t* words = static_cast<uint32_t*>(workspace);
  if (tiling.cluster == 1 && tiling.block_n == 128) return launch<Config<128, 1, true>>(p, a, b, bias, nullptr, stream, &prologue, words);
  if (tiling.cluster == 1 && tiling.block_n == 192) return launch<Config<192, 1, true>>(p, a, b, bias, nullptr, stream, &prologue, words);
  if (tiling.cluster == 1 && tiling.block_n == 256 && defer_last_part())
    return launch<Config<256, 1, true, true>>(p, a, b, bias, nullptr, stream, &prologue, words);
  if (tiling.cluster == 1 && tiling.block_n == 256) return launch<Config<256, 1, true>>(p, a, b, bias, nullptr, stream, &prologue, words);
  throw std::runtime_error("moegemm: gemm_fp8_ragged_rows_quantize_a (sm90): no kernel built for this tiling");
}

}  // namespace moegemm::gemm
