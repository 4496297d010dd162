"""The process group of the two Megatron examples (megatron_ep.py, megatron_ep_train.py) and the
redirects their gloo CPU smoke tests need (megatron-core's training schedules included)."""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist


class _NullEvent:
    def synchronize(self):
        pass

    def record(self, *a, **k):
        pass

    def wait(self, *a, **k):
        pass


class _NullStream:
    def wait_event(self, *a, **k):
        pass

    def wait_stream(self, *a, **k):
        pass

    def record_event(self, *a, **k):
        return _NullEvent()


def cpu_redirects():
    """megatron-core hard-codes torch.cuda calls on the paths the CPU smoke tests take (the all-to-all
    dispatcher's device-to-host copies on a side stream, the RNG tracker)."""
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_stream = lambda *a, **k: _NullStream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    from megatron.core.transformer.moe import token_dispatcher

    token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _NullStream()
    # the split sizes become numpy arrays as on the GPU (megatron converts device tensors only)
    token_dispatcher.maybe_move_tensor_to_cpu = \
        lambda t, as_numpy=False, record_stream=False: t.numpy() if as_numpy and torch.is_tensor(t) else t
    get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    _schedule_redirects()


class _CpuTorch:
    """torch as megatron's schedules module sees it on the CPU: its token counter asks for device="cuda"."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, **kwargs)


def _schedule_redirects():
    """What megatron's schedules (and its EP-overlap schedule: streams, events, NVTX ranges, record_stream)
    call on torch.cuda, made no-ops on the CPU."""
    from megatron.core.pipeline_parallel import schedules

    torch.cuda.Stream = lambda *a, **k: _NullStream()
    torch.cuda.Event = lambda *a, **k: _NullEvent()
    torch.cuda.nvtx.range_push = lambda *a, **k: None
    torch.cuda.nvtx.range_pop = lambda *a, **k: None
    torch.Tensor.record_stream = lambda self, stream: None
    schedules.torch = _CpuTorch()


def init_process_group(cpu: bool):
    """(rank, world, device) of this torchrun process: gloo on the CPU (with cpu_redirects), else NCCL
    with one GPU per process."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if cpu:
        cpu_redirects()
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl")
    return rank, world, device


def init_expert_parallel(cpu: bool, world: int):
    """megatron-core's parallel state for TP = PP = 1, EP = world (and its CUDA RNG seed on a GPU)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # megatron-core 0.16.1 without TransformerEngine
        moe_utils.te_general_gemm = None
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                             expert_model_parallel_size=world)
    if not cpu:
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234)
