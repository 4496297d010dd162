// Counters shared by the CTAs of one launch that no earlier launch zeroes: the one-launch forward's (a plain, not
// cooperative, launch: its CTAs need not be resident at once, so a kernel holding SMs on another stream delays
// only the CTAs it displaces). The words live in a per-call workspace of any contents. The first CTA to swap the
// launch's tag (the host's, a different one per launch) into the tag word zeroes the counters and marks them
// ready; the others, finding the tag there, wait for that mark. The last CTA to close clears the tag and the mark,
// so a CUDA graph replaying the launch (same tag, same memory) starts afresh.
#pragma once

#include <atomic>
#include <cstdint>

namespace moegemm {

struct GridClaims {
  static constexpr int kWords = 8;  // 32-bit words of the workspace
  uint32_t* words;
  uint32_t tag;  // nonzero

  __device__ uint32_t* tag_word() const { return words; }
  __device__ uint32_t* ready() const { return words + 1; }
  __device__ int* tickets() const { return reinterpret_cast<int*>(words + 2); }  // the prologue's work items
  __device__ int* done() const { return reinterpret_cast<int*>(words + 3); }     // of them finished
  __device__ int* tiles() const { return reinterpret_cast<int*>(words + 4); }    // the GEMM's tile counter
  __device__ int* closed() const { return reinterpret_cast<int*>(words + 5); }

  // One thread per CTA, before any counter is used: one compare-and-swap at most (the CTAs of a launch arrive
  // together; a loop of swaps on one word would take time quadratic in their number).
  __device__ void open() const {
    const uint32_t seen = *reinterpret_cast<volatile uint32_t*>(tag_word());
    const bool first = seen != tag && atomicCAS(tag_word(), seen, tag) == seen;
    if (first) {
      *reinterpret_cast<volatile int*>(tickets()) = 0;
      *reinterpret_cast<volatile int*>(done()) = 0;
      *reinterpret_cast<volatile int*>(tiles()) = 0;
      *reinterpret_cast<volatile int*>(closed()) = 0;
      __threadfence();
      asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(ready()), "r"(tag) : "memory");
    } else {
      while (load_acquire(ready()) != tag) __nanosleep(32);
    }
  }

  // One thread per CTA, once the CTA is done with every counter: the last CTA of the launch clears the tag and
  // the mark.
  __device__ void close() const {
    __threadfence();
    if (atomicAdd(closed(), 1) == static_cast<int>(gridDim.x * gridDim.y * gridDim.z) - 1) {
      *reinterpret_cast<volatile uint32_t*>(ready()) = 0;
      *reinterpret_cast<volatile uint32_t*>(tag_word()) = 0;
    }
  }

  // One thread: wait until `count` work items are done (their writes visible to this thread, then to its CTA
  // after a barrier).
  __device__ void wait_done(int count) const {
    while (static_cast<int>(load_acquire(reinterpret_cast<uint32_t*>(done()))) < count) __nanosleep(64);
  }

  // One thread, after a barrier that follows the item's writes by all of the CTA's threads.
  __device__ void finish_item() const {
    __threadfence();
    atomicAdd(done(), 1);
  }

  static __device__ uint32_t load_acquire(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
  }
};

// The host's tag of the next launch: distinct over 2^32 consecutive launches (an odd multiplier is a bijection),
// spread over the word, never zero.
inline uint32_t next_grid_claims_tag() {
  static std::atomic<uint32_t> launches{0};
  const uint32_t tag = (launches.fetch_add(1) + 1) * 0x9E3779B1u;
  return tag != 0 ? tag : 0x9E3779B1u;
}

}  // namespace moegemm
