"""moegemm: FP8 grouped GEMMs for Mixture-of-Experts layers on NVIDIA Hopper.

Public API: ``grouped_linear``, ``GroupedLinear``, ``grouped_mlp``, ``GroupedMLP``, the quantizers ``quantize_act`` / ``quantize_weight``
/ ``make_plan``, ``weights_changed`` (the one explicit call of the FP8 weight cache, ``weight_cache.py``), and the
oracle ``moegemm.reference``.
"""

from . import reference
from .functional import grouped_linear
from .mlp import GroupedMLP, grouped_mlp
from .modules import GroupedLinear
from .quantize import make_plan, quantize_act, quantize_weight
from .weight_cache import weights_changed

__all__ = ["grouped_linear", "GroupedLinear", "grouped_mlp", "GroupedMLP", "make_plan", "quantize_act", "quantize_weight", "reference",
           "weights_changed"]
__version__ = "0.1.0"
