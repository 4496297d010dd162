"""Expert parallelism check of moegemm's Megatron experts (``moegemm.megatron.MoegemmExperts``).

    torchrun --nproc_per_node 2 -m bench.examples.megatron_ep            # NCCL, one GPU per process
    torchrun --nproc_per_node 2 -m bench.examples.megatron_ep --cpu      # gloo smoke test on the CPU

Every process builds the same Megatron ``MoELayer`` with expert-parallel size = world size (each rank
holds ``E / world`` experts; Megatron's alltoall dispatcher, or allgather with ``--cpu``) and moegemm
experts, runs forward and backward on its own tokens, and compares the output, the input gradient, the
router gradient (summed over ranks) and the expert weight gradients with a single-process (EP = 1)
computation of the same layer and the same weights that every rank runs on all ranks' tokens, in
process groups of its own (one rank each): once with moegemm experts and once with megatron-core's
``SequentialMLP``. Prints the relative errors (global Frobenius norms) and PASS / FAIL per recipe;
exits 1 on any FAIL.
"""

from __future__ import annotations

import os

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

import argparse  # noqa: E402
import copy  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.examples.dist_setup import init_expert_parallel, init_process_group  # noqa: E402
from bench.preflight import require_cuda_gpu  # noqa: E402

PROG = "torchrun --nproc_per_node 2 -m bench.examples.megatron_ep"

# relative-error thresholds: (vs EP=1 moegemm, vs EP=1 SequentialMLP, router vs SequentialMLP)
TOLERANCES = {"bf16": (1e-2, 2e-2, 2e-2), "fp8_blockwise": (2e-2, 0.1, 0.15)}


def parse_args():
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true",
                   help="gloo on the CPU (moegemm's reference path), allgather dispatcher")
    p.add_argument("--recipes", default="bf16,fp8_blockwise")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--activation", default="swiglu", choices=["swiglu", "geglu", "gelu", "relu"])
    p.add_argument("--dispatcher", default=None, help="alltoall (default on GPU) or allgather")
    return p.parse_args()


def build_mlp(mlp_spec, config, **kwargs):
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    if isinstance(mlp_spec, ModuleSpec):  # megatron-core <= 0.16
        return build_module(mlp_spec, config=config, **kwargs)
    return mlp_spec(config=config, **kwargs)  # builder-style specs (0.17+)


def singleton_collection(group):
    """Megatron's default process-group collection with every group replaced by ``group`` (one rank)."""
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    pgc = copy.copy(get_default_pg_collection())
    for name, value in list(vars(pgc).items()):
        if isinstance(value, dist.ProcessGroup):
            setattr(pgc, name, group)
    return pgc


def all_gather_cat(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim)


def grel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Global relative Frobenius error over all ranks' pieces."""
    d = torch.stack([((a.double() - b.double()) ** 2).sum(), (b.double() ** 2).sum()])
    dist.all_reduce(d)
    return float((d[0] / d[1]).sqrt()) if d[1] > 0 else float(d[0].sqrt())


def grad_or_zeros(p):
    return p.grad if p.grad is not None else torch.zeros_like(p)


def run(layer, x, dy):
    x = x.detach().clone().requires_grad_()
    y, bias = layer(x)
    assert bias is None
    y.backward(dy)
    return y.detach(), x.grad


def main():
    args = parse_args()
    if not args.cpu:
        require_cuda_gpu(PROG)
    warnings.filterwarnings("ignore")
    rank, world, device = init_process_group(args.cpu)
    dispatcher = args.dispatcher or ("allgather" if args.cpu else "alltoall")
    if args.experts % world:
        raise SystemExit(f"--experts ({args.experts}) must be a multiple of the world size ({world})")

    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    import megatron.core

    from moegemm.megatron import MoegemmExperts, patch_layer_spec

    init_expert_parallel(args.cpu, world)
    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group, in order
    ref_pgc = singleton_collection(singles[rank])

    glu, act = {"swiglu": (True, F.silu), "geglu": (True, F.gelu), "gelu": (False, F.gelu),
                "relu": (False, F.relu)}[args.activation]
    E, H, S, B = args.experts, args.hidden, args.seq, args.batch
    El = E // world
    if rank == 0:
        print(f"megatron-core {megatron.core.__version__}, torch {torch.__version__}, {world} ranks on "
              f"{'CPU' if args.cpu else torch.cuda.get_device_name(device)}; E={E} (EP={world}, {El} per rank), "
              f"hidden={H}, ffn={args.ffn}, tokens/rank={S * B}, topk={args.topk}, {args.activation}, "
              f"{dispatcher} dispatcher", flush=True)

    failed = False
    for recipe in [r for r in args.recipes.split(",") if r]:
        cfg = TransformerConfig(
            num_layers=1, hidden_size=H, num_attention_heads=4, num_moe_experts=E, moe_ffn_hidden_size=args.ffn,
            ffn_hidden_size=args.ffn, moe_router_topk=args.topk, moe_token_dispatcher_type=dispatcher,
            moe_router_load_balancing_type="none", expert_model_parallel_size=world,
            use_cpu_initialization=args.cpu, params_dtype=torch.bfloat16, bf16=True, gated_linear_unit=glu,
            activation_func=act, add_bias_linear=False, bias_activation_fusion=False)
        cfg1 = copy.deepcopy(cfg)
        cfg1.expert_model_parallel_size = 1
        seq_spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False)
        spec = patch_layer_spec(seq_spec, recipe=recipe)

        layer = build_mlp(spec.submodules.mlp, cfg)  # EP = world, Megatron's default groups
        assert isinstance(layer.experts, MoegemmExperts) and layer.experts.num_local_experts == El
        ref = build_mlp(spec.submodules.mlp, cfg1, pg_collection=ref_pgc)  # EP = 1, this rank alone
        seq = build_mlp(seq_spec.submodules.mlp, cfg1, pg_collection=ref_pgc)
        assert ref.experts.num_local_experts == E
        layer, ref, seq = layer.to(device), ref.to(device), seq.to(device)  # the router may be built on the CPU
        with torch.no_grad():
            dist.broadcast(layer.router.weight.data, 0)  # the router is replicated
            ref.router.weight.copy_(layer.router.weight)
            ref.experts.linear_fc1.weight.copy_(all_gather_cat(layer.experts.linear_fc1.weight.detach()))
            ref.experts.linear_fc2.weight.copy_(all_gather_cat(layer.experts.linear_fc2.weight.detach()))
        seq.load_state_dict(ref.state_dict(), strict=True)  # moegemm -> SequentialMLP translation

        gen = torch.Generator(device="cpu").manual_seed(20240 + 7919 * rank)
        x = torch.randn(S, B, H, generator=gen).to(device, torch.bfloat16)
        dy = torch.randn(S, B, H, generator=gen).to(device, torch.bfloat16)
        x_all, dy_all = all_gather_cat(x), all_gather_cat(dy)  # rank-major tokens, as the dispatcher orders them
        mine = slice(rank * S, (rank + 1) * S)

        y, dx = run(layer, x, dy)
        router_grad = grad_or_zeros(layer.router.weight).clone()
        dist.all_reduce(router_grad)
        experts = slice(rank * El, (rank + 1) * El)
        for name, refl in (("EP=1 moegemm", ref), ("EP=1 SequentialMLP", seq)):
            y_ref, dx_ref = run(refl, x_all, dy_all)
            if isinstance(refl.experts, MoegemmExperts):
                dw1_ref = grad_or_zeros(refl.experts.linear_fc1.weight)[experts]
                dw2_ref = grad_or_zeros(refl.experts.linear_fc2.weight)[experts]
            else:
                loc = refl.experts.local_experts[rank * El:(rank + 1) * El]
                dw1_ref = torch.stack([grad_or_zeros(m.linear_fc1.weight) for m in loc])
                dw2_ref = torch.stack([grad_or_zeros(m.linear_fc2.weight) for m in loc])
            errs = {"out": grel(y, y_ref[mine]), "dx": grel(dx, dx_ref[mine]),
                    "router": grel(router_grad, grad_or_zeros(refl.router.weight)),
                    "dW1": grel(grad_or_zeros(layer.experts.linear_fc1.weight), dw1_ref),
                    "dW2": grel(grad_or_zeros(layer.experts.linear_fc2.weight), dw2_ref)}
            tol_moe, tol_seq, tol_router = TOLERANCES[recipe]
            if isinstance(refl.experts, MoegemmExperts):
                ok = max(errs.values()) <= tol_moe
                tol_txt = f"<= {tol_moe:g}"
            else:
                ok = all(v <= (tol_router if k == "router" else tol_seq) for k, v in errs.items())
                tol_txt = f"<= {tol_seq:g}, router <= {tol_router:g}"
            failed |= not ok
            if rank == 0:
                detail = ", ".join(f"{k} {v:.2e}" for k, v in errs.items())
                print(f"[{recipe}] EP={world} vs {name}: max rel err {max(errs.values()):.3e} ({detail}; "
                      f"{tol_txt}) {'PASS' if ok else 'FAIL'}", flush=True)
    if rank == 0:
        print("PASS" if not failed else "FAIL", flush=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
