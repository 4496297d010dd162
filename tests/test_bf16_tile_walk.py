"""The bf16 GEMMs' tile walks (csrc/kernels/gemm/cutlass/dynamic_scheduler.cuh), picked at each launch by the A/B switch
MOEGEMM_AB_BF16_WALK=static|static1x1|dynamic: on a Hopper GPU every walk gives bitwise the static walk's results for
fprop, dgrad and each wgrad output on edge problems (empty experts, one expert, E = 257, fewer and more tiles than
SMs) and under SM budgets of 1 and 7; the dynamic walk's counter starts afresh in every replay of a captured CUDA
graph; a bad value is an error naming the variable."""

from __future__ import annotations

import pytest
import torch

import moegemm
from conftest import capture_step, requires_cuda

ENV = "MOEGEMM_AB_BF16_WALK"
WALKS = ("static1x1", "dynamic")

# (splits, N, K): empty experts, one expert, 257 experts, fewer tiles than SMs and many more
PROBLEMS = [
    ([0, 0, 0], 256, 512),
    ([0, 5, 0, 300, 129, 0], 512, 384),
    ([4000], 768, 256),
    ([3] * 257, 128, 256),
    ([1000, 0, 2500, 17, 600, 0, 3000, 128], 2048, 1024),
]


@pytest.fixture(autouse=True)
def no_budget():
    moegemm.set_num_sms(None)
    yield
    moegemm.set_num_sms(None)


def operands(splits, N, K, seed=0):
    from moegemm.backends import cuda as ops
    gen = torch.Generator(device="cuda").manual_seed(seed)
    E, T = len(splits), sum(splits)
    plan = ops.make_plan(torch.tensor(splits, device="cuda"), T)
    x = torch.randn(T, K, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(E, N, K, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
    dy = torch.randn(T, N, device="cuda", generator=gen).to(torch.bfloat16)
    acc = torch.randn(E, N, K, device="cuda", generator=gen)
    return plan, x, w, dy, acc


def every_output(plan, x, w, dy, acc):
    """fprop, dgrad, wgrad in bf16 and fp32, and wgrad accumulated into a copy of `acc`: as int16 words."""
    from moegemm.backends import cuda as ops
    outs = [ops.gemm_bf16_fprop(x, w, plan), ops.gemm_bf16_dgrad(dy, w, plan),
            ops.gemm_bf16_wgrad(dy, x, plan, out_dtype=torch.bfloat16), ops.gemm_bf16_wgrad(dy, x, plan),
            ops.gemm_bf16_wgrad(dy, x, plan, out=acc.clone())]
    return [o.view(torch.int16).clone() for o in outs]


@requires_cuda
@pytest.mark.parametrize("budget", [None, 1, 7])
@pytest.mark.parametrize("walk", WALKS)
@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: f"E{len(p[0])}-T{sum(p[0])}-N{p[1]}-K{p[2]}")
def test_every_walk_is_bitwise_the_static_walk(monkeypatch, problem, walk, budget):
    args = operands(*problem)
    monkeypatch.setenv(ENV, "static")
    expected = every_output(*args)
    monkeypatch.setenv(ENV, walk)
    moegemm.set_num_sms(budget)
    got = every_output(*args)
    names = ["fprop", "dgrad", "wgrad bf16", "wgrad f32", "wgrad accumulated"]
    for name, e, g in zip(names, expected, got):
        assert torch.equal(e, g), f"{name}: {walk} (budget {budget}) differs from the static walk"


@requires_cuda
def test_dynamic_walk_restarts_in_every_graph_replay(monkeypatch):
    """Each replay zeroes the walk's counter again (the argument-building kernel is in the graph): the output, cleared
    between replays, is computed anew each time."""
    plan, x, w, dy, acc = operands([700, 0, 1300, 45, 2000], 1024, 512, seed=1)
    from moegemm.backends import cuda as ops
    monkeypatch.setenv(ENV, "static")
    expected = ops.gemm_bf16_fprop(x, w, plan).clone()
    monkeypatch.setenv(ENV, "dynamic")
    graph, out = capture_step(lambda: ops.gemm_bf16_fprop(x, w, plan))
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), expected.view(torch.int16))


@requires_cuda
def test_bad_walk_names_the_variable(monkeypatch):
    plan, x, w, _, _ = operands([10, 20], 256, 256)
    from moegemm.backends import cuda as ops
    monkeypatch.setenv(ENV, "nosuch")
    with pytest.raises((ValueError, RuntimeError), match=ENV):
        ops.gemm_bf16_fprop(x, w, plan)
