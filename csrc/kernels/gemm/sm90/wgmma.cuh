// What moegemm's own sm90 GEMM kernels share at the tensor cores: the shared-memory operand descriptor of
// a 128B-swizzled K-major tile, one 64 x N x 32 FP8 wgmma, the 128B-swizzled epilogue tile's byte offsets
// and the bf16 packing of two accumulators.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <utility>

#include "cute/arch/mma_sm90_desc.hpp"
#include "cute/arch/mma_sm90_gmma.hpp"
#include "cute/arch/mma_sm90_gmma_ext.hpp"

namespace moegemm::sm90 {

// A wgmma operand descriptor of a K-major tile of 128-byte rows in 128B-swizzled shared memory (8-row
// atoms 1024 bytes apart), starting at `smem`. Its low bits hold the address / 16, so adding bytes / 16
// to it moves the tile (another stage) or advances K within the swizzle row (32 e4m3 = 2).
__device__ __forceinline__ uint64_t sw128_descriptor(const void* smem) {
  cute::GmmaDescriptor d;
  d.bitfield.start_address_ = static_cast<uint16_t>(cute::cast_smem_ptr_to_uint(smem) >> 4);
  d.bitfield.leading_byte_offset_ = 1;  // unused by swizzled K-major layouts
  d.bitfield.stride_byte_offset_ = 1024 >> 4;
  d.bitfield.base_offset_ = 0;
  d.bitfield.layout_type_ = 1;  // SWIZZLE_128B
  return d.desc_;
}

// Byte offset of the 16-byte unit holding byte `col` of row `row` in a 128B-swizzled tile of 128-byte
// rows (unit u of row r stored at unit u ^ (r % 8)), as TMA writes and reads it.
__device__ __forceinline__ int sw128_offset(int row, int col) {
  return row * 128 + (((col / 16) ^ (row % 8)) * 16) + col % 16;
}

// The same in a 64B-swizzled tile of 64-byte rows (unit u of row r stored at unit u ^ (r / 2 % 4): the
// 128B pattern's address bits on rows half as long).
__device__ __forceinline__ int sw64_offset(int row, int col) {
  return row * 64 + (((col / 16) ^ (row / 2 % 4)) * 16) + col % 16;
}

template <int kN> struct WgmmaOp;
template <> struct WgmmaOp<128> { using type = cute::SM90::GMMA::MMA_64x128x32_F32E4M3E4M3_SS_TN<>; };
template <> struct WgmmaOp<160> { using type = cute::SM90::GMMA::MMA_64x160x32_F32E4M3E4M3_SS_TN<>; };
template <> struct WgmmaOp<192> { using type = cute::SM90::GMMA::MMA_64x192x32_F32E4M3E4M3_SS_TN<>; };

// One 64 x kN x 32 wgmma, d (kN / 2 fp32 per thread) = a · bᵀ (+ d when accumulate). A thread's value i
// lies in 8-column chunk i / 4, at column 2 (lane % 4) + i % 2 of it, in row 16 warp + lane / 4, + 8 when i & 2.
template <int kN, int... I>
__device__ __forceinline__ void wgmma(uint64_t a, uint64_t b, float* d, bool accumulate, std::integer_sequence<int, I...>) {
  WgmmaOp<kN>::type::fma(a, b, d[I]..., accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);
}

// Two fp32 values as a bf16 pair (round to nearest even), the lower column first.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Byte offset of bf16 (row, col) in a warpgroup's epilogue tile: 64-column slabs of 64 rows x 128 bytes, each
// with the 128B swizzle, as the TMA store reads it.
__device__ __forceinline__ int epilogue_offset(int row, int col) {
  const int slab = col / 64, c = col % 64, unit = c / 8;
  return slab * (64 * 128) + row * 128 + ((unit ^ (row % 8)) * 16) + (c % 8) * 2;
}

}  // namespace moegemm::sm90
