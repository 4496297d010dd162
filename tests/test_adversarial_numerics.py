"""Adversarial numerics and execution contexts (docs/design.md#errors): NaN/Inf through every activation and both
recipes, double backward, bitwise-reproducible gradients (bias included), shapes past 2**31 elements,
side streams, a non-current device, torch.compile.

CPU cases run the reference path; CUDA cases (``requires_cuda``) compare with the reference backend
(``MOEGEMM_BACKEND=reference`` on the same CUDA tensors) where the reference is the oracle.
"""

from __future__ import annotations

import pytest
import torch

import moegemm
from moegemm import reference as R

from conftest import cuda_alive, rel, requires_cuda, zipf_splits

E, H, F = 4, 128, 144
SPLITS = [20, 50, 0, 30]
T = sum(SPLITS)
BAD_ROW, BAD_EXPERT = 25, 1          # row 25 belongs to expert 1 (rows 20..69)
EXPERT_ROWS = {0: range(0, 20), 1: range(20, 70), 2: range(70, 70), 3: range(70, 100)}
ACTIVATIONS = ("swiglu", "geglu", "gelu", "relu", "squared_relu")
GLU = ("swiglu", "geglu")
RECIPES = ("fp8_blockwise", "bf16")
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]



def mlp_inputs(device, activation, seed=30):
    torch.manual_seed(seed)
    F1 = 2 * F if activation in GLU else F
    x = torch.randn(T, H, device=device, dtype=torch.bfloat16)
    w1 = (torch.randn(E, F1, H, device=device) * 0.08).to(torch.bfloat16)
    w2 = (torch.randn(E, H, F, device=device) * 0.08).to(torch.bfloat16)
    b1 = (torch.randn(E, F1, device=device) * 0.1).to(torch.bfloat16)
    b2 = (torch.randn(E, H, device=device) * 0.1).to(torch.bfloat16)
    p = torch.rand(T, device=device)
    dy = torch.randn(T, H, device=device, dtype=torch.bfloat16)
    return [x, w1, w2, b1, b2, p, dy]


def poison(inputs, where, value):
    x, w1, w2, b1, b2, p, dy = [t.clone() for t in inputs]
    if where == "x":
        x[BAD_ROW, 3] = value
    elif where == "probs":
        p[BAD_ROW] = value
    elif where == "fc1_weight":
        w1[BAD_EXPERT, 5, 7] = value
    elif where == "fc2_weight":
        w2[BAD_EXPERT, 9, 11] = value
    elif where == "fc1_bias":
        b1[BAD_EXPERT, 5] = value
    else:
        raise AssertionError(where)
    return [x, w1, w2, b1, b2, p, dy]


def run_mlp(inputs, activation, recipe, m=SPLITS):
    leaves = [t.clone().requires_grad_() for t in inputs[:6]]
    x, w1, w2, b1, b2, p = leaves
    y = moegemm.grouped_mlp(x, w1, w2, m, p, b1, b2, activation=activation, recipe=recipe)
    y.backward(inputs[6])
    return {"y": y.detach(), "dx": x.grad, "dw1": w1.grad, "dw2": w2.grad, "db1": b1.grad, "db2": b2.grad,
            "dprobs": p.grad}


# ====================================================================== reference activations at NaN
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_reference_activation_nonfinite(activation, value):
    """act(NaN) is NaN and its gradient at NaN is NaN (relu too); ±Inf never raises."""
    torch.manual_seed(31)
    F1 = 2 * F if activation in GLU else F
    h = torch.randn(8, F1)
    h[2, 4] = value                                   # the gate (or the only) half
    if activation in GLU:
        h[5, F + 6] = value                           # the up half
    p = torch.rand(8)
    da = torch.randn(8, F)
    a = R.act_forward(h, p, activation)
    dh, dp = R.act_backward(da, h, p, activation)
    if value != value:  # NaN
        assert torch.isnan(a[2, 4]) and torch.isnan(dh[2, 4]), (activation, a[2, 4], dh[2, 4])
        assert torch.isnan(dp[2])
        if activation in GLU:
            # NaN in the up half: a and d/dgate are NaN; d/dup = act(gate) is finite (exact math)
            assert torch.isnan(a[5, 6]) and torch.isnan(dh[5, 6]) and torch.isnan(dp[5])
    mask = torch.ones(8, dtype=torch.bool)
    mask[[2, 5]] = False
    assert torch.isfinite(a[mask]).all() and torch.isfinite(dh[mask]).all() and torch.isfinite(dp[mask]).all()


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_reference_relu_family_nan_gradient_through_mlp(activation):
    """The issue's case: NaN in x through relu/squared_relu (and the others) gives NaN y AND NaN dx."""
    inputs = poison(mlp_inputs("cpu", activation), "x", float("nan"))
    out = run_mlp(inputs, activation, "bf16")
    assert torch.isnan(out["y"][BAD_ROW]).all()
    assert not torch.isfinite(out["dx"][BAD_ROW]).any()


# =================================================================== NaN through the whole MLP, both paths
def expectations(where):
    """(rows that must hold a non-finite value in y/dx/dprobs, experts with a non-finite dW/db), and which
    gradients stay finite everywhere: everything outside the poisoned rows/expert is finite."""
    rows = [BAD_ROW] if where in ("x", "probs") else list(EXPERT_ROWS[BAD_EXPERT])
    finite_everywhere = {"db2"}
    if where == "probs":
        finite_everywhere.add("dprobs")     # dprobs[t] = <da[t], act(h[t])> does not depend on probs
    if where in ("fc2_weight",):
        finite_everywhere.add("dw2")        # dW2 = dyᵀ a does not read W2
    return rows, finite_everywhere


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("where", ["x", "probs", "fc1_weight", "fc2_weight", "fc1_bias"])
def test_nan_poisons_exactly_what_depends_on_it(device, recipe, activation, where):
    inputs = poison(mlp_inputs(device, activation), where, float("nan"))
    out = run_mlp(inputs, activation, recipe)
    rows, finite_everywhere = expectations(where)
    other_rows = [t for t in range(T) if t not in rows]
    other_experts = [e for e in range(E) if e != BAD_EXPERT]
    for name, g in out.items():
        bad = ~torch.isfinite(g)
        if name in finite_everywhere:
            assert not bad.any(), name
        elif name in ("y", "dx", "dprobs"):
            assert bad[rows].reshape(len(rows), -1).any(1).all(), (name, "a poisoned row is finite")
            assert not bad[other_rows].any(), (name, "NaN leaked into other rows")
        else:
            assert bad[BAD_EXPERT].any(), (name, "the poisoned expert's gradient is finite")
            assert not bad[other_experts].any(), (name, "NaN leaked into other experts")
    cuda_alive()


@requires_cuda
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("where", ["x", "probs", "fc1_weight", "fc2_weight", "fc1_bias"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_cuda_nonfinite_masks_match_reference(recipe, activation, where, value, monkeypatch):
    """Wherever the reference is non-finite the CUDA path is too; y's masks are equal."""
    inputs = poison(mlp_inputs("cuda", activation), where, value)
    got = run_mlp(inputs, activation, recipe)
    monkeypatch.setattr(moegemm.backends, "FORCE_REFERENCE", True)  # MOEGEMM_BACKEND=reference, read at import
    exp = run_mlp(inputs, activation, recipe)
    for name in got:
        g_bad, e_bad = ~torch.isfinite(got[name]), ~torch.isfinite(exp[name])
        assert not (e_bad & ~g_bad).any(), (name, "finite on CUDA where the reference is not",
                                            int((e_bad & ~g_bad).sum()))
        if name == "y":
            assert torch.equal(g_bad, e_bad), (name, int((g_bad ^ e_bad).sum()))
    cuda_alive()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("where", ["x", "weight", "bias"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_linear_nonfinite(device, recipe, where, value, monkeypatch):
    torch.manual_seed(32)
    K, N = 144, 160
    x = torch.randn(T, K, device=device, dtype=torch.bfloat16)
    w = (torch.randn(E, N, K, device=device) * 0.05).to(torch.bfloat16)
    b = torch.randn(E, N, device=device, dtype=torch.bfloat16)
    dy = torch.randn(T, N, device=device, dtype=torch.bfloat16)
    {"x": x[BAD_ROW], "weight": w[BAD_EXPERT, 3], "bias": b[BAD_EXPERT]}[where][5] = value

    def run():
        xl, wl, bl = (t.clone().requires_grad_() for t in (x, w, b))
        y = moegemm.grouped_linear(xl, wl, SPLITS, bl, recipe=recipe)
        y.backward(dy)
        return {"y": y.detach(), "dx": xl.grad, "dw": wl.grad, "db": bl.grad}

    got = run()
    rows = [BAD_ROW] if where == "x" else list(EXPERT_ROWS[BAD_EXPERT])
    others = [t for t in range(T) if t not in rows]
    assert (~torch.isfinite(got["y"][rows])).any(1).all() and torch.isfinite(got["y"][others]).all()
    assert torch.isfinite(got["db"]).all()  # dbias = Σ dy
    if where == "x":
        assert (~torch.isfinite(got["dw"][BAD_EXPERT])).any()
    if where == "weight":
        assert (~torch.isfinite(got["dx"][rows])).any(1).all()
    assert torch.isfinite(got["dx"][others]).all()
    if device == "cuda":
        monkeypatch.setattr(moegemm.backends, "FORCE_REFERENCE", True)  # MOEGEMM_BACKEND=reference, read at import
        exp = run()
        for name in got:
            g_bad, e_bad = ~torch.isfinite(got[name]), ~torch.isfinite(exp[name])
            assert not (e_bad & ~g_bad).any(), name
        assert torch.equal(~torch.isfinite(got["y"]), ~torch.isfinite(exp["y"]))


# ===================================================================================== double backward
def _double_backward_raises(fn, leaves):
    y = fn()
    loss = (y.float() ** 2).sum()
    try:
        grads = torch.autograd.grad(loss, leaves, create_graph=True)
    except RuntimeError:
        return  # refusing create_graph up front is fine too
    # first-order values are right (same as without create_graph)
    plain = torch.autograd.grad((fn().float() ** 2).sum(), leaves)
    for g, p in zip(grads, plain):
        assert torch.equal(g, p)
    with pytest.raises(RuntimeError):
        second = torch.autograd.grad(sum(g.float().sum() for g in grads), leaves, allow_unused=True)
        raise AssertionError(f"double backward returned values instead of raising: {[s is not None for s in second]}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES)
def test_double_backward_linear_raises(device, recipe):
    torch.manual_seed(33)
    x = torch.randn(T, 144, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(E, 160, 144, device=device) * 0.05).to(torch.bfloat16).requires_grad_()
    b = torch.randn(E, 160, device=device, dtype=torch.bfloat16, requires_grad=True)
    _double_backward_raises(lambda: moegemm.grouped_linear(x, w, SPLITS, b, recipe=recipe), (x, w, b))
    # only x differentiable (the second derivative through dx = dy W would be W-linear: still refused)
    _double_backward_raises(lambda: moegemm.grouped_linear(x, w.detach(), SPLITS, recipe=recipe), (x,))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("activation", ["swiglu", "relu"])
def test_double_backward_mlp_raises(device, recipe, activation):
    inputs = mlp_inputs(device, activation, seed=34)
    leaves = [t.clone().requires_grad_() for t in inputs[:6]]
    x, w1, w2, b1, b2, p = leaves
    _double_backward_raises(
        lambda: moegemm.grouped_mlp(x, w1, w2, SPLITS, p, b1, b2, activation=activation, recipe=recipe), leaves)


# ========================================================================= bitwise reproducible grads
@requires_cuda
@pytest.mark.parametrize("recipe", RECIPES)
def test_bias_grad_bitwise_reproducible(recipe):
    Ed, Td, Kd, Nd = 64, 8192, 256, 512
    torch.manual_seed(35)
    splits = zipf_splits(Ed, Td)
    assert 0 in splits
    x = torch.randn(Td, Kd, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(Ed, Nd, Kd, device="cuda") * 0.05).to(torch.bfloat16)
    b = torch.randn(Ed, Nd, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(Td, Nd, device="cuda", dtype=torch.bfloat16) * 10
    m = torch.tensor(splits, device="cuda")
    runs = []
    for _ in range(3):
        xl, wl, bl = (t.clone().requires_grad_() for t in (x, w, b))
        y = moegemm.grouped_linear(xl, wl, m, bl, recipe=recipe)
        y.backward(dy)
        runs.append((y.detach(), xl.grad, wl.grad, bl.grad))
    for other in runs[1:]:
        for a, c in zip(runs[0], other):
            assert torch.equal(a, c)
    db = runs[0][3]
    assert (db[[e for e, c in enumerate(splits) if c == 0]] == 0).all()
    exp = torch.stack([d.double().sum(0) for d in torch.split(dy, splits)])
    assert rel(db, exp) <= 1e-2
    # the MLP with both biases and probs
    Hm, Fm = 256, 256
    w1 = (torch.randn(Ed, 2 * Fm, Hm, device="cuda") * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(Ed, Hm, Fm, device="cuda") * 0.05).to(torch.bfloat16)
    b1 = torch.randn(Ed, 2 * Fm, device="cuda", dtype=torch.bfloat16)
    b2 = torch.randn(Ed, Hm, device="cuda", dtype=torch.bfloat16)
    xm = torch.randn(Td, Hm, device="cuda", dtype=torch.bfloat16)
    p = torch.rand(Td, device="cuda")
    dym = torch.randn(Td, Hm, device="cuda", dtype=torch.bfloat16)
    runs = []
    for _ in range(3):
        leaves = [t.clone().requires_grad_() for t in (xm, w1, w2, b1, b2, p)]
        y = moegemm.grouped_mlp(leaves[0], leaves[1], leaves[2], m, leaves[5], leaves[3], leaves[4], recipe=recipe)
        y.backward(dym)
        runs.append([y.detach()] + [t.grad for t in leaves])
    for other in runs[1:]:
        for a, c in zip(runs[0], other):
            assert torch.equal(a, c)


# ===================================================================================== past 2**31
def _free_gb() -> float:
    return torch.cuda.mem_get_info()[0] / 2 ** 30 if torch.cuda.is_available() else 0.0


def need_free_gb(gb: float = 40) -> None:
    torch.cuda.empty_cache()
    if _free_gb() < gb:
        pytest.skip(f"needs > {gb} GB free GPU memory, {_free_gb():.1f} GB free")


@requires_cuda
@pytest.mark.parametrize("recipe", RECIPES)
def test_grouped_linear_past_2_31_elements(recipe):
    need_free_gb()
    Tb, Kb, Nb, Eb = 1_050_000, 2048, 128, 4
    assert Tb * Kb > 2 ** 31
    splits = [1000, 524_000, 0, Tb - 525_000]
    torch.manual_seed(36)
    x = torch.randn(Tb, Kb, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(Eb, Nb, Kb, device="cuda") * 0.03).to(torch.bfloat16)
    m = torch.tensor(splits, device="cuda")
    with torch.no_grad():
        y = moegemm.grouped_linear(x, w, m, recipe=recipe)
    torch.cuda.synchronize()
    starts = [0, 1000, 525_000, 525_000]
    rows = [0, 999, 1000, 524_999, 525_000, 1_048_576, Tb - 2, Tb - 1]   # the last ones start past 2**31 elements
    expert = [0, 0, 1, 1, 3, 3, 3, 3]
    assert starts[3] + splits[3] == Tb
    for r, e in zip(rows, expert):
        xr = x[r:r + 1]
        if recipe == "fp8_blockwise":
            q, s = R.quantize_rows(xr)
            qw, sw, _, _ = R.quantize_weight(w[e:e + 1])
            ref_row = R.dequantize_rows(q, s) @ R.dequantize_weight(qw, sw)[0].t()
            tol = 4e-3  # bf16 rounding of one row (~1e-3) against float64 from the same FP8 operands
        else:
            ref_row = xr.double() @ w[e].double().t()
            tol = 1e-2
        assert rel(y[r:r + 1], ref_row) <= tol, (r, rel(y[r:r + 1], ref_row))
    del x, y
    torch.cuda.empty_cache()


@requires_cuda
@pytest.mark.parametrize("recipe", RECIPES)
def test_grouped_linear_backward_past_2_31_elements(recipe):
    need_free_gb()
    Tb, Kb, Nb, Eb = 1_050_000, 2048, 128, 4
    splits = [1000, 524_000, 0, Tb - 525_000]
    torch.manual_seed(37)
    x = torch.randn(Tb, Kb, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(Eb, Nb, Kb, device="cuda") * 0.03).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(Tb, Nb, device="cuda", dtype=torch.bfloat16)
    y = moegemm.grouped_linear(x, w, torch.tensor(splits, device="cuda"), recipe=recipe)
    y.backward(dy)
    torch.cuda.synchronize()
    for r, e in [(0, 0), (524_999, 1), (Tb - 1, 3)]:
        exp = dy[r:r + 1].double() @ w[e].detach().double()
        assert rel(x.grad[r:r + 1], exp) <= (0.1 if recipe == "fp8_blockwise" else 1e-2), r
    # the last expert's weight gradient, its first 128 columns, against float64
    s3 = 525_000
    exp = dy[s3:].double().t() @ x.detach()[s3:, :128].double()
    assert rel(w.grad[3, :, :128], exp) <= (0.1 if recipe == "fp8_blockwise" else 1e-2)
    assert (w.grad[2] == 0).all()
    del x, y, dy
    torch.cuda.empty_cache()


@requires_cuda
def test_quantize_weight_past_2_31_elements():
    need_free_gb()
    Eb, Nb, Kb = 8, 16384, 16384 + 128
    assert Eb * Nb * Kb > 2 ** 31
    torch.manual_seed(38)
    w = torch.randn(Eb, Nb, Kb, device="cuda", dtype=torch.bfloat16)
    w[Eb - 1, -128:, -128:] *= 3.0
    q, s, qT, sT = moegemm.quantize_weight(w)
    torch.cuda.synchronize()
    for e, nb, kb in [(Eb - 1, Nb // 128 - 1, Kb // 128 - 1), (Eb - 1, 0, Kb // 128 - 1), (0, 0, 0), (4, 77, 3)]:
        blk = w[e:e + 1, nb * 128:(nb + 1) * 128, kb * 128:(kb + 1) * 128]
        rq, rs, rqT, rsT = R.quantize_weight(blk)
        assert torch.equal(q[e, nb * 128:(nb + 1) * 128, kb * 128:(kb + 1) * 128].view(torch.uint8), rq[0].view(torch.uint8))
        assert torch.equal(qT[e, kb * 128:(kb + 1) * 128, nb * 128:(nb + 1) * 128].view(torch.uint8), rqT[0].view(torch.uint8))
        assert s[e, nb, kb] == rs[0, 0, 0] and sT[e, kb, nb] == rs[0, 0, 0]
    del w, q, qT
    torch.cuda.empty_cache()


@requires_cuda
def test_quantizers_past_65535_token_blocks():
    """More 128-token blocks than a grid's y dimension holds (65535): the per-tile quantizers' grids continue in z
    (tile_grid; two column blocks, so x is 2 as well). The last expert's blocks from 65500 on against the reference of those rows alone (an expert's
    column blocks start at its first token, so a slice from one of its block starts is quantized alike):
    quantize_act and requantize_cols bitwise, the GLU activation forward and backward (dprobs too) as the
    fused-kernel tests compare them; the uncovered rows zero."""
    need_free_gb(60)
    from moegemm.backends import cuda as ops
    from moegemm.layout import COL_ALIGN

    Tb, K = 65535 * 128 + 3000, 256                      # two column blocks: the grid's x is 2
    splits = [1000, 0, Tb - 1005]                            # 5 rows of no expert at the end
    torch.manual_seed(42)
    x = (torch.randn(Tb, K, device="cuda") * torch.rand(Tb, 1, device="cuda") * 10).to(torch.bfloat16)
    plan = ops.make_plan(torch.tensor(splits, device="cuda"), Tb)
    tok, col, blk = plan.cpu().tolist()
    first = 65500 - blk[2]                                   # the last expert's blocks from 65500 on
    assert blk[3] > 65535
    r0, n = tok[2] + 128 * first, tok[3] - (tok[2] + 128 * first)
    tail = slice(r0, Tb)
    plan_tail = R.make_plan(torch.tensor([n], device="cuda"), Tb - r0)  # n tokens, then the 5 of no expert
    c0, w, nb = col[2] + 128 * first, -(-n // COL_ALIGN) * COL_ALIGN, -(-n // 128)

    def cols_of(qT, sT, at=0, b=0):
        return qT[:, at:at + w].view(torch.uint8), sT[b:b + nb]

    def cols_dequant(qT, sT, at=0, b=0):
        return qT[:, at:at + n].float().t() * sT[b:b + nb].repeat_interleave(128, 0)[:n]

    q, s, qT, sT = ops.quantize_act(x, plan, True, True)
    rq, rs, rqT, rsT = R.quantize_act(x[tail], plan_tail, True, True)
    assert torch.equal(q[tail].view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s[tail], rs)
    assert (q[-5:].view(torch.uint8) == 0).all() and (s[-5:] == 0).all()
    for a, b in zip(cols_of(qT, sT, c0, blk[2] + first), cols_of(rqT, rsT)):
        assert torch.equal(a, b)
    got, exp = ops.requantize_cols(q, s, plan), R.requantize_cols(q[tail], s[tail], plan_tail)
    for a, b in zip(cols_of(*got, c0, blk[2] + first), cols_of(*exp)):
        assert torch.equal(a, b)
    del x, q, s, qT, sT, got, exp
    torch.cuda.empty_cache()

    h = torch.randn(Tb, 2 * K, device="cuda", dtype=torch.bfloat16) * 2
    da = torch.randn(Tb, K, device="cuda", dtype=torch.bfloat16)
    probs = torch.rand(Tb, device="cuda")
    for got, exp in [(ops.act_quantize(h, probs, "swiglu", plan), R.act_quantize(h[tail], probs[tail], "swiglu", plan_tail)),
                     (ops.act_backward_quantize(da, h, probs, "swiglu", plan),
                      R.act_backward_quantize(da[tail], h[tail], probs[tail], "swiglu", plan_tail))]:
        gq, gs, gqT, gsT = got[:4]
        eq, es, eqT, esT = exp[:4]
        assert rel(R.dequantize_rows(gq[tail], gs[tail]), R.dequantize_rows(eq, es)) <= 5e-3
        assert (gq[tail].view(torch.uint8) == eq.view(torch.uint8)).float().mean() > 0.995
        assert (gq[-5:].view(torch.uint8) == 0).all()
        assert rel(cols_dequant(gqT, gsT, c0, blk[2] + first), cols_dequant(eqT, esT)) <= 5e-3
        if len(got) > 4:
            assert rel(got[4][tail], exp[4]) <= 1e-5 and (got[4][-5:] == 0).all()
        del got, exp
    del h, da, probs
    torch.cuda.empty_cache()


# ================================================================ streams, devices, torch.compile
def _linear_step(x, w, b, m, dy, recipe):
    xl, wl, bl = (t.clone().requires_grad_() for t in (x, w, b))
    y = moegemm.grouped_linear(xl, wl, m, bl, recipe=recipe)
    y.backward(dy)
    return [y.detach(), xl.grad, wl.grad, bl.grad]


def _mlp_step(inputs, m, recipe):
    leaves = [t.clone().requires_grad_() for t in inputs[:6]]
    y = moegemm.grouped_mlp(leaves[0], leaves[1], leaves[2], m, leaves[5], leaves[3], leaves[4], recipe=recipe)
    y.backward(inputs[6])
    return [y.detach()] + [t.grad for t in leaves]


@requires_cuda
@pytest.mark.parametrize("recipe", RECIPES)
def test_side_stream_equals_default_stream(recipe):
    torch.manual_seed(39)
    Es, Ts, Ks, Ns = 8, 2048, 256, 384
    x = torch.randn(Ts, Ks, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(Es, Ns, Ks, device="cuda") * 0.05).to(torch.bfloat16)
    b = torch.randn(Es, Ns, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(Ts, Ns, device="cuda", dtype=torch.bfloat16)
    m = torch.tensor(zipf_splits(Es, Ts), device="cuda")
    inputs = mlp_inputs("cuda", "swiglu", seed=40)
    m_mlp = torch.tensor(SPLITS, device="cuda")
    ref_lin, ref_mlp = _linear_step(x, w, b, m, dy, recipe), _mlp_step(inputs, m_mlp, recipe)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.cuda._sleep(10 ** 6)  # the side stream lags: ordering bugs against the default stream show
        got_lin, got_mlp = _linear_step(x, w, b, m, dy, recipe), _mlp_step(inputs, m_mlp, recipe)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    for a, c in zip(got_lin + got_mlp, ref_lin + ref_mlp):
        assert torch.equal(a, c)


@requires_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("recipe", RECIPES)
def test_tensors_on_non_current_device(recipe):
    if torch.cuda.get_device_capability(1) != (9, 0):
        pytest.skip("cuda:1 is not a Hopper GPU")
    torch.manual_seed(41)
    Es, Ts, Ks, Ns = 8, 1024, 256, 256
    x = torch.randn(Ts, Ks, dtype=torch.bfloat16)
    w = (torch.randn(Es, Ns, Ks) * 0.05).to(torch.bfloat16)
    b = torch.randn(Es, Ns, dtype=torch.bfloat16)
    dy = torch.randn(Ts, Ns, dtype=torch.bfloat16)
    splits = zipf_splits(Es, Ts)
    inputs = mlp_inputs("cpu", "swiglu", seed=42)

    def on(dev):
        lin = _linear_step(*(t.to(dev) for t in (x, w, b)), torch.tensor(splits, device=dev), dy.to(dev), recipe)
        mlp = _mlp_step([t.to(dev) for t in inputs], torch.tensor(SPLITS, device=dev), recipe)
        torch.cuda.synchronize(dev)
        return [t.cpu() for t in lin + mlp]

    with torch.cuda.device(0):
        ref = on("cuda:0")
        got = on("cuda:1")             # current device is cuda:0
    with torch.cuda.device(1):
        got0 = on("cuda:0")            # current device is cuda:1
    for a, c, d in zip(got, ref, got0):
        assert torch.equal(a, c) and torch.equal(d, c)
    with pytest.raises(ValueError):
        moegemm.grouped_linear(x.to("cuda:1"), w.to("cuda:0"), splits)


@requires_cuda
@pytest.mark.parametrize("recipe", RECIPES)
def test_torch_compile_fullgraph_linear(recipe):
    torch._dynamo.reset()
    torch.manual_seed(43)
    Es, Ts, Ks, Ns = 8, 1024, 256, 256
    x = torch.randn(Ts, Ks, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(Es, Ns, Ks, device="cuda") * 0.05).to(torch.bfloat16)
    b = torch.randn(Es, Ns, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(Ts, Ns, device="cuda", dtype=torch.bfloat16)

    def f(x, w, b, m):
        return moegemm.grouped_linear(x, w, m, b, recipe=recipe)

    cf = torch.compile(f, fullgraph=True)
    for splits in (zipf_splits(Es, Ts), [-5, Ts + 3, 7, 0, 0, 0, 0, 0], [2 ** 63 - 1, Ts + 1001] + [0] * 6):
        m = torch.tensor(splits, device="cuda")
        outs = []
        for fn in (f, cf):
            xl, wl, bl = (t.clone().requires_grad_() for t in (x, w, b))
            y = fn(xl, wl, bl, m)
            y.backward(dy)
            outs.append((y.detach(), xl.grad, wl.grad, bl.grad))
        for a, c in zip(*outs):
            assert rel(a, c) <= 1e-3
    # the second and third splits cover Ts tokens of expert 1 only / of expert 0 only
    cuda_alive()
