"""The SM budget (moegemm/sm_budget.py): its API and checks on every machine; on a Hopper GPU, budgets of 1, 7, 66
and every SM give bitwise the results of no budget, in eager mode and replayed from a captured CUDA graph (the
graph keeping the budget of its capture), for the training step of both layers and recipes and for the raw GEMMs
at every tiling."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import moegemm
from conftest import capture_step, requires_cuda, zipf_splits
from training_step import Rig, assert_bitwise


@pytest.fixture(autouse=True)
def no_budget():
    """Every test starts and ends without a budget."""
    moegemm.set_num_sms(None)
    yield
    moegemm.set_num_sms(None)


# ------------------------------------------------------------------------------------------------- the API
def test_set_get_and_clear():
    assert moegemm.get_num_sms() is None
    moegemm.set_num_sms(7)
    assert moegemm.get_num_sms() == 7
    moegemm.set_num_sms(None)
    assert moegemm.get_num_sms() is None


def test_context_manager_restores_the_budget_before_it():
    moegemm.set_num_sms(5)
    with moegemm.num_sms(3):
        assert moegemm.get_num_sms() == 3
        with moegemm.num_sms(None):
            assert moegemm.get_num_sms() is None
        assert moegemm.get_num_sms() == 3
    assert moegemm.get_num_sms() == 5
    with pytest.raises(RuntimeError, match="inside"):
        with moegemm.num_sms(2):
            raise RuntimeError("inside")
    assert moegemm.get_num_sms() == 5


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-1, ValueError), (-132, ValueError), (True, TypeError),
                                        (2.0, TypeError), ("8", TypeError)])
def test_bad_budgets_are_refused_and_change_nothing(bad, error):
    moegemm.set_num_sms(4)
    with pytest.raises(error, match="num_sms"):
        moegemm.set_num_sms(bad)
    with pytest.raises(error, match="num_sms"):
        with moegemm.num_sms(bad):
            pass
    assert moegemm.get_num_sms() == 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (its SM count)")
def test_more_sms_than_the_device_has_is_refused():
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    moegemm.set_num_sms(sms)
    with pytest.raises(ValueError, match=f"exceeds the {sms} SMs"):
        moegemm.set_num_sms(sms + 1)
    assert moegemm.get_num_sms() == sms


def _import_with(env_value):
    env = dict(os.environ, MOEGEMM_NUM_SMS=env_value)
    code = "import moegemm; print(moegemm.get_num_sms())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_environment_variable_sets_the_budget_at_import():
    proc = _import_with("12")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "12"
    proc = _import_with("")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "None"


@pytest.mark.parametrize("value", ["0", "-4", "many", "1.5"])
def test_bad_environment_variable_is_a_clear_error(value):
    proc = _import_with(value)
    assert proc.returncode != 0
    assert "MOEGEMM_NUM_SMS" in proc.stderr.strip().splitlines()[-1]


def test_reference_path_is_unchanged_by_a_budget():
    rig = lambda: Rig("mlp", "fp8_blockwise", "grad", device="cpu", E=4, H=128, F=128, T=200)  # noqa: E731
    expected = rig().train_step()
    with moegemm.num_sms(3):
        got = rig().train_step()
    assert_bitwise(got, expected, "the CPU step under a budget")


# ------------------------------------------------------------------------------------------------- on the GPU
def _budgets():
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return [1, 7, 66, sms]


@requires_cuda
@pytest.mark.parametrize("mode", ["grad", "main_grad"])
@pytest.mark.parametrize("recipe", ["fp8_blockwise", "bf16"])
@pytest.mark.parametrize("kind", ["mlp", "linear"])
def test_training_step_is_bitwise_under_every_budget(kind, recipe, mode):
    expected = Rig(kind, recipe, mode).train_step()
    for sms in _budgets():
        with moegemm.num_sms(sms):
            got = Rig(kind, recipe, mode).train_step()
        assert_bitwise(got, expected, f"the step with {sms} SMs")


@requires_cuda
@pytest.mark.parametrize("recipe", ["fp8_blockwise", "bf16"])
def test_captured_graph_keeps_the_budget_of_its_capture(recipe):
    E, H, F, T = 8, 512, 256, 2048
    torch.manual_seed(1)
    mlp = moegemm.GroupedMLP(E, H, F, activation="swiglu", recipe=recipe, device="cuda")
    m = torch.tensor(zipf_splits(E, T), device="cuda")
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)

    def step():
        x.grad = None
        for p in mlp.parameters():
            p.grad = None
        y = mlp(x, m)
        y.backward(dy)
        # (y detached: an output holding the autograd graph would keep its AccumulateGrad nodes, of the stream
        # they were made on, alive into the next capture)
        return [y.detach(), x.grad] + [p.grad for p in mlp.parameters()]

    expected = [t.clone() for t in step()]
    for sms in _budgets():
        with moegemm.num_sms(sms):
            g, out = capture_step(step)
        with moegemm.num_sms(None if sms != 1 else 66):  # replayed under another budget: the capture's holds
            g.replay()
        torch.cuda.synchronize()
        assert_bitwise([t.clone() for t in out], expected, f"the graph captured with {sms} SMs")


@requires_cuda
def test_raw_gemms_are_bitwise_under_every_budget_and_tiling():
    from moegemm.backends import cuda as ops
    from moegemm.layout import SM90_RAGGED_REDUCTION_TILINGS, SM90_RAGGED_ROWS_TILINGS
    torch.manual_seed(2)
    E, N, K = 6, 384, 512
    splits = [0, 1, 300, 129, 700, 40]
    T = sum(splits)
    m = torch.tensor(splits, device="cuda")
    plan = ops.make_plan(m, T)
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(T, N, device="cuda", dtype=torch.bfloat16)
    qa, sa, qaT, saT = ops.quantize_act(x, plan)
    qw, sw, _, _ = ops.quantize_weight(w)
    _, _, qdyT, sdyT = ops.quantize_act(dy, plan)
    rows = lambda t: torch.ops.moegemm.gemm_fp8_ragged_rows(qa, sa, qw, sw, plan, t)  # noqa: E731
    reduction = lambda t: torch.ops.moegemm.gemm_fp8_ragged_reduction(qdyT, sdyT, qaT, saT, plan, torch.float32, 2, t)  # noqa: E731
    bf16 = lambda: (ops.gemm_bf16_fprop(x, w, plan), ops.gemm_bf16_wgrad(dy, x, plan))  # noqa: E731
    expected_rows = [rows(t) for t in range(-1, SM90_RAGGED_ROWS_TILINGS)]
    expected_reduction = [reduction(t) for t in range(-1, SM90_RAGGED_REDUCTION_TILINGS)]
    expected_bf16 = bf16()
    for sms in _budgets():
        with moegemm.num_sms(sms):
            for t in range(-1, SM90_RAGGED_ROWS_TILINGS):
                assert_bitwise([rows(t)], [expected_rows[t + 1]], f"ragged rows, tiling {t}, {sms} SMs")
            for t in range(-1, SM90_RAGGED_REDUCTION_TILINGS):
                assert_bitwise([reduction(t)], [expected_reduction[t + 1]], f"ragged reduction, tiling {t}, {sms} SMs")
            assert_bitwise(list(bf16()), list(expected_bf16), f"bf16 GEMMs, {sms} SMs")
