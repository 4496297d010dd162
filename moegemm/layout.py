"""The layout contract shared by every part of moegemm, declared once for Python (``csrc/moegemm.h`` and
``csrc/api/common.h`` declare it for C++; ``tests/test_layout.py`` checks that both agree).

* FP8 scaling blocks of ``BLOCK`` (1×128 activation rows, 128×1 per-expert columns, 128×128 weights);
  the 1×128 row scales ``[T, Kb]`` stored K-major (``empty_row_scales``).
* The plan ``[PLAN_ROWS, E+1]`` int32: token starts, column starts of the per-expert transposed copy
  (segments padded to ``COL_ALIGN`` tokens), first 128-token scale block of each expert.
* Capacities of the transposed copy (``col_capacity``) and of its scales (``block_capacity``).
* The ids the ops take for activations and recipes.
"""

from __future__ import annotations

import torch

BLOCK = 128  # FP8 scaling block (csrc/moegemm.h: kBlock)
COL_ALIGN = 32  # per-expert token padding of the transposed activation copy (kColAlign)
DIM_ALIGN = 16  # N and K of every GEMM (hidden, ffn): 16-byte FP8 rows, the quantizers' 16-wide vectors (kDimAlign)
MAX_EXPERTS = 1024  # the plan kernel runs one thread per expert (kMaxExperts)
MAX_PLAN_VALUE = 2**31 - 1  # plan entries are int32: col_capacity(T, E) must fit (kMaxPlanValue)
PTR_ALIGN = 16  # data pointers the kernels read: TMA and 16-byte vector accesses (kPtrAlign)
PLAN_ROWS = 3  # token starts, padded column starts, scale-block starts
ROW_SCALE_ALIGN = 4  # the row scales' pitch: T rounded up to 4, 16-byte aligned K-block rows (kRowScaleAlign)
ACT_BF16_COLS = 256  # columns per dprobs partial sum of the bf16 activation backward (kActBf16Cols)

# csrc/moegemm.h: enum class Activation; GLU variants read fc1's output [T, 2F] as (gate, up)
ACTIVATIONS = {"swiglu": 0, "geglu": 1, "gelu": 2, "relu": 3, "squared_relu": 4}
GLU_ACTIVATIONS = ("swiglu", "geglu")
ACTIVATION_NAMES = {i: name for name, i in ACTIVATIONS.items()}

# csrc/api/common.h: enum class Recipe
RECIPE_IDS = {"bf16": 0, "fp8_blockwise": 1}
BF16, FP8_BLOCKWISE = RECIPE_IDS["bf16"], RECIPE_IDS["fp8_blockwise"]

# The FP8 grouped GEMMs' kernels: the `kernel` of torch.ops.moegemm.gemm_fp8_ragged_reduction (csrc/moegemm.h GemmKernel:
# the default choice, CUTLASS's ptr-array kernel, moegemm's own sm90 kernel; the ragged-row GEMM has moegemm's
# kernel alone); and how many tilings each sm90 kernel is built with (the `tiling` of gemm_fp8_ragged_rows and
# gemm_fp8_ragged_reduction indexes csrc/kernels/gemm/heuristics.h's kRaggedRowsTilings / kRaggedReductionTilings;
# GPU tests hold the counts to those tables).
GEMM_CUTLASS, GEMM_SM90 = 1, 2  # 0: the default choice (heuristics.h)
SM90_RAGGED_ROWS_TILINGS = 6
SM90_RAGGED_REDUCTION_TILINGS = 3


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def row_scale_pitch(T: int) -> int:
    """Floats between two K blocks' row scales (csrc/moegemm.h: row_scale_pitch)."""
    return ceil_div(T, ROW_SCALE_ALIGN) * ROW_SCALE_ALIGN


def empty_row_scales(T: int, Kb: int, device=None) -> torch.Tensor:
    """The 1×128 row scales of a ``[T, K]`` row copy, ``[T, Kb]`` fp32, in their K-major layout: strides
    ``(1, row_scale_pitch(T))``, so that an M tile's 128 rows of one K block are 512 contiguous bytes."""
    return torch.empty_strided((T, Kb), (1, row_scale_pitch(T)), dtype=torch.float32, device=device)


def col_capacity(T: int, E: int) -> int:
    """Width of the transposed activation copy: Σ round_up(m_e, 32) ≤ T + 31·E, rounded up to 32."""
    return ceil_div(T + (COL_ALIGN - 1) * E, COL_ALIGN) * COL_ALIGN


def max_plan_tokens(E: int) -> int:
    """The most tokens a plan of E experts holds: col_capacity(T, E) <= MAX_PLAN_VALUE exactly when T <= this."""
    return MAX_PLAN_VALUE // COL_ALIGN * COL_ALIGN - (COL_ALIGN - 1) * E


MAX_TOKENS = max_plan_tokens(MAX_EXPERTS)  # T that fits for every E


def block_capacity(T: int, E: int) -> int:
    """Rows of the column-block scale tensor: Σ ceil(m_e/128) ≤ (T + 127·E) / 128."""
    return (T + (BLOCK - 1) * E) // BLOCK


def act_width(F1: int, activation) -> int:
    """F, the activation's output width, from fc1's output width F1 (= 2F for GLU activations);
    ``activation`` by name or by id."""
    name = activation if isinstance(activation, str) else ACTIVATION_NAMES[int(activation)]
    return F1 // 2 if name in GLU_ACTIVATIONS else F1


def wgrad_dtype(weight: torch.Tensor) -> torch.dtype:
    """A weight gradient not accumulated into main_grad: bf16 for bf16 weights (the wgrad GEMMs write it
    directly), fp32 otherwise (csrc/api/layer_inputs.cpp: wgrad_dtype)."""
    return torch.bfloat16 if weight.dtype == torch.bfloat16 else torch.float32
