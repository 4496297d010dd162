"""The implementations measured, one module per family of variants (bench/peers/interface.py): moegemm's
own (moegemm_variants.py) and the peers' (bench/peers/). load_variants() records in UNAVAILABLE why a
variant cannot run here; build_fc1 (fc1 forward) and build_mlp (expert MLP) build a variant on a case;
make_step is one MLP forward+backward; jit_prewarm says whether a variant compiles kernels at its first call on a
new shape (bench/suite/probes.py runs the points once in child processes first)."""

from __future__ import annotations

import torch

from bench.peers import deepgemm_mlp, expert_loop, te_grouped_linear, torch_grouped_mm, torchao_rowwise
from bench.suite import moegemm_variants
from bench.suite.shared import short
from bench.suite.variants import VARIANTS, VBY

# a variant's family (bench/suite/variants.py) -> the module that builds it
BUILDERS = {"moegemm": moegemm_variants, "torch": torch_grouped_mm, "torchao": torchao_rowwise,
            "loop": expert_loop, "te": te_grouped_linear, "deepgemm": deepgemm_mlp}

# Filled by load_variants(): why a variant cannot run at all (key -> reason).
UNAVAILABLE: dict = {}


def _builder(key):
    return BUILDERS[VBY[key].family]


def load_variants(only=None) -> None:
    """Import what each variant (or only the one named) needs; record why a variant is unavailable."""
    for key in [v.key for v in VARIANTS] if only is None else [only]:
        try:
            _builder(key).load(key)
        except Exception as exc:  # noqa: BLE001 - whatever stops a peer from loading is its reason
            UNAVAILABLE[key] = short(exc)


def jit_prewarm(key) -> bool:
    return bool(getattr(_builder(key), "JIT_PREWARM", False))


def build_fc1(key, c):
    """A callable running fc1's forward (call it under no_grad); per-call preparation (offsets,
    tolist, quantization) is inside the callable, so it is timed."""
    return _builder(key).fc1(key, c)


def build_mlp(key, c):
    return _builder(key).mlp(key, c)


def make_step(impl, c):
    inputs = [c.xg, c.pg] + list(impl.params)

    def step():
        y = impl.fwd(c.xg, c.m, c.pg)
        return torch.autograd.grad(y, inputs, c.dy, allow_unused=True)
    return step
