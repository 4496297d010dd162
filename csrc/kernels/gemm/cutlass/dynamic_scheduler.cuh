// A dynamic tile walk for CUTLASS's sm90 ptr-array cooperative kernel: CTAs claim linear tile indices
// from a global counter instead of taking tiles c, c + grid, c + 2*grid, ... (PersistentTileSchedulerSm90Group),
// so a CTA that starts late (SMs held by another stream's kernel) delays only the tiles it claims.
//
// The kernel builds its scheduler from the problem-shape type (its TileScheduler_ must be void or
// GroupScheduler), so a kernel whose ProblemShape is DynamicWalkShape gets DynamicGroupScheduler.
#pragma once

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/pipeline/pipeline.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"  // the selector and PersistentTileSchedulerSm90Group
#include "cutlass/version.h"

// Written against CUTLASS 4.2's cooperative ptr-array kernel: which roles call the scheduler, the
// __syncthreads after its construction (1x1 clusters), the base's members it uses.
static_assert(CUTLASS_MAJOR == 4 && CUTLASS_MINOR == 2, "dynamic_scheduler.cuh: check it against this CUTLASS's kernel");

namespace moegemm::grouped {

// The most CTAs a dynamic-walk grid may have (the grid is at most the SM count).
constexpr int kMaxGridCtas = 1024;

// Tiles claimed ahead of the one being computed: few, so that the walk stays balanced at its end.
constexpr int kDynamicWalkStages = 2;

// The grouped problem shape plus the walk's counters (kMaxGridCtas + 1 ints): claims[0] is the next
// unclaimed linear tile (zeroed before each GEMM), claims[1 + cta] the first tile CTA cta claimed.
struct DynamicWalkShape : cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>> {
  int* claims = nullptr;
};

// PersistentTileSchedulerSm90Group with its tile walk replaced; the linear index -> (group, M, N) mapping
// is the base's. Only one CTA per cluster: the base's mapping takes the CTA's offset in its cluster from
// blockIdx.y (AlongM raster, the default) or blockIdx.x (AlongN), which is 0 in the grid of 1x1 clusters
// it launches: (sm_count, 1, 1) or (1, sm_count, 1) respectively.
class DynamicGroupScheduler
    : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Group<DynamicWalkShape, kDynamicWalkStages> {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Group<DynamicWalkShape, kDynamicWalkStages>;

 public:
  using typename Base::Params;
  using typename Base::SchedulerResponse;

  // Thread 0 claims the CTA's first tile; the kernel's __syncthreads between building the scheduler
  // and initial_work_tile_info makes it visible to every thread.
  CUTLASS_DEVICE DynamicGroupScheduler(Params const& params, SchedulerResponse* response_ptr) : Base(params, response_ptr) {
    if (threadIdx.x == 0) claims()[1 + cta()] = atomicAdd(claims(), 1);
  }

  // Every thread of the CTA (each warp runs the base's group search together).
  template <class ClusterShape>
  CUTLASS_DEVICE auto initial_work_tile_info(ClusterShape) {
    const int first = *reinterpret_cast<volatile int*>(claims() + 1 + cta());
    return this->get_current_work_for_linear_idx(uint64_t(first));
  }

  // The scheduler warp: waits for a free response slot, then claims the next tile (lane 0) and publishes
  // it to the other roles. One CTA's claims only grow, which the base's forward-only group search needs;
  // a claim past the last tile maps to the invalid tile that ends every role's walk.
  template <class TileSchedulerPipeline, class TileSchedulerPipelineState>
  CUTLASS_DEVICE auto advance_to_next_work(TileSchedulerPipeline& scheduler_pipeline, TileSchedulerPipelineState state,
                                           uint32_t /*advance_count: always 1 here*/ = 1) {
    scheduler_pipeline.producer_acquire(state);
    int next = 0;
    if (cutlass::canonical_lane_idx() == 0) next = atomicAdd(claims(), 1);
    next = __shfl_sync(0xffffffff, next, 0);
    auto work_tile = this->get_current_work_for_linear_idx(uint64_t(next));
    if (cute::elect_one_sync()) {
      this->response_ptr_[state.index()] = work_tile;
      cutlass::arch::fence_view_async_shared();
      scheduler_pipeline.producer_commit(state);
    }
    return cute::make_tuple(work_tile, true);
  }

 private:
  CUTLASS_DEVICE int* claims() const { return this->scheduler_params.problem_shapes_.claims; }
  CUTLASS_DEVICE static int cta() { return int(blockIdx.x + blockIdx.y * gridDim.x); }
};

}  // namespace moegemm::grouped

namespace cutlass::gemm::kernel::detail {

// The grouped kernels' scheduler for a DynamicWalkShape problem (more specialized than CUTLASS's
// GroupScheduler/Sm90 selector, which takes any problem shape).
template <class TileShape, class ClusterShape, uint32_t SchedulerPipelineStageCount>
struct TileSchedulerSelector<GroupScheduler, arch::Sm90, TileShape, ClusterShape, SchedulerPipelineStageCount,
                             moegemm::grouped::DynamicWalkShape> {
  static_assert(cute::size(ClusterShape{}) == 1, "the dynamic tile walk takes 1x1 clusters");
  using Scheduler = moegemm::grouped::DynamicGroupScheduler;
};

}  // namespace cutlass::gemm::kernel::detail
