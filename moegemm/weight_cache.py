"""The FP8 weight cache: the FP8 copies of expert weights (``quantize_weight``: ``W`` and ``Wᵀ`` with their
scales), made once per change of the weights (a layer's weights together: one launch on the GPU) and reused by
every call in between (the micro-batches of a gradient-accumulation step, evaluation, activation recomputation).
Used by ``GroupedLinear``, ``GroupedMLP`` and ``moegemm.megatron.MoegemmExperts``; ``moegemm.torchtitan``'s experts
keep their copies in buffers instead (``moegemm/weight_buffers.py``, which torch.compile can trace), with the
validity rules below.

A weight may also be given as a tuple of tensors (its *parts*, e.g. ``(w1, w3)``): the copy is then the
quantization of their concatenation along dim 1, made without keeping that concatenation, and it is valid only
while every part is (each rule below holds for each part). An expert MLP whose gate and up weights are separate
parameters so gets the fused fc1 copies that ``grouped_mlp`` takes, concatenated once per change of the weights
rather than in every call.

When is a cached copy used? A copy of weight ``w`` is valid only while all of these still hold:

- it was made from this very tensor (identity: an int token the cache puts in the tensor's ``__dict__``;
  a new tensor has none, and ``torch.utils.swap_tensors`` moves it with the contents — a weak reference
  would make PyTorch refuse to swap the parameter in ``module.to`` / ``load_state_dict``), with the same
  ``data_ptr``, shape, dtype and device (``module.to(...)``, a new ``Parameter``, ``.data = ...`` onto a
  new buffer);
- ``w._version`` is unchanged: every in-place write through autograd-visible tensors bumps it
  (``w.mul_(...)``, ``w[0].zero_()``, ``torch.no_grad(): w.copy_(...)``, the ``load_state_dict`` copy,
  the foreach and for-loop implementations of torch.optim's optimizers);
- the global *weights generation* is unchanged. It is bumped by every ``torch.optim.Optimizer.step()``
  (a global step post-hook, registered when the first cache is created; it also covers the *fused*
  optimizers, which write without bumping ``_version``, and Megatron's optimizers, whose inner
  torch optimizer steps before they copy the main parameters into the model's through ``.data`` or the
  parameter buffers) and by ``moegemm.weights_changed()``;
- the module's own epoch is unchanged: ``load_state_dict`` bumps it (a module post-hook, also when a
  parent module loads).

What no counter can see, and the one explicit call: writes through ``param.data`` (``.data`` has its own
version counter), through another tensor sharing the storage (Megatron's parameter buffers, an EMA or
weight-averaging tool writing the model's weights) or from C++/NCCL outside a torch optimizer step.
After such a write, and before the next forward, call ``moegemm.weights_changed()`` (every cache) or the
module's ``refresh_fp8_weights()``. Optimizer steps need nothing: they bump the generation themselves.

``is_first_microbatch`` (the layers' argument; TransformerEngine's convention) still decides when given:

- ``True``: quantize now and keep the copies, whatever the checks say;
- ``False``: reuse the kept copies without any check (the caller vouches that the weights did not
  change); quantize only when there are none for these tensors;
- ``None`` (default): automatic, as above; with ``auto=False`` (the layers' ``fp8_weight_cache=False``)
  it quantizes inside every call instead and keeps nothing (what the benchmarks time as a step's first
  micro-batch).

CUDA graphs. A captured graph reads the cache's tensors at fixed addresses and runs no Python on
replay, so no check can run then. While the current stream is capturing:

- ``None`` quantizes inside the call (the quantization is part of the graph and re-reads the weights on
  every replay: never stale);
- ``True`` quantizes inside the graph into fresh (graph-pool) memory and keeps those copies for the
  ``False`` calls of the same capture (a captured step "``True``, then ``False``, ``False``"); such copies
  are never reused automatically outside the capture, since replays change the weights without any
  counter moving;
- ``False`` reuses the kept copies: the graph then reads them at their addresses, so from then on they
  are re-quantized *in place* (a graph-read copy is "pinned"). Re-quantizing them is the caller's job
  between replays that change the weights: ``refresh_fp8_weights()`` (eagerly, outside the graph).

The checks read only host-side metadata (``_version``, ``data_ptr``, Python counters): no device sync,
legal during capture. Under ``torch.compile`` the cache is bypassed: the weights are quantized inside
the call (traced into the graph), whatever ``is_first_microbatch`` says.

Memory: per cached weight ``[E, N, K]``, the four tensors of ``quantize_weight``: ``q`` and ``qᵀ`` (one
byte per element each, i.e. as much as the bf16 weight itself) and two fp32 scale tensors of
``E·⌈N/128⌉·⌈K/128⌉`` values each. The copies live until the next re-quantization (which drops the old
ones before making the new, unless a pending backward still holds them), ``clear()``
(``fp8_weight_cache = False``, ``to_fp8_inference()``), or the module.

Failures. A re-quantization that fails (``torch.OutOfMemoryError``) leaves no stale copy behind: the
entry it was replacing is gone (the next use quantizes), or, for copies a captured graph reads, still
marked with the weights it holds (so not fresh). Every entry is at all times the exact quantization of
the weights its version and stamp name.
"""

from __future__ import annotations

import itertools
from typing import Optional, Sequence

import torch

from . import backends
from ._validate import check_bool_arg

__all__ = ["FP8WeightCache", "weights_changed", "generation", "attach", "switch"]

_generation = 0
_hook = None


def weights_changed() -> None:
    """Declare that weights may have changed in a way moegemm cannot detect (writes through ``.data`` or
    through a buffer sharing their storage, outside a torch optimizer step): every FP8 weight cache
    re-quantizes at its next use. Cheap (a counter); optimizer steps do it by themselves."""
    global _generation
    _generation += 1


def generation() -> int:
    """The global weights generation (bumped by optimizer steps and ``weights_changed()``)."""
    return _generation


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    weights_changed()


def install_optimizer_hook() -> None:
    """Register the global ``torch.optim.Optimizer`` step post-hook once per process."""
    global _hook
    if _hook is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _hook = register_optimizer_step_post_hook(_after_optimizer_step)


def capturing(device: torch.device) -> bool:
    """Is the current CUDA stream capturing a graph (for tensors on ``device``)?"""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _parts(w) -> tuple:
    """The tensors a cached weight is made of: itself, or the parts of a combined weight (a tuple)."""
    return tuple(w) if isinstance(w, (tuple, list)) else (w,)


def _version(w):
    """The version counter of a weight, a tuple of them for a combined weight; None if any has none."""
    if isinstance(w, (tuple, list)):
        versions = tuple(_version(p) for p in w)
        return None if None in versions else versions
    try:
        return w._version
    except RuntimeError:  # inference tensors have no version counter: never trusted automatically
        return None


def quantize(weights: Sequence[torch.Tensor]) -> list:
    """``quantize_weight`` of each weight (one device; a tuple: of its parts' concatenation along dim 1), as
    ordinary (non-inference) tensors: one 4-tuple per weight, from the backend's ``quantize_weights`` (on the GPU
    a layer's two weights in one launch)."""
    ops = backends.select(_parts(weights[0])[0].device)
    with torch.no_grad(), torch.inference_mode(False):
        return [tuple(q) for q in ops.quantize_weights([_combined(w) for w in weights])]


def _combined(w) -> torch.Tensor:
    """The tensor a weight's copy quantizes: the weight itself, or its parts concatenated along dim 1."""
    if isinstance(w, (tuple, list)):
        return torch.cat([p.detach() for p in w], 1)
    return w.detach().contiguous()


_TOKEN = "_moegemm_fp8_token"
_tokens = itertools.count(1)


def _token(w: torch.Tensor) -> int:
    """The int marking this tensor object for the cache (set on first use, kept in its ``__dict__``)."""
    token = w.__dict__.get(_TOKEN)
    if token is None:
        token = w.__dict__[_TOKEN] = next(_tokens)
    return token


def _identity(w: torch.Tensor, token) -> tuple:
    return token, w.data_ptr(), tuple(w.shape), w.dtype, w.device


class _Entry:
    __slots__ = ("ids", "version", "stamp", "fp8", "captured", "pinned")

    def __init__(self, w, version, stamp, fp8, captured: bool):
        self.ids = tuple(_identity(p, _token(p)) for p in _parts(w))  # per part: token, address, shape, dtype, device
        self.version, self.stamp, self.fp8 = version, stamp, fp8
        self.captured = captured  # made during a capture: graph-pool memory that replays rewrite
        self.pinned = False  # read by a captured graph: re-quantize in place from now on

    def holds(self, w) -> bool:
        """Made from this tensor (from these parts), at its current address, shape, dtype and device."""
        parts = _parts(w)
        return len(parts) == len(self.ids) and all(
            _identity(p, p.__dict__.get(_TOKEN)) == ids for p, ids in zip(parts, self.ids))

    def fresh(self, w, stamp) -> bool:
        return (not self.captured and self.version is not None and self.stamp == stamp
                and self.version == _version(w))


class FP8WeightCache:
    """The FP8 copies of a fixed list of weights (one entry per position), valid as described in this
    module's docstring. ``auto``: whether ``is_first_microbatch=None`` uses the cache (else it quantizes
    inside the call). Not saved with the module: ``state_dict``, pickling and ``copy.deepcopy`` see
    an empty cache."""

    def __init__(self, auto: bool = True):
        install_optimizer_hook()
        self.auto = bool(auto)
        self._entries: list = []
        self._epoch = 0

    # ------------------------------------------------------------------------------- state
    def __getstate__(self):
        return {"auto": self.auto}

    def __setstate__(self, state):
        install_optimizer_hook()
        self.auto, self._entries, self._epoch = state["auto"], [], 0

    def __repr__(self) -> str:
        return f"FP8WeightCache(auto={self.auto}, entries={sum(e is not None for e in self._entries)})"

    def invalidate(self) -> None:
        """Re-quantize every weight at its next (automatic) use."""
        self._epoch += 1

    def clear(self) -> None:
        """Drop every copy (frees their memory once no pending backward holds them)."""
        self._entries = []
        self._epoch += 1

    def copies(self) -> Optional[tuple]:
        """The kept copies, one 4-tuple (or None) per weight; None when nothing is kept."""
        if not any(e is not None for e in self._entries):
            return None
        return tuple(e.fp8 if e is not None else None for e in self._entries)

    # ------------------------------------------------------------------------------- use
    def get(self, weights: Sequence[torch.Tensor], is_first_microbatch: Optional[bool] = None):
        """One ``quantize_weight`` 4-tuple per weight (a tensor, or a tuple of parts: see the module's docstring),
        for this call; None: quantize inside the call."""
        if torch.compiler.is_compiling():
            return None
        capture = capturing(_parts(weights[0])[0].device)
        if is_first_microbatch is None and (capture or not self.auto):
            return None
        stamp = (_generation, self._epoch)
        if len(self._entries) != len(weights):
            self._entries = [None] * len(weights)
        out, stale = [None] * len(weights), []
        for i, w in enumerate(weights):
            e = self._entries[i]
            if e is not None and not e.holds(w):
                e = None
            if e is not None and (is_first_microbatch is False
                                  or (is_first_microbatch is None and e.fresh(w, stamp))):
                if capture and not e.captured:
                    e.pinned = True
                out[i] = e.fp8
            else:
                stale.append(i)
            e = None  # (the old copies must be freeable while quantizing)
        if stale:
            for i, fp8 in zip(stale, self._quantize(stale, weights, stamp, capture)):
                out[i] = fp8
        return tuple(out)

    def refresh(self, weights: Sequence[torch.Tensor]) -> tuple:
        """Quantize every weight now, all in one call (in place for copies a captured graph reads); the copies."""
        stamp = (_generation, self._epoch)
        capture = capturing(_parts(weights[0])[0].device)
        if len(self._entries) != len(weights):
            self._entries = [None] * len(weights)
        return tuple(self._quantize(range(len(weights)), weights, stamp, capture))

    def _quantize(self, indices, weights: Sequence[torch.Tensor], stamp, capture: bool) -> list:
        """Quantize ``weights[i]`` into entry ``i`` for each of ``indices``, in one call of the backend (a layer's
        weights in one launch); their copies. An entry that holds its weight and is pinned (a captured graph reads
        its addresses) is re-quantized in place, the others into new entries, their old copies dropped first. If
        quantizing fails (out of memory), no stale copy is left behind: each of these entries is either None or the
        untouched pinned one, whose version and stamp still name the weights it holds."""
        indices = list(indices)
        todo = [weights[i] for i in indices]
        versions = [_version(w) for w in todo]  # before quantizing: a write racing with it must not be taken as seen
        pinned = []
        for i, w in zip(indices, todo):
            e = self._entries[i]
            if e is None or not (e.pinned and e.holds(w)):
                e = self._entries[i] = None  # frees the old copies now (unless a pending backward holds them)
            pinned.append(e)
        e = None
        copies = quantize(todo)
        for i, w, version, old, fp8 in zip(indices, todo, versions, pinned, copies):
            if old is not None:
                with torch.no_grad():
                    for dst, src in zip(old.fp8, fp8):
                        dst.copy_(src)
                old.version, old.stamp = version, stamp
            else:
                self._entries[i] = _Entry(w, version, stamp, fp8, captured=capture)
        return [self._entries[i].fp8 for i in indices]


# ----------------------------------------------------------------------------- the layers' side
def _invalidate_after_load(module, incompatible_keys) -> None:
    """load_state_dict post-hook: the loaded weights are quantized at their next use."""
    module._fp8_cache.invalidate()


def attach(module: torch.nn.Module, auto: bool = True) -> FP8WeightCache:
    """Give ``module`` its FP8 weight cache (``module._fp8_cache``), invalidated by its ``load_state_dict``
    (also when a parent module loads)."""
    module._fp8_cache = FP8WeightCache(auto=auto)
    module.register_load_state_dict_post_hook(_invalidate_after_load)
    return module._fp8_cache


def _get_switch(module) -> bool:
    return module._fp8_cache.auto


def _set_switch(module, on: bool) -> None:
    module._fp8_cache.auto = check_bool_arg("fp8_weight_cache", on)
    if not on:
        module._fp8_cache.clear()


# A layer's ``fp8_weight_cache`` attribute (``moegemm.modules.base.ExpertLayer``: ``fp8_weight_cache = switch``).
switch = property(_get_switch, _set_switch, doc="Whether is_first_microbatch=None reuses the FP8 weights while "
                  "they are valid (else each call quantizes); setting it to False frees the kept copies.")
