"""The bf16 GEMMs' dynamic tile walk (csrc/kernels/gemm/cutlass/dynamic_scheduler.cuh: CTAs claim tiles off a counter
that the argument-building kernel zeroes). On a Hopper GPU: fprop, dgrad and each wgrad output match the float64
reference on edge problems (empty experts, one expert, E = 257, fewer and more tiles than SMs), and are bitwise the
same from call to call and under SM budgets of 1 and 7 (a tile's result does not depend on which CTA claimed it);
the counter starts afresh in every replay of a captured CUDA graph."""

from __future__ import annotations

import pytest
import torch

import moegemm
from moegemm import reference as ref
from conftest import capture_step, rel, requires_cuda
from training_step import assert_bitwise

# (splits, N, K): empty experts, one expert, 257 experts, fewer tiles than SMs and many more
PROBLEMS = [
    ([0, 0, 0], 256, 512),
    ([0, 5, 0, 300, 129, 0], 512, 384),
    ([4000], 768, 256),
    ([3] * 257, 128, 256),
    ([1000, 0, 2500, 17, 600, 0, 3000, 128], 2048, 1024),
]
NAMES = ["fprop", "dgrad", "wgrad bf16", "wgrad f32", "wgrad accumulated"]


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
    """fprop, dgrad, wgrad in bf16 and fp32, and wgrad accumulated into a copy of `acc`."""
    from moegemm.backends import cuda as ops
    return [ops.gemm_bf16_fprop(x, w, plan).clone(), ops.gemm_bf16_dgrad(dy, w, plan).clone(),
            ops.gemm_bf16_wgrad(dy, x, plan, out_dtype=torch.bfloat16).clone(), ops.gemm_bf16_wgrad(dy, x, plan).clone(),
            ops.gemm_bf16_wgrad(dy, x, plan, out=acc.clone())]


def reference_outputs(plan, x, w, dy, acc):
    plan = plan.cpu()
    x, w, dy, acc = x.cpu(), w.cpu(), dy.cpu(), acc.cpu()
    return [ref.gemm_bf16_fprop(x, w, plan), ref.gemm_bf16_dgrad(dy, w, plan),
            ref.gemm_bf16_wgrad(dy, x, plan, out_dtype=torch.bfloat16), ref.gemm_bf16_wgrad(dy, x, plan),
            ref.gemm_bf16_wgrad(dy, x, plan, out=acc.clone())]


@requires_cuda
@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: f"E{len(p[0])}-T{sum(p[0])}-N{p[1]}-K{p[2]}")
def test_every_output_matches_the_reference_under_every_budget(problem):
    args = operands(*problem)
    expected = reference_outputs(*args)
    first = every_output(*args)
    for name, got, want in zip(NAMES, first, expected):
        assert rel(got.cpu(), want) <= (5e-3 if name == "wgrad bf16" else 8e-3), name
    for budget in (None, 1, 7):
        moegemm.set_num_sms(budget)
        assert_bitwise(every_output(*args), first, f"{', '.join(NAMES)} with budget {budget} against the first call")


@requires_cuda
def test_walk_restarts_in_every_graph_replay():
    """Each replay zeroes the walk's counter again (the argument-building kernel is in the graph): the output, cleared
    between replays, is computed anew each time."""
    plan, x, w, dy, acc = operands([700, 0, 1300, 45, 2000], 1024, 512, seed=1)
    from moegemm.backends import cuda as ops
    expected = ops.gemm_bf16_fprop(x, w, plan).clone()
    graph, out = capture_step(lambda: ops.gemm_bf16_fprop(x, w, plan))
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise([out], [expected], "a graph replay")
