"""moegemm: FP8 grouped GEMMs for Mixture-of-Experts layers on NVIDIA Hopper.

Public API: ``grouped_linear``, ``GroupedLinear``, ``grouped_mlp``, ``GroupedMLP``, the quantizers ``quantize_act`` / ``quantize_weight``
/ ``make_plan``, ``weights_changed`` (the one explicit call of the FP8 weight cache, ``weight_cache.py``), the SM
budget ``set_num_sms`` / ``get_num_sms`` / ``num_sms`` (``sm_budget.py``), and the oracle ``moegemm.reference``.

The package by job: ``functional/`` (the differentiable functions: thin autograd shells over one op per
layer and direction), ``modules/`` (the layer modules on their shared base), ``backends/`` (the backend
protocol, the layer ops' contract, the CUDA and reference backends and their fakes), ``megatron/`` (the
optional Megatron-core integration), ``quantize.py``, ``weight_cache.py``, ``_validate.py`` (argument
checks), ``layout.py`` (layout constants), ``reference.py`` (the oracle), ``build.py`` / ``_build.py`` (the
extension's build) and ``__main__.py`` (``python -m moegemm``, the quick start).
"""

from . import reference
from .functional import WgradStore, grouped_linear, grouped_mlp
from .modules import GroupedLinear, GroupedMLP
from .quantize import Fp8Rows, make_plan, quantize_act, quantize_weight, to_fp8_rows
from .sm_budget import get_num_sms, num_sms, set_num_sms
from .weight_cache import weights_changed

__all__ = ["grouped_linear", "GroupedLinear", "grouped_mlp", "GroupedMLP", "make_plan", "quantize_act", "quantize_weight", "reference",
           "Fp8Rows", "to_fp8_rows", "WgradStore", "weights_changed", "set_num_sms", "get_num_sms", "num_sms"]
__version__ = "0.1.0"
