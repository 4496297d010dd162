// What every entry of the C++ API layer shares: argument checks (TORCH_CHECK -> RuntimeError naming the
// argument), the 16-byte alignment rule, allocation with the caching allocator and the current stream.
//
// Error messages format numbers with num() and shapes with shape(), never by writing a number to an
// iostream: on the GPU machine that crashed inside this extension (a C++ runtime mismatch with the
// loaded libstdc++), turning every such error into a segfault (tests/test_adversarial_ops.py calls
// every check).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>

#include "moegemm.h"

namespace moegemm::api {

using at::Tensor;

// The two recipes of the layer entries (moegemm/layout.py: RECIPE_IDS).
enum class Recipe : int { kBf16 = 0, kFp8Blockwise = 1 };
Recipe to_recipe(int64_t recipe);

// Numbers reach error messages as strings: streaming an at::IntArrayRef into a TORCH_CHECK message crashed the
// extension (segfault) on the GPU machine's torch 2.11.
std::string num(int64_t v);
std::string nums(at::IntArrayRef v);  // "[a, b, ...]"
std::string shape(const Tensor& t);
std::string strides(const Tensor& t);

cudaStream_t current_stream(const Tensor& t);

bool is_aligned(const Tensor& t);
// t itself, or an aligned contiguous copy when its data pointer is not 16-byte aligned.
Tensor aligned(const Tensor& t);

// Runs `fn` on out itself when it is 16-byte aligned, else on an aligned copy that is copied back after.
template <class Fn>
void into_aligned(const Tensor& out, Fn&& fn) {
  if (is_aligned(out)) return fn(out);
  Tensor tmp = out.clone(at::MemoryFormat::Contiguous);
  fn(tmp);
  out.copy_(tmp);
}

// On like's (CUDA) device, `dim` dims, contiguous.
void check_placement(const Tensor& t, const char* name, int64_t dim, const Tensor& like);
// check_placement and the dtype.
void check(const Tensor& t, const char* name, at::ScalarType dtype, int64_t dim, const Tensor& like);
// A checked input, 16-byte aligned.
Tensor input(const Tensor& t, const char* name, at::ScalarType dtype, int64_t dim, const Tensor& like);

DType to_dtype(const Tensor& t, const char* name);
int num_experts(const Tensor& plan);
// An N or K: a positive multiple of kDimAlign. Here and in check_num_experts `what` followed by `what_more` names
// the value in errors (the message is built only on failure).
void check_dim_aligned(int64_t v, const char* what, const char* what_more = "");
void check_num_experts(int64_t E, const char* what, const char* what_more = "");
// m_splits as the ops take it: a 1-d int32 or int64 tensor on like's device.
void check_splits(const Tensor& m_splits, const Tensor& like);
// T tokens fit a plan of E experts (int32 entries): 0 <= T <= max_plan_tokens(E).
void check_plan_tokens(int64_t T, int64_t E);
// A weight [E, N, K] named `name` in errors: E in [1, kMaxExperts], N and K positive multiples of kDimAlign (the message
// is built only on failure).
void check_weight_shape(const Tensor& w, const char* name);

Activation to_activation(int64_t activation);
// F of an activation over h [T, F1]: F1 = 2F for GLU activations.
int64_t act_width(const Tensor& h, Activation act);
// probs [T] fp32, aligned; an undefined tensor when absent.
Tensor probs_input(const std::optional<Tensor>& probs, int64_t T, const Tensor& like);
const float* probs_ptr(const Tensor& probs);

uint8_t* bytes(const Tensor& t);
const uint8_t* cbytes(const Tensor& t);

// Allocation on like's device with the caching allocator, without a dispatcher round trip.
Tensor empty(at::IntArrayRef sizes, at::ScalarType dtype, const Tensor& like);
Tensor workspace(size_t size, const Tensor& like);
// The placeholder for an output or saved slot that is not needed: shape [0], so its fake is static.
Tensor none_like(const Tensor& like, at::ScalarType dtype);

// 1x128 row scales [T, Kb] fp32 in their K-major layout (csrc/moegemm.h: row_scale_pitch): strides (1, pitch).
Tensor empty_row_scales(int64_t T, int64_t Kb, const Tensor& like);
// Row scales of T rows and Kb K blocks given from outside (an FP8 input's, a raw op's): checked (device, dtype,
// shape; any strides), then s itself when it has the K-major layout and is 16-byte aligned, else a copy in it.
Tensor row_scales_input(const Tensor& s, const char* name, int64_t T, int64_t Kb, const Tensor& like);

// A wgrad target: fp32 (written or accumulated) or bf16 (written), [E, N, K] on like's device.
void check_wgrad_out(const Tensor& out, const Tensor& like, bool accumulate);
Tensor new_wgrad(int64_t E, int64_t N, int64_t K, at::ScalarType dtype, const Tensor& like);

// Drops t now. With free_storage, also frees its memory (back to the caching allocator, ordered on the
// current stream) even while the caller's argument list still refers to it: for saved tensors that
// autograd handed over to a backward entry and that nothing else uses.
void release(Tensor& t, bool free_storage);

}  // namespace moegemm::api
