"""The optional ahead-of-time build of the CUDA extension; the project's metadata is in pyproject.toml.

``pip install --no-build-isolation .`` (or ``-e .``) builds ``moegemm/_C*.so`` when the installed torch
has CUDA and nvcc is found (CUDA_HOME, or nvcc on PATH); otherwise, and always under build isolation
(torch is not importable there), it installs the pure-Python package, which builds the extension just
in time on first use on a GPU (or runs the reference without one). ``MOEGEMM_NO_EXTENSION=1`` skips the
build. Wheels carry ``csrc/`` and the CUTLASS pin as ``moegemm/_csrc/`` for that just-in-time build."""

import importlib.util
import os
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def _load_build_module():
    """moegemm/_build.py on its own, without importing the package (which imports torch's Python side)."""
    spec = importlib.util.spec_from_file_location("_moegemm_build", HERE / "moegemm" / "_build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class build_py_with_sources(build_py):
    """Also copies csrc/ (and third_party/cutlass.txt) into the built package as moegemm/_csrc/, the
    sources a just-in-time build from an installed wheel compiles. Editable installs use csrc/ in place."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        dest = Path(self.build_lib) / "moegemm" / "_csrc"
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(HERE / "csrc", dest, ignore=shutil.ignore_patterns("*.o", "*.so", "__pycache__"))
        shutil.copy2(HERE / "third_party" / "cutlass.txt", dest / "cutlass.txt")

    def get_outputs(self, include_bytecode=1):
        outputs = list(super().get_outputs(include_bytecode))
        if not getattr(self, "editable_mode", False):
            dest = Path(self.build_lib) / "moegemm" / "_csrc"
            outputs += [str(dest / p.relative_to(HERE / "csrc")) for p in (HERE / "csrc").rglob("*") if p.is_file()]
            outputs.append(str(dest / "cutlass.txt"))
        return outputs


def extensions():
    if _load_build_module().env_flag("MOEGEMM_NO_EXTENSION"):
        print("moegemm: MOEGEMM_NO_EXTENSION set: installing without the extension (it builds on first use)")
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        print("moegemm: torch is not importable here (build isolation?): installing without the extension "
              "(it builds on first use; `pip install --no-build-isolation .` builds it now)")
        return [], {}
    if torch.version.cuda is None or CUDA_HOME is None:
        print("moegemm: no CUDA build of torch or no nvcc: installing without the extension (it builds on first use)")
        return [], {}
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")
    b = _load_build_module()
    ext = CUDAExtension(
        name="moegemm._C",
        sources=[os.path.relpath(s, HERE) for s in b.sources()],
        include_dirs=b.include_dirs(),
        extra_compile_args={"cxx": b.cxx_flags(), "nvcc": b.NVCC_FLAGS},
    )
    print(f"moegemm: building the CUDA extension ahead of time (binding: {b.cxx_flags()[-1]}, "
          f"MAX_JOBS={os.environ.get('MAX_JOBS', 'unset')})")
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = extensions()
cmdclass["build_py"] = build_py_with_sources
setup(ext_modules=ext_modules, cmdclass=cmdclass)
