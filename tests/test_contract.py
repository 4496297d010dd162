"""The layer ops' contract (``moegemm/backends/contract.py``) holds C++, the fakes and the reference to one
declaration: the generated C++ header is current, the binding registers the contract's schemas, both
backends offer the backend protocol with the contract's signatures, and the reference ops' outputs are
exactly the contract's slots (real tensors of the declared shape and dtype where wanted, placeholders
elsewhere, which is also what the fakes produce). The C++ ops' outputs are held to the same fakes on a
Hopper GPU (test_cuda_api.py, test_split_backward.py)."""

from __future__ import annotations

import inspect
import itertools
import re
from pathlib import Path

import pytest
import torch

from moegemm.backends import contract, protocol
from moegemm.backends import reference as reference_backend
from moegemm.layout import ACTIVATIONS, BF16, FP8_BLOCKWISE

from conftest import requires_cuda

ROOT = Path(__file__).resolve().parent.parent
RECIPES = [BF16, FP8_BLOCKWISE]


def test_header_is_generated_from_the_contract():
    text = (ROOT / contract.HEADER).read_text()
    assert text == contract.header(), ("csrc/api/layer_contract.h is stale: run `python -m moegemm.backends.contract` "
                                       "after editing moegemm/backends/contract.py")


def test_binding_registers_the_contract_schemas():
    """csrc/binding.cpp defines each layer op from the generated header, and by no schema of its own."""
    text = (ROOT / "csrc" / "binding.cpp").read_text()
    for layer in contract.LAYERS:
        for const in ("kFwdSchema", "kBwdSchema", "kWgradSchema"):
            assert f"m.def(contract::{layer.name}::{const});" in text
    for op in contract.OPS:
        assert not re.search(rf'"\s*{op.name}\(', text), f"binding.cpp spells out {op.name}'s schema"


def test_cpp_entries_index_lists_by_name():
    """The entries take the slot enums of the generated header, not counts or positions of their own."""
    for name in ("grouped_linear.cpp", "grouped_mlp.cpp"):
        text = (ROOT / "csrc" / "api" / name).read_text()
        assert '#include "api/layer_contract.h"' in text
        assert not re.search(r"saved\[\d\]|operands\[\d\]|made\d\b", text), name
        assert not re.search(r"enum\s+\w*Slot", text), name


@pytest.mark.parametrize("op", contract.OPS, ids=lambda op: op.name)
def test_reference_ops_have_the_contract_schema(op):
    registered = getattr(torch.ops, reference_backend.NAMESPACE, None)
    assert str(getattr(registered, op.name).default._schema) == str(torch._C.parse_schema(
        f"{reference_backend.NAMESPACE}::{op.schema}"))


@requires_cuda
@pytest.mark.parametrize("op", contract.OPS, ids=lambda op: op.name)
def test_cuda_ops_have_the_contract_schema(op):
    from moegemm.backends import cuda  # noqa: F401  (builds/loads the extension)

    registered = getattr(torch.ops.moegemm, op.name).default._schema
    assert str(registered) == str(torch._C.parse_schema(f"moegemm::{op.schema}"))


def _protocol_members():
    return [n for n, v in vars(protocol.Backend).items() if callable(v) and not n.startswith("_")]


def _check_backend(module):
    """Every member of the protocol, the layer entries with the contract's schema, the primitives with the
    protocol's parameters."""
    entries = {op.name: op for op in contract.OPS}
    for name in _protocol_members():
        assert hasattr(module, name), f"{module.__name__} lacks {name}"
        want = [p for p in inspect.signature(getattr(protocol.Backend, name)).parameters if p != "self"]
        member = getattr(module, name)
        if name in entries:
            got = [a.name for a in member._schema.arguments]
            assert got == want == [a.name for a in torch._C.parse_schema(entries[name].schema).arguments], name
        else:
            assert list(inspect.signature(member).parameters) == want, name


def test_reference_backend_offers_the_protocol():
    _check_backend(reference_backend)
    assert set(op.name for op in contract.OPS) <= set(_protocol_members())


@requires_cuda
def test_cuda_backend_offers_the_protocol():
    from moegemm.backends import cuda

    _check_backend(cuda)


def test_contract_is_consistent():
    for layer in contract.LAYERS:
        for recipe in RECIPES:
            names = [s.name for s in layer.fwd.saved[recipe]]
            assert len(set(names)) == len(names)
            assert len(layer.bwd.made[recipe]) <= layer.bwd.made_count
            gather = layer.wgrad_gather(recipe)  # every operand is found: made, saved, or dy / x
            assert len(gather) == len(layer.wgrad.wgrad_operands[recipe])
        slots = [s for op in (layer.fwd, layer.bwd, layer.wgrad) for s in op.outputs]
        slots += [s for recipe in RECIPES for s in layer.fwd.saved[recipe] + layer.bwd.made[recipe]]
        assert all(d in contract.DIMS for s in slots for d in s.shape)
        for op in (layer.fwd, layer.bwd):
            assert op.fp8_weights and all(w in op.arguments for w in op.fp8_weights)


# ------------------------------------------------------------------ the reference ops against their slots
E, T, K, N, H, F = 3, 200, 128, 144, 128, 144
SPLITS = [70, 0, 130]


def _assert_conforms(op, args, real):
    """``real`` (the reference op's outputs) has exactly the slots' metadata: the fake's outputs on the same
    arguments, placeholders included."""
    fake = contract.outputs(op, contract.bind(op, args, {}))
    flat_real, flat_fake = _flatten(real), _flatten(fake)
    assert len(flat_real) == len(flat_fake), op.name
    for i, (r, f) in enumerate(zip(flat_real, flat_fake)):
        assert (r.shape, r.dtype, r.device) == (f.shape, f.dtype, f.device), f"{op.name} output {i}"
        if r.numel() > 1:  # the strides too (the row scales' K-major ones); a size-1 dimension's do not matter
            strides = [[st for st, n in zip(t.stride(), t.shape) if n > 1] for t in (r, f)]
            assert strides[0] == strides[1], f"{op.name} output {i} strides"


def _flatten(out):
    out = out if isinstance(out, (tuple, list)) else (out,)
    return [t for o in out for t in (o if isinstance(o, (list, tuple)) else (o,))]


def _linear_inputs(weight_dtype):
    torch.manual_seed(0)
    x = torch.randn(T, K, dtype=torch.bfloat16)
    w = (torch.randn(E, N, K) * 0.05).to(weight_dtype)
    return x, w, torch.tensor(SPLITS), torch.randn(E, N)


def _fp8_rows(x, m):
    """An FP8 x as quantize_act's row copy: (q, s)."""
    return reference_backend.quantize_act(x, reference_backend.make_plan(m, x.shape[0]), True, False)[:2]


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fp8_x", [False, True])
def test_reference_linear_ops_conform(recipe, weight_dtype, fp8_x):
    if fp8_x and recipe != FP8_BLOCKWISE:
        pytest.skip("an FP8 x is an fp8_blockwise input")
    ops = reference_backend
    x, w, m, b = _linear_inputs(weight_dtype)
    x, x_scales = _fp8_rows(x, m) if fp8_x else (x, None)
    for need_dx, need_dw, given in itertools.product((True, False), (True, False), (False, True)):
        fp8_weight = list(reference_backend.quantize_weight(w)) if given and recipe == FP8_BLOCKWISE else None
        args = (x, w, m, b, recipe, need_dx, need_dw, x_scales, fp8_weight)
        y, plan, saved = out = ops.linear_fwd(*args)
        _assert_conforms(contract.LINEAR_FWD, args, out)
        dy = torch.randn_like(y)
        for main_grad, defer in ((None, False), (torch.zeros(w.shape), False), (None, True)):
            bwd_args = (dy, plan, saved, x, w, main_grad, recipe, need_dx, need_dw, True, defer, fp8_weight, x_scales)
            dx, dw, db, *made = out = ops.linear_bwd(*bwd_args)
            _assert_conforms(contract.LINEAR_BWD, bwd_args, out)
            if defer and need_dw:
                pool = (*made, *saved, dy, x)
                operands = [pool[i] for i in contract.LINEAR.wgrad_gather(recipe)]
                for mg in (None, torch.zeros(w.shape)):
                    wgrad_args = (plan, operands, w, mg, recipe)
                    _assert_conforms(contract.LINEAR_WGRAD, wgrad_args, ops.linear_wgrad(*wgrad_args))


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("activation", ["swiglu", "relu"])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fp8_x", [False, True])
def test_reference_mlp_ops_conform(recipe, activation, weight_dtype, fp8_x):
    if fp8_x and recipe != FP8_BLOCKWISE:
        pytest.skip("an FP8 x is an fp8_blockwise input")
    ops = reference_backend
    torch.manual_seed(0)
    F1 = 2 * F if activation == "swiglu" else F
    x = torch.randn(T, H, dtype=torch.bfloat16)
    x, x_scales = _fp8_rows(x, torch.tensor(SPLITS)) if fp8_x else (x, None)
    w1, w2 = (torch.randn(E, F1, H) * 0.05).to(weight_dtype), (torch.randn(E, H, F) * 0.05).to(weight_dtype)
    b1, b2, probs, m = torch.randn(E, F1), torch.randn(E, H), torch.rand(T), torch.tensor(SPLITS)
    act = ACTIVATIONS[activation]
    fp8_sets = [[]] + ([[*ops.quantize_weight(w1), *ops.quantize_weight(w2)]] if recipe == FP8_BLOCKWISE else [])
    for fp8, (save, need_dw1, need_dw2) in itertools.product(
            fp8_sets, [(True, True, True), (True, False, True), (True, True, False), (False, False, False)]):
        args = (x, w1, w2, m, b1, b2, probs, act, recipe, fp8, save, need_dw1, need_dw2, x_scales)
        y, plan, saved = out = ops.mlp_fwd(*args)
        _assert_conforms(contract.MLP_FWD, args, out)
        if not save:
            continue
        dy = torch.randn_like(y)
        for p, defer in ((probs, False), (None, False), (probs, True)):
            needs = (True, need_dw1, need_dw2, True, True, p is not None)
            bwd_args = (dy, plan, saved, x, w1, w2, p, fp8, None, None, act, recipe, *needs, False, defer, x_scales)
            out = ops.mlp_bwd(*bwd_args)
            _assert_conforms(contract.MLP_BWD, bwd_args, out)
            if defer:
                pool = (*out[len(contract.MLP_BWD.outputs):], *saved, dy, x)
                operands = [pool[i] for i in contract.MLP.wgrad_gather(recipe)]
                wgrad_args = (plan, operands, w1, w2, None, None, recipe, need_dw1, need_dw2)
                _assert_conforms(contract.MLP_WGRAD, wgrad_args, ops.mlp_wgrad(*wgrad_args))


@pytest.mark.parametrize("recipe", RECIPES)
def test_reference_ops_opcheck(recipe):
    """torch.library.opcheck on the reference layer ops: their fakes (the contract's) against the real
    outputs, and eager against a compiled run."""
    ops = reference_backend
    x, w, m, b = _linear_inputs(torch.bfloat16)
    utils = ("test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(ops.linear_fwd, (x, w, m, b, recipe, True, True), test_utils=utils)
    y, plan, saved = ops.linear_fwd(x, w, m, b, recipe, True, True)
    args = (torch.randn_like(y), plan, saved, x, w, torch.zeros(w.shape), recipe, True, True, True)
    torch.library.opcheck(ops.linear_bwd, args, test_utils=("test_faketensor",))
