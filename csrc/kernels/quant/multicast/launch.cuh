// The multi-cast FP8 quantization kernels (docs/design.md#fp8-recipe), generic over where their values come from.
//
// A tile is (expert 128-token block, 128 output columns). Each value is read once and written as the 1x128
// row-block copy q [T, K] + s [T, Kb] (K-major: csrc/moegemm.h, row_scale_pitch) and the per-expert
// transposed 128x1 column-block copy qT [K, col_cap] + sT [NB, K] (either pair may be skipped). Two forms:
//
//   persistent.cuh  one CTA of 16 warps per SM loops over the tiles through a ring of staged tiles;
//   per_tile.cuh    one CTA of 8 warps per tile, several per SM (the loaders whose kPerTile says so).
// The loaders (where values come from: loaders.cuh, and the activation loaders of act_quantize.cu) and the pieces
// both forms share (common.cuh) are headers of their own; this one chooses the form and launches it (launch).
#pragma once

#include <cstdint>

#include "moegemm.h"
#include "kernels/common/cuda_check.h"
#include "kernels/plan/build.cuh"
#include "kernels/quant/multicast/loaders.cuh"
#include "kernels/quant/multicast/per_tile.cuh"
#include "kernels/quant/multicast/persistent.cuh"

namespace moegemm::multicast {

// Launches the multi-cast kernel over every expert block of the output [T, K] (K = output columns): the
// per-tile form for the loaders that take it, else the persistent one.
// With build.plan set (to `plan`, for these E and T), the plan is built first: by the per-tile form's CTAs
// themselves (see tile_kernel), else (or when there is nothing to quantize) by make_plan's kernel. `zero` (ZeroFill):
// zeroed by the kernel's threads, or by a memset when there is nothing to quantize.
template <class Loader>
void launch(const Loader& src, int64_t T, int64_t K, int E, const int32_t* plan, uint8_t* q, float* s, uint8_t* qT,
            float* sT, float* row_extra, const PlanBuild& build, const ZeroFill& zero, cudaStream_t stream, const char* name) {
  const bool builds = build.plan != nullptr;
  const bool nothing = T == 0 || (q == nullptr && qT == nullptr && row_extra == nullptr);
  if (builds) check_plan_size(build.E, build.T, name);
  if (builds && (nothing || !per_tile<Loader>())) make_plan(build.m_splits, build.m_is_int64, build.E, build.T, build.plan, stream);
  if (nothing) {
    if (zero.count > 0) check_cuda(cudaMemsetAsync(zero.words, 0, sizeof(int32_t) * zero.count, stream), name);
    return;
  }
  if constexpr (per_tile<Loader>()) {
    launch_tiles(src, T, K, E, plan, q, s, qT, sT, build, zero, stream, name);
  } else {
    launch_persistent(src, T, K, E, plan, q, s, qT, sT, row_extra, zero, stream, name);
  }
}

}  // namespace moegemm::multicast
