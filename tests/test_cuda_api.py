"""The layer entries on the GPU: exactly one ``torch.ops.moegemm`` op per layer and direction,
run by one C++ autograd node per call, and every entry's fake (``moegemm/backends/fakes.py``,
from the contract) agrees with the real op in shape, dtype and strides. Skipped without a Hopper GPU."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import moegemm
from moegemm.layout import ACTIVATIONS, RECIPE_IDS

from conftest import HAS_HOPPER, requires_cuda, zipf_splits

pytestmark = requires_cuda
if HAS_HOPPER:
    from moegemm.backends import cuda as cuda_ops  # noqa: F401  (builds/loads the extension)

DEV = "cuda"
RECIPES = ["fp8_blockwise", "bf16"]


class MoegemmOps(TorchDispatchMode):
    """Records the name of every torch.ops.moegemm op dispatched while active (backward included: the
    autograd engine carries the mode to its threads)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "moegemm":
            self.names.append(func.name())
        return func(*args, **(kwargs or {}))


def ops_of(fn):
    with MoegemmOps() as mode:
        out = fn()
    torch.cuda.synchronize()
    return out, mode.names


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("bias", [False, True])
def test_grouped_linear_one_op_per_direction(recipe, bias):
    E, T, K, N = 8, 1000, 256, 384
    # the weight quantized inside the op in every call (fp8_weight_cache=False)
    layer = moegemm.GroupedLinear(E, K, N, bias=bias, recipe=recipe, device=DEV, fp8_weight_cache=False)
    x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    m = torch.tensor(zipf_splits(E, T), device=DEV)
    y, fwd = ops_of(lambda: layer(x, m))
    _, bwd = ops_of(lambda: y.sum().backward())
    assert fwd == ["moegemm::linear_fwd"] and bwd == ["moegemm::linear_bwd"]
    assert x.grad is not None and layer.weight.grad is not None
    with torch.no_grad():
        _, inference = ops_of(lambda: layer(x, m))
    assert inference == ["moegemm::grouped_linear"]  # the differentiable op's forward alone
    if recipe == "fp8_blockwise":  # the automatic FP8 weight cache: quantize_weights once, then one op per direction
        cached = moegemm.GroupedLinear(E, K, N, bias=bias, recipe=recipe, device=DEV)
        y, fwd = ops_of(lambda: cached(x, m))
        assert fwd == ["moegemm::quantize_weights", "moegemm::linear_fwd"]
        y.sum().backward()
        y, fwd = ops_of(lambda: cached(x, m))
        _, bwd = ops_of(lambda: y.sum().backward())
        assert fwd == ["moegemm::linear_fwd"] and bwd == ["moegemm::linear_bwd"]


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("bias", [False, True])
def test_grouped_mlp_one_op_per_direction(recipe, bias):
    E, T, H, F = 8, 1000, 256, 384
    # weights quantized inside the op in every call (fp8_weight_cache=False)
    mlp = moegemm.GroupedMLP(E, H, F, bias=bias, recipe=recipe, device=DEV, fp8_weight_cache=False)
    x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(T, device=DEV, requires_grad=True)
    m = torch.tensor(zipf_splits(E, T), device=DEV)
    y, fwd = ops_of(lambda: mlp(x, m, probs))
    _, bwd = ops_of(lambda: y.sum().backward())
    assert fwd == ["moegemm::mlp_fwd"] and bwd == ["moegemm::mlp_bwd"]
    assert x.grad is not None and probs.grad is not None and mlp.fc1.weight.grad is not None
    if recipe == "fp8_blockwise":  # the automatic FP8 weight cache: both weights by one quantize_weights, then one op per direction
        cached = moegemm.GroupedMLP(E, H, F, bias=bias, recipe=recipe, device=DEV)
        y, fwd = ops_of(lambda: cached(x, m, probs))
        assert fwd == ["moegemm::quantize_weights", "moegemm::mlp_fwd"]
        _, bwd = ops_of(lambda: y.sum().backward())
        y, fwd = ops_of(lambda: cached(x, m, probs))
        _, bwd = ops_of(lambda: y.sum().backward())
        assert fwd == ["moegemm::mlp_fwd"] and bwd == ["moegemm::mlp_bwd"]
    if recipe == "fp8_blockwise":  # reused FP8 weights (is_first_microbatch): still one op per direction
        mlp(x, m, probs, is_first_microbatch=True)
        y, fwd = ops_of(lambda: mlp(x, m, probs, is_first_microbatch=False))
        _, bwd = ops_of(lambda: y.sum().backward())
        assert fwd == ["moegemm::mlp_fwd"] and bwd == ["moegemm::mlp_bwd"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_layer_autograd_is_one_cpp_node(recipe):
    """Each call records one C++ node whose edges go straight to the leaves (no Python Function)."""
    E, T, H, F = 8, 1000, 256, 384
    lin = moegemm.GroupedLinear(E, H, F, bias=True, recipe=recipe, device=DEV)
    mlp = moegemm.GroupedMLP(E, H, F, recipe=recipe, device=DEV)
    x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(T, device=DEV, requires_grad=True)
    m = torch.tensor(zipf_splits(E, T), device=DEV)
    for y, node, leaves in ((lin(x, m), "LinearNode", (x, lin.weight, lin.bias)),
                            (mlp(x, m, probs), "MlpNode", (x, mlp.fc1.weight, mlp.fc2.weight, probs))):
        assert node in y.grad_fn.name() and "CppNode" in y.grad_fn.name(), y.grad_fn.name()
        edges = [f.variable for f, _ in y.grad_fn.next_functions if f is not None]
        assert all(any(e is leaf for e in edges) for leaf in leaves)
    with torch.no_grad():
        assert lin(x, m).grad_fn is None and mlp(x, m, probs).grad_fn is None


# --------------------------------------------------------------------------------------- fakes vs real
def assert_same_meta(real, fake, where):
    if isinstance(real, (list, tuple)):
        assert isinstance(fake, (list, tuple)) and len(real) == len(fake), where
        for i, (r, f) in enumerate(zip(real, fake)):
            assert_same_meta(r, f, f"{where}[{i}]")
        return
    assert (real.shape, real.dtype, real.stride()) == (fake.shape, fake.dtype, fake.stride()), where
    assert fake.device == real.device, where


def check_fake(op, *args):
    """The op's outputs against its fake's, on the same arguments (the fake under FakeTensorMode)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = op(*args)
    mode = FakeTensorMode()

    def fake_of(a):
        if isinstance(a, torch.Tensor):
            return mode.from_tensor(a)
        if isinstance(a, (list, tuple)):
            return type(a)(fake_of(t) for t in a)
        return a

    fake_args = [fake_of(a) for a in args]
    with mode:
        fake = op(*fake_args)
    assert_same_meta(real, fake, op.name())
    return real


def linear_args(recipe, weight_dtype=torch.bfloat16, T=777, E=8, K=256, N=384):
    x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16)
    w = (torch.randn(E, N, K, device=DEV) * 0.05).to(weight_dtype)
    m = torch.tensor(zipf_splits(E, T), device=DEV)
    return x, w, m, torch.randn(E, N, device=DEV)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("need", [(True, True), (True, False), (False, True), (False, False)])
def test_linear_fakes_match_real(recipe, weight_dtype, need):
    need_dx, need_dw = need
    ops = torch.ops.moegemm
    x, w, m, b = linear_args(recipe, weight_dtype)
    rid = RECIPE_IDS[recipe]
    y, plan, saved = check_fake(ops.linear_fwd.default, x, w, m, b, rid, need_dx, need_dw)
    dy = torch.randn_like(y)
    for main_grad in (None, torch.zeros(w.shape, device=DEV)):
        check_fake(ops.linear_bwd.default, dy, plan, saved, x, w, main_grad, rid, need_dx, need_dw, True)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("activation", ["swiglu", "relu"])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cached", [False, True])
def test_mlp_fakes_match_real(recipe, activation, weight_dtype, cached):
    if cached and recipe != "fp8_blockwise":
        pytest.skip("pre-quantized weights are an fp8_blockwise feature")
    E, T, H, F = 8, 777, 256, 384
    F1 = 2 * F if activation == "swiglu" else F
    ops = torch.ops.moegemm
    x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)
    w1 = (torch.randn(E, F1, H, device=DEV) * 0.05).to(weight_dtype)
    w2 = (torch.randn(E, H, F, device=DEV) * 0.05).to(weight_dtype)
    b1, b2 = torch.randn(E, F1, device=DEV), torch.randn(E, H, device=DEV)
    probs = torch.rand(T, device=DEV)
    m = torch.tensor(zipf_splits(E, T), device=DEV)
    fp8 = [*ops.quantize_weight(w1), *ops.quantize_weight(w2)] if cached else []
    act, rid = ACTIVATIONS[activation], RECIPE_IDS[recipe]
    for save, need_dw1, need_dw2 in [(True, True, True), (True, False, True), (True, True, False), (False, False, False)]:
        y, plan, saved = check_fake(ops.mlp_fwd.default, x, w1, w2, m, b1, b2, probs, act, rid, fp8, save, need_dw1, need_dw2)
        if not save:
            continue
        dy = torch.randn_like(y)
        for p in (probs, None):
            mg = (torch.zeros(w1.shape, device=DEV), torch.zeros(w2.shape, device=DEV))
            for mg1, mg2 in [(None, None), mg]:
                needs = (True, need_dw1, need_dw2, True, True, p is not None)
                check_fake(ops.mlp_bwd.default, dy, plan, saved, x, w1, w2, p, fp8, mg1, mg2, act, rid, *needs, False)


@pytest.mark.parametrize("recipe", RECIPES)
def test_layer_ops_opcheck(recipe):
    """torch.library.opcheck on the linear entries (the MLP ones: test_mlp_fakes_match_real). test_schema
    (SchemaCheckMode) cannot take float8 inputs: linear_bwd of fp8_blockwise gets the fake-tensor test."""
    ops = torch.ops.moegemm
    x, w, m, b = linear_args(recipe)
    # counts of 1 mod 128: every padding column and scale block of the transposed copies is written
    # (test_aot_dispatch_dynamic compares every output of eager and traced runs, padding included)
    splits = [129, 1, 257, 1, 129, 1, 1, 129]
    m, x = torch.tensor(splits, device=DEV), x[:sum(splits)].contiguous()
    rid = RECIPE_IDS[recipe]
    utils = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(ops.linear_fwd.default, (x, w, m, b, rid, True, True), test_utils=utils)
    y, plan, saved = ops.linear_fwd(x, w, m, b, rid, True, True)
    args = (torch.randn_like(y), plan, saved, x, w, torch.zeros(w.shape, device=DEV), rid, True, True, True)
    utils = ("test_faketensor",) if recipe == "fp8_blockwise" else ("test_schema", "test_faketensor")
    torch.library.opcheck(ops.linear_bwd.default, args, test_utils=utils)
    # the differentiable op: its Autograd kernel, its fake, and forward + backward traced by AOTAutograd
    # against eager (test_schema's SchemaCheckMode cannot take the float8 tensors inside its backward)
    xg, wg, bg = (t.detach().requires_grad_() for t in (x, w, b))
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    utils += ("test_schema",) if recipe == "bf16" else ()
    torch.library.opcheck(ops.grouped_linear.default, (xg, wg, m, bg, rid), test_utils=utils)


def backward_peak(mlp, x, m, probs):
    """Peak memory of one backward above what the forward left allocated."""
    x.grad = probs.grad = None
    mlp.zero_grad(set_to_none=True)
    y = mlp(x, m, probs)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y.backward(torch.ones_like(y))
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@pytest.mark.parametrize("recipe", RECIPES)
def test_mlp_backward_frees_saved_tensors_early(recipe, monkeypatch):
    """The backward op frees each saved tensor after its last use (the C++ node hands them over): its
    peak is lower than with the saved tensors kept to the end (the Python Function made to keep them)."""
    from moegemm.functional import mlp as mlp_module

    E, T, H, F = 8, 8192, 1024, 1024
    mlp = moegemm.GroupedMLP(E, H, F, recipe=recipe, device=DEV)
    x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    m = torch.tensor(zipf_splits(E, T), device=DEV)
    probs = torch.rand(T, device=DEV, requires_grad=True)
    backward_peak(mlp, x, m, probs)  # warm up
    freed = backward_peak(mlp, x, m, probs)
    unstash = mlp_module._unstash
    monkeypatch.setattr(mlp_module, "_unstash", lambda ctx: (unstash(ctx)[0], False))
    monkeypatch.setattr(cuda_ops, "LAYER_AUTOGRAD", False)  # the Python Function
    kept = backward_peak(mlp, x, m, probs)
    print(f"{recipe}: backward peak {freed / 2**20:.1f} MiB (saved tensors freed early), {kept / 2**20:.1f} MiB (kept)")
    assert freed < kept
