#include "api/launch_fp8_input.h"

namespace moegemm::api {

Quantized run_requantize_cols(const Tensor& q, const Tensor& s, const Tensor& plan, bool cols) {
  const int E = num_experts(plan);
  const int64_t T = q.size(0), K = q.size(1);
  auto f8 = q.options().dtype(at::kFloat8_e4m3fn);
  auto f32 = q.options().dtype(at::kFloat);
  Quantized out{q, s, cols ? at::empty({K, col_capacity(T, E)}, f8) : at::empty({0}, f8),
                cols ? at::empty({block_capacity(T, E), K}, f32) : at::empty({0}, f32)};
  if (cols)
    requantize_cols(cbytes(q), s.data_ptr<float>(), T, K, E, plan.data_ptr<int32_t>(), bytes(out.qT),
                    out.sT.data_ptr<float>(), current_stream(q));
  return out;
}

}  // namespace moegemm::api
