"""The primitive ops' contract (``moegemm/backends/primitives.py``) holds csrc/binding.cpp and the fakes to one
declaration: binding.cpp registers exactly the declared schemas (character for character: the public
``torch.ops.moegemm`` API) beside the layer ops of ``contract.py``, each with a kernel; every op with a tensor has a
fake with its schema's arguments, which ``fakes.register_cuda`` registers, and which torch accepts on that schema
and runs on fake tensors, returning what the schema returns. On CPU: binding.cpp is read as text."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from moegemm.backends import contract, fakes, primitives
from moegemm.layout import ACTIVATIONS, BLOCK, block_capacity, ceil_div, col_capacity, empty_row_scales

BINDING = Path(__file__).resolve().parent.parent / "csrc" / "binding.cpp"
LAYER_SCHEMA = re.compile(r"contract::(\w+)::k(Fwd|Bwd|Wgrad|Autograd)Schema")


def _block(text: str, opening: str) -> str:
    """The body of the block that starts with ``opening`` (``TORCH_LIBRARY(moegemm, m) {``), braces matched."""
    start = text.index(opening) + len(opening)
    depth, i = 1, start
    while depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    return text[start:i - 1]


def _calls(body: str, what: str) -> list:
    """``(first argument, has more arguments)`` of each ``m.<what>(...)`` in ``body``: the first argument's
    string literals joined (adjacent literals concatenate, as in C++), else its text."""
    out = []
    for m in re.finditer(rf"\bm\.{what}\(", body):
        rest = body[m.end():]
        lit = re.match(r'\s*((?:"(?:[^"\\]|\\.)*"\s*)+)', rest)
        if lit:
            first = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', lit.group(1)))
            after = rest[lit.end():].lstrip()
        else:
            expr = re.match(r"\s*([^,)]*)", rest)
            first, after = expr.group(1).strip(), rest[expr.end():].lstrip()
        out.append((first, after.startswith(",")))
    return out


def _binding():
    text = re.sub(r"//[^\n]*", "", BINDING.read_text())  # (no schema holds "//")
    defs = _calls(_block(text, "TORCH_LIBRARY(moegemm, m) {"), "def")
    impls = [name for name, _ in _calls(_block(text, "TORCH_LIBRARY_IMPL(moegemm, CUDA, m) {"), "impl")]
    return defs, impls


def _has_tensor(schema) -> bool:
    return any("Tensor" in str(a.type) for a in (*schema.arguments, *schema.returns))


def test_declarations_parse():
    names = [op.name for op in primitives.OPS]
    assert len(set(names)) == len(names), "a primitive declared twice"
    layer_names = {op.name for op in contract.OPS} | {"grouped_linear", "grouped_mlp"}
    for op in primitives.OPS:
        assert torch._C.parse_schema(op.schema).name == op.name
        assert op.name not in layer_names, f"{op.name} is a layer op (contract.py)"
    assert primitives.BY_NAME == {op.name: op for op in primitives.OPS}


def test_binding_registers_the_declared_schemas():
    """binding.cpp's literal schemas are the declared ones, each once; every other def is a layer op's schema
    from the generated contract header."""
    defs, _ = _binding()
    literal = [schema for schema, _ in defs if not LAYER_SCHEMA.fullmatch(schema)]
    declared = [op.schema for op in primitives.OPS]
    by_name = {torch._C.parse_schema(s).name: s for s in literal}
    assert len(by_name) == len(literal), "binding.cpp defines an op twice"
    missing = sorted(set(by_name) - set(primitives.BY_NAME))
    assert not missing, f"binding.cpp registers {missing}, which moegemm/backends/primitives.py does not declare"
    unregistered = sorted(set(primitives.BY_NAME) - set(by_name))
    assert not unregistered, f"moegemm/backends/primitives.py declares {unregistered}, which binding.cpp does not register"
    for name, schema in by_name.items():
        assert schema == primitives.BY_NAME[name].schema, (
            f"{name}: binding.cpp registers\n  {schema}\nmoegemm/backends/primitives.py declares\n  "
            f"{primitives.BY_NAME[name].schema}")
    assert sorted(literal) == sorted(declared)


def test_every_declared_op_has_a_kernel():
    """A CUDA kernel (``m.impl`` under TORCH_LIBRARY_IMPL(moegemm, CUDA)) for each op with tensors; an op without
    tensors carries its kernel in its def (it runs for every backend)."""
    defs, impls = _binding()
    with_kernel = {torch._C.parse_schema(s).name for s, more in defs if more and not LAYER_SCHEMA.fullmatch(s)}
    assert len(set(impls)) == len(impls), "a CUDA kernel registered twice"
    layer_names = {op.name for op in contract.OPS} | {"grouped_linear", "grouped_mlp"}
    assert set(impls) <= set(primitives.BY_NAME) | layer_names, "a CUDA kernel of an op nobody declares"
    for op in primitives.OPS:
        if _has_tensor(torch._C.parse_schema(op.schema)):
            assert op.name in impls and op.name not in with_kernel, f"{op.name}: no CUDA kernel in binding.cpp"
        else:
            assert op.name in with_kernel and op.name not in impls, f"{op.name}: its kernel belongs in its def"


@pytest.mark.parametrize("op", primitives.OPS, ids=lambda op: op.name)
def test_fake_matches_its_schema(op):
    """Every op with a tensor has a fake with the schema's argument names and defaults; an op without has none."""
    schema = torch._C.parse_schema(op.schema)
    if not _has_tensor(schema):
        assert op.fake is None, f"{op.name} has no tensors: torch dispatches it to no fake"
        return
    assert op.fake is not None, f"{op.name} has no fake (moegemm/backends/primitives.py)"
    params = inspect.signature(op.fake).parameters
    assert list(params) == [a.name for a in schema.arguments], op.name
    for a in schema.arguments:
        default = params[a.name].default
        if a.has_default_value():
            assert default == a.default_value, f"{op.name}: default of {a.name}"
        else:
            assert default is inspect.Parameter.empty, f"{op.name}: {a.name} has a default the schema lacks"


def test_register_cuda_registers_every_declared_fake(monkeypatch):
    registered = []

    def register_fake(name):
        registered.append(name)
        return lambda fn: fn

    monkeypatch.setattr(torch.library, "register_fake", register_fake)
    fakes.register_cuda()
    expected = {f"moegemm::{op.name}" for op in primitives.OPS if op.fake is not None}
    expected |= {f"moegemm::{op.name}" for op in contract.OPS} | {"moegemm::grouped_linear", "moegemm::grouped_mlp"}
    assert len(registered) == len(set(registered))
    assert set(registered) == expected


# ------------------------------------------------------------- the fakes on their schemas, on fake tensors
E, T, N, K, F = 3, 200, 256, 384, 256
SWIGLU = ACTIVATIONS["swiglu"]


def _examples():
    """Arguments of each op with a fake (shapes as the kernels take them)."""
    bf, f8, f32 = torch.bfloat16, torch.float8_e4m3fn, torch.float32
    C, B = col_capacity(T, E), block_capacity(T, E)
    plan = torch.empty(3, E + 1, dtype=torch.int32)
    x, w = torch.empty(T, K, dtype=bf), torch.empty(E, N, K, dtype=bf)
    h, da, probs = torch.empty(T, 2 * F, dtype=bf), torch.empty(T, F, dtype=bf), torch.empty(T)
    qa, sa = torch.empty(T, K, dtype=f8), empty_row_scales(T, ceil_div(K, BLOCK))
    qb, sb = torch.empty(E, N, K, dtype=f8), torch.empty(E, ceil_div(N, BLOCK), ceil_div(K, BLOCK))
    qaT, saT, qbT, sbT = (torch.empty(N, C, dtype=f8), torch.empty(B, N), torch.empty(K, C, dtype=f8),
                          torch.empty(B, K))
    dy = torch.empty(T, N, dtype=bf)

    def weight_copies(rows):  # quantize_weight's four outputs for a weight [E, rows, K]
        nb, kb = ceil_div(rows, BLOCK), ceil_div(K, BLOCK)
        return [torch.empty(E, rows, K, dtype=f8), torch.empty(E, nb, kb), torch.empty(E, K, rows, dtype=f8),
                torch.empty(E, kb, nb)]

    return {
        "make_plan": (torch.empty(E, dtype=torch.int64), T),
        "quantize_act": (x, plan, True, True),
        "requantize_cols": (qa, sa, plan),
        "quantize_weight": (w,),
        "quantize_weights": ([w, w],),
        "quantize_weights_into": ([w, w, w], [2, 1], weight_copies(2 * N) + weight_copies(N)),
        "act_quantize": (h, probs, SWIGLU, plan, True, True),
        "act_backward_quantize": (da, h, probs, SWIGLU, plan, True, True),
        "act_bf16": (h, probs, SWIGLU),
        "act_backward_bf16": (da, h, probs, SWIGLU),
        "gemm_fp8_ragged_rows": (qa, sa, qb, sb, plan),
        "gemm_fp8_ragged_reduction": (qaT, saT, qbT, sbT, plan, f32),
        "gemm_fp8_ragged_reduction_accumulate": (qaT, saT, qbT, sbT, plan, torch.empty(E, N, K)),
        "gemm_bf16_fprop": (x, w, plan),
        "gemm_bf16_dgrad": (dy, w, plan),
        "gemm_bf16_wgrad": (dy, x, plan, f32),
        "gemm_bf16_wgrad_accumulate": (dy, x, plan, torch.empty(E, N, K)),
        "add_bias_": (dy, torch.empty(E, N), plan),
        "bias_grad": (dy, plan),
    }


@pytest.fixture(scope="module")
def scratch_ops():
    """The declared ops with tensors defined in a scratch namespace, with the declared fakes."""
    namespace = "moegemm_primitive_contract"
    lib = torch.library.Library(namespace, "DEF")
    for op in primitives.OPS:
        if op.fake is not None:
            lib.define(op.schema)
            torch.library.register_fake(f"{namespace}::{op.name}", op.fake, lib=lib)
    yield getattr(torch.ops, namespace)
    lib._destroy()


def test_every_fake_has_an_example():
    assert set(_examples()) == {op.name for op in primitives.OPS if op.fake is not None}


@pytest.mark.parametrize("op", [op for op in primitives.OPS if op.fake is not None], ids=lambda op: op.name)
def test_fake_runs_on_its_schema(op, scratch_ops):
    """The fake, registered on the declared schema, runs on fake tensors and returns what the schema returns."""
    schema = torch._C.parse_schema(op.schema)
    with FakeTensorMode() as mode:
        args = [mode.from_tensor(a) if isinstance(a, torch.Tensor)
                else [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in a] if isinstance(a, list)
                else a for a in _examples()[op.name]]
        out = getattr(scratch_ops, op.name)(*args)
    returns = [r.type for r in schema.returns]
    if not returns:
        assert out is None
        return
    outs = out if len(returns) > 1 else (out,)
    assert len(outs) == len(returns)
    for o, r in zip(outs, returns):
        if isinstance(r, torch.ListType):  # Tensor[]
            assert isinstance(o, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in o), op.name
        else:
            assert isinstance(o, torch.Tensor), f"{op.name} returns {r}"
