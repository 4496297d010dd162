// The shared-memory rings of moegemm's own sm90 GEMM kernels (fp8_ragged_rows.cuh, fp8_ragged_reduction.cuh):
// the stage ring, as its consumers see it (kStages stages, each with a full barrier that the producer's copies
// complete; a consumer walks the stages in order, its phase flipping at every wrap), and the ring of tile ids
// of a dynamic tile walk.
#pragma once

#include <cstdint>

#include "cutlass/arch/barrier.h"

namespace moegemm::sm90 {

// Whether the stage after (stage, phase) is full, tested without blocking: issued right after a stage is
// released and before its promotion, the barrier's latency hides behind the promotion, and the consumer
// waits (blocking) only when the test said no.
template <int kStages>
__device__ __forceinline__ bool next_stage_full(uint64_t* full, int stage, uint32_t phase) {
  const int next = stage + 1 == kStages ? 0 : stage + 1;
  return cutlass::arch::ClusterBarrier::test_wait(&full[next], next == 0 ? phase ^ 1 : phase, 1);
}

// The tile ids of a CTA's walk, handed by the one thread that draws them (drawer) to the warps that walk the
// same tiles (readers) through a ring of kSlots shared-memory slots, each with a full barrier (the drawer's
// arrival) and an empty one (one arrival per lane of each reading warp). Ids go in the order drawn; the walk
// ends with an id past the last tile, which every reader receives once.
template <int kSlots>
struct TileIdRing {
  int* ids;         // [kSlots]
  uint64_t* full;   // [kSlots]
  uint64_t* empty;  // [kSlots]
  int slot = 0;
  uint32_t phase = 0;

  static constexpr int kBytes = kSlots * (4 + 2 * 8);

  // one thread, before the CTA's barrier; readers: the reading lanes
  __device__ static void init(uint64_t* full, uint64_t* empty, int readers) {
    for (int s = 0; s < kSlots; ++s) {
      cutlass::arch::ClusterBarrier::init(&full[s], 1);
      cutlass::arch::ClusterBarrier::init(&empty[s], readers);
    }
  }

  // drawer: the next id into the next slot, once every reader has taken the slot's last one
  __device__ __forceinline__ void put(int id) {
    cutlass::arch::ClusterBarrier::wait(&empty[slot], phase ^ 1);
    ids[slot] = id;
    cutlass::arch::ClusterBarrier::arrive(&full[slot]);  // release: the id is seen by whoever waits on it
    advance();
  }

  // reader (a whole warp, every lane): the next id, warp-uniform. Every lane frees the slot after its own read
  // (readers counts lanes), so that each read is ordered before an arrival of its own thread.
  __device__ __forceinline__ int take() {
    cutlass::arch::ClusterBarrier::wait(&full[slot], phase);
    const int id = __shfl_sync(0xffffffff, ids[slot], 0);
    cutlass::arch::ClusterBarrier::arrive(&empty[slot]);
    advance();
    return id;
  }

 private:
  __device__ __forceinline__ void advance() {
    if (++slot == kSlots) slot = 0, phase ^= 1;
  }
};

}  // namespace moegemm::sm90
