"""moegemm as the routed experts of torchtitan's MoE layers (torchtitan 0.3.0; ``docs/torchtitan.md``).

* ``MoegemmGroupedExperts``: a drop-in for ``torchtitan.models.common.moe.GroupedExperts`` (a subclass of it):
  the same parameters ``w1_EFD``, ``w3_EFD`` ``[E, hidden, dim]`` and ``w2_EDF`` ``[E, dim, hidden]``, built,
  initialized (``param_init``), sharded (``sharding_config``) and checkpointed as torchtitan's, called as
  ``inner_experts(x_RD, num_tokens_per_expert_E)`` with the counts on the device (never read on the host) and
  the tokens unpadded. One moegemm expert-MLP op runs both GEMMs per direction with SwiGLU fused
  (``recipe="fp8_blockwise"``, or ``"bf16"``).
* Installing it, either way torchtitan swaps a module:
  - ``MoegemmExpertsConverter``: a model converter, as torchtitan's float8/MXFP8 expert converters, listed in a
    model registry's ``converters=[MoegemmExpertsConverter.Config()]``;
  - the ``@override`` ``moegemm_experts``: ``--override.imports moegemm.torchtitan.moegemm_experts`` (with
    options: ``'moegemm.torchtitan.moegemm_experts={"recipe": "bf16"}'``), no code.
  Both replace every stock ``GroupedExperts.Config`` of the model and leave the token dispatcher as it is.
* ``MoegemmRoutedExperts`` (the converter's default, ``fuse_scores=True``; the override
  ``moegemm.torchtitan.moegemm_routed_experts``): torchtitan's ``RoutedExperts`` (dispatch, experts, combine)
  with moegemm's experts, where the router's scores scale each token's activation inside the experts' op (its
  SwiGLU kernel, and the scores' gradient from its backward) instead of a separate multiplication of the experts'
  output in ``combine``: with the local token dispatcher (no expert parallelism); with any other dispatcher, or
  an expert-parallel mesh, it runs torchtitan's own forward. It has no state: checkpoints are unchanged.

fc1 without copies. moegemm's expert MLP takes fc1 as one ``[E, 2·hidden, dim]`` weight, gate rows (``w1``) first,
up rows (``w3``) second. torchtitan keeps ``w1`` and ``w3`` apart, so:

* forward (``fp8_blockwise``): the module keeps the fused fc1 FP8 copies and fc2's in buffers of its own
  (``moegemm/weight_buffers.py``), re-quantized in place from ``(w1, w3)`` and ``w2`` (one launch, ``w1`` and
  ``w3`` straight into the fused copies' rows) only when the weights changed (an optimizer step, a checkpoint
  load, an in-place write), eager and under ``torch.compile`` alike; the op gets a stand-in fc1 tensor of the
  right shape (no memory) and the copies. With ``fp8_weight_cache=False`` the weights are concatenated and
  quantized inside every call instead (the concatenation freed when the call returns: the backward reads only
  the FP8 copies). ``bf16``: ``torch.cat([w1, w3], 1)`` every call, freed when the call returns as well;
* backward: the op's weight gradients are split off (``defer_wgrad``) and each of ``w1``, ``w3``, ``w2`` gets
  its own wgrad GEMM written straight into its gradient: ``w1``'s from the gate half of fc1's gradient operand,
  ``w3``'s from the up half (the FP8 column copy's rows ``[:hidden]`` and ``[hidden:]``, contiguous slices; bf16:
  the two halves of ``dh`` are copied out, ``T·hidden`` values each, not the weights). bf16's ``dx`` is two dgrad
  GEMMs, the gate half with ``w1`` and the up half with ``w3``, added (as torchtitan's autograd sums them), so that
  no concatenation of the weights lives until the backward.

DTensor parameters (FSDP2, expert parallelism): the op runs on ``to_local()`` as torchtitan's experts do; the
cache is keyed on the local tensors, its buffers have their shapes. Activation checkpointing: the op saves what
backward needs through ``save_for_backward`` (so checkpointing drops and recomputes it; the recompute finds the
cached copies).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch
from torch.distributed.tensor import DTensor
from torchtitan.components.quantization import QuantizationConverter
from torchtitan.config.override import derive, override
from torchtitan.distributed.spmd_types import maybe_set_sparse_mesh
from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher, LocalTokenDispatcher
from torchtitan.ops.scatter_add import deterministic_scatter_add

from . import backends, weight_buffers
from ._validate import (check_bool_arg, check_fp8_weight_pair, check_fp8_weights_recipe, check_layer_sizes, check_mlp_dims,
                        check_probs, check_recipe, check_weight, check_x, check_x_tensor, splits_to_device)
from .backends import contract as C
from .functional.grads import refuse_double_backward
from .layout import ACTIVATIONS, BF16, FP8_BLOCKWISE, RECIPE_IDS

__all__ = ["MoegemmGroupedExperts", "MoegemmRoutedExperts", "MoegemmExpertsConverter", "moegemm_experts",
           "moegemm_routed_experts", "swiglu_experts"]

_SWIGLU = ACTIVATIONS["swiglu"]
_MADE = {r: C.MLP_BWD.made[r] for r in (BF16, FP8_BLOCKWISE)}
_SAVED = {r: C.MLP_FWD.saved[r] for r in (BF16, FP8_BLOCKWISE)}


# ------------------------------------------------------------------------------------------- the op
class _SwigluExperts(torch.autograd.Function):
    """``w2 · (silu(w1 · x) * (w3 · x) * probs)`` per expert, on moegemm's expert-MLP op with the fused fc1
    ``fc1`` (``cat([w1, w3], 1)``, or a stand-in when ``fp8`` holds the FP8 copies of both weights); the
    gradients of ``w1``, ``w3`` and ``w2`` come from one wgrad GEMM each, bf16's ``dx`` from one dgrad GEMM per
    weight."""

    @staticmethod
    def forward(ctx, x, w1, w3, w2, probs, m_splits, fc1, fp8: list, recipe: int):
        need_dw13 = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        need_dw2 = ctx.needs_input_grad[3]
        y, plan, saved = backends.select(x.device).mlp_fwd(x, fc1, w2, m_splits, None, None, probs, _SWIGLU, recipe,
                                                           fp8, True, need_dw13, need_dw2, None)
        # through save_for_backward, so that activation checkpointing drops these and recomputes them. The backward
        # never reads fc1 (FP8: its transposed FP8 copies, in `saved` or `fp8`; bf16: w1 and w3): a stand-in is kept
        # instead of the concatenation, which would otherwise live until the backward (as large as w1 and w3 together).
        ctx.save_for_backward(plan, x if recipe == BF16 else None, _stand_in(w1), w1, w3, w2, probs, *fp8, *saved)
        ctx.recipe, ctx.num_fp8 = recipe, len(fp8)
        return y

    @staticmethod
    def backward(ctx, dy):
        refuse_double_backward("moegemm.torchtitan's experts")
        need_dx, need_dw1, need_dw3, need_dw2, need_dp = ctx.needs_input_grad[:5]
        plan, x, fc1, w1, w3, w2, probs, *rest = ctx.saved_tensors
        fp8, saved = rest[:ctx.num_fp8], rest[ctx.num_fp8:]
        recipe, need_dw13 = ctx.recipe, need_dw1 or need_dw3
        ops = backends.select(dy.device)
        need_dp = need_dp and probs is not None
        # the weight gradients deferred: the op hands back their operands (the made outputs), each weight's GEMM below;
        # bf16's dx as well, from the op's dh (handed back with need_dw1)
        op_dx = need_dx and recipe != BF16
        need_dh = need_dw13 or (need_dx and recipe == BF16)
        dx, _, _, _, _, dp, *made = ops.mlp_bwd(dy, plan, saved, x, fc1, w2, probs, fp8, None, None, _SWIGLU, recipe,
                                                op_dx, need_dh, need_dw2, False, False, need_dp, False,
                                                need_dh or need_dw2, None)
        made, saved = C.by_name(_MADE[recipe], made), C.by_name(_SAVED[recipe], saved)
        F = w1.shape[1]
        if recipe == FP8_BLOCKWISE:  # fc1's operands: the gate / up rows of dh's column copy (contiguous slices)
            fc2 = [made["qdyT"], made["sdyT"], saved["qaT"], saved["saT"]]  # and small copies of their scales' columns
            rows = [made["qdhT"], made["sdhT"]]  # placeholders unless need_dw13
            gate = [rows[0][:F], rows[1][:, :F].contiguous()] if need_dw1 else rows
            up = [rows[0][F:], rows[1][:, F:].contiguous()] if need_dw3 else rows
            gate, up = gate + [made["qxT"], made["sxT"]], up + [made["qxT"], made["sxT"]]
        else:  # bf16: the halves of dh [T, 2F] copied out; dx = gate half · w1 + up half · w3
            fc2 = [dy.contiguous(), saved["a"]]
            dh = made["dh"]
            gate = [dh[:, :F].contiguous(), x] if need_dw1 or need_dx else [dh, x]
            up = [dh[:, F:].contiguous(), x] if need_dw3 or need_dx else [dh, x]
            if need_dx:
                dx = _bf16_dgrad(ops, gate[0], w1, plan).add_(_bf16_dgrad(ops, up[0], w3, plan))
        # one wgrad GEMM per weight, each into its own gradient: w1 with w2 (mlp_wgrad: fc1 = w1, fc2 = w2), then w3
        dw1 = dw2 = dw3 = None
        if need_dw1 or need_dw2:
            dw1, dw2 = ops.mlp_wgrad(plan, fc2 + gate, w1, w2, None, None, recipe, need_dw1, need_dw2)
        if need_dw3:
            dw3 = ops.mlp_wgrad(plan, fc2 + up, w3, w2, None, None, recipe, True, False)[0]
        if dp is not None and need_dp:
            dp = dp.to(probs.dtype)
        return (dx if need_dx else None, dw1 if need_dw1 else None, dw3, dw2 if need_dw2 else None,
                dp if need_dp else None, None, None, None, None)


def _bf16_dgrad(ops, dh: torch.Tensor, w: torch.Tensor, plan: torch.Tensor) -> torch.Tensor:
    """``dh [T, hidden]`` times ``w [E, hidden, dim]`` per expert in bf16: the linear layer's dgrad op (an op with a
    fake on both backends, so that torch.compile traces it), the weight as its own bf16 copy."""
    wb = w.to(torch.bfloat16)
    return ops.linear_bwd(dh, plan, [wb], None, wb, None, BF16, True, False, False)[0]


def _stand_in(w1: torch.Tensor) -> torch.Tensor:
    """An ``[E, 2·hidden, dim]`` tensor like ``w1`` that takes no memory: what the op reads of fc1 when it is
    given fc1's FP8 copies (its shape, dtype and device)."""
    E, F, D = w1.shape
    return torch.empty((), dtype=w1.dtype, device=w1.device).expand(E, 2 * F, D)


def swiglu_experts(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, m_splits,
                   probs: Optional[torch.Tensor] = None, recipe: str = "fp8_blockwise", fp8_weights=None,
                   check_splits: Optional[bool] = None) -> torch.Tensor:
    """torchtitan's expert computation ``w2 · (silu(w1 · x) * (w3 · x))`` per expert on moegemm, for tokens
    ``x [T, dim]`` sorted by expert with ``m_splits`` tokens each (times ``probs [T]`` before ``w2`` when given).
    ``w1``, ``w3``: ``[E, hidden, dim]``; ``w2``: ``[E, dim, hidden]`` (plain tensors: ``to_local()`` a DTensor).
    ``fp8_weights``: the FP8 copies ``(fused fc1, fc2)`` to use, e.g. ``FP8WeightCache.get([(w1, w3), w2])``;
    None: quantized inside the call. Returns ``[T, dim]`` in ``x``'s dtype (computed from ``x`` in bf16)."""
    check_recipe(recipe)
    for name, w in (("w1", w1), ("w3", w3), ("w2", w2)):
        check_weight(w, name)
    E, F, D = w1.shape
    check_mlp_dims(E, D, F, "swiglu", names=("w1/w3 (fc1)", "w2 (fc2)"))
    for name, w, shape in (("w3", w3, (E, F, D)), ("w2", w2, (E, D, F))):
        if tuple(w.shape) != shape or w.device != w1.device:
            raise ValueError(f"{name} must have shape {shape} on {w1.device} to match w1 {(E, F, D)}, got "
                             f"{tuple(w.shape)} on {w.device}")
    check_x_tensor(x)  # before x is cast to bf16
    out_dtype = x.dtype
    xb = x.to(torch.bfloat16).contiguous()
    check_x(xb, D, w1.device, cuda_path=backends.uses_cuda(w1.device))
    check_probs(probs, xb.shape[0], xb.device)
    recipe_id = RECIPE_IDS[recipe]
    check_fp8_weights_recipe(fp8_weights, recipe, "fp8_weights")
    records_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (xb, w1, w3, w2, probs))
    given = recipe_id == FP8_BLOCKWISE and fp8_weights is not None
    fc1_like = _stand_in(w1) if given else None
    if given:  # (fused fc1, fc2): as grouped_mlp's pair, fc1 being [E, 2 hidden, dim]
        check_fp8_weight_pair(fp8_weights, fc1_like, w2, records_grad)
    m = splits_to_device(m_splits, E, xb.shape[0], xb.device, check_splits)
    fp8 = [t for w in fp8_weights for t in w] if given and fp8_weights else []
    # (bf16: in bf16, which the op computes in: fp32 weights' bf16 copy is then not saved for a dgrad that never reads it)
    fc1 = fc1_like if fp8 else torch.cat([w1.detach(), w3.detach()], 1)
    if recipe_id == BF16:
        fc1 = fc1.to(torch.bfloat16)
    if not records_grad:
        y = backends.select(xb.device).mlp_fwd(xb, fc1, w2.detach(), m, None, None, probs, _SWIGLU, recipe_id, fp8,
                                               False, False, False, None)[0]
    else:
        y = _SwigluExperts.apply(xb, w1, w3, w2, probs, m, fc1, fp8, recipe_id)
    return y if y.dtype == out_dtype else y.to(out_dtype)


# ----------------------------------------------------------------------------------------- the module
_COPIES = "_fp8_copy"  # the FP8 copy buffers' prefix (moegemm/weight_buffers.py)


def _invalidate_after_load(module, incompatible_keys) -> None:
    """load_state_dict post-hook: the loaded weights are quantized at their next use."""
    weight_buffers.invalidate(module, _COPIES)


def _local(p: torch.Tensor) -> torch.Tensor:
    """The tensor the op runs on: ``to_local()`` of a DTensor (differentiable, a new view every call), else ``p``."""
    return p.to_local() if isinstance(p, DTensor) else p


def _stored(p: torch.Tensor) -> torch.Tensor:
    """The tensor the FP8 cache keys on: a DTensor's local tensor itself, else ``p``."""
    return p._local_tensor if isinstance(p, DTensor) else p


class MoegemmGroupedExperts(GroupedExperts):
    """torchtitan's ``GroupedExperts`` on moegemm (this module's docstring; ``docs/torchtitan.md``).

    Config (``GroupedExperts.Config`` plus): ``recipe`` ``"fp8_blockwise"`` (default) or ``"bf16"``;
    ``fp8_weight_cache`` (default True): keep the FP8 copies of the weights (fc1's fused) in non-persistent
    buffers between calls and re-quantize them in place only when the weights changed (``moegemm/weight_buffers.py``;
    after writes no check can see, e.g. through ``.data``, call ``refresh_fp8_weights()`` or
    ``moegemm.weights_changed()``). The copies take as much memory as the bf16 weights.

    ``forward(x_RD, num_tokens_per_expert_E, scores_R=None)``: ``scores_R`` (optional, ``[R]``) scales each
    token's activation before ``w2`` (router probabilities fused into the op; torchtitan's dispatchers apply
    them in ``combine`` instead and pass none)."""

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        recipe: Literal["fp8_blockwise", "bf16"] = "fp8_blockwise"
        fp8_weight_cache: bool = True

    def __init__(self, config: Config):
        check_recipe(config.recipe)
        check_bool_arg("fp8_weight_cache", config.fp8_weight_cache)
        check_layer_sizes(("num_experts", config.num_experts), ("dim", config.dim), ("hidden_dim", config.hidden_dim))
        check_mlp_dims(config.num_experts, config.dim, config.hidden_dim, "swiglu",
                       names=("w1_EFD/w3_EFD (fc1)", "w2_EDF (fc2)"))
        super().__init__(config)
        self.recipe = config.recipe
        self._cache_on = config.fp8_weight_cache and self.recipe == "fp8_blockwise"
        self._allocate_fp8_copies()
        self.register_load_state_dict_post_hook(_invalidate_after_load)

    @property
    def fp8_weight_cache(self) -> bool:
        """Whether the FP8 copies of the weights are kept (in buffers) between calls; setting it to False frees them
        (every call then quantizes), True allocates them again."""
        return self._cache_on

    @fp8_weight_cache.setter
    def fp8_weight_cache(self, on: bool) -> None:
        check_bool_arg("fp8_weight_cache", on)
        self._cache_on = on and self.recipe == "fp8_blockwise"
        if self._cache_on:
            self._allocate_fp8_copies()
        else:
            weight_buffers.release(self, _COPIES, len(self._cache_sources()))

    def _cache_sources(self) -> list:
        """The weights the FP8 copies are of: (w1, w3) fused, and w2; a DTensor's stored local tensor (the same object
        every call, also as torch.compile hands it to the refresh op)."""
        return [(_stored(self.w1_EFD), _stored(self.w3_EFD)), _stored(self.w2_EDF)]

    def _allocate_fp8_copies(self) -> None:
        """Give the module FP8 copy buffers for its weights' current (local) shapes, unless it has them or its weights
        are on the meta device (``to_empty`` would make them at the unsharded shapes; ``_init_self_buffers`` does)."""
        sources = self._cache_sources()
        if (self._cache_on and sources[1].device.type != "meta"
                and weight_buffers.matching(self, _COPIES, sources) is None):
            weight_buffers.allocate(self, _COPIES, sources)

    def _apply(self, fn, recurse=True):
        """``module.to`` / ``to_empty`` / ``.bfloat16()``: the copies are dropped rather than converted (a dtype
        conversion would widen them) and made anew for the converted weights."""
        weight_buffers.release(self, _COPIES, len(self._cache_sources()))
        out = super()._apply(fn, recurse)
        self._allocate_fp8_copies()
        return out

    def _init_self_buffers(self, *, buffer_device: Optional[torch.device] = None) -> None:
        """torchtitan's hook after its parallelization and ``to_empty``: the copies for the local shapes, so that a
        compiled forward finds them."""
        super()._init_self_buffers(buffer_device=buffer_device)
        self._allocate_fp8_copies()

    def fp8_weights(self):
        """The FP8 copies (fused fc1, fc2) for this call, refreshed if the weights changed, or None: quantize inside
        the call (bf16, the cache off, a compiled graph traced without copy buffers for these shapes)."""
        if not self._cache_on:
            return None
        sources = self._cache_sources()
        copies = weight_buffers.matching(self, _COPIES, sources)
        if copies is None:
            if torch.compiler.is_compiling():
                return None
            copies = weight_buffers.allocate(self, _COPIES, sources)
        weight_buffers.refresh(sources, copies, getattr(self, _COPIES + "stamp"))
        return copies[:4], copies[4:]

    def refresh_fp8_weights(self) -> None:
        """Quantize the current weights into the FP8 copies now (after writes no check can see)."""
        weight_buffers.invalidate(self, _COPIES)
        self.fp8_weights()

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor,
                scores_R: Optional[torch.Tensor] = None) -> torch.Tensor:
        w1, w3, w2 = _local(self.w1_EFD), _local(self.w3_EFD), _local(self.w2_EDF)
        return swiglu_experts(x_RD, w1, w3, w2, num_tokens_per_expert_E, scores_R, self.recipe, self.fp8_weights())

    def extra_repr(self) -> str:
        E, F, D = self.w1_EFD.shape
        return f"num_experts={E}, dim={D}, hidden_dim={F}, recipe={self.recipe!r}"


def _local_dispatch(dispatcher) -> bool:
    """Whether ``dispatcher`` only reorders tokens locally (combine = score, then scatter_add): torchtitan's
    local dispatcher, or its all-to-all one without an expert-parallel mesh."""
    return type(dispatcher) is LocalTokenDispatcher or (type(dispatcher) is AllToAllTokenDispatcher
                                                        and dispatcher.ep_mesh is None)


class MoegemmRoutedExperts(RoutedExperts):
    """torchtitan's ``RoutedExperts`` whose moegemm experts take the router's scores (this module's docstring):
    dispatch as torchtitan's, ``inner_experts(x, counts, scores)``, combine without the multiplication (the
    deterministic scatter_add alone). Falls back to torchtitan's forward where that does not apply."""

    @dataclass(kw_only=True, slots=True)
    class Config(RoutedExperts.Config):
        pass

    def forward(self, x_BLD: torch.Tensor, topk_scores_BLK: torch.Tensor, topk_expert_ids_BLK: torch.Tensor,
                num_local_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        if not (isinstance(self.inner_experts, MoegemmGroupedExperts) and _local_dispatch(self.token_dispatcher)):
            return super().forward(x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_local_tokens_per_expert_E)
        B, L, D = x_BLD.shape
        K = topk_scores_BLK.size(-1)
        x_TD = x_BLD.view(B * L, D)
        routed_RD, counts_E, meta = LocalTokenDispatcher.dispatch(
            self.token_dispatcher, x_TD, topk_scores_BLK.view(-1, K), topk_expert_ids_BLK.view(-1, K),
            num_local_tokens_per_expert_E)
        with maybe_set_sparse_mesh():
            out_RD = self.inner_experts(routed_RD, counts_E, meta.topk_scores_experts_sorted_N)
        index = meta.token_indices_experts_sorted_N.reshape(-1, 1).expand(-1, D)
        out_TD = deterministic_scatter_add(torch.zeros_like(x_TD), index, out_RD)
        return out_TD.view(B, -1, D)


# ------------------------------------------------------------------------------------ installing it
def _convert(cfg: GroupedExperts.Config, recipe: str, fp8_weight_cache: bool) -> MoegemmGroupedExperts.Config:
    """The moegemm config replacing a stock ``GroupedExperts.Config`` (its fields copied: sizes, param_init,
    sharding_config); an already converted one gets the new options."""
    if type(cfg) not in (GroupedExperts.Config, MoegemmGroupedExperts.Config):
        raise ValueError(f"moegemm replaces torchtitan's stock GroupedExperts only, got {type(cfg).__qualname__} "
                         "(another experts variant or converter: apply moegemm's instead of it)")
    return derive(cfg, MoegemmGroupedExperts.Config, recipe=check_recipe(recipe),
                  fp8_weight_cache=check_bool_arg("fp8_weight_cache", fp8_weight_cache))


class MoegemmExpertsConverter(QuantizationConverter):
    """Model converter: every ``GroupedExperts`` of the model becomes a ``MoegemmGroupedExperts``. List it in a
    model registry's converters, e.g. ``deepseekv3.model_registry("16B", converters=[MoegemmExpertsConverter.Config()])``
    (before a LoRA converter, as torchtitan requires of quantization converters). The token dispatcher is left as
    it is (moegemm takes unpadded tokens)."""

    @dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config):
        recipe: Literal["fp8_blockwise", "bf16"] = "fp8_blockwise"
        """moegemm's recipe: FP8 with 1x128 / 128x128 block scales, or bf16."""
        fp8_weight_cache: bool = True
        """Keep the experts' FP8 weights between calls (re-quantized when the weights change)."""
        fuse_scores: bool = True
        """Apply the router's scores inside the experts' op (``MoegemmRoutedExperts``; local dispatch only)."""

    def __init__(self, config: Config):
        check_recipe(config.recipe)
        self.config = config

    def convert(self, model_config):
        c = self.config
        if c.fuse_scores:
            for _fqn, cfg, parent, attr in list(model_config.traverse(RoutedExperts.Config)):
                model_config = _replace(model_config, parent, attr, _convert_routed(cfg, c.recipe, c.fp8_weight_cache))
        for _fqn, cfg, parent, attr in list(model_config.traverse(GroupedExperts.Config)):
            model_config = _replace(model_config, parent, attr, _convert(cfg, c.recipe, c.fp8_weight_cache))
        return model_config


def _replace(root, parent, attr, new):
    """Put ``new`` where a traversal found a config (``parent``, ``attr``); the root, possibly new."""
    if parent is None:
        return new
    if isinstance(parent, list):
        parent[attr] = new
    else:
        setattr(parent, attr, new)
    return root


def _convert_routed(cfg: RoutedExperts.Config, recipe: str, fp8_weight_cache: bool) -> MoegemmRoutedExperts.Config:
    """``MoegemmRoutedExperts.Config`` in place of a ``RoutedExperts.Config``, its experts converted."""
    if type(cfg) not in (RoutedExperts.Config, MoegemmRoutedExperts.Config):
        raise ValueError(f"moegemm replaces torchtitan's stock RoutedExperts only, got {type(cfg).__qualname__}")
    return derive(cfg, MoegemmRoutedExperts.Config,
                  inner_experts=_convert(cfg.inner_experts, recipe, fp8_weight_cache))


@override(target=GroupedExperts.Config, exact=True,
          description="moegemm grouped GEMMs (FP8 blockwise or bf16, fused SwiGLU) for the routed experts")
def moegemm_experts(cfg: GroupedExperts.Config, recipe: str = "fp8_blockwise",
                    fp8_weight_cache: bool = True) -> MoegemmGroupedExperts.Config:
    """torchtitan override: ``--override.imports moegemm.torchtitan.moegemm_experts`` (options as JSON:
    ``'moegemm.torchtitan.moegemm_experts={"recipe": "bf16"}'``)."""
    return _convert(cfg, recipe, fp8_weight_cache)


@override(target=RoutedExperts.Config, exact=True,
          description="moegemm routed experts: the router scores applied inside moegemm's experts op")
def moegemm_routed_experts(cfg: RoutedExperts.Config, recipe: str = "fp8_blockwise",
                           fp8_weight_cache: bool = True) -> MoegemmRoutedExperts.Config:
    """torchtitan override: ``--override.imports moegemm.torchtitan.moegemm_routed_experts`` (``MoegemmRoutedExperts``
    with moegemm's experts; list it instead of ``moegemm_experts``, not with it)."""
    return _convert_routed(cfg, recipe, fp8_weight_cache)
