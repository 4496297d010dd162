"""One expert layer, its inputs and a training step over it, for the fault and repeatability tests
(``test_faults.py``, ``test_repeatability.py``).

``Rig(kind, recipe, mode, seed)`` builds a ``GroupedMLP`` (SwiGLU, both biases, router probs) or a
``GroupedLinear`` (bias) and its micro-batches (Zipf-skewed device ``m_splits`` with empty experts). Two
rigs of the same arguments are identical: same weights, inputs and output gradients. ``mode`` says where
the weight gradients go: ``grad`` (``.grad``), ``main_grad`` (an fp32 ``main_grad``, accumulated by the
GEMMs), ``split`` / ``split_main_grad`` (split backward: ``delay_wgrad_compute``, then ``backward_dw``).
"""

from __future__ import annotations

import random

import torch

import moegemm

from conftest import zipf_splits

MODES = {"grad": (False, False), "main_grad": (True, False), "split": (False, True), "split_main_grad": (True, True)}


class Rig:
    def __init__(self, kind: str, recipe: str, mode: str, seed: int = 0, device: str = "cuda", E: int = 16,
                 H: int = 512, F: int = 256, T: int = 3000, micro_batches: int = 2):
        main_grad, self.split = MODES[mode]
        random.seed(seed)
        torch.manual_seed(seed)
        self.kind = kind
        if kind == "mlp":
            self.layer = moegemm.GroupedMLP(E, H, F, activation="swiglu", bias=True, recipe=recipe, device=device,
                                            delay_wgrad_compute=self.split)
            out = H
        else:
            self.layer = moegemm.GroupedLinear(E, H, F, bias=True, recipe=recipe, device=device,
                                               delay_wgrad_compute=self.split)
            out = F
        if main_grad:
            for w in self.layer.expert_weights():
                w.main_grad = torch.zeros(w.shape, device=device, dtype=torch.float32)
        self.batches = []
        for _ in range(micro_batches):
            m = torch.tensor(zipf_splits(E, T), device=device)
            x = torch.randn(T, H, device=device, dtype=torch.bfloat16).requires_grad_()
            probs = torch.rand(T, device=device).requires_grad_() if kind == "mlp" else None
            dy = torch.randn(T, out, device=device, dtype=torch.bfloat16)
            self.batches.append((x, m, probs, dy))

    # ------------------------------------------------------------------------------ parts of a step
    def forward(self, i: int = 0) -> torch.Tensor:
        x, m, probs, _ = self.batches[i]
        return self.layer(x, m, probs) if self.kind == "mlp" else self.layer(x, m)

    def backward(self, y: torch.Tensor, i: int = 0) -> None:
        y.backward(self.batches[i][3])

    def backward_dw(self) -> None:
        if self.split:
            self.layer.backward_dw()

    @staticmethod
    def weight_grad(p: torch.Tensor):
        return p.main_grad if hasattr(p, "main_grad") else p.grad

    def grads(self) -> list:
        """Every gradient the step made: inputs, probs, then the parameters (main_grad where there is one)."""
        inputs = [t.grad for x, _, probs, _ in self.batches for t in (x, probs) if t is not None]
        return [g for g in inputs + [self.weight_grad(p) for p in self.layer.parameters()] if g is not None]

    def zero(self) -> None:
        """Discard the gradients (as after a failed step) and any pending split-backward work."""
        for x, _, probs, _ in self.batches:
            x.grad = None
            if probs is not None:
                probs.grad = None
        for p in self.layer.parameters():
            p.grad = None
            if hasattr(p, "main_grad"):
                p.main_grad.zero_()
        self.layer._wgrad_store.clear()

    # ------------------------------------------------------------------------------ whole steps
    def micro_step(self, i: int = 0) -> list:
        """One micro-batch from zero gradients: forward, backward, backward_dw; copies of y and the grads."""
        self.zero()
        y = self.forward(i)
        self.backward(y, i)
        self.backward_dw()
        return [t.detach().clone() for t in [y] + self.grads()]

    def train_step(self, lr: float = 0.05) -> list:
        """Every micro-batch (gradients accumulate; a split backward's work runs once, after the last),
        an SGD update of the parameters in place (the FP8 weight cache re-quantizes), and a forward of the
        first micro-batch with the new weights; copies of every output and gradient."""
        self.zero()
        outs = []
        for i in range(len(self.batches)):
            y = self.forward(i)
            self.backward(y, i)
            outs.append(y.detach().clone())
        self.backward_dw()
        grads = [g.clone() for g in self.grads()]
        with torch.no_grad():
            for p in self.layer.parameters():
                g = self.weight_grad(p)
                p.sub_(lr * g.to(p.dtype))
            after = self.forward(0).clone()
        return outs + grads + [after]


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bitwise(got: list, expected: list, what: str = "") -> None:
    """The same tensors byte for byte (shapes, dtypes and every bit: -0.0 differs from 0.0)."""
    assert len(got) == len(expected), what
    for i, (a, b) in enumerate(zip(got, expected)):
        assert a.shape == b.shape and a.dtype == b.dtype, (what, i, a.shape, b.shape, a.dtype, b.dtype)
        assert torch.equal(bytes_of(a), bytes_of(b)), f"{what}: tensor {i} of {len(got)} differs"
