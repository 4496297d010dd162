"""What ``MoegemmExperts`` reads from Megatron: the recipe and the activation of a ``TransformerConfig``, and
the sizes and ranks of the process groups."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state

from .._env import env_choice
from .._validate import RECIPES, check_recipe

RECIPE_ENV = "MOEGEMM_MEGATRON_RECIPE"


def resolve_recipe(config, recipe: Optional[str] = None) -> str:
    """The moegemm recipe: the ``recipe`` argument, else ``$MOEGEMM_MEGATRON_RECIPE``, else
    ``'fp8_blockwise'`` when ``config.fp8`` is set and ``'bf16'`` otherwise."""
    if recipe is None:
        recipe = env_choice(RECIPE_ENV, RECIPES)
    if recipe is None:
        recipe = "fp8_blockwise" if getattr(config, "fp8", None) else "bf16"
    return check_recipe(recipe)


def reserved_sms(config) -> int:
    """The SMs Megatron's token dispatcher reserves for its communication kernels: ``moe_deepep_num_sms`` or
    ``moe_hybridep_num_sms`` with the flex dispatcher (DeepEP / HybridEP), which hold them while the experts
    compute; 0 with the other dispatchers (NCCL's all-to-all takes a few SMs, which moegemm's dynamic tile walk
    leaves to it without a budget)."""
    if getattr(config, "moe_token_dispatcher_type", None) != "flex":
        return 0
    backend = getattr(config, "moe_flex_dispatcher_backend", "deepep")
    if getattr(config, "moe_enable_deepep", False):
        backend = "deepep"
    field = {"deepep": "moe_deepep_num_sms", "hybridep": "moe_hybridep_num_sms"}.get(backend)
    if field is None:
        return 0
    n = getattr(config, field, 0)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"config.{field} must be a non-negative int, got {n!r}")
    return n


def resolve_sm_budget(config, device_sms: int) -> Optional[int]:
    """The SM budget for the experts' kernels: the ``device_sms`` less what the dispatcher reserves
    (``reserved_sms``), None (every SM) when it reserves none."""
    reserved = reserved_sms(config)
    if reserved == 0:
        return None
    if reserved >= device_sms:
        raise ValueError(f"the token dispatcher reserves {reserved} SMs (config.moe_deepep_num_sms / "
                         f"moe_hybridep_num_sms), leaving none of the GPU's {device_sms} to the experts")
    return device_sms - reserved


def _squared_relu(x):
    return F.relu(x) ** 2


def _known_activations(glu: bool):
    """(name, reference function, functions recognised by identity)."""
    if glu:
        return [("swiglu", F.silu, (F.silu, torch.nn.functional.silu)),
                ("geglu", lambda x: F.gelu(x, approximate="none"), (F.gelu,))]
    sq = []
    try:
        from megatron.core.activations import squared_relu as mc_squared_relu

        sq.append(mc_squared_relu)
    except ImportError:  # pragma: no cover
        pass
    try:
        from megatron.core.transformer.mlp import squared_relu as mc_squared_relu2  # older versions

        sq.append(mc_squared_relu2)
    except ImportError:
        pass
    return [("gelu", lambda x: F.gelu(x, approximate="none"), (F.gelu,)),
            ("relu", F.relu, (F.relu, torch.relu)),
            ("squared_relu", _squared_relu, tuple(sq))]


def resolve_activation(config) -> str:
    """moegemm's activation name for ``config.activation_func`` / ``config.gated_linear_unit``.

    Known functions are recognised by identity (F.silu/F.gelu with GLU -> swiglu/geglu; F.gelu, F.relu,
    megatron's squared_relu without); any other callable (a lambda, a jit-scripted copy) is probed on
    a grid of values and matched against those. Anything else raises ``ValueError``."""
    glu = bool(config.gated_linear_unit)
    fn = config.activation_func
    if glu:
        offset = getattr(config, "glu_linear_offset", 0.0) or 0.0
        clamp = getattr(config, "activation_func_clamp_value", None)
        if offset != 0.0 or clamp is not None:
            raise ValueError("moegemm experts do not support glu_linear_offset != 0 or activation_func_clamp_value "
                             f"(got glu_linear_offset={offset}, activation_func_clamp_value={clamp})")
    known = _known_activations(glu)
    for name, _, fns in known:
        if any(fn is f for f in fns):
            return name
    probe = torch.cat([torch.linspace(-8.0, 8.0, 321, dtype=torch.float64),
                       torch.tensor([-1e-3, 1e-3, 0.5, -0.5], dtype=torch.float64)])
    for dtype, tol in ((torch.float64, 1e-9), (torch.float32, 1e-5)):
        try:
            with torch.no_grad():
                got = fn(probe.to(dtype)).double()
        except Exception:  # noqa: BLE001 - any callable; try the next dtype
            continue
        if not isinstance(got, torch.Tensor) or got.shape != probe.shape:
            break
        for name, ref, _ in known:
            want = ref(probe).double()
            if torch.allclose(got, want, rtol=tol, atol=tol):
                return name
        break
    names = [n for n, _, _ in known]
    raise ValueError(f"moegemm experts support activation_func F.silu / F.gelu with gated_linear_unit=True "
                     f"(swiglu / geglu) and F.gelu / F.relu / squared_relu without; got "
                     f"{getattr(fn, '__name__', fn)!r} with gated_linear_unit={glu} (supported here: {names})")


# ----------------------------------------------------------------------------------------- process groups
def group_size(group) -> int:
    if group is None:
        return 1
    return group.size() if hasattr(group, "size") else torch.distributed.get_world_size(group)


def group_rank(group) -> int:
    if group is None:
        return 0
    return group.rank() if hasattr(group, "rank") else torch.distributed.get_rank(group)


def default_groups():
    return dict(ep=parallel_state.get_expert_model_parallel_group(),
                expt_tp=parallel_state.get_expert_tensor_parallel_group(),
                expt_dp=parallel_state.get_expert_data_parallel_group())
