// The grouped linear layer y[t] = x[t] · weight[e(t)]ᵀ (+ bias[e(t)]): one entry per direction.
//
// Saved for backward (a list whose slots depend on the recipe only, named in moegemm/backends/contract.py;
// [0] placeholders where a part is not needed):
//   fp8_blockwise: qx, sx — x's FP8 row copy (fprop's operand; wgrad's column copy is made from it in
//                  backward); qwT, swT — Wᵀ's copy (dgrad);
//   bf16:          w_bf16 — the bf16 copy of an fp32 weight (dgrad); backward reads x and a bf16
//                  weight from its own arguments.
// An FP8 x (x_scales given, fp8_blockwise only) is its row copy: fprop reads it as it is, and the backward
// takes it back as x and x_scales (an op's outputs never alias its inputs, so it is not in saved).
// With defer_wgrad the backward computes dx and db only; the weight gradient is left to linear_wgrad over
// wgrad_operands fp8 (qdyT, sdyT, qxT, sxT) or bf16 (dy, x). Of these, backward returns the ones it made
// (the made slots: fp8 qdyT, sdyT, qxT, sxT; bf16 none); the caller keeps the others.
#include <c10/core/DeviceGuard.h>

#include <array>

#include "api/layer_contract.h"
#include "api/layer_inputs.h"
#include "api/layers.h"

namespace moegemm::api {

namespace {
namespace saved_fp8 = contract::linear::saved_fp8;
namespace saved_bf16 = contract::linear::saved_bf16;
namespace made_fp8 = contract::linear::made_fp8;
constexpr size_t kFp8Weight = contract::linear::fp8_weights::kCount;

// The weight's FP8 copies given by the caller (quantize_weight's four tensors, kept across calls) as the
// list fp8_weight_input reads, or an empty list (None or []): then the forward quantizes the weight itself.
c10::List<std::optional<Tensor>> fp8_weight_list(const std::optional<at::TensorList>& fp8_weight, Recipe recipe) {
  c10::List<std::optional<Tensor>> list;
  if (!fp8_weight.has_value() || fp8_weight->empty()) return list;
  TORCH_CHECK(fp8_weight->size() == kFp8Weight, "moegemm: fp8_weight must hold ", num(kFp8Weight),
              " tensors (quantize_weight of weight), got ", num(static_cast<int64_t>(fp8_weight->size())));
  TORCH_CHECK(recipe == Recipe::kFp8Blockwise, "moegemm: fp8_weight needs the fp8_blockwise recipe");
  for (const Tensor& t : *fp8_weight) list.push_back(t);
  return list;
}
}  // namespace

std::tuple<Tensor, Tensor, std::vector<Tensor>> linear_fwd(const Tensor& x_in, const Tensor& weight, const Tensor& m_splits,
                                                           const std::optional<Tensor>& bias_in, int64_t recipe_id,
                                                           bool need_dx, bool need_dw,
                                                           const std::optional<Tensor>& x_scales,
                                                           std::optional<at::TensorList> fp8_weight_in) {
  const Recipe recipe = to_recipe(recipe_id);
  const c10::List<std::optional<Tensor>> fp8_weight = fp8_weight_list(fp8_weight_in, recipe);
  const bool weight_given = fp8_weight.size() == kFp8Weight;
  const bool fp8_x = x_scales.has_value();
  const Quantized given = fp8_x ? fp8_x_input(x_in, *x_scales, recipe) : Quantized{};
  const Tensor x = fp8_x ? given.q : x_input(x_in, "x");
  check_weight(weight, "weight", x);
  const int64_t E = weight.size(0), N = weight.size(1), K = weight.size(2), T = x.size(0);
  TORCH_CHECK(x.size(1) == K, "moegemm: x.shape[1] must equal weight.shape[2] = ", num(K), ", got ", num(x.size(1)));
  const Tensor bias = bias_input(bias_in, "bias", E, N, x);
  c10::DeviceGuard guard(x.device());
  const Tensor splits = splits_input(m_splits, E, T, x);
  // fp8: the plan is built inside the first quantizer's launch (the weight's when quantized here, else x's);
  // bf16: by its own.
  const bool fp8 = recipe == Recipe::kFp8Blockwise;
  const Tensor plan = fp8 ? empty_plan(E, x) : run_make_plan(splits, T);
  Tensor plan_from = splits;  // the counts x's quantizer builds the plan from, unless the weight's launch does
  Tensor y;
  std::vector<Tensor> saved;
  if (fp8) {
    Quantized qw;
    if (weight_given) {
      qw = fp8_weight_input(fp8_weight, contract::linear::fp8_weights::kWeight, kLinearFp8Names, E, N, K, need_dx, x);
    } else {
      qw = std::move(run_quantize_weights({{weight_input(weight), to_dtype(weight, "weight")}}, need_dx, {splits, T, plan})[0]);
      plan_from = Tensor();
    }
    // the bias added in the GEMM's epilogue; a bf16 x quantized (into its row copy, qx) in the GEMM's launch where
    // that pays
    Quantized qx;
    const GemmWorkspaces ws = fp8_x ? stream_workspaces(x) : gemm_workspaces(false, plan, true);
    y = run_fprop(x, fp8_x ? &given : nullptr, plan, plan_from, qw.q, qw.s, bias, qx, ws);
    // Wᵀ for dgrad: saved when made here; given copies come back through linear_bwd's fp8_weight (an
    // output may not alias an input)
    const bool keep_wT = need_dx && !weight_given;
    saved.resize(saved_fp8::kCount);
    const bool keep_x = need_dw && !fp8_x;  // an FP8 x comes back as backward's x and x_scales
    saved[saved_fp8::kQx] = keep_x ? qx.q : none_like(x, at::kFloat8_e4m3fn);
    saved[saved_fp8::kSx] = keep_x ? qx.s : none_like(x, at::kFloat);
    saved[saved_fp8::kQwT] = keep_wT ? qw.qT : none_like(x, at::kFloat8_e4m3fn);
    saved[saved_fp8::kSwT] = keep_wT ? qw.sT : none_like(x, at::kFloat);
  } else {
    const Tensor w = weight_bf16(weight);
    y = run_gemm_bf16_ragged_rows(x, w, plan, false);
    if (bias.defined()) run_add_bias(y, bias, plan);
    saved.resize(saved_bf16::kCount);
    saved[saved_bf16::kWBf16] = need_dx && weight.scalar_type() != at::kBFloat16 ? w : none_like(x, at::kBFloat16);
  }
  return {y, plan, saved};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> linear_bwd(
    const Tensor& dy_in, const Tensor& plan, at::TensorList saved, const std::optional<Tensor>& x_in, const Tensor& weight,
    const std::optional<Tensor>& main_grad_in, int64_t recipe_id, bool need_dx, bool need_dw, bool need_db,
    bool defer_wgrad, std::optional<at::TensorList> fp8_weight_in, const std::optional<Tensor>& x_scales,
    bool overwrite_main_grad) {
  const Recipe recipe = to_recipe(recipe_id);
  const c10::List<std::optional<Tensor>> fp8_weight = fp8_weight_list(fp8_weight_in, recipe);
  const bool weight_given = fp8_weight.size() == kFp8Weight;
  TORCH_CHECK(dy_in.is_cuda(), "moegemm: dy must be a CUDA tensor, got one on ", dy_in.device().str());
  check_weight(weight, "weight", dy_in);
  const int64_t E = weight.size(0), N = weight.size(1), K = weight.size(2), T = dy_in.dim() == 2 ? dy_in.size(0) : -1;
  const Tensor dy = grad_input(dy_in, T, N, dy_in);
  check_plan(plan, E, dy);
  const bool defer = defer_wgrad && need_dw;
  const MainGrad main_grad =
      need_dw && !defer ? main_grad_input(main_grad_in, overwrite_main_grad, "main_grad", weight, dy) : MainGrad{};
  c10::DeviceGuard guard(dy.device());
  Tensor dx = none_like(dy, at::kBFloat16), dw = none_like(dy, wgrad_dtype(weight)), db = none_like(dy, at::kFloat);
  const bool fp8 = recipe == Recipe::kFp8Blockwise;
  std::array<Tensor, contract::linear::kMadeCount> made;  // [0] placeholders until made (bf16 makes none)
  if (fp8) {
    made[made_fp8::kQdyT] = none_like(dy, at::kFloat8_e4m3fn), made[made_fp8::kSdyT] = none_like(dy, at::kFloat);
    made[made_fp8::kQxT] = none_like(dy, at::kFloat8_e4m3fn), made[made_fp8::kSxT] = none_like(dy, at::kFloat);
    TORCH_CHECK(saved.size() == saved_fp8::kCount, "moegemm: saved must hold ", num(saved_fp8::kCount), " tensors, got ",
                num(saved.size()));
    if (need_dx || need_dw) {
      const GemmWorkspaces ws = gemm_workspaces(false, plan);  // dgrad's tile counter, zeroed by dy's quantizer
      Quantized qdy = run_quantize_act(dy, DType::kBF16, plan, need_dx, need_dw, {}, ws.words);
      if (need_dx) {
        Quantized wT;
        if (weight_given) {
          wT = fp8_weight_input(fp8_weight, contract::linear::fp8_weights::kWeight, kLinearFp8Names, E, N, K, true, dy);
        } else {
          const int64_t Nb = ceil_div(N, kBlock), Kb = ceil_div(K, kBlock);
          check_tensor(saved[saved_fp8::kQwT], "saved qwT", at::kFloat8_e4m3fn, {E, K, N}, dy);
          check_tensor(saved[saved_fp8::kSwT], "saved swT", at::kFloat, {E, Kb, Nb}, dy);
          wT.qT = aligned(saved[saved_fp8::kQwT]), wT.sT = aligned(saved[saved_fp8::kSwT]);
        }
        dx = run_gemm_fp8_ragged_rows(qdy.q, qdy.s, wT.qT, wT.sT, plan, -1, Tensor(), ws.counter);
      }
      if (need_dw) {
        const Quantized rows = wgrad_x_rows(saved[saved_fp8::kQx], saved[saved_fp8::kSx], x_in, x_scales, T, K, dy);
        const Tensor ws = fp8_wgrad_workspace(!defer, plan);  // zeroed by requantize_cols' launch
        const Quantized xT = run_requantize_cols(rows.q, rows.s, plan, ws);
        if (defer) {
          made[made_fp8::kQdyT] = qdy.qT, made[made_fp8::kSdyT] = qdy.sT;
          made[made_fp8::kQxT] = xT.qT, made[made_fp8::kSxT] = xT.sT;
        } else {
          dw = fp8_weight_grad(weight, main_grad, dy, qdy.qT, qdy.sT, xT.qT, xT.sT, plan, ws);
        }
      }
    }
  } else {
    for (Tensor& t : made) t = none_like(dy, at::kBFloat16);
    TORCH_CHECK(saved.size() == saved_bf16::kCount, "moegemm: saved must hold ", num(saved_bf16::kCount), " tensor, got ",
                num(saved.size()));
    if (need_dx) {
      const bool kept = weight.scalar_type() != at::kBFloat16;  // forward saved the bf16 copy of an fp32 weight
      if (kept) check_tensor(saved[saved_bf16::kWBf16], "saved w_bf16", at::kBFloat16, {E, N, K}, dy);
      dx = run_gemm_bf16_ragged_rows(dy, kept ? aligned(saved[saved_bf16::kWBf16]) : weight_bf16(weight), plan, true);
    }
    if (need_dw) {
      TORCH_CHECK(x_in.has_value(), "moegemm: the bf16 recipe's weight gradient needs x");
      const Tensor x = x_input(*x_in, "x");
      TORCH_CHECK(x.size(0) == T && x.size(1) == K, "moegemm: x must be [", num(T), ", ", num(K), "], got ", shape(x));
      if (!defer) dw = weight_grad(weight, main_grad, dy, [&](const Tensor& out, bool accumulate) {
        run_gemm_bf16_wgrad(dy, x, plan, out, accumulate);
      });
    }
  }
  if (need_db) db = run_bias_grad(dy, plan);
  return {dx, dw, db, made[0], made[1], made[2], made[3]};
}

Tensor linear_wgrad(const Tensor& plan, at::TensorList operands, const Tensor& weight,
                    const std::optional<Tensor>& main_grad_in, int64_t recipe_id, bool overwrite_main_grad) {
  const Recipe recipe = to_recipe(recipe_id);
  TORCH_CHECK(plan.is_cuda(), "moegemm: plan must be a CUDA tensor, got one on ", plan.device().str());
  check_weight(weight, "weight", plan);
  check_plan(plan, weight.size(0), plan);
  const bool fp8 = recipe == Recipe::kFp8Blockwise;
  const size_t count = fp8 ? contract::linear::wgrad_operands_fp8::kCount : contract::linear::wgrad_operands_bf16::kCount;
  TORCH_CHECK(operands.size() == count, "moegemm: wgrad_operands must hold ", num(static_cast<int64_t>(count)),
              " tensors, got ", num(static_cast<int64_t>(operands.size())));
  const MainGrad main_grad = main_grad_input(main_grad_in, overwrite_main_grad, "main_grad", weight, plan);
  c10::DeviceGuard guard(plan.device());
  const size_t first = fp8 ? contract::linear::wgrad_operands_fp8::kQdyT : contract::linear::wgrad_operands_bf16::kDy;
  return deferred_weight_grad(recipe, operands, first, "wgrad_operands", weight, main_grad, plan);
}

}  // namespace moegemm::api
