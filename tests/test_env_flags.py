"""moegemm's boolean environment variables: 1/0, true/false, yes/no, on/off in any case, unset or empty the
default, anything else an error naming the variable; in Python (moegemm/_env.py: MOEGEMM_CHECK_SPLITS,
MOEGEMM_VERBOSE_BUILD, setup.py's MOEGEMM_NO_EXTENSION) and, by the same rule, in C++ (csrc/env_flag.h:
MOEGEMM_ONE_LAUNCH_FORWARD), whose parser is compiled here with the host compiler and run. And MOEGEMM_BACKEND,
which names a backend: ``reference`` in any case, unset or empty the default, anything else an error."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moegemm import _env

ROOT = Path(__file__).resolve().parent.parent

ON = ["1", "true", "TRUE", "True", "yes", "YES", "on", "On", " 1 "]
OFF = ["0", "false", "FALSE", "False", "no", "NO", "off", "Off", " false\n"]
BAD = ["maybe", "2", "-1", "enabled", "truee", "0x1", "y", "n"]
MESSAGE = ("environment variable {name}={value!r} is not a boolean: use one of 1/true/yes/on or 0/false/no/off "
           "(any case), or leave it unset")


@pytest.mark.parametrize("value", ON)
def test_on(value):
    assert _env.parse_flag("MOEGEMM_X", value, default=False) is True


@pytest.mark.parametrize("value", OFF)
def test_off(value):
    assert _env.parse_flag("MOEGEMM_X", value, default=True) is False


@pytest.mark.parametrize("default", [False, True])
@pytest.mark.parametrize("value", [None, "", "  "])
def test_unset_or_empty_is_the_default(value, default):
    assert _env.parse_flag("MOEGEMM_X", value, default) is default


@pytest.mark.parametrize("value", BAD)
def test_anything_else_names_the_variable(value):
    with pytest.raises(ValueError) as err:
        _env.parse_flag("MOEGEMM_X", value, default=False)
    assert str(err.value) == MESSAGE.format(name="MOEGEMM_X", value=value)


def test_env_flag_reads_the_environment(monkeypatch):
    monkeypatch.setenv("MOEGEMM_X", "off")
    assert _env.env_flag("MOEGEMM_X", default=True) is False
    monkeypatch.delenv("MOEGEMM_X")
    assert _env.env_flag("MOEGEMM_X", default=True) is True


def _import_check_splits(value):
    env = dict(os.environ, PYTHONPATH=str(ROOT), MOEGEMM_CHECK_SPLITS=value)
    return subprocess.run([sys.executable, "-c", "import moegemm._validate as v; print(v.CHECK_SPLITS)"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("value, expected", [("false", "False"), ("FALSE", "False"), ("0", "False"), ("no", "False"),
                                             ("", "False"), ("1", "True"), ("True", "True"), ("on", "True")])
def test_check_splits_at_import(value, expected):
    proc = _import_check_splits(value)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == expected


def test_check_splits_rejects_a_non_boolean_at_import():
    proc = _import_check_splits("sometimes")
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == "ValueError: " + MESSAGE.format(name="MOEGEMM_CHECK_SPLITS",
                                                                                    value="sometimes")


def test_build_module_uses_the_same_parser_when_loaded_on_its_own(monkeypatch):
    """setup.py loads moegemm/_build.py by path (no package) and reads MOEGEMM_NO_EXTENSION with its env_flag."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_moegemm_build_alone", ROOT / "moegemm" / "_build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setenv("MOEGEMM_NO_EXTENSION", "False")
    assert mod.env_flag("MOEGEMM_NO_EXTENSION") is False
    monkeypatch.setenv("MOEGEMM_NO_EXTENSION", "nope")
    with pytest.raises(ValueError) as err:
        mod.env_flag("MOEGEMM_NO_EXTENSION")
    assert str(err.value) == MESSAGE.format(name="MOEGEMM_NO_EXTENSION", value="nope")
    assert 'env_flag("MOEGEMM_NO_EXTENSION")' in (ROOT / "setup.py").read_text()


def _import_backend(value):
    env = dict(os.environ, PYTHONPATH=str(ROOT), MOEGEMM_BACKEND=value)
    return subprocess.run([sys.executable, "-c", "import moegemm.backends as b; print(b.FORCE_REFERENCE)"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("value, expected", [("reference", "True"), (" Reference ", "True"), ("", "False")])
def test_backend_at_import(value, expected):
    proc = _import_backend(value)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == expected


@pytest.mark.parametrize("value", ["cuda", "ref", "nosuch"])
def test_backend_rejects_other_names_at_import(value):
    proc = _import_backend(value)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == (
        f"ValueError: environment variable MOEGEMM_BACKEND={value!r} must be one of reference, or unset")


CPP_MAIN = r"""
#include <cstdio>
#include "env_flag.h"
int main(int argc, char** argv) {
  // argv[1]: the default (0/1); the variable MOEGEMM_TEST_FLAG as set by the test (unset: argc == 3 and argv[2] "-")
  try {
    std::printf("%d\n", moegemm::env_flag("MOEGEMM_TEST_FLAG", argv[1][0] == '1') ? 1 : 0);
  } catch (const std::invalid_argument& e) {
    std::printf("invalid_argument: %s\n", e.what());
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def cpp_flag(tmp_path_factory):
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    d = tmp_path_factory.mktemp("env_flag")
    (d / "main.cpp").write_text(CPP_MAIN)
    exe = d / "flag"
    subprocess.run([cxx, "-std=c++17", f"-I{ROOT / 'csrc'}", str(d / "main.cpp"), "-o", str(exe)], check=True,
                   capture_output=True, timeout=300)

    def run(value, default: bool) -> str:
        env = {k: v for k, v in os.environ.items() if k != "MOEGEMM_TEST_FLAG"}
        if value is not None:
            env["MOEGEMM_TEST_FLAG"] = value
        return subprocess.run([str(exe), "1" if default else "0"], env=env, capture_output=True, text=True,
                              check=True, timeout=60).stdout.strip()

    return run


def test_cpp_parses_as_python_does(cpp_flag):
    for value in ON:
        assert cpp_flag(value, default=False) == "1", value
    for value in OFF:
        assert cpp_flag(value, default=True) == "0", value
    for value in (None, "", " "):
        assert cpp_flag(value, default=True) == "1" and cpp_flag(value, default=False) == "0", value
    for value in BAD:
        assert cpp_flag(value, default=True) == "invalid_argument: " + MESSAGE.format(
            name="MOEGEMM_TEST_FLAG", value=value), value


def test_cpp_heuristics_read_the_strict_flag():
    """csrc/kernels/gemm/heuristics.h's enabled_by_env (MOEGEMM_ONE_LAUNCH_FORWARD) is env_flag.h's, default on."""
    text = (ROOT / "csrc" / "kernels" / "gemm" / "heuristics.h").read_text()
    assert '#include "env_flag.h"' in text
    assert "inline bool enabled_by_env(const char* env) { return env_flag(env, true); }" in text


CPP_CHOICE_MAIN = r"""
#include <cstdio>
#include "env_flag.h"
int main() {
  try {
    std::printf("%d\n", moegemm::env_choice("MOEGEMM_TEST_CHOICE", {"sm90", "cutlass"}));
  } catch (const std::invalid_argument& e) {
    std::printf("invalid_argument: %s\n", e.what());
  }
  return 0;
}
"""


def test_cpp_choice_variables_are_strict(tmp_path):
    """env_flag.h's env_choice (MOEGEMM_FP8_WGRAD=sm90|cutlass): a name in any case, unset or empty for the default,
    anything else an error naming the variable."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    (tmp_path / "main.cpp").write_text(CPP_CHOICE_MAIN)
    exe = tmp_path / "choice"
    subprocess.run([cxx, "-std=c++17", f"-I{ROOT / 'csrc'}", str(tmp_path / "main.cpp"), "-o", str(exe)], check=True,
                   capture_output=True, timeout=300)

    def run(value):
        env = {k: v for k, v in os.environ.items() if k != "MOEGEMM_TEST_CHOICE"}
        if value is not None:
            env["MOEGEMM_TEST_CHOICE"] = value
        return subprocess.run([str(exe)], env=env, capture_output=True, text=True, check=True, timeout=60).stdout.strip()

    for value, expected in ((None, "-1"), ("", "-1"), (" ", "-1"), ("sm90", "0"), (" SM90 ", "0"), ("cutlass", "1"),
                            ("CUTLASS", "1")):
        assert run(value) == expected, value
    for value in ("cutlas", "1", "deepgemm"):
        assert run(value) == (f"invalid_argument: environment variable MOEGEMM_TEST_CHOICE='{value}' must be one of "
                              "sm90, cutlass, or unset"), value
    text = (ROOT / "csrc" / "kernels" / "gemm" / "heuristics.h").read_text()
    assert 'env_choice(env, {"sm90", "cutlass"})' in text
