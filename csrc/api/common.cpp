#include "api/common.h"

#include <ATen/cuda/EmptyTensor.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace moegemm::api {

Recipe to_recipe(int64_t recipe) {
  TORCH_CHECK(recipe == static_cast<int64_t>(Recipe::kBf16) || recipe == static_cast<int64_t>(Recipe::kFp8Blockwise),
              "moegemm: unknown recipe ", num(recipe));
  return static_cast<Recipe>(recipe);
}

std::string num(int64_t v) { return std::to_string(v); }

std::string nums(at::IntArrayRef v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
  return out + "]";
}

std::string shape(const Tensor& t) { return nums(t.sizes()); }

std::string strides(const Tensor& t) {
  std::string out = "[";
  for (int64_t i = 0; i < t.dim(); ++i) out += (i ? ", " : "") + std::to_string(t.stride(i));
  return out + "]";
}

cudaStream_t current_stream(const Tensor& t) {
  auto stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(t.device());
  return static_cast<cudaStream_t>(stream.native_handle());
}

bool is_aligned(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % kPtrAlign == 0; }

Tensor aligned(const Tensor& t) { return is_aligned(t) ? t : t.clone(at::MemoryFormat::Contiguous); }

namespace {
// On like's (CUDA) device with `dim` dims, in any strides.
void check_device_and_dims(const Tensor& t, const char* name, int64_t dim, const Tensor& like) {
  TORCH_CHECK(t.is_cuda(), "moegemm: ", name, " must be a CUDA tensor, got one on ", t.device().str());
  TORCH_CHECK(t.device() == like.device(), "moegemm: ", name, " is on ", t.device().str(), ", expected ", like.device().str());
  TORCH_CHECK(t.dim() == dim, "moegemm: ", name, " must have ", num(dim), " dims, got shape ", shape(t));
}

void check_dtype(const Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.scalar_type() == dtype, "moegemm: ", name, " must be ", c10::toString(dtype), ", got ",
              c10::toString(t.scalar_type()));
}
}  // namespace

void check_placement(const Tensor& t, const char* name, int64_t dim, const Tensor& like) {
  check_device_and_dims(t, name, dim, like);
  TORCH_CHECK(t.is_contiguous(), "moegemm: ", name, " must be contiguous, got shape ", shape(t), " with strides ", strides(t));
}

void check(const Tensor& t, const char* name, at::ScalarType dtype, int64_t dim, const Tensor& like) {
  check_placement(t, name, dim, like);
  check_dtype(t, name, dtype);
}

Tensor input(const Tensor& t, const char* name, at::ScalarType dtype, int64_t dim, const Tensor& like) {
  check(t, name, dtype, dim, like);
  return aligned(t);
}

DType to_dtype(const Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kBFloat16: return DType::kBF16;
    case at::kHalf: return DType::kF16;
    case at::kFloat: return DType::kF32;
    default:
      TORCH_CHECK(false, "moegemm: ", name, " must be bfloat16, float16 or float32, got ", c10::toString(t.scalar_type()));
  }
}

int num_experts(const Tensor& plan) {
  TORCH_CHECK(plan.dim() == 2 && plan.size(0) == 3 && plan.size(1) >= 2 && plan.size(1) <= kMaxExperts + 1,
              "moegemm: plan must be [3, E+1] with 1 <= E <= ", num(kMaxExperts), ", got shape ", shape(plan));
  return static_cast<int>(plan.size(1) - 1);
}

void check_dim_aligned(int64_t v, const char* what, const char* what_more) {
  TORCH_CHECK(v > 0 && v % kDimAlign == 0, "moegemm: ", what, what_more, " must be a positive multiple of ", num(kDimAlign),
              ", got ", num(v));
}

void check_num_experts(int64_t E, const char* what, const char* what_more) {
  TORCH_CHECK(E >= 1 && E <= kMaxExperts, "moegemm: ", what, what_more, " must be in [1, ", num(kMaxExperts), "], got ", num(E));
}

void check_splits(const Tensor& m_splits, const Tensor& like) {
  check_placement(m_splits, "m_splits", 1, like);
  TORCH_CHECK(m_splits.scalar_type() == at::kInt || m_splits.scalar_type() == at::kLong,
              "moegemm: m_splits must be int32 or int64, got ", c10::toString(m_splits.scalar_type()));
}

void check_plan_tokens(int64_t T, int64_t E) {
  TORCH_CHECK(T >= 0 && T <= max_plan_tokens(E), "moegemm: T must be in [0, ", num(max_plan_tokens(E)), "] for ", num(E),
              " experts (int32 plan), got ", num(T));
}

void check_weight_shape(const Tensor& w, const char* name) {
  check_num_experts(w.size(0), name, ".shape[0] (experts)");
  check_dim_aligned(w.size(1), name, ".shape[1] (N)");
  check_dim_aligned(w.size(2), name, ".shape[2] (K)");
}

Activation to_activation(int64_t activation) {
  TORCH_CHECK(activation >= 0 && activation <= static_cast<int64_t>(Activation::kSquaredRelu),
              "moegemm: unknown activation ", num(activation));
  return static_cast<Activation>(activation);
}

int64_t act_width(const Tensor& h, Activation act) {
  const int64_t F1 = h.size(1), F = is_glu(act) ? F1 / 2 : F1;
  TORCH_CHECK(!is_glu(act) || F1 % 2 == 0, "moegemm: h.shape[1] must be even (gate and up halves), got ", num(F1));
  check_dim_aligned(F, "the activation's width (h.shape[1], halved for GLU)");
  return F;
}

Tensor probs_input(const std::optional<Tensor>& probs, int64_t T, const Tensor& like) {
  if (!probs.has_value()) return Tensor();
  TORCH_CHECK(probs->dim() == 1 && probs->size(0) == T, "moegemm: probs must have shape [", num(T), "], got ", shape(*probs));
  return input(*probs, "probs", at::kFloat, 1, like);
}

const float* probs_ptr(const Tensor& probs) { return probs.defined() ? probs.data_ptr<float>() : nullptr; }

uint8_t* bytes(const Tensor& t) { return t.numel() ? static_cast<uint8_t*>(t.data_ptr()) : nullptr; }
const uint8_t* cbytes(const Tensor& t) { return static_cast<const uint8_t*>(t.data_ptr()); }
Tensor empty(at::IntArrayRef sizes, at::ScalarType dtype, const Tensor& like) {
  return at::detail::empty_cuda(sizes, dtype, like.device(), std::nullopt);
}

Tensor empty_row_scales(int64_t T, int64_t Kb, const Tensor& like) {
  return at::detail::empty_strided_cuda({T, Kb}, {1, row_scale_pitch(T)}, at::kFloat, like.device());
}

namespace {
// The strides the kernels index by; those of a dimension of size 1 do not matter.
bool has_row_scale_layout(const Tensor& s) {
  const int64_t T = s.size(0), Kb = s.size(1);
  return (T <= 1 || s.stride(0) == 1) && (Kb <= 1 || s.stride(1) == row_scale_pitch(T)) && is_aligned(s);
}
}  // namespace

Tensor row_scales_input(const Tensor& s, const char* name, int64_t T, int64_t Kb, const Tensor& like) {
  check_device_and_dims(s, name, 2, like);
  check_dtype(s, name, at::kFloat);
  TORCH_CHECK(s.size(0) == T && s.size(1) == Kb, "moegemm: ", name, " must have shape [", num(T), ", ", num(Kb), "], got ",
              shape(s));
  if (has_row_scale_layout(s)) return s;
  Tensor out = empty_row_scales(T, Kb, like);
  out.copy_(s);
  return out;
}

Tensor workspace(size_t size, const Tensor& like) { return empty({int64_t(size)}, at::kByte, like); }
Tensor none_like(const Tensor& like, at::ScalarType dtype) { return empty({0}, dtype, like); }

void check_wgrad_out(const Tensor& out, const Tensor& like, bool accumulate) {
  const bool f32 = out.scalar_type() == at::kFloat;
  check(out, "out", f32 ? at::kFloat : at::kBFloat16, 3, like);
  TORCH_CHECK(f32 || !accumulate, "moegemm: wgrad accumulation needs a float32 out, got ", c10::toString(out.scalar_type()));
}

Tensor new_wgrad(int64_t E, int64_t N, int64_t K, at::ScalarType dtype, const Tensor& like) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "moegemm: wgrad out_dtype must be float32 or bfloat16, got ",
              c10::toString(dtype));
  return empty({E, N, K}, dtype, like);
}

void release(Tensor& t, bool free_storage) {
  if (free_storage && t.defined() && t.has_storage()) t.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl()->reset();
  t.reset();
}

}  // namespace moegemm::api
