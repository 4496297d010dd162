"""Building the CUDA extension: just in time (``torch.utils.cpp_extension.load`` + ninja, cached under
``TORCH_EXTENSIONS_DIR`` or torch's default cache), ahead of time by ``setup.py`` (``moegemm/_C*.so``,
preferred when present), and the compile-only check of ``python -m moegemm.build --check`` (CI).

The sources are the repository's ``csrc/`` (a source tree, an sdist, an editable install) or the copy
a wheel carries as ``moegemm/_csrc/``. The CUTLASS headers come from the pinned ``nvidia-cutlass``
package (third_party/README.md), or from ``MOEGEMM_CUTLASS_DIR`` (a CUTLASS checkout: ``include/`` and
``tools/util/include``).

This file imports nothing from the package (``setup.py`` loads it on its own) and imports torch only
inside the functions that need it.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import sys
import threading
import time
from pathlib import Path

PKG = Path(__file__).resolve().parent
ROOT = PKG.parent
NAME = "moegemm_C"


def csrc_dir() -> Path:
    """``csrc/`` of a source tree, else the copy installed with the package (``moegemm/_csrc``)."""
    for d in (ROOT / "csrc", PKG / "_csrc"):
        if (d / "moegemm.h").is_file() and (d / "binding.cpp").is_file():
            return d
    raise RuntimeError(f"moegemm: no C++/CUDA sources next to {PKG} (neither {ROOT / 'csrc'} nor {PKG / '_csrc'}): "
                       "reinstall moegemm from its source tree or a wheel built by its setup.py")


def cutlass_pin() -> str:
    """The pinned CUTLASS header package (third_party/cutlass.txt; a wheel carries it in _csrc/)."""
    for f in (ROOT / "third_party" / "cutlass.txt", PKG / "_csrc" / "cutlass.txt"):
        if f.is_file():
            for line in f.read_text().splitlines():
                if line.strip() and not line.lstrip().startswith("#"):
                    return line.strip()
    return "nvidia-cutlass==4.2.0.0"


def sources() -> list[str]:
    """The binding file, the C++ API layer (csrc/api/*.cpp) and every kernel translation unit (csrc/kernels/**/*.cu)."""
    csrc = csrc_dir()
    return ([str(csrc / "binding.cpp")] + sorted(str(p) for p in (csrc / "api").glob("*.cpp"))
            + sorted(str(p) for p in (csrc / "kernels").rglob("*.cu")))


def cutlass_include_dirs() -> list[str]:
    root = os.environ.get("MOEGEMM_CUTLASS_DIR")
    if root is None:
        try:
            import cutlass_library
        except ImportError as exc:
            raise RuntimeError(
                f"moegemm needs the CUTLASS headers: `pip install --no-deps {cutlass_pin()}` "
                "or set MOEGEMM_CUTLASS_DIR to a CUTLASS checkout") from exc
        root = cutlass_library.source_path
    dirs = [os.path.join(root, "include"), os.path.join(root, "tools", "util", "include")]
    if not os.path.isfile(os.path.join(dirs[0], "cutlass", "cutlass.h")):
        raise RuntimeError(f"no CUTLASS headers under {dirs[0]}")
    return dirs


def include_dirs() -> list[str]:
    return cutlass_include_dirs() + [str(csrc_dir())]


def torch_include_dir() -> str:
    """The installed torch's header folder (``torch/include``), without importing torch's C++ side."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        raise RuntimeError("moegemm: torch is not installed")
    return os.path.join(os.path.dirname(spec.origin), "include")


_STD_ERROR = re.compile(r"#\s*error\s+C\+\+\s*(\d\d)\s+or later")


def cxx_standard(torch_include: str | None = None) -> str:
    """The C++ standard for code that includes torch's headers (``csrc/binding.cpp``): the newest one
    that torch's own headers demand with an ``#error`` (torch 2.15's ``ATen/ATen.h``: "C++20 or later
    compatible compiler is required"; 2.4-2.13 ask for C++17), at least C++17. ``torch_include``:
    a ``torch/include`` folder (default: the installed torch's). The one decision used by the JIT
    build, ``setup.py`` and ``python -m moegemm.build --check``.

    The ``.cu`` kernels include no torch header and stay on C++17 (``NVCC_FLAGS``) whatever torch is."""
    if torch_include is None:
        torch_include = torch_include_dir()
    std = 17
    for rel in ("ATen/ATen.h", "c10/macros/Macros.h", "torch/csrc/api/include/torch/all.h", "torch/extension.h"):
        try:
            text = Path(torch_include, rel).read_text(errors="replace")
        except OSError:
            continue
        std = max([std] + [int(v) for v in _STD_ERROR.findall(text)])
    return f"c++{std}"


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


def cxx_flags(torch_include: str | None = None) -> list[str]:
    """Host compiler flags of the binding: the standard torch's headers need (``cxx_standard``)."""
    return ["-O3", f"-std={cxx_standard(torch_include)}"]


def default_jobs() -> int:
    """Parallel compiler processes when MAX_JOBS is not set: one per core, at most one per 4 GB of
    available memory (a CUTLASS translation unit takes ~4 GB)."""
    jobs = os.cpu_count() or 1
    try:
        with open("/proc/meminfo") as f:
            avail_kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        jobs = min(jobs, avail_kb // (4 << 20))
    except (OSError, StopIteration, ValueError):
        pass
    return max(1, jobs)


def build_directory() -> str:
    """Where the JIT build and its cache live: ``$TORCH_EXTENSIONS_DIR/moegemm_C``, by default
    ``~/.cache/torch_extensions/<python>_<cuda>/moegemm_C`` (e.g. ``py312_cu130``)."""
    import torch.utils.cpp_extension as ext

    try:
        return ext._get_build_directory(NAME, verbose=False)
    except Exception:  # a private helper: fall back to the root
        return os.path.join(os.environ.get("TORCH_EXTENSIONS_DIR") or ext.get_default_build_root(), NAME)


class _NinjaProgress:
    """Turns ninja's verbose output into a short progress display on stderr while the JIT build runs:
    ``torch.utils.cpp_extension.load(verbose=True)`` runs ``ninja -v`` with its output on file
    descriptor 1, which is pointed at a pipe for the duration. Ninja prints ``[i/n] <command>`` when a
    step finishes. Everything is kept in ``build.log`` in the build folder; on failure the end of it
    is printed."""

    def __init__(self, srcs: list[str], log_path: str):
        self.pending = [Path(s).name for s in srcs]
        self.total = len(srcs) + 1  # the link step
        self.log_path = log_path
        self.lines: list[str] = []
        self.start = time.time()
        self.built = 0
        self.last = self.start
        self._stop = threading.Event()

    def _say(self, msg: str) -> None:
        try:
            os.write(self._err, (msg + "\n").encode())
        except OSError:
            pass

    def __enter__(self):
        sys.stdout.flush()
        sys.stderr.flush()
        self._err = os.dup(2)
        self._saved = os.dup(1)
        r, w = os.pipe()
        os.dup2(w, 1)
        os.close(w)
        self._reader = threading.Thread(target=self._read, args=(r,), daemon=True)
        self._ticker = threading.Thread(target=self._tick, daemon=True)
        self._reader.start()
        self._ticker.start()
        return self

    def __exit__(self, exc_type, exc, tb):
        sys.stdout.flush()
        os.dup2(self._saved, 1)  # closes the pipe's last write end: the reader sees EOF
        os.close(self._saved)
        self._reader.join(timeout=10)
        self._stop.set()
        try:
            with open(self.log_path, "w") as f:
                f.write("".join(self.lines))
        except OSError:
            pass
        if exc_type is not None:
            tail = "".join(self.lines[-80:])
            self._say(f"moegemm: the extension build failed after {time.time() - self.start:.0f} s; end of its "
                      f"output (all of it: {self.log_path}):\n{tail}")
        os.close(self._err)
        return False

    def _read(self, fd: int) -> None:
        with os.fdopen(fd, "r", errors="replace") as pipe:
            for line in pipe:
                self.lines.append(line)
                m = re.match(r"\[(\d+)/(\d+)\]\s+(.*)", line)
                if not m:
                    continue
                i, n, cmd = int(m.group(1)), int(m.group(2)), m.group(3)
                src = re.search(r"\s-c\s+(\S+)", cmd)
                if src:
                    name = Path(src.group(1).strip("'\"")).name
                    if name in self.pending:
                        self.pending.remove(name)
                    what = f"compiled {name}"
                elif "-shared" in cmd or " -o " in cmd:
                    what = "linked"
                else:
                    what = cmd.split()[0] if cmd.split() else "step"
                self.built = i
                self.last = time.time()
                left = n - i
                self._say(f"moegemm: [{i:2d}/{n}] {self.last - self.start:4.0f} s  {what}"
                          + (f" ({left} left)" if left else ""))

    def _tick(self) -> None:
        while not self._stop.wait(20.0):
            if time.time() - self.last >= 20.0 and self.pending:
                names = ", ".join(self.pending[:3]) + (", ..." if len(self.pending) > 3 else "")
                self._say(f"moegemm:         {time.time() - self.start:4.0f} s  compiling {len(self.pending)} of "
                          f"{self.total - 1}: {names}")
                self.last = time.time()


class BuildEnvironmentError(RuntimeError):
    """The extension cannot be built (or loaded) here: no CUDA build of torch, CUDA toolkit or CUDA GPU."""


def missing_for_build(toolkit: bool = True) -> list[str]:
    """What building and running the extension here lacks, in words (empty: nothing): a CUDA build of
    torch, the CUDA toolkit (nvcc, as torch's just-in-time build finds it; only with ``toolkit``) and a
    CUDA GPU."""
    import torch

    missing = []
    if torch.version.cuda is None:
        missing.append(f"a CUDA build of torch (the installed torch {torch.__version__} is CPU-only)")
    if toolkit:
        # torch's extension builder logs "No CUDA runtime is found" at import on a machine without a GPU;
        # the sentence below says so already
        cpp_log = logging.getLogger("torch.utils.cpp_extension")
        level = cpp_log.level
        cpp_log.setLevel(logging.ERROR)
        try:
            from torch.utils.cpp_extension import CUDA_HOME
        finally:
            cpp_log.setLevel(level)

        if CUDA_HOME is None or not os.path.isfile(os.path.join(CUDA_HOME, "bin", "nvcc")):
            missing.append("the CUDA toolkit (no nvcc found: set CUDA_HOME or put nvcc on PATH)")
    if not torch.cuda.is_available():
        missing.append("a CUDA GPU (none is visible)")
    return missing


def require_build_environment(toolkit: bool = True) -> None:
    """Raise ``BuildEnvironmentError`` with one plain sentence naming what is missing, if anything."""
    missing = missing_for_build(toolkit)
    if missing:
        needs = missing[0] if len(missing) == 1 else ", ".join(missing[:-1]) + " and " + missing[-1]
        raise BuildEnvironmentError(f"moegemm: cannot build the CUDA extension here: it needs {needs}; without "
                                    "them moegemm runs its reference path (plain PyTorch), which needs no build.")


def prebuilt_extension() -> Path | None:
    """The extension built by setup.py (``moegemm/_C*.so``), if any."""
    found = sorted(PKG.glob("_C*.so"))  # built by setup.py
    return found[0] if found else None


@functools.lru_cache(maxsize=None)
def load_extension():
    """Load the extension built by setup.py, or build it just in time (about a minute on 16 cores,
    several minutes on few; later runs only check the cache) and load it. Without a CUDA build of torch,
    the CUDA toolkit or a GPU, building fails at once with ``BuildEnvironmentError``."""
    import torch
    from torch.utils.cpp_extension import load

    prebuilt = prebuilt_extension()
    if prebuilt is not None:
        torch.ops.load_library(str(prebuilt))
        return str(prebuilt)
    require_build_environment()

    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")
    os.environ.setdefault("MAX_JOBS", str(default_jobs()))
    os.environ.setdefault("NINJA_STATUS", "[%f/%t] ")
    srcs = sources()
    build_dir = build_directory()
    fresh = not os.path.isfile(os.path.join(build_dir, NAME + ".so"))
    if fresh:
        print(f"moegemm: building the CUDA extension ({len(srcs)} translation units, MAX_JOBS={os.environ['MAX_JOBS']}; "
              f"about a minute on 16 cores, several minutes on few) in {build_dir}", file=sys.stderr, flush=True)
    start = time.time()
    os.makedirs(build_dir, exist_ok=True)
    kwargs = dict(name=NAME, sources=srcs, extra_include_paths=include_dirs(), extra_cflags=cxx_flags(),
                  extra_cuda_cflags=NVCC_FLAGS, is_python_module=False)
    if os.environ.get("MOEGEMM_VERBOSE_BUILD", "0") not in ("", "0"):
        module = load(**kwargs, verbose=True)
    else:
        progress = _NinjaProgress(srcs, os.path.join(build_dir, "build.log"))
        with progress:
            module = load(**kwargs, verbose=True)
        if progress.built:
            print(f"moegemm: extension built in {time.time() - start:.0f} s, cached in {build_dir} "
                  "(later runs reuse it; delete the folder to rebuild)", file=sys.stderr, flush=True)
    return module


def compile_check(jobs: int = 2, torch_include: str | None = None, binding_only: bool = False) -> int:
    """Compile every translation unit of csrc/ without linking (no GPU and no CUDA build of torch
    needed): the .cu kernels with nvcc for sm_90a, the binding with the host compiler against torch's
    headers (syntax only) in the standard those headers demand. ``torch_include``: another torch's
    ``include`` folder for the binding (e.g. unpacked from a wheel); ``binding_only``: skip the
    kernels (they include no torch header). Returns the number of failures."""
    import shutil
    import subprocess
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    if torch_include is None:
        torch_include = torch_include_dir()
    torch_includes = [f"-I{torch_include}", f"-I{os.path.join(torch_include, 'torch', 'csrc', 'api', 'include')}"]
    includes = [f"-I{d}" for d in include_dirs()]
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    nvcc = shutil.which("nvcc") or os.path.join(cuda_home, "bin", "nvcc")
    cxx = os.environ.get("CXX", "c++")
    out = tempfile.mkdtemp()
    host = cxx_flags(torch_include)
    print(f"torch headers: {torch_include} -> binding compiled with -{host[-1].lstrip('-')}", flush=True)
    cmds = []
    for src in sources():
        obj = os.path.join(out, Path(src).name + ".o")
        if src.endswith(".cu"):
            if not binding_only:
                cmds.append([nvcc, *NVCC_FLAGS, *includes, "-c", src, "-o", obj])
        else:
            cmds.append([cxx, *host, "-fsyntax-only", *includes, *torch_includes,
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
