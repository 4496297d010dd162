"""A weight's ``overwrite_main_grad`` flag (Megatron-FSDP sets it; Transformer Engine reads it): the weight gradient
is written into ``main_grad`` instead of added to it. Stale values (NaN included) are gone, empty experts get zeros,
a second backward gives the gradient once, and the two MLP weights follow their own flags; in the regular backward
and the split backward's backward_dw (the Megatron experts: tests/test_megatron.py). The values equal those
accumulated into a zeroed main_grad. On the reference backend (CPU) and, with a Hopper GPU, on the CUDA ops."""

from __future__ import annotations

import copy

import pytest
import torch

import moegemm

from conftest import rel, requires_cuda

DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]
RECIPES = ["fp8_blockwise", "bf16"]
SPLITS = [70, 0, 129, 17, 0, 84]  # two empty experts


def _stale(p, overwrite: bool):
    """A main_grad full of stale values (NaN in expert 0), and the flag."""
    mg = torch.full(p.shape, 7.0, device=p.device, dtype=torch.float32)
    mg[0, 0, :3] = float("nan")
    p.main_grad = mg
    p.overwrite_main_grad = overwrite
    return mg


def _zeroed(p):
    p.main_grad = torch.zeros(p.shape, device=p.device, dtype=torch.float32)
    return p.main_grad


def _check_written(mg, expected):
    assert torch.isfinite(mg).all()
    assert rel(mg, expected) <= 1e-6
    for e, count in enumerate(SPLITS):
        if count == 0:
            assert (mg[e] == 0).all()


def _pair(make, split: bool):
    """A module and its copy, the copy with a split backward or not."""
    torch.manual_seed(0)
    ref = make()
    mod = copy.deepcopy(ref)
    mod.delay_wgrad_compute = split
    return ref, mod


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("split", [False, True])
def test_linear(device, recipe, split):
    E, K, N, T = len(SPLITS), 128, 256, sum(SPLITS)
    ref, mod = _pair(lambda: moegemm.GroupedLinear(E, K, N, recipe=recipe, device=device), split)
    x = torch.randn(T, K, device=device, dtype=torch.bfloat16)
    dy = torch.randn(T, N, device=device, dtype=torch.bfloat16)
    expected = _zeroed(ref.weight)
    ref(x, SPLITS).backward(dy)
    mg = _stale(mod.weight, True)
    for _ in range(2):  # the second backward writes over the first
        mod(x, SPLITS).backward(dy)
        mod.backward_dw()
        _check_written(mg, expected)
    assert mod.weight.main_grad is mg and mod.weight.grad is None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("split", [False, True])
def test_mlp_each_weight_its_own_flag(device, recipe, split):
    E, H, F, T = len(SPLITS), 128, 128, sum(SPLITS)
    ref, mod = _pair(lambda: moegemm.GroupedMLP(E, H, F, activation="swiglu", recipe=recipe, device=device), split)
    x = torch.randn(T, H, device=device, dtype=torch.bfloat16)
    probs = torch.rand(T, device=device)
    dy = torch.randn(T, H, device=device, dtype=torch.bfloat16)
    expected1, expected2 = _zeroed(ref.fc1.weight), _zeroed(ref.fc2.weight)
    ref(x, SPLITS, probs).backward(dy)
    mg1 = _stale(mod.fc1.weight, True)
    mg2 = _zeroed(mod.fc2.weight)
    mod.fc2.weight.overwrite_main_grad = False  # fc2 accumulates
    for n in (1, 2):
        mod(x, SPLITS, probs).backward(dy)
        mod.backward_dw()
        _check_written(mg1, expected1)
        assert rel(mg2, n * expected2) <= 1e-6


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("split", [False, True])
def test_flag_without_main_grad_accumulates(device, split):
    """Without a main_grad the flag changes nothing: .grad accumulates over backward passes (in the split backward
    into an fp32 .grad by the GEMM itself)."""
    E, K, N, T = len(SPLITS), 128, 256, sum(SPLITS)
    ref, mod = _pair(lambda: moegemm.GroupedLinear(E, K, N, recipe="fp8_blockwise", device=device,
                                                   dtype=torch.float32), split)
    mod.weight.overwrite_main_grad = True
    x = torch.randn(T, K, device=device, dtype=torch.bfloat16)
    dy = torch.randn(T, N, device=device, dtype=torch.bfloat16)
    ref(x, SPLITS).backward(dy)
    for n in (1, 2):
        mod(x, SPLITS).backward(dy)
        mod.backward_dw()
        assert rel(mod.weight.grad, n * ref.weight.grad) <= 1e-6


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_input(device):
    """An FP8 x (Fp8Rows): fc1's gradient, made from x's FP8 rows, written over main_grad too."""
    E, H, F, T = len(SPLITS), 128, 128, sum(SPLITS)
    ref, mod = _pair(lambda: moegemm.GroupedMLP(E, H, F, activation="swiglu", device=device), False)
    x = torch.randn(T, H, device=device, dtype=torch.bfloat16)
    dy = torch.randn(T, H, device=device, dtype=torch.bfloat16)
    expected = _zeroed(ref.fc1.weight)
    ref(moegemm.to_fp8_rows(x), SPLITS).backward(dy)
    mg = _stale(mod.fc1.weight, True)
    mod(moegemm.to_fp8_rows(x), SPLITS).backward(dy)
    _check_written(mg, expected)
