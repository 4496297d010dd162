"""Plain-PyTorch reference of docs/design.md (operations, FP8 recipe, reference): the oracle of every test and the CPU fallback.

Its primitives have the same canonical layouts as the CUDA extension's, so the CUDA outputs can be compared
with it bitwise; ``moegemm/backends/reference.py`` builds the reference backend (the layer ops) from them:

* plan ``[3, E+1]`` int32 — row 0: token starts ``start_e`` (cumulative ``m_splits``); row 1: column
  starts of each expert in the transposed activation copy (segments padded to 16 tokens, so every
  segment is 16-byte aligned for TMA); row 2: first 128-token scale block of each expert.
* activation rows: ``q [T, K]`` e4m3, ``s [T, ceil(K/128)]`` fp32 (1×128 blocks), stored K-major
  (``layout.empty_row_scales``: strides ``(1, row_scale_pitch(T))``).
* activation columns: ``qT [K, col_capacity(T, E)]`` e4m3, expert ``e`` at columns
  ``[col_start_e, col_start_e + m_e)``; ``sT [block_capacity(T, E), K]`` fp32, expert ``e``'s 128×1
  blocks at rows ``[blk_start_e, blk_start_e + ceil(m_e/128))``. Entries outside the experts' regions
  are unspecified (the reference writes zeros).
* weights: ``q [E, N, K]``, ``s [E, ceil(N/128), ceil(K/128)]``, plus the transposed copies
  ``qT [E, K, N]``, ``sT [E, ceil(K/128), ceil(N/128)]`` used by dgrad.

Loops over experts are fine here: this module is exempt from the no-host-work rule of docs/design.md#plan.
"""

from __future__ import annotations

import torch

from .layout import (ACTIVATIONS, BLOCK, COL_ALIGN, GLU_ACTIVATIONS, block_capacity, ceil_div, col_capacity,  # noqa: F401
                     empty_row_scales)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


# ----------------------------------------------------------------------------------------------- plan
def make_plan(m_splits: torch.Tensor, T: int) -> torch.Tensor:
    """Offsets of every expert, from device (or CPU) counts, without reading them on the host.

    Each count is clamped to [0, T] before the sum (int64 values near 2**63 cannot wrap) and the running
    total to T, so that no kernel ever reads or writes out of bounds whatever the values (docs/design.md#errors, fast
    path). Tokens past the covered ones belong to no expert."""
    m = m_splits.to(torch.int64).clamp(min=0, max=T)
    zero = torch.zeros(1, dtype=torch.int64, device=m.device)
    tok = torch.cat([zero, m.cumsum(0)]).clamp(max=T)
    counts = tok[1:] - tok[:-1]
    col = torch.cat([zero, ((counts + COL_ALIGN - 1) // COL_ALIGN * COL_ALIGN).cumsum(0)])
    blk = torch.cat([zero, ((counts + BLOCK - 1) // BLOCK).cumsum(0)])
    return torch.stack([tok, col, blk]).to(torch.int32)


def _segments(plan: torch.Tensor):
    """Host copy of the plan, for the reference's per-expert loops."""
    tok, col, blk = plan.cpu().tolist()
    return [(tok[e], tok[e + 1] - tok[e], col[e], blk[e]) for e in range(len(tok) - 1)]


# ------------------------------------------------------------------------------------------ quantizer
def block_scale(amax: torch.Tensor) -> torch.Tensor:
    """Smallest power of two ≥ fl32(amax / 448), from the exponent bits (docs/design.md#fp8-recipe step 2).

    amax == 0 gives 1; a non-finite amax gives +inf, so that every value of the block dequantizes to
    NaN (0·inf or NaN) and nothing downstream is silently finite."""
    amax = amax.float()
    # A tensor divisor: torch's CUDA division by a Python scalar multiplies by its rounded reciprocal,
    # which is not fl32(amax / 448) (it differs at powers of two and in the subnormal range).
    r = amax / torch.full_like(amax, FP8_MAX)
    mant, exp = torch.frexp(r)
    exp = torch.where(mant == 0.5, exp - 1, exp)  # r is already a power of two
    scale = torch.ldexp(torch.ones_like(r), exp)
    scale = torch.where(amax == 0, torch.ones_like(r), scale)
    return torch.where(torch.isfinite(amax), scale, torch.full_like(r, float("inf")))


def _nan_amax(v: torch.Tensor, dim) -> torch.Tensor:
    return v.abs().amax(dim=dim)  # torch.amax propagates NaN


def _cast(v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3(v / scale), saturating at ±448 (NaN stays NaN). docs/design.md#fp8-recipe says |v / scale| <= 448 by
    construction, but when fl32(amax / 448) is subnormal (amax < 448 * 2^-126) it can round below
    amax / 448 and the quotient can pass 448; torch's cast would then give NaN, the kernels (cvt with
    satfinite) give ±448."""
    return (v / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_rows(x: torch.Tensor):
    """1×128 blocks along the last dim: ``[T, K] -> (q [T, K], s [T, ceil(K/128)])`` (s K-major)."""
    T, K = x.shape
    kb = ceil_div(K, BLOCK)
    xf = x.float()
    padded = torch.zeros(T, kb * BLOCK, dtype=torch.float32, device=x.device)
    padded[:, :K] = xf
    s = block_scale(_nan_amax(padded.view(T, kb, BLOCK), -1))  # [T, kb]
    q = _cast(padded.view(T, kb, BLOCK), s[..., None]).view(T, kb * BLOCK)[:, :K]
    return q.contiguous(), empty_row_scales(T, kb, x.device).copy_(s)


def quantize_cols(x: torch.Tensor, plan: torch.Tensor):
    """128×1 blocks within each expert's rows, written transposed: ``(qT [K, Wc], sT [NB, K])``."""
    T, K = x.shape
    E = plan.shape[1] - 1
    qT = torch.zeros(K, col_capacity(T, E), dtype=FP8, device=x.device)
    sT = torch.zeros(block_capacity(T, E), K, dtype=torch.float32, device=x.device)
    xf = x.float()
    for start, m, col, blk in _segments(plan):
        for i in range(ceil_div(m, BLOCK)):
            rows = xf[start + i * BLOCK: start + min((i + 1) * BLOCK, m)]  # [r, K]
            s = block_scale(_nan_amax(rows, 0))  # [K]
            qT[:, col + i * BLOCK: col + i * BLOCK + rows.shape[0]] = _cast(rows, s).t()
            sT[blk + i] = s
    return qT, sT


def covered_tokens(plan: torch.Tensor) -> int:
    """Tokens that belong to an expert (the rest, up to T, belong to none: device counts summing below T)."""
    return int(plan[0, -1])


def quantize_act(x: torch.Tensor, plan: torch.Tensor, rows: bool = True, cols: bool = True):
    """Multi-cast activation quantization: ``(q, s, qT, sT)``; the parts not asked for are None. The row
    copy of the tokens past the covered ones is zeros (bytes and scales), as the kernel writes it."""
    q, s = quantize_rows(x) if rows else (None, None)
    if rows:
        covered = covered_tokens(plan)
        q[covered:].view(torch.uint8).zero_()
        s[covered:] = 0
    qT, sT = quantize_cols(x, plan) if cols else (None, None)
    return q, s, qT, sT


def requantize_cols(q: torch.Tensor, s: torch.Tensor, plan: torch.Tensor):
    """The column copy of an FP8 input given as its row copy (``q [T, K]`` e4m3, ``s [T, ceil(K/128)]``,
    quantize_act's rows): dequantize (``q * s``, exact in fp32) and quantize again in per-expert 128×1
    blocks, ``(qT [K, Wc], sT [NB, K])`` as quantize_act's cols (the oracle of the CUDA requantize_cols).
    Double quantization: each value carries the error of its 1×128 row block and then of its 128×1 column
    block (tests/test_fp8_input.py states the total against float64)."""
    return quantize_cols(dequantize_rows(q, s).float(), plan)


def quantize_weight(w: torch.Tensor):
    """128×128 blocks per expert: ``(q [E,N,K], s [E,Nb,Kb], qT [E,K,N], sT [E,Kb,Nb])``."""
    E, N, K = w.shape
    nb, kb = ceil_div(N, BLOCK), ceil_div(K, BLOCK)
    padded = torch.zeros(E, nb * BLOCK, kb * BLOCK, dtype=torch.float32, device=w.device)
    padded[:, :N, :K] = w.float()
    blocks = padded.view(E, nb, BLOCK, kb, BLOCK)
    s = block_scale(_nan_amax(blocks, (2, 4)))  # [E, nb, kb]
    q = _cast(blocks, s[:, :, None, :, None]).view(E, nb * BLOCK, kb * BLOCK)[:, :N, :K].contiguous()
    return q, s, q.transpose(1, 2).contiguous(), s.transpose(1, 2).contiguous()


def quantize_weights(weights):
    """``quantize_weight`` of each weight: a list of its 4-tuples."""
    return [quantize_weight(w) for w in weights]


def quantize_weights_into(parts, counts, out) -> None:
    """``quantize_weight`` of each weight given as ``counts[i]`` consecutive ``parts`` (its rows, in order: the
    quantization of their concatenation along dim 1; every part but a weight's last a multiple of 128 rows, as the
    CUDA op requires), written into ``out``: four tensors per weight (q, s, qT, sT)."""
    if len(out) != 4 * len(counts) or sum(counts) != len(parts) or min(counts, default=1) < 1:
        raise ValueError(f"quantize_weights_into: {len(parts)} parts in counts {list(counts)} and {len(out)} outputs "
                         "(four per weight) disagree")
    start = 0
    for i, n in enumerate(counts):
        for j in range(start, start + n - 1):
            if parts[j].shape[1] % BLOCK:
                raise ValueError(f"quantize_weights_into: parts[{j}] has {parts[j].shape[1]} rows: every part but a "
                                 f"weight's last must have a multiple of {BLOCK}")
        w = torch.cat(list(parts[start:start + n]), 1) if n > 1 else parts[start]
        for j, (dst, src) in enumerate(zip(out[4 * i: 4 * i + 4], quantize_weight(w))):
            if dst.shape != src.shape or dst.dtype != src.dtype or dst.device != src.device:
                raise ValueError(f"quantize_weights_into: out[{4 * i + j}] must be {src.dtype} of shape "
                                 f"{tuple(src.shape)} on {src.device}, got {dst.dtype} {tuple(dst.shape)} on {dst.device}")
            dst.copy_(src)
        start += n


# --------------------------------------------------------------------------------------- dequantizers
def dequantize_rows(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    K = q.shape[-1]
    return q.double() * s.double().repeat_interleave(BLOCK, dim=-1)[..., :K]


def dequantize_cols(qT: torch.Tensor, sT: torch.Tensor, plan: torch.Tensor) -> torch.Tensor:
    """Back to token-major ``[T, K]`` float64."""
    K = qT.shape[0]
    segs = _segments(plan)
    T = segs[-1][0] + segs[-1][1] if segs else 0
    out = torch.zeros(T, K, dtype=torch.float64, device=qT.device)
    for start, m, col, blk in segs:
        if m == 0:
            continue
        nblk = ceil_div(m, BLOCK)
        s = sT[blk: blk + nblk].double().repeat_interleave(BLOCK, dim=0)[:m]  # [m, K]
        out[start: start + m] = qT[:, col: col + m].double().t() * s
    return out


def dequantize_weight(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    N, K = q.shape[-2:]
    full = s.double().repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)
    return q.double() * full[..., :N, :K]


# ---------------------------------------------------------------------------------------------- GEMMs
def _ragged_rows(a: torch.Tensor, b: torch.Tensor, plan: torch.Tensor, out_dtype, bias=None) -> torch.Tensor:
    """``out[t] = a[t] @ b[e(t)]ᵀ (+ bias[e(t)])`` in float64, rounded once; a ``[T, K]``, b ``[E, N, K]``;
    uncovered rows are zeros."""
    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float64, device=a.device)
    for e, (start, m, _, _) in enumerate(_segments(plan)):
        if m:
            out[start: start + m] = a[start: start + m] @ b[e].t()
            if bias is not None:
                out[start: start + m] += bias[e].double()
    return out.to(out_dtype)


def _ragged_reduction(a: torch.Tensor, b: torch.Tensor, plan: torch.Tensor, E: int) -> torch.Tensor:
    """``out[e] = a_eᵀ @ b_e`` in float64; a ``[T, N]``, b ``[T, K]``; empty experts give zeros."""
    out = torch.zeros(E, a.shape[1], b.shape[1], dtype=torch.float64, device=a.device)
    for e, (start, m, _, _) in enumerate(_segments(plan)):
        if m:
            out[e] = a[start: start + m].t() @ b[start: start + m]
    return out


def gemm_fp8_ragged_rows(qa, sa, qb, sb, plan, out_dtype=torch.bfloat16):
    """fprop (b = W) and dgrad (b = Wᵀ copy): row-quantized a times per-expert block-quantized b."""
    return gemm_fp8_fprop(qa, sa, qb, sb, plan, out_dtype, None)


def gemm_fp8_fprop(qa, sa, qb, sb, plan, out_dtype, bias):
    """A layer's FP8 forward GEMM: ``gemm_fp8_ragged_rows`` plus the per-expert ``bias`` [E, N] (or None), added
    before the one rounding to ``out_dtype``, as the CUDA kernel's epilogue adds it."""
    return _ragged_rows(dequantize_rows(qa, sa), dequantize_weight(qb, sb), plan, out_dtype, bias)


def gemm_fp8_ragged_reduction(qaT, saT, qbT, sbT, plan, out=None, out_dtype=torch.float32):
    """wgrad: ``dW[e] = a_eᵀ b_e`` from column-quantized a (dy) and b (x); out_dtype, or added to ``out``."""
    E = plan.shape[1] - 1
    res = _ragged_reduction(dequantize_cols(qaT, saT, plan), dequantize_cols(qbT, sbT, plan), plan, E)
    return _accumulate(res, out, out_dtype)


def gemm_bf16_fprop(x, w, plan):
    return _ragged_rows(x.double(), w.double(), plan, x.dtype)


def gemm_bf16_dgrad(dy, w, plan):
    return _ragged_rows(dy.double(), w.double().transpose(1, 2), plan, dy.dtype)


def gemm_bf16_wgrad(dy, x, plan, out=None, out_dtype=torch.float32):
    E = plan.shape[1] - 1
    return _accumulate(_ragged_reduction(dy.double(), x.double(), plan, E), out, out_dtype)


def _accumulate(res: torch.Tensor, out, out_dtype):
    if out is None:
        return res.to(out_dtype)
    out.add_(res.to(out.dtype))
    return out


# ----------------------------------------------------------------------------------------------- bias
def add_bias_(y: torch.Tensor, bias: torch.Tensor, plan: torch.Tensor) -> torch.Tensor:
    """``y[t] += bias[e(t)]`` in place over the covered tokens (rounded once to y's dtype)."""
    for e, (start, m, _, _) in enumerate(_segments(plan)):
        if m:
            y[start: start + m] = (y[start: start + m].float() + bias[e].float()).to(y.dtype)
    return y


def bias_grad(dy: torch.Tensor, plan: torch.Tensor) -> torch.Tensor:
    """``db[e] = Σ_{t ∈ e} dy[t]`` in fp32 ``[E, N]``, over the covered tokens; empty experts give zeros."""
    segs = _segments(plan)
    db = torch.zeros(len(segs), dy.shape[1], dtype=torch.float32, device=dy.device)
    for e, (start, m, _, _) in enumerate(segs):
        if m:
            db[e] = dy[start: start + m].float().sum(0)
    return db


# ------------------------------------------------------------------- expert-MLP activation (both paths)
def _act_and_grad(activation: str, g: torch.Tensor):
    """(act(g), act'(g)) in fp32; GLU variants use silu (swiglu) or exact GELU (geglu) on the gate."""
    if activation == "swiglu":
        sig = torch.sigmoid(g)
        return g * sig, sig * (1 + g * (1 - sig))
    if activation in ("geglu", "gelu"):
        cdf = 0.5 * (1 + torch.erf(g * 0.7071067811865476))
        return g * cdf, cdf + g * 0.3989422804014327 * torch.exp(-0.5 * g * g)
    if activation == "relu":  # clamp keeps NaN; the derivative at NaN is NaN too (never silently finite)
        return g.clamp_min(0), torch.where(g.isnan(), g, (g > 0).float())
    if activation == "squared_relu":
        r = g.clamp_min(0)
        return r * r, 2 * r
    raise ValueError(f"activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")


def _gate_up(h: torch.Tensor, activation: str):
    h = h.float()
    if activation in GLU_ACTIVATIONS:
        F = h.shape[1] // 2
        return h[:, :F], h[:, F:]
    return h, None


def act_forward(h, probs, activation: str) -> torch.Tensor:
    """``a = act(gate) (* up) * probs[:, None]`` in fp32 (Megatron's GLU layout: gate = h[:, :F])."""
    gate, up = _gate_up(h, activation)
    a = _act_and_grad(activation, gate)[0]
    if up is not None:
        a = a * up
    return a * probs.float()[:, None] if probs is not None else a


def act_backward(da, h, probs, activation: str):
    """``(dh [T, F1] fp32, dprobs [T] fp32 or None)`` for ``a = act_forward(h, probs)``."""
    gate, up = _gate_up(h, activation)
    act, dact = _act_and_grad(activation, gate)
    da = da.float()
    dpa = da * probs.float()[:, None] if probs is not None else da
    if up is not None:
        dh = torch.cat([dpa * up * dact, dpa * act], dim=1)
        pre = act * up
    else:
        dh, pre = dpa * dact, act
    dprobs = (da * pre).sum(1) if probs is not None else None
    return dh, dprobs


def act_bf16(h, probs, activation: str) -> torch.Tensor:
    """The bf16 recipe's activation: ``act_forward`` rounded to h's dtype."""
    return act_forward(h, probs, activation).to(h.dtype)


def act_backward_bf16(da, h, probs, activation: str):
    """``(dh in da's dtype, dprobs fp32 or None)``: ``act_backward`` with dh rounded."""
    dh, dprobs = act_backward(da, h, probs, activation)
    return dh.to(da.dtype), dprobs


def act_quantize(h, probs, activation: str, plan, rows: bool = True, cols: bool = True):
    """The fused kernel's contract: the multi-cast quantization of ``act_forward(h, probs)``."""
    return quantize_act(act_forward(h, probs, activation), plan, rows, cols)


def act_backward_quantize(da, h, probs, activation: str, plan, rows: bool = True, cols: bool = True):
    """``(q, s, qT, sT, dprobs)``: the multi-cast quantization of dh rounded to bf16 (as TransformerEngine
    quantizes its bf16 activation gradient), and dprobs from the fp32 values (None without probs)."""
    dh, dprobs = act_backward(da, h, probs, activation)
    if dprobs is not None:
        dprobs[covered_tokens(plan):] = 0  # tokens of no expert
    return (*quantize_act(dh.to(torch.bfloat16), plan, rows, cols), dprobs)
