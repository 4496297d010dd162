"""Where the layers' gradients go, shared by both autograd shells (``linear.py``, ``mlp.py``): Megatron's
gradient-accumulation fusion (``weight.main_grad``), the gradients autograd gets back, the split
backward's ``WgradStore`` and the targets its deferred work accumulates into, and the refusal of double
backward."""

from __future__ import annotations

import collections
import contextlib
import warnings

import torch

from .._validate import check_int_arg, check_main_grad


def refuse_double_backward(what: str) -> None:
    """Backward under create_graph=True would build a graph whose second derivatives are wrong (the
    kernels are not differentiable): refuse it. (torch.compile refuses double backward by itself.)"""
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        raise RuntimeError(f"moegemm: {what} is not twice differentiable: its backward cannot run with "
                           "create_graph=True (double backward)")


SPLIT_BACKWARD_IN_FULLGRAPH = (
    "moegemm: the split backward (delay_wgrad_compute=True, or a wgrad_store) cannot run inside a torch.compile graph "
    "with fullgraph=True: its backward leaves the weight gradients to a Python store (backward_dw()), which a traced "
    "graph cannot hold, so such a layer runs outside the graph. Compile without fullgraph=True (the layer then runs "
    "eagerly between the compiled graphs), or turn the split backward off in the compiled region.")


def refuse_split_backward_in_fullgraph() -> None:
    """The split-backward layers run outside torch.compile's graphs (``torch.compiler.disable``): a graph break,
    which ``fullgraph=True`` (and export) refuses with torch's hint to remove the disable from moegemm. Refuse
    it first with moegemm's own message instead; without fullgraph the graph break stays what it was."""
    if torch.compiler.is_compiling():
        _refuse_if_one_graph()


@torch._dynamo.assume_constant_result  # run by dynamo while it traces (not traced): it sees the tracer
def _refuse_if_one_graph() -> bool:
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        one_graph = bool(getattr(tx, "one_graph", False) or getattr(tx, "error_on_graph_break", False))
    except Exception:  # noqa: BLE001 - another torch's internals: leave the refusal to torch
        return False
    if one_graph:
        # TorchRuntimeError: the kind of error dynamo passes on as it is (others it rewraps as internal errors)
        from torch._dynamo.exc import TorchRuntimeError

        raise TorchRuntimeError(SPLIT_BACKWARD_IN_FULLGRAPH)
    return False


def weight_grad_target(weight, need_dw: bool, name: str = "weight"):
    """Megatron's gradient-accumulation fusion: wgrad goes into ``weight.main_grad`` when it exists.
    Checked again here: the attribute may have been replaced between forward and backward."""
    if not need_dw:
        return None
    check_main_grad(weight, name)
    return getattr(weight, "main_grad", None)


def overwrites_main_grad(weight, target) -> bool:
    """Whether the gradient is written into its target instead of added to it: the weight's ``overwrite_main_grad``
    flag (Megatron-FSDP's, as Transformer Engine reads it), when the target is main_grad (not an fp32 ``.grad``)."""
    return target is not None and target is not weight.grad and bool(getattr(weight, "overwrite_main_grad", False))


def finish_weight_grad(dw, need_dw: bool, weight, main_grad):
    """The gradient autograd returns for ``weight``: None when not needed or when it went into main_grad."""
    if not need_dw or main_grad is not None:
        return None
    return dw if dw.dtype == weight.dtype else dw.to(weight.dtype)


def finish_sum(total, needed: bool, dtype):
    """A bias or probs gradient (an fp32 sum from the op) in its parameter's dtype, or None."""
    if not needed:
        return None
    return total if total.dtype == dtype else total.to(dtype)


class WgradStore:
    """The weight gradients a split backward left for later (Megatron's ``delay_wgrad_compute``).

    A layer's backward with a store computes the input gradient (and bias/probs gradients) at once and
    pushes its weight-gradient work here, holding the operands it needs (the FP8 column copies of dy and
    of the activations, or their bf16 tensors). ``backward_dw()`` runs all pending work in the order it
    was pushed (several micro-batches may be pending: the results accumulate) and releases the operands.
    Each gradient goes into ``weight.main_grad`` when the weight has one (fp32, accumulated by the GEMM),
    else into ``weight.grad`` (accumulated by the GEMM when it is an fp32 tensor of the weight's shape,
    else created or added to).

    Work never run keeps its operands alive: the store warns once when more than ``max_pending``
    backward passes are pending (backward_dw forgotten) and ``clear()`` drops them without computing.

    Failures (``torch.OutOfMemoryError`` mid-step): when ``backward_dw()``, or a backward that pushes
    here, raises, the store drops all its pending work (freeing the operands) before the exception
    propagates. That step's weight gradients are then incomplete (a main_grad may hold part of them), as
    after any failed backward: discard the step (zero the gradients); the store starts the next one empty."""

    def __init__(self, max_pending: int = 8):
        max_pending = check_int_arg("max_pending", max_pending)
        if max_pending < 0:
            raise ValueError(f"max_pending must be non-negative, got {max_pending}")
        self.max_pending = max_pending
        self._pending = collections.deque()
        self._warned = False

    def __len__(self) -> int:
        return len(self._pending)

    def push(self, job) -> None:
        self._pending.append(job)
        if len(self._pending) > self.max_pending and not self._warned:
            self._warned = True
            warnings.warn(f"moegemm: {len(self._pending)} split backward passes wait for backward_dw() (their FP8 "
                          "operands stay allocated until then); call backward_dw() after each backward, or clear()",
                          stacklevel=2)

    @torch.no_grad()
    def backward_dw(self) -> None:
        with self.dropped_on_failure():
            while self._pending:
                self._pending.popleft()()

    @contextlib.contextmanager
    def dropped_on_failure(self):
        """Run the enclosed work; if it raises, drop all pending work first (see the class docstring)."""
        try:
            yield
        except BaseException:
            self._pending.clear()
            raise

    def clear(self) -> None:
        self._pending.clear()

    def __getstate__(self):
        """A copy (``copy.deepcopy``, pickle) starts empty: pending work writes the original layer's gradients and
        holds its operands, so it stays with the original."""
        return {**self.__dict__, "_pending": collections.deque(), "_warned": False}


def check_wgrad_store(store) -> None:
    """``wgrad_store`` of the functions: None or a ``WgradStore``."""
    if store is not None and not isinstance(store, WgradStore):
        raise TypeError(f"wgrad_store must be a moegemm.WgradStore or None, got {type(store).__name__}")


def drops_on_failure(store):
    """Where a layer's backward runs: with a split-backward store, a failure drops the store's pending work
    (``WgradStore.dropped_on_failure``); without one, nothing."""
    return store.dropped_on_failure() if store is not None else contextlib.nullcontext()


def check_deferrable(*weights) -> None:
    """A split backward hands each weight's gradient to the weight itself later (main_grad or ``.grad``),
    outside autograd: a weight that is not a leaf (e.g. ``master.bfloat16()``) would lose it."""
    for name, w in weights:
        if w.requires_grad and w.grad_fn is not None:
            raise ValueError(f"wgrad_store (split backward) needs {name} to be a leaf tensor (a Parameter): its "
                             "deferred gradient cannot flow back through autograd to where it was computed from")


def grad_target(param: torch.Tensor):
    """Where a deferred GEMM accumulates param's gradient: main_grad (fp32, checked), else an fp32
    ``param.grad`` of param's shape, else None (the GEMM writes a fresh dw for add_grad)."""
    check_main_grad(param)
    target = getattr(param, "main_grad", None)
    grad = param.grad
    if target is None and grad is not None and grad.dtype == torch.float32 and grad.shape == param.shape \
            and grad.is_contiguous() and grad.device == param.device:
        target = grad
    return target


def add_grad(param: torch.Tensor, dw) -> None:
    """param.grad (created, or added to) += dw, unless dw is None (accumulated by the GEMM already)."""
    if dw is None or dw.numel() == 0:
        return
    dw = dw.to(param.dtype)
    if param.grad is None:
        param.grad = dw
    else:
        param.grad.add_(dw)
