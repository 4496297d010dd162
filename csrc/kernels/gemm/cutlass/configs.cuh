// The kernel configurations of moegemm's grouped GEMMs, declared once (CUTLASS-example style).
//   Fp8BlockwiseGemm: e4m3 A (K-major) x e4m3 B (K-major), fp32 accumulation with per-128-K-block
//                     scale promotion (docs/design.md, the fp8_blockwise recipe); CTA tile, cluster and
//                     schedule from a Tiling (below).
//   Bf16Gemm:         bf16 A x bf16 B in any major-ness, fp32 accumulation, cooperative 128x256x64
//                     tiles, 1x1 clusters, the dynamic tile walk (dynamic_scheduler.cuh).
// ElementC = void means out = acc; float C allows out = acc + beta * out (wgrad accumulation).
#pragma once

#include <type_traits>

#include "kernels/gemm/cutlass/ptr_array.cuh"

namespace moegemm::grouped {

template <class ElementC, class ElementD, class EpilogueSchedule, class TileShape, class ClusterShape>
using RowMajorEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float,
    ElementC, cutlass::layout::RowMajor*, 16 / sizeof(ElementD),
    ElementD, cutlass::layout::RowMajor*, 16 / sizeof(ElementD), EpilogueSchedule,
    cutlass::epilogue::fusion::LinearCombination<ElementD, float>>::CollectiveOp;

// One FP8 tiling: CTA tile M x N (x 128 along K, the scale block), cluster ClusterM x ClusterN (TMA
// multicast: of B across the ClusterM CTAs, of A across the ClusterN), cooperative (two warpgroups on one
// tile) or pingpong (one tile per warpgroup, epilogue overlapped with the other's mainloop) schedule.
template <int M, int N, int ClusterM, int ClusterN, bool kPingpong = false>
struct Fp8Tiling {
  using TileShape = Shape<Int<M>, Int<N>, _128>;
  using ClusterShape = Shape<Int<ClusterM>, Int<ClusterN>, _1>;
  using KernelSchedule = std::conditional_t<kPingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise,
                                            cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise>;
  using EpilogueSchedule = std::conditional_t<kPingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                                              cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
};

// The FP8 tiling of the ragged-reduction kernels (fp8_ragged_reduction_*.cu), named once (the others tried:
// docs/performance.md, Ragged-reduction GEMM).
using Tile128x128C1x2 = Fp8Tiling<128, 128, 1, 2>;

template <class ScaleConfig, class ElementC, class ElementD, class Tiling = Tile128x128C1x2>
struct Fp8BlockwiseGemm {
  using Element = cutlass::float_e4m3_t;
  using TileShape = typename Tiling::TileShape;
  using ClusterShape = typename Tiling::ClusterShape;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  using Epilogue = RowMajorEpilogue<ElementC, ElementD, typename Tiling::EpilogueSchedule, TileShape, ClusterShape>;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      Element, cute::tuple<cutlass::layout::RowMajor*, LayoutSFA*>, 16,
      Element, cute::tuple<cutlass::layout::ColumnMajor*, LayoutSFB*>, 16,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Tiling::KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using Runner = GroupedGemm<Gemm, /*kBlockwise=*/true>;
};

// The bf16 GEMMs: CTAs claim tiles off a counter (dynamic_scheduler.cuh), so a CTA that starts late or never
// costs only its own share when another stream holds SMs; single-CTA clusters, so that any free SM can run one.
template <class LayoutA, class LayoutB, class ElementC, class ElementD>
struct Bf16Gemm {
  using Element = cutlass::bfloat16_t;
  using TileShape = Shape<_128, _256, _64>;
  using ClusterShape = Shape<_1, _1, _1>;
  using Epilogue = RowMajorEpilogue<ElementC, ElementD, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
                                    TileShape, ClusterShape>;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      Element, LayoutA*, 8, Element, LayoutB*, 8, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<DynamicWalkShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using Runner = GroupedGemm<Gemm, /*kBlockwise=*/false>;
};

// A stride of the ptr-array kernels with leading dimension `ld`: whichever of the first two modes is
// dynamic gets it (row-major: mode 0, column-major: mode 1); the other is the static unit stride.
template <class Stride>
__device__ __forceinline__ Stride leading(int64_t ld) {
  Stride s{};
  if constexpr (cute::is_static<cute::remove_cvref_t<decltype(get<0>(s))>>::value) get<1>(s) = ld;
  else get<0>(s) = ld;
  return s;
}

}  // namespace moegemm::grouped
