"""``MoegemmExperts``: moegemm as the experts of a Megatron ``MoELayer`` (the package's docstring has the
protocol), on the layers' shared ``ExpertLayer``; and the bridge between moegemm's gradient accumulation
into ``main_grad`` and Megatron DDP's hooks."""

from __future__ import annotations

import contextlib
import warnings
from typing import Optional

import torch
from megatron.core.transformer.module import MegatronModule

from .. import backends, sm_budget
from .._validate import check_bool_arg, check_layer_sizes, check_mlp_dims, check_weight_dtype
from ..functional import grouped_mlp
from ..layout import GLU_ACTIVATIONS
from ..modules.base import ExpertLayer, GroupedWeights
from ..quantize import Fp8Rows
from . import checkpoint
from .config import default_groups, group_size, resolve_activation, resolve_recipe, resolve_sm_budget


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


def _counts(tokens_per_expert):
    """Megatron's tokens_per_expert as grouped_mlp takes them: a numpy array as a tensor, and float counts (those of
    torch.histc, which Megatron's dispatchers have used) as int64, on the device without reading them. A bool tensor is
    no count."""
    splits = tokens_per_expert
    if not isinstance(splits, (torch.Tensor, list, tuple)):
        splits = torch.as_tensor(splits)  # numpy
    if isinstance(splits, torch.Tensor):
        if splits.dtype == torch.bool:
            raise TypeError("tokens_per_expert must hold integer counts, got a torch.bool tensor")
        if splits.dtype not in (torch.int32, torch.int64):
            splits = splits.to(torch.int64)
    return splits


def _token_probs(permuted_probs, T: int):
    """Megatron's permuted_probs (any shape, one value per token) flattened to [T], or None."""
    if permuted_probs is None:
        return None
    if not isinstance(permuted_probs, torch.Tensor):
        raise TypeError(f"permuted_probs must be a tensor or None, got {type(permuted_probs).__name__}")
    if permuted_probs.numel() != T:
        raise ValueError(f"permuted_probs must hold one value per token ({T}), got shape {tuple(permuted_probs.shape)}")
    return permuted_probs.reshape(-1)


def _weight_for_op(param: torch.Tensor) -> torch.Tensor:
    if not hasattr(param, "main_grad"):
        return param
    if not (torch.is_grad_enabled() and param.requires_grad):
        return param.detach()  # no gradient: hide main_grad (moegemm validates it)
    w = _MainGradBridge.apply(param)
    mg = _fusable_main_grad(param)
    if mg is not None:
        w.main_grad = mg
        if getattr(param, "overwrite_main_grad", False):  # Megatron-FSDP: the gradient written over main_grad
            w.overwrite_main_grad = True
    return w


class MoegemmExperts(ExpertLayer, MegatronModule):
    """Megatron-core experts module running on moegemm grouped GEMMs (drop-in for ``SequentialMLP`` /
    ``TEGroupedMLP``).

    Args (as ``MoELayer`` passes them): ``num_local_experts``, ``config`` (``TransformerConfig``),
    ``submodules`` (accepted and ignored), ``pg_collection`` (``ep``, ``expt_tp``, ``expt_dp``; default:
    megatron's ``parallel_state``), ``name``. Own keyword arguments: ``recipe`` (``'bf16'`` or
    ``'fp8_blockwise'``; default from ``$MOEGEMM_MEGATRON_RECIPE`` or ``config.fp8``),
    ``fp8_weight_cache`` (default True; False quantizes the weights inside every call): keep the FP8
    weights and re-quantize them only when they changed (``moegemm/weight_cache.py``; the cache, the split
    backward, ``refresh_fp8_weights`` and ``backward_dw`` are ``ExpertLayer``'s, as in GroupedMLP). Turning
    it off frees the copies. The sizes are checked at construction by grouped_mlp's rules.

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

    SM budget: with the flex token dispatcher (DeepEP or HybridEP), whose kernels hold
    ``config.moe_deepep_num_sms`` / ``moe_hybridep_num_sms`` SMs while the experts compute, the constructor sets
    moegemm's SM budget to the GPU's SMs less those, unless one is set already (``moegemm.set_num_sms``,
    ``MOEGEMM_NUM_SMS``); with the other dispatchers it leaves the budget alone.

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
        groups = default_groups() if pg_collection is None else {}
        for attr in ("ep", "expt_tp", "expt_dp"):
            if attr not in groups:
                g = getattr(pg_collection, attr, None)
                groups[attr] = g if g is not None else default_groups()[attr]
        self.ep_group, self.tp_group, self.dp_group = groups["ep"], groups["expt_tp"], groups["expt_dp"]
        etp = group_size(self.tp_group)
        cfg_etp = getattr(config, "expert_tensor_parallel_size", None)
        if etp != 1 or (cfg_etp is not None and cfg_etp != 1):
            raise ValueError("moegemm experts need expert tensor parallel size 1 (each rank holds whole experts), "
                             f"got {etp if etp != 1 else cfg_etp}: set expert_tensor_parallel_size=1 "
                             "(--expert-tensor-parallel-size 1) and scale out with expert parallelism")
        if getattr(config, "moe_latent_size", None):
            raise ValueError(f"moegemm experts do not support moe_latent_size, got {config.moe_latent_size}")
        ffn_name = "config.moe_ffn_hidden_size" if config.moe_ffn_hidden_size is not None else "config.ffn_hidden_size"
        ffn = config.moe_ffn_hidden_size if config.moe_ffn_hidden_size is not None else config.ffn_hidden_size
        check_layer_sizes(("num_local_experts", num_local_experts), ("config.hidden_size", config.hidden_size),
                          (ffn_name, ffn))
        dtype = check_weight_dtype("config.params_dtype", config.params_dtype)
        if fp8_weight_cache is not None:
            check_bool_arg("fp8_weight_cache", fp8_weight_cache)
        self.num_local_experts = int(num_local_experts)
        self.name = name
        self.activation = resolve_activation(config)
        self.glu = self.activation in GLU_ACTIVATIONS
        self.hidden_size = config.hidden_size
        self.ffn_hidden_size = ffn
        E, H = self.num_local_experts, self.hidden_size
        F1 = check_mlp_dims(E, H, ffn, self.activation, names=("linear_fc1.weight", "linear_fc2.weight"))
        # Split backward (megatron-core's config.delay_wgrad_compute): the weight gradients wait for
        # backward_dw(); Megatron's DDP then hooks their reduction onto this module, not the parameters.
        self._init_expert_layer(resolve_recipe(config, recipe), True if fp8_weight_cache is None else fp8_weight_cache,
                                bool(getattr(config, "delay_wgrad_compute", False)))
        self._wgrad_hooks = []
        self.is_first_microbatch = True  # Megatron's schedule sets it at each step's first micro-batch

        use_cpu = bool(getattr(config, "use_cpu_initialization", False)) or not torch.cuda.is_available()
        device = torch.device("cpu") if use_cpu else torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available():
            self._apply_sm_budget(config)
        bias = bool(config.add_bias_linear)
        self.linear_fc1 = GroupedWeights(E, H, F1, bias, device, dtype)
        self.linear_fc2 = GroupedWeights(E, ffn, H, bias, device, dtype)
        for holder in (self.linear_fc1, self.linear_fc2):
            if holder.bias is not None:
                with torch.no_grad():
                    holder.bias.zero_()
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
        if self.delay_wgrad_compute:
            for p in (self.linear_fc1.weight, self.linear_fc2.weight):
                p.skip_backward_post_hook = True

        if hasattr(self, "register_state_dict_post_hook"):
            self.register_state_dict_post_hook(checkpoint.state_dict_to_sequential)
        else:  # pragma: no cover - older torch
            self._register_state_dict_hook(checkpoint.state_dict_to_sequential)
        if hasattr(self, "register_load_state_dict_pre_hook"):
            self.register_load_state_dict_pre_hook(checkpoint.load_from_any)
        else:  # pragma: no cover - older torch
            self._register_load_state_dict_pre_hook(checkpoint.load_from_any, with_module=True)

    # --------------------------------------------------------------------------------- init
    @staticmethod
    def _apply_sm_budget(config) -> None:
        """With the flex dispatcher, whose DeepEP / HybridEP kernels hold ``moe_deepep_num_sms`` /
        ``moe_hybridep_num_sms`` SMs, moegemm's kernels get the rest (as the dispatcher sets DeepEP's own
        budget at construction). A budget the user set (``moegemm.set_num_sms``, ``MOEGEMM_NUM_SMS``) is kept."""
        device_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        budget = resolve_sm_budget(config, device_sms)
        if budget is not None and sm_budget.get_num_sms() is None:
            sm_budget.set_num_sms(budget)

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
    def expert_weights(self) -> tuple:
        return (self.linear_fc1.weight, self.linear_fc2.weight)

    def _fp8_weights_for_step(self):
        """The FP8 weights for this call (None: quantized inside it), from the FP8 weight cache: re-quantized
        when the weights changed (a torch optimizer step, Megatron's included, a load, an in-place write) or
        when Megatron's schedule raised ``is_first_microbatch``. With the cache off (or Megatron's
        ``disable_parameter_transpose_cache``) every call quantizes, whatever the flag."""
        if self.recipe != "fp8_blockwise":
            return None
        first, self.is_first_microbatch = self.is_first_microbatch, False
        if not self.fp8_weight_cache or getattr(self.config, "disable_parameter_transpose_cache", False):
            return None
        return self.fp8_weights(True if first else None)

    def refresh_fp8_weights(self) -> None:
        """``ExpertLayer.refresh_fp8_weights`` while the cache is on (off, no copies are ever read). After
        writes no check sees (through ``.data`` or a buffer sharing the weights' storage outside an optimizer
        step), or call ``moegemm.weights_changed()``, which reaches every cache."""
        if self.fp8_weight_cache:
            super().refresh_fp8_weights()

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
        if not isinstance(x, (torch.Tensor, Fp8Rows)):
            raise TypeError(f"permuted_local_hidden_states must be a tensor or an Fp8Rows, got {type(x).__name__}")
        if isinstance(x, Fp8Rows):  # an FP8 dispatcher's tokens: [T, H] e4m3 rows + 1x128 scales
            return self._forward_fp8(x, tokens_per_expert, permuted_probs)
        if x.shape[-1] != H:
            raise ValueError(f"permuted_local_hidden_states.shape[-1] must be hidden_size = {H}, got {tuple(x.shape)}")
        shape = x.shape
        x2 = x.reshape(-1, H)
        T = x2.shape[0]
        probs = _token_probs(permuted_probs, T)
        if getattr(self.config, "moe_apply_probs_on_input", False) and probs is not None:
            x2 = (probs.unsqueeze(-1) * x2).to(x.dtype)
            probs = None
        splits = _counts(tokens_per_expert)
        compute_dtype = x2.dtype
        if backends.uses_cuda(x2.device) and compute_dtype != torch.bfloat16:
            compute_dtype = torch.bfloat16  # moegemm's CUDA path takes bf16 activations
        xin = x2.to(compute_dtype).contiguous()
        y = self._mlp(xin, splits, probs)
        y = self._add_fc2_bias(y, splits, probs, T)
        return y.to(x.dtype).reshape(shape), None

    def _mlp(self, x, splits, probs):
        # the parameter holders' forward pre-hooks first (Megatron's param all-gather completes there),
        # then the FP8 weights of the parameters as they are now
        (p1, b1), (p2, _) = self.linear_fc1(), self.linear_fc2()
        fp8_weights = self._fp8_weights_for_step()
        if self.delay_wgrad_compute:
            w1, w2 = self._weight_deferred(p1), self._weight_deferred(p2)
        else:
            w1, w2 = _weight_for_op(p1), _weight_for_op(p2)
        return grouped_mlp(x, w1, w2, splits, probs=probs, fc1_bias=b1, fc2_bias=None, activation=self.activation,
                           recipe=self.recipe, fp8_weights=fp8_weights, wgrad_store=self._wgrad_store if self.delay_wgrad_compute else None)

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
        the bf16 input gradient): fc1 reads the rows as they are (fp8_blockwise only, as grouped_mlp checks)."""
        T = x.q.shape[0]
        probs = _token_probs(permuted_probs, T)
        if getattr(self.config, "moe_apply_probs_on_input", False) and probs is not None:
            raise NotImplementedError("moe_apply_probs_on_input needs the bf16 tokens, not FP8 ones")
        splits = _counts(tokens_per_expert)
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
        super().backward_dw()
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
        """Distributed-checkpoint state in SequentialMLP's / TEGroupedMLP's layout (``checkpoint.py``)."""
        return checkpoint.sharded_state_dict(self, prefix, sharded_offsets, metadata)


def _expert_ids(splits, E: int, T: int, device) -> torch.Tensor:
    """Local expert index of every row, without reading device counts on the host; E for the rows past
    the covered tokens. Counts are clamped to [0, T] as the plan does, so any device values are safe."""
    if isinstance(splits, torch.Tensor):
        c = splits.to(device=device, dtype=torch.int64, non_blocking=True)
    else:
        c = torch.tensor([int(m) for m in splits], dtype=torch.int64, device=device)
    ends = c.clamp(0, T).cumsum(0)
    return torch.searchsorted(ends, torch.arange(T, device=device), right=True)
