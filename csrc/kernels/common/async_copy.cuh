// Asynchronous copies global -> shared memory (16- or 4-byte cp.async per thread, sm_80+) completing on an
// mbarrier, and the mbarrier and named-barrier steps of a ring of shared-memory stages. Device-only.
#pragma once

#include <cstdint>

namespace moegemm::async_copy {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void barrier_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(arrivals) : "memory");
}

// Makes the barriers' initialization visible to the asynchronous proxy (before the CTA-wide sync that follows).
__device__ __forceinline__ void fence_barrier_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

// Waits until the phase of parity `parity` has completed.
__device__ __forceinline__ void wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  } while (!done);
}

// 16 bytes from global to shared memory (both 16-byte aligned), bypassing L1.
__device__ __forceinline__ void load16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}

// 4 bytes from global to shared memory (both 4-byte aligned), through L1.
__device__ __forceinline__ void load4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}

// Closes the group of cp.async this thread issued since the last commit (wait_pending counts groups).
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Waits until at most `n` of this thread's committed groups are still in flight (n > 3 waits as 3 does:
// more landed, never fewer).
__device__ __forceinline__ void wait_pending(int n) {
  switch (n) {
    case 0: asm volatile("cp.async.wait_group 0;" ::: "memory"); break;
    case 1: asm volatile("cp.async.wait_group 1;" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;" ::: "memory"); break;
    default: asm volatile("cp.async.wait_group 3;" ::: "memory"); break;
  }
}

// Waits until every cp.async this thread issued has landed (its own copies only: a CTA barrier follows
// before other threads read them).
__device__ __forceinline__ void wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// One arrival on `bar` once every cp.async this thread issued before has landed (the barrier counts the
// issuing threads: no arrival of their own).
__device__ __forceinline__ void arrive_when_loaded(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// Named barrier `id` (1..15; 0 is __syncthreads') over `threads` threads (a multiple of 32).
__device__ __forceinline__ void sync_threads(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace moegemm::async_copy
