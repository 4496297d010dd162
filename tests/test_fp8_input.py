"""FP8 input: x given as its FP8 row copy with 1×128 scales (``Fp8Rows``, quantize_act's rows,
as an FP8 dispatcher delivers it). fprop reads the rows as given; wgrad's per-expert column copy is made
from them (dequantize, quantize again in 128×1 blocks: ``requantize_cols``); dx (bf16) goes to
``Fp8Rows.grad_target``.

The extra error of the double quantization, against float64: re-quantizing a dequantized FP8 value is
exact unless it falls below E4M3's normal range relative to its column block's scale (a value smaller than
about 2^-15 of the block's largest), since an E4M3 value times a power of two has 4 significant bits. So
the column copy made from FP8 rows carries the row copy's error (≈ 2.7 % on Gaussian data, the same size as
quantizing the columns from bf16), and only values under that 2^-15 band lose more (as they do when the
columns are quantized from bf16). Stated below: double ≈ single on Gaussian and log-normal-scaled data
(within 2 %), and ≤ single + rows on data with a 2^16 dynamic range inside column blocks."""

from __future__ import annotations

import pytest
import torch

import moegemm
from moegemm import reference as R
from moegemm.backends import contract
from moegemm.layout import RECIPE_IDS

from conftest import HAS_HOPPER, rel, requires_cuda, zipf_splits

DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]


def _data(kind, T, K):
    x = torch.randn(T, K)
    if kind == "lognormal":
        x = x * torch.exp(torch.randn(T, 1)) * torch.exp(torch.randn(1, K))
    elif kind == "wide":  # rows 2^16 apart inside every column block
        x = x * torch.where(torch.arange(T) % 7 == 0, 2.0 ** 8, 2.0 ** -8)[:, None]
    return x.bfloat16()


@pytest.mark.parametrize("kind", ["gauss", "lognormal", "wide"])
def test_double_quantization_error_vs_float64(kind):
    T, K, E = 1500, 384, 6
    x = _data(kind, T, K)
    plan = R.make_plan(torch.tensor(zipf_splits(E, T)), T)
    q, s = R.quantize_rows(x)
    single = R.dequantize_cols(*R.quantize_cols(x, plan), plan)
    double = R.dequantize_cols(*R.requantize_cols(q, s, plan), plan)
    x64, rows = x.double(), R.dequantize_rows(q, s)
    e_rows, e_single, e_double = rel(rows, x64), rel(single, x64), rel(double, x64)
    if kind == "wide":
        assert e_double <= e_single + e_rows
    else:
        assert 0.02 <= e_single <= 0.035 and e_double <= 1.02 * e_single
        assert rel(double, rows) <= 1e-3  # re-quantizing FP8 values is (nearly) exact


@pytest.mark.parametrize("device", DEVICES)
def test_linear_fp8_input_against_reference_and_float64(device):
    E, T, K, N = 6, 700, 256, 384
    torch.manual_seed(0)
    splits = zipf_splits(E, T)
    x = torch.randn(T, K, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(E, N, K, device=device) * 0.05).requires_grad_()
    dy = torch.randn(T, N, device=device, dtype=torch.bfloat16)
    xr = moegemm.to_fp8_rows(x)
    assert xr.grad_target is x and xr.q.dtype == torch.float8_e4m3fn
    y = moegemm.grouped_linear(xr, w, splits)
    assert y.dtype == torch.bfloat16
    y.backward(dy)
    dx, dw = x.grad, w.grad
    # the bf16-input path: same dx (dgrad does not read x), y and dw within FP8 noise of it
    x2 = x.detach().clone().requires_grad_()
    w2 = w.detach().clone().requires_grad_()
    y2 = moegemm.grouped_linear(x2, w2, splits)
    y2.backward(dy)
    assert torch.equal(dx, x2.grad)
    assert torch.equal(y, y2)  # the rows are the ones quantize_act makes
    # wgrad's column copy is made from x's row copy in both (docs/design.md, FP8 recipe)
    assert torch.equal(dw, w2.grad)
    # float64 math on the unquantized inputs (docs/design.md#reference: 3-5 %)
    x64, w64, dy64 = x.detach().double().cpu(), w.detach().double().cpu(), dy.double().cpu()
    y64 = torch.cat([xs @ w64[e].T for e, xs in enumerate(torch.split(x64, splits))])
    dw64 = torch.stack([dys.T @ xs for dys, xs in zip(torch.split(dy64, splits), torch.split(x64, splits))])
    assert rel(y.cpu(), y64) <= 0.06 and rel(dw.cpu(), dw64) <= 0.06
    if device == "cuda":  # the column copy the CUDA backward makes (a split backward returns it) is the reference's
        plan_ref = R.make_plan(torch.tensor(splits), T)
        fp8 = RECIPE_IDS["fp8_blockwise"]
        _, plan, saved = torch.ops.moegemm.linear_fwd(xr.q, w.detach(), torch.tensor(splits, device=device), None, fp8,
                                                      True, True, xr.s)
        made = torch.ops.moegemm.linear_bwd(dy, plan, saved, xr.q, w.detach(), None, fp8, False, True, False, True, None,
                                            xr.s)[3:]
        made = contract.by_name(contract.LINEAR_BWD.made[fp8], made)
        qT, sT = R.requantize_cols(xr.q.cpu(), xr.s.cpu(), plan_ref)
        # the columns and block rows the plan uses (the kernel leaves the capacity's unused tail alone)
        cols, blks = int(plan_ref[1, E]), int(plan_ref[2, E])
        assert torch.equal(made["qxT"].cpu()[:, :cols].view(torch.uint8), qT[:, :cols].view(torch.uint8))
        assert torch.equal(made["sxT"].cpu()[:blks], sT[:blks])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("split_backward", [False, True])
def test_mlp_fp8_input(device, split_backward):
    E, T, H, F = 6, 700, 256, 256
    torch.manual_seed(0)
    splits = zipf_splits(E, T)
    mlp = moegemm.GroupedMLP(E, H, F, device=device)
    mlp.delay_wgrad_compute = split_backward
    x = torch.randn(T, H, device=device, dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(T, device=device, requires_grad=True)
    dy = torch.randn(T, H, device=device, dtype=torch.bfloat16)
    y = mlp(moegemm.to_fp8_rows(x), splits, probs)
    y.backward(dy)
    mlp.backward_dw()
    got = [y, x.grad, probs.grad, mlp.fc1.weight.grad, mlp.fc2.weight.grad]
    mlp.zero_grad(set_to_none=True)
    mlp.delay_wgrad_compute = False
    x2, p2 = x.detach().clone().requires_grad_(), probs.detach().clone().requires_grad_()
    y2 = mlp(x2, splits, p2)
    y2.backward(dy)
    expected = [y2, x2.grad, p2.grad, mlp.fc1.weight.grad, mlp.fc2.weight.grad]
    for i, (a, b) in enumerate(zip(got, expected)):
        # the same rows, the same weights; wgrad's column copy is made from x's row copy in both
        assert torch.equal(a, b), i


@pytest.mark.parametrize("device", DEVICES)
def test_row_scales_in_any_strides(device):
    """quantize_act's row scales are K-major (strides (1, pitch)); an FP8 input's scales in another layout
    (row-major, as a dispatcher may send them, or a non-contiguous view) give bitwise the same layer results."""
    E, T, K, N = 3, 301, 384, 256
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(T, K, generator=gen).bfloat16().to(device)
    w = (torch.randn(E, N, K, generator=gen) * 0.05).to(device).requires_grad_()
    splits = [100, 0, 201]
    q, s, _, _ = moegemm.quantize_act(x, splits, rows=True, cols=False)
    assert s.shape == (T, 3) and s.stride() == (1, 304)
    wide = torch.zeros(T, 8, device=device)
    wide[:, 2:5] = s
    outs = []
    for scales in (s, s.contiguous(), wide[:, 2:5]):
        w.grad = None
        y = moegemm.grouped_linear(moegemm.Fp8Rows(q, scales), w, splits)
        y.float().square().sum().backward()
        outs.append((y, w.grad.clone()))
    for y, dw in outs[1:]:
        assert torch.equal(y, outs[0][0]) and torch.equal(dw, outs[0][1])


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_input_without_grad_target_and_errors(device):
    E, T, K, N = 2, 64, 128, 128
    x = torch.randn(T, K, device=device, dtype=torch.bfloat16)
    w = torch.randn(E, N, K, device=device, requires_grad=True)
    q, s, _, _ = moegemm.quantize_act(x, [T], rows=True, cols=False)
    y = moegemm.grouped_linear(moegemm.Fp8Rows(q, s), w, [40, 24])
    y.sum().backward()
    assert w.grad is not None
    with pytest.raises(ValueError, match="bf16"):
        moegemm.grouped_linear(moegemm.Fp8Rows(q, s), w, [40, 24], recipe="bf16")
    with pytest.raises(ValueError, match="Fp8Rows.s"):
        moegemm.grouped_linear(moegemm.Fp8Rows(q, s[:, :0]), w, [40, 24])
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        moegemm.grouped_linear(moegemm.Fp8Rows(x, s), w, [40, 24])
    with pytest.raises(ValueError, match="grad_target"):
        moegemm.grouped_linear(moegemm.Fp8Rows(q, s, x[:10]), w, [40, 24])


@requires_cuda
def test_cuda_fp8_input_no_host_sync_and_graph():
    from conftest import capture_step

    E, T, H, F = 8, 1024, 256, 256
    mlp = moegemm.GroupedMLP(E, H, F, device="cuda")
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    m = torch.tensor(zipf_splits(E, T), device="cuda")
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    xr = moegemm.to_fp8_rows(x)
    mlp(xr, m).backward(dy)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mlp(xr, m).backward(dy)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for p in mlp.parameters():
        p.grad = torch.zeros_like(p)

    def step():
        x.grad = None
        for p in mlp.parameters():
            p.grad.zero_()
        mlp(xr, m).backward(dy)
        return [x.grad] + [p.grad for p in mlp.parameters()]

    graph, static = capture_step(step)
    for _ in range(2):
        m.copy_(torch.tensor(zipf_splits(E, T), device="cuda"))
        graph.replay()
        got = [t.clone() for t in static]
        ref = [t.clone() for t in step()]  # eager, same m
        torch.cuda.synchronize()
        for a, b in zip(got, ref):
            assert rel(a, b) <= 1e-6


if HAS_HOPPER:
    from moegemm.backends import cuda as cuda_ops  # noqa: F401
