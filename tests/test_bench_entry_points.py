"""The bench scripts' front door on any machine: every entry point (each module under bench/ that runs as
a script, and the compute-sanitizer drivers in tests/sanitize/) answers ``--help`` with its own usage
(in a child process each, as a user runs it); without a GPU, those that need one stop with one plain
sentence instead of a traceback (bench/preflight.py; its other sentences are checked with a faked torch)."""

from __future__ import annotations

import os
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import preflight

REPO = Path(__file__).resolve().parents[1]


def _entry_points() -> dict:
    """name -> command: ``python -m <module>`` for every bench module with a ``__main__`` (a package's
    ``__main__.py`` or a module's ``if __name__ == "__main__"``), ``python <file>`` for the sanitizer drivers."""
    found = {}
    for path in sorted((REPO / "bench").rglob("*.py")):
        rel = path.relative_to(REPO).with_suffix("")
        if path.name == "__main__.py":
            found[".".join(rel.parts[:-1])] = None
        elif '__name__ == "__main__"' in path.read_text():
            found[".".join(rel.parts)] = None
    cmds = {m: [sys.executable, "-m", m] for m in found}
    for path in sorted((REPO / "tests" / "sanitize").glob("*.py")):
        cmds[str(path.relative_to(REPO))] = [sys.executable, str(path.relative_to(REPO))]
    return cmds


ENTRY_POINTS = _entry_points()
# Those that need a CUDA GPU for any run, with the arguments of a plain run.
NEED_A_GPU = {"bench.suite": ["--quick"], "bench.suite.profile_mlp": [], "bench.suite.host_breakdown": [],
              "bench.gemm.breakdown": [], "bench.gemm.ab": ["--env", "MOEGEMM_AB", "--values", "0,1"],
              "bench.bandwidth.ab": ["--env", "MOEGEMM_AB", "--values", "0,1"],
              "bench.gemm.ragged_rows": [], "bench.gemm.ragged_reduction": [], "bench.gemm.vs_deepgemm": ["peer.json"],
              "bench.gemm.tile_probe": ["Small experts E=64 zipf fc1 fprop"], "bench.gemm.power": [],
              "bench.gemm.contention": [],
              "bench.peers.deepgemm": [], "bench.examples.megatron_ep": [], "bench.examples.megatron_ep_train": [],
              "tests/sanitize/every_kernel.py": [], "tests/sanitize/adversarial.py": []}


def _run_all(extra_args: dict) -> dict:
    """name -> (exit status, stdout, stderr), all commands at once."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = {name: subprocess.Popen(ENTRY_POINTS[name] + args, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
             for name, args in extra_args.items()}
    return {name: (p.wait(timeout=300), p.stdout.read(), p.stderr.read()) for name, p in procs.items()}


@pytest.fixture(scope="module")
def helps():
    return _run_all({name: ["--help"] for name in ENTRY_POINTS})


def test_every_entry_point_is_found():
    assert {"bench.suite", "bench.gemm.ragged_rows", "bench.peers.deepgemm", "bench.examples.train_lm"} <= set(ENTRY_POINTS)
    assert set(NEED_A_GPU) <= set(ENTRY_POINTS)


@pytest.mark.parametrize("name", list(ENTRY_POINTS))
def test_help(helps, name):
    rc, out, err = helps[name]
    assert rc == 0, err[-2000:]
    usage = out.splitlines()[0]
    assert usage.startswith("usage: ") and name in usage, out[:500]  # its own parser, not CUTLASS's


@pytest.mark.skipif(torch.cuda.is_available() or preflight._driver_lists_a_gpu(),
                    reason="the sentence of a machine without a GPU")
@pytest.mark.parametrize("name", list(NEED_A_GPU))
def test_no_gpu_stops_with_one_sentence(name, monkeypatch):
    """Run in this process (each stops before importing anything of its own): SystemExit with the sentence,
    which the interpreter prints as the last line on stderr, exit status 1."""
    monkeypatch.setattr(sys, "argv", [name] + NEED_A_GPU[name])
    monkeypatch.setattr(os, "environ", dict(os.environ))  # the Megatron examples set NCCL variables first
    with pytest.raises(SystemExit) as stop:
        if name.endswith(".py"):
            runpy.run_path(str(REPO / name), run_name="__main__")
        else:
            runpy.run_module(name, run_name="__main__", alter_sys=True)
    assert re.fullmatch(r".*\b" + re.escape(name) + r" needs a CUDA GPU( \(an H100 or H200\))?, and this machine "
                        r"has none; nothing was run\.", str(stop.value.code)), stop.value.code


def test_preflight_sentences(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(preflight, "_driver_lists_a_gpu", lambda: True)
    with pytest.raises(SystemExit, match=r"^x needs a CUDA build of torch, and this torch \(.*\) is CPU-only; "
                                         r"nothing was run\.$"):
        preflight.require_cuda_gpu("x")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100")
    preflight.require_cuda_gpu("x")  # any GPU will do
    with pytest.raises(SystemExit, match=r"^x needs a Hopper GPU \(compute capability 9\.0\) for moegemm's kernels, "
                                         r"and NVIDIA A100 is 8\.0; nothing was run\.$"):
        preflight.require_cuda_gpu("x", hopper=True)

    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    with pytest.raises(SystemExit, match=r"^x needs the CUDA toolkit \(nvcc\)"):
        preflight.require_cuda_toolkit("x")


# The commands that need a package moegemm does not (matplotlib for the PNGs): the arguments of a plain run and
# the command as the sentence names it.
NEED_MATPLOTLIB = {
    "bench.suite.plot": (["bench/results/results.json"], "python -m bench.suite.plot"),
    "bench.examples.train_lm": (["--plot", "bench/results/lm_loss.json"], "python -m bench.examples.train_lm --plot"),
    "bench.examples.train_moe_lm": (["--plot-only", "bench/results/train_moe_lm.json"],
                                    "python -m bench.examples.train_moe_lm --plot-only")}


@pytest.mark.parametrize("name", list(NEED_MATPLOTLIB))
def test_no_matplotlib_stops_with_one_sentence(name, monkeypatch, tmp_path):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda mod, *a: None if mod == "matplotlib" else find_spec(mod, *a))
    args, command = NEED_MATPLOTLIB[name]
    monkeypatch.setattr(sys, "argv", [name] + args + ["--out", str(tmp_path / "out")])
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as stop:
        runpy.run_module(name, run_name="__main__", alter_sys=True)
    assert stop.value.code == (f"{command} needs matplotlib (pip install matplotlib), and it is not installed; "
                               "nothing was run.")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("script, args", [("bench/gemm/ncu.sh", ["DeepSeek-V2-Lite zipf:fc1 wgrad bf16"]),
                                          ("bench/suite/ncu_quant.sh", [])])
def test_ncu_scripts_without_ncu(script, args, tmp_path):
    """Without Nsight Compute the scripts say so (they printed nothing and exited 0 through their output filter)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "dirname").symlink_to(shutil.which("dirname"))  # PATH holds no ncu, only what the scripts call first
    proc = subprocess.run([shutil.which("bash"), str(REPO / script), *args], env={"PATH": str(bin_dir)},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr == f"bash {script} needs Nsight Compute (ncu on PATH), and none was found; nothing was run.\n"
