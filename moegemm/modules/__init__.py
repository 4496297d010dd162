"""The layer modules: ``GroupedLinear``, ``GroupedMLP`` (and ``moegemm.megatron.MoegemmExperts``), on the
shared ``ExpertLayer`` (FP8 weight cache, split backward)."""

from .base import ExpertLayer, GroupedWeights
from .linear import GroupedLinear
from .mlp import GroupedMLP

__all__ = ["ExpertLayer", "GroupedLinear", "GroupedMLP", "GroupedWeights"]
