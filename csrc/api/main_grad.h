// Megatron's gradient-accumulation fusion seen from C++: a weight's `main_grad` attribute and its
// `overwrite_main_grad` flag, which live on the weight's Python object. The layers' C++ autograd nodes
// (autograd.cpp) read them when backward runs, as the Python shells do, so a main_grad set or replaced
// between forward and backward is the one used.
#pragma once

#include <ATen/ATen.h>

namespace moegemm::api {

// Where a weight's gradient goes besides a fresh dw: its main_grad [E, N, K] fp32 (undefined if none), added to, or
// written over with `overwrite` (the weight's overwrite_main_grad: Megatron-FSDP's flag, as Transformer Engine
// reads it).
struct MainGrad {
  at::Tensor tensor;
  bool overwrite = false;
};

// getattr(weight, "main_grad", None) and bool(getattr(weight, "overwrite_main_grad", False)) in one GIL-held read
// (none when absent or None, or when no Python runs). A main_grad that is not a tensor is a TypeError naming
// `name`; its dtype, shape and device are the entries' to check (main_grad_input).
MainGrad main_grad_attributes(const at::Tensor& weight, const char* name);

}  // namespace moegemm::api
