"""The benchmark suite's parts that run without a GPU: the training-step table of results.md from a small
fake results dict; the training step itself (main_grad accumulation, the in-place update) with torch's
grouped GEMM on the CPU; the DeepGEMM peer's MLP (bench/peers/deepgemm_mlp.py) against a stand-in for
DeepGEMM's two SM90 FP8 grouped GEMMs that checks the operand layouts they read (K-major operands, MN-major
activation scales, the k-grouped GEMM's per-expert K-major flat operands) and computes in plain torch; the
points the JIT prewarm runs and its child-process pool."""

from __future__ import annotations

import argparse
import os

import pytest
import torch

from bench.peers import deepgemm as dgpeer
from bench.peers import deepgemm_mlp
from bench.suite.cases import Case, mlp_errors, reference
from bench.suite.report import render_markdown, render_training
from bench.suite.runner import model_points, prewarm_jobs, train_points
from bench.suite.training import TrainStep

from conftest import HAS_HOPPER


# ------------------------------------------------------------------------------------- the report
def _rec(shape, variant, ga, ms, **kw):
    r = {"shape": shape, "E": 64, "hidden": 2048, "ffn": 1408, "T": 24576, "splits": "zipf", "variant": variant,
         "label": variant, "ga": ga, "status": "ok", "ms": ms}
    r.update(kw)
    return r


def _fake_results():
    recs = []
    for ga, base in ((1, 10.0), (4, 40.0)):
        for key, x in (("torch_bf16", 1.0), ("moegemm_bf16", 1.25), ("moegemm_fp8_wcache", 2.0),
                       ("deepgemm_fp8_wcache", 1.6)):
            recs.append(_rec("DeepSeek-V2-Lite", key, ga, base / x, speedup_vs_torch_bf16=x,
                             main_grad_ratio=float(ga)))
    recs.append(_rec("DeepSeek-V2-Lite", "torch_bf16", 1, 12.0, splits="balanced"))
    recs.append(_rec("DeepSeek-V2-Lite", "moegemm_fp8_wcache", 1, 4.0, splits="balanced", speedup_vs_torch_bf16=3.0))
    recs.append(_rec("Mixtral-8x7B", "torch_bf16", 1, 30.0))
    recs.append(_rec("Mixtral-8x7B", "deepgemm_fp8_wcache", 1, None, status="error",
                     reason="RuntimeError: out of | memory"))
    return {"train": recs, "unavailable": {"deepgemm_fp8": "RuntimeError: no DeepGEMM source tree at .peers/DeepGEMM"}}


def test_training_table():
    md = render_training(_fake_results())
    lines = md.splitlines()
    assert lines[0].startswith("## Training step")
    head = next(line for line in lines if line.startswith("| shape"))
    assert head.split(" | ")[4:] == ["torch bf16 ms", "moegemm bf16 ms", "moegemm fp8 ms", "DeepGEMM fp8 ms",
                                     "moegemm fp8 vs moegemm bf16", "moegemm fp8 vs DeepGEMM fp8",
                                     "main_grad GA/GA=1 |"]
    table = lines[lines.index(head):]
    table = table[:table.index("")]
    rows = [line for line in table if line.startswith("| ") and not line.startswith("| shape")]
    assert len(rows) == 4
    ga1, ga4, bal1, mixtral = ([c.strip() for c in r.strip("|").split("|")] for r in rows)
    assert ga1[:4] == ["DeepSeek-V2-Lite", "zipf", "64/2048/1408/24576", "1"]
    assert ga1[4:8] == ["10.000", "8.000 (1.25x)", "5.000 (2.00x)", "6.250 (1.60x)"]
    assert ga1[8:10] == ["1.60x", "1.25x"]  # moegemm fp8 over moegemm bf16 (8/5), over DeepGEMM (6.25/5)
    assert ga4[:4] == ["", "", "", "4"] and ga4[4] == "40.000" and ga4[8:10] == ["1.60x", "1.25x"]
    assert ga4[10] == "4.000 / 4.000 / 4.000 / 4.000" and ga1[10] == ""
    assert bal1[:4] == ["DeepSeek-V2-Lite", "balanced", "64/2048/1408/24576", "1"]
    assert bal1[4:7] == ["12.000", "", "4.000 (3.00x)"] and bal1[8:10] == ["n/a", "n/a"]
    assert mixtral[:2] == ["Mixtral-8x7B", "zipf"] and mixtral[4] == "30.000" and mixtral[5:7] == ["", ""]
    assert mixtral[7] == "error: RuntimeError: out of / memory" and mixtral[8:10] == ["n/a", "n/a"]
    # the geometric means of each speed-up per GA, over every row that has it
    means = {(c[0], c[1]): c[2:] for c in ([x.strip() for x in line.strip("|").split("|")]
                                           for line in lines[lines.index(head) + len(table):]
                                           if line.startswith("| ") and not line.startswith("| speed-up"))
             if not set(c[0]) <= set("-")}
    assert means[("moegemm fp8 vs torch bf16", "1")] == ["2", f"{(2.0 * 3.0) ** 0.5:.2f}x", "2.00x"]
    assert means[("moegemm fp8 vs moegemm bf16", "1")] == ["1", "1.60x", "1.60x"]
    assert means[("moegemm fp8 vs DeepGEMM fp8", "4")] == ["1", "1.25x", "1.25x"]


def test_results_md_has_the_training_section_and_the_peer():
    md = render_markdown(_fake_results())
    assert "## Training step" in md and "| DeepSeek-V2-Lite | zipf | 64/2048/1408/24576 | 1 | 10.000 |" in md
    assert "Not run (unavailable here): DeepGEMM fp8 blockwise (padded to 128): RuntimeError: no DeepGEMM" in md
    assert render_training({"train": []}) == ""


def _sweep(op, variant, E, host_us, **kw):
    r = {"op": op, "E": E, "hidden": 1024, "ffn": 512, "T": 8192, "splits": "zipf", "variant": variant, "label": variant,
         "status": "ok", "host_us": host_us}
    r.update(kw)
    return r


def test_host_sweep_ratio_rows():
    """The host sweep's last rows: moegemm fp8's host time over torch._grouped_mm's of the same run and E (the host
    time's relative bound); a call that waited for the GPU gives no ratio."""
    sweep = [_sweep("mlp", "moegemm_fp8", 8, 300.0), _sweep("mlp", "torch_bf16", 8, 1000.0),
             _sweep("mlp", "moegemm_fp8", 256, 450.0), _sweep("mlp", "torch_bf16", 256, 900.0),
             _sweep("mlp", "moegemm_fp8_wcache", 8, 500.0, host_gpu_went_idle=1), _sweep("mlp", "moegemm_fp8_wcache", 256, 360.0),
             _sweep("fc1", "moegemm_bf16", 8, 40.0), _sweep("fc1", "torch_bf16", 8, 80.0)]
    md = render_markdown({"train": [], "host_sweep": sweep})
    rows = {r.split("|")[2].strip(): [c.strip() for c in r.strip().strip("|").split("|")][2:]
            for r in md.splitlines() if "/ torch._grouped_mm bf16" in r}
    fp8 = next(v for k, v in rows.items() if k.startswith("moegemm fp8_blockwise /"))
    cached = next(v for k, v in rows.items() if "weight cache" in k)
    assert fp8 == ["0.30x", "0.50x"]
    assert cached == ["", "0.40x"]  # E = 8 waited for the GPU
    assert len(rows) == 2  # no ratio row for bf16, nor for fc1 without a moegemm fp8 variant


# ------------------------------------------------------------------------------- DeepGEMM stand-in
class FakeDeepGEMM:
    """DeepGEMM's SM90 FP8 grouped GEMMs in plain torch (dequantize, matmul), asserting the layouts its
    kernels read (csrc/apis/gemm.hpp, csrc/utils/layout.hpp and tests/generators.py of DeepGEMM)."""

    def __init__(self):
        self.calls = {"m": 0, "k": 0}

    def m_grouped_fp8_gemm_nt_contiguous(self, a, b, d, grouped_layout):
        self.calls["m"] += 1
        (qa, sa), (qb, sb) = a, b
        M, K = qa.shape
        G, N, K_ = qb.shape
        assert K == K_ and M % 128 == 0 and qa.dtype == qb.dtype == torch.float8_e4m3fn
        assert qa.is_contiguous() and qb.is_contiguous()  # K-major: SM90's only FP8 layout
        assert tuple(sa.shape) == (M, K // 128) and sa.dtype == torch.float32
        assert sa.stride(0) == 1 and (K == 128 or sa.stride(1) == M)  # MN-major, TMA-aligned
        assert tuple(sb.shape) == (G, -(-N // 128), K // 128) and sb.is_contiguous()
        assert grouped_layout.dtype == torch.int32 and tuple(grouped_layout.shape) == (M,)
        assert d.dtype == torch.bfloat16 and tuple(d.shape) == (M, N) and d.is_contiguous()
        blocks = grouped_layout.view(M // 128, 128)  # a block: one expert's rows, then its padding
        assert ((blocks == blocks[:, :1]) | (blocks == -1)).all()
        x = qa.float() * sa.repeat_interleave(128, 1)
        d.zero_()  # the padding rows' blocks come back as zeros
        for g in range(G):
            rows = grouped_layout == g
            w = qb[g].float() * sb[g].repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)
            d[rows] = (x[rows] @ w.t()).to(d.dtype)

    def k_grouped_fp8_gemm_nt_contiguous(self, a, b, d, ks_cpu, grouped_layout, c):
        self.calls["k"] += 1
        (fa, sa), (fb, sb) = a, b
        G, M, N = d.shape
        assert c is d and d.dtype == torch.float32 and d.is_contiguous()
        assert len(ks_cpu) == G and all(isinstance(k, int) and k % 128 == 0 for k in ks_cpu)
        assert grouped_layout.dtype == torch.int32 and grouped_layout.tolist() == ks_cpu
        S = sum(ks_cpu)
        assert fa.dim() == fb.dim() == 1 and fa.numel() == S * M and fb.numel() == S * N
        assert tuple(sa.shape) == (M, S // 128) and sa.stride(0) == 1
        assert tuple(sb.shape) == (N, S // 128) and sb.stride(0) == 1
        off = 0
        for e, k in enumerate(ks_cpu):  # each group: [M, k] K-major, one after another
            if k:
                cols = slice(off // 128, (off + k) // 128)
                A = fa[off * M:(off + k) * M].view(M, k).float() * sa[:, cols].repeat_interleave(128, 1)
                B = fb[off * N:(off + k) * N].view(N, k).float() * sb[:, cols].repeat_interleave(128, 1)
                d[e] += A @ B.t()
                off += k


@pytest.fixture
def fake_dg(monkeypatch):
    dg = FakeDeepGEMM()
    monkeypatch.setattr(deepgemm_mlp, "_DG", [dg])
    return dg


def test_layout_and_k_major_operand():
    m = torch.tensor([0, 1, 130, 47, 300])
    lay = deepgemm_mlp._Layout(m, 5, 478)
    assert lay.padded == [0, 128, 256, 128, 384] and lay.T_pad == 896 and lay.ks.tolist() == lay.padded
    assert lay.groups.view(-1, 128)[:, 0].tolist() == [1, 2, 2, 3, 4, 4, 4]
    assert (lay.groups >= 0).sum() == 478 and lay.dst.tolist()[:3] == [0, 128, 129]
    x = torch.randn(478, 3)
    assert torch.equal(lay.unpad(lay.pad(x)), x) and lay.pad(x)[lay.groups < 0].abs().sum() == 0
    q = torch.randn(896, 256).to(torch.float8_e4m3fn)
    want, s = [], 0
    for k in lay.padded:
        want.append(q[s:s + k].t().contiguous().view(-1))
        s += k
    assert torch.equal(dgpeer.k_major(q, lay.padded).view(torch.uint8), torch.cat(want).view(torch.uint8))


@pytest.mark.parametrize("splits", [[32] * 8, [0, 1, 3, 17, 0, 30, 64, 13], [0, 200, 5, 140, 0, 1, 7, 150]])
def test_deepgemm_mlp_against_float64(fake_dg, splits):
    c = Case("t", len(splits), 256, 128, splits, "cpu", seed=1)
    ref = reference(c)
    for key in deepgemm_mlp.KEYS:
        errs = mlp_errors(deepgemm_mlp.mlp(key, c), c, ref)
        assert set(errs) == {"y", "dx", "dprobs", "dW1", "dW2"}
        assert all(0.01 < e < 0.1 for e in errs.values()), errs  # FP8 E4M3 noise, no worse
    h = deepgemm_mlp.fc1("deepgemm_fp8", c)()
    assert h.shape == (c.T, 256) and 0.01 < float((h.double() - ref["h"].double()).norm() / ref["h"].norm()) < 0.06


def _cpu_grouped_mm() -> bool:
    """torch._grouped_mm runs on the CPU (torch >= 2.9)."""
    try:
        torch._grouped_mm(torch.ones(8, 16), torch.ones(2, 16, 32), offs=torch.tensor([4, 8], dtype=torch.int32))
        return True
    except (AttributeError, NotImplementedError, RuntimeError):
        return False


def test_training_step_main_grad_and_weight_cache(fake_dg, monkeypatch):
    made = []
    quantize = dgpeer.quantize_blocks
    monkeypatch.setattr(dgpeer, "quantize_blocks", lambda w: made.append(w.shape) or quantize(w))
    c = Case("t", 4, 256, 128, [0, 200, 5, 140], "cpu", seed=2)
    norms = {}
    variants = [("deepgemm_fp8_wcache", 2), ("deepgemm_fp8", 8)] + ([("torch_bf16", 0)] if _cpu_grouped_mm() else [])
    for key, per_step in variants:
        step = TrainStep(key, c)
        w1 = step.weights[0]
        assert w1 is not c.W1g and w1.data_ptr() != c.W1.data_ptr()  # its own weights
        step.run(1)
        one, version = step.main_grad_norm(), w1._version
        made.clear()
        step.run(4)
        assert len(made) == per_step  # FP8 weights once per step with the cache, else in every micro-batch
        assert w1._version > version  # the update wrote the weights: the cache must quantize again
        assert abs(step.main_grad_norm() / one - 4.0) < 1e-5
        assert w1.grad is None and all(torch.isfinite(w.main_grad).all() for w in step.weights)
        norms[key] = one
    if "torch_bf16" in norms:  # DeepGEMM's main_grad (its k-grouped GEMM's) against torch's bf16 gradients added
        assert abs(norms["deepgemm_fp8"] / norms["torch_bf16"] - 1.0) < 0.05


@pytest.mark.skipif(not (HAS_HOPPER and "libstdc++" in os.environ.get("LD_PRELOAD", "")
                         and (dgpeer.DEFAULT_SRC / "setup.py").is_file()),
                    reason="needs a Hopper GPU, DeepGEMM's source in .peers/DeepGEMM and the libstdc++ preload")
def test_real_deepgemm_matches_the_stand_in():
    """On the GPU, with DeepGEMM built (bench/peers/deepgemm.py): the peer's MLP on DeepGEMM's kernels and on
    the stand-in give the same outputs and gradients up to rounding, so the layouts it hands DeepGEMM are the
    ones DeepGEMM reads; and both are within FP8 noise of float64."""
    deepgemm_mlp.load("deepgemm_fp8")
    real = deepgemm_mlp._DG[0]
    c = Case("t", 8, 512, 256, [0, 1, 300, 17, 0, 130, 64, 13], "cuda", seed=3)
    ref = reference(c)
    out = {}
    try:
        for name, dg in (("real", real), ("stand-in", FakeDeepGEMM())):
            deepgemm_mlp._DG[:] = [dg]
            impl = deepgemm_mlp.mlp("deepgemm_fp8", c)
            y = impl.fwd(c.xg, c.m, c.pg)
            out[name] = [y] + list(torch.autograd.grad(y, [c.xg, c.pg] + impl.params, c.dy))
            assert all(0.01 < e < 0.1 for e in mlp_errors(impl, c, ref).values()), name
    finally:
        deepgemm_mlp._DG[:] = [real]
    for what, a, b in zip(("y", "dx", "dprobs", "dW1", "dW2"), out["real"], out["stand-in"]):
        diff = float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())
        assert diff < 2e-2, (what, diff)


def test_deepgemm_peer_refuses_cleanly_without_gpu():
    if torch.cuda.is_available():
        pytest.skip("a machine with a GPU")
    with pytest.raises(RuntimeError, match="DeepGEMM needs a CUDA GPU, and this machine has none"):
        deepgemm_mlp.load("deepgemm_fp8")
    with pytest.raises(ValueError, match="hidden to be a multiple of 128"):
        deepgemm_mlp.mlp("deepgemm_fp8", Case("t", 2, 144, 128, [3, 5], "cpu"))


# --------------------------------------------------------------------------------- the JIT prewarm
def _args(**kw):
    a = dict(quick=True, shapes=None, splits=None, no_train=False, no_sweep=False)
    a.update(kw)
    return argparse.Namespace(**a)


def test_prewarm_covers_every_point_once():
    from bench.suite.__main__ import make_cfg

    args = _args(splits="zipf,balanced", quick=False, jitter_iters=None, jitter_seconds=None, budget_s=None)
    cfg = make_cfg(args)
    pts = model_points(cfg, None)
    assert len(pts) == 4 * 2 + 1 + 2 and pts[-1][7] == ("fc1",)  # shapes x splits, small experts, GEMM problems
    jobs = prewarm_jobs(cfg, args, ("fc1", "mlp"))
    names = [j["name"] for j in jobs]
    assert len(names) == len(set(names)) == len(pts) + 4  # the training step's points are the model points: no new job
    assert {"sweep E=8", "sweep E=256", "Mixtral-8x7B balanced", "GEMM 4x8192 N=4096 K=7168 balanced"} <= set(names)
    assert len(prewarm_jobs(cfg, args, ("mlp",))) == len(pts) - 2 + 4  # no fc1-only problem for an MLP-only variant
    mixtral = prewarm_jobs(cfg, _args(no_sweep=True, shapes="mixtral"), ("mlp",))
    assert [j["name"] for j in mixtral] == ["Mixtral-8x7B zipf", "Mixtral-8x7B balanced"]
    assert [p[0] for p in train_points(cfg, "qwen,small")] == ["Qwen3-30B-A3B", "Qwen3-30B-A3B", "Small experts E=64"]
    assert [p[5] for p in train_points(cfg, "qwen,small")] == ["zipf", "balanced", "zipf"]


def test_prewarm_pool_runs_every_job_in_a_child():
    from bench.suite.probes import Prewarm

    jobs = [{"name": f"tiny {i}", "E": 2, "H": 128, "F": 128, "splits": [3, 5], "ops": ["mlp"]} for i in range(2)]
    rec = Prewarm("torch_bf16", jobs, max_par=1).wait(240)
    assert rec["points"] == 2 and rec["error"] is None
    if torch.cuda.is_available():
        assert rec["failed"] == {}
    else:  # each child stops at the suite's no-GPU sentence, and the pool reports it
        assert set(rec["failed"]) == {"tiny 0", "tiny 1"}
        assert all("exit code 1: python -m bench.suite needs a CUDA GPU" in v for v in rec["failed"].values())
