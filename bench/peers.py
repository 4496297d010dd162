"""The implementations measured: build_fc1 (fc1 forward) and build_mlp (expert MLP) for every variant:
moegemm, torch._grouped_mm bf16 and torch._scaled_grouped_mm FP8 rowwise (autograd shells with the
quantization in torch ops), torchao, TransformerEngine, and the per-expert loop; make_step, one MLP
forward+backward."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F_

from cases import Case
from peer_imports import MOD
from shared import BF16, FP8, FP8_MAX
from workloads import TorchGroupedLinearBF16


def _offs(m):
    return torch.cumsum(m, 0, dtype=torch.int32)


def swiglu_probs(h, probs, F):
    """The expert activation of every peer: silu(gate) * up * probs (torch ops, bf16)."""
    return F_.silu(h[:, :F]) * h[:, F:] * probs.to(h.dtype).unsqueeze(-1)


def _fp8_rowwise(t):
    """FP8 E4M3 quantization along the last dim in plain torch ops: (q contiguous, fp32 dequant scales
    of shape t.shape[:-1]); scale = amax / 448 per row."""
    amax = torch.linalg.vector_norm(t, float("inf"), dim=-1, keepdim=True).float()
    scale = amax.clamp_min(1e-12) / FP8_MAX
    q = (t / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8).contiguous()
    return q, scale.squeeze(-1).contiguous()


def _torch_fp8_fprop(x, w, offs):
    qx, sx = _fp8_rowwise(x)  # [T, K], [T]
    qw, sw = _fp8_rowwise(w)  # [E, N, K], [E, N]: per output column of B = W^T
    return torch._scaled_grouped_mm(qx, qw.transpose(1, 2), sx, sw, offs=offs, out_dtype=BF16, use_fast_accum=True)


class _TorchGroupedLinearFP8(torch.autograd.Function):
    """torch._scaled_grouped_mm with rowwise FP8 (quantization in torch ops, counted in the time).
    wgrad is FP8 (2d x 2d, scales per row of dy^T and x^T) only when every group is non-empty and a
    multiple of 16 rows: otherwise torch device-asserts (GroupMMCommon.cuh), so it runs in bf16."""

    @staticmethod
    def forward(ctx, x, w, offs, fp8_wgrad):
        ctx.save_for_backward(x, w, offs)
        ctx.fp8_wgrad = fp8_wgrad
        return _torch_fp8_fprop(x, w, offs)

    @staticmethod
    def backward(ctx, dy):
        x, w, offs = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            qdy, sdy = _fp8_rowwise(dy)                  # [T, N], [T]
            qwt, swt = _fp8_rowwise(w.transpose(1, 2))   # [E, K, N] contiguous, [E, K]
            dx = torch._scaled_grouped_mm(qdy, qwt.transpose(1, 2), sdy, swt, offs=offs, out_dtype=BF16,
                                          use_fast_accum=True)
        if ctx.needs_input_grad[1]:
            if ctx.fp8_wgrad:
                E = w.shape[0]
                qdyt, sdyt = _fp8_rowwise(dy.t())        # [N, T], [N]
                qxt, sxt = _fp8_rowwise(x.t())           # [K, T], [K]
                dw = torch._scaled_grouped_mm(qdyt, qxt.t(), sdyt.repeat(E), sxt.repeat(E), offs=offs,
                                              out_dtype=BF16, use_fast_accum=True)
            else:
                dw = torch._grouped_mm(dy.t(), x, offs=offs)
        return dx, dw, None, None


def _te_module(E, fin, fout, W, dev):
    te = MOD["te"]
    mod = te.GroupedLinear(E, fin, fout, bias=False, params_dtype=BF16, device=dev)
    with torch.no_grad():
        for e in range(E):
            getattr(mod, f"weight{e}").copy_(W[e])
    return mod


def _te_ctx(fp8: bool):
    if not fp8:
        return contextlib.nullcontext()
    te = MOD["te"]
    from transformer_engine.common import recipe as te_recipe

    rec = te_recipe.Float8BlockScaling() if hasattr(te_recipe, "Float8BlockScaling") else te_recipe.DelayedScaling()
    autocast = getattr(te, "fp8_autocast", None)
    if autocast is not None:
        return autocast(enabled=True, fp8_recipe=rec)
    return te.autocast(enabled=True, recipe=rec)


def build_fc1(key, c: Case):
    """A callable running fc1's forward (call it under no_grad); per-call preparation (offsets,
    tolist, quantization) is inside the callable, so it is timed."""
    x, W1, m, E, T = c.x, c.W1, c.m, c.E, c.T
    if key in ("moegemm_fp8", "moegemm_bf16"):
        moe, recipe = MOD["moegemm"], "fp8_blockwise" if key == "moegemm_fp8" else "bf16"
        return lambda: moe.grouped_linear(x, W1, m, recipe=recipe)
    if key == "moegemm_fp8_wcache":  # GroupedLinear's automatic FP8 weight cache: W quantized once, x per call
        lin = MOD["moegemm"].GroupedLinear(E, c.H, 2 * c.F, bias=False, recipe="fp8_blockwise", device=x.device, dtype=BF16)
        with torch.no_grad():
            lin.weight.copy_(W1)
        return lambda: lin(x, m)
    if key == "moegemm_fp8_gemm":
        ops = MOD["moegemm_ops"]
        plan = ops.make_plan(m, T)
        qx, sx = ops.quantize_act(x, plan, True, False)[:2]
        qw, sw = ops.quantize_weight(W1)[:2]
        return lambda: ops.gemm_fp8_ragged_m(qx, sx, qw, sw, plan)
    if key == "torch_bf16":
        return lambda: torch._grouped_mm(x, W1.transpose(1, 2), offs=_offs(m))
    if key == "torch_fp8":
        return lambda: _torch_fp8_fprop(x, W1, _offs(m))
    if key == "torch_fp8_gemm":
        qx, sx = _fp8_rowwise(x)
        qw, sw = _fp8_rowwise(W1)
        offs = _offs(m)
        return lambda: torch._scaled_grouped_mm(qx, qw.transpose(1, 2), sx, sw, offs=offs, out_dtype=BF16,
                                                use_fast_accum=True)
    if key == "torchao_fp8":
        ao = MOD["torchao_mm"]
        return lambda: ao(x, W1.transpose(-2, -1), _offs(m), out_dtype=BF16, pad_token_groups_for_grouped_mm=False)
    if key == "loop_bf16":
        w1s = [W1[e].clone() for e in range(E)]

        def loop():
            return torch.cat([F_.linear(xe, w) for xe, w in zip(x.split(m.tolist()), w1s)])
        return loop
    if key in ("te_bf16", "te_fp8"):
        mod, fp8 = _te_module(E, c.H, 2 * c.F, W1, x.device), key == "te_fp8"

        def te_fwd():
            with _te_ctx(fp8):
                return mod(x, m.tolist())
        return te_fwd
    raise KeyError(key)


class MLPImpl:
    """fwd(x, m, probs) -> y; params: the weight leaves; to_w(grads of params) -> (dW1, dW2) stacked."""

    def __init__(self, fwd, params, to_w=None):
        self.fwd, self.params = fwd, params
        self.to_w = to_w or (lambda g: (g[0], g[1]))


def build_mlp(key, c: Case) -> MLPImpl:
    E, H, F, dev = c.E, c.H, c.F, c.x.device
    if key in ("moegemm_fp8", "moegemm_bf16"):
        moe = MOD["moegemm"]
        # fp8_weight_cache=False: the weights are quantized in every call, as in a step's first micro-batch
        mlp = moe.GroupedMLP(E, H, F, activation="swiglu", bias=False,
                             recipe="fp8_blockwise" if key == "moegemm_fp8" else "bf16", device=dev, dtype=BF16,
                             fp8_weight_cache=False)
        with torch.no_grad():
            mlp.fc1.weight.copy_(c.W1)
            mlp.fc2.weight.copy_(c.W2)
        return MLPImpl(lambda x, m, p: mlp(x, m, p), [mlp.fc1.weight, mlp.fc2.weight])
    if key == "moegemm_fp8_wcache":  # the automatic FP8 weight cache: quantized once, reused while unchanged
        moe = MOD["moegemm"]
        mlp = moe.GroupedMLP(E, H, F, activation="swiglu", bias=False, recipe="fp8_blockwise", device=dev, dtype=BF16)
        with torch.no_grad():
            mlp.fc1.weight.copy_(c.W1)
            mlp.fc2.weight.copy_(c.W2)
        return MLPImpl(lambda x, m, p: mlp(x, m, p), [mlp.fc1.weight, mlp.fc2.weight])
    if key == "torch_bf16":
        W1, W2 = c.W1g, c.W2g

        def fwd(x, m, p):
            offs = _offs(m)
            h = TorchGroupedLinearBF16.apply(x, W1, offs)
            return TorchGroupedLinearBF16.apply(swiglu_probs(h, p, F), W2, offs)
        return MLPImpl(fwd, [W1, W2])
    if key == "torch_fp8":
        W1, W2, fp8_wgrad = c.W1g, c.W2g, c.kind == "aligned"

        def fwd(x, m, p):
            offs = _offs(m)
            h = _TorchGroupedLinearFP8.apply(x, W1, offs, fp8_wgrad)
            return _TorchGroupedLinearFP8.apply(swiglu_probs(h, p, F), W2, offs, fp8_wgrad)
        return MLPImpl(fwd, [W1, W2])
    if key == "torchao_fp8":
        ao, W1, W2 = MOD["torchao_mm"], c.W1g, c.W2g

        def fwd(x, m, p):
            offs = _offs(m)
            h = ao(x, W1.transpose(-2, -1), offs, out_dtype=BF16, pad_token_groups_for_grouped_mm=False)
            return ao(swiglu_probs(h, p, F), W2.transpose(-2, -1), offs, out_dtype=BF16,
                      pad_token_groups_for_grouped_mm=False)
        return MLPImpl(fwd, [W1, W2])
    if key == "loop_bf16":
        w1s = [c.W1[e].clone().requires_grad_() for e in range(E)]
        w2s = [c.W2[e].clone().requires_grad_() for e in range(E)]

        def fwd(x, m, p):
            splits = m.tolist()
            return torch.cat([F_.linear(swiglu_probs(F_.linear(xe, w1), pe, F), w2)
                              for xe, pe, w1, w2 in zip(x.split(splits), p.split(splits), w1s, w2s)])
        return MLPImpl(fwd, w1s + w2s, lambda g: (torch.stack(g[:E]), torch.stack(g[E:])))
    if key in ("te_bf16", "te_fp8"):
        fc1, fc2, fp8 = _te_module(E, H, 2 * F, c.W1, dev), _te_module(E, F, H, c.W2, dev), key == "te_fp8"

        def fwd(x, m, p):
            splits = m.tolist()
            with _te_ctx(fp8):
                h = fc1(x, splits)
                return fc2(swiglu_probs(h, p, F), splits)
        params = [getattr(fc1, f"weight{e}") for e in range(E)] + [getattr(fc2, f"weight{e}") for e in range(E)]
        return MLPImpl(fwd, params, lambda g: (torch.stack(g[:E]), torch.stack(g[E:])))
    raise KeyError(key)


def make_step(impl: MLPImpl, c: Case):
    inputs = [c.xg, c.pg] + list(impl.params)

    def step():
        y = impl.fwd(c.xg, c.m, c.pg)
        return torch.autograd.grad(y, inputs, c.dy, allow_unused=True)
    return step
