"""Megatron layer specs with moegemm experts: ``experts_builder`` (what to put in ``MoESubmodules.experts``),
``patch_layer_spec`` (any GPT layer / block / MoE spec), ``get_moe_layer_spec`` and ``get_gpt_layer_spec``."""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Optional

from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from .._validate import check_bool_arg, check_recipe
from .experts import MoegemmExperts

EXPERTS_KWARGS = ("recipe", "fp8_weight_cache")  # MoegemmExperts' own keyword arguments

class _CallableSpec(ModuleSpec):
    """A ModuleSpec that is also a builder: megatron-core <= 0.16 builds experts with
    ``build_module(spec, ...)``, newer versions call ``submodules.experts(...)``."""

    def __call__(self, *args, **kwargs):
        return build_module(self, *args, **kwargs)


def experts_builder(**experts_kwargs):
    """What to put in ``MoESubmodules.experts`` (any megatron-core version): ``MoegemmExperts`` itself,
    or a spec carrying ``experts_kwargs`` (e.g. ``recipe='fp8_blockwise'``), checked here."""
    unknown = sorted(set(experts_kwargs) - set(EXPERTS_KWARGS))
    if unknown:
        raise TypeError(f"unexpected keyword arguments for MoegemmExperts: {unknown}; it takes {list(EXPERTS_KWARGS)}")
    if experts_kwargs.get("recipe") is not None:
        check_recipe(experts_kwargs["recipe"])
    if experts_kwargs.get("fp8_weight_cache") is not None:
        check_bool_arg("fp8_weight_cache", experts_kwargs["fp8_weight_cache"])
    if not experts_kwargs:
        return MoegemmExperts
    return _CallableSpec(module=MoegemmExperts, params=dict(experts_kwargs))


def _replace_fields(obj, changes):
    new = copy.copy(obj)
    for k, v in changes.items():
        object.__setattr__(new, k, v)
    return new


def _patch(obj, builder, count, depth=0):
    if depth > 32:
        return obj
    if isinstance(obj, MoESubmodules):
        count[0] += 1
        return _replace_fields(obj, {"experts": builder})
    if isinstance(obj, functools.partial):
        kw = {k: _patch(v, builder, count, depth + 1) for k, v in obj.keywords.items()}
        args = tuple(_patch(a, builder, count, depth + 1) for a in obj.args)
        return functools.partial(obj.func, *args, **kw)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_patch(v, builder, count, depth + 1) for v in obj)
    if isinstance(obj, dict):
        return {k: _patch(v, builder, count, depth + 1) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {}
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name, None)
            nv = _patch(v, builder, count, depth + 1)
            if nv is not v:
                changes[f.name] = nv
        return _replace_fields(obj, changes) if changes else obj
    return obj


def patch_layer_spec(spec, **experts_kwargs):
    """A copy of ``spec`` (a GPT layer / block / MoE spec or submodules, ModuleSpec- or builder-style)
    whose every ``MoESubmodules.experts`` is ``MoegemmExperts``; raises if it has no MoE layer."""
    count = [0]
    out = _patch(spec, experts_builder(**experts_kwargs), count)
    if not count[0]:
        raise ValueError("patch_layer_spec: the spec contains no MoE layer (MoESubmodules); "
                         "build it with num_experts set")
    return out


def get_moe_layer_spec(num_experts: int, use_te: bool = False, **experts_kwargs):
    """Megatron's MoE layer spec (``get_moe_module_spec``) with moegemm experts."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    spec = get_moe_module_spec(use_te=use_te, num_experts=num_experts, moe_grouped_gemm=False)
    return patch_layer_spec(spec, **experts_kwargs)


def get_gpt_layer_spec(num_experts: int, use_te: bool = False, layer_kwargs: Optional[dict] = None,
                       **experts_kwargs):
    """A GPT transformer-layer spec (``get_gpt_layer_local_spec``, or the TransformerEngine one with
    ``use_te=True``) whose MoE experts are moegemm's. ``layer_kwargs`` go to Megatron's spec function."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    fn = specs.get_gpt_layer_with_transformer_engine_spec if use_te else specs.get_gpt_layer_local_spec
    spec = fn(num_experts=num_experts, moe_grouped_gemm=False, **(layer_kwargs or {}))
    return patch_layer_spec(spec, **experts_kwargs)
