"""pip install --no-build-isolation .

Builds the CUDA extension ahead of time (``moegemm/_C*.so``) when the installed torch has CUDA and nvcc
is found; otherwise installs the pure-Python package, which builds the extension just in time on first
use on a GPU (or runs the reference without one). Set MOEGEMM_NO_EXTENSION=1 to skip the build."""

import os

from setuptools import find_packages, setup


def extensions():
    if os.environ.get("MOEGEMM_NO_EXTENSION", "0") not in ("", "0"):
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        return [], {}
    if torch.version.cuda is None or CUDA_HOME is None:
        print("moegemm: no CUDA build of torch or no nvcc: installing without the extension (it builds on first use)")
        return [], {}
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")
    from moegemm import _build

    ext = CUDAExtension(
        name="moegemm._C",
        sources=[os.path.relpath(s) for s in _build.sources()],
        include_dirs=_build.cutlass_include_dirs() + [str(_build.CSRC)],
        extra_compile_args={"cxx": _build.CXX_FLAGS, "nvcc": _build.NVCC_FLAGS},
    )
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = extensions()
setup(
    name="moegemm",
    version="0.1.0",
    description="FP8 grouped GEMMs for Mixture-of-Experts layers on NVIDIA Hopper",
    packages=find_packages(include=["moegemm", "moegemm.*"]),
    python_requires=">=3.9",
    install_requires=["torch>=2.4"],
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
