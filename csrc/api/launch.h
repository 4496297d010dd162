// One kernel of csrc/moegemm.h each: allocate its outputs (sizes from T, E, N, K only) and enqueue it on
// the current stream. The arguments are already checked and 16-byte aligned, and the caller holds a
// device guard: the primitives (primitives.cpp) and the layer entries (grouped_linear.cpp,
// grouped_mlp.cpp) check first, then call these.
#pragma once

#include <initializer_list>
#include <vector>

#include "api/common.h"

namespace moegemm::api {

// The multi-cast copies of a [T, K] tensor: rows q [T, K] + s [T, ceil(K/128)] (K-major), columns (per-expert
// transposed) qT [K, col_capacity] + sT [block_capacity, K]; the parts not asked for have shape [0].
// Weights use the same four slots: q [E,N,K], s [E,Nb,Kb], qT [E,K,N], sT [E,Kb,Nb].
struct Quantized {
  Tensor q, s, qT, sT;
};

// The plan [3, E+1] int32 of m_splits [E] (int32 or int64) for T tokens: made by its own launch (run_make_plan),
// or allocated by empty_plan and built inside the launch of the forward's first quantizer: the weights' (a
// PlanOut) or x's (plan_from: the checked m_splits; undefined: the plan is only read).
Tensor run_make_plan(const Tensor& m_splits, int64_t T);
void run_make_plan_into(const Tensor& m_splits, int64_t T, const Tensor& plan);  // into an empty_plan's buffer
Tensor empty_plan(int64_t E, const Tensor& like);
struct PlanOut {
  Tensor m_splits;  // undefined: no plan to build
  int64_t T = 0;
  Tensor plan;
};
// zero: a wgrad workspace (fp8_wgrad_workspace) that the launch zeroes too, or undefined.
Quantized run_quantize_act(const Tensor& x, DType dtype, const Tensor& plan, bool rows, bool cols,
                           const Tensor& plan_from = {}, const Tensor& zero = {});
// {q, s, qT, sT} of w [E, N, K]; without `transposed`, qT and sT are [0] placeholders (not written).
Quantized run_quantize_weight(const Tensor& w, DType dtype, bool transposed);
// The same for a layer's weights (one or two), quantized in one launch when their dtypes agree, which also
// builds `plan` when it names one (one launch fewer in a forward that quantizes its weights).
struct WeightIn {
  Tensor w;
  DType dtype;
};
std::vector<Quantized> run_quantize_weights(std::initializer_list<WeightIn> weights, bool transposed, const PlanOut& plan);
// Into existing copies: weights given as parts (row ranges of a weight kept in separate tensors), each part
// written into the copies (q, s, qT, sT) of its whole weight from row row0 (a multiple of 128) of `rows`; up to
// kMaxWeightsPerLaunch parts of one dtype per launch.
struct WeightPart {
  WeightIn in;
  int64_t rows, row0;
  Quantized out;
};
void run_quantize_weight_parts(const std::vector<WeightPart>& parts);
// The per-expert column copy of an FP8 row copy (q [T, K] e4m3 + s [T, ceil(K/128)], quantize_act's row layout: an
// FP8 x as a dispatcher delivers it, or the one a forward saved of a bf16 x), made from the rows (dequantize,
// re-quantize in 128x1 blocks): {[undefined], [undefined], qT, sT}.
Quantized run_requantize_cols(const Tensor& q, const Tensor& s, const Tensor& plan, const Tensor& zero = {});

// a = act(h) * probs, quantized like quantize_act (probs may be undefined).
Quantized run_act_quantize(const Tensor& h, const Tensor& probs, Activation act, const Tensor& plan, bool rows, bool cols);
// dh from da and h, quantized like quantize_act; dprobs_partial [T or 0, ceil(F1/128)] fp32.
Quantized run_act_backward_quantize(const Tensor& da, const Tensor& h, const Tensor& probs, Activation act,
                                    const Tensor& plan, bool rows, bool cols, Tensor& dprobs_partial);
Tensor run_act_bf16(const Tensor& h, const Tensor& probs, Activation act);
// dh [T, F1] bf16; dprobs_partial [T or 0, ceil(F/256)] fp32.
Tensor run_act_backward_bf16(const Tensor& da, const Tensor& h, const Tensor& probs, Activation act, Tensor& dprobs_partial);

// The words that one launch zeroes for the GEMMs after it (a quantizer's `zero`): the wgrad workspace of
// fp8_wgrad_workspace (when wanted) first, then the tile counter of the ragged-row GEMMs (gemm_fp8_ragged_rows's
// workspace: each GEMM leaves it zero, so the GEMMs one after the other on the stream share it), so that those GEMMs
// need no launch of their own to zero them. A forward's workspaces also hold the one-launch forward's claim words
// (`claims`), in the same allocation but past the zeroed words.
struct GemmWorkspaces {
  Tensor words;    // the zeroed words, all of them (undefined: none)
  Tensor wgrad;    // undefined unless wanted
  Tensor counter;  // one word
  Tensor claims;   // gemm_fp8_ragged_rows_quantize_a's workspace, any contents (undefined unless wanted)
};
GemmWorkspaces gemm_workspaces(bool wgrad, const Tensor& plan, bool claims = false);
// The workspaces of GEMMs with no launch of ours before them to zero a counter (an FP8 x's forward): the current
// stream's tile counter (stream_tile_counter), nothing else.
GemmWorkspaces stream_workspaces(const Tensor& like);

// out [T, N] bf16 = qa [T, K] · qb [E, N, K]ᵀ (+ bias [E, N], fp32 or bf16, added before the rounding),
// blockwise scaled (fprop; dgrad with the Wᵀ copy), with the tiling heuristics.h picks unless `tiling` (>= 0)
// names one. counter: its tile counter, zero at launch (gemm_workspaces', or stream_workspaces'), else the current
// stream's.
Tensor run_gemm_fp8_ragged_rows(const Tensor& qa, const Tensor& sa, const Tensor& qb, const Tensor& sb, const Tensor& plan,
                             int tiling = -1, const Tensor& bias = Tensor(), const Tensor& counter = Tensor());
// The same on a bf16 x [T >= 1, K] in one launch that first builds `plan` from m_splits (undefined: `plan` was built
// by an earlier launch) and x's FP8 row copy (`rows`: q, s) with the GEMM's own CTAs, and zeroes ws.words; its
// claim words are ws.claims (gemm_workspaces with claims).
Tensor run_gemm_fp8_ragged_rows_quantize_a(const Tensor& x, const Tensor& m_splits, const Tensor& plan, const Tensor& qb,
                                        const Tensor& sb, const Tensor& bias, Quantized& rows, const GemmWorkspaces& ws);
// A layer's FP8 forward GEMM out = x_e qb[e]ᵀ (+ bias) with x's FP8 row copy in qx (q, s; the column copy is made in
// backward, from this row copy), the plan built from plan_from's counts when defined: an FP8 x given as its row copy
// (fp8_x), or a bf16 x quantized first; where the heuristics prefer it (gemm_fp8_ragged_rows_quantize_a_preferred),
// quantized and multiplied in one launch (run_gemm_fp8_ragged_rows_quantize_a, which builds the plan too). `ws`: the words
// zeroed by x's quantizer or the one launch (gemm_workspaces with the claims); with fp8_x, stream_workspaces.
Tensor run_fprop(const Tensor& x, const Quantized* fp8_x, const Tensor& plan, const Tensor& plan_from, const Tensor& qb,
                 const Tensor& sb, const Tensor& bias, Quantized& qx, const GemmWorkspaces& ws);
// out [E, N, K] (fp32 = or +=, bf16 =) from the column copies qaT [N, Wc] (dy) and qbT [K, Wc] (x), on the
// kernel and tiling heuristics.h picks unless `choice` names them. Its workspace: `zeroed` when given
// (fp8_wgrad_workspace, sized for the default choice and zeroed by the quantizer launched before it), else one
// allocated and zeroed here.
void run_gemm_fp8_ragged_reduction(const Tensor& qaT, const Tensor& saT, const Tensor& qbT, const Tensor& sbT, const Tensor& plan,
                           const Tensor& out, bool accumulate, GemmChoice choice = {}, const Tensor& zeroed = {});
// The workspace of a wgrad GEMM on the default choice (run_gemm_fp8_ragged_reduction's `zeroed`), allocated before the
// quantizer that makes the GEMM's last operand so that its launch zeroes it (run_quantize_act's or
// run_requantize_cols' `zero`): the GEMM then needs no launch of its own for it. Undefined unless `wanted`.
Tensor fp8_wgrad_workspace(bool wanted, const Tensor& plan);
// bf16 recipe: fprop y [T, N] = a [T, K] w[e]ᵀ, or dgrad (dgrad = true) dx [T, K] = a [T, N] w[e].
Tensor run_gemm_bf16_ragged_rows(const Tensor& a, const Tensor& w, const Tensor& plan, bool dgrad);
// bf16 recipe: out [E, N, K] (fp32 = or +=, bf16 =) dy_eᵀ x_e.
void run_gemm_bf16_wgrad(const Tensor& dy, const Tensor& x, const Tensor& plan, const Tensor& out, bool accumulate);

// y [T, N] bf16 += bias[e(t)] in place over the covered tokens; bias [E, N] fp32 or bf16.
void run_add_bias(const Tensor& y, const Tensor& bias, const Tensor& plan);
// db [E, N] fp32, per-expert sums of dy [T, N] in a fixed order.
Tensor run_bias_grad(const Tensor& dy, const Tensor& plan);
// [rows] fp32: each row of partial [rows, cols] fp32 summed left to right (dprobs from its partial sums).
Tensor run_sum_rows(const Tensor& partial);

}  // namespace moegemm::api
