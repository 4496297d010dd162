"""Expert-parallel Megatron training run: moegemm's experts against megatron-core's own, EP = world size, with the
expert-parallel all-to-all overlapped as megatron-core offers it.

    torchrun --nproc_per_node 8 -m bench.examples.megatron_ep_train --model v2-lite-4l     # EP = 8, NCCL
    torchrun --nproc_per_node 8 -m bench.examples.megatron_ep_train --model v2-lite-4l --loss-steps 300 --no-bench
    torchrun --nproc_per_node 8 -m bench.examples.megatron_ep_train --model v2-lite-4l --repeat-check --no-bench
    python -m torch.distributed.run --nproc_per_node 4 -m bench.examples.megatron_ep_train --cpu   # gloo smoke test

The model is megatron-core's ``GPTModel`` (vocabulary embedding, ``--layers`` transformer layers, final RMSNorm,
output layer, cross-entropy) whose layers are ``x + MoELayer(RMSNorm(x))``: the attention is left out (an
identity in the layer spec), so the step is the MoE layers' (router, alltoall dispatcher with expert-parallel
size = world size, dropless, SwiGLU experts without bias, optional shared experts) plus the embedding and the
output layer. ``--model v2-lite-4l`` is DeepSeek-V2-Lite's MoE cut to 4 layers: 64 experts, top-6, hidden 2048,
expert ffn 1408, every layer MoE, no shared experts unless ``--shared-ffn`` (V2-Lite has 2816), vocabulary 8192
(V2-Lite's 102400 would make the output layer cost as much as the experts), 4 micro-batches of 4096 tokens per
GPU per step. Training is megatron-core's: ``get_forward_backward_func()`` (the no-pipelining schedule),
``DistributedDataParallel`` (fp32 gradient buffers, ``finalize_model_grads``) and ``get_megatron_optimizer``
(AdamW on fp32 main parameters, clipping 1.0; ``--cpu``: a stand-in doing the same, megatron's allocates on
"cuda"). Data: synthetic, per rank: uniform tokens, each labelled by one of 4 fixed successors of its token
drawn uniformly (the best loss is ln 4; each position sees its own token only).

Overlap (``--overlap megatron``, the default): ``config.overlap_moe_expert_parallel_comm``, megatron-core's
combined 1F1B schedule: micro-batch i+1's forward runs interleaved with micro-batch i's backward, the dispatch /
combine all-to-alls on a communication stream hidden behind the other micro-batch's expert compute; with
``delay_wgrad_compute`` the experts' weight gradients (``backward_dw``; moegemm's split backward) are deferred
into that schedule where the experts can defer them (megatron-core 0.16's local linear layers cannot: its
``SequentialMLP`` then computes them in its backward; the rows say which). The schedule needs a ``GPTModel`` of
``TransformerLayer``s, EP > 1, the alltoall or flex dispatcher, bf16, torch >= 2.6, no recompute and no
``moe_shared_expert_overlap``; megatron-core 0.16 and 0.19 both offer it (0.19's
``overlap_dispatch_backward_with_experts_wgrad`` needs TransformerEngine >= 2.3 and is not used). ``--overlap
none`` runs the plain schedule. The FP8-dispatch variants cannot run under the 1F1B schedule (its nodes pass
tensors, not ``moegemm.Fp8Rows``): they and their bf16-dispatch twin run the plain schedule with this script's
own overlap (``megatron_fp8_dispatch.py``): each layer's deferred weight gradients computed while the dispatch
gradient's all-to-all is in flight.

Variants (``--variants``; every one from the same initial weights and batches):

- ``moegemm_fp8``: moegemm experts, ``fp8_blockwise``, FP8 weight cache on; ``moegemm_fp8_sms``: the same with
  the SM budget ``moegemm.num_sms(N)`` around the step (``--num-sms``; default the GPU's SMs less
  ``--comm-sms``, left to the all-to-all's kernels); ``moegemm_bf16``: moegemm's bf16 recipe.
- ``sequential_mlp``: megatron-core's ``SequentialMLP`` (bf16); ``te_grouped_mlp``: its ``TEGroupedMLP``
  (TransformerEngine grouped GEMM, bf16), reported "not installed" where TransformerEngine does not import.
- ``moegemm_fp8_dispatch_split`` (FP8 tokens from the dispatcher, ``moegemm.Fp8Rows``) against
  ``moegemm_fp8_split`` (bf16 dispatch), both with the script's own overlap.

Modes (they add up; each writes its own JSON into ``--out``, named after ``--name``):

- numerical check (``--no-check`` skips it, ``--check-only`` runs only it): one micro-batch through the
  FP8-dispatch variant against ``moegemm_fp8`` (same logits, gradients within FP8 noise) and ``moegemm_bf16``;
  relative Frobenius errors over all ranks, PASS / FAIL.
- timing (``--no-bench`` skips it): ``--warmup`` steps, then ``--steps`` steps each ended by a device
  synchronize; tokens/s per GPU = tokens of one rank's step / mean step time (max over ranks); then one more
  step counting host synchronizations (``torch.cuda.set_sync_debug_mode("warn")``; GPU only). megatron's
  alltoall dispatcher reads the split sizes on the host by design (``"error"`` mode would stop in it), so the
  check is that no moegemm variant synchronizes more often per step than ``sequential_mlp``.
- ``--loss-steps N``: loss curves of N steps, new batches every step: ``--loss-ref`` (bf16) twice, with data
  seeds ``--seed`` and ``--seed + 1`` (the run-to-run spread), and ``--loss-fp8`` once with ``--seed``. PASS
  when the fp8 curve's mean distance to the first bf16 curve (moving averages over N/20 steps, second half)
  is within the two bf16 curves' distance. JSON, and a PNG where matplotlib imports.
- ``--repeat-check``: each variant runs ``--repeat-steps`` steps twice from the same weights and batches
  (``config.deterministic_mode``, ``torch.use_deterministic_algorithms(warn_only=True)``); the losses and
  every parameter after the steps compared bitwise. PASS / FAIL per variant.

Exit status 1 when any check fails.
"""

from __future__ import annotations

import os
import sys

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
if "--repeat-check" in sys.argv:  # cuBLAS picks deterministic kernels only with a fixed workspace (before CUDA starts)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import shlex  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.examples.dist_setup import init_expert_parallel, init_process_group  # noqa: E402
from bench.outputs import describe, out_dir  # noqa: E402
from bench.preflight import require_cuda_gpu  # noqa: E402

PROG = "torchrun --nproc_per_node 8 -m bench.examples.megatron_ep_train"
COMMAND = "megatron_ep_train"  # bench/outputs.py's folder name
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass(frozen=True)
class Variant:
    experts: str  # "moegemm", "sequential" or "te_grouped"
    recipe: str | None = None  # moegemm's recipe
    fp8_dispatch: bool = False  # tokens cross the all-to-all in FP8 and reach the experts as Fp8Rows
    split: bool = False  # this script's overlap: weight gradients during the dispatch gradient's all-to-all
    sm_budget: bool = False  # moegemm.num_sms(--num-sms) around the step


VARIANTS = {
    "moegemm_fp8": Variant("moegemm", "fp8_blockwise"),
    "moegemm_fp8_sms": Variant("moegemm", "fp8_blockwise", sm_budget=True),
    "moegemm_bf16": Variant("moegemm", "bf16"),
    "sequential_mlp": Variant("sequential"),
    "te_grouped_mlp": Variant("te_grouped"),
    "moegemm_fp8_dispatch_split": Variant("moegemm", "fp8_blockwise", fp8_dispatch=True, split=True),
    "moegemm_fp8_split": Variant("moegemm", "fp8_blockwise", split=True),
}
DEFAULT_VARIANTS = list(VARIANTS)

# --model presets (any size can be set on its own); --cpu takes "tiny" with 2 experts per rank
PRESETS = {
    "v2-lite-4l": dict(layers=4, experts=64, topk=6, hidden=2048, ffn=1408, shared_ffn=0, vocab=8192, seq=4096,
                       batch=1, micro=4),
    "tiny": dict(layers=2, experts=None, topk=2, hidden=256, ffn=128, shared_ffn=0, vocab=512, seq=32, batch=2,
                 micro=2),
}
SUCCESSORS = 4  # the synthetic task: each token's label is one of 4 fixed tokens (best loss ln 4)

# relative-error thresholds of the check: the FP8-dispatch variant against moegemm_fp8 (the same FP8 rows reach
# fc1: logits to rounding, weight gradients from FP8 column copies made from FP8 rows) and against moegemm_bf16
# (every FP8 GEMM against bf16)
CHECK_TOL = {"moegemm_fp8": {"out": 1e-2, "grads": 0.05}, "moegemm_bf16": {"out": 0.05, "grads": 0.2}}
# acceptance ratios of tokens/s per GPU (reported with the table)
TARGETS = {("moegemm_fp8", "sequential_mlp"): 1.5, ("moegemm_fp8", "moegemm_bf16"): 1.2}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU, moegemm's reference path, tiny shapes")
    p.add_argument("--model", choices=list(PRESETS), default="v2-lite-4l", help="size preset (--cpu: tiny)")
    for name in ("layers", "experts", "topk", "hidden", "ffn", "shared_ffn", "vocab", "seq", "batch", "micro"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None, help="override the preset")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--overlap", choices=("megatron", "none"), default="megatron",
                   help="megatron: overlap_moe_expert_parallel_comm + delay_wgrad_compute (the *_split variants "
                        "keep their own overlap)")
    p.add_argument("--num-sms", type=int, default=None, help="moegemm_fp8_sms's SM budget (default: SMs - --comm-sms)")
    p.add_argument("--comm-sms", type=int, default=24, help="SMs left to the communication by the default budget")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=30, help="timed steps")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0, help="data seed (the weights' seed is fixed)")
    p.add_argument("--no-check", action="store_true", help="skip the numerical check")
    p.add_argument("--check-only", action="store_true", help="run the numerical check only")
    p.add_argument("--no-bench", action="store_true", help="skip the timing")
    p.add_argument("--loss-steps", type=int, default=0, help="loss-curve mode: steps per run (0: off)")
    p.add_argument("--loss-ref", default="sequential_mlp", help="the bf16 variant run twice in the loss mode")
    p.add_argument("--loss-fp8", default="moegemm_fp8", help="the FP8 variant of the loss mode")
    p.add_argument("--repeat-check", action="store_true", help="run each variant twice and compare bitwise")
    p.add_argument("--repeat-steps", type=int, default=3)
    p.add_argument("--name", default="megatron_ep_train", help="stem of the files written")
    p.add_argument("--out", default=None, help=f"folder of the files written ({describe(COMMAND)})")
    args = p.parse_args(argv)
    preset = PRESETS["tiny" if args.cpu else args.model]
    for k, v in preset.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.cpu:
        args.warmup, args.steps = min(args.warmup, 1), min(args.steps, 2)  # smoke test: as few as asked
    if args.check_only:
        args.no_bench = True
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in args.variants + [args.loss_ref, args.loss_fp8] if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    return args


# ----------------------------------------------------------------------------------------- setup
def setup_distributed(args):
    """(rank, world, device): the process group and megatron's parallel state (TP = PP = 1, EP = world)."""
    rank, world, device = init_process_group(args.cpu)
    init_expert_parallel(args.cpu, world)
    if args.experts is None:  # --cpu: two experts per rank at any world size
        args.experts = 2 * world
    if args.experts % world:
        raise SystemExit(f"--experts ({args.experts}) must be a multiple of the world size ({world})")
    if world == 1 and args.overlap == "megatron":
        raise SystemExit("--overlap megatron needs expert parallelism (two processes or more); use --overlap none")
    return rank, world, device


def overlap_of(args, variant: Variant) -> str:
    """The overlap a variant runs with: "megatron" (1F1B EP overlap), "dispatch-wgrad" (this script's) or "none"."""
    return "dispatch-wgrad" if variant.split else args.overlap


def te_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure to import is "not installed"
        return False
    return True


def delay_wgrad_supported(variant: Variant) -> bool:
    """Whether the variant's experts can defer their weight gradients in megatron's 1F1B schedule: moegemm's
    always, TEGroupedMLP's with TransformerEngine >= 2.3, SequentialMLP's where megatron's local linear layers
    have ``backward_dw`` (RowParallelLinear's came after 0.16)."""
    if variant.experts == "moegemm":
        return True
    if variant.experts == "te_grouped":
        import transformer_engine

        major, minor = (int(x) for x in transformer_engine.__version__.split(".")[:2])
        return (major, minor) >= (2, 3)
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    return hasattr(ColumnParallelLinear, "backward_dw") and hasattr(RowParallelLinear, "backward_dw")


def make_config(args, world: int, variant: Variant, overlap: str, deterministic: bool = False):
    from megatron.core.transformer.transformer_config import TransformerConfig

    megatron_overlap = overlap == "megatron"
    cfg = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=16, num_moe_experts=args.experts,
        moe_ffn_hidden_size=args.ffn, ffn_hidden_size=args.ffn, moe_router_topk=args.topk,
        moe_shared_expert_intermediate_size=args.shared_ffn or None, moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="none", moe_grouped_gemm=variant.experts == "te_grouped",
        expert_model_parallel_size=world, use_cpu_initialization=args.cpu, params_dtype=torch.bfloat16, bf16=True,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        bias_activation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
        overlap_moe_expert_parallel_comm=megatron_overlap,
        delay_wgrad_compute=megatron_overlap and delay_wgrad_supported(variant),
        deterministic_mode=deterministic)
    if variant.split:
        # set after validation: megatron ties delay_wgrad_compute to its 1F1B schedule; here the schedule is
        # the plain one and backward_dw runs inside the dispatcher's all-to-all backward
        cfg.delay_wgrad_compute = True
    return cfg


# ----------------------------------------------------------------------------------------- model
def no_attention_class():
    from megatron.core.transformer.identity_op import IdentityOp

    class NoAttention(IdentityOp):
        """The layer's attention slot left empty (x -> x); ``backward_dw`` for megatron's 1F1B schedule."""

        def backward_dw(self):
            pass

    return NoAttention


def layer_spec(args, variant: Variant):
    """megatron's local GPT layer spec with the attention taken out and the variant's experts."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp

    from moegemm.megatron import patch_layer_spec

    spec = get_gpt_layer_local_spec(num_experts=args.experts, moe_grouped_gemm=False, normalization="RMSNorm")
    sub = dataclasses.replace(spec.submodules, input_layernorm=IdentityOp, self_attention=no_attention_class(),
                              self_attn_bda=IdentityFuncOp)
    if variant.experts == "te_grouped":
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

        sub = dataclasses.replace(sub, mlp=get_moe_module_spec(use_te=True, num_experts=args.experts,
                                                               moe_grouped_gemm=True))
    spec = dataclasses.replace(spec, submodules=sub)
    if variant.experts == "moegemm":
        spec = patch_layer_spec(spec, recipe=variant.recipe)
    return spec


_SEQ_EXPERT_KEY = re.compile(r"\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


def to_te_layout(state: dict) -> dict:
    """SequentialMLP's expert keys (``local_experts.{i}.linear_fc1.weight``) as TEGroupedMLP's
    (``linear_fc1.weight{i}``)."""
    return {_SEQ_EXPERT_KEY.sub(lambda m: f".{m.group(2)}.weight{m.group(1)}", k): v for k, v in state.items()}


def build_model(args, variant: Variant, world: int, device, init_state=None, overlap: str | None = None,
                deterministic: bool = False):
    """The ``GPTModel`` of a variant (the dispatcher swapped for the split / FP8-dispatch ones), with
    ``init_state`` loaded when given (SequentialMLP's keys, which moegemm's experts read and write)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from bench.examples.megatron_fp8_dispatch import make_dispatcher_class
    from moegemm.megatron import MoegemmExperts

    overlap = overlap_of(args, variant) if overlap is None else overlap
    cfg = make_config(args, world, variant, overlap, deterministic)
    torch.manual_seed(1234)
    model = GPTModel(config=cfg, transformer_layer_spec=layer_spec(args, variant), vocab_size=args.vocab,
                     max_sequence_length=args.seq, position_embedding_type="none",
                     share_embeddings_and_output_weights=False).to(device)
    for layer in model.decoder.layers:
        moe = layer.mlp
        assert isinstance(moe.experts, MoegemmExperts) == (variant.experts == "moegemm")
        assert moe.experts.num_local_experts == args.experts // world
        if variant.split:
            moe.token_dispatcher = make_dispatcher_class()(
                moe.num_local_experts, moe.local_expert_indices, config=cfg, pg_collection=get_default_pg_collection(),
                fp8=variant.fp8_dispatch, backward_dw=moe.backward_dw)
    if init_state is not None:
        if variant.experts == "te_grouped":  # TE's extra states (FP8 metadata) stay as built
            missing, unexpected = model.load_state_dict(to_te_layout(init_state), strict=False)
            left = [k for k in missing + unexpected if not k.endswith("_extra_state")]
            if left:
                raise RuntimeError(f"TEGroupedMLP did not take the initial weights: {left[:4]}")
        else:
            model.load_state_dict(init_state, strict=True)
    return model, cfg


@dataclasses.dataclass
class Run:
    """A variant built for training: model, DDP, optimizer, config and its SM budget."""
    name: str
    variant: Variant
    model: torch.nn.Module
    ddp: torch.nn.Module
    opt: object
    cfg: object
    num_sms: int | None


def build_run(name, args, world, device, init_state, deterministic: bool = False) -> Run:
    """Megatron DDP (fp32 gradient buffers; expert gradients over the expert-data-parallel group,
    ``finalize_model_grads`` at the end of the schedule) and Megatron's optimizer (AdamW on fp32 main
    parameters, clipping 1.0)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    variant = VARIANTS[name]
    model, cfg = build_model(args, variant, world, device, init_state, deterministic=deterministic)
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                            use_distributed_optimizer=False,
                                            delay_wgrad_compute=cfg.delay_wgrad_compute)
    ddp = DistributedDataParallel(cfg, ddp_cfg, model)
    ddp.broadcast_params()  # the router, the norms, the embedding and the output layer are replicated
    cfg.finalize_model_grads_func = finalize_model_grads
    if args.cpu:  # megatron's optimizers allocate on "cuda" unconditionally
        opt = CpuMixedPrecisionAdamW(model, args.lr)
    else:
        opt_cfg = OptimizerConfig(optimizer="adam", lr=args.lr, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95,
                                  bf16=True, use_distributed_optimizer=False, clip_grad=1.0)
        opt = get_megatron_optimizer(opt_cfg, [ddp])
    return Run(name, variant, model, ddp, opt, cfg, args.num_sms if variant.sm_budget else None)


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


def release(run: Run):
    """Drop what megatron's dispatchers keep of the last forward (tensors with their autograd graph, which
    reaches DDP's hooks and the model again: a cycle through autograd's C++ nodes that Python's garbage
    collector cannot free), then the run itself."""
    for layer in run.model.decoder.layers:
        disp = layer.mlp.token_dispatcher
        for k, v in list(vars(disp).items()):
            if isinstance(v, torch.Tensor) and v.grad_fn is not None:
                setattr(disp, k, None)
    run.model = run.ddp = run.opt = None


# ----------------------------------------------------------------------------------------- data
def task_table(args, device) -> torch.Tensor:
    """The synthetic task's successors ``[vocab, SUCCESSORS]``, the same on every rank and every run."""
    gen = torch.Generator(device="cpu").manual_seed(4242)
    return torch.randint(0, args.vocab, (args.vocab, SUCCESSORS), generator=gen).to(device)


def make_batches(args, table, device, rank: int, seed: int, step: int = 0) -> list:
    """``--micro`` micro-batches (dicts of ``[batch, seq]`` tensors) of one step, different on every rank."""
    gen = torch.Generator(device="cpu").manual_seed(((seed * 1_000_003 + step) * 8191 + rank) % 2 ** 63)
    out = []
    for _ in range(args.micro):
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
        pick = torch.randint(0, SUCCESSORS, (args.batch, args.seq), generator=gen)
        tokens = tokens.to(device)
        out.append(dict(tokens=tokens, labels=table[tokens, pick.to(device)],
                        position_ids=torch.arange(args.seq, device=device).expand(args.batch, -1),
                        loss_mask=torch.ones(args.batch, args.seq, device=device)))
    return out


# ----------------------------------------------------------------------------------------- training
def loss_func(loss_mask, output_tensor):
    """Mean token loss of a micro-batch; the schedule divides the returned loss by the micro-batch count in
    place, so the logged copy is a clone."""
    loss = (output_tensor.float() * loss_mask).sum() / loss_mask.sum()
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """megatron's forward_step_func: the model's per-token losses (or, for the 1F1B schedule, its schedule plan)
    and the loss function."""
    b = next(data_iterator)
    args = (b["tokens"], b["position_ids"], None)
    kwargs = dict(labels=b["labels"], loss_mask=b["loss_mask"])
    if return_schedule_plan:
        return model.build_schedule_plan(*args, **kwargs), lambda out: loss_func(b["loss_mask"], out)
    return model(*args, **kwargs), lambda out: loss_func(b["loss_mask"], out)


def train_step(run: Run, batches, args) -> torch.Tensor:
    """One optimizer step over the micro-batches through megatron's schedule; the mean loss (on the device)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    import moegemm

    run.ddp.zero_grad_buffer()
    run.opt.zero_grad()
    budget = moegemm.num_sms(run.num_sms) if run.num_sms else contextlib.nullcontext()
    with budget:
        stats = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(batches), model=[run.ddp],
            num_microbatches=len(batches), seq_length=args.seq, micro_batch_size=args.batch, forward_only=False)
    ok, _, _ = run.opt.step()
    if not ok:
        raise RuntimeError("optimizer step skipped")
    return torch.stack([s["lm loss"] for s in stats]).mean()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def count_host_syncs(fn, device) -> int | None:
    """Synchronizing CUDA operations torch reports during ``fn()`` (``set_sync_debug_mode("warn")``); None on
    the CPU. The one-time note that the mode is a prototype is not counted."""
    if device.type != "cuda":
        return None
    sync(device)
    prev = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(prev)
    sync(device)
    texts = [str(w.message).lower() for w in caught]
    return sum(1 for t in texts if "synchroniz" in t and "prototype feature" not in t)


def mean_over_ranks(values: torch.Tensor, world: int) -> list:
    v = values.detach().double().reshape(-1).clone()
    dist.all_reduce(v)
    return [float(x) / world for x in v.cpu()]


def not_installed_row(name) -> dict:
    return dict(variant=name, status="not installed (TransformerEngine does not import)",
                **dataclasses.asdict(VARIANTS[name]))


def bench_variant(name, args, world, device, batches, init_state) -> dict:
    """Build, warm up, time ``--steps`` steps, count one step's host syncs: the row of the table."""
    free_memory(device)
    run = build_run(name, args, world, device, init_state)
    for _ in range(args.warmup):
        train_step(run, batches, args)
    sync(device)
    dist.barrier()
    times, losses = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        losses.append(train_step(run, batches, args))
        sync(device)
        times.append(time.perf_counter() - t0)
    syncs = count_host_syncs(lambda: train_step(run, batches, args), device)
    peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else float("nan")
    stats = torch.tensor([sum(times), max(times), peak], dtype=torch.float64, device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    stats = stats.cpu()
    step_s = float(stats[0]) / args.steps
    tokens = args.micro * args.seq * args.batch
    row = dict(variant=name, status="ok", overlap=overlap_of(args, run.variant),
               delay_wgrad_compute=bool(run.cfg.delay_wgrad_compute), num_sms=run.num_sms,
               fp8_weight_cache=run.variant.experts == "moegemm" and run.variant.recipe == "fp8_blockwise",
               tokens_per_s_per_gpu=tokens / step_s, step_ms=step_s * 1e3, step_ms_max=float(stats[1]) * 1e3,
               step_ms_rank0=[round(t * 1e3, 3) for t in times], host_syncs_per_step=syncs,
               peak_mem_gib=float(stats[2]) if device.type == "cuda" else None,
               final_loss=mean_over_ranks(losses[-1], world)[0], **dataclasses.asdict(run.variant))
    release(run)
    free_memory(device)
    return row


# ----------------------------------------------------------------------------------------- numerical check
def grel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Global relative Frobenius error over all ranks' pieces."""
    d = torch.stack([((a.double() - b.double()) ** 2).sum(), (b.double() ** 2).sum()])
    dist.all_reduce(d)
    d = d.cpu()
    return float((d[0] / d[1]).sqrt()) if d[1] > 0 else float(d[0].sqrt())


def one_micro_batch(name, args, world, device, batch, init_state):
    """(logits, {parameter: reduced gradient}) of one micro-batch through a variant, plain schedule."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    model, cfg = build_model(args, VARIANTS[name], world, device, init_state,
                             overlap="dispatch-wgrad" if VARIANTS[name].split else "none")
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, delay_wgrad_compute=cfg.delay_wgrad_compute), model)
    ddp.zero_grad_buffer()
    logits = ddp(batch["tokens"], batch["position_ids"], None)
    F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten()).backward()
    ddp.finish_grad_sync()
    grads = {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}
    out = logits.detach()
    release(Run(name, VARIANTS[name], model, ddp, None, cfg, None))
    del ddp, model, logits
    free_memory(device)
    return out, grads


def check_fp8_dispatch(args, world, device, batch, init_state, rank):
    """The FP8-dispatch variant against moegemm_fp8 (bf16 dispatch) and moegemm_bf16."""
    name = "moegemm_fp8_dispatch_split"
    out, grads = one_micro_batch(name, args, world, device, batch, init_state)
    report, ok = {}, True
    for ref in CHECK_TOL:
        r_out, r_grads = one_micro_batch(ref, args, world, device, batch, init_state)
        errs = {"out": grel(out, r_out)}
        errs.update({f"grad {n}": grel(grads[n], r_grads[n]) for n in sorted(grads)})
        tol = CHECK_TOL[ref]
        passed = all(v <= tol["out" if k == "out" else "grads"] for k, v in errs.items())
        ok &= passed
        report[f"{name} vs {ref}"] = dict(errors=errs, tolerances=tol, passed=passed,
                                          out_bitwise_equal=bool(torch.equal(out, r_out)))
        if rank == 0:
            worst = max((k for k in errs if k.startswith("grad")), key=errs.get)
            print(f"check {name} vs {ref}: logits {errs['out']:.2e}, worst grad {errs[worst]:.2e} ({worst[5:]}); "
                  f"tolerances {tol} -> {'PASS' if passed else 'FAIL'}", flush=True)
    return report, ok


# ----------------------------------------------------------------------------------------- loss curves
def moving_average(xs: list, w: int) -> list:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= w:
            acc -= xs[i - w]
        out.append(acc / min(i + 1, w))
    return out


def curve_distance(a: list, b: list, w: int) -> float:
    """Mean |difference| of the two curves' moving averages over the second half of the steps."""
    ma, mb = moving_average(a, w), moving_average(b, w)
    half = len(a) // 2
    return sum(abs(x - y) for x, y in zip(ma[half:], mb[half:])) / max(1, len(a) - half)


def loss_curve(name, seed, args, world, device, rank, table, init_state) -> list:
    """Losses (mean over ranks) of ``--loss-steps`` steps of one variant, new batches every step."""
    free_memory(device)
    run = build_run(name, args, world, device, init_state)
    losses = [train_step(run, make_batches(args, table, device, rank, seed, step), args)
              for step in range(args.loss_steps)]
    curve = mean_over_ranks(torch.stack(losses), world)
    release(run)
    free_memory(device)
    return curve


def loss_mode(args, world, device, rank, table, init_state) -> tuple:
    runs = {"bf16_a": (args.loss_ref, args.seed), "bf16_b": (args.loss_ref, args.seed + 1),
            "fp8": (args.loss_fp8, args.seed)}
    curves = {}
    for key, (name, seed) in runs.items():
        curves[key] = loss_curve(name, seed, args, world, device, rank, table, init_state)
        if rank == 0:
            print(f"loss {key} ({name}, data seed {seed}): first {curves[key][0]:.4f}, last {curves[key][-1]:.4f}",
                  flush=True)
    w = max(1, args.loss_steps // 20)
    spread = curve_distance(curves["bf16_a"], curves["bf16_b"], w)
    deviation = curve_distance(curves["fp8"], curves["bf16_a"], w)
    passed = deviation <= spread
    result = dict(runs={k: dict(variant=n, data_seed=s, losses=curves[k]) for k, (n, s) in runs.items()},
                  window=w, bf16_spread=spread, fp8_deviation=deviation, passed=passed, best_loss=math.log(SUCCESSORS),
                  rule="mean |moving average difference| over the second half: fp8 vs bf16_a <= bf16_a vs bf16_b")
    if rank == 0:
        print(f"loss: fp8 deviation {deviation:.5f}, bf16 spread {spread:.5f} -> {'PASS' if passed else 'FAIL'}",
              flush=True)
    return result, passed


def plot_loss(result, path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, run in result["runs"].items():
        ax.plot(moving_average(run["losses"], result["window"]),
                label=f"{key}: {run['variant']}, seed {run['data_seed']}")
    ax.set_xlabel("step")
    ax.set_ylabel(f"train loss (moving average over {result['window']} steps)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------------------- repeat check
def params_of(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def repeat_variant(name, args, world, device, batches, init_state) -> dict:
    """The same ``--repeat-steps`` steps twice from the same weights: losses and parameters bitwise equal?"""
    results = []
    for _ in range(2):
        free_memory(device)
        run = build_run(name, args, world, device, init_state, deterministic=True)
        losses = torch.stack([train_step(run, batches, args) for _ in range(args.repeat_steps)])
        results.append((losses.detach().clone(), params_of(run.model)))
        release(run)
    (la, pa), (lb, pb) = results
    flags = torch.tensor([int(torch.equal(la, lb)), int(all(torch.equal(pa[k], pb[k]) for k in pa))],
                         dtype=torch.int64, device=device)
    diff = torch.tensor([max(float((pa[k].float() - pb[k].float()).abs().max()) for k in pa)], dtype=torch.float64,
                        device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    losses_equal, params_equal = (bool(x) for x in flags.cpu())
    return dict(variant=name, steps=args.repeat_steps, losses_bitwise=losses_equal, params_bitwise=params_equal,
                max_param_diff=float(diff.cpu()[0]), losses=mean_over_ranks(la, world),
                passed=losses_equal and params_equal)


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
                "transformer_engine": "installed" if te_available() else "not installed",
                "python": platform.python_version()}
    env = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS", "CUBLAS_WORKSPACE_CONFIG")
    script = ["-m", __spec__.name] if __spec__ else sys.argv[:1]  # run as a module, as the docstring says
    return {"command": launcher + " ".join(shlex.quote(a) for a in script + sys.argv[1:]),
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "git_commit": git_commit(),
            "world_size": world, "expert_parallel_size": world,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "versions": versions, "env": {k: os.environ.get(k) for k in env},
            "settings": {k: v for k, v in vars(args).items() if k != "out"},
            "tokens_per_rank_per_step": args.micro * args.seq * args.batch,
            "notes": ("megatron GPTModel, layers x + MoELayer(RMSNorm(x)) (no attention), alltoall dispatcher, "
                      "EP = world size, SwiGLU, no bias, no load-balancing loss; megatron schedule, DDP (fp32 grad "
                      "buffers) and optimizer (AdamW on fp32 main params, clip 1.0); synthetic successor task; "
                      "tokens/s per GPU = rank's tokens per step / mean synchronized step wall time (max over "
                      "ranks)")}


def ratio(rows, a, b):
    ra = next((r for r in rows if r["variant"] == a and r["status"] == "ok"), None)
    rb = next((r for r in rows if r["variant"] == b and r["status"] == "ok"), None)
    return ra["tokens_per_s_per_gpu"] / rb["tokens_per_s_per_gpu"] if ra and rb else None


def markdown_table(rows) -> str:
    lines = ["| variant | overlap | tokens/s per GPU | step ms | vs sequential_mlp | vs moegemm_bf16 | "
             "host syncs/step | peak mem GiB | loss at end |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['variant']} | - | {r['status']} | | | | | | |")
            continue
        rel = [ratio(rows, r["variant"], b) for b in ("sequential_mlp", "moegemm_bf16")]
        rel = ["-" if x is None else f"{x:.2f}x" for x in rel]
        syncs = "n/a" if r["host_syncs_per_step"] is None else str(r["host_syncs_per_step"])
        mem = "n/a" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.2f}"
        lines.append(f"| {r['variant']} | {r['overlap']} | {r['tokens_per_s_per_gpu']:,.0f} | {r['step_ms']:.1f} | "
                     f"{rel[0]} | {rel[1]} | {syncs} | {mem} | {r['final_loss']:.4f} |")
    return "\n".join(lines)


def acceptance(rows) -> dict:
    """The target ratios, each measured with and without the SM budget where both ran."""
    out = {}
    for (a, b), target in TARGETS.items():
        for mine in (a, a + "_sms"):
            x = ratio(rows, mine, b)
            if x is not None:
                out[f"{mine} / {b}"] = dict(ratio=x, target=target, meets=x >= target)
    return out


def sync_check(rows) -> dict | None:
    """moegemm's variants synchronize no more often per step than megatron's own experts (None: not measured)."""
    base = next((r["host_syncs_per_step"] for r in rows if r["variant"] == "sequential_mlp" and r["status"] == "ok"),
                None)
    mine = {r["variant"]: r["host_syncs_per_step"] for r in rows
            if r["status"] == "ok" and r["experts"] == "moegemm" and r["host_syncs_per_step"] is not None}
    if base is None or not mine:
        return None
    return dict(sequential_mlp=base, moegemm=mine, passed=all(v <= base for v in mine.values()))


class Writer:
    """Rank 0 writes ``<--name><suffix>`` files into ``--out`` (default outside the repository)."""

    def __init__(self, args, rank):
        self.folder = out_dir(args.out, COMMAND) if rank == 0 else None
        self.name, self.rank = args.name, rank

    def path(self, suffix: str) -> str:
        return os.path.join(str(self.folder), self.name + suffix)

    def json(self, suffix: str, obj) -> None:
        if self.rank == 0:
            with open(self.path(suffix), "w") as f:
                json.dump(obj, f, indent=1)
            print(f"wrote {self.path(suffix)}", flush=True)

    def text(self, suffix: str, text: str) -> None:
        if self.rank == 0:
            with open(self.path(suffix), "w") as f:
                f.write(text)
            print(f"wrote {self.path(suffix)}", flush=True)


def table_markdown(result) -> str:
    m = result["meta"]
    s = m["settings"]
    head = (f"# Megatron EP = {m['world_size']} training step\n\n`{m['command']}`\n\ncommit {m['git_commit']}, "
            f"{m['date_utc']}, {m['world_size']} x {m['device']}, torch {m['versions']['torch']}, megatron-core "
            f"{m['versions']['megatron_core']}, TransformerEngine {m['versions']['transformer_engine']}\n\n"
            f"{s['layers']} layers, {s['experts']} experts ({s['experts'] // m['world_size']} per GPU), "
            f"top-{s['topk']}, hidden {s['hidden']}, expert ffn {s['ffn']}, vocabulary {s['vocab']}; "
            f"{s['micro']} micro-batches of {s['seq']}x{s['batch']} tokens per GPU per step; overlap "
            f"{s['overlap']}.\n\n")
    acc = "".join(f"- {k}: {v['ratio']:.2f}x (target {v['target']}x)\n" for k, v in result["acceptance"].items())
    return head + result["markdown"] + "\n\n" + acc


def main(argv=None):
    args = parse_args(argv)
    if not args.cpu:
        require_cuda_gpu(PROG)
    warnings.filterwarnings("ignore")
    rank, world, device = setup_distributed(args)
    from megatron.core import parallel_state

    if not args.cpu and args.num_sms is None:
        args.num_sms = torch.cuda.get_device_properties(device).multi_processor_count - args.comm_sms
    if args.cpu and args.num_sms is None:
        args.num_sms = 8  # checked and kept on the CPU, changes nothing
    writer = Writer(args, rank)
    result = {"meta": meta(args, world, device), "check": None, "rows": []}
    if rank == 0:
        print(f"{result['meta']['command']}\n{world} ranks on {result['meta']['device']}, torch {torch.__version__}, "
              f"megatron-core {result['meta']['versions']['megatron_core']}; {args.layers} layers, E={args.experts} "
              f"({args.experts // world} per rank), hidden {args.hidden}, ffn {args.ffn}, top-{args.topk}, "
              f"{args.seq}x{args.batch} tokens/rank x {args.micro} micro-batches per step, overlap {args.overlap}",
              flush=True)
    table = task_table(args, device)
    batches = make_batches(args, table, device, rank, args.seed)
    init_model, _ = build_model(args, VARIANTS["moegemm_bf16"], world, device, overlap="none")
    init_state = {k: v.detach().clone() for k, v in init_model.state_dict().items() if v is not None}
    del init_model
    ok = True

    if not args.no_check:
        result["check"], passed = check_fp8_dispatch(args, world, device, batches[0], init_state, rank)
        ok &= passed
    if not args.no_bench:
        for name in args.variants:
            if VARIANTS[name].experts == "te_grouped" and not te_available():
                row = not_installed_row(name)
            else:
                row = bench_variant(name, args, world, device, batches, init_state)
            result["rows"].append(row)
            if rank == 0 and row["status"] == "ok":
                print(f"{name}: {row['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, {row['step_ms']:.1f} ms/step, "
                      f"host syncs/step {row['host_syncs_per_step']}, loss {row['final_loss']:.4f}", flush=True)
            elif rank == 0:
                print(f"{name}: {row['status']}", flush=True)
            writer.json(".json", result)  # the rows so far, should a later variant fail
        result["markdown"] = markdown_table(result["rows"])
        result["acceptance"] = acceptance(result["rows"])
        result["sync_check"] = sync_check(result["rows"])
        if result["sync_check"] is not None:
            ok &= result["sync_check"]["passed"]
        if rank == 0:
            print("\n" + table_markdown(result), flush=True)
    if not args.no_check or not args.no_bench:
        writer.json(".json", result)
        if result["rows"]:
            writer.text(".md", table_markdown(result))

    if args.loss_steps:
        loss, passed = loss_mode(args, world, device, rank, table, init_state)
        ok &= passed
        writer.json("_loss.json", {"meta": result["meta"], **loss})
        if rank == 0 and plot_loss(loss, writer.path("_loss.png")):
            print(f"wrote {writer.path('_loss.png')}", flush=True)

    if args.repeat_check:
        if device.type == "cuda":
            torch.use_deterministic_algorithms(True, warn_only=True)
        rows = [repeat_variant(name, args, world, device, batches, init_state) for name in args.variants
                if VARIANTS[name].experts != "te_grouped" or te_available()]
        passed = all(r["passed"] for r in rows)
        ok &= passed
        if rank == 0:
            for r in rows:
                print(f"repeat {r['variant']}: losses bitwise {r['losses_bitwise']}, parameters bitwise "
                      f"{r['params_bitwise']} (max diff {r['max_param_diff']:.3g})", flush=True)
            print("repeat check: " + ("PASS" if passed else "FAIL"), flush=True)
        writer.json("_repeat.json", {"meta": result["meta"], "rows": rows, "passed": passed})

    if rank == 0:
        if result["check"] is not None:
            print("check: " + ("PASS" if all(c["passed"] for c in result["check"].values()) else "FAIL"), flush=True)
        if result.get("sync_check") is not None:
            print("sync check: " + ("PASS" if result["sync_check"]["passed"] else "FAIL"), flush=True)
        print("all: " + ("PASS" if ok else "FAIL"), flush=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
