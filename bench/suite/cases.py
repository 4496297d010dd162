"""The inputs of one benchmark point and the accuracy oracle: Case (x, W1, W2, probs, dy, device
m_splits; FLOP and minimal-byte counts), the float64 per-expert reference, rel_err, and the errors of an
MLP implementation's output and gradients against the reference."""

from __future__ import annotations

import math

import torch

from bench.suite.shared import BF16, short


def split_kind(splits) -> str:
    """'aligned' when every group is non-empty and a multiple of 16 rows (what the FP8 2d x 2d grouped
    GEMM of torch needs), else 'unaligned'."""
    return "aligned" if all(c > 0 and c % 16 == 0 for c in splits) else "unaligned"


class Case:
    """Inputs of one benchmark point: x [T, H], W1 [E, 2F, H] (gate rows, then up rows), W2 [E, H, F],
    router probs [T] (fp32), upstream gradient dy [T, H], device m_splits."""

    def __init__(self, name, E, H, F, splits, dev="cuda", seed=0):
        self.name, self.E, self.H, self.F, self.splits = name, E, H, F, list(splits)
        self.T = T = sum(splits)
        self.kind = split_kind(splits)
        g = torch.Generator(device=dev)
        g.manual_seed(seed)
        self.x = torch.randn(T, H, device=dev, dtype=BF16, generator=g)
        self.W1 = torch.empty(E, 2 * F, H, device=dev, dtype=BF16).uniform_(-H ** -0.5, H ** -0.5, generator=g)
        self.W2 = torch.empty(E, H, F, device=dev, dtype=BF16).uniform_(-F ** -0.5, F ** -0.5, generator=g)
        self.probs = torch.rand(T, device=dev, generator=g) * 0.9 + 0.1
        self.dy = torch.randn(T, H, device=dev, dtype=BF16, generator=g)
        self.m = torch.tensor(self.splits, device=dev, dtype=torch.int64)
        # Leaves for the fwd+bwd step (share storage with the tensors above).
        self.xg = self.x.detach().requires_grad_()
        self.pg = self.probs.detach().requires_grad_()
        self.W1g = self.W1.detach().requires_grad_()
        self.W2g = self.W2.detach().requires_grad_()

    def flops(self, op):
        T, H, F = self.T, self.H, self.F
        if op == "fc1":
            return 2.0 * T * H * 2 * F
        return 3.0 * (2.0 * T * H * 2 * F + 2.0 * T * F * H)

    def min_bytes(self, op):
        """Bytes that any implementation must move (bf16 operands, fp32 probs): a roofline lower bound."""
        T, H, F, E = self.T, self.H, self.F, self.E
        if op == "fc1":
            return 2.0 * (T * H + E * 2 * F * H + T * 2 * F)
        return 2.0 * (4 * T * H + 2 * (E * 2 * F * H + E * H * F)) + 8.0 * T


@torch.no_grad()
def reference(c: Case, fc1_only: bool = False) -> dict:
    """float64 per-expert computation (inputs are the exact bf16 values), stored as fp32; with
    ``fc1_only`` just fc1's output h."""
    dev, T, H, F, E = c.x.device, c.T, c.H, c.F, c.E
    f32 = dict(dtype=torch.float32, device=dev)
    out = {"h": torch.empty(T, 2 * F, **f32), "y": torch.empty(T, H, **f32), "dx": torch.empty(T, H, **f32),
           "dprobs": torch.empty(T, **f32), "dW1": torch.zeros(E, 2 * F, H, **f32),
           "dW2": torch.zeros(E, H, F, **f32)}
    s0 = 0
    for e, cnt in enumerate(c.splits):
        if cnt == 0:
            continue
        rows = slice(s0, s0 + cnt)
        s0 += cnt
        w1, w2 = c.W1[e].double(), c.W2[e].double()
        xe, pe, dye = c.x[rows].double(), c.probs[rows].double()[:, None], c.dy[rows].double()
        h = xe @ w1.t()
        out["h"][rows] = h
        if fc1_only:
            continue
        g, u = h[:, :F], h[:, F:]
        sig = torch.sigmoid(g)
        s = g * sig
        act = s * u
        a = act * pe
        out["y"][rows] = a @ w2.t()
        da = dye @ w2
        out["dW2"][e] = dye.t() @ a
        out["dprobs"][rows] = (da * act).sum(1)
        dap = da * pe
        dh = torch.cat([dap * u * (sig * (1 + g * (1 - sig))), dap * s], 1)
        del h, g, u, sig, act, a, da, dap
        out["dx"][rows] = dh @ w1
        out["dW1"][e] = dh.t() @ xe
        del dh, xe, w1, w2
    return out


def rel_err(out, ref) -> float | None:
    """||out - ref||_F / ||ref||_F, accumulated in float64 over chunks (no full-size fp64 copy)."""
    if out is None:
        return None
    if out.numel() != ref.numel():
        raise ValueError(f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    o, r = out.detach().reshape(-1), ref.reshape(-1)
    num = den = 0.0
    step = 1 << 26
    for i in range(0, r.numel(), step):
        rr, oo = r[i:i + step].double(), o[i:i + step].double()
        num += (oo - rr).pow(2).sum().item()
        den += rr.pow(2).sum().item()
    if not math.isfinite(num):
        return float("nan")
    return math.sqrt(num / den) if den > 0 else (0.0 if num == 0 else float("inf"))


def mlp_errors(impl, c: Case, ref: dict) -> dict:
    """Relative errors of y, dx, dprobs, dW1, dW2 of an MLP implementation (peers.MLPImpl) vs ``ref``."""
    y = impl.fwd(c.xg, c.m, c.pg)
    grads = torch.autograd.grad(y, [c.xg, c.pg] + list(impl.params), c.dy, allow_unused=True)
    dW1, dW2 = impl.to_w(grads[2:])
    errs = {}
    for k, v in (("y", y), ("dx", grads[0]), ("dprobs", grads[1]), ("dW1", dW1), ("dW2", dW2)):
        try:
            errs[k] = rel_err(v, ref[k])
        except ValueError as exc:  # a layout we do not understand: report, do not fail the variant
            errs[k], errs[k + "_error"] = None, short(exc)
    del y, grads, dW1, dW2
    return errs
