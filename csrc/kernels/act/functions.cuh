// The activations of the expert-MLP kernels (the FP8 recipe's fused ones, kernels/quant: act_quantize.cu, glu_forward.cuh,
// glu_backward.cuh; the bf16 recipe's, act_bf16.cu) in fp32: each
// a struct with f(x) and fdf(x, f, df) (value and derivative from one evaluation), and act_grad, one element of an
// activation's gradient, so that every kernel computes the same values by the same fp32 operations.
#pragma once

#include <cstdint>

namespace moegemm::act {

constexpr float kInvSqrt2 = 0.70710678118654752f;
constexpr float kInvSqrt2Pi = 0.39894228040143268f;
constexpr float kLog2e = 1.44269504088896341f;

// e^x and 1 / y on the special-function unit as __expf and __fdividef(1, y) compute them, but with results below
// 2^-126 flushed to zero: one instruction each instead of their range handling. The activations' values are the
// same but for magnitudes below 2^-126 (sigmoid(x) for x < -87 is 2^-126 .. 0 where __fdividef gave 0; GELU's
// derivative for x < -13 is 0 where it was a denormal).
__device__ __forceinline__ float exp_approx(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x * kLog2e));
  return r;
}
__device__ __forceinline__ float rcp_approx(float y) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(y));
  return r;
}

// Fast intrinsics (exp2-based exponential, approximate reciprocal): the result is within a few fp32 ulps of
// torch's, far below FP8's resolution. fdf gives the value and the derivative from one evaluation.
struct Silu {
  __device__ static float sigmoid(float x) { return rcp_approx(1.f + exp_approx(-x)); }
  __device__ static float f(float x) { return x * sigmoid(x); }
  __device__ static void fdf(float x, float& f, float& df) {
    const float sig = sigmoid(x);
    f = x * sig;
    df = sig * (1.f + x * (1.f - sig));
  }
};
struct Gelu {  // exact (erf) GELU, as torch.nn.functional.gelu
  __device__ static float f(float x) { return 0.5f * x * (1.f + erff(x * kInvSqrt2)); }
  __device__ static void fdf(float x, float& f, float& df) {  // f rounded as f(x) is (a GLU backward's up half uses it)
    const float e = erff(x * kInvSqrt2);
    f = 0.5f * x * (1.f + e);
    df = 0.5f * (1.f + e) + x * kInvSqrt2Pi * exp_approx(-0.5f * x * x);
  }
};
// The ReLUs keep NaN (relu(NaN) = NaN, as torch's; a comparison alone would map it to 0), in the value
// and in the derivative, so that nothing downstream of a NaN is finite.
__device__ __forceinline__ bool positive_or_nan(float x) { return !(x <= 0.f); }
struct Relu {
  __device__ static float f(float x) { return positive_or_nan(x) ? x : 0.f; }
  __device__ static void fdf(float x, float& f, float& df) {
    f = positive_or_nan(x) ? x : 0.f;
    df = positive_or_nan(x) ? (x > 0.f ? 1.f : x) : 0.f;
  }
};
struct SquaredRelu {
  __device__ static float f(float x) { return positive_or_nan(x) ? x * x : 0.f; }
  __device__ static void fdf(float x, float& f, float& df) {
    f = positive_or_nan(x) ? x * x : 0.f;
    df = positive_or_nan(x) ? 2.f * x : 0.f;
  }
};

// One element of an activation's gradient, with the probs weight p and up (the GLU's up value, 1 without
// one): the gate-side value da * p * up * act'(gate) and the up-side value da * p * act(gate); returns
// da * act(gate) * up, the element's share of dprobs.
template <class Act>
__device__ __forceinline__ float act_grad(float d, float g, float up, float p, float& gate_grad, float& up_grad) {
  float f, df;
  Act::fdf(g, f, df);
  gate_grad = d * p * up * df;
  up_grad = d * p * f;
  return d * f * up;
}

}  // namespace moegemm::act
