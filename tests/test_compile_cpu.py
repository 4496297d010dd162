"""torch.compile(fullgraph=True) on the reference path (CPU): the reference layer ops are torch ops with the
C++ ops' schemas and fakes (``moegemm/backends/reference.py``), so the whole layer traces as one graph,
fp8_blockwise included, with m_splits as a list or a CPU tensor; compiled and eager give the same values."""

from __future__ import annotations

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
