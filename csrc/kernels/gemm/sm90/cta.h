// The CTA of moegemm's own sm90 GEMM kernels (fp8_ragged_rows.cuh, fp8_ragged_reduction.cuh): one per SM,
// a producer warpgroup and two math warpgroups of 64 rows each, registers moved to the math warpgroups by
// setmaxnreg, the shared memory a block may have.
#pragma once

#include "moegemm.h"

namespace moegemm::sm90 {

struct WarpSpecializedCta {
  static constexpr int kBlockM = kBlock;     // rows of a tile
  static constexpr int kMathWarpgroups = 2;  // 64 rows each
  static constexpr int kWarpgroupRows = kBlockM / kMathWarpgroups;
  static constexpr int kThreads = 128 * (kMathWarpgroups + 1);
  // Registers per thread after setmaxnreg: the math warpgroups' accumulators and the producer's tile walk
  // without spills. setmaxnreg only moves registers between the CTA's warpgroups: the sum stays within
  // what the launch gave each thread (65536 / kThreads, in units of 8), else the math warpgroups wait
  // forever for registers.
  static constexpr int kProducerRegisters = 56, kMathRegisters = 224;
  static constexpr int kLaunchRegisters = 65536 / kThreads / 8 * 8;
  static_assert(kMathWarpgroups * kMathRegisters + kProducerRegisters <= (kMathWarpgroups + 1) * kLaunchRegisters,
                "setmaxnreg moves registers within the launch's allocation");
  static constexpr int kSharedBytes = 232448;  // dynamic shared memory per block on sm90
};

}  // namespace moegemm::sm90
