// The layers' autograd in C++: grouped_linear and grouped_mlp (autograd.h).
//
// Each call records one node (a torch::autograd::Function). What its backward needs is decided in the
// Autograd kernel (which inputs require grad) and kept in the node:
//   linear: the plan, x (for wgrad: the bf16 recipe's x, or an FP8 x's row copy and x_scales), the weight, its
//           given FP8 copies and the forward entry's saved list, as saved variables (released after backward
//           unless retain_graph);
//   mlp:    the same (plus probs) handed over to mlp_bwd, which frees each saved tensor after its last use
//           (peak memory), so that a second backward over the same graph is an error, as in Python.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>

#include <type_traits>
#include <vector>

#include "api/autograd.h"
#include "api/common.h"
#include "api/layers.h"
#include "api/main_grad.h"

namespace moegemm::api {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The op `name` (whose kernel is Fn) through the dispatcher. Called below autograd: real tensors reach
// the CUDA kernel, the tensors of a torch.compile trace its fake.
template <auto& Fn>
const auto& dispatched(const char* name) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<std::remove_reference_t<decltype(Fn)>>();
  return op;
}

bool requires_grad(const std::optional<Tensor>& t) { return t.has_value() && t->defined() && t->requires_grad(); }

std::optional<Tensor> defined_or_none(const Tensor& t) { return t.defined() ? std::optional<Tensor>(t) : std::nullopt; }

// A torch.compile trace's tensors (fake or functional) are Python subclasses.
bool traced(const Tensor& t) { return t.unsafeGetTensorImpl()->is_python_dispatch(); }

void refuse_double_backward(const char* layer, const Tensor& dy) {
  TORCH_CHECK(!at::GradMode::is_enabled() || traced(dy), "moegemm: ", layer, " is not twice differentiable: its ",
              "backward cannot run with create_graph=True (double backward)");
}

// Which gradients a backward computes, as the bits of one integer kept in the node.
int64_t pack(std::initializer_list<bool> needs) {
  int64_t bits = 0, i = 0;
  for (bool n : needs) bits |= static_cast<int64_t>(n) << i++;
  return bits;
}
bool needs(int64_t bits, int which) { return (bits >> which) & 1; }

// A gradient in its parameter's dtype (the entries return fp32 sums and weight gradients in the wgrad
// dtype); undefined when not needed.
Tensor in_dtype(const Tensor& grad, bool needed, at::ScalarType dtype) {
  if (!needed) return Tensor();
  return grad.scalar_type() == dtype ? grad : grad.to(dtype);
}
// A parameter's dtype as the node keeps it (-1: no such parameter, whose gradient is never needed).
int64_t dtype_of(const std::optional<Tensor>& t) {
  return t.has_value() && t->defined() ? static_cast<int64_t>(t->scalar_type()) : -1;
}
at::ScalarType kept_dtype(int64_t dtype) { return dtype < 0 ? at::kFloat : static_cast<at::ScalarType>(dtype); }

std::optional<at::TensorList> list_or_none(const std::vector<Tensor>& v) {
  return v.empty() ? std::nullopt : std::optional<at::TensorList>(v);
}

// ------------------------------------------------------------------------------------------ grouped_linear
enum LinearGrad : int { kLinearDx, kLinearDw, kLinearDb };

struct LinearArgs {  // what autograd does not differentiate
  Tensor x;          // bf16, or the FP8 row copy (with x_scales)
  Tensor m_splits;
  std::optional<Tensor> x_scales;
  std::vector<Tensor> fp8_weight;
  int64_t recipe;
  int64_t needs;  // LinearGrad bits
};

struct LinearNode : torch::autograd::Function<LinearNode> {
  // dx_of: the tensor whose gradient is dx (x itself, or an FP8 x's dx_target)
  static Tensor forward(AutogradContext* ctx, const std::optional<Tensor>& dx_of, const Tensor& weight,
                        const std::optional<Tensor>& bias, const LinearArgs& a) {
    const bool need_dw = needs(a.needs, kLinearDw);
    at::AutoDispatchBelowADInplaceOrView below;
    auto [y, plan, saved] = dispatched<linear_fwd>("moegemm::linear_fwd")
                                .call(a.x, weight, a.m_splits, bias, a.recipe, needs(a.needs, kLinearDx), need_dw,
                                      a.x_scales, list_or_none(a.fp8_weight));
    // wgrad's x: the bf16 recipe's, or an FP8 x's row copy (the fp8 recipe's forward saves a bf16 x's own)
    const bool keep_x = need_dw && (to_recipe(a.recipe) == Recipe::kBf16 || a.x_scales.has_value());
    const Tensor x_scales = keep_x && a.x_scales.has_value() ? *a.x_scales : Tensor();
    variable_list kept{plan, keep_x ? a.x : Tensor(), x_scales, weight};
    kept.insert(kept.end(), a.fp8_weight.begin(), a.fp8_weight.end());
    kept.insert(kept.end(), saved.begin(), saved.end());
    ctx->save_for_backward(kept);
    ctx->saved_data["recipe"] = a.recipe;
    ctx->saved_data["needs"] = a.needs;
    ctx->saved_data["fp8_count"] = static_cast<int64_t>(a.fp8_weight.size());
    ctx->saved_data["bias_dtype"] = dtype_of(bias);
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor& dy = grads[0];
    refuse_double_backward("grouped_linear", dy);
    const int64_t bits = ctx->saved_data["needs"].toInt(), fp8_count = ctx->saved_data["fp8_count"].toInt();
    const bool need_dx = needs(bits, kLinearDx), need_dw = needs(bits, kLinearDw), need_db = needs(bits, kLinearDb);
    const variable_list kept = ctx->get_saved_variables();
    const Tensor &plan = kept[0], &x = kept[1], &x_scales = kept[2], &weight = kept[3];
    const std::vector<Tensor> fp8_weight(kept.begin() + 4, kept.begin() + 4 + fp8_count);
    const std::vector<Tensor> saved(kept.begin() + 4 + fp8_count, kept.end());
    const MainGrad target = need_dw ? main_grad_attributes(weight, "weight") : MainGrad{};
    const std::optional<Tensor> main_grad = defined_or_none(target.tensor);
    at::AutoDispatchBelowADInplaceOrView below;
    auto [dx, dw, db, made0, made1, made2, made3] =
        dispatched<linear_bwd>("moegemm::linear_bwd")
            .call(dy, plan, saved, defined_or_none(x), weight, main_grad, ctx->saved_data["recipe"].toInt(), need_dx,
                  need_dw, need_db, false, list_or_none(fp8_weight), defined_or_none(x_scales), target.overwrite);
    return {need_dx ? dx : Tensor(), in_dtype(dw, need_dw && !main_grad.has_value(), weight.scalar_type()),
            in_dtype(db, need_db, kept_dtype(ctx->saved_data["bias_dtype"].toInt())), Tensor()};
  }
};

// -------------------------------------------------------------------------------------------- grouped_mlp
enum MlpGrad : int { kMlpDx, kMlpDw1, kMlpDw2, kMlpDb1, kMlpDb2, kMlpDprobs };

struct MlpArgs {
  Tensor x, m_splits;
  std::optional<Tensor> x_scales;
  c10::List<std::optional<Tensor>> fp8_weights;
  int64_t activation, recipe;
  int64_t needs;  // MlpGrad bits
};

// The node's tensors for backward, kept as one list that backward takes out (and mlp_bwd frees as it goes).
enum MlpKept : size_t { kKeptPlan, kKeptW1, kKeptW2, kKeptCount };

struct MlpNode : torch::autograd::Function<MlpNode> {
  static Tensor forward(AutogradContext* ctx, const std::optional<Tensor>& dx_of, const Tensor& fc1_weight,
                        const Tensor& fc2_weight, const std::optional<Tensor>& fc1_bias,
                        const std::optional<Tensor>& fc2_bias, const std::optional<Tensor>& probs, const MlpArgs& a) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [y, plan, saved] = dispatched<mlp_fwd>("moegemm::mlp_fwd")
                                .call(a.x, fc1_weight, fc2_weight, a.m_splits, fc1_bias, fc2_bias, probs, a.activation,
                                      a.recipe, a.fp8_weights, true, needs(a.needs, kMlpDw1), needs(a.needs, kMlpDw2),
                                      a.x_scales);
    std::vector<Tensor> kept{plan, fc1_weight, fc2_weight};
    kept.insert(kept.end(), saved.begin(), saved.end());
    auto& d = ctx->saved_data;
    d["kept"] = std::move(kept);
    // wgrad's x: the bf16 recipe's, or an FP8 x's row copy and scales (the fp8 recipe's forward saves a bf16 x's own)
    const bool fp8_x_for_wgrad = a.x_scales.has_value() && needs(a.needs, kMlpDw1);
    d["x"] = to_recipe(a.recipe) == Recipe::kBf16 || fp8_x_for_wgrad ? std::optional<Tensor>(a.x) : std::nullopt;
    d["x_scales"] = fp8_x_for_wgrad ? a.x_scales : std::nullopt;
    d["probs"] = probs;
    d["fp8_weights"] = a.fp8_weights;
    d["activation"] = a.activation;
    d["recipe"] = a.recipe;
    d["needs"] = a.needs;
    d["dtypes"] = std::vector<int64_t>{dtype_of(fc1_bias), dtype_of(fc2_bias), dtype_of(probs)};
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor& dy = grads[0];
    refuse_double_backward("grouped_mlp", dy);
    auto& d = ctx->saved_data;
    const auto found = d.find("kept");
    TORCH_CHECK(found != d.end(), "moegemm: GroupedMLP's backward ran a second time over the same graph; it frees its ",
                "saved tensors during the first one (retain_graph=True is not supported)");
    std::vector<Tensor> kept = found->second.toTensorVector();
    const std::optional<Tensor> x = d["x"].toOptional<Tensor>(), x_scales = d["x_scales"].toOptional<Tensor>();
    const std::optional<Tensor> probs = d["probs"].toOptional<Tensor>();
    const c10::List<std::optional<Tensor>> fp8_weights = d["fp8_weights"].toOptionalTensorList();
    // nothing left in the node
    d.erase(found), d.erase("x"), d.erase("x_scales"), d.erase("probs"), d.erase("fp8_weights");
    const Tensor plan = kept[kKeptPlan], fc1_weight = kept[kKeptW1], fc2_weight = kept[kKeptW2];
    std::vector<Tensor> saved(std::make_move_iterator(kept.begin() + kKeptCount), std::make_move_iterator(kept.end()));
    kept.clear();
    const int64_t bits = d["needs"].toInt();
    bool need[6];
    for (int i = 0; i < 6; ++i) need[i] = needs(bits, i);
    const MainGrad t1 = need[kMlpDw1] ? main_grad_attributes(fc1_weight, "fc1_weight") : MainGrad{};
    const MainGrad t2 = need[kMlpDw2] ? main_grad_attributes(fc2_weight, "fc2_weight") : MainGrad{};
    const std::optional<Tensor> mg1 = defined_or_none(t1.tensor), mg2 = defined_or_none(t2.tensor);
    const std::vector<int64_t> dtypes = d["dtypes"].toIntVector();
    at::AutoDispatchBelowADInplaceOrView below;
    // eager: mlp_bwd frees each saved tensor after its last use (nothing else holds them); a trace keeps them
    auto [dx, dw1, dw2, db1, db2, dprobs, m0, m1, m2, m3, m4, m5] =
        dispatched<mlp_bwd>("moegemm::mlp_bwd")
            .call(dy, plan, saved, x, fc1_weight, fc2_weight, probs, fp8_weights, mg1, mg2, d["activation"].toInt(),
                  d["recipe"].toInt(), need[kMlpDx], need[kMlpDw1], need[kMlpDw2], need[kMlpDb1], need[kMlpDb2],
                  need[kMlpDprobs], !traced(dy), false, x_scales, t1.overwrite, t2.overwrite);
    return {need[kMlpDx] ? dx : Tensor(),
            in_dtype(dw1, need[kMlpDw1] && !mg1.has_value(), fc1_weight.scalar_type()),
            in_dtype(dw2, need[kMlpDw2] && !mg2.has_value(), fc2_weight.scalar_type()),
            in_dtype(db1, need[kMlpDb1], kept_dtype(dtypes[0])),
            in_dtype(db2, need[kMlpDb2], kept_dtype(dtypes[1])),
            in_dtype(dprobs, need[kMlpDprobs], kept_dtype(dtypes[2])),
            Tensor()};
  }
};

}  // namespace

// ------------------------------------------------------------------------------------------ the kernels
Tensor grouped_linear(const Tensor& x, const Tensor& weight, const Tensor& m_splits, const std::optional<Tensor>& bias,
                      int64_t recipe, const std::optional<Tensor>& x_scales, const std::optional<Tensor>& dx_target,
                      std::optional<at::TensorList> fp8_weight) {
  return std::get<0>(linear_fwd(x, weight, m_splits, bias, recipe, false, false, x_scales, fp8_weight));
}

Tensor grouped_linear_autograd(const Tensor& x, const Tensor& weight, const Tensor& m_splits,
                               const std::optional<Tensor>& bias, int64_t recipe, const std::optional<Tensor>& x_scales,
                               const std::optional<Tensor>& dx_target, std::optional<at::TensorList> fp8_weight) {
  const std::optional<Tensor> dx_of = x_scales.has_value() ? dx_target : std::optional<Tensor>(x);
  const bool grad = at::GradMode::is_enabled();
  const int64_t bits = pack({grad && requires_grad(dx_of), grad && weight.requires_grad(), grad && requires_grad(bias)});
  if (bits == 0) {
    at::AutoDispatchBelowADInplaceOrView below;
    return dispatched<grouped_linear>("moegemm::grouped_linear")
        .call(x, weight, m_splits, bias, recipe, x_scales, dx_target, fp8_weight);
  }
  LinearArgs a{x, m_splits, x_scales, fp8_weight.has_value() ? fp8_weight->vec() : std::vector<Tensor>{}, recipe, bits};
  return LinearNode::apply(dx_of, weight, bias, a);
}

Tensor grouped_mlp(const Tensor& x, const Tensor& fc1_weight, const Tensor& fc2_weight, const Tensor& m_splits,
                   const std::optional<Tensor>& fc1_bias, const std::optional<Tensor>& fc2_bias,
                   const std::optional<Tensor>& probs, int64_t activation, int64_t recipe,
                   const c10::List<std::optional<Tensor>>& fp8_weights, const std::optional<Tensor>& x_scales,
                   const std::optional<Tensor>& dx_target) {
  return std::get<0>(mlp_fwd(x, fc1_weight, fc2_weight, m_splits, fc1_bias, fc2_bias, probs, activation, recipe,
                             fp8_weights, false, false, false, x_scales));
}

Tensor grouped_mlp_autograd(const Tensor& x, const Tensor& fc1_weight, const Tensor& fc2_weight, const Tensor& m_splits,
                            const std::optional<Tensor>& fc1_bias, const std::optional<Tensor>& fc2_bias,
                            const std::optional<Tensor>& probs, int64_t activation, int64_t recipe,
                            const c10::List<std::optional<Tensor>>& fp8_weights, const std::optional<Tensor>& x_scales,
                            const std::optional<Tensor>& dx_target) {
  const std::optional<Tensor> dx_of = x_scales.has_value() ? dx_target : std::optional<Tensor>(x);
  const bool grad = at::GradMode::is_enabled();
  const int64_t bits = pack({grad && requires_grad(dx_of), grad && fc1_weight.requires_grad(),
                             grad && fc2_weight.requires_grad(), grad && requires_grad(fc1_bias),
                             grad && requires_grad(fc2_bias), grad && requires_grad(probs)});
  if (bits == 0) {
    at::AutoDispatchBelowADInplaceOrView below;
    return dispatched<grouped_mlp>("moegemm::grouped_mlp")
        .call(x, fc1_weight, fc2_weight, m_splits, fc1_bias, fc2_bias, probs, activation, recipe, fp8_weights, x_scales,
              dx_target);
  }
  MlpArgs a{x, m_splits, x_scales, fp8_weights, activation, recipe, bits};
  return MlpNode::apply(dx_of, fc1_weight, fc2_weight, fc1_bias, fc2_bias, probs, a);
}

}  // namespace moegemm::api
