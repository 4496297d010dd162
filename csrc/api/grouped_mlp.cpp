// The expert MLP y = fc2(act(fc1(x)) * probs): one entry per direction.
//
// With fp8_blockwise the activation is fused with the FP8 quantization of its result (fc2's input and its
// per-expert transposed copy for wgrad), and its backward with quantizing the gradient, so no bf16 copy
// of the activation is written or saved. Saved for backward (only when `save`; the slots are named in
// moegemm/backends/contract.py; [0] placeholders where a part is not needed):
//   fp8_blockwise: qx, sx, h, qaT, saT, qw1T, sw1T, qw2T, sw2T — x's FP8 row copy (fc1's operand; fc1 wgrad's
//                  column copy is made from it in backward), the weights' transposed copies only when quantized
//                  here (pre-quantized weights come back through fp8_weights);
//   bf16:          h, a, w1_bf16, w2_bf16 — the bf16 copies only of fp32 weights.
// The backward entry drops each after its last use, and with release_saved (eager autograd hands the
// list over) frees its memory right there: peak memory, as the order below is laid out for.
// An FP8 x (x_scales given, fp8_blockwise only) is its row copy: fc1 reads it as it is, and the backward takes it
// back as x and x_scales (an op's outputs never alias its inputs, so it is not in saved).
// With defer_wgrad the backward computes dx, the bias and probs gradients only; the weight gradients are
// left to mlp_wgrad over wgrad_operands fp8 (qdyT, sdyT, qaT, saT, qdhT, sdhT, qxT, sxT) or bf16 (dy, a,
// dh, x). Of these, backward returns the ones it made (the made slots: fp8 qdyT, sdyT, qdhT, sdhT, qxT, sxT,
// bf16 dh; [0] where not needed); the caller keeps the saved ones, which this entry then never frees.
#include <c10/core/DeviceGuard.h>

#include <array>

#include "api/layer_contract.h"
#include "api/layer_inputs.h"
#include "api/layers.h"

namespace moegemm::api {

namespace {

namespace fp8 = contract::mlp::saved_fp8;
namespace bf16 = contract::mlp::saved_bf16;
namespace made_fp8 = contract::mlp::made_fp8;
namespace made_bf16 = contract::mlp::made_bf16;
namespace fp8_weights_of = contract::mlp::fp8_weights;
constexpr size_t kFp8Weights = fp8_weights_of::kCount;

// The shapes every MLP entry agrees on: x [T, H], fc1 [E, F1, H], fc2 [E, H, F] with F1 = 2F for GLU.
struct MlpShape {
  int64_t E, T, H, F, F1;
};

MlpShape check_mlp_weights(const Tensor& fc1_weight, const Tensor& fc2_weight, Activation act, int64_t T, const Tensor& like) {
  check_weight(fc1_weight, "fc1_weight", like);
  check_weight(fc2_weight, "fc2_weight", like);
  const int64_t E = fc1_weight.size(0), F1 = fc1_weight.size(1), H = fc1_weight.size(2);
  const int64_t F = is_glu(act) ? F1 / 2 : F1;
  TORCH_CHECK(!is_glu(act) || (F1 % 2 == 0 && F % kDimAlign == 0), "moegemm: fc1_weight.shape[1] must be 2*ffn with ffn a ",
              "multiple of ", num(kDimAlign), " for a GLU activation, got ", num(F1));
  TORCH_CHECK(fc2_weight.size(0) == E && fc2_weight.size(1) == H && fc2_weight.size(2) == F, "moegemm: fc2_weight must be [",
              num(E), ", ", num(H), ", ", num(F), "] to match fc1_weight ", shape(fc1_weight), ", got ", shape(fc2_weight));
  return {E, T, H, F, F1};
}

// The weights' FP8 copies for this call: pre-quantized (fp8_weights, 8 tensors) or quantized here.
bool pre_quantized(const c10::List<std::optional<Tensor>>& fp8_weights) {
  TORCH_CHECK(fp8_weights.size() == 0 || fp8_weights.size() == kFp8Weights, "moegemm: fp8_weights must hold 0 or ",
              num(kFp8Weights), " tensors (quantize_weight of fc1_weight, then of fc2_weight), got ", num(fp8_weights.size()));
  return fp8_weights.size() == kFp8Weights;
}

// Pre-quantized weights given by the caller (fp8_weights), checked; `transposed`: with the Wᵀ copies.
Quantized fc1_given(const c10::List<std::optional<Tensor>>& fp8_weights, const MlpShape& s, bool transposed, const Tensor& like) {
  return fp8_weight_input(fp8_weights, fp8_weights_of::kFc1Weight, kFc1Fp8Names, s.E, s.F1, s.H, transposed, like);
}

Quantized fc2_given(const c10::List<std::optional<Tensor>>& fp8_weights, const MlpShape& s, bool transposed, const Tensor& like) {
  return fp8_weight_input(fp8_weights, fp8_weights_of::kFc2Weight, kFc2Fp8Names, s.E, s.H, s.F, transposed, like);
}

Tensor dprobs_of(const Tensor& partial, bool wanted) { return wanted ? run_sum_rows(partial) : Tensor(); }

}  // namespace

std::tuple<Tensor, Tensor, std::vector<Tensor>> mlp_fwd(
    const Tensor& x_in, const Tensor& fc1_weight, const Tensor& fc2_weight, const Tensor& m_splits,
    const std::optional<Tensor>& fc1_bias, const std::optional<Tensor>& fc2_bias, const std::optional<Tensor>& probs_in,
    int64_t activation, int64_t recipe_id, const c10::List<std::optional<Tensor>>& fp8_weights, bool save, bool need_dw1,
    bool need_dw2, const std::optional<Tensor>& x_scales) {
  const Recipe recipe = to_recipe(recipe_id);
  const Activation act = to_activation(activation);
  const bool fp8_x = x_scales.has_value();
  const Quantized given_x = fp8_x ? fp8_x_input(x_in, *x_scales, recipe) : Quantized{};
  const Tensor x = fp8_x ? given_x.q : x_input(x_in, "x");
  const MlpShape s = check_mlp_weights(fc1_weight, fc2_weight, act, x.size(0), x);
  TORCH_CHECK(x.size(1) == s.H, "moegemm: x.shape[1] must equal fc1_weight.shape[2] = ", num(s.H), ", got ", num(x.size(1)));
  const Tensor b1 = bias_input(fc1_bias, "fc1_bias", s.E, s.F1, x), b2 = bias_input(fc2_bias, "fc2_bias", s.E, s.H, x);
  const bool given = pre_quantized(fp8_weights);
  TORCH_CHECK(!given || recipe == Recipe::kFp8Blockwise, "moegemm: fp8_weights need the fp8_blockwise recipe");
  c10::DeviceGuard guard(x.device());
  const Tensor probs = probs_fp32(probs_in, s.T, x);
  const Tensor splits = splits_input(m_splits, s.E, s.T, x);
  // fp8: the plan is built inside the first quantizer's launch (the weights' when quantized here, both in
  // one launch, each weight's row copy dropped after its GEMM; else x's); bf16: by its own.
  const bool fp8 = recipe == Recipe::kFp8Blockwise;
  const Tensor plan = fp8 ? empty_plan(s.E, x) : run_make_plan(splits, s.T);
  Tensor plan_from = splits;  // the counts x's quantizer builds the plan from, unless the weights' launch does
  std::vector<Tensor> saved;
  Tensor y;
  if (fp8) {
    Quantized qw1, qw2;
    if (given) {
      qw1 = fc1_given(fp8_weights, s, save, x), qw2 = fc2_given(fp8_weights, s, save, x);
    } else {
      std::vector<Quantized> qw = run_quantize_weights({{weight_input(fc1_weight), to_dtype(fc1_weight, "fc1_weight")},
                                                        {weight_input(fc2_weight), to_dtype(fc2_weight, "fc2_weight")}},
                                                       save, {splits, s.T, plan});
      qw1 = std::move(qw[0]), qw2 = std::move(qw[1]);
      plan_from = Tensor();
    }
    // biases added in the GEMMs' epilogues; a bf16 x quantized (into its row copy, qx) in fc1's launch where that pays
    Quantized qx;
    // fc1's tile counter, zeroed before fc1 (an FP8 x: the stream's), which fc1 leaves zero for fc2
    const GemmWorkspaces ws = fp8_x ? stream_workspaces(x) : gemm_workspaces(false, plan, true);
    Tensor h = run_fprop(x, fp8_x ? &given_x : nullptr, plan, plan_from, qw1.q, qw1.s, b1, qx, ws);
    qw1.q.reset(), qw1.s.reset();
    const bool keep_x = save && need_dw1 && !fp8_x;  // an FP8 x comes back as backward's x and x_scales
    if (!keep_x) qx.q.reset(), qx.s.reset();
    Quantized qa = run_act_quantize(h, probs, act, plan, true, need_dw2);
    y = run_gemm_fp8_ragged_rows(qa.q, qa.s, qw2.q, qw2.s, plan, -1, b2, ws.counter);
    if (save) {
      // a fresh empty tensor per unused slot: outputs of an op may not alias each other
      auto none8 = [&] { return none_like(x, at::kFloat8_e4m3fn); };
      auto none32 = [&] { return none_like(x, at::kFloat); };
      saved.resize(fp8::kCount);
      saved[fp8::kQx] = keep_x ? qx.q : none8(), saved[fp8::kSx] = keep_x ? qx.s : none32();
      saved[fp8::kH] = h;
      saved[fp8::kQaT] = qa.qT, saved[fp8::kSaT] = qa.sT;
      saved[fp8::kQw1T] = given ? none8() : qw1.qT, saved[fp8::kSw1T] = given ? none32() : qw1.sT;
      saved[fp8::kQw2T] = given ? none8() : qw2.qT, saved[fp8::kSw2T] = given ? none32() : qw2.sT;
    }
  } else {
    const Tensor w1 = weight_bf16(fc1_weight);
    Tensor h = run_gemm_bf16_ragged_rows(x, w1, plan, false);
    if (b1.defined()) run_add_bias(h, b1, plan);
    Tensor a = run_act_bf16(h, probs, act);
    const Tensor w2 = weight_bf16(fc2_weight);
    y = run_gemm_bf16_ragged_rows(a, w2, plan, false);
    if (b2.defined()) run_add_bias(y, b2, plan);
    if (save) {
      auto none = [&] { return none_like(x, at::kBFloat16); };  // one fresh empty tensor per unused slot
      saved.resize(bf16::kCount);
      saved[bf16::kH] = h, saved[bf16::kA] = a;
      saved[bf16::kW1Bf16] = fc1_weight.scalar_type() == at::kBFloat16 ? none() : w1;
      saved[bf16::kW2Bf16] = fc2_weight.scalar_type() == at::kBFloat16 ? none() : w2;
    }
  }
  return {y, plan, saved};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> mlp_bwd(
    const Tensor& dy_in, const Tensor& plan, at::TensorList saved_in, const std::optional<Tensor>& x_in,
    const Tensor& fc1_weight, const Tensor& fc2_weight, const std::optional<Tensor>& probs_in,
    const c10::List<std::optional<Tensor>>& fp8_weights, const std::optional<Tensor>& fc1_main_grad,
    const std::optional<Tensor>& fc2_main_grad, int64_t activation, int64_t recipe_id, bool need_dx, bool need_dw1,
    bool need_dw2, bool need_db1, bool need_db2, bool need_dprobs, bool release_saved, bool defer_wgrad,
    const std::optional<Tensor>& x_scales, bool fc1_overwrite_main_grad, bool fc2_overwrite_main_grad) {
  const Recipe recipe = to_recipe(recipe_id);
  const Activation act = to_activation(activation);
  TORCH_CHECK(dy_in.is_cuda(), "moegemm: dy must be a CUDA tensor, got one on ", dy_in.device().str());
  const int64_t T = dy_in.dim() == 2 ? dy_in.size(0) : -1;
  const MlpShape s = check_mlp_weights(fc1_weight, fc2_weight, act, T, dy_in);
  const Tensor dy = grad_input(dy_in, T, s.H, dy_in);
  check_plan(plan, s.E, dy);
  const bool defer = defer_wgrad && (need_dw1 || need_dw2);
  const MainGrad mg1 = need_dw1 && !defer
                           ? main_grad_input(fc1_main_grad, fc1_overwrite_main_grad, "fc1_main_grad", fc1_weight, dy)
                           : MainGrad{};
  const MainGrad mg2 = need_dw2 && !defer
                           ? main_grad_input(fc2_main_grad, fc2_overwrite_main_grad, "fc2_main_grad", fc2_weight, dy)
                           : MainGrad{};
  const bool given = pre_quantized(fp8_weights);
  const bool need_dh = need_dx || need_dw1 || need_db1, need_da = need_dh || need_dprobs;
  c10::DeviceGuard guard(dy.device());
  const Tensor probs = probs_fp32(probs_in, T, dy);
  need_dprobs = need_dprobs && probs.defined();
  std::vector<Tensor> saved(saved_in.begin(), saved_in.end());
  // Drops a tensor after its last use; frees its memory now if it is one of the saved tensors handed over.
  auto drop_saved = [&](size_t slot) { release(saved[slot], release_saved); };
  // defer: the wgrad operands made here (the made slots: fp8 qdyT, sdyT, qdhT, sdhT, qxT, sxT; bf16 dh); kMadeCount
  // slots whatever the mode. Every output not made below becomes a [0] placeholder at the end.
  std::array<Tensor, contract::mlp::kMadeCount> made;
  // A saved tensor that the deferred wgrad needs (the caller keeps it): dropped here, never freed.
  auto keep = [&](size_t slot) { saved[slot].reset(); };
  Tensor dx, dw1, dw2, db1, dprobs;
  if (recipe == Recipe::kFp8Blockwise) {
    TORCH_CHECK(saved.size() == fp8::kCount, "moegemm: saved must hold ", num(fp8::kCount), " tensors, got ", num(saved.size()));
    // x's row copy for fc1 wgrad's column copy (made after dx): checked here, before anything is written
    Quantized x_rows;
    if (need_dw1) x_rows = wgrad_x_rows(saved[fp8::kQx], saved[fp8::kSx], x_in, x_scales, T, s.H, dy);
    if (need_da) check_tensor(saved[fp8::kH], "saved h", at::kBFloat16, {T, s.F1}, dy);
    if (need_dw2) {
      check_tensor(saved[fp8::kQaT], "saved qaT", at::kFloat8_e4m3fn, {s.F, col_capacity(T, s.E)}, dy);
      check_tensor(saved[fp8::kSaT], "saved saT", at::kFloat, {block_capacity(T, s.E), s.F}, dy);
    }
    // Wᵀ copies: saved when quantized in forward, else the pre-quantized ones (never freed here).
    Quantized w1T, w2T;
    if (given) {
      if (need_dx) w1T = fc1_given(fp8_weights, s, true, dy);
      if (need_da) w2T = fc2_given(fp8_weights, s, true, dy);
    } else {
      const int64_t Hb = ceil_div(s.H, kBlock), Fb = ceil_div(s.F, kBlock), F1b = ceil_div(s.F1, kBlock);
      if (need_dx) check_tensor(saved[fp8::kQw1T], "saved qw1T", at::kFloat8_e4m3fn, {s.E, s.H, s.F1}, dy);
      if (need_dx) check_tensor(saved[fp8::kSw1T], "saved sw1T", at::kFloat, {s.E, Hb, F1b}, dy);
      if (need_da) check_tensor(saved[fp8::kQw2T], "saved qw2T", at::kFloat8_e4m3fn, {s.E, s.F, s.H}, dy);
      if (need_da) check_tensor(saved[fp8::kSw2T], "saved sw2T", at::kFloat, {s.E, Fb, Hb}, dy);
      w1T.qT = aligned(saved[fp8::kQw1T]), w1T.sT = aligned(saved[fp8::kSw1T]);
      w2T.qT = aligned(saved[fp8::kQw2T]), w2T.sT = aligned(saved[fp8::kSw2T]);
    }
    auto drop_weight = [&](Tensor& t, size_t slot) {
      t.reset();
      if (!given) drop_saved(slot);
    };
    // fc2 wgrad's workspace and the tile counter of fc2's and then fc1's dgrad, zeroed by dy's quantizer
    GemmWorkspaces ws = gemm_workspaces(need_dw2 && !defer, plan);
    Tensor ws2 = ws.wgrad;
    Quantized qdy = run_quantize_act(dy, DType::kBF16, plan, need_da, need_dw2, {}, ws.words);
    if (need_dw2 && defer) {
      made[made_fp8::kQdyT] = qdy.qT, made[made_fp8::kSdyT] = qdy.sT;
      keep(fp8::kQaT), keep(fp8::kSaT);
    } else if (need_dw2) {
      dw2 = fp8_weight_grad(fc2_weight, mg2, dy, qdy.qT, qdy.sT, aligned(saved[fp8::kQaT]), aligned(saved[fp8::kSaT]),
                            plan, ws2);
    }
    ws2.reset(), qdy.qT.reset(), qdy.sT.reset(), drop_saved(fp8::kQaT), drop_saved(fp8::kSaT);
    if (need_da) {
      Tensor da = run_gemm_fp8_ragged_rows(qdy.q, qdy.s, w2T.qT, w2T.sT, plan, -1, Tensor(), ws.counter);
      qdy.q.reset(), qdy.s.reset(), drop_weight(w2T.qT, fp8::kQw2T), drop_weight(w2T.sT, fp8::kSw2T);
      const Tensor h = aligned(saved[fp8::kH]);
      Tensor partial;
      Quantized qdh = run_act_backward_quantize(da, h, probs, act, plan, need_dx, need_dw1, partial);
      // fc1's bias gradient needs dh itself (in bf16), which the fused kernel only quantizes.
      if (need_db1) {
        Tensor unused_partial;
        db1 = run_bias_grad(run_act_backward_bf16(da, h, probs, act, unused_partial), plan);
      }
      da.reset(), drop_saved(fp8::kH);
      if (need_dx) dx = run_gemm_fp8_ragged_rows(qdh.q, qdh.s, w1T.qT, w1T.sT, plan, -1, Tensor(), ws.counter);
      qdh.q.reset(), qdh.s.reset(), drop_weight(w1T.qT, fp8::kQw1T), drop_weight(w1T.sT, fp8::kSw1T);
      if (need_dw1) {  // x's column copy, made from its row copy
        const Tensor ws1 = fp8_wgrad_workspace(!defer, plan);  // fc1 wgrad's, zeroed by requantize_cols' launch
        const Quantized xT = run_requantize_cols(x_rows.q, x_rows.s, plan, ws1);
        x_rows = {}, drop_saved(fp8::kQx), drop_saved(fp8::kSx);
        if (defer) {
          made[made_fp8::kQdhT] = qdh.qT, made[made_fp8::kSdhT] = qdh.sT;
          made[made_fp8::kQxT] = xT.qT, made[made_fp8::kSxT] = xT.sT;
        } else {
          dw1 = fp8_weight_grad(fc1_weight, mg1, dy, qdh.qT, qdh.sT, xT.qT, xT.sT, plan, ws1);
        }
      }
      dprobs = dprobs_of(partial, need_dprobs);
    }
  } else {
    TORCH_CHECK(saved.size() == bf16::kCount, "moegemm: saved must hold ", num(bf16::kCount), " tensors, got ", num(saved.size()));
    if (need_da) check_tensor(saved[bf16::kH], "saved h", at::kBFloat16, {T, s.F1}, dy);
    if (need_dw2) check_tensor(saved[bf16::kA], "saved a", at::kBFloat16, {T, s.F}, dy);
    if (need_dw2 && defer) {
      keep(bf16::kA);
    } else if (need_dw2) {
      const Tensor a = aligned(saved[bf16::kA]);
      dw2 = weight_grad(fc2_weight, mg2, dy, [&](const Tensor& out, bool accumulate) {
        run_gemm_bf16_wgrad(dy, a, plan, out, accumulate);
      });
    }
    drop_saved(bf16::kA);
    if (need_da) {
      // The bf16 copies of fp32 weights were saved; bf16 weights are read in place.
      auto bf16_weight = [&](const Tensor& w, size_t slot, const char* name) {
        if (w.scalar_type() == at::kBFloat16) return weight_bf16(w);
        check_tensor(saved[slot], name, at::kBFloat16, {w.size(0), w.size(1), w.size(2)}, dy);
        return aligned(saved[slot]);
      };
      Tensor da = run_gemm_bf16_ragged_rows(dy, bf16_weight(fc2_weight, bf16::kW2Bf16, "saved w2_bf16"), plan, true);
      drop_saved(bf16::kW2Bf16);
      Tensor partial;
      Tensor dh = run_act_backward_bf16(da, aligned(saved[bf16::kH]), probs, act, partial);
      da.reset(), drop_saved(bf16::kH);
      if (need_dx) dx = run_gemm_bf16_ragged_rows(dh, bf16_weight(fc1_weight, bf16::kW1Bf16, "saved w1_bf16"), plan, true);
      drop_saved(bf16::kW1Bf16);
      if (need_dw1) {
        TORCH_CHECK(x_in.has_value(), "moegemm: the bf16 recipe's fc1 weight gradient needs x");
        const Tensor x = x_input(*x_in, "x");
        TORCH_CHECK(x.size(0) == T && x.size(1) == s.H, "moegemm: x must be [", num(T), ", ", num(s.H), "], got ", shape(x));
        if (defer) made[made_bf16::kDh] = dh;
        if (!defer) dw1 = weight_grad(fc1_weight, mg1, dy, [&](const Tensor& out, bool accumulate) {
          run_gemm_bf16_wgrad(dh, x, plan, out, accumulate);
        });
      }
      if (need_db1) db1 = run_bias_grad(dh, plan);
      dprobs = dprobs_of(partial, need_dprobs);
    }
  }
  Tensor db2 = need_db2 ? run_bias_grad(dy, plan) : Tensor();
  auto or_placeholder = [&](Tensor& t, at::ScalarType dtype) -> Tensor& {
    if (!t.defined()) t = none_like(dy, dtype);
    return t;
  };
  // the made slots' placeholders: fp8 pairs of e4m3 and fp32; bf16 (and past bf16's one slot) bf16
  const bool fp8_made = recipe == Recipe::kFp8Blockwise;
  auto made_dtype = [&](size_t slot) {
    if (!fp8_made) return at::kBFloat16;
    return slot == made_fp8::kQdyT || slot == made_fp8::kQdhT || slot == made_fp8::kQxT ? at::kFloat8_e4m3fn : at::kFloat;
  };
  for (size_t slot = 0; slot < made.size(); ++slot) or_placeholder(made[slot], made_dtype(slot));
  return {or_placeholder(dx, at::kBFloat16), or_placeholder(dw1, wgrad_dtype(fc1_weight)),
          or_placeholder(dw2, wgrad_dtype(fc2_weight)), or_placeholder(db1, at::kFloat), or_placeholder(db2, at::kFloat),
          or_placeholder(dprobs, at::kFloat), made[0], made[1], made[2], made[3], made[4], made[5]};
}

std::tuple<Tensor, Tensor> mlp_wgrad(const Tensor& plan, at::TensorList operands, const Tensor& fc1_weight,
                                     const Tensor& fc2_weight, const std::optional<Tensor>& fc1_main_grad,
                                     const std::optional<Tensor>& fc2_main_grad, int64_t recipe_id, bool need_dw1,
                                     bool need_dw2, bool fc1_overwrite_main_grad, bool fc2_overwrite_main_grad) {
  const Recipe recipe = to_recipe(recipe_id);
  TORCH_CHECK(plan.is_cuda(), "moegemm: plan must be a CUDA tensor, got one on ", plan.device().str());
  check_weight(fc1_weight, "fc1_weight", plan);
  check_weight(fc2_weight, "fc2_weight", plan);
  const int64_t E = fc1_weight.size(0);
  TORCH_CHECK(fc2_weight.size(0) == E && fc2_weight.size(1) == fc1_weight.size(2), "moegemm: fc2_weight ",
              shape(fc2_weight), " does not match fc1_weight ", shape(fc1_weight));
  check_plan(plan, E, plan);
  // each weight's group of wgrad_operands starts at its gradient operand (fc2: dy's, fc1: dh's)
  namespace ops_fp8 = contract::mlp::wgrad_operands_fp8;
  namespace ops_bf16 = contract::mlp::wgrad_operands_bf16;
  const bool fp8 = recipe == Recipe::kFp8Blockwise;
  const size_t count = fp8 ? ops_fp8::kCount : ops_bf16::kCount;
  const size_t fc2_first = fp8 ? ops_fp8::kQdyT : ops_bf16::kDy, fc1_first = fp8 ? ops_fp8::kQdhT : ops_bf16::kDh;
  TORCH_CHECK(operands.size() == count, "moegemm: wgrad_operands must hold ", num(static_cast<int64_t>(count)),
              " tensors, got ", num(static_cast<int64_t>(operands.size())));
  const MainGrad mg1 =
      need_dw1 ? main_grad_input(fc1_main_grad, fc1_overwrite_main_grad, "fc1_main_grad", fc1_weight, plan) : MainGrad{};
  const MainGrad mg2 =
      need_dw2 ? main_grad_input(fc2_main_grad, fc2_overwrite_main_grad, "fc2_main_grad", fc2_weight, plan) : MainGrad{};
  c10::DeviceGuard guard(plan.device());
  Tensor dw2 = need_dw2 ? deferred_weight_grad(recipe, operands, fc2_first, "wgrad_operands (fc2)", fc2_weight, mg2, plan)
                        : none_like(plan, wgrad_dtype(fc2_weight));
  Tensor dw1 = need_dw1 ? deferred_weight_grad(recipe, operands, fc1_first, "wgrad_operands (fc1)", fc1_weight, mg1, plan)
                        : none_like(plan, wgrad_dtype(fc1_weight));
  return {dw1, dw2};
}

}  // namespace moegemm::api
