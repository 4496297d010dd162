"""Megatron-core integration: moegemm as the experts of a Megatron ``MoELayer``.

``MoegemmExperts`` follows megatron-core's experts protocol (``SequentialMLP`` / ``TEGroupedMLP`` in
``megatron/core/transformer/moe/experts.py``; checked against megatron-core 0.16 and 0.19)::

    experts = MoegemmExperts(num_local_experts, config, pg_collection=...)
    output, None = experts(permuted_local_hidden_states, tokens_per_expert, permuted_probs)

and runs the whole expert MLP (fc1 -> activation x probs -> fc2) as moegemm grouped GEMMs, with
``tokens_per_expert`` used as it comes (a device tensor is never read on the host). Use it through
``get_moe_layer_spec`` / ``get_gpt_layer_spec`` or patch an existing spec with ``patch_layer_spec``.

Checkpoints: the plain ``state_dict()`` has exactly ``SequentialMLP``'s keys
(``local_experts.{i}.linear_fc1.weight`` ...), ``load_state_dict`` takes those, ``TEGroupedMLP``'s
(``linear_fc1.weight{i}``) or the native stacked keys, and ``sharded_state_dict`` produces the same
global checkpoint keys and shardings as ``SequentialMLP`` / ``TEGroupedMLP``, so checkpoints move
between the three implementations both ways.

megatron-core is an optional dependency: ``import moegemm`` never imports this module.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import os
import re
import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

try:
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.moe.moe_layer import MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module
    from megatron.core.transformer.utils import make_sharded_object_for_checkpoint
except ImportError as e:  # pragma: no cover - exercised only without megatron-core
    raise ImportError("moegemm.megatron needs megatron-core (pip install megatron-core); "
                      f"importing it failed: {e}") from e

from .. import backends as backend
from .._validate import check_recipe
from ..functional.linear import WgradStore
from ..functional.mlp import grouped_mlp
from ..quantize import Fp8Rows
from .. import weight_cache
from ..layout import GLU_ACTIVATIONS

__all__ = ["MoegemmExperts", "experts_builder", "patch_layer_spec", "get_moe_layer_spec", "get_gpt_layer_spec",
           "resolve_activation", "resolve_recipe"]

RECIPE_ENV = "MOEGEMM_MEGATRON_RECIPE"


# ----------------------------------------------------------------------------------------- config mapping
def resolve_recipe(config, recipe: Optional[str] = None) -> str:
    """The moegemm recipe: the ``recipe`` argument, else ``$MOEGEMM_MEGATRON_RECIPE``, else
    ``'fp8_blockwise'`` when ``config.fp8`` is set and ``'bf16'`` otherwise."""
    if recipe is None:
        recipe = os.environ.get(RECIPE_ENV) or None
    if recipe is None:
        recipe = "fp8_blockwise" if getattr(config, "fp8", None) else "bf16"
    return check_recipe(recipe)


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
def _group_size(group) -> int:
    if group is None:
        return 1
    return group.size() if hasattr(group, "size") else torch.distributed.get_world_size(group)


def _group_rank(group) -> int:
    if group is None:
        return 0
    return group.rank() if hasattr(group, "rank") else torch.distributed.get_rank(group)


def _default_groups():
    return dict(ep=parallel_state.get_expert_model_parallel_group(),
                expt_tp=parallel_state.get_expert_tensor_parallel_group(),
                expt_dp=parallel_state.get_expert_data_parallel_group())


# ----------------------------------------------------------------------------------------- main_grad bridge
class _MainGradBridge(torch.autograd.Function):
    """Identity on an expert weight that speaks Megatron DDP's gradient-accumulation-fusion protocol.

    moegemm accumulates wgrad into ``weight.main_grad`` and returns no gradient. Megatron's DDP hook on
    the parameter's grad accumulator must still fire (with ``overlap_grad_reduce`` it asserts a grad)
    and must not add that grad again: as Megatron's own fused linear layers do, mark
    ``grad_added_to_main_grad = True`` and hand autograd a dummy gradient. A main_grad that moegemm
    cannot take (not fp32) is hidden from it: the real gradient flows back and the hook adds it."""

    @staticmethod
    def forward(ctx, param):
        ctx.param = param
        ctx.set_materialize_grads(False)
        return param.view_as(param)

    @staticmethod
    def backward(ctx, grad):
        if grad is not None:
            return grad
        param = ctx.param
        if not hasattr(param, "grad_added_to_main_grad"):
            return None  # plain main_grad (no Megatron DDP): moegemm's contract, weight.grad stays None
        param.grad_added_to_main_grad = True
        make = torch.zeros if getattr(param, "zero_out_wgrad", False) else torch.empty
        return make(param.shape, dtype=param.dtype, device=param.device)


def _fusable_main_grad(param):
    mg = getattr(param, "main_grad", None)
    if (isinstance(mg, torch.Tensor) and mg.dtype == torch.float32 and mg.shape == param.shape
            and mg.device == param.device and mg.is_contiguous()):
        return mg
    return None


def _weight_for_op(param: torch.Tensor) -> torch.Tensor:
    if not hasattr(param, "main_grad"):
        return param
    if not (torch.is_grad_enabled() and param.requires_grad):
        return param.detach()  # no gradient: hide main_grad (moegemm validates it)
    w = _MainGradBridge.apply(param)
    mg = _fusable_main_grad(param)
    if mg is not None:
        w.main_grad = mg
    return w


# ----------------------------------------------------------------------------------------- the module
class _GroupedWeights(nn.Module):
    """``weight [E, out, in]`` and optional ``bias [E, out]`` of one of the two expert GEMMs."""

    def __init__(self, E: int, in_features: int, out_features: int, bias: bool, device, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(E, out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(E, out_features, device=device, dtype=dtype)) if bias else None

    def forward(self):
        """``(weight, bias)``. MoegemmExperts calls this module before reading its parameters so that the
        forward pre-hooks registered on it run: Megatron DDP's ``overlap_param_gather`` waits there for
        the parameters' all-gather (it looks at each module's own parameters only)."""
        return self.weight, self.bias

    def extra_repr(self) -> str:
        E, N, K = self.weight.shape
        return f"num_experts={E}, in_features={K}, out_features={N}, bias={self.bias is not None}"


_SEQ_KEY = re.compile(r"local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$")
_TE_KEY = re.compile(r"(linear_fc[12])\.(weight|bias)(\d+)$")


class MoegemmExperts(MegatronModule):
    """Megatron-core experts module running on moegemm grouped GEMMs (drop-in for ``SequentialMLP`` /
    ``TEGroupedMLP``).

    Args (as ``MoELayer`` passes them): ``num_local_experts``, ``config`` (``TransformerConfig``),
    ``submodules`` (accepted and ignored), ``pg_collection`` (``ep``, ``expt_tp``, ``expt_dp``; default:
    megatron's ``parallel_state``), ``name``. Own keyword arguments: ``recipe`` (``'bf16'`` or
    ``'fp8_blockwise'``; default from ``$MOEGEMM_MEGATRON_RECIPE`` or ``config.fp8``),
    ``fp8_weight_cache`` (default True; False quantizes the weights inside every call): keep the FP8
    weights and re-quantize them only when they changed (``moegemm/weight_cache.py``). It is read at each
    forward; set it at construction (turning it off later stops using the copies but does not free them).

    FP8 weights and Megatron's optimizers: Megatron's optimizers (``DistributedOptimizer`` included) run
    a torch optimizer on the main (fp32) parameters and then copy them into the model's parameters
    through ``.data`` or the DDP parameter buffers, which no version counter sees. The copy follows the
    inner torch optimizer's ``step()`` within ``optimizer.step()``, and that step bumps the global weights
    generation (a ``torch.optim`` step post-hook), so the next forward re-quantizes; with
    ``overlap_param_gather`` the parameters' all-gather completes in DDP's forward pre-hooks of
    ``linear_fc1`` / ``linear_fc2``, which this module's forward calls before it reads (and quantizes) the
    parameters. Megatron's schedule also raises ``is_first_microbatch`` on the first micro-batch of
    each step (``set_is_first_microbatch``, when ``config.fp8`` is set), which forces the re-quantization
    as before. What remains invisible: writes into the model's parameters outside an optimizer step
    (e.g. restoring the distributed optimizer's parameter state into the model, or EMA swaps): follow them
    with ``moegemm.weights_changed()`` (or ``refresh_fp8_weights()``). Inside a CUDA graph capture
    (Megatron's ``cuda_graph_impl``) every call quantizes the weights inside the graph: replays re-read
    the current weights, never a stale copy.

    Parameters: ``linear_fc1.weight [E, F1, H]`` (F1 = 2·moe_ffn_hidden_size with gated_linear_unit,
    gate rows first like Megatron), ``linear_fc2.weight [E, H, F]`` and ``bias`` ``[E, F1]`` / ``[E, H]``
    with ``add_bias_linear``. They carry ``allreduce = False`` (expert parameters: gradients are reduced
    over the expert-data-parallel group by Megatron's DDP) and Megatron's tensor-parallel attributes.
    """

    def __init__(self, num_local_experts: int, config, submodules=None, pg_collection=None, name: Optional[str] = None,
                 *, recipe: Optional[str] = None, fp8_weight_cache: Optional[bool] = None, model_comm_pgs=None,
                 **kwargs):
        if kwargs:
            warnings.warn(f"MoegemmExperts: ignoring arguments {sorted(kwargs)}")
        super().__init__(config=config)
        if pg_collection is None:
            pg_collection = model_comm_pgs
        groups = _default_groups() if pg_collection is None else {}
        for attr in ("ep", "expt_tp", "expt_dp"):
            if attr not in groups:
                g = getattr(pg_collection, attr, None)
                groups[attr] = g if g is not None else _default_groups()[attr]
        self.ep_group, self.tp_group, self.dp_group = groups["ep"], groups["expt_tp"], groups["expt_dp"]
        etp = _group_size(self.tp_group)
        cfg_etp = getattr(config, "expert_tensor_parallel_size", None)
        if etp != 1 or (cfg_etp is not None and cfg_etp != 1):
            raise ValueError("moegemm experts need expert tensor parallel size 1 (each rank holds whole experts), "
                             f"got {etp if etp != 1 else cfg_etp}: set expert_tensor_parallel_size=1 "
                             "(--expert-tensor-parallel-size 1) and scale out with expert parallelism")
        if getattr(config, "moe_latent_size", None):
            raise ValueError(f"moegemm experts do not support moe_latent_size, got {config.moe_latent_size}")
        self.num_local_experts = int(num_local_experts)
        self.name = name
        self.activation = resolve_activation(config)
        self.recipe = resolve_recipe(config, recipe)
        self.glu = self.activation in GLU_ACTIVATIONS
        self.hidden_size = config.hidden_size
        ffn = config.moe_ffn_hidden_size if config.moe_ffn_hidden_size is not None else config.ffn_hidden_size
        self.ffn_hidden_size = ffn
        for what, size in (("hidden_size", self.hidden_size), ("moe_ffn_hidden_size", ffn)):
            if size % 16:
                raise ValueError(f"moegemm experts need {what} to be a multiple of 16, got {size}")
        self.fp8_weight_cache = True if fp8_weight_cache is None else bool(fp8_weight_cache)
        self.is_first_microbatch = True  # Megatron's schedule sets it at each step's first micro-batch
        weight_cache.attach(self)

        E, H = self.num_local_experts, self.hidden_size
        F1 = 2 * ffn if self.glu else ffn
        use_cpu = bool(getattr(config, "use_cpu_initialization", False)) or not torch.cuda.is_available()
        device = torch.device("cpu") if use_cpu else torch.device("cuda", torch.cuda.current_device())
        dtype = config.params_dtype
        bias = bool(config.add_bias_linear)
        self.linear_fc1 = _GroupedWeights(E, H, F1, bias, device, dtype)
        self.linear_fc2 = _GroupedWeights(E, ffn, H, bias, device, dtype)
        if getattr(config, "perform_initialization", True):
            self._init_weight(self.linear_fc1.weight, config.init_method, use_cpu)
            self._init_weight(self.linear_fc2.weight, config.output_layer_init_method, use_cpu)
        # Megatron's attributes (ColumnParallelLinear fc1 / RowParallelLinear fc2, per expert axis + 1)
        for p, dim, stride in ((self.linear_fc1.weight, 1, 2 if self.glu else 1), (self.linear_fc2.weight, 2, 1),
                               (self.linear_fc1.bias, 1, 2 if self.glu else 1)):
            if p is not None:
                p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, stride
        for p in self.parameters():
            p.allreduce = False
            p.sequence_parallel = False
        # Split backward (megatron-core's config.delay_wgrad_compute): the weight gradients wait for
        # backward_dw(); Megatron's DDP then hooks their reduction onto this module, not the parameters.
        self.delay_wgrad_compute = bool(getattr(config, "delay_wgrad_compute", False))
        self._wgrad_store = WgradStore()
        self._wgrad_hooks = []
        if self.delay_wgrad_compute:
            for p in (self.linear_fc1.weight, self.linear_fc2.weight):
                p.skip_backward_post_hook = True

        if hasattr(self, "register_state_dict_post_hook"):
            self.register_state_dict_post_hook(_state_dict_to_sequential)
        else:  # pragma: no cover - older torch
            self._register_state_dict_hook(_state_dict_to_sequential)
        if hasattr(self, "register_load_state_dict_pre_hook"):
            self.register_load_state_dict_pre_hook(_load_from_any)
        else:  # pragma: no cover - older torch
            self._register_load_state_dict_pre_hook(_load_from_any, with_module=True)

    # --------------------------------------------------------------------------------- init
    def _init_weight(self, weight: torch.Tensor, init_method, use_cpu: bool) -> None:
        """``init_method`` per expert on its ``[out, in]`` matrix, as Megatron initialises each expert's
        linear layer (fp32 master on CPU; in place under the expert-parallel RNG state on GPU)."""
        ctx = contextlib.nullcontext()
        if not use_cpu:
            try:
                from megatron.core.tensor_parallel.random import (get_cuda_rng_tracker,
                                                                  get_expert_parallel_rng_tracker_name)

                tracker, rng = get_cuda_rng_tracker(), get_expert_parallel_rng_tracker_name()
                if tracker.is_initialized() and rng in tracker.get_states():
                    ctx = tracker.fork(rng)
            except Exception:  # noqa: BLE001 - no tracker: default generator
                ctx = contextlib.nullcontext()
        with torch.no_grad(), ctx:
            for e in range(weight.shape[0]):  # init time only
                if use_cpu:
                    master = torch.empty(weight.shape[1:], dtype=torch.float32)
                    init_method(master)
                    weight[e].copy_(master)
                else:
                    init_method(weight[e])

    # --------------------------------------------------------------------------------- forward
    def _fp8_weights(self):
        """The FP8 weights for this call (None: quantized inside it), from the FP8 weight cache
        (``moegemm/weight_cache.py``): re-quantized when the weights changed (a torch optimizer step,
        Megatron's included, a load, an in-place write) or when Megatron's schedule raised
        ``is_first_microbatch``."""
        if self.recipe != "fp8_blockwise":
            return None
        first, self.is_first_microbatch = self.is_first_microbatch, False
        if not self.fp8_weight_cache or getattr(self.config, "disable_parameter_transpose_cache", False):
            return None
        return self._fp8_cache.get((self.linear_fc1.weight, self.linear_fc2.weight), True if first else None)

    def refresh_fp8_weights(self) -> None:
        """Quantize the current weights into the FP8 cache now (after writes no check sees: through
        ``.data`` or a buffer sharing the weights' storage outside an optimizer step; or call
        ``moegemm.weights_changed()``, which reaches every cache)."""
        if self.recipe == "fp8_blockwise" and self.fp8_weight_cache:
            self._fp8_cache.refresh((self.linear_fc1.weight, self.linear_fc2.weight))

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert, permuted_probs=None,
                output_buffer=None, grad_input_buffer=None, **kwargs):
        """``(output, None)``: the expert MLP of every token, tokens grouped by local expert.

        ``permuted_local_hidden_states``: ``[T, H]`` or any ``[..., H]`` (the output has its shape);
        ``tokens_per_expert``: ``E`` counts (device tensor, CPU tensor or list); ``permuted_probs``:
        the router probabilities of the tokens (``T`` values), applied to the activation like Megatron
        (``fc2(act(fc1 x + b1) * p) + b2 * p``), or to the input with ``moe_apply_probs_on_input``."""
        if output_buffer is not None or grad_input_buffer is not None:
            raise NotImplementedError("MoegemmExperts does not support the zero-copy output_buffer/grad_input_buffer "
                                      "of the NCCL-EP dispatcher; use the alltoall or allgather dispatcher")
        if kwargs.get("routing_map") is not None:
            raise NotImplementedError("MoegemmExperts does not support the inference routing_map path")
        x = permuted_local_hidden_states
        H = self.hidden_size
        if isinstance(x, Fp8Rows):  # an FP8 dispatcher's tokens: [T, H] e4m3 rows + 1x128 scales
            return self._forward_fp8(x, tokens_per_expert, permuted_probs)
        if x.shape[-1] != H:
            raise ValueError(f"permuted_local_hidden_states.shape[-1] must be hidden_size = {H}, got {tuple(x.shape)}")
        shape = x.shape
        x2 = x.reshape(-1, H)
        T = x2.shape[0]
        probs = None
        if permuted_probs is not None:
            probs = permuted_probs.reshape(-1)
            if probs.numel() != T:
                raise ValueError(f"permuted_probs must hold one value per token ({T}), got shape "
                                 f"{tuple(permuted_probs.shape)}")
        if getattr(self.config, "moe_apply_probs_on_input", False) and probs is not None:
            x2 = (probs.unsqueeze(-1) * x2).to(x.dtype)
            probs = None
        splits = tokens_per_expert
        if not isinstance(splits, (torch.Tensor, list, tuple)):
            splits = torch.as_tensor(splits)  # numpy
        if isinstance(splits, torch.Tensor) and splits.dtype not in (torch.int32, torch.int64):
            splits = splits.to(torch.int64)
        compute_dtype = x2.dtype
        if backend.uses_cuda(x2.device) and compute_dtype != torch.bfloat16:
            compute_dtype = torch.bfloat16  # moegemm's CUDA path takes bf16 activations
        xin = x2.to(compute_dtype).contiguous()
        y = self._mlp(xin, splits, probs)
        y = self._add_fc2_bias(y, splits, probs, T)
        return y.to(x.dtype).reshape(shape), None

    def _mlp(self, x, splits, probs):
        # the parameter holders' forward pre-hooks first (Megatron's param all-gather completes there),
        # then the FP8 weights of the parameters as they are now
        (p1, b1), (p2, _) = self.linear_fc1(), self.linear_fc2()
        fp8_weights = self._fp8_weights()
        if self.delay_wgrad_compute:
            w1, w2 = self._weight_deferred(p1), self._weight_deferred(p2)
        else:
            w1, w2 = _weight_for_op(p1), _weight_for_op(p2)
        return grouped_mlp(x, w1, w2, splits, probs=probs, fc1_bias=b1, fc2_bias=None, activation=self.activation,
                           recipe=self.recipe, fp8_weights=fp8_weights,
                           wgrad_store=self._wgrad_store if self.delay_wgrad_compute else None)

    @staticmethod
    def _weight_deferred(param):
        """The weight as the split backward takes it: the parameter itself (backward_dw accumulates into its
        fp32 main_grad, or its grad)."""
        if hasattr(param, "main_grad") and _fusable_main_grad(param) is None:
            raise NotImplementedError("moegemm experts with delay_wgrad_compute need an fp32 main_grad "
                                      "(grad_reduce_in_fp32 / accumulate_allreduce_grads_in_fp32)")
        return param

    def _forward_fp8(self, x: Fp8Rows, tokens_per_expert, permuted_probs):
        """The experts of FP8 tokens (``Fp8Rows``: q [T, H] e4m3, s [T, H/128] fp32, grad_target receiving
        the bf16 input gradient): fc1 reads the rows as they are (fp8_blockwise only)."""
        if self.recipe != "fp8_blockwise":
            raise ValueError(f"FP8 tokens (Fp8Rows) need recipe='fp8_blockwise', got {self.recipe!r}")
        T = x.q.shape[0]
        probs = None if permuted_probs is None else permuted_probs.reshape(-1)
        if probs is not None and probs.numel() != T:
            raise ValueError(f"permuted_probs must hold one value per token ({T}), got shape {tuple(permuted_probs.shape)}")
        if getattr(self.config, "moe_apply_probs_on_input", False) and probs is not None:
            raise NotImplementedError("moe_apply_probs_on_input needs the bf16 tokens, not FP8 ones")
        splits = tokens_per_expert
        if isinstance(splits, torch.Tensor) and splits.dtype not in (torch.int32, torch.int64):
            splits = splits.to(torch.int64)
        y = self._add_fc2_bias(self._mlp(x, splits, probs), splits, probs, T)
        return y, None

    def _add_fc2_bias(self, y, splits, probs, T):
        b2 = self.linear_fc2.bias
        if b2 is not None:  # Megatron adds fc2's bias scaled by the token's prob
            ids = _expert_ids(splits, self.num_local_experts, T, y.device)
            b2 = torch.cat([b2, b2.new_zeros(1, b2.shape[1])])  # row E: the tokens past the covered ones
            b = b2.index_select(0, ids).float()  # backward: index_add_, no host sync
            if probs is not None:
                b = b * probs.float().unsqueeze(-1)
            y = (y.float() + b).to(y.dtype)
        return y

    def register_wgrad_accumulation_and_reduce_hooks(self, hook):
        """Megatron DDP (delay_wgrad_compute): ``hook`` runs after backward_dw has made the weight gradients."""
        self._wgrad_hooks.append(hook)

    def backward_dw(self):
        """The delayed weight gradients (config.delay_wgrad_compute; a no-op otherwise): every backward
        since the last call, into main_grad (or .grad), then Megatron DDP's reduction hooks."""
        if not self.delay_wgrad_compute:
            return
        self._wgrad_store.backward_dw()
        for p in (self.linear_fc1.weight, self.linear_fc2.weight):
            if hasattr(p, "grad_added_to_main_grad") and _fusable_main_grad(p) is not None:
                p.grad_added_to_main_grad = True  # as _MainGradBridge: DDP's hook must see a grad, not add it
                if p.grad is None:
                    make = torch.zeros if getattr(p, "zero_out_wgrad", False) else torch.empty
                    p.grad = make(p.shape, dtype=p.dtype, device=p.device)
        for hook in self._wgrad_hooks:
            hook()

    def set_is_first_microbatch(self):  # MegatronModule's version only acts when config.fp8 is set
        self.is_first_microbatch = True

    def extra_repr(self) -> str:
        return (f"num_local_experts={self.num_local_experts}, activation={self.activation!r}, "
                f"recipe={self.recipe!r}")

    # --------------------------------------------------------------------------------- state dict
    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Distributed-checkpoint state with SequentialMLP's / TEGroupedMLP's global keys and shardings
        (``{prefix}experts.linear_fc1.weight`` with the global expert axis; GLU fc1 split in its gate and
        up halves; ``singleton_local_shards`` metadata: one key per expert). Each stacked parameter is one
        ``ShardedTensorFactory``, so optimizer states follow the same layout."""
        metadata = dict(metadata or {})
        singleton = bool(metadata.get("singleton_local_shards", False))
        E = self.num_local_experts
        ep_size, ep_rank = _group_size(self.ep_group), _group_rank(self.ep_group)
        G, first = ep_size * E, ep_rank * E
        dp_rank = _group_rank(self.dp_group)
        replica_id = (0, 0, dp_rank)
        sd = {}
        for lin_name in ("linear_fc1", "linear_fc2"):
            lin = getattr(self, lin_name)
            for pname in ("weight", "bias"):
                p = getattr(lin, pname)
                if p is None:
                    continue
                glu = lin_name == "linear_fc1" and self.glu
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


def _state_dict_to_sequential(module, state_dict, prefix, local_metadata=None):
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


def _load_from_any(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
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


def _expert_ids(splits, E: int, T: int, device) -> torch.Tensor:
    """Local expert index of every row, without reading device counts on the host; E for the rows past
    the covered tokens. Counts are clamped to [0, T] as the plan does, so any device values are safe."""
    if isinstance(splits, torch.Tensor):
        c = splits.to(device=device, dtype=torch.int64, non_blocking=True)
    else:
        c = torch.tensor([int(m) for m in splits], dtype=torch.int64, device=device)
    ends = c.clamp(0, T).cumsum(0)
    return torch.searchsorted(ends, torch.arange(T, device=device), right=True)


# ----------------------------------------------------------------------------------------- specs
class _CallableSpec(ModuleSpec):
    """A ModuleSpec that is also a builder: megatron-core <= 0.16 builds experts with
    ``build_module(spec, ...)``, newer versions call ``submodules.experts(...)``."""

    def __call__(self, *args, **kwargs):
        return build_module(self, *args, **kwargs)


def experts_builder(**experts_kwargs):
    """What to put in ``MoESubmodules.experts`` (any megatron-core version): ``MoegemmExperts`` itself,
    or a spec carrying ``experts_kwargs`` (e.g. ``recipe='fp8_blockwise'``)."""
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
