// The one binding file: registers moegemm's ops with the PyTorch dispatcher (TORCH_LIBRARY), so that
// autograd Functions, torch.compile and CUDA graphs see ordinary ops. Each op checks its tensors,
// allocates its outputs with the caching allocator (sizes from T, E, N, K only) and calls the
// torch-free interface of csrc/moegemm.h on the current stream. Input validation for users happens in
// Python (moegemm/_validate.py) before these are reached; the checks here guard the C++ contract.
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include <optional>

#include "moegemm.h"

namespace moegemm {
namespace {

using at::Tensor;

cudaStream_t current_stream(const Tensor& t) {
  auto stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(t.device());
  return static_cast<cudaStream_t>(stream.native_handle());
}

void check(const Tensor& t, const char* name, at::ScalarType dtype, int64_t dim, const Tensor& like) {
  TORCH_CHECK(t.is_cuda(), "moegemm: ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.device() == like.device(), "moegemm: ", name, " is on ", t.device(), ", expected ", like.device());
  TORCH_CHECK(t.scalar_type() == dtype, "moegemm: ", name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim, "moegemm: ", name, " must have ", dim, " dims, got ", t.dim());
  TORCH_CHECK(t.is_contiguous(), "moegemm: ", name, " must be contiguous");
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
  TORCH_CHECK(plan.dim() == 2 && plan.size(0) == 3, "moegemm: plan must be [3, E+1], got ", plan.sizes());
  return static_cast<int>(plan.size(1) - 1);
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
  TORCH_CHECK(m_splits.is_cuda() && m_splits.dim() == 1 && m_splits.is_contiguous(), "moegemm: m_splits must be a contiguous 1-D CUDA tensor");
  TORCH_CHECK(m_splits.scalar_type() == at::kInt || m_splits.scalar_type() == at::kLong, "moegemm: m_splits must be int32 or int64");
  const int E = static_cast<int>(m_splits.numel());
  TORCH_CHECK(E >= 1 && E <= kMaxExperts, "moegemm: number of experts must be in [1, ", kMaxExperts, "], got ", E);
  c10::DeviceGuard guard(m_splits.device());
  Tensor plan = at::empty({3, E + 1}, m_splits.options().dtype(at::kInt));
  make_plan(m_splits.data_ptr(), m_splits.scalar_type() == at::kLong, E, T, plan.data_ptr<int32_t>(), current_stream(m_splits));
  return plan;
}

std::tuple<Tensor, Tensor, Tensor, Tensor> quantize_act_op(const Tensor& x, const Tensor& plan, bool rows, bool cols) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous(), "moegemm: x must be a contiguous 2-D CUDA tensor");
  const DType dtype = to_dtype(x, "x");
  check(plan, "plan", at::kInt, 2, x);
  const int E = num_experts(plan);
  const int64_t T = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kColAlign == 0, "moegemm: x.shape[1] must be a multiple of 16, got ", K);
  c10::DeviceGuard guard(x.device());
  auto [q, s, qT, sT] = multicast_outputs(x, T, K, E, rows, cols);
  quantize_act(x.data_ptr(), dtype, T, K, E, plan.data_ptr<int32_t>(), rows ? bytes(q) : nullptr,
               rows ? s.data_ptr<float>() : nullptr, cols ? bytes(qT) : nullptr, cols ? sT.data_ptr<float>() : nullptr,
               current_stream(x));
  return {q, s, qT, sT};
}

Activation to_activation(int64_t activation) {
  TORCH_CHECK(activation >= 0 && activation <= static_cast<int64_t>(Activation::kSquaredRelu), "moegemm: unknown activation ", activation);
  return static_cast<Activation>(activation);
}

const float* probs_ptr(const std::optional<Tensor>& probs, int64_t T, const Tensor& like) {
  if (!probs.has_value()) return nullptr;
  check(*probs, "probs", at::kFloat, 1, like);
  TORCH_CHECK(probs->size(0) == T, "moegemm: probs must have ", T, " entries, got ", probs->size(0));
  return probs->data_ptr<float>();
}

// a = act(h) * probs, quantized like quantize_act; h is [T, 2F] for GLU activations, else [T, F].
std::tuple<Tensor, Tensor, Tensor, Tensor> act_quantize_op(const Tensor& h, const std::optional<Tensor>& probs,
                                                           int64_t activation, const Tensor& plan, bool rows, bool cols) {
  check(h, "h", at::kBFloat16, 2, h);
  check(plan, "plan", at::kInt, 2, h);
  const Activation act = to_activation(activation);
  const int E = num_experts(plan);
  const int64_t T = h.size(0), F = is_glu(act) ? h.size(1) / 2 : h.size(1);
  TORCH_CHECK(F % kColAlign == 0 && (!is_glu(act) || h.size(1) == 2 * F), "moegemm: h has shape ", h.sizes());
  c10::DeviceGuard guard(h.device());
  auto [q, s, qT, sT] = multicast_outputs(h, T, F, E, rows, cols);
  act_quantize(h.data_ptr(), probs_ptr(probs, T, h), act, T, F, E, plan.data_ptr<int32_t>(), rows ? bytes(q) : nullptr,
               rows ? s.data_ptr<float>() : nullptr, cols ? bytes(qT) : nullptr, cols ? sT.data_ptr<float>() : nullptr,
               current_stream(h));
  return {q, s, qT, sT};
}

// dh from da [T, F] and h, quantized like quantize_act; plus per-row partial sums for dprobs.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> act_backward_quantize_op(
    const Tensor& da, const Tensor& h, const std::optional<Tensor>& probs, int64_t activation, const Tensor& plan,
    bool rows, bool cols) {
  check(da, "da", at::kBFloat16, 2, da);
  check(h, "h", at::kBFloat16, 2, da);
  check(plan, "plan", at::kInt, 2, da);
  const Activation act = to_activation(activation);
  const int E = num_experts(plan);
  const int64_t T = da.size(0), F = da.size(1), F1 = is_glu(act) ? 2 * F : F;
  TORCH_CHECK(h.size(0) == T && h.size(1) == F1 && F % kColAlign == 0, "moegemm: da ", da.sizes(), " and h ", h.sizes(), " disagree");
  c10::DeviceGuard guard(da.device());
  auto [q, s, qT, sT] = multicast_outputs(da, T, F1, E, rows, cols);
  const float* p = probs_ptr(probs, T, da);
  Tensor partial = at::empty({p != nullptr ? T : 0, ceil_div(F1, kBlock)}, da.options().dtype(at::kFloat));
  act_backward_quantize(da.data_ptr(), h.data_ptr(), p, act, T, F, E, plan.data_ptr<int32_t>(), rows ? bytes(q) : nullptr,
                        rows ? s.data_ptr<float>() : nullptr, cols ? bytes(qT) : nullptr,
                        cols ? sT.data_ptr<float>() : nullptr, p != nullptr ? partial.data_ptr<float>() : nullptr,
                        current_stream(da));
  return {q, s, qT, sT, partial};
}

// bf16 recipe: a = act(h) * probs in bf16; h is [T, 2F] for GLU activations, else [T, F].
Tensor act_bf16_op(const Tensor& h, const std::optional<Tensor>& probs, int64_t activation) {
  check(h, "h", at::kBFloat16, 2, h);
  const Activation act = to_activation(activation);
  const int64_t T = h.size(0), F = is_glu(act) ? h.size(1) / 2 : h.size(1);
  TORCH_CHECK(F % kColAlign == 0 && (!is_glu(act) || h.size(1) == 2 * F), "moegemm: h has shape ", h.sizes());
  c10::DeviceGuard guard(h.device());
  Tensor a = at::empty({T, F}, h.options());
  act_bf16(h.data_ptr(), probs_ptr(probs, T, h), act, T, F, a.data_ptr(), current_stream(h));
  return a;
}

// bf16 recipe: dh (bf16, like h) from da [T, F] and h; plus per-row partial sums for dprobs.
std::tuple<Tensor, Tensor> act_backward_bf16_op(const Tensor& da, const Tensor& h, const std::optional<Tensor>& probs,
                                                int64_t activation) {
  check(da, "da", at::kBFloat16, 2, da);
  check(h, "h", at::kBFloat16, 2, da);
  const Activation act = to_activation(activation);
  const int64_t T = da.size(0), F = da.size(1), F1 = is_glu(act) ? 2 * F : F;
  TORCH_CHECK(h.size(0) == T && h.size(1) == F1 && F % kColAlign == 0, "moegemm: da ", da.sizes(), " and h ", h.sizes(), " disagree");
  c10::DeviceGuard guard(da.device());
  Tensor dh = at::empty({T, F1}, h.options());
  const float* p = probs_ptr(probs, T, da);
  Tensor partial = at::empty({p != nullptr ? T : 0, ceil_div(F, kActBf16Cols)}, da.options().dtype(at::kFloat));
  act_backward_bf16(da.data_ptr(), h.data_ptr(), p, act, T, F, dh.data_ptr(), p != nullptr ? partial.data_ptr<float>() : nullptr,
                    current_stream(da));
  return {dh, partial};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> quantize_weight_op(const Tensor& w) {
  TORCH_CHECK(w.is_cuda() && w.dim() == 3 && w.is_contiguous(), "moegemm: weight must be a contiguous 3-D CUDA tensor");
  const DType dtype = to_dtype(w, "weight");
  const int64_t E = w.size(0), N = w.size(1), K = w.size(2);
  TORCH_CHECK(N % kColAlign == 0 && K % kColAlign == 0, "moegemm: weight's N and K must be multiples of 16, got ", w.sizes());
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
Tensor gemm_fp8_ragged_m_op(const Tensor& qa, const Tensor& sa, const Tensor& qb, const Tensor& sb, const Tensor& plan) {
  check(qa, "qa", at::kFloat8_e4m3fn, 2, qa);
  check(qb, "qb", at::kFloat8_e4m3fn, 3, qa);
  check(sa, "sa", at::kFloat, 2, qa);
  check(sb, "sb", at::kFloat, 3, qa);
  check(plan, "plan", at::kInt, 2, qa);
  const int E = num_experts(plan);
  const int64_t T = qa.size(0), K = qa.size(1), N = qb.size(1);
  TORCH_CHECK(qb.size(0) == E && qb.size(2) == K, "moegemm: qb must be [", E, ", N, ", K, "], got ", qb.sizes());
  TORCH_CHECK(sa.size(0) == T && sa.size(1) == ceil_div(K, kBlock), "moegemm: sa has shape ", sa.sizes());
  TORCH_CHECK(sb.size(0) == E && sb.size(1) == ceil_div(N, kBlock) && sb.size(2) == ceil_div(K, kBlock), "moegemm: sb has shape ", sb.sizes());
  c10::DeviceGuard guard(qa.device());
  Tensor out = at::empty({T, N}, qa.options().dtype(at::kBFloat16));
  if (T == 0 || N == 0) return out;
  Tensor ws = workspace(gemm_fp8_ragged_m_workspace_size(E), qa);
  gemm_fp8_ragged_m(cbytes(qa), sa.data_ptr<float>(), cbytes(qb), sb.data_ptr<float>(), plan.data_ptr<int32_t>(), E, T,
                    N, K, out.data_ptr(), ws.data_ptr(), current_stream(qa));
  return out;
}

// out [E, N, K] (+)= qaT_e · qbT_eᵀ over each expert's tokens; out is fp32 (= or +=) or bf16 (=).
void gemm_fp8_ragged_k_into(const Tensor& qaT, const Tensor& saT, const Tensor& qbT, const Tensor& sbT,
                            const Tensor& plan, const Tensor& out, bool accumulate) {
  check(qaT, "qaT", at::kFloat8_e4m3fn, 2, qaT);
  check(qbT, "qbT", at::kFloat8_e4m3fn, 2, qaT);
  check(saT, "saT", at::kFloat, 2, qaT);
  check(sbT, "sbT", at::kFloat, 2, qaT);
  check(plan, "plan", at::kInt, 2, qaT);
  const bool f32 = out.scalar_type() == at::kFloat;
  check(out, "out", f32 ? at::kFloat : at::kBFloat16, 3, qaT);
  TORCH_CHECK(f32 || !accumulate, "moegemm: wgrad accumulation needs a float32 out");
  const int E = num_experts(plan);
  const int64_t N = qaT.size(0), K = qbT.size(0), Wc = qaT.size(1);
  TORCH_CHECK(qbT.size(1) == Wc && saT.size(0) == sbT.size(0) && saT.size(1) == N && sbT.size(1) == K,
              "moegemm: column-quantized operands disagree: ", qaT.sizes(), saT.sizes(), qbT.sizes(), sbT.sizes());
  TORCH_CHECK(out.size(0) == E && out.size(1) == N && out.size(2) == K, "moegemm: out must be [", E, ", ", N, ", ", K, "], got ", out.sizes());
  c10::DeviceGuard guard(qaT.device());
  if (N == 0 || K == 0) return;
  const auto stream = current_stream(qaT);
  if (f32) {
    Tensor ws = workspace(gemm_fp8_ragged_k_f32_workspace_size(E), qaT);
    gemm_fp8_ragged_k_f32(cbytes(qaT), saT.data_ptr<float>(), cbytes(qbT), sbT.data_ptr<float>(), plan.data_ptr<int32_t>(),
                          E, Wc, N, K, out.data_ptr<float>(), accumulate, ws.data_ptr(), stream);
  } else {
    Tensor ws = workspace(gemm_fp8_ragged_k_bf16_workspace_size(E), qaT);
    gemm_fp8_ragged_k_bf16(cbytes(qaT), saT.data_ptr<float>(), cbytes(qbT), sbT.data_ptr<float>(), plan.data_ptr<int32_t>(),
                           E, Wc, N, K, out.data_ptr(), ws.data_ptr(), stream);
  }
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
Tensor gemm_bf16_ragged_m(const Tensor& a, const Tensor& w, const Tensor& plan, bool dgrad) {
  check(a, dgrad ? "dy" : "x", at::kBFloat16, 2, a);
  check(w, "weight", at::kBFloat16, 3, a);
  check(plan, "plan", at::kInt, 2, a);
  const int E = num_experts(plan);
  const int64_t T = a.size(0), N = w.size(1), K = w.size(2);
  TORCH_CHECK(w.size(0) == E && a.size(1) == (dgrad ? N : K), "moegemm: operand shapes disagree: ", a.sizes(), w.sizes());
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

void gemm_bf16_wgrad_into(const Tensor& dy, const Tensor& x, const Tensor& plan, const Tensor& out, bool accumulate) {
  check(dy, "dy", at::kBFloat16, 2, dy);
  check(x, "x", at::kBFloat16, 2, dy);
  check(plan, "plan", at::kInt, 2, dy);
  const bool f32 = out.scalar_type() == at::kFloat;
  check(out, "out", f32 ? at::kFloat : at::kBFloat16, 3, dy);
  TORCH_CHECK(f32 || !accumulate, "moegemm: wgrad accumulation needs a float32 out");
  const int E = num_experts(plan);
  const int64_t T = dy.size(0), N = dy.size(1), K = x.size(1);
  TORCH_CHECK(x.size(0) == T, "moegemm: dy and x have different token counts: ", dy.sizes(), x.sizes());
  TORCH_CHECK(out.size(0) == E && out.size(1) == N && out.size(2) == K, "moegemm: out must be [", E, ", ", N, ", ", K, "], got ", out.sizes());
  c10::DeviceGuard guard(dy.device());
  const auto stream = current_stream(dy);
  if (f32) {
    Tensor ws = workspace(gemm_bf16_wgrad_f32_workspace_size(E), dy);
    gemm_bf16_wgrad_f32(dy.data_ptr(), x.data_ptr(), plan.data_ptr<int32_t>(), E, T, N, K, out.data_ptr<float>(),
                        accumulate, ws.data_ptr(), stream);
  } else {
    Tensor ws = workspace(gemm_bf16_wgrad_bf16_workspace_size(E), dy);
    gemm_bf16_wgrad_bf16(dy.data_ptr(), x.data_ptr(), plan.data_ptr<int32_t>(), E, T, N, K, out.data_ptr(), ws.data_ptr(),
                         stream);
  }
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
}

}  // namespace moegemm
