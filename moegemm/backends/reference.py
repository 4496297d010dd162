"""The reference backend: the layer ops ``linear_fwd, linear_bwd, linear_wgrad, mlp_fwd, mlp_bwd, mlp_wgrad``
built from the primitives of ``moegemm/reference.py`` (the oracle) and registered as torch ops,
``torch.ops.moegemm_reference.*``, with the C++ ops' schemas, output slots and fakes (``contract.py``,
``fakes.py``). The autograd shells call them as they call the C++ ops, and torch.compile traces either
backend whole (fullgraph=True): an op is one node of the graph, run eagerly, whatever loops it has inside.

Each op reads its lists (saved, wgrad_operands, fp8 weights) and names its results by the contract's slot
names; ``contract.outputs`` turns them into the op's outputs (placeholders where a slot is not wanted).
Sums (bias and probs gradients) are fp32; the shells cast. The primitives are re-exported, so that this
module offers the whole backend interface (``protocol.py``) as ``cuda.py`` does.
"""

from __future__ import annotations

import torch

from .. import reference as R
from ..layout import ACTIVATION_NAMES, FP8_BLOCKWISE, wgrad_dtype
from ..reference import (act_backward_bf16, act_backward_quantize, act_bf16, act_quantize,  # noqa: F401
                         gemm_bf16_dgrad, gemm_bf16_fprop, gemm_bf16_wgrad, gemm_fp8_ragged_reduction, gemm_fp8_ragged_rows,
                         make_plan, quantize_act, quantize_weight, quantize_weights, quantize_weights_into,
                         requantize_cols)
from . import contract as C
from . import fakes

NAMESPACE = "moegemm_reference"
LAYER_AUTOGRAD = False  # the layers' autograd is moegemm/functional's Python Functions


def _add_bias(y, bias, plan):
    return y if bias is None else R.add_bias_(y, bias, plan)


def _weight_grad(gemm, operands: tuple, plan, weight, main_grad, overwrite: bool):
    """``gemm(*operands, plan)`` accumulated into main_grad, or with ``overwrite`` written into it (then None), or a
    fresh dw."""
    if main_grad is not None and overwrite:
        main_grad.copy_(gemm(*operands, plan, out_dtype=torch.float32))
        return None
    dw = gemm(*operands, plan, out=main_grad, out_dtype=wgrad_dtype(weight))
    return None if main_grad is not None else dw


def _x_rows(x, x_scales, plan):
    """x's FP8 row copy (q, s): quantized here (bf16 x), or an FP8 x's rows as given (x_scales given)."""
    if x_scales is None:
        return R.quantize_act(x, plan, rows=True, cols=False)[:2]
    return x, x_scales


def _x_cols(saved: dict, x, x_scales, plan):
    """x's per-expert column copy (qT, sT) for wgrad, made in backward from x's row copy: the one forward saved
    (bf16 x), or an FP8 x's rows (backward's x and x_scales)."""
    return R.requantize_cols(*((x, x_scales) if x_scales is not None else (saved["qx"], saved["sx"])), plan)


def _fp8_weight(op, flat, name: str, weight) -> C.Fp8Weight:
    """The FP8 copies of ``weight``: given in the op's list, else quantized here."""
    given = C.fp8_weight(op, flat, name)
    return given if given is not None else C.Fp8Weight(*R.quantize_weight(weight.contiguous()))


def _in_act_dtype(weight, act):
    """A bf16-recipe weight as the GEMMs read it; the ``*_bf16`` saved slot when its dtype differs."""
    return weight.to(act).contiguous()


# ------------------------------------------------------------------------------------- grouped linear
def _linear_fwd(a) -> dict:
    plan = R.make_plan(a.m_splits, a.x.shape[0])
    if a.recipe == FP8_BLOCKWISE:
        qx, sx = _x_rows(a.x, a.x_scales, plan)
        w = _fp8_weight(C.LINEAR_FWD, a.fp8_weight, "weight", a.weight)
        y = R.gemm_fp8_fprop(qx, sx, w.q, w.s, plan, a.act, a.bias)
        values = dict(qx=qx, sx=sx, qwT=w.qT, swT=w.sT)
    else:
        w = _in_act_dtype(a.weight, a.act)
        y = _add_bias(R.gemm_bf16_fprop(a.x, w, plan), a.bias, plan)
        values = dict(w_bf16=w)
    return dict(values, y=y, plan=plan)


def _linear_bwd(a) -> dict:
    dy, plan, out = a.dy.contiguous(), a.plan, {}
    saved = C.by_name(C.LINEAR_FWD.saved[a.recipe], a.saved)
    if a.recipe == FP8_BLOCKWISE:
        given = C.fp8_weight(C.LINEAR_BWD, a.fp8_weight, "weight")  # the caller's copies: forward saved no Wᵀ
        qwT, swT = (given.qT, given.sT) if given is not None else (saved["qwT"], saved["swT"])
        if a.need_dx or a.need_dw:
            qdy, sdy, qdyT, sdyT = R.quantize_act(dy, plan, rows=a.need_dx, cols=a.need_dw)
        if a.need_dx:
            out["dx"] = R.gemm_fp8_ragged_rows(qdy, sdy, qwT, swT, plan, dy.dtype)
        if a.need_dw:
            qxT, sxT = _x_cols(saved, a.x, a.x_scales, plan)
        if a.defer:
            out.update(qdyT=qdyT, sdyT=sdyT, qxT=qxT, sxT=sxT)
        elif a.need_dw:
            out["dw"] = _weight_grad(R.gemm_fp8_ragged_reduction, (qdyT, sdyT, qxT, sxT), plan, a.weight, a.main_grad,
                                   a.overwrite_main_grad)
    else:
        if a.need_dx:
            w = saved["w_bf16"] if a.weight.dtype != a.act else a.weight
            out["dx"] = R.gemm_bf16_dgrad(dy, w, plan)
        if a.need_dw and not a.defer:  # deferred: dy and x, the caller has them
            out["dw"] = _weight_grad(R.gemm_bf16_wgrad, (dy, a.x), plan, a.weight, a.main_grad, a.overwrite_main_grad)
    if a.need_db:
        out["db"] = R.bias_grad(dy, plan)
    return out


def _deferred_weight_grad(ops: dict, grad: tuple, inp: tuple, plan, weight, main_grad, overwrite: bool, recipe: int):
    """One weight's deferred gradient from its wgrad operands: the gradient's pair ``grad`` and the
    input's pair ``inp`` (names of ``ops``; bf16: one name each)."""
    if recipe == FP8_BLOCKWISE:
        return _weight_grad(R.gemm_fp8_ragged_reduction, tuple(ops[n] for n in grad + inp), plan, weight, main_grad,
                            overwrite)
    return _weight_grad(R.gemm_bf16_wgrad, (ops[grad[0]], ops[inp[0]]), plan, weight, main_grad, overwrite)


def _linear_wgrad(a) -> dict:
    ops = C.by_name(C.LINEAR_WGRAD.wgrad_operands[a.recipe], a.wgrad_operands)
    grad, inp = (("qdyT", "sdyT"), ("qxT", "sxT")) if a.recipe == FP8_BLOCKWISE else (("dy",), ("x",))
    return dict(dw=_deferred_weight_grad(ops, grad, inp, a.plan, a.weight, a.main_grad, a.overwrite_main_grad,
                                         a.recipe))


# ----------------------------------------------------------------------------------------- expert MLP
def _mlp_fwd(a) -> dict:
    act = ACTIVATION_NAMES[a.activation]
    plan = R.make_plan(a.m_splits, a.x.shape[0])
    p32 = a.probs.float() if a.probs is not None else None
    if a.recipe == FP8_BLOCKWISE:
        w1 = _fp8_weight(C.MLP_FWD, a.fp8_weights, "fc1_weight", a.fc1_weight)
        qx, sx = _x_rows(a.x, a.x_scales, plan)
        h = R.gemm_fp8_fprop(qx, sx, w1.q, w1.s, plan, a.act, a.fc1_bias)
        w2 = _fp8_weight(C.MLP_FWD, a.fp8_weights, "fc2_weight", a.fc2_weight)
        qa, sa, qaT, saT = R.act_quantize(h, p32, act, plan, rows=True, cols=a.need_dw2)
        y = R.gemm_fp8_fprop(qa, sa, w2.q, w2.s, plan, a.act, a.fc2_bias)
        values = dict(qx=qx, sx=sx, h=h, qaT=qaT, saT=saT, qw1T=w1.qT, sw1T=w1.sT, qw2T=w2.qT, sw2T=w2.sT)
    else:
        w1, w2 = _in_act_dtype(a.fc1_weight, a.act), _in_act_dtype(a.fc2_weight, a.act)
        h = _add_bias(R.gemm_bf16_fprop(a.x, w1, plan), a.fc1_bias, plan)
        act_out = R.act_bf16(h, p32, act)
        y = _add_bias(R.gemm_bf16_fprop(act_out, w2, plan), a.fc2_bias, plan)
        values = dict(h=h, a=act_out, w1_bf16=w1, w2_bf16=w2)
    return dict(values, y=y, plan=plan)


def _mlp_bwd(a) -> dict:
    """``release_saved`` is for the C++ op only (it frees saved tensors after their last use)."""
    act = ACTIVATION_NAMES[a.activation]
    dy, plan, out = a.dy.contiguous(), a.plan, {}
    p32 = a.probs.float() if a.probs is not None else None
    need_dh = a.need_dx or a.need_dw1 or a.need_db1
    saved = C.by_name(C.MLP_FWD.saved[a.recipe], a.saved)
    if a.recipe == FP8_BLOCKWISE:
        w1 = C.fp8_weight(C.MLP_BWD, a.fp8_weights, "fc1_weight")  # the caller's copies: forward saved no Wᵀ
        w2 = C.fp8_weight(C.MLP_BWD, a.fp8_weights, "fc2_weight")
        qw1T, sw1T = (w1.qT, w1.sT) if w1 is not None else (saved["qw1T"], saved["sw1T"])
        qw2T, sw2T = (w2.qT, w2.sT) if w2 is not None else (saved["qw2T"], saved["sw2T"])
        qdy, sdy, qdyT, sdyT = R.quantize_act(dy, plan, rows=need_dh or a.need_dprobs, cols=a.need_dw2)
        if a.need_dw2 and a.defer:
            out.update(qdyT=qdyT, sdyT=sdyT)
        elif a.need_dw2:
            out["dw2"] = _weight_grad(R.gemm_fp8_ragged_reduction, (qdyT, sdyT, saved["qaT"], saved["saT"]), plan, a.fc2_weight,
                                      a.fc2_main_grad, a.fc2_overwrite_main_grad)
        if need_dh or a.need_dprobs:
            h = saved["h"]
            da = R.gemm_fp8_ragged_rows(qdy, sdy, qw2T, sw2T, plan, dy.dtype)
            qdh, sdh, qdhT, sdhT, out["dprobs"] = R.act_backward_quantize(da, h, p32, act, plan, rows=a.need_dx,
                                                                          cols=a.need_dw1)
            if a.need_db1:  # fc1's bias gradient needs dh itself (in bf16), which the fused kernel only quantizes
                out["db1"] = R.bias_grad(R.act_backward_bf16(da, h, p32, act)[0], plan)
            if a.need_dx:
                out["dx"] = R.gemm_fp8_ragged_rows(qdh, sdh, qw1T, sw1T, plan, dy.dtype)
            if a.need_dw1:
                qxT, sxT = _x_cols(saved, a.x, a.x_scales, plan)
            if a.need_dw1 and a.defer:
                out.update(qdhT=qdhT, sdhT=sdhT, qxT=qxT, sxT=sxT)
            elif a.need_dw1:
                out["dw1"] = _weight_grad(R.gemm_fp8_ragged_reduction, (qdhT, sdhT, qxT, sxT), plan, a.fc1_weight,
                                          a.fc1_main_grad, a.fc1_overwrite_main_grad)
    else:
        w1 = saved["w1_bf16"] if a.fc1_weight.dtype != a.act else a.fc1_weight
        w2 = saved["w2_bf16"] if a.fc2_weight.dtype != a.act else a.fc2_weight
        if a.need_dw2 and not a.defer:  # deferred: dy and a, the caller has them
            out["dw2"] = _weight_grad(R.gemm_bf16_wgrad, (dy, saved["a"]), plan, a.fc2_weight, a.fc2_main_grad,
                                      a.fc2_overwrite_main_grad)
        if need_dh or a.need_dprobs:
            da = R.gemm_bf16_dgrad(dy, w2, plan)
            dh, out["dprobs"] = R.act_backward_bf16(da, saved["h"], p32, act)
            if a.need_dx:
                out["dx"] = R.gemm_bf16_dgrad(dh, w1, plan)
            if a.need_dw1 and a.defer:
                out["dh"] = dh
            elif a.need_dw1:
                out["dw1"] = _weight_grad(R.gemm_bf16_wgrad, (dh, a.x), plan, a.fc1_weight, a.fc1_main_grad,
                                          a.fc1_overwrite_main_grad)
            if a.need_db1:
                out["db1"] = R.bias_grad(dh, plan)
    if a.need_db2:
        out["db2"] = R.bias_grad(dy, plan)
    return out


def _mlp_wgrad(a) -> dict:
    ops = C.by_name(C.MLP_WGRAD.wgrad_operands[a.recipe], a.wgrad_operands)
    if a.recipe == FP8_BLOCKWISE:
        fc2, fc1 = (("qdyT", "sdyT"), ("qaT", "saT")), (("qdhT", "sdhT"), ("qxT", "sxT"))
    else:
        fc2, fc1 = (("dy",), ("a",)), (("dh",), ("x",))
    out = {}
    if a.need_dw2:
        out["dw2"] = _deferred_weight_grad(ops, *fc2, a.plan, a.fc2_weight, a.fc2_main_grad, a.fc2_overwrite_main_grad,
                                           a.recipe)
    if a.need_dw1:
        out["dw1"] = _deferred_weight_grad(ops, *fc1, a.plan, a.fc1_weight, a.fc1_main_grad, a.fc1_overwrite_main_grad,
                                           a.recipe)
    return out


# ---------------------------------------------------------------------------------------- registration
_COMPUTE = {"linear_fwd": _linear_fwd, "linear_bwd": _linear_bwd, "linear_wgrad": _linear_wgrad,
            "mlp_fwd": _mlp_fwd, "mlp_bwd": _mlp_bwd, "mlp_wgrad": _mlp_wgrad}


def _kernel(op: C.LayerOp):
    compute = _COMPUTE[op.name]

    def kernel(*args, **kwargs):
        a = C.bind(op, args, kwargs)
        return C.outputs(op, a, compute(a))
    kernel.__name__ = op.name
    return kernel


_LIBRARY = torch.library.Library(NAMESPACE, "DEF")
for _op in C.OPS:
    _LIBRARY.define(_op.schema)
    for _key in ("CPU", "CUDA"):
        _LIBRARY.impl(_op.name, _kernel(_op), _key)
fakes.register_layer_ops(NAMESPACE)

_ops = getattr(torch.ops, NAMESPACE)
linear_fwd = _ops.linear_fwd.default
linear_bwd = _ops.linear_bwd.default
linear_wgrad = _ops.linear_wgrad.default
mlp_fwd = _ops.mlp_fwd.default
mlp_bwd = _ops.mlp_bwd.default
mlp_wgrad = _ops.mlp_wgrad.default
