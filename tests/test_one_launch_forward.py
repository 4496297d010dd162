"""The fp8_blockwise forward quantizes x inside the GEMM's launch for an x of up to 2^23 values (csrc/moegemm.h
gemm_fp8_ragged_rows_quantize_a: the plan, x's FP8 row copy and the ragged-row GEMM by the GEMM's own CTAs;
heuristics.h quantize_a_in_gemm), on a Hopper GPU, with or without the weight gradient (the row copy it writes is
what forward saves and backward makes wgrad's column copy from): one launch with given FP8 weights, two when the
weights are quantized in the call (their launch builds the plan). Its row copy is bitwise x's own quantizer's, its
output the GEMM's on that copy, and its plan make_plan's: edge counts, counts that do not sum to T (clamped,
negative), special values, bias, int32 and int64 counts, weights given or quantized in the call, the expert MLP's
fc1, CUDA-graph replay with new m_splits, one kernel per call up to 2^23 values and two past them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moegemm import reference as R
from moegemm._env import env_flag
from moegemm.backends import contract
from moegemm.layout import ACTIVATIONS, FP8_BLOCKWISE

from conftest import (GEMM_EDGE_SPLITS, HAS_HOPPER, capture_step, cuda_kernels, poisoned, rel, requires_cuda,
                      zipf_splits)

pytestmark = [requires_cuda, pytest.mark.skipif(not env_flag("MOEGEMM_ONE_LAUNCH_FORWARD", True),
                                                 reason="MOEGEMM_ONE_LAUNCH_FORWARD=0 turns the fused forward off")]

if HAS_HOPPER:
    from moegemm.backends import cuda as cuda_ops

DEV = "cuda"
TOL = 4e-3  # relative to the float64 reference: fp32 accumulation and the one rounding to bf16


def forward(x, w, m, bias, given, need_dw):
    """linear_fwd's output and plan (need_dw: it also saves x's row copy)."""
    y, plan, _ = cuda_ops.linear_fwd(x, w, m, bias, FP8_BLOCKWISE, False, need_dw, None, given)
    return y, plan


def fused(names):
    """Whether the kernels a call ran include the GEMM with x's quantization in its launch (Config<N, 1, true>)."""
    return any("fp8_ragged_rows_kernel" in n and "true" in n for n in names)


def check(splits, K, N, T=None, bias_dtype=None, m_dtype=torch.int64, special=False, seed=0, weights_given=True):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    E = len(splits)
    T = sum(max(0, c) for c in splits) if T is None else T
    x = torch.randn(T, K, device=DEV, generator=gen).to(torch.bfloat16)
    if special and T > 0:
        flat = x.view(-1)
        idx = torch.randint(0, flat.numel(), (64,), device=DEV, generator=gen)
        values = torch.tensor([float("nan"), float("inf"), -float("inf"), 3e38, -1e30, 1e-39, -1e-40, 0.0],
                              device=DEV).to(torch.bfloat16)
        flat[idx] = values.repeat(8)
        x[T // 2] = 0  # an all-zero row: scale 1
        x[-1] *= 1e-35  # a tiny row: a subnormal scale
    w = (torch.randn(E, N, K, device=DEV, generator=gen) * 0.05).to(torch.bfloat16)
    bias = None if bias_dtype is None else (torch.randn(E, N, device=DEV, generator=gen) * 3).to(bias_dtype)
    m = torch.tensor(splits, dtype=m_dtype, device=DEV)
    given = list(cuda_ops.quantize_weight(w)) if weights_given else None  # None: quantized in the call
    y1, plan1 = poisoned(lambda: forward(x, w, m, bias, given, False), (T, N), torch.bfloat16)
    y2, plan2, saved = cuda_ops.linear_fwd(x, w, m, bias, FP8_BLOCKWISE, False, True, None, given)
    assert torch.equal(plan1, cuda_ops.make_plan(m, T)) and torch.equal(plan1, plan2)
    assert torch.equal(y1.view(torch.int16), y2.view(torch.int16))  # bitwise (NaNs included)
    covered = int(plan1[0, -1])
    if T > 0:  # the row copy the launch wrote (saved for wgrad) is x's own quantizer's, and y the GEMM's on it
        saved = contract.by_name(contract.LINEAR_FWD.saved[FP8_BLOCKWISE], saved)
        q, s, _, _ = cuda_ops.quantize_act(x, plan1, True, False)
        # (over the covered rows: no GEMM reads the others, which quantize_act zeroes and the fused launch quantizes)
        assert torch.equal(saved["qx"][:covered].view(torch.uint8), q[:covered].view(torch.uint8))
        assert torch.equal(saved["sx"][:covered].view(torch.int32), s[:covered].view(torch.int32))  # NaN scales too
        qw, sw = (given[0], given[1]) if given is not None else cuda_ops.quantize_weight(w)[:2]
        if bias is None:
            y_two = cuda_ops.gemm_fp8_ragged_rows(q, s, qw, sw, plan1)
            assert torch.equal(y1.view(torch.int16), y_two.view(torch.int16))
        elif not special:  # the bias in the epilogue (the GEMM primitive takes none): the reference's, in float64
            cpu = [t.cpu() for t in (q, s, qw, sw, plan1, bias)]
            y_ref = R.gemm_fp8_fprop(*cpu[:5], torch.bfloat16, cpu[5])
            assert rel(y1[:covered].cpu(), y_ref[:covered]) <= TOL
    assert not y1[covered:].any()  # rows no expert covers are zeros
    (y3, _), names = cuda_kernels(lambda: forward(x, w, m, bias, given, False))
    assert torch.equal(y1.view(torch.int16), y3.view(torch.int16))  # repeatable
    assert fused(names) == (T > 0), names  # the path under test ran (T >= 1 and at most 2^23 values here)


@pytest.mark.parametrize("name", sorted(GEMM_EDGE_SPLITS))
def test_edge_counts(name):
    check(GEMM_EDGE_SPLITS[name], K=256, N=384)


@pytest.mark.parametrize("K,N", [(16, 128), (144, 400), (1024, 192), (2048, 2816)])
def test_shapes(K, N):
    check(zipf_splits(8, 3000), K, N, seed=K + N)


# the heuristic's tilings of these problems (K = 256): 128, 192 and 256 columns on an H200 (on a device with less DRAM
# bandwidth, such as the H100 SXM, 128 and 256: heuristics.h; the fused 192-column form is then not reached, its
# non-fused form is tested in every tiling by test_gemm_fp8_ragged_rows.py)
@pytest.mark.parametrize("splits,N", [([0, 17, 130, 1, 64], 272), ([1000, 0, 2000, 1096], 2816), ([1000, 0, 2000, 1096], 768)])
def test_tilings(splits, N):
    check(splits, K=256, N=N, seed=N)


@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16])
def test_bias(bias_dtype):
    check(GEMM_EDGE_SPLITS["edge_counts"], K=400, N=144, bias_dtype=bias_dtype)


@pytest.mark.parametrize("m_dtype", [torch.int32, torch.int64])
def test_counts_not_summing_to_T(m_dtype):
    check([100, 50, 0, 30], K=128, N=128, T=400, m_dtype=m_dtype)  # rows 180.. covered by no expert
    check([300, 300, 300], K=128, N=128, T=500, m_dtype=m_dtype)  # clamped to T
    check([-5, 200, 100], K=128, N=256, T=300, m_dtype=m_dtype)  # a negative count counts as 0


def test_special_values():
    check(zipf_splits(16, 2000), K=384, N=256, special=True, seed=3)


def test_many_experts_and_tiles():
    check(zipf_splits(1024, 3000), K=128, N=128, seed=4)
    check(zipf_splits(64, 8000), K=1024, N=1536, seed=5)


@pytest.mark.parametrize("name", ["edge_counts", "one_expert_all_tokens"])
@pytest.mark.parametrize("bias_dtype", [None, torch.float32])
def test_weights_quantized_in_the_call(name, bias_dtype):
    """The weights' launch builds the plan; the fused GEMM reads it (and quantizes x) instead of building it."""
    check(GEMM_EDGE_SPLITS[name], K=384, N=272, bias_dtype=bias_dtype, seed=7, weights_given=False)


def test_weights_quantized_in_the_call_uncovered_rows():
    check([100, 50, 0, 30], K=128, N=128, T=400, weights_given=False)
    check([-5, 200, 100], K=128, N=256, T=300, m_dtype=torch.int32, weights_given=False)
    check(zipf_splits(16, 2000), K=384, N=256, special=True, seed=3, weights_given=False)


@pytest.mark.parametrize("T,launches", [(8192, 1), (8193, 2)])  # K = 1024: 2^23 values, one row more
@pytest.mark.parametrize("weights_given", [True, False])
def test_one_launch_up_to_2_23_values(T, launches, weights_given):
    """x in the GEMM's launch up to 2^23 values (its own quantizer's past them); the weights quantized in the call
    add their launch."""
    E, K, N = 8, 1024, 256
    x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16)
    w = (torch.randn(E, N, K, device=DEV) * 0.05).to(torch.bfloat16)
    m = torch.tensor(zipf_splits(E, T), device=DEV)
    given = list(cuda_ops.quantize_weight(w)) if weights_given else None
    names = cuda_kernels(lambda: forward(x, w, m, None, given, False))[1]
    assert len(names) == launches + (0 if weights_given else 1), names


@pytest.mark.parametrize("save", [False, True])
def test_mlp_fc1(save):
    """The expert MLP's forward: fc1 in one launch with given FP8 weights (after the weights' launch when they are
    quantized in the call), with or without fc1's weight gradient (then x's row copy is saved), y the same."""
    E, T, H, F = 8, 3000, 256, 384
    gen = torch.Generator(device=DEV).manual_seed(6)
    x = torch.randn(T, H, device=DEV, generator=gen).to(torch.bfloat16)
    w1 = (torch.randn(E, 2 * F, H, device=DEV, generator=gen) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(E, H, F, device=DEV, generator=gen) * 0.05).to(torch.bfloat16)
    m = torch.tensor(zipf_splits(E, T), device=DEV)
    probs = torch.rand(T, device=DEV, generator=gen)
    given = [*cuda_ops.quantize_weight(w1), *cuda_ops.quantize_weight(w2)]
    act = ACTIVATIONS["swiglu"]
    y1, plan1, _ = cuda_ops.mlp_fwd(x, w1, w2, m, None, None, probs, act, FP8_BLOCKWISE, given, save, False, save)
    y2, plan2, _ = cuda_ops.mlp_fwd(x, w1, w2, m, None, None, probs, act, FP8_BLOCKWISE, given, save, True, save)
    assert torch.equal(y1, y2) and torch.equal(plan1, plan2)
    for need_dw1 in (False, True):
        _, names = cuda_kernels(
            lambda: cuda_ops.mlp_fwd(x, w1, w2, m, None, None, probs, act, FP8_BLOCKWISE, given, save, need_dw1, save))
        assert len(names) == 3, names  # fc1 (with x's quantization and the plan), the activation, fc2
    # the weights quantized in the call: their launch (both weights and the plan) first, fc1 still quantizes x
    y3, plan3, _ = cuda_ops.mlp_fwd(x, w1, w2, m, None, None, probs, act, FP8_BLOCKWISE, [], save, False, save)
    assert torch.equal(y1, y3) and torch.equal(plan1, plan3)
    _, names = cuda_kernels(
        lambda: cuda_ops.mlp_fwd(x, w1, w2, m, None, None, probs, act, FP8_BLOCKWISE, [], save, False, save))
    assert len(names) == 4, names


@pytest.mark.parametrize("weights_given", [True, False])
def test_cuda_graph_replay_with_new_counts(weights_given):
    E, T, K, N = 16, 3000, 256, 384
    x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16)
    w = (torch.randn(E, N, K, device=DEV) * 0.05).to(torch.bfloat16)
    m = torch.tensor(zipf_splits(E, T), device=DEV)
    given = list(cuda_ops.quantize_weight(w)) if weights_given else None
    g, (y_static, plan_static) = capture_step(lambda: forward(x, w, m, None, given, False))
    for seed in range(3):
        m.copy_(torch.tensor(zipf_splits(E, T - 50 * seed), device=DEV))  # the last two cover fewer than T
        g.replay()
        torch.cuda.synchronize()
        y_eager, plan_eager = forward(x, w, m, None, given, True)
        assert torch.equal(y_static, y_eager) and torch.equal(plan_static, plan_eager)


OPT_OUT_CHILD = """
import torch
from moegemm.backends import cuda as ops
from moegemm.layout import FP8_BLOCKWISE
x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
w = (torch.randn(4, 128, 256, device="cuda") * 0.05).to(torch.bfloat16)
m = torch.tensor([100, 0, 300, 112], device="cuda")
given = list(ops.quantize_weight(w))
f = lambda: ops.linear_fwd(x, w, m, None, FP8_BLOCKWISE, False, False, None, given)
f(); torch.cuda.synchronize()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    f(); torch.cuda.synchronize()
print(sum(1 for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA))
"""


@pytest.mark.parametrize("value,launches", [("0", 2), ("false", 2), ("OFF", 2), ("1", 1), ("true", 1), ("", 1)])
def test_opt_out(value, launches):
    """MOEGEMM_ONE_LAUNCH_FORWARD=0 (read once per process; any boolean of csrc/env_flag.h) keeps x's quantizer in a
    launch of its own."""
    env = {**os.environ, "MOEGEMM_ONE_LAUNCH_FORWARD": value}
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", OPT_OUT_CHILD], cwd=root, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) == launches


def test_opt_out_not_a_boolean():
    """A value that is no boolean is an error naming the variable (it used to turn the fused forward on)."""
    env = {**os.environ, "MOEGEMM_ONE_LAUNCH_FORWARD": "maybe"}
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", OPT_OUT_CHILD], cwd=root, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode != 0
    assert "environment variable MOEGEMM_ONE_LAUNCH_FORWARD='maybe' is not a boolean" in out.stderr, out.stderr[-2000:]
