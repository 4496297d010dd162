#include "api/layer_inputs.h"

#include "api/layer_contract.h"

namespace moegemm::api {

Tensor x_input(const Tensor& x, const char* name) { return input(x, name, at::kBFloat16, 2, x); }

Tensor grad_input(const Tensor& dy, int64_t T, int64_t N, const Tensor& like) {
  TORCH_CHECK(dy.dim() == 2 && dy.size(0) == T && dy.size(1) == N, "moegemm: dy must have shape [", num(T), ", ", num(N),
              "], got ", shape(dy));
  return input(dy.contiguous(), "dy", at::kBFloat16, 2, like);
}

void check_weight(const Tensor& weight, const char* name, const Tensor& like) {
  TORCH_CHECK(weight.is_cuda() && weight.device() == like.device(), "moegemm: ", name, " is on ", weight.device().str(),
              ", expected ", like.device().str());
  TORCH_CHECK(weight.dim() == 3, "moegemm: ", name, " must be [E, N, K], got shape ", shape(weight));
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat, "moegemm: ", name,
              " must be bfloat16 or float32, got ", c10::toString(weight.scalar_type()));
  check_weight_shape(weight, name);
}

Tensor weight_input(const Tensor& weight) { return aligned(weight.contiguous()); }
Tensor weight_bf16(const Tensor& weight) { return aligned(weight.to(at::kBFloat16).contiguous()); }

Tensor bias_input(const std::optional<Tensor>& bias, const char* name, int64_t E, int64_t N, const Tensor& like) {
  if (!bias.has_value()) return Tensor();
  TORCH_CHECK(bias->is_cuda() && bias->device() == like.device(), "moegemm: ", name, " is on ", bias->device().str(),
              ", expected ", like.device().str());
  TORCH_CHECK(bias->dim() == 2 && bias->size(0) == E && bias->size(1) == N, "moegemm: ", name, " must be [", num(E), ", ",
              num(N), "], got ", shape(*bias));
  TORCH_CHECK(bias->is_floating_point(), "moegemm: ", name, " must be floating point, got ", c10::toString(bias->scalar_type()));
  const bool kept = bias->scalar_type() == at::kFloat || bias->scalar_type() == at::kBFloat16;
  return aligned((kept ? *bias : bias->to(at::kFloat)).contiguous());
}

Tensor probs_fp32(const std::optional<Tensor>& probs, int64_t T, const Tensor& like) {
  if (!probs.has_value()) return Tensor();
  TORCH_CHECK(probs->is_floating_point(), "moegemm: probs must be floating point, got ", c10::toString(probs->scalar_type()));
  return probs_input(probs->to(at::kFloat).contiguous(), T, like);
}

Tensor splits_input(const Tensor& m_splits, int64_t E, int64_t T, const Tensor& like) {
  check_splits(m_splits, like);
  TORCH_CHECK(m_splits.numel() == E, "moegemm: len(m_splits) must equal the number of experts ", num(E), ", got ",
              num(m_splits.numel()));
  check_plan_tokens(T, E);
  return aligned(m_splits);
}

void check_plan(const Tensor& plan, int64_t E, const Tensor& like) {
  check(plan, "plan", at::kInt, 2, like);
  TORCH_CHECK(num_experts(plan) == E, "moegemm: plan must be [3, ", num(E + 1), "], got ", shape(plan));
}

void check_tensor(const Tensor& t, const char* name, at::ScalarType dtype, std::initializer_list<int64_t> sizes,
                  const Tensor& like) {
  TORCH_CHECK(t.defined(), "moegemm: ", name, " is missing");
  check(t, name, dtype, static_cast<int64_t>(sizes.size()), like);
  int64_t i = 0;
  bool same = true;
  for (int64_t s : sizes) same = same && t.size(i++) == s;
  if (same) return;
  std::string want = "[";  // the message only when the check fails (this runs on every call)
  i = 0;
  for (int64_t s : sizes) want += (i++ ? ", " : "") + num(s);
  TORCH_CHECK(false, "moegemm: ", name, " must have shape ", want, "], got ", shape(t));
}

const Fp8WeightNames kFc1Fp8Names = {"fp8_weights[0] (q)", "fp8_weights[0] (s)", "fp8_weights[0] (qT)", "fp8_weights[0] (sT)"};
const Fp8WeightNames kFc2Fp8Names = {"fp8_weights[1] (q)", "fp8_weights[1] (s)", "fp8_weights[1] (qT)", "fp8_weights[1] (sT)"};
const Fp8WeightNames kLinearFp8Names = {"fp8_weight (q)", "fp8_weight (s)", "fp8_weight (qT)", "fp8_weight (sT)"};

Quantized fp8_weight_input(const c10::List<std::optional<Tensor>>& list, size_t first, const Fp8WeightNames& names, int64_t E,
                           int64_t N, int64_t K, bool transposed, const Tensor& like) {
  auto at_ = [&](size_t i) -> Tensor {
    std::optional<Tensor> t = list.get(first + i);
    return t.has_value() ? *t : Tensor();
  };
  namespace part = contract::fp8_weight_part;
  Quantized w{at_(part::kQ), at_(part::kS), at_(part::kQT), at_(part::kST)};
  const int64_t Nb = ceil_div(N, kBlock), Kb = ceil_div(K, kBlock);
  check_tensor(w.q, names[0], at::kFloat8_e4m3fn, {E, N, K}, like);
  check_tensor(w.s, names[1], at::kFloat, {E, Nb, Kb}, like);
  if (transposed) {
    check_tensor(w.qT, names[2], at::kFloat8_e4m3fn, {E, K, N}, like);
    check_tensor(w.sT, names[3], at::kFloat, {E, Kb, Nb}, like);
  }
  w.q = aligned(w.q), w.s = aligned(w.s);
  if (transposed) w.qT = aligned(w.qT), w.sT = aligned(w.sT);
  return w;
}

MainGrad main_grad_input(const std::optional<Tensor>& main_grad, bool overwrite, const char* name, const Tensor& weight,
                         const Tensor& like) {
  if (!main_grad.has_value()) return {};
  check_tensor(*main_grad, name, at::kFloat, {weight.size(0), weight.size(1), weight.size(2)}, like);
  return {*main_grad, overwrite};
}

Quantized fp8_x_input(const Tensor& x, const Tensor& x_scales, Recipe recipe) {
  TORCH_CHECK(recipe == Recipe::kFp8Blockwise, "moegemm: an FP8 x (x_scales given) needs the fp8_blockwise recipe");
  TORCH_CHECK(x.scalar_type() == at::kFloat8_e4m3fn, "moegemm: x given with x_scales must be float8_e4m3fn (the row copy of ",
              "quantize_act), got ", c10::toString(x.scalar_type()));
  const Tensor q = input(x, "x", at::kFloat8_e4m3fn, 2, x);
  const int64_t T = q.size(0), K = q.size(1);
  check_dim_aligned(K, "x.shape[1] (K)");
  return {q, row_scales_input(x_scales, "x_scales", T, ceil_div(K, kBlock), q), Tensor(), Tensor()};
}

Quantized wgrad_x_rows(const Tensor& saved_q, const Tensor& saved_s, const std::optional<Tensor>& x,
                       const std::optional<Tensor>& x_scales, int64_t T, int64_t K, const Tensor& like) {
  if (x_scales.has_value()) {
    TORCH_CHECK(x.has_value(), "moegemm: x_scales given without x (the FP8 x's row copy)");
    const Quantized given = fp8_x_input(*x, *x_scales, Recipe::kFp8Blockwise);
    check_tensor(given.q, "x", at::kFloat8_e4m3fn, {T, K}, like);
    return given;
  }
  check_tensor(saved_q, "saved qx", at::kFloat8_e4m3fn, {T, K}, like);
  return {aligned(saved_q), row_scales_input(saved_s, "saved sx", T, ceil_div(K, kBlock), like), Tensor(), Tensor()};
}

Tensor fp8_weight_grad(const Tensor& weight, const MainGrad& main_grad, const Tensor& like, const Tensor& qgT,
                       const Tensor& sgT, const Tensor& qxT, const Tensor& sxT, const Tensor& plan, const Tensor& zeroed) {
  return weight_grad(weight, main_grad, like, [&](const Tensor& out, bool accumulate) {
    run_gemm_fp8_ragged_reduction(qgT, sgT, qxT, sxT, plan, out, accumulate, {}, zeroed);
  });
}

size_t wgrad_operand_count(Recipe recipe) { return recipe == Recipe::kFp8Blockwise ? 4 : 2; }

Tensor deferred_weight_grad(Recipe recipe, at::TensorList operands, size_t first, const char* name, const Tensor& weight,
                            const MainGrad& main_grad, const Tensor& plan) {
  const int64_t N = weight.size(1), K = weight.size(2);
  TORCH_CHECK(operands.size() >= first + wgrad_operand_count(recipe), "moegemm: wgrad_operands must hold at least ",
              num(static_cast<int64_t>(first + wgrad_operand_count(recipe))), " tensors, got ",
              num(static_cast<int64_t>(operands.size())));
  const std::string n = name;
  auto at_ = [&](size_t i) { return operands[first + i]; };
  if (recipe == Recipe::kFp8Blockwise) {
    TORCH_CHECK(at_(0).dim() == 2 && at_(1).dim() == 2, "moegemm: ", name, " (qdyT, sdyT) must be 2-d, got ", shape(at_(0)),
                " and ", shape(at_(1)));
    const int64_t Wc = at_(0).size(1), NB = at_(1).size(0);
    TORCH_CHECK(Wc % kColAlign == 0, "moegemm: ", name, " qdyT.shape[1] must be a multiple of ", num(kColAlign), ", got ", num(Wc));
    check_tensor(at_(0), (n + " (qdyT)").c_str(), at::kFloat8_e4m3fn, {N, Wc}, plan);
    check_tensor(at_(1), (n + " (sdyT)").c_str(), at::kFloat, {NB, N}, plan);
    check_tensor(at_(2), (n + " (qxT)").c_str(), at::kFloat8_e4m3fn, {K, Wc}, plan);
    check_tensor(at_(3), (n + " (sxT)").c_str(), at::kFloat, {NB, K}, plan);
    return fp8_weight_grad(weight, main_grad, plan, aligned(at_(0)), aligned(at_(1)), aligned(at_(2)), aligned(at_(3)),
                           plan);
  }
  TORCH_CHECK(at_(0).dim() == 2, "moegemm: ", name, " (dy) must be 2-d, got ", shape(at_(0)));
  const int64_t T = at_(0).size(0);
  check_tensor(at_(0), (n + " (dy)").c_str(), at::kBFloat16, {T, N}, plan);
  check_tensor(at_(1), (n + " (x)").c_str(), at::kBFloat16, {T, K}, plan);
  const Tensor dy = aligned(at_(0)), x = aligned(at_(1));
  return weight_grad(weight, main_grad, plan, [&](const Tensor& out, bool accumulate) {
    run_gemm_bf16_wgrad(dy, x, plan, out, accumulate);
  });
}

at::ScalarType wgrad_dtype(const Tensor& weight) {
  return weight.scalar_type() == at::kBFloat16 ? at::kBFloat16 : at::kFloat;
}

}  // namespace moegemm::api
