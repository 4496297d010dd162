"""The Megatron adapter with the split backward and FP8 input: megatron-core's ``delay_wgrad_compute`` wired to the
split backward (``MoegemmExperts.backward_dw`` makes the weight gradients, then Megatron DDP's hooks run),
and FP8 tokens (``Fp8Rows``) as an FP8 dispatcher delivers them."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

import moegemm  # noqa: E402

from conftest import rel, requires_cuda, zipf_splits  # noqa: E402
from test_megatron import build_moe, cpu, dist_env, gpu, make_config  # noqa: E402,F401


def _experts_pair(device, dtype=torch.float32, recipe=None, **kw):
    torch.manual_seed(0)
    base = build_moe(make_config(device, "swiglu", bias=True, dtype=dtype), "moegemm", recipe=recipe).experts
    cfg = make_config(device, "swiglu", bias=True, dtype=dtype)
    cfg.delay_wgrad_compute = True  # set after validation: megatron asks for its EP-overlap schedule with it
    split = build_moe(cfg, "moegemm", recipe=recipe).experts
    split.load_state_dict(base.state_dict())
    assert split.delay_wgrad_compute and not base.delay_wgrad_compute
    assert split.linear_fc1.weight.skip_backward_post_hook
    return base, split


def _check_split(device, recipe):
    base, split = _experts_pair(device, recipe=recipe)
    E, H = base.num_local_experts, base.hidden_size
    T = 64
    splits = zipf_splits(E, T)
    x = torch.randn(T, H, device=device)
    probs = torch.rand(T, device=device)
    dy = torch.randn(T, H, device=device)
    hooks = []
    split.register_wgrad_accumulation_and_reduce_hooks(lambda: hooks.append(1))
    for p in (split.linear_fc1.weight, split.linear_fc2.weight):
        p.main_grad, p.grad_added_to_main_grad = torch.zeros(p.shape, device=device), False
    out = []
    for ex in (base, split):
        xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
        y, _ = ex(xi, torch.tensor(splits, device=device), pi)
        y.backward(dy)
        if ex is split:
            assert not hooks and split.linear_fc1.weight.main_grad.abs().sum() == 0
            split.backward_dw()
            assert hooks == [1] and split.linear_fc1.weight.grad_added_to_main_grad
        out.append((y, xi.grad, pi.grad, ex.linear_fc1.bias.grad))
    for a, b in zip(*out):
        assert torch.equal(a, b)
    for name in ("linear_fc1", "linear_fc2"):
        assert torch.equal(getattr(split, name).weight.main_grad, getattr(base, name).weight.grad.float())


@pytest.mark.parametrize("recipe", ["bf16", "fp8_blockwise"])
def test_delay_wgrad_compute_cpu(cpu, recipe):
    _check_split(cpu, recipe)


@requires_cuda
@pytest.mark.parametrize("recipe", ["bf16", "fp8_blockwise"])
def test_delay_wgrad_compute_cuda(gpu, recipe):
    _check_split(gpu, recipe)


def _check_fp8_tokens(device):
    base, _ = _experts_pair(device, dtype=torch.bfloat16, recipe="fp8_blockwise")
    E, H = base.num_local_experts, base.hidden_size
    T = 64
    splits = torch.tensor(zipf_splits(E, T), device=device)
    x = torch.randn(T, H, device=device, dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(T, device=device)
    y8, _ = base(moegemm.to_fp8_rows(x), splits, probs)
    y8.float().square().sum().backward()
    dx8 = x.grad
    x2 = x.detach().clone().requires_grad_()
    y, _ = base(x2, splits, probs)
    y.float().square().sum().backward()
    assert torch.equal(y8, y) and torch.equal(dx8, x2.grad)


def test_fp8_tokens_cpu(cpu):
    _check_fp8_tokens(cpu)


@requires_cuda
def test_fp8_tokens_cuda(gpu):
    _check_fp8_tokens(gpu)
