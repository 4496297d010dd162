// The GLU activation's forward with its FP8 multi-cast quantization, one CTA per tile: a = act(gate) * up * probs
// of h [T, 2F] (F a multiple of 16) for a tile of 128 tokens x 128 columns of a [T, F], as the 1x128 row copy and
// the per-expert 128x1 column copy (docs/design.md#fp8-recipe: the fp32 values quantized).
//
// One CTA of 8 warps per tile, three per SM, in the two passes of two_pass.cuh. The CTA stages the tile's gate
// columns k0.. and up columns F + k0.. and its probs in four cp.async groups, one per row pass step of 32 rows,
// each step waiting for its own (1.03x over one wait for the whole tile; docs/performance.md, Activation kernels). The row pass writes a
// lane's 16 fp32 values over the 64 bytes of gate and up it read: column c of the tile (chunk c / 8) in gate's
// chunk for c % 8 < 4, in up's for the others, at float c % 4; the column pass reads them there.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "moegemm.h"
#include "kernels/common/async_copy.cuh"
#include "kernels/common/cuda_check.h"
#include "kernels/common/device.h"
#include "kernels/common/pdl.cuh"
#include "kernels/quant/fp8_block.cuh"
#include "kernels/quant/two_pass.cuh"

namespace moegemm::glu_forward {

// The two passes' constants and pieces (two_pass.cuh).
using two_pass::kThreads, two_pass::kRowLanes, two_pass::kLaneCols, two_pass::kRowsPerPass, two_pass::kSegRows,
      two_pass::kChunks, two_pass::kInputBytes, two_pass::chunk_at, two_pass::quantize16, two_pass::row_block,
      two_pass::check_launch_size, two_pass::amax8;

constexpr int kSmemBytes = 2 * kInputBytes + kBlock * 4;  // gate, up, the probs
constexpr int kCtasPerSm = 3;
constexpr int kRowSteps = kBlock / kRowsPerPass;  // 4 steps of the row pass, a cp.async group each
static_assert(kRowSteps <= 4, "async_copy::wait_pending waits on at most 3 newer groups");

template <class Act>
__global__ void __launch_bounds__(kThreads, kCtasPerSm) kernel(const __nv_bfloat16* __restrict__ h,
    const float* __restrict__ probs, int64_t T, int64_t F, int E, const int32_t* __restrict__ plan,
    uint8_t* __restrict__ q, float* __restrict__ s, uint8_t* __restrict__ qT, float* __restrict__ sT, int64_t col_cap) {
  grid_wait();  // (launched dependent: nothing read or written before)
  grid_release();
  extern __shared__ __align__(128) unsigned char smem[];
  uint4* gate_s = reinterpret_cast<uint4*>(smem);  // [128 rows][16 chunks], swizzled
  uint4* up_s = gate_s + kInputBytes / 16;
  float* p_s = reinterpret_cast<float*>(smem + 2 * kInputBytes);
  const int64_t Kt = (F + kBlock - 1) / kBlock;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int b = tile_block(), kt = static_cast<int>(blockIdx.x);  // token block, column block (tile_grid)
  const int64_t k0 = int64_t(kt) * kBlock;
  const int nk = static_cast<int>(imin64(kBlock, F - k0));
  const Found found = find_tile(b, Kt > 0, E, T, plan, [&](const TileSpot& spot) {
    const int c = tid % kChunks;
#pragma unroll
    for (int g = 0; g < kRowSteps; ++g) {  // group g: rows 32 g .. 32 g + 31 (and the probs in the first)
#pragma unroll
      for (int i = 0; i < kRowsPerPass / (kThreads / kChunks); ++i) {
        const int r = g * kRowsPerPass + i * (kThreads / kChunks) + tid / kChunks;
        if (8 * c < nk && r < spot.nr) {
          const __nv_bfloat16* row = h + (spot.row0 + r) * 2 * F + k0 + 8 * c;
          async_copy::load16(gate_s + chunk_at(r, c), row);
          async_copy::load16(up_s + chunk_at(r, c), row + F);
        }
      }
      if (g == 0 && probs != nullptr && tid < spot.nr) async_copy::load4(p_s + tid, probs + spot.row0 + tid);
      async_copy::commit();
    }
  });
  if (found.covered < T)
    zero_uncovered_rows(found.covered, T, F, Kt, q, s, nullptr, tile_cta() * kThreads + tid, tile_ctas() * kThreads);
  if (!found.fits || !found.spot.has_tile) {
    async_copy::wait_all();  // (no copy may land after the CTA)
    return;
  }
  const int64_t row0 = found.spot.row0;
  const int nr = found.spot.nr;

  auto compute = [&](auto whole) {
    constexpr bool kWhole = decltype(whole)::value;
    const int ql = tid % kRowLanes;
    const bool lane_in = kWhole || kLaneCols * ql < nk;
    float* s_block = s + kt * row_scale_pitch(T) + row0;
#pragma unroll 1
    for (int r = tid / kRowLanes; r < kBlock; r += kRowsPerPass) {
      // This step's rows landed (every thread takes the kRowSteps steps; the last waits for all of its copies).
      async_copy::wait_pending(kRowSteps - 1 - r / kRowsPerPass);
      __syncthreads();
      const int at0 = chunk_at(r, 2 * ql), at1 = chunk_at(r, 2 * ql + 1);
      float v[16];
      float amax = 0.f;
      if (kWhole || (r < nr && lane_in)) {
        const float p = probs != nullptr ? p_s[r] : 1.f;
        float g[2][8], u[2][8];
        unpack_bf16x8(gate_s[at0], g[0]);
        unpack_bf16x8(gate_s[at1], g[1]);
        unpack_bf16x8(up_s[at0], u[0]);
        unpack_bf16x8(up_s[at1], u[1]);
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          v[i] = Act::f(g[i / 8][i % 8]) * u[i / 8][i % 8] * p;  // (act(gate) * up) * p
          amax = nan_max(amax, fabsf(v[i]));
        }
      } else {
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = 0.f;
      }
      if (qT != nullptr) {  // in place, for the column pass
        reinterpret_cast<float4*>(gate_s)[at0] = make_float4(v[0], v[1], v[2], v[3]);
        reinterpret_cast<float4*>(up_s)[at0] = make_float4(v[4], v[5], v[6], v[7]);
        reinterpret_cast<float4*>(gate_s)[at1] = make_float4(v[8], v[9], v[10], v[11]);
        reinterpret_cast<float4*>(up_s)[at1] = make_float4(v[12], v[13], v[14], v[15]);
      }
      if (q == nullptr) continue;  // uniform
      const bool row_in = kWhole || r < nr;
      row_block(v, amax, ql == 0 && row_in, row_in && lane_in, s_block + r, q + (row0 + r) * F + k0 + kLaneCols * ql);
    }
    if (qT == nullptr) return;  // uniform
    __syncthreads();
    // Column pass: 64 column pairs; warp w takes pairs 4 k .. 4 k + 3 for k = w, w + 8; lane (pair l / 8, segment
    // l % 8) rows 16 (l % 8) .. + 15 of its pair: pair cp's floats 2 (cp % 2), + 1 of chunk cp / 4 (= k) of gate
    // (cp % 4 < 2) or up.
    const int seg = lane % 8, pair_in = lane / 8;
    const int chunks = kWhole ? kBlock / 16 : column_chunks(nr);
    const float* src = reinterpret_cast<const float*>(pair_in < 2 ? gate_s : up_s) + 2 * (pair_in % 2);
#pragma unroll 1
    for (int k = warp; k < kBlock / 8; k += kThreads / 32) {
      const int cp = 4 * k + pair_in;
      float a[kSegRows], c[kSegRows];
      float m0 = 0.f, m1 = 0.f;
#pragma unroll
      for (int i = 0; i < kSegRows; ++i) {
        const float2 x = *reinterpret_cast<const float2*>(src + chunk_at(kSegRows * seg + i, k) * 4);
        a[i] = x.x;
        c[i] = x.y;
        m0 = nan_max(m0, fabsf(x.x));
        m1 = nan_max(m1, fabsf(x.y));
      }
      const BlockQuant q0(amax8(m0)), q1(amax8(m1));
      const bool col_in = kWhole || 2 * cp < nk;
      if (seg == 0 && col_in)
        *reinterpret_cast<float2*>(sT + int64_t(b) * F + k0 + 2 * cp) = make_float2(q0.scale, q1.scale);
      const bool simple = __all_sync(0xffffffffu, q0.mul_lo == 1.f && q1.mul_lo == 1.f);
      const uint4 b0 = quantize16(a, q0.mul_hi, q0.mul_lo, simple), b1 = quantize16(c, q1.mul_hi, q1.mul_lo, simple);
      if (seg < chunks && col_in) {
        uint8_t* line = qT + (k0 + 2 * cp) * col_cap + found.spot.qt_col + 16 * seg;
        *reinterpret_cast<uint4*>(line) = b0;
        *reinterpret_cast<uint4*>(line + col_cap) = b1;
      }
    }
  };
  if (nr == kBlock && nk == kBlock) compute(std::true_type{});
  else compute(std::false_type{});
}

// Launches the kernel over every (expert block, column block) the buffers can hold.
template <class Act>
void launch(const void* h, const float* probs, int64_t T, int64_t F, int E, const int32_t* plan, uint8_t* q, float* s,
            uint8_t* qT, float* sT, cudaStream_t stream, const char* name) {
  if (T == 0 || F == 0 || (q == nullptr && qT == nullptr)) return;
  check_launch_size(F, name);
  allow_shared_memory<kernel<Act>>(kSmemBytes, name);
  launch_dependent(kernel<Act>, tile_grid(block_capacity(T, E), (F + kBlock - 1) / kBlock), kThreads, kSmemBytes, stream,
                   name, static_cast<const __nv_bfloat16*>(h), probs, T, F, E, plan, q, s, qT, sT, col_capacity(T, E));
}

}  // namespace moegemm::glu_forward
