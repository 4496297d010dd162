// The differentiable layer ops grouped_linear and grouped_mlp (schemas: moegemm/backends/contract.py
// GROUPED_LINEAR, GROUPED_MLP), the layers' path on the CUDA backend, each registered for two dispatch keys
// (csrc/binding.cpp):
//   - Autograd: one C++ autograd node per call. Forward runs the forward entry (linear_fwd / mlp_fwd) below
//     autograd and keeps what its backward needs in the node; backward reads each weight's main_grad
//     (main_grad.h) and runs the backward entry (linear_bwd / mlp_bwd). No Python runs in either, except
//     the main_grad lookup. Both entries are called through the dispatcher, so a torch.compile trace sees
//     them (and their fakes) in its forward and backward graphs.
//   - CUDA: the forward alone, for tensors outside autograd (inference mode).
// The split backward (a WgradStore) stays with the Python Functions (moegemm/functional), whose backward
// hands work to a Python object.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace moegemm::api {

using at::Tensor;

// y [T, N] bf16. x: the bf16 input, or with x_scales its FP8 row copy, whose gradient goes to dx_target.
Tensor grouped_linear(const Tensor& x, const Tensor& weight, const Tensor& m_splits, const std::optional<Tensor>& bias,
                      int64_t recipe, const std::optional<Tensor>& x_scales, const std::optional<Tensor>& dx_target,
                      std::optional<at::TensorList> fp8_weight);
Tensor grouped_linear_autograd(const Tensor& x, const Tensor& weight, const Tensor& m_splits,
                               const std::optional<Tensor>& bias, int64_t recipe, const std::optional<Tensor>& x_scales,
                               const std::optional<Tensor>& dx_target, std::optional<at::TensorList> fp8_weight);

// y [T, H] bf16 = fc2(act(fc1(x)) * probs) per expert; x and dx_target as for grouped_linear.
Tensor grouped_mlp(const Tensor& x, const Tensor& fc1_weight, const Tensor& fc2_weight, const Tensor& m_splits,
                   const std::optional<Tensor>& fc1_bias, const std::optional<Tensor>& fc2_bias,
                   const std::optional<Tensor>& probs, int64_t activation, int64_t recipe,
                   const c10::List<std::optional<Tensor>>& fp8_weights, const std::optional<Tensor>& x_scales,
                   const std::optional<Tensor>& dx_target);
Tensor grouped_mlp_autograd(const Tensor& x, const Tensor& fc1_weight, const Tensor& fc2_weight, const Tensor& m_splits,
                            const std::optional<Tensor>& fc1_bias, const std::optional<Tensor>& fc2_bias,
                            const std::optional<Tensor>& probs, int64_t activation, int64_t recipe,
                            const c10::List<std::optional<Tensor>>& fp8_weights, const std::optional<Tensor>& x_scales,
                            const std::optional<Tensor>& dx_target);

}  // namespace moegemm::api
