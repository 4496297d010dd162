"""TransformerEngine as a peer: two ``GroupedLinear`` layers (per-expert weights, host split sizes),
bf16 or under TE's FP8 autocast (blockwise scaling where TE has it, else delayed scaling)."""

from __future__ import annotations

import contextlib

import torch

from bench.peers.interface import MLPImpl, swiglu_probs

_TE: list = []  # transformer_engine.pytorch, once imported


def load(key):
    import transformer_engine.pytorch as te

    _TE[:] = [te]


def _module(E, fin, fout, W, dev):
    mod = _TE[0].GroupedLinear(E, fin, fout, bias=False, params_dtype=torch.bfloat16, device=dev)
    with torch.no_grad():
        for e in range(E):
            getattr(mod, f"weight{e}").copy_(W[e])
    return mod


def _autocast(fp8: bool):
    if not fp8:
        return contextlib.nullcontext()
    te = _TE[0]
    from transformer_engine.common import recipe as te_recipe

    rec = te_recipe.Float8BlockScaling() if hasattr(te_recipe, "Float8BlockScaling") else te_recipe.DelayedScaling()
    autocast = getattr(te, "fp8_autocast", None)
    if autocast is not None:
        return autocast(enabled=True, fp8_recipe=rec)
    return te.autocast(enabled=True, recipe=rec)


def fc1(key, c):
    x, m, fp8 = c.x, c.m, key == "te_fp8"
    mod = _module(c.E, c.H, 2 * c.F, c.W1, x.device)

    def fwd():
        with _autocast(fp8):
            return mod(x, m.tolist())
    return fwd


def mlp(key, c):
    E, F, dev, fp8 = c.E, c.F, c.x.device, key == "te_fp8"
    fc1_, fc2_ = _module(E, c.H, 2 * F, c.W1, dev), _module(E, F, c.H, c.W2, dev)

    def fwd(x, m, p):
        splits = m.tolist()
        with _autocast(fp8):
            return fc2_(swiglu_probs(fc1_(x, splits), p, F), splits)
    params = [getattr(fc1_, f"weight{e}") for e in range(E)] + [getattr(fc2_, f"weight{e}") for e in range(E)]
    return MLPImpl(fwd, params, lambda g: (torch.stack(g[:E]), torch.stack(g[E:])))
