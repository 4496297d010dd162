"""torch.compile(fullgraph=True) on the reference path (CPU): the reference layer ops are torch ops with the
C++ ops' schemas and fakes (``moegemm/backends/reference.py``), so the whole layer traces as one graph,
fp8_blockwise included, with m_splits as a list or a CPU tensor; compiled and eager give the same values."""

from __future__ import annotations

import re

import pytest
import torch

import moegemm

from conftest import zipf_splits

E, T, K, N = 4, 200, 128, 144


def _splits(kind: str):
    splits = zipf_splits(E, T)
    return splits if kind == "list" else torch.tensor(splits)


def _outputs(fn, leaves, dy):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    y = fn(*leaves)
    y.backward(dy)
    return [y.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("recipe", ["fp8_blockwise", "bf16"])
@pytest.mark.parametrize("splits", ["list", "tensor"])
def test_grouped_linear_fullgraph(recipe, splits):
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = _splits(splits)
    x = torch.randn(T, K, dtype=torch.bfloat16)
    w = (torch.randn(E, N, K) * 0.05).to(torch.bfloat16)
    b = torch.randn(E, N, dtype=torch.bfloat16)
    dy = torch.randn(T, N, dtype=torch.bfloat16)

    def f(x, w, b):
        return moegemm.grouped_linear(x, w, m, b, recipe=recipe)

    compiled = torch.compile(f, fullgraph=True)
    for got, want in zip(_outputs(compiled, (x, w, b), dy), _outputs(f, (x, w, b), dy)):
        assert torch.equal(got, want)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(f)(x, w, b)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    torch._dynamo.reset()


@pytest.mark.parametrize("recipe", ["fp8_blockwise", "bf16"])
def test_grouped_mlp_module_fullgraph(recipe):
    torch._dynamo.reset()
    torch.manual_seed(0)
    H, F = 128, 128
    mlp = moegemm.GroupedMLP(E, H, F, bias=True, recipe=recipe)
    m = _splits("tensor")
    x = torch.randn(T, H, dtype=torch.bfloat16)
    probs = torch.rand(T)
    dy = torch.randn(T, H, dtype=torch.bfloat16)

    def f(x, probs):
        return mlp(x, m, probs)

    compiled = torch.compile(f, fullgraph=True)
    runs = []
    for fn in (compiled, f):
        mlp.zero_grad(set_to_none=True)
        out = _outputs(fn, (x, probs), dy)
        runs.append(out + [p.grad for p in mlp.parameters()])
    for got, want in zip(*runs):
        assert torch.equal(got, want)
    torch._dynamo.reset()


def _split_layer(kind: str):
    torch.manual_seed(0)
    if kind == "GroupedLinear":
        layer = moegemm.GroupedLinear(E, K, N, recipe="bf16", delay_wgrad_compute=True)
        return layer, (lambda x, m: layer(x, m))
    if kind == "GroupedMLP":
        layer = moegemm.GroupedMLP(E, K, 64, recipe="fp8_blockwise", delay_wgrad_compute=True)
        return layer, (lambda x, m: layer(x, m))
    w = torch.nn.Parameter((torch.randn(E, N, K) * 0.05).to(torch.bfloat16))
    store = moegemm.WgradStore()
    holder = torch.nn.Module()
    holder.weight, holder.backward_dw = w, store.backward_dw
    return holder, (lambda x, m: moegemm.grouped_linear(x, w, m, recipe="bf16", wgrad_store=store))


@pytest.mark.parametrize("kind", ["GroupedLinear", "GroupedMLP", "grouped_linear"])
def test_split_backward_refused_under_fullgraph_with_moegemms_message(kind):
    """Split mode runs outside torch.compile's graphs (a graph break): fullgraph=True gets moegemm's own sentence,
    not torch's hint to remove a torch.compiler.disable from moegemm."""
    torch._dynamo.reset()
    _, f = _split_layer(kind)
    m = zipf_splits(E, T)
    x = torch.randn(T, K, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(RuntimeError) as err:
        torch.compile(f, fullgraph=True)(x, m)
    msg = str(err.value)
    assert msg.startswith("moegemm: the split backward (delay_wgrad_compute=True, or a wgrad_store) cannot run inside "
                          "a torch.compile graph with fullgraph=True"), msg
    assert "Compile without fullgraph=True" in msg
    assert "Remove the `torch.compiler.disable` call" not in msg and "InternalTorchDynamoError" not in msg
    torch._dynamo.reset()


@pytest.mark.parametrize("kind", ["GroupedLinear", "GroupedMLP", "grouped_linear"])
def test_split_backward_under_compile_without_fullgraph(kind):
    """Without fullgraph the split layer still runs (outside the graph) and gives eager's gradients, the weight's
    after backward_dw(); so does it under torch.no_grad() with fullgraph (no backward, nothing deferred)."""
    m = zipf_splits(E, T)
    x = torch.randn(T, K, dtype=torch.bfloat16)
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        layer, f = _split_layer(kind)
        xi = x.clone().requires_grad_()
        fn = torch.compile(f) if compiled else f
        y = fn(xi, m)
        y.float().square().sum().backward()
        layer.backward_dw()
        weight = next(p for p in layer.parameters())
        results.append((y.detach(), xi.grad, weight.grad))
    for got, want in zip(*results):
        assert got is not None and torch.equal(got, want)
    torch._dynamo.reset()
    layer, f = _split_layer(kind)
    with torch.no_grad():
        assert torch.equal(torch.compile(f, fullgraph=True)(x, m), f(x, m))
    torch._dynamo.reset()


@pytest.mark.parametrize("counts, message", [
    ([5, 0, 11, -1], "moegemm: m_splits must be non-negative"),
    ([5, 0, 5, 0], "moegemm: sum(m_splits) must equal x.shape[0] = 15"),
    ([16, 0, 0, 0], "moegemm: every count of m_splits must be at most x.shape[0] = 15"),
])
def test_cpu_tensor_splits_checked_inside_the_graph(counts, message):
    """A CPU tensor's counts cannot be read while tracing: the compiled graph checks them when it runs, as the eager
    call checks them on the host (a silently clamped plan otherwise)."""
    torch._dynamo.reset()
    x = torch.randn(15, 32, dtype=torch.bfloat16)
    w = torch.randn(4, 16, 32, dtype=torch.bfloat16)
    f = torch.compile(lambda x, w, m: moegemm.grouped_linear(x, w, m, recipe="bf16"), fullgraph=True)
    assert torch.equal(f(x, w, torch.tensor([5, 0, 10, 0])), moegemm.grouped_linear(x, w, [5, 0, 10, 0], recipe="bf16"))
    with pytest.raises(RuntimeError, match=re.escape(message)):
        f(x, w, torch.tensor(counts))
    torch._dynamo.reset()
