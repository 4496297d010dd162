"""Building the CUDA extension: just in time (``torch.utils.cpp_extension.load`` + ninja, cached under
``TORCH_EXTENSIONS_DIR`` or torch's default cache), ahead of time by ``setup.py`` (``moegemm/_C*.so``,
preferred when present), and the compile-only check of ``python -m moegemm.build --check`` (CI).

Many processes may start at once (eight ranks of ``torchrun`` on an empty cache): one builds, the others
wait for it and load what it built (``jit_build_and_load``). The cache's lock is a ``flock``, which dies
with its holder (loads share it, a build holds it alone); a lock file torch left in the build folder by a
build that died is removed; a cached .so is loaded only if it matches the manifest written beside it
after its build (size and sha256, the torch, CUDA, Python and nvcc it was built with, a hash of the
sources and flags), else it is rebuilt.

The sources are the repository's ``csrc/`` (a source tree, an sdist, an editable install) or the copy
a wheel carries as ``moegemm/_csrc/``. The CUTLASS headers come from the pinned ``nvidia-cutlass``
package (third_party/README.md), or from ``MOEGEMM_CUTLASS_DIR`` (a CUTLASS checkout: ``include/`` and
``tools/util/include``).

This file imports nothing from the package (``setup.py`` loads it on its own) and imports torch only
inside the functions that need it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import socket
import sys
import threading
import time
from pathlib import Path

try:
    from ._env import env_flag
except ImportError:  # loaded on its own (setup.py): its sibling _env.py, which imports nothing, by path
    import importlib.util as _util

    _spec = _util.spec_from_file_location("_moegemm_env", Path(__file__).resolve().parent / "_env.py")
    _env = _util.module_from_spec(_spec)
    _spec.loader.exec_module(_env)
    env_flag = _env.env_flag

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
            raise BuildEnvironmentError(
                f"moegemm: no CUTLASS headers (the nvidia-cutlass package is not installed): `pip install --no-deps "
                f"{cutlass_pin()}` or set MOEGEMM_CUTLASS_DIR to a CUTLASS checkout") from exc
        root = cutlass_library.source_path
    dirs = [os.path.join(root, "include"), os.path.join(root, "tools", "util", "include")]
    if not os.path.isfile(os.path.join(dirs[0], "cutlass", "cutlass.h")):
        where = "MOEGEMM_CUTLASS_DIR" if os.environ.get("MOEGEMM_CUTLASS_DIR") else "the nvidia-cutlass package"
        raise BuildEnvironmentError(f"moegemm: no CUTLASS headers under {dirs[0]} (cutlass/cutlass.h, from {where})")
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
    """The extension cannot be built (or loaded, or compile-checked) here: no CUDA build of torch, CUDA toolkit,
    CUDA GPU, CUTLASS or torch headers, or compiler. Its message is one line; ``python -m moegemm.build`` prints
    it without a traceback."""


def search_cuda_home() -> str | None:
    """The CUDA toolkit's root as torch's extension builder looks for it (``CUDA_HOME``, ``CUDA_PATH``, the
    folder above the ``nvcc`` on ``PATH``, ``/usr/local/cuda``), the first with ``bin/nvcc``; for a CPU build
    of torch, whose ``cpp_extension.CUDA_HOME`` is always None."""
    import shutil

    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(nvcc)))
    candidates.append("/usr/local/cuda")
    for home in candidates:
        if home and os.path.isfile(os.path.join(home, "bin", "nvcc")):
            return home
    return None


def cuda_home() -> str | None:
    """The CUDA toolkit (its root, with ``bin/nvcc``) the build uses: torch's ``CUDA_HOME`` with a CUDA build of
    torch (what its just-in-time build compiles with), else ``search_cuda_home()``; None if there is none."""
    import torch

    if torch.version.cuda is None:
        return search_cuda_home()
    # torch's extension builder logs "No CUDA runtime is found" at import on a machine without a GPU;
    # missing_for_build's sentence says so already
    cpp_log = logging.getLogger("torch.utils.cpp_extension")
    level = cpp_log.level
    cpp_log.setLevel(logging.ERROR)
    try:
        from torch.utils.cpp_extension import CUDA_HOME
    finally:
        cpp_log.setLevel(level)
    return CUDA_HOME if CUDA_HOME and os.path.isfile(os.path.join(CUDA_HOME, "bin", "nvcc")) else None


def _driver_lists_a_gpu() -> bool:
    """Whether the NVIDIA driver shows a GPU, asked without torch (a CPU build of torch cannot tell)."""
    gpus = Path("/proc/driver/nvidia/gpus")
    try:
        return (gpus.is_dir() and any(gpus.iterdir())) or any(Path("/dev").glob("nvidia[0-9]*"))
    except OSError:
        return False


def missing_for_build(toolkit: bool = True) -> list[str]:
    """What building and running the extension here lacks, in words (empty: nothing): a CUDA build of
    torch, the CUDA toolkit (nvcc, as torch's just-in-time build finds it; only with ``toolkit``) and a
    CUDA GPU (with a CPU build of torch, as the driver lists them)."""
    import torch

    missing = []
    cpu_torch = torch.version.cuda is None
    if cpu_torch:
        missing.append(f"a CUDA build of torch (torch {torch.__version__} is a CPU build)")
    if toolkit and cuda_home() is None:
        missing.append("the CUDA toolkit (no nvcc found: set CUDA_HOME or put nvcc on PATH)")
    gpu = _driver_lists_a_gpu() if cpu_torch else torch.cuda.is_available()
    if not gpu:
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


_LOAD_LOCK = threading.Lock()  # threads of one process: one loads, the others find it loaded


@functools.lru_cache(maxsize=None)
def load_extension():
    """Load the extension built by setup.py, or build it just in time (about a minute on 16 cores,
    several minutes on few; later runs only check the cache) and load it. Without a CUDA build of torch,
    the CUDA toolkit or a GPU, building fails at once with ``BuildEnvironmentError``. Safe to call from
    many processes at once (``jit_build_and_load``) and from many threads."""
    with _LOAD_LOCK:
        prebuilt = prebuilt_extension()
        if prebuilt is not None:
            return load_prebuilt(prebuilt)
        require_build_environment()
        return jit_build_and_load()


def load_prebuilt(path: Path) -> str:
    """Load the extension setup.py built into the package. No lock: nothing is written. It was built
    against the torch installed then; if it no longer loads (another torch, a broken install), the
    ``RuntimeError`` says so and how to fix it, instead of a bare loader error."""
    import torch

    try:
        torch.ops.load_library(str(path))
    except OSError as exc:
        raise RuntimeError(f"moegemm: the prebuilt extension {path} does not load with torch {torch.__version__} "
                           f"({exc}): rebuild it (`pip install --no-build-isolation .`) or delete it to build the "
                           "extension just in time") from exc
    return str(path)


def jit_build_and_load() -> str:
    """Build the extension in the just-in-time cache if needed, and load it; returns the .so's path.

    Safe for many processes at once: eight ranks starting together on an empty cache give one build;
    the others wait for it (one line on stderr) and load what it built. A .so is loaded only when it
    matches its manifest and this toolchain and these sources (``check_cached``); then, under a shared
    lock, any number of processes load it at once. Otherwise, under the exclusive lock (``build_lock``):
    a lock file torch left behind is removed (``remove_stale_baton``), what must not be reused is
    removed, torch's ``load`` builds (ninja: only what changed) and loads, and the new .so gets its
    manifest (``write_manifest``)."""
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")
    os.environ.setdefault("MAX_JOBS", str(default_jobs()))
    os.environ.setdefault("NINJA_STATUS", "[%f/%t] ")
    build_dir = build_directory()
    kwargs = dict(name=NAME, sources=sources(), extra_include_paths=include_dirs(), extra_cflags=cxx_flags(),
                  extra_cuda_cflags=NVCC_FLAGS, build_directory=build_dir, is_python_module=False)
    expected = {"toolchain": toolchain(), "sources": source_fingerprint(kwargs)}
    so = os.path.join(build_dir, NAME + ".so")
    with build_lock(build_dir, shared=True) as locked:
        if locked and cache_problem(build_dir, expected)[0] is None:
            return load_library(so)
    with build_lock(build_dir) as locked:
        if locked:
            remove_stale_baton(build_dir)
        reason = check_cached(build_dir, expected)
        if reason is None:  # built by the process this one waited for
            return load_library(so)
        if reason != NOT_BUILT:
            print(f"moegemm: not reusing the cached extension in {build_dir}: {reason}; rebuilding", file=sys.stderr,
                  flush=True)
        path = build_with_torch(kwargs)
        write_manifest(path, expected)
    return path


def build_with_torch(load_kwargs: dict) -> str:
    """torch's ``load``: build (ninja, only what is out of date) and load; its output goes to ``build.log``
    behind a short progress display (``_NinjaProgress``), or as it is with ``MOEGEMM_VERBOSE_BUILD=1``."""
    from torch.utils import cpp_extension

    srcs, build_dir = load_kwargs["sources"], load_kwargs["build_directory"]
    if not os.path.isfile(os.path.join(build_dir, NAME + ".so")):
        print(f"moegemm: building the CUDA extension ({len(srcs)} translation units, "
              f"MAX_JOBS={os.environ['MAX_JOBS']}; about a minute on 16 cores, several minutes on few) in {build_dir}",
              file=sys.stderr, flush=True)
    if env_flag("MOEGEMM_VERBOSE_BUILD"):
        return cpp_extension.load(**load_kwargs, verbose=True)
    start = time.time()
    progress = _NinjaProgress(srcs, os.path.join(build_dir, "build.log"))
    with progress:
        path = cpp_extension.load(**load_kwargs, verbose=True)
    if progress.built:
        print(f"moegemm: extension built in {time.time() - start:.0f} s, cached in {build_dir} "
              "(later runs reuse it; delete the folder to rebuild)", file=sys.stderr, flush=True)
    return path


def load_library(path: str) -> str:
    """Load a checked .so into this process (its ops register as ``torch.ops.moegemm``); its path."""
    import torch

    torch.ops.load_library(path)
    return path


# ------------------------------------------------------------------------------------- the cache's lock
LOCK_NOTICE_AFTER_S = 1.0  # a wait longer than this is announced on stderr (a load alone takes less)


def lock_path(build_dir: str) -> str:
    """``<extensions root>/moegemm_C.lock``: beside the build folder, which a rebuild may empty."""
    return os.path.join(os.path.dirname(os.path.abspath(build_dir)), NAME + ".lock")


@contextlib.contextmanager
def build_lock(build_dir: str, shared: bool = False):
    """Hold the cache's lock (a ``flock`` on ``lock_path``) for the enclosed work; yields whether it is
    held. Exclusive: to check, repair, build and load; shared (``shared=True``): to check and load a
    valid .so, any number of processes at once. The kernel releases a flock when its holder exits,
    however it ends (Ctrl-C, SIGKILL, an OOM kill, a preempted node), so this lock never goes stale. An
    exclusive holder writes its pid and host into the file; a process that waits longer than
    ``LOCK_NOTICE_AFTER_S`` says once on stderr whom it waits for (Ctrl-C still interrupts the wait).
    On a file system without flock (some network or FUSE mounts) it warns once and yields False: starts
    are then serialized by torch's own lock file alone."""
    path = lock_path(build_dir)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    held = False
    try:
        held = _acquire(fd, path, shared)
        if held and not shared:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield held
    finally:
        if held and not shared:
            os.ftruncate(fd, 0)
        os.close(fd)  # releases the flock


_NO_FLOCK: list = []  # the file systems found without flock, said once


def _acquire(fd: int, path: str, shared: bool) -> bool:
    """Take the flock on ``fd``, waiting as long as another process holds it; False if flock is unsupported."""
    import fcntl

    mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    deadline = time.monotonic() + LOCK_NOTICE_AFTER_S
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        except OSError as exc:  # ENOLCK, EOPNOTSUPP, ...: no locks on this file system
            if path not in _NO_FLOCK:
                _NO_FLOCK.append(path)
                print(f"moegemm: cannot lock {path} ({exc.strerror}): concurrent starts rely on torch's build lock "
                      "alone", file=sys.stderr, flush=True)
            return False
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
    print(f"moegemm: waiting for {holder} to finish building or loading the CUDA extension (lock: {path})",
          file=sys.stderr, flush=True)
    fcntl.flock(fd, mode)
    return True


LEFTOVER_WAIT_S = 1200.0  # the longest a start waits for compilers a killed build left running


def remove_stale_baton(build_dir: str) -> bool:
    """Remove the lock file torch's ``load`` keeps in the build folder while it builds (its ``FileBaton``,
    ``<build_dir>/lock``), if one is there; whether one was. Called only under the exclusive
    ``build_lock``: no live moegemm process is inside torch's ``load`` for this folder then, so the file
    is what a build that died left behind, and every later start would wait for it forever. Compilers
    that the dead build started and that still run in the folder (when its Python process alone was
    killed) are waited for first, at most ``LEFTOVER_WAIT_S``, so that no two builds write into the
    folder at once."""
    baton = os.path.join(build_dir, "lock")
    if not os.path.exists(baton):
        return False
    leftovers = build_processes_in(build_dir)
    if leftovers:
        print(f"moegemm: waiting for {len(leftovers)} process(es) of an interrupted build to end in {build_dir} "
              f"(pid {', '.join(map(str, leftovers[:4]))})", file=sys.stderr, flush=True)
        deadline = time.monotonic() + LEFTOVER_WAIT_S
        while build_processes_in(build_dir) and time.monotonic() < deadline:
            time.sleep(0.2)
    try:
        os.remove(baton)
    except FileNotFoundError:
        return False
    print(f"moegemm: removed the lock file of an interrupted build ({baton})", file=sys.stderr, flush=True)
    return True


# What torch's build runs in the build folder (ninja, nvcc and the tools it drives, the host compiler).
BUILD_TOOLS = {"ninja", "nvcc", "cicc", "ptxas", "cudafe++", "fatbinary", "nvlink", "sh", "c++", "g++", "gcc", "cc",
               "cc1plus", "cc1", "as", "ld", "collect2", "clang", "clang++"}


def build_processes_in(folder: str) -> list[int]:
    """Pids of this host's build tools (``BUILD_TOOLS``) whose working directory is ``folder``: torch runs
    ninja there, and ninja the compilers. A shell a user opened there is not one. Empty where /proc
    cannot tell."""
    target = os.path.realpath(folder)
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return []
    found = []
    for pid in pids:
        if pid == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/comm") as f:
                name = f.read().strip()
            if name in BUILD_TOOLS and os.path.realpath(os.readlink(f"/proc/{pid}/cwd")) == target:
                found.append(pid)
        except OSError:  # gone, or another user's
            continue
    return found


# ------------------------------------------------------------------------------ the cached .so's manifest
MANIFEST = NAME + ".manifest.json"
NOT_BUILT = "not built yet"


def toolchain() -> dict:
    """What a built .so is tied to besides its sources, and what ninja cannot see change: the Python
    ABI, torch's version and CUDA version, and the nvcc binary (its resolved path and size: a
    ``/usr/local/cuda`` link moved to another toolkit keeps ninja's command lines)."""
    import torch

    nvcc = os.path.join(os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda", "bin", "nvcc")
    try:
        from torch.utils.cpp_extension import CUDA_HOME

        if CUDA_HOME:
            nvcc = os.path.join(CUDA_HOME, "bin", "nvcc")
    except ImportError:
        pass
    nvcc = os.path.realpath(nvcc)
    return {"python": f"{sys.version_info.major}.{sys.version_info.minor}", "torch": torch.__version__,
            "cuda": torch.version.cuda, "nvcc": nvcc,
            "nvcc_size": os.path.getsize(nvcc) if os.path.isfile(nvcc) else None}


def source_fingerprint(load_kwargs: dict) -> str:
    """sha256 of everything the build compiles from: every file under csrc/ (path and bytes, headers
    included), the CUTLASS release (its version header), the compiler flags, the include folders and
    ``TORCH_CUDA_ARCH_LIST``."""
    import hashlib
    import json

    h = hashlib.sha256()
    csrc = csrc_dir()
    for p in sorted(q for q in csrc.rglob("*") if q.is_file() and "__pycache__" not in q.parts):
        h.update(str(p.relative_to(csrc)).encode() + b"\0")
        h.update(p.read_bytes() + b"\0")
    for inc in load_kwargs.get("extra_include_paths") or []:  # the CUTLASS release: its version header
        version = Path(inc, "cutlass", "version.h")
        if version.is_file():
            h.update(version.read_bytes())
    flags = {k: load_kwargs.get(k) for k in ("name", "extra_cflags", "extra_cuda_cflags", "extra_include_paths")}
    flags["arch"] = os.environ.get("TORCH_CUDA_ARCH_LIST")
    h.update(json.dumps(flags, sort_keys=True).encode())
    return h.hexdigest()


def file_sha256(path: str) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def read_manifest(build_dir: str):
    """The manifest of the cached .so (a dict), None if there is none or it is unreadable."""
    import json

    try:
        with open(os.path.join(build_dir, MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def write_manifest(so_path: str, expected: dict) -> None:
    """Record what the .so at ``so_path`` is (size, sha256) and was built from (``expected``: toolchain and
    source fingerprint) in the manifest beside it; written whole or not at all (a rename)."""
    import json

    manifest = {"format": 1, "so": os.path.basename(so_path), "size": os.path.getsize(so_path),
                "sha256": file_sha256(so_path), **expected}
    path = os.path.join(os.path.dirname(so_path), MANIFEST)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def cache_problem(build_dir: str, expected: dict):
    """``(reason, remove)``: why the cached ``moegemm_C.so`` may not be loaded as it is (None: it may: it
    matches its manifest's size and sha256 and was built by this toolchain from these sources,
    ``expected``), and what must go before a rebuild: ``"so"`` (the .so and its manifest: ninja relinks,
    recompiling what changed), ``"folder"`` (everything: built by another torch, CUDA, Python or nvcc,
    whose objects ninja might keep) or None. ``NOT_BUILT`` when there is no .so. Reads only."""
    so = os.path.join(build_dir, NAME + ".so")
    if not os.path.isfile(so):
        return NOT_BUILT, None
    manifest = read_manifest(build_dir)
    if manifest is None or manifest.get("so") != NAME + ".so":
        return "it has no manifest (a build that did not finish, or one made by an older moegemm)", "so"
    if manifest.get("toolchain") != expected["toolchain"]:
        old, new = manifest.get("toolchain") or {}, expected["toolchain"]
        changed = ", ".join(f"{k} {old.get(k)} -> {new[k]}" for k in new if old.get(k) != new[k])
        return f"it was built by another toolchain ({changed})", "folder"
    size = os.path.getsize(so)
    if manifest.get("size") != size:
        return f"it is truncated or changed ({size} bytes, {manifest.get('size')} when built)", "so"
    if manifest.get("sha256") != file_sha256(so):
        return "its contents changed since it was built (sha256)", "so"
    if manifest.get("sources") != expected["sources"]:
        return "its sources or compiler flags changed", "so"
    return None, None


def check_cached(build_dir: str, expected: dict):
    """``cache_problem``'s reason, after removing what it says must go (under the exclusive
    ``build_lock``): a truncated, changed, unrecorded or foreign .so is never loaded."""
    reason, remove = cache_problem(build_dir, expected)
    if remove == "folder":
        empty_folder(build_dir)
    elif remove == "so" or reason == NOT_BUILT:
        _remove(os.path.join(build_dir, NAME + ".so"))
        _remove(os.path.join(build_dir, MANIFEST))
    return reason


def empty_folder(build_dir: str) -> None:
    """Remove everything in the build folder (only ever ``.../moegemm_C``), keeping the folder."""
    import shutil

    if os.path.basename(os.path.normpath(build_dir)) != NAME:
        raise RuntimeError(f"moegemm: refusing to empty {build_dir}: not a {NAME} build folder")
    for entry in os.scandir(build_dir):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            _remove(entry.path)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


# What ptxas says (even without -v) when it makes wgmma wait where a kernel meant it to run asynchronously: an
# injected warpgroup.wait (C7517, seen when a register of a chain in flight is touched) or serialized wgmma
# instructions. The kernels overlap work with chains in flight (csrc/kernels/gemm/sm90/), so the compile check fails
# on either.
WGMMA_SERIALIZED = ("(C7517)", "wgmma.mma_async instructions are serialized")


def wgmma_serialized(compiler_output: str) -> list[str]:
    """The lines of a compiler's output that say ptxas serialized wgmma or made it wait (``WGMMA_SERIALIZED``)."""
    return [line for line in compiler_output.splitlines() if any(m in line for m in WGMMA_SERIALIZED)]


def check_tools(torch_include: str | None = None, binding_only: bool = False) -> dict:
    """What ``compile_check`` compiles with, found or refused: ``nvcc`` (the kernels; on ``PATH``, else in the
    CUDA toolkit's ``bin``; not needed with ``binding_only``), the CUDA toolkit's headers (``cuda_runtime.h``,
    which csrc/moegemm.h includes), the CUTLASS headers, torch's headers and the host compiler (``$CXX`` or
    ``c++``). A CPU build of torch will do: the check links nothing. Raises ``BuildEnvironmentError`` naming
    everything missing, in one line."""
    import shutil

    problems = []
    given = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    home = given or search_cuda_home() or "/usr/local/cuda"
    nvcc = shutil.which("nvcc") or os.path.join(home, "bin", "nvcc")
    if not binding_only and not (os.path.isfile(nvcc) and os.access(nvcc, os.X_OK)):
        problems.append(f"nvcc (the CUDA toolkit's compiler: none on PATH nor at {nvcc}; install the CUDA toolkit, "
                        "set CUDA_HOME or put nvcc on PATH)")
    # the headers: in CUDA_HOME (CUDA_PATH) when set, else in /usr/local/cuda or beside the nvcc found
    homes = [given] if given else ["/usr/local/cuda", home, os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))]
    homes = list(dict.fromkeys(homes))
    cuda_include = next((os.path.join(h, "include") for h in homes
                         if os.path.isfile(os.path.join(h, "include", "cuda_runtime.h"))), None)
    if cuda_include is None:
        places = " nor ".join(os.path.join(h, "include") for h in homes)
        problems.append(f"the CUDA toolkit's headers (no cuda_runtime.h in {places}; set CUDA_HOME to the toolkit's "
                        "root)")
    try:
        dirs = include_dirs()
    except BuildEnvironmentError as exc:
        dirs = []
        problems.append("the CUTLASS headers (" + str(exc)[len("moegemm: "):] + ")")
    if torch_include is None:
        try:
            torch_include = torch_include_dir()
        except RuntimeError:
            torch_include = None
    if torch_include is None or not os.path.isfile(os.path.join(torch_include, "torch", "extension.h")):
        problems.append(f"torch's C++ headers (no torch/extension.h in {torch_include}; --torch-include names a "
                        "torch/include folder)" if torch_include else "torch's C++ headers (torch is not installed)")
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        problems.append(f"a host C++ compiler ({cxx!r} not found; set CXX)")
    if problems:
        raise BuildEnvironmentError("moegemm: the compile check cannot run here: it needs " + "; ".join(problems))
    return {"nvcc": nvcc, "cuda_include": cuda_include, "include_dirs": dirs, "torch_include": torch_include, "cxx": cxx}


def compile_check(jobs: int = 2, torch_include: str | None = None, binding_only: bool = False) -> int:
    """Compile every translation unit of csrc/ without linking (no GPU and no CUDA build of torch
    needed): the .cu kernels with nvcc for sm_90a, the binding with the host compiler against torch's
    headers (syntax only) in the standard those headers demand. ``torch_include``: another torch's
    ``include`` folder for the binding (e.g. unpacked from a wheel); ``binding_only``: skip the
    kernels (they include no torch header). A kernel whose wgmma ptxas serialized (``WGMMA_SERIALIZED``)
    counts as a failure. Returns the number of failures. What the check needs and lacks (nvcc, the CUDA
    toolkit's headers, the CUTLASS or torch headers, the host compiler) raises ``BuildEnvironmentError``
    first, in one line naming each (``check_tools``), before anything is compiled."""
    import shutil
    import subprocess
    import sysconfig
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    tools = check_tools(torch_include, binding_only)
    torch_include, nvcc, cxx = tools["torch_include"], tools["nvcc"], tools["cxx"]
    torch_includes = [f"-I{torch_include}", f"-I{os.path.join(torch_include, 'torch', 'csrc', 'api', 'include')}"]
    python_include = sysconfig.get_paths()["include"]  # csrc/api/main_grad.cpp reads a Python attribute
    includes = [f"-I{d}" for d in tools["include_dirs"]]
    cuda_include = tools["cuda_include"]
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
            cmds.append([cxx, *host, "-fsyntax-only", *includes, *torch_includes, f"-I{python_include}",
                         f"-I{cuda_include}", src])

    def run(cmd):
        start = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        name = Path(cmd[-3] if cmd[-2] == "-o" else cmd[-1]).name
        serialized = wgmma_serialized(proc.stdout + proc.stderr)
        failed = proc.returncode != 0 or bool(serialized)
        status = "FAILED" if failed else "ok"
        print(f"compile {name}: {status} ({time.time() - start:.0f} s)", flush=True)
        if proc.returncode:
            print(proc.stdout + proc.stderr, flush=True)
        elif serialized:
            print("ptxas serialized wgmma (a register of an accumulator in flight was touched, or a chain cannot be "
                  "proven asynchronous):\n" + "\n".join(serialized), flush=True)
        return failed

    with ThreadPoolExecutor(jobs) as pool:
        failures = sum(pool.map(run, cmds))
    shutil.rmtree(out, ignore_errors=True)
    return failures
