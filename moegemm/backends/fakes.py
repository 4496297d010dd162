"""The fake (meta) implementations of the ops, so that torch.compile can trace them: the layer ops' of
both backends (``torch.ops.moegemm.*`` and ``torch.ops.moegemm_reference.*``) computed from their
contract (``contract.outputs``), and the CUDA primitives', declared with their schemas in ``primitives.py``.
Registered once the ops exist: by ``cuda.py`` after loading the extension, by ``reference.py`` after
defining its ops."""

from __future__ import annotations

import torch

from . import contract, primitives


def _layer_fake(op: contract.LayerOp):
    def fake(*args, **kwargs):
        return contract.outputs(op, contract.bind(op, args, kwargs))
    fake.__name__ = f"{op.name}_fake"
    return fake


def register_layer_ops(namespace: str) -> None:
    """The fakes of the six layer ops of ``namespace`` (``moegemm`` or ``moegemm_reference``)."""
    for op in contract.OPS:
        torch.library.register_fake(f"{namespace}::{op.name}")(_layer_fake(op))


def _grouped_linear(x, weight, m_splits, bias, recipe, x_scales=None, dx_target=None, fp8_weight=None):
    return x.new_empty((x.shape[0], weight.shape[1]), dtype=torch.bfloat16 if x_scales is not None else x.dtype)


def _grouped_mlp(x, fc1_weight, fc2_weight, m_splits, fc1_bias, fc2_bias, probs, activation, recipe, fp8_weights,
                 x_scales=None, dx_target=None):
    return x.new_empty((x.shape[0], fc2_weight.shape[1]), dtype=torch.bfloat16 if x_scales is not None else x.dtype)


def register_cuda() -> None:
    """Every fake of the extension's ops: the differentiable layer ops (for their forward alone, below
    autograd; above it their C++ node runs and calls the layer ops), the layer ops and the primitives (those with
    tensors: ``primitives.OPS``)."""
    torch.library.register_fake("moegemm::grouped_linear")(_grouped_linear)
    torch.library.register_fake("moegemm::grouped_mlp")(_grouped_mlp)
    register_layer_ops("moegemm")
    for op in primitives.OPS:
        if op.fake is not None:
            torch.library.register_fake(f"moegemm::{op.name}")(op.fake)

