"""Megatron-core integration (moegemm.megatron): MoegemmExperts inside Megatron's MoELayer / GPTModel.

Compared against megatron-core's own ``SequentialMLP`` experts with identical weights (copied through
the state-dict translation): outputs and gradients of the whole MoE layer (router included), checkpoints
both ways (plain ``state_dict`` and distributed checkpoints), Megatron DDP's main_grad protocol, the
parameter attributes Megatron relies on, and the errors. CPU tests run moegemm's reference path with
torch.distributed (gloo, world size 1) and megatron's parallel_state initialised; a few CUDA-only calls
of megatron-core are redirected to the CPU inside the CPU tests only. The ``requires_cuda`` tests repeat
the comparisons on a Hopper GPU with the alltoall dispatcher and run a GPT-MoE training step.
Fresh random inputs every run: no fixed seeds (except for weight initialisation on the GPU, which
megatron's RNG tracker needs).
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import socket
import subprocess
import sys
import types

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core")

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer.moe import moe_utils  # noqa: E402
from megatron.core.transformer.moe.experts import SequentialMLP  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec, build_module  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from moegemm.megatron import (MoegemmExperts, experts_builder, get_gpt_layer_spec, get_moe_layer_spec,  # noqa: E402
                              patch_layer_spec, resolve_activation, resolve_recipe)
import moegemm  # noqa: E402
from moegemm.megatron.config import reserved_sms, resolve_sm_budget  # noqa: E402

from conftest import rel, requires_cuda  # noqa: E402

ACTS = {  # name -> (gated_linear_unit, activation_func)
    "swiglu": (True, F.silu),
    "geglu": (True, F.gelu),
    "gelu": (False, F.gelu),
    "relu": (False, F.relu),
    "squared_relu": (False, None),  # megatron.core.activations.squared_relu, filled in below
}
try:
    from megatron.core.activations import squared_relu as _mc_squared_relu
except ImportError:  # pragma: no cover
    _mc_squared_relu = lambda x: F.relu(x) ** 2  # noqa: E731
ACTS["squared_relu"] = (False, _mc_squared_relu)


# ----------------------------------------------------------------------------------------- fixtures
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def dist_env():
    """torch.distributed (world size 1) + megatron parallel_state, torn down after the module."""
    saved = {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")}
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    created = False
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
        created = True
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                             expert_model_parallel_size=1)
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if created:
            dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _NullStream:
    def wait_event(self, *a, **k):
        pass

    def wait_stream(self, *a, **k):
        pass


@pytest.fixture
def cpu(dist_env, monkeypatch):
    """Megatron on the CPU: its router / optimizer-free paths hard-code a few torch.cuda calls, which are
    redirected here. That redirection breaks Megatron's compiled code paths when a GPU is present, so
    these tests run on GPU-less machines (CI); the *_cuda tests cover the GPU."""
    if torch.cuda.is_available():
        pytest.skip("CPU-path test (redirects torch.cuda calls); runs on machines without a GPU")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: _NullStream())
    # megatron-core 0.16.1 without TransformerEngine references an undefined te_general_gemm
    monkeypatch.setattr(moe_utils, "te_general_gemm", getattr(moe_utils, "te_general_gemm", None), raising=False)
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    monkeypatch.setattr(get_cuda_rng_tracker(), "fork", lambda *a, **k: contextlib.nullcontext())
    return torch.device("cpu")


@pytest.fixture
def gpu(dist_env, monkeypatch):
    monkeypatch.setattr(moe_utils, "te_general_gemm", getattr(moe_utils, "te_general_gemm", None), raising=False)
    return torch.device("cuda", torch.cuda.current_device())


# ----------------------------------------------------------------------------------------- helpers
def make_config(device, activation="swiglu", bias=False, E=8, H=64, ffn=32, topk=2, dispatcher="allgather",
                dtype=torch.bfloat16, **kw):
    glu, act = ACTS[activation]
    return TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=4, num_moe_experts=E, moe_ffn_hidden_size=ffn,
        ffn_hidden_size=ffn, moe_router_topk=topk, moe_token_dispatcher_type=dispatcher,
        moe_router_load_balancing_type="none", use_cpu_initialization=(device.type == "cpu"), params_dtype=dtype,
        bf16=(dtype == torch.bfloat16), gated_linear_unit=glu, activation_func=act, add_bias_linear=bias,
        bias_activation_fusion=False, attention_dropout=0.0, hidden_dropout=0.0, **kw)


def build_mlp(mlp_spec, config, **kwargs):
    """Build a layer spec's mlp: ModuleSpec (megatron-core <= 0.16) or builder (newer)."""
    if isinstance(mlp_spec, ModuleSpec):
        return build_module(mlp_spec, config=config, **kwargs)
    return mlp_spec(config=config, **kwargs)


def build_moe(config, experts="sequential", **experts_kwargs):
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    if experts == "moegemm":
        spec = patch_layer_spec(spec, **experts_kwargs)
    return build_mlp(spec.submodules.mlp, config)


def randomize_biases(layer):
    with torch.no_grad():
        for n, p in layer.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.5)


def pair(config, **experts_kwargs):
    """(SequentialMLP MoELayer, moegemm MoELayer) with identical weights, through the state dicts."""
    ref = build_moe(config, "sequential")
    randomize_biases(ref)
    mine = build_moe(config, "moegemm", **experts_kwargs)
    assert isinstance(ref.experts, SequentialMLP) and isinstance(mine.experts, MoegemmExperts)
    mine.load_state_dict(ref.state_dict(), strict=True)
    return ref, mine


def grad_or_zeros(p):
    return p.grad if p.grad is not None else torch.zeros_like(p)


def run_layer(layer, x, dy):
    x = x.detach().clone().requires_grad_()
    y, bias = layer(x)
    assert bias is None
    y.backward(dy)
    return y.detach(), x.grad


def expert_grads(layer):
    """[(dW1, dW2, db1, db2)] per expert, for either implementation."""
    ex = layer.experts
    out = []
    if isinstance(ex, MoegemmExperts):
        for e in range(ex.num_local_experts):
            out.append(tuple(None if p is None else grad_or_zeros(p)[e]
                             for p in (ex.linear_fc1.weight, ex.linear_fc2.weight, ex.linear_fc1.bias,
                                       ex.linear_fc2.bias)))
    else:
        for m in ex.local_experts:
            out.append(tuple(None if p is None else grad_or_zeros(p)
                             for p in (m.linear_fc1.weight, m.linear_fc2.weight, m.linear_fc1.bias, m.linear_fc2.bias)))
    return out


def compare_layers(ref, mine, x, tol, tol_grad=None, tol_router=None):
    """Relative errors of the moegemm layer vs the SequentialMLP one: output, input gradient, router
    gradient (through the probs) and the experts' weight/bias gradients."""
    tol_grad = tol if tol_grad is None else tol_grad
    tol_router = tol_grad if tol_router is None else tol_router
    dy = torch.randn_like(x)
    y_ref, dx_ref = run_layer(ref, x, dy)
    y, dx = run_layer(mine, x, dy)
    errs = {"out": rel(y, y_ref), "dx": rel(dx, dx_ref),
            "router": rel(grad_or_zeros(mine.router.weight), grad_or_zeros(ref.router.weight))}
    gm, gr = expert_grads(mine), expert_grads(ref)
    stack = lambda gs, i: torch.stack([g[i] for g in gs])  # noqa: E731
    for i, name in enumerate(("dW1", "dW2", "db1", "db2")):
        if gm[0][i] is not None:
            errs[name] = rel(stack(gm, i), stack(gr, i))
    assert errs["out"] <= tol, errs
    assert errs["router"] <= tol_router, errs
    assert all(v <= tol_grad for k, v in errs.items() if k not in ("out", "router")), errs
    return errs


def tokens(config, device, S=16, B=4):
    return torch.randn(S, B, config.hidden_size, device=device, dtype=config.params_dtype)


# ----------------------------------------------------------------------------------------- CPU: numerics
@pytest.mark.parametrize("activation", list(ACTS))
def test_moe_layer_matches_sequential_bf16(cpu, activation):
    cfg = make_config(cpu, activation)
    ref, mine = pair(cfg, recipe="bf16")
    compare_layers(ref, mine, tokens(cfg, cpu), 2e-2, 3e-2 if activation in ("relu", "squared_relu") else 2e-2)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_moe_layer_matches_sequential_fp8(cpu, activation):
    cfg = make_config(cpu, activation, H=128, ffn=128)
    ref, mine = pair(cfg, recipe="fp8_blockwise")
    assert mine.experts.recipe == "fp8_blockwise"
    # the router's gradient goes through softmax/top-k of the probs' gradients <dy, expert output>,
    # which amplifies the FP8 noise a little (observed up to ~0.095)
    compare_layers(ref, mine, tokens(cfg, cpu), 0.1, tol_router=0.15)


def test_moe_layer_fp32_params(cpu):
    cfg = make_config(cpu, "swiglu", dtype=torch.float32)
    ref, mine = pair(cfg)
    compare_layers(ref, mine, tokens(cfg, cpu), 1e-5)


def test_apply_probs_on_input(cpu):
    cfg = make_config(cpu, "swiglu", topk=1, moe_apply_probs_on_input=True, moe_router_pre_softmax=True)
    ref, mine = pair(cfg)
    compare_layers(ref, mine, tokens(cfg, cpu), 2e-2)


def megatron_experts64(seq_experts, x, splits, probs, activation):
    """Megatron's expert MLP semantics in float64, from SequentialMLP's weights:
    ``fc2(act(fc1(x) + b1) * p) + b2 * p`` per expert."""
    outs, start = [], 0
    for m, n in zip(seq_experts.local_experts, splits):
        xe, pe = x[start:start + n].double(), probs[start:start + n].double().unsqueeze(-1)
        w1, w2 = m.linear_fc1.weight.double(), m.linear_fc2.weight.double()
        b1 = m.linear_fc1.bias.double() if m.linear_fc1.bias is not None else None
        b2 = m.linear_fc2.bias.double() if m.linear_fc2.bias is not None else None
        h = F.linear(xe, w1, b1)
        if activation in ("swiglu", "geglu"):
            g, u = torch.chunk(h, 2, dim=-1)
            a = (F.silu(g) if activation == "swiglu" else F.gelu(g)) * u
        else:
            a = {"gelu": F.gelu, "relu": F.relu, "squared_relu": lambda t: F.relu(t) ** 2}[activation](h)
        y = F.linear(a * pe, w2)
        if b2 is not None:
            y = y + b2 * pe
        outs.append(y)
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_experts_bias_semantics(cpu, activation, zipf):
    """add_bias_linear: fc1's bias inside the activation, fc2's bias scaled by the prob (Megatron's MLP).
    (SequentialMLP itself cannot run with biases at TP = EP = 1 in megatron-core: it adds fc2's bias in
    place into a view; the float64 re-implementation of its math is the reference here.)"""
    cfg = make_config(cpu, activation, bias=True, dtype=torch.float32)
    ref, mine = pair(cfg)
    E, H = cfg.num_moe_experts, cfg.hidden_size
    splits = zipf(E, 96)
    x = torch.randn(96, H, requires_grad=True)
    probs = torch.rand(96, requires_grad=True)
    y, bias = mine.experts(x, torch.tensor(splits), probs)
    assert bias is None
    x64, p64 = x.detach().double().requires_grad_(), probs.detach().double().requires_grad_()
    for p in ref.experts.parameters():
        p.requires_grad_(True)
    y64 = megatron_experts64(ref.experts, x64, splits, p64, activation)
    assert rel(y, y64) <= 1e-5
    dy = torch.randn_like(y)
    y.backward(dy)
    y64.backward(dy.double())
    assert rel(x.grad, x64.grad) <= 1e-5
    assert rel(probs.grad, p64.grad) <= 1e-5
    ex = mine.experts
    for e, m in enumerate(ref.experts.local_experts):
        for mine_p, ref_p in ((ex.linear_fc1.weight, m.linear_fc1.weight), (ex.linear_fc2.weight, m.linear_fc2.weight),
                              (ex.linear_fc1.bias, m.linear_fc1.bias), (ex.linear_fc2.bias, m.linear_fc2.bias)):
            assert rel(mine_p.grad[e], grad_or_zeros(ref_p)) <= 1e-5


def test_experts_input_shapes_and_splits_forms(cpu, zipf):
    """[T, H] and [S, B, H] inputs; tokens_per_expert as a list, int32/int64 tensors or numpy."""
    np = pytest.importorskip("numpy")
    cfg = make_config(cpu, "swiglu", dtype=torch.float32)
    ex = build_moe(cfg, "moegemm").experts
    E, H = cfg.num_moe_experts, cfg.hidden_size
    splits = zipf(E, 64)
    x = torch.randn(64, H)
    probs = torch.rand(64)
    y, _ = ex(x, torch.tensor(splits), probs)
    assert y.shape == (64, H)
    for form in (splits, torch.tensor(splits, dtype=torch.int32), np.array(splits)):
        assert torch.equal(ex(x, form, probs)[0], y)
    y3, _ = ex(x.view(16, 4, H), torch.tensor(splits), probs.view(16, 4))
    assert y3.shape == (16, 4, H) and torch.equal(y3.reshape(64, H), y)
    y0, _ = ex(torch.zeros(0, H), torch.zeros(E, dtype=torch.long), torch.zeros(0))
    assert y0.shape == (0, H)
    assert torch.equal(ex(x, torch.tensor(splits, dtype=torch.float32), probs)[0], y)  # torch.histc's counts
    with pytest.raises(TypeError, match=r"tokens_per_expert must hold integer counts, got a torch\.bool tensor"):
        ex(x, torch.tensor(splits) > 0, probs)
    with pytest.raises(TypeError, match=r"permuted_probs must be a tensor or None, got list"):
        ex(x, splits, probs.tolist())
    with pytest.raises(TypeError, match=r"permuted_local_hidden_states must be a tensor or an Fp8Rows, got list"):
        ex(x.tolist(), splits, probs)


# ----------------------------------------------------------------------------------------- CPU: checkpoints
def test_state_dict_keys_match_sequential(cpu):
    cfg = make_config(cpu, "swiglu", bias=True)
    ref, mine = pair(cfg)
    assert list(mine.state_dict().keys()) != [] and set(mine.state_dict()) == set(ref.state_dict())
    assert [k for k, _ in mine.experts.named_parameters()] == ["linear_fc1.weight", "linear_fc1.bias",
                                                               "linear_fc2.weight", "linear_fc2.bias"]


@pytest.mark.parametrize("activation,bias", [("swiglu", False), ("gelu", True)])
def test_torch_save_both_ways(cpu, activation, bias):
    cfg = make_config(cpu, activation, bias=bias)
    ref = build_moe(cfg, "sequential")
    randomize_biases(ref)
    mine = build_moe(cfg, "moegemm")
    buf = io.BytesIO()
    torch.save(ref.state_dict(), buf)
    buf.seek(0)
    mine.load_state_dict(torch.load(buf), strict=True)
    ex = mine.experts
    for e, m in enumerate(ref.experts.local_experts):
        assert torch.equal(ex.linear_fc1.weight[e], m.linear_fc1.weight)
        assert torch.equal(ex.linear_fc2.weight[e], m.linear_fc2.weight)
        if bias:
            assert torch.equal(ex.linear_fc1.bias[e], m.linear_fc1.bias)
            assert torch.equal(ex.linear_fc2.bias[e], m.linear_fc2.bias)
    assert torch.equal(mine.router.weight, ref.router.weight)
    # and back, after changing the moegemm weights
    with torch.no_grad():
        for p in mine.experts.parameters():
            p.add_(torch.randn_like(p))
    buf = io.BytesIO()
    torch.save(mine.state_dict(), buf)
    buf.seek(0)
    fresh = build_moe(cfg, "sequential")
    fresh.load_state_dict(torch.load(buf), strict=True)
    for e, m in enumerate(fresh.experts.local_experts):
        assert torch.equal(ex.linear_fc1.weight[e], m.linear_fc1.weight)
        assert torch.equal(ex.linear_fc2.weight[e], m.linear_fc2.weight)
        if bias:
            assert torch.equal(ex.linear_fc2.bias[e], m.linear_fc2.bias)


def test_load_te_grouped_keys(cpu):
    """TEGroupedMLP's layout: linear_fc1.weight{i} / linear_fc2.weight{i} (+ TE extra states)."""
    cfg = make_config(cpu, "swiglu")
    ref = build_moe(cfg, "sequential")
    mine = build_moe(cfg, "moegemm")
    sd = {"router.weight": ref.router.weight.detach().clone()}
    for e, m in enumerate(ref.experts.local_experts):
        sd[f"experts.linear_fc1.weight{e}"] = m.linear_fc1.weight.detach().clone()
        sd[f"experts.linear_fc2.weight{e}"] = m.linear_fc2.weight.detach().clone()
    sd["experts.linear_fc1._extra_state"] = None
    sd["experts.linear_fc2._extra_state"] = None
    mine.load_state_dict(sd, strict=True)
    for e, m in enumerate(ref.experts.local_experts):
        assert torch.equal(mine.experts.linear_fc1.weight[e], m.linear_fc1.weight)


def test_load_incomplete_keys_fails(cpu):
    cfg = make_config(cpu, "swiglu")
    ref = build_moe(cfg, "sequential")
    mine = build_moe(cfg, "moegemm")
    sd = ref.state_dict()
    del sd["experts.local_experts.3.linear_fc1.weight"]
    with pytest.raises(RuntimeError, match="linear_fc1"):
        mine.load_state_dict(sd, strict=True)


@pytest.mark.parametrize("activation,singleton", [("swiglu", False), ("gelu", False), ("swiglu", True),
                                                  ("relu", True)])
def test_distributed_checkpoint_both_ways(cpu, tmp_path, activation, singleton):
    pytest.importorskip("psutil")  # megatron's torch_dist checkpoint writer needs it
    from megatron.core import dist_checkpointing

    cfg = make_config(cpu, activation)
    ref = build_moe(cfg, "sequential")
    mine = build_moe(cfg, "moegemm")
    md = {"singleton_local_shards": singleton}
    prefix = "decoder.layers.0.mlp."

    def save(layer, d):
        d.mkdir()
        dist_checkpointing.save(layer.sharded_state_dict(prefix=prefix, metadata=md), str(d))

    def load(layer, d):
        sd = dist_checkpointing.load(layer.sharded_state_dict(prefix=prefix, metadata=md), str(d))
        layer.load_state_dict({k[len(prefix):]: v for k, v in sd.items()}, strict=True)

    save(ref, tmp_path / "seq")
    load(mine, tmp_path / "seq")
    for e, m in enumerate(ref.experts.local_experts):
        assert torch.equal(mine.experts.linear_fc1.weight[e], m.linear_fc1.weight)
        assert torch.equal(mine.experts.linear_fc2.weight[e], m.linear_fc2.weight)
    with torch.no_grad():
        for p in mine.experts.parameters():
            p.mul_(-2)
    save(mine, tmp_path / "moegemm")
    load(ref, tmp_path / "moegemm")
    for e, m in enumerate(ref.experts.local_experts):
        assert torch.equal(mine.experts.linear_fc1.weight[e], m.linear_fc1.weight)
        assert torch.equal(mine.experts.linear_fc2.weight[e], m.linear_fc2.weight)


def test_sharded_state_dict_keys(cpu):
    """Global keys and shapes are SequentialMLP's (so TEGroupedMLP's too)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    cfg = make_config(cpu, "swiglu", bias=True)
    ref = build_moe(cfg, "sequential")
    mine = build_moe(cfg, "moegemm")

    def summary(layer):
        sd = layer.sharded_state_dict(prefix="mlp.")
        apply_factories(sd)
        out = {}
        for v in nested_values(sd):
            if isinstance(v, ShardedTensor):
                out.setdefault(v.key, set()).add(tuple(v.global_shape))
            elif isinstance(v, ShardedObject):
                out.setdefault(v.key, set()).add("object")
        return out

    assert summary(mine) == summary(ref)


# ----------------------------------------------------------------------------------------- CPU: DDP and grads
def test_param_attributes(cpu):
    cfg = make_config(cpu, "swiglu", bias=True)
    mine = build_moe(cfg, "moegemm")
    for n, p in mine.experts.named_parameters():
        assert p.allreduce is False, n
        assert p.sequence_parallel is False, n
    for p in (mine.experts.linear_fc1.weight, mine.experts.linear_fc2.weight, mine.experts.linear_fc1.bias):
        assert p.tensor_model_parallel is True
    assert getattr(mine.router.weight, "allreduce", True) is True
    assert mine.experts.linear_fc1.weight.shape == (8, 64, 64) and mine.experts.linear_fc2.weight.shape == (8, 64, 32)


def test_main_grad_accumulation(cpu, zipf):
    """wgrad accumulates into an fp32 main_grad (weight.grad stays None), bit-for-bit the gradient."""
    cfg = make_config(cpu, "swiglu", dtype=torch.float32)
    ex = build_moe(cfg, "moegemm").experts
    plain = build_moe(cfg, "moegemm").experts
    plain.load_state_dict(ex.state_dict())
    E, H = cfg.num_moe_experts, cfg.hidden_size
    splits = torch.tensor(zipf(E, 64))
    x, probs, dy = torch.randn(64, H), torch.rand(64), torch.randn(64, H)
    plain(x, splits, probs)[0].backward(dy)
    for p in (ex.linear_fc1.weight, ex.linear_fc2.weight):
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
    for _ in range(2):
        ex(x, splits, probs)[0].backward(dy)
    for p, q in ((ex.linear_fc1.weight, plain.linear_fc1.weight), (ex.linear_fc2.weight, plain.linear_fc2.weight)):
        assert p.grad is None
        assert rel(p.main_grad, 2 * q.grad) <= 1e-6


def _overwrite_main_grad(device, zipf):
    """Megatron-FSDP's overwrite_main_grad on the expert weights: wgrad written over stale main_grad values."""
    cfg = make_config(device, "swiglu", dtype=torch.float32)
    ex = build_moe(cfg, "moegemm").experts.to(device)
    plain = build_moe(cfg, "moegemm").experts.to(device)
    plain.load_state_dict(ex.state_dict())
    E, H = cfg.num_moe_experts, cfg.hidden_size
    splits = torch.tensor(zipf(E, 64), device=device)
    x, probs, dy = torch.randn(64, H, device=device), torch.rand(64, device=device), torch.randn(64, H, device=device)
    plain(x, splits, probs)[0].backward(dy)
    for p in (ex.linear_fc1.weight, ex.linear_fc2.weight):
        p.main_grad = torch.full(p.shape, float("nan"), device=device)
        p.overwrite_main_grad = True
    for _ in range(2):
        ex(x, splits, probs)[0].backward(dy)
    for p, q in ((ex.linear_fc1.weight, plain.linear_fc1.weight), (ex.linear_fc2.weight, plain.linear_fc2.weight)):
        assert p.grad is None and torch.isfinite(p.main_grad).all()
        assert rel(p.main_grad, q.grad) <= 1e-6


def test_overwrite_main_grad(cpu, zipf):
    _overwrite_main_grad(cpu, zipf)


@requires_cuda
def test_overwrite_main_grad_cuda(gpu, zipf):
    _overwrite_main_grad(gpu, zipf)


def test_main_grad_ddp_protocol(cpu, zipf):
    """With Megatron DDP's ``grad_added_to_main_grad`` flag, a dummy grad reaches the grad accumulator
    (so DDP's hook fires) and the flag tells the hook the gradient is already in main_grad. A main_grad
    moegemm cannot take (bf16) gets the real gradient through the hook instead."""
    cfg = make_config(cpu, "swiglu")
    ex = build_moe(cfg, "moegemm").experts
    E, H = cfg.num_moe_experts, cfg.hidden_size
    splits = torch.tensor(zipf(E, 64))
    x = torch.randn(64, H, dtype=torch.bfloat16)
    w1, w2 = ex.linear_fc1.weight, ex.linear_fc2.weight
    w1.main_grad, w1.grad_added_to_main_grad = torch.zeros(w1.shape), False
    w2.main_grad, w2.grad_added_to_main_grad = torch.zeros(w2.shape, dtype=torch.bfloat16), False
    fired = []
    for w in (w1, w2):
        w.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    ex(x, splits, torch.rand(64))[0].float().sum().backward()
    assert len(fired) == 2
    assert w1.grad_added_to_main_grad is True and w1.main_grad.abs().sum() > 0 and w1.grad is not None
    assert w2.grad_added_to_main_grad is False and w2.main_grad.abs().sum() == 0 and w2.grad.abs().sum() > 0


def test_megatron_ddp_overlap_grad_reduce(cpu):
    """Megatron's DistributedDataParallel (overlap_grad_reduce, fp32 grad buffers) around both layers."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    cfg = make_config(cpu, "swiglu")
    ref, mine = pair(cfg)
    dcfg = DistributedDataParallelConfig(overlap_grad_reduce=True, grad_reduce_in_fp32=True)
    dref, dmine = DistributedDataParallel(cfg, dcfg, ref), DistributedDataParallel(cfg, dcfg, mine)
    x = tokens(cfg, cpu)
    for m in (dref, dmine):
        m.zero_grad_buffer()
        for mb in range(2):  # two micro-batches, gradient reduction overlapped with the last one
            with m.no_sync() if mb == 0 else contextlib.nullcontext():
                m(x)[0].float().square().sum().backward()
        m.finish_grad_sync()
    for e, m in enumerate(ref.experts.local_experts):
        assert rel(mine.experts.linear_fc1.weight.main_grad[e], m.linear_fc1.weight.main_grad) <= 2e-2
        assert rel(mine.experts.linear_fc2.weight.main_grad[e], m.linear_fc2.weight.main_grad) <= 2e-2
    assert rel(mine.router.weight.main_grad, ref.router.weight.main_grad) <= 2e-2
    assert mine.experts.linear_fc1.weight.grad is None


def test_fp8_weight_cache_never_stale(cpu, zipf):
    cfg = make_config(cpu, "swiglu", H=128, ffn=128, dtype=torch.float32)
    cached = build_moe(cfg, "moegemm", recipe="fp8_blockwise", fp8_weight_cache=True).experts
    fresh = build_moe(cfg, "moegemm", recipe="fp8_blockwise", fp8_weight_cache=False).experts
    fresh.load_state_dict(cached.state_dict())
    E, H = cfg.num_moe_experts, cfg.hidden_size
    splits = torch.tensor(zipf(E, 64))
    x, probs = torch.randn(64, H), torch.rand(64)
    y = cached(x, splits, probs)[0]
    first = cached._fp8_cache.copies()
    assert torch.equal(cached(x, splits, probs)[0], y) and cached._fp8_cache.copies() is not None
    assert all(a is b for a, b in zip(cached._fp8_cache.copies(), first))  # reused within a step
    y.sum().backward()
    torch.optim.SGD(cached.parameters(), lr=1.0).step()  # in-place update: the cache must notice
    fresh.load_state_dict(cached.state_dict())
    assert torch.equal(cached(x, splits, probs)[0], fresh(x, splits, probs)[0])
    assert all(a is not b for a, b in zip(cached._fp8_cache.copies(), first))


# ----------------------------------------------------------------------------------------- CPU: config, specs, errors
def test_resolve_recipe(cpu, monkeypatch):
    cfg = make_config(cpu, "swiglu")
    monkeypatch.delenv("MOEGEMM_MEGATRON_RECIPE", raising=False)
    assert resolve_recipe(cfg) == "bf16"
    cfg.fp8 = "e4m3"  # TransformerConfig refuses fp8 + MoE without TransformerEngine at construction
    assert resolve_recipe(cfg) == "fp8_blockwise"
    monkeypatch.setenv("MOEGEMM_MEGATRON_RECIPE", "bf16")
    assert resolve_recipe(cfg) == "bf16"
    assert resolve_recipe(cfg, "fp8_blockwise") == "fp8_blockwise"
    with pytest.raises(ValueError, match="recipe"):
        resolve_recipe(cfg, "fp4")
    monkeypatch.setenv("MOEGEMM_MEGATRON_RECIPE", "fp4")
    with pytest.raises(ValueError, match="MOEGEMM_MEGATRON_RECIPE='fp4' must be one of"):
        resolve_recipe(cfg)
    monkeypatch.setenv("MOEGEMM_MEGATRON_RECIPE", " ")
    assert resolve_recipe(cfg) == "fp8_blockwise"  # blank: unset
    cfg.fp8 = None
    monkeypatch.setenv("MOEGEMM_MEGATRON_RECIPE", "fp8_blockwise")
    ex = MoegemmExperts(4, cfg)
    assert ex.recipe == "fp8_blockwise" and ex.fp8_weight_cache is True  # automatic, whatever config.fp8 says
    assert MoegemmExperts(4, cfg, fp8_weight_cache=False).fp8_weight_cache is False


def test_sm_budget_from_dispatcher_config():
    def cfg(dispatcher, backend="deepep", deepep=20, hybridep=16, enable_deepep=False):
        return types.SimpleNamespace(moe_token_dispatcher_type=dispatcher, moe_flex_dispatcher_backend=backend,
                                     moe_deepep_num_sms=deepep, moe_hybridep_num_sms=hybridep,
                                     moe_enable_deepep=enable_deepep)

    # the flex dispatcher's communication kernels keep their SMs; the experts get the rest
    assert reserved_sms(cfg("flex")) == 20 and resolve_sm_budget(cfg("flex"), 132) == 112
    assert reserved_sms(cfg("flex", "hybridep")) == 16 and resolve_sm_budget(cfg("flex", "hybridep"), 132) == 116
    assert resolve_sm_budget(cfg("flex", "hybridep", enable_deepep=True), 132) == 112  # the deprecated switch
    assert resolve_sm_budget(cfg("flex", deepep=24), 78) == 54
    # the other dispatchers reserve nothing: no budget
    for dispatcher in ("alltoall", "allgather"):
        assert reserved_sms(cfg(dispatcher)) == 0 and resolve_sm_budget(cfg(dispatcher), 132) is None
    assert resolve_sm_budget(cfg("flex", deepep=0), 132) is None
    assert resolve_sm_budget(types.SimpleNamespace(), 132) is None  # an older config without the fields
    with pytest.raises(ValueError, match="moe_deepep_num_sms"):
        resolve_sm_budget(cfg("flex", deepep=132), 132)
    with pytest.raises(ValueError, match="moe_deepep_num_sms"):
        reserved_sms(cfg("flex", deepep=-1))


def test_resolve_activation(cpu):
    def cfg(glu, fn):
        return types.SimpleNamespace(gated_linear_unit=glu, activation_func=fn)

    assert resolve_activation(cfg(True, F.silu)) == "swiglu"
    assert resolve_activation(cfg(True, F.gelu)) == "geglu"
    assert resolve_activation(cfg(False, F.gelu)) == "gelu"
    assert resolve_activation(cfg(False, F.relu)) == "relu"
    assert resolve_activation(cfg(False, _mc_squared_relu)) == "squared_relu"
    assert resolve_activation(cfg(False, lambda x: F.relu(x) ** 2)) == "squared_relu"
    assert resolve_activation(cfg(False, lambda x: torch.pow(torch.relu(x), 2))) == "squared_relu"
    assert resolve_activation(cfg(True, lambda x: x * torch.sigmoid(x))) == "swiglu"
    for glu, fn in ((False, F.silu), (False, torch.tanh), (True, F.relu),
                    (True, lambda x: x * torch.sigmoid(1.702 * x)),  # quick_gelu
                    (False, lambda x: F.gelu(x, approximate="tanh"))):
        with pytest.raises(ValueError, match="activation_func"):
            resolve_activation(cfg(glu, fn))
    with pytest.raises(ValueError, match="glu_linear_offset"):
        resolve_activation(types.SimpleNamespace(gated_linear_unit=True, activation_func=F.silu,
                                                 glu_linear_offset=1.0))


class _FakeGroup:
    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size

    def rank(self):
        return 0


def test_expert_tensor_parallel_error(cpu):
    cfg = make_config(cpu, "swiglu")
    pgs = types.SimpleNamespace(ep=_FakeGroup(1), expt_tp=_FakeGroup(2), expt_dp=_FakeGroup(1))
    with pytest.raises(ValueError, match="expert tensor parallel size must be 1|expert tensor parallel"):
        MoegemmExperts(4, cfg, pg_collection=pgs)
    cfg.expert_tensor_parallel_size = 2
    with pytest.raises(ValueError, match="expert tensor parallel"):
        MoegemmExperts(4, cfg)


def test_unsupported_config_errors(cpu):
    cfg = make_config(cpu, "swiglu")
    bad = copy.copy(cfg)
    bad.gated_linear_unit, bad.activation_func = False, F.silu
    with pytest.raises(ValueError, match="activation_func"):
        MoegemmExperts(4, bad)
    with pytest.raises(ValueError, match="multiple of 16"):
        MoegemmExperts(4, make_config(cpu, "swiglu", ffn=40))
    with pytest.raises(ValueError, match=r"^num_local_experts must be in \[1, 1024\], got 2000$"):
        MoegemmExperts(2000, make_config(cpu, "swiglu", H=1 << 20, ffn=1 << 20))  # refused before allocating
    ex = MoegemmExperts(4, cfg)
    with pytest.raises(NotImplementedError, match="output_buffer"):
        ex(torch.zeros(0, 64), [0, 0, 0, 0], torch.zeros(0), output_buffer=torch.zeros(1))
    with pytest.raises(ValueError, match="hidden_size"):
        ex(torch.zeros(4, 32), [1, 1, 1, 1], torch.zeros(4))


def test_specs(cpu):
    cfg = make_config(cpu, "swiglu")
    spec = get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False)
    before = repr(spec)
    patched = patch_layer_spec(spec, recipe="fp8_blockwise")
    assert repr(spec) == before  # the input spec is not modified
    layer = build_mlp(patched.submodules.mlp, cfg)
    assert isinstance(layer.experts, MoegemmExperts) and layer.experts.recipe == "fp8_blockwise"
    assert isinstance(build_mlp(get_moe_layer_spec(num_experts=8), cfg).experts, MoegemmExperts)
    layer = build_mlp(get_gpt_layer_spec(num_experts=8).submodules.mlp, cfg)
    assert isinstance(layer.experts, MoegemmExperts) and layer.experts.recipe == "bf16"
    assert experts_builder() is MoegemmExperts
    with pytest.raises(ValueError, match="no MoE layer"):
        patch_layer_spec(get_gpt_layer_local_spec())


def test_constructor_arguments_checked_at_construction(cpu):
    """The experts' own arguments and what they read from the config, checked before any allocation, each error
    naming the argument (fp16 params used to fail only at the first forward)."""
    with pytest.raises(TypeError) as err:
        MoegemmExperts(4, make_config(cpu, "swiglu", dtype=torch.float16))
    assert str(err.value) == ("config.params_dtype must be one of (torch.bfloat16, torch.float32) (the dtype of the "
                              "expert weights), got torch.float16")
    with pytest.raises(TypeError, match=r"^num_local_experts must be an int, got float 4\.0$"):
        MoegemmExperts(4.0, make_config(cpu, "swiglu"))
    with pytest.raises(ValueError, match=r"^num_local_experts must be in \[1, 1024\], got 0$"):
        MoegemmExperts(0, make_config(cpu, "swiglu"))
    with pytest.raises(ValueError, match=r"^config\.moe_ffn_hidden_size must be a positive multiple of 16, got 40$"):
        MoegemmExperts(4, make_config(cpu, "swiglu", ffn=40))
    with pytest.raises(ValueError, match=r"^config\.hidden_size must be a positive multiple of 16, got 72$"):
        MoegemmExperts(4, make_config(cpu, "swiglu", H=72))
    with pytest.raises(TypeError, match=r"^fp8_weight_cache must be True or False, got str 'no'$"):
        MoegemmExperts(4, make_config(cpu, "swiglu"), fp8_weight_cache="no")
    with pytest.raises(ValueError, match=r"^recipe must be one of \('bf16', 'fp8_blockwise'\), got 'fp8'$"):
        MoegemmExperts(4, make_config(cpu, "swiglu"), recipe="fp8")
    assert MoegemmExperts(4, make_config(cpu, "swiglu", dtype=torch.float32)).linear_fc1.weight.dtype == torch.float32


def test_spec_arguments_checked_when_the_spec_is_made():
    """The experts' keyword arguments given to the spec helpers are checked there, not when Megatron builds the layer."""
    with pytest.raises(ValueError, match=r"^recipe must be one of \('bf16', 'fp8_blockwise'\), got 'fp8'$"):
        get_gpt_layer_spec(num_experts=8, recipe="fp8")
    with pytest.raises(TypeError, match=r"^unexpected keyword arguments for MoegemmExperts: \['recipie'\]; it takes "
                                        r"\['recipe', 'fp8_weight_cache'\]$"):
        patch_layer_spec(get_gpt_layer_local_spec(num_experts=8), recipie="bf16")
    with pytest.raises(TypeError, match=r"^fp8_weight_cache must be True or False, got int 1$"):
        experts_builder(fp8_weight_cache=1)
    assert experts_builder(recipe="bf16", fp8_weight_cache=False).params == {"recipe": "bf16", "fp8_weight_cache": False}


def test_import_moegemm_does_not_import_megatron():
    code = "import sys, moegemm; sys.exit(any(m == 'megatron' or m.startswith('megatron.') for m in sys.modules))"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert subprocess.run([sys.executable, "-c", code], cwd=root).returncode == 0


def gpt_batch(device, B=4, S=32, vocab=128):
    tok = torch.randint(0, vocab, (B, S), device=device)
    pos = torch.arange(S, device=device).unsqueeze(0).expand(B, S)
    mask = torch.ones(S, S, dtype=torch.bool, device=device).tril().logical_not().view(1, 1, S, S)
    return tok, pos, mask, torch.roll(tok, -1, 1)


def build_gpt(cfg, experts, **experts_kwargs):
    from megatron.core.models.gpt import GPTModel

    if experts == "moegemm":
        spec = get_gpt_layer_spec(num_experts=cfg.num_moe_experts, **experts_kwargs)
    else:
        spec = get_gpt_layer_local_spec(num_experts=cfg.num_moe_experts, moe_grouped_gemm=False)
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=128, max_sequence_length=32,
                    position_embedding_type="rope")


def test_gpt_model_cpu(cpu):
    """A 2-layer GPT-MoE: the SequentialMLP model's state dict loads into the moegemm one (strict), the
    losses and gradients agree, and a few Adam steps train it."""
    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=4,
                            moe_ffn_hidden_size=32, ffn_hidden_size=128, moe_router_topk=2,
                            moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none",
                            use_cpu_initialization=True, params_dtype=torch.float32, gated_linear_unit=True,
                            activation_func=F.silu, add_bias_linear=False, bias_activation_fusion=False,
                            attention_dropout=0.0, hidden_dropout=0.0)
    ref, mine = build_gpt(cfg, "sequential"), build_gpt(cfg, "moegemm")
    assert sum(isinstance(m, MoegemmExperts) for m in mine.modules()) == 2
    mine.load_state_dict(ref.state_dict(), strict=True)
    tok, pos, mask, labels = gpt_batch(cpu)
    losses = []
    for model in (ref, mine):
        loss = model(tok, pos, mask, labels=labels).float().mean()
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) <= 1e-4 * abs(losses[0])
    emb = lambda m: m.embedding.word_embeddings.weight.grad  # noqa: E731
    assert rel(emb(mine), emb(ref)) <= 1e-4
    ref.load_state_dict(mine.state_dict(), strict=True)  # and back
    opt = torch.optim.Adam(mine.parameters(), lr=3e-3)
    first = None
    for _ in range(8):
        opt.zero_grad()
        loss = mine(tok, pos, mask, labels=labels).float().mean()
        loss.backward()
        opt.step()
        first = loss.item() if first is None else first
    assert loss.item() < 0.9 * first


# ----------------------------------------------------------------------------------------- GPU
@requires_cuda
def test_experts_take_the_sm_budget_from_the_flex_dispatcher_cuda(gpu):
    device_sms = torch.cuda.get_device_properties(gpu).multi_processor_count
    before = moegemm.get_num_sms()
    try:
        moegemm.set_num_sms(None)
        MoegemmExperts(4, make_config(gpu, "swiglu", dispatcher="alltoall"))
        assert moegemm.get_num_sms() is None  # NCCL's all-to-all: no budget
        MoegemmExperts(4, make_config(gpu, "swiglu", dispatcher="flex", moe_deepep_num_sms=24))
        assert moegemm.get_num_sms() == device_sms - 24
        moegemm.set_num_sms(7)  # the user's budget is kept
        MoegemmExperts(4, make_config(gpu, "swiglu", dispatcher="flex", moe_deepep_num_sms=24))
        assert moegemm.get_num_sms() == 7
    finally:
        moegemm.set_num_sms(before)


@requires_cuda
@pytest.mark.parametrize("recipe,activation", [("bf16", "swiglu"), ("bf16", "gelu"), ("fp8_blockwise", "swiglu"),
                                               ("fp8_blockwise", "squared_relu")])
def test_moe_layer_matches_sequential_cuda(gpu, recipe, activation):
    cfg = make_config(gpu, activation, H=256, ffn=128, dispatcher="alltoall")
    ref, mine = pair(cfg, recipe=recipe)
    assert mine.experts.linear_fc1.weight.is_cuda
    tol = 2e-2 if recipe == "bf16" else 0.1
    compare_layers(ref, mine, tokens(cfg, gpu, S=64), tol, tol if activation != "squared_relu" else 0.15,
                   tol_router=2e-2 if recipe == "bf16" else 0.15)


@requires_cuda
@pytest.mark.parametrize("recipe", ["bf16", "fp8_blockwise"])
def test_experts_device_splits_no_sync_cuda(gpu, recipe, zipf):
    """Device tokens_per_expert, biases included: forward and backward never synchronise."""
    cfg = make_config(gpu, "swiglu", bias=True, H=256, ffn=128)
    ex = build_moe(cfg, "moegemm", recipe=recipe).experts
    E, H = cfg.num_moe_experts, cfg.hidden_size
    splits = torch.tensor(zipf(E, 300), device=gpu)
    x = torch.randn(300, H, device=gpu, dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(300, device=gpu, requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y, _ = ex(x, splits, probs)
        y.float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = ex(x.detach(), splits.cpu(), probs.detach())[0]
    assert rel(y.detach(), ref) <= 1e-3
    assert x.grad is not None and probs.grad is not None and ex.linear_fc2.bias.grad is not None


@requires_cuda
@pytest.mark.parametrize("recipe", ["bf16", "fp8_blockwise"])
def test_experts_zero_tokens_cuda(gpu, recipe):
    """An EP rank that receives no token: empty output, and every expert weight still gets a (zero)
    gradient through main_grad, so Megatron DDP's hooks fire."""
    cfg = make_config(gpu, "swiglu", H=256, ffn=128)
    ex = build_moe(cfg, "moegemm", recipe=recipe).experts
    E, H = cfg.num_moe_experts, cfg.hidden_size
    fired = []
    for p in (ex.linear_fc1.weight, ex.linear_fc2.weight):
        p.main_grad, p.grad_added_to_main_grad = torch.zeros(p.shape, device=gpu), False
        p.register_post_accumulate_grad_hook(lambda q: fired.append(q))
    x = torch.zeros(0, H, device=gpu, dtype=torch.bfloat16, requires_grad=True)
    y, _ = ex(x, torch.zeros(E, dtype=torch.long, device=gpu), torch.zeros(0, device=gpu, requires_grad=True))
    assert y.shape == (0, H)
    y.float().sum().backward()
    assert len(fired) == 2
    assert ex.linear_fc1.weight.main_grad.abs().sum() == 0 and ex.linear_fc2.weight.main_grad.abs().sum() == 0


@requires_cuda
@pytest.mark.parametrize("recipe", ["bf16", "fp8_blockwise"])
def test_gpt_training_step_cuda(gpu, recipe):
    """GPTModel + moegemm experts under Megatron DDP (overlap_grad_reduce, fp32 main grads) and
    Megatron's distributed optimizer: the loss goes down and expert weights move."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    cfg = TransformerConfig(num_layers=2, hidden_size=128, num_attention_heads=4, num_moe_experts=8,
                            moe_ffn_hidden_size=128, ffn_hidden_size=256, moe_router_topk=2,
                            moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=1e-2,
                            params_dtype=torch.bfloat16, bf16=True, gated_linear_unit=True, activation_func=F.silu,
                            add_bias_linear=False, bias_activation_fusion=False, attention_dropout=0.0,
                            hidden_dropout=0.0)
    from megatron.core.transformer.module import Float16Module

    # bf16 training wraps the model in Float16Module, as Megatron's training loop does
    model = Float16Module(cfg, build_gpt(cfg, "moegemm", recipe=recipe, fp8_weight_cache=recipe == "fp8_blockwise").cuda())
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(overlap_grad_reduce=True, grad_reduce_in_fp32=True,
                                                                     use_distributed_optimizer=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=3e-3, bf16=True, use_distributed_optimizer=True),
                                 [ddp])
    experts = [m for m in model.modules() if isinstance(m, MoegemmExperts)]
    w0 = experts[0].linear_fc1.weight.detach().clone()
    tok, pos, mask, labels = gpt_batch(gpu)
    losses = []
    for _ in range(10):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        for mb in range(2):  # two micro-batches per step, as Megatron's schedule runs them
            for m in experts:
                m.is_first_microbatch = mb == 0
            with ddp.no_sync() if mb == 0 else contextlib.nullcontext():
                loss = ddp(tok, pos, mask, labels=labels).float().mean()
                loss.backward()
        ddp.finish_grad_sync()
        ok, grad_norm, _ = opt.step()
        assert ok and grad_norm is not None and torch.isfinite(torch.tensor(grad_norm))
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses
    assert not torch.equal(experts[0].linear_fc1.weight, w0)
