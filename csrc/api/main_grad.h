// Megatron's gradient-accumulation fusion seen from C++: a weight's `main_grad` attribute (and its
// `overwrite_main_grad` flag), which live on the weight's Python object. The layers' C++ autograd nodes (autograd.cpp) read it when backward runs,
// as the Python shells do, so a main_grad set or replaced between forward and backward is the one used.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace moegemm::api {

// getattr(weight, "main_grad", None) under the GIL: nullopt when absent or None (or when no Python runs);
// a value that is not a tensor is a TypeError naming `name`. Its dtype, shape and device are the entries'
// to check (main_grad_input).
std::optional<at::Tensor> main_grad_attribute(const at::Tensor& weight, const char* name);
// bool(getattr(weight, "overwrite_main_grad", False)) under the GIL (false when no Python runs): Megatron-FSDP's
// flag, the gradient written into main_grad instead of added to it.
bool overwrite_main_grad_attribute(const at::Tensor& weight);

}  // namespace moegemm::api
