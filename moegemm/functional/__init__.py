"""The differentiable functions: ``grouped_linear``, ``grouped_mlp`` (thin autograd shells over one backend
op per direction) and ``WgradStore``, the split backward's pending weight gradients."""

from .grads import WgradStore
from .linear import grouped_linear
from .mlp import grouped_mlp

__all__ = ["WgradStore", "grouped_linear", "grouped_mlp"]
