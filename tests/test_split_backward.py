"""Split backward: with a WgradStore / ``delay_wgrad_compute`` the backward computes dx, the
bias and probs gradients at once and leaves the weight gradients to ``backward_dw()``. Gradients equal the
non-split path's (same GEMMs on the same operands: bitwise); several pending backward passes accumulate;
on the GPU: one op per direction (``linear_wgrad`` / ``mlp_wgrad`` for backward_dw), fakes, no host sync,
CUDA-graph capture of forward + backward + backward_dw replayed with new m_splits, torch.compile.
The same tests run on the reference backend (CPU) and, with a Hopper GPU, on the CUDA ops."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import moegemm
from moegemm.backends import contract
from moegemm.layout import ACTIVATIONS, RECIPE_IDS

from conftest import HAS_HOPPER, capture_step, rel, requires_cuda, zipf_splits

DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]
RECIPES = ["fp8_blockwise", "bf16"]


def _linear_pair(device, recipe, wdtype, E=4, K=128, N=256, bias=True):
    torch.manual_seed(0)
    a = moegemm.GroupedLinear(E, K, N, bias=bias, recipe=recipe, device=device, dtype=wdtype)
    b = copy.deepcopy(a)
    b.delay_wgrad_compute = True
    return a, b


def _mlp_pair(device, recipe, activation, wdtype, E=4, H=128, F=128, bias=True):
    torch.manual_seed(0)
    a = moegemm.GroupedMLP(E, H, F, activation=activation, bias=bias, recipe=recipe, device=device, dtype=wdtype)
    b = copy.deepcopy(a)
    b.delay_wgrad_compute = True
    return a, b


def _with_main_grad(mod):
    for p in (mod.parameters() if not isinstance(mod, moegemm.GroupedLinear) else [mod.weight]):
        if p.dim() == 3:
            p.main_grad = torch.zeros(p.shape, device=p.device, dtype=torch.float32)


def _wgrad(p):
    return p.main_grad if hasattr(p, "main_grad") else p.grad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("main_grad", [False, True])
def test_linear_split_equals_regular(device, recipe, wdtype, main_grad):
    ref, split = _linear_pair(device, recipe, wdtype)
    if main_grad:
        _with_main_grad(ref), _with_main_grad(split)
    T = 300
    splits = zipf_splits(4, T)
    x = torch.randn(T, 128, device=device, dtype=torch.bfloat16)
    dy = torch.randn(T, 256, device=device, dtype=torch.bfloat16)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    ref(xs[0], splits).backward(dy)
    split(xs[1], splits).backward(dy)
    assert torch.equal(xs[0].grad, xs[1].grad) and torch.equal(ref.bias.grad, split.bias.grad)
    assert split.weight.grad is None  # not yet
    if main_grad:
        assert split.weight.main_grad.abs().sum() == 0
    assert len(split._wgrad_store) == 1
    split.backward_dw()
    assert len(split._wgrad_store) == 0
    assert torch.equal(_wgrad(ref.weight), _wgrad(split.weight))
    assert (split.weight.grad is None) == main_grad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("activation", ["swiglu", "relu"])
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("main_grad", [False, True])
def test_mlp_split_equals_regular(device, recipe, activation, wdtype, main_grad):
    ref, split = _mlp_pair(device, recipe, activation, wdtype)
    if main_grad:
        _with_main_grad(ref), _with_main_grad(split)
    T = 300
    splits = zipf_splits(4, T)
    x = torch.randn(T, 128, device=device, dtype=torch.bfloat16)
    probs = torch.rand(T, device=device)
    dy = torch.randn(T, 128, device=device, dtype=torch.bfloat16)
    grads = []
    for mod in (ref, split):
        xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
        mod(xi, splits, pi).backward(dy)
        if mod is split:
            assert mod.fc1.weight.grad is None and mod.fc2.weight.grad is None
            mod.backward_dw()
        grads.append([xi.grad, pi.grad, mod.fc1.bias.grad, mod.fc2.bias.grad, _wgrad(mod.fc1.weight),
                      _wgrad(mod.fc2.weight)])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES)
def test_pending_backward_passes_accumulate(device, recipe):
    ref, split = _mlp_pair(device, recipe, "swiglu", torch.float32, bias=False)
    T = 256
    batches = [(torch.randn(T, 128, device=device, dtype=torch.bfloat16), zipf_splits(4, T)) for _ in range(2)]
    for mod in (ref, split):
        for x, splits in batches:
            mod(x.clone().requires_grad_(), splits).float().square().sum().backward()
    split.backward_dw()
    for a, b in ((ref.fc1.weight, split.fc1.weight), (ref.fc2.weight, split.fc2.weight)):
        assert rel(b.grad, a.grad) <= 1e-6


def test_functional_store_and_forgotten_backward_dw():
    store = moegemm.WgradStore(max_pending=2)
    w = torch.randn(2, 32, 32, requires_grad=True)
    x = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            moegemm.grouped_linear(x, w, [40, 24], recipe="bf16", wgrad_store=store).sum().backward()
    assert len(store) == 3 and any("backward_dw" in str(c.message) for c in caught)
    assert w.grad is None and x.grad is not None
    store.clear()
    assert len(store) == 0 and w.grad is None
    moegemm.grouped_linear(x, w, [40, 24], recipe="bf16", wgrad_store=store).sum().backward()
    store.backward_dw()
    expected = torch.autograd.grad(moegemm.grouped_linear(x, w, [40, 24], recipe="bf16").sum(), w)[0]
    assert torch.equal(w.grad, expected)


def test_split_backward_refuses_non_leaf_weights():
    """The deferred gradient goes to the weight itself (main_grad or .grad), outside autograd: a weight
    computed from another tensor (master.bfloat16()) would lose it silently, so it is refused."""
    master = torch.randn(2, 128, 128, requires_grad=True)
    x = torch.randn(64, 128, dtype=torch.bfloat16)
    store = moegemm.WgradStore()
    with pytest.raises(ValueError, match="weight to be a leaf"):
        moegemm.grouped_linear(x, master.bfloat16(), [40, 24], wgrad_store=store)
    w2 = torch.randn(2, 128, 128, requires_grad=True)
    with pytest.raises(ValueError, match="fc1_weight to be a leaf"):
        moegemm.grouped_mlp(x, master.repeat(1, 2, 1).bfloat16(), w2, [40, 24], activation="swiglu", wgrad_store=store)
    assert len(store) == 0


# ------------------------------------------------------------------------------------------------ GPU only
if HAS_HOPPER:
    from moegemm.backends import cuda as cuda_ops  # noqa: F401


@requires_cuda
@pytest.mark.parametrize("recipe", RECIPES)
def test_cuda_split_one_op_per_direction_and_no_host_sync(recipe):
    from test_cuda_api import ops_of

    _, mlp = _mlp_pair("cuda", recipe, "swiglu", torch.bfloat16, E=8, H=256, F=256)
    T = 1000
    x = torch.randn(T, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(T, device="cuda", requires_grad=True)
    m = torch.tensor(zipf_splits(8, T), device="cuda")
    mlp(x, m, probs).sum().backward()
    mlp.backward_dw()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mlp(x, m, probs).sum().backward()
        mlp.backward_dw()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    y, fwd = ops_of(lambda: mlp(x, m, probs))
    _, bwd = ops_of(lambda: y.sum().backward())
    _, dw = ops_of(mlp.backward_dw)
    assert fwd == ["moegemm::mlp_fwd"] and bwd == ["moegemm::mlp_bwd"] and dw == ["moegemm::mlp_wgrad"]


@requires_cuda
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_cuda_split_fakes_match_real(recipe, weight_dtype):
    from test_cuda_api import check_fake, linear_args

    ops = torch.ops.moegemm
    rid = RECIPE_IDS[recipe]
    x, w, m, b = linear_args(recipe, weight_dtype)
    y, plan, saved = ops.linear_fwd(x, w, m, b, rid, True, True)
    dy = torch.randn_like(y)
    dx, dw, db, *made = check_fake(ops.linear_bwd.default, dy, plan, saved, x, w, None, rid, True, True, True, True)
    pool = (*made, *saved, dy, x)  # what a split backward has; the wgrad operands by name (contract.py)
    operands = [pool[i] for i in contract.LINEAR.wgrad_gather(rid)]
    for mg in (None, torch.zeros(w.shape, device="cuda")):
        check_fake(ops.linear_wgrad.default, plan, operands, w, mg, rid)
    E, T, H, F = 8, 777, 256, 384
    w1 = (torch.randn(E, 2 * F, H, device="cuda") * 0.05).to(weight_dtype)
    w2 = (torch.randn(E, H, F, device="cuda") * 0.05).to(weight_dtype)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    probs, m = torch.rand(T, device="cuda"), torch.tensor(zipf_splits(E, T), device="cuda")
    act = ACTIVATIONS["swiglu"]
    for need_dw1, need_dw2 in [(True, True), (True, False), (False, True)]:
        y, plan, saved = ops.mlp_fwd(x, w1, w2, m, None, None, probs, act, rid, [], True, need_dw1, need_dw2)
        dy = torch.randn_like(y)
        out = check_fake(ops.mlp_bwd.default, dy, plan, saved, x, w1, w2, probs, [], None, None, act, rid, True,
                         need_dw1, need_dw2, False, False, True, False, True)
        pool = (*out[len(contract.MLP_BWD.outputs):], *saved, dy, x)  # made, saved, dy, x
        operands = [pool[i] for i in contract.MLP.wgrad_gather(rid)]
        check_fake(ops.mlp_wgrad.default, plan, operands, w1, w2, None, None, rid, need_dw1, need_dw2)


@requires_cuda
@pytest.mark.parametrize("recipe", RECIPES)
def test_cuda_graph_forward_backward_backward_dw(recipe):
    """forward + backward + backward_dw captured in one CUDA graph, replayed with new m_splits values:
    equal to the eager non-split path each time."""
    E, T, H, F = 8, 1024, 256, 256
    ref, split = _mlp_pair("cuda", recipe, "swiglu", torch.float32, E=E, H=H, F=F)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(T, device="cuda", requires_grad=True)
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    m = torch.tensor(zipf_splits(E, T), device="cuda")
    for p in split.parameters():
        p.grad = torch.zeros_like(p)

    def step():
        for p in split.parameters():
            p.grad.zero_()
        x.grad = probs.grad = None
        split(x, m, probs).backward(dy)
        split.backward_dw()
        return [x.grad, probs.grad] + [p.grad for p in split.parameters()]

    graph, static = capture_step(step)
    for _ in range(3):
        m.copy_(torch.tensor(zipf_splits(E, T), device="cuda"))
        graph.replay()
        ref.zero_grad(set_to_none=True)
        xe, pe = x.detach().clone().requires_grad_(), probs.detach().clone().requires_grad_()
        ref(xe, m, pe).backward(dy)
        torch.cuda.synchronize()
        expected = [xe.grad, pe.grad] + [p.grad for p in ref.parameters()]
        for a, b in zip(static, expected):
            assert rel(a, b) <= 1e-6


@requires_cuda
@pytest.mark.parametrize("recipe", RECIPES)
def test_cuda_split_under_torch_compile(recipe):
    """The split-backward layer runs outside the compiled graph (a graph break) and gives the eager values."""
    torch._dynamo.reset()
    ref, split = _mlp_pair("cuda", recipe, "swiglu", torch.bfloat16, E=8, H=256, F=256)
    T = 1024
    x = torch.randn(T, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    m = torch.tensor(zipf_splits(8, T), device="cuda")
    ref(x, m).float().square().sum().backward()
    gx = x.grad
    x.grad = None
    compiled = torch.compile(lambda x, m: split(x, m).float().square().sum())
    compiled(x, m).backward()
    split.backward_dw()
    assert rel(x.grad, gx) <= 1e-3
    for a, b in zip(ref.parameters(), split.parameters()):
        assert rel(b.grad, a.grad) <= 1e-3


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copy_with_pending_work_starts_empty(how):
    """A copy of a layer whose weight-gradient work is pending gets none of it: the work writes the original's
    gradients (once, as without the copy) and the copy's backward_dw() does nothing."""
    import io

    ref, split = _linear_pair("cpu", "bf16", torch.bfloat16)
    splits = zipf_splits(4, 300)
    x = torch.randn(300, 128, dtype=torch.bfloat16)
    dy = torch.randn(300, 256, dtype=torch.bfloat16)
    ref(x, splits).backward(dy)
    split(x, splits).backward(dy)
    if how == "deepcopy":
        twin = copy.deepcopy(split)
    else:
        buf = io.BytesIO()
        torch.save(split, buf)
        buf.seek(0)
        twin = torch.load(buf, weights_only=False)
    assert len(twin._wgrad_store) == 0 and len(split._wgrad_store) == 1
    twin.backward_dw()
    split.backward_dw()
    assert twin.weight.grad is None
    assert torch.equal(split.weight.grad, ref.weight.grad)
