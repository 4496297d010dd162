"""docs/design.md#errors: every bad input raises ValueError/TypeError naming the argument, before any work."""

from __future__ import annotations

import pytest
import torch

import moegemm
from moegemm import GroupedLinear, grouped_linear

from conftest import requires_cuda

E, T, K, N = 3, 40, 32, 48
SPLITS = [10, 0, 30]


def inputs():
    x = torch.randn(T, K, dtype=torch.bfloat16)
    w = torch.randn(E, N, K, dtype=torch.bfloat16)
    b = torch.randn(E, N, dtype=torch.bfloat16)
    return x, w, b


def test_good_inputs_work():
    x, w, b = inputs()
    assert grouped_linear(x, w, SPLITS, b).shape == (T, N)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool])
def test_x_dtype(dtype):
    x, w, _ = inputs()
    with pytest.raises(TypeError, match=r"x\.dtype"):
        grouped_linear(x.to(dtype), w, SPLITS)


@pytest.mark.parametrize("dtype", [torch.float16, torch.int32, torch.float64, torch.float8_e4m3fn])
def test_weight_dtype(dtype):
    x, w, _ = inputs()
    with pytest.raises(TypeError, match=r"weight\.dtype"):
        grouped_linear(x, w.to(dtype), SPLITS)


@pytest.mark.parametrize("shape", [(T * K,), (1, T, K), ()])
def test_x_not_2d(shape):
    x, w, _ = inputs()
    with pytest.raises(ValueError, match=r"\bx\b.*2-D"):
        grouped_linear(x.reshape(shape) if shape else x[0, 0], w, SPLITS)


@pytest.mark.parametrize("shape", [(E * N, K), (E, N, K, 1)])
def test_weight_not_3d(shape):
    x, w, _ = inputs()
    with pytest.raises(ValueError, match=r"weight.*3-D"):
        grouped_linear(x, w.reshape(shape), SPLITS)


def test_x_inner_dim_mismatch():
    x, w, _ = inputs()
    with pytest.raises(ValueError, match=r"x\.shape\[1\]"):
        grouped_linear(torch.randn(T, K + 16, dtype=torch.bfloat16), w, SPLITS)


def test_x_non_contiguous():
    x, w, _ = inputs()
    xt = torch.randn(K, T, dtype=torch.bfloat16).t()
    assert not xt.is_contiguous()
    with pytest.raises(ValueError, match=r"\bx\b.*contiguous, got strides \(1, 40\)"):
        grouped_linear(xt, w, SPLITS)


# Sizes no allocation could hold: the layers must refuse them before allocating their weights.
HUGE = 1 << 40


@pytest.mark.parametrize("args, match", [
    ((2000, 128, 128), r"^num_experts must be in \[1, 1024\], got 2000$"),
    ((0, 128, 128), r"^num_experts must be in \[1, 1024\], got 0$"),
    ((2000, HUGE, HUGE), r"^num_experts "),
    ((4, HUGE + 8, 128), r"^in_features must be a positive multiple of 16, got 1099511627784$"),
    ((4, 128, HUGE + 8), r"^out_features must be a positive multiple of 16, got 1099511627784$"),
])
def test_grouped_linear_sizes_checked_at_construction(args, match):
    """GroupedLinear(E, in, out) refuses what grouped_linear would, at construction, before allocating."""
    with pytest.raises(ValueError, match=match):
        GroupedLinear(*args)
    with pytest.raises(ValueError, match=r"recipe"):
        GroupedLinear(4, 128, 128, recipe="fp4")


@pytest.mark.parametrize("args, kwargs, match", [
    ((2000, HUGE, HUGE), {}, r"^num_experts must be in \[1, 1024\], got 2000$"),
    ((4, HUGE + 8, 128), {}, r"^hidden_size must be a positive multiple of 16, got 1099511627784$"),
    ((4, 128, HUGE + 8), {"activation": "relu"}, r"^ffn_hidden_size must be a positive multiple of 16"),
    ((4, 128, 72), {}, r"^ffn_hidden_size must be a positive multiple of 16, got 72$"),
    ((4, 128, 128), {"activation": "tanh"}, r"activation"),
    ((4, 128, 128), {"recipe": "fp4"}, r"recipe"),
])
def test_grouped_mlp_sizes_checked_at_construction(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        moegemm.GroupedMLP(*args, **kwargs)


@pytest.mark.parametrize("ms", [[10, 30], [10, 0, 30, 0], [], torch.tensor([10, 30]), torch.tensor([10, 0, 0, 30])])
def test_len_m_splits(ms):
    x, w, _ = inputs()
    with pytest.raises(ValueError, match=r"len\(m_splits\)"):
        grouped_linear(x, w, ms)


@pytest.mark.parametrize("as_tensor", [False, True])
def test_negative_count(as_tensor):
    x, w, _ = inputs()
    ms = [20, -10, 30]
    with pytest.raises(ValueError, match=r"m_splits\[1\].*non-negative"):
        grouped_linear(x, w, torch.tensor(ms) if as_tensor else ms)


@pytest.mark.parametrize("ms", [[10, 0, 29], [10, 0, 31], [0, 0, 0]])
@pytest.mark.parametrize("kind", ["list", "int64", "int32"])
def test_sum_not_T(ms, kind):
    x, w, _ = inputs()
    arg = ms if kind == "list" else torch.tensor(ms, dtype=getattr(torch, kind))
    with pytest.raises(ValueError, match=r"sum\(m_splits\)"):
        grouped_linear(x, w, arg)


@pytest.mark.parametrize("n,k,which", [(40, 32, "N"), (48, 24, "K"), (8, 32, "N"), (48, 136, "K")])
def test_n_k_multiple_of_16(n, k, which):
    x = torch.randn(T, k, dtype=torch.bfloat16)
    w = torch.randn(E, n, k, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=rf"weight\.shape.*\({which}\b.*multiple of 16"):
        grouped_linear(x, w, SPLITS)


def test_too_many_experts():
    Ebig = moegemm._validate.MAX_EXPERTS + 1
    assert Ebig == 1025
    w = torch.zeros(Ebig, 16, 16, dtype=torch.bfloat16)
    x = torch.zeros(4, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"weight\.shape\[0\].*experts"):
        grouped_linear(x, w, [4] + [0] * (Ebig - 1))
    # the maximum itself is fine
    w = torch.zeros(1024, 16, 16, dtype=torch.bfloat16)
    assert grouped_linear(x, w, [4] + [0] * 1023, recipe="bf16").shape == (4, 16)


def test_zero_experts():
    w = torch.zeros(0, 16, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"weight\.shape\[0\]"):
        grouped_linear(torch.zeros(0, 16, dtype=torch.bfloat16), w, [])


@pytest.mark.parametrize("shape", [(E, N + 16), (E + 1, N), (N,), (E, N, 1), (E * N,)])
def test_bias_shape(shape):
    x, w, _ = inputs()
    with pytest.raises(ValueError, match=r"bias.*shape"):
        grouped_linear(x, w, SPLITS, torch.zeros(shape, dtype=torch.bfloat16))


def test_bias_type_and_dtype():
    x, w, _ = inputs()
    with pytest.raises(TypeError, match=r"bias"):
        grouped_linear(x, w, SPLITS, torch.zeros(E, N, dtype=torch.int32))
    with pytest.raises(TypeError, match=r"bias"):
        grouped_linear(x, w, SPLITS, [[0.0] * N] * E)


@pytest.mark.parametrize("recipe", ["fp8", "FP8_BLOCKWISE", "mxfp8", "", None])
def test_unknown_recipe(recipe):
    x, w, _ = inputs()
    with pytest.raises(ValueError, match=r"recipe"):
        grouped_linear(x, w, SPLITS, recipe=recipe)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int16, torch.uint8, torch.bool])
def test_m_splits_tensor_dtype(dtype):
    x, w, _ = inputs()
    with pytest.raises(TypeError, match=r"m_splits\.dtype"):
        grouped_linear(x, w, torch.tensor(SPLITS).to(dtype))


def test_m_splits_tensor_not_1d():
    x, w, _ = inputs()
    with pytest.raises(ValueError, match=r"m_splits.*1-D"):
        grouped_linear(x, w, torch.tensor(SPLITS).view(1, 3))


@pytest.mark.parametrize("ms", [[10.0, 0, 30], [10, "0", 30], [10, None, 30], [10, True, 29], [10, 0, 30.0]])
def test_m_splits_non_int_element(ms):
    x, w, _ = inputs()
    with pytest.raises(TypeError, match=r"m_splits\[\d\]"):
        grouped_linear(x, w, ms)


@pytest.mark.parametrize("ms", [40, "10,0,30", {10, 0, 30}, None])
def test_m_splits_wrong_type(ms):
    x, w, _ = inputs()
    with pytest.raises(TypeError, match=r"m_splits"):
        grouped_linear(x, w, ms)


def test_x_not_a_tensor():
    _, w, _ = inputs()
    with pytest.raises(TypeError, match=r"\bx\b"):
        grouped_linear([[0.0] * K] * T, w, SPLITS)
    with pytest.raises(TypeError, match=r"weight"):
        grouped_linear(torch.zeros(T, K), [[[0.0] * K] * N] * E, SPLITS)


def test_module_forward_errors():
    m = GroupedLinear(E, K, N)
    with pytest.raises(ValueError, match=r"len\(m_splits\)"):
        m(torch.randn(T, K, dtype=torch.bfloat16), [T])
    with pytest.raises(ValueError, match=r"x\.shape\[1\]"):
        m(torch.randn(T, K + 16, dtype=torch.bfloat16), SPLITS)


def test_public_quantizer_errors():
    with pytest.raises(ValueError, match=r"sum\(m_splits\)"):
        moegemm.make_plan([1, 2], 4)
    with pytest.raises(ValueError, match=r"m_splits\[0\]"):
        moegemm.make_plan([-1, 5], 4)
    from moegemm.layout import MAX_TOKENS
    for T in (MAX_TOKENS + 1, -1):  # a plan of int32 offsets would wrap
        with pytest.raises(ValueError, match=r"T \(tokens\) must be in \[0, "):
            moegemm.make_plan([T, 0], T)
    for T in ("5", 5.0, True):
        with pytest.raises(TypeError, match=r"T must be an int"):
            moegemm.make_plan([2, 3], T)
    for m in (torch.tensor(8), torch.tensor([[8]])):  # one count, not a list of them
        with pytest.raises(ValueError, match=r"m_splits must be 1-D"):
            moegemm.quantize_act(torch.randn(8, 128), m)
    with pytest.raises(TypeError, match=r"m_splits must be a list"):
        moegemm.make_plan(8, 8)
    with pytest.raises(ValueError, match=r"\bx\b"):
        moegemm.quantize_act(torch.randn(8, 24), [8])
    with pytest.raises(ValueError, match=r"\bx\b"):
        moegemm.quantize_act(torch.randn(8, 16, 1), [8])
    with pytest.raises(ValueError, match=r"weight"):
        moegemm.quantize_weight(torch.randn(16, 16))
    with pytest.raises(ValueError, match=r"weight\.shape"):
        moegemm.quantize_weight(torch.randn(1, 24, 16))


def test_errors_raise_before_work(monkeypatch):
    """Validation runs before the backend is touched."""
    from moegemm import backends

    def boom(*a, **k):
        raise AssertionError("backend used before validation")

    monkeypatch.setattr(backends, "select", boom)
    x, w, _ = inputs()
    with pytest.raises(ValueError, match=r"sum\(m_splits\)"):
        grouped_linear(x, w, [1, 2, 3])
    with pytest.raises(ValueError, match=r"bias"):
        grouped_linear(x, w, SPLITS, torch.zeros(E, N + 16))


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.float64, torch.float8_e4m3fn])
def test_quantizers_x_dtype(dtype):
    """The quantizers take x in the dtypes the layers take; anything else is refused, not cast."""
    x = torch.randn(T, K).to(dtype)
    with pytest.raises(TypeError, match=r"x\.dtype"):
        moegemm.quantize_act(x, [T])
    with pytest.raises(TypeError, match=r"x\.dtype"):
        moegemm.to_fp8_rows(x)


@pytest.mark.parametrize("other", [(E, N - 16, K), (E, N + 16, K), (E, N, K + 16), (E + 1, N, K), (E - 1, N, K)])
def test_fp8_weight_of_another_shape(other):
    """Copies of another weight's shape would be read as this weight's (a result of the wrong shape, or an
    index error): refused, naming the argument and the part."""
    x, w, _ = inputs()
    copies = moegemm.quantize_weight(torch.randn(other, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"fp8_weight\[0\] \(q of quantize_weight\(weight\).*must have shape"):
        grouped_linear(x, w, SPLITS, fp8_weight=copies)


def test_fp8_weight_parts():
    x, w, _ = inputs()
    q, s, qT, sT = moegemm.quantize_weight(w)
    ref = grouped_linear(x, w, SPLITS)
    assert torch.equal(grouped_linear(x, w, SPLITS, fp8_weight=(q, s, qT, sT)), ref)
    with pytest.raises(TypeError, match=r"fp8_weight must be the 4-tuple .* got tuple of length 2"):
        grouped_linear(x, w, SPLITS, fp8_weight=(q, s))
    with pytest.raises(TypeError, match=r"fp8_weight must be the 4-tuple .* got Tensor"):
        grouped_linear(x, w, SPLITS, fp8_weight=q)
    with pytest.raises(TypeError, match=r"fp8_weight\[0\] \(q .* must be a torch.float8_e4m3fn tensor, got torch.bfloat16"):
        grouped_linear(x, w, SPLITS, fp8_weight=(q.to(torch.bfloat16), s, qT, sT))
    with pytest.raises(ValueError, match=r"fp8_weight\[3\] \(sT .* must have shape \(3, 1, 1\), got \(3, 1, 2\)"):
        grouped_linear(x, w, SPLITS, fp8_weight=(q, s, qT, sT.repeat(1, 1, 2)))
    with pytest.raises(ValueError, match=r"qT and sT must both be tensors or both be None"):
        grouped_linear(x, w, SPLITS, fp8_weight=(q, s, qT, None))
    with pytest.raises(ValueError, match=r"fp8_weight: qT and sT are needed here"):
        grouped_linear(x, w, SPLITS, fp8_weight=(q, s, None, None))  # the linear ops take all four copies


def test_fp8_weights_of_the_mlp():
    x, _, _ = inputs()
    w1, w2 = torch.randn(E, 2 * N, K, dtype=torch.bfloat16), torch.randn(E, K, N, dtype=torch.bfloat16)
    c1, c2 = moegemm.quantize_weight(w1), moegemm.quantize_weight(w2)
    ref = moegemm.grouped_mlp(x, w1, w2, SPLITS)
    assert torch.equal(moegemm.grouped_mlp(x, w1, w2, SPLITS, fp8_weights=(c1, c2)), ref)
    with pytest.raises(TypeError, match=r"fp8_weights must be the pair .* got tuple of length 4"):
        moegemm.grouped_mlp(x, w1, w2, SPLITS, fp8_weights=c1)
    with pytest.raises(ValueError, match=r"fp8_weights\[0\]\[0\] \(q of quantize_weight\(fc1_weight\)"):
        moegemm.grouped_mlp(x, w1, w2, SPLITS, fp8_weights=(c2, c1))
    # without the transposed copies: inference only
    bare = (c1[:2] + (None, None), c2[:2] + (None, None))
    with torch.no_grad():
        assert torch.equal(moegemm.grouped_mlp(x, w1, w2, SPLITS, fp8_weights=bare), ref)
    with pytest.raises(ValueError, match=r"fp8_weights\[0\]: qT and sT are needed here"):
        moegemm.grouped_mlp(x, w1.requires_grad_(), w2, SPLITS, fp8_weights=bare)


def test_fp8_weights_with_the_bf16_recipe():
    """FP8 copies given with recipe="bf16" would be ignored: refused, naming the argument (None and () pass)."""
    x, w, _ = inputs()
    w1, w2 = torch.randn(E, 2 * N, K, dtype=torch.bfloat16), torch.randn(E, K, N, dtype=torch.bfloat16)
    c1, c2 = moegemm.quantize_weight(w1), moegemm.quantize_weight(w2)
    with pytest.raises(ValueError, match=r"^fp8_weight is for recipe='fp8_blockwise' .* recipe is 'bf16'"):
        grouped_linear(x, w, SPLITS, recipe="bf16", fp8_weight=moegemm.quantize_weight(w))
    with pytest.raises(ValueError, match=r"^fp8_weights is for recipe='fp8_blockwise' .* recipe is 'bf16'"):
        moegemm.grouped_mlp(x, w1, w2, SPLITS, recipe="bf16", fp8_weights=(c1, c2))
    ref = moegemm.grouped_mlp(x, w1, w2, SPLITS, recipe="bf16")
    assert torch.equal(moegemm.grouped_mlp(x, w1, w2, SPLITS, recipe="bf16", fp8_weights=()), ref)
    assert torch.equal(grouped_linear(x, w, SPLITS, recipe="bf16", fp8_weight=None), grouped_linear(x, w, SPLITS, recipe="bf16"))


def test_per_call_switches():
    """check_splits, is_first_microbatch and wgrad_store: a string or a number is refused, not read as a truth value."""
    x, w, _ = inputs()
    with pytest.raises(TypeError, match=r"check_splits must be None, True or False, got str 'no'"):
        grouped_linear(x, w, SPLITS, check_splits="no")
    with pytest.raises(TypeError, match=r"is_first_microbatch must be None, True or False, got int 0"):
        GroupedLinear(E, K, N)(x, SPLITS, is_first_microbatch=0)
    with pytest.raises(TypeError, match=r"wgrad_store must be a moegemm.WgradStore or None, got str"):
        grouped_linear(x.requires_grad_(), w, SPLITS, wgrad_store="store")


def test_wgrad_store_max_pending():
    assert moegemm.WgradStore(0).max_pending == 0
    with pytest.raises(ValueError, match=r"max_pending must be non-negative, got -1"):
        moegemm.WgradStore(-1)
    with pytest.raises(TypeError, match=r"max_pending must be an int, got str '8'"):
        moegemm.WgradStore("8")


# ------------------------------------------------------------------------------------- CUDA-only checks
@requires_cuda
def test_device_mismatch():
    x, w, b = inputs()
    wc = w.cuda()
    with pytest.raises(ValueError, match=r"\bx\b.*cpu"):
        grouped_linear(x, wc, SPLITS)
    with pytest.raises(ValueError, match=r"bias"):
        grouped_linear(x.cuda(), wc, SPLITS, b)


@requires_cuda
def test_device_m_splits_checked_mode():
    x, w, _ = (t.cuda() for t in inputs())
    bad = torch.tensor([10, -1, 31], device="cuda")
    with pytest.raises(ValueError, match=r"non-negative"):
        grouped_linear(x, w, bad, check_splits=True)
    with pytest.raises(ValueError, match=r"sum\(m_splits\)"):
        grouped_linear(x, w, torch.tensor([10, 0, 29], device="cuda"), check_splits=True)


def test_mlp_errors_name_the_argument():
    """grouped_mlp's two biases and two weights' main_grad are named as its arguments."""
    w1 = torch.randn(E, 2 * 64, K, dtype=torch.bfloat16)
    w2 = torch.randn(E, K, 64, dtype=torch.bfloat16)
    x = torch.randn(T, K, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"^fc2_bias must have shape \[E, N\]"):
        moegemm.grouped_mlp(x, w1, w2, SPLITS, fc2_bias=torch.zeros(E, 64))
    with pytest.raises(TypeError, match=r"^fc1_bias must be a torch.Tensor or None, got list"):
        moegemm.grouped_mlp(x, w1, w2, SPLITS, fc1_bias=[0.0])
    w2.main_grad = torch.zeros(w2.shape, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"^fc2_weight\.main_grad must be a float32 tensor, got torch\.bfloat16"):
        moegemm.grouped_mlp(x, w1, w2, SPLITS)
    w2.main_grad = [0.0]
    with pytest.raises(TypeError, match=r"^fc2_weight\.main_grad must be a float32 tensor, got list"):
        moegemm.grouped_mlp(x, w1, w2, SPLITS)
    w1.requires_grad_()
    y = moegemm.grouped_mlp(x, w1, torch.randn(E, K, 64, dtype=torch.bfloat16), SPLITS)
    w1.main_grad = torch.zeros(E, 1, dtype=torch.float32)  # replaced between forward and backward
    with pytest.raises(ValueError, match=r"^fc1_weight\.main_grad must be contiguous with fc1_weight's shape"):
        y.float().sum().backward()


def test_quantizer_switches_and_grad_target_checked():
    x = torch.randn(8, 128)
    with pytest.raises(TypeError, match=r"rows must be True or False, got str 'no'"):
        moegemm.quantize_act(x, [8], rows="no")
    with pytest.raises(TypeError, match=r"cols must be True or False, got int 0"):
        moegemm.quantize_act(x, [8], cols=0)
    for bad in ("x", torch.zeros(8, 64), torch.zeros(8, 128, dtype=torch.int32)):
        with pytest.raises(ValueError, match=r"grad_target must be None or a floating-point tensor of x's shape"):
            moegemm.to_fp8_rows(x, grad_target=bad)
    g = torch.zeros(8, 128, requires_grad=True)
    assert moegemm.to_fp8_rows(x, grad_target=g).grad_target is g
