// The one registration file: moegemm's ops with the PyTorch dispatcher (TORCH_LIBRARY), so that autograd,
// torch.compile and CUDA graphs see ordinary ops. Three families:
//   - the differentiable layer ops, one per layer with its C++ autograd node (csrc/api/autograd.h): the
//     layers' path;
//   - the layer entries, one op per layer and direction (csrc/api/layers.h), which those nodes run (and
//     the split backward's Python Functions);
//   - the primitives, one kernel each (csrc/api/primitives.h): for tests and benchmarks.
// Every schema is declared once in Python: the layer ops' in moegemm/backends/contract.py (api/layer_contract.h is
// generated from it), the primitives' with their fakes in moegemm/backends/primitives.py, which the schemas spelled
// out below must equal (tests/test_contract.py, tests/test_primitive_contract.py). The fakes are registered by
// moegemm/backends/fakes.py.
#include <torch/library.h>

#include "api/autograd.h"
#include "api/layer_contract.h"
#include "api/layers.h"
#include "api/primitives.h"
#include "moegemm.h"

namespace moegemm::api {

TORCH_LIBRARY(moegemm, m) {
  // layer entries (recipe: 0 bf16, 1 fp8_blockwise; activation: csrc/moegemm.h Activation); their schemas
  // are declared once in moegemm/backends/contract.py (api/layer_contract.h is generated from it)
  m.def(contract::linear::kAutogradSchema);
  m.def(contract::mlp::kAutogradSchema);
  m.def(contract::linear::kFwdSchema);
  m.def(contract::linear::kBwdSchema);
  m.def(contract::linear::kWgradSchema);
  m.def(contract::mlp::kFwdSchema);
  m.def(contract::mlp::kBwdSchema);
  m.def(contract::mlp::kWgradSchema);
  // primitives: as declared in moegemm/backends/primitives.py (schema and fake; tests/test_primitive_contract.py)
  m.def("make_plan(Tensor m_splits, int T) -> Tensor");
  m.def("quantize_act(Tensor x, Tensor plan, bool rows, bool cols) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("requantize_cols(Tensor x, Tensor x_scales, Tensor plan) -> (Tensor, Tensor)");
  m.def("quantize_weight(Tensor w) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("quantize_weights(Tensor[] weights) -> Tensor[]");
  m.def("quantize_weights_into(Tensor[] parts, int[] counts, Tensor(a!)[] out) -> ()");
  m.def("act_quantize(Tensor h, Tensor? probs, int activation, Tensor plan, bool rows, bool cols) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("act_backward_quantize(Tensor da, Tensor h, Tensor? probs, int activation, Tensor plan, bool rows, bool cols) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("act_bf16(Tensor h, Tensor? probs, int activation) -> Tensor");
  m.def("act_backward_bf16(Tensor da, Tensor h, Tensor? probs, int activation) -> (Tensor, Tensor)");
  m.def("gemm_fp8_ragged_rows(Tensor qa, Tensor sa, Tensor qb, Tensor sb, Tensor plan, int tiling=-1) -> Tensor");
  m.def("gemm_fp8_ragged_reduction(Tensor qaT, Tensor saT, Tensor qbT, Tensor sbT, Tensor plan, ScalarType out_dtype, int kernel=0, int tiling=-1) -> Tensor");
  m.def("gemm_fp8_ragged_reduction_accumulate(Tensor qaT, Tensor saT, Tensor qbT, Tensor sbT, Tensor plan, Tensor(a!) out, int kernel=0, int tiling=-1) -> ()");
  m.def("gemm_bf16_fprop(Tensor x, Tensor w, Tensor plan) -> Tensor");
  m.def("gemm_bf16_dgrad(Tensor dy, Tensor w, Tensor plan) -> Tensor");
  m.def("gemm_bf16_wgrad(Tensor dy, Tensor x, Tensor plan, ScalarType out_dtype) -> Tensor");
  m.def("gemm_bf16_wgrad_accumulate(Tensor dy, Tensor x, Tensor plan, Tensor(a!) out) -> ()");
  m.def("add_bias_(Tensor(a!) y, Tensor bias, Tensor plan) -> ()");
  m.def("bias_grad(Tensor dy, Tensor plan) -> Tensor");
  // the SM budget of the persistent kernels (moegemm/sm_budget.py; no tensors: one kernel for every backend)
  m.def("set_sm_budget(int sms) -> ()", [](int64_t sms) { ::moegemm::set_sm_budget(static_cast<int>(sms)); });
}

// The differentiable layer ops: their node for tensors in autograd, the forward alone for the rest.
TORCH_LIBRARY_IMPL(moegemm, Autograd, m) {
  m.impl("grouped_linear", &grouped_linear_autograd);
  m.impl("grouped_mlp", &grouped_mlp_autograd);
}

TORCH_LIBRARY_IMPL(moegemm, CUDA, m) {
  m.impl("grouped_linear", &grouped_linear);
  m.impl("grouped_mlp", &grouped_mlp);
  m.impl("linear_fwd", &linear_fwd);
  m.impl("linear_bwd", &linear_bwd);
  m.impl("mlp_fwd", &mlp_fwd);
  m.impl("mlp_bwd", &mlp_bwd);
  m.impl("linear_wgrad", &linear_wgrad);
  m.impl("mlp_wgrad", &mlp_wgrad);
  m.impl("make_plan", &make_plan_op);
  m.impl("quantize_act", &quantize_act_op);
  m.impl("requantize_cols", &requantize_cols_op);
  m.impl("quantize_weight", &quantize_weight_op);
  m.impl("quantize_weights", &quantize_weights_op);
  m.impl("quantize_weights_into", &quantize_weights_into_op);
  m.impl("act_quantize", &act_quantize_op);
  m.impl("act_backward_quantize", &act_backward_quantize_op);
  m.impl("act_bf16", &act_bf16_op);
  m.impl("act_backward_bf16", &act_backward_bf16_op);
  m.impl("gemm_fp8_ragged_rows", &gemm_fp8_ragged_rows_op);
  m.impl("gemm_fp8_ragged_reduction", &gemm_fp8_ragged_reduction_op);
  m.impl("gemm_fp8_ragged_reduction_accumulate", &gemm_fp8_ragged_reduction_accumulate_op);
  m.impl("gemm_bf16_fprop", &gemm_bf16_fprop_op);
  m.impl("gemm_bf16_dgrad", &gemm_bf16_dgrad_op);
  m.impl("gemm_bf16_wgrad", &gemm_bf16_wgrad_op);
  m.impl("gemm_bf16_wgrad_accumulate", &gemm_bf16_wgrad_accumulate_op);
  m.impl("add_bias_", &add_bias_op);
  m.impl("bias_grad", &bias_grad_op);
}

}  // namespace moegemm::api
