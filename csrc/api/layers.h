// The layer entries: one op per layer and direction (registered in csrc/binding.cpp). Each checks its
// tensors once, builds or reuses the plan, allocates from host-known sizes, launches the kernels of
// csrc/moegemm.h in order on the current stream, and returns what autograd saves. Outputs not asked for
// come back as [0] placeholders (the Python shells map them to None). No host sync anywhere.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>
#include <vector>

namespace moegemm::api {

using at::Tensor;

// -> (y [T, N] bf16, plan [3, E+1] int32, saved); see grouped_linear.cpp for saved.
std::tuple<Tensor, Tensor, std::vector<Tensor>> linear_fwd(const Tensor& x, const Tensor& weight, const Tensor& m_splits,
                                                           const std::optional<Tensor>& bias, int64_t recipe, bool need_dx,
                                                           bool need_dw);
// -> (dx [T, K] bf16, dw [E, N, K] bf16 for bf16 weights else fp32 ([0] when accumulated into main_grad),
//     db [E, N] fp32).
std::tuple<Tensor, Tensor, Tensor> linear_bwd(const Tensor& dy, const Tensor& plan, at::TensorList saved,
                                              const std::optional<Tensor>& x, const Tensor& weight,
                                              const std::optional<Tensor>& main_grad, int64_t recipe, bool need_dx,
                                              bool need_dw, bool need_db);

// -> (y [T, H] bf16, plan, saved (empty unless `save`)); see grouped_mlp.cpp for saved.
std::tuple<Tensor, Tensor, std::vector<Tensor>> mlp_fwd(
    const Tensor& x, const Tensor& fc1_weight, const Tensor& fc2_weight, const Tensor& m_splits,
    const std::optional<Tensor>& fc1_bias, const std::optional<Tensor>& fc2_bias, const std::optional<Tensor>& probs,
    int64_t activation, int64_t recipe, const c10::List<std::optional<Tensor>>& fp8_weights, bool save, bool need_dw1,
    bool need_dw2);
// -> (dx, dw1, dw2, db1 fp32, db2 fp32, dprobs [T] fp32), [0] for what is not needed.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> mlp_bwd(
    const Tensor& dy, const Tensor& plan, at::TensorList saved, const std::optional<Tensor>& x, const Tensor& fc1_weight,
    const Tensor& fc2_weight, const std::optional<Tensor>& probs, const c10::List<std::optional<Tensor>>& fp8_weights,
    const std::optional<Tensor>& fc1_main_grad, const std::optional<Tensor>& fc2_main_grad, int64_t activation,
    int64_t recipe, bool need_dx, bool need_dw1, bool need_dw2, bool need_db1, bool need_db2, bool need_dprobs,
    bool release_saved);

}  // namespace moegemm::api
