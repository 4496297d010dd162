"""Where the host time of one call goes: enqueue microseconds per call (GPU kept busy, as the suite's
host-overhead column) of each step of moegemm's fc1 forward and MLP forward+backward (weights quantized in
the call, and from the automatic FP8 weight cache), next to a bare torch op and torch._grouped_mm, for E = 8
and 256.

    python -m bench.suite.host_breakdown [--profile]   # --profile: torch.profiler CPU tables (below)
"""

from __future__ import annotations

import argparse

import moegemm
import torch
from moegemm import _validate, backends as backend
from bench.workloads import zipf_splits

from bench.preflight import require_cuda_gpu
from bench.suite.measure import host_overhead

PROG = "python -m bench.suite.host_breakdown"


class _Empty(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def us(fn) -> float:
    fn()
    return host_overhead(fn, reps=11)["host_us"]


def profile_cpu(fn, iters=10):
    """CPU time per op of ``iters`` calls enqueued behind a long GPU sleep (so nothing waits)."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            fn()
    torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=45, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60))


def main():
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", action="store_true", help="also print torch.profiler's CPU tables of one "
                    "grouped_linear call and one MLP step (E = 8), and of one MLP step with the FP8 weight cache "
                    "(E = 8 and 256)")
    args = ap.parse_args()
    require_cuda_gpu(PROG, hopper=True)
    H, F, T = 1024, 512, 8192
    rows = []
    for E in (8, 256):
        dev = "cuda"
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        w1 = torch.randn(E, 2 * F, H, device=dev, dtype=torch.bfloat16) * H ** -0.5
        m = torch.tensor(zipf_splits(E, T), device=dev)
        ops = backend.select(x.device)
        plan = ops.make_plan(m, T)
        qx, sx = ops.quantize_act(x, plan, True, False)[:2]
        qw, sw = ops.quantize_weight(w1)[:2]
        mlp = moegemm.GroupedMLP(E, H, F, device=dev, dtype=torch.bfloat16, fp8_weight_cache=False)  # every call
        mlp_bf16 = moegemm.GroupedMLP(E, H, F, recipe="bf16", device=dev, dtype=torch.bfloat16)
        mlp_cached = moegemm.GroupedMLP(E, H, F, device=dev, dtype=torch.bfloat16)  # weights quantized once
        xg = x.detach().requires_grad_()
        p = torch.rand(T, device=dev, requires_grad=True)
        dy = torch.randn(T, H, device=dev, dtype=torch.bfloat16)

        def step(model):
            def f():
                y = model(xg, m, p)
                return torch.autograd.grad(y, [xg, p, model.fc1.weight, model.fc2.weight], dy)
            return f

        with torch.no_grad():
            cases = {
                "torch: x.add_(0) (one bare op)": lambda: x.add_(0),
                "torch._grouped_mm fc1 (+ cumsum)": lambda: torch._grouped_mm(x, w1.transpose(1, 2),
                                                                               offs=torch.cumsum(m, 0, dtype=torch.int32)),
                "python checks (weight, x, m_splits)": lambda: (_validate.check_weight(w1), _validate.check_x(x, H, x.device),
                                                                _validate.splits_to_device(m, E, T, x.device)),
                "backend.select": lambda: backend.select(x.device),
                "op make_plan": lambda: ops.make_plan(m, T),
                "op quantize_act (rows)": lambda: ops.quantize_act(x, plan, True, False),
                "op quantize_weight": lambda: ops.quantize_weight(w1),
                "op gemm_fp8_ragged_rows": lambda: ops.gemm_fp8_ragged_rows(qx, sx, qw, sw, plan),
                "op gemm_bf16_fprop": lambda: ops.gemm_bf16_fprop(x, w1, plan),
                "op linear_fwd fp8 (torch.ops, direct)": lambda: torch.ops.moegemm.linear_fwd(x, w1, m, None, 1, False, False),
                "op linear_fwd bf16 (torch.ops, direct)": lambda: torch.ops.moegemm.linear_fwd(x, w1, m, None, 0, False, False),
                "empty autograd.Function.apply": lambda: _Empty.apply(xg),
                "grouped_linear fp8 (no grad)": lambda: moegemm.grouped_linear(x, w1, m),
                "grouped_linear bf16 (no grad)": lambda: moegemm.grouped_linear(x, w1, m, recipe="bf16"),
            }
            res = {k: us(f) for k, f in cases.items()}
        w1g = w1.detach().requires_grad_()
        # the floor of any autograd layer here: one empty Function forward + torch.autograd.grad
        res["autograd floor: empty Function fwd+bwd"] = us(lambda: torch.autograd.grad(_Empty.apply(xg), [xg], dy))
        native = ops.LAYER_AUTOGRAD
        try:
            for shell in ("C++ node", "Python Function"):  # the layers' autograd, and the split backward's shell
                ops.LAYER_AUTOGRAD = shell == "C++ node"
                res[f"grouped_linear fp8 fwd (grad), {shell}"] = us(lambda: moegemm.grouped_linear(xg, w1g, m))
                res[f"GroupedMLP fp8 fwd (grad), {shell}"] = us(lambda: mlp(xg, m, p))
                res[f"GroupedMLP fp8 fwd+bwd, {shell}"] = us(step(mlp))
                res[f"GroupedMLP bf16 fwd+bwd, {shell}"] = us(step(mlp_bf16))
        finally:
            ops.LAYER_AUTOGRAD = native
        res["GroupedMLP fp8 fwd (grad), FP8 weight cache"] = us(lambda: mlp_cached(xg, m, p))
        res["GroupedMLP fp8 fwd+bwd, FP8 weight cache"] = us(step(mlp_cached))
        if args.profile and E == 8:
            with torch.no_grad():
                profile_cpu(lambda: moegemm.grouped_linear(x, w1, m))
            profile_cpu(step(mlp))
        if args.profile:
            print(f"\n== one MLP step with the FP8 weight cache, E = {E}")
            profile_cpu(step(mlp_cached))
        rows.append((E, res))
        del mlp, mlp_bf16, mlp_cached
        torch.cuda.empty_cache()
    print(f"\nhost us per call, GPU busy (hidden={H}, ffn={F}, T={T})")
    print(f"{'step':45s}" + "".join(f"{'E=' + str(E):>10s}" for E, _ in rows))
    for k in rows[0][1]:
        print(f"{k:45s}" + "".join(f"{r[k]:10.1f}" for _, r in rows))


if __name__ == "__main__":
    main()
