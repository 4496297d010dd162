// The shared-memory stage ring of moegemm's own sm90 GEMM kernels (fp8_ragged_rows.cuh,
// fp8_ragged_reduction.cuh), as its consumers see it: kStages stages, each with a full barrier that the
// producer's copies complete; a consumer walks the stages in order, its phase flipping at every wrap.
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

}  // namespace moegemm::sm90
