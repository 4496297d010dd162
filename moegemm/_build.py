"""Building the CUDA extension just in time (torch.utils.cpp_extension.load + ninja), cached in
``TORCH_EXTENSIONS_DIR``; ``python -m moegemm.build`` prebuilds it. ``setup.py`` builds the same sources
ahead of time; an installed build (``moegemm/_C*.so``) is preferred when present.

The CUTLASS headers come from the pinned ``nvidia-cutlass`` package (third_party/README.md), or from
``MOEGEMM_CUTLASS_DIR`` (a CUTLASS checkout: ``include/`` and ``tools/util/include``).
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
NAME = "moegemm_C"


def sources() -> list[str]:
    """The binding file and every kernel translation unit."""
    return [str(CSRC / "binding.cpp")] + sorted(str(p) for p in (CSRC / "kernels").glob("*.cu"))


def cutlass_include_dirs() -> list[str]:
    root = os.environ.get("MOEGEMM_CUTLASS_DIR")
    if root is None:
        try:
            import cutlass_library
        except ImportError as exc:
            raise RuntimeError(
                "moegemm needs the CUTLASS headers: `pip install --no-deps nvidia-cutlass==4.2.0.0` "
                "or set MOEGEMM_CUTLASS_DIR to a CUTLASS checkout") from exc
        root = cutlass_library.source_path
    dirs = [os.path.join(root, "include"), os.path.join(root, "tools", "util", "include")]
    if not os.path.isfile(os.path.join(dirs[0], "cutlass", "cutlass.h")):
        raise RuntimeError(f"no CUTLASS headers under {dirs[0]}")
    return dirs


ARCH_FLAGS = ["-gencode=arch=compute_90a,code=sm_90a"]
NVCC_FLAGS = ARCH_FLAGS + [
    "-std=c++17",
    "-O3",
    "--expt-relaxed-constexpr",
    "--expt-extended-lambda",
    "-DNDEBUG",
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-U__CUDA_NO_HALF2_OPERATORS__",
]
CXX_FLAGS = ["-O3", "-std=c++17"]


@functools.lru_cache(maxsize=None)
def load_extension():
    """Import the prebuilt extension, or build it (minutes the first time) and load it."""
    import torch
    from torch.utils.cpp_extension import load

    prebuilt = sorted(Path(__file__).parent.glob("_C*.so"))  # built by setup.py
    if prebuilt:
        torch.ops.load_library(str(prebuilt[0]))
        return str(prebuilt[0])

    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")
    verbose = os.environ.get("MOEGEMM_VERBOSE_BUILD", "0") not in ("", "0")
    print(f"moegemm: building/loading the CUDA extension ({len(sources())} sources; the first build takes a few "
          f"minutes, later runs use the cache) ...", file=sys.stderr, flush=True)
    start = time.time()
    module = load(
        name=NAME,
        sources=sources(),
        extra_include_paths=cutlass_include_dirs() + [str(CSRC)],
        extra_cflags=CXX_FLAGS,
        extra_cuda_cflags=NVCC_FLAGS,
        is_python_module=False,
        verbose=verbose,
    )
    print(f"moegemm: extension ready in {time.time() - start:.0f} s", file=sys.stderr, flush=True)
    return module


def compile_check(jobs: int = 2) -> int:
    """Compile every translation unit of csrc/ without linking (no GPU and no CUDA build of torch
    needed): the .cu kernels with nvcc for sm_90a, the binding with the host compiler against torch's
    headers (syntax only). Used by CI to catch compile errors. Returns the number of failures."""
    import shutil
    import subprocess
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    import torch.utils.cpp_extension as ext

    includes = [f"-I{d}" for d in cutlass_include_dirs() + [str(CSRC)]]
    torch_includes = [f"-I{d}" for d in ext.include_paths()]
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    nvcc = shutil.which("nvcc") or os.path.join(cuda_home, "bin", "nvcc")
    out = tempfile.mkdtemp()
    cmds = []
    for src in sources():
        obj = os.path.join(out, Path(src).name + ".o")
        if src.endswith(".cu"):
            cmds.append([nvcc, *NVCC_FLAGS, *includes, "-c", src, "-o", obj])
        else:
            cmds.append(["c++", *CXX_FLAGS, "-fsyntax-only", *includes, *torch_includes,
                         f"-I{os.path.join(cuda_home, 'include')}", src])

    def run(cmd):
        start = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        name = Path(cmd[-3] if cmd[-2] == "-o" else cmd[-1]).name
        status = "ok" if proc.returncode == 0 else "FAILED"
        print(f"compile {name}: {status} ({time.time() - start:.0f} s)", flush=True)
        if proc.returncode:
            print(proc.stdout + proc.stderr, flush=True)
        return proc.returncode != 0

    with ThreadPoolExecutor(jobs) as pool:
        failures = sum(pool.map(run, cmds))
    shutil.rmtree(out, ignore_errors=True)
    return failures
