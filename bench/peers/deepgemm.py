"""DeepGEMM (github.com/deepseek-ai/DeepGEMM) as a benchmark peer: its m-grouped contiguous FP8 fprop and
its k-grouped FP8 wgrad, timed on the SPEC §7 shapes with balanced, 128-aligned token splits (printed and
written to the JSON, so that our kernels can be timed on the identical splits). No DeepGEMM code lives
here: the source is exported (uncommitted) into .peers/DeepGEMM, built on the GPU machine by build(), and
only called if it imports. SM90 (H100/H200) only.

Remote command (after the usual prefix
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PWD
 with `.peers` in carry):

    export DG_JIT_CACHE_DIR=/tmp/dg_peer/jit_cache MAX_JOBS=16 \
        && python3 bench/deepgemm_peer.py --build --jit-prewarm 8 --json $OUT/deepgemm_peer.json; \
        cp /tmp/dg_peer/build.log $OUT/ 2>/dev/null

  * --build: copies .peers/DeepGEMM to /tmp/dg_peer/src, links the nvidia-cutlass wheel's include/{cute,
    cutlass} into deep_gemm/include (what DeepGEMM's JIT and its host code include), and builds the one
    host extension deep_gemm._C (csrc/python_api.cpp: one translation unit, ~1 min of g++ -O3; MAX_JOBS
    cannot split it) with torch's BuildExtension + ninja; log in /tmp/dg_peer/build.log. A second --build
    reuses the built module (--force-build rebuilds).
  * The GEMM kernels are JIT-compiled by NVCC ($CUDA_HOME/bin/nvcc, sm_90a) at their first call: one kernel
    per (shape, GEMM), 20 in all, plus ~6 small scale-transpose kernels (one per K/128), ~5-15 s each
    (4.5 s for an sm_90a GEMM kernel with nvcc 13.0 on a 2-core CPU box), cached in
    DG_JIT_CACHE_DIR (default /tmp/dg_peer/jit_cache; lost with the machine). --jit-prewarm J compiles them
    in J child processes in parallel first (no timing there); without it, the first call of each GEMM
    pays its compilation (reported as first_call_s). --nvrtc uses NVRTC instead (faster compiles, DeepGEMM
    says "may have performance loss").
  * Expected wall time on an H200 (estimates, not measured): build ~1 min, JIT ~1 min with
    --jit-prewarm 8 (~2-4 min without), operands + checks + timing ~1-2 min.
  * Subsets: --shapes V2-Lite,Mixtral  --gemms fc1_fprop,fc2_wgrad;  --list prints shapes and splits
    (no GPU);  --isolate runs each shape in its own child process (a crash costs one shape, not the run).
  * Crash diagnosis (no benchmark; ~2-4 min with the build):
        MAX_JOBS=16 python3 bench/deepgemm_peer.py --build --diag 2>&1 | tee $OUT/deepgemm_diag.log; \
            cp /tmp/dg_peer/build.log $OUT/ 2>/dev/null
    prints the toolchain / linkage facts (nvcc, driver, g++, CUTLASS version, readelf/ldd of _C, compile line),
    then runs one child that does a tiny transpose_fp32 JIT kernel, m-grouped and k-grouped FP8 GEMM (E=2,
    128 rows each, 256x256), printing every step before it runs, with faulthandler, unbuffered C stdio,
    DG_JIT_DEBUG / DG_JIT_PRINT_COMPILER_COMMAND / DG_JIT_PRINT_LOAD_TIME / DG_PRINT_CONFIGS /
    DG_JIT_PTXAS_VERBOSE, and an LD_PRELOADed SIGSEGV handler whose native backtrace is symbolized with
    addr2line (frames in deep_gemm/_C*.so -> csrc file:line). On a crash it reruns with the warm JIT cache
    (load + launch without compile) and with NVRTC (and with torch's cuBLASLt handle if the crash was in
    DeviceRuntime's constructor). --runtime-api builds the JIT loader on cudart instead of the driver API.

API used (DeepGEMM 2.6.x, SM90):
  fprop  deep_gemm.m_grouped_fp8_gemm_nt_contiguous((x, sx), (w, sw), out, m_indices)
         x [T, K] e4m3 K-major, sx [T, K/128] fp32 per-1x128 scales, transformed once (outside the timed
         call) by deep_gemm.transform_sf_into_required_layout (TMA-aligned, MN-major); w [E, N, K] e4m3,
         sw [E, N/128, K/128] fp32 per-128x128; out [T, N] bf16; m_indices [T] int32 = expert of each row
         (every group a multiple of get_mk_alignment_for_contiguous_layout() = 128 rows).
  wgrad  deep_gemm.k_grouped_fp8_gemm_nt_contiguous((a, sa), (b, sb), d, ks, ks_tensor, c=d)
         d[e] += a_e^T b_e, d [E, M, N] fp32 accumulated in place; a_e = dy rows of expert e, stored
         K-major per group (the flat concatenation of each expert's [M, T_e] transpose), sa [M, T/128] fp32
         per-1x128-token scales (MN-major); b likewise with N; ks = tokens per expert (multiples of 128).
         (k_grouped_fp8_gemm_tn_contiguous, the MN-major variant, is SM100 only.) The per-expert
         transposes and all FP8 casts are operand preparation, outside the timed call.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
DEFAULT_SRC = REPO / ".peers" / "DeepGEMM"
DEFAULT_ROOT = Path(os.environ.get("DG_PEER_ROOT", "/tmp/dg_peer"))
ALIGN = 128  # DeepGEMM's M/K alignment of contiguous groups on SM90
DEV = "cuda"
T_START = time.time()

# name: (E, hidden, ffn per expert, routed tokens); values from moegemm/workloads.py when it loads.
SHAPES = {
    "DeepSeek-V2-Lite": (64, 2048, 1408, 24576),
    "Qwen3-30B-A3B": (128, 2048, 768, 32768),
    "DeepSeek-V3-EP8": (32, 7168, 2048, 32768),
    "Mixtral-8x7B": (8, 4096, 14336, 16384),
    "Small experts E=64": (64, 2048, 1408, 12288),
}
GEMMS = ("fc1_fprop", "fc2_fprop", "fc1_wgrad", "fc2_wgrad")


def _load_workload_shapes() -> None:
    """Take the shape values from moegemm/workloads.py (loaded by path: no moegemm package import)."""
    try:
        spec = importlib.util.spec_from_file_location("_dg_peer_workloads", REPO / "moegemm" / "workloads.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        for src in (getattr(mod, "SHAPES", {}), getattr(mod, "SMALL_EXPERTS", {})):
            for name, val in src.items():
                if name in SHAPES and tuple(val) != SHAPES[name]:
                    print(f"[dg] note: {name} = {tuple(val)} in moegemm.workloads (local {SHAPES[name]})")
                SHAPES[name] = tuple(val)
    except Exception as exc:  # the local table stands
        print(f"[dg] moegemm/workloads.py not loaded ({type(exc).__name__}: {exc}); using the local shapes")


def _short(exc: BaseException, n: int = 400) -> str:
    s = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    return s if len(s) <= n else s[: n - 3] + "..."


# ----------------------------------------------------------------------------------------------- splits
def aligned_splits(E: int, T: int, weights=None, align: int = ALIGN) -> list:
    """Token counts per expert, each a multiple of `align`, summing to round(T / align) * align, as close
    to proportional to `weights` (default: equal) as the granularity allows (largest remainder)."""
    units = max(0, round(T / align))
    w = [1.0] * E if weights is None else [float(x) for x in weights]
    tot = sum(w) or 1.0
    exact = [units * x / tot for x in w]
    base = [int(math.floor(v)) for v in exact]
    order = sorted(range(E), key=lambda e: (-(exact[e] - base[e]), e))
    for e in order[: units - sum(base)]:
        base[e] += 1
    return [u * align for u in base]


def make_splits(E: int, T: int, mode: str) -> list:
    if mode == "balanced":
        return aligned_splits(E, T)
    if mode == "zipf":  # moegemm's Zipf skew (empty experts included), rounded to 128-row groups
        spec = importlib.util.spec_from_file_location("_dg_peer_workloads", REPO / "moegemm" / "workloads.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return aligned_splits(E, T, weights=mod.zipf_splits(E, T))
    raise ValueError(f"unknown split mode {mode}")


def gemm_dims(gemm: str, H: int, F: int) -> dict:
    """fprop: out [T, N] = x [T, K] @ W[e]^T;  wgrad: dW[e] [M, N] = dy_e^T [M, T_e] @ act_e [T_e, N]."""
    return {"fc1_fprop": {"kind": "fprop", "K": H, "N": 2 * F},
            "fc2_fprop": {"kind": "fprop", "K": F, "N": H},
            "fc1_wgrad": {"kind": "wgrad", "M": 2 * F, "N": H},
            "fc2_wgrad": {"kind": "wgrad", "M": H, "N": F}}[gemm]


def _fmt_counts(counts: list) -> str:
    runs, i = [], 0
    while i < len(counts):
        j = i
        while j < len(counts) and counts[j] == counts[i]:
            j += 1
        runs.append(f"{counts[i]}x{j - i}" if j - i > 1 else str(counts[i]))
        i = j
    return "[" + ", ".join(runs) + "]"


# ------------------------------------------------------------------------------------------------ build
def _cuda_home() -> Path:
    """$CUDA_HOME / $CUDA_PATH, else the toolkit of the nvcc on PATH, else /usr/local/cuda."""
    for k in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(k):
            return Path(os.environ[k])
    nvcc = shutil.which("nvcc")
    if nvcc:
        home = Path(nvcc).resolve().parent.parent
        if (home / "include" / "cuda_runtime.h").exists():
            return home
    return Path("/usr/local/cuda")


def _cutlass_include() -> Path:
    """include/ of the nvidia-cutlass wheel (holds cute/ and cutlass/)."""
    cands = []
    if os.environ.get("DG_PEER_CUTLASS_INCLUDE"):
        cands.append(Path(os.environ["DG_PEER_CUTLASS_INCLUDE"]))
    try:
        spec = importlib.util.find_spec("cutlass_library")
        for loc in (spec.submodule_search_locations or []) if spec else []:
            cands.append(Path(loc) / "source" / "include")
    except Exception:
        pass
    try:
        import cutlass_library  # noqa: F401
        cands.append(Path(cutlass_library.source_path) / "include")
    except Exception:
        pass
    for c in cands:
        if (c / "cute").is_dir() and (c / "cutlass" / "arch" / "barrier.h").is_file():
            return c
    raise RuntimeError(f"CUTLASS/CuTe headers not found (nvidia-cutlass wheel on PYTHONPATH? tried {cands})")


def _pip_nvidia_dirs(sub: str) -> list:
    """nvidia/*/{include,lib} of pip CUDA wheels (torch's cu13 runtime) on sys.path."""
    out = []
    for p in sys.path:
        try:
            base = Path(p or ".") / "nvidia"
            if base.is_dir():
                out += sorted(d for d in base.glob(f"*/{sub}") if d.is_dir())
        except Exception:
            pass
    return out


def _find_lib(stem: str, dirs: list):
    """(dir, file) of lib{stem}.so, else its shortest-named lib{stem}.so.N (the SONAME link), in the first
    folder of `dirs` that has either (folder order first: torch's pip wheels ship no unversioned .so)."""
    for d in dirs:
        if (d / f"lib{stem}.so").exists():
            return d, d / f"lib{stem}.so"
        hits = sorted(d.glob(f"lib{stem}.so.[0-9]*"), key=lambda q: len(q.name))
        if hits:
            return d, hits[0]
    return None, None


def _loaded_libs(stems=("cuda", "cudart", "cublasLt", "cublas", "nvrtc", "stdc++", "torch_cuda", "c10_cuda")) -> dict:
    """{stem: [paths]} of the shared objects lib{stem}.so* mapped into this process (/proc/self/maps)."""
    out = {s: [] for s in stems}
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            parts = line.split(None, 5)
            if len(parts) < 6 or "/" not in parts[5]:
                continue
            path = parts[5].strip()
            name = path.rsplit("/", 1)[-1]
            for s in stems:
                if (name == f"lib{s}.so" or name.startswith(f"lib{s}.so.")) and path not in out[s]:
                    out[s].append(path)
    except Exception:
        pass
    return out


def _torch_cuda_lib_dirs() -> list:
    """Folders of the CUDA runtime libraries that torch itself has loaded (its pip nvidia/cu13/lib, or the
    toolkit it was built against): _C is linked and rpath'ed against these first, so that it can never pull
    in a second copy (a different minor version) of cudart / cublasLt / nvrtc from $CUDA_HOME."""
    importlib.import_module("torch")  # loads libtorch_cuda and with it cudart, cublas(Lt), nvrtc
    dirs = []
    for stem, paths in _loaded_libs(("cudart", "cublasLt", "nvrtc")).items():
        for p in paths:
            d = Path(p).parent
            if d not in dirs:
                dirs.append(d)
    return dirs


_SETUP = '''import json, os, sys
from setuptools import setup
import torch.utils.cpp_extension as ce
from torch.utils.cpp_extension import BuildExtension, CUDAExtension
if ce.CUDA_HOME is None and os.environ.get("CUDA_HOME"):
    ce.CUDA_HOME = os.environ["CUDA_HOME"]
cfg = json.load(open(sys.argv.pop(1)))
setup(name="deep_gemm_peer_build", packages=[], py_modules=[],
      ext_modules=[CUDAExtension("deep_gemm._C", ["csrc/python_api.cpp"], include_dirs=cfg["inc"],
                                 library_dirs=cfg["libdirs"], libraries=cfg["libs"],
                                 extra_compile_args={"cxx": cfg["cxx"]}, extra_link_args=cfg["ldflags"])],
      cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)})
'''


def _activate(root: Path) -> None:
    os.environ.setdefault("DG_JIT_CACHE_DIR", str(root / "jit_cache"))
    os.environ.setdefault("CUDA_HOME", str(_cuda_home()))  # DeepGEMM's JIT finds nvcc there
    work = str(root / "src")
    if work not in sys.path:
        sys.path.insert(0, work)
    importlib.invalidate_caches()


def import_deep_gemm(root: Path = DEFAULT_ROOT):
    """deep_gemm from the build under `root` (or any importable one); (module, None) or (None, reason)."""
    if (root / "src" / "deep_gemm").is_dir():
        _activate(root)
    try:
        import deep_gemm
        return deep_gemm, None
    except Exception as exc:
        return None, _short(exc, 2000)


def build(src_dir=DEFAULT_SRC, root=DEFAULT_ROOT, force: bool = False, runtime_api: bool = False) -> bool:
    """Build DeepGEMM's host extension from `src_dir` into `root`/src (a copy) and import it; True when
    `import deep_gemm` works. Prints the reason on failure; never raises.

    Recipe (DeepGEMM's setup.py, adapted): one TU csrc/python_api.cpp, g++ -O3 -fPIC, torch's
    _GLIBCXX_USE_CXX11_ABI, C++20 (torch >= 2.10's cpp_extension default; DeepGEMM says 17), include order as
    upstream ($CUDA_HOME/include, include/cccl, deep_gemm/include, CuTe/CUTLASS, fmt; pip CUDA headers only
    for what the toolkit lacks), -lcudart -lnvrtc (+ -lcublasLt) from the very folders whose copies torch has
    loaded, rpath'ed first. The driver (libcuda.so.1) is dlopen'ed by DeepGEMM itself: no -lcuda.
    runtime_api: -DDG_JIT_USE_RUNTIME_API (load/launch JIT kernels through cudart's cudaLibrary* instead of
    the dlopen'ed driver API; needs $CUDA_HOME/bin/cuobjdump)."""
    src, root = Path(src_dir), Path(root)
    work, log_path = root / "src", root / "build.log"
    try:
        if not (src / "csrc" / "python_api.cpp").is_file() or not (src / "deep_gemm" / "__init__.py").is_file():
            raise RuntimeError(f"no DeepGEMM source at {src} (carry .peers?)")
        if not (src / "third-party" / "fmt" / "include" / "fmt" / "format.h").is_file():
            raise RuntimeError(f"{src}/third-party/fmt/include/fmt/format.h missing (the fmt headers)")
        import torch
        from torch.utils.cpp_extension import CUDA_HOME as TORCH_CUDA_HOME

        cuda_home = Path(TORCH_CUDA_HOME) if TORCH_CUDA_HOME and not os.environ.get("CUDA_HOME") else _cuda_home()
        os.environ["CUDA_HOME"] = str(cuda_home)
        if not (cuda_home / "bin" / "nvcc").exists():
            print(f"[dg] warning: {cuda_home}/bin/nvcc not found: DeepGEMM's JIT will fail (set CUDA_HOME)")
        if runtime_api and not (cuda_home / "bin" / "cuobjdump").exists():
            print(f"[dg] warning: --runtime-api needs {cuda_home}/bin/cuobjdump (kernel symbol lookup); not found")
        cutlass_inc = _cutlass_include()
        built = sorted((work / "deep_gemm").glob("_C*.so")) if work.is_dir() else []
        stamp = f"{(src / 'PEER_SOURCE.txt').read_text() if (src / 'PEER_SOURCE.txt').exists() else src}" \
                f"|{cutlass_inc}|{torch.__version__}|{sys.version}|rtapi={int(runtime_api)}|recipe 3"
        stamp_file = root / "build.stamp"
        if built and not force and stamp_file.exists() and stamp_file.read_text() == stamp:
            print(f"[dg] reusing {built[0]}")
        else:
            t0 = time.time()
            if work.exists():
                shutil.rmtree(work)
            root.mkdir(parents=True, exist_ok=True)
            shutil.copytree(src, work, ignore=shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__",
                                                                     "*.so", "tests", ".git"))
            inc = work / "deep_gemm" / "include"
            for name in ("cute", "cutlass"):  # the JIT compiles with -I deep_gemm/include only
                link = inc / name
                if link.is_symlink() or link.exists():
                    link.unlink() if link.is_symlink() else shutil.rmtree(link)
                link.symlink_to(cutlass_inc / name, target_is_directory=True)
            # Link libraries: the copies torch has loaded first, then its pip wheels, then the toolkit.
            torch_dirs = _torch_cuda_lib_dirs()
            extra_libdirs = [Path(p) for p in os.environ.get("DG_PEER_EXTRA_LIBDIR", "").split(os.pathsep) if p]
            lib_dirs = []
            for d in (torch_dirs + _pip_nvidia_dirs("lib") + extra_libdirs +
                      [cuda_home / "lib64", cuda_home / "lib", cuda_home / "targets" / "x86_64-linux" / "lib"]):
                if d not in lib_dirs:
                    lib_dirs.append(d)
            shim = root / "libshim"
            shim.mkdir(parents=True, exist_ok=True)
            libdirs, rpaths, libs = [str(shim)], [], []
            for stem in ("cudart", "nvrtc", "cublasLt"):  # cublasLt: else only reachable through libtorch_cuda
                d, f = _find_lib(stem, lib_dirs)
                if f is None:
                    if stem == "cublasLt":
                        continue
                    raise RuntimeError(f"lib{stem}.so* not found in {[str(x) for x in lib_dirs]}")
                libs.append(stem)
                s = shim / f"lib{stem}.so"
                if s.is_symlink() or s.exists():
                    s.unlink()
                s.symlink_to(f.resolve())
                if str(d) not in rpaths:
                    rpaths.append(str(d))
                print(f"[dg] link lib{stem}: {f.resolve()}", flush=True)
            rpaths = [str(d) for d in torch_dirs if str(d) in rpaths] + [d for d in rpaths
                                                                         if d not in map(str, torch_dirs)]
            ldflags = [f"-Wl,-rpath,{d}" for d in rpaths]
            incs = [str(cuda_home / "include"), str(cuda_home / "include" / "cccl"), str(inc), str(cutlass_inc),
                    str(work / "third-party" / "fmt" / "include")]
            for hdr in ("cublasLt.h", "nvrtc.h"):  # headers the toolkit may lack (torch's pip wheels have them)
                if not (cuda_home / "include" / hdr).exists():
                    for d in _pip_nvidia_dirs("include"):
                        if (d / hdr).exists():
                            if str(d) not in incs:
                                incs.append(str(d))
                            break
                    else:
                        print(f"[dg] warning: {hdr} found neither in {cuda_home}/include nor in pip nvidia wheels")
            incs += [p for p in os.environ.get("DG_PEER_EXTRA_INCLUDE", "").split(os.pathsep) if p]
            libdirs += [str(p) for p in extra_libdirs]
            cxx = ["-std=c++20", "-O3", "-fPIC", "-Wno-psabi", "-Wno-deprecated-declarations",
                   f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"]
            if runtime_api:
                cxx.append("-DDG_JIT_USE_RUNTIME_API")
            cfg = {"inc": incs, "libdirs": libdirs, "libs": libs, "ldflags": ldflags, "cxx": cxx}
            (work / "_dg_peer_cfg.json").write_text(json.dumps(cfg, indent=1))
            (work / "_dg_peer_setup.py").write_text(_SETUP)
            env = dict(os.environ)
            env.setdefault("MAX_JOBS", str(os.cpu_count() or 8))
            print(f"[dg] building deep_gemm._C in {work} (CUDA_HOME={cuda_home}, CuTe/CUTLASS from {cutlass_inc}"
                  f"{', runtime API' if runtime_api else ''}); log {log_path}", flush=True)
            with open(log_path, "w") as logf:
                rc = subprocess.run([sys.executable, "_dg_peer_setup.py", "_dg_peer_cfg.json", "build_ext", "--inplace"],
                                    cwd=work, env=env, stdout=logf, stderr=subprocess.STDOUT, timeout=1800).returncode
            if rc != 0:
                tail = log_path.read_text(errors="replace").splitlines()[-40:]
                raise RuntimeError(f"build_ext failed (rc {rc}); last lines of {log_path}:\n" + "\n".join(tail))
            stamp_file.write_text(stamp)
            print(f"[dg] built in {time.time() - t0:.0f} s", flush=True)
        dg, why = import_deep_gemm(root)
        if dg is None:
            raise RuntimeError(f"import deep_gemm failed: {why}")
        print(f"[dg] import deep_gemm OK: {dg.__file__} (version {getattr(dg, '__version__', '?')}), "
              f"JIT cache {os.environ.get('DG_JIT_CACHE_DIR')}", flush=True)
        return True
    except Exception as exc:
        print(f"[dg] DeepGEMM build/import FAILED: {exc if isinstance(exc, RuntimeError) else _short(exc, 2000)}",
              flush=True)
        return False


# ------------------------------------------------------------------------------------ operands & timing
def _q_rows(t, gran: int = 128):
    """Per-row, per-`gran`-column FP8 e4m3 cast: (fp8 [R, C], fp32 scales [R, C/gran]) (DeepGEMM's 1x128)."""
    import torch
    R, C = t.shape
    v = t.view(R, C // gran, gran).float()
    s = v.abs().amax(dim=2).clamp(min=1e-4) / 448.0
    return (v / s.unsqueeze(2)).to(torch.float8_e4m3fn).view(R, C), s


def _q_blocks(w, gran: int = 128):
    """Per-128x128-block cast of w [N, K]: (fp8 [N, K], fp32 [ceil(N/128), K/128])."""
    import torch
    N, K = w.shape
    Np = -(-N // gran) * gran
    wp = torch.zeros(Np, K, dtype=w.dtype, device=w.device)
    wp[:N] = w
    v = wp.view(Np // gran, gran, K // gran, gran).float()
    s = v.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-4) / 448.0
    q = (v / s).to(torch.float8_e4m3fn).view(Np, K)[:N].contiguous()
    return q, s.view(Np // gran, K // gran)


def _q_cols(t, gran: int = 128):
    """Per-column, per-`gran`-row cast of t [T, C] (T % gran == 0): (fp8 [T, C], fp32 [T/gran, C])."""
    import torch
    T, C = t.shape
    v = t.view(T // gran, gran, C).float()
    s = v.abs().amax(dim=1).clamp(min=1e-4) / 448.0
    return (v / s.unsqueeze(1)).to(torch.float8_e4m3fn).view(T, C), s


def _rel_err(out, ref) -> float:
    d = (out.double() - ref.double()).norm()
    return float(d / ref.double().norm().clamp(min=1e-30))


def _check_experts(counts: list) -> list:
    E = len(counts)
    cand = sorted({0, E // 3, (2 * E) // 3, E - 1})
    return [e for e in cand if counts[e] > 0]


def time_fn(fn, iters: int, warmup: int, flush_l2: bool = False) -> dict:
    """Median (p10, p90) of per-iteration CUDA-event times, back to back (as bench/measure.time_op)."""
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    buf = torch.empty(256 << 20, dtype=torch.uint8, device="cuda") if flush_l2 else None
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in evs:
        if buf is not None:
            buf.zero_()
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    ts = sorted(a.elapsed_time(b) for a, b in evs)
    pick = lambda p: ts[min(len(ts) - 1, max(0, int(round(p * (len(ts) - 1)))))]  # noqa: E731
    return {"ms": statistics.median(ts), "ms_p10": pick(0.1), "ms_p90": pick(0.9), "iters": iters}


def run_fprop(dg, E: int, K: int, N: int, counts: list, args, seed: int) -> dict:
    """out [T, N] bf16 = x [T, K] @ W[e]^T per contiguous expert group (m_grouped_fp8_gemm_nt_contiguous)."""
    import torch
    dev = DEV
    T = sum(counts)
    torch.manual_seed(seed)
    x = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
    xq, sx = _q_rows(x)
    del x
    wq = torch.empty(E, N, K, device=dev, dtype=torch.float8_e4m3fn)
    sw = torch.empty(E, -(-N // 128), K // 128, device=dev, dtype=torch.float32)
    for e in range(E):
        wq[e], sw[e] = _q_blocks(torch.randn(N, K, device=dev, dtype=torch.bfloat16))
    m_indices = torch.repeat_interleave(torch.arange(E, device=dev, dtype=torch.int32),
                                        torch.tensor(counts, device=dev)).to(torch.int32).contiguous()
    # LHS scales into DeepGEMM's TMA-aligned MN-major layout once (the GEMM call then takes them as they are)
    if hasattr(dg, "transform_sf_into_required_layout"):
        sx_t = dg.transform_sf_into_required_layout(sf=sx, mn=T, k=K, recipe=(1, 128, 128), is_sfa=True)
    else:
        sx_t = dg.get_mn_major_tma_aligned_tensor(sx)
    out = torch.empty(T, N, device=dev, dtype=torch.bfloat16)
    gemm = getattr(dg, "m_grouped_fp8_gemm_nt_contiguous", None) or dg.m_grouped_fp8_fp4_gemm_nt_contiguous

    def fn():
        gemm((xq, sx_t), (wq, sw), out, m_indices)

    res = {"api": "m_grouped_fp8_gemm_nt_contiguous", "flops": 2.0 * T * N * K}
    torch.cuda.synchronize()
    t0 = time.time()
    fn()  # JIT-compiles at the first call
    torch.cuda.synchronize()
    res["first_call_s"] = round(time.time() - t0, 2)
    if args.warm_only:
        return res
    if not args.no_check:
        errs, starts = [], [0]
        for c in counts:
            starts.append(starts[-1] + c)
        for e in _check_experts(counts):
            s0, s1 = starts[e], starts[e + 1]
            xd = xq[s0:s1].float() * sx[s0:s1].repeat_interleave(128, dim=1)
            wd = wq[e].float() * sw[e].repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)
            errs.append(_rel_err(out[s0:s1].float(), xd @ wd.t()))
        res["rel_err"] = max(errs) if errs else None
        res["checked_experts"] = _check_experts(counts)
    res.update(time_fn(fn, args.iters, args.warmup, args.flush_l2))
    return res


def run_wgrad(dg, E: int, M: int, N: int, counts: list, args, seed: int) -> dict:
    """d[e] [M, N] fp32 += dy_e^T @ act_e over each expert's tokens (k_grouped_fp8_gemm_nt_contiguous)."""
    import torch
    dev = DEV
    T = sum(counts)
    torch.manual_seed(seed)
    aq, sa = _q_cols(torch.randn(T, M, device=dev, dtype=torch.bfloat16))  # dy   [T, M], sa [T/128, M]
    bq, sb = _q_cols(torch.randn(T, N, device=dev, dtype=torch.bfloat16))  # act  [T, N], sb [T/128, N]
    # K-major per group: the flat concatenation of each expert's [M, T_e] (resp. [N, T_e]) transpose
    a_flat = torch.empty(T * M, device=dev, dtype=torch.float8_e4m3fn)
    b_flat = torch.empty(T * N, device=dev, dtype=torch.float8_e4m3fn)
    s = 0
    for c in counts:
        if c:
            a_flat[s * M:(s + c) * M].view(M, c).copy_(aq[s:s + c].t())
            b_flat[s * N:(s + c) * N].view(N, c).copy_(bq[s:s + c].t())
        s += c
    sa_t, sb_t = sa.t(), sb.t()  # [M, T/128] / [N, T/128], MN-major (stride 1 along M), TMA-aligned when M % 4 == 0
    if hasattr(dg, "get_mn_major_tma_aligned_tensor"):
        sa_t, sb_t = dg.get_mn_major_tma_aligned_tensor(sa_t), dg.get_mn_major_tma_aligned_tensor(sb_t)
    ks = [int(c) for c in counts]
    ks_t = torch.tensor(ks, device=dev, dtype=torch.int32)
    d = torch.zeros(E, M, N, device=dev, dtype=torch.float32)
    major = torch.cuda.get_device_capability()[0]
    if major != 9:
        raise RuntimeError(f"sm_{major}x: this peer drives DeepGEMM's SM90 wgrad only "
                           "(k_grouped_fp8_gemm_nt_contiguous; SM100 has the MN-major _tn_ variant)")

    def fn():
        dg.k_grouped_fp8_gemm_nt_contiguous((a_flat, sa_t), (b_flat, sb_t), d, ks, ks_t, d)

    res = {"api": "k_grouped_fp8_gemm_nt_contiguous", "flops": 2.0 * T * M * N, "accumulate": True}
    torch.cuda.synchronize()
    t0 = time.time()
    fn()
    torch.cuda.synchronize()
    res["first_call_s"] = round(time.time() - t0, 2)
    if args.warm_only:
        return res
    if not args.no_check:
        d.zero_()
        fn()
        errs, starts = [], [0]
        for c in counts:
            starts.append(starts[-1] + c)
        for e in _check_experts(counts):
            s0, s1 = starts[e], starts[e + 1]
            ad = aq[s0:s1].float() * sa[s0 // 128:s1 // 128].repeat_interleave(128, dim=0)
            bd = bq[s0:s1].float() * sb[s0 // 128:s1 // 128].repeat_interleave(128, dim=0)
            errs.append(_rel_err(d[e], ad.t() @ bd))
        res["rel_err"] = max(errs) if errs else None
        res["checked_experts"] = _check_experts(counts)
    res.update(time_fn(fn, args.iters, args.warmup, args.flush_l2))
    return res


# -------------------------------------------------------------------------------------------- diagnosis
# --diag: one tiny run of each DeepGEMM path this peer uses, in a child process whose every step is printed
# (flushed) before it runs, with Python's faulthandler on, C stdio unbuffered (so DeepGEMM's own printf lines
# reach the log before a crash), DeepGEMM's JIT debug switches on, and a preloaded SIGSEGV handler that
# prints the native backtrace (symbolized afterwards with addr2line against deep_gemm/_C*.so).
DIAG_ENV = {  # names from csrc/jit/*.hpp and csrc/jit_kernels/heuristics/common.hpp
    "DG_JIT_DEBUG": "1",                   # generated code, mkdir, NVCC command + ptxas log, cubin load, TMA descs, launch
    "DG_JIT_PRINT_COMPILER_COMMAND": "1",  # the NVCC / NVRTC command line
    "DG_JIT_PRINT_LOAD_TIME": "1",         # "Load time (...)" after each cubin load
    "DG_PRINT_CONFIGS": "1",               # chosen GEMM config (block sizes, stages, smem, cluster)
    "DG_JIT_PTXAS_VERBOSE": "1",           # ptxas register / smem usage
    "PYTHONFAULTHANDLER": "1",
    "PYTHONUNBUFFERED": "1",
}

_SEGV_SHIM_C = r"""
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
static char alt_stack[1 << 17];
static void put(const char* s) { ssize_t r = write(2, s, strlen(s)); (void)r; }
static void handler(int sig, siginfo_t* si, void* uc) {
    char buf[256];
    void* frames[96];
    (void)uc;
    snprintf(buf, sizeof(buf), "\n[segv-shim] signal %d (si_code %d, si_addr %p; si_code <= 0: re-raised by "
             "faulthandler, address meaningless), pid %d; native backtrace:\n",
             sig, si ? si->si_code : 0, si ? si->si_addr : (void*)0, (int)getpid());
    put(buf);
    int n = backtrace(frames, 96);
    backtrace_symbols_fd(frames, n, 2);
    put("[segv-shim] end of backtrace\n");
    signal(sig, SIG_DFL);
    raise(sig);
}
__attribute__((constructor)) static void dg_segv_shim_init(void) {
    void* warm[4];
    backtrace(warm, 4);  /* loads libgcc_s now, not inside the handler */
    stack_t ss;
    memset(&ss, 0, sizeof(ss));
    ss.ss_sp = alt_stack;
    ss.ss_size = sizeof(alt_stack);
    sigaltstack(&ss, 0);
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = handler;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    int sigs[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};
    for (unsigned i = 0; i < sizeof(sigs) / sizeof(sigs[0]); ++i)
        sigaction(sigs[i], &sa, 0);
}
"""


def _build_segv_shim(root: Path):
    """Compile the SIGSEGV backtrace handler into root/segv_shim.so (for LD_PRELOAD); None if no C compiler."""
    cc = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        return None
    root.mkdir(parents=True, exist_ok=True)
    c_path, so_path = root / "segv_shim.c", root / "segv_shim.so"
    c_path.write_text(_SEGV_SHIM_C)
    r = subprocess.run([cc, "-shared", "-fPIC", "-O0", "-g", "-o", str(so_path), str(c_path)],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        print(f"[diag] segv shim not built ({cc}): {r.stdout.strip()[-500:]}", flush=True)
        return None
    return so_path


def _run_cmd(cmd: list, timeout: int = 60) -> str:
    try:
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
        return r.stdout.strip()
    except Exception as exc:
        return f"({_short(exc, 200)})"


def _symbolize(lines: list) -> list:
    """addr2line for backtrace_symbols_fd frames 'path(+0xoff) [0xabs]' / 'path(sym+0xoff) [..]' in DeepGEMM's
    _C*.so (built with -g), c++filt for the others' symbols."""
    import re
    out = []
    pat = re.compile(r"^(/\S+)\(([^)]*)\)\s*\[(0x[0-9a-fA-F]+)\]")
    a2l = shutil.which("addr2line")
    for ln in lines:
        m = pat.match(ln.strip())
        if not m:
            continue
        path, inner, _abs = m.groups()
        name = path.rsplit("/", 1)[-1]
        desc = inner
        if inner.startswith("+") and a2l and "_C" in name and name.endswith(".so"):
            desc = _run_cmd([a2l, "-f", "-C", "-i", "-p", "-e", path, inner[1:]], 30).replace("\n", " <- ")
        elif inner and not inner.startswith("+") and shutil.which("c++filt"):
            sym, _, off = inner.partition("+")
            desc = _run_cmd(["c++filt", sym], 10) + (f" +{off}" if off else "")
        out.append(f"  {name}: {desc}")
    return out


def _diag_env_report(root: Path) -> None:
    """What the diagnosis depends on, printed from the parent before the child runs."""
    print(f"[diag] python {sys.version.split()[0]} ({sys.executable}); CUDA_HOME={os.environ.get('CUDA_HOME')}",
          flush=True)
    try:
        import torch
        print(f"[diag] torch {torch.__version__} cuda {torch.version.cuda} cxx11abi {torch.compiled_with_cxx11_abi()}"
              f" ({torch.__file__})", flush=True)
    except Exception as exc:
        print(f"[diag] torch import failed: {_short(exc)}", flush=True)
    cuda_home = Path(os.environ.get("CUDA_HOME") or _cuda_home())
    nv = _run_cmd([str(cuda_home / "bin" / "nvcc"), "--version"]).splitlines()
    print(f"[diag] nvcc: {nv[-2:] if nv else '?'}; cuobjdump: {(cuda_home / 'bin' / 'cuobjdump').exists()}",
          flush=True)
    print(f"[diag] g++: {_run_cmd(['g++', '--version']).splitlines()[:1]}", flush=True)
    print(f"[diag] nvidia-smi: {_run_cmd(['nvidia-smi', '--query-gpu=name,driver_version,compute_cap', '--format=csv,noheader'])}",
          flush=True)
    try:
        inc = _cutlass_include()
        ver = {}
        for line in (inc / "cutlass" / "version.h").read_text().splitlines():
            for k in ("CUTLASS_MAJOR", "CUTLASS_MINOR", "CUTLASS_PATCH"):
                if line.startswith(f"#define {k} "):
                    ver[k] = line.split()[2]
        print(f"[diag] CUTLASS headers {inc} version {ver}", flush=True)
    except Exception as exc:
        print(f"[diag] CUTLASS headers: {_short(exc)}", flush=True)
    sos = sorted((root / "src" / "deep_gemm").glob("_C*.so"))
    if not sos:
        print(f"[diag] no {root}/src/deep_gemm/_C*.so (run with --build)", flush=True)
        return
    so = str(sos[0])
    dyn = [ln.strip() for ln in _run_cmd(["readelf", "-d", so]).splitlines() if "NEEDED" in ln or "PATH" in ln]
    print(f"[diag] {so}:\n    " + "\n    ".join(dyn), flush=True)
    ldd = [ln.strip() for ln in _run_cmd(["ldd", so]).splitlines()
           if any(k in ln for k in ("cuda", "cublas", "nvrtc", "torch", "c10", "stdc++", "not found"))]
    print("[diag] ldd (outside python, so without torch's preloads):\n    " + "\n    ".join(ldd), flush=True)
    cfg = root / "src" / "_dg_peer_cfg.json"
    if cfg.exists():
        print(f"[diag] build cfg: {json.dumps(json.loads(cfg.read_text()))}", flush=True)
    try:
        cmd = [ln for ln in (root / "build.log").read_text(errors="replace").splitlines() if "python_api.cpp" in ln]
        print(f"[diag] compile line: {cmd[-1][:3000] if cmd else '?'}", flush=True)
    except Exception:
        pass


class _Step:
    """`with _Step(name):` prints the step before it runs (flushed) and its outcome after."""
    failures = []
    current = None

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        _Step.current = self.name
        print(f"[diag] >>> {self.name}", flush=True)
        self.t0 = time.time()
        return self

    def __exit__(self, et, ev, tb):
        dt = time.time() - self.t0
        if et is None:
            print(f"[diag] <<< ok ({dt:.2f} s): {self.name}", flush=True)
            return False
        print(f"[diag] <<< EXCEPTION ({dt:.2f} s) in {self.name}: {et.__name__}: {ev}", flush=True)
        traceback.print_exception(et, ev, tb, file=sys.stdout)
        sys.stdout.flush()
        _Step.failures.append(self.name)
        return True  # carry on with the next step


def _unbuffer_c_stdio() -> None:
    """setvbuf(stdout/stderr, NULL, _IONBF, 0): DeepGEMM reports through printf, block-buffered into a pipe
    and lost at a crash otherwise."""
    try:
        import ctypes
        libc = ctypes.CDLL(None)
        libc.setvbuf.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_size_t]
        for name in ("stdout", "stderr"):
            libc.setvbuf(ctypes.c_void_p.in_dll(libc, name), None, 2, 0)
    except Exception as exc:
        print(f"[diag] could not unbuffer C stdio: {_short(exc)}", flush=True)


def _diag_child(args) -> int:
    import faulthandler
    faulthandler.enable(all_threads=True)
    _unbuffer_c_stdio()
    print(f"[diag] child pid {os.getpid()}; " + ", ".join(f"{k}={os.environ.get(k)}" for k in sorted(os.environ)
                                                         if k.startswith("DG_") or k in ("CUDA_HOME", "LD_PRELOAD",
                                                                                         "LD_LIBRARY_PATH")),
          flush=True)
    with _Step("import torch"):
        import torch
    if "import torch" in _Step.failures:
        return 2
    with _Step("torch CUDA init + tiny bf16 matmul (torch only)"):
        torch.cuda.init()
        a = torch.randn(64, 64, device=DEV, dtype=torch.bfloat16)
        float((a @ a).float().sum())
        print(f"[diag] device {torch.cuda.get_device_name()} sm_{''.join(map(str, torch.cuda.get_device_capability()))}"
              f", torch {torch.__version__} cuda {torch.version.cuda}, driver "
              f"{getattr(torch._C, '_cuda_getDriverVersion', lambda: '?')()}", flush=True)
    print(f"[diag] CUDA libs mapped after torch: {_loaded_libs()}", flush=True)
    if _Step.failures:
        return 2
    dg = None
    with _Step(f"import deep_gemm from {args.root}/src (+ _C.init(library root, CUDA home))"):
        dg, why = import_deep_gemm(args.root)
        if dg is None:
            raise RuntimeError(why)
        print(f"[diag] deep_gemm {getattr(dg, '__version__', '?')} at {dg.__file__}; _C at {dg._C.__file__}",
              flush=True)
    if dg is None:
        return 3
    print(f"[diag] CUDA libs mapped after deep_gemm: {_loaded_libs()}", flush=True)
    with _Step("dg.get_num_sms()  [DeviceRuntime(): cublasLtCreate, 32 MiB torch workspace, cudaGetDeviceProperties]"):
        print(f"[diag] num_sms {dg.get_num_sms()}, mk alignment {dg.get_mk_alignment_for_contiguous_layout()}",
              flush=True)

    v = {}  # values shared between the steps of a section

    def section(title: str, steps: list) -> None:
        """Runs (name, fn) steps in order; after a failed step the rest of the section is skipped."""
        print(f"[diag] ---- {title}", flush=True)
        for name, fn in steps:
            n0 = len(_Step.failures)
            with _Step(name):
                fn()
            if len(_Step.failures) > n0:
                print(f"[diag] (rest of '{title}' skipped)", flush=True)
                return

    # 1. the smallest JIT kernel: transpose_fp32 (NVCC compile -> cubin load -> launch)
    def transpose_check():
        torch.cuda.synchronize()
        print(f"[diag] transpose: strides {tuple(v['t_out'].stride())}, equal {bool(torch.equal(v['t_out'], v['sf']))}",
              flush=True)

    section("JIT transpose kernel", [
        ("fp32 [256, 4] operand (torch only)", lambda: v.update(sf=torch.rand(256, 4, device=DEV))),
        ("dg.get_mn_major_tma_aligned_tensor(fp32 [256, 4])  [JIT transpose_fp32: compile, load, launch]",
         lambda: v.update(t_out=dg.get_mn_major_tma_aligned_tensor(v["sf"]))),
        ("torch.cuda.synchronize() after transpose_fp32 + check", transpose_check),
    ])

    # 2. m-grouped contiguous FP8 fprop, E=2 x 128 rows, N=K=256
    E, N, K, M, counts = 2, 256, 256, 256, [128, 128]
    T = sum(counts)

    def m_operands():
        xq, sx = _q_rows(torch.randn(T, K, device=DEV, dtype=torch.bfloat16))
        wq = torch.empty(E, N, K, device=DEV, dtype=torch.float8_e4m3fn)
        sw = torch.empty(E, N // 128, K // 128, device=DEV, dtype=torch.float32)
        for e in range(E):
            wq[e], sw[e] = _q_blocks(torch.randn(N, K, device=DEV, dtype=torch.bfloat16))
        m_idx = torch.repeat_interleave(torch.arange(E, device=DEV, dtype=torch.int32),
                                        torch.tensor(counts, device=DEV)).to(torch.int32).contiguous()
        v.update(xq=xq, sx=sx, wq=wq, sw=sw, m_idx=m_idx, out=torch.empty(T, N, device=DEV, dtype=torch.bfloat16))
        torch.cuda.synchronize()

    def m_sf():
        v["sx_t"] = dg.transform_sf_into_required_layout(sf=v["sx"], mn=T, k=K, recipe=(1, 128, 128), is_sfa=True)
        torch.cuda.synchronize()

    def m_check():
        torch.cuda.synchronize()
        errs = []
        for e in range(E):
            s0, s1 = sum(counts[:e]), sum(counts[:e + 1])
            xd = v["xq"][s0:s1].float() * v["sx"][s0:s1].repeat_interleave(128, dim=1)
            wd = v["wq"][e].float() * v["sw"][e].repeat_interleave(128, 0).repeat_interleave(128, 1)
            errs.append(_rel_err(v["out"][s0:s1].float(), xd @ wd.t()))
        print(f"[diag] m-grouped rel err {max(errs):.2e}", flush=True)

    section("m-grouped FP8 GEMM (fprop path)", [
        ("m-grouped operands (torch only)", m_operands),
        ("dg.transform_sf_into_required_layout(sx, recipe=(1,128,128), is_sfa=True)", m_sf),
        ("dg.m_grouped_fp8_gemm_nt_contiguous  [JIT sm90 1D2D m-grouped: compile, load, TMA descs, launch]",
         lambda: dg.m_grouped_fp8_gemm_nt_contiguous((v["xq"], v["sx_t"]), (v["wq"], v["sw"]), v["out"], v["m_idx"])),
        ("torch.cuda.synchronize() after m-grouped GEMM + check", m_check),
    ])

    # 3. k-grouped contiguous FP8 wgrad, E=2 x 128 tokens, M=N=256, accumulating into fp32 d
    def k_operands():
        aq, sa = _q_cols(torch.randn(T, M, device=DEV, dtype=torch.bfloat16))
        bq, sb = _q_cols(torch.randn(T, N, device=DEV, dtype=torch.bfloat16))
        a_flat = torch.empty(T * M, device=DEV, dtype=torch.float8_e4m3fn)
        b_flat = torch.empty(T * N, device=DEV, dtype=torch.float8_e4m3fn)
        s = 0
        for c in counts:
            a_flat[s * M:(s + c) * M].view(M, c).copy_(aq[s:s + c].t())
            b_flat[s * N:(s + c) * N].view(N, c).copy_(bq[s:s + c].t())
            s += c
        v.update(aq=aq, sa=sa, bq=bq, sb=sb, a_flat=a_flat, b_flat=b_flat,
                 ks_t=torch.tensor(counts, device=DEV, dtype=torch.int32),
                 d=torch.zeros(E, M, N, device=DEV, dtype=torch.float32))
        torch.cuda.synchronize()

    def k_sf():
        v["sa_t"] = dg.get_mn_major_tma_aligned_tensor(v["sa"].t())
        v["sb_t"] = dg.get_mn_major_tma_aligned_tensor(v["sb"].t())
        torch.cuda.synchronize()

    def k_check():
        torch.cuda.synchronize()
        errs = []
        for e in range(E):
            s0, s1 = sum(counts[:e]), sum(counts[:e + 1])
            ad = v["aq"][s0:s1].float() * v["sa"][s0 // 128:s1 // 128].repeat_interleave(128, dim=0)
            bd = v["bq"][s0:s1].float() * v["sb"][s0 // 128:s1 // 128].repeat_interleave(128, dim=0)
            errs.append(_rel_err(v["d"][e], ad.t() @ bd))
        print(f"[diag] k-grouped rel err {max(errs):.2e}", flush=True)

    section("k-grouped FP8 GEMM (wgrad path)", [
        ("k-grouped operands (torch only)", k_operands),
        ("dg.get_mn_major_tma_aligned_tensor(sa.t()), (sb.t())", k_sf),
        ("dg.k_grouped_fp8_gemm_nt_contiguous  [JIT sm90 1D1D k-grouped: compile, load, TMA descs, launch]",
         lambda: dg.k_grouped_fp8_gemm_nt_contiguous((v["a_flat"], v["sa_t"]), (v["b_flat"], v["sb_t"]), v["d"],
                                                     list(counts), v["ks_t"], v["d"])),
        ("torch.cuda.synchronize() after k-grouped GEMM + check", k_check),
    ])
    print(f"[diag] child done; failed steps: {_Step.failures or 'none'}", flush=True)
    return 1 if _Step.failures else 0


def _diag_once(args, label: str, env_over: dict, shim) -> tuple:
    """One diagnosis child, its output streamed through; (rc, last step started, output lines)."""
    env = dict(os.environ)
    env.update(DIAG_ENV)
    env.update(env_over)
    if shim is not None:
        env["LD_PRELOAD"] = (str(shim) + " " + env.get("LD_PRELOAD", "")).strip()
    cmd = [sys.executable, "-X", "faulthandler", str(Path(__file__).resolve()), "--diag-child",
           "--src", str(args.src), "--root", str(args.root)]
    print(f"\n[diag] ===== {label}: {' '.join(f'{k}={v}' for k, v in env_over.items())} "
          f"{'LD_PRELOAD=' + str(shim) if shim else '(no native backtrace shim)'}", flush=True)
    import threading
    lines, last = [], None
    t0 = time.time()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         errors="replace", bufsize=1)
    limit = max(30.0, min(args.diag_timeout, args.diag_budget - (time.time() - T_START)))
    watchdog = threading.Timer(limit, p.kill)  # a hang (no output) is killed as well
    watchdog.start()
    try:
        for ln in p.stdout:
            sys.stdout.write(ln)
            sys.stdout.flush()
            lines.append(ln.rstrip("\n"))
            if ln.startswith("[diag] >>> "):
                last = ln[len("[diag] >>> "):].strip()
        rc = p.wait()
    except Exception:
        p.kill()
        rc = p.wait()
    finally:
        watchdog.cancel()
    if time.time() - t0 >= limit - 1:
        print(f"[diag] child killed at its {limit:.0f} s limit (--diag-timeout / --diag-budget)", flush=True)
    import signal as _signal
    what = f"signal {-rc} ({_signal.Signals(-rc).name})" if rc < 0 else f"rc {rc}"
    print(f"[diag] ===== {label}: {what} after {time.time() - t0:.0f} s; last step started: {last}", flush=True)
    if rc < 0:
        sym = _symbolize(lines)
        if sym:
            print("[diag] native frames (innermost first):\n" + "\n".join(sym[:40]), flush=True)
    return rc, last, lines


def diagnose(args) -> int:
    """--diag: see the section comment above. Runs one child; if it dies of a signal, reruns variants that
    separate compile from load/launch (warm JIT cache), NVCC from NVRTC, and DeepGEMM's own cuBLASLt handle
    from torch's, each with the same step log."""
    root = Path(args.root)
    os.environ.setdefault("CUDA_HOME", str(_cuda_home()))
    _diag_env_report(root)
    shim = _build_segv_shim(root)
    cache = root / "diag_jit_cache"
    if cache.exists():
        shutil.rmtree(cache, ignore_errors=True)  # a cold cache: the first child shows the compile too
    base = {"DG_JIT_CACHE_DIR": str(cache)}
    rc, last, _ = _diag_once(args, "diag 1 (cold JIT cache, NVCC)", base, shim)
    if rc >= 0:
        print(f"[diag] SUMMARY: no crash in the tiny run (rc {rc}); failed steps are printed above", flush=True)
        return 0
    runs = [("diag 2 (same JIT cache: load + launch only, no compile)", dict(base))]
    if last and "get_num_sms" in last:
        runs.append(("diag 3 (torch's cuBLASLt handle, temporary workspace)",
                     dict(base, DG_USE_PYTORCH_CUBLASLT_HANDLE="1", DG_USE_TEMP_CUBLASLT_WORKSPACE="1")))
    runs.append(("diag 3 (NVRTC instead of NVCC, own JIT cache)",
                 {"DG_JIT_CACHE_DIR": str(root / "diag_jit_cache_nvrtc"), "DG_JIT_USE_NVRTC": "1"}))
    summary = [f"diag 1: signal {-rc}, last step: {last}"]
    for i, (label, env_over) in enumerate(runs):
        label = f"diag {i + 2} " + label.split(" ", 2)[2]
        if args.diag_budget - (time.time() - T_START) < 60:
            summary.append(f"{label}: not run (--diag-budget {args.diag_budget} s spent)")
            continue
        rc2, last2, _ = _diag_once(args, label, env_over, shim)
        summary.append(f"{label.split(' (')[0]}: {'signal ' + str(-rc2) if rc2 < 0 else 'rc ' + str(rc2)}, "
                       f"last step: {last2}")
    print("[diag] SUMMARY:\n  " + "\n  ".join(summary), flush=True)
    return 0


# ------------------------------------------------------------------------------------------------ driver
def _select(names: list, spec: str | None) -> list:
    if not spec:
        return list(names)
    want = [w.strip() for w in spec.split(",") if w.strip()]
    exact = [n for n in names if n in want]
    if exact and len(exact) == len(want):
        return exact
    return [n for n in names if any(w.lower() in n.lower() for w in want)]


def _problems(args) -> list:
    out = []
    for name in _select(list(SHAPES), args.shapes):
        E, H, F, T = SHAPES[name]
        counts = make_splits(E, T, args.splits)
        for g in _select(list(GEMMS), args.gemms):
            out.append((name, g, E, H, F, counts))
    return out


class Results:
    def __init__(self, path: str | None, meta: dict):
        self.path, self.doc = path, {"meta": meta, "splits": {}, "results": []}

    def add(self, rec: dict) -> None:
        self.doc["results"].append(rec)
        self.save()

    def save(self) -> None:
        if not self.path:
            return
        try:
            p = Path(self.path)
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = p.with_suffix(p.suffix + ".tmp")
            tmp.write_text(json.dumps(self.doc, indent=1))
            tmp.replace(p)
        except Exception as exc:
            print(f"[dg] could not write {self.path}: {_short(exc)}")


def _line(rec: dict) -> str:
    dims = (f"T={rec['T']} N={rec['N']} K={rec['K']}" if rec["kind"] == "fprop"
            else f"out=[{rec['M']},{rec['N']}] T={rec['T']}")
    head = f"DG {rec['shape']:<19s} {rec['gemm']:<9s} E={rec['E']:<3d} {dims:<27s}"
    if rec.get("error"):
        return f"{head} ERROR {rec['error']}"
    err = rec.get("rel_err")
    err_s = "relerr=n/a" if err is None else f"relerr={err:.2e}{'' if err < 2e-2 else ' (HIGH)'}"
    return (f"{head} {rec['ms']:8.3f} ms (p10 {rec['ms_p10']:.3f}, p90 {rec['ms_p90']:.3f})  "
            f"{rec['tflops']:7.1f} TFLOP/s  {err_s}  first call {rec['first_call_s']:.1f} s")


def _meta(dg, src: Path) -> dict:
    import torch
    m = {"peer": "DeepGEMM", "torch": torch.__version__, "cuda": torch.version.cuda,
         "argv": sys.argv[1:], "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        for line in (src / "PEER_SOURCE.txt").read_text().splitlines():
            if line.startswith("commit "):
                m["deepgemm_commit"] = line.split()[1]
    except Exception:
        pass
    if dg is not None:
        m["deepgemm_version"] = getattr(dg, "__version__", None)
        m["deepgemm_file"] = getattr(dg, "__file__", None)
        for k in ("get_num_sms", "get_mk_alignment_for_contiguous_layout"):
            try:
                m[k] = getattr(dg, k)()
            except Exception:
                pass
    try:
        m["device"] = torch.cuda.get_device_name()
        m["capability"] = list(torch.cuda.get_device_capability())
    except Exception:
        pass
    m["DG_JIT_CACHE_DIR"] = os.environ.get("DG_JIT_CACHE_DIR")
    m["DG_JIT_USE_NVRTC"] = os.environ.get("DG_JIT_USE_NVRTC", "0")
    return m


def _child_args(args, shape: str, gemm: str | None, json_path: str, warm_only: bool) -> list:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--shapes", shape, "--json", json_path,
           "--iters", str(args.iters), "--warmup", str(args.warmup), "--splits", args.splits,
           "--src", str(args.src), "--root", str(args.root)]
    if gemm:
        cmd += ["--gemms", gemm]
    for flag in ("no_check", "flush_l2", "nvrtc"):
        if getattr(args, flag):
            cmd.append("--" + flag.replace("_", "-"))
    if warm_only:
        cmd.append("--warm-only")
    return cmd


def _prewarm(args, probs: list) -> None:
    """Compile every kernel first, `args.jit_prewarm` child processes at a time (no timing there)."""
    t0 = time.time()
    print(f"[dg] JIT prewarm: {len(probs)} GEMMs, {args.jit_prewarm} processes", flush=True)
    pending = [(i, n, g) for i, (n, g, *_) in enumerate(probs)]
    running = []
    tmpd = Path(tempfile.mkdtemp(prefix="dg_prewarm_"))
    while pending or running:
        while pending and len(running) < args.jit_prewarm:
            i, n, g = pending.pop(0)
            logf = open(tmpd / f"{i}.log", "w")
            p = subprocess.Popen(_child_args(args, n, g, str(tmpd / f"{i}.json"), True),
                                 stdout=logf, stderr=subprocess.STDOUT)
            running.append((p, n, g, logf))
        time.sleep(0.5)
        for item in list(running):
            p, n, g, logf = item
            if p.poll() is not None:
                logf.close()
                running.remove(item)
                if p.returncode != 0:
                    tail = Path(logf.name).read_text(errors="replace").splitlines()[-12:]
                    print(f"[dg] prewarm {n}/{g} rc {p.returncode}: {' | '.join(tail)}", flush=True)
    print(f"[dg] JIT prewarm done in {time.time() - t0:.0f} s", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Time DeepGEMM's grouped FP8 GEMMs (m-grouped fprop, k-grouped "
                                             "wgrad) on the moegemm shapes; see the module docstring.")
    ap.add_argument("--build", action="store_true", help="build DeepGEMM from --src into --root first")
    ap.add_argument("--force-build", action="store_true", help="rebuild even if a build is there")
    ap.add_argument("--src", default=str(DEFAULT_SRC), help="DeepGEMM source tree (default .peers/DeepGEMM)")
    ap.add_argument("--root", default=str(DEFAULT_ROOT), help="build / JIT-cache root (default /tmp/dg_peer)")
    ap.add_argument("--shapes", default=None, help="comma-separated names or substrings (default all)")
    ap.add_argument("--gemms", default=None, help=f"comma-separated subset of {','.join(GEMMS)}")
    ap.add_argument("--splits", default="balanced", choices=("balanced", "zipf"),
                    help="token counts per expert, rounded to multiples of 128 (default balanced)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--flush-l2", action="store_true", help="zero 256 MiB before every timed iteration")
    ap.add_argument("--no-check", action="store_true", help="skip the float reference check")
    ap.add_argument("--json", default=None, help="write results here (rewritten after every GEMM)")
    ap.add_argument("--nvrtc", action="store_true", help="DG_JIT_USE_NVRTC=1 (faster JIT, maybe slower kernels)")
    ap.add_argument("--jit-prewarm", type=int, default=0, metavar="J",
                    help="compile all kernels first in J parallel child processes")
    ap.add_argument("--isolate", action="store_true", help="one child process per shape")
    ap.add_argument("--list", action="store_true", help="print the shapes, splits and GEMMs, then exit (no GPU)")
    ap.add_argument("--runtime-api", action="store_true",
                    help="build with -DDG_JIT_USE_RUNTIME_API (JIT kernels loaded/launched through cudart instead "
                         "of the dlopen'ed driver API; needs cuobjdump)")
    ap.add_argument("--diag", action="store_true",
                    help="no benchmark: run one tiny transpose / m-grouped / k-grouped call in a child process with "
                         "every step printed first, faulthandler, DG_JIT_DEBUG & co., a native SIGSEGV backtrace; "
                         "on a crash, rerun variants (warm cache, NVRTC) to separate compile from load/launch")
    ap.add_argument("--diag-timeout", type=int, default=240, help="seconds per diagnosis child (default 240)")
    ap.add_argument("--diag-budget", type=int, default=540,
                    help="seconds for the whole --diag run, build included (default 540: the remote 600 s limit)")
    ap.add_argument("--diag-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--warm-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.src, args.root = Path(args.src), Path(args.root)
    if args.diag_child:
        return _diag_child(args)
    import faulthandler
    faulthandler.enable(all_threads=True)  # a native crash still prints the Python stack (stderr)
    os.environ.setdefault("PYTHONFAULTHANDLER", "1")  # and so do the prewarm / isolate children

    _load_workload_shapes()
    if args.nvrtc:
        os.environ["DG_JIT_USE_NVRTC"] = "1"
    os.environ.setdefault("DG_JIT_CACHE_DIR", str(args.root / "jit_cache"))
    probs = _problems(args)

    if args.list:
        for name in _select(list(SHAPES), args.shapes):
            E, H, F, T = SHAPES[name]
            c = make_splits(E, T, args.splits)
            print(f"{name}: E={E} hidden={H} ffn={F} T={T} -> {sum(c)} tokens {_fmt_counts(c)}")
        for name, g, E, H, F, counts in probs:
            print(f"  {name} {g}: {gemm_dims(g, H, F)}")
        return 0

    if args.build:
        build(args.src, args.root, force=args.force_build, runtime_api=args.runtime_api)
    if args.diag:
        return diagnose(args)
    dg, why = import_deep_gemm(args.root)
    import torch
    res = Results(args.json, _meta(dg, args.src))
    for name in _select(list(SHAPES), args.shapes):
        E, H, F, T = SHAPES[name]
        res.doc["splits"][name] = {"E": E, "hidden": H, "ffn": F, "tokens_per_expert": make_splits(E, T, args.splits)}
    res.save()
    if dg is None or not torch.cuda.is_available():
        reason = why if dg is None else "no CUDA device"
        print(f"[dg] DeepGEMM unavailable: {reason}")
        res.doc["meta"]["unavailable"] = reason
        res.save()
        return 0

    if args.isolate and not args.warm_only:
        if args.jit_prewarm > 0:
            _prewarm(args, probs)
        tmpd = Path(tempfile.mkdtemp(prefix="dg_isolate_"))
        for name in _select(list(SHAPES), args.shapes):
            cj = tmpd / f"{abs(hash(name))}.json"
            rc = subprocess.run(_child_args(args, name, args.gemms, str(cj), False)).returncode
            got = json.loads(cj.read_text())["results"] if cj.exists() else []
            done = {r["gemm"] for r in got}
            for r in got:
                res.add(r)
            for n2, g, E, H, F, counts in probs:
                if n2 == name and g not in done:
                    rec = {"shape": name, "gemm": g, "E": E, "T": sum(counts), **gemm_dims(g, H, F),
                           "tokens_per_expert": counts, "error": f"child process rc {rc}"}
                    print(_line(rec), flush=True)
                    res.add(rec)
        return 0

    if args.jit_prewarm > 0 and not args.warm_only:
        _prewarm(args, probs)

    torch.backends.cuda.matmul.allow_tf32 = False
    for i, (name, g, E, H, F, counts) in enumerate(probs):
        dims = gemm_dims(g, H, F)
        rec = {"shape": name, "gemm": g, "E": E, "T": sum(counts), **dims, "tokens_per_expert": counts}
        try:
            if dims["kind"] == "fprop":
                r = run_fprop(dg, E, dims["K"], dims["N"], counts, args, seed=1000 + i)
            else:
                r = run_wgrad(dg, E, dims["M"], dims["N"], counts, args, seed=1000 + i)
            rec.update(r)
            if "ms" in r:
                rec["tflops"] = r["flops"] / (r["ms"] * 1e-3) / 1e12
        except Exception as exc:
            rec["error"] = _short(exc, 1500)
            if os.environ.get("DG_PEER_TRACEBACK"):
                traceback.print_exc()
        if args.warm_only:
            what = rec.get("error") or f"first call {rec.get('first_call_s')} s"
            print(f"[dg] warm {name} {g}: {what}", flush=True)
        else:
            print(_line(rec), flush=True)
        res.add(rec)
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception as exc:  # a sticky CUDA error: the rest of this process cannot run kernels
            print(f"[dg] CUDA context unusable after {name}/{g}: {_short(exc)}; stopping (use --isolate)")
            break
    if not args.warm_only:
        print("[dg] splits (tokens per expert): " + "; ".join(
            f"{n}: {_fmt_counts(v['tokens_per_expert'])}" for n, v in res.doc["splits"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
