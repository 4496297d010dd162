"""``python -m moegemm.build`` without what a build needs (a CUDA build of torch, the CUDA toolkit, a CUDA
GPU) stops at once with one plain sentence naming each missing part; ``--help`` works anywhere."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.utils.cpp_extension

from moegemm import _build

ROOT = Path(__file__).resolve().parent.parent


def _environment(monkeypatch, cuda_torch: bool, toolkit, gpu: bool):
    """A CUDA or CPU build of torch, the toolkit torch finds (a CPU build's CUDA_HOME is always None: moegemm
    looks for nvcc itself, ``search_cuda_home``) and a GPU or none (a CPU build asks the driver)."""
    monkeypatch.setattr(torch.version, "cuda", "12.8" if cuda_torch else None)
    monkeypatch.setattr(torch.utils.cpp_extension, "CUDA_HOME", toolkit if cuda_torch else None)
    monkeypatch.setattr(_build, "search_cuda_home", lambda: None if cuda_torch else toolkit)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu and cuda_torch)
    monkeypatch.setattr(_build, "_driver_lists_a_gpu", lambda: gpu)


def test_missing_parts_are_named(monkeypatch, tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("")
    _environment(monkeypatch, True, str(tmp_path), True)
    assert _build.missing_for_build() == []
    _build.require_build_environment()  # nothing missing: no error
    _environment(monkeypatch, False, None, False)
    with pytest.raises(_build.BuildEnvironmentError) as err:
        _build.require_build_environment()
    msg = str(err.value)
    assert "CUDA build of torch" in msg and "CUDA toolkit" in msg and "CUDA GPU" in msg and "\n" not in msg
    assert "CUDA toolkit" not in str(_build.missing_for_build(toolkit=False))
    _environment(monkeypatch, True, str(tmp_path / "none"), True)  # a CUDA_HOME without nvcc
    assert len(_build.missing_for_build()) == 1 and "nvcc" in _build.missing_for_build()[0]


def test_cpu_torch_with_nvcc_is_named_as_the_cause(monkeypatch, tmp_path):
    """A CPU build of torch with nvcc on PATH (torch's CUDA_HOME is None then): the torch build is the cause,
    never "no nvcc found"."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("")
    _environment(monkeypatch, False, str(tmp_path), True)
    assert _build.missing_for_build() == [f"a CUDA build of torch (torch {torch.__version__} is a CPU build)"]
    with pytest.raises(_build.BuildEnvironmentError) as err:
        _build.require_build_environment()
    assert str(err.value) == (f"moegemm: cannot build the CUDA extension here: it needs a CUDA build of torch (torch "
                              f"{torch.__version__} is a CPU build); without them moegemm runs its reference path "
                              "(plain PyTorch), which needs no build.")
    _environment(monkeypatch, False, str(tmp_path), False)
    assert _build.missing_for_build() == [f"a CUDA build of torch (torch {torch.__version__} is a CPU build)",
                                          "a CUDA GPU (none is visible)"]


def test_search_cuda_home(monkeypatch, tmp_path):
    """The toolkit as torch would find it for a CPU build of torch: CUDA_HOME, CUDA_PATH, the nvcc on PATH."""
    for name in ("a", "b"):
        (tmp_path / name / "bin").mkdir(parents=True)
        (tmp_path / name / "bin" / "nvcc").write_text("#!/bin/sh\n")
        (tmp_path / name / "bin" / "nvcc").chmod(0o755)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "a"))
    assert _build.search_cuda_home() == str(tmp_path / "a")
    monkeypatch.delenv("CUDA_HOME")
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "b" / "bin"))
    assert _build.search_cuda_home() == str(tmp_path / "b")


def _run(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "moegemm.build", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    return proc, time.time() - start


@pytest.mark.skipif(not _build.missing_for_build(), reason="this machine can build the extension (the command "
                    "would build it: minutes)")
def test_build_command_fails_fast_in_one_sentence():
    proc, seconds = _run()
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moegemm: cannot build the CUDA extension here"), proc.stderr
    assert "Traceback" not in proc.stderr and seconds < 60


def _bare_environment(tmp_path) -> dict:
    """No CUDA toolkit: CUDA_HOME at an empty folder, no nvcc on PATH (the Python and the host compiler kept)."""
    keep = [d for d in os.environ.get("PATH", "").split(os.pathsep)
            if d and not os.path.isfile(os.path.join(d, "nvcc"))]
    (tmp_path / "cuda").mkdir()
    python_path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=python_path, PATH=os.pathsep.join(keep), CUDA_HOME=str(tmp_path / "cuda"),
                CUDA_PATH=str(tmp_path / "cuda"))


def test_compile_check_without_a_toolkit_says_so_in_one_line(tmp_path):
    """--check without the CUDA toolkit: one line naming what is missing (nvcc, the toolkit's headers), exit
    status 1, no compiler output and no traceback (it used to print ~100 compiler errors and a traceback)."""
    proc = subprocess.run([sys.executable, "-m", "moegemm.build", "--check", "--jobs", "1"], cwd=ROOT,
                          env=_bare_environment(tmp_path), capture_output=True, text=True, timeout=300)
    cuda = tmp_path / "cuda"
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.strip() == (
        f"moegemm: the compile check cannot run here: it needs nvcc (the CUDA toolkit's compiler: none on PATH nor at "
        f"{cuda}/bin/nvcc; install the CUDA toolkit, set CUDA_HOME or put nvcc on PATH); the CUDA toolkit's headers "
        f"(no cuda_runtime.h in {cuda}/include; set CUDA_HOME to the toolkit's root)"), proc.stderr


def test_compile_check_names_missing_headers(tmp_path, monkeypatch):
    """Each missing part of the check, named: CUTLASS headers, torch's headers (a wrong --torch-include), the host
    compiler; --binding-only needs no nvcc."""
    env = _bare_environment(tmp_path)
    monkeypatch.setattr(os, "environ", env)
    monkeypatch.setenv("MOEGEMM_CUTLASS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-c++")
    with pytest.raises(_build.BuildEnvironmentError) as err:
        _build.check_tools(torch_include=str(tmp_path), binding_only=True)
    msg = str(err.value)
    assert "\n" not in msg and "nvcc (" not in msg
    assert f"the CUTLASS headers (no CUTLASS headers under {tmp_path}/include (cutlass/cutlass.h, from " \
           "MOEGEMM_CUTLASS_DIR))" in msg
    assert f"torch's C++ headers (no torch/extension.h in {tmp_path}; --torch-include names a torch/include folder)" in msg
    assert "a host C++ compiler ('no-such-c++' not found; set CXX)" in msg
    assert "the CUDA toolkit's headers (no cuda_runtime.h in" in msg


def test_compile_check_finds_what_ci_has():
    """CI's machine (a CPU build of torch, nvcc on PATH or in CUDA_HOME): everything the check needs is found."""
    import shutil

    if shutil.which("nvcc") is None and _build.search_cuda_home() is None:
        pytest.skip("no CUDA toolkit here")
    try:
        tools = _build.check_tools()
    except _build.BuildEnvironmentError as exc:
        if "CUTLASS" in str(exc):
            pytest.skip("no CUTLASS headers here")
        raise
    assert os.path.isfile(os.path.join(tools["cuda_include"], "cuda_runtime.h"))
    assert os.path.isfile(os.path.join(tools["torch_include"], "torch", "extension.h"))


def test_compile_check_runs_end_to_end(monkeypatch, tmp_path, capsys):
    """compile_check's whole path (tools, commands, the pool, the report, the cleanup) on two tiny translation
    units standing for csrc/'s, one good and one broken: one failure counted, each named."""
    try:
        _build.check_tools()
    except _build.BuildEnvironmentError as exc:
        pytest.skip(f"the compile check cannot run here: {exc}")
    good, bad = tmp_path / "good.cu", tmp_path / "bad.cu"
    good.write_text("__global__ void k(int* p) { p[threadIdx.x] = 1; }\n")
    bad.write_text("__global__ void k(int* p) { p[threadIdx.x] = undeclared; }\n")
    monkeypatch.setattr(_build, "sources", lambda: [str(good), str(bad)])
    assert _build.compile_check(jobs=2) == 1
    out = capsys.readouterr().out
    assert "compile good.cu: ok" in out and "compile bad.cu: FAILED" in out and "undeclared" in out


def test_build_command_help():
    proc, _ = _run("--help")
    assert proc.returncode == 0 and "--check" in proc.stdout
    assert proc.stdout.startswith("usage: python -m moegemm.build [-h]") and "``" not in proc.stdout


def test_compile_check_refuses_serialized_wgmma():
    """The compile check counts a kernel whose wgmma ptxas made wait or serialized as a failure. The first line as
    nvcc 13.0 printed it here, without -v, for a probe that touched the accumulator of the deferred epilogue's wgmma
    chain (csrc/kernels/gemm/sm90/fp8_ragged_rows.cuh); the second in the form of ptxas's serialization warnings
    (C7511, C7515 in public reports; not seen here)."""
    injected = ("ptxas info    : (C7517) warpgroup.wait is injected in around line 97450 by compiler to allow use of "
                "registers defined by GMMA in function '_ZN7moegemm4sm9022fp8_ragged_rows_kernel'")
    serialized = ("ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized due "
                  "to non wgmma instructions defining accumulator registers of a wgmma between start and end of the "
                  "pipeline stage in the function 'k'")
    plain = "ptxas info    : Used 168 registers, used 16 barriers\nptxas info    : Compiling entry function 'k' for 'sm_90a'"
    assert _build.wgmma_serialized(plain) == []
    assert _build.wgmma_serialized("\n".join([plain, injected, serialized])) == [injected, serialized]
