// The primitive ops (torch.ops.moegemm.make_plan, quantize_act, ..., bias_grad): one kernel each, for
// tests and benchmarks; the layers call the entries of grouped_linear.cpp and grouped_mlp.cpp instead.
// Each op checks its own arguments and raises (RuntimeError) before any launch: a plan is trusted to come
// from make_plan for the same T (its contents live on the device). Inputs whose data pointer is not
// 16-byte aligned are copied to an aligned buffer first, and an accumulation target goes through an
// aligned temporary.
#include "api/primitives.h"

#include <c10/core/DeviceGuard.h>

#include "api/launch.h"
#include "api/layer_inputs.h"

namespace moegemm::api {

namespace {

Quad as_tuple(Quantized&& q) {
  return {std::move(q.q), std::move(q.s), std::move(q.qT), std::move(q.sT)};
}

// A weight [E, N, K] checked for quantize_weight (named `name` in errors, on like's device), 16-byte aligned.
WeightIn weight_input(const Tensor& w_in, const char* name, const Tensor& like) {
  check_placement(w_in, name, 3, like);
  const DType dtype = to_dtype(w_in, name);
  const Tensor w = aligned(w_in);
  check_weight_shape(w, name);
  return {w, dtype};
}

// da [T, F] and h [T, F1] of one activation; returns F.
int64_t check_act_grad_shapes(const Tensor& da, const Tensor& h, Activation act) {
  const int64_t F = act_width(h, act);
  TORCH_CHECK(h.size(0) == da.size(0) && da.size(1) == F, "moegemm: da ", shape(da), " and h ", shape(h), " disagree");
  return F;
}

void check_wgrad_shape(const Tensor& out, int E, int64_t N, int64_t K) {
  TORCH_CHECK(out.size(0) == E && out.size(1) == N && out.size(2) == K, "moegemm: out must be [", num(E), ", ", num(N), ", ",
              num(K), "], got ", shape(out));
}

// kernel and tiling of a raw GEMM op, checked against the sm90 kernel's table of `tilings` tilings.
GemmChoice gemm_choice(int64_t kernel, int64_t tiling, int tilings) {
  TORCH_CHECK(kernel >= 0 && kernel <= 2, "moegemm: kernel must be 0 (default), 1 (CUTLASS) or 2 (sm90), got ", num(kernel));
  TORCH_CHECK(tiling == -1 || kernel == static_cast<int64_t>(GemmKernel::kSm90),
              "moegemm: tiling selects one of the sm90 kernel's tilings: pass it with kernel=2, got kernel=", num(kernel));
  TORCH_CHECK(tiling >= -1 && tiling < tilings, "moegemm: tiling must be -1 (the heuristic's) or an index of the sm90 tilings [0, ",
              num(tilings), "), got ", num(tiling));
  return {static_cast<GemmKernel>(kernel), static_cast<int>(tiling)};
}

void gemm_fp8_ragged_reduction_into(const Tensor& qaT_in, const Tensor& saT_in, const Tensor& qbT_in, const Tensor& sbT_in,
                            const Tensor& plan, const Tensor& out, bool accumulate, int64_t kernel, int64_t tiling) {
  const GemmChoice choice = gemm_choice(kernel, tiling, num_ragged_reduction_tilings());
  const Tensor qaT = input(qaT_in, "qaT", at::kFloat8_e4m3fn, 2, qaT_in);
  const Tensor qbT = input(qbT_in, "qbT", at::kFloat8_e4m3fn, 2, qaT);
  const Tensor saT = input(saT_in, "saT", at::kFloat, 2, qaT);
  const Tensor sbT = input(sbT_in, "sbT", at::kFloat, 2, qaT);
  check(plan, "plan", at::kInt, 2, qaT);
  check_wgrad_out(out, qaT, accumulate);
  const int E = num_experts(plan);
  const int64_t N = qaT.size(0), K = qbT.size(0), Wc = qaT.size(1);
  TORCH_CHECK(qbT.size(1) == Wc && saT.size(0) == sbT.size(0) && saT.size(1) == N && sbT.size(1) == K,
              "moegemm: column-quantized operands disagree: ", shape(qaT), shape(saT), shape(qbT), shape(sbT));
  TORCH_CHECK(Wc % kColAlign == 0, "moegemm: qaT.shape[1] (the column copy's capacity) must be a multiple of ", num(kColAlign),
              ", got ", num(Wc));
  check_dim_aligned(N, "qaT.shape[0] (N)");
  check_dim_aligned(K, "qbT.shape[0] (K)");
  check_wgrad_shape(out, E, N, K);
  c10::DeviceGuard guard(qaT.device());
  run_gemm_fp8_ragged_reduction(qaT, saT, qbT, sbT, plan, out, accumulate, choice);
}

// bf16 recipe: a [T, A] with w [E, N, K]; fprop has A = K, dgrad has A = N.
Tensor gemm_bf16_ragged_rows(const Tensor& a_in, const Tensor& w_in, const Tensor& plan, bool dgrad) {
  const Tensor a = input(a_in, dgrad ? "dy" : "x", at::kBFloat16, 2, a_in);
  const Tensor w = input(w_in, "weight", at::kBFloat16, 3, a);
  check(plan, "plan", at::kInt, 2, a);
  const int E = num_experts(plan);
  const int64_t N = w.size(1), K = w.size(2);
  TORCH_CHECK(w.size(0) == E && a.size(1) == (dgrad ? N : K), "moegemm: operand shapes disagree: ", shape(a), shape(w));
  check_dim_aligned(N, "weight.shape[1] (N)");
  check_dim_aligned(K, "weight.shape[2] (K)");
  c10::DeviceGuard guard(a.device());
  return run_gemm_bf16_ragged_rows(a, w, plan, dgrad);
}

void gemm_bf16_wgrad_into(const Tensor& dy_in, const Tensor& x_in, const Tensor& plan, const Tensor& out, bool accumulate) {
  const Tensor dy = input(dy_in, "dy", at::kBFloat16, 2, dy_in);
  const Tensor x = input(x_in, "x", at::kBFloat16, 2, dy);
  check(plan, "plan", at::kInt, 2, dy);
  check_wgrad_out(out, dy, accumulate);
  const int E = num_experts(plan);
  const int64_t T = dy.size(0), N = dy.size(1), K = x.size(1);
  TORCH_CHECK(x.size(0) == T, "moegemm: dy and x have different token counts: ", shape(dy), shape(x));
  check_dim_aligned(N, "dy.shape[1] (N)");
  check_dim_aligned(K, "x.shape[1] (K)");
  check_wgrad_shape(out, E, N, K);
  c10::DeviceGuard guard(dy.device());
  run_gemm_bf16_wgrad(dy, x, plan, out, accumulate);
}

Tensor new_wgrad_for(const Tensor& plan, int64_t N, int64_t K, at::ScalarType dtype, const Tensor& like) {
  return new_wgrad(plan.size(1) - 1, N, K, dtype, like);
}

}  // namespace

Tensor make_plan_op(const Tensor& m_splits, int64_t T) {
  check_splits(m_splits, m_splits);
  check_num_experts(m_splits.numel(), "len(m_splits) (the number of experts)");
  const int E = static_cast<int>(m_splits.numel());
  check_plan_tokens(T, E);
  c10::DeviceGuard guard(m_splits.device());
  return run_make_plan(m_splits, T);
}

Quad quantize_act_op(const Tensor& x_in, const Tensor& plan, bool rows, bool cols) {
  check_placement(x_in, "x", 2, x_in);
  const DType dtype = to_dtype(x_in, "x");
  const Tensor x = aligned(x_in);
  check(plan, "plan", at::kInt, 2, x);
  num_experts(plan);
  check_dim_aligned(x.size(1), "x.shape[1]");
  c10::DeviceGuard guard(x.device());
  return as_tuple(run_quantize_act(x, dtype, plan, rows, cols));
}

std::tuple<Tensor, Tensor> requantize_cols_op(const Tensor& x, const Tensor& x_scales, const Tensor& plan) {
  const Quantized rows = fp8_x_input(x, x_scales, Recipe::kFp8Blockwise);
  check(plan, "plan", at::kInt, 2, rows.q);
  num_experts(plan);
  c10::DeviceGuard guard(rows.q.device());
  Quantized cols = run_requantize_cols(rows.q, rows.s, plan);
  return {std::move(cols.qT), std::move(cols.sT)};
}

Quad act_quantize_op(const Tensor& h_in, const std::optional<Tensor>& probs_in,
                                                           int64_t activation, const Tensor& plan, bool rows, bool cols) {
  const Tensor h = input(h_in, "h", at::kBFloat16, 2, h_in);
  check(plan, "plan", at::kInt, 2, h);
  const Activation act = to_activation(activation);
  num_experts(plan);
  act_width(h, act);
  const Tensor probs = probs_input(probs_in, h.size(0), h);
  c10::DeviceGuard guard(h.device());
  return as_tuple(run_act_quantize(h, probs, act, plan, rows, cols));
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> act_backward_quantize_op(
    const Tensor& da_in, const Tensor& h_in, const std::optional<Tensor>& probs_in, int64_t activation, const Tensor& plan,
    bool rows, bool cols) {
  const Tensor da = input(da_in, "da", at::kBFloat16, 2, da_in);
  const Tensor h = input(h_in, "h", at::kBFloat16, 2, da);
  check(plan, "plan", at::kInt, 2, da);
  const Activation act = to_activation(activation);
  num_experts(plan);
  check_act_grad_shapes(da, h, act);
  const Tensor probs = probs_input(probs_in, da.size(0), da);
  c10::DeviceGuard guard(da.device());
  Tensor partial;
  Quantized dh = run_act_backward_quantize(da, h, probs, act, plan, rows, cols, partial);
  return {dh.q, dh.s, dh.qT, dh.sT, partial};
}

Tensor act_bf16_op(const Tensor& h_in, const std::optional<Tensor>& probs_in, int64_t activation) {
  const Tensor h = input(h_in, "h", at::kBFloat16, 2, h_in);
  const Activation act = to_activation(activation);
  act_width(h, act);
  const Tensor probs = probs_input(probs_in, h.size(0), h);
  c10::DeviceGuard guard(h.device());
  return run_act_bf16(h, probs, act);
}

std::tuple<Tensor, Tensor> act_backward_bf16_op(const Tensor& da_in, const Tensor& h_in, const std::optional<Tensor>& probs_in,
                                                int64_t activation) {
  const Tensor da = input(da_in, "da", at::kBFloat16, 2, da_in);
  const Tensor h = input(h_in, "h", at::kBFloat16, 2, da);
  const Activation act = to_activation(activation);
  check_act_grad_shapes(da, h, act);
  const Tensor probs = probs_input(probs_in, da.size(0), da);
  c10::DeviceGuard guard(da.device());
  Tensor partial;
  Tensor dh = run_act_backward_bf16(da, h, probs, act, partial);
  return {dh, partial};
}

Quad quantize_weight_op(const Tensor& w_in) {
  const WeightIn w = weight_input(w_in, "weight", w_in);
  c10::DeviceGuard guard(w.w.device());
  return as_tuple(run_quantize_weight(w.w, w.dtype, true));
}

std::vector<Tensor> quantize_weights_op(at::TensorList ws) {
  TORCH_CHECK(!ws.empty(), "moegemm: quantize_weights: weights is empty");
  std::vector<WeightIn> in;
  for (size_t i = 0; i < ws.size(); ++i)
    in.push_back(weight_input(ws[i], ("weights[" + std::to_string(i) + "]").c_str(), ws[0]));
  c10::DeviceGuard guard(ws[0].device());
  std::vector<Tensor> out;
  for (size_t i = 0; i < in.size(); i += 2) {  // a layer's weights (one or two) per launch
    const std::vector<Quantized> q = i + 1 < in.size() ? run_quantize_weights({in[i], in[i + 1]}, true, {})
                                                       : run_quantize_weights({in[i]}, true, {});
    for (const Quantized& w : q) out.insert(out.end(), {w.q, w.s, w.qT, w.sT});
  }
  return out;
}

void quantize_weights_into_op(at::TensorList parts, at::IntArrayRef counts, at::TensorList out) {
  const std::string listed = nums(counts);
  TORCH_CHECK(!parts.empty(), "moegemm: quantize_weights_into: parts is empty");
  TORCH_CHECK(out.size() == 4 * counts.size(), "moegemm: quantize_weights_into: out must hold four tensors (q, s, qT, sT) "
              "per weight, ", num(4 * counts.size()), " for counts ", listed, ", got ", num(out.size()));
  int64_t total = 0;
  for (const int64_t c : counts) {
    TORCH_CHECK(c >= 1, "moegemm: quantize_weights_into: counts must be positive, got ", listed);
    total += c;
  }
  TORCH_CHECK(total == static_cast<int64_t>(parts.size()), "moegemm: quantize_weights_into: counts ", listed,
              " must add up to the number of parts, ", num(parts.size()));
  c10::DeviceGuard guard(parts[0].device());
  std::vector<WeightPart> jobs;
  size_t p = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    const size_t first = p;
    int64_t rows = 0;
    for (int64_t j = 0; j < counts[i]; ++j, ++p) {
      const std::string name = "parts[" + std::to_string(p) + "]";
      const WeightIn in = weight_input(parts[p], name.c_str(), parts[0]);
      const Tensor w0 = p == first ? in.w : jobs[first].in.w;
      TORCH_CHECK(in.w.size(0) == w0.size(0) && in.w.size(2) == w0.size(2) && in.w.scalar_type() == w0.scalar_type(),
                  "moegemm: quantize_weights_into: ", name, " ", shape(in.w), " ", in.w.scalar_type(), " must match the first "
                  "part of its weight in experts, K and dtype: ", shape(w0), " ", w0.scalar_type());
      TORCH_CHECK(j + 1 == counts[i] || in.w.size(1) % kBlock == 0, "moegemm: quantize_weights_into: ", name, " has ",
                  num(in.w.size(1)), " rows: every part but a weight's last must have a multiple of ", num(kBlock));
      jobs.push_back({in, 0, rows, {}});
      rows += in.w.size(1);
    }
    const int64_t E = jobs[first].in.w.size(0), K = jobs[first].in.w.size(2);
    const int64_t Rb = ceil_div(rows, kBlock), Kb = ceil_div(K, kBlock);
    const int64_t want[4][3] = {{E, rows, K}, {E, Rb, Kb}, {E, K, rows}, {E, Kb, Rb}};  // q, s, qT, sT
    for (int c = 0; c < 4; ++c) {
      const Tensor& t = out[4 * i + c];
      const std::string name = "out[" + std::to_string(4 * i + c) + "]";
      check(t, name.c_str(), c % 2 == 0 ? at::kFloat8_e4m3fn : at::kFloat, 3, parts[0]);
      const bool fits = t.size(0) == want[c][0] && t.size(1) == want[c][1] && t.size(2) == want[c][2];
      TORCH_CHECK(fits, "moegemm: quantize_weights_into: ", name, " must have shape [", num(want[c][0]), ", ",
                  num(want[c][1]), ", ", num(want[c][2]), "] for a weight of ", num(rows), " rows, got ", shape(t));
      TORCH_CHECK(is_aligned(t), "moegemm: quantize_weights_into: ", name, " must be 16-byte aligned");
    }
    const Quantized copies{out[4 * i], out[4 * i + 1], out[4 * i + 2], out[4 * i + 3]};
    for (size_t j = first; j < p; ++j) {
      jobs[j].rows = rows;
      jobs[j].out = copies;
    }
  }
  run_quantize_weight_parts(jobs);
}

Tensor gemm_fp8_ragged_rows_op(const Tensor& qa_in, const Tensor& sa_in, const Tensor& qb_in, const Tensor& sb_in,
                            const Tensor& plan, int64_t tiling) {
  TORCH_CHECK(tiling >= -1 && tiling < num_ragged_rows_tilings(), "moegemm: tiling must be -1 (the heuristic's) or an index of "
              "the sm90 tilings [0, ", num(num_ragged_rows_tilings()), "), got ", num(tiling));
  const Tensor qa = input(qa_in, "qa", at::kFloat8_e4m3fn, 2, qa_in);
  const Tensor qb = input(qb_in, "qb", at::kFloat8_e4m3fn, 3, qa);
  const Tensor sb = input(sb_in, "sb", at::kFloat, 3, qa);
  check(plan, "plan", at::kInt, 2, qa);
  const int E = num_experts(plan);
  const int64_t T = qa.size(0), K = qa.size(1), N = qb.size(1);
  TORCH_CHECK(qb.size(0) == E && qb.size(2) == K, "moegemm: qb must be [", num(E), ", N, ", num(K), "], got ", shape(qb));
  check_dim_aligned(K, "qa.shape[1] (K)");
  check_dim_aligned(N, "qb.shape[1] (N)");
  const Tensor sa = row_scales_input(sa_in, "sa", T, ceil_div(K, kBlock), qa);
  TORCH_CHECK(sb.size(0) == E && sb.size(1) == ceil_div(N, kBlock) && sb.size(2) == ceil_div(K, kBlock), "moegemm: sb has shape ",
              shape(sb));
  c10::DeviceGuard guard(qa.device());
  return run_gemm_fp8_ragged_rows(qa, sa, qb, sb, plan, static_cast<int>(tiling));
}

Tensor gemm_fp8_ragged_reduction_op(const Tensor& qaT, const Tensor& saT, const Tensor& qbT, const Tensor& sbT, const Tensor& plan,
                            at::ScalarType out_dtype, int64_t kernel, int64_t tiling) {
  Tensor out = new_wgrad_for(plan, qaT.size(0), qbT.size(0), out_dtype, qaT);
  gemm_fp8_ragged_reduction_into(qaT, saT, qbT, sbT, plan, out, false, kernel, tiling);
  return out;
}

void gemm_fp8_ragged_reduction_accumulate_op(const Tensor& qaT, const Tensor& saT, const Tensor& qbT, const Tensor& sbT,
                                     const Tensor& plan, const Tensor& out, int64_t kernel, int64_t tiling) {
  gemm_fp8_ragged_reduction_into(qaT, saT, qbT, sbT, plan, out, true, kernel, tiling);
}

Tensor gemm_bf16_fprop_op(const Tensor& x, const Tensor& w, const Tensor& plan) { return gemm_bf16_ragged_rows(x, w, plan, false); }
Tensor gemm_bf16_dgrad_op(const Tensor& dy, const Tensor& w, const Tensor& plan) { return gemm_bf16_ragged_rows(dy, w, plan, true); }

Tensor gemm_bf16_wgrad_op(const Tensor& dy, const Tensor& x, const Tensor& plan, at::ScalarType out_dtype) {
  Tensor out = new_wgrad_for(plan, dy.size(1), x.size(1), out_dtype, dy);
  gemm_bf16_wgrad_into(dy, x, plan, out, false);
  return out;
}

void gemm_bf16_wgrad_accumulate_op(const Tensor& dy, const Tensor& x, const Tensor& plan, const Tensor& out) {
  gemm_bf16_wgrad_into(dy, x, plan, out, true);
}

void add_bias_op(const Tensor& y, const Tensor& bias_in, const Tensor& plan) {
  check(plan, "plan", at::kInt, 2, y);
  const int E = num_experts(plan);
  check(y, "y", at::kBFloat16, 2, y);
  TORCH_CHECK(bias_in.scalar_type() == at::kFloat || bias_in.scalar_type() == at::kBFloat16,
              "moegemm: bias must be float32 or bfloat16, got ", c10::toString(bias_in.scalar_type()));
  const Tensor bias = input(bias_in, "bias", bias_in.scalar_type(), 2, y);
  const int64_t N = y.size(1);
  TORCH_CHECK(bias.size(0) == E && bias.size(1) == N, "moegemm: bias must be [", num(E), ", ", num(N), "], got ", shape(bias));
  check_dim_aligned(N, "y.shape[1] (N)");
  c10::DeviceGuard guard(y.device());
  run_add_bias(y, bias, plan);
}

Tensor bias_grad_op(const Tensor& dy_in, const Tensor& plan) {
  const Tensor dy = input(dy_in, "dy", at::kBFloat16, 2, dy_in);
  check(plan, "plan", at::kInt, 2, dy);
  num_experts(plan);
  check_dim_aligned(dy.size(1), "dy.shape[1] (N)");
  c10::DeviceGuard guard(dy.device());
  return run_bias_grad(dy, plan);
}

}  // namespace moegemm::api
