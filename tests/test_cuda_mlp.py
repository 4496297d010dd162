"""GroupedMLP on the GPU: fused activation kernels vs the reference, the whole MLP vs the reference
backend, no host sync, torch.compile(fullgraph=True), and a CUDA-graph-captured training step that
replays with new m_splits. Skipped without a Hopper GPU."""

from __future__ import annotations

import copy

import pytest
import torch

import moegemm
from moegemm import reference as ref

from conftest import HAS_HOPPER, rel, requires_cuda, zipf_splits

pytestmark = requires_cuda
if HAS_HOPPER:
    from moegemm.backends import cuda as cuda_ops

DEV = "cuda"
ACTS = list(ref.ACTIVATIONS)


def plans(splits, T):
    m = torch.tensor(splits, device=DEV)
    return cuda_ops.make_plan(m, T), ref.make_plan(m, T)


def dequant_all(q, s, qT, sT, plan_ref):
    return ref.dequantize_rows(q, s), ref.dequantize_cols(qT, sT, plan_ref)


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("with_probs", [True, False])
@pytest.mark.parametrize("F", [272, 256])  # 272: a 128-column block straddles the GLU halves; 256: both halves from one tile
def test_fused_activation_kernels_match_reference(activation, with_probs, F):
    E, T = 8, 1500
    F1 = 2 * F if activation in ref.GLU_ACTIVATIONS else F
    splits = zipf_splits(E, T)
    plan, plan_ref = plans(splits, T)
    h = torch.randn(T, F1, device=DEV, dtype=torch.bfloat16) * 2
    da = torch.randn(T, F, device=DEV, dtype=torch.bfloat16)
    probs = torch.rand(T, device=DEV) if with_probs else None
    got = cuda_ops.act_quantize(h, probs, activation, plan)
    exp = ref.act_quantize(h, probs, activation, plan_ref)
    for g, e in zip(dequant_all(*got, plan_ref), dequant_all(*exp, plan_ref)):
        assert rel(g, e) <= 5e-3
    # FP8 bytes agree except where fp32 rounding of the activation flips an e4m3 rounding
    assert (got[0].view(torch.uint8) == exp[0].view(torch.uint8)).float().mean() > 0.995
    *got_q, got_dp = cuda_ops.act_backward_quantize(da, h, probs, activation, plan)
    *exp_q, exp_dp = ref.act_backward_quantize(da, h, probs, activation, plan_ref)
    for g, e in zip(dequant_all(*got_q, plan_ref), dequant_all(*exp_q, plan_ref)):
        assert rel(g, e) <= 5e-3
    assert (got_q[0].view(torch.uint8) == exp_q[0].view(torch.uint8)).float().mean() > 0.995
    if with_probs:
        assert rel(got_dp, exp_dp) <= 1e-5
    else:
        assert got_dp is None


@pytest.mark.parametrize("activation", ["swiglu", "geglu", "gelu"])
@pytest.mark.parametrize("rows,cols", [(True, False), (False, True)])
def test_fused_activation_kernels_one_copy(activation, rows, cols):
    # only the row copy or only the column copy asked for (the other's pointers null), a partial column block
    E, T, F = 6, 900, 272
    F1 = 2 * F if activation in ref.GLU_ACTIVATIONS else F
    splits = zipf_splits(E, T)
    plan, plan_ref = plans(splits, T)
    g = torch.Generator(device=DEV).manual_seed(5)
    h = torch.randn(T, F1, device=DEV, dtype=torch.bfloat16, generator=g) * 2
    da = torch.randn(T, F, device=DEV, dtype=torch.bfloat16, generator=g)
    probs = torch.rand(T, device=DEV, generator=g)
    both = cuda_ops.act_quantize(h, probs, activation, plan)
    one = cuda_ops.act_quantize(h, probs, activation, plan, rows=rows, cols=cols)
    exp = ref.act_quantize(h, probs, activation, plan_ref)
    *both_b, _ = cuda_ops.act_backward_quantize(da, h, probs, activation, plan)
    *one_b, _ = cuda_ops.act_backward_quantize(da, h, probs, activation, plan, rows=rows, cols=cols)
    _, col, blk = plan_ref.tolist()
    written = torch.zeros(both[2].shape[1], dtype=torch.bool, device=DEV)  # each expert's columns, padding included
    for e in range(E):
        written[col[e]: col[e + 1]] = True
    parts = [lambda t: t, lambda t: t[:, :T], lambda t: t[:, written], lambda t: t[: blk[E]]]  # q, s, qT, sT
    kept = [0, 1] if rows else [2, 3]
    for got, full in ((one, both), (one_b, both_b)):
        for i in range(4):
            if i in kept:  # the same bytes either way
                a, b = (parts[i](t[i]).contiguous().view(torch.uint8) for t in (got, full))
                assert torch.equal(a, b)
            else:
                assert got[i] is None
    if rows:
        assert rel(ref.dequantize_rows(one[0], one[1]), ref.dequantize_rows(exp[0], exp[1])) <= 5e-3
    else:
        assert rel(ref.dequantize_cols(one[2], one[3], plan_ref), ref.dequantize_cols(exp[2], exp[3], plan_ref)) <= 5e-3


@pytest.mark.parametrize("activation", ["swiglu", "relu"])
def test_fused_activation_max_experts(activation):
    # E = 1024: SwiGLU's per-tile kernels find each tile's expert among 1024; ReLU: the persistent multi-cast
    # kernel, whose copy of the plan takes a large part of its shared memory
    E, T, F = 1024, 3000, 128
    F1 = 2 * F if activation in ref.GLU_ACTIVATIONS else F
    plan, plan_ref = plans(zipf_splits(E, T), T)
    h = torch.randn(T, F1, device=DEV, dtype=torch.bfloat16) * 2
    da = torch.randn(T, F, device=DEV, dtype=torch.bfloat16)
    probs = torch.rand(T, device=DEV)
    got = cuda_ops.act_quantize(h, probs, activation, plan)
    exp = ref.act_quantize(h, probs, activation, plan_ref)
    for g, e in zip(dequant_all(*got, plan_ref), dequant_all(*exp, plan_ref)):
        assert rel(g, e) <= 5e-3
    *got_q, got_dp = cuda_ops.act_backward_quantize(da, h, probs, activation, plan)
    *exp_q, exp_dp = ref.act_backward_quantize(da, h, probs, activation, plan_ref)
    for g, e in zip(dequant_all(*got_q, plan_ref), dequant_all(*exp_q, plan_ref)):
        assert rel(g, e) <= 5e-3
    assert (got_q[0].view(torch.uint8) == exp_q[0].view(torch.uint8)).float().mean() > 0.995
    assert rel(got_dp, exp_dp) <= 1e-5


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("with_probs", [True, False])
def test_bf16_activation_kernels_match_reference(activation, with_probs):
    T, F = 1500, 272 + 16 * 20  # F = 592: a partial 256-column block
    F1 = 2 * F if activation in ref.GLU_ACTIVATIONS else F
    h = torch.randn(T, F1, device=DEV, dtype=torch.bfloat16) * 2
    da = torch.randn(T, F, device=DEV, dtype=torch.bfloat16)
    probs = torch.rand(T, device=DEV) if with_probs else None
    a = cuda_ops.act_bf16(h, probs, activation)
    a_ref = ref.act_bf16(h, probs, activation)
    assert a.dtype == torch.bfloat16 and a.shape == (T, F) and rel(a, a_ref) <= 1e-2
    assert (a == a_ref).float().mean() > 0.99  # bf16 roundings of fp32 values a few ulps apart
    dh, dp = cuda_ops.act_backward_bf16(da, h, probs, activation)
    dh_ref, dp_ref = ref.act_backward_bf16(da, h, probs, activation)
    assert dh.dtype == torch.bfloat16 and dh.shape == h.shape and rel(dh, dh_ref) <= 1e-2
    assert (dh == dh_ref).float().mean() > 0.99
    if with_probs:
        assert rel(dp, dp_ref) <= 1e-5
    else:
        assert dp is None


def make_inputs(E, T, H, requires_grad=True):
    x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16, requires_grad=requires_grad)
    probs = torch.rand(T, device=DEV, requires_grad=requires_grad)
    m = torch.tensor(zipf_splits(E, T), device=DEV)
    return x, probs, m


@pytest.mark.parametrize("activation", ["swiglu", "squared_relu"])
@pytest.mark.parametrize("recipe", ["fp8_blockwise", "bf16"])
@pytest.mark.parametrize("bias", [False, True])
def test_mlp_cuda_matches_reference_backend(activation, recipe, bias, monkeypatch):
    E, T, H, F = 8, 2000, 256, 384
    mlp = moegemm.GroupedMLP(E, H, F, activation=activation, bias=bias, recipe=recipe, device=DEV)
    x, probs, m = make_inputs(E, T, H)
    dy = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)

    def run():
        for t in [x, probs, *mlp.parameters()]:
            t.grad = None
        y = mlp(x, m, probs)
        y.backward(dy)
        return [y.detach(), x.grad, probs.grad] + [p.grad for p in mlp.parameters()]

    got = run()
    monkeypatch.setattr(moegemm.backends, "FORCE_REFERENCE", True)  # MOEGEMM_BACKEND=reference, read at import
    expected = run()
    tol = 1e-2 if recipe == "fp8_blockwise" else 1e-2
    if activation == "squared_relu" and recipe == "fp8_blockwise":
        tol = 3e-2  # relu masks at FP8-rounded pre-activations
    for g, e in zip(got, expected):
        assert rel(g, e) <= tol


@pytest.mark.parametrize("recipe", ["fp8_blockwise", "bf16"])
def test_mlp_no_host_sync(recipe):
    E, T, H, F = 16, 2048, 256, 256
    mlp = moegemm.GroupedMLP(E, H, F, recipe=recipe, device=DEV)
    x, probs, m = make_inputs(E, T, H)
    mlp(x, m, probs).sum().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = mlp(x, m, probs)
        y.backward(torch.ones_like(y))
        with torch.no_grad():
            mlp(x, m, probs, is_first_microbatch=True)
            mlp(x, m, probs, is_first_microbatch=False)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("recipe", ["fp8_blockwise", "bf16"])
def test_mlp_torch_compile_fullgraph(recipe):
    torch._dynamo.reset()
    E, T, H, F = 8, 1024, 256, 256
    mlp = moegemm.GroupedMLP(E, H, F, recipe=recipe, device=DEV)
    x, probs, m = make_inputs(E, T, H)
    dy = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)

    def step(x, m, probs):
        return mlp(x, m, probs)

    compiled = torch.compile(step, fullgraph=True)
    grads = []
    for fn in (step, compiled):
        x.grad = probs.grad = None
        mlp.zero_grad(set_to_none=True)
        y = fn(x, m, probs)
        y.backward(dy)
        grads.append([y.detach(), x.grad, probs.grad, mlp.fc1.weight.grad, mlp.fc2.weight.grad])
    for a, b in zip(*grads):
        assert rel(a, b) <= 1e-3


@pytest.mark.parametrize("recipe", ["fp8_blockwise", "bf16"])
def test_training_step_in_cuda_graph(recipe):
    E, T, H, F = 8, 1024, 256, 256
    torch.manual_seed(0)
    model = moegemm.GroupedMLP(E, H, F, recipe=recipe, device=DEV, dtype=torch.float32)
    eager = copy.deepcopy(model)
    x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)
    probs = torch.rand(T, device=DEV)
    target = torch.randn(T, H, device=DEV)
    m = torch.tensor(zipf_splits(E, T), device=DEV)

    def make_opt(mod):
        return torch.optim.Adam(mod.parameters(), lr=1e-3, capturable=True)

    opt, opt_eager = make_opt(model), make_opt(eager)

    def step(mod, optimizer, m):
        optimizer.zero_grad(set_to_none=False)
        loss = (mod(x, m, probs).float() - target).pow(2).mean()
        loss.backward()
        optimizer.step()
        return loss

    # warm up on a side stream (also initialises the optimizer state), then capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step(model, opt, m)
            step(eager, opt_eager, m)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step(model, opt, m)
    for _ in range(4):
        m.copy_(torch.tensor(zipf_splits(E, T), device=DEV))
        graph.replay()
        loss = step(eager, opt_eager, m)
        torch.cuda.synchronize()
        assert rel(static_loss, loss) <= 1e-5
    for a, b in zip(model.parameters(), eager.parameters()):
        assert rel(a, b) <= 1e-5


def test_fp8_weight_cache_and_inference_mode():
    E, T, H, F = 8, 512, 256, 256
    mlp = moegemm.GroupedMLP(E, H, F, device=DEV)
    x, probs, m = make_inputs(E, T, H, requires_grad=False)
    with torch.no_grad():
        y0 = mlp(x, m, probs, is_first_microbatch=True)
        mlp.fc1.weight.add_(torch.randn_like(mlp.fc1.weight) * 0.05)
        assert torch.equal(mlp(x, m, probs, is_first_microbatch=False), y0)
        y1 = mlp(x, m, probs, is_first_microbatch=True)
        assert not torch.equal(y1, y0)
        mlp.to_fp8_inference()
        assert torch.equal(mlp(x, m, probs), y1)
