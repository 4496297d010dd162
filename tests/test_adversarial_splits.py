"""Adversarial m_splits (docs/design.md#errors): device counts of any value never cause out-of-bounds access.

Semantics tested (independently of the implementation, by ``covered_counts`` below): each count is
clamped to [0, T] first, then the running total is clamped to T; rows [covered, T) of y and dx are zero
(no bias there either) and contribute nothing to weight/bias/probs gradients. The checked mode rejects
every count outside [0, T] and every sum != T (int64 wrap included).

CPU tests run the reference plan and ops; GPU tests (``requires_cuda``) compare the CUDA path with a
valid-splits run of the covered rows and with the reference backend on the same device counts. The
out-of-bounds detector for these cases is ``tests/sanitize/adversarial.py`` under compute-sanitizer.
"""

from __future__ import annotations

import pytest
import torch

import moegemm
from moegemm import reference as R
from moegemm.layout import COL_ALIGN

from conftest import capture_step, cuda_alive, rel, requires_cuda, zipf_splits

DEV = "cuda"
E, T, K, N = 4, 300, 144, 160          # T, K, N not multiples of 128: partial tiles and blocks
H, F = 128, 144                        # expert MLP sizes
I64_MAX, I64_MIN = 2 ** 63 - 1, -2 ** 63
I32_MAX, I32_MIN = 2 ** 31 - 1, -2 ** 31
RECIPES = ("fp8_blockwise", "bf16")


def bad_cases(T: int = T) -> dict:
    """E = 4 counts that are invalid (or valid only after clamping), by name."""
    g = torch.Generator().manual_seed(12)
    stale = torch.randint(I64_MIN, I64_MAX, (4,), dtype=torch.int64, generator=g).tolist()
    return {
        "negative": [-5, 100, -7, T],
        "over_T": [T + 1, 5, 0, 7],
        "each_over_T": [T + 17, T + 1, 2 * T, T],
        "sum_below": [10, 0, 50, 3],
        "all_zero": [0, 0, 0, 0],
        "sum_above": [200, 200, 200, 200],
        "wrap2": [I64_MAX, T + 1001, 0, 0],             # int64 prefix sum overflows
        "wrap2_late": [0, 7, I64_MAX, T + 1001],
        "wrap3_sums_to_T": [I64_MAX, T + 1001, I64_MAX - 1000, 0],  # raw int64 sum wraps to exactly T
        "int64_extremes": [I64_MIN, I64_MAX, -1, T],
        "int32_extremes": [I32_MAX, I32_MAX, I32_MIN, 5],  # int32 sum wraps
        "stale_bytes": stale,
    }


def int32_ok(ms) -> bool:
    return all(I32_MIN <= v <= I32_MAX for v in ms)


def case_params(dtypes=(torch.int64, torch.int32)):
    for name, ms in bad_cases().items():
        for dt in dtypes:
            if dt == torch.int32 and not int32_ok(ms):
                continue
            yield pytest.param(name, dt, id=f"{name}-{str(dt)[6:]}")


def covered_counts(ms, T: int) -> list:
    """The oracle: per-expert token counts after clamping (Python ints: no wrap)."""
    tok, out = 0, []
    for v in ms:
        nxt = min(tok + min(max(int(v), 0), T), T)
        out.append(nxt - tok)
        tok = nxt
    return out


def oracle_plan(counts) -> list:
    tok, col, blk = [0], [0], [0]
    for c in counts:
        tok.append(tok[-1] + c)
        col.append(col[-1] + -(-c // COL_ALIGN) * COL_ALIGN)
        blk.append(blk[-1] + -(-c // 128))
    return [tok, col, blk]



# ============================================================================ CPU: the reference plan
@pytest.mark.parametrize("name,dt", list(case_params()))
def test_reference_plan_clamps_every_bad_count(name, dt):
    ms = bad_cases()[name]
    plan = R.make_plan(torch.tensor(ms, dtype=dt), T)
    counts = covered_counts(ms, T)
    assert plan.dtype == torch.int32 and plan.shape == (3, E + 1)
    assert plan.tolist() == oracle_plan(counts), name
    assert plan[1, -1].item() <= R.col_capacity(T, E) and plan[2, -1].item() <= R.block_capacity(T, E)


def test_reference_plan_wrap_two_experts():
    """The brief's literal cases with E = 2 and E = 3."""
    for ms in ([I64_MAX, T + 1001], [I64_MAX, T + 1001, I64_MAX - 1000], [T + 1001, I64_MAX], [I64_MIN, I64_MIN]):
        plan = R.make_plan(torch.tensor(ms, dtype=torch.int64), T)
        assert plan.tolist() == oracle_plan(covered_counts(ms, T)), ms


@pytest.mark.parametrize("seed", range(5))
def test_reference_plan_random_stale_bytes(seed):
    torch.manual_seed(seed)
    for Ei in (1, 3, 64, 1024):
        ms = torch.randint(I64_MIN, I64_MAX, (Ei,), dtype=torch.int64)
        for Ti in (0, 1, 4097):
            plan = R.make_plan(ms, Ti)
            assert plan.tolist() == oracle_plan(covered_counts(ms.tolist(), Ti))
        ms32 = torch.randint(I32_MIN, I32_MAX, (Ei,), dtype=torch.int32)
        assert R.make_plan(ms32, 4097).tolist() == oracle_plan(covered_counts(ms32.tolist(), 4097))


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name", ["sum_below", "wrap2", "wrap3_sums_to_T", "negative", "stale_bytes", "all_zero"])
def test_reference_ops_with_clamped_plan(recipe, name):
    """The reference backend (the oracle of the CUDA path) on a plan from bad counts: rows past the
    covered ones are zero in fprop/dgrad, and wgrad equals the one of the covered rows."""
    torch.manual_seed(1)
    ms = bad_cases()[name]
    counts = covered_counts(ms, T)
    cov = sum(counts)
    plan = R.make_plan(torch.tensor(ms, dtype=torch.int64), T)
    good = R.make_plan(torch.tensor(counts, dtype=torch.int64), cov)
    x = torch.randn(T, K, dtype=torch.bfloat16)
    dy = torch.randn(T, N, dtype=torch.bfloat16)
    w = torch.randn(E, N, K, dtype=torch.bfloat16) * 0.05
    if recipe == "fp8_blockwise":
        qx, sx, _, _ = R.quantize_act(x, plan, cols=False)
        qxT, sxT = R.requantize_cols(qx, sx, plan)  # wgrad's column copy is made from the row copy
        qdy, sdy, qdyT, sdyT = R.quantize_act(dy, plan)
        qw, sw, qwT, swT = R.quantize_weight(w)
        y = R.gemm_fp8_ragged_rows(qx, sx, qw, sw, plan)
        dx = R.gemm_fp8_ragged_rows(qdy, sdy, qwT, swT, plan)
        dw = R.gemm_fp8_ragged_reduction(qdyT, sdyT, qxT, sxT, plan)
        gx, gdy = R.quantize_act(x[:cov], good), R.quantize_act(dy[:cov], good)
        y_good = R.gemm_fp8_ragged_rows(gx[0], gx[1], qw, sw, good)
        dx_good = R.gemm_fp8_ragged_rows(gdy[0], gdy[1], qwT, swT, good)
        dw_good = R.gemm_fp8_ragged_reduction(gdy[2], gdy[3], *R.requantize_cols(gx[0], gx[1], good), good)
    else:
        y, dx, dw = R.gemm_bf16_fprop(x, w, plan), R.gemm_bf16_dgrad(dy, w, plan), R.gemm_bf16_wgrad(dy, x, plan)
        y_good = R.gemm_bf16_fprop(x[:cov], w, good)
        dx_good = R.gemm_bf16_dgrad(dy[:cov], w, good)
        dw_good = R.gemm_bf16_wgrad(dy[:cov], x[:cov], good)
    assert y.shape == (T, N) and dx.shape == (T, K) and dw.shape == (E, N, K)
    assert (y[cov:] == 0).all() and (dx[cov:] == 0).all()
    assert torch.equal(y[:cov], y_good) and torch.equal(dx[:cov], dx_good) and torch.equal(dw, dw_good)


@pytest.mark.parametrize("name", ["negative", "over_T", "sum_below", "sum_above", "wrap2", "wrap3_sums_to_T",
                                  "int64_extremes", "stale_bytes"])
def test_host_counts_rejected_without_wrap(name):
    """Host counts (list or CPU tensor) are always checked; Python ints cannot wrap, so the int64 case
    whose raw sum wraps to T is rejected too, by every public entry point."""
    ms = bad_cases()[name]
    x = torch.randn(T, K, dtype=torch.bfloat16)
    w = torch.randn(E, N, K, dtype=torch.bfloat16)
    w1 = torch.randn(E, 2 * F, H, dtype=torch.bfloat16)
    w2 = torch.randn(E, H, F, dtype=torch.bfloat16)
    for arg in (ms, torch.tensor(ms, dtype=torch.int64)):
        for check in (None, True):
            with pytest.raises(ValueError, match="m_splits"):
                moegemm.grouped_linear(x, w, arg, check_splits=check)
            with pytest.raises(ValueError, match="m_splits"):
                moegemm.grouped_mlp(torch.randn(T, H, dtype=torch.bfloat16), w1, w2, arg, check_splits=check)
            with pytest.raises(ValueError, match="m_splits"):
                moegemm.make_plan(arg, T, check_splits=check)
        with pytest.raises(ValueError, match="m_splits"):
            moegemm.quantize_act(x, arg)


def test_too_many_experts_public_make_plan():
    """E = 1025 is past the plan kernel's maximum: the public make_plan says so on every device."""
    with pytest.raises(ValueError, match="experts|m_splits"):
        moegemm.make_plan([0] * 1025, 0)
    assert moegemm.make_plan([0] * 1023 + [5], 5).shape == (3, 1025)


def test_non_contiguous_host_splits_tensor():
    """A strided CPU m_splits view is read correctly (not its neighbours)."""
    torch.manual_seed(2)
    splits = [100, 0, 150, 50]
    interleaved = torch.tensor([v for s in splits for v in (s, -999)], dtype=torch.int64)
    view = interleaved[::2]
    assert not view.is_contiguous() and view.tolist() == splits
    x = torch.randn(T, K, dtype=torch.bfloat16)
    w = torch.randn(E, N, K, dtype=torch.bfloat16)
    for recipe in RECIPES:
        assert torch.equal(moegemm.grouped_linear(x, w, view, recipe=recipe),
                           moegemm.grouped_linear(x, w, splits, recipe=recipe))


# ==================================================================================== GPU helpers
def linear_inputs(seed=0, bias=True, T=T):
    torch.manual_seed(seed)
    x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16)
    w = (torch.randn(E, N, K, device=DEV) * 0.05).to(torch.bfloat16)
    b = torch.randn(E, N, device=DEV, dtype=torch.bfloat16) if bias else None
    dy = torch.randn(T, N, device=DEV, dtype=torch.bfloat16)
    return x, w, b, dy


def run_linear(x, w, b, m, dy, recipe, **kw):
    """(y, dx, dw, db) of one fwd+bwd on fresh leaves."""
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    bl = b.clone().requires_grad_() if b is not None else None
    y = moegemm.grouped_linear(xl, wl, m, bl, recipe=recipe, **kw)
    y.backward(dy)
    return y.detach(), xl.grad, wl.grad, (bl.grad if bl is not None else None)


def mlp_inputs(seed=0, activation="swiglu", T=T):
    torch.manual_seed(seed)
    F1 = 2 * F if activation in ("swiglu", "geglu") else F
    x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)
    w1 = (torch.randn(E, F1, H, device=DEV) * 0.08).to(torch.bfloat16)
    w2 = (torch.randn(E, H, F, device=DEV) * 0.08).to(torch.bfloat16)
    b1 = torch.randn(E, F1, device=DEV, dtype=torch.bfloat16) * 0.1
    b2 = torch.randn(E, H, device=DEV, dtype=torch.bfloat16) * 0.1
    p = torch.rand(T, device=DEV)
    dy = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)
    return x, w1, w2, b1, b2, p, dy


def run_mlp(inputs, m, activation, recipe, **kw):
    x, w1, w2, b1, b2, p, dy = inputs
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2, b1, b2, p)]
    y = moegemm.grouped_mlp(leaves[0], leaves[1], leaves[2], m, leaves[5], leaves[3], leaves[4],
                            activation=activation, recipe=recipe, **kw)
    y.backward(dy)
    return [y.detach()] + [t.grad for t in leaves]


def assert_close(got, exp, tol, what):
    for i, (g, e) in enumerate(zip(got, exp)):
        if e is None:
            assert g is None, (what, i)
            continue
        assert g.shape == e.shape, (what, i)
        assert rel(g, e) <= tol, (what, i, rel(g, e))


# ========================================================================= GPU: invalid device counts
@requires_cuda
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name,dt", list(case_params()))
def test_invalid_device_splits_linear(recipe, name, dt, monkeypatch):
    ms = bad_cases()[name]
    counts = covered_counts(ms, T)
    cov = sum(counts)
    x, w, b, dy = linear_inputs(seed=3)
    m = torch.tensor(ms, dtype=dt, device=DEV)
    m0 = m.clone()
    got = run_linear(x, w, b, m, dy, recipe)
    cuda_alive()
    assert torch.equal(m, m0)  # m_splits is not modified
    y, dx, dw, db = got
    assert (y[cov:] == 0).all() and (dx[cov:] == 0).all(), "rows past the covered tokens must be zero (no bias)"
    assert torch.isfinite(y).all() and torch.isfinite(dx).all() and torch.isfinite(dw).all()
    # covered rows = a valid-splits run on those rows with the clamped counts
    if cov:
        exp = run_linear(x[:cov], w, b, counts, dy[:cov], recipe)
        assert_close((y[:cov], dx[:cov], dw, db), exp, 2e-3, "valid-splits run")
    else:
        assert (dw == 0).all() and (db == 0).all()
    for e, c in enumerate(counts):
        if c == 0:
            assert (dw[e] == 0).all() and (db[e] == 0).all()
    # the reference backend on the same device counts
    monkeypatch.setattr(moegemm.backends, "FORCE_REFERENCE", True)  # MOEGEMM_BACKEND=reference, read at import
    expected = run_linear(x, w, b, m, dy, recipe)
    assert_close(got, expected, 2e-3 if recipe == "fp8_blockwise" else 8e-3, "reference backend")


@requires_cuda
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("activation", ["swiglu", "relu"])
@pytest.mark.parametrize("name", list(bad_cases()))
def test_invalid_device_splits_mlp(recipe, activation, name):
    ms = bad_cases()[name]
    counts = covered_counts(ms, T)
    cov = sum(counts)
    inputs = mlp_inputs(seed=4, activation=activation)
    m = torch.tensor(ms, dtype=torch.int64, device=DEV)
    y, dx, dw1, dw2, db1, db2, dp = run_mlp(inputs, m, activation, recipe)
    cuda_alive()
    assert (y[cov:] == 0).all() and (dx[cov:] == 0).all() and (dp[cov:] == 0).all()
    for g in (y, dx, dw1, dw2, db1, db2, dp):
        assert torch.isfinite(g).all()
    if cov:
        sub = [inputs[0][:cov], inputs[1], inputs[2], inputs[3], inputs[4], inputs[5][:cov], inputs[6][:cov]]
        exp = run_mlp(sub, counts, activation, recipe)
        assert_close((y[:cov], dx[:cov], dw1, dw2, db1, db2, dp[:cov]), exp, 2e-3, "valid-splits run")
    else:
        assert all((g == 0).all() for g in (dw1, dw2, db1, db2))


@requires_cuda
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name", ["sum_below", "wrap2", "negative", "all_zero"])
def test_uncovered_rows_never_read(recipe, name):
    """NaN in x, dy and probs on rows past the covered ones changes nothing: those rows are not read by
    any GEMM, bias gradient or activation gradient that the covered rows depend on."""
    ms = bad_cases()[name]
    cov = sum(covered_counts(ms, T))
    m = torch.tensor(ms, device=DEV)
    x, w, b, dy = linear_inputs(seed=5)
    clean = run_linear(x, w, b, m, dy, recipe)
    xn, dyn = x.clone(), dy.clone()
    xn[cov:] = float("nan")
    dyn[cov:] = float("nan")
    dirty = run_linear(xn, w, b, m, dyn, recipe)
    for c, d in zip(clean, dirty):
        assert torch.equal(c, d)
    inputs = mlp_inputs(seed=5)
    clean = run_mlp(inputs, m, "swiglu", recipe)
    dirty_inputs = [t.clone() for t in inputs]
    for i in (0, 5, 6):
        dirty_inputs[i][cov:] = float("nan")
    dirty = run_mlp(dirty_inputs, m, "swiglu", recipe)
    for c, d in zip(clean, dirty):
        assert torch.equal(c, d)


@requires_cuda
@pytest.mark.parametrize("name,dt", list(case_params()))
def test_invalid_device_splits_plan_and_quantizer(name, dt):
    ms = bad_cases()[name]
    counts = covered_counts(ms, T)
    m = torch.tensor(ms, dtype=dt, device=DEV)
    assert moegemm.make_plan(m, T).cpu().tolist() == oracle_plan(counts)
    torch.manual_seed(6)
    x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16)
    q, s, qT, sT = moegemm.quantize_act(x, m)
    plan = R.make_plan(m.cpu(), T)
    rq, rs, rqT, rsT = R.quantize_act(x.cpu(), plan)
    assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s.cpu(), rs)
    for start, c, col, blk in R._segments(plan):
        wd, nb = -(-c // COL_ALIGN) * COL_ALIGN, -(-c // 128)
        assert torch.equal(qT[:, col:col + wd].cpu().view(torch.uint8), rqT[:, col:col + wd].view(torch.uint8))
        assert torch.equal(sT[blk:blk + nb].cpu(), rsT[blk:blk + nb])
    cuda_alive()


# =========================================================================== GPU: the checked mode
@requires_cuda
@pytest.mark.parametrize("via", ["argument", "env"])
@pytest.mark.parametrize("name,dt", list(case_params()))
def test_checked_mode_rejects(name, dt, via, monkeypatch):
    ms = bad_cases()[name]
    m = torch.tensor(ms, dtype=dt, device=DEV)
    kw = {"check_splits": True} if via == "argument" else {}
    if via == "env":
        monkeypatch.setattr(moegemm._validate, "CHECK_SPLITS", True)  # MOEGEMM_CHECK_SPLITS=1, read at import
    x, w, b, _ = linear_inputs(seed=7)
    inputs = mlp_inputs(seed=7)
    with pytest.raises(ValueError, match="m_splits"):
        moegemm.grouped_linear(x, w, m, b, **kw)
    with pytest.raises(ValueError, match="m_splits"):
        moegemm.GroupedLinear(E, K, N, device=DEV)(x, m, **kw)
    with pytest.raises(ValueError, match="m_splits"):
        moegemm.grouped_mlp(inputs[0], inputs[1], inputs[2], m, inputs[5], **kw)
    with pytest.raises(ValueError, match="m_splits"):
        moegemm.make_plan(m, T, **kw)
    cuda_alive()


@requires_cuda
@pytest.mark.parametrize("dt", [torch.int32, torch.int64])
def test_checked_mode_accepts_valid(dt):
    torch.manual_seed(8)
    x, w, b, dy = linear_inputs(seed=8)
    for splits in (zipf_splits(E, T), [T, 0, 0, 0], [0, 0, 0, T]):
        m = torch.tensor(splits, dtype=dt, device=DEV)
        for recipe in RECIPES:
            a = run_linear(x, w, b, m, dy, recipe, check_splits=True)
            c = run_linear(x, w, b, m, dy, recipe, check_splits=False)
            for u, v in zip(a, c):
                assert torch.equal(u, v)
    # T = 0: all-zero counts are the only valid ones
    x0 = torch.zeros(0, K, device=DEV, dtype=torch.bfloat16)
    assert moegemm.grouped_linear(x0, w, torch.zeros(E, dtype=dt, device=DEV), check_splits=True).shape == (0, N)
    with pytest.raises(ValueError, match="m_splits"):
        moegemm.grouped_linear(x0, w, torch.tensor([1, -1, 0, 0], dtype=dt, device=DEV), check_splits=True)


# ===================================================================== GPU: more adversarial counts
@requires_cuda
@pytest.mark.parametrize("recipe", RECIPES)
def test_T0_with_garbage_device_counts(recipe):
    x, w, b, _ = linear_inputs(seed=9, T=0)
    for ms in ([5, -3, I64_MAX, 7], [I64_MAX, I64_MAX, I64_MAX, I64_MAX], [I64_MIN, 1, 1, 1]):
        m = torch.tensor(ms, device=DEV)
        y, dx, dw, db = run_linear(x, w, b, m, torch.zeros(0, N, device=DEV, dtype=torch.bfloat16), recipe)
        assert y.shape == (0, N) and dx.shape == (0, K)
        assert (dw == 0).all() and (db == 0).all()
        inputs = mlp_inputs(seed=9, T=0)
        outs = run_mlp(inputs, m, "swiglu", recipe)
        assert outs[0].shape == (0, H)
        assert all((g == 0).all() for g in outs[2:6])
    cuda_alive()


@requires_cuda
@pytest.mark.parametrize("recipe", RECIPES)
def test_single_expert_garbage(recipe):
    torch.manual_seed(10)
    x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16)
    w = (torch.randn(1, N, K, device=DEV) * 0.05).to(torch.bfloat16)
    b = torch.randn(1, N, device=DEV, dtype=torch.bfloat16)
    dy = torch.randn(T, N, device=DEV, dtype=torch.bfloat16)
    full = run_linear(x, w, b, [T], dy, recipe)
    for ms in ([T + 5], [I64_MAX], [T * 10 ** 6]):
        got = run_linear(x, w, b, torch.tensor(ms, device=DEV), dy, recipe)
        for g, f in zip(got, full):
            assert torch.equal(g, f)
    for ms in ([-1], [I64_MIN], [0]):
        y, dx, dw, db = run_linear(x, w, b, torch.tensor(ms, device=DEV), dy, recipe)
        assert (y == 0).all() and (dx == 0).all() and (dw == 0).all() and (db == 0).all()


@requires_cuda
def test_non_contiguous_device_splits():
    """A strided device m_splits view: handled (a contiguous copy) or a clear error, never its neighbours."""
    splits = [100, 0, 150, 50]
    inter = torch.tensor([v for s in splits for v in (s, 10 ** 6)], device=DEV)
    view = inter[::2]
    assert not view.is_contiguous()
    x, w, b, dy = linear_inputs(seed=11)
    for recipe in RECIPES:
        try:
            got = run_linear(x, w, b, view, dy, recipe)
        except ValueError as err:
            assert "m_splits" in str(err) and "contiguous" in str(err)
            continue
        for g, e in zip(got, run_linear(x, w, b, splits, dy, recipe)):
            assert torch.equal(g, e)


@requires_cuda
def test_splits_on_wrong_device():
    x, w, b, _ = linear_inputs(seed=12)
    m = torch.tensor([100, 0, 150, 50], device=DEV)
    with pytest.raises(ValueError, match="m_splits"):
        moegemm.grouped_linear(x.cpu(), w.cpu(), m)  # device counts for CPU tensors
    with pytest.raises(ValueError, match="m_splits"):
        moegemm.grouped_linear(x, w, torch.tensor([100, 0, 150, 50, 0], device=DEV))  # length, no sync
    if torch.cuda.device_count() >= 2:
        with pytest.raises(ValueError, match="m_splits"):
            moegemm.grouped_linear(x, w, m.to("cuda:1"))
    cuda_alive()


# ===================================================================================== E at the max
@requires_cuda
@pytest.mark.parametrize("recipe", RECIPES)
def test_max_experts(recipe, monkeypatch):
    Em, Tm, Km, Nm = 1024, 3000, 128, 128
    torch.manual_seed(13)
    splits = zipf_splits(Em, Tm)
    x = torch.randn(Tm, Km, device=DEV, dtype=torch.bfloat16)
    w = (torch.randn(Em, Nm, Km, device=DEV) * 0.05).to(torch.bfloat16)
    b = torch.randn(Em, Nm, device=DEV, dtype=torch.bfloat16)
    dy = torch.randn(Tm, Nm, device=DEV, dtype=torch.bfloat16)
    m = torch.tensor(splits, device=DEV)
    got = run_linear(x, w, b, m, dy, recipe)
    monkeypatch.setattr(moegemm.backends, "FORCE_REFERENCE", True)  # MOEGEMM_BACKEND=reference, read at import
    expected = run_linear(x, w, b, m, dy, recipe)
    assert_close(got, expected, 2e-3 if recipe == "fp8_blockwise" else 8e-3, "E=1024")
    empty = [e for e, c in enumerate(splits) if c == 0]
    assert (got[2][empty] == 0).all() and (got[3][empty] == 0).all()
    # invalid counts at the maximum E
    monkeypatch.setattr(moegemm.backends, "FORCE_REFERENCE", False)
    garbage = torch.randint(I64_MIN, I64_MAX, (Em,), dtype=torch.int64)
    cov = sum(covered_counts(garbage.tolist(), Tm))
    y, dx, _, _ = run_linear(x, w, b, garbage.to(DEV), dy, recipe)
    assert (y[cov:] == 0).all() and (dx[cov:] == 0).all()
    cuda_alive()


@requires_cuda
def test_too_many_experts_public():
    x = torch.zeros(4, 16, device=DEV, dtype=torch.bfloat16)
    w = torch.zeros(1025, 16, 16, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="experts"):
        moegemm.grouped_linear(x, w, torch.zeros(1025, dtype=torch.int64, device=DEV))
    with pytest.raises(ValueError):
        moegemm.make_plan(torch.zeros(1025, dtype=torch.int64, device=DEV), 4)
    cuda_alive()


# ============================================================================ CUDA graph, bad counts
@requires_cuda
@pytest.mark.parametrize("recipe", RECIPES)
def test_cuda_graph_replay_with_invalid_counts(recipe):
    x, w, b, dy = linear_inputs(seed=14)
    xl, wl, bl = x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
    m = torch.tensor(zipf_splits(E, T), device=DEV)

    def step():
        xl.grad = wl.grad = bl.grad = None
        y = moegemm.grouped_linear(xl, wl, m, bl, recipe=recipe)
        y.backward(dy)
        return y, xl.grad, wl.grad, bl.grad

    g, (y_static, gx, gw, gb) = capture_step(step)
    for name in ["negative", "over_T", "wrap2", "wrap3_sums_to_T", "stale_bytes", "sum_below", "all_zero"]:
        ms = bad_cases()[name]
        cov = sum(covered_counts(ms, T))
        m.copy_(torch.tensor(ms, device=DEV))
        g.replay()
        torch.cuda.synchronize()
        assert (y_static[cov:] == 0).all() and (gx[cov:] == 0).all(), name
        eager = run_linear(x, w, b, m, dy, recipe)
        for a, c in zip((y_static, gx, gw, gb), eager):
            assert torch.equal(a, c), name
    cuda_alive()
