// The primitive ops: one kernel of csrc/moegemm.h each, checked (primitives.cpp). Registered in
// csrc/binding.cpp for tests and benchmarks; the layers' path is layers.h.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>
#include <vector>

namespace moegemm::api {

using at::Tensor;
using Quad = std::tuple<Tensor, Tensor, Tensor, Tensor>;

Tensor make_plan_op(const Tensor& m_splits, int64_t T);
Quad quantize_act_op(const Tensor& x, const Tensor& plan, bool rows, bool cols);
// The per-expert column copy (qT, sT) of an FP8 row copy x [T, K] with its 1x128 row scales x_scales (quantize_act's
// rows, scales in any strides), as quantize_act(x dequantized, plan, false, true) would make it.
std::tuple<Tensor, Tensor> requantize_cols_op(const Tensor& x, const Tensor& x_scales, const Tensor& plan);
Quad quantize_weight_op(const Tensor& w);
// quantize_weight of each weight (on one device), flattened: four tensors per weight; a layer's two weights in
// one launch (the FP8 weight cache's refresh).
std::vector<Tensor> quantize_weights_op(at::TensorList ws);
// The same into existing copies (out: q, s, qT, sT per weight), each weight given as counts[i] parts, its row
// ranges in order (all but the last a multiple of 128 rows): quantized as their concatenation without making it.
void quantize_weights_into_op(at::TensorList parts, at::IntArrayRef counts, at::TensorList out);
Quad act_quantize_op(const Tensor& h, const std::optional<Tensor>& probs, int64_t activation, const Tensor& plan, bool rows,
                     bool cols);
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> act_backward_quantize_op(const Tensor& da, const Tensor& h,
                                                                            const std::optional<Tensor>& probs,
                                                                            int64_t activation, const Tensor& plan,
                                                                            bool rows, bool cols);
Tensor act_bf16_op(const Tensor& h, const std::optional<Tensor>& probs, int64_t activation);
std::tuple<Tensor, Tensor> act_backward_bf16_op(const Tensor& da, const Tensor& h, const std::optional<Tensor>& probs,
                                                int64_t activation);
// tiling: -1 the heuristic's (csrc/kernels/gemm/heuristics.h), else an index of heuristics.h's kRaggedRowsTilings.
Tensor gemm_fp8_ragged_rows_op(const Tensor& qa, const Tensor& sa, const Tensor& qb, const Tensor& sb, const Tensor& plan,
                            int64_t tiling);
// kernel: 0 the default (heuristics.h), 1 CUTLASS's ptr-array kernel, 2 moegemm's own sm90 kernel; tiling (sm90):
// -1 the heuristic's, else an index of heuristics.h's kRaggedReductionTilings.
Tensor gemm_fp8_ragged_reduction_op(const Tensor& qaT, const Tensor& saT, const Tensor& qbT, const Tensor& sbT, const Tensor& plan,
                            at::ScalarType out_dtype, int64_t kernel, int64_t tiling);
void gemm_fp8_ragged_reduction_accumulate_op(const Tensor& qaT, const Tensor& saT, const Tensor& qbT, const Tensor& sbT,
                                     const Tensor& plan, const Tensor& out, int64_t kernel, int64_t tiling);
Tensor gemm_bf16_fprop_op(const Tensor& x, const Tensor& w, const Tensor& plan);
Tensor gemm_bf16_dgrad_op(const Tensor& dy, const Tensor& w, const Tensor& plan);
Tensor gemm_bf16_wgrad_op(const Tensor& dy, const Tensor& x, const Tensor& plan, at::ScalarType out_dtype);
void gemm_bf16_wgrad_accumulate_op(const Tensor& dy, const Tensor& x, const Tensor& plan, const Tensor& out);
void add_bias_op(const Tensor& y, const Tensor& bias, const Tensor& plan);
Tensor bias_grad_op(const Tensor& dy, const Tensor& plan);

}  // namespace moegemm::api
