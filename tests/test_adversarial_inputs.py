"""Adversarial inputs (docs/design.md#errors): misaligned views, guard memory around caller buffers, empty weight
dimensions, wrong dtypes before any device work, zero-stride weights, main_grad misuse, inference mode.

Every case runs on the reference path on CPU and, with ``requires_cuda``, on the CUDA path. Caller
buffers that the ops write (``weight.main_grad``) are views into larger buffers whose guard regions hold
a sentinel that must survive.
"""

from __future__ import annotations

import pytest
import torch

import moegemm
from moegemm import backends
from moegemm import reference as R

from conftest import cuda_alive, requires_cuda

E, T, K, N = 4, 300, 144, 160
H, F = 128, 144
SPLITS = [100, 0, 150, 50]
RECIPES = ("fp8_blockwise", "bf16")
SENTINEL = -1234.5
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]



def offset_view(t: torch.Tensor, offset: int = 1) -> torch.Tensor:
    """A contiguous copy of ``t`` at an element offset into a flat buffer (data pointer not 16-byte
    aligned for offset * itemsize not a multiple of 16)."""
    flat = torch.full((t.numel() + offset + 5,), 7, dtype=t.dtype, device=t.device)
    v = flat[offset:offset + t.numel()].view(t.shape)
    v.copy_(t)
    assert v.is_contiguous() and (v.numel() == 0 or v.data_ptr() % 16 != 0)
    return v


def guarded(shape, device, offset: int = 3, after: int = 5, dtype=torch.float32):
    """(view, buffer): a zeroed view of ``shape`` at an odd element offset into a sentinel-filled buffer."""
    n = 1
    for s in shape:
        n *= s
    buf = torch.full((offset + n + after,), SENTINEL, dtype=dtype, device=device)
    view = buf[offset:offset + n].view(shape)
    view.zero_()
    return view, buf, (offset, offset + n)


def guards_intact(buf, span) -> bool:
    return bool((buf[:span[0]] == SENTINEL).all() and (buf[span[1]:] == SENTINEL).all())


# ================================================================================ misaligned inputs
LINEAR_WHICH = ["x", "weight", "weight_fp32", "bias", "main_grad", "dy", "m_splits", "all"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("which", LINEAR_WHICH)
def test_misaligned_linear(device, recipe, which):
    """Contiguous tensors at element offsets give bitwise the results of aligned ones; main_grad (a view
    at an odd offset into a flat fp32 buffer) gets the gradient and its neighbours stay untouched."""
    torch.manual_seed(20)
    wdtype = torch.float32 if which == "weight_fp32" else torch.bfloat16
    x = torch.randn(T, K, device=device, dtype=torch.bfloat16)
    w = (torch.randn(E, N, K, device=device) * 0.05).to(wdtype)
    b = torch.randn(E, N, device=device, dtype=torch.bfloat16)
    dy = torch.randn(T, N, device=device, dtype=torch.bfloat16)
    m = torch.tensor(SPLITS, dtype=torch.int64, device=device)

    def mis(name):
        return which == name or which == "all" or (name == "weight" and which == "weight_fp32")

    def run(misaligned: bool):
        def pick(name, t, offset=1):
            return offset_view(t, offset) if misaligned and mis(name) else t.clone()
        xl = pick("x", x).requires_grad_()
        wl = pick("weight", w, 3).requires_grad_()
        bl = pick("bias", b).requires_grad_()
        use_mg = which in ("main_grad", "all")
        if use_mg:
            mg, buf, span = guarded(w.shape, device) if misaligned else (torch.zeros(w.shape, device=device), None, None)
            wl.main_grad = mg
        y = moegemm.grouped_linear(xl, wl, pick("m_splits", m), bl, recipe=recipe)
        y.backward(pick("dy", dy))
        if use_mg:
            assert wl.grad is None
            if buf is not None:
                assert guards_intact(buf, span), "main_grad's neighbours were written"
        return y.detach(), xl.grad, (wl.main_grad if use_mg else wl.grad), bl.grad

    got, exp = run(True), run(False)
    for g, e in zip(got, exp):
        assert torch.equal(g, e)
    cuda_alive()


MLP_WHICH = ["x", "fc1_weight", "fc2_weight", "fc1_bias", "fc2_bias", "probs", "main_grad", "dy", "all"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("which", MLP_WHICH)
def test_misaligned_mlp(device, recipe, which):
    torch.manual_seed(21)
    x = torch.randn(T, H, device=device, dtype=torch.bfloat16)
    w1 = (torch.randn(E, 2 * F, H, device=device) * 0.08).to(torch.bfloat16)
    w2 = (torch.randn(E, H, F, device=device) * 0.08).to(torch.bfloat16)
    b1 = torch.randn(E, 2 * F, device=device, dtype=torch.bfloat16) * 0.1
    b2 = torch.randn(E, H, device=device, dtype=torch.bfloat16) * 0.1
    p = torch.rand(T, device=device)
    dy = torch.randn(T, H, device=device, dtype=torch.bfloat16)

    def run(misaligned: bool):
        def pick(name, t, offset=1):
            return offset_view(t, offset) if misaligned and which in (name, "all") else t.clone()
        leaves = [pick(n, t).requires_grad_() for n, t in
                  (("x", x), ("fc1_weight", w1), ("fc2_weight", w2), ("fc1_bias", b1), ("fc2_bias", b2), ("probs", p))]
        use_mg = which in ("main_grad", "all")
        bufs = []
        if use_mg:
            for wl in leaves[1:3]:
                if misaligned:
                    mg, buf, span = guarded(wl.shape, device, offset=5)
                    bufs.append((buf, span))
                else:
                    mg = torch.zeros(wl.shape, device=device)
                wl.main_grad = mg
        y = moegemm.grouped_mlp(leaves[0], leaves[1], leaves[2], SPLITS, leaves[5], leaves[3], leaves[4],
                                activation="swiglu", recipe=recipe)
        y.backward(pick("dy", dy))
        for buf, span in bufs:
            assert guards_intact(buf, span)
        grads = [t.grad for t in leaves]
        if use_mg:
            grads[1], grads[2] = leaves[1].main_grad, leaves[2].main_grad
        return [y.detach()] + grads

    for g, e in zip(run(True), run(False)):
        assert torch.equal(g, e)
    cuda_alive()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_misaligned_public_quantizers(device, dtype):
    torch.manual_seed(22)
    x = torch.randn(T, K, device=device).to(dtype)
    m = torch.tensor(SPLITS, device=device)
    (q1, s1, qT1, sT1), (q2, s2, qT2, sT2) = moegemm.quantize_act(offset_view(x, 1), m), moegemm.quantize_act(x.clone(), m)
    assert torch.equal(q1.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s1, s2)
    # the column copies are compared where they are defined (the padding columns are unspecified)
    plan = moegemm.make_plan(m, T)
    assert torch.equal(R.dequantize_cols(qT1, sT1, plan), R.dequantize_cols(qT2, sT2, plan))
    w = torch.randn(E, N, K, device=device).to(dtype)
    for a, b in zip(moegemm.quantize_weight(offset_view(w, 3)), moegemm.quantize_weight(w.clone())):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == torch.float8_e4m3fn else torch.equal(a, b)
    cuda_alive()


# ============================================================================= empty weight dimensions
@pytest.mark.parametrize("device", DEVICES)
def test_zero_N_or_K_rejected_before_any_kernel(device, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("backend used before validation")

    monkeypatch.setattr(backends, "select", boom)
    bf = torch.bfloat16
    x = torch.randn(T, K, device=device, dtype=bf)
    with pytest.raises(ValueError, match=r"weight\.shape\[1\]"):
        moegemm.grouped_linear(x, torch.zeros(E, 0, K, device=device, dtype=bf), SPLITS)
    with pytest.raises(ValueError, match=r"weight\.shape\[2\]"):
        moegemm.grouped_linear(torch.zeros(T, 0, device=device, dtype=bf), torch.zeros(E, N, 0, device=device, dtype=bf),
                               SPLITS)
    with pytest.raises(ValueError, match=r"weight\.shape\[[12]\]"):
        moegemm.quantize_weight(torch.zeros(E, 0, K, device=device, dtype=bf))
    with pytest.raises(ValueError, match=r"weight\.shape\[[12]\]"):
        moegemm.quantize_weight(torch.zeros(E, N, 0, device=device, dtype=bf))
    xm = torch.randn(T, H, device=device, dtype=bf)
    with pytest.raises(ValueError, match=r"fc1_weight\.shape\[1\]"):
        moegemm.grouped_mlp(xm, torch.zeros(E, 0, H, device=device, dtype=bf), torch.zeros(E, H, 0, device=device, dtype=bf),
                            SPLITS, activation="relu")
    with pytest.raises(ValueError, match=r"fc[12]_weight\.shape\[[12]\]"):
        moegemm.grouped_mlp(torch.zeros(T, 0, device=device, dtype=bf), torch.zeros(E, 2 * F, 0, device=device, dtype=bf),
                            torch.zeros(E, 0, F, device=device, dtype=bf), SPLITS)


# ======================================================================= dtype errors before device work
@requires_cuda
@pytest.mark.parametrize("xdtype", [torch.float32, torch.float16])
def test_cuda_x_dtype_error_before_any_device_work(xdtype):
    """x of a dtype the CUDA path does not take raises TypeError before the checked mode's sync and before
    the host-to-device copy of list m_splits."""
    torch.manual_seed(23)
    x = torch.randn(T, K, device="cuda").to(xdtype)
    w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16)
    xm = torch.randn(T, H, device="cuda").to(xdtype)
    w1 = torch.randn(E, 2 * F, H, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(E, H, F, device="cuda", dtype=torch.bfloat16)
    m_dev = torch.tensor(SPLITS, device="cuda")
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.cuda.set_sync_debug_mode("error")
        try:
            for ms, check in ((SPLITS, None), (torch.tensor(SPLITS), None), (m_dev, True)):
                with pytest.raises(TypeError, match=r"x\.dtype"):
                    moegemm.grouped_linear(x, w, ms, check_splits=check)
                with pytest.raises(TypeError, match=r"x\.dtype"):
                    moegemm.grouped_mlp(xm, w1, w2, ms, check_splits=check)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
    copies = [ev.name for ev in prof.events() if "memcpy" in ev.name.lower() or "HtoD" in ev.name]
    assert not copies, copies
    cuda_alive()


# ======================================================================== zero-stride expanded weight
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES)
def test_zero_stride_weight(device, recipe):
    torch.manual_seed(24)
    x = torch.randn(T, K, device=device, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(E, N, device=device, dtype=torch.bfloat16)
    w0 = torch.zeros(1, device=device, dtype=torch.bfloat16).expand(E, N, K)
    y = moegemm.grouped_linear(x, w0, SPLITS, b, recipe=recipe)
    y.backward(torch.randn_like(y))
    assert torch.equal(y, torch.cat([b[e].expand(c, N) for e, c in enumerate(SPLITS)]))
    assert (x.grad == 0).all()
    # a weight shared by all experts through a zero stride equals its materialised copy
    w1 = (torch.randn(1, N, K, device=device) * 0.05).to(torch.bfloat16)
    we = w1.expand(E, N, K).requires_grad_()
    wc = w1.expand(E, N, K).contiguous().requires_grad_()
    ye = moegemm.grouped_linear(x.detach(), we, SPLITS, recipe=recipe)
    yc = moegemm.grouped_linear(x.detach(), wc, SPLITS, recipe=recipe)
    assert torch.equal(ye, yc)
    dy = torch.randn_like(ye)
    ye.backward(dy)
    yc.backward(dy)
    assert we.grad.shape == (E, N, K) and torch.equal(we.grad, wc.grad)


# ================================================================================== main_grad misuse
@pytest.mark.parametrize("device", DEVICES)
def test_main_grad_wrong_at_forward(device):
    x = torch.randn(T, K, device=device, dtype=torch.bfloat16)
    w = torch.randn(E, N, K, device=device, dtype=torch.bfloat16, requires_grad=True)
    w.main_grad = torch.zeros(E, N, K, device=device, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="main_grad"):
        moegemm.grouped_linear(x, w, SPLITS)
    for bad in (torch.zeros(E, N, K + 16, device=device), torch.zeros(E * N * K, device=device),
                torch.zeros(E, K, N, device=device).transpose(1, 2)):
        w.main_grad = bad
        with pytest.raises(ValueError, match="main_grad"):
            moegemm.grouped_linear(x, w, SPLITS)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES)
def test_main_grad_replaced_between_forward_and_backward(device, recipe):
    """A main_grad swapped for a wrong one after forward: backward raises (never writes past it)."""
    torch.manual_seed(25)
    x = torch.randn(T, K, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(E, N, K, device=device) * 0.05).to(torch.bfloat16).requires_grad_()
    bads = [(E, N, K - 16), (E, N - 16, K), (E - 1, N, K), (E * N * K,), (2, E, N, K)]
    dtypes = [torch.float32] * len(bads)
    if device == "cuda":  # the reference path's add_ casts; the CUDA accumulate op takes fp32 only
        bads.append((E, N, K))
        dtypes.append(torch.bfloat16)
    for shape, dt in zip(bads, dtypes):
        w.main_grad = torch.zeros(E, N, K, device=device)
        y = moegemm.grouped_linear(x, w, SPLITS, recipe=recipe)
        n = 1
        for s in shape:
            n *= s
        view, buf, span = guarded((n,), device, dtype=dt)
        w.main_grad = view.view(shape)
        with pytest.raises((RuntimeError, ValueError, TypeError)):
            y.backward(torch.ones_like(y))
        assert guards_intact(buf, span) and (view == 0).all(), shape
        x.grad = None
        cuda_alive()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES)
def test_main_grad_read_when_backward_runs(device, recipe):
    """main_grad is looked up when backward runs (as a sharded-gradient wrapper may set it only then):
    set after forward, it receives the gradient; removed after forward, .grad does."""
    torch.manual_seed(27)
    x = torch.randn(T, K, device=device, dtype=torch.bfloat16)
    w = (torch.randn(E, N, K, device=device) * 0.05).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(T, N, device=device, dtype=torch.bfloat16)
    moegemm.grouped_linear(x, w, SPLITS, recipe=recipe).backward(dy)
    plain, w.grad = w.grad.float(), None
    y = moegemm.grouped_linear(x, w, SPLITS, recipe=recipe)
    w.main_grad = torch.zeros(E, N, K, device=device)
    y.backward(dy)
    assert w.grad is None and torch.allclose(w.main_grad, plain, rtol=1e-2, atol=1e-2)
    y = moegemm.grouped_linear(x, w, SPLITS, recipe=recipe)
    del w.main_grad
    y.backward(dy)
    assert w.grad is not None and torch.allclose(w.grad.float(), plain, rtol=1e-2, atol=1e-2)


# ===================================================================================== inference mode
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES)
def test_inference_mode(device, recipe):
    torch.manual_seed(26)
    lin = moegemm.GroupedLinear(E, K, N, bias=True, recipe=recipe, device=device)
    mlp = moegemm.GroupedMLP(E, H, F, activation="swiglu", bias=True, recipe=recipe, device=device)
    x = torch.randn(T, K, device=device, dtype=torch.bfloat16)
    xm = torch.randn(T, H, device=device, dtype=torch.bfloat16)
    p = torch.rand(T, device=device)
    m = torch.tensor(SPLITS, device=device)
    with torch.no_grad():
        y_ng, ym_ng = lin(x, m), mlp(xm, m, p)
    with torch.inference_mode():
        y_im, ym_im = lin(x, m), mlp(xm, m, p)
        xi = torch.randn(T, K, device=device, dtype=torch.bfloat16)  # an inference tensor as input
        assert lin(xi, SPLITS).shape == (T, N)
    assert torch.equal(y_ng, y_im) and torch.equal(ym_ng, ym_im)
    # grad mode with the same inputs still works afterwards
    xg = x.clone().requires_grad_()
    lin(xg, m).sum().backward()
    assert xg.grad is not None and torch.isfinite(xg.grad).all()


# ====================================================================================== CUDA specifics
@requires_cuda
def test_cuda_mixed_devices_rejected():
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16)
    xm = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    w1 = torch.randn(E, 2 * F, H, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(E, H, F, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="probs"):
        moegemm.grouped_mlp(xm, w1, w2, SPLITS, probs=torch.rand(T))
    with pytest.raises(ValueError, match="fc2_weight"):
        moegemm.grouped_mlp(xm, w1, w2.cpu(), SPLITS)
    wl = w.clone().requires_grad_()
    wl.main_grad = torch.zeros(E, N, K)
    with pytest.raises(ValueError, match="main_grad"):
        moegemm.grouped_linear(x, wl, SPLITS)
    cuda_alive()
