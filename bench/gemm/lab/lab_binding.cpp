// Python binding of the GEMM lab (lab.h): run a named tiling on operands made by moegemm's own ops.
#include <ATen/cuda/CUDAContext.h>
#include <torch/extension.h>

#include "lab.h"

namespace {

const uint8_t* bytes(const at::Tensor& t) { return static_cast<const uint8_t*>(t.data_ptr()); }

template <class V>
const V& find(std::vector<V>& table, const std::string& name, bool want_f32 = false, bool check_f32 = false) {
  for (const V& v : table) {
    if (v.name != name) continue;
    if constexpr (std::is_same_v<V, moegemm_lab::RaggedK>)
      if (check_f32 && v.f32 != want_f32) continue;
    return v;
  }
  TORCH_CHECK(false, "gemm lab: no variant ", name);
}

at::Tensor ragged_m(const std::string& name, const at::Tensor& qa, const at::Tensor& sa, const at::Tensor& qb,
                    const at::Tensor& sb, const at::Tensor& plan) {
  const auto& v = find(moegemm_lab::ragged_m_variants(), name);
  const int E = static_cast<int>(qb.size(0));
  const int64_t T = qa.size(0), K = qa.size(1), N = qb.size(1);
  at::Tensor out = at::empty({T, N}, qa.options().dtype(at::kBFloat16));
  at::Tensor ws = at::empty({static_cast<int64_t>(v.workspace_size(E))}, qa.options().dtype(at::kByte));
  v.run({plan.data_ptr<int32_t>(), E, T, N, K, out.data_ptr()}, {bytes(qa), sa.data_ptr<float>()},
        {bytes(qb), sb.data_ptr<float>()}, ws.data_ptr(), at::cuda::getCurrentCUDAStream(), name.c_str());
  return out;
}

void ragged_k(const std::string& name, const at::Tensor& qaT, const at::Tensor& saT, const at::Tensor& qbT,
              const at::Tensor& sbT, const at::Tensor& plan, const at::Tensor& out, bool accumulate) {
  const bool f32 = out.scalar_type() == at::kFloat;
  const auto& v = find(moegemm_lab::ragged_k_variants(), name, f32, true);
  const int E = static_cast<int>(out.size(0));
  const int64_t N = qaT.size(0), K = qbT.size(0), Wc = qaT.size(1), NB = saT.size(0);
  at::Tensor ws = at::empty({static_cast<int64_t>(v.workspace_size(E))}, qaT.options().dtype(at::kByte));
  const moegemm::WgradOut kind = !f32 ? moegemm::WgradOut::kBF16
                                 : accumulate ? moegemm::WgradOut::kF32Accumulate : moegemm::WgradOut::kF32;
  v.run({plan.data_ptr<int32_t>(), E, N, K, /*T=*/0, Wc, NB, out.data_ptr(), kind}, {bytes(qaT), saT.data_ptr<float>()},
        {bytes(qbT), sbT.data_ptr<float>()}, ws.data_ptr(), at::cuda::getCurrentCUDAStream(), name.c_str());
}

std::vector<std::string> names(bool wgrad, bool f32) {
  std::vector<std::string> out;
  if (!wgrad)
    for (const auto& v : moegemm_lab::ragged_m_variants()) out.push_back(v.name);
  else
    for (const auto& v : moegemm_lab::ragged_k_variants())
      if (v.f32 == f32) out.push_back(v.name);
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("ragged_m", &ragged_m);
  m.def("ragged_k", &ragged_k);
  m.def("names", &names);
}
