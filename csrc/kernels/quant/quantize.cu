// FP8 blockwise quantization kernels (docs/design.md#fp8-recipe).
//   quantize_act: the multi-cast kernel (multicast/launch.cuh) reading x as it is.
//   requantize_cols: the same kernel (per tile) reading an FP8 row copy and its row scales (dequantized),
//   writing only the column copy.
//   quantize_weight_kernel: one CTA per 128x128 block of one expert, staged in shared memory by cp.async;
//   writes W and Wᵀ copies, both as contiguous 128-byte row segments (Wᵀ through a swizzled FP8 tile in shared memory
//   and 4x4 byte transposes in registers). A layer's weights in one launch, and the plan by one more CTA.
#include <algorithm>

#include "moegemm.h"
#include "kernels/common/async_copy.cuh"
#include "kernels/common/cuda_check.h"
#include "kernels/common/device.h"
#include "kernels/common/pdl.cuh"
#include "kernels/plan/build.cuh"
#include "kernels/quant/fp8_block.cuh"
#include "kernels/quant/multicast/launch.cuh"

namespace moegemm {
namespace {

using multicast::warp_amax;
constexpr int kThreads = 256;                  // weight kernel: one CTA per 128x128 block
constexpr int kWarps = kThreads / 32;
constexpr int kRowsPerWarp = kBlock / kWarps;  // warp w owns rows w, w + 8, ...

// Four consecutive values in their storage type (one 8- or 16-byte shared-memory load).
template <typename T>
struct alignas(4 * sizeof(T)) Raw4 {
  T x[4];
  __device__ __forceinline__ void get(float (&v)[4]) const {
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = to_float(x[i]);
  }
};

// The FP8 tile in shared memory: 128 rows of 32 words (4 e4m3 each); row r's word w stored at w ^ 4 (r / 16 % 8),
// so that both the row writes (a warp: one row's 32 words) and the transposed reads (a warp: 8 rows, 16
// apart, 4 consecutive words of each) reach 32 different banks.
__device__ __forceinline__ int tile_word(int r, int w) { return r * (kBlock / 4) + (w ^ (4 * ((r / 16) % 8))); }

// Bytes j of a, b, c, d as one word [a_j, b_j, c_j, d_j], for j = 0..3: a 4x4 byte transpose.
__device__ __forceinline__ void transpose4x4(uint32_t a, uint32_t b, uint32_t c, uint32_t d, uint32_t (&out)[4]) {
  const uint32_t ab01 = __byte_perm(a, b, 0x5140), ab23 = __byte_perm(a, b, 0x7362);  // [a0 b0 a1 b1], [a2 b2 a3 b3]
  const uint32_t cd01 = __byte_perm(c, d, 0x5140), cd23 = __byte_perm(c, d, 0x7362);
  out[0] = __byte_perm(ab01, cd01, 0x5410);
  out[1] = __byte_perm(ab01, cd01, 0x7632);
  out[2] = __byte_perm(ab23, cd23, 0x5410);
  out[3] = __byte_perm(ab23, cd23, 0x7632);
}

// The weight tile is staged in shared memory by 16-byte cp.async instead of waiting in registers for its
// amax, so that a thread needs 40 registers and 4 CTAs per SM (2 for fp32 weights) have their whole tiles
// in flight at once: 93-98 % of the copy bandwidth on the H200, more than with the values in registers at 3 CTAs
// per SM (docs/performance.md, Quantizers). Shared memory: the tile in its own type, the FP8 tile, the
// warps' maxima.
template <typename T>
constexpr int kWeightCtasPerSm = sizeof(T) == 2 ? 4 : 2;
template <typename T>
constexpr int kWeightSmemBytes = kBlock * kBlock * int(sizeof(T)) + kBlock * kBlock + kWarps * 4;

// One launch's weights (csrc/moegemm.h quantize_weights) and the plan built on the side: CTA 0 builds the plan
// when there is one; every other CTA quantizes one 128x128 block, the first weight's blocks (column block
// fastest, then row block, then expert) before the second's, the second's before the third's.
struct WeightLaunch {
  WeightQuant weight[kMaxWeightsPerLaunch];
  int64_t blocks[kMaxWeightsPerLaunch];  // E * Nb * Kb of each weight
  int count;
  PlanBuild plan;
};

// The launch's weight `index`, field by field (no dynamic index into the parameter space).
__device__ __forceinline__ WeightQuant weight_of(const WeightLaunch& launch, int index) {
  static_assert(kMaxWeightsPerLaunch == 3, "one select per weight");
  WeightQuant w = launch.weight[0];
  if (index == 1) w = launch.weight[1];
  if (index == 2) w = launch.weight[2];
  return w;
}

template <typename T>
__global__ void __launch_bounds__(kThreads, kWeightCtasPerSm<T>) quantize_weight_kernel(const WeightLaunch launch) {
  grid_wait();  // (launched dependent: nothing read or written before)
  grid_release();
  int64_t block = blockIdx.x;
  if (launch.plan.plan != nullptr) {
    if (block == 0) return build_plan<kThreads>(launch.plan);
    --block;
  }
  int index = 0;
  if (launch.count > 1 && block >= launch.blocks[0]) {
    block -= launch.blocks[0];
    index = 1;
    if (launch.count > 2 && block >= launch.blocks[1]) {
      block -= launch.blocks[1];
      index = 2;
    }
  }
  const WeightQuant job = weight_of(launch, index);
  const int64_t N = job.N, K = job.K;
  // the copies' rows per expert, and this weight's first row among them (a part of a larger weight)
  const int64_t R = job.rows > 0 ? job.rows : N, row0 = job.row0;
  uint8_t* __restrict__ q = job.q;
  float* __restrict__ s = job.s;
  uint8_t* __restrict__ qT = job.qT;
  float* __restrict__ sT = job.sT;
  const int64_t Nb = (N + kBlock - 1) / kBlock, Kb = (K + kBlock - 1) / kBlock;
  const int64_t Rb = (R + kBlock - 1) / kBlock, rb0 = row0 / kBlock;
  const int64_t kb = block % Kb, nb = block / Kb % Nb, e = block / (Kb * Nb);

  extern __shared__ __align__(16) uint8_t smem_raw[];
  T* tile = reinterpret_cast<T*>(smem_raw);                                             // [128][128] T
  uint32_t* tileq = reinterpret_cast<uint32_t*>(smem_raw + kBlock * kBlock * sizeof(T));  // FP8, tile_word layout
  float* warp_max = reinterpret_cast<float*>(smem_raw + kBlock * kBlock * sizeof(T) + kBlock * kBlock);
  const int64_t n0 = nb * kBlock, k0 = kb * kBlock;
  const int nn = static_cast<int>(imin64(kBlock, N - n0));
  const int nk = static_cast<int>(imin64(kBlock, K - k0));
  const T* src = static_cast<const T*>(job.w) + e * N * K + n0 * K + k0;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const bool lane_active = 4 * lane < nk;

  // The tile's rows inside the weight into shared memory, 16-byte chunks in row order (nk a multiple of 16:
  // a chunk lies wholly inside or outside); the rest of the tile is never read.
  constexpr int kChunkValues = 16 / sizeof(T), kRowChunks = kBlock / kChunkValues;
  for (int i = threadIdx.x; i < kBlock * kRowChunks; i += kThreads) {
    const int r = i / kRowChunks, c = (i % kRowChunks) * kChunkValues;
    if (r < nn && c < nk) async_copy::load16(tile + r * kBlock + c, src + r * K + c);
  }
  async_copy::wait_all();
  __syncthreads();

  // The block's amax, then its values quantized into the row copy and the FP8 tile.
  float a = 0.f;
#pragma unroll
  for (int j = 0; j < kRowsPerWarp; ++j) {
    const int r = warp + j * kWarps;
    if (r < nn && lane_active) {
      float v[4];
      reinterpret_cast<const Raw4<T>*>(tile + r * kBlock)[lane].get(v);
#pragma unroll
      for (int c = 0; c < 4; ++c) a = nan_max(a, fabsf(v[c]));
    }
  }
  a = warp_amax(a);
  if (lane == 0) warp_max[warp] = a;
  __syncthreads();
  a = warp_max[0];
#pragma unroll
  for (int i = 1; i < kWarps; ++i) a = nan_max(a, warp_max[i]);
  const BlockQuant quant(a);
  const float scale = quant.scale;
  if (threadIdx.x == 0) {
    s[(e * Rb + rb0 + nb) * Kb + kb] = scale;
    if (qT != nullptr) sT[(e * Kb + kb) * Rb + rb0 + nb] = scale;
  }
#pragma unroll
  for (int j = 0; j < kRowsPerWarp; ++j) {
    const int r = warp + j * kWarps;
    if (r < nn && lane_active) {
      float v[4];
      reinterpret_cast<const Raw4<T>*>(tile + r * kBlock)[lane].get(v);
      const uint32_t packed = quant.pack4(v);
      if (qT != nullptr) tileq[tile_word(r, lane)] = packed;
      *reinterpret_cast<uint32_t*>(q + (e * R + row0 + n0 + r) * K + k0 + 4 * lane) = packed;
    }
  }
  if (qT == nullptr) return;  // (the same for every thread) no transposed copy
  __syncthreads();
  // Transposed copy: thread = (4 columns kq, 16 rows rc) of the tile, 16 bytes of each column's row of Wᵀ; the 8
  // threads of one kq write those 4 rows' 128 contiguous bytes (whole lines when R is a multiple of 128; nn and nk
  // are multiples of 16).
  static_assert(kThreads == (kBlock / 4) * (kBlock / 16), "one thread per 4 columns x 16 rows");
  const int kq = threadIdx.x / 8, rc = threadIdx.x % 8;
  if (4 * kq >= nk || 16 * rc >= nn) return;
  uint32_t cols[4][4];  // [column c][rows 4g..4g+3]
#pragma unroll
  for (int g = 0; g < 4; ++g) {
    const int r = 16 * rc + 4 * g;
    uint32_t t[4];
    transpose4x4(tileq[tile_word(r, kq)], tileq[tile_word(r + 1, kq)], tileq[tile_word(r + 2, kq)], tileq[tile_word(r + 3, kq)], t);
#pragma unroll
    for (int c = 0; c < 4; ++c) cols[c][g] = t[c];
  }
  uint8_t* dst = qT + e * R * K + (k0 + 4 * kq) * R + row0 + n0 + 16 * rc;
#pragma unroll
  for (int c = 0; c < 4; ++c) *reinterpret_cast<uint4*>(dst + c * R) = make_uint4(cols[c][0], cols[c][1], cols[c][2], cols[c][3]);
}

template <typename T>
void launch_act(const void* x, int64_t T_, int64_t K, int E, const int32_t* plan, uint8_t* q, float* s, uint8_t* qT,
                float* sT, const PlanBuild& build, const ZeroFill& zero, cudaStream_t stream) {
  multicast::launch(multicast::PlainLoader<T>{static_cast<const T*>(x), K}, T_, K, E, plan, q, s, qT, sT, nullptr,
                    build, zero, stream, "quantize_act");
}

// The plan a quantizer builds from plan_from (none when it names no counts).
PlanBuild plan_build(DeviceSplits plan_from, int E, int64_t T, int32_t* plan) {
  if (plan_from.m_splits == nullptr) return {};
  return {plan_from.m_splits, plan_from.m_is_int64, E, T, plan};
}

template <typename T>
void launch_weights(const WeightLaunch& launch, int64_t grid, cudaStream_t stream) {
  allow_shared_memory<quantize_weight_kernel<T>>(kWeightSmemBytes<T>, "quantize_weight");
  launch_dependent(quantize_weight_kernel<T>, static_cast<unsigned>(grid), kThreads, kWeightSmemBytes<T>, stream,
                   "quantize_weight", launch);
}

}  // namespace

void quantize_act(const void* x, DType dtype, int64_t T, int64_t K, int E, int32_t* plan, uint8_t* q, float* s,
                  uint8_t* qT, float* sT, DeviceSplits plan_from, ZeroFill zero, cudaStream_t stream) {
  const PlanBuild build = plan_build(plan_from, E, T, plan);
  switch (dtype) {
    case DType::kBF16: return launch_act<__nv_bfloat16>(x, T, K, E, plan, q, s, qT, sT, build, zero, stream);
    case DType::kF16: return launch_act<__half>(x, T, K, E, plan, q, s, qT, sT, build, zero, stream);
    case DType::kF32: return launch_act<float>(x, T, K, E, plan, q, s, qT, sT, build, zero, stream);
  }
}

void requantize_cols(const uint8_t* q, const float* s, int64_t T, int64_t K, int E, const int32_t* plan, uint8_t* qT,
                     float* sT, ZeroFill zero, cudaStream_t stream) {
  multicast::launch(multicast::Fp8RowsLoader{q, s, K, row_scale_pitch(T)}, T, K, E, plan, nullptr, nullptr, qT, sT,
                    nullptr, PlanBuild{}, zero, stream, "requantize_cols");
}

void quantize_weights(const WeightQuant* weights, int count, DType dtype, const PlanBuild& plan, cudaStream_t stream) {
  if (count < 1 || count > kMaxWeightsPerLaunch) throw std::runtime_error("moegemm: quantize_weights: 1 to 3 weights per launch");
  WeightLaunch launch{};
  launch.plan = plan.m_splits != nullptr ? plan : PlanBuild{};  // no counts: nothing to build
  int64_t grid = launch.plan.plan != nullptr ? 1 : 0;
  if (launch.plan.plan != nullptr) check_plan_size(plan.E, plan.T, "quantize_weights (plan)");
  for (int i = 0; i < count; ++i) {
    const WeightQuant& w = weights[i];
    const int64_t blocks = w.E * ceil_div(w.N, kBlock) * ceil_div(w.K, kBlock);
    if (blocks == 0) continue;  // an empty weight: nothing to write
    launch.weight[launch.count] = w;
    launch.blocks[launch.count++] = blocks;
    grid += blocks;
  }
  if (grid == 0) return;
  if (grid > 0x7fffffff) throw std::runtime_error("moegemm: quantize_weights: too many 128x128 blocks for one launch");
  switch (dtype) {
    case DType::kBF16: return launch_weights<__nv_bfloat16>(launch, grid, stream);
    case DType::kF16: return launch_weights<__half>(launch, grid, stream);
    case DType::kF32: return launch_weights<float>(launch, grid, stream);
  }
}

}  // namespace moegemm
