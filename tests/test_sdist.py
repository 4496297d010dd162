"""The sdist carries what a build needs and the tests with everything they import and read (MANIFEST.in): it is
built here (``setup.py sdist`` into a temporary folder, the egg-info too, nothing written into the tree), its
listing checked file by file, and its tests collected from the unpacked sdist (they used to fail to collect: the
sdist lacked the bench/ package they import)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    """(path of the .tar.gz, the set of its files relative to its top folder)."""
    # pyproject.toml's SPDX license needs setuptools 77 (a fresh virtual environment may have none, or an older one)
    pytest.importorskip("setuptools", minversion="77.0.3")
    out = tmp_path_factory.mktemp("sdist")
    env = dict(os.environ, MOEGEMM_NO_EXTENSION="1")
    proc = subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(out), "sdist", "--dist-dir",
                           str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (tar_path,) = out.glob("moegemm-*.tar.gz")
    with tarfile.open(tar_path) as tar:
        names = {m.name.split("/", 1)[1] for m in tar.getmembers() if m.isfile() and "/" in m.name}
    return tar_path, names


def _files(folder: str, suffixes: tuple) -> set:
    return {str(p.relative_to(ROOT)) for p in (ROOT / folder).rglob("*")
            if p.is_file() and p.suffix in suffixes and "__pycache__" not in p.parts and "results" not in p.parts}


def test_sdist_carries_the_build_and_the_tests_with_what_they_read(sdist):
    _, names = sdist
    wanted = (_files("moegemm", (".py",)) | _files("csrc", (".cu", ".cuh", ".h", ".cpp")) | _files("tests", (".py",))
              | _files("bench", (".py", ".sh")) | _files("docs", (".md",))
              | {"README.md", "LICENSE", "setup.py", "pyproject.toml", "MANIFEST.in", "third_party/cutlass.txt",
                 ".ci/run", "bench/README.md"})
    missing = sorted(wanted - names)
    assert not missing, f"the sdist lacks {missing}"
    assert not [n for n in names if n.startswith("bench/results/")], "the sdist carries the committed bench results"
    assert not [n for n in names if n.endswith((".so", ".pyc", ".o"))]


def test_every_local_module_the_tests_import_is_in_the_sdist(sdist):
    """For each import in tests/ of a module of this repository (moegemm, bench, the tests' own helpers): its file."""
    _, names = sdist
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}  # moegemm, bench
    helpers = {p.stem for p in (ROOT / "tests").glob("*.py")}  # conftest, training_step (tests/ is on sys.path)
    needed = set()
    for path in (ROOT / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]  # names may be modules
            else:
                continue
            for mod in mods:
                parts = mod.split(".")
                base = ROOT if parts[0] in packages else ROOT / "tests" if parts[0] in helpers else None
                if base is None:
                    continue
                for i in range(1, len(parts) + 1):  # each package on the way, and the module
                    for cand in (Path(*parts[:i]) / "__init__.py", Path(*parts[:i]).with_suffix(".py")):
                        if (base / cand).is_file():
                            needed.add(str((base / cand).relative_to(ROOT)))
    assert {"bench/__init__.py", "bench/preflight.py", "bench/peers/deepgemm.py", "bench/outputs.py",
            "moegemm/__init__.py", "moegemm/_build.py", "tests/conftest.py"} <= needed, sorted(needed)
    assert not sorted(needed - names), f"tests import modules the sdist lacks: {sorted(needed - names)}"


def test_the_sdists_tests_collect(sdist, tmp_path):
    tar_path, _ = sdist
    with tarfile.open(tar_path) as tar:
        tar.extractall(tmp_path)
    (root,) = tmp_path.glob("moegemm-*")
    env = dict(os.environ, PYTHONPATH=str(root), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-2000:]
    assert proc.returncode == 0 and "error" not in tail, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert tail.endswith("tests collected") or "tests collected in" in tail, tail
