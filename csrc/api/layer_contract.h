// The layer ops' contract for the C++ entries, generated from moegemm/backends/contract.py (its one
// declaration): edit that file and run `python -m moegemm.backends.contract`; tests/test_contract.py
// fails while this header is stale. The schemas csrc/binding.cpp registers, and by name the slots
// of each list an entry reads or writes (saved, made, wgrad_operands, fp8 weights).
#pragma once

#include <cstddef>

namespace moegemm::api::contract {

// quantize_weight's four tensors: the parts of every FP8 weight an op takes
namespace fp8_weight_part { enum : size_t { kQ, kS, kQT, kST, kCount }; }

// -------------------------------------------------------------------------------------- linear
namespace linear {

inline constexpr char kFwdSchema[] =
    "linear_fwd(Tensor x, Tensor weight, Tensor m_splits, Tensor? bias, int recipe, bool need_dx, "
    "bool need_dw, Tensor? x_scales=None, Tensor[]? fp8_weight=None) -> (Tensor y, Tensor plan, "
    "Tensor[] saved)";
inline constexpr char kBwdSchema[] =
    "linear_bwd(Tensor dy, Tensor plan, Tensor[] saved, Tensor? x, Tensor weight, Tensor(a!)? main_grad, "
    "int recipe, bool need_dx, bool need_dw, bool need_db, bool defer_wgrad=False, "
    "Tensor[]? fp8_weight=None, Tensor? x_scales=None, bool overwrite_main_grad=False) -> (Tensor dx, "
    "Tensor dw, Tensor db, Tensor made0, Tensor made1, Tensor made2, Tensor made3)";
inline constexpr char kWgradSchema[] =
    "linear_wgrad(Tensor plan, Tensor[] wgrad_operands, Tensor weight, Tensor(a!)? main_grad, "
    "int recipe, bool overwrite_main_grad=False) -> Tensor dw";
inline constexpr char kAutogradSchema[] =
    "grouped_linear(Tensor x, Tensor weight, Tensor m_splits, Tensor? bias, int recipe, "
    "Tensor? x_scales=None, Tensor? dx_target=None, Tensor[]? fp8_weight=None) -> Tensor y";

namespace saved_bf16 { enum : size_t { kWBf16, kCount }; }
namespace saved_fp8 { enum : size_t { kQx, kSx, kQwT, kSwT, kCount }; }
namespace made_bf16 { enum : size_t { kCount }; }
namespace made_fp8 { enum : size_t { kQdyT, kSdyT, kQxT, kSxT, kCount }; }
inline constexpr size_t kMadeCount = 4;
namespace wgrad_operands_bf16 { enum : size_t { kDy, kX, kCount }; }
namespace wgrad_operands_fp8 { enum : size_t { kQdyT, kSdyT, kQxT, kSxT, kCount }; }
namespace fp8_weights { enum : size_t { kWeight = 0, kCount = 4 }; }

}  // namespace linear

// -------------------------------------------------------------------------------------- mlp
namespace mlp {

inline constexpr char kFwdSchema[] =
    "mlp_fwd(Tensor x, Tensor fc1_weight, Tensor fc2_weight, Tensor m_splits, Tensor? fc1_bias, "
    "Tensor? fc2_bias, Tensor? probs, int activation, int recipe, Tensor?[] fp8_weights, bool save, "
    "bool need_dw1, bool need_dw2, Tensor? x_scales=None) -> (Tensor y, Tensor plan, Tensor[] saved)";
inline constexpr char kBwdSchema[] =
    "mlp_bwd(Tensor dy, Tensor plan, Tensor[] saved, Tensor? x, Tensor fc1_weight, Tensor fc2_weight, "
    "Tensor? probs, Tensor?[] fp8_weights, Tensor(a!)? fc1_main_grad, Tensor(b!)? fc2_main_grad, "
    "int activation, int recipe, bool need_dx, bool need_dw1, bool need_dw2, bool need_db1, "
    "bool need_db2, bool need_dprobs, bool release_saved, bool defer_wgrad=False, Tensor? x_scales=None, "
    "bool fc1_overwrite_main_grad=False, bool fc2_overwrite_main_grad=False) -> (Tensor dx, Tensor dw1, "
    "Tensor dw2, Tensor db1, Tensor db2, Tensor dprobs, Tensor made0, Tensor made1, Tensor made2, "
    "Tensor made3, Tensor made4, Tensor made5)";
inline constexpr char kWgradSchema[] =
    "mlp_wgrad(Tensor plan, Tensor[] wgrad_operands, Tensor fc1_weight, Tensor fc2_weight, "
    "Tensor(a!)? fc1_main_grad, Tensor(b!)? fc2_main_grad, int recipe, bool need_dw1, bool need_dw2, "
    "bool fc1_overwrite_main_grad=False, bool fc2_overwrite_main_grad=False) -> (Tensor dw1, Tensor dw2)";
inline constexpr char kAutogradSchema[] =
    "grouped_mlp(Tensor x, Tensor fc1_weight, Tensor fc2_weight, Tensor m_splits, Tensor? fc1_bias, "
    "Tensor? fc2_bias, Tensor? probs, int activation, int recipe, Tensor?[] fp8_weights, "
    "Tensor? x_scales=None, Tensor? dx_target=None) -> Tensor y";

namespace saved_bf16 { enum : size_t { kH, kA, kW1Bf16, kW2Bf16, kCount }; }
namespace saved_fp8 { enum : size_t { kQx, kSx, kH, kQaT, kSaT, kQw1T, kSw1T, kQw2T, kSw2T, kCount }; }
namespace made_bf16 { enum : size_t { kDh, kCount }; }
namespace made_fp8 { enum : size_t { kQdyT, kSdyT, kQdhT, kSdhT, kQxT, kSxT, kCount }; }
inline constexpr size_t kMadeCount = 6;
namespace wgrad_operands_bf16 { enum : size_t { kDy, kA, kDh, kX, kCount }; }
namespace wgrad_operands_fp8 { enum : size_t { kQdyT, kSdyT, kQaT, kSaT, kQdhT, kSdhT, kQxT, kSxT, kCount }; }
namespace fp8_weights { enum : size_t { kFc1Weight = 0, kFc2Weight = 4, kCount = 8 }; }

}  // namespace mlp

}  // namespace moegemm::api::contract
