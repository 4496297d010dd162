// The one binding file: registers moegemm's ops with the PyTorch dispatcher (TORCH_LIBRARY), so that
// autograd Functions, torch.compile and CUDA graphs see ordinary ops. Each op checks its tensors,
// allocates its outputs with the caching allocator (sizes from T, E, N, K only) and calls the
// torch-free interface of csrc/moegemm.h on the current stream. Input validation for users happens in
// Python (moegemm/_validate.py) before these are reached; the checks here guard the C++ contract: every
// op checks its own arguments and raises (RuntimeError) before any launch. Inputs whose data pointer is
// not 16-byte aligned (views at an element offset) are copied to an aligned buffer first, and an
// accumulation target goes through an aligned temporary: TMA and the 16-byte vector accesses need it.
// A plan is trusted to come from make_plan for the same T (its contents live on the device).
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include <optional>

#include "moegemm.h"

namespace moegemm {
namespace {

using at::Tensor;

// Error messages format numbers with std::to_string and shapes with shape(), never by writing a number
// to an iostream: on the GPU machine that crashed inside this extension (a C++ runtime mismatch with the
// loaded libstdc++), turning every such error into a segfault (tests/test_adversarial_ops.py calls
// every check).
std::string num(int64_t v) { return std::to_string(v); }

std::string shape(const Tensor& t) {
  std::string out = "[";
  for (int64_t i = 0; i < t.dim(); ++i) out += (i ? ", " : "") + std::to_string(t.size(i));
  return out + "]";
}

cudaStream_t current_stream(const Tensor& t) {
  auto stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(t.device());
  return static_cast<cudaStream_t>(stream.native_handle());
}

bool is_aligned(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % kPtrAlign == 0; }

// t itself, or an aligned contiguous copy when its data pointer is not 16-byte aligned.
Tensor aligned(const Tensor& t) { return is_aligned(t) ? t : t.clone(at::MemoryFormat::Contiguous); }

void check_placement(const Tensor& t, const char* name, int64_t dim, const Tensor& like) {
  TORCH_CHECK(t.is_cuda(), "moegemm: ", name, " must be a CUDA tensor, got one on ", t.device().str());
  TORCH_CHECK(t.device() == like.device(), "moegemm: ", name, " is on ", t.device().str(), ", expected ", like.device().str());
  TORCH_CHECK(t.dim() == dim, "moegemm: ", name, " must have ", num(dim), " dims, got shape ", shape(t));
  TORCH_CHECK(t.is_contiguous(), "moegemm: ", name, " must be contiguous");
}

void check(const Tensor& t, const char* name, at::ScalarType dtype, int64_t dim, const Tensor& like) {
  check_placement(t, name, dim, like);
  TORCH_CHECK(t.scalar_type() == dtype, "moegemm: ", name, " must be ", dtype, ", got ", t.scalar_type());
}

// A checked input, 16-byte aligned.
Tensor input(const Tensor& t, const char* name, at::ScalarType dtype, int64_t dim, const Tensor& like) {
  check(t, name, dtype, dim, like);
  return aligned(t);
}

DType to_dtype(const Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kBFloat16: return DType::kBF16;
    case at::kHalf: return DType::kF16;
    case at::kFloat: return DType::kF32;
    default: TORCH_CHECK(false, "moegemm: ", name, " must be bfloat16, float16 or float32, got ", t.scalar_type());
  }
}

int num_experts(const Tensor& plan) {
  TORCH_CHECK(plan.dim() == 2 && plan.size(0) == 3 && plan.size(1) >= 2 && plan.size(1) <= kMaxExperts + 1,
              "moegemm: plan must be [3, E+1] with 1 <= E <= ", num(kMaxExperts), ", got shape ", shape(plan));
  return static_cast<int>(plan.size(1) - 1);
}

void check_multiple_of_16(int64_t v, const char* what) {
  TORCH_CHECK(v > 0 && v % kColAlign == 0, "moegemm: ", what, " must be a positive multiple of 16, got ", num(v));
}

uint8_t* bytes(const Tensor& t) { return t.numel() ? static_cast<uint8_t*>(t.data_ptr()) : nullptr; }
const uint8_t* cbytes(const Tensor& t) { return static_cast<const uint8_t*>(t.data_ptr()); }
Tensor workspace(size_t size, const Tensor& like) { return at::empty({int64_t(size)}, like.options().dtype(at::kByte)); }

// Outputs of a multi-cast quantization of [T, K] values; the parts not asked for are empty.
std::tuple<Tensor, Tensor, Tensor, Tensor> multicast_outputs(const Tensor& like, int64_t T, int64_t K, int E, bool rows,
                                                             bool cols) {
  auto f8 = like.options().dtype(at::kFloat8_e4m3fn);
  auto f32 = like.options().dtype(at::kFloat);
  return {rows ? at::empty({T, K}, f8) : at::empty({0}, f8), rows ? at::empty({T, ceil_div(K, kBlock)}, f32) : at::empty({0}, f32),
          cols ? at::empty({K, col_capacity(T, E)}, f8) : at::empty({0}, f8), cols ? at::empty({block_capacity(T, E), K}, f32) : at::empty({0}, f32)};
}

// ------------------------------------------------------------------------------------------------ ops
Tensor make_plan_op(const Tensor& m_splits, int64_t T) {
  check_placement(m_splits, "m_splits", 1, m_splits);
  TORCH_CHECK(m_splits.scalar_type() == at::kInt || m_splits.scalar_type() == at::kLong,
              "moegemm: m_splits must be int32 or int64, got ", m_splits.scalar_type());
  TORCH_CHECK(m_splits.numel() >= 1 && m_splits.numel() <= kMaxExperts, "moegemm: len(m_splits) (the number of experts) must be in [1, ",
              num(kMaxExperts), "], got ", num(m_splits.numel()));
  const int E = static_cast<int>(m_splits.numel());
  TORCH_CHECK(T >= 0 && col_capacity(T, E) <= kMaxPlanValue, "moegemm: T must be in [0, ", num(kMaxPlanValue - 15 * E),
              "] for ", num(E), " experts (int32 plan), got ", num(T));
  c10::DeviceGuard guard(m_splits.device());
  Tensor plan = at::empty({3, E + 1}, m_splits.options().dtype(at::kInt));
  make_plan(m_splits.data_ptr(), m_splits.scalar_type() == at::kLong, E, T, plan.data_ptr<int32_t>(), current_stream(m_splits));
  return plan;
}

std::tuple<Tensor, Tensor, Tensor, Tensor> quantize_act_op(const Tensor& x_in, const Tensor& plan, bool rows, bool cols) {
  check_placement(x_in, "x", 2, x_in);
  const DType dtype = to_dtype(x_in, "x");
  const Tensor x = aligned(x_in);
  check(plan, "plan", at::kInt, 2, x);
  const int E = num_experts(plan);
  const int64_t T = x.size(0), K = x.size(1);
  check_multiple_of_16(K, "x.shape[1]");
  c10::DeviceGuard guard(x.device());
  auto [q, s, qT, sT] = multicast_outputs(x, T, K, E, rows, cols);
  quantize_act(x.data_ptr(), dtype, T, K, E, plan.data_ptr<int32_t>(), rows ? bytes(q) : nullptr,
               rows ? s.data_ptr<float>() : nullptr, cols ? bytes(qT) : nullptr, cols ? sT.data_ptr<float>() : nullptr,
               current_stream(x));
  return {q, s, qT, sT};
}

Activation to_activation(int64_t activation) {
  TORCH_CHECK(activation >= 0 && activation <= static_cast<int64_t>(Activation::kSquaredRelu), "moegemm: unknown activation ", num(activation));
  return static_cast<Activation>(activation);
}

// probs [T] fp32, aligned; an undefined tensor when absent.
Tensor probs_input(const std::optional<Tensor>& probs, int64_t T, const Tensor& like) {
  if (!probs.has_value()) return Tensor();
  TORCH_CHECK(probs->dim() == 1 && probs->size(0) == T, "moegemm: probs must have shape [", num(T), "], got ", shape(*probs));
  return input(*probs, "probs", at::kFloat, 1, like);
}

const float* probs_ptr(const Tensor& probs) { return probs.defined() ? probs.data_ptr<float>() : nullptr; }

// F of an activation over h [T, F1]: F1 = 2F for GLU activations.
int64_t act_width(const Tensor& h, Activation act) {
  const int64_t F1 = h.size(1), F = is_glu(act) ? F1 / 2 : F1;
  TORCH_CHECK(!is_glu(act) || F1 % 2 == 0, "moegemm: h.shape[1] must be even (gate and up halves), got ", num(F1));
  check_multiple_of_16(F, "the activation's width (h.shape[1], halved for GLU)");
  return F;
}

// a = act(h) * probs, quantized like quantize_act; h is [T, 2F] for GLU activations, else [T, F].
std::tuple<Tensor, Tensor, Tensor, Tensor> act_quantize_op(const Tensor& h_in, const std::optional<Tensor>& probs_in,
                                                           int64_t activation, const Tensor& plan, bool rows, bool cols) {
  const Tensor h = input(h_in, "h", at::kBFloat16, 2, h_in);
  check(plan, "plan", at::kInt, 2, h);
  const Activation act = to_activation(activation);
  const int E = num_experts(plan);
  const int64_t T = h.size(0), F = act_width(h, act);
  const Tensor probs = probs_input(probs_in, T, h);
  c10::DeviceGuard guard(h.device());
  auto [q, s, qT, sT] = multicast_outputs(h, T, F, E, rows, cols);
  act_quantize(h.data_ptr(), probs_ptr(probs), act, T, F, E, plan.data_ptr<int32_t>(), rows ? bytes(q) : nullptr,
               rows ? s.data_ptr<float>() : nullptr, cols ? bytes(qT) : nullptr, cols ? sT.data_ptr<float>() : nullptr,
               current_stream(h));
  return {q, s, qT, sT};
}

// dh from da [T, F] and h, quantized like quantize_act; plus per-row partial sums for dprobs.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> act_backward_quantize_op(
    const Tensor& da_in, const Tensor& h_in, const std::optional<Tensor>& probs_in, int64_t activation, const Tensor& plan,
    bool rows, bool cols) {
  const Tensor da = input(da_in, "da", at::kBFloat16, 2, da_in);
  const Tensor h = input(h_in, "h", at::kBFloat16, 2, da);
  check(plan, "plan", at::kInt, 2, da);
  const Activation act = to_activation(activation);
  const int E = num_experts(plan);
  const int64_t T = da.size(0), F = act_width(h, act), F1 = h.size(1);
  TORCH_CHECK(h.size(0) == T && da.size(1) == F, "moegemm: da ", shape(da), " and h ", shape(h), " disagree");
  const Tensor probs = probs_input(probs_in, T, da);
  const float* p = probs_ptr(probs);
  c10::DeviceGuard guard(da.device());
  auto [q, s, qT, sT] = multicast_outputs(da, T, F1, E, rows, cols);
  Tensor partial = at::empty({p != nullptr ? T : 0, ceil_div(F1, kBlock)}, da.options().dtype(at::kFloat));
  act_backward_quantize(da.data_ptr(), h.data_ptr(), p, act, T, F, E, plan.data_ptr<int32_t>(), rows ? bytes(q) : nullptr,
                        rows ? s.data_ptr<float>() : nullptr, cols ? bytes(qT) : nullptr,
                        cols ? sT.data_ptr<float>() : nullptr, p != nullptr ? partial.data_ptr<float>() : nullptr,
                        current_stream(da));
  return {q, s, qT, sT, partial};
}

// bf16 recipe: a = act(h) * probs in bf16; h is [T, 2F] for GLU activations, else [T, F].
Tensor act_bf16_op(const Tensor& h_in, const std::optional<Tensor>& probs_in, int64_t activation) {
  const Tensor h = input(h_in, "h", at::kBFloat16, 2, h_in);
  const Activation act = to_activation(activation);
  const int64_t T = h.size(0), F = act_width(h, act);
  const Tensor probs = probs_input(probs_in, T, h);
  c10::DeviceGuard guard(h.device());
  Tensor a = at::empty({T, F}, h.options());
  act_bf16(h.data_ptr(), probs_ptr(probs), act, T, F, a.data_ptr(), current_stream(h));
  return a;
}

// bf16 recipe: dh (bf16, like h) from da [T, F] and h; plus per-row partial sums for dprobs.
std::tuple<Tensor, Tensor> act_backward_bf16_op(const Tensor& da_in, const Tensor& h_in, const std::optional<Tensor>& probs_in,
                                                int64_t activation) {
  const Tensor da = input(da_in, "da", at::kBFloat16, 2, da_in);
  const Tensor h = input(h_in, "h", at::kBFloat16, 2, da);
  const Activation act = to_activation(activation);
  const int64_t T = da.size(0), F = act_width(h, act), F1 = h.size(1);
  TORCH_CHECK(h.size(0) == T && da.size(1) == F, "moegemm: da ", shape(da), " and h ", shape(h), " disagree");
  const Tensor probs = probs_input(probs_in, T, da);
  const float* p = probs_ptr(probs);
  c10::DeviceGuard guard(da.device());
  Tensor dh = at::empty({T, F1}, h.options());
  Tensor partial = at::empty({p != nullptr ? T : 0, ceil_div(F, kActBf16Cols)}, da.options().dtype(at::kFloat));
  act_backward_bf16(da.data_ptr(), h.data_ptr(), p, act, T, F, dh.data_ptr(), p != nullptr ? partial.data_ptr<float>() : nullptr,
                    current_stream(da));
  return {dh, partial};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> quantize_weight_op(const Tensor& w_in) {
  check_placement(w_in, "weight", 3, w_in);
  const DType dtype = to_dtype(w_in, "weight");
  const Tensor w = aligned(w_in);
  const int64_t E = w.size(0), N = w.size(1), K = w.size(2);
  TORCH_CHECK(E >= 1 && E <= kMaxExperts, "moegemm: weight.shape[0] (experts) must be in [1, ", num(kMaxExperts), "], got ", num(E));
  check_multiple_of_16(N, "weight.shape[1] (N)");
  check_multiple_of_16(K, "weight.shape[2] (K)");
  c10::DeviceGuard guard(w.device());
  auto f8 = w.options().dtype(at::kFloat8_e4m3fn);
  auto f32 = w.options().dtype(at::kFloat);
  const int64_t Nb = ceil_div(N, kBlock), Kb = ceil_div(K, kBlock);
  Tensor q = at::empty({E, N, K}, f8), qT = at::empty({E, K, N}, f8);
  Tensor s = at::empty({E, Nb, Kb}, f32), sT = at::empty({E, Kb, Nb}, f32);
  quantize_weight(w.data_ptr(), dtype, E, N, K, bytes(q), s.data_ptr<float>(), bytes(qT), sT.data_ptr<float>(), current_stream(w));
  return {q, s, qT, sT};
}

// out [T, N] = qa [T, K] · qb [E, N, K]ᵀ, blockwise scaled.
Tensor gemm_fp8_ragged_m_op(const Tensor& qa_in, const Tensor& sa_in, const Tensor& qb_in, const Tensor& sb_in,
                            const Tensor& plan) {
  const Tensor qa = input(qa_in, "qa", at::kFloat8_e4m3fn, 2, qa_in);
  const Tensor qb = input(qb_in, "qb", at::kFloat8_e4m3fn, 3, qa);
  const Tensor sa = input(sa_in, "sa", at::kFloat, 2, qa);
  const Tensor sb = input(sb_in, "sb", at::kFloat, 3, qa);
  check(plan, "plan", at::kInt, 2, qa);
  const int E = num_experts(plan);
  const int64_t T = qa.size(0), K = qa.size(1), N = qb.size(1);
  TORCH_CHECK(qb.size(0) == E && qb.size(2) == K, "moegemm: qb must be [", num(E), ", N, ", num(K), "], got ", shape(qb));
  check_multiple_of_16(K, "qa.shape[1] (K)");
  check_multiple_of_16(N, "qb.shape[1] (N)");
  TORCH_CHECK(sa.size(0) == T && sa.size(1) == ceil_div(K, kBlock), "moegemm: sa has shape ", shape(sa));
  TORCH_CHECK(sb.size(0) == E && sb.size(1) == ceil_div(N, kBlock) && sb.size(2) == ceil_div(K, kBlock), "moegemm: sb has shape ", shape(sb));
  c10::DeviceGuard guard(qa.device());
  Tensor out = at::empty({T, N}, qa.options().dtype(at::kBFloat16));
  if (T == 0) return out;
  Tensor ws = workspace(gemm_fp8_ragged_m_workspace_size(E), qa);
  gemm_fp8_ragged_m(cbytes(qa), sa.data_ptr<float>(), cbytes(qb), sb.data_ptr<float>(), plan.data_ptr<int32_t>(), E, T,
                    N, K, out.data_ptr(), ws.data_ptr(), current_stream(qa));
  return out;
}

// out [E, N, K] (+)= qaT_e · qbT_eᵀ over each expert's tokens; out is fp32 (= or +=) or bf16 (=).
// Runs `fn` on out itself when it is 16-byte aligned, else on an aligned copy that is copied back after.
template <class Fn>
void into_aligned(const Tensor& out, Fn&& fn) {
  if (is_aligned(out)) return fn(out);
  Tensor tmp = out.clone(at::MemoryFormat::Contiguous);
  fn(tmp);
  out.copy_(tmp);
}

void check_wgrad_out(const Tensor& out, const Tensor& like, bool accumulate) {
  const bool f32 = out.scalar_type() == at::kFloat;
  check(out, "out", f32 ? at::kFloat : at::kBFloat16, 3, like);
  TORCH_CHECK(f32 || !accumulate, "moegemm: wgrad accumulation needs a float32 out, got ", out.scalar_type());
}

void gemm_fp8_ragged_k_into(const Tensor& qaT_in, const Tensor& saT_in, const Tensor& qbT_in, const Tensor& sbT_in,
                            const Tensor& plan, const Tensor& out, bool accumulate) {
  const Tensor qaT = input(qaT_in, "qaT", at::kFloat8_e4m3fn, 2, qaT_in);
  const Tensor qbT = input(qbT_in, "qbT", at::kFloat8_e4m3fn, 2, qaT);
  const Tensor saT = input(saT_in, "saT", at::kFloat, 2, qaT);
  const Tensor sbT = input(sbT_in, "sbT", at::kFloat, 2, qaT);
  check(plan, "plan", at::kInt, 2, qaT);
  check_wgrad_out(out, qaT, accumulate);
  const bool f32 = out.scalar_type() == at::kFloat;
  const int E = num_experts(plan);
  const int64_t N = qaT.size(0), K = qbT.size(0), Wc = qaT.size(1);
  TORCH_CHECK(qbT.size(1) == Wc && saT.size(0) == sbT.size(0) && saT.size(1) == N && sbT.size(1) == K,
              "moegemm: column-quantized operands disagree: ", shape(qaT), shape(saT), shape(qbT), shape(sbT));
  TORCH_CHECK(Wc % kColAlign == 0, "moegemm: qaT.shape[1] (the column copy's capacity) must be a multiple of 16, got ", num(Wc));
  check_multiple_of_16(N, "qaT.shape[0] (N)");
  check_multiple_of_16(K, "qbT.shape[0] (K)");
  TORCH_CHECK(out.size(0) == E && out.size(1) == N && out.size(2) == K, "moegemm: out must be [", num(E), ", ", num(N), ", ", num(K), "], got ", shape(out));
  c10::DeviceGuard guard(qaT.device());
  const auto stream = current_stream(qaT);
  into_aligned(out, [&](const Tensor& o) {
    if (f32) {
      Tensor ws = workspace(gemm_fp8_ragged_k_f32_workspace_size(E), qaT);
      gemm_fp8_ragged_k_f32(cbytes(qaT), saT.data_ptr<float>(), cbytes(qbT), sbT.data_ptr<float>(), plan.data_ptr<int32_t>(),
                            E, Wc, N, K, o.data_ptr<float>(), accumulate, ws.data_ptr(), stream);
    } else {
      Tensor ws = workspace(gemm_fp8_ragged_k_bf16_workspace_size(E), qaT);
      gemm_fp8_ragged_k_bf16(cbytes(qaT), saT.data_ptr<float>(), cbytes(qbT), sbT.data_ptr<float>(), plan.data_ptr<int32_t>(),
                             E, Wc, N, K, o.data_ptr(), ws.data_ptr(), stream);
    }
  });
}

Tensor new_wgrad(const Tensor& plan, int64_t N, int64_t K, at::ScalarType dtype, const Tensor& like) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "moegemm: wgrad out_dtype must be float32 or bfloat16, got ", dtype);
  return at::empty({plan.size(1) - 1, N, K}, like.options().dtype(dtype));
}

Tensor gemm_fp8_ragged_k_op(const Tensor& qaT, const Tensor& saT, const Tensor& qbT, const Tensor& sbT, const Tensor& plan,
                            at::ScalarType out_dtype) {
  Tensor out = new_wgrad(plan, qaT.size(0), qbT.size(0), out_dtype, qaT);
  gemm_fp8_ragged_k_into(qaT, saT, qbT, sbT, plan, out, false);
  return out;
}

void gemm_fp8_ragged_k_accumulate_op(const Tensor& qaT, const Tensor& saT, const Tensor& qbT, const Tensor& sbT,
                                     const Tensor& plan, const Tensor& out) {
  gemm_fp8_ragged_k_into(qaT, saT, qbT, sbT, plan, out, true);
}

// bf16 recipe: a [T, A] with w [E, N, K]; fprop has A = K, dgrad has A = N.
Tensor gemm_bf16_ragged_m(const Tensor& a_in, const Tensor& w_in, const Tensor& plan, bool dgrad) {
  const Tensor a = input(a_in, dgrad ? "dy" : "x", at::kBFloat16, 2, a_in);
  const Tensor w = input(w_in, "weight", at::kBFloat16, 3, a);
  check(plan, "plan", at::kInt, 2, a);
  const int E = num_experts(plan);
  const int64_t T = a.size(0), N = w.size(1), K = w.size(2);
  TORCH_CHECK(w.size(0) == E && a.size(1) == (dgrad ? N : K), "moegemm: operand shapes disagree: ", shape(a), shape(w));
  check_multiple_of_16(N, "weight.shape[1] (N)");
  check_multiple_of_16(K, "weight.shape[2] (K)");
  c10::DeviceGuard guard(a.device());
  Tensor out = at::empty({T, dgrad ? K : N}, a.options());
  if (T == 0) return out;
  Tensor ws = workspace(dgrad ? gemm_bf16_dgrad_workspace_size(E) : gemm_bf16_fprop_workspace_size(E), a);
  auto fn = dgrad ? gemm_bf16_dgrad : gemm_bf16_fprop;
  fn(a.data_ptr(), w.data_ptr(), plan.data_ptr<int32_t>(), E, T, N, K, out.data_ptr(), ws.data_ptr(), current_stream(a));
  return out;
}

Tensor gemm_bf16_fprop_op(const Tensor& x, const Tensor& w, const Tensor& plan) { return gemm_bf16_ragged_m(x, w, plan, false); }
Tensor gemm_bf16_dgrad_op(const Tensor& dy, const Tensor& w, const Tensor& plan) { return gemm_bf16_ragged_m(dy, w, plan, true); }

void gemm_bf16_wgrad_into(const Tensor& dy_in, const Tensor& x_in, const Tensor& plan, const Tensor& out, bool accumulate) {
  const Tensor dy = input(dy_in, "dy", at::kBFloat16, 2, dy_in);
  const Tensor x = input(x_in, "x", at::kBFloat16, 2, dy);
  check(plan, "plan", at::kInt, 2, dy);
  check_wgrad_out(out, dy, accumulate);
  const bool f32 = out.scalar_type() == at::kFloat;
  const int E = num_experts(plan);
  const int64_t T = dy.size(0), N = dy.size(1), K = x.size(1);
  TORCH_CHECK(x.size(0) == T, "moegemm: dy and x have different token counts: ", shape(dy), shape(x));
  check_multiple_of_16(N, "dy.shape[1] (N)");
  check_multiple_of_16(K, "x.shape[1] (K)");
  TORCH_CHECK(out.size(0) == E && out.size(1) == N && out.size(2) == K, "moegemm: out must be [", num(E), ", ", num(N), ", ", num(K), "], got ", shape(out));
  c10::DeviceGuard guard(dy.device());
  const auto stream = current_stream(dy);
  into_aligned(out, [&](const Tensor& o) {
    if (f32) {
      Tensor ws = workspace(gemm_bf16_wgrad_f32_workspace_size(E), dy);
      gemm_bf16_wgrad_f32(dy.data_ptr(), x.data_ptr(), plan.data_ptr<int32_t>(), E, T, N, K, o.data_ptr<float>(),
                          accumulate, ws.data_ptr(), stream);
    } else {
      Tensor ws = workspace(gemm_bf16_wgrad_bf16_workspace_size(E), dy);
      gemm_bf16_wgrad_bf16(dy.data_ptr(), x.data_ptr(), plan.data_ptr<int32_t>(), E, T, N, K, o.data_ptr(), ws.data_ptr(),
                           stream);
    }
  });
}

// y [T, N] bf16 += bias[e(t)] over the covered tokens, in place; bias [E, N] bf16 or fp32.
void add_bias_op(const Tensor& y, const Tensor& bias_in, const Tensor& plan) {
  check(plan, "plan", at::kInt, 2, y);
  const int E = num_experts(plan);
  check(y, "y", at::kBFloat16, 2, y);
  TORCH_CHECK(bias_in.scalar_type() == at::kFloat || bias_in.scalar_type() == at::kBFloat16,
              "moegemm: bias must be float32 or bfloat16, got ", bias_in.scalar_type());
  const Tensor bias = input(bias_in, "bias", bias_in.scalar_type(), 2, y);
  const int64_t T = y.size(0), N = y.size(1);
  TORCH_CHECK(bias.size(0) == E && bias.size(1) == N, "moegemm: bias must be [", num(E), ", ", num(N), "], got ", shape(bias));
  check_multiple_of_16(N, "y.shape[1] (N)");
  c10::DeviceGuard guard(y.device());
  into_aligned(y, [&](const Tensor& o) {
    add_bias(o.data_ptr(), bias.data_ptr(), bias.scalar_type() == at::kFloat, plan.data_ptr<int32_t>(), E, T, N,
             current_stream(y));
  });
}

// db [E, N] fp32 = per-expert sums of dy [T, N] (bf16) over the covered tokens; bitwise reproducible.
Tensor bias_grad_op(const Tensor& dy_in, const Tensor& plan) {
  const Tensor dy = input(dy_in, "dy", at::kBFloat16, 2, dy_in);
  check(plan, "plan", at::kInt, 2, dy);
  const int E = num_experts(plan);
  const int64_t T = dy.size(0), N = dy.size(1);
  check_multiple_of_16(N, "dy.shape[1] (N)");
  c10::DeviceGuard guard(dy.device());
  Tensor db = at::empty({E, N}, dy.options().dtype(at::kFloat));
  Tensor partial = at::empty({bias_grad_workspace_floats(T, E, N)}, dy.options().dtype(at::kFloat));
  bias_grad(dy.data_ptr(), plan.data_ptr<int32_t>(), E, T, N, db.data_ptr<float>(), partial.data_ptr<float>(),
            current_stream(dy));
  return db;
}

Tensor gemm_bf16_wgrad_op(const Tensor& dy, const Tensor& x, const Tensor& plan, at::ScalarType out_dtype) {
  Tensor out = new_wgrad(plan, dy.size(1), x.size(1), out_dtype, dy);
  gemm_bf16_wgrad_into(dy, x, plan, out, false);
  return out;
}

void gemm_bf16_wgrad_accumulate_op(const Tensor& dy, const Tensor& x, const Tensor& plan, const Tensor& out) {
  gemm_bf16_wgrad_into(dy, x, plan, out, true);
}

}  // namespace

TORCH_LIBRARY(moegemm, m) {
  m.def("make_plan(Tensor m_splits, int T) -> Tensor");
  m.def("quantize_act(Tensor x, Tensor plan, bool rows, bool cols) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("quantize_weight(Tensor w) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("act_quantize(Tensor h, Tensor? probs, int activation, Tensor plan, bool rows, bool cols) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("act_backward_quantize(Tensor da, Tensor h, Tensor? probs, int activation, Tensor plan, bool rows, bool cols) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("act_bf16(Tensor h, Tensor? probs, int activation) -> Tensor");
  m.def("act_backward_bf16(Tensor da, Tensor h, Tensor? probs, int activation) -> (Tensor, Tensor)");
  m.def("gemm_fp8_ragged_m(Tensor qa, Tensor sa, Tensor qb, Tensor sb, Tensor plan) -> Tensor");
  m.def("gemm_fp8_ragged_k(Tensor qaT, Tensor saT, Tensor qbT, Tensor sbT, Tensor plan, ScalarType out_dtype) -> Tensor");
  m.def("gemm_fp8_ragged_k_accumulate(Tensor qaT, Tensor saT, Tensor qbT, Tensor sbT, Tensor plan, Tensor(a!) out) -> ()");
  m.def("gemm_bf16_fprop(Tensor x, Tensor w, Tensor plan) -> Tensor");
  m.def("gemm_bf16_dgrad(Tensor dy, Tensor w, Tensor plan) -> Tensor");
  m.def("gemm_bf16_wgrad(Tensor dy, Tensor x, Tensor plan, ScalarType out_dtype) -> Tensor");
  m.def("gemm_bf16_wgrad_accumulate(Tensor dy, Tensor x, Tensor plan, Tensor(a!) out) -> ()");
  m.def("add_bias_(Tensor(a!) y, Tensor bias, Tensor plan) -> ()");
  m.def("bias_grad(Tensor dy, Tensor plan) -> Tensor");
}

TORCH_LIBRARY_IMPL(moegemm, CUDA, m) {
  m.impl("make_plan", &make_plan_op);
  m.impl("quantize_act", &quantize_act_op);
  m.impl("quantize_weight", &quantize_weight_op);
  m.impl("act_quantize", &act_quantize_op);
  m.impl("act_backward_quantize", &act_backward_quantize_op);
  m.impl("act_bf16", &act_bf16_op);
  m.impl("act_backward_bf16", &act_backward_bf16_op);
  m.impl("gemm_fp8_ragged_m", &gemm_fp8_ragged_m_op);
  m.impl("gemm_fp8_ragged_k", &gemm_fp8_ragged_k_op);
  m.impl("gemm_fp8_ragged_k_accumulate", &gemm_fp8_ragged_k_accumulate_op);
  m.impl("gemm_bf16_fprop", &gemm_bf16_fprop_op);
  m.impl("gemm_bf16_dgrad", &gemm_bf16_dgrad_op);
  m.impl("gemm_bf16_wgrad", &gemm_bf16_wgrad_op);
  m.impl("gemm_bf16_wgrad_accumulate", &gemm_bf16_wgrad_accumulate_op);
  m.impl("add_bias_", &add_bias_op);
  m.impl("bias_grad", &bias_grad_op);
}

}  // namespace moegemm
