"""The layout contract is declared once per language (``moegemm/layout.py``; ``csrc/moegemm.h`` and
``csrc/api/common.h``): the C++ declarations, parsed here, must agree with the Python ones."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from moegemm import layout

CSRC = Path(__file__).resolve().parents[1] / "csrc"
HEADER = (CSRC / "moegemm.h").read_text()
API_COMMON = (CSRC / "api" / "common.h").read_text()


def constants(text: str) -> dict:
    return {name: int(value) for name, value in re.findall(r"constexpr\s+(?:int|int64_t)\s+(\w+)\s*=\s*(\d+)\s*;", text)}


def enum(text: str, name: str) -> dict:
    """``enum class name : int { kFooBar = 0, ... }`` -> {"foo_bar": 0, ...}."""
    body = re.search(r"enum\s+class\s+" + name + r"\s*:\s*int\s*\{([^}]*)\}", text).group(1)
    snake = lambda k: re.sub(r"(?<!^)([A-Z])", r"_\1", k[1:]).lower()  # noqa: E731
    return {snake(k): int(v) for k, v in re.findall(r"(k\w+)\s*=\s*(\d+)", body)}


def cpp_function(text: str, name: str):
    """A one-line inline C++ function of (T, E) as a Python function (integer division)."""
    body = re.search(r"inline int64_t " + name + r"\(int64_t T, int64_t E\) \{ return ([^;]+); \}", text).group(1)
    names = {"ceil_div": layout.ceil_div, **{k: v for k, v in constants(HEADER).items()}}
    return lambda T, E: eval(body.replace("/", "//"), {}, {**names, "T": T, "E": E})  # noqa: S307


def test_constants_agree():
    c = constants(HEADER)
    assert c["kBlock"] == layout.BLOCK
    assert c["kColAlign"] == layout.COL_ALIGN
    assert c["kDimAlign"] == layout.DIM_ALIGN
    assert c["kMaxExperts"] == layout.MAX_EXPERTS
    assert c["kMaxPlanValue"] == layout.MAX_PLAN_VALUE
    assert c["kPtrAlign"] == layout.PTR_ALIGN
    assert c["kActBf16Cols"] == layout.ACT_BF16_COLS
    assert c["kRowScaleAlign"] == layout.ROW_SCALE_ALIGN
    assert layout.MAX_TOKENS == layout.max_plan_tokens(c["kMaxExperts"])


def test_max_plan_tokens_agrees_and_is_exact():
    body = re.search(r"inline int64_t max_plan_tokens\(int64_t E\) \{ return ([^;]+); \}", HEADER).group(1)
    cpp = lambda E: eval(body.replace("/", "//"), {}, {**constants(HEADER), "E": E})  # noqa: E731, S307
    for E in (1, 2, 7, 64, 1024):
        T = layout.max_plan_tokens(E)
        assert cpp(E) == T, E
        assert layout.col_capacity(T, E) <= layout.MAX_PLAN_VALUE < layout.col_capacity(T + 1, E), E


def test_enums_agree():
    assert enum(HEADER, "Activation") == layout.ACTIVATIONS
    assert enum(API_COMMON, "Recipe") == layout.RECIPE_IDS
    assert set(layout.GLU_ACTIVATIONS) == {"swiglu", "geglu"}  # csrc/moegemm.h: is_glu
    assert "kSwiglu || a == Activation::kGeglu" in HEADER


@pytest.mark.parametrize("name", ["col_capacity", "block_capacity"])
def test_capacities_agree(name):
    cpp, py = cpp_function(HEADER, name), getattr(layout, name)
    for T in (0, 1, 15, 16, 127, 128, 129, 4097, 2**31 - 1 - 31 * 1024):
        for E in (1, 2, 7, 64, 1024):
            assert cpp(T, E) == py(T, E), (name, T, E)


def test_row_scale_pitch_agrees():
    body = re.search(r"constexpr int64_t row_scale_pitch\(int64_t T\) \{ return ([^;]+); \}", HEADER).group(1)
    cpp = lambda T: eval(body.replace("/", "//"), {}, {**constants(HEADER), "T": T})  # noqa: E731, S307
    for T in (0, 1, 3, 4, 5, 127, 128, 129, 2**31 - 1):
        assert cpp(T) == layout.row_scale_pitch(T), T
    s = layout.empty_row_scales(7, 3)
    assert s.shape == (7, 3) and s.stride() == (1, 8)


def test_plan_rows_agree():
    assert re.search(r"plan \[" + str(layout.PLAN_ROWS) + r", E\+1\] int32", HEADER)
    launch = (CSRC / "api" / "launch.cpp").read_text()
    assert re.search(r"empty\(\{" + str(layout.PLAN_ROWS) + r", E \+ 1\}", launch)
