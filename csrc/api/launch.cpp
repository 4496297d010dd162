#include "api/launch.h"

#include <ATen/record_function.h>

#include <algorithm>
#include <array>
#include <map>
#include <mutex>
#include <utility>

// Each launch shows in torch.profiler traces as a named range inside its op (no cost when not profiling).
#define MOEGEMM_RANGE(name) RECORD_FUNCTION(name, c10::ArrayRef<const c10::IValue>{})

namespace moegemm::api {

namespace {

int32_t* plan_ptr(const Tensor& plan) { return plan.data_ptr<int32_t>(); }

// 32-bit words (ZeroFill's unit) covering `bytes`.
int64_t words_of(size_t bytes) { return static_cast<int64_t>((bytes + sizeof(int32_t) - 1) / sizeof(int32_t)); }

// The counts a launch builds the plan from (none when undefined).
DeviceSplits device_splits(const Tensor& m_splits) {
  if (!m_splits.defined()) return {};
  return {m_splits.data_ptr(), m_splits.scalar_type() == at::kLong};
}

Quantized multicast_outputs(const Tensor& like, int64_t T, int64_t K, int E, bool rows, bool cols) {
  // the parts not asked for: [0] placeholders
  auto part = [&](bool wanted, int64_t d0, int64_t d1, at::ScalarType dtype) {
    return wanted ? empty({d0, d1}, dtype, like) : none_like(like, dtype);
  };
  return {part(rows, T, K, at::kFloat8_e4m3fn), rows ? empty_row_scales(T, ceil_div(K, kBlock), like) : none_like(like, at::kFloat),
          part(cols, K, col_capacity(T, E), at::kFloat8_e4m3fn), part(cols, block_capacity(T, E), K, at::kFloat)};
}

uint8_t* q_ptr(const Tensor& q, bool wanted) { return wanted ? bytes(q) : nullptr; }
float* s_ptr(const Tensor& s, bool wanted) { return wanted ? s.data_ptr<float>() : nullptr; }

}  // namespace

Tensor run_make_plan(const Tensor& m_splits, int64_t T) {
  Tensor plan = empty_plan(m_splits.numel(), m_splits);
  run_make_plan_into(m_splits, T, plan);
  return plan;
}

void run_make_plan_into(const Tensor& m_splits, int64_t T, const Tensor& plan) {
  MOEGEMM_RANGE("moegemm::run_make_plan");
  const int E = static_cast<int>(m_splits.numel());
  make_plan(m_splits.data_ptr(), m_splits.scalar_type() == at::kLong, E, T, plan.data_ptr<int32_t>(), current_stream(m_splits));
}

Tensor empty_plan(int64_t E, const Tensor& like) { return empty({3, E + 1}, at::kInt, like); }

namespace {
// The words of a workspace that a quantizer's launch zeroes (none when undefined).
ZeroFill zero_fill_of(const Tensor& zero) {
  if (!zero.defined()) return {};
  return {zero.data_ptr<int32_t>(), zero.numel()};
}
}  // namespace

Quantized run_quantize_act(const Tensor& x, DType dtype, const Tensor& plan, bool rows, bool cols, const Tensor& plan_from,
                           const Tensor& zero) {
  MOEGEMM_RANGE("moegemm::run_quantize_act");
  const int E = num_experts(plan);
  const int64_t T = x.size(0), K = x.size(1);
  Quantized out = multicast_outputs(x, T, K, E, rows, cols);
  quantize_act(x.data_ptr(), dtype, T, K, E, plan_ptr(plan), q_ptr(out.q, rows), s_ptr(out.s, rows), q_ptr(out.qT, cols),
               s_ptr(out.sT, cols), device_splits(plan_from), zero_fill_of(zero), current_stream(x));
  return out;
}

namespace {
Quantized weight_outputs(const Tensor& w, bool transposed) {
  const int64_t E = w.size(0), N = w.size(1), K = w.size(2);
  const int64_t Nb = ceil_div(N, kBlock), Kb = ceil_div(K, kBlock);
  return {empty({E, N, K}, at::kFloat8_e4m3fn, w), empty({E, Nb, Kb}, at::kFloat, w),
          transposed ? empty({E, K, N}, at::kFloat8_e4m3fn, w) : none_like(w, at::kFloat8_e4m3fn),
          transposed ? empty({E, Kb, Nb}, at::kFloat, w) : none_like(w, at::kFloat)};
}

WeightQuant weight_job(const Tensor& w, const Quantized& out, bool transposed) {
  return {w.data_ptr(), w.size(0), w.size(1), w.size(2), bytes(out.q), out.s.data_ptr<float>(),
          transposed ? bytes(out.qT) : nullptr, transposed ? out.sT.data_ptr<float>() : nullptr};
}

// Launches n jobs in order, consecutive jobs of one input dtype together (kMaxWeightsPerLaunch at most); the plan,
// when one is asked for, is built by the first launch.
void launch_weight_jobs(const WeightQuant* jobs, const DType* dtypes, int n, const PlanBuild& build, cudaStream_t stream) {
  int start = 0;
  for (int i = 1; i <= n; ++i) {
    if (i < n && i - start < kMaxWeightsPerLaunch && dtypes[i] == dtypes[start]) continue;
    quantize_weights(jobs + start, i - start, dtypes[start], start == 0 ? build : PlanBuild{}, stream);
    start = i;
  }
}
}  // namespace

Quantized run_quantize_weight(const Tensor& w, DType dtype, bool transposed) {
  return run_quantize_weights({{w, dtype}}, transposed, {}).front();
}

std::vector<Quantized> run_quantize_weights(std::initializer_list<WeightIn> weights, bool transposed, const PlanOut& plan) {
  MOEGEMM_RANGE("moegemm::run_quantize_weights");
  TORCH_CHECK(weights.size() >= 1 && weights.size() <= kMaxWeightsPerLaunch, "moegemm: run_quantize_weights: 1 to ",
              kMaxWeightsPerLaunch, " weights");
  std::vector<Quantized> out;
  std::array<WeightQuant, kMaxWeightsPerLaunch> jobs;
  std::array<DType, kMaxWeightsPerLaunch> dtypes;
  for (const WeightIn& in : weights) {
    out.push_back(weight_outputs(in.w, transposed));
    jobs[out.size() - 1] = weight_job(in.w, out.back(), transposed);
    dtypes[out.size() - 1] = in.dtype;
  }
  PlanBuild build;
  if (plan.m_splits.defined()) {
    const DeviceSplits from = device_splits(plan.m_splits);
    build = {from.m_splits, from.m_is_int64, num_experts(plan.plan), plan.T, plan_ptr(plan.plan)};
  }
  launch_weight_jobs(jobs.data(), dtypes.data(), static_cast<int>(weights.size()), build,
                     current_stream(weights.begin()->w));
  return out;
}

void run_quantize_weight_parts(const std::vector<WeightPart>& parts) {
  MOEGEMM_RANGE("moegemm::run_quantize_weight_parts");
  if (parts.empty()) return;
  std::vector<WeightQuant> jobs;
  std::vector<DType> dtypes;
  for (const WeightPart& part : parts) {
    WeightQuant job = weight_job(part.in.w, part.out, true);
    job.rows = part.rows;
    job.row0 = part.row0;
    jobs.push_back(job);
    dtypes.push_back(part.in.dtype);
  }
  launch_weight_jobs(jobs.data(), dtypes.data(), static_cast<int>(jobs.size()), PlanBuild{},
                     current_stream(parts.front().in.w));
}

Quantized run_requantize_cols(const Tensor& q, const Tensor& s, const Tensor& plan, const Tensor& zero) {
  MOEGEMM_RANGE("moegemm::run_requantize_cols");
  const int E = num_experts(plan);
  const int64_t T = q.size(0), K = q.size(1);
  Tensor qT = empty({K, col_capacity(T, E)}, at::kFloat8_e4m3fn, q), sT = empty({block_capacity(T, E), K}, at::kFloat, q);
  requantize_cols(cbytes(q), s.data_ptr<float>(), T, K, E, plan_ptr(plan), bytes(qT), sT.data_ptr<float>(), zero_fill_of(zero),
                  current_stream(q));
  return {Tensor(), Tensor(), qT, sT};
}

Quantized run_act_quantize(const Tensor& h, const Tensor& probs, Activation act, const Tensor& plan, bool rows, bool cols) {
  MOEGEMM_RANGE("moegemm::run_act_quantize");
  const int E = num_experts(plan);
  const int64_t T = h.size(0), F = act_width(h, act);
  Quantized out = multicast_outputs(h, T, F, E, rows, cols);
  act_quantize(h.data_ptr(), probs_ptr(probs), act, T, F, E, plan_ptr(plan), q_ptr(out.q, rows), s_ptr(out.s, rows),
               q_ptr(out.qT, cols), s_ptr(out.sT, cols), current_stream(h));
  return out;
}

Quantized run_act_backward_quantize(const Tensor& da, const Tensor& h, const Tensor& probs, Activation act,
                                    const Tensor& plan, bool rows, bool cols, Tensor& dprobs_partial) {
  MOEGEMM_RANGE("moegemm::run_act_backward_quantize");
  const int E = num_experts(plan);
  const int64_t T = da.size(0), F = act_width(h, act), F1 = h.size(1);
  const float* p = probs_ptr(probs);
  Quantized out = multicast_outputs(da, T, F1, E, rows, cols);
  dprobs_partial = empty({p != nullptr ? T : 0, ceil_div(F1, kBlock)}, at::kFloat, da);
  act_backward_quantize(da.data_ptr(), h.data_ptr(), p, act, T, F, E, plan_ptr(plan), q_ptr(out.q, rows), s_ptr(out.s, rows),
                        q_ptr(out.qT, cols), s_ptr(out.sT, cols), p != nullptr ? dprobs_partial.data_ptr<float>() : nullptr,
                        current_stream(da));
  return out;
}

Tensor run_act_bf16(const Tensor& h, const Tensor& probs, Activation act) {
  MOEGEMM_RANGE("moegemm::run_act_bf16");
  const int64_t T = h.size(0), F = act_width(h, act);
  Tensor a = empty({T, F}, h.scalar_type(), h);
  act_bf16(h.data_ptr(), probs_ptr(probs), act, T, F, a.data_ptr(), current_stream(h));
  return a;
}

Tensor run_act_backward_bf16(const Tensor& da, const Tensor& h, const Tensor& probs, Activation act, Tensor& dprobs_partial) {
  MOEGEMM_RANGE("moegemm::run_act_backward_bf16");
  const int64_t T = da.size(0), F = act_width(h, act);
  const float* p = probs_ptr(probs);
  Tensor dh = empty(h.sizes(), h.scalar_type(), h);
  dprobs_partial = empty({p != nullptr ? T : 0, ceil_div(F, kActBf16Cols)}, at::kFloat, da);
  act_backward_bf16(da.data_ptr(), h.data_ptr(), p, act, T, F, dh.data_ptr(), p != nullptr ? dprobs_partial.data_ptr<float>() : nullptr,
                    current_stream(da));
  return dh;
}

namespace {
// A tile counter for a ragged-row GEMM launched with none from its caller: the current stream's, zeroed once (the
// GEMM leaves it zero, and launches on one stream never overlap), so the GEMM needs no launch before it to zero it;
// while the stream captures a CUDA graph, a fresh one zeroed in the graph (replays may run beside eager work on
// the stream).
Tensor stream_tile_counter(const Tensor& like) {
  const int64_t words = words_of(gemm_fp8_ragged_rows_workspace_size());
  const cudaStream_t stream = current_stream(like);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) {
    const cudaError_t error = cudaGetLastError();  // (cleared, so that no later check reports it)
    TORCH_CHECK(false, "moegemm: cudaStreamIsCapturing failed: ", cudaGetErrorString(error));
  }
  if (capture != cudaStreamCaptureStatusNone) return empty({words}, at::kInt, like).zero_();
  static std::mutex mutex;
  static auto* counters = new std::map<std::pair<int, cudaStream_t>, Tensor>();  // kept to the end of the process
  const std::lock_guard<std::mutex> lock(mutex);
  Tensor& counter = (*counters)[{like.get_device(), stream}];
  if (!counter.defined()) counter = empty({words}, at::kInt, like).zero_();
  return counter;
}
}  // namespace

Tensor run_gemm_fp8_ragged_rows(const Tensor& qa, const Tensor& sa, const Tensor& qb, const Tensor& sb, const Tensor& plan,
                             int tiling, const Tensor& bias, const Tensor& counter) {
  MOEGEMM_RANGE("moegemm::run_gemm_fp8_ragged_rows");
  const int E = num_experts(plan);
  const int64_t T = qa.size(0), K = qa.size(1), N = qb.size(1);
  Tensor out = empty({T, N}, at::kBFloat16, qa);
  if (T == 0) return out;
  const Tensor ws = counter.defined() ? counter : stream_tile_counter(qa);  // (the raw op)
  const ExpertBias b{bias.defined() ? bias.data_ptr() : nullptr, bias.defined() && bias.scalar_type() == at::kFloat};
  gemm_fp8_ragged_rows({plan_ptr(plan), E, T, N, K, out.data_ptr()}, {cbytes(qa), sa.data_ptr<float>()},
                    {cbytes(qb), sb.data_ptr<float>()}, b, tiling, ws.data_ptr(), current_stream(qa));
  return out;
}

Tensor run_gemm_fp8_ragged_rows_quantize_a(const Tensor& x, const Tensor& m_splits, const Tensor& plan, const Tensor& qb,
                                        const Tensor& sb, const Tensor& bias, Quantized& rows, const GemmWorkspaces& ws) {
  MOEGEMM_RANGE("moegemm::run_gemm_fp8_ragged_rows_quantize_a");
  const int E = num_experts(plan);
  const int64_t T = x.size(0), K = x.size(1), N = qb.size(1);
  const Tensor qa = empty({T, K}, at::kFloat8_e4m3fn, x), sa = empty_row_scales(T, ceil_div(K, kBlock), x);
  Tensor out = empty({T, N}, at::kBFloat16, x);
  const ExpertBias b{bias.defined() ? bias.data_ptr() : nullptr, bias.defined() && bias.scalar_type() == at::kFloat};
  const DeviceSplits from = device_splits(m_splits);
  TORCH_CHECK(ws.claims.defined(), "moegemm: internal: the one-launch forward without its claim words");
  gemm_fp8_ragged_rows_quantize_a({from.m_splits, from.m_is_int64, E, T, plan_ptr(plan)}, x.data_ptr(), N, K, out.data_ptr(),
                               bytes(qa), sa.data_ptr<float>(), {cbytes(qb), sb.data_ptr<float>()}, b, zero_fill_of(ws.words),
                               ws.claims.data_ptr(), current_stream(x));
  rows = {qa, sa, Tensor(), Tensor()};
  return out;
}

Tensor run_fprop(const Tensor& x, const Quantized* fp8_x, const Tensor& plan, const Tensor& plan_from, const Tensor& qb,
                 const Tensor& sb, const Tensor& bias, Quantized& qx, const GemmWorkspaces& ws) {
  const int64_t T = x.size(0), K = x.size(1);
  if (fp8_x != nullptr) {
    if (plan_from.defined()) run_make_plan_into(plan_from, T, plan);
    qx = *fp8_x;
  } else if (T > 0 && gemm_fp8_ragged_rows_quantize_a_preferred(T, K)) {
    return run_gemm_fp8_ragged_rows_quantize_a(x, plan_from, plan, qb, sb, bias, qx, ws);
  } else {
    qx = run_quantize_act(x, DType::kBF16, plan, true, false, plan_from, ws.words);
  }
  return run_gemm_fp8_ragged_rows(qx.q, qx.s, qb, sb, plan, -1, bias, ws.counter);
}

namespace {
WgradOut wgrad_out(const Tensor& out, bool accumulate) {
  if (out.scalar_type() != at::kFloat) return WgradOut::kBF16;
  return accumulate ? WgradOut::kF32Accumulate : WgradOut::kF32;
}

// A wgrad workspace of `bytes` in 32-bit words (ZeroFill's unit).
Tensor wgrad_workspace(size_t bytes, const Tensor& like) {
  return empty({static_cast<int64_t>((bytes + sizeof(int32_t) - 1) / sizeof(int32_t))}, at::kInt, like);
}
}  // namespace

namespace {
// The bytes of a wgrad workspace on the default choice. The output kind changes only CUTLASS's size (a choice of
// MOEGEMM_FP8_WGRAD): the larger of the two.
size_t fp8_wgrad_workspace_bytes(const Tensor& plan) {
  RaggedReduction p{};
  p.E = num_experts(plan), p.out_kind = WgradOut::kF32;
  const size_t f32 = gemm_fp8_ragged_reduction_workspace_size(p, {});
  p.out_kind = WgradOut::kBF16;
  return std::max(f32, gemm_fp8_ragged_reduction_workspace_size(p, {}));
}
}  // namespace

Tensor fp8_wgrad_workspace(bool wanted, const Tensor& plan) {
  if (!wanted) return Tensor();
  return wgrad_workspace(fp8_wgrad_workspace_bytes(plan), plan);
}

GemmWorkspaces gemm_workspaces(bool wgrad, const Tensor& plan, bool claims) {
  GemmWorkspaces ws;
  const int64_t wgrad_words = wgrad ? words_of(fp8_wgrad_workspace_bytes(plan)) : 0;
  const int64_t total = wgrad_words + words_of(gemm_fp8_ragged_rows_workspace_size());
  const int64_t claim_words = claims ? words_of(gemm_fp8_ragged_rows_quantize_a_workspace_size()) : 0;
  // (the wgrad workspace first: CUTLASS's part of it wants the allocation's alignment; the claims last, not zeroed)
  const Tensor all = empty({total + claim_words}, at::kInt, plan);
  ws.words = all.narrow(0, 0, total);
  if (claims) ws.claims = all.narrow(0, total, claim_words);
  if (wgrad) ws.wgrad = ws.words.narrow(0, 0, wgrad_words);
  ws.counter = ws.words.narrow(0, wgrad_words, total - wgrad_words);
  return ws;
}

GemmWorkspaces stream_workspaces(const Tensor& like) {
  GemmWorkspaces ws;
  ws.counter = stream_tile_counter(like);
  return ws;
}

void run_gemm_fp8_ragged_reduction(const Tensor& qaT, const Tensor& saT, const Tensor& qbT, const Tensor& sbT, const Tensor& plan,
                           const Tensor& out, bool accumulate, GemmChoice choice, const Tensor& zeroed) {
  MOEGEMM_RANGE("moegemm::run_gemm_fp8_ragged_reduction");
  const int E = num_experts(plan);
  const int64_t N = qaT.size(0), K = qbT.size(0), cols = qaT.size(1), blocks = saT.size(0);
  into_aligned(out, [&](const Tensor& o) {
    const WgradOut kind = wgrad_out(o, accumulate);
    const RaggedReduction p{plan_ptr(plan), E, N, K, /*T=*/0, cols, blocks, o.data_ptr(), kind};
    const size_t size = gemm_fp8_ragged_reduction_workspace_size(p, choice);
    Tensor ws = zeroed;
    if (ws.defined()) {
      TORCH_CHECK(ws.nbytes() >= size, "moegemm: internal: the wgrad workspace has ", num(int64_t(ws.nbytes())),
                  " bytes, the GEMM needs ", num(int64_t(size)));
    } else {
      ws = wgrad_workspace(size, qaT).zero_();
    }
    gemm_fp8_ragged_reduction(p, {cbytes(qaT), saT.data_ptr<float>()}, {cbytes(qbT), sbT.data_ptr<float>()}, choice, ws.data_ptr(),
                      current_stream(qaT));
  });
}

Tensor run_gemm_bf16_ragged_rows(const Tensor& a, const Tensor& w, const Tensor& plan, bool dgrad) {
  MOEGEMM_RANGE("moegemm::run_gemm_bf16_ragged_rows");
  const int E = num_experts(plan);
  const int64_t T = a.size(0), N = w.size(1), K = w.size(2);
  // out [T, N_out] with reduction K_red: fprop out = a w[e]^T (N_out = N), dgrad out = a w[e] (N_out = K)
  const int64_t n_out = dgrad ? K : N, k_red = dgrad ? N : K;
  Tensor out = empty({T, n_out}, a.scalar_type(), a);
  if (T == 0) return out;
  Tensor ws = workspace(gemm_bf16_ragged_rows_workspace_size(E, dgrad), a);
  gemm_bf16_ragged_rows({plan_ptr(plan), E, T, n_out, k_red, out.data_ptr()}, a.data_ptr(), w.data_ptr(), dgrad, ws.data_ptr(),
                     current_stream(a));
  return out;
}

void run_gemm_bf16_wgrad(const Tensor& dy, const Tensor& x, const Tensor& plan, const Tensor& out, bool accumulate) {
  MOEGEMM_RANGE("moegemm::run_gemm_bf16_wgrad");
  const int E = num_experts(plan);
  const int64_t T = dy.size(0), N = dy.size(1), K = x.size(1);
  into_aligned(out, [&](const Tensor& o) {
    const WgradOut kind = wgrad_out(o, accumulate);
    Tensor ws = workspace(gemm_bf16_ragged_reduction_workspace_size(E, kind), dy);
    gemm_bf16_ragged_reduction({plan_ptr(plan), E, N, K, T, /*cols=*/0, /*blocks=*/0, o.data_ptr(), kind}, dy.data_ptr(), x.data_ptr(),
                       ws.data_ptr(), current_stream(dy));
  });
}

void run_add_bias(const Tensor& y, const Tensor& bias, const Tensor& plan) {
  MOEGEMM_RANGE("moegemm::run_add_bias");
  const int E = num_experts(plan);
  const int64_t T = y.size(0), N = y.size(1);
  into_aligned(y, [&](const Tensor& o) {
    add_bias(o.data_ptr(), bias.data_ptr(), bias.scalar_type() == at::kFloat, plan_ptr(plan), E, T, N, current_stream(y));
  });
}

Tensor run_bias_grad(const Tensor& dy, const Tensor& plan) {
  MOEGEMM_RANGE("moegemm::run_bias_grad");
  const int E = num_experts(plan);
  const int64_t T = dy.size(0), N = dy.size(1);
  Tensor db = empty({E, N}, at::kFloat, dy);
  Tensor partial = empty({bias_grad_workspace_floats(T, E, N)}, at::kFloat, dy);
  bias_grad(dy.data_ptr(), plan_ptr(plan), E, T, N, db.data_ptr<float>(), partial.data_ptr<float>(), current_stream(dy));
  return db;
}

Tensor run_sum_rows(const Tensor& partial) {
  MOEGEMM_RANGE("moegemm::run_sum_rows");
  const int64_t rows = partial.size(0), cols = partial.size(1);
  Tensor out = empty({rows}, at::kFloat, partial);
  sum_rows(partial.data_ptr<float>(), rows, cols, out.data_ptr<float>(), current_stream(partial));
  return out;
}

}  // namespace moegemm::api
