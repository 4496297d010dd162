// The layer entries: one op per layer and direction (registered in csrc/binding.cpp). Each checks its
// tensors once, builds or reuses the plan, allocates from host-known sizes, launches the kernels of
// csrc/moegemm.h in order on the current stream, and returns what autograd saves. Outputs not asked for
// come back as [0] placeholders (the Python shells map them to None). No host sync anywhere. The slots of
// saved, made and wgrad_operands are declared by name in moegemm/backends/contract.py (api/layer_contract.h).
// A weight gradient goes into the weight's main_grad when one is given (accumulated; written over when its
// overwrite_main_grad flag is set), else into a fresh dw.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>
#include <vector>

namespace moegemm::api {

using at::Tensor;

// -> (y [T, N] bf16, plan [3, E+1] int32, saved); see grouped_linear.cpp for saved. With x_scales, x is
// FP8: the row copy q [T, K] e4m3 with x_scales [T, ceil(K/128)] fp32, any strides (fp8_blockwise only). fp8_weight:
// empty, or the four tensors of quantize_weight(weight) kept by the caller (then passed to linear_bwd too).
std::tuple<Tensor, Tensor, std::vector<Tensor>> linear_fwd(const Tensor& x, const Tensor& weight, const Tensor& m_splits,
                                                           const std::optional<Tensor>& bias, int64_t recipe, bool need_dx,
                                                           bool need_dw, const std::optional<Tensor>& x_scales,
                                                           std::optional<at::TensorList> fp8_weight);
// -> (dx [T, K] bf16, dw [E, N, K] bf16 for bf16 weights else fp32 ([0] when accumulated into main_grad or
//     deferred), db [E, N] fp32, made0..made3). defer_wgrad (with need_dw): no weight gradient here; it is
//     left to linear_wgrad, and made0..made3 are the operands made here (fp8 qdyT, sdyT, qxT, sxT). Otherwise
//     (and for bf16, which makes none) they are [0] placeholders (fp8: e4m3, fp32, e4m3, fp32; bf16: bf16). A
//     fixed number of outputs, not a list: torch.compile functionalizes an op with mutable arguments only then.
//     x: the bf16 recipe's x (wgrad), or an FP8 x's row copy with x_scales (fp8: wgrad's column copy made from them).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> linear_bwd(
    const Tensor& dy, const Tensor& plan, at::TensorList saved, const std::optional<Tensor>& x, const Tensor& weight,
    const std::optional<Tensor>& main_grad, int64_t recipe, bool need_dx, bool need_dw, bool need_db, bool defer_wgrad,
    std::optional<at::TensorList> fp8_weight, const std::optional<Tensor>& x_scales, bool overwrite_main_grad);
// The deferred weight gradient: dw as linear_bwd's (written, or into main_grad) from
// wgrad_operands fp8 [qdyT, sdyT, qxT, sxT] / bf16 [dy, x] (a defer_wgrad linear_bwd's with the saved or
// given rest) over the same plan.
Tensor linear_wgrad(const Tensor& plan, at::TensorList wgrad_operands, const Tensor& weight,
                    const std::optional<Tensor>& main_grad, int64_t recipe, bool overwrite_main_grad);

// -> (y [T, H] bf16, plan, saved (empty unless `save`)); see grouped_mlp.cpp for saved.
std::tuple<Tensor, Tensor, std::vector<Tensor>> mlp_fwd(
    const Tensor& x, const Tensor& fc1_weight, const Tensor& fc2_weight, const Tensor& m_splits,
    const std::optional<Tensor>& fc1_bias, const std::optional<Tensor>& fc2_bias, const std::optional<Tensor>& probs,
    int64_t activation, int64_t recipe, const c10::List<std::optional<Tensor>>& fp8_weights, bool save, bool need_dw1,
    bool need_dw2, const std::optional<Tensor>& x_scales);
// -> (dx, dw1, dw2, db1 fp32, db2 fp32, dprobs [T] fp32, made0..made5), [0] for what is not needed;
// with defer_wgrad dw1/dw2 are [0] and made0..5 are the operands of mlp_wgrad made here (fp8 qdyT, sdyT,
// qdhT, sdhT, qxT, sxT; bf16 dh and five [0]); else [0] placeholders (fp8: e4m3, fp32 pairs; bf16: bf16).
// x: the bf16 recipe's x (wgrad), or an FP8 x's row copy with x_scales (fp8: fc1 wgrad's column copy made from them).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> mlp_bwd(
    const Tensor& dy, const Tensor& plan, at::TensorList saved, const std::optional<Tensor>& x, const Tensor& fc1_weight,
    const Tensor& fc2_weight, const std::optional<Tensor>& probs, const c10::List<std::optional<Tensor>>& fp8_weights,
    const std::optional<Tensor>& fc1_main_grad, const std::optional<Tensor>& fc2_main_grad, int64_t activation,
    int64_t recipe, bool need_dx, bool need_dw1, bool need_dw2, bool need_db1, bool need_db2, bool need_dprobs,
    bool release_saved, bool defer_wgrad, const std::optional<Tensor>& x_scales, bool fc1_overwrite_main_grad,
    bool fc2_overwrite_main_grad);
// The deferred weight gradients (dw1, dw2) of a defer_wgrad mlp_bwd over the same plan, [0] where not needed
// or accumulated into a main_grad; wgrad_operands fp8 [qdyT, sdyT, qaT, saT, qdhT, sdhT, qxT, sxT], bf16
// [dy, a, dh, x] (fc2's pair first).
std::tuple<Tensor, Tensor> mlp_wgrad(const Tensor& plan, at::TensorList wgrad_operands, const Tensor& fc1_weight,
                                     const Tensor& fc2_weight, const std::optional<Tensor>& fc1_main_grad,
                                     const std::optional<Tensor>& fc2_main_grad, int64_t recipe, bool need_dw1,
                                     bool need_dw2, bool fc1_overwrite_main_grad, bool fc2_overwrite_main_grad);

}  // namespace moegemm::api
