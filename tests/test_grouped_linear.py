"""Public API on CPU (reference backend): grouped_linear and GroupedLinear, forward and backward."""

from __future__ import annotations

import copy

import pytest
import torch

import moegemm
from moegemm import GroupedLinear, grouped_linear
from moegemm import reference as R

from conftest import rel, zipf_splits

TOL = {"bf16": 1e-2, "fp8_blockwise": 8e-2}
RECIPES = list(TOL)

SPLITS = {
    "odd": [1, 17, 129, 0, 3, 48],
    "zipf": None,
    "empty_experts": [0, 40, 0, 0, 90, 0],
    "one_expert": [0, 0, 250, 0],
    "E1": [130],
    "T0": [0, 0, 0],
    "T0_E1": [0],
}


def get_splits(name):
    s = SPLITS[name]
    return zipf_splits(8, 500) if s is None else list(s)


def f64_reference(x, w, b, splits, dy):
    """Unquantized float64 math by a per-expert loop, differentiated by torch.autograd."""
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_() if b is not None else None
    outs = []
    for e, x_e in enumerate(torch.split(x64, splits)):
        y_e = x_e @ w64[e].t()
        if b64 is not None:
            y_e = y_e + b64[e]
        outs.append(y_e)
    y = torch.cat(outs)
    y.backward(dy.double())
    return y.detach(), x64.grad, w64.grad, (b64.grad if b64 is not None else None)


def make_inputs(splits, K, N, dtype=torch.bfloat16, wdtype=torch.bfloat16, bias=True):
    E, T = len(splits), sum(splits)
    x = torch.randn(T, K, dtype=dtype).requires_grad_()
    w = (torch.randn(E, N, K) * 0.05).to(wdtype).requires_grad_()
    b = (torch.randn(E, N) * 0.1).to(wdtype).requires_grad_() if bias else None
    dy = torch.randn(T, N, dtype=dtype)
    return x, w, b, dy


# ------------------------------------------------------------------------------- vs float64 unquantized
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name", list(SPLITS))
@pytest.mark.parametrize("bias", [True, False])
def test_vs_float64(recipe, name, bias):
    splits = get_splits(name)
    E, T, K, N = len(splits), sum(splits), 144, 160
    x, w, b, dy = make_inputs(splits, K, N, bias=bias)
    y = grouped_linear(x, w, splits, b, recipe=recipe)
    assert y.shape == (T, N) and y.dtype == x.dtype
    y.backward(dy)
    y64, dx64, dw64, db64 = f64_reference(x, w, b, splits, dy)
    tol = TOL[recipe]
    assert x.grad.shape == x.shape and x.grad.dtype == x.dtype
    assert w.grad.shape == w.shape and w.grad.dtype == w.dtype
    assert rel(y, y64) < tol
    assert rel(x.grad, dx64) < tol
    assert rel(w.grad, dw64) < tol
    if bias:
        assert b.grad.shape == b.shape and b.grad.dtype == b.dtype
        assert rel(b.grad, db64) < tol
    for e, m in enumerate(splits):
        if m == 0:
            assert (w.grad[e] == 0).all()  # exact zeros for empty experts
            if bias:
                assert (b.grad[e] == 0).all()
    if T == 0:
        assert x.grad.shape == (0, K)
        assert (w.grad == 0).all()


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp32_weight_and_fp16_x(recipe):
    splits = zipf_splits(5, 300)
    K, N = 128, 96
    x, w, b, dy = make_inputs(splits, K, N, wdtype=torch.float32)
    y = grouped_linear(x, w, splits, b, recipe=recipe)
    y.backward(dy)
    y64, dx64, dw64, db64 = f64_reference(x, w, b, splits, dy)
    assert y.dtype == torch.bfloat16 and w.grad.dtype == torch.float32 and b.grad.dtype == torch.float32
    for a, r in ((y, y64), (x.grad, dx64), (w.grad, dw64), (b.grad, db64)):
        assert rel(a, r) < TOL[recipe]
    # fp16 activations on the reference path
    x16 = x.detach().half().requires_grad_()
    y16 = grouped_linear(x16, w, splits, b, recipe=recipe)
    assert y16.dtype == torch.float16
    y16.backward(dy.half())
    assert x16.grad.dtype == torch.float16
    assert rel(y16, y64) < TOL[recipe] and rel(x16.grad, dx64) < TOL[recipe]


# ------------------------------------------------------------------ fp8: equal to the quantized reference
def loop_m(a64, b64, splits):
    parts = [a_e @ b64[e].t() for e, a_e in enumerate(torch.split(a64, splits))]
    return torch.cat(parts)


def loop_k(a64, b64, splits):
    return torch.stack([a_e.t() @ b_e for a_e, b_e in zip(torch.split(a64, splits), torch.split(b64, splits))])


@pytest.mark.parametrize("name", ["odd", "zipf", "empty_experts", "E1"])
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
def test_fp8_equals_quantized_reference(name, wdtype):
    splits = get_splits(name)
    E, T, K, N = len(splits), sum(splits), 272, 144
    x, w, b, dy = make_inputs(splits, K, N, wdtype=wdtype)
    y = grouped_linear(x, w, splits, b, recipe="fp8_blockwise")
    y.backward(dy)

    plan = R.make_plan(torch.tensor(splits), T)
    ids = torch.repeat_interleave(torch.arange(E), torch.tensor(splits))
    qw, sw, _, _ = R.quantize_weight(w.detach())
    W = R.dequantize_weight(qw, sw)  # [E, N, K] float64
    X = R.dequantize_rows(*R.quantize_rows(x.detach()))
    DY = R.dequantize_rows(*R.quantize_rows(dy))
    # wgrad's column copy of x is made from x's FP8 row copy (docs/design.md), not from x: the two differ where a
    # value lies below E4M3's range in its column block, which some inputs have
    XT = R.dequantize_cols(*R.requantize_cols(*R.quantize_rows(x.detach()), plan), plan)
    DYT = R.dequantize_cols(*R.quantize_cols(dy, plan), plan)

    # the bias is added to the GEMM's unrounded result, which is rounded once (docs/design.md)
    y_ref = (loop_m(X, W, splits) + b.detach().double()[ids]).to(torch.bfloat16)
    dx_ref = loop_m(DY, W.transpose(1, 2), splits).to(torch.bfloat16)
    dw_ref = loop_k(DYT, XT, splits).float().to(wdtype)
    db_ref = torch.stack([d.double().sum(0) for d in torch.split(dy, splits)])

    assert rel(y, y_ref) <= 1e-6
    assert rel(x.grad, dx_ref) <= 1e-6
    assert rel(w.grad, dw_ref) <= 1e-6
    assert rel(b.grad, db_ref) <= 2.0 ** -8


@pytest.mark.parametrize("recipe", RECIPES)
def test_partial_requires_grad(recipe):
    splits = [30, 0, 100, 70]
    K, N = 144, 160
    x, w, b, dy = make_inputs(splits, K, N)
    _, dx64, dw64, _ = f64_reference(x, w, b, splits, dy)
    # frozen weight: only dx
    w_frozen = w.detach()
    grouped_linear(x, w_frozen, splits, None, recipe=recipe).backward(dy)
    assert rel(x.grad, dx64) < TOL[recipe] and w_frozen.grad is None
    # frozen input: only dweight (and dbias)
    xd = x.detach()
    grouped_linear(xd, w, splits, b, recipe=recipe).backward(dy)
    assert rel(w.grad, dw64) < TOL[recipe] and b.grad is not None
    # only the bias
    b2 = b.detach().requires_grad_()
    grouped_linear(xd, w.detach(), splits, b2, recipe=recipe).backward(dy)
    db = torch.stack([d.float().sum(0) for d in torch.split(dy, splits)])
    assert rel(b2.grad, db) < 2.0 ** -8


def test_fp8_nonfinite_input_not_silently_finite():
    splits = [20, 50, 0, 30]
    x, w, b, dy = make_inputs(splits, 144, 160, bias=False)
    x = x.detach().clone()
    x[25, 3] = float("nan")
    y = grouped_linear(x, w.detach(), splits, recipe="fp8_blockwise")
    assert not torch.isfinite(y[25]).any()
    mask = torch.ones(y.shape[0], dtype=torch.bool)
    mask[25] = False
    assert torch.isfinite(y[mask]).all()


# ------------------------------------------------------------------------------------------ m_splits forms
@pytest.mark.parametrize("recipe", RECIPES)
def test_m_splits_forms_agree(recipe):
    splits = [17, 0, 129, 1, 33]
    K, N = 144, 160
    x, w, b, dy = make_inputs(splits, K, N)
    results = []
    for ms in (splits, tuple(splits), torch.tensor(splits, dtype=torch.int64), torch.tensor(splits, dtype=torch.int32)):
        xi, wi, bi = (t.detach().clone().requires_grad_() for t in (x, w, b))
        y = grouped_linear(xi, wi, ms, bi, recipe=recipe)
        y.backward(dy)
        results.append((y, xi.grad, wi.grad, bi.grad))
    for other in results[1:]:
        for a, c in zip(results[0], other):
            assert torch.equal(a, c)


def test_m_splits_tensor_not_modified():
    splits = torch.tensor([3, 0, 5], dtype=torch.int32)
    before = splits.clone()
    x, w, b, _ = make_inputs([3, 0, 5], 32, 16)
    grouped_linear(x, w, splits, b)
    assert torch.equal(splits, before) and splits.dtype == torch.int32


@pytest.mark.parametrize("recipe", RECIPES)
def test_T0(recipe):
    for splits in ([0], [0, 0, 0, 0]):
        x, w, b, dy = make_inputs(splits, 48, 32)
        y = grouped_linear(x, w, splits, b, recipe=recipe)
        assert y.shape == (0, 32) and y.dtype == torch.bfloat16
        y.sum().backward()
        assert x.grad.shape == (0, 48)
        assert w.grad.shape == w.shape and (w.grad == 0).all()
        assert (b.grad == 0).all()


@pytest.mark.parametrize("recipe", RECIPES)
def test_all_tokens_on_last_and_first_expert(recipe):
    for splits in ([200, 0, 0], [0, 0, 200]):
        x, w, b, dy = make_inputs(splits, 144, 160)
        y = grouped_linear(x, w, splits, b, recipe=recipe)
        y.backward(dy)
        y64, dx64, dw64, db64 = f64_reference(x, w, b, splits, dy)
        assert rel(y, y64) < TOL[recipe] and rel(x.grad, dx64) < TOL[recipe] and rel(w.grad, dw64) < TOL[recipe]
        for e, m in enumerate(splits):
            if m == 0:
                assert (w.grad[e] == 0).all() and (b.grad[e] == 0).all()


# ---------------------------------------------------------------------------------------------- module
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("bias", [True, False])
def test_module_forward_backward(recipe, bias):
    E, K, N = 4, 144, 160
    m = GroupedLinear(E, K, N, bias=bias, recipe=recipe)
    assert m.weight.shape == (E, N, K) and m.weight.dtype == torch.bfloat16
    assert (m.bias is not None) == bias
    if bias:
        assert m.bias.shape == (E, N)
    assert recipe in repr(m)
    splits = zipf_splits(E, 300)
    x = torch.randn(300, K, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(300, N, dtype=torch.bfloat16)
    y = m(x, splits)
    y.backward(dy)
    y64, dx64, dw64, db64 = f64_reference(x, m.weight, m.bias, splits, dy)
    tol = TOL[recipe]
    assert rel(y, y64) < tol and rel(x.grad, dx64) < tol and rel(m.weight.grad, dw64) < tol
    if bias:
        assert rel(m.bias.grad, db64) < tol


@pytest.mark.parametrize("recipe", RECIPES)
def test_module_state_dict_round_trip(recipe):
    E, K, N = 3, 64, 48
    m = GroupedLinear(E, K, N, recipe=recipe)
    sd = m.state_dict()
    assert set(sd) == {"weight", "bias"}
    m2 = GroupedLinear(E, K, N, recipe=recipe)
    assert not torch.equal(m2.weight, m.weight)
    m2.load_state_dict(copy.deepcopy(sd))
    assert torch.equal(m2.weight, m.weight) and torch.equal(m2.bias, m.bias)
    splits = [10, 0, 22]
    x = torch.randn(32, K, dtype=torch.bfloat16)
    assert torch.equal(m(x, splits), m2(x, splits))
    m3 = GroupedLinear(E, K, N, bias=False, recipe=recipe, dtype=torch.float32)
    assert set(m3.state_dict()) == {"weight"} and m3.weight.dtype == torch.float32


def test_module_init_bounds_and_bad_recipe():
    m = GroupedLinear(2, 256, 32)
    bound = 1.0 / 16
    assert m.weight.abs().max().item() <= bound and m.bias.abs().max().item() <= bound
    with pytest.raises(ValueError, match="recipe"):
        GroupedLinear(2, 32, 32, recipe="fp4")


# ------------------------------------------------------------------------------------------ main_grad
@pytest.mark.parametrize("recipe", RECIPES)
def test_main_grad_accumulation(recipe):
    splits = [40, 0, 129, 17]
    E, T, K, N = 4, 186, 144, 160
    x, w, b, dy = make_inputs(splits, K, N)
    plan = R.make_plan(torch.tensor(splits), T)
    if recipe == "fp8_blockwise":
        ref = R.gemm_fp8_ragged_reduction(*R.quantize_cols(dy, plan), *R.quantize_cols(x.detach(), plan), plan)
    else:
        ref = R.gemm_bf16_wgrad(dy, x.detach(), plan)
    assert ref.dtype == torch.float32
    w.main_grad = torch.zeros(E, N, K, dtype=torch.float32)
    mg = w.main_grad
    for _ in range(2):
        grouped_linear(x, w, splits, b, recipe=recipe).backward(dy)
    assert w.grad is None
    assert w.main_grad is mg and mg.dtype == torch.float32
    assert rel(mg, 2 * ref) <= 1e-6
    for e, m in enumerate(splits):
        if m == 0:
            assert (mg[e] == 0).all()
    # the other gradients are unaffected
    _, dx64, _, db64 = f64_reference(x, w, b, splits, dy)
    assert rel(x.grad, 2 * dx64) < TOL[recipe]
    assert rel(b.grad, 2 * db64) < TOL[recipe]


@pytest.mark.parametrize("recipe", RECIPES)
def test_non_contiguous_weight_and_bias(recipe):
    """weight/bias views (e.g. slices of a bigger stacked parameter) give the same results as copies."""
    splits = [20, 0, 44]
    K, N = 144, 160
    x, w, b, dy = make_inputs(splits, K, N)
    w_nc = w.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    b_nc = torch.stack([b.detach(), b.detach()], -1)[..., 0].requires_grad_()
    assert not w_nc.is_contiguous() and not b_nc.is_contiguous()
    y = grouped_linear(x, w, splits, b, recipe=recipe)
    y.backward(dy)
    x2 = x.detach().requires_grad_()
    y2 = grouped_linear(x2, w_nc, splits, b_nc, recipe=recipe)
    y2.backward(dy)
    assert torch.equal(y, y2)
    assert torch.equal(x.grad, x2.grad) and torch.equal(w.grad, w_nc.grad) and torch.equal(b.grad, b_nc.grad)
