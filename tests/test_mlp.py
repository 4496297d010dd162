"""Expert MLP on CPU (reference backend): grouped_mlp / GroupedMLP, forward and backward.

``y = fc2(act(fc1(x)) * probs[:, None])`` per expert, Megatron's GLU layout (gate = fc1 out[:, :ffn],
up = out[:, ffn:]). Checked against an independent float64 per-expert implementation differentiated by
torch.autograd, against the documented composition of the reference FP8 pieces (bitwise-ish), and for
the module's behaviours (FP8 weight cache, FP8-only inference, main_grad, state_dict).
Fresh random inputs every run: no fixed seeds.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from moegemm import GroupedMLP, grouped_mlp
from moegemm import reference as R

from conftest import rel, zipf_splits

ACTIVATIONS = ("swiglu", "geglu", "gelu", "relu", "squared_relu")
GLU = ("swiglu", "geglu")
RECIPES = ("bf16", "fp8_blockwise")
# (hidden, ffn) per activation, so that every size in {128, 144, 256} appears on both sides
SHAPES = {"swiglu": (256, 144), "geglu": (144, 128), "gelu": (128, 256), "relu": (256, 128),
          "squared_relu": (144, 144)}


def tol(recipe: str, activation: str, what: str) -> float:
    """Relative-Frobenius tolerance of the op vs unquantized float64 math."""
    if recipe == "bf16":
        if activation == "relu" and what in ("dx", "dw1", "db1"):
            # fc1's bias is added to the bf16-rounded GEMM output (two roundings, functional.add_bias), which
            # can flip the sign of h ≈ 0 vs float64: a few flipped relu masks give 0.01-0.02 here.
            return 5e-2
        return 2e-2
    if activation in ("relu", "squared_relu") and what in ("dx", "dw1", "db1"):
        return 0.25  # relu masks flip under FP8 noise of h
    return 0.12


def fc1_out(activation: str, ffn: int) -> int:
    return 2 * ffn if activation in GLU else ffn


# ------------------------------------------------------------------------------- float64 oracle
def act64(h: torch.Tensor, activation: str) -> torch.Tensor:
    """Independent float64 activation (not the package's): Megatron GLU layout, exact-erf GELU."""
    if activation in GLU:
        ffn = h.shape[1] // 2
        gate, up = h[:, :ffn], h[:, ffn:]
        g = F.silu(gate) if activation == "swiglu" else F.gelu(gate, approximate="none")
        return g * up
    if activation == "gelu":
        return F.gelu(h, approximate="none")
    if activation == "relu":
        return F.relu(h)
    if activation == "squared_relu":
        return F.relu(h) ** 2
    raise AssertionError(activation)


def mlp64(x, w1, w2, b1, b2, probs, splits, activation, dy):
    """Unquantized float64 per-expert MLP; returns y and the grads of (x, w1, w2, b1, b2, probs)."""
    leaves = [t.detach().double().requires_grad_() if t is not None else None for t in (x, w1, w2, b1, b2, probs)]
    x64, w164, w264, b164, b264, p64 = leaves
    outs = []
    start = 0
    for e, m in enumerate(splits):
        xe = x64[start:start + m]
        h = xe @ w164[e].t()
        if b164 is not None:
            h = h + b164[e]
        a = act64(h, activation)
        if p64 is not None:
            a = a * p64[start:start + m, None]
        y = a @ w264[e].t()
        if b264 is not None:
            y = y + b264[e]
        outs.append(y)
        start += m
    y = torch.cat(outs) if outs else torch.zeros(0, w264.shape[1], dtype=torch.float64)
    y.backward(dy.double())
    return y.detach(), [t.grad if t is not None else None for t in leaves]


def make_inputs(splits, hidden, ffn, activation, bias=True, probs=True, wdtype=torch.bfloat16,
                pdtype=torch.float32):
    E, T = len(splits), sum(splits)
    F1 = fc1_out(activation, ffn)
    x = torch.randn(T, hidden, dtype=torch.bfloat16).requires_grad_()
    w1 = (torch.randn(E, F1, hidden) * hidden ** -0.5).to(wdtype).requires_grad_()
    w2 = (torch.randn(E, hidden, ffn) * ffn ** -0.5).to(wdtype).requires_grad_()
    b1 = (torch.randn(E, F1) * 0.1).to(wdtype).requires_grad_() if bias else None
    b2 = (torch.randn(E, hidden) * 0.1).to(wdtype).requires_grad_() if bias else None
    p = torch.rand(T).clamp_min(0.05).to(pdtype).requires_grad_() if probs else None
    dy = torch.randn(T, hidden, dtype=torch.bfloat16)
    return x, w1, w2, b1, b2, p, dy


def check_vs_f64(y, leaves, splits, activation, recipe, dy, names=("dx", "dw1", "dw2", "db1", "db2", "dprobs")):
    x, w1, w2, b1, b2, p = leaves
    y64, grads64 = mlp64(x, w1, w2, b1, b2, p, splits, activation, dy)
    errs = {"y": rel(y, y64)}
    assert errs["y"] <= tol(recipe, activation, "y"), errs
    for name, t, g64 in zip(names, leaves, grads64):
        if t is None or not t.requires_grad:
            continue
        assert t.grad is not None, name
        assert t.grad.shape == t.shape and t.grad.dtype == t.dtype, name
        errs[name] = rel(t.grad, g64)
        assert errs[name] <= tol(recipe, activation, name), (name, errs)
    return errs


# --------------------------------------------------------------------------------- vs float64 math
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("with_probs", [True, False])
def test_vs_float64(recipe, activation, bias, with_probs):
    hidden, ffn = SHAPES[activation]
    splits = zipf_splits(6, int(torch.randint(300, 600, ()).item()))
    x, w1, w2, b1, b2, p, dy = make_inputs(splits, hidden, ffn, activation, bias, with_probs)
    y = grouped_mlp(x, w1, w2, splits, p, b1, b2, activation=activation, recipe=recipe)
    assert y.shape == (sum(splits), hidden) and y.dtype == x.dtype
    y.backward(dy)
    check_vs_f64(y, (x, w1, w2, b1, b2, p), splits, activation, recipe, dy)
    for e, m in enumerate(splits):
        if m == 0:  # empty experts: exact zero weight / bias gradients
            assert (w1.grad[e] == 0).all() and (w2.grad[e] == 0).all()
            if bias:
                assert (b1.grad[e] == 0).all() and (b2.grad[e] == 0).all()


@pytest.mark.parametrize("recipe", RECIPES)
def test_module_vs_float64_and_functional(recipe):
    activation = "swiglu"
    E, hidden, ffn = 4, 144, 128
    m = GroupedMLP(E, hidden, ffn, activation=activation, bias=True, recipe=recipe)
    assert m.fc1.weight.shape == (E, 2 * ffn, hidden) and m.fc2.weight.shape == (E, hidden, ffn)
    assert m.fc1.bias.shape == (E, 2 * ffn) and m.fc2.bias.shape == (E, hidden)
    assert m.fc1.weight.dtype == torch.bfloat16
    splits = zipf_splits(E, 300)
    x = torch.randn(300, hidden, dtype=torch.bfloat16, requires_grad=True)
    p = torch.rand(300, requires_grad=True)
    dy = torch.randn(300, hidden, dtype=torch.bfloat16)
    y = m(x, splits, p)
    y.backward(dy)
    leaves = (x, m.fc1.weight, m.fc2.weight, m.fc1.bias, m.fc2.bias, p)
    check_vs_f64(y, leaves, splits, activation, recipe, dy)
    # the module is exactly the functional on its parameters
    y2 = grouped_mlp(x.detach(), m.fc1.weight.detach(), m.fc2.weight.detach(), splits, p.detach(),
                     m.fc1.bias.detach(), m.fc2.bias.detach(), activation=activation, recipe=recipe)
    assert torch.equal(y.detach(), y2)
    # non-GLU fc1 is [E, ffn, hidden]
    m2 = GroupedMLP(E, hidden, ffn, activation="relu", recipe=recipe)
    assert m2.fc1.weight.shape == (E, ffn, hidden) and m2.fc1.bias is None


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp32_weights(recipe):
    activation = "geglu"
    E, hidden, ffn = 3, 128, 144
    splits = zipf_splits(E, 257)
    x, w1, w2, b1, b2, p, dy = make_inputs(splits, hidden, ffn, activation, wdtype=torch.float32)
    y = grouped_mlp(x, w1, w2, splits, p, b1, b2, activation=activation, recipe=recipe)
    assert y.dtype == torch.bfloat16
    y.backward(dy)
    check_vs_f64(y, (x, w1, w2, b1, b2, p), splits, activation, recipe, dy)
    assert w1.grad.dtype == w2.grad.dtype == b1.grad.dtype == torch.float32


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("frozen", ["weights", "x", "all_but_probs"])
def test_partial_requires_grad(recipe, frozen):
    activation = "swiglu"
    hidden, ffn = 128, 128
    splits = [30, 0, 129, 17]
    x, w1, w2, b1, b2, p, dy = make_inputs(splits, hidden, ffn, activation)
    if frozen in ("weights", "all_but_probs"):
        w1, w2, b1, b2 = (t.detach() for t in (w1, w2, b1, b2))
    if frozen in ("x", "all_but_probs"):
        x = x.detach()
    y = grouped_mlp(x, w1, w2, splits, p, b1, b2, activation=activation, recipe=recipe)
    y.backward(dy)
    check_vs_f64(y, (x, w1, w2, b1, b2, p), splits, activation, recipe, dy)
    for t in (x, w1, w2, b1, b2):
        if not t.requires_grad:
            assert t.grad is None


# --------------------------------------------------------------------- the reference activation
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("with_probs", [True, False])
def test_reference_act_backward_is_autograd_of_forward(activation, with_probs):
    T, ffn = 257, 144
    F1 = fc1_out(activation, ffn)
    h = (torch.randn(T, F1, dtype=torch.float64) * 2).requires_grad_()
    p = torch.rand(T, dtype=torch.float64).requires_grad_() if with_probs else None
    da = torch.randn(T, ffn, dtype=torch.float64)
    a = R.act_forward(h, p, activation)
    assert a.shape == (T, ffn)
    # forward: matches the independent float64 definition (Megatron GLU layout, exact GELU)
    a64 = act64(h.detach(), activation)
    if p is not None:
        a64 = a64 * p.detach()[:, None]
    assert rel(a, a64) <= 1e-6
    a.backward(da)
    dh, dprobs = R.act_backward(da, h.detach(), p.detach() if p is not None else None, activation)
    assert dh.shape == (T, F1)
    assert rel(dh, h.grad) <= 1e-5
    if with_probs:
        assert dprobs.shape == (T,)
        assert rel(dprobs, p.grad) <= 1e-5
    else:
        assert dprobs is None
    # and both match autograd of the float64 definition
    h2 = h.detach().clone().requires_grad_()
    p2 = p.detach().clone().requires_grad_() if p is not None else None
    a2 = act64(h2, activation)
    (a2 * p2[:, None] if p2 is not None else a2).backward(da)
    assert rel(dh, h2.grad) <= 1e-5
    if with_probs:
        assert rel(dprobs, p2.grad) <= 1e-5


# ------------------------------------------------------------ fp8: the documented composition
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("with_probs", [True, False])
def test_fp8_equals_reference_composition(activation, with_probs):
    hidden, ffn = SHAPES[activation]
    splits = zipf_splits(5, 400)
    E, T = len(splits), sum(splits)
    x, w1, w2, b1, b2, p, dy = make_inputs(splits, hidden, ffn, activation, True, with_probs)
    y = grouped_mlp(x, w1, w2, splits, p, b1, b2, activation=activation, recipe="fp8_blockwise")
    y.backward(dy)

    plan = R.make_plan(torch.tensor(splits), T)
    ids = torch.repeat_interleave(torch.arange(E), torch.tensor(splits))
    xd, p32 = x.detach(), (p.detach().float() if with_probs else None)
    qw1, sw1, qw1T, sw1T = R.quantize_weight(w1.detach())
    qw2, sw2, qw2T, sw2T = R.quantize_weight(w2.detach())
    qx, sx, _, _ = R.quantize_act(xd, plan, cols=False)
    qxT, sxT = R.requantize_cols(qx, sx, plan)  # wgrad's column copy is made from the row copy
    h = R.gemm_fp8_fprop(qx, sx, qw1, sw1, plan, torch.bfloat16, b1.detach())  # the bias before the rounding
    qa, sa, qaT, saT = R.act_quantize(h, p32, activation, plan)
    # the fused kernel's contract: the multi-cast quantization of act_forward
    for got, want in zip((qa, sa, qaT, saT), R.quantize_act(R.act_forward(h, p32, activation), plan)):
        assert torch.equal(got.view(torch.uint8) if got.dtype == R.FP8 else got,
                           want.view(torch.uint8) if want.dtype == R.FP8 else want)
    y_ref = R.gemm_fp8_fprop(qa, sa, qw2, sw2, plan, torch.bfloat16, b2.detach())
    assert rel(y, y_ref) <= 1e-6

    # backward, piece by piece
    qdy, sdy, qdyT, sdyT = R.quantize_act(dy, plan)
    dw2_ref = R.gemm_fp8_ragged_reduction(qdyT, sdyT, qaT, saT, plan)
    da = R.gemm_fp8_ragged_rows(qdy, sdy, qw2T, sw2T, plan, torch.bfloat16)
    qdh, sdh, qdhT, sdhT, dprobs_ref = R.act_backward_quantize(da, h, p32, activation, plan)
    dx_ref = R.gemm_fp8_ragged_rows(qdh, sdh, qw1T, sw1T, plan, torch.bfloat16)
    dw1_ref = R.gemm_fp8_ragged_reduction(qdhT, sdhT, qxT, sxT, plan)
    db1_ref = torch.zeros(E, w1.shape[1], dtype=torch.float64).index_add_(
        0, ids, R.act_backward(da, h, p32, activation)[0].double())
    db2_ref = torch.zeros(E, hidden, dtype=torch.float64).index_add_(0, ids, dy.double())
    assert rel(x.grad, dx_ref) <= 1e-6
    assert rel(w1.grad, dw1_ref.to(w1.dtype)) <= 1e-6
    assert rel(w2.grad, dw2_ref.to(w2.dtype)) <= 1e-6
    assert rel(b1.grad, db1_ref) <= 2.0 ** -8
    assert rel(b2.grad, db2_ref) <= 2.0 ** -8
    if with_probs:
        assert rel(p.grad, dprobs_ref) <= 1e-6


# ------------------------------------------------------------------------------- probs dtypes
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("pdtype", [torch.float32, torch.bfloat16, torch.float16])
def test_probs_dtypes(recipe, pdtype):
    activation = "swiglu"
    hidden, ffn = 128, 144
    splits = zipf_splits(4, 333)
    x, w1, w2, b1, b2, p, dy = make_inputs(splits, hidden, ffn, activation, pdtype=pdtype)
    y = grouped_mlp(x, w1, w2, splits, p, b1, b2, activation=activation, recipe=recipe)
    assert y.dtype == torch.bfloat16
    y.backward(dy)
    assert p.grad.dtype == pdtype and p.grad.shape == p.shape
    check_vs_f64(y, (x, w1, w2, b1, b2, p), splits, activation, recipe, dy)


@pytest.mark.parametrize("recipe", RECIPES)
def test_probs_non_contiguous_view(recipe):
    """probs as a column of a top-k [T, k] tensor: gradient flows back into it."""
    activation = "gelu"
    hidden, ffn = 128, 128
    splits = [50, 0, 77, 130]
    T = sum(splits)
    x, w1, w2, b1, b2, _, dy = make_inputs(splits, hidden, ffn, activation, probs=False)
    topk = torch.rand(T, 2, requires_grad=True)
    p = topk[:, 1]
    assert not p.is_contiguous()
    y = grouped_mlp(x, w1, w2, splits, p, b1, b2, activation=activation, recipe=recipe)
    y.backward(dy)
    p_c = topk.detach()[:, 1].contiguous().requires_grad_()
    y2 = grouped_mlp(x.detach(), w1.detach(), w2.detach(), splits, p_c, b1.detach(), b2.detach(),
                     activation=activation, recipe=recipe)
    y2.backward(dy)
    assert torch.equal(y, y2)
    assert (topk.grad[:, 0] == 0).all() and torch.equal(topk.grad[:, 1], p_c.grad)


# ------------------------------------------------------------------------------- m_splits edges
SPLITS = {
    "odd": [1, 17, 129, 0, 3, 48],
    "empty_experts": [0, 40, 0, 0, 90, 0, 0, 7],
    "one_expert": [0, 0, 250, 0],
    "E1": [130],
    "T0": [0, 0, 0],
    "T0_E1": [0],
}


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name", list(SPLITS))
@pytest.mark.parametrize("activation", ["swiglu", "relu"])
def test_splits_edge_cases(recipe, name, activation):
    splits = list(SPLITS[name])
    E, T = len(splits), sum(splits)
    hidden, ffn = 144, 128
    x, w1, w2, b1, b2, p, dy = make_inputs(splits, hidden, ffn, activation)
    y = grouped_mlp(x, w1, w2, splits, p, b1, b2, activation=activation, recipe=recipe)
    assert y.shape == (T, hidden) and y.dtype == torch.bfloat16
    y.backward(dy)
    if T == 0:
        assert x.grad.shape == (0, hidden) and p.grad.shape == (0,)
        for t in (w1, w2, b1, b2):
            assert t.grad is not None and t.grad.shape == t.shape and (t.grad == 0).all()
    else:
        check_vs_f64(y, (x, w1, w2, b1, b2, p), splits, activation, recipe, dy)
    for e, m in enumerate(splits):
        if m == 0:
            for t in (w1, w2, b1, b2):
                assert (t.grad[e] == 0).all()


@pytest.mark.parametrize("recipe", RECIPES)
def test_splits_forms_agree(recipe):
    activation = "squared_relu"
    splits = [17, 0, 129, 1, 33]
    hidden, ffn = 128, 144
    x, w1, w2, b1, b2, p, dy = make_inputs(splits, hidden, ffn, activation)
    results = []
    for ms in (splits, tuple(splits), torch.tensor(splits, dtype=torch.int64), torch.tensor(splits, dtype=torch.int32)):
        leaves = [t.detach().clone().requires_grad_() for t in (x, w1, w2, b1, b2, p)]
        y = grouped_mlp(leaves[0], leaves[1], leaves[2], ms, leaves[5], leaves[3], leaves[4],
                        activation=activation, recipe=recipe)
        y.backward(dy)
        results.append([y.detach()] + [t.grad for t in leaves])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)
    # and the module takes them too
    m = GroupedMLP(5, hidden, ffn, activation=activation, recipe=recipe)
    outs = [m(x.detach(), ms) for ms in (splits, torch.tensor(splits, dtype=torch.int32))]
    assert torch.equal(outs[0], outs[1])


# ------------------------------------------------------------------------------------------ errors
def _good(activation="swiglu", E=2, hidden=128, ffn=128, T=40):
    F1 = fc1_out(activation, ffn)
    return (torch.randn(T, hidden, dtype=torch.bfloat16), torch.randn(E, F1, hidden, dtype=torch.bfloat16),
            torch.randn(E, hidden, ffn, dtype=torch.bfloat16), [T // 2, T - T // 2])


def test_good_inputs_pass():
    x, w1, w2, s = _good()
    assert grouped_mlp(x, w1, w2, s).shape == x.shape


def test_error_unknown_activation():
    x, w1, w2, s = _good()
    with pytest.raises(ValueError, match="activation"):
        grouped_mlp(x, w1, w2, s, activation="silu")
    with pytest.raises(ValueError, match="activation"):
        GroupedMLP(2, 128, 128, activation="tanh")


def test_error_bad_recipe():
    x, w1, w2, s = _good()
    with pytest.raises(ValueError, match="recipe"):
        grouped_mlp(x, w1, w2, s, recipe="fp4")
    with pytest.raises(ValueError, match="recipe"):
        GroupedMLP(2, 128, 128, recipe="mxfp8")


@pytest.mark.parametrize("shape", [(2, 128, 144), (3, 128, 128), (2, 144, 128), (2, 128, 256)])
def test_error_fc2_weight_shape(shape):
    x, w1, _, s = _good()
    w2 = torch.randn(*shape, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="fc2_weight"):
        grouped_mlp(x, w1, w2, s)


def test_error_fc2_weight_not_3d():
    x, w1, _, s = _good()
    with pytest.raises(ValueError, match="fc2_weight"):
        grouped_mlp(x, w1, torch.randn(128, 128, dtype=torch.bfloat16), s)


def test_error_probs():
    x, w1, w2, s = _good()
    T = x.shape[0]
    with pytest.raises(ValueError, match="probs"):
        grouped_mlp(x, w1, w2, s, probs=torch.rand(T + 1))
    with pytest.raises(ValueError, match="probs"):
        grouped_mlp(x, w1, w2, s, probs=torch.rand(T, 1))
    with pytest.raises(TypeError, match="probs"):
        grouped_mlp(x, w1, w2, s, probs=torch.ones(T, dtype=torch.int64))
    with pytest.raises(TypeError, match="probs"):
        grouped_mlp(x, w1, w2, s, probs=torch.ones(T, dtype=torch.int32))


@pytest.mark.parametrize("activation", GLU)
def test_error_glu_fc1_sizes(activation):
    x, _, w2, s = _good(activation, ffn=128)
    E, hidden = 2, 128
    # ffn = 72 (fc1 out 144, a multiple of 16, but ffn itself is not)
    w1 = torch.randn(E, 144, hidden, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="fc1_weight"):
        grouped_mlp(x, w1, w2, s, activation=activation)  # fc2 of a valid size: the GLU check names fc1
    w2b = torch.randn(E, hidden, 72, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="fc1_weight|fc2_weight"):
        grouped_mlp(x, w1, w2b, s, activation=activation)
    # odd fc1 out
    w1 = torch.randn(E, 257, hidden, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="fc1_weight"):
        grouped_mlp(x, w1, w2, s, activation=activation)
    # the module with an ffn that is not a multiple of 16: refused at construction, naming its argument
    with pytest.raises(ValueError, match=r"^ffn_hidden_size must be a positive multiple of 16, got 72$"):
        GroupedMLP(E, hidden, 72, activation=activation)


def test_error_x_and_splits():
    x, w1, w2, s = _good()
    with pytest.raises(ValueError, match="x.shape"):
        grouped_mlp(torch.randn(40, 144, dtype=torch.bfloat16), w1, w2, s)
    with pytest.raises(ValueError, match="m_splits"):
        grouped_mlp(x, w1, w2, [10, 10])
    with pytest.raises(ValueError, match="m_splits"):
        grouped_mlp(x, w1, w2, [40])


# ------------------------------------------------------------------------------ FP8 weight cache
def _perturb(m: GroupedMLP):
    with torch.no_grad():
        for w in (m.fc1.weight, m.fc2.weight):
            w.add_(torch.randn_like(w) * w.float().std().item())


@pytest.mark.parametrize("grad", [True, False])
def test_is_first_microbatch_caches_fp8_weights(grad):
    E, hidden, ffn = 4, 144, 128
    m = GroupedMLP(E, hidden, ffn, activation="swiglu", bias=True, recipe="fp8_blockwise")
    splits = zipf_splits(E, 300)
    x = torch.randn(300, hidden, dtype=torch.bfloat16, requires_grad=grad)
    p = torch.rand(300)
    dy = torch.randn(300, hidden, dtype=torch.bfloat16)
    def grads():
        out = [t.grad.clone() for t in (x, m.fc1.weight, m.fc2.weight, m.fc1.bias, m.fc2.bias)]
        m.zero_grad(set_to_none=True)
        x.grad = None
        return out

    y_first = m(x, splits, p, is_first_microbatch=True)
    if grad:
        y_first.backward(dy)
        g_first = grads()
    _perturb(m)
    y_cached = m(x, splits, p, is_first_microbatch=False)
    assert torch.equal(y_cached, y_first), "is_first_microbatch=False must reuse the cached FP8 weights"
    if grad:  # backward uses the same cached FP8 weights (their transposed copies): same gradients
        y_cached.backward(dy)
        for a, b in zip(grads(), g_first):
            assert torch.equal(a, b)
    y_none = m(x, splits, p, is_first_microbatch=None)
    assert not torch.equal(y_none, y_first), "is_first_microbatch=None must quantize the current weights"
    y_new = m(x, splits, p, is_first_microbatch=True)
    assert torch.equal(y_new, y_none), "is_first_microbatch=True must requantize"
    assert torch.equal(m(x, splits, p, is_first_microbatch=False), y_new)


def test_is_first_microbatch_ignored_for_bf16():
    E, hidden, ffn = 3, 128, 128
    m = GroupedMLP(E, hidden, ffn, activation="gelu", recipe="bf16")
    splits = [100, 0, 60]
    x = torch.randn(160, hidden, dtype=torch.bfloat16)
    y1 = m(x, splits, is_first_microbatch=True)
    _perturb(m)
    y2 = m(x, splits, is_first_microbatch=False)
    assert not torch.equal(y1, y2)
    assert torch.equal(y2, m(x, splits))


# ---------------------------------------------------------------------------- FP8-only inference
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("activation", ["swiglu", "squared_relu"])
def test_to_fp8_inference(bias, activation):
    E, hidden, ffn = 4, 256, 144
    m = GroupedMLP(E, hidden, ffn, activation=activation, bias=bias, recipe="fp8_blockwise")
    splits = zipf_splits(E, 333)
    x = torch.randn(333, hidden, dtype=torch.bfloat16)
    p = torch.rand(333)
    with torch.no_grad():
        y_before = m(x, splits, p)
    nbytes_before = m.fc1.weight.untyped_storage().nbytes()
    assert nbytes_before >= E * fc1_out(activation, ffn) * hidden * 2
    out = m.to_fp8_inference()
    assert out is m and not m.training
    for w in (m.fc1.weight, m.fc2.weight):
        assert w.untyped_storage().nbytes() <= 16
    assert m.fc1.weight.shape == (E, fc1_out(activation, ffn), hidden) and m.fc2.weight.shape == (E, hidden, ffn)
    with torch.no_grad():
        y_after = m(x, splits, p)
        for first in (True, False, None):
            assert torch.equal(m(x, splits, p, is_first_microbatch=first), y_before)
    assert torch.equal(y_after, y_before)
    with pytest.raises(RuntimeError):
        m(x.clone().requires_grad_(), splits, p)


@pytest.mark.parametrize("case", ["bias", "probs"])
def test_to_fp8_inference_grad_mode_without_input_grad(case):
    """Grad mode on, x not requiring grad, but a bias (still a trainable Parameter) or router probs
    requiring grad: either refuse at forward (RuntimeError) or give a graph whose backward works."""
    E, hidden, ffn = 2, 128, 128
    m = GroupedMLP(E, hidden, ffn, bias=(case == "bias"), recipe="fp8_blockwise")
    x = torch.randn(50, hidden, dtype=torch.bfloat16)
    p = torch.rand(50, requires_grad=(case == "probs"))
    with torch.no_grad():
        y0 = m(x, [20, 30], p)
    m.to_fp8_inference()
    try:
        y = m(x, [20, 30], p)
    except RuntimeError:
        return
    assert torch.equal(y.detach(), y0)
    if y.requires_grad:
        y.sum().backward()  # must not crash on the FP8-only weights (no transposed copies kept)


def test_to_fp8_inference_refuses_state_dicts():
    """After to_fp8_inference the weight parameters are placeholders and the FP8 weights are no state: saving or
    loading a state_dict (directly or through a parent module) is refused, not given zeros or ignored."""
    m = GroupedMLP(2, 128, 128, recipe="fp8_blockwise")
    saved = m.state_dict()
    parent = torch.nn.Sequential(m)
    m.to_fp8_inference()
    for save in (m.state_dict, parent.state_dict):
        with pytest.raises(RuntimeError, match=r"state_dict of a GroupedMLP that holds only FP8 weights"):
            save()
    for load in (lambda: m.load_state_dict(saved), lambda: m.load_state_dict(saved, assign=True),
                 lambda: parent.load_state_dict({f"0.{k}": v for k, v in saved.items()})):
        with pytest.raises(RuntimeError, match=r"load_state_dict of a GroupedMLP that holds only FP8 weights"):
            load()
    assert GroupedMLP(2, 128, 128, recipe="fp8_blockwise").load_state_dict(saved) is not None  # the normal module


def test_to_fp8_inference_needs_fp8_recipe():
    m = GroupedMLP(2, 128, 128, recipe="bf16")
    with pytest.raises(ValueError, match="recipe"):
        m.to_fp8_inference()


# ---------------------------------------------------------------------------------------- main_grad
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("activation", ["geglu", "relu"])
def test_main_grad_accumulation(recipe, activation):
    E, hidden, ffn = 4, 128, 144
    splits = [40, 0, 129, 17]
    T = sum(splits)
    m = GroupedMLP(E, hidden, ffn, activation=activation, bias=True, recipe=recipe)
    ref = copy.deepcopy(m)
    x = torch.randn(T, hidden, dtype=torch.bfloat16, requires_grad=True)
    p = torch.rand(T)
    dy = torch.randn(T, hidden, dtype=torch.bfloat16)
    # the plain gradient (bf16, in .grad) of a copy without main_grad
    ref(x.detach(), splits, p).backward(dy)
    for w in (m.fc1.weight, m.fc2.weight):
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
    mgs = (m.fc1.weight.main_grad, m.fc2.weight.main_grad)
    m(x, splits, p).backward(dy)
    once = [g.clone() for g in mgs]
    assert all(g.abs().sum() > 0 for g in once)
    m(x, splits, p).backward(dy)
    for w, g, g1, r in zip((m.fc1.weight, m.fc2.weight), mgs, once, (ref.fc1.weight, ref.fc2.weight)):
        assert w.grad is None
        assert w.main_grad is g and g.dtype == torch.float32
        assert rel(g, 2 * g1) <= 1e-6
        assert rel(g1, r.grad) <= 2.0 ** -8  # same gradient, before the bf16 rounding of .grad
        for e, cnt in enumerate(splits):
            if cnt == 0:
                assert (g[e] == 0).all()
    # biases and x still get ordinary (accumulated) gradients
    assert rel(m.fc1.bias.grad, 2 * ref.fc1.bias.grad) <= 2.0 ** -7
    assert rel(m.fc2.bias.grad, 2 * ref.fc2.bias.grad) <= 2.0 ** -7
    y64, g64 = mlp64(x, m.fc1.weight, m.fc2.weight, m.fc1.bias, m.fc2.bias, p, splits, activation, dy)
    assert rel(x.grad, 2 * g64[0]) <= tol(recipe, activation, "dx")
    assert rel(mgs[1], 2 * g64[2]) <= tol(recipe, activation, "dw2")


# ---------------------------------------------------------------------------------------- state_dict
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("bias", [True, False])
def test_state_dict_round_trip(recipe, bias):
    E, hidden, ffn = 3, 144, 128
    m = GroupedMLP(E, hidden, ffn, activation="swiglu", bias=bias, recipe=recipe)
    sd = m.state_dict()
    names = {"fc1.weight", "fc2.weight"} | ({"fc1.bias", "fc2.bias"} if bias else set())
    assert set(sd) == names
    assert {n for n, _ in m.named_parameters()} == names
    m2 = GroupedMLP(E, hidden, ffn, activation="swiglu", bias=bias, recipe=recipe)
    assert not torch.equal(m2.fc1.weight, m.fc1.weight)
    m2.load_state_dict(copy.deepcopy(sd))
    for n in names:
        assert torch.equal(m2.state_dict()[n], sd[n])
    splits = [50, 0, 81]
    x = torch.randn(131, hidden, dtype=torch.bfloat16)
    p = torch.rand(131)
    assert torch.equal(m(x, splits, p), m2(x, splits, p))
    if recipe == "fp8_blockwise":
        assert torch.equal(m(x, splits, p, is_first_microbatch=True), m2(x, splits, p, is_first_microbatch=True))


# ------------------------------------------------------------------------------------- non-finite
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_input_not_silently_finite(recipe, activation, bad):
    hidden, ffn = SHAPES[activation]
    splits = [20, 50, 0, 30]
    x, w1, w2, _, _, p, _ = make_inputs(splits, hidden, ffn, activation, bias=False)
    x = x.detach().clone()
    x[25, 3] = bad
    with torch.no_grad():
        y = grouped_mlp(x, w1.detach(), w2.detach(), splits, p.detach(), activation=activation, recipe=recipe)
    assert not torch.isfinite(y[25]).any()
    mask = torch.ones(y.shape[0], dtype=torch.bool)
    mask[25] = False
    assert torch.isfinite(y[mask]).all()


@pytest.mark.parametrize("recipe", RECIPES)
def test_second_backward_over_the_graph_is_a_clear_error(recipe):
    """Backward frees the saved tensors as it goes (peak memory), so a second backward cannot run."""
    x, w1, w2, s = _good()
    x.requires_grad_()
    y = grouped_mlp(x, w1, w2, s, recipe=recipe)
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second time"):
        y.sum().backward()
