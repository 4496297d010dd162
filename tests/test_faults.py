"""Out of memory in the middle of a step (docs/design.md#errors).

On a Hopper GPU, real allocation failures: the caching allocator is capped (``memory_cap``: every free
byte it holds is taken by ballast, then ``torch.cuda.set_per_process_memory_fraction`` lets it grow by a
given budget) during one phase of a training step (forward, backward or backward_dw), for budgets from 0
up until the step passes, so that the failure moves through the phase's allocations: in the FP8 weight
cache's quantization, inside the forward op, inside the backward op, inside the split backward's wgrad
op (where it allocates: on moegemm's own wgrad kernel backward_dw allocates nothing and passes with a
budget of 0). After each failure: the error is ``torch.OutOfMemoryError`` and the CUDA context still works; every
kept FP8 weight copy is the exact quantization of the current weights (a warm cache is untouched); the
split backward's store is empty; the next step, after the failed one is discarded (gradients zeroed),
gives bitwise the outputs and gradients of a run that never failed; and once the step's results and the
cache are dropped, the allocated memory is what it was before the step, to the byte (nothing leaked).

On the CPU (reference path), the same rules with failures injected where the GPU would raise: a failed
re-quantization leaves no stale copy (not even for ``is_first_microbatch=False``), and a failed backward
or backward_dw drops the store's pending work.
"""

from __future__ import annotations

import contextlib
import gc
import os
import traceback

import pytest
import torch

import moegemm
from moegemm import weight_cache
from moegemm.backends import reference as reference_backend

from conftest import cuda_alive, requires_cuda, zipf_splits
from training_step import Rig, assert_bitwise, bytes_of

PKG = os.path.dirname(os.path.abspath(moegemm.__file__))
MB = 1 << 20


def oom() -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError("CUDA out of memory (injected by the test)")


def _same_bytes(copies, want) -> bool:
    """Two quantize_weight 4-tuples, byte for byte."""
    return all(torch.equal(bytes_of(a), bytes_of(b)) for a, b in zip(copies, want))


# ============================================================================= CPU: the rules, injected
def _fp8_mlp(cache: bool = True):
    torch.manual_seed(0)
    return moegemm.GroupedMLP(4, 128, 128, activation="swiglu", bias=True, recipe="fp8_blockwise",
                              fp8_weight_cache=cache)


def test_failed_requantization_leaves_no_stale_copy(monkeypatch):
    """Both weights stale, their re-quantization (one call for the layer) fails: neither old copy survives, so
    even ``is_first_microbatch=False`` quantizes anew instead of reusing stale copies; the next call refreshes
    both."""
    mlp, plain = _fp8_mlp(), _fp8_mlp(cache=False)
    x, m, probs = torch.randn(200, 128, dtype=torch.bfloat16), zipf_splits(4, 200), torch.rand(200)
    with torch.no_grad():
        mlp(x, m, probs)  # both weights cached
        for module in (mlp, plain):
            module.fc1.weight.mul_(0.5), module.fc2.weight.mul_(0.5)  # in place: both copies stale
    real = weight_cache.quantize
    calls = []

    def failing(weights):
        calls.append(len(weights))
        raise oom()

    monkeypatch.setattr(weight_cache, "quantize", failing)
    with pytest.raises(torch.OutOfMemoryError), torch.no_grad():
        mlp(x, m, probs)
    monkeypatch.setattr(weight_cache, "quantize", real)
    assert calls == [2], "the layer's two weights are quantized in one call"
    assert mlp._fp8_cache._entries == [None, None], "stale copies survived the failed re-quantization"
    with torch.no_grad():
        assert torch.equal(mlp(x, m, probs, is_first_microbatch=False), plain(x, m, probs))
    first, second = mlp._fp8_cache._entries
    stamp = (weight_cache.generation(), mlp._fp8_cache._epoch)
    assert first.fresh(mlp.fc1.weight, stamp) and second.fresh(mlp.fc2.weight, stamp)
    assert all(_same_bytes(e.fp8, q) for e, q in zip((first, second), real([mlp.fc1.weight, mlp.fc2.weight])))


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_failed_backward_dw_drops_pending_work(kind, monkeypatch):
    """Two pending backward passes; backward_dw fails in the first: the store drops both (and their
    operands), and the next step, from zeroed gradients, equals a run that never failed."""
    rig, clean = (Rig(kind, "fp8_blockwise", "split_main_grad", device="cpu", E=4, H=128, F=128, T=200)
                  for _ in range(2))
    expected = clean.micro_step()
    op = "linear_wgrad" if kind == "linear" else "mlp_wgrad"
    for i in range(2):
        rig.backward(rig.forward(i), i)
    assert len(rig.layer._wgrad_store) == 2
    monkeypatch.setattr(reference_backend, op, lambda *a, **k: (_ for _ in ()).throw(oom()))
    with pytest.raises(torch.OutOfMemoryError):
        rig.layer.backward_dw()
    monkeypatch.undo()
    assert len(rig.layer._wgrad_store) == 0
    assert_bitwise(rig.micro_step(), expected, "the step after the failed one")


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_failed_backward_drops_pending_work(kind, monkeypatch):
    """A split backward whose second micro-batch fails in its backward op: the first micro-batch's
    pending work is dropped too (the step is lost; the next one starts with an empty store)."""
    rig, clean = (Rig(kind, "bf16", "split", device="cpu", E=4, H=128, F=128, T=200) for _ in range(2))
    expected = clean.micro_step()
    rig.backward(rig.forward(0), 0)
    assert len(rig.layer._wgrad_store) == 1
    y = rig.forward(1)
    monkeypatch.setattr(reference_backend, f"{kind}_bwd", lambda *a, **k: (_ for _ in ()).throw(oom()))
    with pytest.raises(torch.OutOfMemoryError):
        rig.backward(y, 1)
    monkeypatch.undo()
    del y
    assert len(rig.layer._wgrad_store) == 0
    assert_bitwise(rig.micro_step(), expected, "the step after the failed one")


# ============================================================================= GPU: real allocation failures
_LARGE = [256 * MB, 64 * MB, 16 * MB, 4 * MB, 2 * MB, MB + 512]  # the allocator's large pool (> 1 MB)
_SMALL = [MB, 256 << 10, 64 << 10, 16 << 10, 4 << 10, 1 << 10, 512]  # its small pool (2 MB segments)
BUDGETS = [0, 1 * MB, 2 * MB, 4 * MB, 8 * MB] + [20 * k * MB for k in range(1, 13)] + [320 * MB, 512 * MB, 1024 * MB]


def _settled() -> int:
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


@contextlib.contextmanager
def memory_cap(budget: int):
    """Let the caching allocator grow by at most ``budget`` bytes: cap it at what it holds, take every free
    byte it holds with ballast (largest pieces first, in both pools), then raise the cap by ``budget``. Any
    allocation past the budget raises ``torch.OutOfMemoryError``."""
    ballast = []
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory  # what the fraction is of
    try:
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(torch.cuda.memory_reserved() / total)
        for size in _LARGE + _SMALL:
            while True:
                try:
                    ballast.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
                except torch.OutOfMemoryError:
                    break
        torch.cuda.set_per_process_memory_fraction(min(1.0, (torch.cuda.memory_reserved() + budget) / total))
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        ballast.clear()


def _capped(on: bool, budget: int):
    return memory_cap(budget) if on else contextlib.nullcontext()


def _frames(exc: BaseException) -> list:
    """``package-relative file:function`` of the moegemm frames the error passed through, innermost last."""
    return [f"{os.path.relpath(f.filename, PKG)}:{f.name}" for f in traceback.extract_tb(exc.__traceback__)
            if os.path.abspath(f.filename).startswith(PKG + os.sep)]


def _attempt(rig: Rig, phase: str, budget: int):
    """One micro-batch step with the memory cap on ``phase`` only: ("passed", results) or ("failed", frames)."""
    try:
        with _capped(phase == "forward", budget):
            y = rig.forward()
        with _capped(phase == "backward", budget):
            rig.backward(y)
        with _capped(phase == "backward_dw", budget):
            rig.backward_dw()
        return "passed", [t.detach().clone() for t in [y] + rig.grads()]
    except torch.OutOfMemoryError as exc:  # anything else (a CUDA error) fails the test
        return "failed", _frames(exc)


def _check_cache(rig: Rig) -> None:
    """Every kept FP8 copy is the exact quantization of its weight and is marked fresh."""
    cache = rig.layer._fp8_cache
    stamp = (weight_cache.generation(), cache._epoch)
    for entry, w in zip(cache._entries, rig.layer.expert_weights()):
        if entry is None:
            continue
        assert entry.holds(w) and entry.fresh(w, stamp)
        assert _same_bytes(entry.fp8, weight_cache.quantize([w])[0])


# Each case walks a cap through every phase's allocations (~10-20 s on an H200): the FP8 recipe with
# plain .grad and with the split backward into main_grad (which adds the backward_dw phase), the bf16
# recipe with main_grad, each for both layers.
FAULT_CASES = [(kind, recipe, mode) for kind in ("mlp", "linear")
               for recipe, mode in (("fp8_blockwise", "grad"), ("fp8_blockwise", "split_main_grad"), ("bf16", "main_grad"))]


@requires_cuda
@pytest.mark.parametrize("kind,recipe,mode", FAULT_CASES)
def test_out_of_memory_mid_step(kind, recipe, mode):
    shape = {"E": 8, "H": 512, "F": 256, "T": 2048}
    rig = Rig(kind, recipe, mode, **shape)
    expected = Rig(kind, recipe, mode, **shape).micro_step()
    cache = rig.layer._fp8_cache
    phases = ["forward", "backward"] + (["backward_dw"] if rig.split else [])
    failures = []
    passed_at = {}  # phase -> the budget it first passed with
    for phase in phases:
        for warm in ([False, True] if phase == "forward" and recipe == "fp8_blockwise" else [False]):
            for budget in BUDGETS:
                rig.zero()
                cache.clear()
                base = _settled()
                if warm:
                    rig.layer.refresh_fp8_weights()
                kept = cache.copies()
                outcome, info = _attempt(rig, phase, budget)
                if outcome == "passed":
                    assert_bitwise(info, expected, f"{phase} passed with {budget} bytes")
                    passed_at[phase] = budget
                    info = kept = None
                    break
                failures.append((phase, info))
                cuda_alive()
                _check_cache(rig)
                if warm:  # a failure inside the op leaves valid copies alone
                    assert all(a is b for u, v in zip(cache.copies(), kept) for a, b in zip(u, v))
                assert len(rig.layer._wgrad_store) == 0
                rig.zero()  # discard the failed step (a main_grad may hold part of it)
                assert_bitwise(rig.micro_step(), expected, f"the step after a failure in {phase} ({info[-1:]})")
                rig.zero()
                kept = None
                cache.clear()
                assert _settled() == base, f"memory leaked by a failure in {phase} at {info[-1:]}"
            else:
                pytest.fail(f"{phase} never passed within {BUDGETS[-1]} bytes")
    layer_file = f"functional{os.sep}{'mlp' if kind == 'mlp' else 'linear'}.py"
    inside = {(phase, frames[-1]) for phase, frames in failures if frames}
    # inside the layer's op: the split backward's Python Function (forward, backward), else the call of the
    # differentiable op, whose backward runs in its C++ node (no moegemm Python frame)
    assert ("forward", f"{layer_file}:forward" if rig.split else f"{layer_file}:grouped_{kind}") in inside, inside
    if rig.split:
        assert ("backward", f"{layer_file}:backward") in inside, inside
    else:
        assert any(phase == "backward" for phase, _ in failures), failures
    if recipe == "fp8_blockwise":  # the cold cache's quantization failed too
        assert any(phase == "forward" and any(f.startswith("weight_cache.py") for f in frames)
                   for phase, frames in failures), inside
    if rig.split:  # its wgrad op failed, or it allocates nothing (moegemm's own wgrad kernel needs no workspace)
        assert any(phase == "backward_dw" for phase, _ in failures) or passed_at["backward_dw"] == 0, inside
