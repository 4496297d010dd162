"""DeepGEMM (github.com/deepseek-ai/DeepGEMM) as an expert-MLP peer of the suite (bench/peers/interface.py):
the MLP every peer computes (fc1 -> silu(gate) * up * probs -> fc2, forward and backward) composed from
DeepGEMM's public Python API, written the way its users must write it on Hopper (SM90):

- ``m_splits`` is read on the host (``.tolist()``, the one sync of every call; everything else that the
  host sizes shape is derived on the device from the same counts): DeepGEMM's wgrad takes host
  sizes, and every expert's rows are padded to a multiple of 128 (its contiguous layout), so the padded
  total sizes the buffers;
- the tokens are gathered once into a zero-padded buffer, the whole MLP runs in that layout (the router
  probs of the padding rows are 0) and the outputs are gathered back;
- quantization in torch ops (bench/peers/deepgemm.py's quantizers, E4M3 with amax/448 scales), each
  quantizer and the SwiGLU forward and backward under ``torch.compile`` on the GPU (inductor fuses their
  elementwise ops and reductions into a few kernels, as a user who wants DeepGEMM's speed writes the work
  around it; in eager torch ops it took ~70 % of the peer's step on the H200): activations in 1x128 blocks,
  their scales handed over in the MN-major layout DeepGEMM's kernels read;
  weights in 128x128 blocks inside every call (``deepgemm_fp8``), or once per change of the weights
  (``deepgemm_fp8_wcache``: the cache a user writes to quantize once per optimizer step, keyed on the
  weights' version counters);
- fprop and dgrad on ``m_grouped_fp8_gemm_nt_contiguous`` (each padded row tagged with its expert, padding
  rows -1). SM90 takes only K-major operands, so dgrad multiplies by the transposed FP8 weight: a 128x128
  block is its own transpose's block, so W's bytes and scales are transposed rather than quantized again;
- wgrad on ``k_grouped_fp8_gemm_nt_contiguous`` with the host sizes: 128x1 column scales within each
  expert's padded rows (``quantize_cols``), each expert's operand transposed to K-major ([C, k_e], one
  expert after another: every 128-token tile transposed, then its 128-byte pieces put in place in one
  indexed copy, not a copy per expert), accumulated in fp32 into
  ``weight.main_grad`` when the weight has one (Megatron's gradient-accumulation fusion), else into zeros
  returned in the weight's dtype;
- the SwiGLU backward and dprobs in torch ops, in bf16 as autograd would run them (dprobs summed in fp32),
  compiled as above.

``load`` builds DeepGEMM from the carried source tree (``.peers/DeepGEMM``, bench/peers/deepgemm.py) on its
first use and needs the system libstdc++ preloaded; where it cannot run, it raises with the reason.
DeepGEMM compiles each kernel at its first call on a new shape (``JIT_PREWARM``: the suite runs every
point once in child processes first, bench/suite/probes.py)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F_

from bench.peers import deepgemm as dgpeer
from bench.peers.interface import MLPImpl, swiglu_probs

KEYS = ("deepgemm_fp8", "deepgemm_fp8_wcache")
BLOCK = 128  # the quantization blocks: 1x128, 128x1, 128x128
ALIGN = dgpeer.ALIGN  # each expert's rows padded to a multiple of this (DeepGEMM's contiguous layout on SM90)
assert ALIGN % BLOCK == 0  # so that no 128x1 block crosses an expert's rows
JIT_PREWARM = True
_DG: list = []  # the deep_gemm module, once loaded


def load(key):
    if key not in KEYS:
        raise KeyError(key)
    if _DG:
        return
    if not torch.cuda.is_available():
        raise RuntimeError("DeepGEMM needs a CUDA GPU, and this machine has none")
    if torch.cuda.get_device_capability() != (9, 0):
        major, minor = torch.cuda.get_device_capability()
        raise RuntimeError(f"the DeepGEMM kernels used here are its SM90 ones, and {torch.cuda.get_device_name()} "
                           f"is {major}.{minor}")
    if not (dgpeer.DEFAULT_SRC / "setup.py").is_file():
        raise RuntimeError(f"no DeepGEMM source tree at {dgpeer.DEFAULT_SRC} (carry one there: see "
                           "bench/peers/deepgemm.py)")
    if "libstdc++" not in os.environ.get("LD_PRELOAD", ""):
        raise RuntimeError(f"DeepGEMM crashes at its first GEMM unless the system libstdc++ is preloaded: run "
                           f"with {dgpeer.PRELOAD}")
    dg = dgpeer.load(dgpeer.build())
    missing = [f for f in ("m_grouped_fp8_gemm_nt_contiguous", "k_grouped_fp8_gemm_nt_contiguous")
               if not hasattr(dg, f)]
    if missing:
        raise RuntimeError(f"this DeepGEMM ({getattr(dg, '__version__', '?')}) has no {' or '.join(missing)}")
    _DG[:] = [dg]


def _dg():
    if not _DG:
        raise RuntimeError("DeepGEMM is not loaded (call load(key) first)")
    return _DG[0]


def _check_dims(H: int, F: int) -> None:
    for name, v in (("hidden", H), ("ffn", F)):
        if v % BLOCK:
            raise ValueError(f"the DeepGEMM peer needs {name} to be a multiple of {BLOCK} (its 128-wide scale "
                             f"blocks), got {v}")


_COMPILED: dict = {}  # function -> its torch.compile'd form
_GRAPHS_PER_FUNCTION = 64  # shapes a compiled function may specialize for (a benchmark run meets ~20)


def _fused(fn, *args):
    """fn(*args): on a GPU under torch.compile, specialized to each shape (kernels with static sizes), on the
    CPU (the tests' stand-in for DeepGEMM) eagerly."""
    if not args[0].is_cuda:
        return fn(*args)
    compiled = _COMPILED.get(fn)
    if compiled is None:
        compiled = _COMPILED[fn] = torch.compile(fn, dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=_GRAPHS_PER_FUNCTION):
        return compiled(*args)


# ------------------------------------------------------------------------------------------- layout
class _Layout:
    """Where the tokens go in DeepGEMM's contiguous layout: expert e's rows start at a multiple of ALIGN and
    are padded to one. Made from m_splits read on the host."""

    def __init__(self, m, E: int, T: int):
        counts = m.tolist()  # the host sync of every call: the padded sizes are host sizes
        if len(counts) != E or sum(counts) != T:
            raise ValueError(f"m_splits must hold {E} counts summing to {T}, got {counts}")
        self.padded = [-(-c // ALIGN) * ALIGN for c in counts]  # wgrad's ks (host)
        self.T_pad = sum(self.padded)
        dev = m.device
        m = m.to(torch.int64)
        pm = (m + ALIGN - 1) // ALIGN * ALIGN
        self.ks = pm.to(torch.int32)  # the same sizes on the device
        expert = torch.repeat_interleave(torch.arange(E, device=dev), m, output_size=T)
        shift = (torch.cumsum(pm, 0) - pm) - (torch.cumsum(m, 0) - m)
        self.dst = torch.arange(T, device=dev) + shift[expert]  # token t's row in the padded layout
        self.groups = torch.full((self.T_pad,), -1, dtype=torch.int32, device=dev)  # rows' experts; padding -1
        self.groups.index_copy_(0, self.dst, expert.to(torch.int32))

    def pad(self, t):
        """t [T, ...] -> [T_pad, ...], zeros in the padding rows."""
        return t.new_zeros((self.T_pad,) + tuple(t.shape[1:])).index_copy_(0, self.dst, t)

    def unpad(self, t):
        return t.index_select(0, self.dst)


# ------------------------------------------------------------------------------------------- weights
class _FP8Weight:
    """The FP8 copy of one expert weight W [E, N, K] in 128x128 blocks (fprop) and, made when first asked
    for, its transpose (dgrad: W^T's blocks are W's blocks transposed, bytes and scales alike)."""

    def __init__(self, w):
        self.q, self.s = _fused(dgpeer.quantize_blocks, w.detach())
        self._t = None

    def t(self):
        if self._t is None:
            self._t = (self.q.transpose(1, 2).contiguous(), self.s.transpose(1, 2).contiguous())
        return self._t


class _WeightCache:
    """cached=False: the weights are quantized in every call. True: the copies are kept until a weight
    changes (its storage or its version counter, which every in-place write moves), i.e. made once per
    optimizer step."""

    def __init__(self, cached: bool):
        self.cached, self.stamp, self.copies = cached, None, None

    def get(self, *ws):
        stamp = tuple((w.data_ptr(), w._version) for w in ws)
        if self.cached and stamp == self.stamp:
            return self.copies
        self.stamp = self.copies = None  # the old copies go before the new ones are made
        copies = tuple(_FP8Weight(w) for w in ws)
        if self.cached:
            self.stamp, self.copies = stamp, copies
        return copies


# ------------------------------------------------------------------------------------------- GEMMs
def _rows_mn_major(t):
    q, s = dgpeer.quantize_rows(t)
    return q, s.t().contiguous().t()


def _rows(t):
    """1x128-block FP8 of t [R, C], its scales [R, C/128] in the MN-major layout (strides (1, R)) that
    DeepGEMM's SM90 kernels read (R a multiple of 128, so TMA-aligned)."""
    q, s = _fused(_rows_mn_major, t)
    if s.stride(0) != 1:  # the layout DeepGEMM reads, whatever strides the compiled graph gave
        s = s.t().contiguous().t()
    return q, s


def _m_grouped(dg, a, w, lay):
    """[T_pad, N] bf16: row r of a [T_pad, K] times expert groups[r]'s W^T (w: (q [E, N, K], scales
    [E, N/128, K/128])); DeepGEMM writes zeros in the padding rows' blocks."""
    qa, sa = _rows(a)
    out = torch.empty(lay.T_pad, w[0].shape[1], dtype=torch.bfloat16, device=a.device)
    dg.m_grouped_fp8_gemm_nt_contiguous((qa, sa), w, out, lay.groups)
    return out


def _k_grouped(dg, a, b, lay, out):
    """out[e] (fp32 [M, N]) += a_e^T b_e over expert e's padded rows of a [T_pad, M] and b [T_pad, N] (the
    padding rows are zeros)."""
    qa, sa = _fused(dgpeer.quantize_cols, a)  # [T_pad, M], scales [T_pad/128, M]
    qb, sb = _fused(dgpeer.quantize_cols, b)
    dg.k_grouped_fp8_gemm_nt_contiguous((dgpeer.k_major(qa, lay.padded, lay.ks), sa.t()), (dgpeer.k_major(qb, lay.padded, lay.ks), sb.t()),
                                        out, lay.padded, lay.ks, out)


def _weight_grad(dg, w, a, b, lay):
    """dW = a^T b per expert: into w.main_grad when w has one (returns None), else returned in w's dtype."""
    main_grad = getattr(w, "main_grad", None)
    if main_grad is not None:
        if main_grad.dtype != torch.float32 or main_grad.shape != w.shape or not main_grad.is_contiguous():
            raise ValueError(f"weight.main_grad must be a contiguous float32 tensor of shape {tuple(w.shape)}, "
                             f"got {main_grad.dtype} {tuple(main_grad.shape)}")
        _k_grouped(dg, a, b, lay, main_grad)
        return None
    out = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
    _k_grouped(dg, a, b, lay, out)
    return out.to(w.dtype)


def _swiglu_backward(da, h, probs, F: int):
    """From da = dL/d(silu(g) * u * p) and h = [g | u]: (dprobs [rows] fp32, dh = [dg | du], the activation
    a = silu(g) * u * p that fc2 read, for its wgrad), in h's dtype as autograd runs them."""
    g, u = h[:, :F], h[:, F:]
    s = F_.silu(g)
    act = s * u
    pb = probs.to(h.dtype).unsqueeze(1)
    dprobs = (da * act).sum(1, dtype=torch.float32)
    dact = da * pb
    dh = torch.cat([torch.ops.aten.silu_backward(dact * u, g), dact * s], 1)
    return dprobs, dh, act * pb


class _ExpertMLP(torch.autograd.Function):
    """y = fc2(silu(gate) * up * probs) with fc1 = x W1[e]^T, fc2 = a W2[e]^T, on DeepGEMM's grouped GEMMs."""

    @staticmethod
    def forward(ctx, x, probs, w1, w2, m, dg, cache):
        T, F = x.shape[0], w2.shape[2]
        lay = _Layout(m, w1.shape[0], T)
        x_pad, p_pad = lay.pad(x), lay.pad(probs)
        fc1, fc2 = cache.get(w1, w2)
        h = _m_grouped(dg, x_pad, (fc1.q, fc1.s), lay)
        y = lay.unpad(_m_grouped(dg, _fused(swiglu_probs, h, p_pad, F), (fc2.q, fc2.s), lay))
        ctx.save_for_backward(x_pad, h, p_pad)
        ctx.lay, ctx.dg, ctx.fp8, ctx.weights, ctx.F, ctx.probs_dtype = lay, dg, (fc1, fc2), (w1, w2), F, probs.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x_pad, h, p_pad = ctx.saved_tensors
        lay, dg, (fc1, fc2), (w1, w2), F = ctx.lay, ctx.dg, ctx.fp8, ctx.weights, ctx.F
        need_x, need_p, need_w1, need_w2 = ctx.needs_input_grad[:4]
        dy_pad = lay.pad(dy.contiguous())
        da = _m_grouped(dg, dy_pad, fc2.t(), lay)  # dgrad of fc2: dy W2[e]
        dprobs, dh, a = _fused(_swiglu_backward, da, h, p_pad, F)
        del da
        dprobs = lay.unpad(dprobs).to(ctx.probs_dtype) if need_p else None
        dx = lay.unpad(_m_grouped(dg, dh, fc1.t(), lay)) if need_x else None  # dgrad of fc1: dh W1[e]
        dw2 = _weight_grad(dg, w2, dy_pad, a, lay) if need_w2 else None
        del a
        dw1 = _weight_grad(dg, w1, dh, x_pad, lay) if need_w1 else None
        return dx, dprobs, dw1, dw2, None, None, None


# ------------------------------------------------------------------------------------------- the peer
def fc1(key, c):
    if key not in KEYS:
        raise KeyError(key)
    _check_dims(c.H, c.F)
    dg, x, W1, m, E, T = _dg(), c.x, c.W1, c.m, c.E, c.T
    cache = _WeightCache(key == "deepgemm_fp8_wcache")

    def call():
        lay = _Layout(m, E, T)
        (w,) = cache.get(W1)
        return lay.unpad(_m_grouped(dg, lay.pad(x), (w.q, w.s), lay))
    return call


def mlp(key, c):
    if key not in KEYS:
        raise KeyError(key)
    _check_dims(c.H, c.F)
    dg, W1, W2 = _dg(), c.W1g, c.W2g
    cache = _WeightCache(key == "deepgemm_fp8_wcache")
    return MLPImpl(lambda x, m, p: _ExpertMLP.apply(x, p, W1, W2, m, dg, cache), [W1, W2])
