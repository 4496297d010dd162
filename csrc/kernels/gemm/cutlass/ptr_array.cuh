// Shared machinery of moegemm's CUTLASS sm90 ptr-array grouped GEMMs.
//
// Each GEMM translation unit declares its kernel configuration as type aliases (CUTLASS-example
// style), a tiny device kernel that builds every group's problem shape, pointers and strides from the
// plan (one thread per expert; PyTorch's GroupMMCommon.cuh does the same), and calls
// GroupedGemm<Gemm>::run. Problem shapes exist only on the device: CUTLASS gets
// {E, device_shapes, nullptr} and a persistent grid of sm_count CTAs.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <mutex>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.h"

#include "kernels/gemm/cutlass/dynamic_scheduler.cuh"

#include "kernels/common/cuda_check.h"
#include "kernels/common/device.h"
#include "kernels/plan/plan.cuh"

namespace moegemm::grouped {

using namespace cute;

using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
using GroupShape = ProblemShape::UnderlyingProblemShape;

// The per-group argument arrays, carved out of the front of the caller's workspace.
template <class Gemm, bool kBlockwise>
struct GroupArrays {
  using Kernel = typename Gemm::GemmKernel;
  using ElementA = typename Kernel::ElementA;
  using ElementB = typename Kernel::ElementB;
  using ElementC = typename Kernel::CollectiveEpilogue::ElementC;
  using ElementD = typename Kernel::CollectiveEpilogue::ElementD;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;
  // A kernel with the dynamic tile walk (dynamic_scheduler.cuh) also takes its claim counters.
  static constexpr bool kDynamicWalk = std::is_same_v<typename Kernel::ProblemShape, DynamicWalkShape>;

  GroupShape* shape;
  const ElementA** A;
  const ElementB** B;
  const ElementC** C;
  ElementD** D;
  StrideA* stride_A;
  StrideB* stride_B;
  StrideC* stride_C;
  StrideD* stride_D;
  const float** SFA;  // blockwise only
  const float** SFB;
  int* claims;  // dynamic walk only: kMaxGridCtas + 1 counters

  // Lays the arrays out from `base`; returns the bytes they take (each array 128-byte aligned).
  static size_t carve(void* base, int E, GroupArrays* out) {
    size_t offset = 0;
    auto take_bytes = [&](auto*& ptr, size_t bytes) {
      offset = (offset + 127) / 128 * 128;
      if (out) ptr = reinterpret_cast<std::remove_reference_t<decltype(ptr)>>(static_cast<char*>(base) + offset);
      offset += bytes;
    };
    auto take = [&](auto*& ptr, size_t elem) { take_bytes(ptr, elem * E); };
    GroupArrays dummy{};
    GroupArrays& a = out ? *out : dummy;
    take(a.shape, sizeof(GroupShape));
    take(a.A, sizeof(void*));
    take(a.B, sizeof(void*));
    take(a.C, sizeof(void*));
    take(a.D, sizeof(void*));
    take(a.stride_A, sizeof(StrideA));
    take(a.stride_B, sizeof(StrideB));
    take(a.stride_C, sizeof(StrideC));
    take(a.stride_D, sizeof(StrideD));
    if constexpr (kBlockwise) {
      take(a.SFA, sizeof(void*));
      take(a.SFB, sizeof(void*));
    }
    if constexpr (kDynamicWalk) take_bytes(a.claims, sizeof(int) * (kMaxGridCtas + 1));
    return (offset + 127) / 128 * 128;
  }
};

// Device id -> hardware info (SM count, max active clusters), queried once per device.
template <class Kernel>
cutlass::KernelHardwareInfo hardware_info() {
  static std::array<cutlass::KernelHardwareInfo, 64> cache{};
  static std::array<std::once_flag, 64> once;
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  std::call_once(once[device], [&] { cache[device] = cutlass::KernelHardwareInfo::make_kernel_hardware_info<Kernel>(device); });
  return cache[device];
}

template <class Gemm, bool kBlockwise>
struct GroupedGemm {
  using Arrays = GroupArrays<Gemm, kBlockwise>;
  using Kernel = typename Gemm::GemmKernel;

  // sms: the SMs the persistent grid spreads over (0 or the device's count: every SM)
  static typename Gemm::Arguments arguments(const Arrays& a, int E, float alpha, float beta, int sms = 0) {
    typename Gemm::Arguments args;
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    if constexpr (Arrays::kDynamicWalk) args.problem_shape = DynamicWalkShape{{E, a.shape, nullptr}, a.claims};
    else args.problem_shape = {E, a.shape, nullptr};
    if constexpr (kBlockwise) {
      args.mainloop = {a.A, a.stride_A, a.B, a.stride_B, a.SFA, nullptr, a.SFB, nullptr};
    } else {
      args.mainloop = {a.A, a.stride_A, a.B, a.stride_B};
    }
    args.epilogue = {{}, a.C, a.stride_C, a.D, a.stride_D};
    args.epilogue.thread.alpha = alpha;
    args.epilogue.thread.beta = beta;
    args.hw_info = hardware_info<Kernel>();
    if (sms > 0 && sms < args.hw_info.sm_count) {
      // Whole clusters within the budget, at least one (a budget below the cluster size gets one cluster).
      constexpr int kCluster = size(typename Kernel::DispatchPolicy::ClusterShape{});
      const int clusters = std::max(1, sms / kCluster);
      args.hw_info.sm_count = clusters * kCluster;
      if (args.hw_info.max_active_clusters > clusters) args.hw_info.max_active_clusters = clusters;
    }
    // One claim slot per CTA of the dynamic walk's grid (sm_count CTAs).
    if constexpr (Arrays::kDynamicWalk) args.hw_info.sm_count = std::min(args.hw_info.sm_count, kMaxGridCtas);
    return args;
  }

  // Argument arrays + CUTLASS's own workspace (tensor maps per SM).
  static size_t workspace_size(int E) {
    Arrays a{};
    return Arrays::carve(nullptr, E, nullptr) + Gemm::get_workspace_size(arguments(a, E, 1.f, 0.f));
  }

  // Carves the arrays; the caller's build kernel fills them before `run`.
  static Arrays arrays(void* workspace, int E) {
    Arrays a{};
    Arrays::carve(workspace, E, &a);
    return a;
  }

  // Per call: the kernel's parameters (CUTLASS's to_underlying_arguments, which encodes TMA
  // descriptors on the host) and the launch. Host work only; nothing waits for the device.
  static void run(const Arrays& a, int E, float alpha, float beta, void* workspace, cudaStream_t stream, const char* name) {
    const int sms = grid_sms();  // the SM budget's
    const typename Kernel::Params& params = cached_params(a, E, alpha, beta, sms, workspace, name);
    // No device work for these configurations (CUTLASS 4.2: the group scheduler, the array-TMA
    // mainloops and the linear-combination epilogue return at once); kept per call in case a
    // configuration needs it.
    if (Kernel::initialize_workspace(arguments(a, E, alpha, beta, sms), cutlass_workspace(workspace, E), stream) !=
        cutlass::Status::kSuccess)
      throw std::runtime_error(std::string("moegemm: ") + name + ": CUTLASS workspace initialization failed");
    launch(params, stream, name);
  }

 private:
  static void* cutlass_workspace(void* workspace, int E) { return static_cast<char*>(workspace) + Arrays::carve(nullptr, E, nullptr); }

  // The parameters are a pure function of (workspace, E, alpha, beta, SMs, device): the argument arrays
  // are carved from the workspace at fixed offsets and the problem shapes live on the device. The
  // last few built on this thread are kept and reused when a key repeats (the caching allocator hands
  // the same workspaces back step after step; an MLP step runs each configuration two or three
  // times), so a repeated call skips CUTLASS's host setup (TMA descriptor encoding).
  struct CachedParams {
    bool valid = false;
    void* workspace = nullptr;
    int E = 0, sms = 0, device = -1;
    float alpha = 0.f, beta = 0.f;
    typename Kernel::Params params;
  };
  static constexpr int kCachedParams = 4;

  static const typename Kernel::Params& cached_params(const Arrays& a, int E, float alpha, float beta, int sms,
                                                      void* workspace, const char* name) {
    thread_local std::array<CachedParams, kCachedParams> cache{};
    thread_local int next = 0;
    int device = 0;
    check_cuda(cudaGetDevice(&device), "cudaGetDevice");
    for (const CachedParams& c : cache)
      if (c.valid && c.workspace == workspace && c.E == E && c.sms == sms && c.device == device && c.alpha == alpha &&
          c.beta == beta)
        return c.params;
    auto args = arguments(a, E, alpha, beta, sms);
    if (Gemm::can_implement(args) != cutlass::Status::kSuccess)
      throw std::runtime_error(std::string("moegemm: ") + name + ": CUTLASS cannot implement these arguments");
    CachedParams& c = cache[next];
    next = (next + 1) % kCachedParams;
    c.valid = false;
    c.params = Kernel::to_underlying_arguments(args, cutlass_workspace(workspace, E));
    c.workspace = workspace, c.E = E, c.sms = sms, c.device = device, c.alpha = alpha, c.beta = beta;
    c.valid = true;
    return c.params;
  }

  // What GemmUniversalAdapter::run does for an sm90 cluster kernel, minus its per-call
  // cudaFuncSetAttribute calls: the shared-memory limit is raised once per device (the cluster sizes
  // here are portable, so the non-portable-cluster attribute is not needed).
  static void launch(const typename Kernel::Params& params, cudaStream_t stream, const char* name) {
    moegemm::allow_shared_memory<cutlass::device_kernel<Kernel>>(int(Kernel::SharedStorageSize), name);
    static_assert(size(typename Kernel::DispatchPolicy::ClusterShape{}) <= 8, "portable cluster sizes only");
    cudaLaunchConfig_t config{};
    config.gridDim = Kernel::get_grid_shape(params);
    config.blockDim = Kernel::get_block_shape();
    config.dynamicSmemBytes = Kernel::SharedStorageSize;
    config.stream = stream;
    cudaLaunchAttribute cluster[1];
    cluster[0].id = cudaLaunchAttributeClusterDimension;
    cluster[0].val.clusterDim.x = size<0>(typename Kernel::DispatchPolicy::ClusterShape{});
    cluster[0].val.clusterDim.y = size<1>(typename Kernel::DispatchPolicy::ClusterShape{});
    cluster[0].val.clusterDim.z = size<2>(typename Kernel::DispatchPolicy::ClusterShape{});
    config.attrs = cluster;
    config.numAttrs = 1;
    check_cuda(cudaLaunchKernelEx(&config, cutlass::device_kernel<Kernel>, params), name);
  }
};

constexpr int kPrepThreads = 128;
inline dim3 prep_grid(int E) { return dim3((E + kPrepThreads - 1) / kPrepThreads); }

// Ragged-row outputs: the rows past the plan's covered tokens (device counts summing below T) get
// zeros from kZeroBlocks extra blocks of the argument-building kernel, launched after prep_grid(E)'s
// blocks; when the counts cover T they return at once.
constexpr int kZeroBlocks = 32;
inline dim3 prep_grid_zeroing_rows(int E) { return dim3(prep_grid(E).x + kZeroBlocks); }

// True for the zeroing blocks, after they have cleared rows [covered, T) of out (row_bytes each, a
// multiple of 16); the other blocks build the arguments.
__device__ inline bool zero_uncovered_rows(int64_t covered, int64_t T, int64_t row_bytes, void* out) {
  const int zero_block = static_cast<int>(blockIdx.x) - static_cast<int>(gridDim.x - kZeroBlocks);
  if (zero_block < 0) return false;
  zero_rows(out, covered, T, row_bytes, int64_t(zero_block) * blockDim.x + threadIdx.x, int64_t(kZeroBlocks) * blockDim.x);
  return true;
}

}  // namespace moegemm::grouped
