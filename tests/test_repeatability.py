"""Repeatability (docs/design.md#determinism): the same training step gives bitwise the same outputs and gradients, compared
byte for byte: run twice, on another CUDA stream, and in two threads at once, each driving its own layer
on its own stream.

The step (``training_step.Rig.train_step``): two micro-batches whose gradients accumulate, an SGD update of
the weights in place (the FP8 weight cache re-quantizes) and a forward with the updated weights. Both
recipes; the MLP (SwiGLU, both biases, router probs) and the linear layer (bias); every gradient target:
``.grad``, an fp32 ``main_grad``, and the split backward with either. On a Hopper GPU (the CUDA kernels);
the reruns and the threads also on the CPU (the reference path, small shapes).
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from conftest import requires_cuda
from training_step import MODES, Rig, assert_bitwise

RECIPES = ["fp8_blockwise", "bf16"]
KINDS = ["mlp", "linear"]
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]
SMALL = {"E": 4, "H": 128, "F": 128, "T": 200}  # the CPU's shapes (the GPU's: Rig's defaults)


def rig(kind, recipe, mode, device="cuda") -> Rig:
    return Rig(kind, recipe, mode, device=device, **(SMALL if device == "cpu" else {}))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("kind", KINDS)
def test_rerun_is_bitwise(kind, recipe, mode, device):
    expected = rig(kind, recipe, mode, device).train_step()
    assert_bitwise(rig(kind, recipe, mode, device).train_step(), expected, "a second run of the step")


@requires_cuda
@pytest.mark.parametrize("mode", ["grad", "split_main_grad"])
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("kind", KINDS)
def test_other_stream_is_bitwise(kind, recipe, mode):
    expected = rig(kind, recipe, mode).train_step()
    other = rig(kind, recipe, mode)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = other.train_step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert_bitwise(got, expected, "the step on a side stream")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["grad", "split_main_grad"])
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("kind", KINDS)
def test_two_threads_two_streams_are_bitwise(kind, recipe, mode, device):
    """Two threads start together and each runs the step three times (a fresh, identical layer each time)
    on its own stream, so the two streams' kernels overlap on the GPU."""
    expected = rig(kind, recipe, mode, device).train_step()
    rigs = [[rig(kind, recipe, mode, device) for _ in range(3)] for _ in range(2)]
    if device == "cuda":
        torch.cuda.synchronize()
    results, errors = [[], []], []
    start = threading.Barrier(2)

    def drive(k: int) -> None:
        try:
            stream = torch.cuda.Stream() if device == "cuda" else None
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                start.wait(timeout=60)
                for r in rigs[k]:
                    results[k].append(r.train_step())
            if stream is not None:
                stream.synchronize()
        except BaseException as exc:  # re-raised on the main thread
            errors.append(exc)

    threads = [threading.Thread(target=drive, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    if errors:
        raise errors[0]
    for k in range(2):
        assert len(results[k]) == 3
        for i, got in enumerate(results[k]):
            assert_bitwise(got, expected, f"thread {k}, step {i}")
