"""Can this machine run a bench script? Each check ends the script with one plain sentence (exit status 1)
instead of a traceback from deep inside torch or a compiler. Scripts call them after parsing their
arguments (so that ``--help`` works on any machine) and before importing what builds or loads a CUDA
extension."""

from __future__ import annotations

from pathlib import Path


def _stop(script: str, sentence: str) -> None:
    raise SystemExit(f"{script} {sentence}; nothing was run.")


def _driver_lists_a_gpu() -> bool:
    """Whether the NVIDIA driver shows a GPU, asked without torch (a CPU-only torch cannot tell)."""
    gpus = Path("/proc/driver/nvidia/gpus")
    return (gpus.is_dir() and any(gpus.iterdir())) or any(Path("/dev").glob("nvidia[0-9]*"))


def require_cuda_gpu(script: str, hopper: bool = False) -> None:
    """A CUDA build of torch that sees a GPU; with ``hopper``, a GPU of compute capability 9.0 (H100,
    H200), the only one moegemm's kernels are built for."""
    import torch

    if not torch.cuda.is_available():
        if torch.version.cuda is None and _driver_lists_a_gpu():
            _stop(script, f"needs a CUDA build of torch, and this torch ({torch.__version__}) is CPU-only")
        _stop(script, "needs a CUDA GPU" + (" (an H100 or H200)" if hopper else "") + ", and this machine has none")
    if hopper and torch.cuda.get_device_capability() != (9, 0):
        major, minor = torch.cuda.get_device_capability()
        _stop(script, f"needs a Hopper GPU (compute capability 9.0) for moegemm's kernels, and "
                      f"{torch.cuda.get_device_name()} is {major}.{minor}")


def require_module(script: str, module: str) -> None:
    """A Python package the script needs that moegemm does not (``matplotlib`` for the plots)."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        _stop(script, f"needs {module} (pip install {module}), and it is not installed")


def require_cuda_toolkit(script: str) -> None:
    """nvcc where torch's extension builder looks for it (``CUDA_HOME``, else the nvcc on ``PATH``), for
    scripts that compile CUDA code of their own."""
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None or not (Path(CUDA_HOME) / "bin" / "nvcc").is_file():
        _stop(script, "needs the CUDA toolkit (nvcc) to compile its kernels, and none was found "
                      "(set CUDA_HOME to the toolkit's folder)")
