// The GLU activation's backward with its FP8 multi-cast quantization, one CTA per tile (F a multiple of 128): dh's
// gate half (da * p * up * act'(gate)) and up half (da * p * act(gate)) of a tile of 128 tokens x 128 gate columns,
// rounded to bf16 (the values the FP8 copies quantize: docs/design.md#fp8-recipe), as the 1x128 row copy and the
// per-expert 128x1 column copy of each half, plus each row's share of dprobs (da * act(gate) * up summed).
//
// One CTA of 8 warps per tile, three per SM, in the two passes of two_pass.cuh. The CTA stages da and gate; the row
// pass reads up from global memory (a lane's 32 bytes of its next row loaded while it computes the current one),
// writes both halves' values, rounded to bf16, over the row's da and gate (each lane rewrites what it read) and
// makes each half's row block; the column pass takes the column scales on the packed bf16 pairs. (1.06x faster
// on the memory-bound table than staging up too: 96 KB a CTA, two CTAs per SM; docs/performance.md, Activation kernels.)
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "moegemm.h"
#include "kernels/common/async_copy.cuh"
#include "kernels/common/cuda_check.h"
#include "kernels/common/device.h"
#include "kernels/common/pdl.cuh"
#include "kernels/plan/plan.cuh"
#include "kernels/act/functions.cuh"
#include "kernels/quant/fp8_block.cuh"
#include "kernels/quant/two_pass.cuh"

namespace moegemm::glu_backward {

// The two passes' constants and pieces (two_pass.cuh).
using two_pass::kThreads, two_pass::kRowLanes, two_pass::kLaneCols, two_pass::kRowsPerPass, two_pass::kSegRows,
      two_pass::kChunks, two_pass::kInputBytes, two_pass::chunk_at, two_pass::quantize16, two_pass::row_block,
      two_pass::check_launch_size, two_pass::abs_max_of;

constexpr int kSmemBytes = 2 * kInputBytes + kBlock * 4;  // da, gate, the probs
constexpr int kCtasPerSm = 3;                             // (80 registers: SwiGLU no spills, GeGLU 24 bytes)

template <class Act>
__global__ void __launch_bounds__(kThreads, kCtasPerSm) kernel(const __nv_bfloat16* __restrict__ da,
    const __nv_bfloat16* __restrict__ h, const float* __restrict__ probs, int64_t T, int64_t F, int E,
    const int32_t* __restrict__ plan, uint8_t* __restrict__ q, float* __restrict__ s, uint8_t* __restrict__ qT,
    float* __restrict__ sT, int64_t col_cap, float* __restrict__ row_extra) {
  grid_wait();  // (launched dependent: nothing read or written before)
  grid_release();
  extern __shared__ __align__(128) unsigned char smem[];
  uint4* staged = reinterpret_cast<uint4*>(smem);  // [2][128 rows][16 chunks], swizzled
  float* p_s = reinterpret_cast<float*>(smem + 2 * kInputBytes);
  const int64_t Kt = F / kBlock, K = 2 * F, Kb = 2 * Kt;  // tile columns; dh's columns and column blocks
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int b = tile_block(), kt = static_cast<int>(blockIdx.x);  // token block, column block (tile_grid)
  const int64_t k0 = int64_t(kt) * kBlock;

  const Found found = find_tile(b, true, E, T, plan, [&](const TileSpot& spot) {
    const int c = tid % kChunks;
    for (int r = tid / kChunks; r < spot.nr; r += kThreads / kChunks) {
      const int64_t t = spot.row0 + r;
      async_copy::load16(staged + chunk_at(r, c), da + t * F + k0 + 8 * c);
      async_copy::load16(staged + kInputBytes / 16 + chunk_at(r, c), h + t * K + k0 + 8 * c);
    }
    if (probs != nullptr && tid < spot.nr) async_copy::load4(p_s + tid, probs + spot.row0 + tid);
  });
  const TileSpot spot = found.spot;
  const int64_t row0 = spot.row0, covered = found.covered;
  const int nr = spot.nr;
  const bool active = found.fits && spot.has_tile;
  // Lane l of a row's 8 takes columns 16 l .. 16 l + 15 (chunks 2 l, 2 l + 1) in the row pass: its up values are
  // the 32 bytes at up_at + (row) * K / 8, the first row's loaded here (over the staging and the zeroing).
  const int ql = tid % kRowLanes;
  const uint4* up_at = reinterpret_cast<const uint4*>(h + row0 * K + F + k0) + 2 * ql;
  uint4 up_next[2] = {make_uint4(0u, 0u, 0u, 0u), make_uint4(0u, 0u, 0u, 0u)};
  if (active && tid / kRowLanes < nr) {
    const uint4* at = up_at + (tid / kRowLanes) * (K / 8);
    up_next[0] = __ldg(at);
    up_next[1] = __ldg(at + 1);
  }
  if (covered < T)
    zero_uncovered_rows(covered, T, K, Kb, q, s, row_extra, tile_cta() * kThreads + tid, tile_ctas() * kThreads);
  async_copy::wait_all();  // (also before leaving: no copy may land after the CTA)
  if (!active) return;
  __syncthreads();

  // ---- Row pass.
  const int64_t s_pitch = row_scale_pitch(T);
#pragma unroll 1
  for (int r = tid / kRowLanes; r < kBlock; r += kRowsPerPass) {
    const int at0 = chunk_at(r, 2 * ql), at1 = chunk_at(r, 2 * ql + 1);
    uint4* in_da = staged;
    uint4* in_gate = staged + kInputBytes / 16;
    const uint4 raw_u[2] = {up_next[0], up_next[1]};
    if (r + kRowsPerPass < nr) {  // the lane's next row's up
      const uint4* at = up_at + (r + kRowsPerPass) * (K / 8);
      up_next[0] = __ldg(at);
      up_next[1] = __ldg(at + 1);
    }
    uint32_t gw[8], uw[8];  // the row's 16 values of each half, bf16 pairs
    float extra[2] = {0.f, 0.f};  // the dprobs share of each 8-column chunk
    if (r < nr) {
      const float p = probs != nullptr ? p_s[r] : 1.f;
      const uint4 raw_d[2] = {in_da[at0], in_da[at1]}, raw_g[2] = {in_gate[at0], in_gate[at1]};
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float d[8], g[8], u[8];
        unpack_bf16x8(raw_d[half], d);
        unpack_bf16x8(raw_g[half], g);
        unpack_bf16x8(raw_u[half], u);
        float gg[8], ug[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) extra[half] += act::act_grad<Act>(d[i], g[i], u[i], p, gg[i], ug[i]);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          gw[4 * half + i] = bf16x2_rn(gg[2 * i], gg[2 * i + 1]);
          uw[4 * half + i] = bf16x2_rn(ug[2 * i], ug[2 * i + 1]);
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) gw[i] = uw[i] = 0u;  // (the column copy's rows past the tokens: zeros)
    }
    // In place: the gate half over da, the up half over gate.
    in_da[at0] = make_uint4(gw[0], gw[1], gw[2], gw[3]);
    in_da[at1] = make_uint4(gw[4], gw[5], gw[6], gw[7]);
    in_gate[at0] = make_uint4(uw[0], uw[1], uw[2], uw[3]);
    in_gate[at1] = make_uint4(uw[4], uw[5], uw[6], uw[7]);

    // The row's dprobs share over the tile's columns (the row's 8 lanes are lanes 8 k .. 8 k + 7 of the warp), added
    // in the order of the multi-cast kernel's row sums (multicast/common.cuh, scatter_sum4: chunk c with c ^ 8, ^ 4, ^ 2,
    // then ^ 1).
#pragma unroll
    for (int o = kRowLanes / 2; o >= 1; o >>= 1) {
      extra[0] += __shfl_xor_sync(0xffffffffu, extra[0], o);
      extra[1] += __shfl_xor_sync(0xffffffffu, extra[1], o);
    }
    if (row_extra != nullptr && ql == 0 && r < nr) {
      float* at = row_extra + (row0 + r) * Kb + kt;
      at[0] = extra[0] + extra[1];
      at[Kt] = 0.f;  // (the up half's share)
    }
    if (q == nullptr) continue;  // uniform
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // gate half: output block kt; up half: Kt + kt
      const uint32_t(&w)[8] = half == 0 ? gw : uw;
      const uint32_t m = abs_max_bf16x2(
          abs_max_bf16x2(abs_max_bf16x2(w[0], w[1]), abs_max_bf16x2(w[2], w[3])),
          abs_max_bf16x2(abs_max_bf16x2(w[4], w[5]), abs_max_bf16x2(w[6], w[7])));
      const int64_t kb_out = kt + half * Kt;
      row_block(w, abs_max_of(m), ql == 0 && r < nr, r < nr, s + kb_out * s_pitch + row0 + r,
                q + (row0 + r) * K + kb_out * kBlock + kLaneCols * ql);
    }
  }
  if (qT == nullptr) return;  // uniform
  __syncthreads();

  // ---- Column pass: 128 column pairs (64 per half); warp w takes pairs 4 k .. 4 k + 3 of half k / 16 for
  // k = w, w + 8, ...; lane (pair l / 8, segment l % 8) rows 16 (l % 8) .. + 15 of its pair.
  const int seg = lane % 8, pair_in = lane / 8;
  const int chunks = column_chunks(nr);  // 16-byte chunks of a column line: the tokens rounded up to kColAlign
#pragma unroll 1
  for (int k = warp; k < 2 * kBlock / 8; k += kThreads / 32) {
    const int half = k / 16, cp = 4 * (k % 16) + pair_in;  // columns 2 cp, 2 cp + 1 of the half
    const uint32_t* src = reinterpret_cast<const uint32_t*>(staged + half * kInputBytes / 16);
    uint32_t w[kSegRows];
#pragma unroll
    for (int i = 0; i < kSegRows; ++i) {
      const int r = kSegRows * seg + i;
      w[i] = src[chunk_at(r, cp / 4) * 4 + cp % 4];
    }
    uint32_t m = w[0];
#pragma unroll
    for (int i = 1; i < kSegRows; ++i) m = abs_max_bf16x2(m, w[i]);
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) m = abs_max_bf16x2(m, __shfl_xor_sync(0xffffffffu, m, o));
    const BlockQuant q0(fabsf(bf16_lo(m))), q1(fabsf(bf16_hi(m)));
    const int64_t c0 = (kt + half * Kt) * kBlock + 2 * cp;  // dh's column of the pair's first
    if (seg == 0) *reinterpret_cast<float2*>(sT + int64_t(b) * K + c0) = make_float2(q0.scale, q1.scale);
    // Each column's 16 bytes: the pair's low halves for column c0, the high halves for c0 + 1.
    uint32_t lo_w[8], hi_w[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      lo_w[i] = __byte_perm(w[2 * i], w[2 * i + 1], 0x5410);  // low halves of rows 2i, 2i + 1
      hi_w[i] = __byte_perm(w[2 * i], w[2 * i + 1], 0x7632);  // high halves
    }
    const bool simple = __all_sync(0xffffffffu, q0.mul_lo == 1.f && q1.mul_lo == 1.f);
    const uint4 b0 = quantize16(lo_w, q0.mul_hi, q0.mul_lo, simple), b1 = quantize16(hi_w, q1.mul_hi, q1.mul_lo, simple);
    if (seg < chunks) {
      uint8_t* line = qT + c0 * col_cap + spot.qt_col + 16 * seg;
      *reinterpret_cast<uint4*>(line) = b0;
      *reinterpret_cast<uint4*>(line + col_cap) = b1;
    }
  }
}

// Launches the kernel over every (expert block, gate column block) the buffers can hold; F % 128 == 0.
template <class Act>
void launch(const void* da, const void* h, const float* probs, int64_t T, int64_t F, int E, const int32_t* plan,
            uint8_t* q, float* s, uint8_t* qT, float* sT, float* row_extra, cudaStream_t stream, const char* name) {
  if (T == 0 || F == 0 || (q == nullptr && qT == nullptr && row_extra == nullptr)) return;
  check_launch_size(F, name);
  allow_shared_memory<kernel<Act>>(kSmemBytes, name);
  launch_dependent(kernel<Act>, tile_grid(block_capacity(T, E), F / kBlock), kThreads, kSmemBytes, stream, name,
                   static_cast<const __nv_bfloat16*>(da), static_cast<const __nv_bfloat16*>(h), probs, T, F, E, plan, q, s,
                   qT, sT, col_capacity(T, E), row_extra);
}

}  // namespace moegemm::glu_backward
