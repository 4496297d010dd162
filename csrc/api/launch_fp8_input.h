// Launch helpers of the FP8-input path (issue 16), next to launch.h's: an FP8 x arrives as its row copy
// (q [T, K] e4m3 + 1x128 scales s [T, ceil(K/128)], quantize_act's row layout, as an FP8 dispatcher
// delivers it) and the per-expert column copy wgrad needs is made on the device from it.
#pragma once

#include "api/launch.h"

namespace moegemm::api {

// {q, s, qT, sT}: the given rows and, if `cols`, their per-expert column copy (dequantize, re-quantize in
// 128x1 blocks; else [0] placeholders). q, s checked and aligned; the caller holds a device guard.
Quantized run_requantize_cols(const Tensor& q, const Tensor& s, const Tensor& plan, bool cols);

}  // namespace moegemm::api
