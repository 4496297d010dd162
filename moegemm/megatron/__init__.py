"""Megatron-core integration: moegemm as the experts of a Megatron ``MoELayer``.

``MoegemmExperts`` follows megatron-core's experts protocol (``SequentialMLP`` / ``TEGroupedMLP`` in
``megatron/core/transformer/moe/experts.py``; checked against megatron-core 0.16 and 0.19)::

    experts = MoegemmExperts(num_local_experts, config, pg_collection=...)
    output, None = experts(permuted_local_hidden_states, tokens_per_expert, permuted_probs)

and runs the whole expert MLP (fc1 -> activation x probs -> fc2) as moegemm grouped GEMMs, with
``tokens_per_expert`` used as it comes (a device tensor is never read on the host). Use it through
``get_moe_layer_spec`` / ``get_gpt_layer_spec`` or patch an existing spec with ``patch_layer_spec``.

* ``experts.py``: the module; ``config.py``: what it reads from Megatron's config and process groups;
  ``checkpoint.py``: its state dicts in SequentialMLP's / TEGroupedMLP's layouts (checkpoints move between
  the three implementations both ways); ``specs.py``: layer specs with moegemm experts.

megatron-core is an optional dependency: ``import moegemm`` never imports this package.
"""

try:
    from .config import resolve_activation, resolve_recipe
    from .experts import MoegemmExperts
    from .specs import experts_builder, get_gpt_layer_spec, get_moe_layer_spec, patch_layer_spec
except ImportError as e:  # pragma: no cover - exercised only without megatron-core
    raise ImportError("moegemm.megatron needs megatron-core (pip install megatron-core); "
                      f"importing it failed: {e}") from e

__all__ = ["MoegemmExperts", "experts_builder", "patch_layer_spec", "get_moe_layer_spec", "get_gpt_layer_spec",
           "resolve_activation", "resolve_recipe"]
