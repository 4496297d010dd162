"""The checkpoints of ``MoegemmExperts`` in Megatron's layouts: the plain ``state_dict()`` with
``SequentialMLP``'s keys (``local_experts.{i}.linear_fc1.weight`` ...), ``load_state_dict`` of those,
``TEGroupedMLP``'s (``linear_fc1.weight{i}``) or the native stacked keys, and ``sharded_state_dict`` with
the global keys and shardings of ``SequentialMLP`` / ``TEGroupedMLP``: checkpoints move between the three
implementations both ways."""

from __future__ import annotations

import functools
import re
from typing import Optional

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.transformer.utils import make_sharded_object_for_checkpoint

from .config import group_rank, group_size

_SEQ_KEY = re.compile(r"local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$")
_TE_KEY = re.compile(r"(linear_fc[12])\.(weight|bias)(\d+)$")


def sharded_state_dict(experts, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
    """``experts.sharded_state_dict``: the distributed-checkpoint state with SequentialMLP's / TEGroupedMLP's
    global keys and shardings (``{prefix}experts.linear_fc1.weight`` with the global expert axis; GLU fc1
    split in its gate and up halves; ``singleton_local_shards`` metadata: one key per expert). Each stacked
    parameter is one ``ShardedTensorFactory``, so optimizer states follow the same layout."""
    metadata = dict(metadata or {})
    singleton = bool(metadata.get("singleton_local_shards", False))
    E = experts.num_local_experts
    ep_size, ep_rank = group_size(experts.ep_group), group_rank(experts.ep_group)
    G, first = ep_size * E, ep_rank * E
    dp_rank = group_rank(experts.dp_group)
    replica_id = (0, 0, dp_rank)
    sd = {}
    for lin_name in ("linear_fc1", "linear_fc2"):
        lin = getattr(experts, lin_name)
        for pname in ("weight", "bias"):
            p = getattr(lin, pname)
            if p is None:
                continue
            glu = lin_name == "linear_fc1" and experts.glu
            build = functools.partial(_build_expert_shards, prefix=prefix, sharded_offsets=tuple(sharded_offsets),
                                      glu=glu, singleton=singleton, E=E, G=G, first=first,
                                      ep_rank=ep_rank, ep_size=ep_size)
            merge = functools.partial(_merge_expert_shards, glu=glu, singleton=singleton)
            sd[f"{prefix}{lin_name}.{pname}"] = ShardedTensorFactory(
                f"{prefix}experts.{lin_name}.{pname}", p, build, merge, replica_id)
    for e in range(E):  # SequentialMLP's (empty) per-expert extra states, for loading both ways
        g = first + e
        offsets = tuple(sharded_offsets) if singleton else (*sharded_offsets, (len(sharded_offsets), g, G))
        for lin_name in ("linear_fc1", "linear_fc2"):
            key = (f"{prefix}experts.{g}.{lin_name}._extra_state" if singleton
                   else f"{prefix}experts.{lin_name}._extra_state")
            sd[f"{prefix}local_experts.{e}.{lin_name}._extra_state"] = make_sharded_object_for_checkpoint(
                None, key, offsets, replica_id)
    return sd


def state_dict_to_sequential(module, state_dict, prefix, local_metadata=None):
    """Plain state dict in SequentialMLP's layout: per-expert views, ``_extra_state`` None."""
    for lin in ("linear_fc1", "linear_fc2"):
        for pname in ("weight", "bias"):
            k = f"{prefix}{lin}.{pname}"
            if k in state_dict:
                v = state_dict.pop(k)
                for e in range(v.shape[0]):
                    state_dict[f"{prefix}local_experts.{e}.{lin}.{pname}"] = v[e]
    for e in range(module.num_local_experts):
        for lin in ("linear_fc1", "linear_fc2"):
            state_dict[f"{prefix}local_experts.{e}.{lin}._extra_state"] = None


def load_from_any(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    """Translate SequentialMLP (``local_experts.{i}.linear_fc1.weight``) or TEGroupedMLP
    (``linear_fc1.weight{i}``) keys into the stacked parameters; drop ``_extra_state`` entries."""
    E = module.num_local_experts
    found = {}
    for k in list(state_dict.keys()):
        if not k.startswith(prefix):
            continue
        rest = k[len(prefix):]
        if rest.endswith("_extra_state") and (rest.startswith("local_experts.") or rest.startswith("linear_fc")
                                               or rest.startswith("expert")):
            del state_dict[k]
            continue
        m = _SEQ_KEY.fullmatch(rest)
        if m:
            found.setdefault((m.group(2), m.group(3)), {})[int(m.group(1))] = k
            continue
        m = _TE_KEY.fullmatch(rest)
        if m:
            found.setdefault((m.group(1), m.group(2)), {})[int(m.group(3))] = k
    for (lin, pname), keys in found.items():
        target = f"{prefix}{lin}.{pname}"
        if target in state_dict or sorted(keys) != list(range(E)):
            continue  # incomplete or conflicting: leave them, load_state_dict reports them
        state_dict[target] = torch.stack([state_dict.pop(keys[e]) for e in range(E)])


def _build_expert_shards(key, t, replica_id, flattened_range, *, prefix, sharded_offsets, glu, singleton, E, G, first,
                         ep_rank, ep_size):
    """ShardedTensors of a stacked ``[E, ...]`` expert tensor ``t`` (the parameter or an optimizer
    state), laid out like SequentialMLP's per-expert tensors (see ``MoegemmExperts.sharded_state_dict``)."""
    if flattened_range is not None:
        raise NotImplementedError("MoegemmExperts.sharded_state_dict does not support flattened ranges "
                                  "(deprecated distributed-optimizer formats); use 'fully_reshardable' or "
                                  "'dp_reshardable'")
    pan = len(sharded_offsets)
    if not singleton:
        if not glu:
            return ShardedTensor.from_rank_offsets(key, t, *sharded_offsets, (pan, ep_rank, ep_size),
                                                   replica_id=replica_id, prepend_axis_num=pan)
        w, v = torch.chunk(t, 2, dim=1)
        return [ShardedTensor.from_rank_offsets(key, half.contiguous(), *sharded_offsets, (pan, ep_rank, ep_size),
                                                (pan + 1, i, 2), replica_id=replica_id, prepend_axis_num=pan)
                for i, half in enumerate((w, v))]
    out = []
    for e in range(E):
        k = key.replace(f"{prefix}experts.", f"{prefix}experts.{first + e}.", 1)
        if not glu:
            out.append(ShardedTensor.from_rank_offsets(k, t[e], *sharded_offsets, replica_id=replica_id,
                                                       prepend_axis_num=pan))
        else:
            w, v = torch.chunk(t[e], 2, dim=0)
            out.append([ShardedTensor.from_rank_offsets(f"{k}_{s}", half.contiguous(), *sharded_offsets, (pan, 0, 1),
                                                        replica_id=replica_id, prepend_axis_num=pan)
                        for s, half in (("w", w), ("v", v))])
    return out


def _merge_expert_shards(sub, *, glu, singleton):
    with torch.no_grad():
        if not singleton:
            return torch.cat(sub, dim=1) if glu else sub
        if glu:
            return torch.stack([torch.cat(pair, dim=0) for pair in sub])
        return torch.stack(sub)
