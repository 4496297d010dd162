"""FP8 copies of a module's weights kept in the module's buffers: the FP8 weight cache for code that
``torch.compile`` traces (``moegemm.torchtitan``'s experts, whose blocks torchtitan compiles with
``fullgraph=True``), and the same cache in eager mode.

The copies (per weight the four tensors of ``quantize_weight``: ``q``, ``s``, ``qT``, ``sT``) are buffers of the
module (``register_buffer(..., persistent=False)``: moved by ``module.to``, never in a ``state_dict``), allocated
once for the weights' shapes. Before every use, ``refresh`` re-quantizes them *in place* when the weights are not
the ones they hold; under ``torch.compile`` it is the op ``torch.ops.moegemm_cache.refresh_fp8_copies_``, which
declares the copies mutated, so that the compiled graph orders it before the GEMMs that read them and inductor
runs it on the buffers themselves. The check runs on the host at run time (eager or inside the compiled graph),
with no device sync:

- the *stamp*, a small int64 CPU tensor beside the buffers (an attribute, not a buffer, so that ``module.to``
  leaves it on the host), records what the copies hold: the global weights generation
  (``moegemm.weight_cache``: bumped by every optimizer step and ``moegemm.weights_changed()``) and per weight
  part its identity token, address and version counter, read before quantizing;
- the copies are fresh while all of these are unchanged: the rules of ``moegemm/weight_cache.py`` (in-place
  writes bump the version, optimizer steps the generation; writes through ``.data`` or another tensor need
  ``moegemm.weights_changed()``). ``deepcopy`` carries the copies' values with them and moves the weights (a new
  address: stale; ``moegemm.torchtitan``'s experts make their copies anew on ``module.to``); a compiled graph
  that hands the op a copy of the buffers (a recompute under activation checkpointing) hands it their values,
  and so their freshness;
- ``invalidate`` (a ``load_state_dict``, ``refresh_fp8_weights()``) clears the stamp.

A weight given as a tuple of parts (``(w1, w3)``) is quantized as their concatenation along dim 1, as in the
weight cache: straight into the copies' rows when every part but the last is whole 128-row blocks (the backend's
``quantize_weights_into``, all weights in one launch), else concatenated first. Under CUDA-graph capture the
copies are re-quantized inside the graph, so at every replay; since a replay may also change the weights
without moving any counter (a captured optimizer step), copies a capture wrote are re-quantized at every eager
use from then on. A tensor the check cannot identify (no version counter, a view made anew every call) is
re-quantized at every use.

In place means: a backward still pending from a forward before the weights changed would read the new copies;
eager autograd refuses that (the copies it saved were modified in place), and the re-quantization happens only
when the weights changed, which in training is after every backward of the step.
"""

from __future__ import annotations

import functools
from typing import List, Optional, Sequence

import torch

from . import backends, weight_cache
from .layout import BLOCK, ceil_div

__all__ = ["allocate", "release", "matching", "refresh", "invalidate"]

_NAMES = ("q", "s", "qT", "sT")
_HEAD = 2  # stamp words before the parts': state, generation
_STALE, _HELD, _CAPTURED = 0, 1, -1  # stamp[0]: to be quantized; holds the weights below; written by a graph capture
_PART = 3  # per part: token, address, version


def _shapes(E: int, N: int, K: int) -> list:
    nb, kb = ceil_div(N, BLOCK), ceil_div(K, BLOCK)
    return [((E, N, K), torch.float8_e4m3fn), ((E, nb, kb), torch.float32),
            ((E, K, N), torch.float8_e4m3fn), ((E, kb, nb), torch.float32)]


def _combined_shape(w) -> tuple:
    parts = weight_cache._parts(w)
    E, _, K = parts[0].shape
    return E, sum(p.shape[1] for p in parts), K


def _key(weights: Sequence) -> tuple:
    """What the copy buffers are made for: the weights' device and each weight's combined shape."""
    return (weight_cache._parts(weights[0])[0].device, *(_combined_shape(w) for w in weights))


@functools.lru_cache(maxsize=None)
def _buffer_names(prefix: str, count: int) -> tuple:
    return tuple(f"{prefix}{i}_{n}" for i in range(count) for n in _NAMES)


def allocate(module: torch.nn.Module, prefix: str, weights: Sequence) -> List[torch.Tensor]:
    """Register (or replace) ``module``'s FP8 copy buffers for ``weights`` (tensors or tuples of parts, all on one
    device), named ``{prefix}{i}_{q,s,qT,sT}``, their stamp ``{prefix}stamp`` (cleared: not yet quantized) and what
    they are made for ``{prefix}key``; returns them as ``matching`` does."""
    key = _key(weights)
    with torch.inference_mode(False):  # (made in an inference-mode call they must still take training's writes)
        for i, w in enumerate(weights):
            for name, (shape, dtype) in zip(_NAMES, _shapes(*key[1 + i])):
                module.register_buffer(f"{prefix}{i}_{name}", torch.empty(shape, dtype=dtype, device=key[0]),
                                       persistent=False)
        parts = sum(len(weight_cache._parts(w)) for w in weights)
        setattr(module, f"{prefix}stamp", torch.zeros(_HEAD + _PART * parts, dtype=torch.int64))
    setattr(module, f"{prefix}key", key)
    weight_cache.install_optimizer_hook()
    return [module._buffers[n] for n in _buffer_names(prefix, len(weights))]


def release(module: torch.nn.Module, prefix: str, count: int) -> None:
    """Drop the copy buffers (their memory is freed once no pending backward holds them)."""
    for name in _buffer_names(prefix, count):
        module._buffers.pop(name, None)
    for name in ("stamp", "key"):
        if hasattr(module, prefix + name):
            delattr(module, prefix + name)


def matching(module: torch.nn.Module, prefix: str, weights: Sequence) -> Optional[List[torch.Tensor]]:
    """The copy buffers (flat, four per weight) if ``module`` has them for these weights' shapes and device,
    else None. (Only ``allocate`` and ``release`` make and drop them, ``module.to`` through ``release``: the key
    they record stands for the buffers' shapes, so no buffer is inspected on this per-call path.)"""
    if getattr(module, f"{prefix}key", None) != _key(weights):
        return None
    copies = [module._buffers.get(n) for n in _buffer_names(prefix, len(weights))]
    return None if any(c is None for c in copies) else copies


def invalidate(module: torch.nn.Module, prefix: str) -> None:
    """The copies are re-quantized at their next use."""
    stamp = getattr(module, f"{prefix}stamp", None)
    if stamp is not None and int(stamp[0]) == _HELD:
        stamp[0] = _STALE


def refresh(weights: Sequence, copies: List[torch.Tensor], stamp: torch.Tensor) -> None:
    """Re-quantize ``copies`` in place unless they hold ``weights`` (this module's docstring). Eager: a plain call
    (copies untouched, so no version counter moves, when fresh); under torch.compile: the op, which the graph
    orders before the copies' readers."""
    parts = [weight_cache._parts(w) for w in weights]
    flat = [p for ps in parts for p in ps]
    counts = [len(ps) for ps in parts]
    if torch.compiler.is_compiling():
        torch.ops.moegemm_cache.refresh_fp8_copies_(flat, counts, copies, stamp)
    else:
        _refresh(flat, counts, copies, stamp)


def _identity(p: torch.Tensor) -> list:
    version = weight_cache._version(p)
    return [weight_cache._token(p), p.data_ptr(), -1 if version is None else version]


def _refresh(flat: List[torch.Tensor], counts: List[int], copies: List[torch.Tensor], stamp: torch.Tensor) -> None:
    capture = weight_cache.capturing(copies[0].device)
    held = stamp.tolist()  # (a host tensor: no sync)
    now = [v for p in flat for v in _identity(p)]  # before quantizing: a write racing with it is not taken as seen
    if (not capture and held[0] == _HELD and held[1] == weight_cache.generation() and -1 not in now[2::_PART]
            and held[_HEAD:] == now):
        return
    # A captured graph re-quantizes the copies at every replay, and a replay that also changes the weights (a
    # captured optimizer step) moves no counter: copies a capture wrote are never trusted again.
    captured = capture or held[0] == _CAPTURED
    if not captured:
        stamp[0] = _STALE  # (while the copies are being overwritten: a failure leaves them stale)
    parts, sizes, start = [], [], 0
    for n in counts:  # a weight's parts as they are where each but the last is whole 128-row blocks, else concatenated
        mine = flat[start:start + n]
        whole = all(p.shape[1] % BLOCK == 0 for p in mine[:-1])
        parts += [p.detach().contiguous() for p in mine] if whole else [weight_cache._combined(tuple(mine))]
        sizes.append(n if whole else 1)
        start += n
    with torch.no_grad():
        backends.select(copies[0].device).quantize_weights_into(parts, sizes, copies)
    stamp.copy_(torch.tensor([_CAPTURED if captured else _HELD, weight_cache.generation()] + now, dtype=torch.int64))


@torch.library.custom_op("moegemm_cache::refresh_fp8_copies_", mutates_args=("copies", "stamp"))
def _refresh_op(weights: List[torch.Tensor], parts: List[int], copies: List[torch.Tensor], stamp: torch.Tensor) -> None:
    _refresh(weights, parts, copies, stamp)


@_refresh_op.register_fake
def _refresh_fake(weights, parts, copies, stamp) -> None:
    return None
