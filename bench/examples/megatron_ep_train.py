"""EP=2 Megatron training step with moegemm's experts: FP8 dispatch + split backward against bf16 and
SequentialMLP.

    torchrun --nproc_per_node 2 -m bench.examples.megatron_ep_train --out bench/results   # two GPUs, NCCL
    python -m torch.distributed.run --nproc_per_node 2 -m bench.examples.megatron_ep_train --cpu   # gloo smoke test
    torchrun --nproc_per_node 2 -m bench.examples.megatron_ep_train --check-only           # numerics only

Every process builds a stack of ``--layers`` pre-norm residual MoE blocks (``x + MoELayer(RMSNorm(x))``,
megatron-core's ``MoELayer``: top-k router, all-to-all dispatcher, expert-parallel size = world size, no
bias, SwiGLU), wraps it in Megatron's ``DistributedDataParallel`` (fp32 gradient buffers) and trains it
with Megatron's optimizer (Adam with decoupled weight decay, i.e. AdamW, on fp32 main parameters; torch's
AdamW underneath without apex / TransformerEngine): each step accumulates ``--micro`` micro-batches of
``--seq x --batch`` synthetic tokens per rank (loss: mean squared error against a random target), then
reduces the gradients and steps (``--cpu``: a stand-in optimizer doing the same, megatron's allocates on
"cuda"). Variants, all in one run, from the same initial weights and batches:

- ``moegemm_fp8_dispatch_split``: moegemm experts, ``fp8_blockwise``; the tokens cross the all-to-all in FP8
  (1x128 row scales, quantized once by the sender) and reach the experts as ``moegemm.Fp8Rows``; split
  backward (``config.delay_wgrad_compute``): each layer's weight gradients are computed while the input
  gradient's all-to-all of that layer is in flight (``backward_dw()`` called inside that all-to-all's backward,
  between launching it and waiting for it: ``_grad_all_to_all_overlapping_dw``).
- ``moegemm_fp8_dispatch``: the same FP8 dispatch, regular (fused) backward.
- ``moegemm_fp8_split``: bf16 dispatch, split backward overlapped the same way.
- ``moegemm_fp8``: bf16 dispatch (megatron's own dispatcher), regular backward.
- ``moegemm_bf16``: moegemm's bf16 recipe, megatron's dispatcher, regular backward.
- ``sequential_mlp``: megatron-core's ``SequentialMLP`` (per-expert local linear layers).

Timing: ``--warmup`` steps, then ``--steps`` steps, each ended by ``torch.cuda.synchronize`` (wall clock,
``time.perf_counter``); tokens/s per GPU = tokens of one rank's input per step / mean step time (the max
over ranks). Peak memory: ``torch.cuda.max_memory_allocated`` over the variant's build and steps (the
initial weights and the batches, shared by all variants, included).

Before timing, a numerical check (``--no-check`` skips it): one micro-batch through the FP8-dispatch split
variant against the bf16-dispatch ``moegemm_fp8`` (same weights, same tokens: output and input gradient are
expected to agree to rounding, the weight gradients within FP8 noise) and against ``moegemm_bf16`` (all
within FP8 noise): relative Frobenius errors over all ranks, PASS / FAIL (exit 1 on FAIL).

Output: a markdown table on rank 0 and ``megatron_ep_train.json`` (command line, settings, versions,
per-variant step times, the check) in ``--out``.
"""

from __future__ import annotations

import os

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.examples.dist_setup import init_expert_parallel, init_process_group  # noqa: E402
from bench.preflight import require_cuda_gpu  # noqa: E402

PROG = "torchrun --nproc_per_node 2 -m bench.examples.megatron_ep_train"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass(frozen=True)
class Variant:
    experts: str  # "moegemm" or "sequential"
    recipe: str | None = None  # moegemm's recipe
    fp8_dispatch: bool = False  # tokens cross the all-to-all in FP8 and reach the experts as Fp8Rows
    split: bool = False  # config.delay_wgrad_compute: weight gradients during the dispatch gradient's all-to-all


VARIANTS = {
    "moegemm_fp8_dispatch_split": Variant("moegemm", "fp8_blockwise", fp8_dispatch=True, split=True),
    "moegemm_fp8_dispatch": Variant("moegemm", "fp8_blockwise", fp8_dispatch=True),
    "moegemm_fp8_split": Variant("moegemm", "fp8_blockwise", split=True),
    "moegemm_fp8": Variant("moegemm", "fp8_blockwise"),
    "moegemm_bf16": Variant("moegemm", "bf16"),
    "sequential_mlp": Variant("sequential"),
}
# relative-error thresholds of the check: FP8 dispatch + split against moegemm_fp8 (output and input
# gradient: the same FP8 rows reach fc1; weight gradients: FP8 column copies made from FP8 rows) and
# against moegemm_bf16 (everything within FP8 noise)
# (every FP8 GEMM of both layers, forward and backward, against bf16: ~0.1 on the weight gradients of the last
# layer measured on one H200)
CHECK_TOL = {"moegemm_fp8": {"out": 1e-2, "dx": 1e-2, "grads": 0.05},
             "moegemm_bf16": {"out": 0.05, "dx": 0.05, "grads": 0.2}}


def parse_args():
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU, moegemm's reference path, tiny shapes")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=64, help="experts in total (EP = world size)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=1408, help="expert ffn hidden size")
    p.add_argument("--topk", type=int, default=6)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2, help="tokens per rank per micro-batch = seq x batch")
    p.add_argument("--micro", type=int, default=2, help="micro-batches per step (gradient accumulation)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=30, help="timed steps")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--no-check", action="store_true", help="skip the numerical check")
    p.add_argument("--check-only", action="store_true", help="run the numerical check, no timing")
    p.add_argument("--out", default=None, help="folder of megatron_ep_train.json (default: not written)")
    args = p.parse_args()
    if args.cpu:  # tiny shapes, 2 steps
        args.experts, args.hidden, args.ffn, args.topk = 8, 256, 128, 2
        args.seq, args.batch, args.micro, args.warmup, args.steps = 32, 2, 2, 1, 2
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    return args


# ----------------------------------------------------------------------------------------- setup
def setup_distributed(args):
    """(rank, world, device): the process group and megatron's parallel state (TP = PP = 1, EP = world)."""
    rank, world, device = init_process_group(args.cpu)
    init_expert_parallel(args.cpu, world)
    if args.experts % world:
        raise SystemExit(f"--experts ({args.experts}) must be a multiple of the world size ({world})")
    return rank, world, device


def make_config(args, world: int, split: bool):
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=16, num_moe_experts=args.experts,
        moe_ffn_hidden_size=args.ffn, ffn_hidden_size=args.ffn, moe_router_topk=args.topk,
        moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none",
        expert_model_parallel_size=world, use_cpu_initialization=args.cpu, params_dtype=torch.bfloat16, bf16=True,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, bias_activation_fusion=False,
        hidden_dropout=0.0, attention_dropout=0.0)
    # set after validation, as tests/test_megatron_split_fp8.py does: megatron ties delay_wgrad_compute to its
    # EP-overlap schedule (and TE); here the schedule is this script's dispatcher (DispatchGradAllToAll)
    cfg.delay_wgrad_compute = split
    return cfg


# ----------------------------------------------------------------------------------------- FP8 dispatch
def _all_to_all(out_rows: int, x: torch.Tensor, out_splits, in_splits, group, async_op: bool = False):
    out = x.new_empty((out_rows, *x.shape[1:]))
    work = dist.all_to_all_single(out, x.contiguous(), output_split_sizes=out_splits, input_split_sizes=in_splits,
                                  group=group, async_op=async_op)
    return (out, work) if async_op else out


def _grad_all_to_all_overlapping_dw(ctx, grad):
    """The backward of a dispatch all-to-all: the bf16 input gradient goes back to the ranks that sent the
    tokens; while it is in flight, ``ctx.backward_dw`` (the layer's split-backward weight gradients) runs
    on the compute stream."""
    out, work = _all_to_all(sum(ctx.in_splits), grad, ctx.in_splits, ctx.out_splits, ctx.group, async_op=True)
    if ctx.backward_dw is not None:
        ctx.backward_dw()
    work.wait()
    return out


class Fp8AllToAll(torch.autograd.Function):
    """Forward: quantize the permuted tokens ``x [T, H]`` into FP8 rows (moegemm's ``quantize_act`` row copy:
    e4m3 + 1x128 fp32 scales), send both through the all-to-all (as bytes and fp32) and return
    ``(handle, q, s)``: ``q [R, H]`` e4m3 and ``s`` of the received tokens, and ``handle``, a bf16 ``[R, H]``
    stand-in (one element, expanded) that the experts name as ``Fp8Rows.grad_target``. Backward: the bf16
    gradient of the received tokens (delivered to ``handle``) goes back through the reverse all-to-all,
    the layer's deferred weight gradients running meanwhile."""

    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits, backward_dw):
        from moegemm import quantize_act

        ctx.group, ctx.out_splits, ctx.in_splits, ctx.backward_dw = group, out_splits, in_splits, backward_dw
        R = sum(out_splits)
        q, s, _, _ = quantize_act(x, [x.shape[0]], rows=True, cols=False)
        q = _all_to_all(R, q.view(torch.uint8), out_splits, in_splits, group).view(torch.float8_e4m3fn)
        s = _all_to_all(R, s, out_splits, in_splits, group)
        handle = x.new_zeros(()).expand(R, x.shape[1])
        ctx.mark_non_differentiable(q, s)
        return handle, q, s

    @staticmethod
    def backward(ctx, grad, _q, _s):
        return _grad_all_to_all_overlapping_dw(ctx, grad), None, None, None, None


class DispatchGradAllToAll(torch.autograd.Function):
    """megatron's bf16 dispatch all-to-all whose backward runs the layer's deferred weight gradients while
    the input gradient's all-to-all is in flight (split backward with bf16 dispatch)."""

    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits, backward_dw):
        ctx.group, ctx.out_splits, ctx.in_splits, ctx.backward_dw = group, out_splits, in_splits, backward_dw
        return _all_to_all(sum(out_splits), x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        return _grad_all_to_all_overlapping_dw(ctx, grad), None, None, None, None


class SortFp8Chunks(torch.autograd.Function):
    """megatron's "permutation 2" (``sort_chunks_by_idxs``: received chunks from (rank, expert) order to
    (expert, rank) order) on FP8 rows and their scales; the gradient (on the stand-in) is un-sorted the way
    megatron's combine_preprocess un-sorts the expert output."""

    @staticmethod
    def forward(ctx, handle, q, s, splits, order, back_splits, back_order):
        from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs

        ctx.back_splits, ctx.back_order = back_splits, back_order
        q, _ = sort_chunks_by_idxs(q.view(torch.uint8), splits, order)
        s, _ = sort_chunks_by_idxs(s, splits, order)
        ctx.mark_non_differentiable(q, s)
        return handle.new_zeros(()).expand(handle.shape), q.view(torch.float8_e4m3fn), s

    @staticmethod
    def backward(ctx, grad, _q, _s):
        from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs

        grad, _ = sort_chunks_by_idxs(grad.contiguous(), ctx.back_splits, ctx.back_order)
        return grad, None, None, None, None, None, None


def make_dispatcher_class():
    from megatron.core.tensor_parallel import all_to_all
    from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from moegemm import Fp8Rows

    class OverlapAlltoAllTokenDispatcher(MoEAlltoAllTokenDispatcher):
        """megatron's all-to-all dispatcher with FP8 tokens (``fp8=True``: quantized before the all-to-all,
        handed to the experts as ``Fp8Rows``) and/or the split backward's weight gradients (``backward_dw``)
        run during the dispatch gradient's all-to-all. EP only (TP = 1), dropless, unfused permutation."""

        def __init__(self, *args, fp8: bool = False, backward_dw=None, **kwargs):
            super().__init__(*args, **kwargs)
            if self.tp_size != 1 or self.drop_and_pad or self.config.moe_permute_fusion:
                raise NotImplementedError("OverlapAlltoAllTokenDispatcher: TP = 1, dropless, unfused permutation only")
            self.fp8, self.backward_dw = fp8, backward_dw

        def token_dispatch(self, permutated_local_input_tokens, permuted_probs):
            self.tokens_per_expert = self._maybe_dtoh_and_synchronize("before_ep_alltoall", self.tokens_per_expert)
            x = permutated_local_input_tokens
            if self.output_splits is None:  # EP = 1: megatron computes no splits
                out_splits = in_splits = [x.shape[0]]
            else:
                out_splits, in_splits = [int(n) for n in self.output_splits], [int(n) for n in self.input_splits]
            if self.fp8:
                handle, q, s = Fp8AllToAll.apply(x, self.ep_group, out_splits, in_splits, self.backward_dw)
                tokens = Fp8Rows(q, s, handle)
            else:
                tokens = DispatchGradAllToAll.apply(x, self.ep_group, out_splits, in_splits, self.backward_dw)
            probs = all_to_all(self.ep_group, permuted_probs, self.output_splits, self.input_splits)
            return tokens, probs

        def dispatch_postprocess(self, global_input_tokens, global_probs):
            if not self.fp8:
                return super().dispatch_postprocess(global_input_tokens, global_probs)
            self.tokens_per_expert = self._maybe_dtoh_and_synchronize("before_permutation_2", self.tokens_per_expert)
            tokens = global_input_tokens
            if self.num_local_experts > 1:
                splits = self.num_global_tokens_per_local_expert.ravel()
                handle, q, s = SortFp8Chunks.apply(tokens.grad_target, tokens.q, tokens.s, splits,
                                                   self.sort_input_by_local_experts,
                                                   self.num_global_tokens_per_local_expert.T.ravel(),
                                                   self.restore_output_by_local_experts)
                tokens = Fp8Rows(q, s, handle)
                global_probs, _ = sort_chunks_by_idxs(global_probs, splits, self.sort_input_by_local_experts)
            tokens_per_expert = self._maybe_dtoh_and_synchronize("before_finish", self.tokens_per_expert)
            self.tokens_per_expert = None
            return tokens, tokens_per_expert, global_probs

    return OverlapAlltoAllTokenDispatcher


# ----------------------------------------------------------------------------------------- model
def build_mlp(mlp_spec, config, **kwargs):
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    if isinstance(mlp_spec, ModuleSpec):  # megatron-core <= 0.16
        return build_module(mlp_spec, config=config, **kwargs)
    return mlp_spec(config=config, **kwargs)  # builder-style specs (0.17+)


def make_stack_class():
    from megatron.core.transformer.module import MegatronModule

    class MoEStack(MegatronModule):
        """``--layers`` x (x + MoELayer(RMSNorm(x))), then RMSNorm."""

        def __init__(self, config, moe_spec, device):
            super().__init__(config=config)
            H, L = config.hidden_size, config.num_layers
            kw = dict(device=device, dtype=config.params_dtype)
            self.norms = torch.nn.ModuleList(torch.nn.RMSNorm(H, eps=1e-5, **kw) for _ in range(L))
            self.moes = torch.nn.ModuleList(build_mlp(moe_spec, config) for _ in range(L))
            self.final_norm = torch.nn.RMSNorm(H, eps=1e-5, **kw)

        def forward(self, x):
            for norm, moe in zip(self.norms, self.moes):
                y, _ = moe(norm(x))
                x = x + y
            return self.final_norm(x)

    return MoEStack


def build_model(args, variant: Variant, world: int, device, init_state=None):
    """The stack of a variant (moegemm or SequentialMLP experts; the dispatcher swapped where the variant
    asks), with ``init_state`` loaded when given (the SequentialMLP keys both expert kinds share)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from moegemm.megatron import MoegemmExperts, patch_layer_spec

    cfg = make_config(args, world, variant.split)
    spec = get_gpt_layer_local_spec(num_experts=args.experts, moe_grouped_gemm=False)
    if variant.experts == "moegemm":
        spec = patch_layer_spec(spec, recipe=variant.recipe)
    torch.manual_seed(1234)
    model = make_stack_class()(cfg, spec.submodules.mlp, device).to(device)  # the router may be built on the CPU
    for moe in model.moes:
        assert isinstance(moe.experts, MoegemmExperts) == (variant.experts == "moegemm")
        assert moe.experts.num_local_experts == args.experts // world
        if variant.fp8_dispatch or variant.split:
            moe.token_dispatcher = make_dispatcher_class()(
                moe.num_local_experts, moe.local_expert_indices, config=cfg, pg_collection=get_default_pg_collection(),
                fp8=variant.fp8_dispatch, backward_dw=moe.backward_dw if variant.split else None)
    if init_state is not None:
        model.load_state_dict(init_state, strict=True)
    return model, cfg


def build_trainer(model, cfg, args, variant: Variant):
    """Megatron DDP (fp32 gradient buffers; expert gradients over the expert-data-parallel group) and
    Megatron's optimizer (Adam with decoupled weight decay on fp32 main parameters, gradient clipping 1.0)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                            use_distributed_optimizer=False, delay_wgrad_compute=variant.split)
    ddp = DistributedDataParallel(cfg, ddp_cfg, model)
    ddp.broadcast_params()  # the router and the norms are replicated over the data-parallel ranks
    if args.cpu:  # megatron's optimizers allocate on "cuda" unconditionally
        return ddp, CpuMixedPrecisionAdamW(model, args.lr)
    opt_cfg = OptimizerConfig(optimizer="adam", lr=args.lr, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95,
                              bf16=True, use_distributed_optimizer=False, clip_grad=1.0)
    opt = get_megatron_optimizer(opt_cfg, [ddp])
    return ddp, opt


class CpuMixedPrecisionAdamW:
    """The CPU smoke test's stand-in for megatron's Float16OptimizerWithFloat16Params: torch AdamW on fp32
    copies of the parameters, gradients from DDP's fp32 ``main_grad`` buffers, clipping at 1.0 (global
    norm over all ranks' parameters: expert shards counted once, replicated ones once), copy back."""

    def __init__(self, model, lr):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.main = [p.detach().float().clone() for p in self.params]
        self.opt = torch.optim.AdamW(self.main, lr=lr, betas=(0.9, 0.95), weight_decay=0.01)

    def zero_grad(self):
        for m in self.main:
            m.grad = None

    def step(self):
        for p, m in zip(self.params, self.main):
            m.grad = p.main_grad.clone()
        expert = [m.grad for p, m in zip(self.params, self.main) if not getattr(p, "allreduce", True)]
        dense = [m.grad for p, m in zip(self.params, self.main) if getattr(p, "allreduce", True)]
        zero = torch.zeros((), dtype=torch.float64)
        sq = sum((g.double().square().sum() for g in expert), zero)
        dist.all_reduce(sq)  # expert shards summed over the ranks, replicated ones added once below
        norm = float((sq + sum((g.double().square().sum() for g in dense), zero)).sqrt())
        for m in self.main:
            m.grad.mul_(min(1.0, 1.0 / (norm + 1e-6)))
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.main):
                p.copy_(m)
        return True, norm, None


def make_batches(args, device, rank: int):
    """``--micro`` (input, target) pairs ``[seq, batch, hidden]`` bf16, different on every rank."""
    gen = torch.Generator(device="cpu").manual_seed(20240 + 7919 * rank)
    shape = (args.seq, args.batch, args.hidden)
    return [(torch.randn(shape, generator=gen).to(device, torch.bfloat16),
             torch.randn(shape, generator=gen).to(device, torch.bfloat16)) for _ in range(args.micro)]


# ----------------------------------------------------------------------------------------- training
def micro_backward(ddp, x, target, scale: float) -> torch.Tensor:
    """Forward and backward of one micro-batch; the loss (detached, unscaled)."""
    loss = F.mse_loss(ddp(x).float(), target.float())
    (loss * scale).backward()
    return loss.detach()


def train_step(ddp, opt, batches) -> torch.Tensor:
    ddp.zero_grad_buffer()
    opt.zero_grad()
    losses = [micro_backward(ddp, x, t, 1.0 / len(batches)) for x, t in batches]
    ddp.finish_grad_sync()
    ok, _, _ = opt.step()
    if not ok:
        raise RuntimeError("optimizer step skipped")
    return torch.stack(losses).mean()


def release(model):
    """Drop what megatron's dispatchers keep of the last forward: the router probabilities with their autograd
    graph, which reaches the router weight's gradient accumulator, DDP's hook on it, DDP and the model again:
    a cycle through autograd's C++ nodes that Python's garbage collector cannot free (each variant's model,
    gradient buffers and optimizer state would stay allocated)."""
    for moe in model.moes:
        for k, v in list(vars(moe.token_dispatcher).items()):
            if isinstance(v, torch.Tensor) and v.grad_fn is not None:
                setattr(moe.token_dispatcher, k, None)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def bench_variant(name, args, world, device, batches, init_state):
    """Build, warm up, time ``--steps`` steps; the row of the table (max step time over ranks)."""
    variant = VARIANTS[name]
    free_memory(device)
    mem_start = torch.cuda.memory_allocated(device) / 2 ** 30 if device.type == "cuda" else float("nan")
    model, cfg = build_model(args, variant, world, device, init_state)
    ddp, opt = build_trainer(model, cfg, args, variant)
    for _ in range(args.warmup):
        train_step(ddp, opt, batches)
    sync(device)
    dist.barrier()
    times, loss = [], None
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss = train_step(ddp, opt, batches)
        sync(device)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else float("nan")
    stats = torch.tensor([sum(times), max(times), peak], dtype=torch.float64, device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    loss = loss.double().reshape(1)
    dist.all_reduce(loss)
    stats, loss = stats.cpu(), loss.cpu()
    step_s = float(stats[0]) / args.steps
    tokens = args.micro * args.seq * args.batch
    row = dict(variant=name, tokens_per_s_per_gpu=tokens / step_s, step_ms=step_s * 1e3,
               step_ms_max=float(stats[1]) * 1e3,
               step_ms_rank0=[round(t * 1e3, 3) for t in times],
               peak_mem_gib=float(stats[2]) if device.type == "cuda" else None,
               mem_at_start_gib_rank0=mem_start if device.type == "cuda" else None, final_loss=float(loss[0]) / world,
               wgrad="during the dispatch gradient's all-to-all" if variant.split else "in the fused backward",
               **dataclasses.asdict(variant))
    release(model)
    del ddp, opt, model
    free_memory(device)
    return row


# ----------------------------------------------------------------------------------------- check
def grel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Global relative Frobenius error over all ranks' pieces."""
    d = torch.stack([((a.double() - b.double()) ** 2).sum(), (b.double() ** 2).sum()])
    dist.all_reduce(d)
    d = d.cpu()
    return float((d[0] / d[1]).sqrt()) if d[1] > 0 else float(d[0].sqrt())


def one_micro_batch(name, args, world, device, batch, init_state):
    """(output, input gradient, {parameter: reduced gradient}) of one micro-batch through a variant."""
    model, cfg = build_model(args, VARIANTS[name], world, device, init_state)
    ddp, opt = build_trainer(model, cfg, args, VARIANTS[name])
    ddp.zero_grad_buffer()
    x = batch[0].detach().clone().requires_grad_()
    out = ddp(x)
    F.mse_loss(out.float(), batch[1].float()).backward()
    ddp.finish_grad_sync()
    grads = {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}
    res = out.detach(), x.grad.detach()
    release(model)
    del ddp, opt, model, out, x
    free_memory(device)
    return (*res, grads)


def check_fp8_dispatch(args, world, device, batch, init_state, rank):
    """The FP8-dispatch split variant against moegemm_fp8 (bf16 dispatch) and moegemm_bf16."""
    name = "moegemm_fp8_dispatch_split"
    out, dx, grads = one_micro_batch(name, args, world, device, batch, init_state)
    report, ok = {}, True
    for ref in CHECK_TOL:
        r_out, r_dx, r_grads = one_micro_batch(ref, args, world, device, batch, init_state)
        errs = {"out": grel(out, r_out), "dx": grel(dx, r_dx)}
        errs.update({f"grad {n}": grel(grads[n], r_grads[n]) for n in sorted(grads)})
        tol = CHECK_TOL[ref]
        passed = all(v <= tol[k if k in ("out", "dx") else "grads"] for k, v in errs.items())
        ok &= passed
        report[f"{name} vs {ref}"] = dict(errors=errs, tolerances=tol, passed=passed,
                                          out_bitwise_equal=bool(torch.equal(out, r_out)))
        if rank == 0:
            worst = max((k for k in errs if k.startswith("grad")), key=errs.get)
            print(f"check {name} vs {ref}: out {errs['out']:.2e}, dx {errs['dx']:.2e}, worst grad "
                  f"{errs[worst]:.2e} ({worst[5:]}); tolerances {tol} -> {'PASS' if passed else 'FAIL'}", flush=True)
    return report, ok


# ----------------------------------------------------------------------------------------- report
def git_commit() -> str:
    if os.environ.get("MOEGEMM_COMMIT"):
        return os.environ["MOEGEMM_COMMIT"]
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=20).stdout.strip()
        return rev if len(rev) == 40 else "unknown"
    except Exception:  # noqa: BLE001 - no git on the device machine
        return "unknown"


def meta(args, world, device) -> dict:
    import megatron.core

    launcher = f"torchrun --nproc_per_node {world} " if "LOCAL_RANK" in os.environ else "python "
    versions = {"torch": torch.__version__, "cuda": torch.version.cuda, "megatron_core": megatron.core.__version__,
                "python": platform.python_version()}
    env = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")
    script = ["-m", __spec__.name] if __spec__ else sys.argv[:1]  # run as a module, as the docstring says
    return {"command": launcher + " ".join(shlex.quote(a) for a in script + sys.argv[1:]),
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "git_commit": git_commit(),
            "world_size": world, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "versions": versions, "env": {k: os.environ.get(k) for k in env},
            "settings": {k: v for k, v in vars(args).items() if k != "out"},
            "tokens_per_rank_per_step": args.micro * args.seq * args.batch,
            "notes": ("stack of MoE blocks x + MoELayer(RMSNorm(x)), alltoall dispatcher, EP = world size, "
                      "SwiGLU, no bias, no load-balancing loss; Megatron DDP (fp32 grad buffers) + Megatron "
                      "optimizer (AdamW on fp32 main params, clip 1.0); mse loss against a random target; "
                      "tokens/s per GPU = rank's input tokens per step / mean synchronized step wall time "
                      "(max over ranks)")}


def gib(row) -> str:
    return "n/a" if row["peak_mem_gib"] is None else f"{row['peak_mem_gib']:.2f}"


def markdown_table(rows) -> str:
    lines = ["| variant | tokens/s per GPU | step ms | vs sequential_mlp | peak mem GiB | loss at end |",
             "|---|---:|---:|---:|---:|---:|"]
    base = next((r for r in rows if r["variant"] == "sequential_mlp"), None)
    for r in rows:
        speed = f"{r['tokens_per_s_per_gpu'] / base['tokens_per_s_per_gpu']:.2f}x" if base else "-"
        lines.append(f"| {r['variant']} | {r['tokens_per_s_per_gpu']:,.0f} | {r['step_ms']:.1f} | {speed} | "
                     f"{gib(r)} | {r['final_loss']:.5f} |")
    return "\n".join(lines)


def write_json(args, result, rank):
    if rank != 0 or not args.out:
        return
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "megatron_ep_train.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}", flush=True)


def main():
    args = parse_args()
    if not args.cpu:
        require_cuda_gpu(PROG)
    warnings.filterwarnings("ignore")
    rank, world, device = setup_distributed(args)
    from megatron.core import parallel_state

    result = {"meta": meta(args, world, device), "rows": [], "check": None}
    if rank == 0:
        m = result["meta"]
        print(f"{m['command']}\n{world} ranks on {m['device']}, torch {torch.__version__}, megatron-core "
              f"{m['versions']['megatron_core']}; {args.layers} MoE layers, E={args.experts} "
              f"({args.experts // world} per rank), hidden {args.hidden}, ffn {args.ffn}, top-{args.topk}, "
              f"{args.seq}x{args.batch} tokens/rank x {args.micro} micro-batches per step", flush=True)
    batches = make_batches(args, device, rank)
    init_model, _ = build_model(args, VARIANTS["moegemm_bf16"], world, device)  # the initial weights of every variant
    init_state = {k: v.detach().clone() for k, v in init_model.state_dict().items() if v is not None}
    del init_model

    ok = True
    if not args.no_check or args.check_only:
        result["check"], ok = check_fp8_dispatch(args, world, device, batches[0], init_state, rank)
        write_json(args, result, rank)
    if not args.check_only:
        for name in args.variants:
            row = bench_variant(name, args, world, device, batches, init_state)
            result["rows"].append(row)
            if rank == 0:
                print(f"{name}: {row['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, {row['step_ms']:.1f} ms/step, "
                      f"peak {gib(row)} GiB, loss {row['final_loss']:.5f}", flush=True)
            write_json(args, result, rank)
        if rank == 0:
            print("\n" + markdown_table(result["rows"]), flush=True)
            print("\nsplit variants: weight gradients computed while the dispatch gradient's all-to-all is in flight "
                  "(inside that all-to-all's backward)", flush=True)
    result["markdown"] = markdown_table(result["rows"]) if result["rows"] else None
    write_json(args, result, rank)
    if rank == 0 and result["check"] is not None:
        print("check: " + ("PASS" if ok else "FAIL"), flush=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
