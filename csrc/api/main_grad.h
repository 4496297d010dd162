// Megatron's gradient-accumulation fusion seen from C++: a weight's `main_grad` attribute and its
// `overwrite_main_grad` flag, which live on the weight's Python object. The layers' C++ autograd nodes
// (autograd.cpp) read them when backward runs, as the Python shells do, so a main_grad set or replaced
// between forward and backward is the one used.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace moegemm::api {

struct MainGradAttributes {
  std::optional<at::Tensor> main_grad;  // getattr(weight, "main_grad", None); nullopt when absent or None
  bool overwrite = false;               // bool(getattr(weight, "overwrite_main_grad", False)) with a main_grad
};

// Both attributes in one GIL-held read (none when no Python runs). A main_grad that is not a tensor is a
// TypeError naming `name`; its dtype, shape and device are the entries' to check (main_grad_input).
// overwrite_main_grad is Megatron-FSDP's flag: the gradient written into main_grad instead of added to it.
MainGradAttributes main_grad_attributes(const at::Tensor& weight, const char* name);

}  // namespace moegemm::api
