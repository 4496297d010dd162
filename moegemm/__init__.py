"""moegemm: FP8 grouped GEMMs for Mixture-of-Experts layers on NVIDIA Hopper.

Public API: ``grouped_linear``, ``GroupedLinear``, ``grouped_mlp``, ``GroupedMLP``, the quantizers ``quantize_act`` / ``quantize_weight``
/ ``make_plan``, and the oracle ``moegemm.reference``.
"""

from . import reference
from .functional import WgradStore, grouped_linear
from .mlp import GroupedMLP, grouped_mlp
from .modules import GroupedLinear
from .quantize import Fp8Rows, make_plan, quantize_act, quantize_weight, to_fp8_rows

__all__ = ["grouped_linear", "GroupedLinear", "grouped_mlp", "GroupedMLP", "make_plan", "quantize_act", "quantize_weight", "reference",
           "Fp8Rows", "to_fp8_rows", "WgradStore"]
__version__ = "0.1.0"
