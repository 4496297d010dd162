"""The training-step section: one optimizer step of the expert MLP as Megatron runs it, per
variant: GA micro-batches of forward + backward, the weight gradients accumulated in fp32 ``main_grad``
buffers, then an in-place weight update. runner.py times ``TrainStep.run`` (measure.time_op) for each GA.

- Each variant gets its own copy of the case's weights, each with an fp32 ``main_grad``, zeroed at the
  start of the step (Megatron's ``zero_grad_buffer``).
- A micro-batch is the MLP's forward and backward on the case's inputs (the input and probs gradients
  are computed, as for the layers below). A weight gradient the variant returns (torch ``_grouped_mm``:
  bf16 from autograd) is added to ``main_grad`` in fp32; where the variant's wgrad GEMM accumulated into
  ``main_grad`` itself (moegemm, the DeepGEMM peer: Megatron's gradient-accumulation fusion) autograd
  gets None back.
- The step ends as an optimizer's would: ``w -= LR * main_grad`` in place under no_grad. Every weight's
  version counter moves, so every FP8 weight cache (moegemm's automatic one, the DeepGEMM peer's) makes
  its copies again at the next step's first micro-batch: one refresh per step. LR is so small that the
  weights hardly move (all but the tiniest bf16 values stay exactly as they were), so every step does
  the same work and main_grad after GA micro-batches is GA times one micro-batch's (checked)."""

from __future__ import annotations

import copy

import torch

from bench.suite.implementations import build_mlp

LR = 1e-9


class TrainStep:
    def __init__(self, key, c):
        own = copy.copy(c)  # the case with weight leaves of this variant's own (main_grad, the update)
        own.W1g = c.W1.detach().clone().requires_grad_()
        own.W2g = c.W2.detach().clone().requires_grad_()
        self.c = c
        self.impl = build_mlp(key, own)
        self.weights = list(self.impl.params)
        for w in self.weights:
            w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=w.device)

    def run(self, ga: int) -> None:
        """One optimizer step of ``ga`` micro-batches."""
        c = self.c
        for w in self.weights:
            w.main_grad.zero_()
        for _ in range(ga):
            y = self.impl.fwd(c.xg, c.m, c.pg)
            grads = torch.autograd.grad(y, [c.xg, c.pg] + self.weights, c.dy, allow_unused=True)
            del y
            for w, g in zip(self.weights, grads[2:]):
                if g is not None:
                    w.main_grad.add_(g)
            del grads
        with torch.no_grad():
            for w in self.weights:
                w.sub_(w.main_grad, alpha=LR)

    def main_grad_norm(self) -> float:
        """The Frobenius norm of all main_grad buffers together (after run(GA): GA micro-batches' worth)."""
        return sum(float(torch.linalg.vector_norm(w.main_grad)) ** 2 for w in self.weights) ** 0.5
