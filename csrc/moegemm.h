// moegemm's torch-free C++ interface: everything the binding (csrc/binding.cpp) calls.
//
// All pointers are device pointers; every function only enqueues work on `stream` (no host sync,
// no allocation). Layouts are the canonical ones of moegemm/reference.py. Errors are thrown as
// std::runtime_error before anything is launched where they can be detected on the host.
#pragma once

#include <cuda_runtime.h>
#include <cstddef>
#include <cstdint>

namespace moegemm {

constexpr int kBlock = 128;       // FP8 scaling block (1x128, 128x1, 128x128)
constexpr int kColAlign = 32;     // per-expert token padding of the transposed activation copy (32-byte sectors)
static_assert(kColAlign % 16 == 0 && kBlock % kColAlign == 0, "the quantizers store whole 16-byte chunks of a 128-token tile");
constexpr int kDimAlign = 16;     // N and K of every GEMM (hidden, ffn): 16-byte FP8 rows, the quantizers' 16-wide vectors
constexpr int kMaxExperts = 1024; // one thread per expert in the plan kernel
constexpr int64_t kMaxPlanValue = 2147483647;  // plan entries are int32: T + 31*E (col_capacity) must fit
constexpr int kPtrAlign = 16;     // every tensor's data pointer: TMA and 16-byte vector loads/stores

enum class DType : int { kBF16 = 0, kF16 = 1, kF32 = 2 };

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The 1x128 row scales of an FP8 row copy q [T, K] are stored K-major: the scale of token t in K block kb at
// s[kb * row_scale_pitch(T) + t], so that an M tile's 128 rows of one K block are 512 contiguous bytes (one
// coalesced load per stage in the GEMM, coalesced stores in the quantizers). As a torch tensor: shape
// [T, Kb], strides (1, pitch). The pitch is T rounded up to 4: each K block's row starts 16-byte aligned.
constexpr int kRowScaleAlign = 4;
constexpr int64_t row_scale_pitch(int64_t T) { return (T + kRowScaleAlign - 1) / kRowScaleAlign * kRowScaleAlign; }
inline int64_t col_capacity(int64_t T, int64_t E) { return ceil_div(T + (kColAlign - 1) * E, kColAlign) * kColAlign; }
inline int64_t block_capacity(int64_t T, int64_t E) { return (T + (kBlock - 1) * E) / kBlock; }
// The most tokens a plan of E experts holds: col_capacity(T, E) <= kMaxPlanValue exactly when T <= max_plan_tokens(E).
inline int64_t max_plan_tokens(int64_t E) { return kMaxPlanValue / kColAlign * kColAlign - (kColAlign - 1) * E; }

// What a plan may address (the device-side check plan_fits, csrc/kernels/plan/plan.cuh): tok[E] <= tok,
// col[E] <= col, blk[E] <= blk; kNoLimit where the caller's buffers set no bound of that kind.
constexpr int64_t kNoLimit = 0x7fffffffffffffffLL;
struct PlanLimits {
  int64_t tok, col, blk;
};

// plan [3, E+1] int32: token starts, padded column starts, 128-token scale-block starts.
// Each count is clamped to [0, T] before the prefix sum, and the running total to T (whatever the
// device values). Tokens past the covered ones (plan[0][E] <= T) belong to no expert: the ragged-row
// GEMMs write zeros there. Needs 1 <= E <= kMaxExperts and col_capacity(T, E) <= kMaxPlanValue.
void make_plan(const void* m_splits, bool m_is_int64, int E, int64_t T, int32_t* plan, cudaStream_t stream);
// Device counts of E experts (int32 or int64) that a quantizer builds its plan from (m_splits == nullptr: none).
struct DeviceSplits {
  const void* m_splits = nullptr;
  bool m_is_int64 = false;
};
// The same plan built inside another launch (quantize_weights: one more CTA; quantize_act: by its CTAs;
// gemm_fp8_ragged_rows_quantize_a: its first CTA), with the same requirements. Built only when the counts are given:
// without them (m_splits null) nothing is built, and a launch that reads a plan (the fused GEMM) reads plan as an
// earlier launch on the stream left it.
struct PlanBuild {
  const void* m_splits = nullptr;
  bool m_is_int64 = false;
  int E = 0;
  int64_t T = 0;
  int32_t* plan = nullptr;
};

// Words a quantizer's launch zeroes besides its outputs (none when count is 0): the workspace of the wgrad GEMM
// launched after it on the stream (gemm_fp8_ragged_reduction needs it zeroed), which then needs no launch of its own to zero it.
// A quantizer with nothing to quantize (T = 0, no outputs) launches no kernel and zeroes them with a memset.
struct ZeroFill {
  int32_t* words = nullptr;
  int64_t count = 0;
};

// Multi-cast activation quantization of x [T, K] in one launch. Either output pair may be null.
//   rows: q [T, K] e4m3, s [T, ceil(K/128)] (K-major, row_scale_pitch)
//   cols: qT [K, col_capacity] e4m3, sT [block_capacity, K]
// With plan_from.m_splits set, `plan` is built from those counts first (else only read): by the quantizer's
// own CTAs where its form allows (16-bit x), else by make_plan's kernel before it. `zero`: see ZeroFill.
void quantize_act(const void* x, DType dtype, int64_t T, int64_t K, int E, int32_t* plan,
                  uint8_t* q, float* s, uint8_t* qT, float* sT, DeviceSplits plan_from, ZeroFill zero, cudaStream_t stream);

// The column copy of an FP8 input given as its row copy (q [T, K] e4m3 with 1x128 scales s [T, ceil(K/128)],
// quantize_act's row layout (K-major scales), e.g. from an FP8 dispatcher): each value is dequantized (q * s, exact in fp32)
// and quantized again in per-expert 128x1 blocks, written as quantize_act's cols (qT [K, col_capacity],
// sT [block_capacity, K]), over a plan built earlier on the stream. `zero`: see ZeroFill.
void requantize_cols(const uint8_t* q, const float* s, int64_t T, int64_t K, int E, const int32_t* plan, uint8_t* qT,
                     float* sT, ZeroFill zero, cudaStream_t stream);

// Activations of the expert MLP. GLU variants read fc1's output h [T, 2F] as Megatron lays it out:
// gate = h[:, :F], up = h[:, F:]; the others read h [T, F].
enum class Activation : int { kSwiglu = 0, kGeglu = 1, kGelu = 2, kRelu = 3, kSquaredRelu = 4 };
inline bool is_glu(Activation a) { return a == Activation::kSwiglu || a == Activation::kGeglu; }

// Fused: a = act(gate) (* up) * probs[t] (probs may be null), then the multi-cast quantization of
// a [T, F] exactly as quantize_act would quantize it (outputs as for quantize_act, either pair null).
void act_quantize(const void* h_bf16, const float* probs, Activation act, int64_t T, int64_t F, int E,
                  const int32_t* plan, uint8_t* q, float* s, uint8_t* qT, float* sT, cudaStream_t stream);

// Fused backward: from da [T, F] (bf16) and h, dh [T, F1] (F1 = 2F for GLU, else F) is quantized like
// quantize_act (either pair null). If probs is given, dprobs_partial [T, ceil(F1/128)] receives per-row
// partial sums of da * act(gate) (* up) (sum over its columns to get dprobs).
void act_backward_quantize(const void* da_bf16, const void* h_bf16, const float* probs, Activation act, int64_t T,
                           int64_t F, int E, const int32_t* plan, uint8_t* q, float* s, uint8_t* qT, float* sT,
                           float* dprobs_partial, cudaStream_t stream);

// bf16 recipe, the same activations without quantization (bf16 out, fp32 math):
//   act_bf16: a [T, F] = act(gate) (* up) * probs[t];
//   act_backward_bf16: dh [T, F1] from da [T, F] and h, reading each input once for both GLU halves; if
//   probs is given, dprobs_partial [T, ceil(F/256)] receives per-row partial sums of da * act(gate) (* up).
void act_bf16(const void* h_bf16, const float* probs, Activation act, int64_t T, int64_t F, void* a_bf16,
              cudaStream_t stream);
void act_backward_bf16(const void* da_bf16, const void* h_bf16, const float* probs, Activation act, int64_t T,
                       int64_t F, void* dh_bf16, float* dprobs_partial, cudaStream_t stream);
constexpr int kActBf16Cols = 256;  // columns per dprobs partial sum (one warp, 8 per lane)

// 128x128-block weight quantization of w [E, N, K]: q [E,N,K], s [E,Nb,Kb], qT [E,K,N], sT [E,Kb,Nb]
// (qT and sT both null: no transposed copy, for a forward without dgrad). A part of a larger weight (rows > 0):
// w holds rows [row0, row0 + N) of a weight of `rows` rows per expert, whose four copies the outputs are, so
// that weights kept apart (a gate and an up projection) are quantized as their concatenation without making
// it; row0 is a multiple of kBlock.
struct WeightQuant {
  const void* w;
  int64_t E, N, K;
  uint8_t* q;
  float* s;
  uint8_t* qT;
  float* sT;
  int64_t rows = 0, row0 = 0;  // rows 0: the whole weight (N)
};
// Up to kMaxWeightsPerLaunch weights (or parts) of one dtype quantized in one launch (a layer's weights, or an
// expert MLP's gate, up and down projections), and the plan built by one more CTA when plan.plan is set (a
// forward's first launch then needs no make_plan).
constexpr int kMaxWeightsPerLaunch = 3;
void quantize_weights(const WeightQuant* weights, int count, DType dtype, const PlanBuild& plan, cudaStream_t stream);

// Per-expert bias over the plan's covered tokens (rows past them are left alone), by 128-token blocks:
//   add_bias: y[t, n] += bias[e(t), n], y bf16 [T, N], bias bf16 or fp32 [E, N] (bias_is_f32);
//   bias_grad: db[e, n] = sum of dy[t, n] over the expert's tokens, fp32 [E, N], in a fixed order
//   (bitwise reproducible, no atomics; empty experts get zeros). partial: bias_grad_workspace_floats.
void add_bias(void* y_bf16, const void* bias, bool bias_is_f32, const int32_t* plan, int E, int64_t T, int64_t N,
              cudaStream_t stream);
inline int64_t bias_grad_workspace_floats(int64_t T, int64_t E, int64_t N) { return block_capacity(T, E) * N; }
void bias_grad(const void* dy_bf16, const int32_t* plan, int E, int64_t T, int64_t N, float* db, float* partial,
               cudaStream_t stream);
// out[r] = in[r, 0] + in[r, 1] + ... (left to right), in fp32 [rows, cols]: the dprobs partial sums.
void sum_rows(const float* in, int64_t rows, int64_t cols, float* out, cudaStream_t stream);

// Writes exact zeros into out[e] (bytes_per_expert bytes each) for every expert with no tokens (wgrad
// of an empty expert gets no GEMM tiles, see docs/design.md#plan).
// A plan that does not fit `limits` counts as the plan of no tokens: every out[e] is zeroed.
void zero_empty_experts(const int32_t* plan, int E, PlanLimits limits, int64_t bytes_per_expert, void* out,
                        cudaStream_t stream);

// ---- the SM budget: moegemm's persistent kernels (the grouped GEMMs, the multi-cast quantizer) spread over at most
// `sms` SMs of the device (0: every SM), leaving the others to kernels on other streams (an all-to-all's). Process-wide,
// read at each launch (a captured CUDA graph keeps the budget of its capture); a budget above the device's SM count is
// refused at the launch.
void set_sm_budget(int sms);  // sms >= 0

// ---- grouped GEMMs. A problem travels as one struct; `workspace` (the device-built arguments of the
// CUTLASS kernels, or the tile counter of moegemm's sm90 ragged reduction) has the size the matching
// *_workspace_size returns (0: none needed); gemm_fp8_ragged_reduction's is zeroed by the caller (by the ZeroFill of the
// quantizer launched before it, or by a fill of its own).

// An FP8 operand: e4m3 bytes and their fp32 block scales.
struct Fp8Operand {
  const uint8_t* q;
  const float* s;
};

// Ragged rows (fprop, dgrad): out [T, N] bf16; the rows of expert e get a_e times expert e's weight,
// the rows past the covered tokens zeros.
//   FP8:  a = (qa [T, K], 1x128 scales [T, Kb] K-major), b = (qb [E, N, K], 128x128 scales [E, Nb, Kb]),
//         out = a_e qb[e]^T; dgrad passes the W^T copy with N and K swapped.
//   bf16: a [T, K]; fprop b = w [E, N, K] (out = a_e w[e]^T); dgrad b = w [E, K, N] (out = a_e w[e]).
struct RaggedRows {
  const int32_t* plan;
  int E;
  int64_t T, N, K;
  void* out;
};

// Where a weight gradient goes: fp32 written or accumulated (Megatron's main_grad), or bf16 written.
enum class WgradOut : int { kF32 = 0, kF32Accumulate = 1, kBF16 = 2 };

// Ragged reduction (wgrad): out [E, N, K], per expert the sum over its tokens of dy_t^T x_t. Experts
// without tokens get zeros, or their accumulator is left as it is: moegemm's sm90 kernel does it in its
// tiles; CUTLASS's kernels get no tiles for them (a zero-length reduction hangs or misbehaves there) and
// zero_empty_experts writes the zeros.
//   FP8:  the per-expert column copies of quantize_act: a = dy (qT [N, cols], sT [blocks, N]),
//         b = x (qT [K, cols], sT [blocks, K]); cols = col_capacity, blocks = block_capacity.
//   bf16: a = dy [T, N], b = x [T, K].
struct RaggedReduction {
  const int32_t* plan;
  int E;
  int64_t N, K;
  int64_t T;              // bf16: tokens
  int64_t cols, blocks;   // FP8: the capacities of the column copies
  void* out;
  WgradOut out_kind;
};

// A per-expert bias [E, N] (fp32 or bf16; none when data is null), added to a ragged-row GEMM's fp32 result
// before it is rounded to bf16: out[t] = a_t qb[e]^T + bias[e].
struct ExpertBias {
  const void* data = nullptr;
  bool f32 = false;
};

// The FP8 ragged-row GEMM (fprop, dgrad) runs on moegemm's own persistent sm90 kernel
// (csrc/kernels/gemm/sm90/) with the tiling heuristics.h picks (tiling < 0) or the one at that index of its
// table (kRaggedRowsTilings). workspace: gemm_fp8_ragged_rows_workspace_size bytes, zeroed before the launch (the
// kernel's tile walk draws from a counter that starts at 0) and zero again after it: launches one after the other
// on a stream may share it.
int num_ragged_rows_tilings();  // the size of that table
size_t gemm_fp8_ragged_rows_workspace_size();
void gemm_fp8_ragged_rows(const RaggedRows& p, Fp8Operand a, Fp8Operand b, ExpertBias bias, int tiling, void* workspace,
                       cudaStream_t stream);
// The same GEMM on a bf16 x [plan.T, K] in one launch, with the tiling heuristics.h picks: its CTAs first build the
// plan of plan.m_splits into plan.plan (make_plan's, for the kernels after it too; m_splits null: plan.plan was built
// by an earlier launch on the stream, e.g. quantize_weights') and x's FP8 row copy into qa [T, K] and sa
// (quantize_act's bytes on the rows the plan covers; the rows past them, which quantize_act zeroes, are quantized
// too and never read), then run the GEMM out [T, N] with a = (qa, sa). The CTAs claim that work off counters in
// `workspace` (gemm_fp8_ragged_rows_quantize_a_workspace_size bytes, of any contents): none waits for a CTA that a
// kernel on another stream keeps from starting. Needs T >= 1 and make_plan's
// requirements. `zero`: words that the launch zeroes too, for the GEMMs after it (their tile counters), or none.
size_t gemm_fp8_ragged_rows_quantize_a_workspace_size();
void gemm_fp8_ragged_rows_quantize_a(const PlanBuild& plan, const void* x, int64_t N, int64_t K, void* out, uint8_t* qa,
                                  float* sa, Fp8Operand b, ExpertBias bias, ZeroFill zero, void* workspace,
                                  cudaStream_t stream);
// Whether to take that one launch for an x of T x K values: where csrc/kernels/gemm/heuristics.h finds it faster
// and MOEGEMM_ONE_LAUNCH_FORWARD (read once, csrc/env_flag.h)
// is not off.
bool gemm_fp8_ragged_rows_quantize_a_preferred(int64_t T, int64_t K);
// The FP8 ragged reduction (wgrad) runs on the choice of heuristics.h, CUTLASS's ptr-array kernel, or
// moegemm's own sm90 kernel with heuristics.h's tiling or the one at that index of kRaggedReductionTilings.
enum class GemmKernel : int { kDefault = 0, kCutlass = 1, kSm90 = 2 };
struct GemmChoice {
  GemmKernel kernel = GemmKernel::kDefault;
  int tiling = -1;
};
int num_ragged_reduction_tilings();
size_t gemm_fp8_ragged_reduction_workspace_size(const RaggedReduction& p, GemmChoice choice);
// workspace: zeroed before the launch (the sm90 kernel's tile walk draws from a counter that starts at 0).
void gemm_fp8_ragged_reduction(const RaggedReduction& p, Fp8Operand a, Fp8Operand b, GemmChoice choice, void* workspace,
                       cudaStream_t stream);
size_t gemm_bf16_ragged_rows_workspace_size(int E, bool dgrad);
void gemm_bf16_ragged_rows(const RaggedRows& p, const void* a, const void* b, bool dgrad, void* workspace,
                        cudaStream_t stream);
size_t gemm_bf16_ragged_reduction_workspace_size(int E, WgradOut out);
void gemm_bf16_ragged_reduction(const RaggedReduction& p, const void* a, const void* b, void* workspace, cudaStream_t stream);

}  // namespace moegemm
