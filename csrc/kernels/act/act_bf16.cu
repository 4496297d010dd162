// The activations of an expert MLP for the bf16 recipe, between its two GEMMs: a = act(gate) (* up) * probs in bf16
// (act_bf16), and its backward (act_backward_bf16: dh from da and h, plus each row's share of the probs gradient,
// summed by sum_rows.cu). The same activations in fp32 as the FP8 recipe's fused kernels (functions.cuh;
// kernels/quant/act_quantize.cu quantizes them on the fly).
#include <algorithm>
#include <stdexcept>

#include "moegemm.h"
#include "kernels/act/functions.cuh"
#include "kernels/common/cuda_check.h"
#include "kernels/common/device.h"
#include "kernels/common/vec8.cuh"

namespace moegemm {
namespace {

using act::act_grad, act::Gelu, act::Relu, act::Silu, act::SquaredRelu;

__device__ __forceinline__ float prob(const float* probs, int64_t row) { return probs != nullptr ? probs[row] : 1.f; }

// bf16 recipe: one warp per (row, 256 columns), eight columns per lane; the backward reads da, gate and
// up once and writes both halves of dh. Warps stride over the (row, block) tasks.
template <class Act, bool kGlu, bool kBackward>
__global__ void __launch_bounds__(256) act_bf16_kernel(const __nv_bfloat16* __restrict__ h,
    const __nv_bfloat16* __restrict__ da, const float* __restrict__ probs, int64_t T, int64_t F,
    __nv_bfloat16* __restrict__ out, float* __restrict__ partial) {
  constexpr int n = 8;
  const int64_t nb = (F + kActBf16Cols - 1) / kActBf16Cols;
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  const int64_t ld = kGlu ? 2 * F : F;
  for (int64_t task = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; task < T * nb; task += warps) {
    const int64_t row = task / nb, blk = task % nb;
    const int64_t k = blk * kActBf16Cols + n * lane;
    float extra = 0.f;
    if (k < F) {  // F is a multiple of 16: a lane's eight columns are all in or all out
      float g[n], u[n], o[n];
      load8(h + row * ld + k, g);
      if (kGlu) load8(h + row * ld + F + k, u);
      const float p = prob(probs, row);
      if constexpr (!kBackward) {
#pragma unroll
        for (int i = 0; i < n; ++i) o[i] = Act::f(g[i]) * (kGlu ? u[i] : 1.f) * p;
        store8(out + row * F + k, o);
      } else {
        float d[n], o_up[n];
        load8(da + row * F + k, d);
#pragma unroll
        for (int i = 0; i < n; ++i) extra += act_grad<Act>(d[i], g[i], kGlu ? u[i] : 1.f, p, o[i], o_up[i]);
        store8(out + row * ld + k, o);
        if (kGlu) store8(out + row * ld + F + k, o_up);
      }
    }
    if constexpr (kBackward) {
      extra = warp_sum(extra);  // every lane of the warp: the task is warp-uniform
      if (partial != nullptr && lane == 0) partial[row * nb + blk] = extra;
    }
  }
}

template <class Act, bool kGlu, bool kBackward>
void launch_act_bf16(const void* h, const void* da, const float* probs, int64_t T, int64_t F, void* out, float* partial,
                     cudaStream_t stream, const char* name) {
  const int64_t tasks = T * ceil_div(F, kActBf16Cols);
  if (tasks == 0) return;
  // Eight CTAs per SM of the budget (grid_sms), striding over the tasks.
  const int64_t grid = std::min<int64_t>(ceil_div(tasks, 8), int64_t(grid_sms()) * 8);
  act_bf16_kernel<Act, kGlu, kBackward><<<static_cast<unsigned>(grid), 256, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(h), static_cast<const __nv_bfloat16*>(da), probs, T, F,
      static_cast<__nv_bfloat16*>(out), partial);
  check_launch(name);
}

template <bool kBackward>
void run_act_bf16(Activation act, const void* h, const void* da, const float* probs, int64_t T, int64_t F, void* out,
                  float* partial, cudaStream_t stream, const char* name) {
  switch (act) {
    case Activation::kSwiglu: return launch_act_bf16<Silu, true, kBackward>(h, da, probs, T, F, out, partial, stream, name);
    case Activation::kGeglu: return launch_act_bf16<Gelu, true, kBackward>(h, da, probs, T, F, out, partial, stream, name);
    case Activation::kGelu: return launch_act_bf16<Gelu, false, kBackward>(h, da, probs, T, F, out, partial, stream, name);
    case Activation::kRelu: return launch_act_bf16<Relu, false, kBackward>(h, da, probs, T, F, out, partial, stream, name);
    case Activation::kSquaredRelu:
      return launch_act_bf16<SquaredRelu, false, kBackward>(h, da, probs, T, F, out, partial, stream, name);
  }
  throw std::runtime_error("moegemm: unknown activation");
}

}  // namespace

void act_bf16(const void* h_bf16, const float* probs, Activation act, int64_t T, int64_t F, void* a_bf16,
              cudaStream_t stream) {
  run_act_bf16<false>(act, h_bf16, nullptr, probs, T, F, a_bf16, nullptr, stream, "act_bf16");
}

void act_backward_bf16(const void* da_bf16, const void* h_bf16, const float* probs, Activation act, int64_t T,
                       int64_t F, void* dh_bf16, float* dprobs_partial, cudaStream_t stream) {
  run_act_bf16<true>(act, h_bf16, da_bf16, probs, T, F, dh_bf16, dprobs_partial, stream, "act_backward_bf16");
}

}  // namespace moegemm
