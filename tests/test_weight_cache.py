"""The FP8 weight cache (``moegemm/weight_cache.py``) of GroupedMLP and the Megatron experts.

Never stale: after torch.optim steps (SGD, AdamW; for-loop, foreach and fused), ``load_state_dict``,
in-place edits, and ``.data`` writes followed by the explicit call; every output and gradient equals the
no-cache path's bitwise. Re-quantized once per optimizer step, not per micro-batch (quantizer calls
counted). ``is_first_microbatch`` True/False, ``fp8_weight_cache=False``, ``to_fp8_inference``,
``torch.compile``, copies and pickling, the CUDA-graph rules (simulated on the CPU, real capture on a
Hopper GPU) and the Megatron experts (Megatron's schedule flag, its optimizers' ``.data`` copies).
CPU cases run the reference path; ``cuda`` cases need a Hopper GPU. Fresh random inputs every run.
"""

from __future__ import annotations

import contextlib
import copy
import io
import pickle

import pytest
import torch

import moegemm
from moegemm import GroupedMLP, reference, weight_cache
from moegemm.backends import reference as reference_backend

from conftest import HAS_HOPPER, capture_step, rel, requires_cuda, zipf_splits

DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]
E, H, FFN, T = 4, 128, 128, 200

try:  # the Megatron experts' tests reuse test_megatron's fixtures (imported by name: pytest finds them)
    import megatron.core  # noqa: F401

    from test_megatron import build_gpt, build_moe, cpu, dist_env, gpt_batch, gpu, make_config  # noqa: F401
    from moegemm.megatron import MoegemmExperts

    HAS_MEGATRON = True
except ImportError:
    HAS_MEGATRON = False
requires_megatron = pytest.mark.skipif(not HAS_MEGATRON, reason="needs megatron-core")


# ----------------------------------------------------------------------------------------- helpers
_QUANTIZE = {"cpu": reference_backend.quantize_weight}  # the unpatched quantizers (the fixture counts calls)
if HAS_HOPPER:
    from moegemm.backends import cuda as cuda_ops

    _QUANTIZE["cuda"] = cuda_ops.quantize_weight


def make_mlp(device, cache=True, bias=True, dtype=None):
    return GroupedMLP(E, H, FFN, activation="swiglu", bias=bias, recipe="fp8_blockwise", device=device, dtype=dtype,
                      fp8_weight_cache=cache)


def batch(device):
    splits = zipf_splits(E, T)
    x = torch.randn(T, H, device=device, dtype=torch.bfloat16, requires_grad=True)
    return x, torch.tensor(splits, device=device), torch.rand(T, device=device), torch.randn_like(x)


def fwd_bwd(m, x, splits, p, dy, **kw):
    """(y, dx, grads of m's parameters), fresh gradients."""
    x = x.detach().requires_grad_()
    m.zero_grad(set_to_none=False)
    y = m(x, splits, p, **kw)
    y.backward(dy)
    return [y.detach(), x.grad] + [q.grad.clone() for q in m.parameters()]


def fwd(m, x, splits, p, **kw):
    with torch.no_grad():
        return m(x, splits, p, **kw)


def assert_same(a, b):
    for u, v in zip(a, b):
        assert torch.equal(u, v)


def bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def is_quantization_of(copies, w) -> bool:
    """``copies`` (q, s, qT, sT) are bitwise ``quantize_weight(w)``."""
    with torch.no_grad():
        want = _QUANTIZE[w.device.type](w.detach().contiguous())
    return all(torch.equal(bits(c), bits(f)) for c, f in zip(copies, want))


def cached_equals_current(m) -> bool:
    """The kept copies are those of the current weights (bitwise)."""
    kept = m._fp8_cache.copies()
    return kept is not None and all(is_quantization_of(c, w) for c, w in zip(kept, (m.fc1.weight, m.fc2.weight)))


def same_copies(a, b) -> bool:
    """The same cached tensors (not merely equal values)."""
    return all(x is y for u, v in zip(a, b) for x, y in zip(u, v))


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9, foreach=False),
    "sgd-foreach": lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9, foreach=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
}


# ----------------------------------------------------------------------------------------- torch's counters
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_torch_optimizer_steps_and_version_counters(opt):
    """What the cache relies on, on this torch: for-loop and foreach steps bump ``_version``; fused steps
    need not (on CPU torch 2.13 they do not), which the global step post-hook covers."""
    p = torch.nn.Parameter(torch.randn(16, 16, dtype=torch.bfloat16))
    o = OPTIMIZERS[opt]([p])
    p.grad = torch.randn_like(p)
    v, g = p._version, weight_cache.generation()
    weight_cache.FP8WeightCache()  # registers the hook (once per process)
    o.step()
    if not opt.endswith("fused"):
        assert p._version > v
    assert weight_cache.generation() > g


# ----------------------------------------------------------------------------------------- never stale
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_never_stale_after_optimizer_steps_and_once_per_step(device, opt, quant):
    """Three micro-batches per step, four steps: bitwise the outputs and gradients of the module that
    quantizes in every call, and one quantization per weight per step (none per micro-batch)."""
    cached = make_mlp(device)
    fresh = copy.deepcopy(cached)
    fresh.fp8_weight_cache = False
    opts = [OPTIMIZERS[opt](list(m.parameters())) for m in (cached, fresh)]
    for step in range(4):
        for o in opts:
            o.zero_grad(set_to_none=True)
        before = dict(quant)
        for mb in range(3):
            x, s, p, dy = batch(device)
            for m in (cached, fresh):
                y = m(x, s, p)
                y.backward(dy)
            assert torch.equal(fwd(cached, x, s, p), fwd(fresh, x, s, p))
            assert cached_equals_current(cached)
        assert quant["cache"] - before["cache"] == 2, "fc1 and fc2 quantized once per step"
        assert quant["cache_calls"] - before["cache_calls"] == 1, "both weights of the layer in one call"
        if device == "cpu":  # the op quantizes only for the module without a cache: 2 per forward
            assert quant["op"] - before["op"] == 2 * 3 * 2
        for a, b in zip(cached.parameters(), fresh.parameters()):
            assert torch.equal(a.grad, b.grad)
        for o in opts:
            o.step()
        for a, b in zip(cached.parameters(), fresh.parameters()):
            assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("assign", [False, True])
def test_never_stale_after_load_state_dict(device, assign, quant):
    m, other = make_mlp(device), make_mlp(device)
    x, s, p, dy = batch(device)
    y_old = fwd(m, x, s, p)
    n = quant["cache"]
    m.load_state_dict(other.state_dict(), assign=assign)
    assert torch.equal(fwd(m, x, s, p), fwd(other, x, s, p))
    assert quant["cache"] == n + 4  # m's two weights, then other's
    assert not torch.equal(fwd(m, x, s, p), y_old)
    assert_same(fwd_bwd(m, x, s, p, dy), fwd_bwd(other, x, s, p, dy))


@pytest.mark.parametrize("device", DEVICES)
def test_load_state_dict_post_hook_alone_invalidates(device, quant, monkeypatch):
    """Even a load that moved no version counter re-quantizes: the module's load_state_dict post-hook
    bumps its epoch, also when a parent module loads (the counters are hidden here to show it)."""
    monkeypatch.setattr(weight_cache, "_version", lambda w: 0)
    m = make_mlp(device)
    parent = torch.nn.ModuleDict({"experts": m})
    x, s, p, _ = batch(device)
    fwd(m, x, s, p)
    fwd(m, x, s, p)
    n = quant["cache"]
    assert n == 2
    parent.load_state_dict(parent.state_dict())
    fwd(m, x, s, p)
    assert quant["cache"] == n + 2


@pytest.mark.parametrize("device", DEVICES)
def test_never_stale_after_in_place_edits(device, quant):
    m = make_mlp(device)
    ref = copy.deepcopy(m)
    ref.fp8_weight_cache = False
    x, s, p, dy = batch(device)
    fwd(m, x, s, p)
    edits = [lambda w1, w2: w1.mul_(2.0), lambda w1, w2: w2[0].zero_(), lambda w1, w2: w1[1, :5].add_(1.0),
             lambda w1, w2: w2.copy_(torch.randn_like(w2)), lambda w1, w2: w1.transpose(1, 2)[0].neg_()]
    for edit in edits:
        n = quant["cache"]
        with torch.no_grad():
            edit(m.fc1.weight, m.fc2.weight)
            for a, b in zip(ref.parameters(), m.parameters()):
                a.copy_(b)
        assert torch.equal(fwd(m, x, s, p), fwd(ref, x, s, p))
        assert quant["cache"] == n + 1, "only the edited weight is re-quantized"
        assert cached_equals_current(m)
    assert_same(fwd_bwd(m, x, s, p, dy), fwd_bwd(ref, x, s, p, dy))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("explicit", ["weights_changed", "refresh_fp8_weights"])
def test_data_writes_need_the_explicit_call(device, explicit):
    """A write through ``.data`` is invisible to every counter (documented): the copies stay until
    ``moegemm.weights_changed()`` or ``refresh_fp8_weights()``."""
    m = make_mlp(device)
    x, s, p, _ = batch(device)
    y0 = fwd(m, x, s, p)
    m.fc1.weight.data.mul_(-1.0)
    m.fc2.weight.data.copy_(torch.randn_like(m.fc2.weight))
    assert torch.equal(fwd(m, x, s, p), y0)  # the limitation: stale until told
    if explicit == "weights_changed":
        moegemm.weights_changed()
    else:
        m.refresh_fp8_weights()
    fresh = copy.deepcopy(m)
    fresh.fp8_weight_cache = False
    assert torch.equal(fwd(m, x, s, p), fwd(fresh, x, s, p))
    assert cached_equals_current(m)


@pytest.mark.parametrize("device", DEVICES)
def test_data_assignment_and_to_are_seen(device, quant):
    """``.data = new tensor`` (new address) and new Parameters are seen through data_ptr / identity."""
    m = make_mlp(device)
    x, s, p, _ = batch(device)
    fwd(m, x, s, p)
    m.fc1.weight.data = torch.randn_like(m.fc1.weight) * 0.05
    m.fc2.weight = torch.nn.Parameter(torch.randn_like(m.fc2.weight) * 0.05)
    n = quant["cache"]
    fwd(m, x, s, p)
    assert quant["cache"] == n + 2 and cached_equals_current(m)
    m.float()  # dtype change: new tensors
    fwd(m, x, s, p)
    assert quant["cache"] == n + 4 and cached_equals_current(m)


# ----------------------------------------------------------------------------------------- flags
@pytest.mark.parametrize("device", DEVICES)
def test_is_first_microbatch_true_and_false(device, quant):
    m = make_mlp(device)
    x, s, p, dy = batch(device)
    y0 = fwd(m, x, s, p, is_first_microbatch=True)
    assert quant["cache"] == 2
    fwd(m, x, s, p, is_first_microbatch=True)  # forces, although the copies are valid
    assert quant["cache"] == 4
    fwd(m, x, s, p)  # automatic: valid
    assert quant["cache"] == 4
    with torch.no_grad():
        m.fc1.weight.mul_(0.5)
    g_false = fwd_bwd(m, x, s, p, dy, is_first_microbatch=False)  # reuse unchecked: the caller vouches
    assert torch.equal(g_false[0], y0) and quant["cache"] == 4
    y_auto = fwd(m, x, s, p)  # automatic again: sees the edit
    assert not torch.equal(y_auto, y0) and quant["cache"] == 5
    assert torch.equal(fwd(m, x, s, p, is_first_microbatch=False), y_auto)


@pytest.mark.parametrize("device", DEVICES)
def test_no_cache_quantizes_in_every_call(device, quant):
    m = make_mlp(device, cache=False)
    x, s, p, dy = batch(device)
    for _ in range(3):
        fwd_bwd(m, x, s, p, dy)
    assert quant["cache"] == 0 and m._fp8_cache.copies() is None
    if device == "cpu":
        assert quant["op"] == 6
    # the explicit flags keep their meaning without the automatic cache (as before it existed)
    y = fwd(m, x, s, p, is_first_microbatch=True)
    assert quant["cache"] == 2 and torch.equal(fwd(m, x, s, p, is_first_microbatch=False), y)
    m.fp8_weight_cache = True
    fwd(m, x, s, p)
    assert quant["cache"] == 2  # valid copies kept by the flag are used
    m.fp8_weight_cache = False
    assert m._fp8_cache.copies() is None  # switching it off frees them


def test_bf16_recipe_keeps_nothing(quant):
    m = GroupedMLP(E, H, FFN, recipe="bf16")
    x, s, p, dy = batch("cpu")
    fwd_bwd(m, x, s, p, dy)
    m(x, s, p, is_first_microbatch=True)
    assert quant["cache"] == 0 and m._fp8_cache.copies() is None


@pytest.mark.parametrize("device", DEVICES)
def test_to_fp8_inference_after_training(device):
    m = make_mlp(device)
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    x, s, p, dy = batch(device)
    for _ in range(2):
        m(x, s, p).backward(dy)
        o.step()
        o.zero_grad()
    ref = copy.deepcopy(m)
    ref.fp8_weight_cache = False
    y = fwd(ref, x, s, p)
    m.to_fp8_inference()
    assert m._fp8_cache.copies() is None  # the transposed copies are gone
    for flag in (None, True, False):
        assert torch.equal(fwd(m, x, s, p, is_first_microbatch=flag), y)
    m.refresh_fp8_weights()  # no-op: no bf16 weights left
    assert torch.equal(fwd(m, x, s, p), y)


@pytest.mark.parametrize("device", DEVICES)
def test_inference_mode_then_training(device):
    """Copies made under torch.inference_mode are ordinary tensors, usable by a later training step."""
    m = make_mlp(device)
    x, s, p, dy = batch(device)
    with torch.inference_mode():
        y = m(x.detach(), s, p)
    kept = m._fp8_cache.copies()
    assert kept is not None and not any(t.is_inference() for c in kept for t in c)
    g = fwd_bwd(m, x, s, p, dy)
    assert torch.equal(g[0], y) and same_copies(m._fp8_cache.copies(), kept)


# ----------------------------------------------------------------------------------------- copies, pickling
def test_deepcopy_and_pickle_start_empty():
    m = make_mlp("cpu")
    x, s, p, _ = batch("cpu")
    y = fwd(m, x, s, p)
    for c in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert c._fp8_cache.copies() is None and c._fp8_cache.auto
        assert torch.equal(fwd(c, x, s, p), y)
        with torch.no_grad():
            c.fc1.weight.mul_(2)  # independent of the original's cache
        assert torch.equal(fwd(m, x, s, p), y)
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    assert torch.equal(fwd(torch.load(buf, weights_only=False), x, s, p), y)


# ----------------------------------------------------------------------------------------- torch.compile
def test_torch_compile_bypasses_the_cache(quant):
    """Under torch.compile the weights are quantized inside the traced call, whatever the flag; the
    eager cache is left alone. (fullgraph=True: on the reference path in test_compile_cpu.py, on the CUDA
    path in test_cuda_mlp.py and below.)"""
    torch._dynamo.reset()
    m = make_mlp("cpu")
    x, s, p, dy = batch("cpu")
    y = fwd(m, x, s, p)
    kept = m._fp8_cache.copies()
    for flag in (None, True, False):
        f = torch.compile(lambda x: m(x, s.tolist(), p, is_first_microbatch=flag), backend="eager")
        assert torch.equal(f(x.detach()), y)
    assert quant["cache"] == 2 and same_copies(m._fp8_cache.copies(), kept)
    torch._dynamo.reset()


@requires_cuda
@pytest.mark.parametrize("flag", [None, True, False])
def test_torch_compile_fullgraph_cuda(flag):
    torch._dynamo.reset()
    m = make_mlp("cuda")
    x, s, p, dy = batch("cuda")
    eager = fwd_bwd(m, x, s, p, dy)  # fills the cache
    compiled = torch.compile(lambda x: m(x, s, p, is_first_microbatch=flag), fullgraph=True)
    x2 = x.detach().requires_grad_()
    m.zero_grad(set_to_none=False)
    y = compiled(x2)
    y.backward(dy)
    for a, b in zip([y.detach(), x2.grad] + [q.grad for q in m.parameters()], eager):
        assert rel(a, b) <= 1e-3  # as test_cuda_mlp's compiled-vs-eager check
    torch._dynamo.reset()


# ----------------------------------------------------------------------------------------- CUDA graphs
def test_capture_rules_simulated(monkeypatch, quant):
    """The cache's decisions while a stream captures (simulated: ``capturing`` patched)."""
    m = make_mlp("cpu")
    x, s, p, _ = batch("cpu")
    w = (m.fc1.weight, m.fc2.weight)
    eager = m._fp8_cache.get(w)  # an eager entry
    monkeypatch.setattr(weight_cache, "capturing", lambda device: True)
    assert m._fp8_cache.get(w) is None  # None: quantize inside the call (inside the graph)
    assert quant["cache"] == 2
    pinned = m._fp8_cache.get(w, False)  # False: the graph reads the eager copies ...
    assert same_copies(pinned, eager)
    monkeypatch.setattr(weight_cache, "capturing", lambda device: False)
    with torch.no_grad():
        m.fc1.weight.mul_(3.0)
    m.refresh_fp8_weights()  # ... so they are refreshed in place: same tensors, new values
    assert same_copies(m._fp8_cache.copies(), eager)
    assert cached_equals_current(m)
    with torch.no_grad():
        m.fc2.weight.mul_(3.0)
    m._fp8_cache.get(w)  # an automatic refresh of a pinned copy is in place too
    assert same_copies(m._fp8_cache.copies(), eager) and cached_equals_current(m)
    # True during capture: copies in fresh (graph-pool) memory, kept for the capture's False calls
    m2 = make_mlp("cpu")
    w2 = (m2.fc1.weight, m2.fc2.weight)
    monkeypatch.setattr(weight_cache, "capturing", lambda device: True)
    made = m2._fp8_cache.get(w2, True)
    assert same_copies(m2._fp8_cache.get(w2, False), made)
    monkeypatch.setattr(weight_cache, "capturing", lambda device: False)
    n = quant["cache"]
    after = m2._fp8_cache.get(w2)  # never trusted automatically after the capture (replays move nothing)
    assert quant["cache"] == n + 2 and not any(x is y for u, v in zip(after, made) for x, y in zip(u, v))


@requires_cuda
def test_cuda_graph_capture_with_the_cache():
    """A captured forward+backward replays correctly with each flag: None quantizes inside the graph
    (fresh on every replay), False reads the pinned eager copies (refreshed in place by
    refresh_fp8_weights between replays), True then False inside one capture."""
    m = make_mlp("cuda")
    x, s, p, dy = batch("cuda")
    xs = x.detach().requires_grad_()

    def run(*flags):
        def step():
            xs.grad = None
            for q in m.parameters():
                q.grad = None
            ys = [m(xs, s, p, is_first_microbatch=f) for f in flags]
            torch.autograd.backward(ys, [dy] * len(ys))
            return ys[-1]
        return step

    def expected():
        ref = copy.deepcopy(m)
        ref.fp8_weight_cache = False
        return fwd(ref, x, s, p)

    for flags, refresh in (((None,), False), ((False,), True), ((True, False), False)):
        m.fp8_weights(None)  # an eager entry
        g, out = capture_step(run(*flags))
        for _ in range(2):
            with torch.no_grad():
                m.fc1.weight.add_(torch.randn_like(m.fc1.weight) * 0.01)
                m.fc2.weight.mul_(0.9)
            if refresh:
                m.refresh_fp8_weights()
            g.replay()
            torch.cuda.synchronize()
            assert rel(out, expected()) <= 1e-4, flags  # bitwise expected; a stale copy is off by ~1e-2


@requires_cuda
def test_training_step_in_cuda_graph_cache_on_and_off():
    """The whole step (forward, backward, capturable Adam) captured with the default cache and without:
    identical losses and weights on every replay (the step's optimizer runs inside the graph)."""
    torch.manual_seed(0)
    models = [make_mlp("cuda", dtype=torch.float32), None]
    models[1] = copy.deepcopy(models[0])
    models[1].fp8_weight_cache = False
    x, s, p, _ = batch("cuda")
    target = torch.randn(T, H, device="cuda")
    opts = [torch.optim.Adam(mod.parameters(), lr=1e-3, capturable=True) for mod in models]

    def step(i):
        def f():
            opts[i].zero_grad(set_to_none=False)
            loss = (models[i](x.detach(), s, p).float() - target).pow(2).mean()
            loss.backward()
            opts[i].step()
            return loss
        return f

    graphs = [capture_step(step(i)) for i in range(2)]
    for _ in range(3):
        for g, _ in graphs:
            g.replay()
        torch.cuda.synchronize()
        assert torch.equal(graphs[0][1], graphs[1][1])
    for a, b in zip(*(mod.parameters() for mod in models)):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------- Megatron experts
@pytest.fixture(params=["cpu", pytest.param("cuda", marks=requires_cuda)])
def mdev(request):
    if not HAS_MEGATRON:
        pytest.skip("needs megatron-core")
    return request.getfixturevalue("cpu" if request.param == "cpu" else "gpu")


def megatron_experts(device, **kw):
    cfg = make_config(device, "swiglu", H=128, ffn=128, dtype=torch.float32 if device.type == "cpu" else torch.bfloat16)
    return build_moe(cfg, "moegemm", recipe="fp8_blockwise", **kw).experts, cfg


def experts_batch(ex, device):
    splits = torch.tensor(zipf_splits(ex.num_local_experts, 96), device=device)
    dt = ex.linear_fc1.weight.dtype
    return torch.randn(96, ex.hidden_size, device=device, dtype=dt), splits, torch.rand(96, device=device)


def experts_fresh(ex, device):
    """A copy without the cache, with ex's current weights."""
    fresh = megatron_experts(device, fp8_weight_cache=False)[0]
    fresh.load_state_dict(ex.state_dict())
    return fresh


@requires_megatron
def test_megatron_experts_once_per_step_never_stale(mdev, quant):
    ex, _ = megatron_experts(mdev)
    assert ex.fp8_weight_cache is True
    opt = torch.optim.AdamW(ex.parameters(), lr=1e-2, foreach=True)
    for step in range(3):
        before = quant["cache"]
        for mb in range(3):
            x, s, p = experts_batch(ex, mdev)
            y = ex(x, s, p)[0]
            y.float().square().sum().backward()
            with torch.no_grad():
                assert torch.equal(ex(x, s, p)[0], experts_fresh(ex, mdev)(x, s, p)[0])
        # Megatron's flag starts True (first forward), then automatic: once per step
        assert quant["cache"] - before == 2
        opt.step()
        opt.zero_grad()


@requires_megatron
def test_megatron_experts_data_writes(mdev, quant):
    """Megatron's optimizers copy main params into the model through ``.data`` after their inner torch
    optimizer's step: simulated with fp32 main copies and a torch AdamW. The step's post-hook makes the
    next forward re-quantize; a ``.data`` write outside a step needs ``set_is_first_microbatch()`` (what
    Megatron's schedule calls with config.fp8), ``weights_changed()`` or ``refresh_fp8_weights()``."""
    ex, _ = megatron_experts(mdev)
    params = [ex.linear_fc1.weight, ex.linear_fc2.weight]
    main = [q.detach().float().clone().requires_grad_() for q in params]
    opt = torch.optim.AdamW(main, lr=1e-2)
    x, s, p = experts_batch(ex, mdev)
    for _ in range(2):
        ex(x, s, p)[0].float().square().sum().backward()
        for q, mq in zip(params, main):
            mq.grad = q.grad.float()
            q.grad = None
        opt.step()
        with torch.no_grad():
            for q, mq in zip(params, main):
                q.data.copy_(mq)  # Megatron's _copy_main_params_to_model_params
        with torch.no_grad():
            assert torch.equal(ex(x, s, p)[0], experts_fresh(ex, mdev)(x, s, p)[0])
    for fix in ("set_is_first_microbatch", "weights_changed", "refresh_fp8_weights"):
        ex.linear_fc1.weight.data.mul_(0.5)  # outside any optimizer step
        if fix == "set_is_first_microbatch":
            ex.set_is_first_microbatch()
        elif fix == "weights_changed":
            moegemm.weights_changed()
        else:
            ex.refresh_fp8_weights()
        with torch.no_grad():
            assert torch.equal(ex(x, s, p)[0], experts_fresh(ex, mdev)(x, s, p)[0]), fix


@requires_megatron
def test_megatron_experts_param_gather_pre_hooks(mdev):
    """Megatron DDP's overlap_param_gather waits for the parameters' all-gather in forward pre-hooks of
    the modules owning them (linear_fc1 / linear_fc2 here), and the all-gather then writes the buffers in
    place. Simulated: pre-hooks that write new values through ``.data``, after an optimizer step (the
    generation bump): the forward must quantize what the hooks left, not what was there before."""
    ex, _ = megatron_experts(mdev)
    x, s, p = experts_batch(ex, mdev)
    with torch.no_grad():
        ex(x, s, p)  # copies of the current weights
    gathered = {mod: torch.randn_like(mod.weight) * 0.05 for mod in (ex.linear_fc1, ex.linear_fc2)}
    order = []

    def all_gather_done(module, args):
        order.append(module)
        module.weight.data.copy_(gathered[module])

    handles = [mod.register_forward_pre_hook(all_gather_done) for mod in gathered]
    q = torch.nn.Parameter(torch.zeros(1, device=mdev))
    q.grad = torch.ones_like(q)
    torch.optim.SGD([q], lr=1.0).step()  # the step (of the main params) before the copy / all-gather
    with torch.no_grad():
        y = ex(x, s, p)[0]
    for h in handles:
        h.remove()
    assert order == [ex.linear_fc1, ex.linear_fc2]
    with torch.no_grad():
        assert torch.equal(y, experts_fresh(ex, mdev)(x, s, p)[0])
    for kept, w in zip(ex._fp8_cache.copies(), (ex.linear_fc1.weight, ex.linear_fc2.weight)):
        assert is_quantization_of(kept, w)


@requires_megatron
def test_megatron_experts_flag_load_and_opt_out(mdev, quant):
    ex, _ = megatron_experts(mdev)
    x, s, p = experts_batch(ex, mdev)
    with torch.no_grad():
        ex(x, s, p)
        n = quant["cache"]
        ex(x, s, p)
        assert quant["cache"] == n  # valid: reused
        ex.set_is_first_microbatch()
        ex(x, s, p)
        assert quant["cache"] == n + 2  # the schedule's flag forces
        other, _ = megatron_experts(mdev)
        ex.load_state_dict(other.state_dict())  # SequentialMLP keys, stacked by the pre-hook
        assert torch.equal(ex(x, s, p)[0], experts_fresh(other, mdev)(x, s, p)[0])
        off, _ = megatron_experts(mdev, fp8_weight_cache=False)
        m = quant["cache"]
        for _ in range(2):
            off(x, s, p)
        assert quant["cache"] == m and off._fp8_cache.copies() is None


@requires_megatron
@requires_cuda
@pytest.mark.parametrize("overlap_param_gather", [False, True])
def test_megatron_distributed_optimizer_never_stale(gpu, overlap_param_gather):
    """GPTModel + Megatron DDP + the distributed optimizer (parameters written through the DDP buffers;
    with overlap_param_gather, all-gathered in the next forward's pre-hooks), config.fp8 unset (so
    Megatron's schedule never raises is_first_microbatch) and the flag never set: after every step the
    experts' next forward uses the FP8 copies of the current weights."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig
    import torch.nn.functional as F

    cfg = TransformerConfig(num_layers=1, hidden_size=128, num_attention_heads=4, num_moe_experts=4,
                            moe_ffn_hidden_size=128, ffn_hidden_size=256, moe_router_topk=2,
                            moe_token_dispatcher_type="alltoall", params_dtype=torch.bfloat16, bf16=True,
                            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                            bias_activation_fusion=False, attention_dropout=0.0, hidden_dropout=0.0)
    model = Float16Module(cfg, build_gpt(cfg, "moegemm", recipe="fp8_blockwise").cuda())
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(overlap_grad_reduce=True, grad_reduce_in_fp32=True,
                                                                     use_distributed_optimizer=True,
                                                                     overlap_param_gather=overlap_param_gather), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=3e-3, bf16=True, use_distributed_optimizer=True),
                                 [ddp])
    ex = [mod for mod in model.modules() if isinstance(mod, MoegemmExperts)][0]
    tok, pos, mask, labels = gpt_batch(gpu)
    for step in range(3):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        for mb in range(2):
            ex.is_first_microbatch = False  # as Megatron's schedule leaves it without config.fp8
            with ddp.no_sync() if mb == 0 else contextlib.nullcontext():
                ddp(tok, pos, mask, labels=labels).float().mean().backward()
            for kept, w in zip(ex._fp8_cache.copies(), (ex.linear_fc1.weight, ex.linear_fc2.weight)):
                assert is_quantization_of(kept, w), step
        ddp.finish_grad_sync()
        ok, _, _ = opt.step()
        assert ok


# ------------------------------------------------------------------------------------ GroupedLinear
def _linear_pair(device):
    """Two GroupedLinear layers with the same weights: with and without the FP8 weight cache."""
    cached = moegemm.GroupedLinear(E, H, FFN, bias=True, device=device)
    plain = moegemm.GroupedLinear(E, H, FFN, bias=True, device=device, fp8_weight_cache=False)
    plain.load_state_dict(cached.state_dict())
    return cached, plain


def _linear_step(layer, x, splits, dy):
    x = x.detach().requires_grad_()
    layer.zero_grad(set_to_none=True)
    y = layer(x, splits)
    y.backward(dy)
    return y.detach(), x.grad, layer.weight.grad, layer.bias.grad


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_linear_cache_once_per_step_never_stale(device, quant):
    """GroupedLinear keeps its FP8 weight: quantized once per optimizer step over several micro-batches,
    again after a step, a load_state_dict and an in-place edit; every output and gradient bitwise the
    no-cache layer's."""
    torch.manual_seed(11)
    cached, plain = _linear_pair(device)
    opt_c = torch.optim.SGD(cached.parameters(), lr=0.1)
    opt_p = torch.optim.SGD(plain.parameters(), lr=0.1)
    splits = torch.tensor(zipf_splits(E, T), device=device)
    for step in range(2):
        before = quant["cache"]
        for _ in range(3):  # micro-batches
            x = torch.randn(T, H, device=device, dtype=torch.bfloat16)
            dy = torch.randn(T, FFN, device=device, dtype=torch.bfloat16)
            for a, b in zip(_linear_step(cached, x, splits, dy), _linear_step(plain, x, splits, dy)):
                assert torch.equal(a, b)
        assert quant["cache"] - before == 1, f"step {step}: quantized {quant['cache'] - before} times"
        opt_c.step()
        opt_p.step()
    for change in ("load", "in_place"):
        if change == "load":
            state = {k: v + 0.01 for k, v in plain.state_dict().items()}
            plain.load_state_dict(state)
            cached.load_state_dict(state)
        else:
            with torch.no_grad():
                for layer in (cached, plain):
                    layer.weight[0].mul_(-1)
        x = torch.randn(T, H, device=device, dtype=torch.bfloat16)
        dy = torch.randn(T, FFN, device=device, dtype=torch.bfloat16)
        for a, b in zip(_linear_step(cached, x, splits, dy), _linear_step(plain, x, splits, dy)):
            assert torch.equal(a, b), change


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_linear_cache_flags(device, quant):
    """is_first_microbatch True re-quantizes, False reuses unchecked; fp8_weight_cache=False keeps nothing."""
    torch.manual_seed(12)
    cached, plain = _linear_pair(device)
    splits = torch.tensor(zipf_splits(E, T), device=device)
    x = torch.randn(T, H, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        cached(x, splits, is_first_microbatch=True)
        cached(x, splits, is_first_microbatch=True)
        assert quant["cache"] == 2
        cached(x, splits, is_first_microbatch=False)
        cached(x, splits)
        assert quant["cache"] == 2
        plain(x, splits)
        assert quant["cache"] == 2 and plain._fp8_cache.copies() is None


@pytest.mark.parametrize("device", DEVICES)
def test_cache_allows_parameter_swap(device):
    """The cache marks a weight with a token in its __dict__, not a weak reference (PyTorch refuses to swap a
    tensor that has one): module.to and load_state_dict on the swap path work after a cached forward, and
    the swapped-in weights are quantized afresh."""
    torch.manual_seed(13)
    old = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        for make in (lambda: make_mlp(device), lambda: moegemm.GroupedLinear(E, H, FFN, device=device)):
            m = make()
            x, splits, p, dy = batch(device)
            with torch.no_grad():
                run = (lambda: m(x, splits, p)) if isinstance(m, GroupedMLP) else (lambda: m(x, splits))
                run()
                m.to(torch.float32)  # the swap path
                m.to(torch.bfloat16)
                state = {k: v + 0.5 for k, v in m.state_dict().items()}
                m.load_state_dict(state)
                y = run()
            fresh = make()
            fresh.load_state_dict(state)
            fresh.fp8_weight_cache = False
            with torch.no_grad():
                y_ref = fresh(x, splits, p) if isinstance(fresh, GroupedMLP) else fresh(x, splits)
            assert torch.equal(y, y_ref)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(old)
