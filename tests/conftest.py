"""Shared helpers of the moegemm test suite.

* ``requires_cuda``: marker for tests that need the CUDA kernels (a Hopper GPU, capability 9.0).
  Use it as ``@requires_cuda`` (imported from this module) or ``@pytest.mark.requires_cuda``;
  such tests are skipped everywhere else.
* ``zipf_splits(E, T, empty=True)``: Zipf-skewed token counts, with some empty experts.
* ``rel(out, expected)``: ‖out − expected‖ / ‖expected‖ in float64 (docs/design.md#reference's measure).
* ``cuda_alive()``: asserts that the CUDA context still works (after an input that must not kill it).
* ``capture_step(step)``: warms ``step`` up on a side stream and captures it in a CUDA graph.
* ``cuda_kernels(fn)``: ``fn()``'s result and the CUDA kernels it ran (after one warm-up call).
* ``quant`` (fixture): counts of the weight quantizations of the FP8 weight cache and of the reference op.
"""

from __future__ import annotations

import atexit
import os
import random
import shutil
import tempfile

# torch.compile's on-disk caches (inductor's FX graphs) key a graph by its code, not by the fakes of the custom ops
# in it: a cache written by an older moegemm (other saved-list shapes) would fail the compiled tests' stride checks.
# Each pytest run compiles into a fresh directory, removed at exit.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="moegemm-tests-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)

import pytest  # noqa: E402
import torch  # noqa: E402


def has_hopper() -> bool:
    try:
        return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    except Exception:  # pragma: no cover - broken driver etc.
        return False


HAS_HOPPER = has_hopper()
requires_cuda = pytest.mark.requires_cuda


def pytest_configure(config):
    config.addinivalue_line("markers", "requires_cuda: needs a CUDA GPU of compute capability 9.0 (Hopper)")


def pytest_collection_modifyitems(config, items):
    if HAS_HOPPER:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU of compute capability (9, 0)")
    for item in items:
        if "requires_cuda" in item.keywords:
            item.add_marker(skip)


def zipf_splits(E: int, T: int, empty: bool = True, alpha: float = 1.2) -> list:
    """E non-negative ints summing to T, Zipf-skewed (in a random expert order).

    With ``empty=True`` (and E >= 2) about a quarter of the experts, at least one, get no tokens."""
    if E < 1:
        raise ValueError("E must be >= 1")
    if T < 0:
        raise ValueError("T must be >= 0")
    weights = [1.0 / (r + 1) ** alpha for r in range(E)]
    random.shuffle(weights)
    if empty and E >= 2:
        n_empty = max(1, E // 4)
        for e in random.sample(range(E), n_empty):
            weights[e] = 0.0
    if T == 0:
        return [0] * E
    probs = torch.tensor(weights, dtype=torch.float64)
    idx = torch.multinomial(probs, T, replacement=True)
    counts = torch.bincount(idx, minlength=E).tolist()
    assert sum(counts) == T and len(counts) == E
    return [int(c) for c in counts]


@pytest.fixture
def zipf():
    return zipf_splits


@pytest.fixture
def quant(monkeypatch):
    """Counts weight quantizations: ``cache`` (the weights the FP8 weight caches quantized, through the backend's
    quantize_weights or quantize_weights_into), ``cache_calls`` (their calls of them: one per layer refresh) and
    ``op`` (inside the reference op; the CUDA op quantizes in C++, not counted)."""
    from moegemm import reference
    from moegemm.backends import reference as reference_backend

    calls = {"cache": 0, "cache_calls": 0, "op": 0}

    def counting_many(fn):
        def wrapped(weights):
            calls["cache"] += len(weights)
            calls["cache_calls"] += 1
            return fn(weights)
        return wrapped

    def counting(fn):
        def wrapped(w):
            calls["op"] += 1
            return fn(w)
        return wrapped

    def counting_into(fn):
        def wrapped(parts, counts, out):
            calls["cache"] += len(counts)
            calls["cache_calls"] += 1
            with monkeypatch.context() as m:  # (the reference's calls quantize_weight: not the op's)
                m.setattr(reference, "quantize_weight", plain)
                return fn(parts, counts, out)
        return wrapped

    plain = reference.quantize_weight  # (reference.quantize_weights calls the module's, counted as the op's below)
    monkeypatch.setattr(reference_backend, "quantize_weights", counting_many(lambda weights: [plain(w) for w in weights]))
    monkeypatch.setattr(reference_backend, "quantize_weights_into", counting_into(reference.quantize_weights_into))
    monkeypatch.setattr(reference, "quantize_weight", counting(reference.quantize_weight))
    if HAS_HOPPER:
        from moegemm.backends import cuda as cuda_ops

        monkeypatch.setattr(cuda_ops, "quantize_weights", counting_many(cuda_ops.quantize_weights))
        monkeypatch.setattr(cuda_ops, "quantize_weights_into", counting_into(cuda_ops.quantize_weights_into))
    return calls


def rel(out: torch.Tensor, expected: torch.Tensor) -> float:
    """‖out − expected‖ / ‖expected‖ in float64; against an all-zero reference: 0 if out is zero too, else inf."""
    out, expected = out.double(), expected.double()
    diff, norm = (out - expected).norm().item(), expected.norm().item()
    if norm == 0:
        return 0.0 if diff == 0 else float("inf")
    return diff / norm


def cuda_alive() -> None:
    """The CUDA context still works after whatever ran before (no-op without CUDA)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        a = torch.arange(8, device="cuda", dtype=torch.float32)
        assert (a * 2).sum().item() == 56.0


# The counts per expert every grouped-GEMM kernel test runs: empty experts, one token, counts around the
# 128-token blocks, one expert holding every token, a single token, experts shorter than a block (around
# the column copy's 16-token alignment too).
GEMM_EDGE_SPLITS = {
    "edge_counts": [0, 1, 17, 127, 128, 129, 0, 255, 256, 257, 3],
    "one_expert_all_tokens": [0, 0, 1000, 0],
    "single_token": [1],
    "short_experts": [5, 64, 65, 63, 1, 2, 16, 15],
    "step_ends": [32, 96, 160, 224, 31, 33, 97, 0, 383],
}


def poisoned(fn, shape, dtype):
    """fn() after leaving NaNs in the memory the caching allocator is likely to hand an output of this
    shape and dtype, so that an output element the kernel fails to write shows."""
    poison = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    del poison
    return fn()


def capture_step(step):
    """``(graph, outputs)``: ``step()`` run twice on a side stream (warm-up), then captured once."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step()
    return g, out


def cuda_kernels(fn):
    """``(fn()'s result, the names of the CUDA kernels it ran)``: fn() once to warm up, then once profiled."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = fn()
        torch.cuda.synchronize()
    return out, [ev.name for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA]
