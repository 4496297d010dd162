// The arguments of the layer entries (grouped_linear.cpp, grouped_mlp.cpp), checked once per call and
// turned into what the kernels take (bf16/fp32, contiguous, 16-byte aligned), and the weight gradient's
// two targets (a fresh tensor, or accumulation into main_grad).
#pragma once

#include <array>
#include <initializer_list>

#include "api/launch.h"
#include "api/main_grad.h"

namespace moegemm::api {

// x [T, K] bf16 on a CUDA device, contiguous; aligned.
Tensor x_input(const Tensor& x, const char* name);
// dy [T, N] bf16 on like's device (any strides: made contiguous); aligned.
Tensor grad_input(const Tensor& dy, int64_t T, int64_t N, const Tensor& like);
// weight [E, N, K] bf16 or fp32 on like's device, 1 <= E <= kMaxExperts, N and K positive multiples of
// 16 (any strides: the entries make it contiguous where they read it).
void check_weight(const Tensor& weight, const char* name, const Tensor& like);
// The weight as the kernels read it: contiguous and aligned, in its dtype or in bf16.
Tensor weight_input(const Tensor& weight);
Tensor weight_bf16(const Tensor& weight);
// bias [E, N] floating point on like's device, as fp32 or bf16, contiguous, aligned; undefined if absent.
Tensor bias_input(const std::optional<Tensor>& bias, const char* name, int64_t E, int64_t N, const Tensor& like);
// probs [T] floating point on like's device, as fp32, contiguous, aligned; undefined if absent.
Tensor probs_fp32(const std::optional<Tensor>& probs, int64_t T, const Tensor& like);
// m_splits (E int32/int64 counts on like's device, for T tokens) checked; aligned. The plan is made from it by
// its own launch (run_make_plan) or on the side of the weights' (run_quantize_weights).
Tensor splits_input(const Tensor& m_splits, int64_t E, int64_t T, const Tensor& like);
// A plan passed back to a backward entry: [3, E+1] int32 on like's device.
void check_plan(const Tensor& plan, int64_t E, const Tensor& like);
// t is dtype with exactly these sizes on like's device, contiguous (saved tensors, FP8 weight copies).
void check_tensor(const Tensor& t, const char* name, at::ScalarType dtype, std::initializer_list<int64_t> sizes,
                  const Tensor& like);
// A pre-quantized weight (q [E,N,K], s [E,Nb,Kb], qT [E,K,N], sT [E,Kb,Nb]): the Tensor?[] list's entries
// first .. first + 3 (what quantize_weight returns), named in errors by `names`; the transposed parts are
// checked only if `transposed` (they may be None for inference).
using Fp8WeightNames = std::array<const char*, 4>;
extern const Fp8WeightNames kFc1Fp8Names, kFc2Fp8Names, kLinearFp8Names;
Quantized fp8_weight_input(const c10::List<std::optional<Tensor>>& list, size_t first, const Fp8WeightNames& names, int64_t E,
                           int64_t N, int64_t K, bool transposed, const Tensor& like);
// main_grad (MainGrad, api/main_grad.h) checked: fp32 [E, N, K] on like's device, contiguous; none if absent (then `overwrite` has no effect).
MainGrad main_grad_input(const std::optional<Tensor>& main_grad, bool overwrite, const char* name, const Tensor& weight,
                         const Tensor& like);

// x's FP8 row copy for wgrad's column copy (fp8_blockwise), checked: the one forward saved (saved_q [T, K] e4m3,
// saved_s [T, ceil(K/128)] fp32 in the row-scale layout), or with x_scales an FP8 x given back to backward (x: its
// row copy, x_scales: its scales in any strides, copied into the layout). -> {q, s, [0], [0]}. The backward makes
// the column copy from it with run_requantize_cols(q, s, plan).
Quantized wgrad_x_rows(const Tensor& saved_q, const Tensor& saved_s, const std::optional<Tensor>& x,
                       const std::optional<Tensor>& x_scales, int64_t T, int64_t K, const Tensor& like);

// An FP8 x (Fp8Rows), fp8_blockwise recipe only: q [T, K] e4m3 on a CUDA device, contiguous, with its 1x128
// row scales x_scales [T, ceil(K/128)] fp32 in any strides (quantize_act's row copy; copied into the K-major
// layout, csrc/moegemm.h row_scale_pitch, when not in it); both aligned. -> {q, s, [0], [0]}.
Quantized fp8_x_input(const Tensor& x, const Tensor& x_scales, Recipe recipe);

// A deferred weight gradient (defer_wgrad backward, then linear_wgrad / mlp_wgrad): the GEMM operands of
// weight [E, N, K] at operands[first], [first + 1], ...:
//   fp8_blockwise: qdyT [N, Wc] e4m3, sdyT [NB, N] fp32, qxT [K, Wc] e4m3, sxT [NB, K] fp32 (column copies);
//   bf16:          dy [T, N] bf16, x [T, K] bf16.
// Checked, then the gradient is written or accumulated as by weight_grad. The operands must come from a
// backward over this plan (its device values cannot be checked against their widths on the host).
size_t wgrad_operand_count(Recipe recipe);
Tensor deferred_weight_grad(Recipe recipe, at::TensorList operands, size_t first, const char* name, const Tensor& weight,
                            const MainGrad& main_grad, const Tensor& plan);
// The fp8 weight gradient from the column copies of the output gradient (qgT, sgT) and of the input (qxT, sxT), as
// weight_grad returns it (written, or into main_grad); `zeroed`: its GEMM's workspace, zeroed by the
// quantizer that made the last of them (fp8_wgrad_workspace), or undefined (then allocated and zeroed here).
Tensor fp8_weight_grad(const Tensor& weight, const MainGrad& main_grad, const Tensor& like, const Tensor& qgT,
                       const Tensor& sgT, const Tensor& qxT, const Tensor& sxT, const Tensor& plan,
                       const Tensor& zeroed = {});

// The gradient of a weight [E, N, K]: `gemm(out, accumulate)` accumulates into main_grad when there is one (writes
// it with main_grad.overwrite; then the returned dw is the [0] placeholder), else writes a fresh dw in the wgrad
// dtype (bf16 for bf16 weights, fp32 otherwise).
at::ScalarType wgrad_dtype(const Tensor& weight);
template <class Gemm>
Tensor weight_grad(const Tensor& weight, const MainGrad& main_grad, const Tensor& like, Gemm&& gemm) {
  if (main_grad.tensor.defined()) {
    gemm(main_grad.tensor, !main_grad.overwrite);
    return none_like(like, wgrad_dtype(weight));
  }
  Tensor dw = new_wgrad(weight.size(0), weight.size(1), weight.size(2), wgrad_dtype(weight), like);
  gemm(dw, false);
  return dw;
}

}  // namespace moegemm::api
