// The fused kernels between an expert MLP's two GEMMs: activation x router probs -> FP8 multi-cast,
// and its backward (activation gradient, rounded to bf16 -> FP8 multi-cast, plus the probs gradient). They are
// the multi-cast kernel of multicast/launch.cuh with loaders that compute their values on the fly in fp32; a GLU's
// forward takes the per-tile kernel of glu_forward.cuh, its backward (F a multiple of 128) glu_backward.cuh's.
// The activations themselves: kernels/act/functions.cuh; the bf16 recipe's (no quantization): kernels/act/act_bf16.cu.
#include <stdexcept>

#include "moegemm.h"
#include "kernels/act/functions.cuh"
#include "kernels/quant/glu_backward.cuh"
#include "kernels/quant/glu_forward.cuh"
#include "kernels/quant/multicast/launch.cuh"

namespace moegemm {
namespace {

using act::act_grad, act::Gelu, act::Relu, act::Silu, act::SquaredRelu;

// a[t, k] = act(h[t, k]) * probs[t] (a GLU's forward: glu_forward.cuh); staged: the columns and probs (the row
// factor).
template <class Act>
struct ActForward {
  using Raw = __nv_bfloat16;
  static constexpr int kInputs = 1;
  static constexpr bool kExtra = false;
  static constexpr bool kPerTile = false;  // (not measured per tile)
  static constexpr bool kRowFactor = true;  // probs
  const __nv_bfloat16* h;
  const float* probs;
  int64_t F;
  __device__ __forceinline__ int segments(int, int64_t k0, int nk, multicast::Segment (&seg)[2]) const {
    seg[0] = {k0, 0, nk};
    return 1;
  }
  __device__ __forceinline__ const __nv_bfloat16* row_start(int, int64_t row) const { return h + row * F; }
  __device__ __forceinline__ const float* row_factor(int64_t) const { return probs; }
  __device__ __forceinline__ float values(const __nv_bfloat16* const (&raw)[kInputs], float p, int64_t, int64_t,
                                          float (&v)[multicast::kVec]) const {
    float g[multicast::kVec];
    load8(raw[0], g);
#pragma unroll
    for (int i = 0; i < multicast::kVec; ++i) v[i] = Act::f(g[i]) * p;
    return 0.f;
  }
};

// dh[t, k] for k < F: da * p * (GLU: up) * act'(gate); GLU, k >= F: da[t, k - F] * p * act(gate).
// extra (for dprobs): da * act(gate) * up, counted on the k < F columns only. Staged: da and gate at the
// columns the tile's output columns read (k, or k - F past F: two segments when a block straddles F), and
// the up columns of the k < F part.
template <class Act, bool kGlu>
struct ActBackward {
  using Raw = __nv_bfloat16;
  static constexpr int kInputs = kGlu ? 3 : 2;  // da, gate, up
  static constexpr bool kExtra = true;
  static constexpr bool kPerTile = false;  // (several staged inputs)
  static constexpr bool kRowFactor = true;  // probs
  const __nv_bfloat16* da;
  const __nv_bfloat16* h;
  const float* probs;
  int64_t F;
  __device__ __forceinline__ const float* row_factor(int64_t) const { return probs; }
  __device__ __forceinline__ int segments(int in, int64_t k0, int nk, multicast::Segment (&seg)[2]) const {
    if (!kGlu) {
      seg[0] = {k0, 0, nk};
      return 1;
    }
    const int n_gate = static_cast<int>(k0 >= F ? 0 : (k0 + nk <= F ? nk : F - k0));  // output columns below F
    const multicast::Segment gate_part{in == 2 ? F + k0 : k0, 0, n_gate}, up_part{k0 + n_gate - F, n_gate, nk - n_gate};
    const bool has_gate = n_gate > 0, has_up = n_gate < nk && in != 2;  // (constant indices below: registers)
    seg[0] = has_gate ? gate_part : up_part;
    seg[1] = up_part;
    return int(has_gate) + int(has_up);
  }
  __device__ __forceinline__ const __nv_bfloat16* row_start(int in, int64_t row) const {
    return in == 0 ? da + row * F : h + row * (kGlu ? 2 * F : F);
  }
  __device__ __forceinline__ float values(const __nv_bfloat16* const (&raw)[kInputs], float p, int64_t, int64_t k,
                                          float (&v)[multicast::kVec]) const {
    constexpr int n = multicast::kVec;
    const bool up_half = kGlu && k >= F;  // F is a multiple of 16: a lane's eight columns are all on one side
    float d[n], g[n], u[n];
    load8(raw[0], d);
    load8(raw[1], g);
    if (kGlu && !up_half) load8(raw[kInputs - 1], u);
    float extra = 0.f, unused;
    if (up_half) {  // (act_grad's up-side value, without the derivative)
#pragma unroll
      for (int i = 0; i < n; ++i) v[i] = round_bf16(d[i] * p * Act::f(g[i]));
      return 0.f;
    }
#pragma unroll
    for (int i = 0; i < n; ++i) {
      extra += act_grad<Act>(d[i], g[i], kGlu ? u[i] : 1.f, p, v[i], unused);
      v[i] = round_bf16(v[i]);
    }
    return extra;
  }
};

template <template <class, bool> class Loader, class Fn>
void dispatch(Activation act, Fn&& fn) {
  switch (act) {
    case Activation::kSwiglu: return fn(Loader<Silu, true>{});
    case Activation::kGeglu: return fn(Loader<Gelu, true>{});
    case Activation::kGelu: return fn(Loader<Gelu, false>{});
    case Activation::kRelu: return fn(Loader<Relu, false>{});
    case Activation::kSquaredRelu: return fn(Loader<SquaredRelu, false>{});
  }
  throw std::runtime_error("moegemm: unknown activation");
}

}  // namespace

void act_quantize(const void* h_bf16, const float* probs, Activation act, int64_t T, int64_t F, int E,
                  const int32_t* plan, uint8_t* q, float* s, uint8_t* qT, float* sT, cudaStream_t stream) {
  const char* name = "act_quantize";
  auto run = [&](auto loader) {
    loader.h = static_cast<const __nv_bfloat16*>(h_bf16);
    loader.probs = probs;
    loader.F = F;
    multicast::launch(loader, T, F, E, plan, q, s, qT, sT, nullptr, PlanBuild{}, ZeroFill{}, stream, name);
  };
  switch (act) {  // a GLU: gate and up of a tile in one CTA (glu_forward.cuh)
    case Activation::kSwiglu: return glu_forward::launch<Silu>(h_bf16, probs, T, F, E, plan, q, s, qT, sT, stream, name);
    case Activation::kGeglu: return glu_forward::launch<Gelu>(h_bf16, probs, T, F, E, plan, q, s, qT, sT, stream, name);
    case Activation::kGelu: return run(ActForward<Gelu>{});
    case Activation::kRelu: return run(ActForward<Relu>{});
    case Activation::kSquaredRelu: return run(ActForward<SquaredRelu>{});
  }
  throw std::runtime_error("moegemm: unknown activation");
}

void act_backward_quantize(const void* da_bf16, const void* h_bf16, const float* probs, Activation act, int64_t T,
                           int64_t F, int E, const int32_t* plan, uint8_t* q, float* s, uint8_t* qT, float* sT,
                           float* dprobs_partial, cudaStream_t stream) {
  auto run = [&](auto loader) {
    loader.da = static_cast<const __nv_bfloat16*>(da_bf16);
    loader.h = static_cast<const __nv_bfloat16*>(h_bf16);
    loader.probs = probs;
    loader.F = F;
    const int64_t F1 = is_glu(act) ? 2 * F : F;
    multicast::launch(loader, T, F1, E, plan, q, s, qT, sT, dprobs_partial, PlanBuild{}, ZeroFill{},
                      stream, "act_backward_quantize");
  };
  // A GLU with F a multiple of 128: both halves of a tile from one read of da, gate and up (glu_backward.cuh).
  const char* name = "act_backward_quantize";
  if (F % kBlock == 0 && act == Activation::kSwiglu)
    return glu_backward::launch<Silu>(da_bf16, h_bf16, probs, T, F, E, plan, q, s, qT, sT, dprobs_partial, stream, name);
  if (F % kBlock == 0 && act == Activation::kGeglu)
    return glu_backward::launch<Gelu>(da_bf16, h_bf16, probs, T, F, E, plan, q, s, qT, sT, dprobs_partial, stream, name);
  dispatch<ActBackward>(act, run);
}

}  // namespace moegemm
