// The probs gradient of an expert MLP's activation backward: the per-row sums of the partial sums its kernels write
// (act_backward_bf16, act_backward_quantize: one per row and column block), one thread per row, in column order.
#include "moegemm.h"
#include "kernels/common/cuda_check.h"

namespace moegemm {
namespace {

constexpr int kThreads = 128;

__global__ void sum_rows_kernel(const float* in, int64_t rows, int64_t cols, float* out) {
  const int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  const float* row = in + r * cols;
  float sum = 0.f;
  for (int64_t c = 0; c < cols; ++c) sum += row[c];
  out[r] = sum;
}

}  // namespace

void sum_rows(const float* in, int64_t rows, int64_t cols, float* out, cudaStream_t stream) {
  if (rows == 0) return;
  sum_rows_kernel<<<static_cast<unsigned>(ceil_div(rows, kThreads)), kThreads, 0, stream>>>(in, rows, cols, out);
  check_launch("sum_rows");
}

}  // namespace moegemm
